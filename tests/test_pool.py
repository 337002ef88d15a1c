"""KVPool on the host backend, as a specification: data, elasticity, bad input, memory accounting."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvcached
from kvcached import _core

torch = pytest.importorskip("torch")

PAGE_BYTES = 16 << 10  # small pages (4 blocks each) keep the tests fast
BLOCK_BYTES = 4 << 10
NUM_LAYERS = 2
LAYOUTS = ["per_layer", "contiguous"]


def make_pool(layout: str = "per_layer", *, device=None, capacity_bytes: int = 64 << 20, **kwargs) -> kvcached.KVPool:
    options = dict(
        num_blocks=64,
        page_bytes=PAGE_BYTES,
        layout=layout,
        background_worker=False,
        min_reserve_pages=0,
        max_reserve_pages=0,
    )
    options.update(kwargs)
    return kvcached.KVPool(NUM_LAYERS, BLOCK_BYTES, device=device or _core.open_host_device(capacity_bytes), **options)


def block_bytes_view(pool: kvcached.KVPool, layer: int, buffer: int, block: int) -> torch.Tensor:
    flat = torch.from_dlpack(pool.tensor())
    start = pool.space.offset_of(layer, buffer, block)
    return flat[start : start + BLOCK_BYTES]


def fill(pool: kvcached.KVPool, ids, seed: int) -> None:
    for b in ids:
        for layer in range(NUM_LAYERS):
            for buf in range(2):
                block_bytes_view(pool, layer, buf, int(b)).fill_((seed + int(b) * 7 + layer * 3 + buf) % 251)


def check(pool: kvcached.KVPool, ids, seed: int) -> None:
    for b in ids:
        for layer in range(NUM_LAYERS):
            for buf in range(2):
                expected = (seed + int(b) * 7 + layer * 3 + buf) % 251
                view = block_bytes_view(pool, layer, buf, int(b))
                assert bool((view == expected).all()), f"block {b} layer {layer} buffer {buf} lost its data"


@pytest.fixture(params=LAYOUTS)
def pool(request):
    with make_pool(request.param) as p:
        yield p


# ---- data -------------------------------------------------------------------------


def test_data_survives_other_allocations_frees_grows_and_shrinks(pool):
    kept = pool.alloc(6)
    fill(pool, kept, seed=1)
    others = pool.alloc(20)  # grows the pool
    fill(pool, others, seed=2)
    pool.free(others[::2])
    pool.trim()  # shrinks: unmaps pages no kept block lives on
    more = pool.alloc(9)
    fill(pool, more, seed=3)
    pool.free(more)
    pool.resize(pool.stats()["held_bytes"])  # a limit at exactly what is held
    pool.maintain()
    check(pool, kept, seed=1)
    check(pool, others[1::2], seed=2)


def test_freed_blocks_can_be_reallocated_and_written(pool):
    ids = pool.alloc(8)
    fill(pool, ids, seed=5)
    pool.free(ids)
    again = pool.alloc(8)
    assert sorted(again.tolist()) == sorted(ids.tolist())  # best fit reuses the mapped page
    fill(pool, again, seed=9)
    check(pool, again, seed=9)


def test_unmapped_regions_read_zero_with_zero_backing(pool):
    flat = torch.from_dlpack(pool.tensor())
    assert int(flat.count_nonzero()) == 0
    ids = pool.alloc(pool.blocks_per_page)
    fill(pool, ids, seed=1)
    pool.free(ids)
    pool.trim()
    assert pool.stats()["mapped_pages"] == 0
    assert int(flat.count_nonzero()) == 0  # and reading never faulted


def test_null_block_is_never_handed_out_or_freed():
    with make_pool(null_block=True) as p:
        ids = p.alloc(p.num_blocks - 1)
        assert 0 not in ids.tolist()
        before = p.stats()
        with pytest.raises(ValueError, match="null block"):
            p.free([0])
        assert p.stats() == before


# ---- bad input: a clear error and the pool exactly as it was ---------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_bytes=0), "block_bytes must be positive"),
        (dict(block_bytes=-4096), "block_bytes must be positive"),
        (dict(num_blocks=0), "num_blocks must be positive"),
        (dict(num_blocks=-1), "num_blocks must be positive"),
        (dict(num_layers=0), "num_layers must be positive"),
        (dict(num_buffers=3), "num_buffers must be 1"),
        (dict(page_bytes=PAGE_BYTES + 100), "multiple of the device granularity|does not divide"),
        (dict(block_bytes=3000), "a page of .* bytes would work"),
        (dict(block_bytes=PAGE_BYTES * 2), f"a page of {PAGE_BYTES * 2} bytes would work"),
        (dict(limit_bytes=-1), "must not be negative"),
        (dict(layout="diagonal"), "per_layer"),
    ],
)
def test_bad_construction_arguments_raise_value_error(kwargs, message):
    options = dict(
        num_layers=NUM_LAYERS, block_bytes=BLOCK_BYTES, num_blocks=64, page_bytes=PAGE_BYTES, background_worker=False
    )
    options.update(kwargs)
    device = _core.open_host_device(64 << 20)
    with pytest.raises(ValueError, match=message):
        kvcached.KVPool(device=device, **options)
    assert device.counters()["reserved_bytes"] == 0  # nothing left behind


def test_block_larger_than_page_names_a_page_size_that_works():
    with pytest.raises(ValueError) as info:
        kvcached.KVPool(
            NUM_LAYERS, 3 * PAGE_BYTES, num_blocks=4, page_bytes=PAGE_BYTES, device=_core.open_host_device(1 << 30)
        )
    assert f"a page of {3 * PAGE_BYTES} bytes would work" in str(info.value)


@pytest.mark.parametrize(
    "bad_free, message",
    [
        (lambda ids: ids[:1].tolist() * 2, "listed twice"),
        (lambda ids: [int(ids[0]), int(ids[1]), int(ids[0])], "listed twice"),
        (lambda ids: [int(ids[0]), 63], "not allocated"),  # valid-looking id not allocated here
        (lambda ids: [int(ids[0]), 64], "outside"),  # beyond this pool's range
        (lambda ids: [int(ids[0]), 1 << 40], "outside"),  # an id from a far bigger pool
        (lambda ids: [-1], "outside"),
    ],
)
def test_bad_free_raises_and_frees_nothing(pool, bad_free, message):
    ids = pool.alloc(5)
    before = pool.stats()
    with pytest.raises(ValueError, match=message):
        pool.free(bad_free(ids))
    assert pool.stats() == before
    pool.free(ids)  # still all allocated
    assert pool.stats()["used_blocks"] == 0


def test_double_free_raises_and_changes_nothing(pool):
    ids = pool.alloc(3)
    pool.free(ids[:1])
    before = pool.stats()
    with pytest.raises(ValueError, match="double free"):
        pool.free(ids)
    assert pool.stats() == before


def test_ids_from_another_pool_are_refused(pool):
    with make_pool(num_blocks=256) as bigger:
        foreign = bigger.alloc(80)  # ids 0..79; 64..79 are beyond `pool`'s range
        mine = pool.alloc(2)
        before = pool.stats()
        with pytest.raises(ValueError):
            pool.free(foreign[-1:])
        with pytest.raises(ValueError):
            pool.free(foreign[10:12])  # in range, but not allocated here
        assert pool.stats() == before
        pool.free(mine)


@pytest.mark.parametrize("bad", [-1, 1.5, "3", None])
def test_bad_alloc_count_raises(pool, bad):
    before = pool.stats()
    with pytest.raises((TypeError, ValueError)):
        pool.alloc(bad)
    assert pool.stats() == before


def test_negative_limit_raises_and_keeps_the_old_limit(pool):
    pool.resize(pool.page_id_bytes * 3)
    before = pool.stats()
    with pytest.raises(ValueError, match="must not be negative"):
        pool.resize(-1)
    assert pool.stats() == before


def test_alloc_of_zero_blocks_is_empty(pool):
    assert pool.alloc(0).tolist() == []


# ---- out of memory: an exception, never an abort, and rolled back -------------------------


def test_alloc_over_the_limit_raises_out_of_memory_and_rolls_back(pool):
    pool.resize(2 * pool.page_id_bytes)
    ids = pool.alloc(3)
    before = pool.stats()
    with pytest.raises(kvcached.OutOfMemoryError) as info:
        pool.alloc(2 * pool.blocks_per_page)
    assert isinstance(info.value, MemoryError)
    assert "bound by the limit of 2 page(s)" in str(info.value)  # the bound that held, by name
    assert pool.stats() == before
    pool.free(ids)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_small_device_capacity_raises_out_of_memory_and_rolls_back(layout):
    page_id_bytes = NUM_LAYERS * 2 * PAGE_BYTES
    device = _core.open_host_device(3 * page_id_bytes)
    with make_pool(layout, device=device) as p:
        ids = p.alloc(1)
        before, counters = p.stats(), device.counters()
        with pytest.raises(MemoryError) as info:
            p.alloc(4 * p.blocks_per_page)  # needs 4 pages, the device has room for 2 more
        assert isinstance(info.value, kvcached.OutOfMemoryError)
        assert "bound by the device's free memory" in str(info.value)
        assert p.stats() == before
        assert device.counters() == counters
        p.free(ids)
        assert len(p.alloc(3 * p.blocks_per_page)) == 3 * p.blocks_per_page  # what fits still works


# ---- elasticity -----------------------------------------------------------------------------


def test_limit_below_use_is_deferred_until_blocks_are_freed(pool):
    ids = pool.alloc(4 * pool.blocks_per_page)  # four full pages
    assert pool.stats()["mapped_pages"] == 4
    pool.resize(pool.page_id_bytes)  # below use: accepted, not refused
    assert pool.stats()["mapped_pages"] == 4 and pool.available() == 0
    pool.free(ids[: 2 * pool.blocks_per_page])
    pool.maintain()
    assert pool.stats()["mapped_pages"] == 2
    pool.free(ids[2 * pool.blocks_per_page :])
    pool.maintain()
    assert pool.stats()["mapped_pages"] == 0  # this pool keeps no free pages in reserve
    assert pool.available() == pool.blocks_per_page  # the limit of one page still holds


def test_a_deferred_shrink_also_gives_back_the_allocations_kept_as_spares(pool):
    # Unmapped pages may be kept as pre-created spares; under a limit they must go too.
    ids = pool.alloc(2 * pool.blocks_per_page)
    pool.resize(0)
    pool.free(ids)
    pool.maintain()
    assert pool.stats()["held_bytes"] == 0
    assert pool.device.counters()["created_bytes"] == 0


def test_background_worker_completes_a_deferred_shrink():
    with make_pool(background_worker=True) as p:
        ids = p.alloc(3 * p.blocks_per_page)
        p.resize(p.page_id_bytes)
        p.free(ids)
        deadline = time.monotonic() + 5
        while p.stats()["held_bytes"] > p.page_id_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.stats()["held_bytes"] <= p.page_id_bytes


def test_trim_returns_memory(pool):
    device = pool.device
    ids = pool.alloc(3 * pool.blocks_per_page)
    pool.free(ids)
    assert device.counters()["created_bytes"] >= 3 * pool.page_id_bytes
    assert pool.trim() == 3
    assert pool.stats()["held_bytes"] == 0
    assert device.counters()["mapped_bytes"] == 0 and device.counters()["created_bytes"] == 0


def test_every_counter_returns_to_zero_at_close(monkeypatch):
    monkeypatch.setenv("KVCACHED_MIN_SPARE_PAGES", "1")  # hold a pre-created allocation too
    device = _core.open_host_device(64 << 20)
    budget = _core.FixedBudget(1 << 20)
    p = make_pool(device=device, budget=budget)
    ids = p.alloc(13)
    p.free(ids[:5])
    p.maintain()
    assert p.stats()["spare_pages"] == 1 and budget.used_bytes > 0
    p.close()
    stats = p.stats()
    for key in ("used_blocks", "mapped_pages", "spare_pages", "pending_pages", "held_bytes", "mapped_bytes"):
        assert stats[key] == 0, key
    counters = device.counters()
    assert counters["mapped_bytes"] == 0 and counters["created_bytes"] == 0
    assert budget.used_bytes == 0
    del p
    assert device.counters()["reserved_bytes"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ending", ["close", "drop"])
def test_a_view_outliving_its_pool_reads_zeros(layout, ending):
    device = _core.open_host_device(64 << 20)
    p = make_pool(layout, device=device)
    ids = p.alloc(6)
    fill(p, ids, seed=4)
    view = torch.from_dlpack(p.tensor())
    assert int(view.count_nonzero()) > 0
    if ending == "close":
        p.close()
    del p
    assert int(view.count_nonzero()) == 0  # reads zeros, never faults
    assert device.counters()["mapped_bytes"] == 0 and device.counters()["created_bytes"] == 0
    del view
    assert device.counters()["reserved_bytes"] == 0


def test_closed_pool_refuses_work_with_a_clear_error(pool):
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        pool.alloc(1)
    assert pool.available() == 0


def test_ids_are_numpy_int64_and_free_accepts_lists_and_arrays(pool):
    ids = pool.alloc(4)
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int64
    pool.free(ids[:2])
    pool.free([int(i) for i in ids[2:]])
    assert pool.stats()["used_blocks"] == 0
