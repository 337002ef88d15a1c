"""``kvcached serve`` with the real engines: two vLLM models and one SGLang model (tiny random-weight
Llamas, CPU builds) behind one endpoint, driven with the real ``openai`` client.

One serve process runs through the module, in the order written: nothing is accepted while the
engines load; the router's answers equal the engines' own; a client that leaves cancels its request
in the engine; kvtop and /metrics show the models; a burst on one model takes the memory an idle one
holds; a model's min stays free while a higher priority takes all it can; a higher-priority model
gets memory from a busy lower-priority one, which shrinks no lower than its min; kill -9 of one
engine gives 503 for it only until it is back; SIGTERM stops everything cleanly. The measured
hand-over times are printed. Needs vLLM in this Python, the serve extra, and SGLang's environment in
``KVCACHED_SGLANG_PYTHON``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvcached.testing.serve_needs import require_real_engines

SGLANG_PYTHON = require_real_engines()

import openai  # noqa: E402

from kvcached.serve.ports import free_port  # noqa: E402
from kvcached.serve.processes import group_members  # noqa: E402
from kvcached.testing.serve_session import (  # noqa: E402
    Sampler,
    ServeProcess,
    metric_sum,
    metric_value,
    registry_entries,
    serve_config,
)
from kvcached.testing.tiny_llama import prompt_ids  # noqa: E402
from kvcached.testing.tiny_tokenizer import write_tiny_tokenizer  # noqa: E402

pytestmark = [pytest.mark.serve, pytest.mark.slow]

MiB = 1 << 20
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve-cpu.yaml"
MODELS = ("tiny-a", "tiny-b", "tiny-s")
BUDGET = "88MiB"
# 16 sequences of 500 + 32 tokens: 5 blocks of 128 each, 80 blocks (+ the null block) = 11 page ids
# of 4 MiB: 44 MiB in vLLM. Two such bursts do not fit the budget beside SGLang's 8 MiB.
BURST = prompt_ids(16, 500, seed=11)
BURST_TOKENS = 32
RESTART_TIMEOUT_S = 300
# tiny-b's guaranteed memory; tiny-a (priority 1) outranks it (priority 0).
B_MIN_MIB = 24
# 16 sequences of 500 + 400 tokens: 8 blocks each, more than a model's 64 MiB max; busy for many steps.
LONG_LOAD = prompt_ids(16, 500, seed=12)
LONG_TOKENS = 400
# 4 sequences of 500 + 32 tokens: 20 blocks (+ the null block) = 3 page ids, within tiny-b's min.
SMALL = prompt_ids(4, 500, seed=13)
# Two bursts' worth at once: 16 sequences run (max_num_seqs) while 16 wait, so tiny-a needs more than it
# holds for two rounds. On two cores one step of a busy engine may take seconds, and the memory it gives
# back only when its step is done: a single burst could be served by what tiny-a had before it arrived.
DOUBLE_BURST = prompt_ids(32, 500, seed=14)
# An engine's answer reaches the client through the router this long after the engine is done, at most.
ANSWER_SLACK_S = 0.5


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("serve")
    model = Path(write_tiny_tokenizer(_tiny_llama(workdir / "model")))
    registry = workdir / "registry"
    registry.mkdir()
    config = serve_config(
        EXAMPLE,
        model,
        SGLANG_PYTHON,
        free_port(),
        BUDGET,
        {
            # tiny-b keeps what it mapped while idle (until someone is refused), the others give it back at once.
            "tiny-a": {"env": {"KVCACHED_IDLE_RELEASE_S": "0"}},
            "tiny-b": {
                "env": {"KVCACHED_IDLE_RELEASE_S": "600", "KVCACHED_IDLE_RELEASE_MAX_S": "600"},
                "memory": {"min": f"{B_MIN_MIB}MiB"},
            },
            # tiny-b alone is below tiny-a's priority: the busy model asked to shrink is tiny-b.
            "tiny-s": {"env": {"KVCACHED_IDLE_RELEASE_S": "0"}, "memory": {"priority": 1}},
        },
    )
    process = ServeProcess(workdir, config, registry)
    process.start()
    try:
        # While the engines load, the address is taken but nothing is accepted yet.
        deadline = time.monotonic() + 120
        while "started" not in process.log():
            assert process.process.poll() is None and time.monotonic() < deadline, process.log()
            time.sleep(0.1)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", process.port), timeout=5).close()
        process.wait_healthy()
        yield process
    finally:
        if process.process.poll() is None:
            process.stop()


def _tiny_llama(path: Path) -> str:
    from kvcached.testing.tiny_llama import make_tiny_llama

    return make_tiny_llama(path)


def client(base_url: str) -> openai.OpenAI:
    # No retries: a 503 must reach the test, not be retried away.
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)


def answers(api: openai.OpenAI, model: str) -> dict:
    """A completion, a chat completion and a streamed chat completion, greedy."""
    completion = api.completions.create(model=model, prompt="Hello there", max_tokens=16, temperature=0)
    chat = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0
    )
    stream = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "tell me"}], max_tokens=12, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    return {
        "completion": completion.choices[0].text,
        "chat": chat.choices[0].message.content,
        "streamed": streamed,
        "usage": (completion.usage.prompt_tokens, completion.usage.completion_tokens),
    }


def registry_usage(serve) -> dict[str, dict]:
    usage = {name: {"mapped": 0, "live": 0, "targets": []} for name in MODELS}
    for entry in registry_entries(serve.registry_dir):
        if entry["name"] in usage and entry["alive"]:
            usage[entry["name"]]["mapped"] += entry["mapped_bytes"]
            usage[entry["name"]]["live"] += 1
            if entry["reclaim_target_bytes"] is not None:
                usage[entry["name"]]["targets"].append(entry["reclaim_target_bytes"])
    return usage


def test_every_model_answers_through_the_router_as_its_engine_does(serve):
    router = client(serve.url)
    assert [m.id for m in router.models.list().data] == list(MODELS)
    engines = serve.engines()
    assert {name: e["engine"] for name, e in engines.items()} == {
        "tiny-a": "vllm",
        "tiny-b": "vllm",
        "tiny-s": "sglang",
    }
    completions = set()
    for name in MODELS:
        direct = answers(client(f"http://127.0.0.1:{engines[name]['port']}"), name)
        routed = answers(router, name)
        assert routed == direct, name
        assert routed["usage"][1] == 16 and routed["streamed"], name
        completions.add(routed["completion"])
    # The same random model in vLLM and SGLang: greedy text agrees across engines too.
    assert len(completions) == 1


def test_an_unknown_model_is_a_404_the_openai_client_understands(serve):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(serve.url).completions.create(model="tiny-z", prompt="x", max_tokens=2)


def _running_in_vllm(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("vllm:num_requests_running"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vLLM reports no num_requests_running")


def test_a_client_that_leaves_cancels_its_request_in_the_engine(serve):
    port = serve.engines()["tiny-a"]["port"]
    stream = client(serve.url).completions.create(
        model="tiny-a", prompt="x", max_tokens=1500, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    assert _running_in_vllm(port) == 1
    stream.close()
    deadline = time.monotonic() + 10
    while _running_in_vllm(port) != 0:
        assert time.monotonic() < deadline, "the engine still generates for a client that left"
        time.sleep(0.2)
    assert metric_value(serve.metrics(), "kvcached_serve_requests_total", model="tiny-a", status="499") == 1


def test_kvtop_and_metrics_show_the_served_models(serve):
    kvtop = subprocess.run(
        [sys.executable, "-m", "kvcached.kvtop", "--once"],
        env={**serve.env, "COLUMNS": "160"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert kvtop.returncode == 0 and all(name in kvtop.stdout for name in MODELS), kvtop.stdout + kvtop.stderr
    text = serve.metrics()
    usage = registry_usage(serve)
    for name in MODELS:
        assert metric_value(text, "kvcached_serve_engine_up", model=name) == 1
        assert metric_value(text, "kvcached_serve_model_max_bytes", model=name) == 64 * MiB
        assert metric_value(text, "kvcached_serve_model_mapped_bytes", model=name) == usage[name]["mapped"] > 0
    assert metric_value(text, "kvcached_serve_model_min_bytes", model="tiny-a") == 8 * MiB
    assert metric_value(text, "kvcached_serve_device_budget_bytes") == 88 * MiB


def _burst(model: str, serve) -> None:
    client(serve.url).completions.create(
        model=model, prompt=BURST, max_tokens=BURST_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )


def test_a_burst_takes_the_memory_an_idle_model_holds(serve, capsys):
    _burst("tiny-b", serve)
    time.sleep(1.0)
    held = registry_usage(serve)["tiny-b"]["mapped"]
    assert held >= 40 * MiB, "tiny-b should keep its memory while idle (its hold is 600 s)"
    peaks = {"tiny-a": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peaks["tiny-a"] = max(peaks["tiny-a"], registry_usage(serve)["tiny-a"]["mapped"])
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        _burst("tiny-a", serve)
    finally:
        done.set()
        watcher.join()
    after = registry_usage(serve)
    text = serve.metrics()
    count = metric_sum(text, "kvcached_serve_memory_handover_seconds_count", to_model="tiny-a")
    total = metric_sum(text, "kvcached_serve_memory_handover_seconds_sum", to_model="tiny-a")
    assert after["tiny-b"]["mapped"] < held, "the idle model gave nothing back"
    assert peaks["tiny-a"] > 88 * MiB - held - 8 * MiB, "the burst got no more than was free"
    assert count and count >= 1, text
    assert metric_value(text, "kvcached_serve_memory_refusals_total", model="tiny-a") >= 1
    with capsys.disabled():
        print(
            f"\nserve hand-over: tiny-b held {held / MiB:.0f} MiB idle; tiny-a's burst peaked at "
            f"{peaks['tiny-a'] / MiB:.0f} MiB; {count:.0f} hand-over(s) to tiny-a, mean {total / count * 1000:.0f} ms "
            f"from refusal to memory (sampled every 10 ms)"
        )


class UsageSampler(Sampler):
    """Every model's mapped bytes (``samples``) and the reclaim targets asked of it (``shrinks``), every 10 ms."""

    def __init__(self, serve) -> None:
        self.serve = serve
        self.shrinks: list[dict[str, list[int]]] = []
        super().__init__(self._mapped)

    def _mapped(self) -> dict[str, int]:
        usage = registry_usage(self.serve)
        self.shrinks.append({name: usage[name]["targets"] for name in MODELS})
        return {name: usage[name]["mapped"] for name in MODELS}

    def peak(self, name: str) -> int:
        return max(sample[name] for _, sample in self.samples)

    def low(self, name: str, since: float, until: float = float("inf")) -> int:
        return min(sample[name] for at, sample in self.samples if since <= at < until)

    def targets(self, name: str) -> list[int]:
        return [target for sample in self.shrinks for target in sample[name]]

    def changes(self, name: str, since: float) -> str:
        """What ``name`` held from ``since`` on, one entry per change: "+seconds: MiB", for a failure's message."""
        seen, last = [], None
        for at, sample in self.samples:
            if at >= since and sample[name] != last:
                last = sample[name]
                seen.append(f"+{at - since:.2f}s: {last / MiB:.0f}")
        return ", ".join(seen)


