"""The ``kvcached demo`` subcommand: its options, and running it from parsed arguments."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from kvcached.registry import format_bytes, parse_bytes

logger = logging.getLogger(__name__)

DEFAULT_PLOT_PATH = "kvcached-demo.png"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the demo's options to ``parser`` (the ``demo`` subparser of ``kvcached``)."""
    from kvcached.demo.run import DEFAULT_BUDGET_BYTES, DEFAULT_DURATION_S, DEFAULT_ENGINES, DEFAULT_WAIT_TIMEOUT_S

    parser.add_argument("--engines", type=int, default=DEFAULT_ENGINES,
                        help=f"engine processes sharing the device (default {DEFAULT_ENGINES})")
    parser.add_argument("--duration", type=float, default=DEFAULT_DURATION_S, metavar="SECONDS",
                        help=f"length of each of the two runs' schedules (default {DEFAULT_DURATION_S:g})")
    parser.add_argument("--seed", type=int, default=0, help="traffic seed; the same seed gives the same requests")
    parser.add_argument("--budget", default=None, metavar="SIZE",
                        help=f"device budget shared by all engines, e.g. 256MiB (default "
                             f"{format_bytes(DEFAULT_BUDGET_BYTES)}); the traffic scales with it")
    parser.add_argument("--device", default="cpu", help="cpu (host memory, default) or a GPU such as cuda:0")
    parser.add_argument("--wait-timeout", type=float, default=DEFAULT_WAIT_TIMEOUT_S, metavar="SECONDS",
                        help="how long a request that finds no memory waits before it is refused "
                             f"(default {DEFAULT_WAIT_TIMEOUT_S:g})")
    parser.add_argument("--plot", default=DEFAULT_PLOT_PATH, metavar="PATH",
                        help=f"PNG of memory per instance over time (default {DEFAULT_PLOT_PATH}); '' for none")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON")
    parser.add_argument("--no-live", action="store_true",
                        help="plain progress lines instead of the live table (automatic when not a terminal)")


def run_command(args: argparse.Namespace) -> int:
    """Runs the demo as the parsed options say; prints the summary. Exit status 0 if all checks passed."""
    from kvcached.demo.live import make_view
    from kvcached.demo.run import DEFAULT_BUDGET_BYTES, DemoConfig, run_demo
    from kvcached.demo.summary import format_summary, summarize

    try:
        budget_bytes = parse_bytes(args.budget) if args.budget else DEFAULT_BUDGET_BYTES
        config = DemoConfig(
            engines=args.engines,
            duration_s=args.duration,
            seed=args.seed,
            budget_bytes=budget_bytes,
            device=args.device,
            wait_timeout_s=args.wait_timeout,
        )
        config.validate()
    except ValueError as error:
        print(f"kvcached demo: {error}", file=sys.stderr)
        return 2
    print(f"kvcached demo: {config.engines} engines, {format_bytes(budget_bytes)} on {config.device}, "
          f"two runs of {config.duration_s:g} s (elastic, then static); starting engines...", flush=True)
    try:
        with make_view(not args.no_live, budget_bytes, config.duration_s, config.engines) as view:
            outcome = run_demo(config, observer=view)
    except KeyboardInterrupt:
        print("kvcached demo: interrupted", file=sys.stderr)
        return 130
    summary = summarize(outcome)
    print()
    print(format_summary(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"summary written to {args.json}")
    if args.plot:
        from kvcached.demo.plot import plot_summary

        print(f"plot written to {plot_summary(summary, args.plot)}")
    return 0 if summary["ok"] else 1


__all__ = ["add_arguments", "run_command"]
