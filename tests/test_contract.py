"""The backend contract, as a specification every backend must meet.

Runs against every backend usable in this process: host always; CUDA or HIP
when a GPU (or, in CI, the driver emulation) is present. Every misuse must
raise and leave the device usable and its counters unchanged.
"""

from __future__ import annotations

import ctypes
import os

import pytest

import kvcached
from kvcached import _core


def page(device) -> int:
    return device.granularity[1]


def zero_counters(device) -> dict:
    c = device.counters()
    return {k: c[k] for k in ("reserved_bytes", "created_bytes", "mapped_bytes")}


@pytest.fixture(autouse=True)
def nothing_leaks(device):
    before = zero_counters(device)
    yield
    assert zero_counters(device) == before


def test_granularity_is_sane(device):
    minimum, recommended = device.granularity
    assert minimum > 0 and recommended >= minimum
    assert recommended % minimum == 0
    assert recommended & (recommended - 1) == 0


def test_memory_info_reports_free_within_total(device):
    free_bytes, total_bytes = device.memory_info()
    assert 0 < total_bytes
    assert 0 <= free_bytes <= total_bytes


def test_reserve_and_free_round_trip(device):
    size = 64 * page(device)
    r = device.reserve(size)
    assert r.size == size and r.address % page(device) == 0
    assert device.counters()["reserved_bytes"] >= size
    r.free()
    assert not r.valid
    r.free()  # idempotent


def test_reserve_with_alignment(device):
    alignment = 16 * page(device)
    r = device.reserve(page(device), alignment)
    assert r.address % alignment == 0
    r.free()


def test_create_and_release_round_trip(device):
    a = device.create(page(device))
    assert a.size == page(device)
    a.release()
    assert not a.valid
    a.release()  # idempotent


def test_mapped_memory_holds_data(device, access):
    p = page(device)
    r = device.reserve(4 * p)
    a = device.create(p)
    device.map(r.address, a)
    device.set_access(r.address, p)
    device.fence_new_mappings()  # a fresh mapping is visible to device work after the fence
    payload = bytes(range(256)) * 16
    access.write(r.address + 123, payload)
    assert access.read(r.address + 123, len(payload)) == payload
    device.unmap(r.address, p)
    a.release()
    r.free()


def test_two_mappings_of_one_allocation_share_bytes(device, access):
    p = page(device)
    r = device.reserve(4 * p)
    a = device.create(p)
    first, second = r.address, r.address + 2 * p
    device.map(first, a)
    device.map(second, a)
    device.set_access(first, p)
    device.set_access(second, p)
    device.fence_new_mappings()
    access.write(first + 7, b"written through the first mapping")
    assert access.read(second + 7, 33) == b"written through the first mapping"
    device.unmap(first, p)
    device.unmap(second, p)
    a.release()
    r.free()


def test_a_second_mapping_sees_what_was_written_before_it(device, access):
    # The host backend's anonymous memory moves its bytes into a shared file when a
    # second mapping appears (test_every_host_memory_kind_keeps_the_contract): nothing is lost.
    p = page(device)
    r = device.reserve(6 * p)
    a = device.create(p)
    first, second, third = r.address, r.address + 2 * p, r.address + 4 * p
    device.map(first, a)
    device.set_access(first, p)
    device.fence_new_mappings()
    access.write(first + p - 5, b"early")
    device.map(second, a)  # access not set yet: the first mapping must stay usable
    device.set_access(second, p)
    device.fence_new_mappings()
    assert access.read(second + p - 5, 5) == b"early"
    access.write(second, b"back")
    assert access.read(first, 4) == b"back"
    device.unmap(first, p)
    assert access.read(second, 4) == b"back"
    device.unmap(second, p)
    device.map(third, a)
    device.set_access(third, p)
    device.fence_new_mappings()
    assert access.read(third, 4) == b"back" and access.read(third + p - 5, 5) == b"early"
    device.unmap(third, p)
    a.release()
    r.free()


def test_unmap_then_remap_keeps_the_allocation_contents(device, access):
    p = page(device)
    r = device.reserve(4 * p)
    a = device.create(p)
    device.map(r.address, a)
    device.set_access(r.address, p)
    device.fence_new_mappings()
    access.write(r.address, b"kept")
    device.unmap(r.address, p)
    device.map(r.address + 3 * p, a)
    device.set_access(r.address + 3 * p, p)
    device.fence_new_mappings()
    assert access.read(r.address + 3 * p, 4) == b"kept"
    device.unmap(r.address + 3 * p, p)
    a.release()
    r.free()


