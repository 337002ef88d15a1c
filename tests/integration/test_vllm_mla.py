"""kvcached with multi-head latent attention (DeepSeek-V2 style MLA) in the real vLLM CPU build.

vLLM's CPU MLA (its reference backend: 576-wide latent cells, 16-token blocks)
gives greedy outputs that change with which requests share a step, without
kvcached. With the multiprocessing client the EngineCore schedules requests
as they arrive, so two identical runs of vLLM alone can batch them
differently and disagree. These engines run in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): every request is queued before the
first step, so a run's batches follow from its KV budget alone. Then:

* kvcached with room to spare batches as vLLM does: outputs are identical;
* a kvcached limit of N blocks batches as vLLM's own static pool of N blocks
  does: outputs are identical to that pool's, and differ from the unlimited
  run's only because vLLM's MLA does (the last test shows it without kvcached).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

vllm = pytest.importorskip("vllm")
pytest.importorskip("kvcached.pool", reason="kvcached core not built")
pytest.importorskip("transformers")

from kvcached.testing.tiny_hybrids import (  # noqa: E402
    check_outputs_read_context,
    make_tiny_hybrid,
    with_context_changed,
)
from kvcached.testing.tiny_llama import prompt_ids  # noqa: E402
from kvcached.testing.vllm_runs import engine_env, peak, probe, run_side_by_side  # noqa: E402

# One block: 16 tokens x 576 float32 values per layer; 2 layers.
BLOCK_ID_BYTES = 2 * 16 * 576 * 4
# 256 KiB asked, grown to hold whole 36 KiB blocks: 64 blocks (2.25 MiB) per page and layer.
PAGE_BYTES = 256 << 10
PAGE_ID_BYTES = 64 * BLOCK_ID_BYTES
# Two page ids: 128 blocks, the null block included; the load peaks at 5 page ids.
LIMIT_BLOCKS = 128
LIMIT_BYTES = LIMIT_BLOCKS * BLOCK_ID_BYTES
SPEC = {
    "prefix_caching": False,  # vLLM's CPU MLA turns it off anyway
    "max_num_batched_tokens": 8192,
    "max_model_len": 1024,
    "phases": [
        # The last: the first's last token in another context (see check_outputs_read_context).
        {"prompts": with_context_changed(prompt_ids(4, 200, seed=1, shared_prefix=130)), "max_tokens": 8},
        # 8 requests of 500 + 32 tokens: 34 blocks each.
        {"prompts": prompt_ids(8, 500, seed=11), "max_tokens": 32, "probe_during": True},
    ],
}


@pytest.fixture(scope="module")
def mla_runs(vllm_workdir):
    model = make_tiny_hybrid("deepseek_v2", vllm_workdir / "deepseek_v2")
    registry = vllm_workdir / "registry-mla"
    registry.mkdir()
    spec = {**SPEC, "model": model}
    inproc = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVCACHED_PAGE_BYTES": str(PAGE_BYTES)}
    return run_side_by_side(
        vllm_workdir,
        {
            "mla_base": (spec, engine_env(False, registry, **inproc)),
            "mla_kv": (spec, engine_env(True, registry, **inproc)),
            # vLLM's own static pool of LIMIT_BLOCKS blocks, and kvcached limited to as many.
            "mla_base_small": ({**spec, "kv_cache_bytes": LIMIT_BYTES}, engine_env(False, registry, **inproc)),
            "mla_tight": (spec, engine_env(True, registry, KVCACHED_LIMIT_BYTES=str(LIMIT_BYTES), **inproc)),
        },
    )


def test_the_latent_cache_is_backed_by_kvcached(mla_runs):
    log = mla_runs["mla_kv"]["log"]
    assert "kvcached is NOT active" not in log
    line = next(text for text in log.splitlines() if "is a virtual" in text)
    assert "MLAAttentionSpec" in line, line
    engine = probe(mla_runs["mla_kv"], "after_init")["engine"]
    assert (engine["layout_block_bytes"], engine["page_id_bytes"]) == (BLOCK_ID_BYTES // 2, PAGE_ID_BYTES)


def test_greedy_outputs_match_without_kvcached(mla_runs):
    check_outputs_read_context(mla_runs["mla_base"]["outputs"][0])  # else matching outputs would prove nothing
    assert mla_runs["mla_kv"]["outputs"] == mla_runs["mla_base"]["outputs"]


def test_memory_grows_with_load_and_returns_when_idle(mla_runs):
    kv = mla_runs["mla_kv"]
    assert peak(kv, "phase1_running") >= 5 * PAGE_ID_BYTES
    assert peak(kv, "phase1_running", side="workers") >= 5 * PAGE_ID_BYTES
    for label in ("after_init", "phase1_done"):
        assert probe(kv, label)["engine"]["mapped_bytes"] <= PAGE_ID_BYTES, label
    done = probe(kv, "phase1_done")
    assert done["workers"][0]["mapped_bytes"] == done["engine"]["mapped_bytes"]
    assert done["engine"]["engine_used_blocks"] == 0 and done["engine"]["pending_pages"] == 0


def test_a_tight_limit_batches_as_vllms_own_pool_of_that_size(mla_runs):
    # Compared with vLLM's own pool of the limit's size, not with the unlimited run: vLLM's CPU
    # MLA gives other greedy outputs when fewer requests share a step, with or without kvcached.
    tight = mla_runs["mla_tight"]
    assert peak(mla_runs["mla_kv"], "phase1_running") > LIMIT_BYTES  # the load does not fit at once
    assert peak(tight, "phase1_running") <= LIMIT_BYTES
    assert tight["outputs"] == mla_runs["mla_base_small"]["outputs"]