def _in_background(model: str, serve, prompts, tokens: int) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def work() -> None:
        answer = client(serve.url).completions.create(
            model=model, prompt=prompts, max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True}
        )
        box["tokens"] = [choice.text for choice in answer.choices]
        box["usage"] = answer.usage.completion_tokens
        box["finished_at"] = time.monotonic()

    thread = threading.Thread(target=work)
    thread.start()
    return thread, box


def test_a_min_holds_while_a_higher_priority_model_takes_all_it_can(serve, capsys):
    budget = 88 * MiB
    with UsageSampler(serve) as sampler:
        greedy, result = _in_background("tiny-a", serve, LONG_LOAD, LONG_TOKENS)
        deadline = time.monotonic() + 120
        while registry_usage(serve)["tiny-a"]["mapped"] < 32 * MiB:
            assert greedy.is_alive() and time.monotonic() < deadline, "tiny-a's load never grew"
            time.sleep(0.05)
        asked = time.monotonic()
        _burst_of(serve, "tiny-b", SMALL)
        got_s = time.monotonic() - asked
        greedy.join()
    assert result["usage"] == 16 * LONG_TOKENS
    sglang = max(sample["tiny-s"] for _, sample in sampler.samples)
    # tiny-a wants more than its 64 MiB max, but never gets into the room kept for tiny-b's min
    # (one 4 MiB page id of slack for a sample taken mid-change).
    assert sampler.peak("tiny-a") <= budget - B_MIN_MIB * MiB - sglang + 4 * MiB, sampler.peak("tiny-a")
    # And tiny-b got its memory while tiny-a held most of the rest.
    assert any(s["tiny-b"] >= 12 * MiB and s["tiny-a"] >= 40 * MiB for _, s in sampler.samples)
    with capsys.disabled():
        print(
            f"\nserve min: tiny-a peaked at {sampler.peak('tiny-a') / MiB:.0f} MiB of {budget / MiB:.0f}; "
            f"tiny-b's {B_MIN_MIB} MiB min stayed free; its burst took {got_s:.1f} s"
        )


