"""The backend contract, as a specification every backend must meet.

Runs against every backend usable in this process: host always; CUDA or HIP
when a GPU (or, in CI, the driver emulation) is present. Every misuse must
raise and leave the device usable and its counters unchanged. What only the
host backend promises is in tests/test_host_backend.py.
"""

from __future__ import annotations

import pytest

import kvcached


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
