"""WeightSpace, the core of model weights that sleep and wake: a specification run on every backend.

Host always; CUDA and HIP over a real GPU or, in CI, the driver emulation (HIP with fresh
mappings invisible to device work for a while, so a missing fence loses the copy back).
"""

from __future__ import annotations

import pytest

import kvcached
from kvcached import _core


def page(device) -> int:
    return device.granularity[1]


def counters(device) -> dict:
    c = device.counters()
    return {k: c[k] for k in ("reserved_bytes", "created_bytes", "mapped_bytes")}


@pytest.fixture(autouse=True)
def nothing_leaks(device):
    before = counters(device)
    yield
    assert counters(device) == before


def pattern(size: int, seed: int = 7) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(size))


def test_level_1_keeps_the_contents_at_the_same_addresses(device, access):
    space = _core.WeightSpace(device, 5 * page(device), None, chunk_bytes=2 * page(device))
    base, size = space.base_address, space.size_bytes
    data = pattern(size)
    access.write(base, data)
    space.sleep(1)
    assert space.sleep_level == 1
    assert space.stats()["mapped_bytes"] == 0
    assert space.try_wake()
    assert (space.base_address, space.sleep_level) == (base, 0)
    assert access.read(base, size) == data
    space.close()


def test_asleep_the_device_memory_is_given_back(device):
    before = counters(device)
    space = _core.WeightSpace(device, 3 * page(device), None, chunk_bytes=page(device))
    held = counters(device)
    assert held["created_bytes"] - before["created_bytes"] == 3 * page(device)
    assert held["mapped_bytes"] - before["mapped_bytes"] == 3 * page(device)
    space.sleep(2)
    asleep = counters(device)
    assert asleep["created_bytes"] == before["created_bytes"]
    assert asleep["mapped_bytes"] == before["mapped_bytes"]
    assert asleep["reserved_bytes"] == held["reserved_bytes"]  # the addresses stay reserved
    space.try_wake()
    assert counters(device) == held
    space.close()


def test_level_2_wakes_to_zeros(device, access):
    space = _core.WeightSpace(device, 2 * page(device), None)
    access.write(space.base_address, b"\xff" * space.size_bytes)
    space.sleep(2)
    assert space.try_wake()
    assert access.read(space.base_address, space.size_bytes) == bytes(space.size_bytes)
    space.close()


def test_chunks_cover_the_range_and_the_last_may_be_smaller(device):
    space = _core.WeightSpace(device, 5 * page(device) - 1, None, chunk_bytes=2 * page(device))
    stats = space.stats()
    assert stats["size_bytes"] == 5 * page(device)
    assert (stats["chunks"], stats["chunk_bytes"]) == (3, 2 * page(device))
    assert stats["mapped_bytes"] == 5 * page(device)
    space.close()


def test_sleeping_twice_and_waking_an_awake_space_are_no_ops(device, access):
    space = _core.WeightSpace(device, page(device), None)
    access.write(space.base_address, b"abc")
    assert space.try_wake()  # awake: nothing to do
    space.sleep(1)
    space.sleep(1)
    space.sleep(2)  # already asleep (level 1): the contents stay kept
    assert space.sleep_level == 1
    space.try_wake()
    assert access.read(space.base_address, 3) == b"abc"
    assert space.stats()["sleeps"] == 1 and space.stats()["wakes"] == 1
    space.close()


@pytest.mark.parametrize("level", [0, 3, -1])
def test_an_unknown_level_is_refused_and_changes_nothing(device, level):
    space = _core.WeightSpace(device, page(device), None)
    with pytest.raises(ValueError, match="sleep level"):
        space.sleep(level)
    assert space.sleep_level == 0 and space.stats()["mapped_bytes"] == page(device)
    space.close()


def test_a_budget_that_refuses_leaves_the_weights_asleep_with_nothing_mapped(device, access):
    budget = kvcached._core.FixedBudget(4 * page(device))
    weights = _core.MemoryBudgetWeights(budget)
    space = _core.WeightSpace(device, 3 * page(device), weights)
    assert budget.used_bytes == 3 * page(device)
    access.write(space.base_address, b"kept")
    space.sleep(1)
    assert budget.used_bytes == 0
    assert budget.try_acquire(2 * page(device))  # someone else takes memory meanwhile
    asleep = counters(device)
    assert not space.try_wake()
    assert space.sleep_level == 1 and counters(device) == asleep and budget.used_bytes == 2 * page(device)
    budget.release(2 * page(device))
    assert space.try_wake()
    assert access.read(space.base_address, 4) == b"kept"
    space.close()
    assert budget.used_bytes == 0


def test_weights_that_do_not_fit_the_budget_are_refused_at_once(device):
    budget = kvcached._core.FixedBudget(page(device))
    with pytest.raises(kvcached.OutOfMemoryError, match="do not fit"):
        _core.WeightSpace(device, 2 * page(device), _core.MemoryBudgetWeights(budget))
    assert budget.used_bytes == 0


