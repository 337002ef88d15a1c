"""kvcached's cover of vLLM 0.32's KV cache groups and tensors (no engine started).

vLLM's own planner (``get_kv_cache_config_from_groups``) lays out hybrid models
(sliding window + full attention, Mamba state + attention, several layers per
group) in each KV cache layout; the views kvcached carves over its space are
checked against the block regions kvcached maps: every byte a group's block
``b`` view reaches lies in kvcached's block ``b``, and every group's views
alias the same bytes vLLM's own buffer would give them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvcached.integration.vllm.v0_32.errors import UnsupportedVLLMConfig  # noqa: E402
from kvcached.integration.vllm.v0_32.kv_tensors import describe_layers, footprint, views_over  # noqa: E402
from kvcached.integration.vllm.v0_32.plan import layout_of  # noqa: E402

NUM_BLOCKS = 16
FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
WINDOW = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=16)
# A Mamba state padded to the attention page (vLLM unifies page sizes of hybrid models).
MAMBA = MambaSpec(
    block_size=64,
    shapes=((3, 64), (4, 16, 8)),
    dtypes=(torch.float32, torch.float32),
    page_size_padded=FULL.page_size_bytes,
)
CHUNKED = ChunkedLocalAttentionSpec(
    block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, attention_chunk_size=32
)
# DeepSeek-style latent cells: one KV head, K only (576 wide on vLLM's CPU MLA).
MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)


def _config(groups: list[KVCacheGroupSpec], layout: KVCacheLayout) -> KVCacheConfig:
    """vLLM's own plan for ``groups`` in ``layout`` (only the settings its planner reads)."""
    cache = SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: layout,
        num_gpu_blocks_override=NUM_BLOCKS,
        prefix_cache_retention_interval=None,
    )
    vllm_config = SimpleNamespace(cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None))
    return kv_cache_utils.get_kv_cache_config_from_groups(vllm_config, groups, 1 << 30)


MODELS = {
    # Gemma 3: five sliding-window layers to one full layer, one layer per group.
    "gemma3": [KVCacheGroupSpec([f"swa{i}"], WINDOW) for i in range(5)] + [KVCacheGroupSpec(["full"], FULL)],
    # gpt-oss: two groups of two layers each.
    "gpt_oss": [KVCacheGroupSpec(["swa0", "swa1"], WINDOW), KVCacheGroupSpec(["full0", "full1"], FULL)],
    # Qwen3-Next / Granite 4.0 hybrid: three state layers to one attention layer.
    "mamba_hybrid": [KVCacheGroupSpec(["m0", "m1", "m2"], MAMBA), KVCacheGroupSpec(["attn"], FULL)],
    # Llama 4: three chunked-local layers to one global layer, one layer per group.
    "llama4": [KVCacheGroupSpec([f"local{i}"], CHUNKED) for i in range(3)] + [KVCacheGroupSpec(["global"], FULL)],
    # DeepSeek-V2: every layer's latent cache in one group.
    "deepseek_v2": [KVCacheGroupSpec(["mla0", "mla1"], MLA)],
}
LAYOUTS = [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLHNC, KVCacheLayout.BLNHC]


def _block_region(found, block: int) -> torch.Tensor:
    """A mask of the bytes kvcached maps for ``block`` (every layer slot's page of it)."""
    size = found.num_layers * found.block_bytes * NUM_BLOCKS
    mask = torch.zeros(size, dtype=torch.bool)
    for slot in range(found.num_layers):
        start = slot * found.block_bytes * NUM_BLOCKS + block * found.block_bytes
        mask[start : start + found.block_bytes] = True
    return mask


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_groups_block_lies_in_the_block_kvcached_maps(model, layout):
    config = _config(MODELS[model], layout)
    found = footprint(config)
    assert found.num_layers * found.block_bytes * NUM_BLOCKS == config.kv_cache_tensors[0].size
    kv_layout = layout_of(config, page_bytes=1 << 16)
    assert (kv_layout.num_layers, kv_layout.block_bytes) == (found.num_layers, found.block_bytes)
    flat = torch.zeros(config.kv_cache_tensors[0].size, dtype=torch.int8)
    views = views_over(flat, config, layout, kernel_block_sizes=None)
    assert set(views) == {name for group in config.kv_cache_groups for name in group.layer_names}
    for block in range(NUM_BLOCKS):
        region = _block_region(found, block)
        for name, view in views.items():
            flat.zero_()
            view[block].view(torch.int8).fill_(1)
            reached = flat != 0
            assert reached.any() and not (reached & ~region).any(), (name, block)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_the_views_are_the_ones_vllm_carves_over_its_own_buffer(layout):
    """Same shapes, strides, dtype and offsets as vLLM's ``allocate_kv_cache`` (over its zeros)."""
    from vllm.v1.worker.utils import allocate_kv_cache

    config = _config(MODELS["gpt_oss"], layout)
    theirs = allocate_kv_cache(config, torch.device("cpu"), layout)
    flat = torch.zeros(config.kv_cache_tensors[0].size, dtype=torch.int8)
    ours = views_over(flat, config, layout, kernel_block_sizes=None)
    base = {"theirs": next(iter(theirs.values())).untyped_storage().data_ptr(), "ours": flat.data_ptr()}
    for name, view in theirs.items():
        mine = ours[name]
        assert (mine.shape, mine.stride(), mine.dtype) == (view.shape, view.stride(), view.dtype), name
        assert mine.data_ptr() - base["ours"] == view.data_ptr() - base["theirs"], name


