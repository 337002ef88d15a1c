"""Misuse that must fail clearly: racing close(), ids of the wrong type, absurd sizes, a failing worker."""

from __future__ import annotations

import resource
import threading
import time

import numpy as np
import pytest

import kvcached
from kvcached import _core

BLOCK_BYTES = 4 << 10
PAGE_BYTES = 16 << 10


def make_pool(**kwargs) -> kvcached.KVPool:
    options = dict(num_blocks=64, page_bytes=PAGE_BYTES, device=_core.open_host_device(64 << 20))
    options.update(kwargs)
    return kvcached.KVPool(2, BLOCK_BYTES, **options)


def make_manager(**kwargs) -> kvcached.KVCacheManager:
    return kvcached.KVCacheManager(
        32, 16, 256, 2, page_bytes=PAGE_BYTES, device=_core.open_host_device(64 << 20), **kwargs
    )


def close_from_two_threads(closable) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def close() -> None:
        try:
            start.wait()
            closable.close()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=close) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "close() hung"
    assert not errors, errors


@pytest.mark.parametrize("kind", ["block_manager", "pool", "manager"])
def test_close_from_two_threads_at_once_neither_hangs_nor_raises(kind):
    for _ in range(20):
        if kind == "pool":
            obj = make_pool()
            obj.free(obj.alloc(5))
        elif kind == "manager":
            obj = make_manager()
            obj.free(obj.alloc(5))
        else:
            layout = kvcached.KVLayout(
                num_layers=2, block_bytes=BLOCK_BYTES, num_blocks=64, page_bytes=PAGE_BYTES, kind="contiguous"
            )
            obj = kvcached.BlockManager(layout)
            obj.free(obj.alloc(5))
        close_from_two_threads(obj)


@pytest.mark.parametrize(
    "bad",
    [
        [2.9],
        [1.0],
        [True, False],
        np.array([2.9]),
        np.array([True, False]),
        np.array([1.0, 2.0], dtype=np.float32),
        ["3"],
    ],
)
def test_free_and_alloc_ids_refuse_non_integer_ids(bad):
    with make_pool(background_worker=False) as pool:
        ids = pool.alloc(4)
        before = pool.stats()
        with pytest.raises(TypeError, match="integer"):
            pool.free(bad)
        assert pool.stats() == before
        with pytest.raises(TypeError, match="integer"):
            pool.alloc_ids(bad)
        assert pool.stats() == before
        pool.free(ids)


@pytest.mark.parametrize("bad", [None, 1.5, "3", [2], True], ids=["None", "float", "str", "list", "bool"])
@pytest.mark.parametrize("call", ["alloc", "alloc_list", "try_reserve"])
def test_a_count_that_is_not_an_integer_is_a_type_error_naming_it(call, bad):
    with make_pool(background_worker=False) as pool:
        ids = pool.alloc(4)
        before = pool.stats()
        with pytest.raises(kvcached.errors.InvalidTypeError, match=f"n must be an integer, got {type(bad).__name__}"):
            getattr(pool, call)(bad)
        assert pool.stats() == before
        pool.free(ids)


def test_ids_that_are_none_are_a_type_error_naming_them():
    with make_pool(background_worker=False) as pool:
        for call in (pool.free, pool.alloc_ids):
            with pytest.raises(kvcached.errors.InvalidTypeError, match="ids must be integer block ids.*NoneType"):
                call(None)


