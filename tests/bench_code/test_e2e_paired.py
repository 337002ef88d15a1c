"""The paired end-to-end benchmarks' figures (bench/e2e/e2e_paired.py): ratios, interval, pooled throughput."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import e2e_paired  # bench/e2e, on the path through pyproject's pytest settings
from e2e_paired import median_interval, run_paired, summary


def _run(k: int, on: bool, tokens_per_s: float, wall_s: float = 2.0) -> dict:
    return dict(
        round=k,
        kvcached=on,
        tokens_per_s=tokens_per_s,
        output_tokens=tokens_per_s * wall_s,
        wall_s=wall_s,
        tpot_p99_ms=10.0 * (1.1 if on else 1.0),
        ttft_p50_ms=100.0,
        ttft_p99_ms=200.0,
    )


def test_interval_holds_the_median_and_narrows_with_more_passes():
    few = [0.90, 0.95, 1.00, 0.93, 0.97]
    many = few * 8
    low, high = median_interval(few)
    assert low <= statistics.median(few) <= high
    low_many, high_many = median_interval(many)
    assert high_many - low_many <= high - low
    assert median_interval([0.9] * 6) == (0.9, 0.9)


def test_summary_pairs_passes_and_pools_throughput():
    runs = [
        _run(0, False, 100.0),
        _run(0, True, 90.0),
        _run(1, True, 50.0),
        _run(1, False, 50.0),
        _run(2, False, 80.0),
    ]  # pass 2 has no partner: left out
    text = summary(runs)
    assert text.startswith("2 passes")
    assert "output tokens/s: median **0.950**" in text  # ratios 0.9 and 1.0
    assert "TPOT p99: median **1.100**" in text
    # pooled: (180 + 100) / 4 s on, (200 + 100) / 4 s off
    assert "on ÷ off **0.933**" in text


def test_summary_without_a_complete_pass():
    assert summary([_run(0, False, 100.0)]) == "no complete pass\n"


def test_summary_adds_the_engines_cpu_seconds_when_every_pass_has_them():
    runs = [
        dict(_run(0, False, 100.0), cpu_s=4.0),
        dict(_run(0, True, 90.0), cpu_s=4.4),
        dict(_run(1, True, 50.0), cpu_s=3.0),
        dict(_run(1, False, 50.0), cpu_s=3.0),
    ]
    assert "CPU seconds of the engine's processes per pass (the same work on both): median **1.050**" in summary(runs)
    del runs[3]["cpu_s"]
    assert "CPU seconds" not in summary(runs)


def test_summary_adds_each_engines_page_faults_when_every_pass_has_them():
    def faults(*counts: int) -> dict:
        return {"processes": {f"p[{i}]": {"cpu_s": 1.0, "minor_faults": c} for i, c in enumerate(counts)}}

    runs = [
        dict(_run(0, False, 100.0), **faults(10, 0)),
        dict(_run(0, True, 90.0), **faults(250_000, 5)),
        dict(_run(1, True, 50.0), **faults(3_000, 0)),
        dict(_run(1, False, 50.0), **faults(30, 0)),
    ]
    assert "minor page faults of the engine's processes per pass (median): off 20, on 126502" in summary(runs)
    del runs[3]["processes"]["p[1]"]["minor_faults"]  # a process recorded without them
    assert "page faults" not in summary(runs)


def test_the_session_window_counts_the_page_faults_of_what_each_process_touched():
    from e2e_common import session_processes, timed_window

    before = session_processes()
    touched = bytearray(64 << 20)  # fresh pages, each faulted in by its first write
    touched[::4096] = b"\1" * len(touched[::4096])
    window = timed_window(before, session_processes())
    assert sum(figures["minor_faults"] for figures in window.values()) >= (64 << 20) // 4096 // 2


def test_the_session_cpu_window_counts_what_each_process_did():
    from e2e_common import cpu_seconds, session_processes, timed_window

    before = session_processes()
    deadline = time.process_time() + 0.1
    while time.process_time() < deadline:  # this process's CPU, counted in clock ticks
        pass
    window = timed_window(before, session_processes())
    assert cpu_seconds(window) >= 0.05
    assert any(figures["cpu_s"] >= 0.05 for figures in window.values())


def test_summary_adds_the_per_step_differences_when_the_steps_were_timed():
    def timed(k: int, on: bool, step_ms: float, worker_ms: float, apply_ms: float | None) -> dict:
        return dict(
            _run(k, on, 100.0),
            engine_step_ms_per_step=step_ms,
            worker_ms_per_step=worker_ms,
            apply_ms_per_step=apply_ms,
            worker_faults_per_step=100.0 + 50.0 * on,
            worker_cpu_ms_per_step=worker_ms - 0.5,
            worker_sys_ms_per_step=1.0 + 0.25 * on,
            scheduler_cpu_us_per_step=700.0 + 100.0 * on,
        )

    runs = [
        timed(0, False, 10.0, 9.0, None),
        timed(0, True, 11.0, 9.5, 0.25),
        timed(1, True, 12.0, 10.5, 0.75),
        timed(1, False, 10.0, 9.0, None),
    ]
    text = summary(runs)
    assert (
        "EngineCore step +1.500 ms (off 10.00 ms), worker +1.000 ms, of which kvcached's page-op apply 0.500 ms; "
        "worker thread CPU +1.000 ms (in the kernel +0.250 ms); worker page faults +50; scheduler CPU +100 µs"
    ) in text
    for run in runs:  # an engine whose worker's CPU was not timed
        del run["worker_cpu_ms_per_step"], run["worker_sys_ms_per_step"]
    assert "apply 0.500 ms; worker page faults +50" in summary(runs)
    assert "EngineCore step" not in summary([_run(0, False, 100.0), _run(0, True, 90.0)])


def test_the_report_warns_when_the_installed_kvcached_is_not_this_checkouts(tmp_path, monkeypatch):
    import shutil

    import e2e_common

    import kvcached

    checkout = tmp_path / "kvcached"
    shutil.copytree(
        Path(kvcached.__file__).resolve().parent,
        checkout,
        ignore=shutil.ignore_patterns("*.so", "*.pyi", "__pycache__"),
    )
    monkeypatch.setattr(e2e_common, "CHECKOUT_PACKAGE", checkout)
    line = e2e_common.installed_kvcached()
    assert "KVCACHED_HOST_MEMORY in effect: " in line and "reinstall" not in line
    (checkout / "config.py").write_text((checkout / "config.py").read_text() + "\n# changed\n")
    line = e2e_common.installed_kvcached()
    assert "differ from this checkout's (config.py)" in line and "reinstall" in line


def test_the_setting_options_say_what_each_engine_gets():
    import argparse

    from e2e_paired import add_setting_options, engine_settings, settings_note

    parser = argparse.ArgumentParser()
    add_setting_options(parser)
    args = parser.parse_args(["--on-env", "KVCACHED_HOST_MEMORY=anonymous", "--off-env", "KVCACHED_ENABLE=1"])
    assert engine_settings(args, True) == (True, {"KVCACHED_HOST_MEMORY": "anonymous"})
    assert engine_settings(args, False) == (False, {"KVCACHED_ENABLE": "1"})  # kvcached on there too, by the variable
    assert settings_note(args) == (
        "the engine with kvcached also has KVCACHED_HOST_MEMORY=anonymous; the engine without it has KVCACHED_ENABLE=1"
    )
    control = parser.parse_args(["--control"])
    assert engine_settings(control, True) == (False, {})
    assert settings_note(control) == "the engine with kvcached also has no kvcached (--control: an A/A run)"
    assert settings_note(parser.parse_args([])) == ""


def test_an_interval_over_engine_pairs_resamples_the_pairs_first():
    ratios = [0.90] * 10 + [1.00] * 30  # four engine pairs, each steady, one of them 10 % off the others
    assert median_interval(ratios) == (1.00, 1.00)  # passes alone: the odd pair looks like noise
    low, high = median_interval(ratios, groups=[0] * 10 + [1] * 10 + [2] * 10 + [3] * 10)
    assert (low, high) == (0.90, 1.00)  # a draw of four pairs is three of the odd one 5 % of the time


def test_the_summary_names_each_engine_pairs_ratio():
    runs = [
        dict(_run(k, on, 100.0 if not on else (90.0 if k < 2 else 100.0)), engine_pair=k // 2)
        for k in range(4)
        for on in (False, True)
    ]
    text = summary(runs)
    assert "over 2 engine pairs" in text
    assert "- output tokens/s by engine pair (median, passes): 0: 0.900 (2), 1: 1.000 (2)" in text
    assert "engine pair" not in summary([_run(0, False, 100.0), _run(0, True, 90.0)])


class _FakeEngine:
    """What run_paired uses of an EngineProcess, recording what it was asked."""

    def __init__(self, out: Path, on: bool, calls: list) -> None:
        self.label, self.calls = ("on" if on else "off"), calls
        self.log_path = out / f"engine-{self.label}.log"
        self.log_path.write_text("log\n")
        calls.append(f"start {self.label}")

    def next_result(self, timeout_s: float) -> dict:
        return {"ready": True}

    def run(self, k: int, timeout_s: float) -> dict:
        self.calls.append(f"p{k}-{self.label}")
        return dict(
            tokens_per_s=100.0,
            output_tokens=200,
            wall_s=2.0,
            tpot_p99_ms=10.0,
            tpot_p50_ms=9.0,
            ttft_p50_ms=100.0,
            ttft_p99_ms=200.0,
            load_before=[0.0],
            load_after=[0.0],
        )

    def stop(self) -> None:
        self.calls.append(f"stop {self.label}")


def test_restarts_share_the_passes_and_alternate_which_engine_starts_first(tmp_path, monkeypatch):
    import e2e_paired

    monkeypatch.setattr(e2e_paired, "installed_kvcached", lambda: "kvcached (test)")
    calls: list[str] = []
    runs = run_paired(
        tmp_path, "t", lambda on: _FakeEngine(tmp_path, on, calls), passes=5, gap_s=0.0, timeout_s=1.0, restarts=2
    )
    assert calls == [
        "start off",
        "start on",
        "p0-off",
        "p0-on",
        "p1-on",
        "p1-off",
        "stop off",
        "stop on",
        "start on",
        "start off",
        "p2-off",
        "p2-on",
        "p3-on",
        "p3-off",
        "p4-off",
        "p4-on",
        "stop on",
        "stop off",
    ]
    assert [run["engine_pair"] for run in runs] == [0] * 4 + [1] * 6
    assert sorted(path.name for path in tmp_path.glob("engine-*")) == [
        "engine-off.pair0.log",
        "engine-off.pair1.log",
        "engine-on.pair0.log",
        "engine-on.pair1.log",
    ]
    assert "2 engine pairs, started one after the other" in (tmp_path / "t.md").read_text()


def test_what_a_profiler_saw_leaves_out_the_first_pass_only(tmp_path):
    import json

    from e2e_paired import counted_after_first_pass

    runs = [
        dict(label="p0-off", kvcached=False, steps=5),
        dict(label="p0-on", kvcached=True, steps=7),
        dict(label="p1-on", kvcached=True, steps=11),
        dict(label="p1-off", kvcached=False, steps=13),
    ]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    assert counted_after_first_pass(tmp_path / "runs.json") == {"on": 2, "off": 1}
    assert counted_after_first_pass(tmp_path / "runs.json", "steps") == {"on": 18, "off": 13}


def test_the_busy_clock_stops_while_the_engine_waits_for_its_turn():
    from e2e_common import BusyClock

    clock = BusyClock()
    start, wall = clock(), time.perf_counter()
    time.sleep(0.02)
    clock.wait(lambda: time.sleep(0.1))
    busy, elapsed = clock() - start, time.perf_counter() - wall
    assert 0.02 <= busy < 0.08 and elapsed >= 0.12


_LOCKSTEP_CHILD = """
import json, sys, threading, time
import e2e_paired
from e2e_common import BusyClock

