"""The vLLM plugin entry: gating, version check, idempotence (no engine started)."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

from kvcached.integration import vllm as plugin
from kvcached.integration.common import settings

pytestmark = pytest.mark.vllm


@pytest.fixture
def no_flags(monkeypatch):
    for name in ("KVCACHED_ENABLE", "ENABLE_KVCACHED"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "name,value,expected",
    [
        ("KVCACHED_ENABLE", "1", True),
        ("KVCACHED_ENABLE", "true", True),
        ("ENABLE_KVCACHED", "true", True),
        ("ENABLE_KVCACHED", "1", True),
        ("KVCACHED_ENABLE", "0", False),
        ("KVCACHED_ENABLE", "", False),
        ("ENABLE_KVCACHED", "false", False),
    ],
)
def test_enabled_by_either_variable(no_flags, name, value, expected):
    no_flags.setenv(name, value)
    assert settings.is_enabled() is expected


def test_register_is_a_no_op_when_disabled(no_flags):
    before = dict(plugin._installed)
    plugin.register()
    assert plugin._installed == before


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "1.0.0", "0.25.0+cu124", "dev"])
def test_other_vllm_versions_are_refused_by_name(version):
    with pytest.raises(plugin.UnsupportedVLLMVersion, match="supported: 0.32.x, 0.33.x, 0.34.x"):
        plugin.module_for(version)


def test_supported_versions_resolve_to_one_module():
    assert plugin.module_for("0.32.0").__name__.endswith(".v0_32")
    assert plugin.module_for("0.32.1+cpu").__name__.endswith(".v0_32")
    assert plugin.module_for("0.33.0").__name__.endswith(".v0_33")
    assert plugin.module_for("0.34.0").__name__.endswith(".v0_34")


def test_register_logs_and_survives_an_unsupported_vllm(no_flags, caplog):
    vllm = pytest.importorskip("vllm")
    no_flags.setenv("KVCACHED_ENABLE", "1")
    no_flags.setattr(vllm, "__version__", "0.99.0")
    no_flags.setattr(plugin._plugin, "installed", {})
    with caplog.at_level(logging.ERROR, logger="kvcached.integration.vllm"):
        plugin.register()  # must not raise: vLLM calls plugins unguarded
    assert plugin._plugin.installed == {}
    assert "kvcached is NOT active" in caplog.text and "0.32.x" in caplog.text


def test_entry_point_is_installed():
    pytest.importorskip("vllm")
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(p.name == "kvcached" and p.value == "kvcached.integration.vllm:register" for p in points)


def test_patches_install_once_and_bind_the_block_pool(no_flags):
    pytest.importorskip("vllm")
    import vllm

    if plugin.POLICY.release_of(vllm.__version__) not in plugin.POLICY.releases:
        pytest.skip(f"vLLM {vllm.__version__} is not a supported version")
    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.block_pool import BlockPool

    no_flags.setenv("KVCACHED_ENABLE", "1")
    plugin.register()
    plugin.register()  # idempotent
    pool_class = kv_cache_coordinator.BlockPool
    assert issubclass(pool_class, BlockPool) and pool_class is not BlockPool
    assert pool_class.__name__ == "KvcachedBlockPool"
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = Scheduler.schedule
    plugin._installed.clear()
    plugin.register()  # a second install must not wrap twice
    assert Scheduler.schedule is schedule


# --------------------------------------------------------------------------- #
# Planning checks of the EngineCore (no engine: the plan's own rules)
# --------------------------------------------------------------------------- #


def _ranks(*hosts):
    import os
    import socket

    from kvcached.integration.common.rank_devices import RankDevice

    return [
        RankDevice(
            rank=i,
            device="cpu",
            local_device="cpu",
            total_bytes=1 << 30,
            pid=os.getpid(),
            host=host or socket.gethostname(),
        )
        for i, host in enumerate(hosts)
    ]


def _layouts(*layers, block_bytes=4096):
    from kvcached.integration.common.engine_layout import engine_layout

    return [
        engine_layout(num_blocks=64, block_bytes=block_bytes, num_layers=n, num_buffers=1, page_bytes=64 << 10)
        for n in layers
    ]


def test_ranks_of_tensor_and_pipeline_parallel_engines_are_accepted():
    from kvcached.integration.vllm.v0_32 import plan

    plan._check_ranks(_ranks(None, None), _layouts(2, 2))  # tensor parallel: the same layout
    plan._check_ranks(_ranks(None, None), _layouts(3, 1))  # pipeline stages: their own layers


def test_workers_on_another_host_are_refused_by_name():
    from kvcached.integration.vllm.v0_32 import plan

    with pytest.raises(plan.UnsupportedVLLMConfig, match="node-b"):
        plan._check_ranks(_ranks(None, "node-b"), _layouts(2, 2))


def test_ranks_must_share_their_block_ids():
    from kvcached.integration.vllm.v0_32 import plan

    mixed = [_layouts(2)[0], _layouts(2, block_bytes=8192)[0]]
    with pytest.raises(plan.UnsupportedVLLMConfig, match="same blocks on every rank"):
        plan._check_ranks(_ranks(None, None), mixed)
    with pytest.raises(RuntimeError, match="ranks"):
        plan._check_ranks(_ranks(None), _layouts(2, 2))  # one description for two configs


def test_an_engine_process_flushes_when_its_loop_goes_idle_and_an_in_process_engine_after_its_step(monkeypatch):
    pytest.importorskip("vllm")
    import threading
    from types import SimpleNamespace

    from kvcached.integration.vllm.v0_32 import scheduler

    flushed = []
    engine = SimpleNamespace(lock=threading.RLock())

    def flush(core, hold=True):
        flushed.append((core, hold, engine.lock._is_owned()))

    monkeypatch.setattr(scheduler, "_flush_if_idle", flush)

    class InProcessCore:  # vLLM's EngineCore: the caller steps it, nothing runs after
        def __init__(self):
            self._idle_state_callbacks = []
            self.scheduler = SimpleNamespace(_kvcached=engine)

        def step(self):
            stepped_locked.append(engine.lock._is_owned())
            return "outputs"

    class CoreProcess(InProcessCore):  # EngineCoreProc: its loop runs the idle callbacks before waiting
        def run_busy_loop(self):
            raise AssertionError("not run here")

    stepped_locked = []
    step = scheduler.wrap_flushing(InProcessCore.step)
    core = InProcessCore()
    assert step(core) == "outputs" and flushed == [(core, True, True)]  # held, under the lock
    assert stepped_locked == [True]  # an idle flush on the watching thread waits for the step
    flushed.clear()
    process = CoreProcess()
    assert step(process) == "outputs" and step(process) == "outputs"
    assert flushed == [] and process._idle_state_callbacks == [flush]  # registered once
    process._idle_state_callbacks.pop()(process)  # what the loop does once it has no work
    assert flushed == [(process, True, False)] and stepped_locked == [True, False, False]


def _idle_engine(hold_s):
    """An EngineKV stand-in with what the idle flush uses, and the list of what it released."""
    import threading
    from types import SimpleNamespace

    from kvcached.integration.common.idle import IdleRelease

    released = []

    class Blocks:  # what the idle flush uses of EngineBlocks
        def trim(self):
            released.append("trim")

        def take_page_ops(self):
            return None

        def poll_acknowledgements(self):
            pass

    class BlockPool:
        def release_cached_blocks(self, keep_bytes):
            released.append("prefix cache")

    engine = SimpleNamespace(
        blocks=Blocks(), block_pool=BlockPool(), idle=IdleRelease(hold_s, []), lock=threading.RLock()
    )
    return engine, released


def test_an_idle_in_process_engine_holds_its_memory_then_the_watching_thread_gives_it_back():
    pytest.importorskip("vllm")
    import time
    from types import SimpleNamespace

    from kvcached.integration.vllm.v0_32 import scheduler

    engine, released = _idle_engine(0.2)
    core = SimpleNamespace(scheduler=SimpleNamespace(_kvcached=engine, get_num_unfinished_requests=lambda: 0))
    started = time.monotonic()
    with engine.lock:  # as at the end of a step
        scheduler._flush_if_idle(core)
        assert released == []  # held
        time.sleep(0.4)  # the hold passes while a step still runs: the flush waits for it
        assert released == []
    deadline = time.monotonic() + 5.0
    while not released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert released == ["prefix cache", "trim"] and time.monotonic() - started >= 0.2
    engine.idle.close()


def test_an_in_process_engine_busy_again_within_its_hold_keeps_its_memory():
    pytest.importorskip("vllm")
    import time
    from types import SimpleNamespace

    from kvcached.integration.vllm.v0_32 import scheduler

    engine, released = _idle_engine(0.2)
    unfinished = [0]
    core = SimpleNamespace(
        scheduler=SimpleNamespace(_kvcached=engine, get_num_unfinished_requests=lambda: unfinished[0])
    )
    scheduler._flush_if_idle(core)
    unfinished[0] = 1
    engine.idle.busy()  # the next schedule(): work came back before the hold ran out
    time.sleep(0.5)
    assert released == []
    engine.idle.close()


def test_an_idle_engine_process_holds_its_memory_then_its_loop_is_woken_to_give_it_back():
    pytest.importorskip("vllm")
    import queue
    from types import SimpleNamespace

    from vllm.v1.engine import EngineCoreRequestType

    from kvcached.integration.vllm.v0_32 import scheduler

    class CoreProcess(SimpleNamespace):  # an EngineCoreProc: its loop is woken to flush
        def run_busy_loop(self):
            raise AssertionError("not run here")

    engine, released = _idle_engine(0.2)
    core = CoreProcess(
        scheduler=SimpleNamespace(_kvcached=engine, get_num_unfinished_requests=lambda: 0),
        _idle_state_callbacks=[],
        input_queue=queue.Queue(),
    )
    scheduler._flush_if_idle(core)
    assert released == []  # held: the loop goes on to wait for input
    # The hold passes: the watching thread asks the loop to go round once more.
    assert core.input_queue.get(timeout=5.0) == (EngineCoreRequestType.WAKEUP, None)
    assert core._idle_state_callbacks == [scheduler._flush_if_idle]
    core._idle_state_callbacks.pop()(core)  # what the loop does before waiting again
    assert released == ["prefix cache", "trim"]
    engine.idle.close()


def test_the_pools_free_count_follows_kvcached_within_a_step_and_rereads_it_each_step():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.v1.core.block_pool import BlockPool

    from kvcached.integration.common.blocks import EngineBlocks
    from kvcached.integration.common.engine_layout import engine_layout
    from kvcached.integration.vllm.v0_32.block_pool import building, make_block_pool_class
    from kvcached.registry import registry_for

    layout = engine_layout(num_blocks=64, block_bytes=4096, num_layers=1, num_buffers=1, page_bytes=64 << 10)
    budget = registry_for("cpu").register("free-count")
    blocks = EngineBlocks.local(layout, device="cpu", budget=budget, name="free-count")
    reads = []
    available = blocks.available
    blocks.available = lambda: reads.append(1) or available()
    token = building.set(SimpleNamespace(blocks=blocks))
    try:
        pool = make_block_pool_class(BlockPool)(64, enable_caching=True, hash_block_size=16)
    finally:
        building.reset(token)
    try:
        first = pool.get_num_free_blocks()
        assert [pool.get_num_free_blocks() for _ in range(31)] == [first] * 31 and len(reads) == 1  # once a step
        taken = pool.get_new_blocks(5)
        assert pool.get_num_free_blocks() == first - 5 and len(reads) == 2  # what this pool took shows at once
        pool.free_blocks(taken)
        assert pool.get_num_free_blocks() == first
        blocks.manager.resize(layout.page_id_bytes)  # the limit moved: seen from the next step on
        assert pool.get_num_free_blocks() == first
        pool.forget_available()
        assert pool.get_num_free_blocks() < first
    finally:
        blocks.close()
