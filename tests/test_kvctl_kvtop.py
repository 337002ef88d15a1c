"""kvctl and kvtop through their real entry points (python -m), against a live registry."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from kvcached.registry import DeviceRegistry, MemoryPolicy
from registry_files import entry_offset, poke

PAGE_BYTES = 2 * 1024 * 1024
DEVICE = "cpu"
# Made-up physical identities, shaped like nvidia-smi's.
GPU = "cuda-GPU-0a1b2c3d-0000-4000-8000-00000000000a"
OTHER_GPU = "cuda-GPU-0a1b2c3d-0000-4000-8000-00000000000b"
BUDGET_BYTES = 64 * PAGE_BYTES
COMMAND_TIMEOUT_S = 60
# Wide enough that kvtop's table never elides a column.
TERMINAL_COLUMNS = "160"


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    return {**os.environ, "COLUMNS": TERMINAL_COLUMNS}


@pytest.fixture
def registry(env):
    return DeviceRegistry(DEVICE, BUDGET_BYTES)


def run(env, module, *args, expect_rc=0):
    """Runs kvctl / kvtop; ``expect_rc=None`` leaves checking the exit code to the caller."""
    argv = [os.fsencode(arg) for arg in (sys.executable, "-m", f"kvcached.{module}", *args)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert expect_rc is None or done.returncode == expect_rc, done.stderr
    return done


def kvctl_json(env, *args, expect_rc=0):
    return json.loads(run(env, "kvctl", *args, "--json", expect_rc=expect_rc).stdout)


def child_register_and_exit(name: str) -> None:
    budget = DeviceRegistry(DEVICE).register(name)
    assert budget.try_acquire(PAGE_BYTES)
    os.kill(os.getpid(), signal.SIGKILL)  # die without unregistering


def test_kvctl_list_shows_instances_and_device_totals(env, registry):
    engine = registry.register("llama", policy=MemoryPolicy(max_bytes=8 * PAGE_BYTES))
    assert engine.try_acquire(3 * PAGE_BYTES)
    engine.report_usage(PAGE_BYTES, 3 * PAGE_BYTES)
    listing = kvctl_json(env, "list")
    assert (listing["device"], listing["exists"], listing["budget_bytes"]) == (DEVICE, True, BUDGET_BYTES)
    assert listing["mapped_bytes"] == 3 * PAGE_BYTES
    (entry,) = listing["instances"]
    assert (entry["name"], entry["pid"], entry["alive"]) == ("llama", os.getpid(), True)
    assert (entry["limit_bytes"], entry["used_bytes"], entry["free_mapped_bytes"]) == (
        8 * PAGE_BYTES,
        PAGE_BYTES,
        2 * PAGE_BYTES,
    )
    human = run(env, "kvctl").stdout  # no command means list
    assert "llama" in human and "6.0 MiB" in human and "16.0 MiB" in human


def test_kvctl_options_go_before_or_after_the_command(env, registry):
    engine = registry.register("a")  # kept: dropping unregisters
    assert engine.registered
    before = json.loads(run(env, "kvctl", "--json", "--device", DEVICE, "list").stdout)
    after = json.loads(run(env, "kvctl", "list", "--device", DEVICE, "--json").stdout)
    assert before == after


def test_kvctl_list_of_an_unused_device_is_empty_not_an_error(env):
    listing = kvctl_json(env, "--device", GPU, "list")
    assert (listing["device"], listing["exists"], listing["instances"]) == (GPU, False, [])


def test_kvctl_limits_reach_the_running_instance(env, registry):
    engine = registry.register("qwen")
    other = registry.register("other")
    result = kvctl_json(env, "set-limit", "qwen", "4MiB")
    assert (result["matched"], result["limit_bytes"]) == (1, 2 * PAGE_BYTES)
    assert engine.max_bytes == 2 * PAGE_BYTES and other.max_bytes is None
    assert engine.try_acquire(2 * PAGE_BYTES) and not engine.try_acquire(PAGE_BYTES)
    assert kvctl_json(env, "set-limit", str(os.getpid()), "16M")["matched"] == 2, "by pid: both of ours"
    assert kvctl_json(env, "clear-limit", "qwen")["limit_bytes"] is None
    assert engine.max_bytes is None and other.max_bytes == 8 * PAGE_BYTES


def test_kvctl_unknown_instance_or_bad_size_fails_clearly(env, registry):
    failed = kvctl_json(env, "set-limit", "nobody", "1G", expect_rc=1)
    assert failed["matched"] == 0 and "nobody" in failed["error"]
    bad_size = run(env, "kvctl", "set-limit", "x", "lots", expect_rc=1)
    assert "not a size" in bad_size.stderr


def test_kvctl_set_budget_takes_effect_at_once(env, registry):
    engine = registry.register("engine")
    assert engine.try_acquire(10 * PAGE_BYTES)
    result = kvctl_json(env, "set-budget", "8MiB")
    assert (result["previous_budget_bytes"], result["budget_bytes"]) == (BUDGET_BYTES, 4 * PAGE_BYTES)
    assert registry.budget_bytes == 4 * PAGE_BYTES
    assert not engine.try_acquire(PAGE_BYTES)
    assert engine.external_limit_bytes == 4 * PAGE_BYTES, "told to shrink to the new budget"


def test_kvctl_set_budget_of_a_device_without_a_registry_fails_and_creates_nothing(env, tmp_path):
    for device in (DEVICE, GPU):
        failed = run(env, "kvctl", "--device", device, "set-budget", "1GiB", expect_rc=1)
        assert "no registry for device" in failed.stderr and "first engine" in failed.stderr
    assert list(tmp_path.iterdir()) == [], "the first engine creates a registry, never kvctl"


def test_kvctl_clean_reclaims_dead_instances(env, registry):
    child = multiprocessing.get_context("spawn").Process(target=child_register_and_exit, args=("crashed",))
    child.start()
    child.join(COMMAND_TIMEOUT_S)
    assert child.exitcode == -signal.SIGKILL
    (dead,) = kvctl_json(env, "list")["instances"]
    assert dead["name"] == "crashed" and not dead["alive"]
    assert kvctl_json(env, "clean") == {"device": DEVICE, "cleaned": 1, "removed_files": []}
    assert registry.entries() == [] and registry.available_bytes == BUDGET_BYTES


def test_kvtop_once_prints_one_frame_of_every_device(env, registry):
    engine = registry.register("llama-8b", policy=MemoryPolicy(max_bytes=32 * PAGE_BYTES))
    assert engine.try_acquire(8 * PAGE_BYTES)
    engine.report_usage(4 * PAGE_BYTES, 8 * PAGE_BYTES)
    other_device = DeviceRegistry(GPU, BUDGET_BYTES).register("mistral-7b", local_device="cuda:3")  # kept
    frame = run(env, "kvtop", "--once").stdout
    for text in ("cpu", GPU, "cuda:3", "budget 128.0 MiB", "llama-8b", str(os.getpid()), "8.0M", "16M", "64M", "ok"):
        assert text in frame, text
    assert "█" in frame and "▒" in frame, "usage bars drawn"
    only_cuda = run(env, "kvtop", "--once", "--device", GPU).stdout
    assert "mistral-7b" in only_cuda and "llama-8b" not in only_cuda
    assert other_device.registered


def test_kvtop_once_without_any_registry_says_so(env):
    assert "no kvcached registry under" in run(env, "kvtop", "--once").stdout


def test_kvtop_live_view_refreshes_until_interrupted(env, registry):
    engine = registry.register("live-engine")  # kept: dropping unregisters
    view = subprocess.Popen(
        [sys.executable, "-m", "kvcached.kvtop", "--interval", "0.1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell's background job ignores SIGINT and children inherit that: undo it, so the
        # test means the same however the suite was started.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(2.0)
    view.send_signal(signal.SIGINT)
    out, err = view.communicate(timeout=COMMAND_TIMEOUT_S)
    assert view.returncode == 0, err
    assert "live-engine" in out and engine.registered


# ---- bad input: one line on stderr, a non-zero exit, never a traceback ----------------------


def assert_one_line_failure(done, rc: int, words: str) -> None:
    assert done.returncode == rc, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert words in done.stderr, done.stderr


def run_in_process(capsys, module: str, *args: str) -> subprocess.CompletedProcess:
    """The tool's main() in this process (fast): an uncaught exception fails the test like a traceback."""
    main = importlib.import_module(f"kvcached.cli.{module}").main
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


