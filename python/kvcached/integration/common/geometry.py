"""An engine's KV cache in kvcached's terms: one value for the block manager and the KV space(s).

Engines describe their KV memory as blocks (vLLM) or token pages (SGLang) of
some bytes per layer and buffer; kvcached maps it in pages of ``page_bytes``
per layer and buffer. :class:`KVGeometry` carries the numbers both sides of an
integration must agree on, and is the one place that turns them into the core
constructors' arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LAYOUTS = ("per_layer", "contiguous")


@dataclass(frozen=True)
class KVGeometry:
    """Blocks of ``block_bytes`` in each of ``num_layers`` x ``num_buffers`` arrays.

    ``num_blocks`` counts the block ids the engine addresses; kvcached rounds
    its space up to whole pages, and the ids past ``num_blocks`` are never
    handed to the engine (see :class:`~kvcached.integration.common.blocks.EngineBlocks`).
    """

    num_blocks: int
    block_bytes: int
    num_layers: int
    num_buffers: int
    page_bytes: int
    layout: str = "per_layer"

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_bytes", "num_layers", "page_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVGeometry.{name} must be positive, got {getattr(self, name)}")
        if self.num_buffers not in (1, 2):
            raise ValueError(f"KVGeometry.num_buffers must be 1 or 2, got {self.num_buffers}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"KVGeometry.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.page_bytes % self.block_bytes:
            raise ValueError(
                f"a {self.page_bytes}-byte page does not hold a whole number of "
                f"{self.block_bytes}-byte blocks; choose KVCACHED_PAGE_BYTES as a multiple"
            )

    @property
    def blocks_per_page(self) -> int:
        return self.page_bytes // self.block_bytes

    @property
    def block_id_bytes(self) -> int:
        """Physical bytes behind one block id (every layer and buffer)."""
        return self.block_bytes * self.num_layers * self.num_buffers

    def core_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`kvcached.KVPool`, ``BlockManager`` and ``KVSpace``.

        The one place that spells the core constructors' geometry arguments.
        """
        return dict(
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            num_layers=self.num_layers,
            num_buffers=self.num_buffers,
            layout=self.layout,
            page_bytes=self.page_bytes,
        )


__all__ = ["KVGeometry", "LAYOUTS"]