def _burst_of(serve, model: str, prompts) -> None:
    client(serve.url).completions.create(
        model=model, prompt=prompts, max_tokens=BURST_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )


def test_a_higher_priority_model_gets_memory_from_a_busy_lower_priority_one(serve, capsys):
    before = metric_sum(serve.metrics(), "kvcached_serve_memory_handover_seconds_count", to_model="tiny-a")
    with UsageSampler(serve) as sampler:
        busy, result = _in_background("tiny-b", serve, LONG_LOAD, LONG_TOKENS)
        deadline = time.monotonic() + 120
        while registry_usage(serve)["tiny-b"]["mapped"] < 48 * MiB:
            assert busy.is_alive() and time.monotonic() < deadline, "tiny-b's load never grew"
            time.sleep(0.05)
        asked = time.monotonic()
        _burst_of(serve, "tiny-a", DOUBLE_BURST)
        took_s = time.monotonic() - asked
        busy.join()
    assert result["usage"] == 16 * LONG_TOKENS  # preempted, not failed
    # The min bounds the shrink of a busy model. Once tiny-b's load is done it is idle and gives all
    # it holds back to the refused tiny-a (its min stays reserved in the budget all the same), so
    # only samples from before its answer (less the time the answer takes to reach the client) count.
    # After tiny-a's burst nobody is refused and tiny-b only grows, so samples from then on count too:
    # a burst can end within a second or two, and on a loaded machine the sampler may take none in it.
    still_busy = result["finished_at"] - ANSWER_SLACK_S
    timeline = f"tiny-b done at +{result['finished_at'] - asked:.2f}s; MiB held: {sampler.changes('tiny-b', asked)}"
    # tiny-b may still grow a page or two before tiny-a's ask reaches it: what it gave back counts from
    # the most it held since the ask, not from what it held when the ask was made.
    while_busy = [(at, sample["tiny-b"]) for at, sample in sampler.samples if asked <= at < still_busy]
    most_so_far = [max(mapped for _, mapped in while_busy[: i + 1]) for i in range(len(while_busy))]
    shrinks = [at for (at, mapped), most in zip(while_busy, most_so_far) if mapped < most]
    assert shrinks, f"tiny-b gave memory back only once its load was done: {timeline}"
    held = max(mapped for at, mapped in while_busy if at <= shrinks[0])
    lowest = min(mapped for _, mapped in while_busy)
    assert B_MIN_MIB * MiB <= lowest < held, (lowest, held, timeline)
    assert all(target >= B_MIN_MIB * MiB for target in sampler.targets("tiny-b")), sampler.targets("tiny-b")
    assert sampler.peak("tiny-a") >= 40 * MiB, f"tiny-a's MiB: {sampler.changes('tiny-a', asked)}; {timeline}"
    text = serve.metrics()
    after = metric_sum(text, "kvcached_serve_memory_handover_seconds_count", to_model="tiny-a")
    assert after > before, text
    with capsys.disabled():
        print(
            f"\nserve priority: busy tiny-b held {held / MiB:.0f} MiB and shrank to {lowest / MiB:.0f} MiB "
            f"(its min {B_MIN_MIB} MiB) for tiny-a's burst, which took {took_s:.1f} s\n  {timeline}"
        )


