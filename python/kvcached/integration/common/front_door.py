"""One front door for every engine plugin: enabled?, which version package, its patch points, install.

Each engine (vLLM, SGLang) states one :class:`VersionPolicy`: the releases
kvcached supports, each mapped to the version package holding every private
engine name kvcached touches for it. A version package declares those names
as :class:`PatchPoint` values (``PATCH_POINTS``) and installs itself with
``install(settings)``. :class:`EnginePlugin` is what the engine's plugin entry
calls: nothing happens unless ``KVCACHED_ENABLE`` is set; then the running
engine's version picks the package, every patch point is verified *before*
anything is patched (a name that moved or vanished in a release is an error
naming it, never a silent no-op), and the package installs once per process.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any, Callable, Optional

from kvcached.errors import KvcachedError
from kvcached.integration.common.settings import Settings, is_enabled

__all__ = [
    "EnginePlugin",
    "PatchPoint",
    "PatchPointMoved",
    "UnsupportedEngineVersion",
    "VersionPolicy",
    "verify_patch_points",
]


class UnsupportedEngineVersion(KvcachedError, RuntimeError):
    """The installed engine is not a release kvcached has a version package for."""


class PatchPointMoved(KvcachedError, RuntimeError):
    """An engine name kvcached patches or calls moved, vanished or changed its signature."""


@dataclasses.dataclass(frozen=True)
class PatchPoint:
    """One engine name kvcached patches or relies on, and what it must look like.

    ``attribute`` is dotted inside ``module`` (``"Scheduler.schedule"``).
    ``parameters`` are the parameter names kvcached's wrapper passes or reads,
    in the order they must appear (with ``exact``, the whole parameter list:
    for a function kvcached replaces, which callers may call with any of its
    parameters); ``members`` are attributes the object must have (a class's
    methods kvcached calls or overrides). An ``optional`` point belongs to a
    part of the engine that a build may leave out: its module may exist and
    fail to import (a missing dependency such as Triton), and is then skipped;
    a module that is not there at all is still an error (it moved).
    """

    module: str
    attribute: str
    parameters: tuple[str, ...] = ()
    members: tuple[str, ...] = ()
    optional: bool = False
    exact: bool = False

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"

    def resolve(self) -> Any:
        """The object, or raises PatchPointMoved. Raises ImportError for an optional point whose module's
        own imports fail (that part of the engine cannot run in this build)."""
        target: Any = sys.modules.get(self.module)
        if target is None:
            try:
                found = importlib.util.find_spec(self.module)
            except ModuleNotFoundError:  # a parent package is gone
                found = None
            if found is None:
                raise PatchPointMoved(f"module {self.module} is gone (wanted {self.name})")
            try:
                target = importlib.import_module(self.module)
            except ImportError:
                if self.optional:
                    raise
                raise PatchPointMoved(f"module {self.module} does not import (wanted {self.name})") from None
        for part in self.attribute.split("."):
            if not hasattr(target, part):
                raise PatchPointMoved(f"{self.name} is gone")
            target = inspect.getattr_static(target, part) if inspect.isclass(target) else getattr(target, part)
            if isinstance(target, (staticmethod, classmethod)):
                target = target.__func__
        return target

    def problem(self) -> Optional[str]:
        """What is wrong with this point in the running engine (None: as expected, or an optional
        part this build cannot import)."""
        try:
            target = self.resolve()
        except PatchPointMoved as exc:
            return str(exc)
        except ImportError:
            return None
        missing = [m for m in self.members if not hasattr(target, m)]
        if missing:
            return f"{self.name} lacks {', '.join(missing)}"
        if self.parameters:
            try:
                have = list(inspect.signature(inspect.unwrap(target)).parameters)
            except (TypeError, ValueError):
                return f"{self.name} has no inspectable signature"
            positions = [have.index(p) if p in have else -1 for p in self.parameters]
            if (self.exact and have != list(self.parameters)) or -1 in positions or positions != sorted(positions):
                return f"{self.name}({', '.join(have)}) no longer takes ({', '.join(self.parameters)})"
        return None


def verify_patch_points(points: Iterable[PatchPoint], *, engine: str, version: str, package: str) -> None:
    """Raises PatchPointMoved naming every point that moved; returns when all are as declared."""
    problems = [p for p in (point.problem() for point in points) if p]
    if problems:
        raise PatchPointMoved(
            f"kvcached's {package} does not fit {engine} {version}: "
            + "; ".join(problems)
            + f". This {engine} release needs its own version package (see docs/engine-versions.md); "
            "unset KVCACHED_ENABLE to run without kvcached."
        )


@dataclasses.dataclass(frozen=True)
class VersionPolicy:
    """The releases of one engine kvcached supports, each mapped to its version package.

    A release is the first ``release_parts`` numbers of a version string
    (vLLM: ``(0, 32)`` covers ``0.32.1+cpu``; SGLang: ``(0, 5, 23)`` covers
    ``0.5.23.post1``).
    """

    engine: str  # as users write it: "vLLM", "SGLang"
    package: str  # the engine's integration package, parent of the version packages
    releases: Mapping[tuple[int, ...], str]  # release -> version package (a subpackage of ``package``)
    release_parts: int
    error: type = UnsupportedEngineVersion  # an UnsupportedEngineVersion subclass, for the engine's name

    @property
    def supported(self) -> str:
        """The supported releases, for messages: ``0.32.x, 0.33.x`` or ``0.5.23``."""
        tail = ".x" if self.release_parts == 2 else ""
        return ", ".join(".".join(map(str, r)) + tail for r in sorted(self.releases))

    def release_of(self, version: str) -> tuple[int, ...]:
        match = re.match(r"\d+(?:\.\d+)*", version)
        numbers = tuple(int(n) for n in match.group(0).split(".")) if match else ()
        if len(numbers) < self.release_parts:
            raise self.error(f"cannot parse {self.engine} version {version!r}; supported: {self.supported}")
        return numbers[: self.release_parts]

    def package_for(self, version: str) -> ModuleType:
        """The version package for ``version``; raises ``error`` naming the supported releases."""
        name = self.releases.get(self.release_of(version))
        if name is None:
            raise self.error(
                f"kvcached does not support {self.engine} {version}; supported: {self.supported}. "
                f"Install a supported {self.engine} or unset KVCACHED_ENABLE."
            )
        return importlib.import_module(f"{self.package}.{name}")


class EnginePlugin:
    """An engine's plugin entry: enable check, version check, patch-point check, install once per process."""

    def __init__(self, policy: VersionPolicy, engine_version: Callable[[], str], logger: logging.Logger) -> None:
        self.policy = policy
        self._engine_version = engine_version
        self.logger = logger
        self.installed: dict[int, ModuleType] = {}  # pid -> version package (a forked child installs again)

    def install(self) -> ModuleType:
        """Verifies and installs the running engine's version package (idempotent per process).

        Raises ``policy.error`` for other releases and :class:`PatchPointMoved`
        when a name the package patches is not as it declares.
        """
        pid = os.getpid()
        if pid in self.installed:
            return self.installed[pid]
        version = self._engine_version()
        module = self.policy.package_for(version)
        verify_patch_points(module.PATCH_POINTS, engine=self.policy.engine, version=version, package=module.__name__)
        module.install(Settings.from_env())
        self.installed[pid] = module
        return module

    def register(self) -> None:
        """The engine's plugin entry point: a no-op unless kvcached is enabled.

        Never raises (an engine calls plugins unguarded): a failure is logged and
        the engine runs without kvcached.
        """
        if not is_enabled():
            return
        try:
            module = self.install()
            self.logger.info("kvcached: elastic KV cache enabled for %s (%s)", self.policy.engine, module.__name__)
        except KvcachedError as exc:
            self.logger.error("kvcached is NOT active: %s", exc)
        except Exception:  # noqa: BLE001 - a plugin must not take the engine down
            self.logger.exception("kvcached is NOT active: installing the %s integration failed", self.policy.engine)
