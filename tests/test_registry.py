"""The per-device registry: one budget shared by several processes, and nothing a dead one can break."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest

from kvcached import _core
from kvcached.errors import KvcachedError
from kvcached.registry import (
    DEFAULT_GPU_UTILIZATION,
    DeviceRegistry,
    RegistryNotFoundError,
    default_budget_bytes,
    format_bytes,
    known_devices,
    parse_bytes,
    registry_for,
)

PAGE_BYTES = 2 * 1024 * 1024
DEVICE = "cpu"
# Made-up physical identities, shaped like nvidia-smi's.
GPU_A = "cuda-GPU-0a1b2c3d-0000-4000-8000-00000000000a"
GPU_B = "cuda-GPU-0a1b2c3d-0000-4000-8000-00000000000b"
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


# ---- one process ------------------------------------------------------------


def test_first_user_creates_registry_and_later_users_keep_its_budget(isolated_registry_dir):
    first = make_registry(8)
    second = DeviceRegistry(DEVICE, 99 * PAGE_BYTES)
    assert second.budget_bytes == first.budget_bytes == 8 * PAGE_BYTES
    assert first.path == str(isolated_registry_dir / "kvcached-cpu") == DeviceRegistry.segment_path(DEVICE)
    assert known_devices() == [DEVICE]
    assert list(isolated_registry_dir.iterdir()) == [isolated_registry_dir / "kvcached-cpu"]


def test_missing_registry_without_budget_is_file_not_found():
    with pytest.raises(FileNotFoundError, match="no kvcached registry"):
        DeviceRegistry(GPU_A)
    assert issubclass(RegistryNotFoundError, FileNotFoundError)
    assert issubclass(RegistryNotFoundError, KvcachedError)


def test_foreign_file_is_refused_not_misread_nor_replaced(isolated_registry_dir):
    size = os.path.getsize(make_registry(1).path)
    foreign = isolated_registry_dir / f"kvcached-{GPU_A}"
    foreign.write_bytes(b"\x01" * size)
    foreign.chmod(0o600)
    for budget in (None, PAGE_BYTES):
        with pytest.raises(RuntimeError, match="not a kvcached registry"):
            DeviceRegistry(GPU_A, budget)
    (isolated_registry_dir / f"kvcached-{GPU_B}").write_bytes(b"short")
    (isolated_registry_dir / f"kvcached-{GPU_B}").chmod(0o600)
    with pytest.raises(RuntimeError, match="not a kvcached registry"):
        DeviceRegistry(GPU_B, PAGE_BYTES)
    assert foreign.read_bytes() == b"\x01" * size, "never rewritten"


def test_try_acquire_respects_device_budget_and_own_limit():
    registry = make_registry(4)
    budget = registry.register("engine", limit_bytes=3 * PAGE_BYTES)
    assert budget.available_bytes == 3 * PAGE_BYTES
    assert budget.try_acquire(2 * PAGE_BYTES)
    assert not budget.try_acquire(2 * PAGE_BYTES), "own limit"
    assert budget.try_acquire(PAGE_BYTES)
    registry.set_limit("engine", None)
    other = registry.register("other")
    assert other.try_acquire(PAGE_BYTES)
    assert not budget.try_acquire(PAGE_BYTES), "device budget"
    assert registry.mapped_bytes == 4 * PAGE_BYTES and registry.available_bytes == 0
    budget.release(3 * PAGE_BYTES)
    assert budget.mapped_bytes == 0 and registry.available_bytes == 3 * PAGE_BYTES
    assert budget.try_acquire(0), "nothing is always available"


def test_refused_request_is_pressure_on_the_others_but_own_limit_is_not():
    registry = make_registry(2)
    holder, needy = registry.register("holder"), registry.register("needy", limit_bytes=PAGE_BYTES)
    assert holder.try_acquire(PAGE_BYTES)
    assert not needy.try_acquire(2 * PAGE_BYTES)  # own limit: nobody else can help
    assert holder.pressure_bytes == 0
    assert holder.try_acquire(PAGE_BYTES)
    assert not needy.try_acquire(PAGE_BYTES)  # device full: the holder should give back
    assert holder.pressure_bytes == PAGE_BYTES
    assert [entry["wanted_bytes"] for entry in registry.entries()] == [0, PAGE_BYTES]


def test_entries_report_identity_and_usage():
    registry = make_registry(8)
    budget = registry.register("llama", limit_bytes=6 * PAGE_BYTES)
    assert budget.try_acquire(3 * PAGE_BYTES)
    budget.report_usage(PAGE_BYTES, 3 * PAGE_BYTES)
    (entry,) = registry.entries()
    assert entry["name"] == "llama" and entry["pid"] == os.getpid() and entry["alive"]
    assert entry["start_time_ticks"] > 0 and entry["instance_id"] == budget.instance_id
    assert (entry["limit_bytes"], entry["mapped_bytes"]) == (6 * PAGE_BYTES, 3 * PAGE_BYTES)
    assert (entry["used_bytes"], entry["reserved_bytes"]) == (PAGE_BYTES, 2 * PAGE_BYTES)


def test_unregister_frees_the_slot_and_returns_its_bytes():
    registry = make_registry(4)
    with registry.register("engine") as budget:
        assert budget.try_acquire(2 * PAGE_BYTES)
        assert registry.mapped_bytes == 2 * PAGE_BYTES
    assert not budget.registered and registry.entries() == [] and registry.mapped_bytes == 0
    with pytest.raises(RuntimeError, match="is gone"):
        budget.try_acquire(PAGE_BYTES)
    budget.unregister()  # idempotent
    transient = registry.register("transient")
    del transient  # dropping the handle unregisters too
    assert registry.entries() == []


def test_limits_change_from_outside_and_take_effect():
    registry = make_registry(16)
    budget = registry.register("engine")
    assert budget.try_acquire(4 * PAGE_BYTES)
    assert registry.set_limit(os.getpid(), 2 * PAGE_BYTES) == 1
    assert budget.limit_bytes == budget.external_limit_bytes == 2 * PAGE_BYTES
    assert not budget.try_acquire(PAGE_BYTES), "limit below use: no growth, shrink is deferred"
    assert registry.set_limit("no-such-engine", PAGE_BYTES) == 0
    assert registry.set_limit("engine", None) == 1
    assert budget.external_limit_bytes is None and budget.try_acquire(PAGE_BYTES)


def test_lowered_device_budget_tells_every_instance_to_shrink():
    registry = make_registry(16)
    first, second = registry.register("first"), registry.register("second")
    assert first.try_acquire(6 * PAGE_BYTES) and second.try_acquire(2 * PAGE_BYTES)
    assert first.external_limit_bytes is None
    registry.budget_bytes = 4 * PAGE_BYTES
    assert not first.try_acquire(PAGE_BYTES) and not second.try_acquire(PAGE_BYTES)
    # Each may keep what the others leave of the budget.
    assert first.external_limit_bytes == 2 * PAGE_BYTES
    assert second.external_limit_bytes == 0
    first.release(4 * PAGE_BYTES)
    assert registry.mapped_bytes == registry.budget_bytes
    assert first.external_limit_bytes is None and second.external_limit_bytes is None


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda r: r.register(""), "name must be"),
        (lambda r: r.register("x" * 64), "name must be"),
        (lambda r: r.register("engine", pid=2**31 - 1), "not a running process"),
        (lambda r: r.register("engine", limit_bytes=-1), ">= 0"),
        (lambda r: r.set_limit("engine", -4096), ">= 0"),
        (lambda r: setattr(r, "budget_bytes", -1), ">= 0"),
        (lambda r: DeviceRegistry("cuda/0", 1), "device name"),
        (lambda r: DeviceRegistry("", 1), "device name"),
    ],
)
def test_bad_arguments_are_value_errors_and_change_nothing(call, message):
    registry = make_registry(4)
    with pytest.raises(ValueError, match=message):
        call(registry)
    assert registry.entries() == [] and registry.budget_bytes == 4 * PAGE_BYTES


def test_table_full_is_a_clear_error():
    registry = make_registry(4)
    handles = [registry.register(f"engine-{index}") for index in range(_core.REGISTRY_CAPACITY)]
    with pytest.raises(RuntimeError, match="full"):
        registry.register("one-too-many")
    handles.pop().unregister()
    registry.register("fits-again")


def test_default_budget_follows_documented_utilisation(monkeypatch):
    total = 80 * 2**30
    monkeypatch.delenv("KVCACHED_GPU_UTILIZATION", raising=False)
    assert default_budget_bytes("cuda:0", total) == int(total * DEFAULT_GPU_UTILIZATION)
    monkeypatch.setenv("KVCACHED_GPU_UTILIZATION", "0.5")
    assert default_budget_bytes("cuda:0", total) == total // 2
    assert default_budget_bytes("cpu", total) == total, "host capacity is used whole"
    for invalid in ("1.5", "abc", "nan", "0"):
        monkeypatch.setenv("KVCACHED_GPU_UTILIZATION", invalid)
        for device in ("cuda:0", "cpu"):  # the host too, as documented
            with pytest.raises(ValueError, match="KVCACHED_GPU_UTILIZATION"):
                default_budget_bytes(device, total)
        with pytest.raises(ValueError, match="KVCACHED_GPU_UTILIZATION"):
            registry_for("cpu", total_bytes=total)
    monkeypatch.delenv("KVCACHED_GPU_UTILIZATION")
    registry = registry_for("cpu", total_bytes=12 * PAGE_BYTES)
    assert registry.budget_bytes == 12 * PAGE_BYTES
    assert registry_for("cpu", total_bytes=1).budget_bytes == 12 * PAGE_BYTES, "first user decides"


def test_sizes_parse_and_print():
    assert parse_bytes("4096") == 4096
    assert parse_bytes("512MiB") == parse_bytes("512M") == 512 * 2**20
    assert parse_bytes("1.5G") == 3 * 2**29
    assert parse_bytes("2GB") == 2 * 10**9
    with pytest.raises(ValueError):
        parse_bytes("lots")
    assert format_bytes(None) == "-" and format_bytes(512) == "512 B" and format_bytes(3 * 2**29) == "1.5 GiB"


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


def test_lock_held_by_a_live_but_stuck_process_times_out_with_its_pid():
    registry = make_registry(4)
    locked = spawn.Event()
    child = spawn.Process(target=child_take_then_hold_lock, args=(1, locked))
    child.start()
    try:
        assert locked.wait(CHILD_TIMEOUT_S)
        with pytest.raises(RuntimeError, match=f"held for over .* by pid {child.pid}"):
            registry.clean_stale()
    finally:
        child.kill()
        child.join(CHILD_TIMEOUT_S)
    assert registry.clean_stale() == 1, "once it is dead, the lock and its memory come back"


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
