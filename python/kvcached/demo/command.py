"""The ``kvcached demo`` subcommand: its options, checked before anything starts, and running it."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

from kvcached.cli.support import EXIT_USAGE, check_settings, names_a_setting, report_failure
from kvcached.errors import ConfigurationError, InvalidArgumentError, KvcachedError
from kvcached.registry import format_bytes, parse_bytes

logger = logging.getLogger(__name__)

DEFAULT_PLOT_PATH = "kvcached-demo.png"
EXIT_INTERRUPTED = 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the demo's options to ``parser`` (the ``demo`` subparser of ``kvcached``)."""
    from kvcached.demo.config import (
        DEFAULT_BUDGET_BYTES,
        DEFAULT_DURATION_S,
        DEFAULT_ENGINES,
        DEFAULT_WAIT_TIMEOUT_S,
    )

    parser.add_argument(
        "--engines",
        type=int,
        default=DEFAULT_ENGINES,
        help=f"engine processes sharing the device (default {DEFAULT_ENGINES})",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=DEFAULT_DURATION_S,
        metavar="SECONDS",
        help=f"length of each of the two runs' schedules (default {DEFAULT_DURATION_S:g})",
    )
    parser.add_argument("--seed", type=int, default=0, help="traffic seed; the same seed gives the same requests")
    parser.add_argument(
        "--budget",
        default=None,
        metavar="SIZE",
        help=f"device budget shared by all engines, e.g. 256MiB (default "
        f"{format_bytes(DEFAULT_BUDGET_BYTES)}); the traffic scales with it",
    )
    parser.add_argument("--device", default="cpu", help="cpu (host memory, default) or a GPU such as cuda:0")
    parser.add_argument(
        "--wait-timeout",
        type=float,
        default=DEFAULT_WAIT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"how long a request that finds no memory waits before it is refused (default {DEFAULT_WAIT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help=f"PNG of memory per instance over time (default {DEFAULT_PLOT_PATH} when matplotlib "
        "is installed); '' for none",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON")
    parser.add_argument(
        "--no-live",
        action="store_true",
        help="plain progress lines instead of the live table (automatic when not a terminal)",
    )


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _output_path(option: str, path: str) -> Path:
    """``path`` if a file can be written there (checked now, not after the whole run).

    Tried for real, since permissions do not tell (root passes ``os.access`` for ``/proc``, where no
    file can be made): opened for appending, without blocking (a FIFO with no reader is refused), and
    removed again if the try created it."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise InvalidArgumentError(f"{option} {path!r} is a directory; give a file name")
    if not folder.is_dir():
        raise InvalidArgumentError(f"{option} {path!r}: the directory {str(folder)!r} does not exist")
    existed = target.exists()
    try:
        os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666))
    except OSError as exc:
        raise InvalidArgumentError(f"{option} {path!r} cannot be written: {exc.strerror or exc}") from None
    if not existed:
        target.unlink()
    return target


def _plot_path(requested: Optional[str]) -> Optional[Path]:
    """Where to draw the plot: the path asked for, the default one if matplotlib is here, or none."""
    if requested == "":
        return None
    if not _installed("matplotlib"):
        if requested is None:
            print("kvcached demo: no plot (pip install matplotlib to get one)")
            return None
        raise InvalidArgumentError(f"--plot {requested!r} needs matplotlib: pip install matplotlib")
    return _output_path("--plot", requested or DEFAULT_PLOT_PATH)


def _checked_config(args: argparse.Namespace) -> Any:
    """The demo's config from its options and settings; ValueError/KvcachedError naming what is wrong."""
    from kvcached.demo.block_pattern import needs_torch
    from kvcached.demo.config import DEFAULT_BUDGET_BYTES, DemoConfig
    from kvcached.devices import open_device
    from kvcached.registry import resolve_device

    check_settings()  # every KVCACHED_* variable the engines will read
    budget_bytes = parse_bytes(args.budget, "--budget") if args.budget else DEFAULT_BUDGET_BYTES
    try:
        device = resolve_device(args.device)
    except (KvcachedError, ValueError) as error:
        raise InvalidArgumentError(f"--device {args.device!r}: {error}") from None
    if not device.local:
        raise InvalidArgumentError(f"--device {args.device!r}: name the device as this process sees it, e.g. cuda:0")
    config = DemoConfig(
        engines=args.engines,
        duration_s=args.duration,
        seed=args.seed,
        budget_bytes=budget_bytes,
        device=device.local,
        wait_timeout_s=args.wait_timeout,
    )
    config.validate()
    _free_bytes, total_bytes = open_device(device.local).memory_info()
    if budget_bytes > total_bytes:
        capacity = " (KVCACHED_HOST_CAPACITY_BYTES sets it)" if device.local == "cpu" else ""
        raise InvalidArgumentError(
            f"--budget {format_bytes(budget_bytes)} is more than {device.local} has: "
            f"{format_bytes(total_bytes)}{capacity}"
        )
    if needs_torch(config.device) and not _installed("torch"):
        raise InvalidArgumentError(
            f"--device {config.device}: the demo checks GPU blocks through torch: pip install torch"
        )
    return config


def run_command(args: argparse.Namespace) -> int:
    """Runs the demo as the parsed options say; prints the summary. Exit status 0 if all checks passed.

    Before any engine starts, a bad option is one line on stderr and exit status 2; a bad
    ``KVCACHED_*`` setting raises ConfigurationError (``kvcached`` says it in one line, status 1)."""
    from kvcached.demo.live import make_view
    from kvcached.demo.run import DemoSetup
    from kvcached.demo.summary import format_summary, summarize

    with contextlib.ExitStack() as stack:
        try:
            config = _checked_config(args)
            json_path = _output_path("--json", args.json) if args.json else None
            plot_path = _plot_path(args.plot)
            # Checks the budget against the device's page size; removes its directory on exit.
            setup = stack.enter_context(DemoSetup(config))
        except (KvcachedError, ValueError, OSError) as error:
            if names_a_setting(error):  # kvcached's own one-line error for a bad setting, exit status 1
                raise ConfigurationError(str(error)) from None
            report_failure("kvcached demo", str(error), as_json=False)
            return EXIT_USAGE
        print(
            f"kvcached demo: {config.engines} engines, {format_bytes(config.budget_bytes)} on {config.device}, "
            f"two runs of {config.duration_s:g} s (elastic, then static); starting engines...",
            flush=True,
        )
        print(f"kvcached demo: to list its engines from another terminal: {setup.kvctl_command()}", flush=True)
        try:
            with make_view(not args.no_live, config.budget_bytes, config.duration_s, config.engines) as view:
                outcome = setup.run(observer=view)
        except KeyboardInterrupt:
            print("kvcached demo: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
    summary = summarize(outcome)
    print()
    print(format_summary(summary))
    if json_path is not None:
        json_path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"summary written to {json_path}")
    if plot_path is not None:
        from kvcached.demo.plot import plot_summary

        print(f"plot written to {plot_summary(summary, plot_path)}")
    return 0 if summary["ok"] else 1


__all__ = ["add_arguments", "run_command"]
