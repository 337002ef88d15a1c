"""The memory policy with a real SGLang engine (its CPU build): a busy low-priority engine gives
memory to a high-priority pool in another process, down to its min, with its outputs unchanged.

The engine runs through ``sglang_harness.py`` beside a baseline engine without kvcached; the
high-priority pool is a KVPool in this process, registered in the engine's device registry
(docs/memory-policy.md). The engine must evict its radix cache and retract running requests
to fit: its load needs several page ids, its min is two.
"""

from __future__ import annotations

import pytest

from kvcached.testing.sglang_env import require_sglang

require_sglang()
pytest.importorskip("kvcached.pool", reason="kvcached core not built")

from kvcached.registry import registry_for  # noqa: E402
from kvcached.testing.policy_squeeze import live_entry, squeeze_low, wait_until_busy  # noqa: E402
from kvcached.testing.tiny_llama import prompt_ids  # noqa: E402
from sglang_runs import ENGINE_TIMEOUT_S, PAGE_ID_BYTES, engine_env, finish, start  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

BUDGET_BYTES = 8 * PAGE_ID_BYTES
MIN_BYTES = 2 * PAGE_ID_BYTES  # the padding page's page id and one more: 4095 token slots
# 16 requests of 300 prompt tokens decoding 128 more: 6848 slots, 4 page ids at peak (the
# padding page's among them); over a hundred steps, long enough to be taken from while busy.
LOAD = {"prompts": prompt_ids(16, 300, seed=11), "max_new_tokens": 128}
# In use beyond its min: free pages alone cannot make way, its requests must.
BUSY_BYTES = 3 * PAGE_ID_BYTES
# The pool's page id: 2 layers x K and V x 2 MiB, as the engine's.
HIGH_LAYERS, HIGH_BUFFERS, HIGH_BLOCK_BYTES = 2, 2, 128 << 10


def test_a_busy_low_priority_sglang_engine_gives_a_high_priority_pool_memory_down_to_its_min(
    sglang_workdir, monkeypatch
):
    registry_dir = sglang_workdir / "registry-policy"
    registry_dir.mkdir()
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(registry_dir))
    registry = registry_for("cpu", total_bytes=BUDGET_BYTES)
    spec = {"page_size": 1, "phases": [{**LOAD, "settle_s": 0.0}]}
    # The idle hold outlasts the test: whatever the engine gives back, it gives because it is asked.
    low_env = engine_env(
        True,
        registry_dir,
        KVCACHED_NAME="low",
        KVCACHED_MIN_BYTES=str(MIN_BYTES),
        KVCACHED_PRIORITY="0",
        KVCACHED_IDLE_RELEASE_S="600",
    )
    base_spec = {**spec, "engine": {"max_total_tokens": 16384}}  # SGLang's CPU engine needs a size
    base = start(sglang_workdir, "policy_base", base_spec, engine_env(False, sglang_workdir / "registry-policy-base"))
    low = start(sglang_workdir, "policy_low", spec, low_env)
    try:
        wait_until_busy(registry, [base[0], low[0]], "used_bytes", BUSY_BYTES, ENGINE_TIMEOUT_S)
        assert live_entry(registry)["min_bytes"] == MIN_BYTES
        squeeze = squeeze_low(
            registry,
            low[0],
            budget_bytes=BUDGET_BYTES,
            min_bytes=MIN_BYTES,
            page_id_bytes=PAGE_ID_BYTES,
            layers=HIGH_LAYERS,
            buffers=HIGH_BUFFERS,
            block_bytes=HIGH_BLOCK_BYTES,
        )
        result_base = finish(sglang_workdir, "policy_base", *base)
        result_low = finish(sglang_workdir, "policy_low", *low)
    finally:
        for proc, _ in (base, low):
            if proc.poll() is None:
                proc.kill()
    print(f"hand-over of {BUDGET_BYTES - MIN_BYTES} bytes from the busy SGLang engine: {squeeze.handover_s:.3f} s")
    squeeze.check_given_down_to(MIN_BYTES, PAGE_ID_BYTES)
    # Retracted requests are recomputed: the same tokens as the engine without kvcached.
    assert result_low["outputs"] == result_base["outputs"]
    assert "Retract requests" in result_low["log"]
    assert squeeze.handover_s < 30.0, "a busy engine shrinks within a few steps (cached prefixes, then retraction)"
