"""kvctl, kvtop and kvcached under hostile input and on first use: instances named by pid or by
name, dead ones refused, no registry made as a side effect, errors as JSON under --json,
--version, and kvtop readable at 80 columns and without a terminal."""

from __future__ import annotations

import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import time

import pytest

import kvcached
from kvcached.registry import DeviceRegistry, MemoryPolicy

PAGE_BYTES = 2 * 1024 * 1024
BUDGET_BYTES = 64 * PAGE_BYTES
GPU = "cuda-GPU-0a1b2c3d-0000-4000-8000-00000000000a"
COMMAND_TIMEOUT_S = 60
NARROW_COLUMNS = 80
LONG_NAME = "engine-llama-3.1-8b-instruct"  # 28 characters


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    return {**os.environ, "COLUMNS": "160"}


@pytest.fixture
def registry(env):
    return DeviceRegistry("cpu", BUDGET_BYTES)


def run(env, module, *args, expect_rc=0) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", module, *args]
    done = subprocess.run(argv, env=env, check=False, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert expect_rc is None or done.returncode == expect_rc, (done.stdout, done.stderr)
    return done


def kvctl_json(env, *args, expect_rc=0) -> dict:
    return json.loads(run(env, "kvcached.kvctl", *args, "--json", expect_rc=expect_rc).stdout)


def assert_one_line(done, rc: int, words: str) -> None:
    assert done.returncode == rc, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert words in done.stderr, done.stderr


def register_and_die(name: str) -> None:
    budget = DeviceRegistry("cpu").register(name)
    assert budget.try_acquire(PAGE_BYTES)
    os.kill(os.getpid(), signal.SIGKILL)  # dies without unregistering


# ---- kvctl: what it targets and what it refuses ----------------------------------------------


@pytest.mark.parametrize("args", [("set-budget", "1G"), ("set-limit", "x", "1G"), ("clear-limit", "x")])
def test_kvctl_never_creates_a_registry(env, tmp_path, args):
    missing = tmp_path / "newdir"
    done = run({**env, "KVCACHED_REGISTRY_DIR": str(missing)}, "kvcached.kvctl", *args, expect_rc=None)
    assert_one_line(done, 1, "no registry for device 'cpu'")
    assert not missing.exists(), "kvctl made a registry directory"
    run(env, "kvcached.kvctl", *args, expect_rc=1)  # the directory exists, no registry in it
    assert list(tmp_path.iterdir()) == [], "kvctl made a registry"


@pytest.mark.parametrize(
    "target, words",
    [
        ("9223372036854775808", "is not a process id (1 to 2147483647); for an instance named so, write name:"),
        ("99999999999", "is not a process id"),
        ("pid:0", "is not a process id"),
        ("pid:-1", "is not a process id: expected pid:<digits>"),
        ("pid:x", "is not a process id: expected pid:<digits>"),
        ("name:", "names no instance"),
    ],
)
def test_kvctl_refuses_a_target_that_can_name_no_instance_in_one_line(env, registry, target, words):
    done = run(env, "kvcached.kvctl", "set-limit", target, "1G", expect_rc=None)
    assert_one_line(done, 1, f"{target!r} {words}")
    assert "bad_cast" not in done.stderr


def test_registry_set_limit_refuses_a_pid_no_process_can_have(registry):
    for pid in (2**63, 2**64, 0, -1):
        with pytest.raises(ValueError, match="pid"):
            registry.set_policy(pid, max_bytes=PAGE_BYTES)


def test_kvctl_names_instances_by_pid_or_by_name_even_all_digits(env, registry):
    numeric, llama = registry.register("12345"), registry.register("llama")
    assert kvctl_json(env, "set-limit", "name:12345", "4MiB")["matched"] == 1
    assert (numeric.max_bytes, llama.max_bytes) == (2 * PAGE_BYTES, None)
    assert kvctl_json(env, "set-limit", "llama", "8MiB")["matched"] == 1, "a bare name still works"
    assert kvctl_json(env, "set-limit", f"pid:{os.getpid()}", "16MiB")["matched"] == 2
    assert kvctl_json(env, "clear-limit", str(os.getpid()))["matched"] == 2, "a bare pid still works"
    assert numeric.max_bytes is None and llama.max_bytes is None


def test_kvctl_refuses_to_limit_a_dead_instance(env, registry):
    child = multiprocessing.get_context("spawn").Process(target=register_and_die, args=("crashed",))
    child.start()
    child.join(COMMAND_TIMEOUT_S)
    assert child.exitcode == -signal.SIGKILL
    for target in ("crashed", f"pid:{child.pid}"):
        done = run(env, "kvcached.kvctl", "set-limit", target, "1G", expect_rc=None)
        assert_one_line(done, 1, "dead instance")
        assert "kvctl clean" in done.stderr
    (dead,) = registry.entries()
    assert dead["limit_bytes"] is None, "a refused command changes nothing"


# ---- --json: failures are JSON too -----------------------------------------------------------


@pytest.mark.parametrize(
    "args, variables, rc",
    [
        (("bogus", "--json"), {}, 2),
        (("--json", "set-limit"), {}, 2),
        (("list", "--all", "--device", "cpu", "--json"), {}, 2),
        (("set-limit", "x", "lots", "--json"), {}, 1),
        (("set-budget", "1G", "--json"), {}, 1),
        (("list", "--json"), {"KVCACHED_REGISTRY_GROUP": "no-such-group-kvcached"}, 1),
        (("list", "--json"), {"KVCACHED_GPU_UTILIZATION": "2"}, 1),
    ],
)
def test_kvctl_failures_are_json_on_stdout_under_json(env, args, variables, rc):
    done = run({**env, **variables}, "kvcached.kvctl", *args, expect_rc=rc)
    failure = json.loads(done.stdout)
    assert isinstance(failure["error"], str) and failure["error"] in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


# ---- every tool -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module, name", [("kvcached", "kvcached"), ("kvcached.kvctl", "kvctl"), ("kvcached.kvtop", "kvtop")]
)
def test_every_tool_prints_the_package_version(env, module, name):
    assert run(env, module, "--version").stdout.split() == [name, kvcached.__version__]


