"""kvcached inside vLLM: an elastic KV cache behind vLLM's own block manager.

vLLM loads :func:`register` in every process it starts (front end, EngineCore,
workers, the model-registry helper) through the entry point
``vllm.general_plugins: kvcached = "kvcached.integration.vllm:register"``.
Nothing happens unless ``KVCACHED_ENABLE=1`` (or ``ENABLE_KVCACHED=true``) is
set. When enabled, :func:`register` checks ``vllm.__version__`` and installs the
patches of the one package written for that version (see ``_PATCH_MODULES``);
any other version is refused with a message naming the supported ones.

How it works (vLLM 0.32; details in ``v0_32``):

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

import importlib
import logging
import os
from types import ModuleType
from typing import Any

from kvcached.errors import KvcachedError
from kvcached.integration.common.engine_log import route_to_engine_log
from kvcached.integration.common.settings import Settings, is_enabled

# Under kvcached's logger, and also written through vLLM's handlers (vLLM's stream and format).
logger = logging.getLogger(__name__)
route_to_engine_log(logger, "vllm")

#: vLLM minor version -> module holding every private vLLM name kvcached touches.
_PATCH_MODULES: dict[tuple[int, int], str] = {
    (0, 32): "v0_32",
}
SUPPORTED_VERSIONS = ", ".join(f"{a}.{b}.x" for a, b in sorted(_PATCH_MODULES))


class UnsupportedVLLMVersion(KvcachedError, RuntimeError):
    """The installed vLLM is not one kvcached has patches for."""


_installed: dict[int, ModuleType] = {}  # pid -> patch module (fork-safe idempotence)


def _vllm_release(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string such as ``0.32.0+cpu``."""
    parts = version.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise UnsupportedVLLMVersion(
            f"cannot parse vLLM version {version!r}; supported: {SUPPORTED_VERSIONS}"
        ) from None


def patch_module_for(version: str) -> ModuleType:
    """The patch module for a vLLM version; raises :class:`UnsupportedVLLMVersion`."""
    release = _vllm_release(version)
    name = _PATCH_MODULES.get(release)
    if name is None:
        raise UnsupportedVLLMVersion(
            f"kvcached does not support vLLM {version}; supported: {SUPPORTED_VERSIONS}. "
            "Install a supported vLLM or unset KVCACHED_ENABLE."
        )
    return importlib.import_module(f"{__name__}.{name}")


def apply_patches() -> ModuleType:
    """Installs the patches for the running vLLM (idempotent per process).

    Raises :class:`UnsupportedVLLMVersion` for other vLLM versions. Most callers
    want :func:`register`, which also honours ``KVCACHED_ENABLE``.
    """
    pid = os.getpid()
    if pid in _installed:
        return _installed[pid]
    import vllm

    module = patch_module_for(vllm.__version__)
    module.install(Settings.from_env())
    _installed[pid] = module
    return module


def register() -> None:
    """vLLM general-plugin entry point. A no-op unless kvcached is enabled.

    Never raises: vLLM calls plugins without a guard, and an exception here would
    kill the process. Failures are logged; vLLM then runs without kvcached.
    """
    if not is_enabled():
        return
    try:
        module = apply_patches()
        logger.info("kvcached: elastic KV cache enabled for vLLM (%s)", module.__name__)
    except UnsupportedVLLMVersion as exc:
        logger.error("kvcached is NOT active: %s", exc)
    except Exception:  # noqa: BLE001 - a plugin must not take vLLM down
        logger.exception("kvcached is NOT active: installing the vLLM patches failed")


def worker_kv_stats(worker: Any = None) -> dict | None:
    """Mapping statistics of this worker process's KV space (None if it has none).

    From a front end: ``LLM.collective_rpc("kvcached_kv_stats")``; the
    EngineCore's view: ``llm.llm_engine.engine_core.call_utility("kvcached_stats")``.
    """
    module = _installed.get(os.getpid())
    return module.worker_kv_stats(worker) if module is not None else None


__all__ = [
    "register",
    "apply_patches",
    "patch_module_for",
    "worker_kv_stats",
    "UnsupportedVLLMVersion",
    "SUPPORTED_VERSIONS",
    "is_enabled",
]