def test_free_accepts_every_integer_dtype_and_numpy_scalars():
    with make_pool(background_worker=False) as pool:
        for dtype in (np.int64, np.int32, np.uint16, np.int8):
            ids = pool.alloc(3)
            pool.free(ids.astype(dtype))
        ids = pool.alloc(3)
        pool.free([np.int64(i) for i in ids])
        ids = pool.alloc(4)
        pool.free(ids[::2])  # strided
        pool.free(tuple(int(i) for i in ids[1::2]))
        assert pool.stats()["used_blocks"] == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_layers=1 << 40), "too large|overflow|exceeds"),
        (dict(num_blocks=1 << 62), "too large|overflow|exceeds"),
        (dict(num_blocks=10**30), "too large|overflow|exceeds"),
        (dict(block_bytes=1 << 62, page_bytes=1 << 62), "too large|overflow|exceeds|granularity"),
    ],
)
def test_absurd_sizes_get_a_value_error_with_the_reason(kwargs, message):
    options = dict(num_layers=2, block_bytes=BLOCK_BYTES, num_blocks=64, page_bytes=PAGE_BYTES)
    options.update(kwargs)
    device = _core.open_host_device(64 << 20)
    with pytest.raises(ValueError, match=message):
        kvcached.KVPool(options.pop("num_layers"), options.pop("block_bytes"), device=device, **options)
    assert device.counters()["reserved_bytes"] == 0


HUGE_GEOMETRY = {
    "num_layers": 1,
    "num_buffers": 1,
    "block_bytes": 4096,
    "page_bytes": 4096,
    "device": "cpu",
    "register": False,
}


@pytest.mark.parametrize("num_blocks", [2**28, 2**30, 2**32 - 1])
def test_a_geometry_whose_bookkeeping_would_exhaust_the_host_is_refused_up_front(num_blocks):
    # 2^28 page ids grew to ~22 GB before the first block (OOM-killed); 2^30 raised std::bad_alloc.
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    with pytest.raises(
        ValueError,
        match=rf"over {num_blocks} page ids \(.*\) keeps \d+ bytes of bookkeeping per page id.*"
        r"more than the \d+ bytes kvcached allows.*Use larger pages \(page_bytes\) or fewer blocks",
    ):
        kvcached.KVPool(num_blocks=num_blocks, **HUGE_GEOMETRY)
    assert time.monotonic() - started < 2.0, "refused before sizing anything"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kib < 64 << 10, "no bookkeeping was allocated"


def test_a_device_less_block_manager_refuses_such_a_geometry_too():
    layout = kvcached.KVLayout.from_config(
        1, 4096, 2**30, num_buffers=1, page_bytes=4096, device=_core.open_host_device(64 << 20)
    )
    with pytest.raises(ValueError, match=r"a block manager over 1073741824 page ids"):
        kvcached.BlockManager(layout, mirrors=2)


def test_a_large_but_sane_geometry_is_still_accepted():
    with kvcached.KVPool(num_blocks=2**20, **HUGE_GEOMETRY) as pool:  # about 100 MB of bookkeeping
        ids = pool.alloc(3)
        assert sorted(ids) == [0, 1, 2], "the lowest page ids first"
        pool.free(ids)


def test_manager_alloc_after_close_raises_instead_of_answering_none():
    m = make_manager()
    m.close()
    with pytest.raises(ValueError, match="closed"):
        m.alloc(1)


