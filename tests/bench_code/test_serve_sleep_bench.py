"""bench/e2e/serve_sleep.py without engines: its arguments, sizes and config, its statistics, table and picture."""

from __future__ import annotations

import time
import types

import pytest

pytest.importorskip("yaml", reason="the serve config is YAML")

from serve_sleep import awake_sizes, model_names, parse_args, serve_sleep_config  # noqa: E402
from serve_sleep_cold import first_token  # noqa: E402
from serve_sleep_report import MiB, format_table, plot_series, ratio, spread, summarize, write_plot  # noqa: E402

from kvcached.serve.config import parse_config  # noqa: E402


def _round(k: int, asleep_ms, cold_ms, awake_ms, same_text=True) -> dict:
    times = dict(asleep_ms=asleep_ms, cold_ms=cold_ms, awake_ms=awake_ms, wake_ms=40.0)
    return dict(round=k, model=f"tiny-{k % 3}", same_text=same_text, **times)


def test_arguments_default_and_refuse_what_cannot_run(capsys):
    args = parse_args([])
    assert (args.models, args.rounds, args.levels, args.plot, args.json) == (3, 3, (1, 2), None, None)
    args = parse_args(["--models", "4", "--levels", "2", "--plot", "/tmp/p.png", "--plot-requests", "2"])
    assert (args.models, args.levels, args.plot, args.plot_requests) == (4, (2,), "/tmp/p.png", 2)
    assert parse_args(["--levels", "2,1"]).levels == (2, 1)
    for bad in (["--models", "2"], ["--rounds", "0"], ["--levels", "3"], ["--levels", "1,1"], ["--levels", ""]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert "--levels" in capsys.readouterr().err


@pytest.mark.parametrize("weights_bytes", [1, 4 * MiB, 6_298_792, 100 * MiB, 3 * 1024 * MiB])
def test_the_budget_holds_two_models_awake_and_not_three(weights_bytes):
    min_bytes, budget = awake_sizes(weights_bytes)
    awake = weights_bytes + min_bytes
    assert min_bytes >= 8 * MiB and min_bytes % (2 * MiB) == 0 and budget % (2 * MiB) == 0
    assert 2 * awake <= budget < 3 * awake
    # What the spare room leaves is less than a model: a third wake must put one to sleep.
    assert budget - 2 * awake < awake


def test_sizes_refuse_weights_that_were_not_measured():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="weights_bytes must be positive"):
            awake_sizes(bad)


def test_the_config_is_models_that_may_sleep_and_serve_accepts(tmp_path):
    names = model_names(3)
    dirs = {name: str(tmp_path / name) for name in names}
    for name in names:
        (tmp_path / name).mkdir()
    min_bytes, budget = awake_sizes(4 * MiB)
    for level in (1, 2):
        spec = parse_config(serve_sleep_config(dirs, level, min_bytes, budget, 8123), tmp_path)
        assert [m.name for m in spec.models] == ["tiny-0", "tiny-1", "tiny-2"]
        assert [m.model for m in spec.models] == [dirs[name] for name in names]  # each its own checkpoint
        assert all(m.sleep.level == level and m.sleep.idle_s is None for m in spec.models)
        assert all(m.memory.min_bytes == min_bytes and "--enforce-eager" in m.args for m in spec.models)
        assert spec.budget_bytes == budget and spec.can_sleep


def test_spread_and_ratio():
    assert spread([]) == {"median": None, "min": None, "max": None}
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert ratio(10.0, 4.0) == 2.5
    assert ratio(None, 4.0) is None and ratio(10.0, None) is None and ratio(10.0, 0.0) is None


def test_the_summary_takes_medians_and_their_ratios_and_counts_other_answers():
    rounds = [_round(0, 100.0, 20000.0, 40.0), _round(1, 300.0, 30000.0, 60.0, False), _round(2, 200.0, None, 50.0)]
    summary = summarize(rounds)
    assert summary["asleep_ms"] == {"median": 200.0, "min": 100.0, "max": 300.0}
    assert summary["cold_ms"]["median"] == 25000.0  # the round without a cold start is left out, not zero
    assert summary["awake_ms"]["median"] == 50.0
    assert summary["cold_over_asleep"] == 125.0 and summary["asleep_over_awake"] == 4.0
    assert (summary["rounds"], summary["rounds_with_other_text"]) == (3, 1)


