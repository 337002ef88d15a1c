"""The engine-independent parts of the integrations: layouts, engine blocks, ranks and their acknowledgements."""

from __future__ import annotations

import dataclasses
import time

import pytest

from kvcached.errors import IntegrationError, OutOfMemoryError
from kvcached.integration.common.acks import AckBoard
from kvcached.integration.common.blocks import EngineBlocks
from kvcached.integration.common.engine_layout import engine_layout, engine_page_bytes, stage_layout
from kvcached.integration.common.mirrors import process_alive
from kvcached.integration.common.rank_devices import RankDevice, describe_rank, require_one_host
from kvcached.integration.common.registration import register_ranks
from kvcached.integration.common.settings import DEFAULT_PAGE_BYTES, Settings, is_enabled
from kvcached.registry import DeviceRegistry, MemoryPolicy, registry_for
from rank_process import RankProcess, close_all

KiB = 1 << 10
# 100 engine blocks of 4 KiB in 64 KiB pages: 16 blocks per page, 7 pages, the
# last one holding only 4 blocks (ids past 99 do not exist).
LAYOUT = engine_layout(num_blocks=100, block_bytes=4 * KiB, num_layers=2, num_buffers=2, page_bytes=64 * KiB)
PAGE_ID_BYTES = 64 * KiB * 2 * 2


@pytest.fixture
def blocks(request):
    name = request.node.name[:60]
    budget = registry_for("cpu").register(name)
    engine = EngineBlocks.local(LAYOUT, device="cpu", budget=budget, name=name)
    yield engine
    engine.close()


def test_engine_layout_holds_whole_blocks_and_exact_block_ids():
    assert (LAYOUT.num_blocks, LAYOUT.num_pages, LAYOUT.blocks_per_page) == (100, 7, 16)
    assert LAYOUT.blocks_on_page(6) == 4
    odd = engine_layout(num_blocks=10, block_bytes=3 * KiB, num_layers=1, num_buffers=2, page_bytes=64 * KiB)
    assert odd.page_bytes == engine_page_bytes(64 * KiB, 3 * KiB) == 192 * KiB  # grows to hold whole blocks
    stage = stage_layout(LAYOUT, 1)
    assert (stage.num_layers, stage.num_blocks, stage.blocks_per_page) == (1, 100, 16)
    assert stage.page_id_bytes == LAYOUT.page_id_bytes // 2
    with pytest.raises(ValueError):
        engine_layout(num_blocks=8, block_bytes=4 * KiB, num_layers=1, num_buffers=3, page_bytes=64 * KiB)
    with pytest.raises(ValueError):
        engine_page_bytes(0, 4 * KiB)


def test_engine_blocks_hand_out_every_engine_id_and_never_the_null_block(blocks):
    assert blocks.available() == 99 == blocks.logical_free()
    ids = blocks.alloc(99)  # everything, the short last page included
    assert sorted(ids.tolist()) == list(range(1, 100))
    assert blocks.available() == 0 and blocks.logical_free() == 0
    with pytest.raises(OutOfMemoryError):
        blocks.alloc(1)
    blocks.free(ids)
    assert blocks.available() == 99
    assert blocks.trim() == 6  # idle: every free page goes back; the null block's page stays
    assert blocks.stats()["mapped_pages"] == 1


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
    registry_for("cpu").set_policy(blocks.manager.name, max_bytes=blocks.stats()["held_bytes"])  # no more pages
    assert not blocks.secure(40) and blocks.num_short_secures == 1
    ids = blocks.alloc(20)  # takes the secured blocks: no new page needed
    assert ids.size == 20 and blocks.secured == 11  # partial securing kept the rest of the mapped pages
    with pytest.raises(ValueError):
        blocks.free([int(blocks.stats()["used_blocks"])])  # a secured id is not the engine's to free
    blocks.end_step()
    assert blocks.secured == 0 and blocks.logical_free() == 79


def test_alloc_that_fails_keeps_secured_blocks(blocks):
    registry_for("cpu").set_policy(blocks.manager.name, max_bytes=2 * PAGE_ID_BYTES)
    assert blocks.secure(8)
    with pytest.raises(OutOfMemoryError):
        blocks.alloc(100)
    assert blocks.secured == 8 and blocks.logical_free() == 99


