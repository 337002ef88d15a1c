"""kvctl set-policy, and the memory policy in kvctl list and kvtop, through their real entry points."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvcached.registry import DeviceRegistry, MemoryPolicy
from test_kvctl_kvtop import BUDGET_BYTES, DEVICE, PAGE_BYTES, kvctl_json, run

MIB = 1 << 20


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    return {**os.environ, "COLUMNS": "200"}


@pytest.fixture
def registry(env):
    return DeviceRegistry(DEVICE, BUDGET_BYTES)


def test_set_policy_reaches_the_running_instance_and_list_shows_it(env, registry):
    engine = registry.register("qwen")
    result = kvctl_json(env, "set-policy", "name:qwen", "--min", "8MiB", "--max", "32MiB", "--priority", "3")
    assert (result["matched"], result["min_bytes"], result["max_bytes"], result["priority"]) == (
        1,
        8 * MIB,
        32 * MIB,
        3,
    )
    assert (engine.min_bytes, engine.max_bytes, engine.priority) == (8 * MIB, 32 * MIB, 3)
    (entry,) = kvctl_json(env, "list")["instances"]
    assert (entry["min_bytes"], entry["limit_bytes"], entry["priority"], entry["reclaim_target_bytes"]) == (
        8 * MIB,
        32 * MIB,
        3,
        None,
    )
    human = run(env, "kvctl", "list").stdout
    assert "MIN" in human and "PRIO" in human and "8.0 MiB" in human
    # One field at a time; the others stay.
    assert kvctl_json(env, "set-policy", "qwen", "--priority", "-2")["priority"] == -2
    assert kvctl_json(env, "set-policy", str(os.getpid()), "--max", "none")["max_bytes"] is None
    assert (engine.min_bytes, engine.max_bytes, engine.priority) == (8 * MIB, None, -2)


def test_set_policy_refuses_mins_above_the_budget_naming_the_numbers(env, registry):
    first = registry.register("first", policy=MemoryPolicy(min_bytes=BUDGET_BYTES // 2))
    second = registry.register("second")
    failed = kvctl_json(env, "set-policy", "second", "--min", f"{BUDGET_BYTES // 2 + PAGE_BYTES}", expect_rc=1)
    assert "would sum to 136314880 bytes (130 MiB), above the device budget of 134217728 bytes" in failed["error"]
    assert second.min_bytes == 0 and first.min_bytes == BUDGET_BYTES // 2, "nothing changed"
    failed = kvctl_json(env, "set-policy", "first", "--max", "1MiB", expect_rc=1)
    assert "above its max" in failed["error"] and first.max_bytes is None
    refused = run(env, "kvctl", "set-budget", "32MiB", expect_rc=1)
    assert "guaranteed minimums" in refused.stderr and registry.budget_bytes == BUDGET_BYTES


def test_a_min_set_on_an_instance_of_equal_priority_is_claimed_from_the_holder(env, registry):
    holder, late = registry.register("holder"), registry.register("late")
    assert holder.try_acquire(BUDGET_BYTES)
    holder.report_usage(BUDGET_BYTES, BUDGET_BYTES)  # busy: no free memory to give
    assert kvctl_json(env, "set-policy", "late", "--min", "32MiB")["matched"] == 1  # accepted: the mins fit
    assert not late.try_acquire(2 * MIB)
    # Equal priorities never ask each other for more, but a min is there to be claimed.
    assert holder.reclaim_target_bytes == BUDGET_BYTES - 2 * MIB
    (entry,) = [e for e in kvctl_json(env, "list")["instances"] if e["name"] == "holder"]
    assert entry["reclaim_target_bytes"] == BUDGET_BYTES - 2 * MIB
    holder.release(2 * MIB)  # the holder honours it, like a lowered limit
    assert late.try_acquire(2 * MIB)
    assert holder.reclaim_target_bytes == BUDGET_BYTES - 2 * MIB, "kept while late may ask again"
    holder.release(BUDGET_BYTES - 2 * MIB)
    late.release(2 * MIB)


def test_set_policy_bad_input_is_one_clear_line(env, registry):
    engine = registry.register("x")
    assert engine.registered
    assert "changes nothing" in run(env, "kvctl", "set-policy", "x", expect_rc=1).stderr
    assert "whole number" in run(env, "kvctl", "set-policy", "x", "--priority", "high", expect_rc=1).stderr
    assert "out of range" in run(env, "kvctl", "set-policy", "x", "--priority", str(2**31), expect_rc=1).stderr
    assert "not a size" in run(env, "kvctl", "set-policy", "x", "--min", "lots", expect_rc=1).stderr
    assert "nobody" in kvctl_json(env, "set-policy", "nobody", "--min", "1MiB", expect_rc=1)["error"]


def test_kvtop_shows_the_policy_and_who_is_asked_to_shrink(env, registry):
    low = registry.register("low-prio", policy=MemoryPolicy(min_bytes=4 * PAGE_BYTES, priority=0))
    high = registry.register("high-prio", policy=MemoryPolicy(priority=7))
    assert low.try_acquire(BUDGET_BYTES)
    low.report_usage(BUDGET_BYTES, BUDGET_BYTES)
    stop = threading.Event()

    def wait_for_memory() -> None:  # as a waiting alloc does: the refusal stays recent
        while not stop.is_set():
            assert not high.try_acquire(8 * PAGE_BYTES)
            time.sleep(0.05)

    waiter = threading.Thread(target=wait_for_memory)
    assert not high.try_acquire(8 * PAGE_BYTES)
    waiter.start()
    try:
        assert low.reclaim_target_bytes == BUDGET_BYTES - 8 * PAGE_BYTES
        frame = run(env, "kvtop", "--once").stdout
        (listed,) = [e for e in kvctl_json(env, "list")["instances"] if e["name"] == "low-prio"]
    finally:
        stop.set()
        waiter.join()
    low_row = next(line for line in frame.splitlines() if "low-prio" in line)
    assert "shrink to 112M" in low_row and "8.0M" in low_row
    assert "7" in next(line for line in frame.splitlines() if "high-prio" in line)
    assert listed["reclaim_target_bytes"] == BUDGET_BYTES - 8 * PAGE_BYTES
    low.release(BUDGET_BYTES)
