"""bench/e2e/serve_handover.py without engines: its arguments, the config it writes, its report."""

from __future__ import annotations

import pytest

pytest.importorskip("yaml", reason="the serve config is YAML")

from serve_handover import (  # noqa: E402
    BUDGET,
    EXAMPLE,
    MiB,
    config_models,
    format_round,
    format_summary,
    parse_args,
    spread,
    summarize,
)

from kvcached.serve.config import parse_config  # noqa: E402
from kvcached.testing.serve_session import serve_config  # noqa: E402


def _round(k: int, handover_ms, to_need_ms) -> dict:
    return dict(
        round=k,
        b_held_bytes=44 * MiB,
        b_low_bytes=8 * MiB,
        a_peak_bytes=44 * MiB,
        a_peak_used_bytes=40 * MiB,
        handovers=0 if handover_ms is None else 1,
        handover_ms=handover_ms,
        to_need_ms=to_need_ms,
        burst_ms=900.0,
    )


def test_arguments_default_and_refuse_what_cannot_run(capsys):
    args = parse_args([])
    assert (args.rounds, args.mode, args.json) == (5, "idle", None)
    args = parse_args(["--rounds", "3", "--mode", "busy", "--json", "/tmp/x.json"])
    assert (args.rounds, args.mode, args.json) == (3, "busy", "/tmp/x.json")
    for bad in (["--rounds", "0"], ["--rounds", "two"], ["--mode", "eager"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert "--rounds" in capsys.readouterr().err


def test_spread_is_median_p90_and_max():
    assert spread([]) == {"median": None, "p90": None, "max": None}
    assert spread([7.0]) == {"median": 7.0, "p90": 7.0, "max": 7.0}
    s = spread([float(v) for v in range(1, 11)])
    assert s["median"] == 5.5 and s["max"] == 10.0 and 9.0 <= s["p90"] <= 10.0


def test_rounds_without_a_figure_are_counted_not_averaged():
    rounds = [_round(0, 100.0, 300.0), _round(1, None, 500.0), _round(2, 300.0, None)]
    summary = summarize(rounds)
    assert summary["handover_ms"]["median"] == 200.0 and summary["handover_ms"]["max"] == 300.0
    assert summary["to_need_ms"]["median"] == 400.0
    assert (summary["rounds_without_handover"], summary["rounds_short_of_need"]) == (1, 1)
    result = {
        "mode": "idle",
        "need_bytes": 40 * MiB,
        "need_mapped_bytes": 44 * MiB,
        "rounds": rounds,
        "summary": summary,
    }
    report = format_summary(result)
    assert "serve hand-over (idle, 3 rounds; A needs 40 MiB in use for its burst, 44 MiB mapped alone)" in report
    assert "median 200 ms  p90 " in report and "max 300 ms" in report
    assert "rounds with no hand-over: 1; rounds where A never held its need: 1" in report
    assert "A peaked at 44 MiB (40 MiB in use); 0 hand-over(s), mean - ms; to need 500 ms" in format_round(rounds[1])


def test_the_config_is_two_vllm_models_serve_accepts(tmp_path):
    for mode in ("idle", "busy"):
        config = serve_config(EXAMPLE, tmp_path, None, 8123, BUDGET, config_models(mode))
        assert [(m["name"], m["engine"]) for m in config["models"]] == [("tiny-a", "vllm"), ("tiny-b", "vllm")]
        spec = parse_config(config, tmp_path)
        a, b = spec.models
        assert (a.memory.priority, b.memory.priority) == (1, 0)
        assert b.memory.min_bytes == (24 * MiB if mode == "busy" else 0)
        # A's burst (44 MiB) fits beside what B holds only if B gives back.
        assert spec.budget_bytes - 44 * MiB < 44 * MiB <= spec.budget_bytes - b.memory.min_bytes
