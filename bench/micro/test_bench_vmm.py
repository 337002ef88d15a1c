"""Latency of the VMM contract (kvcached._core.Device), timed from Python.

Compared with the driver floor in reference_figures.py. Covers its two facts worth
re-checking on every machine: cost follows the number of physical allocations,
not their bytes; and how one set_access over many adjacent mappings compares
with one call per mapping, for separate allocations and for the *same*
allocation mapped many times (what GPU zero backing does).

Each operation is timed alone, once per round (set-up and clean-up are untimed).
"""

from __future__ import annotations

import pytest

from conftest import PAGE_BYTES, GiB, MiB, describe, is_gpu, time_each

ROUNDS_PER_OP = 200  # single driver calls: tens of microseconds each on a GPU
ROUNDS_BATCH = 30  # 64-page batches: a few milliseconds each on a GPU
BATCH_PAGES = 64
SPAN_COUNTS = (8, 64)
ALLOCATION_SIZES_MIB = (2, 8, 32, 64)


def reserve_bytes(device_spec: str) -> int:
    # 64 GiB like the driver-floor measurement; the host reserves (PROT_NONE) less.
    return 64 * GiB if is_gpu(device_spec) else 4 * GiB


@pytest.fixture
def scratch(device):
    """A reservation with room for the largest batch, freed after the test."""
    reservation = device.reserve(2 * BATCH_PAGES * 64 * MiB)
    yield reservation
    reservation.free()


# ---- one call, one 2 MiB page --------------------------------------------------------------


def test_reserve(benchmark, device, device_spec):
    size = reserve_bytes(device_spec)
    describe(
        benchmark, "vmm.reserve_64GiB" if size == 64 * GiB else "vmm.reserve", group="vmm: one call", size_bytes=size
    )
    time_each(benchmark, lambda: device.reserve(size), undo=lambda r: r.free(), rounds=ROUNDS_PER_OP)


def test_free_reservation(benchmark, device, device_spec):
    size = reserve_bytes(device_spec)
    describe(benchmark, "vmm.free", group="vmm: one call", size_bytes=size)
    time_each(benchmark, lambda r: r.free(), prepare=lambda: (device.reserve(size),), rounds=ROUNDS_PER_OP)


def test_create(benchmark, device):
    describe(benchmark, "vmm.create", group="vmm: one call", size_bytes=PAGE_BYTES)
    time_each(benchmark, lambda: device.create(PAGE_BYTES), undo=lambda a: a.release(), rounds=ROUNDS_PER_OP)


def test_map(benchmark, device, scratch):
    describe(benchmark, "vmm.map", group="vmm: one call", size_bytes=PAGE_BYTES)
    time_each(
        benchmark,
        lambda a: device.map(scratch.address, a),
        prepare=lambda: (device.create(PAGE_BYTES),),
        undo=lambda _, a: (device.unmap(scratch.address, PAGE_BYTES), a.release()),
        rounds=ROUNDS_PER_OP,
    )


def test_set_access(benchmark, device, scratch):
    describe(benchmark, "vmm.set_access", group="vmm: one call", size_bytes=PAGE_BYTES)

    def prepare():
        a = device.create(PAGE_BYTES)
        device.map(scratch.address, a)
        return (a,)

    time_each(
        benchmark,
        lambda a: device.set_access(scratch.address, PAGE_BYTES),
        prepare=prepare,
        undo=lambda _, a: (device.unmap(scratch.address, PAGE_BYTES), a.release()),
        rounds=ROUNDS_PER_OP,
    )


def test_unmap(benchmark, device, scratch):
    describe(benchmark, "vmm.unmap", group="vmm: one call", size_bytes=PAGE_BYTES)

    def prepare():
        a = device.create(PAGE_BYTES)
        device.map(scratch.address, a)
        device.set_access(scratch.address, PAGE_BYTES)
        return (a,)

    time_each(
        benchmark,
        lambda a: device.unmap(scratch.address, PAGE_BYTES),
        prepare=prepare,
        undo=lambda _, a: a.release(),
        rounds=ROUNDS_PER_OP,
    )


def test_release(benchmark, device):
    describe(benchmark, "vmm.release", group="vmm: one call", size_bytes=PAGE_BYTES)
    time_each(benchmark, lambda a: a.release(), prepare=lambda: (device.create(PAGE_BYTES),), rounds=ROUNDS_PER_OP)


# ---- batches of 64 separate 2 MiB pages ------------------------------------------------------


def _grow_pages(device, address: int, allocations) -> None:
    for i, a in enumerate(allocations):
        device.map(address + i * PAGE_BYTES, a)
        device.set_access(address + i * PAGE_BYTES, PAGE_BYTES)


def test_batch_grow(benchmark, device, scratch):
    """create + map + set_access for 64 pages, one allocation each (per-page figure in the report)."""
    describe(benchmark, "vmm.batch_grow", ops_per_call=BATCH_PAGES, group="vmm: 64 pages", pages=BATCH_PAGES)

    def grow():
        allocations = [device.create(PAGE_BYTES) for _ in range(BATCH_PAGES)]
        _grow_pages(device, scratch.address, allocations)
        return allocations

    def undo(allocations):
        device.unmap(scratch.address, BATCH_PAGES * PAGE_BYTES)
        for a in allocations:
            a.release()

    time_each(benchmark, grow, undo=undo, rounds=ROUNDS_BATCH)


