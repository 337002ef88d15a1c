"""kvctl: inspect and steer the kvcached instances sharing a device.

    kvctl list                          instances, their usage and limits
    kvctl list --all                    the same for every device with a registry, each once
    kvctl set-limit NAME|PID SIZE       cap one instance (it shrinks lazily)
    kvctl clear-limit NAME|PID          remove that cap
    kvctl set-budget SIZE               change the device-wide budget
    kvctl clean                         reclaim dead instances and unusable registry files
    kvctl files                         every registry file in the directory, with its status

Every command takes ``--device`` (default cpu; a GPU as this process sees it,
``cuda:0``, or its registry name, ``cuda-GPU-<uuid>``) and ``--json``
(machine-readable output). Sizes are exact: 4096, 512MiB, 8G (powers of 1024)
or 2GB (powers of 1000); see docs/configuration.md. Every failure is one line
on stderr and a non-zero exit (1: the operation failed, 2: bad usage). Also
runs as ``python -m kvcached.kvctl``.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import sys
from typing import Any, NoReturn, Optional, Sequence, Union

from kvcached.errors import KvcachedError, RegistryNotFoundError, RegistryUnusableError
from kvcached.registry import (
    HOST_DEVICE,
    DeviceRegistry,
    clean_directory,
    format_bytes,
    open_existing,
    printable,
    registry_dir,
    registry_files,
    registry_for,
    resolve_device,
)
from kvcached.sizes import parse_bytes

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (and exit code 2) instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog.split()[0]} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _target(text: str) -> Union[int, bytes]:
    """An instance is named by pid (all digits) or by name (bytes, so names that are not UTF-8 match)."""
    return int(text) if text.isdigit() else os.fsencode(text)


def _emit(as_json: bool, payload: dict[str, Any], human: str) -> None:
    print(json.dumps(payload, indent=2, sort_keys=True) if as_json else human)


def _fail(as_json: bool, payload: dict[str, Any], message: str) -> int:
    line = printable(" ".join(message.split()))
    if as_json:
        print(json.dumps({**payload, "error": line}, indent=2, sort_keys=True))
    print(f"kvctl: {line}", file=sys.stderr)
    return EXIT_FAILED


def _device_summary(registry: DeviceRegistry) -> dict[str, Any]:
    return {
        "device": registry.device,
        "local_device": registry.local_device,
        "path": registry.path,
        "exists": True,
        "budget_bytes": registry.budget_bytes,
        "mapped_bytes": registry.mapped_bytes,
        "available_bytes": registry.available_bytes,
    }


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _instances_table(entries: list[dict[str, Any]]) -> str:
    header = ("NAME", "PID", "USER", "AS", "STATE", "USED", "RESERVED", "MAPPED", "LIMIT", "WANTS", "ERRORS")
    rows = [header] + [
        (
            printable(entry["name"]),
            str(entry["pid"]),
            _user_name(entry["uid"]),
            printable(entry["local_device"]) or "-",
            "alive" if entry["alive"] else "dead",
            format_bytes(entry["used_bytes"]),
            format_bytes(entry["reserved_bytes"]),
            format_bytes(entry["mapped_bytes"]),
            format_bytes(entry["limit_bytes"]),
            format_bytes(entry["wanted_bytes"]) if entry["wanted_bytes"] else "-",
            str(entry["worker_errors"]) if entry["worker_errors"] else "-",
        )
        for entry in entries
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def _registry_label(registry: DeviceRegistry) -> str:
    """"cuda-GPU-… (cuda:0 here)" or "cpu"."""
    local = registry.local_device
    return registry.device if not local or local == registry.device else f"{registry.device} ({local} here)"


def _device_listing(registry: DeviceRegistry) -> tuple[dict[str, Any], str]:
    """One device's summary and instances: the JSON payload and the human text."""
    payload = {**_device_summary(registry), "instances": registry.entries()}
    human = (
        f"{_registry_label(registry)}: budget {format_bytes(payload['budget_bytes'])}, "
        f"mapped {format_bytes(payload['mapped_bytes'])}, "
        f"available {format_bytes(payload['available_bytes'])} ({registry.path})\n"
        + _instances_table(payload["instances"])
    )
    return payload, human


