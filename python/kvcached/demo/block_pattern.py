"""The demo's data check: per-block values written into a pool and read back.

On the host backend the view is a NumPy array (the demo then needs nothing but
kvcached and NumPy); on a GPU it is a torch tensor, so the values are written and
read on the device.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcached.errors import InvalidArgumentError

WORD_BYTES = 8  # the pattern is written as int64 words
HOST_DEVICES = ("cpu", "host")


def needs_torch(device: str) -> bool:
    """Whether checking blocks on ``device`` takes torch (every device but the host)."""
    return device.strip().lower() not in HOST_DEVICES


def _strides_in_words(space: Any) -> tuple[int, ...]:
    """The ``[layer, buffer, block, word]`` strides of ``space``, checked on the corners."""
    if space.block_stride_bytes % WORD_BYTES or space.block_bytes % WORD_BYTES:
        raise InvalidArgumentError("block sizes must be multiples of 8 bytes for the demo's pattern")
    # The view is only right for a layout with uniform strides; prove it on the corners.
    for layer in (0, space.num_layers - 1):
        for buffer in (0, space.num_buffers - 1):
            for block in (0, space.num_blocks - 1):
                expected = layer * space.layer_stride_bytes + buffer * space.buffer_stride_bytes
                expected += block * space.block_stride_bytes
                if space.offset_of(layer, buffer, block) != expected:
                    raise InvalidArgumentError(f"layout {space.layout!r} has no uniform block stride; use per_layer")
    strides = (space.layer_stride_bytes, space.buffer_stride_bytes, space.block_stride_bytes)
    return tuple(stride // WORD_BYTES for stride in strides) + (1,)


class BlockPattern:
    """Writes and checks per-block values through a strided view of the pool.

    The view is ``[layer, buffer, block, word]`` over the pool's flat byte
    tensor, so a block id addresses its bytes in every layer and buffer at once.
    """

    def __init__(self, pool: Any) -> None:
        space = pool.space
        shape = (space.num_layers, space.num_buffers, space.num_blocks, space.block_bytes // WORD_BYTES)
        strides = _strides_in_words(space)
        self._torch: Any = None
        if needs_torch(pool.device.name):
            import torch

            self._torch = torch
            words = torch.from_dlpack(pool.tensor()).view(torch.int64)
            self.kv = words.as_strided(shape, strides)
        else:
            words = np.from_dlpack(pool.tensor()).view(np.int64)
            self.kv = np.lib.stride_tricks.as_strided(
                words, shape, tuple(stride * WORD_BYTES for stride in strides), writeable=True
            )

    def _as_view(self, ids: list[int], values: np.ndarray) -> tuple[Any, Any]:
        """Block indices and the expected values, shaped to broadcast over the view."""
        if self._torch is None:
            return np.asarray(ids, dtype=np.int64), values.reshape(1, 1, -1, 1)
        torch, device = self._torch, self.kv.device
        index = torch.tensor(ids, dtype=torch.int64, device=device)
        return index, torch.from_numpy(values).to(device).view(1, 1, -1, 1)

    def write(self, ids: list[int], values: np.ndarray) -> None:
        """Fills every word of block ``ids[i]`` (all layers, buffers) with ``values[i]``."""
        index, expected = self._as_view(ids, values)
        self.kv[:, :, index, :] = expected

    def count_mismatches(self, ids: list[int], values: np.ndarray) -> int:
        """How many of ``ids`` do not hold their value everywhere."""
        index, expected = self._as_view(ids, values)
        wrong = self.kv[:, :, index, :] != expected
        if self._torch is None:
            return int(wrong.any(axis=(0, 1, 3)).sum())
        return int(wrong.any(dim=3).any(dim=1).any(dim=0).sum().item())


__all__ = ["WORD_BYTES", "BlockPattern", "needs_torch"]
