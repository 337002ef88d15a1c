"""kvcached inside SGLang: an elastic KV cache behind SGLang's own pools and allocators.

SGLang runs :func:`register` in every process it starts (engine or HTTP server,
schedulers, detokenizer) through the general-plugin entry point
``sglang.srt.plugins: kvcached = "kvcached.integration.sglang:register"``.
Nothing happens unless ``KVCACHED_ENABLE=1`` (or ``ENABLE_KVCACHED=true``) is
set. When enabled, :func:`register` checks ``sglang.__version__`` and registers
the hooks of the one module written for that version (see ``_HOOK_MODULES``)
with SGLang's ``HookRegistry``; any other version is refused with a message
naming the supported ones, and SGLang runs without kvcached.

How it works (SGLang 0.5.23; details in ``v0_5_23``): each scheduler process
plans its KV cache for a large virtual capacity, backs SGLang's KV pool with a
kvcached KV space, and takes token slots (or pages) from a kvcached block
manager in the same process; memory follows the slots in use, and running out
makes requests wait or be retracted.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from types import ModuleType

from kvcached.errors import KvcachedError
from kvcached.integration.common.engine_log import route_to_engine_log
from kvcached.integration.common.settings import Settings, is_enabled

# Under kvcached's logger, and also written through SGLang's handlers, if it has its own.
logger = logging.getLogger(__name__)
route_to_engine_log(logger, "sglang")

#: SGLang release -> the package holding every private SGLang name kvcached touches.
_HOOK_MODULES: dict[tuple[int, int, int], str] = {
    (0, 5, 23): "v0_5_23",
}
SUPPORTED_VERSIONS = ", ".join(".".join(map(str, v)) for v in sorted(_HOOK_MODULES))


class UnsupportedSGLangVersion(KvcachedError, RuntimeError):
    """The installed SGLang is not one kvcached has hooks for."""


_installed: dict[int, ModuleType] = {}  # pid -> hook module (fork-safe idempotence)


def _sglang_release(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of an SGLang version string such as ``0.5.23`` or ``0.5.23.post1``."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedSGLangVersion(f"cannot parse SGLang version {version!r}; supported: {SUPPORTED_VERSIONS}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def hook_module_for(version: str) -> ModuleType:
    """The hook module for an SGLang version; raises :class:`UnsupportedSGLangVersion`."""
    name = _HOOK_MODULES.get(_sglang_release(version))
    if name is None:
        raise UnsupportedSGLangVersion(
            f"kvcached does not support SGLang {version}; supported: {SUPPORTED_VERSIONS}. "
            "Install a supported SGLang or unset KVCACHED_ENABLE."
        )
    return importlib.import_module(f"{__name__}.{name}")


def install_hooks() -> ModuleType:
    """Registers the hooks for the running SGLang (idempotent per process).

    Raises :class:`UnsupportedSGLangVersion` for other versions. Most callers
    want :func:`register`, which also honours ``KVCACHED_ENABLE``.
    """
    pid = os.getpid()
    if pid in _installed:
        return _installed[pid]
    import sglang

    module = hook_module_for(sglang.__version__)
    module.install(Settings.from_env())
    _installed[pid] = module
    return module


def register() -> None:
    """SGLang general-plugin entry point. A no-op unless kvcached is enabled.

    Never raises: a failure is logged and SGLang runs without kvcached.
    """
    if not is_enabled():
        return
    try:
        module = install_hooks()
        logger.info("kvcached: elastic KV cache enabled for SGLang (%s)", module.__name__)
    except UnsupportedSGLangVersion as exc:
        logger.error("kvcached is NOT active: %s", exc)
    except Exception:  # noqa: BLE001 - a plugin must not take SGLang down
        logger.exception("kvcached is NOT active: registering the SGLang hooks failed")


__all__ = [
    "register",
    "install_hooks",
    "hook_module_for",
    "UnsupportedSGLangVersion",
    "SUPPORTED_VERSIONS",
    "is_enabled",
]
