"""vLLM 0.34's workers with kvcached: 0.32's, with 0.34's ``allocate_kv_cache(..., allocate=None)``.

0.34 added an ``allocate`` callback to ``allocate_kv_cache`` (Model Runner V2
passes it, for vLLM's own extensible KV cache and HiSparse). kvcached's
replacement accepts it: without a callback, 0.32's replacement backs the views
with kvcached (or runs vLLM's own function for a cache kvcached did not plan);
with one, vLLM's own function runs, and a cache kvcached planned is refused
(``extensible`` keeps vLLM's extensible KV cache off while kvcached plans).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..v0_32 import worker as v0_32_worker
from ..v0_32.plan import PLAN_ATTR, UnsupportedVLLMConfig


def wrap_allocate_kv_cache(original: Any) -> Any:
    def four_arguments(kv_cache_config: Any, device: Any, layout: Any, kernel_block_sizes: Any = None) -> dict:
        return original(kv_cache_config, device, layout, kernel_block_sizes)

    kvcached_allocate = v0_32_worker.wrap_allocate_kv_cache(four_arguments)

    def allocate_kv_cache(
        kv_cache_config: Any,
        device: Any,
        layout: Any,
        kernel_block_sizes: Any = None,
        allocate: Optional[Callable[[int], Any]] = None,
    ) -> dict:
        if allocate is None:
            return kvcached_allocate(kv_cache_config, device, layout, kernel_block_sizes)
        if getattr(kv_cache_config, PLAN_ATTR, None) is not None:
            raise UnsupportedVLLMConfig(
                "kvcached backs this KV cache, but vLLM asked for its own backing allocation too "
                "(extensible KV cache or HiSparse); disable that or unset KVCACHED_ENABLE"
            )
        return original(kv_cache_config, device, layout, kernel_block_sizes, allocate=allocate)

    return allocate_kv_cache


__all__ = ["wrap_allocate_kv_cache"]