@pytest.mark.parametrize(
    "args, rc, words",
    [
        (("set-limit", "x", "1e99"), 1, "exponents"),
        (("set-limit", "x", "0.5"), 1, "whole number of bytes"),
        (("set-limit", "x", "-1"), 1, "negative"),
        (("set-limit", "x", "99999999999999999999"), 1, "too large"),
        (("set-limit", "x", "inf"), 1, "not a size"),
        (("set-budget", "nan"), 1, "not a size"),
        (("set-budget", "9223372036854775808"), 1, "too large"),
        (("--device", "../x", "list"), 1, "unknown device '../x'"),
        (("--device", "cuda:0/../../etc", "clean"), 1, "unknown device"),
        (("--device", "cuda:77", "list"), 1, "cannot open"),
        (("--device", "cuda:77", "set-budget", "1G"), 1, "cannot open"),
        (("--device", "cuda-GPU-not-a-uuid", "set-budget", "1G"), 1, "unknown device"),
        (("set-limit", "x"), 2, "the following arguments are required"),
        (("frobnicate",), 2, "invalid choice"),
        (("--bogus",), 2, "unrecognized arguments"),
    ],
)
def test_kvctl_answers_bad_arguments_in_one_line(env, tmp_path, capsys, args, rc, words):
    assert_one_line_failure(run_in_process(capsys, "kvctl", *args), rc, words)
    assert list(tmp_path.iterdir()) == [], "a bad argument creates nothing"


