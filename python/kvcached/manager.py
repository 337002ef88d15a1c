"""KVCacheManager: the block-manager API users of the reference kvcached know, over a KVPool.

Names and conventions follow the reference implementation so engine
integrations port over unchanged: sizes in blocks, ``alloc`` answers ``None``
when memory is short, ``resize`` takes the bytes of *one* layer's K (or V)
buffer. Everything else (limits, budget, reserve worker, zero backing) is the
:class:`~kvcached.pool.KVPool` underneath, reachable as :attr:`KVCacheManager.pool`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Iterable, Optional, Union

import numpy as np

from kvcached import _core
from kvcached.errors import OutOfMemoryError
from kvcached.pool import KVPool

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

_UNITS = {"bytes": 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


class KVCacheManager:
    """Block ids for an engine's KV cache whose memory follows the blocks in use.

    Args:
        num_blocks: blocks the engine addresses; ids are in ``[0, num_blocks)``.
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
        self.num_blocks = _check_positive("num_blocks", num_blocks)
        self.block_size = _check_positive("block_size", block_size)
        self.cell_size = _check_positive("cell_size", cell_size)
        self.num_layers = _check_positive("num_layers", num_layers)
        self.num_kv_buffers = _check_positive("num_kv_buffers", num_kv_buffers)
        self.block_mem_size = self.block_size * self.cell_size  # bytes of one block of one buffer
        self.pool = KVPool(
            num_layers=self.num_layers,
            block_bytes=self.block_mem_size,
            num_buffers=self.num_kv_buffers,
            num_blocks=self.num_blocks,
            layout=layout,
            page_bytes=page_bytes,
            device=device,
            zero_backing=zero_backing,
            limit_bytes=limit_bytes,
            null_block=reserve_null_block,
            budget=budget,
            background_worker=background_worker,
            name=name,
        )
        self.reserve_null_block = reserve_null_block
        self._lock = threading.Lock()
        # The pool rounds capacity up to whole pages; ids past num_blocks exist
        # there but not in the engine's tables. When the pool hands one out it
        # is parked here (kept allocated, never given to the caller).
        self._tail_blocks = self.pool.num_blocks - self.num_blocks
        self._parked: list[int] = []
        self._in_use = np.zeros(self.num_blocks, dtype=bool)  # ids handed to the caller
        self._num_used = 0
        self._reserved: list[int] = []

    # ---- the reference's API ---------------------------------------------------------

    def alloc(self, need_size: int) -> Optional[list[int]]:
        """``need_size`` block ids, or ``None`` when there is not enough memory.

        Never partial: on ``None`` nothing was allocated.
        """
        if isinstance(need_size, bool) or not isinstance(need_size, (int, np.integer)):
            raise TypeError(f"need_size must be an int, got {type(need_size).__name__}")
        if need_size < 0:
            raise ValueError(f"need_size must not be negative, got {need_size}")
        if need_size == 0:
            return []
        with self._lock:
            if need_size > self._available_locked():
                return None
            try:
                ids = self.pool.alloc(int(need_size))
                if self._tail_blocks and ids.max() >= self.num_blocks:
                    ids = self._replace_tail_ids_locked(ids)
            except OutOfMemoryError:
                return None
            self._in_use[ids] = True
            self._num_used += len(ids)
            return ids.tolist()

    def _replace_tail_ids_locked(self, ids: np.ndarray) -> np.ndarray:
        """Park ids past ``num_blocks`` and allocate replacements (all or nothing)."""
        good, tail = ids[ids < self.num_blocks], ids[ids >= self.num_blocks]
        try:
            while tail.size:
                self._parked.extend(tail.tolist())
                more = self.pool.alloc(int(tail.size))
                good = np.concatenate([good, more[more < self.num_blocks]])
                tail = more[more >= self.num_blocks]
        except BaseException:
            if good.size:
                self.pool.free(good)
            raise
        return good

    def free(self, indices: Iterable[int]) -> None:
        """Give block ids back. Unknown, repeated or already-free ids raise
        ValueError and free nothing."""
        ids = self._as_ids(indices)
        if ids.size == 0:
            return
        with self._lock:
            self.pool.free(ids)
            self._in_use[ids] = False
            self._num_used -= len(ids)

    def try_to_reserve(self, need_size: int) -> bool:
        """Allocate ``need_size`` blocks and hold them until :meth:`free_reserved`."""
        ids = self.alloc(need_size)
        if ids is None:
            return False
        self._reserved.extend(ids)
        return True

    def free_reserved(self) -> None:
        """Free the blocks taken by :meth:`try_to_reserve`."""
        reserved, self._reserved = self._reserved, []
        if reserved:
            self.free(reserved)

    def available_size(self) -> int:
        """Blocks :meth:`alloc` could return right now (within limits and memory)."""
        with self._lock:
            return self._available_locked()

    def _available_locked(self) -> int:
        pool_available = self.pool.available()
        unparked_tail = self._tail_blocks - len(self._parked)
        # Free tail ids count in the pool's figure once their page is mapped;
        # before that the pool would fill every lower page first.
        if unparked_tail and self.pool.space.is_mapped(self.pool.space.num_pages - 1):
            pool_available -= unparked_tail
        engine_free = self.num_blocks - self._num_used - int(self.reserve_null_block)
        return max(0, min(pool_available, engine_free))

    def get_mapped_memory_size(self, unit: str = "bytes") -> float:
        """Physical memory mapped for this cache, in ``unit`` (bytes, kb, mb, gb)."""
        try:
            scale = _UNITS[unit.lower()]
        except KeyError:
            raise ValueError(f"unit must be one of {sorted(_UNITS)}, got {unit!r}") from None
        mapped = self.pool.stats()["mapped_bytes"]
        return mapped if scale == 1 else mapped / scale

    def resize(self, new_mem_size: Optional[int]) -> bool:
        """Limit each layer's K (or V) buffer to ``new_mem_size`` bytes (None: no limit).

        A limit below current use is accepted: memory is given back as blocks
        are freed. Returns True (the reference's signature).
        """
        if new_mem_size is None:
            self.pool.resize(None)
            return True
        if isinstance(new_mem_size, bool) or not isinstance(new_mem_size, (int, np.integer)):
            raise TypeError(f"new_mem_size must be an int or None, got {type(new_mem_size).__name__}")
        if new_mem_size < 0:
            raise ValueError(f"new_mem_size must not be negative, got {new_mem_size}")
        self.pool.resize(int(new_mem_size) * self.num_layers * self.num_kv_buffers)
        return True

    def trim(self) -> None:
        """Give back every mapped page that holds no block in use."""
        self.pool.trim()

    def clear(self) -> None:
        """Free every block handed out (the null block stays reserved)."""
        with self._lock:
            ids = np.flatnonzero(self._in_use)
            if ids.size:
                self.pool.free(ids)
            self._in_use[:] = False
            self._num_used = 0
            self._reserved = []

    # ---- tensors and lifetime -----------------------------------------------------------

    def get_kv_tensors(self, dtype: Optional["torch.dtype"] = None) -> list["torch.Tensor"]:
        """Per layer ``(num_kv_buffers, num_blocks, block_size, cell_size / itemsize)`` views.

        ``dtype`` defaults to bytes (torch.uint8); its size must divide
        ``cell_size``. The views share memory with the cache and stay valid
        (reading zeros) after :meth:`close`.
        """
        import torch

        from kvcached.geometry import strided_bytes_view

        dtype = torch.uint8 if dtype is None else dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        if self.cell_size % itemsize:
            raise ValueError(f"cell_size {self.cell_size} is not a multiple of {dtype}'s {itemsize} bytes")
        space = self.pool.space
        flat = torch.from_dlpack(space.tensor())
        shape = [self.num_kv_buffers, self.num_blocks, self.block_size, self.cell_size // itemsize]
        strides = [space.buffer_stride_bytes, space.block_stride_bytes, self.cell_size, itemsize]
        return [
            strided_bytes_view(flat, shape=shape, strides_bytes=strides, dtype=dtype,
                               offset_bytes=layer * space.layer_stride_bytes)
            for layer in range(self.num_layers)
        ]

    def stats(self) -> dict:
        """The pool's counters plus ``parked_blocks`` (pool ids past num_blocks held back)."""
        stats = self.pool.stats()
        stats["parked_blocks"] = len(self._parked)
        return stats

    def close(self) -> None:
        """Release all memory; live tensors then read zeros. Idempotent."""
        self.pool.close()

    def __enter__(self) -> "KVCacheManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _as_ids(self, indices: Iterable[int]) -> np.ndarray:
        if hasattr(indices, "__dlpack__") and not isinstance(indices, np.ndarray):
            indices = np.from_dlpack(indices.cpu() if hasattr(indices, "cpu") else indices)
        ids = np.asarray(indices if isinstance(indices, np.ndarray) else list(indices))
        if ids.size == 0:
            return ids.astype(np.int64).reshape(0)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise TypeError(f"block ids must be a flat sequence of ints, got {ids.dtype} of shape {ids.shape}")
        ids = ids.astype(np.int64, copy=False)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.num_blocks:
            bad = low if low < 0 else high
            raise ValueError(f"block id {bad} is outside [0, {self.num_blocks})")
        return np.ascontiguousarray(ids)


__all__ = ["KVCacheManager"]