def test_clear_frees_everything_handed_out(blocks):
    blocks.alloc(30)
    blocks.secure(5)
    blocks.clear()
    stats = blocks.stats()
    assert blocks.logical_free() == 99 and stats["secured_blocks"] == 0 and stats["used_blocks"] == 1


def test_a_released_engine_sleeps_with_nothing_mapped_and_its_own_accounting_unchanged(blocks):
    ids = blocks.alloc(30)
    with pytest.raises(ValueError, match="30 block"):
        blocks.sleep()  # the engine flushes its cache first
    blocks.free(ids)
    assert blocks.secure(10)
    assert blocks.sleep() == 2 and blocks.asleep  # secured blocks go back with everything else
    entry = next(e for e in registry_for("cpu").entries() if e["name"] == blocks.manager.name)
    assert entry["mapped_bytes"] == 0  # the null block's page too
    stats = blocks.stats()
    assert stats["engine_used_blocks"] == 0 and stats["secured_blocks"] == 0 and blocks.logical_free() == 99
    assert blocks.available() == 0 and not blocks.secure(1)
    blocks.end_step()  # steps and idle turns map nothing
    assert blocks.trim() == 0 and blocks.stats()["mapped_pages"] == 0
    blocks.wake_up()
    assert not blocks.asleep and blocks.stats()["mapped_pages"] == 1 and blocks.available() == 99


def test_an_engine_keeps_the_pages_it_freed_until_its_idle_hold_ends(blocks):
    """A flushed cache followed by the next requests maps nothing again."""
    blocks.alloc(60)
    mapped = blocks.stats()["mapped_pages"]
    assert mapped == 4
    blocks.clear()  # frees every block, then one reserve round
    blocks.end_step()
    assert blocks.stats()["mapped_pages"] == mapped and blocks.stats()["free_pages"] == mapped - 1
    slow = blocks.stats()["slow_allocs"]
    blocks.alloc(60)
    assert blocks.stats()["slow_allocs"] == slow  # every block came from a page still mapped
    blocks.clear()
    for _ in range(8):  # steps with nothing to allocate still keep them
        blocks.end_step()
    assert blocks.stats()["mapped_pages"] == mapped
    assert blocks.trim() == mapped - 1  # the idle hold's end: only the null block's page stays


def test_a_busy_engine_gives_freed_pages_back_when_another_instance_waits(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))  # a device of 6 pages of its own
    registry = DeviceRegistry("cpu", 6 * PAGE_ID_BYTES)
    budget, other = registry.register("busy"), registry.register("waiting")
    engine = EngineBlocks.local(LAYOUT, device="cpu", budget=budget, name="busy")
    try:
        ids = engine.alloc(90)  # 6 pages: the device is full
        engine.free(ids[:60])
        engine.end_step()
        stats = engine.stats()
        assert stats["mapped_pages"] == 6 and stats["free_pages"] >= 2  # kept: nobody else wants it
        other.want(PAGE_ID_BYTES)  # the device is full: pressure on the holder
        engine.end_step()
        stats = engine.stats()
        assert stats["free_pages"] == 0 and stats["mapped_pages"] == stats["used_pages"] < 6
        assert budget.mapped_bytes == stats["held_pages"] * PAGE_ID_BYTES
    finally:
        engine.close()


def test_without_keeping_freed_pages_they_go_back_at_the_end_of_the_step(request, monkeypatch):
    monkeypatch.setenv("KVCACHED_KEEP_FREED_WHILE_BUSY", "0")
    monkeypatch.setenv("KVCACHED_MAX_RESERVE_PAGES", "1")
    name = request.node.name[:60]
    budget = registry_for("cpu").register(name)
    engine = EngineBlocks.local(LAYOUT, device="cpu", budget=budget, name=name)
    try:
        engine.alloc(60)
        engine.clear()
        assert engine.stats()["mapped_pages"] == 2  # the null block's page and one free page
    finally:
        engine.close()


def test_engine_blocks_stats_count_engine_and_core(blocks):
    blocks.alloc(3)
    blocks.secure(2)
    stats = blocks.stats()
    assert stats["engine_used_blocks"] == 3 and stats["used_blocks"] == 6  # + 2 secured + the null block
    assert stats["available_blocks"] == 96 and stats["engine_blocks"] == 100


