"""Where a module's tensors go in a weights range: one slot per storage, views kept as views.

A module's parameters and buffers are found once, deduplicated (a tied embedding
is one Parameter in two modules; a buffer may view a parameter's storage), and
grouped by the storage they live in. Each storage gets one aligned slot in the
range, exported as a storage of its own; every tensor on it is rebuilt over that
storage with the same offset, shape, strides and dtype, so tensors that shared
memory still do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvcached.errors import InvalidArgumentError

#: Alignment of each storage's slot: what PyTorch's allocators give (512 B on
#: GPUs), so kernels that vectorise their loads see the same alignment as before.
SLOT_ALIGNMENT_BYTES = 512


@dataclasses.dataclass
class StorageSlot:
    """One storage of the module and the tensors on it."""

    offset: int  # of the slot in the range, bytes
    nbytes: int  # of the storage
    source: Any  # a tensor on the storage (any one), to copy the bytes from
    tensors: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Placement:
    """Every storage of a module laid out in one range of ``size_bytes``."""

    slots: list[StorageSlot]
    size_bytes: int

    @property
    def tensors(self) -> list[Any]:
        return [tensor for slot in self.slots for tensor in slot.tensors]


def module_tensors(module: Any) -> list[Any]:
    """Every parameter and buffer of ``module`` and its children, each tensor object once."""
    seen: set[int] = set()
    found = []
    for child in module.modules():
        for table in (child._parameters, child._buffers):
            for tensor in table.values():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    found.append(tensor)
    return found


def _round_up(value: int, unit: int) -> int:
    return (value + unit - 1) // unit * unit


def place(tensors: list[Any], torch_device: Any) -> Placement:
    """Groups ``tensors`` by storage and gives each storage a slot; refuses (changing nothing)
    tensors that are not ordinary strided tensors on ``torch_device``."""
    import torch

    by_storage: dict[tuple[int, int], StorageSlot] = {}
    for tensor in tensors:
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise InvalidArgumentError(f"a tensor of layout {tensor.layout} cannot be moved: only strided tensors can")
        if tensor.device != torch_device:
            raise InvalidArgumentError(
                f"a tensor of shape {tuple(tensor.shape)} is on {tensor.device}, not on {torch_device}: "
                "move the module to the device first"
            )
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        slot = by_storage.get(key)
        if slot is None:
            slot = by_storage[key] = StorageSlot(offset=0, nbytes=storage.nbytes(), source=tensor)
        slot.tensors.append(tensor)
    offset = 0
    slots = sorted(by_storage.values(), key=lambda s: -s.nbytes)  # largest first: fewest gaps
    for slot in slots:
        slot.offset = offset
        offset = _round_up(offset + max(slot.nbytes, 1), SLOT_ALIGNMENT_BYTES)
    return Placement(slots, offset)


def storage_bytes(tensor: Any) -> Any:
    """A uint8 tensor over the whole storage ``tensor`` lives in."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def rebuild(tensor: Any, slot_bytes: Any) -> Any:
    """A tensor like ``tensor`` (dtype, shape, strides, offset in its storage) over the storage
    of ``slot_bytes``, a uint8 tensor of its own storage holding the same bytes."""
    import torch

    rebuilt = torch.empty(0, dtype=tensor.dtype, device=slot_bytes.device)
    return rebuilt.set_(slot_bytes.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())


__all__ = ["SLOT_ALIGNMENT_BYTES", "Placement", "StorageSlot", "module_tensors", "place", "rebuild", "storage_bytes"]
