"""What ``kvcached serve`` shows while engines load: a table of each model's state, time and last log line."""

from __future__ import annotations

import dataclasses
import io
import logging
import time

import pytest

pytest.importorskip("rich", reason="the live table needs rich (the serve extra)")
pytest.importorskip("httpx", reason="kvcached serve needs the serve extra: pip install '.[serve]'")

from kvcached.serve.progress import StartupProgress  # noqa: E402
from kvcached.serve.supervisor import EngineState  # noqa: E402


@dataclasses.dataclass
class Spec:
    engine: str


@dataclasses.dataclass
class FakeEngine:
    state: EngineState
    spec: Spec
    log: str
    started_at: float = 0.0
    ready_after_s: float | None = None

    def log_tail(self, lines: int) -> str:
        return self.log

    @property
    def shown_state(self) -> str:
        return self.state.value


def test_the_table_shows_each_model_state_and_last_log_line():
    engines = {
        "qwen": FakeEngine(EngineState.READY, Spec("vllm"), "Application startup complete.\n", ready_after_s=12.5),
        "llama": FakeEngine(EngineState.STARTING, Spec("sglang"), "Loading safetensors 3/4\n\n"),
    }
    out = io.StringIO()
    with StartupProgress(engines, stream=out, live=True) as progress:
        assert logging.getLogger("kvcached.serve").getEffectiveLevel() >= logging.WARNING  # the table says it all
        progress.tick()
    text = out.getvalue()
    for expected in ("qwen", "vllm", "ready", "12.5 s", "Application startup complete.", "llama", "starting"):
        assert expected in text, text
    assert "Loading safetensors 3/4" in text


def test_without_a_terminal_nothing_is_drawn():
    out = io.StringIO()
    with StartupProgress({"a": FakeEngine(EngineState.STARTING, Spec("vllm"), "x")}, stream=out) as progress:
        progress.tick()
    assert out.getvalue() == ""


LONG_NAME = "org-with-a-long-name/" + "m" * 42  # 63 bytes: the longest name the registry takes
LONG_LOG = "INFO 12-01 10:00:00 Loading safetensors checkpoint shards: 3/4 completed, and more\n"


def drawn(monkeypatch, columns: int) -> list[str]:
    monkeypatch.setenv("COLUMNS", str(columns))
    engines = {
        LONG_NAME: FakeEngine(EngineState.RESTARTING, Spec("sglang"), LONG_LOG, started_at=time.monotonic() - 42),
        "short": FakeEngine(EngineState.READY, Spec("vllm"), "Application startup complete.\n", ready_after_s=3.0),
    }
    out = io.StringIO()
    with StartupProgress(engines, stream=out, live=True) as progress:
        progress.tick()
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= columns
    return lines


def test_at_120_columns_every_name_and_state_is_whole(monkeypatch):
    lines = drawn(monkeypatch, 120)
    row = next(line for line in lines if LONG_NAME in line)  # the whole name, on one line
    assert "sglang" in row and "restarting" in row and " 42.0 s " in row and ", and more │" in row, row


def test_on_a_narrow_terminal_a_long_name_folds_and_loses_nothing(monkeypatch):
    lines = drawn(monkeypatch, 80)
    cells = "".join(line.split("│")[1].strip() for line in lines if line.startswith("│"))
    assert LONG_NAME in cells and any("restarting" in line for line in lines)


def test_without_a_terminal_each_engine_still_loading_is_logged_every_interval(caplog):
    caplog.set_level(logging.INFO, logger="kvcached.serve")
    engines = {
        "qwen": FakeEngine(EngineState.READY, Spec("vllm"), "Application startup complete.\n", ready_after_s=12.5),
        "llama": FakeEngine(EngineState.STARTING, Spec("sglang"), "Loading safetensors 3/4\n\n"),
    }
    with StartupProgress(engines, stream=io.StringIO(), log_interval_s=3600) as progress:
        progress.tick()
    assert not caplog.records  # nothing before the first interval has passed
    with StartupProgress(engines, stream=io.StringIO(), log_interval_s=0) as progress:
        progress.tick()
        engines["llama"].log = "\n=== kvcached serve: python -m sglang.launch_server ... ===\n"  # launched again
        progress.tick()
    said = [record.getMessage() for record in caplog.records]
    assert (
        len(said) == 2
        and said[0].startswith("llama: starting for ")
        and said[0].endswith(" s; its log: Loading safetensors 3/4")
    ), said
    assert said[1].startswith("llama: starting for ") and said[1].endswith(" s"), said  # serve's own line is not its
