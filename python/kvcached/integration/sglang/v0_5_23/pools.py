"""SGLang 0.5.23's KV pools with their buffers as views of a kvcached KV space."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

from kvcached.errors import IntegrationError
from kvcached.integration.common.engine_layout import engine_layout
from kvcached.integration.sglang.token_views import sglang_views
from kvcached.tensor_views import strided_bytes_view

from .plan import require_plan


class KvcachedMHATokenToKVPool(MHATokenToKVPool):
    """``MHATokenToKVPool`` whose per-layer K and V buffers are kvcached views (NHD)."""

    def _create_buffers_normal(self) -> None:
        if self.kv_cache_layout != "nhd":
            raise IntegrationError(f"kvcached backs only SGLang's NHD KV layout, not {self.kv_cache_layout!r}")
        plan = require_plan(self)
        rows = self.size + self.page_size  # slot 0's page pads dummy writes
        item = torch.empty((), dtype=self.store_dtype).element_size()
        layout = engine_layout(
            num_blocks=-(-rows // self.page_size),
            block_bytes=self.page_size * self.head_num * self.head_dim * item,
            num_layers=self.layer_num,
            num_buffers=2,
            page_bytes=plan.settings.page_bytes,
        )
        self.kvcached_blocks = plan.open_blocks(layout)
        views = sglang_views(
            self.kvcached_blocks.space, num_heads=self.head_num, head_dim=self.head_dim, dtype=self.store_dtype
        )
        self.k_buffer = [k[:rows] for k, _ in views]
        self.v_buffer = [v[:rows] for _, v in views]


class KvcachedMLATokenToKVPool(MLATokenToKVPool):
    """``MLATokenToKVPool`` whose per-layer latent buffers are kvcached views."""

    def _create_buffers(self) -> None:
        if self.use_dsa or self.kv_cache_dim != self.kv_lora_rank + self.qk_rope_head_dim:
            raise IntegrationError("kvcached backs only plain MLA pools (no DSA, no packed FP8 rows)")
        plan = require_plan(self)
        rows = self.size + self.page_size
        item = torch.empty((), dtype=self.store_dtype).element_size()
        row_bytes = self.kv_cache_dim * item
        layout = engine_layout(
            num_blocks=-(-rows // self.page_size),
            block_bytes=self.page_size * row_bytes,
            num_layers=self.layer_num,
            num_buffers=1,
            page_bytes=plan.settings.page_bytes,
        )
        self.kvcached_blocks = plan.open_blocks(layout)
        space = self.kvcached_blocks.space
        flat = torch.from_dlpack(space.tensor())
        self.kv_buffer = [
            strided_bytes_view(
                flat,
                shape=[rows, 1, self.kv_cache_dim],
                strides_bytes=[row_bytes, row_bytes, item],
                dtype=self.store_dtype,
                offset_bytes=layer * space.layer_stride_bytes,
            )
            for layer in range(self.layer_num)
        ]
