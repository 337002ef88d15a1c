"""kvcached inside vLLM 0.33: vLLM 0.32's package, with 0.33's planner call.

What differs from 0.32 among the names kvcached patches or calls (diffed from
the two releases' sources):

* ``get_kv_cache_configs`` (planning, in the EngineCore) takes the model's
  global KV cache groups as a fourth argument: ``plan`` wraps it with that
  signature and reuses 0.32's planning unchanged.
* ``BlockPool.__init__``, ``get_kv_cache_coordinator`` and ``KVCacheManager.__init__``
  gained ``num_hash_lookahead_tokens``: kvcached's block pool forwards every
  argument to vLLM's, so nothing changes here.
* ``KVCacheManager.get_computed_blocks`` gained ``max_cache_hit_length``: not patched.
* Everything else ``v0_32.patch_points`` declares (the V1 and V2 model runners'
  ``allocate_kv_cache`` and ``initialize_kv_cache``, the scheduler, the
  EngineCore, ``request_memory``, ``create_kv_cache_views``) is unchanged; the
  plugin front door verifies it at start-up.
"""

from __future__ import annotations

from kvcached.integration.common.front_door import PatchPoint
from kvcached.integration.common.settings import Settings

from .. import v0_32
from ..v0_32 import KVCachePoolExhausted, UnsupportedVLLMConfig, worker_kv_stats
from ..v0_32.patch_points import patch_points
from . import plan

PATCH_POINTS: tuple[PatchPoint, ...] = patch_points(configs_parameters=plan.GET_KV_CACHE_CONFIGS_PARAMETERS)


def install(settings: Settings) -> None:
    """Installs 0.32's patches with 0.33's planner wrapper."""
    v0_32.install(settings, configs_wrapper=plan.wrap_get_kv_cache_configs)


__all__ = ["PATCH_POINTS", "KVCachePoolExhausted", "UnsupportedVLLMConfig", "install", "worker_kv_stats"]
