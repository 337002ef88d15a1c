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
LAYOUT = kvcached.KVLayout(NUM_LAYERS, BLOCK_BYTES, NUM_BLOCKS, page_bytes=PAGE_BYTES, kind="contiguous")


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
    with kvcached.KVPool(
        NUM_LAYERS,
        BLOCK_BYTES,
        num_blocks=NUM_BLOCKS,
        page_bytes=PAGE_BYTES,
        device=_core.open_host_device(64 << 20),
        background_worker=False,
    ) as pool:
        with pytest.raises(ValueError, match="no page ops"):
            pool.take_page_ops()


# ---- several mirrors, each on its own budget (tensor and pipeline parallelism) -----------------


class Mirrors:
    """In-process mirror KV spaces (one per rank or stage) fed the manager's batches."""

    def __init__(self, layouts) -> None:
        self.spaces = [
            kvcached.KVSpace(layout, _core.open_host_device(64 << 20), kvcached.KVSpaceOptions()) for layout in layouts
        ]

    def apply(self, manager, ops, to=None) -> None:
        for i in range(len(self.spaces)) if to is None else to:
            manager.acknowledge(i, self.spaces[i].apply(ops))

    def close(self) -> None:
        for space in self.spaces:
            space.close()


def used(budgets) -> list[int]:
    return [b.used_bytes for b in budgets]


def test_every_page_is_charged_on_every_mirror_and_released_per_mirror_on_its_ack():
    budgets = [_core.FixedBudget(1 << 30) for _ in range(3)]
    manager = kvcached.BlockManager(LAYOUT, mirrors=[kvcached.Mirror(b) for b in budgets])
    mirrors = Mirrors([LAYOUT] * 3)
    page = manager.page_id_bytes
    ids = manager.alloc(2 * manager.blocks_per_page)
    assert used(budgets) == [2 * page] * 3
    mirrors.apply(manager, manager.take_page_ops())
    manager.free(ids)
    manager.trim()
    ops = manager.take_page_ops()
    assert len(ops.unmap_pages) == 2
    mirrors.apply(manager, ops, to=[0])
    assert used(budgets) == [0, 2 * page, 2 * page]  # mirror 0 unmapped: its budget only
    assert manager.stats()["pending_pages"] == 2  # not reusable until every mirror acknowledged
    mirrors.apply(manager, ops, to=[2])
    assert used(budgets) == [0, 2 * page, 0] and manager.stats()["pending_pages"] == 2
    mirrors.apply(manager, ops, to=[1])
    assert used(budgets) == [0, 0, 0] and manager.stats()["pending_pages"] == 0
    assert [m["acked_seq"] for m in manager.stats()["mirrors"]] == [ops.seq] * 3
    manager.close()
    mirrors.close()


def test_a_budget_refusing_on_one_mirror_leaves_nothing_taken_on_the_others():
    page = LAYOUT.page_id_bytes
    budgets = [_core.FixedBudget(8 * page), _core.FixedBudget(1 * page), _core.FixedBudget(8 * page)]
    manager = kvcached.BlockManager(LAYOUT, mirrors=[kvcached.Mirror(b) for b in budgets])
    assert manager.available() == manager.blocks_per_page  # the tightest mirror decides
    with pytest.raises(kvcached.OutOfMemoryError, match="mirror 1"):
        manager.alloc_ids([0, LAYOUT.blocks_per_page])  # two pages
    assert used(budgets) == [0, 0, 0]
    assert manager.stats()["mapped_pages"] == 0 and not manager.take_page_ops()
    assert len(manager.alloc(manager.blocks_per_page)) == manager.blocks_per_page
    assert used(budgets) == [page] * 3
    manager.close()
    assert used(budgets) == [0, 0, 0]


def test_pipeline_stages_are_charged_what_a_page_costs_on_them():
    whole = kvcached.KVLayout(4, BLOCK_BYTES, NUM_BLOCKS, page_bytes=PAGE_BYTES, kind="contiguous")  # 4 layers in all
    stages = [
        kvcached.KVLayout(3, BLOCK_BYTES, NUM_BLOCKS, page_bytes=PAGE_BYTES, kind="contiguous"),
        kvcached.KVLayout(1, BLOCK_BYTES, NUM_BLOCKS, page_bytes=PAGE_BYTES, kind="contiguous"),
    ]
    budgets = [_core.FixedBudget(1 << 30) for _ in stages]
    manager = kvcached.BlockManager(whole, mirrors=[kvcached.Mirror(b, s) for b, s in zip(budgets, stages)])
    mirrors = Mirrors(stages)
    ids = manager.alloc(3 * manager.blocks_per_page)
    assert used(budgets) == [3 * stages[0].page_id_bytes, 3 * stages[1].page_id_bytes]
    mirrors.apply(manager, manager.take_page_ops())
    assert [s.mapped_pages for s in mirrors.spaces] == [3, 3]  # same block ids on every stage
    stats = manager.stats()["mirrors"]
    assert [m["page_id_bytes"] for m in stats] == [s.page_id_bytes for s in stages]
    manager.free(ids)
    manager.trim()
    mirrors.apply(manager, manager.take_page_ops())
    assert used(budgets) == [0, 0]
    other = kvcached.KVLayout(1, BLOCK_BYTES, NUM_BLOCKS, page_bytes=2 * PAGE_BYTES, kind="contiguous")
    with pytest.raises(ValueError, match="blocks per page"):
        kvcached.BlockManager(whole, mirrors=[kvcached.Mirror(None, other)])
    manager.close()
    mirrors.close()


