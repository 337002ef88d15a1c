"""``kvcached.geometry``: the name the kernel-shaped views were first published under.

The views live in :mod:`kvcached.tensor_views`; this module keeps
``kvcached.geometry.flash_attn_views(...)`` and its siblings working.
"""

from __future__ import annotations

from kvcached.tensor_views import flash_attn_views, flashinfer_views, layer_views, mla_views, strided_bytes_view

__all__ = ["flash_attn_views", "flashinfer_views", "layer_views", "mla_views", "strided_bytes_view"]
