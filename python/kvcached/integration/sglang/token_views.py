"""SGLang's token-pool shape over a kvcached KV space: per layer ``(k, v)``, one row per token slot."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcached.errors import InvalidArgumentError
from kvcached.tensor_views import (
    SpaceLike,
    itemsize_of,
    kv_block_geometry,
    space_of,
    strided_bytes_view,
    torch_module,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


def sglang_views(
    pool: SpaceLike, *, num_heads: int, head_dim: int, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(k, v)``, each ``(num_tokens, num_heads, head_dim)``: SGLang's token pool.

    A token index is ``block * block_size + slot``, so a layer's blocks must
    be packed back to back: only the per_layer layout with separate K and V
    buffers has that shape.
    """
    space = space_of(pool)
    if space.num_buffers != 2:
        raise InvalidArgumentError("SGLang views need separate K and V buffers (num_buffers=2)")
    if space.block_stride_bytes != space.block_bytes:
        raise InvalidArgumentError(
            f"SGLang views need a layer's blocks packed back to back (block stride == block bytes), "
            f"but this space's block stride is {space.block_stride_bytes} bytes for "
            f"{space.block_bytes}-byte blocks; use layout='per_layer'"
        )
    block_size, kv_stride, token_bytes = kv_block_geometry(space, num_heads, head_dim, dtype)
    itemsize = itemsize_of(dtype)
    shape = [space.num_blocks * block_size, num_heads, head_dim]
    strides = [token_bytes, head_dim * itemsize, itemsize]
    flat = torch_module().from_dlpack(space.tensor())
    views = []
    for layer in range(space.num_layers):
        base = layer * space.layer_stride_bytes
        k = strided_bytes_view(flat, shape=shape, strides_bytes=strides, dtype=dtype, offset_bytes=base)
        v = strided_bytes_view(flat, shape=shape, strides_bytes=strides, dtype=dtype, offset_bytes=base + kv_stride)
        views.append((k, v))
    return views


__all__ = ["sglang_views"]
