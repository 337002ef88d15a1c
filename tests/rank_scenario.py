"""Tensor-parallel ranks on one or several GPUs: the scenario shared by the GPU tests and their emulated twins.

One process (the test) decides blocks with a device-less BlockManager; each
rank is another process (tests/rank_worker.py) holding a KV space on the GPU
it sees under its own visible-devices mask, and each rank's budget is its own
entry in the registry of the physical GPU it uses. The test process opens those
registries by their physical identity and never opens a device itself.

What differs between a real GPU and the driver emulation is only where the
processes run (rank_processes.Machine) and how a rank touches memory (torch
kernels or host views, chosen inside rank_worker), so the assertions cannot
drift apart.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import kvcached
from kvcached.registry import DeviceRegistry
from rank_processes import Machine, Worker

# 2 layers x K,V of 256 KiB blocks on 2 MiB pages: 8 blocks a page, a page id is 8 MiB on every rank.
LAYOUT = kvcached.KVLayout(2, 256 << 10, 256, page_bytes=2 << 20, kind="contiguous")
PAGE_ID_BYTES = LAYOUT.page_id_bytes
BLOCKS_PER_PAGE = LAYOUT.blocks_per_page


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a rank runs: its process's visible-devices list (None: unset) and the index it uses there."""

    mask: Optional[str]
    ordinal: int

    @property
    def physical_index(self) -> int:
        """The physical GPU (its index with no mask) this rank uses."""
        return int(self.mask.split(",")[self.ordinal]) if self.mask is not None else self.ordinal

    def __str__(self) -> str:
        return f"{'unset' if self.mask is None else self.mask}:{self.ordinal}"


# Two ranks on one GPU, seen without a mask and with "0": one registry, both charged.
SAME_GPU = (Placement(None, 0), Placement("0", 0))
# Two ranks on physical GPU 1, seen under different masks and indices: still one registry.
SAME_GPU_REORDERED = (Placement("1", 0), Placement("0,1", 1))
# Two ranks on two GPUs: the usual cuda:0 / cuda:1, and the same GPUs seen in the other order.
TWO_GPUS = (Placement(None, 0), Placement(None, 1))
TWO_GPUS_REORDERED = (Placement("1,0", 1), Placement("1,0", 0))
PLACEMENTS = {
    "same_gpu": SAME_GPU,
    "same_gpu_reordered": SAME_GPU_REORDERED,
    "two_gpus": TWO_GPUS,
    "two_gpus_reordered": TWO_GPUS_REORDERED,
}


def gpus_needed(placements: Sequence[Placement]) -> int:
    """How many GPUs the placements' masks and indices refer to."""
    return 1 + max(p.physical_index if p.mask is None else max(int(i) for i in p.mask.split(",")) for p in placements)


# ---- ranks ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Rank:
    """One rank as the deciding process knows it."""

    index: int
    placement: Placement
    worker: Worker
    local_device: str
    identity: str
    pid: int
    registry: DeviceRegistry
    name: str = ""
    budget: Any = None

    def entry(self) -> dict[str, Any]:
        (entry,) = [e for e in self.registry.entries() if e["name"] == self.name]
        return entry


def start_ranks(machine: Machine, placements: Sequence[Placement], registry_dir: Path) -> list[Rank]:
    """Starts one process per placement and checks that each names the GPU it uses by the
    physical identity behind its index. Each scenario then opens the ranks' KV spaces."""
    physical = machine.physical_identities()
    workers = [Worker(machine, p.mask, registry_dir) for p in placements]  # all start at once
    ranks = []
    try:
        for index, (placement, worker) in enumerate(zip(placements, workers)):
            seen = worker.call("identify", machine.backend)
            device = seen["devices"][placement.ordinal]
            expected = physical[placement.physical_index]
            assert device["identity"] == expected, (
                f"rank {index} ({placement}) uses {device['local']}, which should be physical GPU "
                f"{placement.physical_index} ({expected}), but names it {device['identity']}"
            )
            registry = DeviceRegistry(expected)  # created by the rank; opened here by name only
            assert registry.path == device["path"], "the rank and this process use different registry files"
            ranks.append(Rank(index, placement, worker, device["local"], expected, seen["pid"], registry))
    except BaseException:
        for worker in workers:
            worker.close()
        raise
    return ranks


