"""The per-device registry in one process: budget, limits, entries and bad arguments (processes: test_registry_processes)."""

from __future__ import annotations

import os

import pytest

from kvcached import _core
from kvcached.errors import KvcachedError, RegistryError, RegistryUnusableError
from kvcached.registry import (
    DEFAULT_GPU_UTILIZATION,
    DeviceRegistry,
    MemoryPolicy,
    RegistryNotFoundError,
    default_budget_bytes,
    known_devices,
    registry_for,
)
from registry_files import GPU_A, GPU_B

PAGE_BYTES = 2 * 1024 * 1024
DEVICE = "cpu"


@pytest.fixture(autouse=True)
def isolated_registry_dir(tmp_path, monkeypatch):
    """Every test gets its own registry directory."""
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    return tmp_path


def make_registry(pages: int) -> DeviceRegistry:
    return DeviceRegistry(DEVICE, pages * PAGE_BYTES)


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
    budget = registry.register("engine", policy=MemoryPolicy(max_bytes=3 * PAGE_BYTES))
    assert budget.available_bytes == 3 * PAGE_BYTES
    assert budget.try_acquire(2 * PAGE_BYTES)
    assert not budget.try_acquire(2 * PAGE_BYTES), "own limit"
    assert budget.try_acquire(PAGE_BYTES)
    registry.set_policy("engine", clear_max=True)
    other = registry.register("other")
    assert other.try_acquire(PAGE_BYTES)
    assert not budget.try_acquire(PAGE_BYTES), "device budget"
    assert registry.mapped_bytes == 4 * PAGE_BYTES and registry.available_bytes == 0
    budget.release(3 * PAGE_BYTES)
    assert budget.mapped_bytes == 0 and registry.available_bytes == 3 * PAGE_BYTES
    assert budget.try_acquire(0), "nothing is always available"


def test_refused_request_is_pressure_on_the_others_but_own_limit_is_not():
    registry = make_registry(2)
    holder, needy = registry.register("holder"), registry.register("needy", policy=MemoryPolicy(max_bytes=PAGE_BYTES))
    assert holder.try_acquire(PAGE_BYTES)
    assert not needy.try_acquire(2 * PAGE_BYTES)  # own limit: nobody else can help
    assert holder.pressure_bytes == 0
    assert holder.try_acquire(PAGE_BYTES)
    assert not needy.try_acquire(PAGE_BYTES)  # device full: the holder should give back
    assert holder.pressure_bytes == PAGE_BYTES
    assert [entry["wanted_bytes"] for entry in registry.entries()] == [0, PAGE_BYTES]


def test_memory_wanted_without_asking_is_pressure_only_when_the_device_is_full():
    """An engine that checks free memory before it allocates says it waits with want()."""
    registry = make_registry(2)
    holder, waiting = (
        registry.register("holder"),
        registry.register("waiting", policy=MemoryPolicy(max_bytes=2 * PAGE_BYTES)),
    )
    waiting.want(PAGE_BYTES)  # the device has room: nobody needs to give back
    assert holder.pressure_bytes == 0
    assert holder.try_acquire(2 * PAGE_BYTES)
    waiting.want(PAGE_BYTES)  # the device is full
    assert holder.pressure_bytes == PAGE_BYTES and waiting.pressure_bytes == 0
    assert waiting.mapped_bytes == 0  # nothing was taken
    with pytest.raises(ValueError):
        waiting.want(-1)


def test_wanting_more_than_an_instance_could_hold_asks_for_the_part_within_reach():
    """An engine's figure is all its requests may need; its max bounds what it waits for, it does not
    silence the wait (a higher priority whose requests needed more than its max was never helped)."""
    registry = make_registry(4)
    holder = registry.register("holder")
    waiting = registry.register("waiting", policy=MemoryPolicy(max_bytes=2 * PAGE_BYTES, priority=1))
    assert holder.try_acquire(4 * PAGE_BYTES)
    waiting.want(3 * PAGE_BYTES)  # one page beyond its max
    assert holder.pressure_bytes == 2 * PAGE_BYTES
    assert holder.reclaim_target_bytes == 2 * PAGE_BYTES  # shrink by the two pages it could hold


def test_an_instance_at_its_max_waits_for_nothing():
    registry = make_registry(4)
    holder = registry.register("holder")
    full = registry.register("full", policy=MemoryPolicy(max_bytes=PAGE_BYTES, priority=1))
    assert full.try_acquire(PAGE_BYTES) and holder.try_acquire(3 * PAGE_BYTES)
    full.want(PAGE_BYTES)  # its own limit stands in the way: nobody else can help
    assert holder.pressure_bytes == 0 and holder.reclaim_target_bytes is None


