"""What ``kvcached serve`` shows while its engines load: one line per model, live on a terminal.

On a terminal (and with rich installed) a live table: each model's state, time so far and the
last line of its log. Elsewhere (a log file, a container) one plain line per state change.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any, Optional, TextIO

from kvcached.registry import printable

LOG_LINE_WIDTH = 80


def _last_log_line(engine: Any) -> str:
    for line in reversed(engine.log_tail(5).splitlines()):
        line = printable(line.strip())
        if line:
            return line[-LOG_LINE_WIDTH:]
    return ""


class StartupProgress:
    """Shows the engines' states until they are all ready; use as a context manager, ``tick()`` often."""

    def __init__(self, engines: Mapping[str, Any], stream: TextIO = sys.stderr, live: Optional[bool] = None) -> None:
        self._engines = engines
        self._stream = stream
        self._started = time.monotonic()
        self._shown: dict[str, str] = {}
        self._live: Any = None
        wants_live = stream.isatty() if live is None else live
        if wants_live:
            try:
                from rich.console import Console
                from rich.live import Live
            except ImportError:
                return
            self._live = Live(self._table(), console=Console(file=stream), auto_refresh=False, transient=False)

    def __enter__(self) -> StartupProgress:
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._table(), refresh=True)
            self._live.__exit__(*exc)

    def tick(self) -> None:
        """Refreshes the table, or prints the states that changed."""
        if self._live is not None:
            self._live.update(self._table(), refresh=True)
            return
        for name, engine in self._engines.items():
            state = str(engine.state.value)
            if self._shown.get(name) != state:
                self._shown[name] = state
                self._stream.write(f"kvcached serve: {name}: {self._describe(engine)}\n")
                self._stream.flush()

    @staticmethod
    def _describe(engine: Any) -> str:
        state = str(engine.state.value)
        if state == "ready" and engine.ready_after_s is not None:
            return f"ready after {engine.ready_after_s:.1f} s (pid {engine.pid}, port {engine.port})"
        if state == "failed":
            return f"failed: {engine.failure}"
        return f"{state} ({engine.spec.engine}, pid {engine.pid}, log {engine.log_path})"

    def _table(self) -> Any:
        from rich.table import Table
        from rich.text import Text

        table = Table(title="kvcached serve: starting engines", title_justify="left", expand=False)
        for column in ("MODEL", "ENGINE", "STATE", "TIME", "LOG"):
            table.add_column(column, no_wrap=True)
        styles = {"ready": "green", "failed": "bold red", "restarting": "yellow"}
        for name, engine in self._engines.items():
            state = str(engine.state.value)
            elapsed = engine.ready_after_s if engine.ready_after_s is not None else time.monotonic() - engine.started_at
            table.add_row(
                printable(name),
                engine.spec.engine,
                Text(state, style=styles.get(state, "cyan")),
                f"{elapsed:5.1f} s",
                Text(_last_log_line(engine), style="dim", overflow="ellipsis"),
            )
        return table


__all__ = ["StartupProgress"]
