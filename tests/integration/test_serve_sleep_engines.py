"""``kvcached serve`` holds more models than fit, with the real engines: three vLLM models and one
SGLang model (tiny random-weight Llamas of different seeds, CPU builds) on a budget that holds two
awake (weights and each model's min).

One serve process runs through the module, in the order written: the models start in turn and
report ready (awake or asleep); round-robin requests and concurrent requests for several sleeping
models are all answered, each with its model's own greedy output; a model with ``idle_s`` sleeps on
its own; the registry, sampled throughout, never holds more than the budget nor more than two
models awake; /metrics counts the wakes and sleeps. Needs vLLM in this Python, the serve extra, and
SGLang's environment in ``KVCACHED_SGLANG_PYTHON``.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvcached.testing.serve_needs import require_real_engines

SGLANG_PYTHON = require_real_engines()

import openai  # noqa: E402

from kvcached.serve.ports import free_port  # noqa: E402
from kvcached.testing.serve_session import Sampler, ServeProcess, metric_value, registry_entries  # noqa: E402
from kvcached.testing.tiny_llama import make_tiny_llama  # noqa: E402
from kvcached.testing.tiny_tokenizer import write_tiny_tokenizer  # noqa: E402

pytestmark = [pytest.mark.serve, pytest.mark.slow]

MiB = 1 << 20
# A tiny model's weights take 4 MiB awake; each model's min is 8 MiB: two awake take 24 MiB.
BUDGET_MIB = 28
MIN_MIB = 8
IDLE_S = 8
VLLM_MODELS = ("sleepy-a", "sleepy-b", "sleepy-c")
MODELS = (*VLLM_MODELS, "sleepy-s")
VLLM_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "4",
    "--block-size",
    "128",
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    "268435456",
]
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "KVCACHED_VIRTUAL_CAPACITY_BYTES": "256MiB",
    "KVCACHED_IDLE_RELEASE_S": "0",
    "OMP_NUM_THREADS": "1",
}
SGLANG_ARGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--dtype",
    "float32",
    "--max-total-tokens",
    "4096",
    "--max-running-requests",
    "4",
    "--disable-cuda-graph",
    "--log-level",
    "warning",
]


def _model(workdir: Path, name: str, seed: int) -> str:
    return write_tiny_tokenizer(make_tiny_llama(workdir / name, seed=seed))


def _config(workdir: Path, port: int) -> dict:
    models = []
    sleeps = {
        "sleepy-a": {"level": 1},
        "sleepy-b": {"level": 2},  # woken, its weights are loaded again from the model
        "sleepy-c": {"level": 1, "idle_s": IDLE_S},
    }
    for seed, name in enumerate(VLLM_MODELS):
        models.append(
            {
                "name": name,
                "engine": "vllm",
                "model": _model(workdir, name, seed),
                "args": list(VLLM_ARGS),
                "env": dict(VLLM_ENV),
                "memory": {"min": f"{MIN_MIB}MiB"},
                "sleep": sleeps[name],
            }
        )
    models.append(
        {
            "name": "sleepy-s",
            "engine": "sglang",
            "model": _model(workdir, "sleepy-s", 7),
            "python": SGLANG_PYTHON,
            "module": "kvcached.testing.sglang_cpu_server",
            "args": SGLANG_ARGS,
            "env": {"KVCACHED_VIRTUAL_CAPACITY_BYTES": "256MiB", "KVCACHED_IDLE_RELEASE_S": "0"},
            "memory": {"min": f"{MIN_MIB}MiB"},
            "sleep": {"level": 1},
        }
    )
    return {"listen": f"127.0.0.1:{port}", "device": "cpu", "budget": f"{BUDGET_MIB}MiB", "models": models}


def _awake_and_held(registry_dir: Path) -> tuple[list[str], int]:
    awake, held = [], 0
    for entry in registry_entries(registry_dir):
        if entry["name"] in MODELS and entry["alive"]:
            held += entry["weights_bytes"] + entry["mapped_bytes"]
            if entry["weights_bytes"] > 0:
                awake.append(entry["name"])
    return awake, held


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("serve-sleep")
    registry = workdir / "registry"
    registry.mkdir()
    process = ServeProcess(workdir, _config(workdir, free_port()), registry)
    sampler = Sampler(lambda: _awake_and_held(registry), interval_s=0.05)
    with sampler:
        process.start()
        try:
            process.wait_healthy()
            process.sampler = sampler
            yield process
        finally:
            if process.process.poll() is None:
                process.stop()


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)


def complete(serve, model: str) -> str:
    answer = client(serve.url).completions.create(model=model, prompt="Hello there", max_tokens=12, temperature=0)
    return answer.choices[0].text


@pytest.fixture(scope="module")
def own_outputs(serve):
    """Each model's greedy output, asked once each in turn (waking each as needed)."""
    return {name: complete(serve, name) for name in MODELS}


