"""Shared pieces of the benchmarks: the devices they run on, timing helpers, and
the collector for results pytest-benchmark cannot hold (latency traces).

Set ``KVCACHED_BENCH_RESULTS=/path/results.json`` to keep the custom results;
they are also printed at the end of the run.
"""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Any, Callable, Optional

import pytest
from reference_figures import figure

import kvcached

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
PAGE_BYTES = 2 * MiB  # the H200's (and host's) recommended granularity

RESULTS_ENV = "KVCACHED_BENCH_RESULTS"


def available_device_specs() -> list[str]:
    """'cpu' always, plus the first device of each GPU backend usable here."""
    return kvcached.devices.usable_devices()


def is_gpu(spec: str) -> bool:
    return spec != "cpu"


@pytest.fixture(params=available_device_specs())
def device_spec(request) -> str:
    return request.param


@pytest.fixture
def device(device_spec) -> kvcached._core.Device:
    return kvcached.open_device(device_spec)


def describe(benchmark, metric: str, *, ops_per_call: int = 1, group: Optional[str] = None, **info: Any) -> None:
    """Label a benchmark for bench/micro/report.py: which figure it is compared with,
    and how many operations one timed call performs (the report divides by it)."""
    fig = figure(metric)
    benchmark.extra_info.update(metric=metric, ops_per_call=ops_per_call, **info)
    if fig.target_us is not None:
        benchmark.extra_info["target_us"] = fig.target_us
    if fig.reference_us is not None:
        benchmark.extra_info["reference_us"] = fig.reference_us
    if group:
        benchmark.group = group


def time_each(
    benchmark,
    operation: Callable[..., Any],
    *,
    rounds: int,
    prepare: Optional[Callable[[], tuple]] = None,
    undo: Optional[Callable[..., None]] = None,
    warmup_rounds: int = 2,
) -> None:
    """Time ``operation(*prepare())`` once per round.

    ``prepare`` (untimed) builds the arguments; ``undo(result, *args)`` (untimed)
    reverses what the operation did. undo runs at the start of the next round's
    set-up and once after the last round, so it never counts in the timing and
    needs no teardown support from pytest-benchmark.
    """
    pending: list[tuple] = []

    def settle() -> None:
        while pending:
            result, args = pending.pop()
            if undo is not None:
                undo(result, *args)

    def setup():
        settle()
        return (prepare() if prepare else ()), {}

    def target(*args):
        pending.append((operation(*args), args))

    try:
        benchmark.pedantic(target, setup=setup, rounds=rounds, warmup_rounds=warmup_rounds, iterations=1)
    finally:
        settle()


# ---- custom results ------------------------------------------------------------------------

_custom_results: list[dict] = []


@pytest.fixture
def record_result(request):
    """Keep one custom result (a dict) for the JSON file and the end-of-run summary."""

    def record(name: str, device_spec: str, values: dict) -> None:
        _custom_results.append({"name": name, "test": request.node.nodeid, "device": device_spec, **values})
        _write_custom_results()  # at once, so a run cut short by a time limit keeps what it measured

    return record


def _write_custom_results() -> None:
    path = os.environ.get(RESULTS_ENV)
    if not path or not _custom_results:
        return
    payload = {
        "machine": platform.node(),
        "datetime_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kvcached_version": kvcached.__version__,
        "results": _custom_results,
    }
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(path + ".tmp", path)


def pytest_terminal_summary(terminalreporter):
    if not _custom_results:
        return
    tr = terminalreporter
    tr.section("kvcached custom results")
    for r in _custom_results:
        values = {k: v for k, v in r.items() if k not in ("name", "test", "device")}
        shown = ", ".join(f"{k}={_short(v)}" for k, v in values.items() if not isinstance(v, (list, dict)))
        tr.write_line(f"{r['name']} [{r['device']}]: {shown}")


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
