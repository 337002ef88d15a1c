"""Deciding in one process, mapping in others: a BlockManager driving two mirror KV spaces over pipes."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import pickle

import pytest

import kvcached
from kvcached import _core

NUM_LAYERS = 2
BLOCK_BYTES = 4 << 10
PAGE_BYTES = 16 << 10
NUM_BLOCKS = 32
LAYOUT = kvcached.KVLayout(NUM_LAYERS, BLOCK_BYTES, NUM_BLOCKS, page_bytes=PAGE_BYTES)


def mirror_main(conn) -> None:
    """A worker process: its own host KV space, applying page ops in order and touching blocks."""
    space = kvcached.KVSpace(LAYOUT, _core.open_host_device(64 << 20), kvcached.KVSpaceOptions(zero_backing=True))

    def addresses(block: int):
        for layer in range(NUM_LAYERS):
            for buffer in range(2):
                yield space.base_address + space.offset_of(layer, buffer, block)

    while True:
        command, *args = conn.recv()
        if command == "apply":
            conn.send(space.apply(args[0]))  # the seq to acknowledge
        elif command == "write":
            block, value = args
            for address in addresses(block):
                ctypes.memset(address, value, BLOCK_BYTES)
            conn.send(None)
        elif command == "read":
            block = args[0]
            conn.send([set(ctypes.string_at(address, BLOCK_BYTES)) for address in addresses(block)])
        elif command == "mapped_pages":
            conn.send(space.mapped_pages)
        elif command == "close":
            space.close()
            conn.send(None)
            return


class Mirror:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=mirror_main, args=(child,), daemon=True)
        self.process.start()

    def call(self, *message):
        self.conn.send(message)
        if not self.conn.poll(30):
            raise TimeoutError(f"mirror did not answer {message[0]!r}")
        return self.conn.recv()

    def stop(self) -> None:
        try:
            self.call("close")
        finally:
            self.process.join(10)


@pytest.fixture(scope="module")
def mirrors():
    ctx = mp.get_context("spawn")
    pair = [Mirror(ctx), Mirror(ctx)]
    yield pair
    for m in pair:
        m.stop()


def test_page_ops_pickle_round_trip():
    ops = kvcached.PageOps(7, [1, 2], [3])
    back = pickle.loads(pickle.dumps(ops))
    assert (back.seq, back.map_pages, back.unmap_pages) == (7, [1, 2], [3]) and back == ops


def test_memory_is_released_only_after_every_mirror_acknowledges(mirrors):
    # Both mirrors live on the one host device: each page is charged twice on its budget.
    budget = _core.FixedBudget(1 << 30)
    manager = kvcached.BlockManager(LAYOUT, kvcached.BlockManagerOptions(), mirrors=2, budget=budget)
    page = manager.page_id_bytes
    per_page = manager.blocks_per_page

    def send(ops, to=(0, 1)):
        for index in to:
            manager.acknowledge(index, mirrors[index].call("apply", ops))

    # Grow: two pages decided here, mapped there.
    ids = manager.alloc(2 * per_page).tolist()
    assert budget.used_bytes == 2 * 2 * page  # memory is counted when decided, on every mirror
    send(manager.take_page_ops())
    assert [m.call("mapped_pages") for m in mirrors] == [2, 2]
    for index, m in enumerate(mirrors):  # each mirror has its own memory
        for b in ids:
            m.call("write", b, 10 * (index + 1) + b % 7)
    for index, m in enumerate(mirrors):
        for b in ids:
            assert m.call("read", b) == [{10 * (index + 1) + b % 7}] * (2 * NUM_LAYERS)

    # Shrink: the unmap is pending until both mirrors have applied it.
    first_page = [b for b in ids if manager.page_of(b) == manager.page_of(ids[0])]
    manager.free(first_page)
    assert manager.trim() == 1
    ops = manager.take_page_ops()
    assert len(ops.unmap_pages) == 1 and not ops.map_pages
    held_before = manager.stats()["held_bytes"]
    assert manager.stats()["pending_pages"] == 1 and budget.used_bytes == 2 * 2 * page

    send(ops, to=(0,))
    assert manager.stats()["pending_pages"] == 1, "the page id was reused before the second mirror acknowledged"
    # Mirror 0 has unmapped it: its share goes back; mirror 1 still holds the page.
    assert budget.used_bytes == (1 + 2) * page
    assert [m["held_bytes"] for m in manager.stats()["mirrors"]] == [page, 2 * page]
    assert manager.stats()["held_bytes"] == held_before

    send(ops, to=(1,))
    assert manager.stats()["pending_pages"] == 0
    assert manager.stats()["held_bytes"] == page and budget.used_bytes == 2 * page
    assert [m.call("mapped_pages") for m in mirrors] == [1, 1]
    for m in mirrors:  # the unmapped page reads zeros; the other keeps its data
        assert m.call("read", first_page[0]) == [{0}] * (2 * NUM_LAYERS)
    kept = [b for b in ids if b not in first_page]
    assert mirrors[1].call("read", kept[0]) == [{20 + kept[0] % 7}] * (2 * NUM_LAYERS)

    # An idle owner flushes pending unmaps on its own: maintain, then take the ops.
    manager.free(kept)
    manager.maintain()
    ops = manager.take_page_ops()
    assert len(ops.unmap_pages) == 1
    send(ops)
    assert manager.stats()["held_bytes"] == 0 and budget.used_bytes == 0
    assert [m.call("mapped_pages") for m in mirrors] == [0, 0]

    # Nothing recorded: an empty batch that needs no acknowledgement.
    empty = manager.take_page_ops()
    assert not empty and empty.seq == 0
    manager.close()
    assert budget.used_bytes == 0


def test_acknowledging_an_unknown_mirror_or_seq_is_refused():
    manager = kvcached.BlockManager(LAYOUT, mirrors=2)
    manager.alloc(1)
    ops = manager.take_page_ops()
    with pytest.raises(ValueError, match="mirror index"):
        manager.acknowledge(2, ops.seq)
    with pytest.raises(ValueError, match="never handed out"):
        manager.acknowledge(0, ops.seq + 1)
    manager.close()


def test_a_pool_that_maps_its_own_pages_has_no_page_ops():
    with kvcached.KVPool(NUM_LAYERS, BLOCK_BYTES, num_blocks=NUM_BLOCKS, page_bytes=PAGE_BYTES,
                         device=_core.open_host_device(64 << 20), background_worker=False) as pool:
        with pytest.raises(ValueError, match="no page ops"):
            pool.take_page_ops()