def test_an_ack_board_is_shared_by_its_path():
    board = AckBoard.create(3)
    other = AckBoard.attach(board.path, 3)
    other.publish(2, 41)
    assert board.seqs() == [0, 0, 41]
    with pytest.raises(RuntimeError, match="ranks"):
        AckBoard.attach(board.path, 4)
    other.close()
    other.close()  # idempotent
    board.close()
    with pytest.raises(RuntimeError, match="same user"):
        AckBoard.attach("/proc/self/fd/999999", 1)


def test_a_rank_describes_its_device_and_registers_under_its_label():
    rank = describe_rank("cpu", 3)
    assert (rank.device, rank.local_device, rank.label, rank.rank) == ("cpu", "cpu", "rank3-cpu", 3)
    policy = MemoryPolicy(min_bytes=1 << 19, max_bytes=1 << 20, priority=-3)
    budgets = register_ranks("described", [rank, describe_rank("cpu", 4)], policy=policy)
    entries = [e for e in registry_for("cpu").entries() if e["name"] == "described"]
    assert sorted(e["local_device"] for e in entries) == ["rank3-cpu", "rank4-cpu"]
    assert {(e["max_bytes"], e["min_bytes"], e["priority"]) for e in entries} == {(1 << 20, 1 << 19, -3)}
    for budget in budgets:
        budget.unregister()


def test_every_rank_must_run_on_the_deciding_host():
    here = describe_rank("cpu", 0)
    require_one_host([here, dataclasses.replace(here, rank=1)], ranks_called="worker", decider="the EngineCore")
    away = dataclasses.replace(here, rank=1, host="elsewhere-node")
    with pytest.raises(
        IntegrationError, match=r"every worker on the host of the EngineCore .*workers run on elsewhere-node"
    ):
        require_one_host([here, away], ranks_called="worker", decider="the EngineCore")

    class EngineRefusal(IntegrationError):
        pass

    with pytest.raises(EngineRefusal, match="Unset KVCACHED_ENABLE"):
        require_one_host([away], ranks_called="rank", decider="rank 0", error=EngineRefusal)


def test_a_zombie_is_not_alive():
    import subprocess

    child = subprocess.Popen(["true"])
    deadline = time.time() + 10
    while process_alive(child.pid) and time.time() < deadline:
        time.sleep(0.01)  # exited, not reaped: a zombie
    assert not process_alive(child.pid)
    child.wait()
    assert process_alive(__import__("os").getpid())


# --------------------------------------------------------------------------- #
# A deciding engine and its ranks, each in a process of its own
# --------------------------------------------------------------------------- #


def _entry(name: str, label: str) -> dict:
    (entry,) = [e for e in registry_for("cpu").entries() if e["name"] == name and e["local_device"] == label]
    return entry


@pytest.fixture
def two_ranks(request):
    """A deciding engine with two ranks (pipeline stages: 2 layers and 1), each in its own process."""
    name = request.node.name[:60]
    layouts = [LAYOUT, stage_layout(LAYOUT, 1)]
    board = AckBoard.create(2)
    ranks = [RankProcess(layout, rank, board.path, 2) for rank, layout in enumerate(layouts)]
    devices = [rank.device for rank in ranks]
    budgets = register_ranks(name, devices, policy=MemoryPolicy())
    engine = EngineBlocks.deciding(layouts, budgets, ranks=devices, board=board, name=name, ack_timeout_s=0.5)
    yield engine, ranks, name
    close_all(ranks)
    engine.close()


def _send(engine: EngineBlocks, ranks: list) -> None:
    ops = engine.take_page_ops()
    for rank in ranks:
        if ops is not None:
            rank.apply(ops)


