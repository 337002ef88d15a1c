"""KVCacheManager: the block-manager API users of the reference kvcached know, over a KVPool.

Names and conventions follow the reference implementation so engine
integrations port over unchanged: sizes in blocks, ``alloc`` answers ``None``
when memory is short, ``resize`` takes the bytes of *one* layer's K (or V)
buffer, ``try_to_reserve`` sets blocks aside that the next ``alloc`` hands out
first. It is a thin veneer: every count (blocks in use, reserved blocks, the
null block, the block count itself) lives in the :class:`~kvcached.pool.KVPool`
underneath, reachable as :attr:`KVCacheManager.pool`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np

from kvcached import _core, defaults
from kvcached.devices import default_device, open_device
from kvcached.errors import InvalidArgumentError, InvalidTypeError, OutOfMemoryError
from kvcached.layout import KVLayout
from kvcached.pool import KVPool

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

_UNITS = {"bytes": 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}


_MAX_COUNT = 2**63 - 1  # the largest count the core takes as it is


def _check_count(name: str, value: Any) -> None:
    """Raises the error a block count ``value`` deserves (the slow path: plain small ints never get here)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise InvalidArgumentError(f"{name} must not be negative, got {value}")
    if value > _MAX_COUNT:
        raise InvalidArgumentError(f"{name}={value} is too large")


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise InvalidArgumentError(f"{name} must be positive, got {value}")
    return int(value)


