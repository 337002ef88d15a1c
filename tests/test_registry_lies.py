"""Fault injection, continued: registry files that lie or move, and pools whose registry goes bad under them.

A table with impossible values (byte counts no device has, pids no process can
have) is refused like any other damage: every user detaches with a clear error
and the next engine replaces the file. An engine whose registry directory is
renamed stops taking memory from the budget new engines no longer see. A pool
whose registry was truncated says so on alloc, with or without its background
worker, instead of reporting the budget as full.
"""

from __future__ import annotations

import os
import time

import pytest

import kvcached
from kvcached.errors import OutOfMemoryError, RegistryUnusableError
from kvcached.registry import DeviceRegistry, MemoryPolicy, clean_directory, registry_files
from registry_files import LAYOUT, PAGE_BYTES, entry_offset, poke

DEVICE = "cpu"


@pytest.fixture(autouse=True)
def isolated_registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    monkeypatch.delenv("KVCACHED_REGISTRY_GROUP", raising=False)
    return tmp_path


def make_registry(pages: int) -> DeviceRegistry:
    return DeviceRegistry(DEVICE, pages * PAGE_BYTES)


def write_u64(path: str, offset: int, value: int) -> None:
    poke(path, offset, value.to_bytes(8, "little", signed=value < 0))


# ---- entries that lie ----------------------------------------------------------------


def test_two_entries_claiming_2_to_the_63_bytes_do_not_wrap_the_total_to_zero():
    registry = make_registry(8)
    first, second = registry.register("first"), registry.register("second")
    for budget in (first, second):
        write_u64(registry.path, entry_offset(budget.slot, "mapped_bytes"), 2**63)
    # Read without the lock, the sum saturates: nothing is granted on a wrapped total.
    assert first.available_bytes == 0
    with pytest.raises(RegistryUnusableError, match=r"cannot be true \(slot \d+: mapped_bytes 9223372036854775808\)"):
        _ = registry.mapped_bytes
    with pytest.raises(RegistryUnusableError, match="cannot be true"):
        second.try_acquire(PAGE_BYTES)
    assert first.available_bytes == 0 and not first.registered, "every user of the file detached"


def test_a_byte_count_larger_than_any_device_is_refused_even_without_overflow():
    registry = make_registry(8)
    budget = registry.register("engine")
    write_u64(registry.path, entry_offset(budget.slot, "mapped_bytes"), 2**60)
    with pytest.raises(RegistryUnusableError, match="mapped_bytes 1152921504606846976"):
        budget.try_acquire(PAGE_BYTES)


@pytest.mark.parametrize("pid", [2**62, 2**31, -5], ids=["2^62", "2^31", "negative"])
def test_an_entry_whose_pid_no_process_can_have_makes_the_file_unusable(pid):
    registry = make_registry(4)
    budget = registry.register("engine")
    assert budget.try_acquire(2 * PAGE_BYTES)
    write_u64(registry.path, entry_offset(budget.slot, "pid"), pid)
    # kill((pid_t)2^62, 0) is kill(0, 0), which succeeds: the entry must not be judged alive.
    with pytest.raises(RegistryUnusableError, match=rf"cannot be true \(slot {budget.slot}: pid {pid}\)"):
        registry.clean_stale()
    with pytest.raises(RegistryUnusableError, match="cannot be true"):
        DeviceRegistry(DEVICE)  # a tool (no budget): told, never handed the lie
    fresh = make_registry(4)  # the next engine replaces the damaged file
    assert fresh.entries() == [] and fresh.mapped_bytes == 0


def test_a_slot_state_that_is_neither_free_nor_active_is_a_lie():
    registry = make_registry(4)
    write_u64(registry.path, entry_offset(3, "state"), 7)
    with pytest.raises(RegistryUnusableError, match=r"slot 3: state 7"):
        registry.entries()


def test_a_budget_larger_than_any_device_is_refused_when_set_and_when_found():
    registry = make_registry(4)
    with pytest.raises(ValueError, match="larger than any device"):
        registry.budget_bytes = 2**60
    with pytest.raises(ValueError, match="larger than any device"):
        DeviceRegistry("cuda-index-3", 2**60)
    assert registry.budget_bytes == 4 * PAGE_BYTES
    budget = registry.register("engine")
    write_u64(registry.path, LAYOUT["header.budget_bytes"], 2**63)
    assert budget.available_bytes <= 2**56, "read without the lock, the hint stays plausible"
    with pytest.raises(RegistryUnusableError, match="budget_bytes 9223372036854775808"):
        budget.try_acquire(2**57)  # the page-by-page path never grants on it
    with pytest.raises(RegistryUnusableError, match="budget_bytes 9223372036854775808"):
        registry.entries()


def test_honest_entries_at_the_limit_of_plausible_sizes_are_accepted():
    registry = DeviceRegistry(DEVICE, 2**56)
    budget = registry.register("huge")
    assert budget.try_acquire(2**55) and registry.mapped_bytes == 2**55
    budget.release(2**55)


