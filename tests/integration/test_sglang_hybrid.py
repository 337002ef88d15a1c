"""Model families beyond plain attention inside the real SGLang 0.5.23 CPU engine, under kvcached.

Tiny random-weight models from ``kvcached.testing.tiny_hybrids``, each served
with and without kvcached side by side (``sglang_harness.py``, one process per
engine), greedy:

* Gemma 3 (5 sliding-window layers : 1 full; the variant whose next token
  depends on its context): SGLang turns its SWA pool off for Gemma 3 and serves
  every layer from ``MHATokenToKVPool``, kvcached's pool.
* DeepSeek-V2-style MLA (``MLATokenToKVPool``, one 576-wide latent row per token
  and layer), on the absorbed MLA path (``kvcached.testing.sglang_mla_cpu``: the
  CPU engine fails DeepSeek's MHA-form prefill without kvcached), in both engines.

Pages of 256 tokens (``KVCACHED_PAGE_BYTES``) make the small load span several
page ids. The kvcached engine runs the load, is capped by ``kvctl set-limit`` to
three page ids while it runs, and runs the load again. The pool families
kvcached refuses (SWA pool, Mamba / linear-attention state) are checked at the
end without an engine: SGLang's CPU build runs none of their models.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvcached.testing.sglang_env import require_sglang
from kvcached.testing.sglang_mla_cpu import ENV as ABSORBED_MLA
from kvcached.testing.tiny_hybrids import make_tiny_hybrid
from kvcached.testing.tiny_llama import prompt_ids

require_sglang()
pytest.importorskip("kvcached.pool", reason="kvcached core not built")

from sglang_runs import engine_env, finish, kvctl, probe, start, wait_for_file  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

# 8 requests growing to 232 tokens: 1856 slots, about 8 pages of 256 tokens.
LOAD = {"prompts": prompt_ids(8, 200, seed=7), "max_new_tokens": 32}
ENGINE = {"max_total_tokens": 4096}
LIMIT_PAGE_IDS = 3  # the padding page and two more: two or three requests at a time
# family -> (environment of both engines, KVCACHED_PAGE_BYTES giving 256-token pages)
FAMILIES = {
    # K or V of a token and layer: 4 heads x 64 x float32 = 1 KiB
    "gemma3_attending": ({}, 256 * 1024),
    # one 576-wide float32 latent row (2304 bytes): pages grow to 64 KiB x 9, 256 rows
    "deepseek_v2": ({ABSORBED_MLA: "1"}, 64 * 1024),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every family with and without kvcached, all engines at once; the kvcached
    ones are capped by kvctl between their two loads."""
    started, signals = {}, {}
    for family, (env, page_bytes) in FAMILIES.items():
        workdir = tmp_path_factory.mktemp(f"sglang-{family}")
        make_tiny_hybrid(family, workdir / "model")
        registry = workdir / "registry"
        registry.mkdir()
        loaded, limited = workdir / "loaded", workdir / "limited"
        common = {"page_size": 1, "engine": ENGINE}
        base_env = engine_env(False, registry, **env)
        kv_env = engine_env(True, registry, KVCACHED_NAME=f"kv-{family}", KVCACHED_PAGE_BYTES=str(page_bytes), **env)
        phases = [{**LOAD, "signal": str(loaded)}, {**LOAD, "wait_for": str(limited)}]
        started[family] = {
            "workdir": workdir,
            "base": start(workdir, "base", {**common, "phases": [LOAD]}, base_env),
            "kv": start(workdir, "kv", {**common, "phases": phases}, kv_env),
        }
        signals[family] = (registry, loaded, limited)
    results = {}
    try:
        for family, (registry, loaded, limited) in signals.items():
            procs = [started[family]["base"][0], started[family]["kv"][0]]
            wait_for_file(loaded, procs, f"{family}'s first load")
            # Idle after its first load, the engine maps its padding page: one page id.
            page_id_bytes = _mapped_bytes(registry, f"kv-{family}")
            limit = str(LIMIT_PAGE_IDS * page_id_bytes)
            results[family] = {"set_limit": kvctl(registry, "set-limit", f"kv-{family}", limit)}
            limited.write_text("done")
    finally:
        for _, _, limited in signals.values():
            limited.write_text("done")
    for family, engines in started.items():
        for label in ("base", "kv"):
            results[family][label] = finish(engines["workdir"], label, *engines[label])
    return results


