"""The host backend beyond the contract: its memory kinds, population, capacity and OS resources.

tests/test_contract.py holds what every backend must do; these are the host
backend's own promises (KVCACHED_HOST_MEMORY, KVCACHED_HOST_POPULATE,
KVCACHED_HOST_CAPACITY_BYTES; docs/gpu-backends.md describes the backend).
"""

from __future__ import annotations

import ctypes
import os

import pytest

from kvcached import _core, configured


def page(device) -> int:
    return device.granularity[1]


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
    device = _core.open_host_device(256 * 2**20, memory="anonymous")
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
    device = _core.open_host_device(256 * 2**20, memory=kind)
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


@pytest.mark.skipif(
    _huge_page_setting() not in ("always", "madvise"), reason="transparent huge pages are off or absent on this kernel"
)
def test_host_huge_pages_are_huge_pages_allocated_at_create(monkeypatch):
    device = _core.open_host_device(64 * 2**20, memory="huge_pages")
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
    device = _core.open_host_device(64 * 2**20, memory=kind)
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
    with pytest.raises(ValueError, match="'hugepages' is not a host memory kind: expected anonymous, huge_pages or"):
        _core.open_host_device(64 * 2**20, memory="hugepages")
    monkeypatch.setenv("KVCACHED_HOST_MEMORY", "hugepages")
    with pytest.raises(ValueError, match="KVCACHED_HOST_MEMORY='hugepages'.*anonymous, huge_pages or shared_files"):
        configured.host_device_settings()


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
def test_shared_files_pages_are_populated_when_mapped_unless_asked_otherwise(monkeypatch, bound_to_one_cpu, populate):
    device = _core.open_host_device(64 * 2**20, memory="shared_files", populate=populate)
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
    assert _populated_after_access(_core.open_host_device(64 * 2**20, memory="shared_files", populate="background")) > 0
    populating = _threads_with_policy(os.SCHED_IDLE)
    assert len(populating) == 1, populating
    (cpus,) = populating.values()
    assert cpus and not cpus & os.sched_getaffinity(0)


def test_a_mapping_thread_free_to_run_anywhere_leaves_its_pages_to_their_first_write(monkeypatch):
    # No CPU to spare: a populating thread would only compete with the engine's own.
    everywhere = os.sched_getaffinity(0)
    online = set(range(os.cpu_count()))
    if everywhere != online:
        pytest.skip(f"this process may not run on every online CPU ({sorted(everywhere)} of {sorted(online)})")
    assert (
        _populated_after_access(_core.open_host_device(64 * 2**20, memory="shared_files", populate="background")) == 0
    )


def test_background_population_keeps_up_with_pages_moving_under_it(monkeypatch, bound_to_one_cpu):
    # Ranges unmapped, released or mapped to other memory before the populating
    # thread reaches them: it must neither fail the caller nor touch the data.
    device = _core.open_host_device(64 * 2**20, memory="shared_files", populate="background")
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
    with pytest.raises(ValueError, match="'eager' is not a way to populate host pages: expected background or"):
        _core.open_host_device(64 * 2**20, populate="eager")
    monkeypatch.setenv("KVCACHED_HOST_POPULATE", "eager")
    with pytest.raises(ValueError, match="KVCACHED_HOST_POPULATE='eager'.*background or on_touch"):
        configured.host_device_settings()


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
    assert configured.host_capacity_bytes() == 64 * 2**20
    settings = configured.host_device_settings()
    assert _core.open_host_device(settings.capacity_bytes).memory_info()[1] == 64 * 2**20
    assert _core.open_host_device().memory_info()[1] == _core.machine_host_capacity_bytes(), (
        "given nothing, reads nothing"
    )
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY_BYTES", "lots")
    with pytest.raises(ValueError, match="KVCACHED_HOST_CAPACITY_BYTES"):
        configured.host_capacity_bytes()


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
