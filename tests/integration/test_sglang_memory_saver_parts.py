"""kvcached's memory saver adapter for SGLang 0.5.23, without an engine: what pause and resume do to a model's
weights and to a KV cache, driven the way SGLang's release_memory_occupation and resume_memory_occupation drive
them, on the host backend."""

from __future__ import annotations

import types

import pytest

from kvcached.testing.sglang_env import require_sglang

sglang = require_sglang()
import torch  # noqa: E402  (SGLang needs it)

from kvcached.errors import IntegrationError, InvalidArgumentError, OutOfMemoryError  # noqa: E402
from kvcached.integration import sglang as plugin  # noqa: E402
from kvcached.integration.common.settings import Settings  # noqa: E402
from kvcached.registry import MemoryPolicy, registry_for  # noqa: E402

pytestmark = pytest.mark.sglang
MiB = 1 << 20
SUPPORTED = plugin.POLICY.release_of(sglang.__version__) in plugin.POLICY.releases


@pytest.fixture
def v():
    if not SUPPORTED:
        pytest.skip(f"SGLang {sglang.__version__} is not supported")
    return plugin.module_for(sglang.__version__)


@pytest.fixture
def engine(v, monkeypatch, request):
    """One scheduler process's view: its server arguments and kvcached's settings, named after the test."""
    import sglang.srt.runtime_context as runtime_context

    name = request.node.name[:60]
    server_args = types.SimpleNamespace(tp_size=1, pp_size=1, dp_size=1, model_path="/models/tiny")
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: server_args)
    monkeypatch.setattr(
        v.plan, "_settings", Settings(virtual_bytes=None, policy=MemoryPolicy(), page_bytes=2 * MiB, name=name)
    )
    return types.SimpleNamespace(name=name, server_args=server_args, saver=v.memory_saver.MemorySaver())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model.register_buffer("scale", torch.full((8,), 2.0))
    return model


def _row(name: str) -> dict:
    (row,) = [e for e in registry_for("cpu").entries() if e["name"] == name]
    return row


def _load(v, saver, model, cpu_backup: bool):
    """What SGLang's load_model_with_memory_saver does with kvcached's adapter, then the hook after it."""
    adapter = v.memory_saver.KvcachedMemorySaverAdapter(saver)
    with adapter.region("weights", enable_cpu_backup=cpu_backup):
        pass  # SGLang loads the model here
    return saver.adopt_weights(model, device="cpu", gpu_id=0)


def test_the_adapter_is_sglangs_own_kind_and_its_contexts_only_record(v, engine):
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    adapter = v.memory_saver.KvcachedMemorySaverAdapter(engine.saver)
    assert isinstance(adapter, TorchMemorySaverAdapter) and adapter.enabled
    with adapter.configure_subprocess(), adapter.disable(), adapter.region("kv_cache"):
        pass
    with adapter.region("weights", enable_cpu_backup=True):
        pass
    assert engine.saver.weights_level == v.memory_saver.LEVEL_DISCARD  # nothing adopted yet
    adapter.pause("cuda_graph")  # graph memory stays: nothing to do, nothing refused
    adapter.resume("cuda_graph")
    with pytest.raises(InvalidArgumentError, match="no memory type 'kv'"):
        adapter.pause("kv")
    with pytest.raises(IntegrationError, match="no model weights"):
        adapter.pause("weights")
    with pytest.raises(IntegrationError, match="no KV cache"):
        adapter.resume("kv_cache")


def test_weights_with_sglangs_cpu_backup_sleep_on_the_ranks_row_and_wake_with_their_contents(v, engine):
    model, x = _model(), torch.randn(4, 64)
    expected = model(x) * model.scale
    weights = _load(v, engine.saver, model, cpu_backup=True)
    row = _row(engine.name)
    assert row["local_device"] == "rank0-cpu" and row["weights_bytes"] == weights.nbytes > 0
    adapter = v.memory_saver.KvcachedMemorySaverAdapter(engine.saver)
    adapter.pause("weights")
    assert weights.sleep_level == 1
    row = _row(engine.name)
    assert (row["weights_bytes"], row["sleeping"]) == (0, True)
    adapter.resume("weights")
    assert torch.equal(model(x) * model.scale, expected)
    assert _row(engine.name)["weights_bytes"] == weights.nbytes
    # The KV cache's registration (Plan.open_blocks) joins the row: one per rank.
    from kvcached.integration.common.rank_devices import describe_rank
    from kvcached.integration.common.registration import register_rank

    kv = register_rank(engine.name, describe_rank("cpu", 0), policy=MemoryPolicy(), join=True)
    assert [e["name"] for e in registry_for("cpu").entries()].count(engine.name) == 1
    kv.unregister()
    weights.close()


def test_weights_without_the_backup_are_discarded_and_read_zeros_until_loaded_again(v, engine):
    model = _model()
    weights = _load(v, engine.saver, model, cpu_backup=False)
    engine.saver.pause("weights")
    assert weights.sleep_level == 2
    engine.saver.resume("weights")
    assert all(not p.any() for p in model.parameters()) and not model.scale.any()
    weights.close()


