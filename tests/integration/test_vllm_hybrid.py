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

from kvcached.testing.tiny_hybrids import SLIDING_WINDOW, make_tiny_hybrid  # noqa: E402
from kvcached.testing.tiny_llama import prompt_ids  # noqa: E402
from kvcached.testing.vllm_runs import MiB, engine_env, peak, probe, run_side_by_side  # noqa: E402

# A shared prefix (prefix hits across the groups), then long prompts: 500
# tokens grow past 512 while decoding, so every sliding-window group drops the
# blocks its window left behind while the requests still run.
SHARED = {"prompts": prompt_ids(4, 200, seed=1, shared_prefix=130), "max_tokens": 8}
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
    tight_env = engine_env(True, registry, KVCACHED_LIMIT_BYTES=str(options["limit_bytes"]))
    return run_side_by_side(
        workdir,
        {
            f"{family}_base": (spec, engine_env(False, registry)),
            f"{family}_kv": (spec, engine_env(True, registry)),
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


@pytest.fixture(scope="module")
def gemma3_tp2(vllm_workdir):
    """Gemma 3 with tensor parallelism 2 (two worker processes), without and with kvcached."""
    model = make_tiny_hybrid("gemma3", vllm_workdir / "gemma3")
    registry = vllm_workdir / "registry-gemma3-tp2"
    registry.mkdir()
    load = {"prompts": prompt_ids(8, PROMPT_TOKENS, seed=11), "max_tokens": NEW_TOKENS, "probe_during": True}
    spec = {
        "model": model,
        "phases": [SHARED, load],
        "max_num_batched_tokens": 8192,
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.15,
    }
    return run_side_by_side(
        vllm_workdir, {"tp2_base": (spec, engine_env(False, registry)), "tp2_kv": (spec, engine_env(True, registry))}
    )


def test_tensor_parallel_hybrid_outputs_match_and_every_rank_follows_load(gemma3_tp2):
    base, kv = gemma3_tp2["tp2_base"], gemma3_tp2["tp2_kv"]
    assert kv["outputs"] == base["outputs"]
    page_costs = [m["page_id_bytes"] for m in probe(kv, "phase1_done")["engine"]["mirrors"]]
    running = [p for p in kv["probes"] if p["label"] == "phase1_running"]
    for rank, cost in enumerate(page_costs):
        # Each rank maps the same page ids for every group, in its own process.
        assert max(p["workers"][rank]["mapped_bytes"] for p in running) >= 3 * cost
    done = probe(kv, "phase1_done")
    assert [w["mapped_bytes"] for w in done["workers"]] == page_costs
    assert [m["acked_seq"] for m in done["engine"]["mirrors"]] == [done["engine"]["sent_seq"]] * 2
