"""KVSpace on every backend: mapping runs of page ids across zero-backing chunks, applying PageOps in order."""

from __future__ import annotations

import pickle

import pytest

import kvcached
from device_access import ByteAccess

LAYERS, BUFFERS, BLOCK_BYTES = 2, 2, 64 << 10


def make_space(device, layout: str = "per_layer", **options) -> kvcached.KVSpace:
    kv_layout = kvcached.KVLayout.from_config(
        LAYERS, BLOCK_BYTES, kind=layout, num_buffers=BUFFERS, capacity_bytes=1 << 30, device=device
    )
    return kvcached.KVSpace(kv_layout, device, kvcached.KVSpaceOptions(**options))


@pytest.mark.parametrize("layout", ["per_layer", "contiguous"])
def test_a_run_of_pages_maps_and_unmaps_across_zero_chunks(device, layout):
    access = ByteAccess(device)
    space = make_space(device, layout, zero_backing=True)
    per_page = space.blocks_per_page
    run = list(range(3, 3 + 40))  # spans several coarse zero chunks on GPUs

    def address(layer: int, buffer: int, page: int) -> int:
        # `del space` below clears this closure's cell too, so the space is freed before the check.
        return space.base_address + space.offset_of(layer, buffer, page * per_page)  # noqa: F821

    space.map_pages(run)
    for page in (run[0], run[17], run[-1]):
        for layer in range(LAYERS):
            for buffer in range(BUFFERS):
                access.write(address(layer, buffer, page), bytes([page, layer, buffer, 7]))
    assert access.read(address(1, 1, run[17]), 4) == bytes([run[17], 1, 1, 7])
    # Neighbours of the run are still backed by zeros.
    assert access.read(address(1, 0, run[0] - 1), 4) == bytes(4)
    assert access.read(address(0, 1, run[-1] + 1), 4) == bytes(4)
    result = space.unmap_pages(run)
    assert (result.unmapped_pages, result.kept_spare_pages, result.released_pages) == (40, 0, 40)
    assert access.read(address(1, 1, run[17]), 4) == bytes(4)
    space.map_pages([run[17]])  # fresh memory again, unrelated to the old contents' lifetime
    space.unmap_pages([run[17]])
    assert space.mapped_pages == 0
    space.close()
    del space
    assert device.counters()["mapped_bytes"] == 0


def test_unmap_and_trim_say_what_they_did(device):
    space = make_space(device, max_spare_pages=2)
    space.map_pages([0, 1, 2])
    result = space.unmap_pages([0, 1, 2])
    assert (result.unmapped_pages, result.kept_spare_pages, result.released_pages) == (3, 2, 1)
    assert space.spare_pages == 2
    assert space.trim_spares(0) == 2 and space.trim_spares(0) == 0
    with pytest.raises(ValueError, match="not mapped"):
        space.unmap_pages([0])
    space.close()


def test_apply_takes_batches_in_order_unmapping_before_mapping(device):
    access = ByteAccess(device)
    space = make_space(device, max_spare_pages=0)
    first = kvcached.PageOps(1, [0, 1], [])
    assert pickle.loads(pickle.dumps(first)) == first  # crosses processes as is
    assert space.apply(first) == 1 and space.applied_seq == 1
    address = space.base_address + space.offset_of(0, 0, 0)
    access.write(address, b"\x05")
    # One batch may unmap a page and map it again: it succeeds only because the
    # unmap comes first (mapping a mapped page is refused), and the page is usable.
    assert space.apply(kvcached.PageOps(2, [0], [0, 1])) == 2
    assert space.is_mapped(0) and not space.is_mapped(1) and space.mapped_pages == 1
    access.write(address, b"\x07")
    assert access.read(address, 1) == b"\x07"
    for bad, message in [
        (kvcached.PageOps(2, [3], []), "applied already"),
        (kvcached.PageOps(4, [3], []), "missing"),
        (kvcached.PageOps(3, [0], []), "mapped already"),
        (kvcached.PageOps(3, [], [5]), "not mapped"),
        (kvcached.PageOps(0, [5], []), "seq"),
    ]:
        with pytest.raises(ValueError, match=message):
            space.apply(bad)
        assert space.applied_seq == 2 and space.mapped_pages == 1  # nothing changed
    assert space.apply(kvcached.PageOps()) == 0  # an empty batch needs no acknowledgement
    space.close()


@pytest.mark.parametrize("layout", ["per_layer", "contiguous"])
def test_a_batch_that_runs_out_of_memory_leaves_the_space_as_it_was(layout):
    # Several pages are mapped together (per-layer: one region at a time); running
    # out part-way unmaps what the batch mapped and gives every range its zeros back.
    page_id_bytes = LAYERS * BUFFERS * (2 << 20)
    device = kvcached._core.open_host_device(3 * page_id_bytes)
    access = ByteAccess(device)
    space = make_space(device, layout, zero_backing=True, max_spare_pages=0)
    space.map_pages([0])
    address = space.base_address + space.offset_of(1, 1, 0)
    access.write(address, b"\x09")
    counters = device.counters()
    with pytest.raises(kvcached.OutOfMemoryError):
        space.map_pages([4, 5, 6])  # room for two more pages only
    assert device.counters() == counters and space.mapped_pages == 1 and space.spare_pages == 0
    for page in (4, 5, 6):
        assert not space.is_mapped(page)
        for layer in range(LAYERS):
            assert access.read(
                space.base_address + space.offset_of(layer, 1, page * space.blocks_per_page), 2
            ) == bytes(2)
    assert access.read(address, 1) == b"\x09"
    space.map_pages([4, 5])  # what fits still maps
    assert space.mapped_pages == 3
    space.close()
