"""kvtop: a live view of every kvcached instance on each device, with usage bars.

    kvtop                       refresh every second until Ctrl-C
    kvtop --once                print one frame and exit (for scripts)
    kvtop | less                not a terminal: a plain snapshot every interval
    kvtop --device cuda:0       only this device (repeatable); default: all found
    kvtop --interval 0.5        refresh period in seconds

Each instance's bar shows its model weights (dark shade, ``docs/sleep.md``), its
used KV memory (solid), its mapped but free KV memory (light shade: pages kept
ready, no block in use) and the rest of its allowance (its weights and its limit,
or the device budget); the device's bar above shows the same for every instance
together. WEIGHTS is what an instance's weights hold (shown on a device where
some instance has weights) and "asleep" says they sleep; MIN, LIMIT and PRIO are
its memory policy (``docs/memory-policy.md``), and "shrink to" says a
higher-priority instance waits for its memory. On a narrow terminal the bars give way
first, then the AS column, the policy's and WEIGHTS; only then are names (whole
up to 40 characters) cut, to no fewer than 24. Devices are shown by registry name
(``cuda-GPU-<uuid>``), each instance with the device as its own process sees it.
A bad argument is one line on stderr and exit code 2.
Also runs as ``python -m kvcached.kvtop``. Needs ``rich`` (the ``ui`` extra: ``pip install ".[ui]"``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

from kvcached.cli.support import (
    EXIT_FAILED,
    REGISTRY_OPTIONS,
    OneLineArgumentParser,
    add_version_argument,
    check_settings,
    quiet_on_broken_pipe,
    report_failure,
)
from kvcached.cli.widgets import (
    FREE_CHAR,
    FREE_MAPPED_CHAR,
    MAX_BAR_WIDTH,
    MIN_BAR_WIDTH,
    USED_CHAR,
    WEIGHTS_CHAR,
    UsageBar,
    short_bytes,
)
from kvcached.errors import KvcachedError
from kvcached.registry import (
    DeviceRegistry,
    format_bytes,
    open_existing,
    printable,
    registry_dir,
    registry_files,
    resolve_device,
)

DEFAULT_INTERVAL_S = 1.0
# Refresh periods outside this range are mistakes (a busy loop, or a frozen view).
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.01, 3600.0
# A name up to NAME_WHOLE_WIDTH is kept whole while columns can give way; only when the fewest
# columns still do not fit is it cut, to no less than NAME_MIN_WIDTH.
NAME_WHOLE_WIDTH, NAME_MIN_WIDTH = 40, 24
DEFAULT_WIDTH = 120  # cells, where no console says otherwise
try:
    from rich import box
    from rich.console import Console, Group
    from rich.live import Live
    from rich.table import Table
    from rich.text import Text
except ImportError:  # reported by main(), so importing this module never fails
    Console = None


def _status(entry: dict[str, Any]) -> Text:
    if not entry["alive"]:
        status = Text("dead", style="red")
    elif entry["sleeping"]:
        status = Text("asleep", style="blue")
        if entry["wanted_bytes"]:  # a wake refused in the last second
            status.append(f" waits {short_bytes(entry['wanted_bytes'])}", style="bold red")
    elif entry["wanted_bytes"]:
        # Refused in the last second: the device budget is the bottleneck.
        status = Text(f"waits {short_bytes(entry['wanted_bytes'])}", style="bold red")
    else:
        status = Text("ok", style="green")
    if entry["reclaim_target_bytes"] is not None:
        # A higher-priority instance waits: this one is asked to shrink (docs/memory-policy.md).
        status.append(f" shrink to {short_bytes(entry['reclaim_target_bytes'])}", style="bold magenta")
    if entry["worker_errors"]:
        status.append(f" {entry['worker_errors']} err", style="bold yellow")
    return status


def _instance_row(entry: dict[str, Any], budget_bytes: int) -> dict[str, Any]:
    limit, weights = entry["max_bytes"], entry["weights_bytes"]
    # Used comes from the pool's last report; mapped is what the budget counts.
    free_mapped = max(entry["free_mapped_bytes"], entry["mapped_bytes"] - entry["used_bytes"])
    # The limit caps the KV cache alone: the weights sit beside it.
    allowance = weights + limit if limit is not None else budget_bytes
    return {
        "NAME": printable(entry["name"]),
        "PID": str(entry["pid"]),
        "AS": printable(entry["local_device"]) or "-",
        "USED": short_bytes(entry["used_bytes"]),
        "MAPPED": short_bytes(entry["mapped_bytes"]),
        "WEIGHTS": short_bytes(weights) if weights else "-",
        "MIN": short_bytes(entry["min_bytes"]) if entry["min_bytes"] else "-",
        "LIMIT": short_bytes(limit),
        "PRIO": str(entry["priority"]),
        "STATUS": _status(entry),
        "USAGE": UsageBar(entry["used_bytes"], free_mapped, allowance, weights),
    }


# Column, justification; the name comes first and the bar last.
TEXT_COLUMNS = (
    ("PID", "right"),
    ("AS", "left"),
    ("USED", "right"),
    ("MAPPED", "right"),
    ("WEIGHTS", "right"),
    ("MIN", "right"),
    ("LIMIT", "right"),
    ("PRIO", "right"),
    ("STATUS", "left"),
)
# Shown only on a device where some instance has a memory policy (a min or a priority).
POLICY_COLUMNS = ("MIN", "PRIO")
# Shown only on a device where some instance has model weights, awake or asleep.
WEIGHTS_COLUMNS = ("WEIGHTS",)
# What gives way on a narrow terminal, in this order, before a name is cut.
OPTIONAL_COLUMNS = ("USAGE", "AS", "MIN", "PRIO", "WEIGHTS")
CELL_PADDING = 3  # between two columns: a space each side of the (blank) separator


def _columns_that_fit(widths: dict[str, int], total_width: int) -> tuple[list[str], int]:
    """The columns to show in ``total_width`` cells (those ``widths`` has, or fewer: without the
    bar, then without AS, then without the policy's, then without WEIGHTS) and the cells left over,
    negative when even the fewest columns are too wide."""
    shown = ["NAME"] + [column for column, _ in TEXT_COLUMNS if column in widths] + ["USAGE"]
    droppable = [column for column in OPTIONAL_COLUMNS if column in shown]
    while True:
        needed = sum(widths[column] for column in shown) + CELL_PADDING * (len(shown) - 1)
        if needed <= total_width or not droppable:
            return shown, total_width - needed
        shown.remove(droppable.pop(0))


def _layout(widths: dict[str, int], longest_name: int, total_width: int) -> tuple[list[str], int, int]:
    """The columns shown, the name's width and the bar's, for text columns of ``widths`` (NAME and
    USAGE are set here) and names up to ``longest_name`` cells long, in ``total_width`` cells."""
    widths = {**widths, "NAME": min(NAME_WHOLE_WIDTH, longest_name), "USAGE": MIN_BAR_WIDTH}
    shown, spare = _columns_that_fit(widths, total_width)
    if spare < 0:  # every optional column gave way and the names still do not fit: cut them
        name_width = max(NAME_MIN_WIDTH, widths["NAME"] + spare)
    else:  # room to spare goes to names longer still, then to the bar
        name_width = min(longest_name, widths["NAME"] + spare)
    # The bar's width is fixed, since a bar rich lays out wider than the room left is cut at the
    # edge, which hides its scale.
    bar_width = min(MAX_BAR_WIDTH, MIN_BAR_WIDTH + max(0, spare) - max(0, name_width - widths["NAME"]))
    return shown, name_width, bar_width


def _device_header(registry: DeviceRegistry, entries: list[dict[str, Any]]) -> Group:
    """The device's name on a line of its own (a GPU's identity is long and must stay whole), its
    figures, and a bar of what its instances hold together: weights, KV used, KV mapped but free."""
    budget, mapped, weights = registry.budget_bytes, registry.mapped_bytes, registry.weights_bytes
    held = mapped + weights
    share = held / budget if budget else 0.0
    local = registry.local_device
    label = registry.device if not local or local == registry.device else f"{registry.device} ({local} here)"
    figures = Table.grid()
    figures.add_row(
        "  ",
        f"budget {format_bytes(budget)}  held {format_bytes(held)} ({share:.0%})  "
        f"available {format_bytes(registry.available_bytes)}",
    )
    # Entries are read a moment after the totals: the used part never exceeds what is mapped.
    used = min(mapped, sum(entry["used_bytes"] for entry in entries))
    bar = Table.grid()
    bar.add_row(
        "  ",
        UsageBar(used, mapped - used, budget, weights),
        f"  weights {format_bytes(weights)}  KV {format_bytes(mapped)}",
    )
    return Group(Text(label, style="bold cyan", overflow="fold"), figures, bar)


def device_view(registry: DeviceRegistry, total_width: int = DEFAULT_WIDTH) -> Group:
    """One device in ``total_width`` cells: a header with its budget bar, then a table of its instances."""
    entries = registry.entries()
    header = _device_header(registry, entries)
    budget = registry.budget_bytes
    if not entries:
        return Group(header, Text("  no instances", style="dim"), Text(""))
    rows = [_instance_row(entry, budget) for entry in entries]
    hidden = set()
    if not any(entry["min_bytes"] or entry["priority"] for entry in entries):
        hidden.update(POLICY_COLUMNS)
    if not any(entry["weights_bytes"] or entry["sleeping"] for entry in entries):
        hidden.update(WEIGHTS_COLUMNS)
    columns = [column for column, _ in TEXT_COLUMNS if column not in hidden]
    widths = {column: max([len(column)] + [len(str(row[column])) for row in rows]) for column in columns}
    longest_name = max([len("NAME")] + [len(row["NAME"]) for row in rows])
    shown, name_width, bar_width = _layout(widths, longest_name, total_width)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1))
    table.add_column("NAME", no_wrap=True, min_width=name_width, max_width=name_width, overflow="ellipsis")
    # Short columns never shrink (rich would cut "512M" to "5…").
    for column, justify in TEXT_COLUMNS:
        if column in shown:
            table.add_column(column, justify=justify, no_wrap=True, min_width=widths[column])
    if "USAGE" in shown:
        table.add_column("USAGE", no_wrap=True, width=bar_width)
    for row in rows:
        table.add_row(*(row[column] for column in shown))
    return Group(header, table, Text(""))


def _device_or_error(name: str, total_width: int) -> Any:
    """One device's view, or a line saying why it cannot be shown (the file may change under us)."""
    try:
        registry = open_existing(name)
        if registry is None:
            return Text(f"{name}: no registry yet (no engine has registered)", style="dim")
        return device_view(registry, total_width)
    except (KvcachedError, ValueError, OSError) as error:
        return Text(printable(f"{name}: {error}"), style="yellow")


