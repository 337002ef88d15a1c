"""The tensor side of an integration in a process that holds KV tensors but does not decide blocks.

When an engine decides blocks in one process and keeps its KV tensors in
others (vLLM's EngineCore and workers; tensor-parallel ranks), each tensor
process owns a :class:`WorkerSpace`: a kvcached KV space laid out like the
deciding side's :class:`~kvcached.integration.common.geometry.KVGeometry`,
applying the page-op batches that side emits, in order. Applying a batch
synchronises the device before it unmaps (the core's fence), so pages a kernel
may still read are never unmapped under it.
"""

from __future__ import annotations

import os
from typing import Any

from kvcached.integration.common.blocks import WireOps
from kvcached.integration.common.geometry import KVGeometry


class WorkerSpace:
    """A KV space mirroring an engine's block decisions in this process."""

    def __init__(self, geometry: KVGeometry, *, device: str, zero_backing: bool = True) -> None:
        from kvcached.pool import KVSpace

        self.geometry = geometry
        self.space = KVSpace(**geometry.core_kwargs(), device=device, zero_backing=zero_backing)
        self.applied_seq = 0

    def flat_bytes(self) -> Any:
        """The whole reservation as a flat torch uint8 tensor (keeps it alive)."""
        import torch

        return torch.from_dlpack(self.space.tensor())

    def apply(self, ops: WireOps) -> int:
        """Applies one ``(seq, map_pages, unmap_pages)`` batch; returns the seq to acknowledge."""
        from kvcached.pool import PageOps

        batch = PageOps()
        batch.seq, batch.map_pages, batch.unmap_pages = ops
        self.applied_seq = int(self.space.apply(batch))
        return self.applied_seq

    def stats(self) -> dict[str, Any]:
        mapped_pages = int(self.space.mapped_pages)
        return {
            "pid": os.getpid(),
            "mapped_pages": mapped_pages,
            "mapped_bytes": mapped_pages * self.space.page_id_bytes,
            "applied_seq": self.applied_seq,
        }

    def close(self) -> None:
        """Unmaps everything; live tensors then read zeros. Idempotent."""
        self.space.close()


__all__ = ["WorkerSpace"]
