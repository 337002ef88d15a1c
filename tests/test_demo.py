"""The demo: its traffic is reproducible, its data check catches corruption, and the
real ``python -m kvcached demo`` runs both runs, accounts for every request and draws a PNG."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from kvcached.demo.traffic import generate, make_profile, total_requests

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DEMO_TIMEOUT_S = 240
MIN_PNG_BYTES = 10_000
MAX_PNG_BYTES = 5_000_000


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


# -- the whole demo, through its real entry point ----------------------------------------


def _run_demo(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "120"}
    env.pop("KVCACHED_REGISTRY_DIR", None)  # the demo makes its own private registry
    return subprocess.run(
        [sys.executable, "-m", "kvcached", "demo", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S,
    )


@pytest.mark.slow
def test_demo_runs_both_runs_and_accounts_for_everything(tmp_path):
    summary_path, plot_path = tmp_path / "out.json", tmp_path / "out.png"
    # Phases of 2.5 s, like the default run's: the peaks take turns (seed 1's are marked).
    done = _run_demo(tmp_path, "--engines", "2", "--duration", "5", "--seed", "1",
                     "--json", str(summary_path), "--plot", str(plot_path), "--no-live")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "admitted at once" in done.stdout and "elastic" in done.stdout and "static" in done.stdout

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


def test_demo_rejects_bad_options(tmp_path):
    done = _run_demo(tmp_path, "--engines", "0", "--no-live", "--plot", "")
    assert done.returncode == 2
    assert "--engines" in done.stderr
    done = _run_demo(tmp_path, "--budget", "lots", "--no-live", "--plot", "")
    assert done.returncode == 2
    assert "not a size" in done.stderr