def test_memory_awaiting_acknowledgement_is_allocatable_at_once():
    """An unmap not yet acknowledged holds its budget; a new page takes over that charge at
    once (every mirror applies the unmap before the map), so nothing looks missing."""
    page = LAYOUT.page_id_bytes
    budgets = [_core.FixedBudget(2 * page) for _ in range(2)]
    manager = kvcached.BlockManager(LAYOUT, mirrors=[kvcached.Mirror(b) for b in budgets])
    mirrors = Mirrors([LAYOUT] * 2)
    per_page = manager.blocks_per_page
    first = manager.alloc(2 * per_page)
    mirrors.apply(manager, manager.take_page_ops())
    manager.free(first[:per_page])
    manager.trim()
    unmap = manager.take_page_ops()  # not applied anywhere yet
    assert manager.available() == per_page
    again = manager.alloc(per_page)  # no waiting for the mirrors
    assert used(budgets) == [2 * page, 2 * page]  # never more than the budgets hold
    assert manager.page_of(int(again[0])) not in unmap.unmap_pages  # a page id is reused only after the acks
    mirrors.apply(manager, unmap)
    mirrors.apply(manager, manager.take_page_ops())
    assert [s.mapped_pages for s in mirrors.spaces] == [2, 2] and used(budgets) == [2 * page, 2 * page]
    manager.close()
    mirrors.close()


def test_a_lost_mirror_gives_its_budget_back_and_is_no_longer_waited_for():
    budgets = [_core.FixedBudget(1 << 30) for _ in range(2)]
    manager = kvcached.BlockManager(LAYOUT, mirrors=[kvcached.Mirror(b) for b in budgets])
    mirrors = Mirrors([LAYOUT] * 2)
    page = manager.page_id_bytes
    ids = manager.alloc(3 * manager.blocks_per_page)
    mirrors.apply(manager, manager.take_page_ops(), to=[0])  # mirror 1 never answers
    manager.free(ids[: manager.blocks_per_page])
    manager.trim()
    mirrors.apply(manager, manager.take_page_ops(), to=[0])
    ages = [m["oldest_unacked_age_s"] for m in manager.stats()["mirrors"]]
    assert ages[0] == 0 and ages[1] > 0 and manager.stats()["mirrors"][1]["unacked_batches"] == 2
    assert used(budgets) == [2 * page, 3 * page] and manager.stats()["pending_pages"] == 1
    manager.mirror_lost(1)
    assert used(budgets) == [2 * page, 0] and manager.stats()["pending_pages"] == 0
    assert manager.stats()["mirrors"][1]["alive"] is False
    more = manager.alloc(manager.blocks_per_page)  # charged on the live mirror only
    assert used(budgets) == [3 * page, 0]
    manager.acknowledge(1, 1)  # a late acknowledgement from the lost mirror changes nothing
    mirrors.apply(manager, manager.take_page_ops(), to=[0])
    assert used(budgets) == [3 * page, 0]
    manager.free(more)
    manager.close()
    assert used(budgets) == [0, 0]
    mirrors.close()


def test_mirrors_on_the_shared_registry_budget():
    """Two ranks, each registered on its device's registry (here both on the host's):
    charges, per-mirror release, refusal leaving nothing taken, and a lost rank."""
    from kvcached.registry import registry_for

    registry = registry_for("cpu")
    ranks = [registry.register(f"rank-{i}") for i in range(2)]
    page = LAYOUT.page_id_bytes
    manager = kvcached.BlockManager(LAYOUT, mirrors=[kvcached.Mirror(r) for r in ranks])
    mirrors = Mirrors([LAYOUT] * 2)
    try:
        ids = manager.alloc(2 * manager.blocks_per_page)
        assert [r.mapped_bytes for r in ranks] == [2 * page, 2 * page]
        mirrors.apply(manager, manager.take_page_ops())
        registry.set_policy("rank-1", max_bytes=2 * page)  # rank 1 may hold no more
        with pytest.raises(kvcached.OutOfMemoryError):
            manager.alloc(manager.blocks_per_page)
        assert [r.mapped_bytes for r in ranks] == [2 * page, 2 * page]
        manager.free(ids)
        manager.trim()
        ops = manager.take_page_ops()
        mirrors.apply(manager, ops, to=[1])
        assert [r.mapped_bytes for r in ranks] == [2 * page, 0]
        manager.mirror_lost(0)
        assert [r.mapped_bytes for r in ranks] == [0, 0] and manager.stats()["pending_pages"] == 0
    finally:
        manager.close()
        mirrors.close()
        for r in ranks:
            r.unregister()