def test_a_wake_the_budget_cannot_hold_fails_in_resume_and_the_weights_stay_asleep(v, engine, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    model = _model()
    probe = _model()
    from kvcached.weights import ModelWeights

    with ModelWeights(probe, device="cpu", register=False) as sized:
        weights_bytes = sized.nbytes
    registry = registry_for("cpu", total_bytes=2 * weights_bytes)
    weights = _load(v, engine.saver, model, cpu_backup=True)
    engine.saver.pause("weights")
    other = registry.register("training")
    assert other.try_acquire(weights_bytes + 4096)  # the device lent to someone else meanwhile
    with pytest.raises(OutOfMemoryError, match="did not have room"):
        engine.saver.resume("weights")  # SGLang's scheduler reports it as any failed resume
    assert weights.sleep_level == 1 and _row(engine.name)["sleeping"] is True
    other.release(weights_bytes + 4096)
    engine.saver.resume("weights")
    assert not weights.is_sleeping
    weights.close()


def _kv_cache(v, name: str):
    from kvcached.integration.common.rank_devices import describe_rank

    settings = Settings(virtual_bytes=None, policy=MemoryPolicy(), page_bytes=2 * MiB, name=name)
    plan = v.Plan(settings=settings, rank=describe_rank("cpu", 0), name=name, virtual_bytes=64 * MiB)
    with v.building(plan):
        pool = v.KvcachedMHATokenToKVPool(
            size=8192,
            page_size=1,
            dtype=torch.float32,
            head_num=4,
            head_dim=64,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,  # SGLang's own adapter here: no hooks applied in this process
        )
    return pool, v.KvcachedTokenToKVPoolAllocator(8192, torch.float32, "cpu", pool, False)


def test_a_released_kv_cache_sleeps_when_sglang_flushes_it_and_grows_again_once_resumed(
    v, engine, tmp_path, monkeypatch
):
    page_id_bytes = 2 * MiB * 2 * 2  # 2 MiB pages, 2 layers, K and V
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    registry = registry_for("cpu", total_bytes=4 * page_id_bytes)
    pool, allocator = _kv_cache(v, engine.name)
    engine.saver.track_kv_cache(allocator)
    assert pool.kvcached_blocks.layout.page_id_bytes == page_id_bytes
    held = allocator.alloc(3000)  # cached prefixes, say
    assert _row(engine.name)["mapped_bytes"] == 2 * page_id_bytes
    engine.saver.pause("kv_cache")
    assert _row(engine.name)["mapped_bytes"] == 2 * page_id_bytes  # blocks in use: it sleeps at the flush
    allocator.clear()  # SGLang's flush_cache, right after pause("kv_cache")
    row = _row(engine.name)
    assert row["mapped_bytes"] == 0 and allocator.kvcached_stats()["asleep"]  # the padding page too
    assert allocator.available_size() == 0 and allocator.alloc(1) is None
    other = registry.register("training")
    assert other.try_acquire(4 * page_id_bytes)  # the device is full meanwhile
    assert not allocator.secure_tokens(16)
    assert _row(engine.name)["wanted_bytes"] == 0  # a released engine asks nobody for memory
    assert other.pressure_bytes == 0
    assert allocator.logical_available_size() == 8192  # SGLang's own accounting is unchanged
    other.release(4 * page_id_bytes)
    engine.saver.resume("kv_cache")
    assert _row(engine.name)["mapped_bytes"] == page_id_bytes  # the padding page
    loc = allocator.alloc(3000)
    assert loc is not None and int(loc.min()) >= 1 and held.shape == loc.shape
    allocator.free(loc)
    allocator.clear()
    engine.saver.pause("kv_cache")  # an empty cache sleeps at once
    assert _row(engine.name)["mapped_bytes"] == 0
    engine.saver.resume("kv_cache")
    pool.kvcached_blocks.close()


def test_sglang_gets_kvcached_adapter_only_where_kvcached_runs_the_engine(v, engine, monkeypatch):
    original = lambda enable: ("sglang's own", enable)  # noqa: E731
    create = v.memory_saver.hook_create_adapter
    assert create(original, False) == ("sglang's own", False)
    monkeypatch.setattr(v.memory_saver.SAVER, "handed_out_pid", None)
    assert isinstance(create(original, True), v.memory_saver.KvcachedMemorySaverAdapter)
    assert v.memory_saver.SAVER.in_use
    engine.server_args.speculative_algorithm = "EAGLE"  # refused by kvcached: SGLang's memory saver
    assert create(original, True) == ("sglang's own", True)
    with pytest.raises(IntegrationError, match="needs kvcached to run this engine's KV cache"):
        v.memory_saver.check_planned(None)  # refused only once the KV cache is planned: a clear stop
    v.memory_saver.check_planned(object())