def _mapped_bytes(registry, name: str) -> int:
    """What ``kvctl list`` shows ``name`` mapping now."""
    listing = kvctl(registry, "list", "--json")
    assert listing.returncode == 0, listing.stderr
    return next(e["mapped_bytes"] for e in json.loads(listing.stdout)["instances"] if e["name"] == name)


@pytest.mark.parametrize("family", FAMILIES)
def test_kvcached_backs_the_family_and_outputs_match_without_it(runs, family):
    kv, base = runs[family]["kv"], runs[family]["base"]
    assert probe(kv, "after_init")["kvcached"] is not None
    assert probe(base, "after_init")["kvcached"] is None
    assert "kvcached is NOT active" not in kv["log"]
    assert kv["outputs"][0] == base["outputs"][0]
    # The outputs compared depend on the KV cache: the model does not just repeat its last token.
    assert any(len(set(tokens)) > 2 for tokens in base["outputs"][0])


def test_gemma3_runs_on_sglangs_plain_pool_every_layer_elastic(runs):
    gemma3 = runs["gemma3_attending"]
    # SGLang's own decision, with or without kvcached: no SWA pool for Gemma 3.
    assert "Disable hybrid SWA memory for Gemma3ForCausalLM" in gemma3["kv"]["log"]
    stats = probe(gemma3["kv"], "after_init")["kvcached"]
    assert stats["engine_blocks"] == 4096 + 1  # every layer's slots in one kvcached space, + padding slot


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_grows_with_load_and_returns_when_idle(runs, family):
    kv = runs[family]["kv"]
    idle = probe(kv, "after_init")["mapped_bytes"]
    assert idle and idle > 0
    assert kv["peak_mapped_bytes"][0] >= 5 * idle  # the load's ~8 pages of 256 tokens
    done = probe(kv, "phase0_done")
    assert done["mapped_bytes"] == idle
    assert done["kvcached"]["engine_used_blocks"] == 0 and done["kvcached"]["secured_blocks"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_tight_limit_makes_requests_wait_with_unchanged_outputs(runs, family):
    assert runs[family]["set_limit"].returncode == 0, runs[family]["set_limit"].stderr
    kv, base = runs[family]["kv"], runs[family]["base"]
    idle = probe(kv, "after_init")["mapped_bytes"]
    assert kv["peak_mapped_bytes"][1] <= LIMIT_PAGE_IDS * idle
    assert probe(kv, "phase1_done")["kvcached"]["limit_pages"] == LIMIT_PAGE_IDS
    assert kv["outputs"][1] == base["outputs"][0]


# --------------------------------------------------------------------------- #
# Families kvcached refuses (no engine: SGLang's CPU build cannot run their models)
# --------------------------------------------------------------------------- #


def _configurator(**family):
    import sglang

    from kvcached.integration import sglang as plugin

    v = plugin.module_for(sglang.__version__)
    server_args = SimpleNamespace(kv_cache_dtype="auto", model_path="/m/hybrid", disaggregation_mode="null")
    fields = dict(is_hybrid_swa=False, mambaish_config=None, use_mla_backend=False)
    fields.update(family)
    configurator = SimpleNamespace(
        server_args=server_args,
        model_config=SimpleNamespace(head_dim=64, v_head_dim=64),
        is_draft_worker=False,
        post_capture_kv_active=False,
        device="cpu",
        gpu_id=0,
        **fields,
    )
    return v, configurator


@pytest.mark.parametrize(
    "family, named, reason",
    [
        ({"is_hybrid_swa": True}, "SWAKVPool: gpt-oss", "GptOssForCausalLM requires one of"),
        ({"mambaish_config": object()}, "MambaPool: Qwen3-Next", "No module named 'sgl_kernel.mamba'"),
    ],
)
def test_unbacked_pool_families_are_refused_by_name_with_the_cpu_builds_error(family, named, reason):
    v, configurator = _configurator(**family)
    (refusal,) = v.refusals(configurator)
    assert named in refusal and reason in refusal
    assert v.plan_for(configurator) is None  # SGLang builds its own pools


def test_mla_and_plain_attention_are_not_refused():
    for family in ({}, {"use_mla_backend": True}):
        v, configurator = _configurator(**family)
        assert v.refusals(configurator) == []
