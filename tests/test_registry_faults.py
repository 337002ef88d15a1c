"""Fault injection on the shared registry: whatever happens to the file, no engine crashes and no budget splits.

Truncated, wiped, overwritten, removed, replaced, symlinked and garbage
registries; faults elsewhere still fatal; SIGKILL storms; PID reuse; stopped
lock holders (threads and pool create/close cycles: test_registry_processes).
Bounded in time: children are forked, rounds are few.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcached.errors import RegistryUnusableError
from kvcached.registry import DeviceRegistry, registry_for
from registry_files import GPU_A, GPU_B, LAYOUT, PAGE_BYTES, entry_offset, poke, start_ticks

fork = multiprocessing.get_context("fork")
CHILD_TIMEOUT_S = 30.0
DEVICE = "cpu"


@pytest.fixture(autouse=True)
def isolated_registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    monkeypatch.delenv("KVCACHED_REGISTRY_GROUP", raising=False)
    return tmp_path


def make_registry(pages: int, device: str = DEVICE) -> DeviceRegistry:
    return DeviceRegistry(device, pages * PAGE_BYTES)


# ---- damage under a live engine -----------------------------------------------


def truncate_to_zero(path: str) -> None:
    os.truncate(path, 0)


def truncate_partly(path: str) -> None:
    os.truncate(path, LAYOUT["entries"] + 7)


def wipe_in_place(path: str) -> None:  # truncate, then grow back: every byte reads zero
    os.truncate(path, 0)
    os.truncate(path, LAYOUT["layout_bytes"])


def overwrite_header(path: str) -> None:
    poke(path, 0, os.urandom(LAYOUT["header.budget_bytes"]))


def remove(path: str) -> None:
    os.unlink(path)


def replace_by_rename(path: str) -> None:
    other = DeviceRegistry(GPU_B, PAGE_BYTES)
    os.rename(other.path, path)


DAMAGES = {
    truncate_to_zero: "was truncated",
    truncate_partly: "was truncated",
    wipe_in_place: "was overwritten",
    overwrite_header: "was overwritten",
    remove: "was removed",
    replace_by_rename: "was replaced|was removed",
}


def child_engine(ready, go, results) -> None:
    """Registers and maps, then uses every call after the parent damaged the file."""
    registry = DeviceRegistry(DEVICE)
    budget = registry.register("victim")
    assert budget.try_acquire(PAGE_BYTES)
    ready.set()
    go.wait(CHILD_TIMEOUT_S)
    # Lock-free reads touch the mapping directly: a truncated file faults here.
    _ = (budget.available_bytes, budget.external_limit_bytes, budget.pressure_bytes, budget.registered)
    budget.report_usage(PAGE_BYTES, PAGE_BYTES)
    seen = {}
    try:
        budget.try_acquire(PAGE_BYTES)
        seen["try_acquire"] = "granted"
    except RegistryUnusableError as error:
        seen["try_acquire"] = str(error)
    try:
        registry.entries()
        seen["entries"] = "listed"
    except RegistryUnusableError as error:
        seen["entries"] = str(error)
    seen.update(available=budget.available_bytes, registered=budget.registered, pressure=budget.pressure_bytes)
    budget.release(PAGE_BYTES)
    budget.unregister()
    results.put(seen)


@pytest.mark.parametrize("damage", list(DAMAGES), ids=lambda damage: damage.__name__)
def test_an_engine_survives_its_registry_being_damaged_and_is_told_why(damage):
    registry = make_registry(8)
    ready, go, results = fork.Event(), fork.Event(), fork.Queue()
    child = fork.Process(target=child_engine, args=(ready, go, results))
    child.start()
    assert ready.wait(CHILD_TIMEOUT_S)
    damage(registry.path)
    go.set()
    seen = results.get(timeout=CHILD_TIMEOUT_S)
    child.join(CHILD_TIMEOUT_S)
    assert child.exitcode == 0, "no SIGBUS, no abort"
    assert re.search(DAMAGES[damage], seen["try_acquire"]) and "Restart the engine" in seen["try_acquire"]
    assert seen["entries"] == seen["try_acquire"]
    assert (seen["available"], seen["registered"], seen["pressure"]) == (0, False, 0), (
        "a detached budget grants nothing"
    )


def child_hammer(ready, results) -> None:
    """Takes and gives back pages as fast as it can until the registry goes; counts what it saw."""
    budget = DeviceRegistry(DEVICE).register("hammer")
    rounds = 0
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        if rounds == 100:
            ready.set()  # well into the loop: the damage lands mid-flight
        try:
            if budget.try_acquire(PAGE_BYTES):
                budget.release(PAGE_BYTES)
            _ = (budget.available_bytes, budget.external_limit_bytes, budget.pressure_bytes)
            rounds += 1
        except RegistryUnusableError:
            results.put(("detached", rounds))
            return
    results.put(("never noticed", rounds))


@pytest.mark.parametrize("damage", [truncate_to_zero, truncate_partly, wipe_in_place], ids=lambda d: d.__name__)
def test_truncating_under_busy_engines_never_kills_them(damage):
    """The file shrinks at a random moment, inside or outside a locked section: SIGBUS is caught."""
    registry = make_registry(4)
    ready = [fork.Event() for _ in range(3)]
    results = fork.Queue()
    children = [fork.Process(target=child_hammer, args=(event, results)) for event in ready]
    for child in children:
        child.start()
    assert all(event.wait(CHILD_TIMEOUT_S) for event in ready)
    time.sleep(random.uniform(0.01, 0.1))
    damage(registry.path)
    outcomes = [results.get(timeout=CHILD_TIMEOUT_S) for _ in children]
    for child in children:
        child.join(CHILD_TIMEOUT_S)
    assert [child.exitcode for child in children] == [0, 0, 0]
    assert all(state == "detached" and rounds > 0 for state, rounds in outcomes)


def child_fault_outside_any_registry(path: str) -> None:
    import mmap

    DeviceRegistry(DEVICE)  # kvcached's SIGBUS handler is installed by now
    with open(path, "r+b") as file:
        mapping = mmap.mmap(file.fileno(), 4096)
    os.truncate(path, 0)
    mapping[0]  # a SIGBUS that is not kvcached's: it must still end the process
    os._exit(0)


def test_a_sigbus_elsewhere_still_ends_the_process(tmp_path):
    make_registry(4)
    other = tmp_path / "someone-elses-file"
    other.write_bytes(b"x" * 4096)
    child = fork.Process(target=child_fault_outside_any_registry, args=(str(other),))
    child.start()
    child.join(CHILD_TIMEOUT_S)
    assert child.exitcode == -signal.SIGBUS, "kvcached only catches faults in its own mappings"
    # A fresh interpreter, where the handler before kvcached's is the default action.
    other.write_bytes(b"x" * 4096)
    code = "import sys, test_registry_faults as t; t.child_fault_outside_any_registry(sys.argv[1])"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(other)], env=env, capture_output=True, timeout=CHILD_TIMEOUT_S
    )
    assert done.returncode == -signal.SIGBUS, done.stderr


def test_a_new_engine_replaces_a_truncated_registry_and_the_old_one_takes_nothing_more(isolated_registry_dir):
    old = make_registry(4).register("old")
    assert old.try_acquire(2 * PAGE_BYTES)
    truncate_to_zero(old_path := str(isolated_registry_dir / "kvcached-cpu"))
    fresh = registry_for(DEVICE, budget_bytes=4 * PAGE_BYTES)
    new = fresh.register("new")
    assert new.try_acquire(4 * PAGE_BYTES) and fresh.mapped_bytes == 4 * PAGE_BYTES
    with pytest.raises(RegistryUnusableError, match="truncated"):
        old.try_acquire(PAGE_BYTES)
    assert os.path.getsize(old_path) == LAYOUT["layout_bytes"]


def test_an_unlinked_registry_never_leaves_two_budgets_honoured():
    first = make_registry(4)
    old = first.register("old")
    assert old.try_acquire(4 * PAGE_BYTES)
    os.unlink(first.path)
    second = make_registry(4)  # a new engine creates a new file at the path
    new = second.register("new")
    assert new.try_acquire(4 * PAGE_BYTES)
    with pytest.raises(RegistryUnusableError, match="was removed"):
        old.try_acquire(PAGE_BYTES)
    with pytest.raises(RegistryUnusableError, match="was removed"):
        first.entries()
    assert second.mapped_bytes == 4 * PAGE_BYTES and [e["name"] for e in second.entries()] == ["new"]


# ---- files that are not what they claim -----------------------------------------


def test_a_symlink_to_another_valid_registry_is_not_followed(isolated_registry_dir):
    target = make_registry(8, GPU_A)
    (isolated_registry_dir / f"kvcached-{GPU_B}").symlink_to(target.path)
    for budget in (None, PAGE_BYTES):
        with pytest.raises(RegistryUnusableError, match=rf"symbolic link \(to {target.path}\)"):
            DeviceRegistry(GPU_B, budget)
    assert target.budget_bytes == 8 * PAGE_BYTES and target.entries() == []


def test_a_dangling_symlink_gets_a_plain_message(isolated_registry_dir):
    (isolated_registry_dir / "kvcached-cpu").symlink_to(isolated_registry_dir / "nowhere")
    with pytest.raises(RegistryUnusableError, match="symbolic link .*which does not exist.*Remove the link"):
        make_registry(4)
    assert not (isolated_registry_dir / "nowhere").exists(), "nothing created through the link"


def test_a_fifo_at_the_path_is_refused_without_blocking(isolated_registry_dir):
    os.mkfifo(isolated_registry_dir / "kvcached-cpu", 0o600)
    started = time.monotonic()
    with pytest.raises(RegistryUnusableError, match="not a regular file"):
        make_registry(4)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "is empty"),
        (b"\0" * 100, "starts with zeros"),
    ],
)
def test_a_damaged_file_is_reported_then_replaced_by_the_next_engine(isolated_registry_dir, content, message):
    path = isolated_registry_dir / "kvcached-cpu"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(RegistryUnusableError, match=message):
        DeviceRegistry(DEVICE)
    assert make_registry(4).budget_bytes == 4 * PAGE_BYTES


def test_garbage_written_into_a_live_registry_detaches_it(isolated_registry_dir):
    registry = make_registry(4)
    budget = registry.register("engine")
    poke(registry.path, LAYOUT["header.device"], b"cuda-index-9\0")
    with pytest.raises(RegistryUnusableError, match="was overwritten"):
        budget.try_acquire(PAGE_BYTES)


# ---- processes dying at the worst moment --------------------------------------------


def child_churn_until_killed(seed: int) -> None:
    rng = random.Random(seed)
    budget = DeviceRegistry(DEVICE).register(f"storm-{seed}")
    held = 0
    while True:
        if held and rng.random() < 0.5:
            budget.release(PAGE_BYTES)
            held -= 1
        elif budget.try_acquire(PAGE_BYTES):
            held += 1


def test_a_sigkill_storm_leaves_the_budget_exact():
    registry = make_registry(16)
    survivor = registry.register("survivor")
    rng = random.Random(11)
    for round_index in range(12):
        children = [fork.Process(target=child_churn_until_killed, args=(round_index * 10 + i,)) for i in range(4)]
        for child in children:
            child.start()
        time.sleep(rng.uniform(0.02, 0.06))  # mid-churn: some die holding the lock
        for child in children:
            os.kill(child.pid, signal.SIGKILL)
        for child in children:
            child.join(CHILD_TIMEOUT_S)
        started = time.monotonic()
        registry.clean_stale()
        assert time.monotonic() - started < 1.0, "the lock of a killed holder is recovered at once"
        assert registry.mapped_bytes == 0, f"round {round_index}: the dead's pages all came back"
        assert survivor.try_acquire(16 * PAGE_BYTES), "the whole budget is free again"
        survivor.release(16 * PAGE_BYTES)
        assert [entry["name"] for entry in registry.entries()] == ["survivor"]


def test_a_reused_pid_does_not_keep_a_dead_entry_alive():
    registry = make_registry(4)
    sleeper = fork.Process(target=time.sleep, args=(CHILD_TIMEOUT_S,))
    sleeper.start()
    try:
        budget = registry.register("was-here", pid=sleeper.pid)
        assert budget.try_acquire(2 * PAGE_BYTES)
        # Same pid, another process: what the registry sees after the pid is reused.
        poke(
            registry.path,
            entry_offset(budget.slot, "start_time_ticks"),
            (start_ticks(sleeper.pid) + 1).to_bytes(8, "little"),
        )
        (entry,) = registry.entries()
        assert entry["pid"] == sleeper.pid and not entry["alive"]
        assert registry.clean_stale() == 1 and registry.mapped_bytes == 0
    finally:
        sleeper.kill()
        sleeper.join(CHILD_TIMEOUT_S)


def child_hold_lock(locked) -> None:
    DeviceRegistry(DEVICE)._hold_lock_for_test()
    locked.set()
    time.sleep(CHILD_TIMEOUT_S)


def test_a_stopped_lock_holder_is_named_and_a_killed_one_recovered():
    registry = make_registry(4)
    locked = fork.Event()
    holder = fork.Process(target=child_hold_lock, args=(locked,))
    holder.start()
    try:
        assert locked.wait(CHILD_TIMEOUT_S)
        os.kill(holder.pid, signal.SIGSTOP)
        with pytest.raises(RuntimeError, match=f"held for over 5 s by pid {holder.pid}"):
            registry.clean_stale()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(CHILD_TIMEOUT_S)
    registry.budget_bytes = 2 * PAGE_BYTES
    assert registry.budget_bytes == 2 * PAGE_BYTES