def test_registry_views_call_mapped_but_free_memory_free_mapped(env, registry):
    engine = registry.register("engine")
    assert engine.try_acquire(3 * PAGE_BYTES)
    engine.report_usage(PAGE_BYTES, 3 * PAGE_BYTES)
    (entry,) = kvctl_json(env, "list")["instances"]
    assert entry["free_mapped_bytes"] == 2 * PAGE_BYTES and "reserved_bytes" not in entry
    table = run(env, "kvcached.kvctl", "list").stdout
    assert "FREE-MAPPED" in table and "RESERVED" not in table
    frame = run(env, "kvcached.kvtop", "--once").stdout
    assert "mapped, free" in frame and "reserved" not in frame


# ---- kvtop on a narrow terminal and without one ----------------------------------------------


def test_kvtop_keeps_names_whole_at_80_columns(env, registry):
    busy = DeviceRegistry(GPU, BUDGET_BYTES).register(
        LONG_NAME, local_device="cuda:3", policy=MemoryPolicy(max_bytes=8 * PAGE_BYTES)
    )
    assert busy.try_acquire(4 * PAGE_BYTES)
    busy.report_usage(PAGE_BYTES, 4 * PAGE_BYTES)
    busy.report_worker_errors(3)
    host = registry.register("qwen2.5-0.5b-instruct")
    frame = run({**env, "COLUMNS": str(NARROW_COLUMNS)}, "kvcached.kvtop", "--once").stdout
    for text in (LONG_NAME, "qwen2.5-0.5b-instruct", GPU, "3 err", "8.0M", "16M"):
        assert text in frame, (text, frame)
    assert max(len(line) for line in frame.splitlines()) <= NARROW_COLUMNS, frame
    assert busy.registered and host.registered


def test_kvtop_without_a_terminal_streams_plain_snapshots(env, registry):
    engine = registry.register("piped-engine")
    view = subprocess.Popen(
        [sys.executable, "-m", "kvcached.kvtop", "--interval", "0.2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # Ctrl-C as a terminal sends it, even where this test's runner was started with SIGINT
        # ignored (a background job of a shell), which the child would otherwise inherit.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = b""
    try:
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        # Two snapshots while it runs, before anything asks it to stop.
        while seen.count(b"piped-engine") < 2 and time.monotonic() < deadline:
            if select.select([view.stdout], [], [], 1.0)[0]:
                chunk = os.read(view.stdout.fileno(), 65536)
                if not chunk:
                    break
                seen += chunk
    finally:
        view.send_signal(signal.SIGINT)
        view.communicate(timeout=COMMAND_TIMEOUT_S)
    assert seen.count(b"piped-engine") >= 2, seen.decode(errors="replace")
    assert b"\x1b[" not in seen, "plain text: no cursor movement or colours"
    assert engine.registered