def test_every_model_is_ready_awake_or_asleep_after_the_start_in_turn(serve):
    status, health = serve.health()
    assert status == 200 and set(health["models"]) == set(MODELS)
    # The idle_s model may already be on its way to sleep on its own.
    assert set(health["models"].values()) <= {"ready", "asleep", "falling asleep"}, health
    assert "asleep" in health["models"].values(), "four models on a budget for two: some sleep"


def test_round_robin_requests_get_each_models_own_answers(serve, own_outputs):
    assert len(set(own_outputs.values())) == len(MODELS), "different seeds answer differently"
    for _ in range(2):
        for name in MODELS:
            assert complete(serve, name) == own_outputs[name], name


def test_concurrent_requests_for_several_sleeping_models_are_all_answered(serve, own_outputs):
    order = ["sleepy-a", "sleepy-s", "sleepy-b", "sleepy-c", "sleepy-a", "sleepy-b"]
    with ThreadPoolExecutor(len(order)) as pool:
        answers = list(pool.map(lambda name: complete(serve, name), order))
    assert answers == [own_outputs[name] for name in order]


def test_a_model_with_idle_s_sleeps_on_its_own(serve, own_outputs):
    assert complete(serve, "sleepy-c") == own_outputs["sleepy-c"]
    deadline = time.monotonic() + IDLE_S + 30
    while serve.health()[1]["models"]["sleepy-c"] != "asleep":
        assert time.monotonic() < deadline, f"sleepy-c did not sleep after {IDLE_S} s idle"
        time.sleep(0.5)
    (entry,) = [e for e in registry_entries(serve.registry_dir) if e["name"] == "sleepy-c"]
    assert entry["sleeping"] and entry["weights_bytes"] == 0 and entry["mapped_bytes"] == 0


def test_the_registry_never_held_more_than_the_budget_nor_more_than_two_models_awake(serve, own_outputs):
    samples = [value for _, value in serve.sampler.samples]
    assert len(samples) > 100
    assert max(held for _, held in samples) <= BUDGET_MIB * MiB
    assert max(len(awake) for awake, _ in samples) <= 2, "never three of the models awake"
    assert all(len([n for n in awake if n in VLLM_MODELS]) < 3 for awake, _ in samples)


def test_metrics_count_the_wakes_and_sleeps(serve, own_outputs):
    text = serve.metrics()
    wakes = {name: metric_value(text, "kvcached_serve_model_wakes_total", model=name) or 0 for name in MODELS}
    sleeps = {name: metric_value(text, "kvcached_serve_model_sleeps_total", model=name) or 0 for name in MODELS}
    assert sum(wakes.values()) >= 4 and sum(sleeps.values()) >= 4
    assert all(wakes[name] >= 1 for name in MODELS), wakes  # each model slept and woke at least once
    assert metric_value(text, "kvcached_serve_model_wake_seconds_count", model="sleepy-b") >= 1
    asleep = [name for name in MODELS if metric_value(text, "kvcached_serve_model_sleeping", model=name) == 1.0]
    assert len(asleep) >= 2


def test_sigterm_leaves_no_registry_entry(serve):
    assert serve.stop() == 0
    assert not [e for e in registry_entries(serve.registry_dir) if e["name"] in MODELS and e["alive"]]
