"""kvcached inside a real vLLM engine (the CPU build, default multi-process mode).

Every engine runs in its own process through ``vllm_harness.py`` on a tiny
random-weight Llama written by the test, with token-id prompts, greedy
sampling and ``skip_tokenizer_init``. vLLM starts an EngineCore and a worker
process under each engine, so page ops really cross processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

vllm = pytest.importorskip("vllm")
pytest.importorskip("kvcached.pool", reason="kvcached core not built")

from kvcached.testing.registry_env import make_shared_budget  # noqa: E402
from kvcached.testing.vllm_runs import (  # noqa: E402
    ENGINE_TIMEOUT_S,
    PAGE_ID_BYTES,
    PHASES,
    engine_env,
    finish,
    peak,
    probe,
    run_side_by_side,
    start,
)


@pytest.fixture(scope="module")
def prefix_on(vllm_workdir):
    registry = vllm_workdir / "registry-on"
    registry.mkdir()
    spec = {"prefix_caching": True, "phases": PHASES}
    # The idle hold: a load, a look 0.3 s after it, another once the 2 s hold has passed.
    hold = {"prefix_caching": True, "phases": [{**PHASES[2], "settle_s": 0.3}, {"settle_s": 3.0}]}
    return run_side_by_side(
        vllm_workdir,
        {
            "base_on": (spec, engine_env(False, registry)),
            "kv_on": (spec, engine_env(True, registry)),
            "kv_hold": (hold, engine_env(True, registry, KVCACHED_NAME="kv-hold", KVCACHED_IDLE_RELEASE_S="2")),
            "kv_hold_inproc": (
                hold,
                engine_env(
                    True,
                    registry,
                    KVCACHED_NAME="kv-hold-inproc",
                    KVCACHED_IDLE_RELEASE_S="2",
                    VLLM_ENABLE_V1_MULTIPROCESSING="0",
                ),
            ),
        },
    )


@pytest.fixture(scope="module")
def prefix_off_and_tight(vllm_workdir):
    """Prefix caching off (baseline vs kvcached), and kvcached under a limit that
    forces preemption (four page ids: the null block's and three for 36 blocks'
    worth of requests)."""
    registry = vllm_workdir / "registry-off"
    registry.mkdir()
    spec = {"prefix_caching": False, "phases": PHASES[:1]}
    tight = {"prefix_caching": True, "phases": [PHASES[2]]}
    return run_side_by_side(
        vllm_workdir,
        {
            "base_off": (spec, engine_env(False, registry)),
            "kv_off": (spec, engine_env(True, registry)),
            "kv_tight": (tight, engine_env(True, registry, KVCACHED_LIMIT_BYTES=str(4 * PAGE_ID_BYTES))),
        },
    )


# --------------------------------------------------------------------------- #


def test_kvcached_is_active_in_every_process(prefix_on):
    log = prefix_on["kv_on"]["log"]
    assert "kvcached: virtual KV cache of" in log  # EngineCore planned blocks
    assert "is a virtual" in log  # the worker backs the views with a KV space
    assert "kvcached" not in prefix_on["base_on"]["log"].replace("KVCACHED", "")
    # The CPU worker runs the model: it keeps its freed heap (KVCACHED_HOST_HEAP_KEEP_BYTES, 256 MiB).
    assert "keeps up to 256 MiB of freed heap memory" in log
    assert "freed heap" not in prefix_on["base_on"]["log"]
    stats = probe(prefix_on["kv_on"], "after_init")["engine"]
    assert stats["layout_num_blocks"] % (stats["layout_page_bytes"] // stats["layout_block_bytes"]) == 0


def test_greedy_outputs_match_without_kvcached_prefix_caching_on(prefix_on):
    assert prefix_on["kv_on"]["outputs"] == prefix_on["base_on"]["outputs"]


def test_greedy_outputs_match_without_kvcached_prefix_caching_off(prefix_off_and_tight):
    runs = prefix_off_and_tight
    assert runs["kv_off"]["outputs"] == runs["base_off"]["outputs"]


def test_kv_memory_grows_with_load_and_returns_when_idle(prefix_on):
    result = prefix_on["kv_on"]
    idle_before = probe(result, "after_init")
    done = probe(result, "phase2_done")
    page_id_bytes = done["engine"]["page_id_bytes"]
    assert page_id_bytes == PAGE_ID_BYTES
    # While 12 requests run, several page ids are mapped, in the worker too
    # (36 blocks + the null block: 5 page ids of 8 blocks).
    assert peak(result, "phase2_running") >= 5 * page_id_bytes
    assert peak(result, "phase2_running", side="workers") >= 5 * page_id_bytes
    # Idle again: only the null block's page stays; the worker applied the
    # unmaps and acknowledged them, so nothing is pending release.
    for idle in (idle_before, done):
        assert idle["engine"]["mapped_bytes"] <= page_id_bytes
    assert done["engine"]["pending_pages"] == 0
    assert done["engine"]["acked_seq"] == done["engine"]["sent_seq"] > 0
    assert done["workers"][0]["mapped_bytes"] == done["engine"]["mapped_bytes"]
    assert done["workers"][0]["applied_seq"] == done["engine"]["sent_seq"]


@pytest.mark.parametrize("run", ["kv_hold", "kv_hold_inproc"])
def test_an_idle_engine_keeps_its_memory_for_the_hold_then_gives_it_back(prefix_on, run):
    result = prefix_on[run]
    assert result["outputs"][0] == prefix_on["kv_on"]["outputs"][2]
    held, released = probe(result, "phase0_done"), probe(result, "phase1_done")
    assert held["engine"]["idle_release_s"] == 2.0
    # 0.3 s after the load: its prefix cache (24 full blocks: 3 page ids) is
    # still mapped, in the worker too, for the next burst to find.
    assert held["engine"]["mapped_bytes"] >= 3 * PAGE_ID_BYTES
    assert held["workers"][0]["mapped_bytes"] >= 3 * PAGE_ID_BYTES
    # Once the hold has passed, the woken loop (in-process: the watching thread) gave it all back
    # (nobody asked earlier).
    done = released["engine"]
    assert done["mapped_bytes"] <= PAGE_ID_BYTES and done["pending_pages"] == 0
    assert done["acked_seq"] == done["sent_seq"] and released["workers"][0]["mapped_bytes"] == done["mapped_bytes"]
    assert done["idle_early_releases"] == 0


def test_exhaustion_becomes_preemption_not_a_crash(prefix_on, prefix_off_and_tight):
    tight = prefix_off_and_tight["kv_tight"]
    assert peak(tight, "phase0_running") <= 4 * PAGE_ID_BYTES
    # 12 requests outgrow 31 blocks while decoding: vLLM preempts some.
    assert probe(tight, "phase0_done")["engine"]["num_preempted"] > 0
    # Same tokens as the unconstrained engines: preempted requests recompute.
    assert tight["outputs"][0] == prefix_on["base_on"]["outputs"][2]


def test_two_engines_share_one_budget(vllm_workdir):
    """Two engines in two processes under one device budget that fits only one
    engine's peak: each uses memory the other released, and kvctl sees both."""
    workdir = vllm_workdir
    budget_bytes = 8 * PAGE_ID_BYTES  # 2 null-block pages + 6 for load; one peak is 5
    registry = make_shared_budget(workdir / "registry-shared", budget_bytes)
    flag = {name: str(workdir / f"{name}.flag") for name in ("b_ready", "a_done", "kvctl_done", "b_done")}
    spec_a = {
        "prefix_caching": True,
        "phases": [
            {"wait_for": flag["b_ready"], **PHASES[2], "signal": flag["a_done"]},
            {"wait_for": flag["b_done"], "settle_s": 0.2},  # stay alive: B must use what A *released*
        ],
    }
    spec_b = {
        "prefix_caching": True,
        "phases": [
            {"signal": flag["b_ready"]},
            {"wait_for": flag["a_done"], **PHASES[2]},
            {"wait_for": flag["kvctl_done"], "signal": flag["b_done"]},
        ],
    }
    # A's idle hold outlasts the test: A gives its memory back because B asks for it.
    env_a = engine_env(True, registry, KVCACHED_NAME="engine-a", KVCACHED_IDLE_RELEASE_S="600")
    env_b = engine_env(True, registry, KVCACHED_NAME="engine-b")
    proc_a, out_a = start(workdir, "engine_a", spec_a, env_a)
    proc_b, out_b = start(workdir, "engine_b", spec_b, env_b)
    try:
        deadline = time.time() + ENGINE_TIMEOUT_S
        while not os.path.exists(flag["a_done"]):
            assert proc_a.poll() is None and proc_b.poll() is None, "an engine died"
            assert time.time() < deadline, "engine A did not finish its load"
            time.sleep(0.5)
        listing = subprocess.run(
            [sys.executable, "-m", "kvcached.kvctl", "list", "--json", "--device", "cpu"],
            env=dict(os.environ, KVCACHED_REGISTRY_DIR=str(registry)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        Path(flag["kvctl_done"]).write_text("done")
        result_a = finish(workdir, "engine_a", proc_a, out_a)
        result_b = finish(workdir, "engine_b", proc_b, out_b)
    finally:
        for proc in (proc_a, proc_b):
            if proc.poll() is None:
                proc.kill()
    assert listing.returncode == 0, listing.stderr
    names = {entry["name"] for entry in json.loads(listing.stdout)["instances"]}
    assert {"engine-a", "engine-b"} <= names, listing.stdout
    # Both completed with the unconstrained engine's tokens.
    peak_a = peak(result_a, "phase0_running")
    peak_b = peak(result_b, "phase1_running")
    assert result_a["outputs"][0] == result_b["outputs"][1]
    # Together they mapped more than the budget: each used memory that the
    # other had given back.
    assert peak_a + peak_b > budget_bytes, (peak_a, peak_b)
    # Idle, A kept its prefix cache until B was refused memory, then gave it back.
    assert probe(result_a, "phase0_done")["engine"]["mapped_bytes"] > PAGE_ID_BYTES
    after_b = probe(result_a, "phase1_done")["engine"]
    assert after_b["idle_early_releases"] >= 1 and after_b["mapped_bytes"] <= PAGE_ID_BYTES


def test_in_process_engine(vllm_workdir, prefix_on):
    """VLLM_ENABLE_V1_MULTIPROCESSING=0: front end, EngineCore and worker in one
    process; the same ordered path (page ops on SchedulerOutput) is used."""
    workdir = vllm_workdir
    registry = workdir / "registry-inproc"
    registry.mkdir()
    spec = {"prefix_caching": True, "phases": PHASES}
    env = engine_env(True, registry, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    result = run_side_by_side(workdir, {"kv_inproc": (spec, env)})["kv_inproc"]
    assert result["outputs"] == prefix_on["base_on"]["outputs"]
    assert peak(result, "phase2_running") >= 5 * PAGE_ID_BYTES
    done = probe(result, "phase2_done")["engine"]
    assert done["mapped_bytes"] <= PAGE_ID_BYTES and done["pending_pages"] == 0
