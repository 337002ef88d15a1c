"""Several threads allocating and freeing at once: no id is handed out twice and the counters add up."""

from __future__ import annotations

import random
import threading

import pytest

import kvcached
from kvcached import _core

NUM_THREADS = 4
ROUNDS = 2000


@pytest.mark.parametrize("layout", ["per_layer", "contiguous"])
def test_concurrent_alloc_and_free_never_duplicate_ids(layout):
    device = _core.open_host_device(256 << 20)
    pool = kvcached.KVPool(2, 4 << 10, num_blocks=512, page_bytes=16 << 10, layout=layout, device=device,
                           background_worker=True, min_reserve_pages=1, max_reserve_pages=2)
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
