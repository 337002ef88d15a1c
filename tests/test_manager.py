"""KVCacheManager: the reference implementation's API (alloc answers None, resize per K/V buffer) over a KVPool."""

from __future__ import annotations

import numpy as np
import pytest

import kvcached
from kvcached import _core

NUM_LAYERS = 2
BLOCK_SIZE, CELL_SIZE = 16, 256  # 4 KiB blocks
PAGE_BYTES = 16 << 10  # 4 blocks per page


def make_manager(num_blocks: int = 30, **kwargs) -> kvcached.KVCacheManager:
    kwargs.setdefault("device", _core.open_host_device(64 << 20))
    return kvcached.KVCacheManager(
        num_blocks, BLOCK_SIZE, CELL_SIZE, NUM_LAYERS, page_bytes=PAGE_BYTES, background_worker=False, **kwargs
    )


def test_alloc_returns_a_list_of_ids_and_free_gives_them_back():
    with make_manager() as m:
        assert m.available_size() == 30
        ids = m.alloc(5)
        assert isinstance(ids, list) and len(set(ids)) == 5 and all(isinstance(i, int) for i in ids)
        assert m.available_size() == 25
        m.free(ids)
        assert m.available_size() == 30
        assert m.alloc(0) == []


def test_alloc_answers_none_when_memory_is_short_and_takes_nothing():
    with make_manager() as m:
        held = m.alloc(28)
        before = m.stats()
        assert m.alloc(3) is None
        assert m.stats() == before
        assert len(m.alloc(2)) == 2
        m.free(held)


def test_ids_never_reach_past_num_blocks_even_when_pages_round_up():
    # 30 blocks need 8 pages of 4: the last page holds 2, and the pool knows it.
    with make_manager(30) as m:
        assert m.pool.num_blocks == 30 and m.pool.stats()["num_pages"] == 8
        ids = m.alloc(30)
        assert sorted(ids) == list(range(30))
        assert m.alloc(1) is None and m.available_size() == 0
        m.free(ids[:10])
        again = m.alloc(10)
        assert max(again) < 30
        m.clear()
        assert m.available_size() == 30


def test_free_refuses_bad_ids_and_frees_nothing():
    with make_manager() as m:
        ids = m.alloc(4)
        before = m.stats()
        for bad, error in [
            ([ids[0], ids[0]], ValueError),
            ([30], ValueError),
            ([-1], ValueError),
            ([ids[0], 29], ValueError),
            ([1.5], TypeError),
        ]:
            with pytest.raises(error):
                m.free(bad)
            assert m.stats() == before
        m.free(np.array(ids))


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        make_manager(0)
    with pytest.raises(ValueError, match="would work"):
        kvcached.KVCacheManager(8, 3, 1000, NUM_LAYERS, device=_core.open_host_device(64 << 20), page_bytes=PAGE_BYTES)
    with make_manager() as m:
        with pytest.raises(ValueError):
            m.alloc(-1)
        with pytest.raises(TypeError):
            m.alloc(2.0)
        with pytest.raises(ValueError, match="must not be negative"):
            m.resize(-1)


def test_resize_takes_bytes_of_one_layer_buffer():
    with make_manager() as m:
        block_bytes = BLOCK_SIZE * CELL_SIZE
        assert m.resize(8 * block_bytes) is True  # two pages of each layer's K and V
        assert m.stats()["limit_bytes"] == 8 * block_bytes * NUM_LAYERS * 2
        assert m.available_size() == 8
        ids = m.alloc(8)
        assert m.alloc(1) is None
        m.resize(4 * block_bytes)  # below use: deferred, not refused
        m.free(ids)
        m.pool.maintain()
        assert m.get_mapped_memory_size() <= 4 * block_bytes * NUM_LAYERS * 2
        m.resize(None)
        assert m.available_size() == 30


def test_trim_and_clear_return_memory():
    device = _core.open_host_device(64 << 20)
    with make_manager(device=device) as m:
        m.alloc(7)
        m.alloc(5)
        assert m.get_mapped_memory_size("kb") > 0
        m.clear()
        assert m.available_size() == 30 and m.stats()["used_blocks"] == 0
        m.trim()
        assert m.get_mapped_memory_size() == 0 and device.counters()["created_bytes"] == 0


def test_null_block_is_held_back():
    with make_manager(reserve_null_block=True) as m:
        assert m.available_size() == 29
        ids = m.alloc(29)
        assert 0 not in ids
        m.clear()
        assert m.available_size() == 29


def test_try_to_reserve_and_free_reserved():
    with make_manager() as m:
        assert m.try_to_reserve(10)
        assert m.available_size() == 30  # reserved blocks count as available (the reference's figure)
        assert m.stats()["reserved_blocks"] == 10
        assert not m.try_to_reserve(25)  # only 20 more exist
        assert m.stats()["reserved_blocks"] == 10
        m.free_reserved()
        assert m.available_size() == 30 and m.stats()["used_blocks"] == 0


@pytest.mark.parametrize("layout", ["per_layer", "contiguous"])
def test_kv_tensors_are_per_layer_views_of_the_cache(layout):
    torch = pytest.importorskip("torch")
    with make_manager(layout=layout) as m:
        tensors = m.get_kv_tensors(torch.float16)
        assert len(tensors) == NUM_LAYERS
        assert tuple(tensors[0].shape) == (2, 30, BLOCK_SIZE, CELL_SIZE // 2)
        block = m.alloc(3)[1]
        tensors[1][1, block, 2] = 3.0
        flat = torch.from_dlpack(m.pool.tensor())
        start = m.pool.space.offset_of(1, 1, block) + 2 * CELL_SIZE
        assert flat[start : start + CELL_SIZE].view(torch.float16).eq(3.0).all()
    assert tensors[1].abs().sum() == 0  # closed: reads zeros, never faults


def test_default_device_is_a_gpu_if_present_else_the_host():
    with kvcached.KVCacheManager(4, BLOCK_SIZE, CELL_SIZE, 1, background_worker=False) as m:
        assert m.pool.device.name == kvcached.open_device(kvcached.default_device()).name
