"""The memory policy with a real vLLM engine (the CPU build): a busy low-priority engine gives
memory to a high-priority pool in another process, down to its min, with its outputs unchanged.

The engine runs through ``vllm_harness.py`` beside a baseline engine without kvcached; the
high-priority pool is a KVPool in this process, registered in the engine's device registry
(docs/memory-policy.md).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

vllm = pytest.importorskip("vllm")
pytest.importorskip("kvcached.pool", reason="kvcached core not built")

from kvcached.registry import registry_for  # noqa: E402
from kvcached.testing.policy_squeeze import live_entry, squeeze_low, wait_until_busy  # noqa: E402
from kvcached.testing.tiny_llama import prompt_ids  # noqa: E402
from kvcached.testing.vllm_runs import ENGINE_TIMEOUT_S, PAGE_ID_BYTES, engine_env, finish, probe, start  # noqa: E402

BUDGET_BYTES = 10 * PAGE_ID_BYTES
MIN_BYTES = 3 * PAGE_ID_BYTES
# 12 requests of 250 prompt tokens decoding 200 more: 4 blocks of 128 each, 48 blocks,
# about 7 page ids at peak; long enough (hundreds of steps) to be taken from while busy.
LOAD = {"prompts": prompt_ids(12, 250, seed=7), "max_tokens": 200}
BUSY_BYTES = 5 * PAGE_ID_BYTES  # the engine is deep in its load once it maps this much
HIGH_LAYERS, HIGH_BLOCK_BYTES = 2, 128 << 10  # the pool's page id: 2 layers x 2 MiB, as the engine's


def test_a_busy_low_priority_vllm_engine_gives_a_high_priority_pool_memory_down_to_its_min(vllm_workdir, monkeypatch):
    registry_dir = vllm_workdir / "registry-policy"
    registry_dir.mkdir()
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(registry_dir))
    registry = registry_for("cpu", total_bytes=BUDGET_BYTES)
    spec = {"prefix_caching": True, "phases": [LOAD]}
    # The idle hold outlasts the test: whatever the engine gives back, it gives because it is asked.
    low_env = engine_env(
        True,
        registry_dir,
        KVCACHED_NAME="low",
        KVCACHED_MIN_BYTES=str(MIN_BYTES),
        KVCACHED_PRIORITY="0",
        KVCACHED_IDLE_RELEASE_S="600",
    )
    base = start(vllm_workdir, "policy_base", spec, engine_env(False, vllm_workdir / "registry-policy-base"))
    low = start(vllm_workdir, "policy_low", spec, low_env)
    try:
        wait_until_busy(registry, [base[0], low[0]], "mapped_bytes", BUSY_BYTES, ENGINE_TIMEOUT_S)
        assert live_entry(registry)["min_bytes"] == MIN_BYTES
        squeeze = squeeze_low(
            registry,
            low[0],
            budget_bytes=BUDGET_BYTES,
            min_bytes=MIN_BYTES,
            page_id_bytes=PAGE_ID_BYTES,
            layers=HIGH_LAYERS,
            buffers=1,
            block_bytes=HIGH_BLOCK_BYTES,
        )
        result_base = finish(vllm_workdir, "policy_base", *base)
        result_low = finish(vllm_workdir, "policy_low", *low)
    finally:
        for proc, _ in (base, low):
            if proc.poll() is None:
                proc.kill()
    print(f"hand-over of {BUDGET_BYTES - MIN_BYTES} bytes from the busy engine: {squeeze.handover_s:.3f} s")
    squeeze.check_given_down_to(MIN_BYTES, PAGE_ID_BYTES)
    # Preempted requests recompute: the same tokens as the engine without kvcached.
    assert result_low["outputs"] == result_base["outputs"]
    assert probe(result_low, "phase0_done")["engine"]["num_preempted"] > 0
    assert squeeze.handover_s < 30.0, "a busy engine shrinks within a few steps (cached prefixes, then preemption)"