def test_unmap_covers_adjacent_whole_mappings(device):
    p = page(device)
    r = device.reserve(4 * p)
    a, b = device.create(p), device.create(p)
    mapped_before = device.counters()["mapped_bytes"]
    device.map(r.address, a)
    device.map(r.address + p, b)
    device.set_access(r.address, 2 * p)  # one call spanning two mappings
    assert device.counters()["mapped_bytes"] == mapped_before + 2 * p
    device.unmap(r.address, 2 * p)  # one call spanning two mappings
    assert device.counters()["mapped_bytes"] == mapped_before
    a.release()
    b.release()
    r.free()


def test_a_multi_page_allocation_maps_as_one(device, access):
    p = page(device)
    r = device.reserve(8 * p)
    a = device.create(4 * p)
    device.map(r.address + 4 * p, a)
    device.set_access(r.address + 4 * p, 4 * p)
    device.fence_new_mappings()
    access.write(r.address + 8 * p - 4, b"tail")
    assert access.read(r.address + 8 * p - 4, 4) == b"tail"
    device.unmap(r.address + 4 * p, 4 * p)
    a.release()
    r.free()


def test_freeing_a_reservation_unmaps_what_is_inside(device):
    p = page(device)
    r = device.reserve(2 * p)
    a = device.create(p)
    mapped_before = device.counters()["mapped_bytes"]
    device.map(r.address, a)
    r.free()
    assert device.counters()["mapped_bytes"] == mapped_before
    a.release()  # no longer mapped, so release is allowed


# ---- misuse: clear errors, nothing changed ------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4095, 3 * 1024 + 1])
def test_unaligned_or_zero_sizes_are_refused(device, size):
    with pytest.raises(ValueError, match="granularity"):
        device.reserve(size)
    with pytest.raises(ValueError, match="granularity"):
        device.create(size)


def test_unaligned_alignment_is_refused(device):
    with pytest.raises(ValueError, match="alignment"):
        device.reserve(page(device), 12345)


def test_mapping_outside_a_reservation_is_refused(device):
    p = page(device)
    r = device.reserve(2 * p)
    a = device.create(2 * p)
    with pytest.raises(ValueError, match="reserved range"):
        device.map(r.address + p, a)  # would run past the end
    a.release()
    r.free()


def test_mapping_at_an_unaligned_address_is_refused(device):
    p = page(device)
    r = device.reserve(2 * p)
    a = device.create(p)
    with pytest.raises(ValueError, match="granularity"):
        device.map(r.address + 1, a)
    a.release()
    r.free()


def test_mapping_over_a_mapped_range_is_refused_and_harmless(device, access):
    p = page(device)
    r = device.reserve(4 * p)
    a, b = device.create(2 * p), device.create(2 * p)
    device.map(r.address, a)
    device.set_access(r.address, 2 * p)
    device.fence_new_mappings()
    access.write(r.address + p, b"original")
    with pytest.raises(ValueError, match="mapped|overlaps"):
        device.map(r.address + p, b)
    with pytest.raises(ValueError, match="mapped|overlaps"):
        device.map(r.address, b)
    assert access.read(r.address + p, 8) == b"original"
    device.unmap(r.address, 2 * p)
    a.release()
    b.release()
    r.free()


def test_unmapping_what_is_not_mapped_is_refused(device):
    p = page(device)
    r = device.reserve(4 * p)
    with pytest.raises(ValueError, match="no mapping"):
        device.unmap(r.address, p)
    a = device.create(2 * p)
    device.map(r.address, a)
    with pytest.raises(ValueError, match="split"):
        device.unmap(r.address, p)  # half of a mapping
    with pytest.raises(ValueError, match="gap|whole"):
        device.unmap(r.address, 3 * p)  # past the mapping
    device.unmap(r.address, 2 * p)
    a.release()
    r.free()


def test_set_access_on_unmapped_memory_is_refused(device):
    p = page(device)
    r = device.reserve(2 * p)
    with pytest.raises(ValueError, match="not mapped"):
        device.set_access(r.address, p)
    r.free()


def test_releasing_a_mapped_allocation_is_refused(device, access):
    p = page(device)
    r = device.reserve(p)
    a = device.create(p)
    device.map(r.address, a)
    device.set_access(r.address, p)
    device.fence_new_mappings()
    with pytest.raises(ValueError, match="still mapped"):
        a.release()
    assert a.valid
    access.write(r.address, b"still usable")
    assert access.read(r.address, 12) == b"still usable"
    device.unmap(r.address, p)
    a.release()
    r.free()