def stop_ranks(ranks: Sequence[Rank]) -> list[dict[str, Any]]:
    """Closes every rank's space; returns what each device still counted afterwards."""
    results = []
    for rank in ranks:
        results.append(rank.worker.close())
    return results


def register_ranks(ranks: Sequence[Rank], tag: str) -> None:
    """A fresh KV space on every rank (for a new block manager) and each rank's budget: an
    entry in its GPU's registry, in the rank's name, pid and device index."""
    for rank in ranks:
        opened = rank.worker.call("open_space", LAYOUT, rank.local_device)
        assert (opened["identity"], opened["registry_path"]) == (rank.identity, rank.registry.path), (
            f"rank {rank.index}'s space is on {opened['identity']} ({opened['registry_path']}), "
            f"expected {rank.identity} ({rank.registry.path})"
        )
        assert (opened["mapped_pages"], opened["page_bytes_created"]) == (0, 0), f"rank {rank.index}: {opened}"
        rank.name = f"{tag}-rank{rank.index}"
        rank.budget = rank.registry.register(rank.name, pid=rank.pid, local_device=rank.local_device)


def unregister_ranks(ranks: Sequence[Rank]) -> None:
    for rank in ranks:
        if rank.budget is not None:
            rank.budget.unregister()
            rank.budget = None


class Ledger:
    """What every rank's registry entry and every registry must read at each step, and the record of it."""

    def __init__(self, ranks: Sequence[Rank]) -> None:
        self.ranks = list(ranks)
        self.charged_pages = [0] * len(ranks)  # decided and not yet given back after the rank's acknowledgement
        self.mapped_pages = [0] * len(ranks)  # what the rank's space maps
        self.lines: list[str] = []

    def charge(self, pages: int) -> None:
        self.charged_pages = [c + pages for c in self.charged_pages]

    def check(self, step: str) -> None:
        """Every entry reads its rank's charge; every registry the sum of its ranks' charges."""
        readings = []
        for i, rank in enumerate(self.ranks):
            mapped = rank.entry()["mapped_bytes"]
            readings.append(f"rank{i} {mapped >> 20} MiB")
            assert mapped == self.charged_pages[i] * PAGE_ID_BYTES, (
                f"{step}: rank {i}'s entry on {rank.identity} reads {mapped} bytes, "
                f"expected {self.charged_pages[i]} page(s) of {PAGE_ID_BYTES}"
            )
        for registry, members in self.by_registry().items():
            expected = sum(self.charged_pages[i] for i in members) * PAGE_ID_BYTES
            actual = self.ranks[members[0]].registry.mapped_bytes
            readings.append(f"{registry[:17]}… {actual >> 20} MiB")
            assert actual == expected, f"{step}: registry {registry} reads {actual} bytes, expected {expected}"
        self.lines.append(f"{step:<40} " + ", ".join(readings))

    def by_registry(self) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, rank in enumerate(self.ranks):
            groups.setdefault(rank.identity, []).append(i)
        return groups

    def applied(self, i: int, reply: dict[str, Any], step: str) -> None:
        """The rank's own account of what it maps: its space and its device's allocations."""
        assert reply["mapped_pages"] == self.mapped_pages[i], f"{step}: rank {i} maps {reply['mapped_pages']} pages"
        assert reply["page_bytes_created"] == self.mapped_pages[i] * PAGE_ID_BYTES, (
            f"{step}: rank {i}'s device holds {reply['page_bytes_created']} bytes of pages, "
            f"expected {self.mapped_pages[i]} page(s)"
        )