def test_a_layout_no_block_id_space_covers_is_refused_by_name():
    # Head-outer pages of several layers (LHBNC): a block is spread over every head.
    groups = [KVCacheGroupSpec(["a", "b"], FULL)]
    config = _config(groups, KVCacheLayout.LHBNC)
    with pytest.raises(UnsupportedVLLMConfig, match="cannot cover this KV cache layout.*Unset KVCACHED_ENABLE"):
        footprint(config)


def test_host_resident_tensors_are_refused_by_name():
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=FULL.page_size_bytes * NUM_BLOCKS,
                layers=["full"],
                layer_stride=FULL.page_size_bytes * NUM_BLOCKS,
                block_stride=FULL.page_size_bytes,
                offset=0,
                host_resident=True,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["full"], FULL)],
    )
    with pytest.raises(UnsupportedVLLMConfig, match="FullAttentionSpec.*host-resident"):
        footprint(config)


def _engine_config(kv_cache_memory_bytes):
    return SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_memory_bytes=kv_cache_memory_bytes),
        model_config=SimpleNamespace(enable_sleep_mode=False),
        kv_transfer_config=None,
        attention_config=SimpleNamespace(hisparse_config=None),
    )


def _plan_refused(kv_cache_memory_bytes, calls):
    """kvcached's planning wrapper around a vLLM planner that lays the model out in a refused layout."""
    from kvcached.integration.vllm.v0_32 import plan

    refused = _config([KVCacheGroupSpec(["a", "b"], FULL)], KVCacheLayout.LHBNC)

    def original(vllm_config, specs, available_memory):
        calls.append(list(available_memory))
        return [refused]

    token = plan._described.set([object()])
    try:
        return plan.wrap_get_kv_cache_configs(original)(_engine_config(kv_cache_memory_bytes), {}, [1 << 30])
    finally:
        plan._described.reset(token)


def test_a_refused_model_runs_on_vllms_own_cache_of_the_size_set(caplog):
    from kvcached.integration.vllm.v0_32 import plan

    calls: list = []
    plan.logger.addHandler(caplog.handler)
    try:
        configs = _plan_refused(64 << 20, calls)
    finally:
        plan.logger.removeHandler(caplog.handler)
    # vLLM planned again for the size the user set, not kvcached's virtual capacity ...
    assert calls == [[1 << 30], [64 << 20]]
    # ... and nothing marks the configs as kvcached's: scheduler, pool and workers stay vLLM's own.
    assert not hasattr(configs[0], plan.PLAN_ATTR)
    assert "kvcached is NOT active for this engine" in caplog.text and "cannot cover" in caplog.text


def test_a_refused_model_without_a_kv_size_is_refused_with_what_to_set():
    with pytest.raises(UnsupportedVLLMConfig, match="cannot cover.*set kv_cache_memory_bytes"):
        _plan_refused(None, [])


def test_the_worker_log_names_the_layers_it_backs():
    """A pipeline stage's log line says which of the model's layers its KV space holds."""
    stage = [f"model.layers.{i}.self_attn.attn" for i in (5, 3, 4, 9)]
    assert describe_layers(stage) == "layers 3-5, 9"
    assert describe_layers(["model.layers.0.self_attn.attn"]) == "layers 0"
    # Names without exactly one index are listed as they are.
    assert describe_layers(["decoder.layers.1.encoder_attn.2", "lm"]) == "layers decoder.layers.1.encoder_attn.2, lm"