def test_every_rank_maps_the_pages_and_is_charged_on_its_own_budget(two_ranks):
    engine, ranks, name = two_ranks
    engine.alloc(40)  # 3 pages, with the null block's
    _send(engine, ranks)
    engine.poll_acknowledgements()
    stats = [rank.stats() for rank in ranks]
    assert [s["mapped_pages"] for s in stats] == [3, 3]
    assert [s["mapped_bytes"] for s in stats] == [3 * PAGE_ID_BYTES, 3 * PAGE_ID_BYTES // 2]  # stage 1: one layer
    assert _entry(name, "rank0-cpu")["mapped_bytes"] == 3 * PAGE_ID_BYTES
    assert _entry(name, "rank1-cpu")["mapped_bytes"] == 3 * PAGE_ID_BYTES // 2
    mirrors = engine.stats()["mirrors"]
    assert [m["acked_seq"] for m in mirrors] == [engine.stats()["last_seq"]] * 2


def test_an_unmap_is_released_on_a_rank_only_after_that_rank_acknowledged_it(two_ranks):
    engine, ranks, name = two_ranks
    ids = engine.alloc(40)
    _send(engine, ranks)
    engine.poll_acknowledgements()
    engine.free(ids)
    engine.trim()
    unmap = engine.take_page_ops()
    ranks[0].apply(unmap)  # rank 1 has not applied the unmap yet
    engine.poll_acknowledgements()
    assert _entry(name, "rank0-cpu")["mapped_bytes"] == PAGE_ID_BYTES  # the null block's page
    assert _entry(name, "rank1-cpu")["mapped_bytes"] == 3 * PAGE_ID_BYTES // 2  # still mapped there
    assert engine.stats()["pending_pages"] == 2  # not reusable until every rank unmapped them
    assert engine.available() == 99 - 2 * 16  # the other ids are allocatable: the charge moves to them
    ranks[1].apply(unmap)
    engine.poll_acknowledgements()
    assert _entry(name, "rank1-cpu")["mapped_bytes"] == PAGE_ID_BYTES // 2
    assert engine.stats()["pending_pages"] == 0 and engine.available() == 99


def test_a_rank_keeps_no_memory_its_budget_was_given_back(two_ranks):
    """The unmapped allocations are released in the rank's process, not kept as spares the budget no longer counts."""
    engine, ranks, name = two_ranks
    engine.free(engine.alloc(40))
    _send(engine, ranks)
    engine.trim()
    _send(engine, ranks)
    engine.poll_acknowledgements()
    assert [rank.stats()["mapped_pages"] for rank in ranks] == [1, 1]  # the null block's page
    assert [rank.stats()["spare_pages"] for rank in ranks] == [0, 0]
    assert _entry(name, "rank0-cpu")["mapped_bytes"] == PAGE_ID_BYTES


def test_a_dead_rank_gives_its_budget_back_and_stops_holding_the_others(two_ranks, caplog):
    engine, ranks, name = two_ranks
    ids = engine.alloc(40)
    _send(engine, ranks)
    engine.poll_acknowledgements()
    engine.free(ids)
    engine.trim()
    ranks[1].kill()
    _send(engine, ranks[:1])
    with caplog.at_level("ERROR"):
        assert engine.mirrors.check_ranks() == [1]
    assert "rank 1 (cpu on cpu) is lost: its process" in caplog.text
    assert _entry(name, "rank1-cpu")["mapped_bytes"] == 0
    engine.poll_acknowledgements()
    assert engine.stats()["pending_pages"] == 0  # rank 0 alone decides reuse now
    assert engine.stats()["lost_ranks"].keys() == {1}
    engine.alloc(40)  # charged on rank 0 only
    _send(engine, ranks[:1])
    assert _entry(name, "rank0-cpu")["mapped_bytes"] == 3 * PAGE_ID_BYTES


def test_a_rank_that_stops_acknowledging_is_declared_lost_after_the_timeout(two_ranks):
    engine, ranks, name = two_ranks
    engine.alloc(40)
    ops = engine.take_page_ops()
    ranks[0].apply(ops)
    ranks[1].stall()
    engine.poll_acknowledgements()
    assert engine.mirrors.check_ranks() == []  # not yet: within the bound
    time.sleep(0.6)
    assert engine.mirrors.check_ranks() == [1]
    assert "acknowledged no page operations" in engine.mirrors.lost[1]


@pytest.mark.parametrize("word", [2**64 - 1, 2**63, "next"])
def test_a_rank_whose_word_names_a_batch_never_handed_out_is_declared_lost(two_ranks, caplog, word):
    """A corrupt or hostile acknowledgement costs that rank, never the deciding process."""
    engine, ranks, name = two_ranks
    engine.alloc(40)
    _send(engine, ranks)
    seq = engine.stats()["last_seq"]
    engine.mirrors.board.publish(1, seq + 1 if word == "next" else word)
    with caplog.at_level("ERROR"):
        engine.poll_acknowledgements()  # no exception
        engine.poll_acknowledgements()  # and none on the next step either
    assert engine.stats()["lost_ranks"].keys() == {1}
    assert "was never handed out" in engine.mirrors.lost[1]
    assert "rank 1 (cpu on cpu) is lost" in caplog.text
    assert _entry(name, "rank1-cpu")["mapped_bytes"] == 0  # its memory is no longer charged
    assert engine.stats()["mirrors"][0]["acked_seq"] == seq  # the good rank still acknowledged
    engine.free(engine.alloc(16))  # the decider goes on
    _send(engine, ranks[:1])
    engine.poll_acknowledgements()
    assert engine.stats()["mirrors"][0]["acked_seq"] == engine.stats()["last_seq"]


def test_a_rank_whose_word_goes_back_is_declared_lost(two_ranks):
    engine, ranks, name = two_ranks
    engine.alloc(40)
    _send(engine, ranks)
    engine.poll_acknowledgements()
    engine.mirrors.board.publish(1, 0)
    engine.poll_acknowledgements()
    assert "went back" in engine.mirrors.lost[1]
    assert _entry(name, "rank1-cpu")["mapped_bytes"] == 0


@pytest.mark.emulation
def test_describe_rank_keys_a_gpu_by_its_physical_identity_whatever_the_index():
    """Two rank processes seeing one emulated GPU under different indices land in one registry."""
    pytest.importorskip("torch")
    from emulated_process import run_emulated

    code = """
        import dataclasses, json, torch
        from kvcached.integration.common.rank_devices import describe_rank
        {rocm}
        print(json.dumps(dataclasses.asdict(describe_rank(torch.device("cuda:{index}"), {rank}))))
    """
    seen = [
        run_emulated(
            "cuda", code.format(rocm="", index=0, rank=0), {"KVCACHED_EMULATED_GPUS": "2", "CUDA_VISIBLE_DEVICES": "1"}
        ),
        run_emulated("cuda", code.format(rocm="", index=1, rank=1), {"KVCACHED_EMULATED_GPUS": "2"}),
        run_emulated(
            "hip",
            code.format(rocm='torch.version.hip = "7.0"', index=0, rank=2),
            {"KVCACHED_EMULATED_GPUS": "2", "HIP_VISIBLE_DEVICES": "1"},
        ),
    ]
    ranks = [RankDevice(**fields) for fields in seen]
    assert ranks[0].device == ranks[1].device and ranks[0].device.startswith("cuda-GPU-")
    assert [r.label for r in ranks] == ["rank0-cuda:0", "rank1-cuda:1", "rank2-hip:0"]
    assert ranks[2].device.startswith("hip-GPU-")
    budgets = register_ranks("tp-engine", ranks, policy=MemoryPolicy())  # this process never opens a GPU
    try:
        entries = registry_for(ranks[0].device).entries()
        assert sorted(e["local_device"] for e in entries if e["name"] == "tp-engine") == [
            "rank0-cuda:0",
            "rank1-cuda:1",
        ]
        assert [e["local_device"] for e in registry_for(ranks[2].device).entries()] == ["rank2-hip:0"]
    finally:
        for budget in budgets:
            budget.unregister()


def test_settings_come_from_the_one_options_table(monkeypatch):
    for name in (
        "KVCACHED_VIRTUAL_CAPACITY_BYTES",
        "KVCACHED_PAGE_BYTES",
        "KVCACHED_IDLE_CACHE_BYTES",
        "KVCACHED_RANK_ACK_TIMEOUT_S",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVCACHED_LIMIT_BYTES", "64MiB")
    monkeypatch.setenv("KVCACHED_MIN_BYTES", "16MiB")
    monkeypatch.setenv("KVCACHED_PRIORITY", "-7")
    monkeypatch.setenv("KVCACHED_NAME", "engine-a")
    settings = Settings.from_env()
    assert settings == Settings(
        virtual_bytes=None,
        policy=MemoryPolicy(min_bytes=16 << 20, max_bytes=64 << 20, priority=-7),
        page_bytes=DEFAULT_PAGE_BYTES,
        name="engine-a",
        idle_cache_bytes=0,
        rank_ack_timeout_s=120.0,
    )
    monkeypatch.setenv("KVCACHED_LIMIT_BYTES", "lots")
    with pytest.raises(ValueError, match="KVCACHED_LIMIT_BYTES"):
        Settings.from_env()
    monkeypatch.setenv("KVCACHED_ENABLE", "maybe")
    assert is_enabled() is False  # an engine plugin never raises on it
