"""Allocation granularities other than 2 MiB: every layout and the zero backing adapt.

ROCm reports a 4 KiB minimum beside a 2 MiB recommendation on MI300X, and other
devices and versions differ (older runtimes answered the minimum to both
queries). Each granularity runs in a process of its own over the HIP emulation,
with fresh mappings invisible to GPU work for a while and garbage in fresh
memory, and checks through GPU work (hipMemcpy) what engines would see.
"""

from __future__ import annotations

import pytest

from emulated_process import run_emulated

pytestmark = pytest.mark.emulation

MiB = 1 << 20

SCENARIO = """
    import json, kvcached
    from device_access import EmulatedHipWork
    work = EmulatedHipWork()
    device = kvcached.open_device("hip:0")
    minimum, recommended = device.granularity
    block_bytes = 64 << 10
    results = []
    # The default page (the recommended size) and, where the minimum is smaller,
    # a page of a few minimum units chosen by the engine.
    pages = [None] + ([max(minimum, block_bytes) * 2] if minimum < recommended else [])
    for page_bytes in pages:
        for layout in ("per_layer", "contiguous"):
            for zero_backing in (True, False):
                kv_layout = kvcached.KVLayout.from_config(2, block_bytes, num_buffers=2, kind=layout, page_bytes=page_bytes,
                                              capacity_bytes={capacity}, device=device)
                space = kvcached.KVSpace(kv_layout, device, kvcached.KVSpaceOptions(zero_backing=zero_backing))
                per_page = space.blocks_per_page
                mapped = [1, 2, 5]
                space.map_pages(mapped)
                ok = True
                for page in mapped:
                    for layer in range(2):
                        for buffer in range(2):
                            for block in (page * per_page, page * per_page + per_page - 1):
                                address = space.base_address + space.offset_of(layer, buffer, block)
                                payload = bytes([page, layer, buffer, block % 251]) * (block_bytes // 4)
                                work.write(address, payload)
                                ok &= work.read(address, block_bytes) == payload
                neighbour = space.base_address + space.offset_of(1, 1, 3 * per_page)
                if zero_backing:
                    unmapped_reads_zeros = work.read(neighbour, block_bytes) == bytes(block_bytes)
                else:  # nothing mapped there: GPU work faults (hipErrorIllegalAddress)
                    import ctypes
                    target = ctypes.create_string_buffer(16)
                    unmapped_reads_zeros = work.copy(ctypes.addressof(target), neighbour, 16, work.DEVICE_TO_HOST) == 700
                space.unmap_pages(mapped)
                space.map_pages([5])  # mapped again: GPU work sees it at once
                again = space.base_address + space.offset_of(1, 0, 5 * per_page)
                work.write(again, b"again")
                ok &= work.read(again, 5) == b"again"
                space.unmap_pages([5])
                space.close()
                del space
                results.append(dict(layout=layout, page_bytes=page_bytes, zero_backing=zero_backing, ok=ok,
                                    unmapped=unmapped_reads_zeros, mapped_after=device.counters()["mapped_bytes"]))
    print(json.dumps(dict(granularity=[minimum, recommended], results=results)))
"""


@pytest.mark.parametrize(
    "emulated, expected",
    [
        ("4096/2097152", (4096, 2 * MiB)),  # MI300X (rocminfo)
        ("65536/2097152", (65536, 2 * MiB)),
        ("4096/4096", (4096, 2 * MiB)),  # a runtime that answers the minimum to both queries
        ("2097152/4194304", (2 * MiB, 4 * MiB)),  # larger pages
        ("65536/67108864", (65536, 64 * MiB)),
    ],
)
def test_layouts_and_zero_backing_adapt_to_the_granularity(emulated, expected):
    capacity = 16 * 4 * expected[1]  # 16 page ids of 2 layers x K and V
    seen = run_emulated(
        "hip",
        SCENARIO.format(capacity=capacity),
        {
            "KVCACHED_EMULATED_GRANULARITY": emulated,
            "KVCACHED_EMULATED_HIP_MAPPING_DELAY_US": "1500",
            "KVCACHED_EMULATED_DIRTY_MEMORY": "1" if expected[1] <= 4 * MiB else "0",
            # Zero chunks of a few sizes, small enough to keep the filling cheap
            # (64 MiB pages: one size per layout, already a quarter GiB to fill).
            "KVCACHED_ZERO_CHUNK_BYTES": str(4 * expected[1] if expected[1] <= 4 * MiB else expected[1]),
        },
    )
    assert tuple(seen["granularity"]) == expected
    assert len(seen["results"]) == (8 if expected[0] < expected[1] else 4)
    for result in seen["results"]:
        assert result["ok"], result
        assert result["unmapped"], result
        assert result["mapped_after"] == 0, result
