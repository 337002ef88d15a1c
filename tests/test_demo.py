"""The demo: its traffic is reproducible, its data check catches corruption, and the
real ``python -m kvcached demo`` runs both runs, accounts for every request and draws a PNG."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from kvcached.demo.traffic import generate, make_profile, total_requests

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DEMO_TIMEOUT_S = 240
MIN_PNG_BYTES = 10_000
MAX_PNG_BYTES = 5_000_000
# How long the kvctl command the demo prints may take to show its engines (they start in seconds).
KVCTL_WAIT_S = 120


# -- traffic ---------------------------------------------------------------------------


def test_same_seed_gives_the_same_schedule():
    profile = make_profile(budget_blocks=960, num_engines=3, duration_s=15.0)
    assert generate(profile, seed=7) == generate(profile, seed=7)
    assert generate(profile, seed=7) != generate(profile, seed=8)


def test_schedule_is_ordered_bounded_and_unique():
    profile = make_profile(budget_blocks=960, num_engines=3, duration_s=15.0)
    schedules = generate(profile, seed=0)
    ids = [request.request_id for requests in schedules for request in requests]
    assert len(ids) == len(set(ids)) == total_requests(schedules)
    for engine, requests in enumerate(schedules):
        arrivals = [request.arrival_s for request in requests]
        assert arrivals == sorted(arrivals)
        assert all(0 <= t < profile.duration_s for t in arrivals)
        assert all(request.engine == engine for request in requests)
        for request in requests:
            assert profile.prompt_blocks[0] <= request.prompt_blocks <= profile.prompt_blocks[1]
            assert profile.decode_blocks[0] <= request.decode_blocks <= profile.decode_blocks[1]


def test_each_engine_peaks_in_its_own_phases():
    profile = make_profile(budget_blocks=960, num_engines=3, duration_s=15.0)
    for engine, requests in enumerate(generate(profile, seed=0)):
        busy = sum(profile.busy_engine(request.arrival_s) == engine for request in requests)
        # Busy phases are a third of the time but carry most of the engine's requests.
        assert busy > 0.7 * len(requests)


def test_rates_follow_the_budget():
    small = make_profile(budget_blocks=500, num_engines=3, duration_s=10.0)
    large = make_profile(budget_blocks=1000, num_engines=3, duration_s=10.0)
    assert large.busy_rate_hz == pytest.approx(2 * small.busy_rate_hz)
    with pytest.raises(ValueError):
        make_profile(budget_blocks=0, num_engines=3, duration_s=10.0)


# -- the data check ----------------------------------------------------------------------


def test_block_pattern_catches_a_corrupted_block():
    torch = pytest.importorskip("torch")
    from kvcached.demo.engine import BlockPattern
    from kvcached.pool import KVPool

    with KVPool(num_layers=2, block_bytes=64 << 10, num_blocks=64, device="cpu", layout="per_layer") as pool:
        pattern = BlockPattern(pool)
        ids = [int(i) for i in pool.alloc(5)]
        values = np.arange(100, 105, dtype=np.int64)
        pattern.write(ids, values)
        assert pattern.count_mismatches(ids, values) == 0
        # One byte of the last layer's V buffer of one block goes wrong.
        flat = torch.from_dlpack(pool.tensor())
        flat[pool.space.offset_of(1, 1, ids[2]) + 17] ^= 0xFF
        assert pattern.count_mismatches(ids, values) == 1
        pool.free(ids)


def test_block_pattern_on_the_host_needs_no_torch(monkeypatch):
    from kvcached.demo.block_pattern import BlockPattern
    from kvcached.pool import KVPool

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails, as where it is missing
    with KVPool(num_layers=2, block_bytes=64 << 10, num_blocks=64, device="cpu", layout="per_layer") as pool:
        pattern = BlockPattern(pool)
        ids = [int(i) for i in pool.alloc(5)]
        values = np.arange(100, 105, dtype=np.int64)
        pattern.write(ids, values)
        assert pattern.count_mismatches(ids, values) == 0
        flat = np.from_dlpack(pool.tensor())
        flat[pool.space.offset_of(1, 1, ids[2]) + 17] ^= 0xFF  # one byte of one block goes wrong
        assert pattern.count_mismatches(ids, values) == 1
        pool.free(ids)


# -- the whole demo, through its real entry point ----------------------------------------


def _demo_env(base=None) -> dict:
    env = {**(base or os.environ), "COLUMNS": "120"}
    env.pop("KVCACHED_REGISTRY_DIR", None)  # the demo makes its own private registry
    return env


def _run_demo(tmp_path, *args: str, variables=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcached", "demo", *args],
        cwd=tmp_path,
        env={**_demo_env(), **(variables or {})},
        check=False,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
    )


def _kvctl_lists_the_demo_engines(demo: subprocess.Popen, header: list[str]) -> list[str]:
    """Runs the kvctl command the demo printed (``KVCACHED_REGISTRY_DIR=... kvctl list``) with
    ``--json`` while the demo runs, until it shows the engines; returns their names."""
    (line,) = [text for text in header if "kvctl list" in text]
    assignment, command = line.strip().split(": ")[-1].split(" ", 1)
    variable, directory = assignment.split("=", 1)
    assert (variable, command) == ("KVCACHED_REGISTRY_DIR", "kvctl list"), line
    env = {**os.environ, variable: directory}
    deadline = time.monotonic() + KVCTL_WAIT_S
    while demo.poll() is None and time.monotonic() < deadline:
        listing = subprocess.run(
            [sys.executable, "-m", "kvcached.kvctl", "list", "--json"],
            env=env,
            check=False,
            capture_output=True,
            text=True,
            timeout=KVCTL_WAIT_S,
        )
        names = sorted(entry["name"] for entry in json.loads(listing.stdout).get("instances", []))
        if any(name.startswith("demo-engine-") for name in names):
            return names
        time.sleep(0.2)
    return []


@pytest.mark.slow
def test_demo_runs_both_runs_and_accounts_for_everything(tmp_path, env_without_torch):
    """Also: on the host it runs without torch, and the kvctl command it prints lists its engines."""
    summary_path, plot_path = tmp_path / "out.json", tmp_path / "out.png"
    # Phases of 2.5 s, like the default run's: the peaks take turns (seed 1's are marked).
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvcached",
            "demo",
            "--engines",
            "2",
            "--duration",
            "5",
            "--seed",
            "1",
            "--json",
            str(summary_path),
            "--plot",
            str(plot_path),
            "--no-live",
        ],
        cwd=tmp_path,
        env=_demo_env(env_without_torch),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        header = [demo.stdout.readline() for _ in range(2)]
        listed = _kvctl_lists_the_demo_engines(demo, header)
        out, err = demo.communicate(timeout=DEMO_TIMEOUT_S)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 0, "".join(header) + out + err
    assert "Traceback" not in err, err
    assert listed and all(name.startswith("demo-engine-") for name in listed), (header, listed)
    assert "admitted at once" in out and "elastic" in out and "static" in out

    summary = json.loads(summary_path.read_text())
    assert summary["ok"] is True
    assert set(summary["runs"]) == {"elastic", "static"}
    elastic, static = summary["runs"]["elastic"], summary["runs"]["static"]
    assert elastic["limit_bytes_per_instance"] is None
    assert static["limit_bytes_per_instance"] <= summary["config"]["budget_bytes"] // 2
    requests = elastic["totals"]["requests"]
    assert requests > 0 and static["totals"]["requests"] == requests
    for run in (elastic, static):
        totals = run["totals"]
        assert totals["at_once"] + totals["delayed"] + totals["refused"] == totals["requests"]
        assert totals["completed"] == totals["at_once"] + totals["delayed"]
        assert totals["unserved"] == 0
        assert totals["data_check_failures"] == 0 and totals["blocks_checked"] > 0
        assert len(run["engines"]) == 2
        for engine in run["engines"]:
            assert engine["at_once"] + engine["delayed"] + engine["refused"] == engine["requests"]
            assert engine["mapped_bytes_after_close"] == 0 and engine["used_blocks_at_end"] == 0
            assert 0 < engine["peak_mapped_bytes"] <= summary["config"]["budget_bytes"]
        assert run["registry_mapped_after_bytes"] == 0 and run["registry_entries_after"] == 0
        assert run["peak_device_mapped_bytes"] <= summary["config"]["budget_bytes"]
    for engine in static["engines"]:
        assert engine["peak_mapped_bytes"] <= static["limit_bytes_per_instance"]
    assert elastic["totals"]["at_once"] >= static["totals"]["at_once"]

    png = plot_path.read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    assert MIN_PNG_BYTES < len(png) < MAX_PNG_BYTES
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk comes first
    assert 600 <= width <= 4000 and 400 <= height <= 4000


@pytest.mark.parametrize(
    "args, variables, words",
    [
        (("--engines", "0"), {}, "--engines"),
        (("--engines", "100000"), {}, "--engines"),
        (("--budget", "lots"), {}, "not a size"),
        (("--budget", "1M"), {}, "--budget"),
        (("--budget", "1T"), {}, "--budget"),
        (("--device", "bogus"), {}, "--device 'bogus'"),
        (("--device", "cuda:77"), {}, "--device 'cuda:77'"),
        (("--duration", "nan"), {}, "--duration"),
        (("--duration", "inf"), {}, "--duration"),
        (("--wait-timeout", "inf"), {}, "--wait-timeout"),
        (("--seed", "-1"), {}, "--seed"),
        (("--plot", "/nonexistent/x.png"), {}, "--plot '/nonexistent/x.png'"),
        (("--json", "/nonexistent/x.json"), {}, "--json '/nonexistent/x.json'"),
        # /proc takes no new file, though permissions (for root) say it does.
        (("--json", "/proc/summary.json"), {}, "--json '/proc/summary.json' cannot be written"),
        (("--plot", "/proc/x.png"), {}, "--plot '/proc/x.png'"),
        ((), {"KVCACHED_HOST_CAPACITY_BYTES": "1M"}, "KVCACHED_HOST_CAPACITY_BYTES"),
    ],
)
def test_demo_refuses_a_bad_option_in_one_line_before_starting(tmp_path, args, variables, words):
    done = _run_demo(tmp_path, *args, "--no-live", variables=variables)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert words in done.stderr, done.stderr
    assert "starting engines" not in done.stdout, "refused before any engine starts"
    assert list(tmp_path.iterdir()) == [], "nothing written"


@pytest.mark.parametrize(
    "variable, value",
    [
        ("KVCACHED_REGISTRY_GROUP", "no-such-group-kvcached"),
        ("KVCACHED_PAGE_BYTES", "4GB"),
        ("KVCACHED_LAYOUT", "diagonal"),
        ("KVCACHED_ZERO_BACKING", "maybe"),
    ],
)
def test_demo_refuses_a_bad_setting_in_one_line_before_starting(tmp_path, variable, value):
    done = _run_demo(tmp_path, "--no-live", variables={variable: value})
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("kvcached: error: ") and f"{variable}={value!r}" in done.stderr, done.stderr
    assert "starting engines" not in done.stdout, "refused before any engine starts"
    assert list(tmp_path.iterdir()) == [], "nothing written"


def test_an_output_path_nothing_would_read_from_is_refused_at_once(tmp_path):
    from kvcached.demo.command import _output_path
    from kvcached.errors import InvalidArgumentError

    fifo = tmp_path / "summary.json"
    os.mkfifo(fifo)  # no reader: writing the summary there would block at the end of the run
    with pytest.raises(InvalidArgumentError, match=r"^--json '.*summary.json' cannot be written: "):
        _output_path("--json", str(fifo))
    fresh = tmp_path / "fresh.json"
    assert _output_path("--json", str(fresh)) == fresh and not fresh.exists()  # checked, nothing left
