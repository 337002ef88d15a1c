"""The per-device registry across processes and threads: one budget, racing users, nothing a dead one can break."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

import kvcached
from kvcached.registry import DeviceRegistry, registry_for

PAGE_BYTES = 2 * 1024 * 1024
DEVICE = "cpu"
# Generous bound for a spawned child to start and reach a rendezvous point.
CHILD_TIMEOUT_S = 60.0

spawn = multiprocessing.get_context("spawn")


@pytest.fixture(autouse=True)
def isolated_registry_dir(tmp_path, monkeypatch):
    """Every test gets its own registry directory; spawned children inherit it."""
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    return tmp_path


def make_registry(pages: int) -> DeviceRegistry:
    return DeviceRegistry(DEVICE, pages * PAGE_BYTES)


# ---- children (module-level so spawn can find them) -------------------------


def child_open(budget_bytes: int, ready, results) -> None:
    ready.wait()
    results.put(DeviceRegistry(DEVICE, budget_bytes).budget_bytes)


def child_grab_all(name: str, start, results) -> None:
    budget = DeviceRegistry(DEVICE).register(name)
    start.wait()
    taken = 0
    while budget.try_acquire(PAGE_BYTES):
        taken += 1
    results.put(taken)
    start.wait()  # hold the pages until every child has counted


def child_churn(name: str, operations: int, seed: int, start, results) -> None:
    registry = DeviceRegistry(DEVICE)
    budget = registry.register(name)
    rng = random.Random(seed)
    held = violations = granted = 0
    start.wait()
    for _ in range(operations):
        if held and rng.random() < 0.5:
            pages = rng.randint(1, held)
            budget.release(pages * PAGE_BYTES)
            held -= pages
        else:
            pages = rng.randint(1, 3)
            if budget.try_acquire(pages * PAGE_BYTES):
                held += pages
                granted += 1
        # Mapped bytes only grow under the lock, so any read above budget is a real breach.
        if registry.mapped_bytes > registry.budget_bytes:
            violations += 1
    results.put((violations, granted, held * PAGE_BYTES == budget.mapped_bytes))
    budget.release(held * PAGE_BYTES)


def child_idle_holder(ready, stop) -> None:
    """Grabs the whole budget as reserve, then trims whenever someone else is refused."""
    budget = DeviceRegistry(DEVICE).register("holder")
    held = 0
    while budget.try_acquire(PAGE_BYTES):
        held += 1
    ready.set()
    while not stop.is_set():
        if held and budget.pressure_bytes > 0:
            give_back = max(1, held // 2)
            budget.release(give_back * PAGE_BYTES)
            held -= give_back
        time.sleep(0.005)


def child_take_then_hold_lock(pages: int, locked) -> None:
    registry = DeviceRegistry(DEVICE)
    budget = registry.register("doomed")
    assert budget.try_acquire(pages * PAGE_BYTES)
    registry._hold_lock_for_test()
    locked.set()
    time.sleep(CHILD_TIMEOUT_S)


def child_take_and_wait(pages: int, ready) -> None:
    budget = DeviceRegistry(DEVICE).register("short-lived")
    assert budget.try_acquire(pages * PAGE_BYTES)
    ready.set()
    time.sleep(CHILD_TIMEOUT_S)


def kill_and_keep_zombie(process) -> None:
    """SIGKILL without reaping: the child stays a zombie, which must already count as dead."""
    os.kill(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        with open(f"/proc/{process.pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.01)
    raise AssertionError("child did not die")


# ---- many processes ---------------------------------------------------------


def test_simultaneous_first_users_agree_on_one_registry():
    ready, results = spawn.Event(), spawn.Queue()
    children = [spawn.Process(target=child_open, args=((index + 1) * PAGE_BYTES, ready, results)) for index in range(6)]
    for child in children:
        child.start()
    ready.set()
    budgets = {results.get(timeout=CHILD_TIMEOUT_S) for _ in children}
    for child in children:
        child.join(CHILD_TIMEOUT_S)
        assert child.exitcode == 0
    assert len(budgets) == 1, "exactly one creator won; everybody sees its budget"
    assert DeviceRegistry(DEVICE).budget_bytes in budgets


def test_processes_racing_for_the_last_pages_never_take_more_than_the_budget():
    budget_pages = 37
    make_registry(budget_pages)
    start, results = spawn.Barrier(5), spawn.Queue()
    children = [spawn.Process(target=child_grab_all, args=(f"grabber-{i}", start, results)) for i in range(4)]
    for child in children:
        child.start()
    start.wait(CHILD_TIMEOUT_S)
    taken = [results.get(timeout=CHILD_TIMEOUT_S) for _ in children]
    assert sum(taken) == budget_pages
    assert DeviceRegistry(DEVICE).mapped_bytes == budget_pages * PAGE_BYTES
    start.wait(CHILD_TIMEOUT_S)
    for child in children:
        child.join(CHILD_TIMEOUT_S)
        assert child.exitcode == 0


def test_concurrent_churn_never_oversubscribes_and_accounts_exactly():
    registry = make_registry(20)
    workers, operations = 6, 3000
    start, results = spawn.Barrier(workers), spawn.Queue()
    children = [
        spawn.Process(target=child_churn, args=(f"churn-{i}", operations, i, start, results)) for i in range(workers)
    ]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=CHILD_TIMEOUT_S * 2) for _ in children]
    for child in children:
        child.join(CHILD_TIMEOUT_S)
        assert child.exitcode == 0
    assert all(violations == 0 for violations, _, _ in outcomes)
    assert all(accounted for _, _, accounted in outcomes), "each entry's mapped bytes match what it holds"
    assert sum(granted for _, granted, _ in outcomes) > workers, "the budget really was contended and shared"
    assert registry.mapped_bytes == 0 and registry.entries() == []


def test_memory_moves_from_an_idle_instance_to_a_busy_one():
    registry = make_registry(16)
    ready, stop = spawn.Event(), spawn.Event()
    holder = spawn.Process(target=child_idle_holder, args=(ready, stop))
    holder.start()
    try:
        assert ready.wait(CHILD_TIMEOUT_S)
        assert registry.available_bytes == 0
        busy = registry.register("busy")
        wanted_pages, got = 8, 0
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while got < wanted_pages and time.monotonic() < deadline:
            if busy.try_acquire(PAGE_BYTES):
                got += 1
            else:
                time.sleep(0.002)
        assert got == wanted_pages, "the idle holder gave its reserve back under pressure"
        assert registry.mapped_bytes <= registry.budget_bytes
    finally:
        stop.set()
        holder.join(CHILD_TIMEOUT_S)
    assert holder.exitcode == 0


def test_process_killed_while_holding_the_lock_leaves_no_lock_held():
    registry = make_registry(10)
    locked = spawn.Event()
    child = spawn.Process(target=child_take_then_hold_lock, args=(6, locked))
    child.start()
    assert locked.wait(CHILD_TIMEOUT_S)
    kill_and_keep_zombie(child)
    try:
        # Each of these takes the lock; with a plain mutex they would hang (or time out).
        started = time.monotonic()
        survivor = registry.register("survivor")
        assert time.monotonic() - started < 1.0
        assert [entry["name"] for entry in registry.entries()] == ["survivor"], "register reclaims the dead"
        assert registry.mapped_bytes == 0, "the dead child's pages count as free"
        assert survivor.try_acquire(10 * PAGE_BYTES)
        registry.budget_bytes = 10 * PAGE_BYTES
        assert registry.clean_stale() == 0
    finally:
        child.join(CHILD_TIMEOUT_S)
    assert child.exitcode == -signal.SIGKILL


def test_dead_entry_is_visible_until_cleaned_then_its_memory_is_free():
    registry = make_registry(10)
    ready = spawn.Event()
    child = spawn.Process(target=child_take_and_wait, args=(7, ready))
    child.start()
    assert ready.wait(CHILD_TIMEOUT_S)
    kill_and_keep_zombie(child)
    (entry,) = registry.entries()
    assert entry["pid"] == child.pid and not entry["alive"]
    assert registry.mapped_bytes == 7 * PAGE_BYTES, "counted until reclaimed"
    assert registry.clean_stale() == 1
    assert registry.entries() == [] and registry.available_bytes == 10 * PAGE_BYTES
    child.join(CHILD_TIMEOUT_S)


def test_refused_request_reclaims_a_dead_process_memory_by_itself():
    registry = make_registry(10)
    engine = registry.register("engine")  # registered first, so nothing cleans on the child's behalf
    ready = spawn.Event()
    child = spawn.Process(target=child_take_and_wait, args=(10, ready))
    child.start()
    assert ready.wait(CHILD_TIMEOUT_S)
    kill_and_keep_zombie(child)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not engine.try_acquire(4 * PAGE_BYTES):  # a refusal rescans at most every 100 ms
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert [entry["name"] for entry in registry.entries()] == ["engine"]
    child.join(CHILD_TIMEOUT_S)


def child_forked_copy_exits(budget) -> None:
    budget.unregister()  # the inherited handle is not this process's registration


def test_a_forked_child_cannot_unregister_its_parent():
    registry = make_registry(4)
    budget = registry.register("parent")
    child = multiprocessing.get_context("fork").Process(target=child_forked_copy_exits, args=(budget,))
    child.start()
    child.join(CHILD_TIMEOUT_S)
    assert child.exitcode == 0
    assert budget.registered and [entry["name"] for entry in registry.entries()] == ["parent"]


# ---- threads, and pools coming and going ----------------------------------


def test_threads_and_a_reader_share_one_registry_exactly():
    registry = make_registry(32)
    errors: list[BaseException] = []
    stop = threading.Event()

    def engine(index: int) -> None:
        try:
            for cycle in range(40):
                with registry.register(f"thread-{index}-{cycle}") as budget:
                    held = sum(budget.try_acquire(PAGE_BYTES) for _ in range(3))
                    budget.release(held * PAGE_BYTES)
        except BaseException as error:  # reported below
            errors.append(error)

    def reader() -> None:
        while not stop.is_set():
            try:
                assert registry.mapped_bytes <= registry.budget_bytes
                registry.set_policy("nobody", max_bytes=PAGE_BYTES)
                registry.entries()
            except BaseException as error:
                errors.append(error)
                return

    threads = [threading.Thread(target=engine, args=(index,)) for index in range(6)]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CHILD_TIMEOUT_S)
    stop.set()
    watcher.join(CHILD_TIMEOUT_S)
    assert errors == []
    assert registry.mapped_bytes == 0 and registry.entries() == []


def _resources() -> tuple[int, int, int]:
    """Open descriptors, memory mappings and threads of this process."""
    maps = Path("/proc/self/maps").read_text().count("\n")
    return len(os.listdir("/proc/self/fd")), maps, len(os.listdir("/proc/self/task"))


def test_pool_create_close_cycles_leave_descriptors_mappings_and_threads_flat():
    def cycle() -> None:
        with kvcached.KVPool(
            num_layers=2, block_bytes=64 << 10, num_blocks=64, device="cpu", page_bytes=256 << 10
        ) as pool:
            pool.free(pool.alloc(8))

    for _ in range(20):  # warm up: lazily created singletons, allocator arenas
        cycle()
    before = _resources()
    for _ in range(200):
        cycle()
    after = _resources()
    assert after[0] == before[0], "file descriptors"
    assert after[2] == before[2], "threads"
    assert after[1] <= before[1] + 2, f"mappings grew from {before[1]} to {after[1]}"
    assert registry_for(DEVICE).entries() == []
