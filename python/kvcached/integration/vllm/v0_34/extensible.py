"""vLLM 0.34's own extensible KV cache, off while kvcached backs the KV cache.

0.34 can reserve its KV cache with device virtual memory and commit pages
after warm-up (``enable_extensible_kv_cache``; on by default on CUDA and ROCm).
Two mechanisms over the same tensors would each think they own the pages, so
with kvcached the default becomes off, and an explicit request is refused
before planning, with a message saying so.
"""

from __future__ import annotations

from typing import Any

from ..v0_32.plan import UnsupportedVLLMConfig

_MARKER = "_kvcached_v0_34"  # on the refusal wrapper (0.32's own marker is on it too, see install)


def wrap_resolve_extensible_kv_cache(original: Any) -> Any:
    def _resolve_extensible_kv_cache(self: Any) -> Any:
        cache_config = self.cache_config
        if cache_config.enable_extensible_kv_cache is None:  # unset: kvcached's elastic cache, not vLLM's
            cache_config.enable_extensible_kv_cache = False
        return original(self)

    return _resolve_extensible_kv_cache


def refuse_extensible(vllm_config: Any) -> None:
    """Raises UnsupportedVLLMConfig when vLLM's extensible KV cache was asked for explicitly."""
    if getattr(vllm_config.cache_config, "enable_extensible_kv_cache", False):
        raise UnsupportedVLLMConfig(
            "kvcached cannot run with vLLM's extensible KV cache (enable_extensible_kv_cache): both would "
            "own the KV pages. Drop --enable-extensible-kv-cache or unset KVCACHED_ENABLE."
        )


def wrap_refusing_get_kv_cache_configs(original: Any) -> Any:
    def get_kv_cache_configs(vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        refuse_extensible(vllm_config)
        return original(vllm_config, *args, **kwargs)

    return get_kv_cache_configs


__all__ = ["refuse_extensible", "wrap_refusing_get_kv_cache_configs", "wrap_resolve_extensible_kv_cache"]
