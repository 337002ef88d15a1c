"""Shows the demo while it runs: a rich live table with bars, or plain progress lines.

The rich view (a terminal with ``rich`` installed) redraws a table of the
engines: memory each one holds against the budget (or its static cap), its
queue and what happened to its requests so far. Elsewhere (a pipe, a log,
``--no-live``) one plain line per second says the same in short.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO

from kvcached.cli.widgets import UsageBar, short_bytes
from kvcached.demo.fleet import engine_name
from kvcached.demo.traffic import TrafficProfile

# Plain lines are for logs: one per second is plenty.
PLAIN_INTERVAL_S = 1.0
# The rich view redraws at most this often (sampling runs at 10 Hz).
LIVE_INTERVAL_S = 0.25


class _ViewBase:
    """What both views remember about the current run."""

    def __init__(self, budget_bytes: int, duration_s: float) -> None:
        self.budget_bytes = budget_bytes
        self.duration_s = duration_s
        self.run_name = ""
        self.limit_bytes: Optional[int] = None
        self.profile: Optional[TrafficProfile] = None

    def __enter__(self) -> _ViewBase:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def begin_run(self, run_name: str, profile: TrafficProfile, limit_bytes: Optional[int]) -> None:
        self.run_name, self.profile, self.limit_bytes = run_name, profile, limit_bytes

    def busy_engine(self, time_s: float) -> Optional[int]:
        if self.profile is None or not 0 <= time_s < self.profile.duration_s:
            return None  # before the start, or draining after the schedule
        return self.profile.busy_engine(time_s)

    def describe_run(self) -> str:
        if self.limit_bytes is None:
            return f"{self.run_name}: all engines share one budget of {short_bytes(self.budget_bytes)}"
        return f"{self.run_name}: each engine capped at {short_bytes(self.limit_bytes)} (budget / N)"


class PlainProgress(_ViewBase):
    """One line per second: time, then each engine's memory and queue."""

    def __init__(self, budget_bytes: int, duration_s: float, stream: TextIO = sys.stdout) -> None:
        super().__init__(budget_bytes, duration_s)
        self.stream = stream
        self._next_line_s = 0.0

    def begin_run(self, run_name: str, profile: TrafficProfile, limit_bytes: Optional[int]) -> None:
        super().begin_run(run_name, profile, limit_bytes)
        self._next_line_s = 0.0
        print(self.describe_run(), file=self.stream, flush=True)

    def sample(self, time_s: float, mapped_bytes: list[int], counters: list[dict[str, int]]) -> None:
        if time_s < self._next_line_s:
            return
        self._next_line_s = time_s + PLAIN_INTERVAL_S
        busy = self.busy_engine(time_s)
        cells = []
        for engine, (mapped, counts) in enumerate(zip(mapped_bytes, counters)):
            mark = "*" if engine == busy else " "
            cells.append(
                f"{engine}{mark} {short_bytes(mapped):>5} q{counts.get('waiting', 0):<3d} "
                f"r{counts.get('refused', 0):<3d}"
            )
        line = f"  {self.run_name:7s} {time_s:5.1f} s  total {short_bytes(sum(mapped_bytes)):>5}  " + " | ".join(cells)
        print(line, file=self.stream, flush=True)

    def end_run(self) -> None:
        print(f"  {self.run_name} run done", file=self.stream, flush=True)


class LiveTable(_ViewBase):
    """A rich Live table, redrawn a few times a second; use as a context manager."""

    def __init__(self, budget_bytes: int, duration_s: float, num_engines: int) -> None:
        from rich.console import Console
        from rich.live import Live

        super().__init__(budget_bytes, duration_s)
        self.num_engines = num_engines
        self.console = Console()
        self.live = Live(console=self.console, auto_refresh=False, transient=False)
        self._last_draw = 0.0
        self._frame: Any = None

    def __enter__(self) -> LiveTable:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(*exc)

    def begin_run(self, run_name: str, profile: TrafficProfile, limit_bytes: Optional[int]) -> None:
        super().begin_run(run_name, profile, limit_bytes)
        self._last_draw = 0.0

    def sample(self, time_s: float, mapped_bytes: list[int], counters: list[dict[str, int]]) -> None:
        now = time.monotonic()
        if now - self._last_draw < LIVE_INTERVAL_S:
            return
        self._last_draw = now
        self._frame = self._render(time_s, mapped_bytes, counters)
        self.live.update(self._frame, refresh=True)

    def end_run(self) -> None:
        # Leave the run's last frame on screen above the next run's table.
        if self._frame is not None:
            self.live.console.print(self._frame)
            self._frame = None

    def _render(self, time_s: float, mapped_bytes: list[int], counters: list[dict[str, int]]) -> Any:
        from rich import box
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        total = sum(mapped_bytes)
        clock = f"{min(time_s, self.duration_s):4.1f} / {self.duration_s:g} s"
        if time_s >= self.duration_s:
            clock += "  (draining)"
        header = Table.grid(padding=(0, 2))
        header.add_row(Text(self.describe_run(), style="bold cyan"), clock)
        header.add_row(
            f"device: {short_bytes(total)} of {short_bytes(self.budget_bytes)} mapped",
            ProgressBar(total=max(self.budget_bytes, 1), completed=min(total, self.budget_bytes), width=40),
        )
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1))
        for column, justify in (
            ("ENGINE", "left"),
            ("USED", "right"),
            ("MAPPED", "right"),
            ("RUN", "right"),
            ("QUEUE", "right"),
            ("AT ONCE", "right"),
            ("DELAYED", "right"),
            ("REFUSED", "right"),
        ):
            table.add_column(column, justify=justify, no_wrap=True)
        table.add_column("MEMORY (used, mapped, allowance)", no_wrap=True)
        busy = self.busy_engine(time_s)
        scale = self.limit_bytes if self.limit_bytes is not None else self.budget_bytes
        for engine in range(self.num_engines):
            counts = counters[engine] if engine < len(counters) else {}
            mapped = mapped_bytes[engine] if engine < len(mapped_bytes) else 0
            used = min(counts.get("used_block_bytes", 0), mapped)
            name = Text(
                engine_name(engine) + (" busy" if engine == busy else ""), style="bold" if engine == busy else ""
            )
            refused = counts.get("refused", 0)
            table.add_row(
                name,
                short_bytes(used),
                short_bytes(mapped),
                str(counts.get("running", 0)),
                str(counts.get("waiting", 0)),
                str(counts.get("at_once", 0)),
                str(counts.get("delayed", 0)),
                Text(str(refused), style="bold red" if refused else ""),
                UsageBar(used, mapped - used, scale),
            )
        return Group(header, table)


def make_view(live: bool, budget_bytes: int, duration_s: float, num_engines: int) -> Any:
    """The rich table when asked for and possible (a terminal, rich installed), else plain lines."""
    if live and sys.stdout.isatty():
        try:
            return LiveTable(budget_bytes, duration_s, num_engines)
        except ImportError:
            pass
    return PlainProgress(budget_bytes, duration_s)


__all__ = ["LiveTable", "PlainProgress", "make_view"]
