"""What ``kvcached serve`` shows on a terminal while its engines load: a live table, one row per model.

Each row: the model's state, the time so far and the last line of its engine's log. Serve's own
log lines (started, ready, failed) are held back meanwhile, since the table says the same. Model
names are never cut: the log column gives way first, and on a narrow terminal a long name folds.
Not on a terminal (a log file, a container), or without rich, those log lines are the progress,
with a line every :data:`PROGRESS_LOG_INTERVAL_S` for each engine still loading (a large model can
take minutes, which must not look like a hang).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import Any, Optional, TextIO

from kvcached.registry import printable
from kvcached.serve.engine_logs import LAUNCH_HEADER

LOG_LINE_WIDTH = 80
PROGRESS_LOG_INTERVAL_S = 10.0
_SERVE_LOGGER = logging.getLogger("kvcached.serve")
logger = logging.getLogger(__name__)
# Widths of the columns that never give way: ENGINE ("sglang"), STATE ("restarting"), TIME ("1234.5 s").
_FIXED_WIDTHS = {"ENGINE": 6, "STATE": 10, "TIME": 8}
_COLUMNS = ("MODEL", "ENGINE", "STATE", "TIME", "LOG")
_FRAME_WIDTH = 3 * len(_COLUMNS) + 1  # a border and a space each side of every column
MIN_LOG_WIDTH = 12


def _last_log_line(engine: Any) -> str:
    """The engine's own last line ("" before it wrote one: serve's launch header is not its)."""
    for line in reversed(engine.log_tail(5).splitlines()):
        if line.startswith(LAUNCH_HEADER):
            return ""
        line = printable(line.strip())
        if line:
            return line[-LOG_LINE_WIDTH:]
    return ""


def _line_end(line: str, width: int) -> str:
    """The end of ``line`` in ``width`` characters: where a log line says how far it got."""
    return line if len(line) <= width else "…" + line[-(width - 1) :]


class StartupProgress:
    """Shows the engines' states until they are all ready; use as a context manager, ``tick()`` often."""

    def __init__(
        self,
        engines: Mapping[str, Any],
        stream: TextIO = sys.stderr,
        live: Optional[bool] = None,
        log_interval_s: float = PROGRESS_LOG_INTERVAL_S,
    ) -> None:
        self._engines = engines
        self._stream = stream
        self._started = time.monotonic()
        self._log_interval_s = log_interval_s
        self._next_log = self._started + log_interval_s
        self._quiet_level = logging.NOTSET
        self._live: Any = None
        self._console: Any = None
        wants_live = stream.isatty() if live is None else live
        if wants_live:
            try:
                from rich.console import Console
                from rich.live import Live
            except ImportError:
                return
            self._console = Console(file=stream)
            self._live = Live(self._table(), console=self._console, auto_refresh=False, transient=False)

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
        """Refreshes the table; without one, logs each engine still loading every interval."""
        if self._live is not None:
            self._live.update(self._table(), refresh=True)
            return
        now = time.monotonic()
        if now < self._next_log:
            return
        self._next_log = now + self._log_interval_s
        for name, engine in self._engines.items():
            state = engine.shown_state
            if state not in ("ready", "asleep"):
                last = _last_log_line(engine)
                logger.info(
                    "%s: %s for %.0f s%s",
                    printable(name),
                    state,
                    now - engine.started_at,
                    f"; its log: {last}" if last else "",
                )

    def _table(self) -> Any:
        from rich.table import Table
        from rich.text import Text

        table = Table(title="kvcached serve: starting engines", title_justify="left", expand=False)
        widths = self._widths()
        for column, width in widths.items():
            fold = column == "MODEL"  # a name folds on a terminal too narrow for it, never cut
            table.add_column(
                column,
                no_wrap=not fold,
                overflow="fold" if fold else "ellipsis",
                min_width=width if column != "LOG" else None,
                max_width=width,
            )
        styles = {"ready": "green", "asleep": "blue", "failed": "bold red", "restarting": "yellow"}
        for name, engine in self._engines.items():
            state = engine.shown_state
            elapsed = engine.ready_after_s if engine.ready_after_s is not None else time.monotonic() - engine.started_at
            table.add_row(
                printable(name),
                engine.spec.engine,
                Text(state, style=styles.get(state, "cyan")),
                f"{elapsed:5.1f} s",
                Text(_line_end(_last_log_line(engine), widths["LOG"]), style="dim"),
            )
        return table

    def _widths(self) -> dict[str, int]:
        """Each column's width on this terminal: fixed ones whole, then every model name whole, the log the rest."""
        total = self._console.width if self._console is not None else 120
        names = max((len(printable(name)) for name in self._engines), default=0)
        fixed = sum(_FIXED_WIDTHS.values()) + _FRAME_WIDTH
        model = max(len("MODEL"), min(names, total - fixed - MIN_LOG_WIDTH))
        log = max(MIN_LOG_WIDTH, min(LOG_LINE_WIDTH, total - fixed - model))
        return {"MODEL": model, **_FIXED_WIDTHS, "LOG": log}


__all__ = ["StartupProgress"]