def test_worker_failures_are_counted_and_visible_in_stats():
    # Closing the pool's KV space behind its back makes the worker's next map fail.
    pool = make_pool(background_worker=True, min_reserve_pages=2, max_reserve_pages=4)
    try:
        deadline = time.monotonic() + 5
        while pool.stats()["free_pages"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.stats()["free_pages"] >= 2, "the worker did not fill its reserve"
        pool.space.close()
        ids = pool.alloc(2 * pool.blocks_per_page)  # from the reserve: the worker must refill it
        while pool.stats()["worker_errors"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = pool.stats()
        assert stats["worker_errors"] >= 1
        assert "closed" in stats["last_worker_error"]
        # kvctl and kvtop see the same count in the device registry.
        from kvcached.registry import registry_for

        (entry,) = [e for e in registry_for("cpu").entries() if e["name"] == pool.name]
        assert entry["worker_errors"] >= 1
        pool.free(ids)
    finally:
        pool.close()


# --------------------------------------------------------------------------- #
# Counts of blocks: bools refused, numpy integers taken, negatives a clear error
# --------------------------------------------------------------------------- #


def _block_manager() -> kvcached.BlockManager:
    return kvcached.BlockManager(kvcached.KVLayout(2, BLOCK_BYTES, 64, page_bytes=PAGE_BYTES, kind="contiguous"))


@pytest.mark.parametrize("kind", ["block_manager", "pool", "manager"])
def test_block_counts_are_checked_naming_the_argument_and_change_nothing(kind):
    obj = {
        "block_manager": _block_manager,
        "pool": lambda: make_pool(background_worker=False),
        "manager": lambda: make_manager(background_worker=False),
    }[kind]()
    with obj:
        pool = obj.pool if kind == "manager" else obj
        alloc = obj.alloc
        reserve = obj.try_to_reserve if kind == "manager" else obj.try_reserve
        name = "need_size" if kind == "manager" else "n"
        ids = alloc(3)
        before = pool.stats()
        for call in (alloc, reserve) + (() if kind == "manager" else (obj.alloc_list,)):
            with pytest.raises(ValueError, match=f"{name} must not be negative, got -1"):
                call(-1)
            with pytest.raises(TypeError, match=f"{name} must be an int.*bool"):
                call(True)
            with pytest.raises(TypeError, match=f"{name} must be an int.*float"):
                call(2.0)
            with pytest.raises(ValueError, match=f"{name}=18446744073709551616 is too large"):
                call(2**64)
            assert pool.stats() == before
        taken = alloc(np.int64(2))  # a numpy integer is an int
        assert len(taken) == 2
        assert reserve(np.uint8(1))
        pool.release_reserved()
        obj.free(list(ids) + list(taken))
        assert pool.stats()["used_blocks"] == 0


@pytest.mark.parametrize("one_id", [1, np.int64(1), np.uint32(1)])
def test_free_of_a_single_id_says_to_pass_a_sequence(one_id):
    with make_pool(background_worker=False) as pool:
        ids = pool.alloc(4)
        before = pool.stats()
        with pytest.raises(TypeError, match=r"ids must be a sequence or 1-D array of block ids.*pass \[1\]"):
            pool.free(one_id)
        assert pool.stats() == before
        pool.free(ids)


# --------------------------------------------------------------------------- #
# The limit in force, wherever it was set
# --------------------------------------------------------------------------- #


def test_stats_report_a_limit_set_from_outside_and_the_tighter_of_two():
    from kvcached.registry import registry_for

    with make_pool(background_worker=False) as pool:
        page = pool.page_id_bytes
        registry = registry_for("cpu")
        assert pool.stats()["limit_bytes"] is None
        assert registry.set_policy(pool.name, max_bytes=3 * page + 1) == 1  # what kvctl set-limit does
        stats = pool.stats()
        assert (stats["limit_bytes"], stats["limit_pages"]) == (3 * page + 1, 3)
        assert pool.available() == 3 * pool.blocks_per_page  # and it is obeyed
        pool.resize(2 * page)  # the pool's own limit, tighter
        assert pool.stats()["limit_bytes"] == 2 * page
        pool.resize(5 * page)  # looser than the outside one: that one is in force
        assert pool.stats()["limit_bytes"] == 3 * page + 1
        registry.set_policy(pool.name, clear_max=True)
        assert pool.stats()["limit_bytes"] == 5 * page
        pool.resize(None)
        assert pool.stats()["limit_bytes"] is None


# --------------------------------------------------------------------------- #
# available() accounts for every bound alloc applies
# --------------------------------------------------------------------------- #


def test_available_is_bound_by_the_device_before_the_first_alloc():
    """72 MiB of host memory, a 1 GiB budget, 256 MiB of virtual capacity in 16 MiB page ids."""
    device = _core.open_host_device(72 << 20)
    with kvcached.KVPool(
        num_layers=4, block_bytes=32 << 10, capacity_bytes=256 << 20, device=device, budget=_core.FixedBudget(1 << 30)
    ) as pool:
        assert pool.page_id_bytes == 16 << 20
        assert pool.available() == 4 * pool.blocks_per_page  # 4 page ids fit in 72 MiB, not 16
        ids = pool.alloc(pool.available())
        with pytest.raises(kvcached.OutOfMemoryError):
            pool.alloc(1)
        pool.free(ids)