e2e_paired.TURN_S = 0.0  # a turn per step

def serve(spec_path, result_fd):
    ticks = []  # a background thread's clock readings: it must not run outside this engine's turns
    def tick():
        while True:
            ticks.append(time.perf_counter())
            time.sleep(0.001)
    threading.Thread(target=tick, daemon=True).start()

    def run_pass(k, take_turn=None):
        clock, steps = BusyClock(), []
        start = clock()
        for _ in range(4):
            clock.wait(take_turn)
            began = time.perf_counter()
            time.sleep(0.03)
            steps.append((began, time.perf_counter()))
        return dict(busy_s=clock() - start, steps=steps, ticks=list(ticks))

    e2e_paired.serve_passes(result_fd, run_pass)

e2e_paired.serve_if_child(serve)
"""


def test_lockstep_engines_take_turns_and_nothing_of_the_other_runs_meanwhile(tmp_path):
    import os

    from e2e_paired import EngineProcess, run_lockstep_pass

    script = tmp_path / "child.py"
    script.write_text(_LOCKSTEP_CHILD)
    # The child imports the harness from its folder, as the benchmarks' own children do.
    harness_dir = str(Path(e2e_paired.__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [harness_dir, os.environ.get("PYTHONPATH")])))
    engines = [EngineProcess(str(script), tmp_path, {}, env, on) for on in (False, True)]
    try:
        for engine in engines:
            assert engine.next_result(30.0) == {"ready": True}
        results = run_lockstep_pass(engines, 0, 30.0)
    finally:
        for engine in engines:
            engine.stop()
    first, second = (results[engine] for engine in engines)
    # Strictly alternating steps, the first engine first.
    steps = sorted(
        [(begin, end, 0) for begin, end in first["steps"]] + [(begin, end, 1) for begin, end in second["steps"]]
    )
    assert [who for _, _, who in steps] == [0, 1] * 4
    assert all(end <= next_begin for (_, end, _), (next_begin, _, _) in zip(steps, steps[1:]))
    # Each engine's clock counted its own four steps, not the other's.
    for result in (first, second):
        assert 0.11 <= result["busy_s"] < 0.2
    # A thread of the waiting engine did not run during the other's steps (its process was stopped).
    for mine, other in ((first, second), (second, first)):
        for begin, end in other["steps"]:
            assert not [t for t in mine["ticks"] if begin + 0.005 < t < end - 0.005]