def test_a_killed_engine_is_a_503_for_its_model_only_until_it_is_back(serve):
    victim = serve.engines()["tiny-b"]
    os.kill(victim["pid"], signal.SIGKILL)
    router = client(serve.url)
    deadline = time.monotonic() + 60
    while True:
        try:
            router.completions.create(model="tiny-b", prompt="x", max_tokens=2)
        except openai.InternalServerError as error:
            assert error.status_code == 503 and "tiny-b` is not available" in str(error), error
            break
        except openai.APIConnectionError:
            pass  # the engine died under this very request: the router answered 503 or closed it
        assert time.monotonic() < deadline, "tiny-b never became unavailable"
        time.sleep(0.2)
    for name in ("tiny-a", "tiny-s"):
        assert router.completions.create(model=name, prompt="x", max_tokens=2).usage.completion_tokens == 2
    deadline = time.monotonic() + 60
    while registry_usage(serve)["tiny-b"]["live"] or group_members(victim["pid"]):
        assert time.monotonic() < deadline, "the dead engine's processes or registry entries are still there"
        time.sleep(0.5)
    serve.wait_healthy(RESTART_TIMEOUT_S)
    assert serve.engines()["tiny-b"]["pid"] != victim["pid"]
    assert router.completions.create(model="tiny-b", prompt="x", max_tokens=2).usage.completion_tokens == 2
    text = serve.metrics()
    assert metric_value(text, "kvcached_serve_engine_crashes_total", model="tiny-b") == 1
    assert metric_value(text, "kvcached_serve_engine_restarts_total", model="tiny-b") == 1
    assert "tiny-b: engine exited with signal 9" in serve.log()


def test_sigterm_stops_every_engine_and_leaves_no_registry_entry(serve):
    groups = serve.all_pids()
    assert len(groups) == 4  # three engines and tiny-b's restart
    assert serve.stop() == 0, serve.log()[-4000:]
    assert [pid for pid in groups if group_members(pid)] == []
    assert registry_usage(serve) == {name: {"mapped": 0, "live": 0, "targets": []} for name in MODELS}
    assert registry_entries(serve.registry_dir) == []
    assert "stopped: every engine's processes are gone" in serve.log()
    # Serve created the registry with its budget; it leaves it with the budget a new one gets.
    from kvcached.registry import default_budget_bytes, open_existing
    from kvcached.testing.registry_env import using_registry_dir

    with using_registry_dir(serve.registry_dir):
        assert open_existing("cpu").budget_bytes == default_budget_bytes("cpu")
    assert "device cpu: budget put back to" in serve.log()