def _apply_everywhere(
    manager: Any,
    ranks: Sequence[Rank],
    ledger: Ledger,
    ops: Any,
    step: str,
    unmapped_pages: int = 0,
    write: Optional[tuple[list[int], int]] = None,
) -> None:
    """Each rank in turn applies ``ops`` and acknowledges it; the ledger is checked after each.
    With ``write``, kernels writing those blocks are still running when the batch arrives."""
    mapped_pages = len(ops.map_pages) - len(ops.unmap_pages)
    for i, rank in enumerate(ranks):
        if write is None:
            reply = rank.worker.call("apply", ops)
        else:
            reply = rank.worker.call("write_then_apply", write[0], write[1] + i, ops)
        ledger.mapped_pages[i] += mapped_pages
        ledger.applied(i, reply, f"{step}, rank {i} applied")
        manager.acknowledge(i, reply["seq"])
        ledger.charged_pages[i] -= unmapped_pages
        ledger.check(f"{step}, rank {i} acknowledged")


def _whole_pages(manager: Any, blocks: list[int], pages: int) -> list[int]:
    """The blocks of the first ``pages`` pages holding ``blocks`` (whole pages: nothing else lives there)."""
    first = sorted({manager.page_of(b) for b in blocks})[:pages]
    chosen = [b for b in blocks if manager.page_of(b) in first]
    assert len(chosen) == pages * BLOCKS_PER_PAGE, "the blocks do not fill whole pages"
    return chosen


def check_budgets_follow_every_step(ranks: Sequence[Rank], rounds: int = 3) -> list[str]:
    """Grows and shrinks a cache mirrored on every rank; every registry entry reads exactly
    what its rank holds after every decision, apply and acknowledgement; unmaps arrive while
    kernels still write; data survives where it must and unmapped blocks read zeros; all
    returns to zero. Returns the ledger's record."""
    register_ranks(ranks, "tp")
    ledger = Ledger(ranks)
    manager = kvcached.BlockManager(
        LAYOUT, kvcached.BlockManagerOptions(), mirrors=[kvcached.Mirror(rank.budget) for rank in ranks]
    )
    try:
        ledger.check("registered")
        live: list[int] = []
        for round_ in range(rounds):
            value = 16 * round_ + 1
            new = manager.alloc(3 * BLOCKS_PER_PAGE).tolist()
            ops = manager.take_page_ops()
            assert len(ops.map_pages) == 3 and not ops.unmap_pages
            ledger.charge(3)
            ledger.check(f"round {round_}: alloc 3 pages decided")
            _apply_everywhere(manager, ranks, ledger, ops, f"round {round_}: map")
            for i, rank in enumerate(ranks):
                rank.worker.call("write", new, value + i)
                assert rank.worker.call("read", new) == [[value + i]] * len(new), f"rank {i} lost its writes"
            live += new

            freed = _whole_pages(manager, live, 2)
            kept = [b for b in live if b not in freed]
            manager.free(freed)
            manager.trim()
            ops = manager.take_page_ops()
            assert len(ops.unmap_pages) == 2 and not ops.map_pages
            ledger.check(f"round {round_}: unmap 2 pages decided")  # held until each rank acknowledges
            _apply_everywhere(
                manager,
                ranks,
                ledger,
                ops,
                f"round {round_}: unmap while writing",
                unmapped_pages=2,
                write=(live, value + 8),
            )
            for i, rank in enumerate(ranks):
                assert rank.worker.call("read", kept) == [[value + 8 + i]] * len(kept), f"rank {i}: kept blocks changed"
                assert rank.worker.call("read", freed[::BLOCKS_PER_PAGE]) == [[0]] * 2, (
                    f"rank {i}: unmapped blocks must read zeros (zero backing)"
                )
            live = kept

        manager.free(live)
        manager.trim()
        ops = manager.take_page_ops()
        assert len(ops.unmap_pages) == len(set(manager.page_of(b) for b in live)) and not ops.map_pages
        _apply_everywhere(manager, ranks, ledger, ops, "end: unmap everything", unmapped_pages=len(ops.unmap_pages))
        assert ledger.charged_pages == [0] * len(ranks) and ledger.mapped_pages == [0] * len(ranks)
        assert manager.stats()["held_bytes"] == 0
    finally:
        manager.close()
        unregister_ranks(ranks)
    for rank in ranks:
        assert rank.registry.mapped_bytes == 0 and rank.registry.entries() == []
    return ledger.lines