def test_asking_for_more_memory_than_the_device_has_is_a_memory_error(device):
    p = page(device)
    _, total_bytes = device.memory_info()
    too_much = (total_bytes // p + 1) * p
    with pytest.raises(kvcached.DeviceOutOfMemoryError) as info:
        device.create(too_much)
    assert isinstance(info.value, MemoryError)
    assert isinstance(info.value, kvcached.DriverError)
    assert info.value.backend == device.backend and info.value.call
    # The device is still usable afterwards.
    a = device.create(p)
    a.release()


def test_objects_dropped_without_cleanup_release_everything(device):
    before = zero_counters(device)
    p = page(device)
    r = device.reserve(2 * p)
    a = device.create(p)
    device.map(r.address, a)
    del a  # still mapped: the destructor unmaps, then releases
    del r
    assert zero_counters(device) == before


def test_device_names_its_physical_identity(device):
    identity = device.canonical_name
    assert identity == kvcached.devices.canonical_device_name(device.name)
    if device.backend == "host":
        assert identity == "cpu"
    else:
        assert identity.startswith((f"{device.backend}-GPU-", f"{device.backend}-pci-"))


def test_a_view_never_spans_two_reservations(device):
    p = page(device)
    first, second = device.reserve(2 * p), device.reserve(2 * p)
    device.view(first.address, first.size, first)  # the whole reservation is fine
    for address, size in [
        (first.address, first.size + p),  # runs past the end (maybe into the other one)
        (first.address + first.size - 1, 2),
        (min(first.address, second.address), abs(second.address - first.address) + second.size),
        (first.address - p, p),  # before the start
    ]:
        with pytest.raises(ValueError, match="inside one reserved range"):
            device.view(address, size, None)
    first.free()
    with pytest.raises(ValueError, match="inside one reserved range"):
        device.view(first.address, p, None)  # freed
    second.free()


# ---- host specifics -----------------------------------------------------------------------


def _fds_and_maps() -> tuple[int, int]:
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    return fds, maps


def test_host_leaves_no_file_descriptors_or_mappings(host_device):
    p = page(host_device)
    before = _fds_and_maps()
    for _ in range(3):
        r = host_device.reserve(64 * p)
        allocs = [host_device.create(p) for _ in range(8)]
        for i, a in enumerate(allocs):
            host_device.map(r.address + 2 * i * p, a)
            host_device.set_access(r.address + 2 * i * p, p)
        for i, a in enumerate(allocs):
            host_device.unmap(r.address + 2 * i * p, p)
            a.release()
        r.free()
    assert _fds_and_maps() == before


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_host_anonymous_release_gives_the_memory_back(monkeypatch):
    monkeypatch.setenv("KVCACHED_HOST_MEMORY", "anonymous")
    device = _core.open_host_device(256 * 2**20)
    size = 64 * 2**20
    r = device.reserve(size)
    a = device.create(size)
    device.map(r.address, a)
    device.set_access(r.address, size)
    ctypes.memset(r.address, 1, size)
    written = _resident_bytes()
    device.unmap(r.address, size)
    assert _resident_bytes() > written - size // 2, "unmapping keeps the allocation (and its bytes)"
    a.release()
    assert _resident_bytes() < written - size // 2
    r.free()


@pytest.mark.parametrize("kind", ["anonymous", "huge_pages"])
def test_host_anonymous_memory_is_allocated_at_create(monkeypatch, kind):
    # As cuMemCreate on a GPU: no page fault left for the engine's forward pass.
    monkeypatch.setenv("KVCACHED_HOST_MEMORY", kind)
    device = _core.open_host_device(256 * 2**20)
    size = 64 * 2**20
    before = _resident_bytes()
    a = device.create(size)
    assert _resident_bytes() >= before + size * 3 // 4
    a.release()
    assert _resident_bytes() < before + size // 4


def _huge_page_setting() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unsupported"


def _vmstat(name: str) -> int:
    with open("/proc/vmstat") as f:
        return next((int(line.split()[1]) for line in f if line.split()[0] == name), 0)


def _anon_huge_kib(address: int) -> int:
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(_huge_page_setting() not in ("always", "madvise"),
                    reason="transparent huge pages are off or absent on this kernel")
def test_host_huge_pages_are_huge_pages_allocated_at_create(monkeypatch):
    monkeypatch.setenv("KVCACHED_HOST_MEMORY", "huge_pages")
    device = _core.open_host_device(64 * 2**20)
    size = 8 * 2**20
    r = device.reserve(size, 2 * 2**20)
    fallbacks = _vmstat("thp_fault_fallback")
    a = device.create(size)
    device.map(r.address, a)
    device.set_access(r.address, size)
    huge_kib = _anon_huge_kib(r.address)  # before any write: allocated at create
    ctypes.memset(r.address, 1, size)
    assert ctypes.string_at(r.address + size - 3, 3) == b"\x01\x01\x01"
    device.unmap(r.address, size)
    a.release()
    r.free()
    if huge_kib == 0 and _vmstat("thp_fault_fallback") > fallbacks:
        pytest.skip("the kernel had no free huge page (thp_fault_fallback rose)")
    assert huge_kib >= 2048


@pytest.mark.parametrize("kind", ["anonymous", "huge_pages", "shared_files"])
def test_every_host_memory_kind_keeps_the_contract(monkeypatch, kind):
    monkeypatch.setenv("KVCACHED_HOST_MEMORY", kind)
    device = _core.open_host_device(64 * 2**20)
    p = page(device)
    r = device.reserve(6 * p)
    a = device.create(p)
    device.map(r.address, a)
    device.set_access(r.address, p)
    ctypes.memmove(r.address + 5, b"kept", 4)
    device.unmap(r.address, p)
    device.map(r.address + 2 * p, a)
    device.map(r.address + 4 * p, a)  # two live mappings share bytes
    device.set_access(r.address + 2 * p, p)
    device.set_access(r.address + 4 * p, p)
    assert ctypes.string_at(r.address + 2 * p + 5, 4) == b"kept"
    ctypes.memmove(r.address + 4 * p, b"both", 4)
    assert ctypes.string_at(r.address + 2 * p, 4) == b"both"
    device.unmap(r.address + 2 * p, p)
    device.unmap(r.address + 4 * p, p)
    a.release()
    r.free()
    assert device.memory_info()[0] == 64 * 2**20


def test_an_unknown_host_memory_kind_is_refused(monkeypatch):
    monkeypatch.setenv("KVCACHED_HOST_MEMORY", "hugepages")
    with pytest.raises(ValueError, match="KVCACHED_HOST_MEMORY='hugepages'.*anonymous, huge_pages or shared_files"):
        _core.open_host_device(64 * 2**20)


def _resident_pages(address: int, size: int) -> int:
    """How many of the range's 4 KiB pages have memory behind them (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    vector = ctypes.create_string_buffer(size // os.sysconf("SC_PAGESIZE"))
    assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
    return sum(byte & 1 for byte in vector.raw)


@pytest.fixture
def bound_to_one_cpu():
    """The calling thread bound to one of the CPUs (as a CPU engine's worker is), restored afterwards."""
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two CPUs: one for the mapping thread, one for the populating thread")
    os.sched_setaffinity(0, {min(before)})
    yield
    os.sched_setaffinity(0, before)


def _populated_after_access(device) -> int:
    """Pages with memory behind them once a fresh allocation is mapped and accessible (none written)."""
    p = page(device)
    r = device.reserve(2 * p)
    a = device.create(p)
    device.map(r.address, a)
    assert _resident_pages(r.address, p) == 0  # nothing before access is granted
    device.set_access(r.address, p)
    _core.wait_for_host_population()
    resident = _resident_pages(r.address, p)
    assert ctypes.string_at(r.address, 4) == b"\0" * 4  # populated pages read zeros
    device.unmap(r.address, p)
    a.release()
    r.free()
    return resident


@pytest.mark.parametrize("populate", ["background", "on_touch"])
def test_shared_files_pages_are_populated_when_mapped_unless_asked_otherwise(monkeypatch, bound_to_one_cpu,
                                                                             populate):
    monkeypatch.setenv("KVCACHED_HOST_MEMORY", "shared_files")
    monkeypatch.setenv("KVCACHED_HOST_POPULATE", populate)
    device = _core.open_host_device(64 * 2**20)
    expected = page(device) // os.sysconf("SC_PAGESIZE") if populate == "background" else 0
    assert _populated_after_access(device) == expected


def _threads_with_policy(policy: int) -> dict[int, set[int]]:
    """This process's threads scheduled under ``policy``: tid -> the CPUs it may run on."""
    found = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            if os.sched_getscheduler(tid) == policy:
                found[tid] = os.sched_getaffinity(tid)
        except (ProcessLookupError, FileNotFoundError):
            continue  # a thread that ended meanwhile
    return found


def test_the_populating_thread_runs_only_when_the_other_cpus_are_idle(monkeypatch, bound_to_one_cpu):
    # SCHED_IDLE: the engine's own threads on those CPUs (vLLM's EngineCore)
    # preempt it at once; and never on the mapping thread's CPU.
    monkeypatch.setenv("KVCACHED_HOST_MEMORY", "shared_files")
    monkeypatch.setenv("KVCACHED_HOST_POPULATE", "background")
    assert _populated_after_access(_core.open_host_device(64 * 2**20)) > 0
    populating = _threads_with_policy(os.SCHED_IDLE)
    assert len(populating) == 1, populating
    (cpus,) = populating.values()
    assert cpus and not cpus & os.sched_getaffinity(0)


def test_a_mapping_thread_free_to_run_anywhere_leaves_its_pages_to_their_first_write(monkeypatch):
    # No CPU to spare: a populating thread would only compete with the engine's own.
    monkeypatch.setenv("KVCACHED_HOST_MEMORY", "shared_files")
    monkeypatch.setenv("KVCACHED_HOST_POPULATE", "background")
    everywhere = os.sched_getaffinity(0)
    online = set(range(os.cpu_count()))
    if everywhere != online:
        pytest.skip(f"this process may not run on every online CPU ({sorted(everywhere)} of {sorted(online)})")
    assert _populated_after_access(_core.open_host_device(64 * 2**20)) == 0


def test_background_population_keeps_up_with_pages_moving_under_it(monkeypatch, bound_to_one_cpu):
    # Ranges unmapped, released or mapped to other memory before the populating
    # thread reaches them: it must neither fail the caller nor touch the data.
    monkeypatch.setenv("KVCACHED_HOST_MEMORY", "shared_files")
    monkeypatch.setenv("KVCACHED_HOST_POPULATE", "background")
    device = _core.open_host_device(64 * 2**20)
    p = page(device)
    r = device.reserve(4 * p)
    for round_index in range(50):
        slot = r.address + (round_index % 4) * p
        a = device.create(p)
        device.map(slot, a)
        device.set_access(slot, p)
        marker = round_index.to_bytes(4, "little")
        ctypes.memmove(slot + p - 4, marker, 4)
        assert ctypes.string_at(slot + p - 4, 4) == marker
        device.unmap(slot, p)
        a.release()
    _core.wait_for_host_population()
    r.free()
    assert device.memory_info()[0] == 64 * 2**20


def test_an_unknown_host_populate_way_is_refused(monkeypatch):
    monkeypatch.setenv("KVCACHED_HOST_POPULATE", "eager")
    with pytest.raises(ValueError, match="KVCACHED_HOST_POPULATE='eager'.*background or on_touch"):
        _core.open_host_device(64 * 2**20)


def test_host_capacity_is_enforced_as_memory_error():
    device = _core.open_host_device(8 * 2**20)
    assert device.memory_info() == (8 * 2**20, 8 * 2**20)
    a = device.create(6 * 2**20)
    with pytest.raises(MemoryError, match="capacity"):
        device.create(4 * 2**20)
    b = device.create(2 * 2**20)
    assert device.memory_info()[0] == 0
    a.release()
    b.release()
    assert device.memory_info()[0] == 8 * 2**20


def test_host_default_capacity_follows_the_environment(monkeypatch):
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY_BYTES", str(64 * 2**20))
    assert _core.default_host_capacity_bytes() == 64 * 2**20
    assert _core.open_host_device().memory_info()[1] == 64 * 2**20
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY_BYTES", "lots")
    with pytest.raises(ValueError, match="KVCACHED_HOST_CAPACITY_BYTES"):
        _core.default_host_capacity_bytes()


def test_host_views_are_numpy_and_torch_visible(host_device):
    import numpy as np

    torch = pytest.importorskip("torch")
    p = page(host_device)
    r = host_device.reserve(p)
    a = host_device.create(p)
    host_device.map(r.address, a)
    host_device.set_access(r.address, p)
    view = np.from_dlpack(host_device.view(r.address, p, r))
    view[:4] = [1, 2, 3, 4]
    t = torch.from_dlpack(host_device.view(r.address, p, r))
    assert t.device.type == "cpu" and t[:4].tolist() == [1, 2, 3, 4]
    del view, t
    host_device.unmap(r.address, p)
    a.release()
    r.free()
