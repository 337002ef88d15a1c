"""The supervisor of ``kvcached serve`` with stand-in engines (``fake_engine_server.py``): engines
start with kvcached on under their model's name, a killed one is reclaimed and restarted (a limited
number of times) while the others keep running, a start failure fails the start, and stopping
leaves no process and no registry entry."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("httpx", reason="kvcached serve needs the serve extra: pip install '.[serve]'")

from kvcached.serve.config import parse_config  # noqa: E402
from kvcached.serve.memory import DeviceMemory  # noqa: E402
from kvcached.serve.processes import group_members  # noqa: E402
from kvcached.serve.supervisor import EngineState, Supervisor  # noqa: E402

MiB = 1 << 20
TESTS = Path(__file__).resolve().parent
WAIT_S = 60


def make_supervisor(
    tmp_path, monkeypatch, failing: str = "", max_attempts: int = 2, names=("one", "two"), startup_timeout_s=900
) -> Supervisor:
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path / "registry"))
    (tmp_path / "registry").mkdir()
    pythonpath = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    models = []
    for index, name in enumerate(names):
        env = {"PYTHONPATH": pythonpath, "FAKE_ENGINE_RECORD": str(tmp_path / f"{index}.jsonl")}
        env["FAKE_ENGINE_MAPPED_BYTES"] = str(4 * MiB)
        if name == failing:
            env["FAKE_ENGINE_FAIL"] = "1"
        memory = {"min": "2MiB", "max": "32MiB", "priority": 3} if name == "one" else {}
        models.append(
            {
                "name": name,
                "engine": "vllm",
                "model": "/m",
                "module": "fake_engine_server",
                "env": env,
                "memory": memory,
            }
        )
    config = parse_config(
        {
            "device": "cpu",
            "budget": "64MiB",
            "stop_timeout_s": 1,
            "startup_timeout_s": startup_timeout_s,
            "restart": {"max_attempts": max_attempts, "backoff_s": 0.1},
            "models": models,
        }
    )
    (tmp_path / "logs").mkdir()
    return Supervisor(config, DeviceMemory(config), tmp_path / "logs")


def starts(tmp_path, name: str, names=("one", "two")) -> list[dict]:
    path = tmp_path / f"{names.index(name)}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture
def supervisor(tmp_path, monkeypatch):
    supervisor = make_supervisor(tmp_path, monkeypatch)
    supervisor.start()
    yield supervisor
    supervisor.stop()


def test_engines_start_with_kvcached_on_under_their_model_name(supervisor, tmp_path):
    assert supervisor.wait_ready(lambda: False) is None
    (one,) = starts(tmp_path, "one")
    assert one["args"]["served_model_name"] == "one" and one["args"]["model"] == "/m"
    assert one["args"]["port"] == supervisor.route("one").port and supervisor.route("one").url.endswith(
        str(one["args"]["port"])
    )
    env = one["env"]
    assert (env["KVCACHED_ENABLE"], env["KVCACHED_NAME"], env["KVCACHED_PRIORITY"]) == ("1", "one", "3")
    assert (env["KVCACHED_MIN_BYTES"], env["KVCACHED_LIMIT_BYTES"]) == (str(2 * MiB), str(32 * MiB))
    assert "KVCACHED_LIMIT_BYTES" not in starts(tmp_path, "two")[0]["env"]
    memory = supervisor.engines["one"]._memory
    usage = memory.usage()
    assert usage["one"].mapped_bytes == usage["two"].mapped_bytes == 4 * MiB and memory.budget_bytes == 64 * MiB


def test_a_killed_engine_is_reclaimed_and_restarted_while_the_other_runs(supervisor, tmp_path, caplog):
    caplog.set_level("INFO", logger="kvcached.serve")
    assert supervisor.wait_ready(lambda: False) is None
    (first,) = starts(tmp_path, "one")
    other_pid = supervisor.route("two").pid
    os.kill(first["pid"], signal.SIGKILL)
    wait_for(lambda: supervisor.route("one").url is None, "the dead engine is still routed to")
    wait_for(
        lambda: supervisor.route("one").state is EngineState.READY and len(starts(tmp_path, "one")) == 2, "no restart"
    )
    assert group_members(first["pid"]) == []  # its stubborn child went with it
    registry = supervisor.engines["one"]._memory.registry
    assert sorted(e["name"] for e in registry.entries()) == ["one", "two"]  # the dead entry is gone
    assert registry.mapped_bytes == 8 * MiB  # and its 4 MiB returned to the budget
    assert supervisor.route("two").pid == other_pid and supervisor.route("two").url is not None
    engine = supervisor.route("one")
    assert (engine.crashes, engine.restarts) == (1, 1)
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("one: engine exited with signal 9") for m in said), said
    assert "one: 4.0 MiB of KV memory returned to the device budget" in said


def test_restarts_are_limited(supervisor, tmp_path):
    assert supervisor.wait_ready(lambda: False) is None
    for _attempt in range(3):
        wait_for(lambda: supervisor.route("one").state is EngineState.READY, "not back")
        os.kill(supervisor.route("one").pid, signal.SIGKILL)
        wait_for(lambda: supervisor.route("one").state is not EngineState.READY, "still ready after kill -9")
    wait_for(lambda: supervisor.route("one").state is EngineState.FAILED, "restarted without end")
    assert "gave up after 2 restarts" in supervisor.route("one").failure
    assert len(starts(tmp_path, "one")) == 3 and supervisor.route("two").state is EngineState.READY


def test_an_engine_that_fails_to_start_fails_the_start_and_says_why(tmp_path, monkeypatch):
    supervisor = make_supervisor(tmp_path, monkeypatch, failing="two")
    supervisor.start()
    try:
        problem = supervisor.wait_ready(lambda: False)
    finally:
        supervisor.stop()
    assert problem.startswith("two: engine exited with exit code 3 while starting") and "two.log" in problem
    assert "failing as asked" in supervisor.route("two").log_tail()
    assert len(starts(tmp_path, "two")) == 0 and supervisor.route("two").state is EngineState.STOPPED


def test_stopping_leaves_no_process_and_no_registry_entry(tmp_path, monkeypatch):
    supervisor = make_supervisor(tmp_path, monkeypatch)
    supervisor.start()
    assert supervisor.wait_ready(lambda: False) is None
    records = starts(tmp_path, "one") + starts(tmp_path, "two")
    memory = supervisor.engines["one"]._memory
    started = time.monotonic()
    supervisor.stop()
    assert time.monotonic() - started < 15  # SIGKILL after stop_timeout_s for the child that ignores SIGTERM
    assert [r["pid"] for r in records if group_members(r["pid"])] == []
    assert memory.registry.entries() == [] and memory.registry.mapped_bytes == 0


def wait_bounded(supervisor: Supervisor, bound_s: float = WAIT_S):
    """supervisor.wait_ready, ended as if by a signal after ``bound_s`` (a test must not hang)."""
    deadline = time.monotonic() + bound_s
    return supervisor.wait_ready(lambda: time.monotonic() > deadline)


def test_model_names_that_look_like_paths_do_not_steer_the_log_path(tmp_path, monkeypatch):
    # vLLM's own default served name has a slash; the others would point out of the log directory.
    absolute = f"/tmp/kvcached-test-{os.getpid()}"  # a path the log would have been written to, ".log" added
    names = ("Qwen/Qwen2.5-0.5B-Instruct", "../../escaped", absolute, "Qwen_Qwen2.5-0.5B-Instruct")
    supervisor = make_supervisor(tmp_path, monkeypatch, names=names)
    supervisor.start()
    try:
        assert wait_bounded(supervisor) is None
        paths = [supervisor.engines[name].log_path for name in names]
        assert all(path.parent == tmp_path / "logs" and path.is_file() for path in paths), paths
        assert len(set(paths)) == len(names)  # one log per model, even for names that differ in a slash only
        assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == sorted(p.name for p in paths)
        assert not (tmp_path / "escaped.log").exists() and not Path(absolute + ".log").exists()
    finally:
        supervisor.stop()
        Path(absolute + ".log").unlink(missing_ok=True)


def test_an_engine_that_cannot_be_launched_fails_the_start_with_the_reason(tmp_path, monkeypatch):
    import kvcached.serve.supervisor as supervision

    supervisor = make_supervisor(tmp_path, monkeypatch)
    real_popen = supervision.subprocess.Popen

    def popen(command, **kwargs):
        if "two" in command:
            raise ValueError("embedded null byte")
        return real_popen(command, **kwargs)

    monkeypatch.setattr(supervision.subprocess, "Popen", popen)
    supervisor.start()
    try:
        problem = wait_bounded(supervisor)
    finally:
        supervisor.stop()
    assert problem.startswith("two: engine could not be launched: ValueError: embedded null byte"), problem
    assert supervisor.route("two").state is EngineState.STOPPED


def test_a_fault_in_an_engine_thread_fails_the_start_instead_of_hanging(tmp_path, monkeypatch):
    import kvcached.serve.ports as ports

    supervisor = make_supervisor(tmp_path, monkeypatch)

    def broken_port(host):
        raise RuntimeError("no port today")

    monkeypatch.setattr(ports, "free_port", broken_port)
    supervisor.start()
    try:
        problem = wait_bounded(supervisor)
    finally:
        supervisor.stop()
    assert "supervising the engine failed: RuntimeError: no port today" in problem, problem


def test_the_start_ends_after_startup_timeout_s_whatever_the_engines_threads_do(tmp_path, monkeypatch):
    import kvcached.serve.supervisor as supervision
    from kvcached.serve.supervisor import Engine

    supervisor = make_supervisor(tmp_path, monkeypatch, startup_timeout_s=0.5)
    monkeypatch.setattr(supervision, "STARTUP_SLACK_S", 0.0)
    stuck = threading.Event()
    monkeypatch.setattr(Engine, "_run", lambda self: stuck.wait(WAIT_S))  # alive, "starting" for ever
    supervisor.start()
    started = time.monotonic()
    try:
        problem = wait_bounded(supervisor)
    finally:
        stuck.set()
        supervisor.stop()
    assert problem == "one, two: not ready within startup_timeout_s (0.5 s)", problem
    assert time.monotonic() - started < 5


def test_an_engine_thread_that_ends_without_a_verdict_fails_the_start(tmp_path, monkeypatch):
    from kvcached.serve.supervisor import Engine

    supervisor = make_supervisor(tmp_path, monkeypatch)
    monkeypatch.setattr(Engine, "_run", lambda self: None)
    supervisor.start()
    try:
        problem = wait_bounded(supervisor)
    finally:
        supervisor.stop()
    assert problem == "one, two: the engine's supervision ended before it was ready", problem