def _list_all(args: argparse.Namespace) -> int:
    """Every registry in the directory: one per physical device, each shown once."""
    devices: list[dict[str, Any]] = []
    unusable: list[dict[str, Any]] = []
    blocks: list[str] = []
    for file in registry_files():
        if file["status"] == "unfinished":
            continue  # a creation in progress: not a device yet
        problem = None
        if file["status"] == "current":
            try:  # the file may change between the scan and here
                registry = open_existing(file["device"])
                problem = None if registry is not None else "removed while kvctl read the directory"
            except (KvcachedError, ValueError, OSError) as error:
                registry, problem = None, str(error)
            if registry is not None:
                payload, human = _device_listing(registry)
                devices.append(payload)
                blocks.append(human)
                continue
        detail = problem or file["detail"]
        unusable.append({"path": file["path"], "status": file["status"], "detail": detail})
        blocks.append(printable(f"{file['path']}: {file['status']}: {detail}"))
    if not blocks:
        blocks.append(f"{registry_dir()}: no registry yet (no engine has registered)")
    payload = {"directory": str(registry_dir()), "devices": devices, "unusable": unusable}
    _emit(args.json, payload, "\n\n".join(blocks))
    return EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    if args.all:
        return _list_all(args)
    registry = open_existing(args.device)
    if registry is None:
        name = resolve_device(args.device)
        payload = {"device": name.registry, "local_device": name.local,
                   "path": DeviceRegistry.segment_path(name.registry), "exists": False, "instances": []}
        _emit(args.json, payload, f"{name.registry}: no registry yet (no engine has registered)")
        return EXIT_OK
    payload, human = _device_listing(registry)
    _emit(args.json, payload, human)
    return EXIT_OK


def _set_limit(args: argparse.Namespace, limit_bytes: Optional[int]) -> int:
    payload: dict[str, Any] = {"device": args.device, "target": args.target, "limit_bytes": limit_bytes}
    registry = open_existing(args.device)
    if registry is None:
        return _fail(args.json, {**payload, "matched": 0}, f"no registry for device {args.device!r}")
    payload["device"] = registry.device
    matched = registry.set_limit(_target(args.target), limit_bytes)
    payload["matched"] = matched
    if matched == 0:
        return _fail(args.json, payload, f"no instance named or with pid {args.target!r} on {registry.device}")
    action = f"limit {format_bytes(limit_bytes)}" if limit_bytes is not None else "limit cleared"
    _emit(args.json, payload, f"{registry.device}: {printable(args.target)}: {action} ({matched} instance(s))")
    return EXIT_OK


def cmd_set_limit(args: argparse.Namespace) -> int:
    return _set_limit(args, parse_bytes(args.size, "SIZE"))


def cmd_clear_limit(args: argparse.Namespace) -> int:
    return _set_limit(args, None)


def cmd_set_budget(args: argparse.Namespace) -> int:
    budget_bytes = parse_bytes(args.size, "SIZE")
    existing = open_existing(args.device)
    previous = existing.budget_bytes if existing is not None else None
    if existing is not None:
        registry = existing
        registry.budget_bytes = budget_bytes
    elif resolve_device(args.device).local:
        # A device this process sees and nobody uses yet: its registry starts with this budget.
        registry = registry_for(args.device, budget_bytes=budget_bytes)
    else:
        raise RegistryNotFoundError(
            f"no registry for device {args.device!r}: it is created by the first engine on that device "
            "(or name the device as this machine sees it, e.g. cuda:0)")
    payload = {**_device_summary(registry), "previous_budget_bytes": previous}
    over = payload["mapped_bytes"] > budget_bytes
    note = " (over budget: instances shrink as they free memory)" if over else ""
    _emit(args.json, payload,
          f"{registry.device}: budget {format_bytes(previous)} -> {format_bytes(budget_bytes)}{note}")
    return EXIT_OK


