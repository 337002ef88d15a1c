"""The pool's path kept free of what can happen in the background: spares instead of releases
on a shrink, the next page ids split ahead of bursts, a waiting alloc woken by memory coming
back from another process, and the device's free memory known without a driver call."""

from __future__ import annotations

import multiprocessing as mp
import random
import time

import pytest

import kvcached
from kvcached import _core

LAYERS, BLOCK_BYTES = 2, 64 << 10  # 2 MiB pages hold 32 blocks


def make_pool(device, layout: str, **kwargs) -> kvcached.KVPool:
    kwargs.setdefault("register", False)
    kwargs.setdefault("background_worker", False)
    return kvcached.KVPool(
        LAYERS,
        BLOCK_BYTES,
        capacity_bytes=2 << 30,
        layout=layout,
        page_bytes=2 << 20,
        device=device,
        zero_backing=True,
        **kwargs,
    )


def worker_round(pool: kvcached.KVPool) -> None:
    """What the background worker does each round."""
    pool.maintain()
    pool.prepare_ahead()


@pytest.mark.parametrize("layout", ["contiguous", "per_layer"])
def test_a_bursty_trace_never_splits_a_zero_chunk_on_the_grow_path(device, layout):
    if device.backend == "host":
        pytest.skip("host zero pages are free: nothing is ever split")
    rng = random.Random(12)
    with make_pool(device, layout, min_reserve_pages=0, max_reserve_pages=0) as pool:
        per_page = pool.blocks_per_page
        frontier = pool.space.zero_frontier_pages
        assert frontier == kvcached.config.get("zero_frontier_pages") > 0
        # Right after set-up, before any worker round: a burst the set-up prepared for.
        held = [pool.alloc(32 * per_page)]
        largest = 32
        for _ in range(30):
            worker_round(pool)
            assert pool.lookahead_pages >= frontier
            if rng.random() < 0.25:  # a burst up to what the look-ahead promises (and a third of the space)
                pages = rng.randint(8, min(pool.lookahead_pages, pool.num_pages // 3))
            else:
                pages = rng.randint(1, 3)
            while pool.available() < pages * per_page:
                pool.free(held.pop(0))
                worker_round(pool)
            held.append(pool.alloc(pages * per_page))
            largest = max(largest, pages)
            if rng.random() < 0.4 and len(held) > 1:
                pool.free(held.pop(rng.randrange(len(held))))
        assert pool.space.zero_splits_on_map == 0, "a grow split a zero chunk"
        for ids in held:
            pool.free(ids)


def test_a_burst_makes_the_look_ahead_follow(device):
    with make_pool(device, "contiguous", min_reserve_pages=0, max_reserve_pages=0) as pool:
        if device.backend == "host":
            assert pool.lookahead_pages == 0  # nothing to get ready on host
            return
        floor = pool.space.zero_frontier_pages
        assert pool.lookahead_pages == floor
        ids = pool.alloc(floor * pool.blocks_per_page)  # a burst as large as the floor
        assert pool.lookahead_pages == 2 * floor
        worker_round(pool)
        more = pool.alloc(2 * floor * pool.blocks_per_page)  # twice as large again: ready too
        assert pool.space.zero_splits_on_map == 0
        pool.free(ids)
        pool.free(more)


def test_a_shrink_keeps_its_allocations_until_the_next_round(host_device):
    with make_pool(
        host_device, "contiguous", min_reserve_pages=0, max_reserve_pages=0, budget=_core.FixedBudget(1 << 30)
    ) as pool:
        ids = pool.alloc(3 * pool.blocks_per_page)
        created = host_device.counters()["created_bytes"]
        pool.free(ids)
        pool.maintain()  # the shrink: nothing released on this path
        stats = pool.stats()
        assert stats["mapped_pages"] == 0 and stats["spare_pages"] == 3
        assert host_device.counters()["created_bytes"] == created
        assert stats["held_bytes"] == 3 * pool.page_id_bytes  # spares stay charged to the budget
        pool.maintain()  # the next round releases beyond the maximum
        assert pool.stats()["spare_pages"] == kvcached.config.get("max_spare_pages")


def test_the_device_free_estimate_needs_no_driver_call(host_device):
    device = _core.open_host_device(64 << 20)
    assert device.estimated_free_bytes == 64 << 20
    allocation = device.create(2 << 20)
    assert device.estimated_free_bytes == 62 << 20 == device.memory_info()[0]
    allocation.release()
    assert device.estimated_free_bytes == 64 << 20


def test_a_timeout_must_be_a_number_of_seconds(host_device):
    with make_pool(host_device, "contiguous") as pool:
        with pytest.raises(ValueError, match="timeout_s"):
            pool.alloc(1, timeout_s=-1)


# ---- a waiting alloc across processes (the shared registry budget) ---------------------------

PAGES = 4


def _holder(conn, device: str) -> None:
    """Holds PAGES page ids until told to free them; its worker gives them back."""
    try:
        pool = kvcached.KVPool(
            LAYERS,
            BLOCK_BYTES,
            capacity_bytes=64 << 20,
            layout="contiguous",
            page_bytes=2 << 20,
            device=device,
            name="holder",
        )
        ids = pool.alloc(PAGES * pool.blocks_per_page)
        conn.send("held")
        conn.recv()
        pool.free(ids)
        deadline = time.monotonic() + 10
        while pool.stats()["held_bytes"] > pool.page_id_bytes and time.monotonic() < deadline:
            time.sleep(0.001)  # the worker returns the memory (the waiter's refusals are pressure)
        conn.send(pool.stats()["held_bytes"])
        conn.recv()
        pool.close()
    except BaseException as exc:  # report, never hang the parent
        conn.send(f"error: {exc!r}")


def test_a_waiting_alloc_gets_the_memory_another_process_gives_back(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    from kvcached.registry import DeviceRegistry

    page_id_bytes = LAYERS * 2 * (2 << 20)
    # Room for the holder's pages and one page of reserve: the waiter needs what the holder has.
    DeviceRegistry("cpu", (PAGES + 1) * page_id_bytes)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(child, "cpu"))
    proc.start()
    try:
        assert parent.poll(60) and parent.recv() == "held"
        with kvcached.KVPool(
            LAYERS,
            BLOCK_BYTES,
            capacity_bytes=64 << 20,
            layout="contiguous",
            page_bytes=2 << 20,
            device="cpu",
            name="waiter",
            min_reserve_pages=0,
        ) as pool:
            want = PAGES * pool.blocks_per_page
            with pytest.raises(kvcached.OutOfMemoryError):
                pool.alloc(want)  # no timeout: refused at once
            start = time.monotonic()
            parent.send("free")
            ids = pool.alloc(want, timeout_s=30)
            waited = time.monotonic() - start
            assert len(ids) == want and waited < 10
            assert parent.poll(30)
            holder_held = parent.recv()
            assert holder_held <= page_id_bytes, holder_held
            pool.free(ids)
        parent.send("stop")
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