def test_an_absurd_request_is_recorded_as_pressure_without_poisoning_the_file():
    registry = make_registry(4)
    with kvcached.KVPool(
        num_layers=1,
        block_bytes=PAGE_BYTES,
        num_blocks=8,
        device=DEVICE,
        page_bytes=PAGE_BYTES,
        background_worker=False,
    ) as pool:
        for blocks in (2**40, 2**62):
            with pytest.raises(OutOfMemoryError):
                pool.alloc(blocks)
        budget = registry.register("reporter")
        budget.report_usage(2**62, 2**62)
        names = [entry["name"] for entry in registry.entries()]  # the table is still believed
        assert len(names) == 2 and "reporter" in names


# ---- policy values no kvcached writes -------------------------------------------------

HOUR_NS = 3600 * 10**9


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("priority", 2**40, "priority 1099511627776"),
        ("priority", -(2**62), "priority -4611686018427387904"),
        ("wanted_at_ns", -5, "wanted_at_ns -5"),
        ("wanted_at_ns", "future", r"wanted_at_ns \d+, \d+ ms in the future"),  # a refusal never lapsing
    ],
)
def test_a_policy_value_out_of_its_range_makes_every_user_detach(field, value, words):
    registry = make_registry(8)
    engine, other = registry.register("engine"), registry.register("other")
    if value == "future":
        value = time.monotonic_ns() + HOUR_NS  # CLOCK_MONOTONIC, the clock kvcached writes there
        write_u64(registry.path, entry_offset(engine.slot, "wanted_bytes"), PAGE_BYTES)
    write_u64(registry.path, entry_offset(engine.slot, field), value)
    with pytest.raises(RegistryUnusableError, match=rf"cannot be true \(slot {engine.slot}: {words}"):
        registry.entries()  # kvctl list, kvtop
    with pytest.raises(RegistryUnusableError, match="cannot be true"):
        other.try_acquire(PAGE_BYTES)
    with pytest.raises(RegistryUnusableError, match="cannot be true"):
        DeviceRegistry(DEVICE)  # a tool (no budget): told, never handed the lie
    fresh = make_registry(8)  # the next engine replaces the damaged file
    assert fresh.entries() == []


def contradict_min_above_max(registry, engine, other):
    write_u64(registry.path, entry_offset(engine.slot, "limit_bytes"), PAGE_BYTES)
    write_u64(registry.path, entry_offset(engine.slot, "min_bytes"), 2 * PAGE_BYTES)
    return rf"slot {engine.slot}: min_bytes {2 * PAGE_BYTES} above its limit of {PAGE_BYTES} bytes"


def contradict_mins_above_budget(registry, engine, other):
    for budget in (engine, other):
        write_u64(registry.path, entry_offset(budget.slot, "min_bytes"), 5 * PAGE_BYTES)
    return rf"mins summing to {10 * PAGE_BYTES} bytes, above the budget of {8 * PAGE_BYTES} bytes"


def contradict_target_asked_by_itself(registry, engine, other):
    write_u64(registry.path, entry_offset(engine.slot, "reclaim_requester_slot"), engine.slot)
    write_u64(registry.path, entry_offset(engine.slot, "reclaim_requester_id"), engine.instance_id)
    write_u64(registry.path, entry_offset(engine.slot, "reclaim_target_bytes"), 0)
    return rf"slot {engine.slot}: a reclaim target asked by itself"


def contradict_target_asked_by_nobody(registry, engine, other):
    write_u64(registry.path, entry_offset(engine.slot, "reclaim_requester_slot"), other.slot)
    write_u64(registry.path, entry_offset(engine.slot, "reclaim_requester_id"), 99)
    write_u64(registry.path, entry_offset(engine.slot, "reclaim_target_bytes"), 0)
    return rf"slot {engine.slot}: a reclaim target asked by instance 99, never handed out"


@pytest.mark.parametrize(
    "contradict",
    [
        contradict_min_above_max,
        contradict_mins_above_budget,
        contradict_target_asked_by_itself,
        contradict_target_asked_by_nobody,
    ],
)
def test_policy_values_that_contradict_each_other_make_every_user_detach(contradict):
    registry = make_registry(8)
    engine, other = registry.register("engine"), registry.register("other")
    assert other.try_acquire(PAGE_BYTES)
    words = contradict(registry, engine, other)
    with pytest.raises(RegistryUnusableError, match=rf"cannot be true \({words}"):
        registry.entries()
    with pytest.raises(RegistryUnusableError, match="cannot be true"):
        other.try_acquire(PAGE_BYTES)
    assert not other.registered, "every user of the file detached"
    (listed,) = registry_files()  # kvctl files: looked at under the file's lock
    assert (listed["status"], listed["removable"]) == ("damaged", True) and "cannot be true" in listed["detail"]
    fresh = make_registry(8)  # the next engine replaces it
    assert fresh.entries() == []


