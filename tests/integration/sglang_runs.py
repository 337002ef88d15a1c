"""Starting and finishing SGLang (and vLLM) engine processes for the SGLang integration tests.

Each engine is a harness script in its own process (``sglang_harness.py`` or
``vllm_harness.py``, the latter with vLLM's own Python), on the tiny Llama,
with a private device registry; this module holds the workloads they share.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvcached.testing.sglang_env import sglang_cpu_env
from kvcached.testing.tiny_llama import prompt_ids
from kvcached.testing.vllm_runs import HARNESS as VLLM_HARNESS

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 900
MiB = 1 << 20
# One page id of the tiny model in SGLang: 2 MiB x 2 layers x K and V.
PAGE_ID_BYTES = 8 * MiB
# vLLM keeps K||V in one buffer: 2 MiB x 2 layers.
VLLM_PAGE_ID_BYTES = 4 * MiB
ENGINE = {"max_total_tokens": 8192}  # SGLang's CPU engine needs it without kvcached
# 12 prompts sharing a 130-token prefix: later ones hit the radix cache.
SHARED = {"prompts": prompt_ids(12, 200, seed=1, shared_prefix=130), "max_new_tokens": 16}
# 16 requests growing to 364 tokens: 5824 slots = 3 pages of 2048 slots.
LOAD = {"prompts": prompt_ids(16, 300, seed=7), "max_new_tokens": 64}
# vLLM's load in the mixed test: 12 x (250 + 32) tokens in blocks of 128 = 5 page ids with its null block.
VLLM_LOAD = {"prompts": prompt_ids(12, 250, seed=7), "max_tokens": 32}
_FLAGS = (
    "KVCACHED_ENABLE",
    "ENABLE_KVCACHED",
    "KVCACHED_LIMIT_BYTES",
    "KVCACHED_NAME",
    "KVCACHED_IDLE_CACHE_BYTES",
    "KVCACHED_PAGE_BYTES",
    "KVCACHED_IDLE_RELEASE_S",
)


def engine_env(kvcached_on: bool, registry_dir: Path, *, sglang: bool = True, **extra: str) -> dict[str, str]:
    """An engine's environment: a private registry, kvcached on or off, SGLang's CPU set-up if ``sglang``."""
    env = sglang_cpu_env() if sglang else dict(os.environ)
    for name in _FLAGS:
        env.pop(name, None)
    env["KVCACHED_REGISTRY_DIR"] = str(registry_dir)  # never the machine's /dev/shm
    env["KVCACHED_VIRTUAL_CAPACITY_BYTES"] = str(1 << 30)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # vLLM engines share the cores too
    if kvcached_on:
        env["KVCACHED_ENABLE"] = "1"
    # Idle engines give memory back at once, as the tests' probes expect;
    # tests of the idle hold set their own.
    env["KVCACHED_IDLE_RELEASE_S"] = "0"
    env.update(extra)
    return env


def start(
    workdir: Path, label: str, spec: dict, env: dict, python: str = sys.executable, harness: str = "sglang_harness.py"
) -> tuple[subprocess.Popen, Path]:
    spec = {"model": str(workdir / "model"), **spec}
    spec_path, out_path = workdir / f"{label}.spec.json", workdir / f"{label}.out.json"
    spec_path.write_text(json.dumps(spec))
    log = open(workdir / f"{label}.log", "w")
    script = HERE / harness if harness == "sglang_harness.py" else VLLM_HARNESS
    proc = subprocess.Popen(
        [python, str(script), str(spec_path), str(out_path)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir
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


def wait_for_file(path: Path, procs: list[subprocess.Popen], what: str) -> None:
    deadline = time.time() + ENGINE_TIMEOUT_S
    while not path.exists():
        failed = [p.args[-1] for p in procs if p.poll() not in (None, 0)]
        assert not failed, f"engine {failed} failed before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def kvctl(registry: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcached.kvctl", *args, "--device", "cpu"],
        env=dict(os.environ, KVCACHED_REGISTRY_DIR=str(registry)),
        capture_output=True,
        text=True,
        timeout=60,
    )


def probe(result: dict, label: str) -> dict:
    return next(p for p in result["probes"] if p["label"] == label)


def run_page1(workdir: Path) -> dict[str, dict]:
    """Page size 1 with and without kvcached, side by side: [SHARED, LOAD]."""
    registry = workdir / "registry-p1"
    registry.mkdir()
    spec = {"page_size": 1, "engine": ENGINE, "phases": [SHARED, LOAD]}
    runs = {"base_p1": engine_env(False, registry), "kv_p1": engine_env(True, registry, KVCACHED_NAME="kv-p1")}
    started = {label: start(workdir, label, spec, env) for label, env in runs.items()}
    return {label: finish(workdir, label, *started[label]) for label in started}
