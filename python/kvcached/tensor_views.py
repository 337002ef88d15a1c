"""Torch views of a KV space: per-layer tensors in attention kernels' shapes, as strided views of its bytes.

A KV space is one flat byte range; kernels want per-layer tensors of their own
shape. Every shape here is ``torch.as_strided`` over the flat bytes viewed as
the kernel's dtype, so no memory is copied and the views keep the reservation
alive. torch stays optional for the package: it is imported inside functions.
Shapes that only one engine uses live in that engine's integration
(SGLang's token pool: :mod:`kvcached.integration.sglang.token_views`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

from kvcached.errors import InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from kvcached.pool import KVPool, KVSpace


def torch_module() -> Any:
    """torch, imported on first use, or an ImportError saying how to install it."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("kvcached.tensor_views needs torch: pip install torch") from exc
    return torch


def itemsize_of(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype; TypeError for anything that is not one."""
    torch = torch_module()
    if not isinstance(dtype, torch.dtype):
        raise InvalidTypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def _as_flat_bytes(flat: Any) -> torch.Tensor:
    """A 1-D contiguous uint8 tensor over ``flat`` (a tensor or a DLPack exporter)."""
    torch = torch_module()
    if not isinstance(flat, torch.Tensor):
        flat = torch.from_dlpack(flat)
    if flat.dim() != 1 or not flat.is_contiguous():
        raise InvalidArgumentError(f"flat must be a 1-D contiguous byte tensor, got shape {tuple(flat.shape)}")
    if flat.dtype != torch.uint8:
        raise InvalidArgumentError(f"flat must hold bytes (torch.uint8), got {flat.dtype}")
    return flat


def _in_items(name: str, value_bytes: int, itemsize: int, dtype: Any) -> int:
    if value_bytes < 0:
        raise InvalidArgumentError(f"{name} must not be negative, got {value_bytes}")
    if value_bytes % itemsize:
        raise InvalidArgumentError(
            f"{name}={value_bytes} is not a multiple of the {itemsize}-byte size of {dtype}; "
            "choose a dtype whose size divides every stride and offset"
        )
    return value_bytes // itemsize


def strided_bytes_view(
    flat: Any,
    *,
    shape: Sequence[int],
    strides_bytes: Sequence[int],
    dtype: torch.dtype,
    offset_bytes: int = 0,
) -> torch.Tensor:
    """A view of ``flat``'s bytes as ``dtype`` with byte strides.

    Raises ValueError when a stride or the offset is not a multiple of the
    dtype's size, when the base address is misaligned for it, or when the view
    would reach past the end of ``flat``.
    """
    flat = _as_flat_bytes(flat)
    itemsize = itemsize_of(dtype)
    if len(shape) != len(strides_bytes):
        raise InvalidArgumentError(f"shape {tuple(shape)} and strides {tuple(strides_bytes)} differ in length")
    if any(int(n) <= 0 for n in shape):
        raise InvalidArgumentError(f"every dimension must be positive, got shape {tuple(shape)}")
    if flat.data_ptr() % itemsize:
        raise InvalidArgumentError(f"the buffer's address is not aligned to the {itemsize}-byte size of {dtype}")
    offset = _in_items("offset_bytes", offset_bytes, itemsize, dtype)
    strides = [_in_items("stride", s, itemsize, dtype) for s in strides_bytes]
    last_item = offset + sum((int(n) - 1) * s for n, s in zip(shape, strides))
    total_items = flat.numel() // itemsize
    if last_item >= total_items:
        raise InvalidArgumentError(
            f"the view (shape {tuple(shape)}, byte strides {tuple(strides_bytes)}, offset {offset_bytes}) "
            f"reaches byte {(last_item + 1) * itemsize}, past the buffer's {flat.numel()} bytes"
        )
    typed = flat[: total_items * itemsize].view(dtype)
    # as_strided's offset counts from the storage's start, not from the tensor's.
    return torch_module().as_strided(typed, [int(n) for n in shape], strides, typed.storage_offset() + offset)


def layer_views(
    flat: Any,
    *,
    num_layers: int,
    num_blocks: int,
    block_shape: Sequence[int],
    dtype: torch.dtype,
    layer_stride_bytes: int,
    block_stride_bytes: int,
    offset_bytes: int = 0,
) -> list[torch.Tensor]:
    """One ``(num_blocks, *block_shape)`` tensor per layer over ``flat``'s bytes.

    Block ``b`` of layer ``l`` starts at byte
    ``offset_bytes + l * layer_stride_bytes + b * block_stride_bytes``; inside a
    block the elements are packed (row-major ``block_shape``). This is the
    shape vLLM asks for when it hands a kernel one buffer per layer whose cells
    hold K and V together.
    """
    if num_layers <= 0 or num_blocks <= 0:
        raise InvalidArgumentError(f"num_layers and num_blocks must be positive, got {num_layers} and {num_blocks}")
    itemsize = itemsize_of(dtype)
    block_elems = math.prod(int(n) for n in block_shape)
    if block_elems * itemsize > block_stride_bytes and num_blocks > 1:
        raise InvalidArgumentError(
            f"a block of shape {tuple(block_shape)} in {dtype} takes {block_elems * itemsize} bytes, "
            f"more than the block stride of {block_stride_bytes} bytes: blocks would overlap"
        )
    inner = _packed_strides_bytes(block_shape, itemsize)
    return [
        strided_bytes_view(
            flat,
            shape=[num_blocks, *block_shape],
            strides_bytes=[block_stride_bytes, *inner],
            dtype=dtype,
            offset_bytes=offset_bytes + layer * layer_stride_bytes,
        )
        for layer in range(num_layers)
    ]


def _packed_strides_bytes(shape: Sequence[int], itemsize: int) -> list[int]:
    strides, step = [], itemsize
    for n in reversed(list(shape)):
        strides.append(step)
        step *= int(n)
    return list(reversed(strides))


# ---- ready-made geometries of a KVSpace / KVPool -------------------------------------


SpaceLike = Union["KVSpace", "KVPool"]


def space_of(obj: SpaceLike) -> KVSpace:
    """The KV space of a KVPool (or the KVSpace itself); TypeError for anything else."""
    space = getattr(obj, "space", obj)
    for attr in ("block_stride_bytes", "layer_stride_bytes", "buffer_stride_bytes", "tensor"):
        if not hasattr(space, attr):
            raise InvalidTypeError(f"expected a KVSpace or KVPool, got {type(obj).__name__}")
    return space


def _tokens_per_block(space: KVSpace, token_bytes: int, halves: int) -> int:
    """Tokens in one block when each token takes ``token_bytes`` in each of ``halves`` parts."""
    cell_bytes = token_bytes * halves
    if space.block_bytes % cell_bytes:
        raise InvalidArgumentError(
            f"a block of {space.block_bytes} bytes does not hold a whole number of tokens of "
            f"{cell_bytes} bytes ({halves} x {token_bytes})"
        )
    return space.block_bytes // cell_bytes


def kv_block_geometry(space: KVSpace, num_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(block_size, k_to_v_stride_bytes, token_bytes) for a space of K and V blocks.

    With two buffers K and V are separate arrays (``buffer_stride_bytes``
    apart); with one buffer each block is a K||V cell: K's tokens, then V's.
    """
    if num_heads <= 0 or head_dim <= 0:
        raise InvalidArgumentError(f"num_heads and head_dim must be positive, got {num_heads} and {head_dim}")
    token_bytes = num_heads * head_dim * itemsize_of(dtype)
    if space.num_buffers == 2:
        block_size = _tokens_per_block(space, token_bytes, 1)
        return block_size, space.buffer_stride_bytes, token_bytes
    block_size = _tokens_per_block(space, token_bytes, 2)
    return block_size, block_size * token_bytes, token_bytes


def _per_layer(space: KVSpace, shape: list[int], strides: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    flat = torch_module().from_dlpack(space.tensor())
    return [
        strided_bytes_view(
            flat, shape=shape, strides_bytes=strides, dtype=dtype, offset_bytes=layer * space.layer_stride_bytes
        )
        for layer in range(space.num_layers)
    ]


def flash_attn_views(pool: SpaceLike, *, num_heads: int, head_dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per layer ``(2, num_blocks, block_size, num_heads, head_dim)``: FlashAttention / vLLM style.

    Index 0 of the first dimension is K, 1 is V. ``block_size`` (tokens per
    block) follows from the space's block bytes.
    """
    space = space_of(pool)
    block_size, kv_stride, token_bytes = kv_block_geometry(space, num_heads, head_dim, dtype)
    itemsize = itemsize_of(dtype)
    shape = [2, space.num_blocks, block_size, num_heads, head_dim]
    strides = [kv_stride, space.block_stride_bytes, token_bytes, head_dim * itemsize, itemsize]
    return _per_layer(space, shape, strides, dtype)


def flashinfer_views(pool: SpaceLike, *, num_heads: int, head_dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per layer ``(num_blocks, 2, block_size, num_heads, head_dim)``: FlashInfer style (NHD)."""
    space = space_of(pool)
    block_size, kv_stride, token_bytes = kv_block_geometry(space, num_heads, head_dim, dtype)
    itemsize = itemsize_of(dtype)
    shape = [space.num_blocks, 2, block_size, num_heads, head_dim]
    strides = [space.block_stride_bytes, kv_stride, token_bytes, head_dim * itemsize, itemsize]
    return _per_layer(space, shape, strides, dtype)


def mla_views(pool: SpaceLike, *, dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per layer ``(num_blocks, block_size, dim)`` for MLA's single latent buffer (num_buffers=1)."""
    space = space_of(pool)
    if space.num_buffers != 1:
        raise InvalidArgumentError(f"MLA views need a space with num_buffers=1, this one has {space.num_buffers}")
    if dim <= 0:
        raise InvalidArgumentError(f"dim must be positive, got {dim}")
    itemsize = itemsize_of(dtype)
    block_size = _tokens_per_block(space, dim * itemsize, 1)
    return layer_views(
        space.tensor(),
        num_layers=space.num_layers,
        num_blocks=space.num_blocks,
        block_shape=(block_size, dim),
        dtype=dtype,
        layer_stride_bytes=space.layer_stride_bytes,
        block_stride_bytes=space.block_stride_bytes,
    )


__all__ = [
    "flash_attn_views",
    "flashinfer_views",
    "layer_views",
    "mla_views",
    "strided_bytes_view",
]
