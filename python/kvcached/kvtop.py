"""kvtop: a live view of every kvcached instance on each device, with usage bars.

    kvtop                       refresh every second until Ctrl-C
    kvtop --once                print one frame and exit (for scripts)
    kvtop --device cuda:0       only this device (repeatable); default: all found
    kvtop --interval 0.5        refresh period in seconds

Each instance's bar shows used memory (solid), its mapped free reserve (shaded)
and the rest of its allowance (its limit, or the device budget). Also runs as
``python -m kvcached.kvtop``. Needs ``rich`` (``pip install kvcached[ui]``).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Optional, Sequence

from kvcached.registry import DeviceRegistry, format_bytes, known_devices, open_existing, registry_dir

DEFAULT_INTERVAL_S = 1.0
# Bars stretch with the terminal between these widths (in cells).
MIN_BAR_WIDTH, MAX_BAR_WIDTH = 10, 40
NAME_MAX_WIDTH = 24
USED_CHAR, RESERVED_CHAR, FREE_CHAR = "█", "▒", "·"
# Binary prefixes, one letter each, so a size fits in five cells ("512M", "3.5G").
_SHORT_UNITS = ("B", "K", "M", "G", "T")
_UNIT_STEP = 1024
_ONE_DECIMAL_BELOW = 10

try:
    from rich import box
    from rich.console import Console, ConsoleOptions, Group, RenderResult
    from rich.live import Live
    from rich.measure import Measurement
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text
except ImportError:  # reported by main(), so importing this module never fails
    Console = None


def short_bytes(count: Optional[int]) -> str:
    """A size in at most five cells: ``512M``, ``3.5G``; ``-`` for None."""
    if count is None:
        return "-"
    value = float(count)
    for unit in _SHORT_UNITS:
        if value < _UNIT_STEP or unit == _SHORT_UNITS[-1]:
            return f"{value:.1f}{unit}" if unit != "B" and value < _ONE_DECIMAL_BELOW else f"{value:.0f}{unit}"
        value /= _UNIT_STEP
    raise AssertionError("unreachable")


class UsageBar:
    """A stacked bar filling its table cell: used, then reserved, then free, of ``scale_bytes``."""

    def __init__(self, used_bytes: int, reserved_bytes: int, scale_bytes: int) -> None:
        self.used_bytes, self.reserved_bytes = used_bytes, reserved_bytes
        self.scale_bytes = max(scale_bytes, used_bytes + reserved_bytes, 1)

    def text(self, width: int) -> "Text":
        used_cells = round(width * self.used_bytes / self.scale_bytes)
        reserved_cells = min(width - used_cells, round(width * self.reserved_bytes / self.scale_bytes))
        bar = Text(no_wrap=True)
        bar.append(USED_CHAR * used_cells, style="green")
        bar.append(RESERVED_CHAR * reserved_cells, style="yellow")
        bar.append(FREE_CHAR * (width - used_cells - reserved_cells), style="dim")
        return bar

    def __rich_measure__(self, console: "Console", options: "ConsoleOptions") -> "Measurement":
        return Measurement(MIN_BAR_WIDTH, MAX_BAR_WIDTH)

    def __rich_console__(self, console: "Console", options: "ConsoleOptions") -> "RenderResult":
        yield self.text(max(MIN_BAR_WIDTH, min(MAX_BAR_WIDTH, options.max_width)))


def _status(entry: dict[str, Any]) -> "Text":
    if not entry["alive"]:
        return Text("dead", style="red")
    if entry["wanted_bytes"]:
        # Refused in the last second: the device budget is the bottleneck.
        return Text(f"waits {short_bytes(entry['wanted_bytes'])}", style="bold red")
    return Text("ok", style="green")


def _instance_row(entry: dict[str, Any], budget_bytes: int) -> list[Any]:
    limit = entry["limit_bytes"]
    # Used comes from the pool's last report; mapped is what the budget counts.
    reserved = max(entry["reserved_bytes"], entry["mapped_bytes"] - entry["used_bytes"])
    return [
        entry["name"],
        str(entry["pid"]),
        short_bytes(entry["used_bytes"]),
        short_bytes(entry["mapped_bytes"]),
        short_bytes(limit),
        _status(entry),
        UsageBar(entry["used_bytes"], reserved, limit if limit is not None else budget_bytes),
    ]


def device_view(registry: DeviceRegistry) -> "Group":
    """One device: a header with its budget bar, then a table of its instances."""
    budget, mapped = registry.budget_bytes, registry.mapped_bytes
    share = mapped / budget if budget else 0.0
    header = Table.grid(padding=(0, 2))
    header.add_row(
        Text(registry.device, style="bold cyan"),
        f"budget {format_bytes(budget)}  mapped {format_bytes(mapped)} ({share:.0%})  "
        f"available {format_bytes(registry.available_bytes)}",
    )
    header.add_row("", ProgressBar(total=max(budget, 1), completed=min(mapped, max(budget, 1)), width=MAX_BAR_WIDTH))
    entries = registry.entries()
    if not entries:
        return Group(header, Text("  no instances", style="dim"), Text(""))
    rows = [_instance_row(entry, budget) for entry in entries]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1))
    # Short columns never shrink (rich would cut "512M" to "5…"); the name and the bar give way.
    for index, (column, justify) in enumerate(
        (("PID", "right"), ("USED", "right"), ("MAPPED", "right"), ("LIMIT", "right"), ("STATUS", "left")),
        start=1,
    ):
        width = max([len(column)] + [len(str(row[index])) for row in rows])
        if index == 1:
            table.add_column("NAME", no_wrap=True, max_width=NAME_MAX_WIDTH, overflow="ellipsis")
        table.add_column(column, justify=justify, no_wrap=True, min_width=width)
    table.add_column("USAGE", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return Group(header, table, Text(""))


def frame(devices: Optional[Sequence[str]]) -> "Group":
    """Everything kvtop shows at one instant."""
    names = list(devices) if devices else known_devices()
    views: list[Any] = []
    for name in names:
        registry = open_existing(name)
        if registry is None:
            views.append(Text(f"{name}: no registry yet (no engine has registered)", style="dim"))
        else:
            views.append(device_view(registry))
    if not views:
        views.append(Text(f"no kvcached registry under {registry_dir()}", style="dim"))
    footer = Text(f"{USED_CHAR} used  {RESERVED_CHAR} reserved  {FREE_CHAR} free   "
                  f"{time.strftime('%H:%M:%S')}", style="dim")
    return Group(*views, footer)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", action="append", help="device to show (repeatable); default: all")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if Console is None:
        print("kvtop needs rich: pip install 'kvcached[ui]'", file=sys.stderr)
        return 1
    if args.interval <= 0:
        print("kvtop: --interval must be > 0", file=sys.stderr)
        return 2
    console = Console()
    if args.once:
        console.print(frame(args.device))
        return 0
    try:
        # Refreshed by hand, once per interval: each frame reads the registry.
        with Live(frame(args.device), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(frame(args.device), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
