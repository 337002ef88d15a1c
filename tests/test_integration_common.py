"""The engine-independent parts of the integrations: geometry, engine blocks, worker spaces, devices."""

from __future__ import annotations

import pytest

from kvcached.errors import OutOfMemoryError
from kvcached.integration.common.blocks import EngineBlocks
from kvcached.integration.common.devices import kvcached_device_name
from kvcached.integration.common.geometry import KVGeometry
from kvcached.integration.common.settings import DEFAULT_PAGE_BYTES, Settings
from kvcached.integration.common.space import WorkerSpace
from kvcached.registry import registry_for

KiB = 1 << 10
# 100 engine blocks of 4 KiB in 64 KiB pages: 16 blocks per page, 7 pages, so
# the last page holds 12 ids past the engine's range.
GEOMETRY = KVGeometry(num_blocks=100, block_bytes=4 * KiB, num_layers=2, num_buffers=2, page_bytes=64 * KiB)


@pytest.fixture
def blocks(request):
    budget = registry_for("cpu").register(request.node.name[:60])
    engine = EngineBlocks.local(GEOMETRY, device="cpu", budget=budget, name=request.node.name[:60])
    yield engine
    engine.close()
    budget.unregister()


def test_geometry_rejects_what_the_core_cannot_lay_out():
    assert GEOMETRY.blocks_per_page == 16 and GEOMETRY.block_id_bytes == 16 * KiB
    with pytest.raises(ValueError, match="whole number"):
        KVGeometry(num_blocks=8, block_bytes=3 * KiB, num_layers=1, num_buffers=2, page_bytes=64 * KiB)
    with pytest.raises(ValueError, match="num_buffers"):
        KVGeometry(num_blocks=8, block_bytes=4 * KiB, num_layers=1, num_buffers=3, page_bytes=64 * KiB)
    with pytest.raises(ValueError, match="layout"):
        KVGeometry(num_blocks=8, block_bytes=4 * KiB, num_layers=1, num_buffers=2, page_bytes=64 * KiB,
                   layout="striped")


def test_engine_blocks_hand_out_only_engine_ids_and_never_the_null_block(blocks):
    assert blocks.manager.num_blocks == 112 and blocks.available() == 99 == blocks.logical_free()
    ids = blocks.alloc(99)  # everything, including the last page with the 12 tail ids
    assert sorted(ids.tolist()) == list(range(1, 100))
    assert blocks.stats()["parked_blocks"] == 12 and blocks.available() == 0
    with pytest.raises(OutOfMemoryError):
        blocks.alloc(1)
    blocks.free(ids)
    assert blocks.available() == 99
    blocks.trim()  # idle: tail ids and free pages go back; the null block's page stays
    assert blocks.stats()["parked_blocks"] == 0 and blocks.stats()["mapped_pages"] == 1


def test_engine_blocks_refuse_bad_frees_and_change_nothing(blocks):
    ids = blocks.alloc(4)
    for bad in ([0], [100], [ids[0], ids[0]], [int(ids.max()) + 1]):
        with pytest.raises(ValueError):
            blocks.free(bad)
    assert blocks.logical_free() == 95
    blocks.free(ids)
    with pytest.raises(ValueError):
        blocks.free(ids)


def test_secured_blocks_survive_a_budget_taken_by_another_process(blocks):
    """What a check secured is still there when the step allocates."""
    assert blocks.secure(20) and blocks.secured == 20
    registry_for("cpu").set_limit(blocks.manager.name, blocks.stats()["held_bytes"])  # no more pages
    assert not blocks.secure(40) and blocks.num_short_secures == 1
    ids = blocks.alloc(20)  # takes the secured blocks: no new page needed
    assert ids.size == 20 and blocks.secured == 11  # partial securing kept the rest of the mapped pages
    blocks.end_step()
    assert blocks.secured == 0 and blocks.logical_free() == 79


def test_alloc_that_fails_keeps_secured_blocks(blocks):
    registry_for("cpu").set_limit(blocks.manager.name, 2 * GEOMETRY.page_bytes * 4)
    assert blocks.secure(8)
    with pytest.raises(OutOfMemoryError):
        blocks.alloc(100)
    assert blocks.secured == 8 and blocks.logical_free() == 99


def test_clear_frees_everything_handed_out(blocks):
    blocks.alloc(30)
    blocks.secure(5)
    blocks.clear()
    assert blocks.logical_free() == 99 and blocks.secured == 0 and blocks.stats()["used_blocks"] == 1


def test_worker_space_mirrors_a_deciding_engine():
    """Decisions without a device, tensors in a WorkerSpace: ordered page ops, acknowledged."""
    budget = registry_for("cpu").register("deciding")
    decider = EngineBlocks.deciding(GEOMETRY, budget=budget, name="deciding", null_block=True)
    worker = WorkerSpace(GEOMETRY, device="cpu")
    try:
        ids = decider.alloc(40)
        ops = decider.take_page_ops()
        assert ops is not None and ops[2] == []
        seq = worker.apply(ops)
        mapped = decider.stats()["mapped_bytes"]
        assert worker.stats()["mapped_bytes"] == mapped == len(ops[1]) * GEOMETRY.page_bytes * 4
        flat = worker.flat_bytes()
        offset = worker.space.offset_of(1, 1, int(ids[-1]))
        flat[offset:offset + 8] = 7  # the mapped block is writable in the worker
        decider.acknowledge(seq)
        decider.free(ids)
        decider.trim()
        unmap = decider.take_page_ops()
        assert unmap is not None and unmap[1] == [] and len(unmap[2]) >= 2
        worker.apply(unmap)
        decider.acknowledge(unmap[0])
        assert worker.stats()["mapped_bytes"] == decider.stats()["mapped_bytes"] == GEOMETRY.page_bytes * 4
        assert decider.stats()["pending_pages"] == 0
    finally:
        worker.close()
        decider.close()
        budget.unregister()


def test_device_names_follow_torchs_build(monkeypatch):
    torch = pytest.importorskip("torch")
    assert kvcached_device_name("cpu") == kvcached_device_name(torch.device("cpu"), registry=True) == "cpu"
    assert kvcached_device_name("cuda:1") == "cuda:1"
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)  # a ROCm build of PyTorch
    assert kvcached_device_name("cuda:1") == "hip:1"
    assert kvcached_device_name("cuda:1", registry=True) == "rocm:1"
    with pytest.raises(ValueError):
        kvcached_device_name("mps")


def test_settings_come_from_the_environment(monkeypatch):
    for name in ("KVCACHED_VIRTUAL_CAPACITY_BYTES", "KVCACHED_PAGE_BYTES", "KVCACHED_IDLE_CACHE_BYTES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVCACHED_LIMIT_BYTES", "64MiB")
    monkeypatch.setenv("KVCACHED_NAME", "engine-a")
    settings = Settings.from_env()
    assert settings == Settings(virtual_bytes=None, limit_bytes=64 << 20, page_bytes=DEFAULT_PAGE_BYTES,
                                name="engine-a", idle_cache_bytes=0)
    monkeypatch.setenv("KVCACHED_LIMIT_BYTES", "lots")
    with pytest.raises(ValueError, match="KVCACHED_LIMIT_BYTES"):
        Settings.from_env()


def test_engine_blocks_stats_count_engine_and_core(blocks):
    blocks.alloc(3)
    stats = blocks.stats()
    assert stats["engine_used_blocks"] == 3 and stats["used_blocks"] == 4  # + the null block
    assert stats["available_blocks"] == 96 and stats["engine_blocks"] == 100
