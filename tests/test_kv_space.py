"""KVSpace on every backend: mapping runs of page ids across zero-backing chunks."""

from __future__ import annotations

import pytest

import kvcached
from device_access import ByteAccess

LAYERS, BUFFERS, BLOCK_BYTES = 2, 2, 64 << 10


@pytest.mark.parametrize("layout", ["per_layer", "contiguous"])
def test_a_run_of_pages_maps_and_unmaps_across_zero_chunks(device, layout):
    access = ByteAccess(device)
    space = kvcached.KVSpace(None, BLOCK_BYTES, LAYERS, BUFFERS, layout=layout, device=device,
                             capacity_bytes=1 << 30, zero_backing=True)
    per_page = space.blocks_per_page
    run = list(range(3, 3 + 40))  # spans several coarse zero chunks on GPUs

    def address(layer: int, buffer: int, page: int) -> int:
        return space.base_address + space.offset_of(layer, buffer, page * per_page)

    space.map_pages(run)
    for page in (run[0], run[17], run[-1]):
        for layer in range(LAYERS):
            for buffer in range(BUFFERS):
                access.write(address(layer, buffer, page), bytes([page, layer, buffer, 7]))
    assert access.read(address(1, 1, run[17]), 4) == bytes([run[17], 1, 1, 7])
    # Neighbours of the run are still backed by zeros.
    assert access.read(address(1, 0, run[0] - 1), 4) == bytes(4)
    assert access.read(address(0, 1, run[-1] + 1), 4) == bytes(4)
    space.unmap_pages(run)
    assert access.read(address(1, 1, run[17]), 4) == bytes(4)
    space.map_pages([run[17]])  # fresh memory again, unrelated to the old contents' lifetime
    space.unmap_pages([run[17]])
    assert space.mapped_pages == 0
    space.close()
    del space
    assert device.counters()["mapped_bytes"] == 0
