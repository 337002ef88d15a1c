"""What ``kvcached serve`` shows on a terminal while its engines load: a live table, one row per model.

Each row: the model's state, the time so far and the last line of its engine's log. Serve's own
log lines (started, ready, failed) are held back meanwhile, since the table says the same. Not on
a terminal (a log file, a container), or without rich, those log lines are the progress.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import Any, Optional, TextIO

from kvcached.registry import printable

LOG_LINE_WIDTH = 80
_SERVE_LOGGER = logging.getLogger("kvcached.serve")


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
        self._quiet_level = logging.NOTSET
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
            self._quiet_level = _SERVE_LOGGER.level
            _SERVE_LOGGER.setLevel(max(logging.WARNING, _SERVE_LOGGER.getEffectiveLevel()))
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._table(), refresh=True)
            self._live.__exit__(*exc)
            _SERVE_LOGGER.setLevel(self._quiet_level)

    def tick(self) -> None:
        """Refreshes the table (nothing without one)."""
        if self._live is not None:
            self._live.update(self._table(), refresh=True)

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
