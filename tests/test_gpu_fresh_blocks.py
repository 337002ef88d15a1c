"""On a real GPU: a kernel launched right after a block is handed out sees that block's memory.

On gfx1201 / ROCm 7.2.1 a kernel launched right after hipMemMap + hipMemSetAccess
read zeros and lost its stores (ROCm/rocm-systems#11693); kvcached fences new
mappings before handing blocks out. Here every step takes blocks on pages never
mapped before (no background worker, so the pool maps them inside alloc) and at
once fills them with a torch kernel, then checks them with another.
"""

from __future__ import annotations

import pytest

import kvcached

pytestmark = pytest.mark.gpu

LAYERS, BLOCK_BYTES, STEPS = 4, 64 << 10, 32


@pytest.mark.parametrize("layout", ["per_layer", "contiguous"])
def test_kernels_see_blocks_as_soon_as_they_are_handed_out(layout):
    torch = pytest.importorskip("torch")
    spec = kvcached.default_device()
    pool = kvcached.KVPool(
        LAYERS,
        BLOCK_BYTES,
        capacity_bytes=2 << 30,
        device=spec,
        layout=layout,
        zero_backing=True,
        background_worker=False,
        register=False,
    )
    space = pool.space
    flat = torch.from_dlpack(pool.tensor())
    wrong, held = [], []
    for step in range(STEPS):
        blocks = pool.alloc(space.blocks_per_page)  # a page that was never mapped
        held.append(blocks)
        views = []
        for layer in range(LAYERS):
            for buffer in range(2):
                offset = space.offset_of(layer, buffer, int(blocks[0]))
                view = flat[offset : offset + BLOCK_BYTES]
                view.fill_(step + 1)  # the first kernel on the fresh mapping
                views.append(view)
        for index, view in enumerate(views):
            if not bool(torch.all(view == step + 1)):
                wrong.append((step, index))
    torch.cuda.synchronize()
    for blocks in held:
        pool.free(blocks)
    del flat
    pool.close()
    assert wrong == [], f"blocks whose first kernel's writes were lost: {wrong}"
