"""Model Runner V2's KV tensors under kvcached: V2's entry points called with real KV cache configs.

vLLM 0.32 runs Model Runner V2 (``vllm/v1/worker/gpu/``) on GPUs with Triton;
the CPU build falls back to the V1 runner, so no engine here reaches V2. These
tests call the function V2 builds its KV tensors with
(``vllm.v1.worker.gpu.attn_utils.allocate_kv_cache``, as kvcached patched it)
with configs vLLM's own planner laid out, plain and hybrid, on the host device,
and compare the tensors with what V2 allocates without kvcached.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")
pytest.importorskip("kvcached.pool", reason="kvcached core not built")
torch = pytest.importorskip("torch")

from vllm.v1.kv_cache_interface import KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvcached.integration import vllm as plugin  # noqa: E402
from test_vllm_kv_tensors import MODELS, _config  # noqa: E402

CONFIGS = {**MODELS, "llama": [KVCacheGroupSpec(["l0", "l1"], MODELS["gpt_oss"][1].kv_cache_spec)]}


@pytest.fixture
def v2_attn_utils(monkeypatch, tmp_path):
    """V2's attn_utils with kvcached's patches installed; closes the KV space a test made."""
    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    plugin.register()
    from vllm.v1.worker.gpu import attn_utils

    from kvcached.integration.vllm.v0_32 import worker

    assert getattr(attn_utils.allocate_kv_cache, "_kvcached_patched", False)
    yield attn_utils
    space = worker._spaces.pop(os.getpid(), None)
    if space is not None:
        space.close()


def _plan(config, page_bytes: int = 64 << 10):
    """Marks ``config`` as kvcached's plan of a one-rank engine on the host, as the EngineCore does."""
    from kvcached.integration.common.acks import AckBoard
    from kvcached.integration.common.rank_devices import describe_rank
    from kvcached.integration.vllm.v0_32 import plan

    layout = plan.layout_of(config, page_bytes)
    board = AckBoard.create(1)
    ranks = (describe_rank(torch.device("cpu"), 0),)
    setattr(config, plan.PLAN_ATTR, plan.EnginePlan(ranks=ranks, layouts=(layout,), board_path=board.path))
    setattr(config, plan.RANK_ATTR, 0)
    return board


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC], ids=lambda layout: layout.name)
@pytest.mark.parametrize("model", sorted(CONFIGS))
def test_v2_kv_tensors_match_vllms_own_over_kvcached_memory(v2_attn_utils, model, layout):
    from kvcached.integration.vllm.v0_32 import worker

    config = _config(CONFIGS[model], layout)
    kernel_block_sizes = [group.kv_cache_spec.block_size for group in config.kv_cache_groups]
    theirs = v2_attn_utils.allocate_kv_cache.__wrapped__(config, torch.device("cpu"), layout, kernel_block_sizes)
    board = _plan(config)
    try:
        ours = v2_attn_utils.allocate_kv_cache(config, torch.device("cpu"), layout, kernel_block_sizes)
        flat = worker._spaces[os.getpid()].flat_bytes()
    finally:
        board.close()
    assert set(ours) == set(theirs)
    their_base = next(iter(theirs.values())).untyped_storage().data_ptr()
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel()
    for name, view in theirs.items():
        mine = ours[name]
        assert (mine.shape, mine.stride(), mine.dtype) == (view.shape, view.stride(), view.dtype), name
        # Same place in kvcached's space as in vLLM's buffer: groups alias exactly as they do there.
        assert mine.data_ptr() - start == view.data_ptr() - their_base, name
        assert start <= mine.data_ptr() < end, name
    if len(config.kv_cache_groups) > 1 and layout is KVCacheLayout.LBHNC:
        # Overlaid groups: the first layer of every group starts at the space's first byte.
        firsts = {ours[group.layer_names[0]].data_ptr() for group in config.kv_cache_groups}
        assert firsts == {start}


def test_v2_model_runner_kv_cache_entry_is_patched(v2_attn_utils):
    model_runner = pytest.importorskip("vllm.v1.worker.gpu.model_runner")
    assert getattr(model_runner.GPUModelRunner.initialize_kv_cache, "_kvcached_patched", False)