def test_batch_shrink(benchmark, device, scratch):
    """unmap + release for 64 pages, one call each."""
    describe(benchmark, "vmm.batch_shrink", ops_per_call=BATCH_PAGES, group="vmm: 64 pages", pages=BATCH_PAGES)

    def prepare():
        allocations = [device.create(PAGE_BYTES) for _ in range(BATCH_PAGES)]
        _grow_pages(device, scratch.address, allocations)
        return (allocations,)

    def shrink(allocations):
        for i, a in enumerate(allocations):
            device.unmap(scratch.address + i * PAGE_BYTES, PAGE_BYTES)
            a.release()

    time_each(benchmark, shrink, prepare=prepare, rounds=ROUNDS_BATCH)


# ---- one set_access over N adjacent mappings vs N calls --------------------------------------


@pytest.mark.parametrize("calls", ["one_call", "per_mapping"])
@pytest.mark.parametrize("count", SPAN_COUNTS)
@pytest.mark.parametrize("backing", ["same_allocation", "separate_allocations"])
def test_set_access_span(benchmark, device, scratch, backing, count, calls):
    """N adjacent 2 MiB mappings of one allocation (zero backing's case) or of N
    allocations: is one set_access over all of them cheaper than N calls?"""
    describe(
        benchmark,
        f"vmm.set_access_span.{backing}.{calls}",
        group=f"vmm: set_access over {count} mappings",
        mappings=count,
    )
    base = scratch.address
    allocations = [device.create(PAGE_BYTES) for _ in range(1 if backing == "same_allocation" else count)]

    def prepare():
        for i in range(count):
            device.map(base + i * PAGE_BYTES, allocations[i % len(allocations)])
        return ()

    if calls == "one_call":

        def access():
            device.set_access(base, count * PAGE_BYTES)
    else:

        def access():
            for i in range(count):
                device.set_access(base + i * PAGE_BYTES, PAGE_BYTES)

    try:
        time_each(
            benchmark,
            access,
            prepare=prepare,
            undo=lambda _: device.unmap(base, count * PAGE_BYTES),
            rounds=ROUNDS_BATCH * 2,
        )
    finally:
        for a in allocations:
            a.release()


@pytest.mark.parametrize("calls", ["one_call", "per_mapping"])
@pytest.mark.parametrize("count", SPAN_COUNTS)
def test_unmap_span_same_allocation(benchmark, device, scratch, count, calls):
    """Tearing down N mappings of one allocation: one unmap over all, or N calls."""
    describe(benchmark, f"vmm.unmap_span.same_allocation.{calls}", group=f"vmm: unmap {count} mappings", mappings=count)
    base = scratch.address
    allocation = device.create(PAGE_BYTES)

    def prepare():
        for i in range(count):
            device.map(base + i * PAGE_BYTES, allocation)
        device.set_access(base, count * PAGE_BYTES)
        return ()

    if calls == "one_call":

        def unmap():
            device.unmap(base, count * PAGE_BYTES)
    else:

        def unmap():
            for i in range(count):
                device.unmap(base + i * PAGE_BYTES, PAGE_BYTES)

    try:
        time_each(benchmark, unmap, prepare=prepare, rounds=ROUNDS_BATCH * 2)
    finally:
        allocation.release()


# ---- one allocation of 2 / 8 / 32 / 64 MiB: cost follows allocations, not bytes ------------


@pytest.mark.parametrize("size_mib", ALLOCATION_SIZES_MIB)
def test_grow_one_allocation(benchmark, device, scratch, size_mib):
    """create + map + set_access of one allocation of `size_mib`."""
    size = size_mib * MiB
    describe(
        benchmark, f"vmm.grow_alloc_{size_mib}MiB", group="vmm: one allocation, create+map+access", size_bytes=size
    )

    def grow():
        a = device.create(size)
        device.map(scratch.address, a)
        device.set_access(scratch.address, size)
        return a

    def undo(a):
        device.unmap(scratch.address, size)
        a.release()

    time_each(benchmark, grow, undo=undo, rounds=ROUNDS_PER_OP // 2)


@pytest.mark.parametrize("size_mib", ALLOCATION_SIZES_MIB)
def test_shrink_one_allocation(benchmark, device, scratch, size_mib):
    """unmap + release of one allocation of `size_mib`."""
    size = size_mib * MiB
    describe(benchmark, f"vmm.shrink_alloc_{size_mib}MiB", group="vmm: one allocation, unmap+release", size_bytes=size)

    def prepare():
        a = device.create(size)
        device.map(scratch.address, a)
        device.set_access(scratch.address, size)
        return (a,)

    def shrink(a):
        device.unmap(scratch.address, size)
        a.release()

    time_each(benchmark, shrink, prepare=prepare, rounds=ROUNDS_PER_OP // 2)