def test_the_table_shows_every_round_and_each_levels_medians():
    levels = {}
    for level in (2, 1):
        rounds = [_round(0, 100.0 * level, 20000.0, 40.0), _round(1, 300.0, 30000.0, 60.0, False)]
        levels[level] = {"rounds": rounds, "summary": summarize(rounds)}
    table = format_table(levels)
    rows = table.splitlines()
    assert rows[0].split()[:4] == ["level", "round", "model", "asleep"]
    assert rows.index(next(r for r in rows if r.split()[:2] == ["1", "0"])) < rows.index(
        next(r for r in rows if r.split()[:2] == ["2", "0"])
    )  # levels in order
    assert any(r.split()[:2] == ["1", "1"] and r.rstrip().endswith("NO") for r in rows)
    assert "200.0x" in table  # round 0 of level 1: 20000 / 100
    assert "level 1: time to first token of a sleeping model 200 ms (median of 2; 100-300)" in table
    assert "a cold engine start 25000 ms (125.0x as long)" in table
    assert "1 round(s) answered other text than the cold engine" in table


def _samples():
    # Three models, one asleep at a time, the budget changing once: (seconds, budget, {model: (weights, kv)}).
    return [
        (100.0, 30 * MiB, {"tiny-0": (4 * MiB, 8 * MiB), "tiny-1": (4 * MiB, 2 * MiB)}),
        (100.5, 30 * MiB, {"tiny-0": (4 * MiB, 8 * MiB), "tiny-1": (0, 0), "tiny-2": (4 * MiB, 4 * MiB)}),
        (101.0, 32 * MiB, {"tiny-0": (0, 0), "tiny-1": (4 * MiB, 6 * MiB), "tiny-2": (4 * MiB, 4 * MiB)}),
    ]


def test_plot_series_are_mib_from_the_first_sample_and_zero_for_a_model_not_seen():
    series = plot_series(_samples(), ["tiny-0", "tiny-1", "tiny-2"])
    assert series["t"] == [0.0, 0.5, 1.0] and series["budget"] == [30.0, 30.0, 32.0]
    assert series["tiny-0"] == {"weights": [4.0, 4.0, 0.0], "kv": [8.0, 8.0, 0.0]}
    assert series["tiny-2"] == {"weights": [0.0, 4.0, 4.0], "kv": [0.0, 4.0, 4.0]}
    with pytest.raises(ValueError, match="no samples"):
        plot_series([], ["tiny-0"])


def test_the_picture_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sleep.png"
    requests = [("tiny-0", 100.1, 100.4), ("tiny-2", 100.5, 100.9), ("tiny-1", 100.9, 101.0)]
    write_plot(str(path), _samples(), ["tiny-0", "tiny-1", "tiny-2"], requests, title="fake")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1200, 576)  # 10 x 4.8 inches at 120 dpi


class _FakeCompletions:
    def __init__(self, chunks):
        self.chunks, self.asked = chunks, []

    def create(self, **request):
        self.asked.append(request)
        return iter(self.chunks)


def _chunk(text):
    return types.SimpleNamespace(choices=[types.SimpleNamespace(text=text)] if text is not None else [])


def test_first_token_is_the_first_chunk_with_a_choice_and_the_text_is_all_of_them():
    completions = _FakeCompletions([_chunk(None), _chunk(""), _chunk("ab"), _chunk("c")])
    client = types.SimpleNamespace(completions=completions)
    sent = time.monotonic()
    seconds, text = first_token(client, "tiny-1", sent=sent)
    assert text == "abc" and 0.0 <= seconds < 1.0
    (request,) = completions.asked
    assert request["model"] == "tiny-1" and request["stream"] is True and request["temperature"] == 0
    empty = types.SimpleNamespace(completions=_FakeCompletions([_chunk(None)]))
    with pytest.raises(RuntimeError, match="tiny-1: the stream ended without a token"):
        first_token(empty, "tiny-1", sent=0.0)