def cmd_clean(args: argparse.Namespace) -> int:
    try:
        registry = open_existing(args.device)
        unusable = None
    except RegistryUnusableError as error:  # e.g. truncated: the directory sweep below removes it
        registry, unusable = None, error
    cleaned = registry.clean_stale() if registry is not None else 0
    removed = clean_directory()
    device = registry.device if registry is not None else args.device
    payload = {"device": device, "cleaned": cleaned, "removed_files": [file["path"] for file in removed]}
    if unusable is not None and _still_unusable(args.device):
        return _fail(args.json, payload, str(unusable))
    lines = [f"{device}: reclaimed {cleaned} stale entr{'y' if cleaned == 1 else 'ies'}"]
    lines += [f"removed {printable(file['path'])}: {printable(file['detail'])}" for file in removed]
    _emit(args.json, payload, "\n".join(lines))
    return EXIT_OK


def _still_unusable(device: str) -> bool:
    """After cleaning: does the device's registry path still hold a file kvcached cannot use?"""
    try:
        open_existing(device)
        return False
    except RegistryUnusableError:
        return True


def cmd_files(args: argparse.Namespace) -> int:
    files = registry_files()
    payload = {"directory": str(registry_dir()), "files": files}
    lines = [f"{registry_dir()}: {len(files)} registry file(s)"]
    lines += [f"{printable(file['file_name'])}  {file['status']}  {printable(file['detail'])}" for file in files]
    _emit(args.json, payload, "\n".join(lines))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    # --device/--json are accepted both before and after the command; SUPPRESS
    # keeps a subcommand's unset copy from overwriting the top-level value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default=argparse.SUPPRESS,
                        help=f"device: cpu, cuda:0, or a registry name such as cuda-GPU-<uuid> (default {HOST_DEVICE})")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")

    parser = OneLineArgumentParser(prog="kvctl", description=__doc__.split("\n\n")[0], parents=[common])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineArgumentParser)
    list_ = commands.add_parser("list", parents=[common], help="list instances")
    list_.add_argument("--all", action="store_true", help="every device with a registry (not with --device)")
    list_.set_defaults(handler=cmd_list)
    set_limit = commands.add_parser("set-limit", parents=[common], help="set an instance's limit")
    set_limit.add_argument("target", metavar="NAME|PID")
    set_limit.add_argument("size", metavar="SIZE", help="e.g. 8G, 512MiB, 4096, 2GB")
    set_limit.set_defaults(handler=cmd_set_limit)
    clear_limit = commands.add_parser("clear-limit", parents=[common], help="remove an instance's limit")
    clear_limit.add_argument("target", metavar="NAME|PID")
    clear_limit.set_defaults(handler=cmd_clear_limit)
    set_budget = commands.add_parser("set-budget", parents=[common], help="set the device-wide budget")
    set_budget.add_argument("size", metavar="SIZE")
    set_budget.set_defaults(handler=cmd_set_budget)
    commands.add_parser("clean", parents=[common],
                        help="reclaim dead instances; remove old-style, damaged and unfinished registry files"
                        ).set_defaults(handler=cmd_clean)
    commands.add_parser("files", parents=[common], help="list the registry directory's files").set_defaults(
        handler=cmd_files
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "all", False) and hasattr(args, "device"):
        parser.error("list --all shows every device: give --device or --all, not both")
    args.all = getattr(args, "all", False)
    args.device = getattr(args, "device", HOST_DEVICE)
    args.json = getattr(args, "json", False)
    handler = getattr(args, "handler", cmd_list)
    failure = {"device": args.device}
    try:
        return handler(args)
    except (KvcachedError, ValueError, OSError, RuntimeError, TypeError) as error:
        return _fail(args.json, failure, str(error))
    except KeyboardInterrupt:
        return EXIT_FAILED
    except Exception as error:  # a command line answers in one line, never a traceback
        return _fail(args.json, failure, f"unexpected {type(error).__name__}: {error}")


if __name__ == "__main__":
    sys.exit(main())
