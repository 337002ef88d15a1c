"""The ``kvcached`` command: ``info`` (backends, devices and their identity, granularity, memory) and more."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Optional

from kvcached import config
from kvcached.cli.support import (
    EXIT_FAILED,
    OneLineArgumentParser,
    add_version_argument,
    quiet_on_broken_pipe,
    report_failure,
    wants_json,
)
from kvcached.configured import default_layout
from kvcached.demo.command import add_arguments as add_demo_arguments
from kvcached.demo.command import run_command as run_demo_command
from kvcached.devices import backends, canonical_device_name, open_device
from kvcached.errors import KvcachedError
from kvcached.serve.command import add_arguments as add_serve_arguments
from kvcached.serve.command import run_command as run_serve_command


def _format_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{count} B"


def _identity(spec: str) -> Optional[str]:
    try:
        return canonical_device_name(spec)
    except KvcachedError:
        return None


def _layout_source() -> str:
    return "KVCACHED_LAYOUT" if config.get("layout") else "default for the device kind"


def collect_info() -> dict:
    """Backends, their devices (ordinal and physical identity), granularity and memory, as plain data.

    Each backend also says which KV layout its pools get (``default_layout``: the
    device kind's default from :data:`kvcached.layout.DEFAULT_LAYOUTS`, or
    ``KVCACHED_LAYOUT``) and why (``layout_source``). A device that cannot be opened
    (no VMM support, say) is listed with its identity and the error saying why.
    """
    report: dict = {"backends": []}
    for status in backends():
        entry: dict = {
            "name": status.name,
            "available": status.available,
            "reason": status.reason,
            "driver_version": status.driver_version,
            "default_layout": default_layout(status.name),
            "layout_source": _layout_source(),
            "devices": [],
        }
        for ordinal in range(status.device_count if status.available else 0):
            spec = "cpu" if status.name == "host" else f"{status.name}:{ordinal}"
            try:
                device = open_device(spec)
                free_bytes, total_bytes = device.memory_info()
                minimum, recommended = device.granularity
                entry["devices"].append(
                    {
                        "device": device.name,
                        "identity": device.canonical_name,
                        "dlpack_device_type": device.dlpack_device_type,
                        "granularity_min_bytes": minimum,
                        "granularity_recommended_bytes": recommended,
                        "free_bytes": free_bytes,
                        "total_bytes": total_bytes,
                    }
                )
            except KvcachedError as exc:
                entry["devices"].append({"device": spec, "identity": _identity(spec), "error": str(exc)})
        report["backends"].append(entry)
    return report


def _print_info(report: dict) -> None:
    for backend in report["backends"]:
        state = "available" if backend["available"] else f"unavailable: {backend['reason']}"
        print(f"{backend['name']:5s} {state}")
        if backend["available"]:
            print(f"  pools default to the {backend['default_layout']} layout ({backend['layout_source']})")
        for dev in backend["devices"]:
            label = f"{dev['device']} = {dev['identity'] or 'unknown device'}"
            if "error" in dev:
                print(f"  {label}: cannot be used: {dev['error']}")
                continue
            print(
                f"  {label}: granularity {_format_bytes(dev['granularity_min_bytes'])} min / "
                f"{_format_bytes(dev['granularity_recommended_bytes'])} recommended, "
                f"memory {_format_bytes(dev['free_bytes'])} free of {_format_bytes(dev['total_bytes'])}"
            )


def _cmd_info(args: argparse.Namespace) -> int:
    report = collect_info()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_info(report)
    return 0


def build_parser(json_errors: bool = False) -> argparse.ArgumentParser:
    """The ``kvcached`` parser; ``json_errors``: a usage error is also JSON on stdout (``info --json``)."""
    parser = OneLineArgumentParser(
        prog="kvcached", description="Elastic KV cache for LLM serving.", json_errors=json_errors
    )
    add_version_argument(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineArgumentParser)
    info = sub.add_parser("info", help="backends, devices, granularity and memory", json_errors=json_errors)
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=_cmd_info)
    demo = sub.add_parser("demo", help="engines sharing one device elastically vs a static split, live")
    add_demo_arguments(demo)
    demo.set_defaults(func=run_demo_command)
    serve = sub.add_parser("serve", help="several models on one device behind one OpenAI-compatible endpoint")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve_command)
    return parser


@quiet_on_broken_pipe
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs ``kvcached``; a bad argument or ``KVCACHED_*`` setting is one line on stderr (and,
    with ``info --json``, a JSON object on stdout) and a non-zero exit, never a traceback."""
    words = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(json_errors=wants_json(words) and "info" in words)  # demo's --json is a path
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    try:
        return int(args.func(args))
    except KvcachedError as exc:
        report_failure("kvcached", str(exc), args.command == "info" and args.json)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