def test_kvctl_clean_removes_a_file_whose_values_contradict_each_other():
    registry = make_registry(8)
    engine, other = registry.register("engine"), registry.register("other")
    contradict_mins_above_budget(registry, engine, other)
    assert [file["status"] for file in clean_directory()] == ["damaged"]
    assert registry_files() == []


def test_nothing_kvcached_writes_for_the_policy_is_taken_for_a_lie():
    registry = make_registry(8)
    low = registry.register(
        "low", policy=MemoryPolicy(min_bytes=2 * PAGE_BYTES, max_bytes=6 * PAGE_BYTES, priority=-(2**31))
    )
    high = registry.register("high", policy=MemoryPolicy(min_bytes=2 * PAGE_BYTES, priority=2**31 - 1))
    assert low.try_acquire(6 * PAGE_BYTES)
    assert not high.try_acquire(8 * PAGE_BYTES)  # beyond reach: no trace
    assert not high.try_acquire(4 * PAGE_BYTES)  # recorded now, and a reclaim target on low
    high.want(4 * PAGE_BYTES)
    assert low.reclaim_target_bytes == 4 * PAGE_BYTES
    registry.budget_bytes = 4 * PAGE_BYTES  # below what is mapped, but not below the mins
    with pytest.raises(ValueError, match="guaranteed minimums"):
        registry.budget_bytes = 3 * PAGE_BYTES  # refused, never written
    assert {entry["name"] for entry in registry.entries()} == {"low", "high"}
    assert [file["status"] for file in registry_files()] == ["current"]
    low.release(6 * PAGE_BYTES)


# ---- a registry moved away from its path --------------------------------------------


def test_an_engine_whose_registry_directory_is_renamed_stops_taking_memory(tmp_path, monkeypatch):
    directory = tmp_path / "registry"
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(directory))
    old = DeviceRegistry(DEVICE, 4 * PAGE_BYTES)
    budget = old.register("running")
    assert budget.try_acquire(PAGE_BYTES)
    directory.rename(tmp_path / "moved")  # by someone allowed to: new engines and kvctl no longer see it
    time.sleep(0.15)  # the allocation path looks at the path at most every 100 ms
    with pytest.raises(RegistryUnusableError, match="was removed .*or moved.*Restart the engine"):
        budget.try_acquire(PAGE_BYTES)
    fresh = DeviceRegistry(DEVICE, 4 * PAGE_BYTES)  # a new engine starts a registry at the path
    assert fresh.register("new").try_acquire(4 * PAGE_BYTES)
    with pytest.raises(RegistryUnusableError, match="or moved"):
        old.entries()


# ---- a pool whose registry was truncated --------------------------------------------


@pytest.mark.parametrize("background_worker", [False, True], ids=["no-worker", "worker"])
def test_a_pool_whose_registry_was_truncated_says_so_on_alloc(isolated_registry_dir, background_worker):
    registry = make_registry(8)
    with kvcached.KVPool(
        num_layers=1,
        block_bytes=PAGE_BYTES,
        num_blocks=8,
        device=DEVICE,
        page_bytes=PAGE_BYTES,
        background_worker=background_worker,
        min_reserve_pages=0,
        max_reserve_pages=0,
    ) as pool:
        blocks = pool.alloc(2)
        os.truncate(registry.path, 0)
        with pytest.raises(RegistryUnusableError, match="was truncated.*Restart the engine"):
            pool.alloc(4)
        with pytest.raises(RegistryUnusableError, match="was truncated"):
            pool.alloc(4, timeout_s=0.2)  # no pointless wait for memory that cannot come back
        pool.free(blocks)  # what the pool holds stays usable


def test_a_pool_whose_registry_lies_says_so_instead_of_out_of_memory():
    registry = make_registry(8)
    with kvcached.KVPool(
        num_layers=1,
        block_bytes=PAGE_BYTES,
        num_blocks=8,
        device=DEVICE,
        page_bytes=PAGE_BYTES,
        background_worker=False,
        min_reserve_pages=0,
        max_reserve_pages=0,
    ) as pool:
        other = registry.register("other")
        write_u64(registry.path, entry_offset(other.slot, "mapped_bytes"), 2**63)
        with pytest.raises(RegistryUnusableError, match="cannot be true"):
            pool.alloc(1)


def test_a_full_but_sound_registry_is_still_out_of_memory():
    make_registry(2)
    with (
        kvcached.KVPool(
            num_layers=1,
            block_bytes=PAGE_BYTES,
            num_blocks=8,
            device=DEVICE,
            page_bytes=PAGE_BYTES,
            background_worker=False,
        ) as pool,
        pytest.raises(OutOfMemoryError, match="bound by the memory budget"),
    ):
        pool.alloc(4)