def test_hundreds_of_cycles_leak_nothing(device, access):
    space = _core.WeightSpace(device, 3 * page(device), None, chunk_bytes=page(device))
    held = counters(device)
    where, data = space.base_address + page(device) + 5, pattern(64, seed=3)
    for cycle in range(200):
        level = 1 + cycle % 2
        access.write(where, data)
        space.sleep(level)
        assert space.try_wake()
        assert access.read(where, 64) == (data if level == 1 else bytes(64))
    assert counters(device) == held
    assert space.stats()["sleeps"] == space.stats()["wakes"] == 200
    space.close()


def test_close_gives_everything_back_and_is_idempotent(device):
    budget = kvcached._core.FixedBudget(8 * page(device))
    space = _core.WeightSpace(device, 2 * page(device), _core.MemoryBudgetWeights(budget))
    space.sleep(1)
    assert space.stats()["host_buffer_bytes"] == space.size_bytes
    space.close()
    space.close()
    assert space.closed and budget.used_bytes == 0
    with pytest.raises(ValueError, match="closed"):
        space.try_wake()
    with pytest.raises(ValueError, match="closed"):
        space.sleep(1)


def test_the_host_buffer_is_kept_for_the_next_sleep_and_can_be_freed(device):
    space = _core.WeightSpace(device, page(device), None)
    space.sleep(1)
    with pytest.raises(ValueError, match="wake them first"):
        space.release_host_buffer()
    space.try_wake()
    assert space.stats()["host_buffer_bytes"] == page(device)
    space.release_host_buffer()
    assert space.stats()["host_buffer_bytes"] == 0
    space.close()


def test_contents_kept_asleep_can_be_read(device, access):
    import numpy as np

    space = _core.WeightSpace(device, page(device), None)
    access.write(space.base_address + 10, b"hello")
    space.sleep(1)
    out = np.zeros(5, dtype=np.uint8)
    space.copy_kept_contents(10, out)
    assert out.tobytes() == b"hello"
    with pytest.raises(ValueError, match="not kept"):
        space.copy_kept_contents(space.size_bytes - 2, out)
    space.try_wake()
    with pytest.raises(ValueError, match="not asleep"):
        space.copy_kept_contents(0, out)
    space.close()


def test_level_2_keeps_the_ranges_asked_for_and_zeroes_the_rest(device, access):
    import numpy as np

    p = page(device)
    space = _core.WeightSpace(device, 3 * p, None, chunk_bytes=p)
    base = space.base_address
    access.write(base, b"\x11" * (3 * p))
    access.write(base + p - 4, b"spans two chunks")  # 4 bytes in chunk 0, 12 in chunk 1
    access.write(base + 2 * p + 100, b"kept")
    space.sleep(2, keep=[(2 * p + 100, 4), (p - 4, 16), (2 * p + 102, 1)])  # overlapping ranges merge
    assert space.stats()["kept_bytes"] == 20 and space.stats()["host_buffer_bytes"] >= 20
    out = np.zeros(16, dtype=np.uint8)
    space.copy_kept_contents(p - 4, out)
    assert out.tobytes() == b"spans two chunks"
    assert space.try_wake()
    assert access.read(base + p - 4, 16) == b"spans two chunks"
    assert access.read(base + 2 * p + 100, 4) == b"kept"
    assert access.read(base, 64) == bytes(64) and access.read(base + 2 * p + 104, 64) == bytes(64)
    with pytest.raises(ValueError, match="outside"):
        space.sleep(2, keep=[(3 * p - 1, 2)])
    assert space.sleep_level == 0, "refused: still awake"
    space.close()


def test_bad_sizes_are_refused(device):
    with pytest.raises(ValueError):
        _core.WeightSpace(device, 0, None)
    with pytest.raises((ValueError, TypeError)):
        _core.WeightSpace(device, -5, None)


def test_a_device_out_of_memory_on_wake_leaves_the_weights_asleep():
    device = _core.open_host_device(8 * 2**20)  # a host backend of 8 MiB
    space = _core.WeightSpace(device, 6 * 2**20, None, chunk_bytes=2 * 2**20)
    ctypes_payload = b"still here"
    import ctypes

    ctypes.memmove(space.base_address, ctypes_payload, len(ctypes_payload))
    space.sleep(1)
    hog = device.create(4 * 2**20)  # the device fills up meanwhile
    with pytest.raises(kvcached.DeviceOutOfMemoryError):
        space.try_wake()
    assert space.sleep_level == 1 and device.counters()["mapped_bytes"] == 0
    hog.release()
    assert space.try_wake()
    assert ctypes.string_at(space.base_address, len(ctypes_payload)) == ctypes_payload
    space.close()
    assert device.counters()["created_bytes"] == 0


def test_host_reads_of_sleeping_weights_give_zeros(host_device):
    import ctypes

    space = _core.WeightSpace(host_device, 2**20, None)
    ctypes.memmove(space.base_address, b"xyz", 3)
    space.sleep(1)
    assert ctypes.string_at(space.base_address, 3) == b"\0\0\0"
    space.try_wake()
    assert ctypes.string_at(space.base_address, 3) == b"xyz"
    space.close()
