"""Starting and finishing vLLM engine processes for the vLLM integration tests, and their workloads.

Each engine is ``vllm_harness.py`` in its own process (vLLM's CPU build then
starts its EngineCore and workers), on the tiny Llama, with a private device
registry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvcached.testing.tiny_llama import prompt_ids

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "vllm_harness.py"
ENGINE_TIMEOUT_S = 900
MiB = 1 << 20
# One page id of the tiny model: 2 MiB per layer x 2 layers.
PAGE_ID_BYTES = 2 * 2 * MiB

SHARED_PREFIX = prompt_ids(8, 200, seed=1, shared_prefix=130)
# 12 requests of 250 prompt tokens (2 blocks of 128) that grow into a third
# block while decoding: 36 blocks = 5 page ids at peak.
LOAD = prompt_ids(12, 250, seed=7)
PHASES = [
    {"prompts": SHARED_PREFIX, "max_tokens": 16},
    {"prompts": SHARED_PREFIX[:4], "max_tokens": 16},  # prefix hits across calls
    {"prompts": LOAD, "max_tokens": 32, "probe_during": True},
]


def engine_env(kvcached_on: bool, registry_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("KVCACHED_ENABLE", "ENABLE_KVCACHED", "KVCACHED_LIMIT_BYTES", "KVCACHED_NAME"):
        env.pop(name, None)
    env["KVCACHED_REGISTRY_DIR"] = str(registry_dir)  # never the machine's /dev/shm
    # Memory returns as soon as an engine is idle, which most tests look at; the
    # tests of the idle hold set their own.
    env["KVCACHED_IDLE_RELEASE_S"] = "0"
    env["KVCACHED_VIRTUAL_CAPACITY_BYTES"] = str(1 << 30)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # share two cores between engines and ranks
    if kvcached_on:
        env["KVCACHED_ENABLE"] = "1"
    env.update(extra)
    return env


def start(workdir: Path, label: str, spec: dict, env: dict) -> tuple[subprocess.Popen, Path]:
    spec = {"model": str(workdir / "model"), **spec}
    spec_path = workdir / f"{label}.spec.json"
    out_path = workdir / f"{label}.out.json"
    spec_path.write_text(json.dumps(spec))
    log = open(workdir / f"{label}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(HARNESS), str(spec_path), str(out_path)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=workdir,
    )
    return proc, out_path


def finish(workdir: Path, label: str, proc: subprocess.Popen, out_path: Path) -> dict:
    try:
        rc = proc.wait(timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    log = (workdir / f"{label}.log").read_text()
    assert rc == 0 and out_path.exists(), f"engine {label} failed (rc={rc}):\n{log[-6000:]}"
    result = json.loads(out_path.read_text())
    result["log"] = log
    return result


def run_side_by_side(workdir: Path, runs: dict[str, tuple[dict, dict]]) -> dict[str, dict]:
    """Runs engines side by side (vLLM start-up is mostly single-threaded)."""
    started = {label: start(workdir, label, spec, env) for label, (spec, env) in runs.items()}
    return {label: finish(workdir, label, *started[label]) for label in started}


def probe(result: dict, label: str) -> dict:
    return next(p for p in result["probes"] if p["label"] == label)


def peak(result: dict, label: str, side: str = "engine") -> int:
    """Largest mapped_bytes seen in the probes taken after each step of a phase."""
    probes = [p for p in result["probes"] if p["label"] == label]
    assert probes, f"no probe {label}"
    if side == "engine":
        return max(p["engine"]["mapped_bytes"] for p in probes)
    return max(p["workers"][0]["mapped_bytes"] for p in probes)
