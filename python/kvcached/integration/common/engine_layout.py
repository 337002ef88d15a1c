"""An engine's KV cache as one :class:`kvcached.KVLayout`: the value both sides of an integration share.

Engines describe their KV memory as blocks (vLLM) or token pages (SGLang) of
some bytes per layer and buffer; kvcached maps it in pages of ``page_bytes``
per layer and buffer. The integrations do not keep a geometry type of their
own: the core's immutable, picklable ``KVLayout`` is the one value the
deciding side (block manager) and every tensor side (KV spaces, one per rank
or pipeline stage) are built from. This module only derives it from an
engine's numbers.
"""

from __future__ import annotations

import math

from kvcached.errors import InvalidArgumentError
from kvcached.layout import KVLayout


def engine_page_bytes(page_bytes: int, block_bytes: int) -> int:
    """``page_bytes`` grown to the least common multiple with ``block_bytes``, so
    a page holds whole blocks (and stays a multiple of the device granularity)."""
    if page_bytes <= 0 or block_bytes <= 0:
        raise InvalidArgumentError(f"page and block sizes must be positive, got {page_bytes} and {block_bytes}")
    return page_bytes * block_bytes // math.gcd(page_bytes, block_bytes)


def engine_layout(
    *,
    num_blocks: int,
    block_bytes: int,
    num_layers: int,
    num_buffers: int,
    page_bytes: int,
    kind: str = "per_layer",
) -> KVLayout:
    """The layout of an engine's ``num_blocks`` block ids of ``block_bytes`` per layer and buffer.

    ``num_blocks`` is exact (the last page may hold fewer blocks); the page
    grows to hold whole blocks (:func:`engine_page_bytes`). The core checks the
    rest and raises ValueError with the reason.
    """
    return KVLayout(
        num_layers,
        block_bytes,
        num_blocks,
        num_buffers=num_buffers,
        page_bytes=engine_page_bytes(page_bytes, block_bytes),
        kind=kind,
    )


def stage_layout(layout: KVLayout, num_layers: int) -> KVLayout:
    """A pipeline stage's layout: the same block ids and pages, only its ``num_layers`` layers."""
    return KVLayout(
        num_layers,
        layout.block_bytes,
        layout.num_blocks,
        num_buffers=layout.num_buffers,
        page_bytes=layout.page_bytes,
        kind=layout.kind,
    )


__all__ = ["engine_layout", "engine_page_bytes", "stage_layout"]
