"""Kernel- and engine-shaped views: every shape addresses the same bytes the KV space's strides say."""

from __future__ import annotations

import pytest

import kvcached
from kvcached import _core, tensor_views
from kvcached.integration.sglang.token_views import sglang_views

torch = pytest.importorskip("torch")

NUM_LAYERS = 3
HEADS, HEAD_DIM, BLOCK_SIZE = 2, 8, 16
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn]


def make_pool(layout: str, dtype, num_buffers: int = 2) -> kvcached.KVPool:
    itemsize = torch.empty((), dtype=dtype).element_size()
    block_bytes = BLOCK_SIZE * HEADS * HEAD_DIM * itemsize * (2 if num_buffers == 1 else 1)
    page_bytes = max(4096, block_bytes * 4)
    return kvcached.KVPool(
        NUM_LAYERS,
        block_bytes,
        num_buffers=num_buffers,
        num_blocks=16,
        page_bytes=page_bytes,
        layout=layout,
        device=_core.open_host_device(64 << 20),
        background_worker=False,
    )


def raw_bytes(pool, layer: int, buffer: int, block: int, start: int, size: int) -> bytes:
    flat = torch.from_dlpack(pool.tensor())
    offset = pool.space.offset_of(layer, buffer, block) + start
    return bytes(flat[offset : offset + size].numpy().tobytes())