@pytest.mark.parametrize(
    "args, words",
    [
        (("--interval", "nan"), "'nan' is not between"),
        (("--interval", "inf"), "'inf' is not between"),
        (("--interval", "-1"), "is not between"),
        (("--interval", "0"), "is not between"),
        (("--interval", "soon"), "is not a number of seconds"),
        (("--device", "../x", "--once"), "unknown device '../x'"),
        (("--device", "cuda:77", "--once"), "cannot open"),
    ],
)
def test_kvtop_answers_bad_arguments_in_one_line(env, capsys, args, words):
    assert_one_line_failure(run_in_process(capsys, "kvtop", *args), 2, words)


@pytest.mark.parametrize("module", ["kvctl", "kvtop"])
@pytest.mark.parametrize(
    "variable, value, words",
    [
        ("KVCACHED_REGISTRY_DIR", "relative/dir", "absolute path"),
        ("KVCACHED_REGISTRY_GROUP", "no-such-group-kvcached", "names no group"),
    ],
)
def test_a_bad_setting_is_one_line_too(env, monkeypatch, module, variable, value, words):
    env = {**env, variable: value}
    args = ("list",) if module == "kvctl" else ("--once",)
    assert_one_line_failure(run(env, module, *args, expect_rc=None), 1, words)


def test_names_that_are_not_printable_utf8_are_shown_escaped(env, registry):
    engine = registry.register("crafted-name-xxxx")
    # What another writer of the file could leave: invalid UTF-8 and a terminal escape sequence.
    poke(registry.path, entry_offset(engine.slot, "name"), b"crafted\xff\xfe\x1b[2J\x00")
    (entry,) = registry.entries()
    assert entry["name"] == "crafted\\xff\\xfe\x1b[2J"
    listing = run(env, "kvctl", "list").stdout
    assert "crafted\\xff\\xfe\\x1b[2J" in listing and "\x1b" not in listing
    assert kvctl_json(env, "list")["instances"][0]["name"] == "crafted\\xff\\xfe\x1b[2J"
    frame = run(env, "kvtop", "--once").stdout
    assert "crafted\\xff\\xfe" in frame and "\x1b[2J" not in frame
    assert kvctl_json(env, "set-limit", "crafted\udcff\udcfe\x1b[2J", "4M")["matched"] == 1, "named as it is stored"
    assert engine.max_bytes == 2 * PAGE_BYTES


def test_kvctl_files_and_list_report_a_damaged_registry_in_one_line(env, registry, tmp_path):
    os.truncate(registry.path, 0)
    assert_one_line_failure(run(env, "kvctl", "list", expect_rc=None), 1, "is empty (truncated)")
    (damaged,) = kvctl_json(env, "files")["files"]
    assert (damaged["status"], damaged["removable"]) == ("damaged", True)
    assert "is empty (truncated)" in run(env, "kvtop", "--once").stdout
    assert kvctl_json(env, "clean")["removed_files"] == [registry.path]


# ---- every device at once, each physical device once -------------------------------------------


