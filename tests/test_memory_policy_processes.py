"""The memory policy across real processes, at the pool level: a min holds, priority takes memory back.

Each low-priority holder runs in its own process with a real KVPool on the host backend and
behaves like an engine: an idle one gives its memory back when the device wants it (the
integrations' IdleRelease), a busy one "preempts" (frees blocks in use) while its pool holds
more than the limit in force, which a higher-priority pool's refusal lowers
(docs/memory-policy.md).
"""

from __future__ import annotations

import multiprocessing
import time

import pytest

import kvcached
from kvcached.integration.common.idle import IdleRelease
from kvcached.registry import DeviceRegistry, MemoryPolicy

PAGE_BYTES = 2 * 1024 * 1024
BLOCK_BYTES = 256 * 1024
BLOCKS_PER_PAGE = PAGE_BYTES // BLOCK_BYTES
BUDGET_PAGES = 16
DEVICE = "cpu"
CHILD_TIMEOUT_S = 60.0
# "At once" on a loaded 2-core machine: polls of 10 ms and a worker round of 50 ms, with room to spare.
PROMPT_S = 3.0

spawn = multiprocessing.get_context("spawn")


@pytest.fixture(autouse=True)
def isolated_registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    return tmp_path


def make_pool(budget) -> kvcached.KVPool:
    """One layer, one buffer: a page id is one 2 MiB page of 8 blocks; no reserve kept, so
    what a pool maps is exactly what its blocks need."""
    return kvcached.KVPool(
        num_layers=1,
        block_bytes=BLOCK_BYTES,
        num_buffers=1,
        num_blocks=4 * BUDGET_PAGES * BLOCKS_PER_PAGE,
        page_bytes=PAGE_BYTES,
        device=DEVICE,
        budget=budget,
        min_reserve_pages=0,
        max_reserve_pages=0,
    )


# ---- children (module-level so spawn can find them) -------------------------


def child_idle_low(pages: int, ready, stop, results) -> None:
    """Fills `pages` with blocks (cached prefixes), then idles; gives them back when wanted."""
    budget = DeviceRegistry(DEVICE).register("idle-low", policy=MemoryPolicy(priority=0))
    pool = make_pool(budget)
    held = pool.alloc(pages * BLOCKS_PER_PAGE).tolist()
    idle = IdleRelease(60.0, [budget])  # a long hold: only the device's wanting ends it early
    gave_back = []

    def give_back() -> None:
        pool.free(held)
        pool.trim()
        gave_back.append(time.monotonic())

    assert not idle.due()
    idle.wake_when_due(give_back)
    ready.set()
    stop.wait(CHILD_TIMEOUT_S)
    idle.close()
    results.put((len(gave_back), budget.mapped_bytes))
    pool.close()


