"""What ROCm is reported to do, emulated, and how kvcached's HIP path copes (docs/amd.md cites each report).

Each case runs in a process of its own over the HIP driver emulation, configured
for the behaviour: no VMM support, fresh mappings invisible to GPU work for a
while, copies refused across reservations.
"""

from __future__ import annotations

import pytest

from emulated_process import run_emulated

pytestmark = pytest.mark.emulation

VMM_ATTRIBUTE = "hipDeviceAttributeVirtualMemoryManagementSupported"
# Wider than any scheduling hiccup between a map and the next line of Python,
# so work issued right after a map without the fence reliably lands inside it.
WIDE_WINDOW_US = 50_000
WIDE_WINDOW = {
    "KVCACHED_EMULATED_HIP_MAPPING_DELAY_US": str(WIDE_WINDOW_US),
    "KVCACHED_HIP_MAPPING_SETTLE_US": str(WIDE_WINDOW_US),
}


def test_a_device_without_vmm_support_fails_to_open_naming_the_attribute():
    seen = run_emulated(
        "hip",
        """
        import json, kvcached
        from kvcached.cli.main import collect_info
        from kvcached.devices import canonical_device_name
        try:
            kvcached.open_device("hip:0")
            error = None
        except kvcached.BackendUnavailableError as exc:
            error = str(exc)
        import kvcached._hip as hip
        print(json.dumps(dict(error=error, vmm=hip.vmm_supported(0), identity=canonical_device_name("hip:0"),
                              info=collect_info())))
        """,
        {"KVCACHED_EMULATED_VMM": "0"},
    )
    assert seen["vmm"] is False
    assert seen["error"] is not None and VMM_ATTRIBUTE in seen["error"] and "is 0" in seen["error"]
    assert "amdgpu" in seen["error"]  # says what to check
    hip = next(b for b in seen["info"]["backends"] if b["name"] == "hip")
    assert hip["devices"] == [{"device": "hip:0", "identity": seen["identity"], "error": seen["error"]}]


# Maps pages the way a pool does, then "GPU work" (hipMemcpy) writes and reads
# every block of them at once, as a kernel launched right after would.
FRESH_PAGES = """
    import json, kvcached
    from device_access import EmulatedHipWork
    work = EmulatedHipWork()
    layers, block_bytes = 2, 64 << 10
    {make}
    space = pool.space
    stale, held = [], []
    for step in range(3):  # each step takes a page that was never mapped before
        blocks = pool.alloc(space.blocks_per_page)
        held.append(blocks)
        for block in blocks:
            for layer in range(layers):
                for buffer in range(2):
                    address = space.base_address + space.offset_of(layer, buffer, int(block))
                    payload = bytes([step + 1, layer, buffer, 7]) * 64
                    work.write(address, payload)
                    if work.read(address, len(payload)) != payload:
                        stale.append([step, int(block), layer, buffer])
    for blocks in held:
        pool.free(blocks)
    pool.close()
    print(json.dumps(dict(stale=stale)))
"""
POOL = """pool = kvcached.KVPool(layers, block_bytes, capacity_bytes=256 << 20, device="hip:0",
                          layout="{layout}", zero_backing=True, background_worker=False, register=False)"""


@pytest.mark.parametrize("layout", ["per_layer", "contiguous"])
def test_blocks_handed_out_are_visible_to_gpu_work_at_once(layout):
    seen = run_emulated("hip", FRESH_PAGES.format(make=POOL.format(layout=layout)), WIDE_WINDOW)
    assert seen["stale"] == []


def test_the_default_settle_time_covers_the_reported_window():
    # ~2 ms made the reported corruption disappear; the emulated window is a bit shorter.
    seen = run_emulated(
        "hip",
        FRESH_PAGES.format(make=POOL.format(layout="per_layer")),
        {"KVCACHED_EMULATED_HIP_MAPPING_DELAY_US": "1500"},
    )
    assert seen["stale"] == []


