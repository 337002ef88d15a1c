"""kvcached serve holds more models than fit: idle models sleep, requests wake them (fake engines)."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import httpx
import pytest

pytest.importorskip("fastapi")

from kvcached.serve.sleep_manager import SleepManager, SleepState, WakeRefused  # noqa: E402
from kvcached.serve.spec import SleepPolicy  # noqa: E402
from serve_fakes import ServerThread  # noqa: E402
from serve_sleep_fakes import FakeMemory, FakeSleepyEngine, MiB, sleepy_config, sleepy_engine  # noqa: E402

L1, L2 = SleepPolicy(level=1), SleepPolicy(level=2)


@pytest.fixture
def fleet():
    """Builds models on fake engines: fleet(models, budget) -> (manager, memory, calls)."""
    with ExitStack() as stack:

        def build(models, budget_bytes, weights=None, wake_timeout_s=5.0, fail_wake=None):
            config = sleepy_config(models, wake_timeout_s)
            memory, calls = FakeMemory(budget_bytes), []
            engines = {}
            for spec in config.models:
                app = sleepy_engine(
                    spec.name,
                    spec.engine,
                    memory,
                    (weights or {}).get(spec.name, 10 * MiB),
                    calls,
                    fail_wake if spec.name == "b" else None,
                )
                server = stack.enter_context(ServerThread(app))
                engines[spec.name] = FakeSleepyEngine(spec, server.url)
            manager = SleepManager(config, memory, engines)
            for name in engines:
                manager.engine_ready(name)
            return manager, memory, calls

        yield build


def test_a_sleeping_model_is_woken_after_the_least_recently_used_idle_one_is_put_to_sleep(fleet):
    manager, memory, calls = fleet([("a", "vllm", L1, 0), ("b", "vllm", L1, 0), ("c", "vllm", L1, 0)], 25 * MiB)
    manager.put_to_sleep("c")
    assert memory.held() == 20 * MiB
    assert manager.claim("a")  # a is used after b
    manager.done("a")
    manager.wake_and_claim("c")
    assert manager.state("c") is SleepState.AWAKE
    assert manager.state("b") is SleepState.ASLEEP, "b, the least recently used, made room"
    assert manager.state("a") is SleepState.AWAKE
    assert memory.held() <= 25 * MiB
    assert [c[:2] for c in calls] == [("c", "sleep"), ("b", "sleep"), ("c", "wake_up")]


def test_lower_priority_sleeps_first_and_a_model_with_requests_in_flight_never(fleet):
    manager, memory, calls = fleet([("a", "vllm", L1, 0), ("b", "vllm", L1, 5), ("c", "vllm", L1, 9)], 25 * MiB)
    manager.put_to_sleep("c")
    assert manager.claim("a")  # a (the lowest priority) is busy
    manager.wake_and_claim("c")
    assert manager.state("b") is SleepState.ASLEEP and manager.state("a") is SleepState.AWAKE
    manager.done("a")


def test_a_wake_waits_for_a_busy_model_to_finish_then_puts_it_to_sleep(fleet):
    manager, memory, _ = fleet([("a", "vllm", L1, 0), ("c", "vllm", L1, 0)], 15 * MiB)
    manager.put_to_sleep("c")
    assert manager.claim("a")
    threading.Timer(0.3, lambda: manager.done("a")).start()
    started = time.monotonic()
    manager.wake_and_claim("c")
    assert time.monotonic() - started >= 0.25, "waited for a's request"
    assert manager.state("a") is SleepState.ASLEEP and manager.state("c") is SleepState.AWAKE


def test_a_model_that_cannot_fit_beside_the_models_that_never_sleep_is_refused_at_once(fleet):
    manager, memory, calls = fleet([("a", "vllm", None, 0), ("c", "vllm", L1, 0)], 30 * MiB, {"a": 25 * MiB})
    manager.put_to_sleep("c")
    started = time.monotonic()
    with pytest.raises(WakeRefused, match="never sleep"):
        manager.wake_and_claim("c")
    assert time.monotonic() - started < 1.0
    assert manager.state("c") is SleepState.ASLEEP and ("a", "sleep", {}) not in calls


def test_no_idle_model_within_the_wake_timeout_is_a_refusal_not_a_hang(fleet):
    manager, memory, _ = fleet([("a", "vllm", L1, 0), ("c", "vllm", L1, 0)], 15 * MiB, wake_timeout_s=0.5)
    manager.put_to_sleep("c")
    assert manager.claim("a")
    with pytest.raises(WakeRefused, match="no other model was idle"):
        manager.wake_and_claim("c")
    manager.done("a")


def test_an_engine_that_fails_to_wake_is_a_refusal_and_stays_asleep(fleet):
    fail = threading.Event()
    fail.set()
    manager, memory, _ = fleet([("a", "vllm", L1, 0), ("b", "vllm", L1, 0)], 100 * MiB, fail_wake=fail)
    manager.put_to_sleep("b")
    with pytest.raises(WakeRefused, match="could not be woken.*500"):
        manager.wake_and_claim("b")
    assert manager.state("b") is SleepState.ASLEEP
    fail.clear()
    manager.wake_and_claim("b")
    assert manager.state("b") is SleepState.AWAKE


def test_level_2_wakes_the_weights_reloads_them_then_wakes_the_kv_cache(fleet):
    manager, memory, calls = fleet([("v", "vllm", L2, 0), ("s", "sglang", L2, 0)], 100 * MiB)
    for name in ("v", "s"):
        manager.put_to_sleep(name)
        manager.wake_and_claim(name)
    assert [c[1:] for c in calls if c[0] == "v"] == [
        ("sleep", {"level": "2"}),
        ("wake_up", {"tags": "weights"}),
        ("collective_rpc", {}),
        ("wake_up", {"tags": "kv_cache"}),
    ]
    assert [c[1] for c in calls if c[0] == "s"] == [
        "release_memory_occupation",
        "resume_memory_occupation",
        "update_weights_from_disk",
    ]


def test_concurrent_requests_for_several_sleeping_models_are_all_woken(fleet):
    manager, memory, _ = fleet([(n, "vllm", L1, 0) for n in "abcd"], 25 * MiB)
    for name in "bcd":
        manager.put_to_sleep(name)
    errors = []

    def use(name):
        try:
            manager.wake_and_claim(name)
            time.sleep(0.05)
            manager.done(name)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=use, args=(n,)) for n in "bcdabc"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert memory.held() <= 25 * MiB


def test_a_model_woken_for_a_request_is_not_put_to_sleep_before_the_request_ends(fleet):
    # The wake claims the model for its request: the next wake cannot take it back in between.
    manager, memory, _ = fleet([("a", "vllm", L1, 0), ("c", "vllm", L1, 0)], 15 * MiB, wake_timeout_s=0.5)
    manager.put_to_sleep("c")
    manager.wake_and_claim("c")
    assert manager.state("a") is SleepState.ASLEEP and manager.state("c") is SleepState.AWAKE
    assert not manager.put_to_sleep("c"), "c has its request"
    with pytest.raises(WakeRefused, match="no other model was idle"):
        manager.wake_and_claim("a")
    assert manager.state("c") is SleepState.AWAKE and manager.state("a") is SleepState.ASLEEP
    manager.done("c")
    manager.wake_and_claim("a")
    assert manager.state("c") is SleepState.ASLEEP and manager.state("a") is SleepState.AWAKE
    manager.done("a")


def test_a_model_with_idle_s_sleeps_on_its_own_but_not_while_it_serves(fleet):
    quick = SleepPolicy(level=1, idle_s=0.3)
    manager, memory, _ = fleet([("a", "vllm", quick, 0), ("b", "vllm", None, 0)], 100 * MiB)
    manager.start()
    try:
        assert manager.claim("a")
        time.sleep(1.2)
        assert manager.state("a") is SleepState.AWAKE, "busy: never put to sleep"
        manager.done("a")
        deadline = time.monotonic() + 5
        while manager.state("a") is not SleepState.ASLEEP:
            assert time.monotonic() < deadline, "idle 0.3 s, it should sleep"
            time.sleep(0.05)
        assert manager.state("b") is SleepState.AWAKE, "b has no sleep: never"
    finally:
        manager.stop()


def test_the_router_wakes_a_sleeping_model_for_its_request_and_reports_it(fleet):
    from kvcached.serve.metrics import ServeMetrics
    from kvcached.serve.router import create_app
    from serve_fakes import FakeRoute, FakeRoutes

    manager, memory, _ = fleet([("a", "vllm", L1, 0), ("b", "vllm", L1, 0)], 15 * MiB)
    manager.put_to_sleep("b")
    routes = FakeRoutes({name: FakeRoute(engine.base_url) for name, engine in manager._engines.items()})
    metrics = ServeMetrics(list(manager._config.models))
    metrics.watch_sleep(manager)
    manager._on_wake, manager._on_sleep = metrics.woke, metrics.slept
    with ServerThread(create_app(routes, ["a", "b"], metrics, sleep=manager)) as router:
        health = httpx.get(f"{router.url}/health").json()
        assert health["models"] == {"a": "ready", "b": "asleep"} and health["status"] == "ok"
        answer = httpx.post(f"{router.url}/v1/completions", json={"model": "b", "prompt": "x"}, timeout=30)
        assert answer.status_code == 200 and answer.json()["model"] == "b"
        assert manager.state("a") is SleepState.ASLEEP
        text = httpx.get(f"{router.url}/metrics").text
    assert 'kvcached_serve_model_wakes_total{model="b"} 1.0' in text
    assert 'kvcached_serve_model_sleeps_total{model="a"} 1.0' in text
    assert 'kvcached_serve_model_sleeping{model="a"} 1.0' in text
    assert 'kvcached_serve_model_wake_seconds_count{model="b"} 1.0' in text


def test_the_router_answers_a_wake_that_cannot_happen_with_a_503_in_the_openai_shape(fleet):
    from kvcached.serve.metrics import ServeMetrics
    from kvcached.serve.router import create_app
    from serve_fakes import FakeRoute, FakeRoutes

    manager, memory, _ = fleet([("a", "vllm", None, 0), ("c", "vllm", L1, 0)], 30 * MiB, {"a": 25 * MiB})
    manager.put_to_sleep("c")
    routes = FakeRoutes({name: FakeRoute(engine.base_url) for name, engine in manager._engines.items()})
    with ServerThread(create_app(routes, ["a", "c"], ServeMetrics(list(manager._config.models)), sleep=manager)) as r:
        answer = httpx.post(f"{r.url}/v1/completions", json={"model": "c", "prompt": "x"}, timeout=30)
    assert answer.status_code == 503
    error = answer.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == "model_cannot_wake"
    assert "never sleep" in error["message"]
