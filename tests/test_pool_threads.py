"""Several threads allocating and freeing at once: no id is handed out twice and the counters add up."""

from __future__ import annotations

import random
import threading
import time

import pytest

import kvcached
from kvcached import _core

NUM_THREADS = 4
ROUNDS = 2000


@pytest.mark.parametrize("layout", ["per_layer", "contiguous"])
def test_concurrent_alloc_and_free_never_duplicate_ids(layout):
    device = _core.open_host_device(256 << 20)
    pool = kvcached.KVPool(
        2,
        4 << 10,
        num_blocks=512,
        page_bytes=16 << 10,
        layout=layout,
        device=device,
        background_worker=True,
        min_reserve_pages=1,
        max_reserve_pages=2,
    )
    owner: dict[int, int] = {}  # id -> thread holding it
    owner_lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(NUM_THREADS + 1)

    def worker(index: int) -> None:
        rng = random.Random(index)
        held: list[int] = []
        try:
            start.wait()
            for _ in range(ROUNDS):
                if held and rng.random() < 0.45:
                    rng.shuffle(held)
                    count = rng.randint(1, len(held))
                    give_back, held[:] = held[:count], held[count:]
                    with owner_lock:
                        for i in give_back:
                            del owner[i]
                    pool.free(give_back)
                else:
                    try:
                        ids = pool.alloc(rng.randint(1, 12)).tolist()
                    except kvcached.OutOfMemoryError:
                        continue
                    with owner_lock:
                        for i in ids:
                            assert i not in owner, f"block {i} handed to threads {owner[i]} and {index}"
                            owner[i] = index
                    held.extend(ids)
                if rng.random() < 0.02:
                    pool.resize(None if rng.random() < 0.5 else rng.randint(4, 40) * pool.page_id_bytes)
                if rng.random() < 0.01:
                    pool.trim()
            pool.free(held)
            with owner_lock:
                for i in held:
                    del owner[i]
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(NUM_THREADS)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    assert not owner
    # stats() does not wait for a map or unmap the worker has in flight (those
    # pages count as used meanwhile); one round by hand leaves it nothing to do.
    pool.maintain()
    stats = pool.stats()
    assert stats["used_blocks"] == 0 and stats["used_pages"] == 0
    assert stats["free_mapped_blocks"] == stats["mapped_pages"] * pool.blocks_per_page
    pool.resize(None)
    assert pool.available() == pool.num_blocks
    pool.close()
    assert device.counters()["mapped_bytes"] == 0 and device.counters()["created_bytes"] == 0


def _hold_registry_lock(device: str, locked) -> None:
    from kvcached.registry import DeviceRegistry

    DeviceRegistry(device)._hold_lock_for_test()
    locked.set()
    time.sleep(60)  # killed by the test: the robust lock then passes to the next locker


@pytest.mark.slow
def test_the_fast_path_never_waits_on_another_process():
    """Another process holds the registry's lock: a thread whose alloc must map a page waits
    for it, but alloc from mapped pages, free, available() and stats() in other threads do not."""
    import multiprocessing as mp

    from kvcached.registry import registry_for

    registry_for("cpu")  # make sure the registry exists
    pool = kvcached.KVPool(
        2,
        4 << 10,
        num_blocks=512,
        page_bytes=16 << 10,
        device=_core.open_host_device(64 << 20),
        background_worker=False,
        min_reserve_pages=0,
        max_reserve_pages=0,
    )
    try:
        held = pool.alloc(1)  # page 0 mapped, 3 free blocks on it
        ctx = mp.get_context("spawn")
        locked = ctx.Event()
        holder = ctx.Process(target=_hold_registry_lock, args=("cpu", locked))
        holder.start()
        assert locked.wait(30)
        outcome: list = []

        def alloc_that_maps() -> None:  # needs the budget: waits for the registry lock
            try:
                outcome.append(pool.alloc(2 * pool.blocks_per_page))
            except Exception as exc:  # the registry's lock timeout, if it comes first
                outcome.append(exc)

        slow = threading.Thread(target=alloc_that_maps)
        slow.start()
        time.sleep(0.2)
        assert slow.is_alive(), "the alloc that maps pages should be waiting for the registry lock"
        start = time.monotonic()
        for _ in range(100):
            pool.free(pool.alloc(2))
            pool.available()
            pool.stats()
        assert time.monotonic() - start < 1.0, "the fast path waited on another process"
        holder.kill()
        holder.join(30)
        slow.join(30)
        assert len(outcome) == 1 and not slow.is_alive()
        if not isinstance(outcome[0], Exception):
            pool.free(outcome[0])
        pool.free(held)
    finally:
        pool.close()