def frame(devices: Optional[Sequence[str]], total_width: int = DEFAULT_WIDTH) -> Group:
    """Everything kvtop shows at one instant, laid out for ``total_width`` cells."""
    views: list[Any] = []
    try:
        files = [] if devices else registry_files()
    except (KvcachedError, ValueError, OSError) as error:  # e.g. the directory went away meanwhile
        files, views = [], [Text(printable(str(error)), style="yellow")]
    if devices:
        views = [_device_or_error(name, total_width) for name in devices]
    else:
        for file in files:
            if file["status"] == "current":
                views.append(_device_or_error(file["device"], total_width))
            elif file["status"] != "unfinished":
                views.append(
                    Text(printable(f"{file['file_name']}: {file['status']}: {file['detail']}"), style="yellow")
                )
    if not views:
        views.append(Text(f"no kvcached registry under {registry_dir()}", style="dim"))
    footer = Text(
        f"{WEIGHTS_CHAR} weights  {USED_CHAR} KV used  {FREE_MAPPED_CHAR} KV mapped, free  {FREE_CHAR} not held   "
        f"{time.strftime('%H:%M:%S')}",
        style="dim",
    )
    return Group(*views, footer)


def _interval(text: str) -> float:
    """Seconds between refreshes: a finite number in [MIN_INTERVAL_S, MAX_INTERVAL_S]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:
        raise argparse.ArgumentTypeError(f"{text!r} is not between {MIN_INTERVAL_S:g} and {MAX_INTERVAL_S:g} seconds")
    return value


def shown_devices(names: Sequence[str]) -> list[str]:
    """The devices asked for, each physical device once, by the name that keeps what this
    process calls it ("cuda:1" shows "cuda-GPU-… (cuda:1 here)"). Resolved once, so a bad
    name is an error now, not a line in every frame."""
    shown: dict[str, str] = {}
    for name in names:
        resolved = resolve_device(name)
        shown.setdefault(resolved.registry, resolved.local or resolved.registry)
    return list(shown.values())


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="kvtop", description=__doc__.split("\n\n")[0])
    add_version_argument(parser)
    parser.add_argument(
        "--device", action="append", help="device to show: cpu, cuda:0 or a registry name (repeatable); default: all"
    )
    parser.add_argument("--interval", type=_interval, default=DEFAULT_INTERVAL_S, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    return parser


def _stream_snapshots(console: Console, devices: Sequence[str], interval_s: float) -> None:
    """Not a terminal (a pipe, a log file): one plain frame per interval, each after the last.

    A reader that goes away (``kvtop | head``) ends it quietly through rich (exit status 1)."""
    while True:
        console.print(frame(devices, console.width))
        console.file.flush()
        time.sleep(interval_s)


@quiet_on_broken_pipe
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if Console is None:
        report_failure("kvtop", "kvtop needs rich: pip install rich", as_json=False)
        return EXIT_FAILED
    try:
        devices = shown_devices(args.device or [])
    except (KvcachedError, ValueError, OSError) as error:
        parser.error(printable(str(error)))
    try:
        check_settings(REGISTRY_OPTIONS)
        registry_files()  # a bad KVCACHED_REGISTRY_DIR or _GROUP: say so once, and stop
    except (KvcachedError, ValueError, OSError) as error:
        report_failure("kvtop", str(error), as_json=False)
        return EXIT_FAILED
    console = Console()
    if args.once:
        console.print(frame(devices, console.width))
        return 0
    try:
        if not console.is_terminal:
            _stream_snapshots(console, devices, args.interval)
        # Refreshed by hand, once per interval: each frame reads the registry.
        with Live(frame(devices, console.width), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(frame(devices, console.width), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