def test_wanting_less_than_a_recent_refusal_keeps_the_refusal():
    """want() says the wait goes on; it never shrinks what a refusal said was wanted."""
    registry = make_registry(4)
    holder, waiting = registry.register("holder"), registry.register("waiting")
    assert holder.try_acquire(4 * PAGE_BYTES)
    assert not waiting.try_acquire(3 * PAGE_BYTES)
    waiting.want(PAGE_BYTES)
    assert holder.pressure_bytes == 3 * PAGE_BYTES
    waiting.want(4 * PAGE_BYTES)  # more than before: the larger figure
    assert holder.pressure_bytes == 4 * PAGE_BYTES


def test_a_partial_grant_leaves_the_rest_wanted():
    """A pool that waits takes memory as it comes back: what it still lacks stays pressure."""
    registry = make_registry(4)
    holder, needy = registry.register("holder"), registry.register("needy")
    assert holder.try_acquire(3 * PAGE_BYTES)
    assert not needy.try_acquire(3 * PAGE_BYTES)  # wants 3 pages, 1 is free
    assert holder.pressure_bytes == 3 * PAGE_BYTES
    assert needy.try_acquire(PAGE_BYTES)  # takes the one there is
    assert holder.pressure_bytes == 2 * PAGE_BYTES
    holder.release(2 * PAGE_BYTES)
    assert needy.try_acquire(2 * PAGE_BYTES)  # all it wanted: nobody waits any more
    assert holder.pressure_bytes == 0


def test_entries_report_identity_and_usage():
    registry = make_registry(8)
    budget = registry.register("llama", policy=MemoryPolicy(max_bytes=6 * PAGE_BYTES))
    assert budget.try_acquire(3 * PAGE_BYTES)
    budget.report_usage(PAGE_BYTES, 3 * PAGE_BYTES)
    (entry,) = registry.entries()
    assert entry["name"] == "llama" and entry["pid"] == os.getpid() and entry["alive"]
    assert entry["start_time_ticks"] > 0 and entry["instance_id"] == budget.instance_id
    assert (entry["limit_bytes"], entry["mapped_bytes"]) == (6 * PAGE_BYTES, 3 * PAGE_BYTES)
    assert (entry["used_bytes"], entry["free_mapped_bytes"]) == (PAGE_BYTES, 2 * PAGE_BYTES)


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
    assert registry.set_policy(os.getpid(), max_bytes=2 * PAGE_BYTES) == 1
    assert budget.max_bytes == budget.external_limit_bytes == 2 * PAGE_BYTES
    assert not budget.try_acquire(PAGE_BYTES), "limit below use: no growth, shrink is deferred"
    assert registry.set_policy("no-such-engine", max_bytes=PAGE_BYTES) == 0
    assert registry.set_policy("engine", clear_max=True) == 1
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
        (lambda r: r.register("engine", policy=MemoryPolicy(max_bytes=-1)), "max_bytes must not be negative"),
        (lambda r: r.set_policy("engine", max_bytes=-4096), ">= 0"),
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


class _OpenedGpu:
    """Stands for an opened GPU: its name as this process sees it and, maybe, its identity."""

    def __init__(self, name: str, canonical_name: str = "") -> None:
        self.name, self.canonical_name = name, canonical_name


def test_a_gpu_is_resolved_to_its_physical_identity_and_remembered_as_this_process_sees_it():
    from kvcached.registry import DeviceName, resolve_device

    assert resolve_device(_OpenedGpu("cuda:1", GPU_A)) == DeviceName(GPU_A, "cuda:1")
    assert resolve_device(GPU_A) == DeviceName(GPU_A, "")
    assert resolve_device(" CPU ") == resolve_device("host") == DeviceName("cpu", "cpu")
    registry = registry_for(_OpenedGpu("cuda:1", GPU_A), total_bytes=8 * PAGE_BYTES)
    assert (registry.device, registry.local_device) == (GPU_A, "cuda:1")
    first = registry.register("seen-as-cuda-1")
    second = registry_for(_OpenedGpu("cuda:0", GPU_A)).register("seen-as-cuda-0")  # same GPU, another mask
    assert first.registered and second.registered
    assert [(e["name"], e["local_device"]) for e in DeviceRegistry(GPU_A).entries()] == [
        ("seen-as-cuda-1", "cuda:1"),
        ("seen-as-cuda-0", "cuda:0"),
    ], "one registry, each entry as its process sees it"


def test_a_gpu_without_identity_is_keyed_by_index_and_a_bad_identity_is_refused(caplog):
    from kvcached.registry import DeviceName, resolve_device

    assert resolve_device(_OpenedGpu("hip:2")) == DeviceName("hip-index-2", "hip:2")
    assert "reports no device identity" in caplog.text
    with pytest.raises(ValueError, match="not a device identity"):
        resolve_device(_OpenedGpu("cuda:0", "cuda-index-0"))
    with pytest.raises(ValueError, match="unknown device '../x'"):
        resolve_device("../x")


def test_a_registry_error_is_a_kvcached_error_and_keeps_its_builtin_base():
    assert issubclass(RegistryUnusableError, RegistryError) and issubclass(RegistryError, KvcachedError)
    assert issubclass(RegistryError, RuntimeError)
