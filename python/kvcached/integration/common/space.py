"""The tensor side of an integration in a process that holds KV tensors but does not decide blocks.

When an engine decides blocks in one process and keeps its KV tensors in
others (vLLM's EngineCore and workers; tensor-parallel ranks; pipeline
stages), each rank's process owns a :class:`WorkerSpace`: a kvcached KV space
laid out by that rank's :class:`kvcached.KVLayout` (a pipeline stage: only its
layers), applying the deciding side's page-op batches in order, and
acknowledging each on the :class:`~kvcached.integration.common.acks.AckBoard`.
Applying a batch synchronises the device before it unmaps (the core's fence),
so pages a kernel may still read are never unmapped under it. An unmap
releases its memory at once (no spare allocations kept): the deciding side
gives a page back to this rank's budget once the rank acknowledges the unmap,
so memory kept here would be memory the budget no longer counts.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from kvcached.configured import space_options
from kvcached.integration.common.acks import AckBoard
from kvcached.layout import KVLayout


class WorkerSpace:
    """Rank ``rank``'s KV space, mirroring an engine's block decisions in this process.

    Args:
        layout: this rank's layout.
        device: the kvcached device ("cpu", "cuda:0", "hip:1").
        rank: its index among the engine's ranks (its slot on the board).
        board: where it acknowledges (None: the caller acknowledges).
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        device: str,
        rank: int = 0,
        board: Optional[AckBoard] = None,
        zero_backing: bool = True,
    ) -> None:
        from kvcached.pool import KVSpace

        self.rank = rank
        self.board = board
        self.space = KVSpace(layout, device, space_options(zero_backing=zero_backing, max_spare_pages=0))

    def flat_bytes(self) -> Any:
        """The whole reservation as a flat torch uint8 tensor (keeps it alive)."""
        import torch

        return torch.from_dlpack(self.space.tensor())

    def apply(self, ops: Any) -> int:
        """Applies one :class:`kvcached.PageOps` batch (in order) and acknowledges it; returns its seq."""
        seq = int(self.space.apply(ops))
        if self.board is not None:
            self.board.publish(self.rank, seq)
        return seq

    def stats(self) -> dict[str, Any]:
        """What this rank has mapped, in this process."""
        mapped_pages = int(self.space.mapped_pages)
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "device": self.space.device.name,
            "mapped_pages": mapped_pages,
            "mapped_bytes": mapped_pages * self.space.page_id_bytes,
            "spare_pages": int(self.space.spare_pages),  # always 0: unmapped memory is released at once
            "applied_seq": int(self.space.applied_seq),
        }

    def close(self) -> None:
        """Unmaps everything (live tensors then read zeros). Idempotent."""
        self.space.close()
        if self.board is not None:
            self.board.close()


__all__ = ["WorkerSpace"]