@pytest.mark.parametrize("layout", ["per_layer", "contiguous"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["flash_attn", "flashinfer"])
def test_kv_views_write_where_the_space_says(layout, dtype, style):
    with make_pool(layout, dtype) as pool:
        views = getattr(tensor_views, f"{style}_views")(pool, num_heads=HEADS, head_dim=HEAD_DIM, dtype=dtype)
        assert len(views) == NUM_LAYERS
        block = int(pool.alloc(3)[2])
        token, head = 5, 1
        value = torch.arange(HEAD_DIM, dtype=torch.float32).to(dtype)
        layer, kv = 2, 1
        cell = views[layer][kv, block] if style == "flash_attn" else views[layer][block, kv]
        assert tuple(cell.shape) == (BLOCK_SIZE, HEADS, HEAD_DIM)
        cell[token, head] = value
        itemsize = value.element_size()
        start = (token * HEADS + head) * HEAD_DIM * itemsize
        assert (
            raw_bytes(pool, layer, kv, block, start, HEAD_DIM * itemsize) == value.view(torch.uint8).numpy().tobytes()
        )
        total = views[layer].view(torch.uint8) if dtype == torch.uint8 else views[layer].float()
        assert int(total.count_nonzero()) == HEAD_DIM - 1  # nothing else was touched


@pytest.mark.parametrize("layout", ["per_layer", "contiguous"])
def test_kv_cells_of_one_buffer_split_into_k_then_v(layout):
    with make_pool(layout, torch.float16, num_buffers=1) as pool:
        fa = tensor_views.flash_attn_views(pool, num_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float16)
        fi = tensor_views.flashinfer_views(pool, num_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float16)
        block = int(pool.alloc(1)[0])
        fa[1][1, block, 0, 0, 0] = 7.0  # V's first element sits half a block in
        assert fi[1][block, 1, 0, 0, 0] == 7.0
        half = pool.space.block_bytes // 2
        assert (
            raw_bytes(pool, 1, 0, block, half, 2)
            == torch.tensor([7.0], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
        )


@pytest.mark.parametrize("layout", ["per_layer", "contiguous"])
def test_mla_views(layout):
    dim = 64
    pool = kvcached.KVPool(
        NUM_LAYERS,
        BLOCK_SIZE * dim * 2,
        num_buffers=1,
        num_blocks=8,
        page_bytes=16 << 10,
        layout=layout,
        device=_core.open_host_device(64 << 20),
        background_worker=False,
    )
    views = tensor_views.mla_views(pool, dim=dim, dtype=torch.bfloat16)
    assert tuple(views[0].shape) == (pool.num_blocks, BLOCK_SIZE, dim)
    block = int(pool.alloc(2)[1])
    views[2][block, 3, 4] = 1.5
    assert (
        raw_bytes(pool, 2, 0, block, (3 * dim + 4) * 2, 2)
        == torch.tensor([1.5], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    )
    pool.close()
    with make_pool("per_layer", torch.float16) as two_buffers, pytest.raises(ValueError, match="num_buffers=1"):
        tensor_views.mla_views(two_buffers, dim=dim, dtype=torch.bfloat16)


def test_sglang_views_index_tokens_across_blocks():
    with make_pool("per_layer", torch.float16) as pool:
        views = sglang_views(pool, num_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float16)
        k, v = views[1]
        assert tuple(k.shape) == (pool.num_blocks * BLOCK_SIZE, HEADS, HEAD_DIM)
        block = int(pool.alloc(2)[1])
        token = block * BLOCK_SIZE + 3
        v[token, 1, 2] = 4.0
        fa = tensor_views.flash_attn_views(pool, num_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float16)
        assert fa[1][1, block, 3, 1, 2] == 4.0 and k[token].abs().sum() == 0


def test_sglang_views_need_the_per_layer_layout():
    with make_pool("contiguous", torch.float16) as pool, pytest.raises(ValueError, match="per_layer"):
        sglang_views(pool, num_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float16)


def test_layer_views_of_a_caller_given_geometry():
    flat = torch.zeros(4096, dtype=torch.uint8)
    views = tensor_views.layer_views(
        flat,
        num_layers=2,
        num_blocks=4,
        block_shape=(2, 3),
        dtype=torch.float16,
        layer_stride_bytes=1024,
        block_stride_bytes=64,
        offset_bytes=128,
    )
    assert [tuple(v.shape) for v in views] == [(4, 2, 3)] * 2
    views[1][2, 1, 0] = 1.0
    start = 128 + 1024 + 2 * 64 + 3 * 2
    assert flat[start : start + 2].tolist() == list(torch.tensor([1.0], dtype=torch.float16).view(torch.uint8).tolist())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_stride_bytes=63), "not a multiple of the 2-byte size"),
        (dict(offset_bytes=1), "not a multiple of the 2-byte size"),
        (dict(layer_stride_bytes=4096), "past the buffer"),
        (dict(block_shape=(64, 3)), "blocks would overlap"),
        (dict(num_layers=0), "must be positive"),
    ],
)
def test_layer_views_refuse_bad_geometry(kwargs, message):
    options = dict(
        num_layers=2,
        num_blocks=4,
        block_shape=(2, 3),
        dtype=torch.float16,
        layer_stride_bytes=1024,
        block_stride_bytes=64,
    )
    options.update(kwargs)
    with pytest.raises(ValueError, match=message):
        tensor_views.layer_views(torch.zeros(4096, dtype=torch.uint8), **options)


def test_a_block_that_holds_no_whole_token_is_refused():
    with make_pool("per_layer", torch.float16) as pool, pytest.raises(ValueError, match="whole number of tokens"):
        tensor_views.flash_attn_views(pool, num_heads=3, head_dim=HEAD_DIM, dtype=torch.float16)


def test_views_keep_the_memory_alive_and_read_zeros_after_close():
    pool = make_pool("per_layer", torch.float16)
    views = tensor_views.flash_attn_views(pool, num_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.float16)
    block = int(pool.alloc(1)[0])
    views[0][0, block] = 2.0
    pool.close()
    del pool
    assert views[0].abs().sum() == 0


def test_the_published_kvcached_geometry_names_are_the_tensor_views():
    """``kvcached.geometry.flash_attn_views`` (the README's example) stays the same function."""
    from kvcached import geometry

    for name in geometry.__all__:
        assert getattr(geometry, name) is getattr(tensor_views, name)
    assert "flash_attn_views" in geometry.__all__ and kvcached.geometry is geometry
