"""kvctl: inspect and steer the kvcached instances sharing a device.

    kvctl list                          instances, their usage and limits
    kvctl set-limit NAME|PID SIZE       cap one instance (it shrinks lazily)
    kvctl clear-limit NAME|PID          remove that cap
    kvctl set-budget SIZE               change the device-wide budget
    kvctl clean                         reclaim entries of dead processes

Every command takes ``--device`` (default cpu) and ``--json`` (machine-readable
output). Sizes accept 4096, 512MiB, 8G (binary) or 2GB (decimal). Also runs as
``python -m kvcached.kvctl``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence, Union

from kvcached.registry import (
    HOST_DEVICE,
    DeviceRegistry,
    format_bytes,
    open_existing,
    parse_bytes,
)

EXIT_OK = 0
EXIT_FAILED = 1


def _target(text: str) -> Union[int, str]:
    """An instance is named by pid (all digits) or by name."""
    return int(text) if text.isdigit() else text


def _emit(as_json: bool, payload: dict[str, Any], human: str) -> None:
    print(json.dumps(payload, indent=2, sort_keys=True) if as_json else human)


def _fail(as_json: bool, payload: dict[str, Any], message: str) -> int:
    if as_json:
        print(json.dumps({**payload, "error": message}, indent=2, sort_keys=True))
    print(f"kvctl: {message}", file=sys.stderr)
    return EXIT_FAILED


def _device_summary(registry: DeviceRegistry) -> dict[str, Any]:
    return {
        "device": registry.device,
        "path": registry.path,
        "exists": True,
        "budget_bytes": registry.budget_bytes,
        "mapped_bytes": registry.mapped_bytes,
        "available_bytes": registry.available_bytes,
    }


def _instances_table(entries: list[dict[str, Any]]) -> str:
    header = ("NAME", "PID", "STATE", "USED", "RESERVED", "MAPPED", "LIMIT", "WANTS")
    rows = [header] + [
        (
            entry["name"],
            str(entry["pid"]),
            "alive" if entry["alive"] else "dead",
            format_bytes(entry["used_bytes"]),
            format_bytes(entry["reserved_bytes"]),
            format_bytes(entry["mapped_bytes"]),
            format_bytes(entry["limit_bytes"]),
            format_bytes(entry["wanted_bytes"]) if entry["wanted_bytes"] else "-",
        )
        for entry in entries
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def cmd_list(args: argparse.Namespace) -> int:
    registry = open_existing(args.device)
    if registry is None:
        payload = {"device": args.device, "path": DeviceRegistry.segment_path(args.device),
                   "exists": False, "instances": []}
        _emit(args.json, payload, f"{args.device}: no registry yet (no engine has registered)")
        return EXIT_OK
    payload = {**_device_summary(registry), "instances": registry.entries()}
    human = (
        f"{registry.device}: budget {format_bytes(registry.budget_bytes)}, "
        f"mapped {format_bytes(registry.mapped_bytes)}, "
        f"available {format_bytes(registry.available_bytes)} ({registry.path})\n"
        + _instances_table(payload["instances"])
    )
    _emit(args.json, payload, human)
    return EXIT_OK


def _set_limit(args: argparse.Namespace, limit_bytes: Optional[int]) -> int:
    payload: dict[str, Any] = {"device": args.device, "target": args.target, "limit_bytes": limit_bytes}
    registry = open_existing(args.device)
    if registry is None:
        return _fail(args.json, {**payload, "matched": 0}, f"no registry for device {args.device!r}")
    matched = registry.set_limit(_target(args.target), limit_bytes)
    payload["matched"] = matched
    if matched == 0:
        return _fail(args.json, payload, f"no instance named or with pid {args.target!r} on {args.device}")
    action = f"limit {format_bytes(limit_bytes)}" if limit_bytes is not None else "limit cleared"
    _emit(args.json, payload, f"{args.device}: {args.target}: {action} ({matched} instance(s))")
    return EXIT_OK


def cmd_set_limit(args: argparse.Namespace) -> int:
    return _set_limit(args, parse_bytes(args.size))


def cmd_clear_limit(args: argparse.Namespace) -> int:
    return _set_limit(args, None)


def cmd_set_budget(args: argparse.Namespace) -> int:
    budget_bytes = parse_bytes(args.size)
    existing = open_existing(args.device)
    previous = existing.budget_bytes if existing is not None else None
    # Setting a budget on a device nobody uses yet creates its registry with it.
    registry = existing if existing is not None else DeviceRegistry(args.device, budget_bytes)
    registry.budget_bytes = budget_bytes
    payload = {**_device_summary(registry), "previous_budget_bytes": previous}
    over = registry.mapped_bytes > budget_bytes
    note = " (over budget: instances shrink as they free memory)" if over else ""
    _emit(args.json, payload, f"{args.device}: budget {format_bytes(previous)} -> {format_bytes(budget_bytes)}{note}")
    return EXIT_OK


def cmd_clean(args: argparse.Namespace) -> int:
    registry = open_existing(args.device)
    cleaned = registry.clean_stale() if registry is not None else 0
    payload = {"device": args.device, "cleaned": cleaned}
    _emit(args.json, payload, f"{args.device}: reclaimed {cleaned} stale entr{'y' if cleaned == 1 else 'ies'}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    # --device/--json are accepted both before and after the command; SUPPRESS
    # keeps a subcommand's unset copy from overwriting the top-level value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default=argparse.SUPPRESS, help=f"device, e.g. cpu or cuda:0 (default {HOST_DEVICE})")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")

    parser = argparse.ArgumentParser(prog="kvctl", description=__doc__.split("\n\n")[0], parents=[common])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("list", parents=[common], help="list instances").set_defaults(handler=cmd_list)
    set_limit = commands.add_parser("set-limit", parents=[common], help="set an instance's limit")
    set_limit.add_argument("target", metavar="NAME|PID")
    set_limit.add_argument("size", metavar="SIZE", help="e.g. 8G, 512MiB, 4096")
    set_limit.set_defaults(handler=cmd_set_limit)
    clear_limit = commands.add_parser("clear-limit", parents=[common], help="remove an instance's limit")
    clear_limit.add_argument("target", metavar="NAME|PID")
    clear_limit.set_defaults(handler=cmd_clear_limit)
    set_budget = commands.add_parser("set-budget", parents=[common], help="set the device-wide budget")
    set_budget.add_argument("size", metavar="SIZE")
    set_budget.set_defaults(handler=cmd_set_budget)
    commands.add_parser("clean", parents=[common], help="reclaim entries of dead processes").set_defaults(
        handler=cmd_clean
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.device = getattr(args, "device", HOST_DEVICE)
    args.json = getattr(args, "json", False)
    handler = getattr(args, "handler", cmd_list)
    try:
        return handler(args)
    except (ValueError, OSError, RuntimeError) as error:
        return _fail(args.json, {"device": args.device}, str(error))


if __name__ == "__main__":
    sys.exit(main())