def test_kvctl_list_all_shows_each_device_once_with_the_index_each_instance_sees(env, registry, tmp_path):
    registry.register("host-engine")  # kept: dropping unregisters
    gpu = DeviceRegistry(GPU, BUDGET_BYTES)
    other = DeviceRegistry(OTHER_GPU, BUDGET_BYTES)
    # One GPU seen as cuda:1 by one process and cuda:0 by another; a second GPU.
    kept = [
        gpu.register("rank-0", local_device="cuda:1"),
        gpu.register("rank-1", local_device="cuda:0"),
        other.register("solo", local_device="cuda:0"),
    ]
    assert kept[0].try_acquire(PAGE_BYTES)
    listing = kvctl_json(env, "list", "--all")
    assert listing["directory"] == str(tmp_path) and listing["unusable"] == []
    by_device = {device["device"]: device for device in listing["devices"]}
    assert sorted(by_device) == sorted([DEVICE, GPU, OTHER_GPU]) and len(listing["devices"]) == 3
    assert {(e["name"], e["local_device"]) for e in by_device[GPU]["instances"]} == {
        ("rank-0", "cuda:1"),
        ("rank-1", "cuda:0"),
    }
    assert by_device[GPU]["mapped_bytes"] == PAGE_BYTES and by_device[OTHER_GPU]["mapped_bytes"] == 0
    human = run(env, "kvctl", "list", "--all").stdout
    headers = [line for line in human.splitlines() if line.startswith(("cpu", "cuda-GPU-"))]
    assert [header.split(":")[0] for header in headers] == [d["device"] for d in listing["devices"]]
    rows = {tuple(line.split()[:4:3]) for line in human.splitlines() if line.startswith(("rank-", "solo"))}
    assert rows == {("rank-0", "cuda:1"), ("rank-1", "cuda:0"), ("solo", "cuda:0")}


def test_kvctl_list_all_reports_files_it_cannot_use_beside_the_devices(env, registry):
    engine = registry.register("engine")
    broken = DeviceRegistry(GPU, BUDGET_BYTES)
    os.truncate(broken.path, 0)
    listing = kvctl_json(env, "list", "--all")
    assert [device["device"] for device in listing["devices"]] == [DEVICE]
    (unusable,) = listing["unusable"]
    assert (unusable["path"], unusable["status"]) == (broken.path, "damaged")
    assert f"{broken.path}: damaged" in run(env, "kvctl", "list", "--all").stdout
    assert engine.registered


def test_kvctl_list_all_without_any_registry_says_so(env, tmp_path):
    assert kvctl_json(env, "list", "--all") == {"directory": str(tmp_path), "devices": [], "unusable": []}
    assert "no registry yet" in run(env, "kvctl", "list", "--all").stdout


def test_kvctl_list_all_with_a_device_is_a_usage_error(env, capsys):
    assert_one_line_failure(run_in_process(capsys, "kvctl", "list", "--all", "--device", GPU), 2, "not both")


def test_kvtop_shows_a_device_named_twice_once(env, registry):
    engine = registry.register("twice")
    frame = run(env, "kvtop", "--once", "--device", "cpu", "--device", "host").stdout
    assert frame.count("twice") == 1 and engine.registered


@pytest.mark.emulation
def test_kvtop_names_a_gpu_by_identity_and_by_the_index_this_process_sees(env, tmp_path):
    """Under CUDA_VISIBLE_DEVICES=1,0, cuda:1 is physical GPU 0: kvtop shows its identity,
    "(cuda:1 here)", and shows it once when it is also named by identity."""
    from emulated_process import emulated_env, run_emulated

    gpus = {"KVCACHED_EMULATED_GPUS": "2", "KVCACHED_REGISTRY_DIR": str(tmp_path)}
    physical = run_emulated(
        "cuda",
        """
        import json
        from kvcached.devices import canonical_device_name
        from kvcached.registry import registry_for
        registry_for("cuda:0").register("kept-by-the-file")  # creates the registry; the entry dies with us
        print(json.dumps([canonical_device_name("cuda:0"), canonical_device_name("cuda:1")]))
    """,
        gpus,
    )
    masked = {**emulated_env("cuda", gpus), "CUDA_VISIBLE_DEVICES": "1,0", "COLUMNS": TERMINAL_COLUMNS}
    frame = run(masked, "kvtop", "--once", "--device", "cuda:1", "--device", physical[0]).stdout
    assert f"{physical[0]} (cuda:1 here)" in frame and frame.count(physical[0]) == 1, frame
