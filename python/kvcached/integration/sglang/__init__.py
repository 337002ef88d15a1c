"""kvcached inside SGLang: an elastic KV cache behind SGLang's own pools and allocators.

SGLang runs :func:`register` in every process it starts (engine or HTTP server,
schedulers, detokenizer) through the general-plugin entry point
``sglang.srt.plugins: kvcached = "kvcached.integration.sglang:register"``.
Nothing happens unless ``KVCACHED_ENABLE=1`` (or ``ENABLE_KVCACHED=true``) is
set. When enabled, :func:`register` checks ``sglang.__version__``, verifies the
SGLang names hooked by the package written for that release (see ``POLICY`` and
:mod:`kvcached.integration.common.front_door`) and registers its hooks with
SGLang's ``HookRegistry``; any other version, or a hooked name that moved, is
refused with a message naming it, and SGLang runs without kvcached.

How it works (SGLang 0.5.23; details in ``v0_5_23``): each scheduler process
plans its KV cache for a large virtual capacity, backs SGLang's KV pool with a
kvcached KV space, and takes token slots (or pages) from a kvcached block
manager in the same process; memory follows the slots in use, and running out
makes requests wait or be retracted.
"""

from __future__ import annotations

import logging
from types import ModuleType

from kvcached.integration.common.engine_log import route_to_engine_log
from kvcached.integration.common.front_door import (
    EnginePlugin,
    PatchPointMoved,
    UnsupportedEngineVersion,
    VersionPolicy,
)
from kvcached.integration.common.settings import is_enabled

# Under kvcached's logger, and also written through SGLang's handlers, if it has its own.
logger = logging.getLogger(__name__)
route_to_engine_log(logger, "sglang")


class UnsupportedSGLangVersion(UnsupportedEngineVersion):
    """The installed SGLang is not one kvcached has hooks for."""


#: SGLang release (major, minor, patch) -> the package holding every private SGLang name kvcached touches.
POLICY = VersionPolicy(
    engine="SGLang",
    package=__name__,
    releases={(0, 5, 23): "v0_5_23"},
    release_parts=3,
    error=UnsupportedSGLangVersion,
)
SUPPORTED_VERSIONS = POLICY.supported


def _sglang_version() -> str:
    import sglang

    return sglang.__version__


_plugin = EnginePlugin(POLICY, _sglang_version, logger)
_installed = _plugin.installed  # pid -> version package (fork-safe idempotence)


def module_for(version: str) -> ModuleType:
    """The version package for an SGLang version; raises :class:`UnsupportedSGLangVersion`."""
    return POLICY.package_for(version)


def install() -> ModuleType:
    """Verifies the running SGLang's hook targets and installs its version package (idempotent per process).

    Raises :class:`UnsupportedSGLangVersion` for other SGLang versions and
    :class:`PatchPointMoved` when a hooked SGLang name moved. Most callers
    want :func:`register`, which also honours ``KVCACHED_ENABLE``.
    """
    return _plugin.install()


def register() -> None:
    """SGLang general-plugin entry point. A no-op unless kvcached is enabled.

    Never raises: a failure is logged and SGLang runs without kvcached.
    """
    _plugin.register()


__all__ = [
    "register",
    "install",
    "module_for",
    "UnsupportedSGLangVersion",
    "PatchPointMoved",
    "POLICY",
    "SUPPORTED_VERSIONS",
    "is_enabled",
]
