"""vLLM 0.33's planner call: ``get_kv_cache_configs`` takes the model's global KV cache groups too.

0.33 computes the groups once in ``EngineCore._initialize_kv_caches``
(``get_global_kv_cache_groups``) and passes them as a fourth argument. 0.32's
planning wrapper is reused as is, over a three-argument view of 0.33's function.
"""

from __future__ import annotations

from typing import Any

from ..v0_32 import plan as v0_32_plan

#: 0.33's ``get_kv_cache_configs`` parameters (kvcached's wrapper has this exact signature).
GET_KV_CACHE_CONFIGS_PARAMETERS = ("vllm_config", "kv_cache_specs", "available_memory", "global_kv_cache_groups")


def wrap_get_kv_cache_configs(original: Any) -> Any:
    def get_kv_cache_configs(
        vllm_config: Any, kv_cache_specs: Any, available_memory: Any, global_kv_cache_groups: Any
    ) -> Any:
        def with_groups(config: Any, specs: Any, memory: Any) -> Any:
            return original(config, specs, memory, global_kv_cache_groups)

        return v0_32_plan.wrap_get_kv_cache_configs(with_groups)(vllm_config, kv_cache_specs, available_memory)

    return get_kv_cache_configs


__all__ = ["GET_KV_CACHE_CONFIGS_PARAMETERS", "wrap_get_kv_cache_configs"]