def check_refusal_leaves_nothing_taken(ranks: Sequence[Rank]) -> list[str]:
    """A rank without room makes the allocation fail for every rank, with nothing taken
    anywhere and nothing to apply: a limit on one rank's entry (``kvctl set-limit``), and a
    device whose budget cannot hold one more page for each of its ranks (with two ranks on
    one GPU, the first is charged and given back when the second is refused)."""
    register_ranks(ranks, "full")
    ledger = Ledger(ranks)
    manager = kvcached.BlockManager(
        LAYOUT, kvcached.BlockManagerOptions(), mirrors=[kvcached.Mirror(rank.budget) for rank in ranks]
    )
    try:
        first = manager.alloc(BLOCKS_PER_PAGE).tolist()
        ledger.charge(1)
        _apply_everywhere(manager, ranks, ledger, manager.take_page_ops(), "one page mapped")
        for j, rank in enumerate(ranks):
            rank.registry.set_policy(rank.name, max_bytes=PAGE_ID_BYTES)  # rank j may hold no more than it has
            _refused(manager, ledger, "limit", f"rank {j} at its limit")
            rank.registry.set_policy(rank.name, clear_max=True)

            on_device = ledger.by_registry()[rank.identity]
            budget_bytes = rank.registry.budget_bytes
            # Room for one page fewer than the device's ranks need for one more page each.
            rank.registry.budget_bytes = rank.registry.mapped_bytes + (len(on_device) - 1) * PAGE_ID_BYTES
            try:
                names = "mirror (" + "|".join(str(i) for i in on_device) + ")"
                _refused(manager, ledger, names, f"rank {j}'s device without room")
            finally:
                rank.registry.budget_bytes = budget_bytes
        more = manager.alloc(2 * BLOCKS_PER_PAGE).tolist()
        ledger.charge(2)
        ledger.check("room again: 2 pages decided")
        _apply_everywhere(manager, ranks, ledger, manager.take_page_ops(), "room again: map")
        manager.free(first + more)
        manager.trim()
        _apply_everywhere(manager, ranks, ledger, manager.take_page_ops(), "end: unmap everything", unmapped_pages=3)
    finally:
        manager.close()
        unregister_ranks(ranks)
    for rank in ranks:
        assert rank.registry.mapped_bytes == 0
    return ledger.lines


def _refused(manager: Any, ledger: Ledger, reason: str, step: str) -> None:
    """Asking for one more page fails, saying ``reason``, and changes no budget."""
    try:
        manager.alloc(BLOCKS_PER_PAGE)
    except kvcached.OutOfMemoryError as error:
        assert re.search(reason, str(error)), f"{step}: the refusal should say {reason!r}: {error}"
    else:
        raise AssertionError(f"{step}: the allocation should have been refused")
    assert not manager.take_page_ops(), f"{step}: a refused allocation left page ops to apply"
    ledger.check(f"{step}: refused, nothing taken")


def finish(ranks: Sequence[Rank]) -> None:
    """Stops the ranks: every device gives back every byte it created and mapped."""
    for i, left in enumerate(stop_ranks(ranks)):
        assert left == {"mapped_pages": 0, "device_mapped_bytes": 0, "device_created_bytes": 0}, (i, left)