def child_busy_low(pages: int, min_pages: int, ready, stop, results, *, priority: int = 0, step_s: float = 0.005):
    """Holds `pages` of blocks in use; while over the limit in force, preempts a page's worth a step."""
    budget = DeviceRegistry(DEVICE).register(
        "busy-low", policy=MemoryPolicy(min_bytes=min_pages * PAGE_BYTES, priority=priority)
    )
    pool = make_pool(budget)
    held = pool.alloc(pages * BLOCKS_PER_PAGE).tolist()
    ready.set()
    lowest_mapped = budget.mapped_bytes
    preempted = 0
    while not stop.is_set():
        limit = budget.external_limit_bytes
        if limit is not None and len(held) * BLOCK_BYTES > limit:
            pool.free(held[-BLOCKS_PER_PAGE:])  # the newest request's blocks: one page
            del held[-BLOCKS_PER_PAGE:]
            preempted += 1
        lowest_mapped = min(lowest_mapped, budget.mapped_bytes)
        time.sleep(step_s)
    lowest_mapped = min(lowest_mapped, budget.mapped_bytes)  # a last free may have been unmapped since
    results.put((lowest_mapped, preempted, len(held) // BLOCKS_PER_PAGE))
    pool.close()


def child_busy_high(pages: int, ready, stop, results) -> None:
    """A busy holder of priority 5 and no min."""
    child_busy_low(pages, 0, ready, stop, results, priority=5)


def child_slow_busy_low(pages: int, ready, stop, results) -> None:
    """A busy holder that frees a page per step of 100 ms: a hand-over of 12 pages outlasts the 1 s window."""
    child_busy_low(pages, 0, ready, stop, results, step_s=0.1)


def child_slower_busy_low(pages: int, ready, stop, results) -> None:
    """A busy holder that frees a page per step of 300 ms: all of it takes about 5 s."""
    child_busy_low(pages, 0, ready, stop, results, step_s=0.3)


def engine_requester(budget):
    """Blocks the way an engine integration holds them: it looks at what is available and
    allocates only when the whole request fits, and otherwise says that it waits."""
    from kvcached.integration.common.blocks import EngineBlocks
    from kvcached.integration.common.engine_layout import engine_layout

    layout = engine_layout(
        num_blocks=4 * BUDGET_PAGES * BLOCKS_PER_PAGE,
        block_bytes=BLOCK_BYTES,
        num_layers=1,
        num_buffers=1,
        page_bytes=PAGE_BYTES,
    )
    return EngineBlocks.local(layout, device=DEVICE, budget=budget, name=budget.name, null_block=False)


def wait_like_an_engine(blocks, need: int, deadline_s: float, stop=None):
    """Each 20 ms step: allocates `need` blocks once they fit, else wants more; the ids, or None."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        if blocks.available() >= need:
            return blocks.alloc(need)
        blocks.want_more()
        time.sleep(0.02)
    return None


def child_waiting_engine(pages: int, ready, stop, results) -> None:
    """A priority-5 engine that waits for `pages` and is killed before it has them."""
    blocks = engine_requester(DeviceRegistry(DEVICE).register("waiting-high", policy=MemoryPolicy(priority=5)))
    ready.set()
    results.put(wait_like_an_engine(blocks, pages * BLOCKS_PER_PAGE, CHILD_TIMEOUT_S, stop) is not None)
    blocks.close()


def child_greedy(priority: int, ready, stop, results) -> None:
    """Takes every page it can, then holds them."""
    budget = DeviceRegistry(DEVICE).register("greedy", policy=MemoryPolicy(priority=priority))
    pool = make_pool(budget)
    pages = 0
    while True:
        try:
            pool.alloc(BLOCKS_PER_PAGE)
        except kvcached.OutOfMemoryError:
            break
        pages += 1
    results.put(pages)
    ready.set()
    stop.wait(CHILD_TIMEOUT_S)
    pool.close()


def start(target, *args):
    ready, stop, results = spawn.Event(), spawn.Event(), spawn.Queue()
    process = spawn.Process(target=target, args=(*args, ready, stop, results))
    process.start()
    assert ready.wait(CHILD_TIMEOUT_S), "the child did not get ready"
    return process, stop, results


def finish(process, stop, results):
    stop.set()
    outcome = results.get(timeout=CHILD_TIMEOUT_S)
    process.join(CHILD_TIMEOUT_S)
    assert process.exitcode == 0
    return outcome


def low_entry(registry: DeviceRegistry, name: str) -> dict:
    return next(entry for entry in registry.entries() if entry["name"] == name)


# ---- the policy ---------------------------------------------------------------


def test_a_min_holds_against_a_higher_priority_that_takes_all_it_can():
    registry = DeviceRegistry(DEVICE, BUDGET_PAGES * PAGE_BYTES)
    guaranteed = registry.register("guaranteed", policy=MemoryPolicy(min_bytes=6 * PAGE_BYTES, priority=0))
    process, stop, results = start(child_greedy, 9)
    try:
        pool = make_pool(guaranteed)
        blocks = pool.alloc(6 * BLOCKS_PER_PAGE)  # at once: no waiting for anybody
        assert guaranteed.mapped_bytes == 6 * PAGE_BYTES
        with pytest.raises(kvcached.OutOfMemoryError):
            pool.alloc(BLOCKS_PER_PAGE)  # beyond its min it is like anyone else
        pool.free(blocks)
        pool.close()
    finally:
        greedy_pages = finish(process, stop, results)
    assert greedy_pages == BUDGET_PAGES - 6, "the higher priority got everything but the min"


def test_a_higher_priority_gets_an_idle_lower_prioritys_memory_at_once():
    registry = DeviceRegistry(DEVICE, BUDGET_PAGES * PAGE_BYTES)
    process, stop, results = start(child_idle_low, BUDGET_PAGES)
    try:
        assert registry.available_bytes == 0
        pool = make_pool(registry.register("high", policy=MemoryPolicy(priority=5)))
        began = time.monotonic()
        blocks = pool.alloc(8 * BLOCKS_PER_PAGE, timeout_s=CHILD_TIMEOUT_S)
        waited_s = time.monotonic() - began
        assert len(blocks) == 8 * BLOCKS_PER_PAGE
        assert waited_s < PROMPT_S, f"an idle holder gives back at once, not after its hold ({waited_s:.2f} s)"
        pool.free(blocks)
        pool.close()
    finally:
        gave_back, mapped_after = finish(process, stop, results)
    assert (gave_back, mapped_after) == (1, 0), "woken once, long before its 60 s hold, and gave everything"


def test_a_busy_lower_priority_shrinks_to_what_is_asked_never_below_its_min_and_is_freed_after():
    registry = DeviceRegistry(DEVICE, BUDGET_PAGES * PAGE_BYTES)
    min_pages = 4
    process, stop, results = start(child_busy_low, BUDGET_PAGES, min_pages)
    try:
        high = registry.register("high", policy=MemoryPolicy(priority=5))
        pool = make_pool(high)
        began = time.monotonic()
        blocks = pool.alloc(8 * BLOCKS_PER_PAGE, timeout_s=CHILD_TIMEOUT_S)
        first_s = time.monotonic() - began
        assert first_s < PROMPT_S, f"took {first_s:.2f} s"
        assert low_entry(registry, "busy-low")["mapped_bytes"] == (BUDGET_PAGES - 8) * PAGE_BYTES, "just enough"
        # Everything but the low priority's min: it shrinks to the min and not a byte more.
        more = pool.alloc((BUDGET_PAGES - 8 - min_pages) * BLOCKS_PER_PAGE, timeout_s=CHILD_TIMEOUT_S)
        assert low_entry(registry, "busy-low")["mapped_bytes"] == min_pages * PAGE_BYTES
        with pytest.raises(kvcached.OutOfMemoryError):
            pool.alloc(BLOCKS_PER_PAGE, timeout_s=0.3)
        assert low_entry(registry, "busy-low")["mapped_bytes"] == min_pages * PAGE_BYTES
        # The pressure ends: the shrink is no longer in force (within the one-second window).
        deadline = time.monotonic() + PROMPT_S
        while low_entry(registry, "busy-low")["reclaim_target_bytes"] is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert low_entry(registry, "busy-low")["reclaim_target_bytes"] is None
        pool.free(blocks)
        pool.free(more)
        pool.close()
    finally:
        lowest_mapped, preempted, kept_pages = finish(process, stop, results)
    assert lowest_mapped == min_pages * PAGE_BYTES and kept_pages == min_pages
    assert preempted == BUDGET_PAGES - min_pages


def test_a_min_registered_while_a_busy_higher_priority_holds_everything_is_claimed_from_it():
    registry = DeviceRegistry(DEVICE, BUDGET_PAGES * PAGE_BYTES)
    process, stop, results = start(child_busy_high, BUDGET_PAGES)
    min_pages = 6
    try:
        late = registry.register(
            "late", policy=MemoryPolicy(min_bytes=min_pages * PAGE_BYTES, priority=0)
        )  # accepted: the mins fit
        pool = make_pool(late)
        began = time.monotonic()
        blocks = pool.alloc(min_pages * BLOCKS_PER_PAGE, timeout_s=CHILD_TIMEOUT_S)
        waited_s = time.monotonic() - began
        assert waited_s < PROMPT_S, f"a min is there to be claimed ({waited_s:.2f} s)"
        assert low_entry(registry, "busy-low")["reclaim_target_bytes"] is None, "the claim ends at the min"
        with pytest.raises(kvcached.OutOfMemoryError):
            pool.alloc(BLOCKS_PER_PAGE, timeout_s=0.3)  # beyond its min a higher priority owes it nothing
        pool.free(blocks)
        pool.close()
    finally:
        lowest_mapped, preempted, kept_pages = finish(process, stop, results)
    assert lowest_mapped == (BUDGET_PAGES - min_pages) * PAGE_BYTES, "it gave what the min is owed, no more"
    assert preempted == min_pages


def test_a_request_no_giving_back_could_meet_fails_at_once_and_asks_nobody():
    registry = DeviceRegistry(DEVICE, BUDGET_PAGES * PAGE_BYTES)
    min_pages = 4
    process, stop, results = start(child_busy_low, BUDGET_PAGES, min_pages)
    try:
        pool = make_pool(registry.register("high", policy=MemoryPolicy(priority=5)))
        for pages in (BUDGET_PAGES + 1, BUDGET_PAGES - min_pages + 1):  # the budget; the budget less the min
            began = time.monotonic()
            with pytest.raises(kvcached.OutOfMemoryError, match="could never grant more than 12 more page"):
                pool.alloc(pages * BLOCKS_PER_PAGE, timeout_s=10.0)
            assert time.monotonic() - began < PROMPT_S, "refused at once, not after its timeout"
            entries = {entry["name"]: entry for entry in registry.entries()}
            assert entries["high"]["wanted_bytes"] == 0 and entries["busy-low"]["reclaim_target_bytes"] is None
        assert low_entry(registry, "busy-low")["mapped_bytes"] == BUDGET_PAGES * PAGE_BYTES
        pool.close()
    finally:
        lowest_mapped, preempted, _ = finish(process, stop, results)
    assert (lowest_mapped, preempted) == (BUDGET_PAGES * PAGE_BYTES, 0), "nobody was asked to shrink"


def test_an_engine_waiting_longer_than_the_window_gets_all_it_needs_from_a_slow_busy_holder():
    registry = DeviceRegistry(DEVICE, BUDGET_PAGES * PAGE_BYTES)
    need_pages = 12
    process, stop, results = start(child_slow_busy_low, BUDGET_PAGES)
    try:
        blocks = engine_requester(registry.register("waiting-high", policy=MemoryPolicy(priority=5)))
        began = time.monotonic()
        ids = wait_like_an_engine(blocks, need_pages * BLOCKS_PER_PAGE, CHILD_TIMEOUT_S)
        waited_s = time.monotonic() - began
        assert ids is not None, "the burst never reached its need"
        assert waited_s > 1.0, f"the holder gives a page per 100 ms: longer than the window ({waited_s:.2f} s)"
        # It stopped asking: the shrink ends within the window.
        deadline = time.monotonic() + PROMPT_S
        while low_entry(registry, "busy-low")["reclaim_target_bytes"] is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert low_entry(registry, "busy-low")["reclaim_target_bytes"] is None
        blocks.free(ids)
        blocks.close()
    finally:
        lowest_mapped, _, _ = finish(process, stop, results)
    assert lowest_mapped >= (BUDGET_PAGES - need_pages - 1) * PAGE_BYTES, "asked for what was missing, not all"


def test_a_shrink_asked_by_a_waiting_engine_stays_while_it_waits_and_lapses_when_it_dies():
    registry = DeviceRegistry(DEVICE, BUDGET_PAGES * PAGE_BYTES)
    holder, holder_stop, holder_results = start(child_slower_busy_low, BUDGET_PAGES)
    waiter, waiter_stop, _ = start(child_waiting_engine, BUDGET_PAGES)  # the holder's all: it waits seconds
    try:
        began = time.monotonic()
        deadline = began + 15.0  # 4 pages take 1.2 s from that holder
        while time.monotonic() < deadline:  # past the window, while the engine waits, the holder goes on giving
            low = low_entry(registry, "busy-low")
            given = BUDGET_PAGES - low["mapped_bytes"] // PAGE_BYTES
            if time.monotonic() - began > 1.5 and given >= 4 and low["reclaim_target_bytes"] is not None:
                break
            time.sleep(0.05)
        assert time.monotonic() < deadline, "the shrink lapsed while the engine still waited"
        waiter.kill()
        waiter.join(CHILD_TIMEOUT_S)
        killed = time.monotonic()
        while low_entry(registry, "busy-low")["reclaim_target_bytes"] is not None and time.monotonic() < killed + 5:
            time.sleep(0.05)
        lapsed_s = time.monotonic() - killed
        assert lapsed_s < PROMPT_S, f"a dead requester's shrink lapses within the window ({lapsed_s:.2f} s)"
    finally:
        waiter_stop.set()
        if waiter.is_alive():
            waiter.kill()
        finish(holder, holder_stop, holder_results)
