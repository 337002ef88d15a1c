"""kvcached inside vLLM: an elastic KV cache behind vLLM's own block manager.

vLLM loads :func:`register` in every process it starts (front end, EngineCore,
workers, the model-registry helper) through the entry point
``vllm.general_plugins: kvcached = "kvcached.integration.vllm:register"``.
Nothing happens unless ``KVCACHED_ENABLE=1`` (or ``ENABLE_KVCACHED=true``) is
set. When enabled, :func:`register` checks ``vllm.__version__``, verifies every
vLLM name the package written for that release patches (see ``POLICY`` and
:mod:`kvcached.integration.common.front_door`), then installs it; any other
version, or a name that moved, is refused with a message naming it.

How it works (vLLM 0.32 to 0.34; details in ``v0_32``, what differs in ``v0_33``
and ``v0_34``):

- every worker describes its device; workers report a *virtual* KV capacity
  instead of profiled free memory, and back vLLM's KV views with a kvcached KV
  space of their own (tensor-parallel ranks and pipeline stages alike);
- the EngineCore's ``BlockPool`` is a subclass whose blocks come from a
  device-less block manager with one mirror per rank, each charged on its own
  device's budget; running out becomes preemption;
- page map/unmap lists ride on each ``SchedulerOutput`` to every worker, in step
  order; every rank acknowledges on a shared-memory board; an idle engine
  flushes pending unmaps with one ordered RPC.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any

from kvcached.integration.common.engine_log import route_to_engine_log
from kvcached.integration.common.front_door import (
    EnginePlugin,
    PatchPointMoved,
    UnsupportedEngineVersion,
    VersionPolicy,
)
from kvcached.integration.common.settings import is_enabled

# Under kvcached's logger, and also written through vLLM's handlers (vLLM's stream and format).
logger = logging.getLogger(__name__)
route_to_engine_log(logger, "vllm")


class UnsupportedVLLMVersion(UnsupportedEngineVersion):
    """The installed vLLM is not one kvcached has patches for."""


#: vLLM release (major, minor) -> the package holding every private vLLM name kvcached touches.
POLICY = VersionPolicy(
    engine="vLLM",
    package=__name__,
    releases={(0, 32): "v0_32", (0, 33): "v0_33", (0, 34): "v0_34"},
    release_parts=2,
    error=UnsupportedVLLMVersion,
)
SUPPORTED_VERSIONS = POLICY.supported


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


_plugin = EnginePlugin(POLICY, _vllm_version, logger)
_installed = _plugin.installed  # pid -> version package (fork-safe idempotence)


def module_for(version: str) -> ModuleType:
    """The version package for a vLLM version; raises :class:`UnsupportedVLLMVersion`."""
    return POLICY.package_for(version)


def install() -> ModuleType:
    """Verifies the running vLLM's patch points and installs its version package (idempotent per process).

    Raises :class:`UnsupportedVLLMVersion` for other vLLM versions and
    :class:`PatchPointMoved` when a vLLM name the package patches moved. Most
    callers want :func:`register`, which also honours ``KVCACHED_ENABLE``.
    """
    return _plugin.install()


def register() -> None:
    """vLLM general-plugin entry point. A no-op unless kvcached is enabled.

    Never raises: vLLM calls plugins without a guard, and an exception here would
    kill the process. Failures are logged; vLLM then runs without kvcached.
    """
    _plugin.register()


def worker_kv_stats(worker: Any = None) -> dict | None:
    """Mapping statistics of this worker process's KV space (None if it has none).

    From a front end: ``LLM.collective_rpc("kvcached_kv_stats")``; the
    EngineCore's view: ``llm.llm_engine.engine_core.call_utility("kvcached_stats")``.
    """
    module = _installed.get(os.getpid())
    return module.worker_kv_stats(worker) if module is not None else None


__all__ = [
    "register",
    "install",
    "module_for",
    "worker_kv_stats",
    "UnsupportedVLLMVersion",
    "PatchPointMoved",
    "POLICY",
    "SUPPORTED_VERSIONS",
    "is_enabled",
]