def test_without_the_fence_gpu_work_reads_zeros_and_loses_its_writes():
    # The emulation mode itself: a raw map + set_access, GPU work right away,
    # then again after Device.fence_new_mappings().
    seen = run_emulated(
        "hip",
        """
        import json, kvcached
        from device_access import EmulatedHipWork
        work = EmulatedHipWork()
        device = kvcached.open_device("hip:0")
        page = device.granularity[1]
        r = device.reserve(page)
        a = device.create(page)
        device.map_accessible(r.address, a)
        work.write(r.address, b"lost")
        before = work.read(r.address, 4)
        device.fence_new_mappings()
        after_fence_read = work.read(r.address, 4)
        work.write(r.address, b"kept")
        after = work.read(r.address, 4)
        device.unmap(r.address, page); a.release(); r.free()
        print(json.dumps(dict(before=before.hex(), after_fence_read=after_fence_read.hex(), after=after.hex())))
        """,
        WIDE_WINDOW,
    )
    assert seen == {"before": "00000000", "after_fence_read": "00000000", "after": b"kept".hex()}


def test_zero_backing_reads_zeros_even_over_garbage_memory():
    # Fresh device memory holds garbage here; the shared zero chunks are filled by
    # GPU work (hipMemset) right after mapping them, so that fill must be fenced too.
    seen = run_emulated(
        "hip",
        """
        import json, kvcached
        from device_access import EmulatedHipWork
        work = EmulatedHipWork()
        layout = kvcached.KVLayout.from_config(2, 64 << 10, capacity_bytes=256 << 20, device="hip:0")
        space = kvcached.KVSpace(layout, "hip:0", kvcached.KVSpaceOptions(zero_backing=True))
        base = space.base_address
        space.map_pages([3])
        per_page = space.blocks_per_page
        unmapped = [base + space.offset_of(1, 1, 0), base + space.offset_of(0, 1, 4 * per_page + 5)]
        zeros = [work.read(address, 4096) == bytes(4096) for address in unmapped]
        space.close()
        print(json.dumps(dict(zeros=zeros)))
        """,
        {**WIDE_WINDOW, "KVCACHED_EMULATED_DIRTY_MEMORY": "1"},
    )
    assert seen["zeros"] == [True, True]


def test_no_exported_tensor_spans_two_reservations_and_such_copies_fail():
    seen = run_emulated(
        "hip",
        """
        import ctypes, json, kvcached
        from device_access import EmulatedHipWork
        work = EmulatedHipWork()
        pools = [kvcached.KVPool(2, 64 << 10, capacity_bytes=64 << 20, device="hip:0", register=False,
                                 zero_backing=True, background_worker=False) for _ in range(2)]
        exported = [pool.tensor().__dlpack_device__() for pool in pools]
        spans = []
        for pool in pools:
            base = pool.space.base_address
            size = pool.space.size_bytes
            target = ctypes.create_string_buffer(size)
            whole = work.copy(ctypes.addressof(target), base, size, work.DEVICE_TO_HOST)
            past_end = work.copy(ctypes.addressof(target), base + size - 4096, 8192, work.DEVICE_TO_HOST)
            spans.append([whole, past_end])
        a, b = sorted(pools, key=lambda pool: pool.space.base_address)
        across = work.copy(ctypes.addressof(ctypes.create_string_buffer(8192)),
                           a.space.base_address + a.space.size_bytes - 4096, 8192, work.DEVICE_TO_HOST)
        try:
            pools[0].device.view(a.space.base_address, b.space.base_address + 4096 - a.space.base_address, None)
            view_error = None
        except ValueError as exc:
            view_error = str(exc)
        for pool in pools:
            pool.close()
        print(json.dumps(dict(exported=exported, spans=spans, across=across, view_error=view_error)))
        """,
    )
    hip_error_invalid_value = 1
    assert seen["exported"] == [[10, 0], [10, 0]]  # kDLROCM, ordinal 0
    assert seen["spans"] == [[0, hip_error_invalid_value]] * 2  # a whole export copies; past its end fails
    assert seen["across"] == hip_error_invalid_value
    assert "inside one reserved range" in seen["view_error"]


def test_a_bad_settle_time_is_a_clear_error_when_opening():
    seen = run_emulated(
        "hip",
        """
        import json, kvcached
        try:
            kvcached.open_device("hip:0")
            error = None
        except ValueError as exc:
            error = str(exc)
        print(json.dumps(dict(error=error)))
        """,
        {"KVCACHED_HIP_MAPPING_SETTLE_US": "soon"},
    )
    assert "KVCACHED_HIP_MAPPING_SETTLE_US" in seen["error"]
