"""The values a KV cache is built from: KVLayout and the options, checked once, immutable, picklable."""

from __future__ import annotations

import pickle

import pytest

import kvcached
from kvcached import _core

PAGE_BYTES = 16 << 10


def test_a_layout_knows_its_geometry_and_a_partial_last_page():
    layout = kvcached.KVLayout(2, 4 << 10, 30, page_bytes=PAGE_BYTES, kind="per_layer")
    assert (layout.num_pages, layout.blocks_per_page, layout.num_blocks) == (8, 4, 30)
    assert [layout.blocks_on_page(p) for p in (0, 6, 7, 8)] == [4, 4, 2, 0]
    assert layout.page_id_bytes == 2 * 2 * PAGE_BYTES and layout.block_id_bytes == 2 * 2 * (4 << 10)
    assert layout.kind == "per_layer" and layout.as_dict()["num_blocks"] == 30
    with pytest.raises(ValueError, match="outside the layout"):
        layout.offset_of(0, 0, 30)


def test_a_layout_takes_explicit_values_and_from_config_fills_the_rest(monkeypatch):
    with pytest.raises(TypeError):
        kvcached.KVLayout(2, 4 << 10, 30)  # no page size, no kind: nothing is read from anywhere
    monkeypatch.delenv("KVCACHED_LAYOUT", raising=False)
    monkeypatch.setenv("KVCACHED_PAGE_BYTES", str(PAGE_BYTES))
    filled = kvcached.KVLayout.from_config(2, 4 << 10, 30)
    assert filled == kvcached.KVLayout(2, 4 << 10, 30, page_bytes=PAGE_BYTES, kind="contiguous")  # no device: host's
    assert type(filled) is kvcached.KVLayout
    monkeypatch.setenv("KVCACHED_LAYOUT", "per_layer")
    monkeypatch.setenv("KVCACHED_VIRTUAL_CAPACITY_BYTES", str(8 * 2 * 2 * PAGE_BYTES))
    assert kvcached.KVLayout.from_config(2, 4 << 10).as_dict() == dict(
        num_layers=2, num_buffers=2, block_bytes=4 << 10, page_bytes=PAGE_BYTES, num_blocks=32, kind="per_layer"
    )
    assert kvcached.KVLayout.from_config(2, 4 << 10, 30, kind="contiguous", page_bytes=2 * PAGE_BYTES).kind == (
        "contiguous"
    ), "what the caller gives wins"


def test_for_capacity_holds_whole_pages():
    layout = _core.KVLayout.for_capacity(2, 4 << 10, 10 * 4 * PAGE_BYTES + 1, PAGE_BYTES)
    assert layout.num_pages == 10 and layout.num_blocks == 40
    with pytest.raises(ValueError, match="smaller than one page id"):
        _core.KVLayout.for_capacity(2, 4 << 10, 100, PAGE_BYTES)


@pytest.mark.parametrize(
    "args, error, message",
    [
        (dict(num_layers=-1), ValueError, "num_layers must be positive, got -1"),
        (dict(num_layers=0), ValueError, "num_layers must be positive"),
        (dict(num_layers=2.0), TypeError, "num_layers must be an integer"),
        (dict(num_layers=True), TypeError, "num_layers must be an integer"),
        (dict(num_blocks=10**30), ValueError, "num_blocks=.* is too large"),
        (dict(num_layers=1 << 40), ValueError, "too large"),
        (dict(num_buffers=3), ValueError, "num_buffers must be 1"),
        (dict(block_bytes=3000), ValueError, "would work"),
        (dict(kind="diagonal"), ValueError, "per_layer"),
    ],
)
def test_bad_layouts_are_refused_with_the_reason(args, error, message):
    values = dict(num_layers=2, block_bytes=4 << 10, num_blocks=30, page_bytes=PAGE_BYTES)
    values.update(args)
    with pytest.raises(error, match=message):
        _core.KVLayout(**values)


def test_values_compare_hash_and_pickle():
    layout = kvcached.KVLayout(2, 4 << 10, 30, page_bytes=PAGE_BYTES, kind="contiguous")
    again = pickle.loads(pickle.dumps(layout))
    assert again == layout and hash(again) == hash(layout) and len({layout, again}) == 1
    assert layout != kvcached.KVLayout(2, 4 << 10, 31, page_bytes=PAGE_BYTES, kind="contiguous")
    options = kvcached.BlockManagerOptions(
        null_block=True, limit_bytes=1 << 20, min_free_pages=1, max_free_pages=3, placement="fullest_first"
    )
    assert pickle.loads(pickle.dumps(options)) == options != kvcached.BlockManagerOptions()
    space_options = kvcached.KVSpaceOptions(zero_backing=False, max_spare_pages=2)
    assert pickle.loads(pickle.dumps(space_options)) == space_options


def test_options_are_checked_once():
    with pytest.raises(ValueError, match="minimums must not exceed"):
        kvcached.BlockManagerOptions(min_free_pages=3, max_free_pages=2)
    with pytest.raises(ValueError, match="must not be negative"):
        kvcached.BlockManagerOptions(limit_bytes=-1)
    with pytest.raises(ValueError, match="fewest_pages"):
        kvcached.BlockManagerOptions(placement="random")


def test_one_layout_value_is_shared_by_the_space_and_the_manager(host_device):
    layout = kvcached.KVLayout(2, 4 << 10, 30, page_bytes=PAGE_BYTES, kind="contiguous")
    with kvcached.KVPool(kv_layout=layout, device=host_device, background_worker=False) as pool:
        assert pool.kv_layout == layout == pool.space.kv_layout
        assert pool.num_blocks == 30 and pool.space.num_blocks == 30
    other = kvcached.KVLayout(2, 4 << 10, 32, page_bytes=PAGE_BYTES, kind="contiguous")
    space = kvcached.KVSpace(other, host_device)
    with pytest.raises(ValueError, match="differs"):
        _core.BlockManager(layout, kvcached.BlockManagerOptions(), space=space)
    space.close()
