"""How vLLM 0.32's KV cache groups and tensors sit in one kvcached KV space.

vLLM 0.32 keeps every KV cache group (full attention, sliding window, chunked
local, Mamba / GDN state, ...) in **one** flat allocation of ``num_blocks``
blocks: each ``KVCacheTensor`` places layer ``l`` of block ``b`` at ``offset +
l * layer_stride + b * block_stride``, and the groups overlay each other from
byte 0 (a block id belongs to one group at a time; the groups share one
``BlockPool``). kvcached backs that allocation with one KV space whose block
``b`` covers every byte any group's block ``b`` uses:

* layer-outermost layouts (LBHNC, ...; page sizes equal across groups, as
  vLLM requires there): the allocation is ``L`` layer *slots* of ``num_blocks``
  pages; each group's layers fill slots from slot 0, so kvcached's layer ``i``
  is slot ``i`` and ``block_bytes`` is the (padded) page;
* block-outermost layouts (BLHNC, ...): a block is one run holding every
  layer of every group, so the space has one layer of ``bytes_per_block``.

Mapping block ``b`` thus maps what whichever group holds it reads and writes
(a group with fewer layers than the largest leaves some of it unused, as vLLM's
own allocation does).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from kvcached.errors import IntegrationError

from .errors import UnsupportedVLLMConfig


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What one block id occupies in vLLM's allocation, in kvcached's terms."""

    num_layers: int  # kvcached layers: layer slots, or 1 for a block-outermost layout
    block_bytes: int  # one block of one kvcached layer
    layer_stride: Optional[int]  # bytes between slots (None: block-outermost)


def layer_spec(kv_cache_config: Any, layer_name: str) -> tuple[int, Any]:
    """The KV cache group index and spec of one layer."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        if layer_name in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[layer_name]
            return group_id, spec
    raise IntegrationError(f"kvcached: layer {layer_name} is in no KV cache group")


def refuse_unbackable(kv_cache_config: Any) -> None:
    """Raises UnsupportedVLLMConfig for KV tensors kvcached cannot back (named, with the reason)."""
    for tensor in kv_cache_config.kv_cache_tensors:
        _, spec = layer_spec(kv_cache_config, tensor.layers[0])
        if tensor.host_resident or not getattr(spec, "has_layer_views", True):
            raise UnsupportedVLLMConfig(
                f"kvcached cannot back KV cache spec {type(spec).__name__}: its layers get raw "
                "buffers or host-resident pools outside the block pool. Unset KVCACHED_ENABLE "
                "for this model."
            )


def footprint(kv_cache_config: Any) -> Footprint:
    """Where block ids live in vLLM's one allocation; raises UnsupportedVLLMConfig if no
    kvcached layout covers it (the message names the strides)."""
    tensors = kv_cache_config.kv_cache_tensors
    refuse_unbackable(kv_cache_config)
    num_blocks = kv_cache_config.num_blocks
    sizes = {tensor.size for tensor in tensors}
    if len(sizes) != 1:
        raise UnsupportedVLLMConfig(f"kvcached expects one shared KV allocation; vLLM sized {sorted(sizes)}")
    size = sizes.pop()
    block_strides = {tensor.block_stride for tensor in tensors}
    if len(block_strides) == 1:
        # Layer-outermost: every layer of every group is a slot of num_blocks pages.
        block_bytes = next(iter(block_strides))
        slot = block_bytes * num_blocks
        if size % slot == 0 and all(
            t.offset % slot == 0 and (len(t.layers) == 1 or t.layer_stride == slot) for t in tensors
        ):
            return Footprint(num_layers=size // slot, block_bytes=block_bytes, layer_stride=slot)
    per_block = size // num_blocks
    if (
        size == per_block * num_blocks
        and block_strides == {per_block}
        and all(t.offset + len(t.layers) * t.layer_stride <= per_block for t in tensors)
    ):
        return Footprint(num_layers=1, block_bytes=per_block, layer_stride=None)
    described = "; ".join(
        f"{len(t.layers)} layers at offset {t.offset} (layer stride {t.layer_stride}, block stride {t.block_stride})"
        for t in tensors
    )
    raise UnsupportedVLLMConfig(
        f"kvcached cannot cover this KV cache layout with one block-id space: {described}. "
        "Unset KVCACHED_ENABLE for this model."
    )


def views_over(flat: Any, kv_cache_config: Any, layout: Any, kernel_block_sizes: Any) -> dict:
    """Every layer's KV view over ``flat`` (kvcached's space), as vLLM's ``allocate_kv_cache``
    carves them over its own buffer: per tensor, the group's spec and kernel block size."""
    from vllm.v1.kv_cache_interface import create_kv_cache_views

    kv_caches: dict = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        group_id, spec = layer_spec(kv_cache_config, tensor.layers[0])
        kernel_block_size = None
        if kernel_block_sizes is not None and group_id < len(kernel_block_sizes):
            kernel_block_size = kernel_block_sizes[group_id]
        views = create_kv_cache_views(
            flat, spec, kv_cache_config.num_blocks_of(tensor), layout, tensor, kernel_block_size=kernel_block_size
        )
        kv_caches.update(zip(tensor.layers, views))
    return kv_caches


def describe_groups(kv_cache_config: Any) -> str:
    """``FullAttentionSpec x1 + SlidingWindowSpec x5``: the groups, for the log."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    kinds: dict[str, int] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        kinds[type(spec).__name__] = kinds.get(type(spec).__name__, 0) + 1
    return " + ".join(f"{name} x{count}" for name, count in kinds.items())


def describe_layers(layer_names: Any) -> str:
    """``layers 0-2, 5``: which of the model's layers a worker holds (a pipeline stage holds some)."""
    numbers = [[int(part) for part in name.split(".") if part.isdigit()] for name in layer_names]
    if not numbers or any(len(found) != 1 for found in numbers):  # not one index per name: the names
        return "layers " + ", ".join(sorted(layer_names))
    runs: list[list[int]] = []
    for index in sorted({found[0] for found in numbers}):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return "layers " + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


__all__ = [
    "Footprint",
    "describe_groups",
    "describe_layers",
    "footprint",
    "layer_spec",
    "refuse_unbackable",
    "views_over",
]
