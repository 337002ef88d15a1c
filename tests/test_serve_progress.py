"""What ``kvcached serve`` shows while engines load: a table of each model's state, time and last log line."""

from __future__ import annotations

import dataclasses
import io
import logging

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