class KVCacheManager:
    """Block ids for an engine's KV cache whose memory follows the blocks in use.

    Args:
        num_blocks: blocks the engine addresses; ids are in ``[0, num_blocks)``
            (need not fill whole pages).
        block_size: tokens per block.
        cell_size: bytes of one token in one layer's K (or V) buffer
            (``num_kv_heads * head_dim * dtype size``).
        num_layers: transformer layers.
        num_kv_buffers: 2 for K and V, 1 for MLA or K||V cells.
        device: ``"cpu"``, ``"cuda:N"``, ... or a Device (default: a GPU if
            any, else the host).
        reserve_null_block: keep block 0 out of circulation (engines point
            padding at it), as the reference's option of the same name.
        layout, page_bytes, zero_backing, limit_bytes, budget,
        background_worker, name: passed to :class:`~kvcached.pool.KVPool`.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        cell_size: int,
        num_layers: int,
        num_kv_buffers: int = 2,
        device: Union[str, _core.Device, None] = None,
        *,
        reserve_null_block: bool = False,
        layout: Optional[str] = None,
        page_bytes: Optional[int] = None,
        zero_backing: Optional[bool] = None,
        limit_bytes: Optional[int] = None,
        budget: Optional[_core.MemoryBudget] = None,
        background_worker: bool = True,
        name: Optional[str] = None,
    ) -> None:
        self.block_size = _check_positive("block_size", block_size)
        self.cell_size = _check_positive("cell_size", cell_size)
        self.block_mem_size = self.block_size * self.cell_size  # bytes of one block of one buffer
        dev = device if isinstance(device, _core.Device) else open_device(device or default_device())
        kv_layout = KVLayout.from_config(
            num_layers,
            self.block_mem_size,
            num_blocks,
            num_buffers=num_kv_buffers,
            page_bytes=page_bytes,
            kind=layout,
            device=dev,
        )
        options = defaults.current().block_manager_options(
            null_block=reserve_null_block, limit_bytes=limit_bytes, background_worker=background_worker
        )
        self.pool = KVPool(
            kv_layout=kv_layout, options=options, device=dev, zero_backing=zero_backing, budget=budget, name=name
        )
        self.reserve_null_block = reserve_null_block
        self._alloc = self.pool.alloc_list  # bound once: the veneer costs one Python call
        self._free = self.pool.free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_layers(self) -> int:
        return self.pool.num_layers

    @property
    def num_kv_buffers(self) -> int:
        return self.pool.num_buffers

    # ---- the reference's API ---------------------------------------------------------

    def alloc(self, need_size: int) -> Optional[list[int]]:
        """``need_size`` block ids (reserved ones first), or ``None`` when memory is short.

        Never partial: on ``None`` nothing was allocated. Memory being given
        back is waited for, never reported short. Raises ValueError once closed.
        """
        if need_size.__class__ is not int or not 0 <= need_size <= _MAX_COUNT:
            _check_count("need_size", need_size)
        try:
            return self._alloc(need_size)
        except OutOfMemoryError:
            return None

    def free(self, indices: Iterable[int]) -> None:
        """Give block ids back (a list, a numpy array or a CPU tensor of integers).

        Unknown, repeated, reserved or already-free ids raise ValueError and
        free nothing; non-integer ids raise TypeError."""
        self._free(indices)

    def try_to_reserve(self, need_size: int) -> bool:
        """Set ``need_size`` more blocks aside; the next :meth:`alloc` calls hand them out first,
        so an alloc of that size is guaranteed. False (nothing taken) when memory is short."""
        if need_size.__class__ is not int or not 0 <= need_size <= _MAX_COUNT:
            _check_count("need_size", need_size)
        return self.pool.try_reserve(need_size)

    def free_reserved(self) -> None:
        """Free the blocks set aside by :meth:`try_to_reserve` and not handed out yet."""
        self.pool.release_reserved()

    def available_size(self) -> int:
        """Blocks :meth:`alloc` could return right now (reserved ones included)."""
        return self.pool.available()

    def get_mapped_memory_size(self, unit: str = "bytes") -> float:
        """Physical memory mapped for this cache, in ``unit`` (bytes, kb, mb, gb)."""
        try:
            scale = _UNITS[unit.lower()]
        except KeyError:
            raise InvalidArgumentError(f"unit must be one of {sorted(_UNITS)}, got {unit!r}") from None
        mapped = self.pool.stats()["mapped_bytes"]
        return mapped if scale == 1 else mapped / scale

    def resize(self, new_mem_size: Optional[int]) -> bool:
        """Limit each layer's K (or V) buffer to ``new_mem_size`` bytes (None: no limit).

        Returns True when the cache is within the new limit now, False when the
        shrink is deferred until blocks in use are freed (blocks set aside by
        :meth:`try_to_reserve` are freed first) — the reference's meaning.
        """
        if new_mem_size is None:
            return self.pool.resize(None)
        if isinstance(new_mem_size, bool) or not isinstance(new_mem_size, (int, np.integer)):
            raise InvalidTypeError(f"new_mem_size must be an int or None, got {type(new_mem_size).__name__}")
        if new_mem_size < 0:
            raise InvalidArgumentError(f"new_mem_size must not be negative, got {new_mem_size}")
        return self.pool.resize(int(new_mem_size) * self.num_layers * self.num_kv_buffers)

    def trim(self) -> None:
        """Give back every mapped page that holds no block in use, and every spare.

        The pool then stays that small while idle; its reserve of ready pages
        refills once allocation resumes."""
        self.pool.trim()

    def clear(self) -> None:
        """Free every block handed out or reserved (the null block stays)."""
        self.pool.clear()

    # ---- tensors and lifetime -----------------------------------------------------------

    def get_kv_tensors(self, dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
        """Per layer ``(num_kv_buffers, num_blocks, block_size, cell_size / itemsize)`` views.

        ``dtype`` defaults to bytes (torch.uint8); its size must divide
        ``cell_size``. The views share memory with the cache and stay valid
        (reading zeros) after :meth:`close`.
        """
        import torch

        from kvcached.tensor_views import strided_bytes_view

        dtype = torch.uint8 if dtype is None else dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        if self.cell_size % itemsize:
            raise InvalidArgumentError(f"cell_size {self.cell_size} is not a multiple of {dtype}'s {itemsize} bytes")
        space = self.pool.space
        flat = torch.from_dlpack(space.tensor())
        shape = [self.num_kv_buffers, self.num_blocks, self.block_size, self.cell_size // itemsize]
        strides = [space.buffer_stride_bytes, space.block_stride_bytes, self.cell_size, itemsize]
        return [
            strided_bytes_view(
                flat, shape=shape, strides_bytes=strides, dtype=dtype, offset_bytes=layer * space.layer_stride_bytes
            )
            for layer in range(self.num_layers)
        ]

    def stats(self) -> dict:
        """The pool's counters (see :meth:`kvcached.pool.KVPool.stats`)."""
        return self.pool.stats()

    def close(self) -> None:
        """Release all memory; live tensors then read zeros. Idempotent."""
        self.pool.close()

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["KVCacheManager"]
