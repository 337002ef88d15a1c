"""kvctl: inspect and steer the kvcached instances sharing a device.

    kvctl list                          instances: KV memory, model weights (asleep or not), limits
    kvctl list --all                    the same for every device with a registry, each once
    kvctl set-limit TARGET SIZE         cap a live instance (it shrinks lazily)
    kvctl clear-limit TARGET            remove that cap
    kvctl set-policy TARGET [--min SIZE] [--max SIZE|none] [--priority N]
                                        its memory policy (docs/memory-policy.md); max is the limit
    kvctl set-budget SIZE               change the budget of a device's registry
    kvctl clean                         reclaim dead instances and unusable registry files
    kvctl files                         every registry file in the directory, with its status

Every command takes ``--device`` (default cpu; a GPU as this process sees it,
``cuda:0``, or its registry name, ``cuda-GPU-<uuid>``) and ``--json``
(machine-readable output). Sizes are exact: 4096, 512MiB, 8G (powers of 1024)
or 2GB (powers of 1000); see docs/configuration.md.

TARGET names instances: ``pid:1234`` (by process id), ``name:llama`` (by
name, whatever its characters), or bare: all digits is a pid, anything else a
name. Only live instances can be limited; ``kvctl clean`` reclaims dead ones.

kvctl never creates a registry: the first engine on a device does. Every
failure is one line on stderr and a non-zero exit (1: the operation failed or
a KVCACHED_* setting is bad, 2: bad usage); with ``--json`` the same line is
also printed on stdout as ``{"error": ...}``. ``--version`` prints the version.
Also runs as ``python -m kvcached.kvctl``.
"""

from __future__ import annotations

import argparse
import functools
import pwd
import sys
from collections.abc import Sequence
from typing import Any, Optional

from kvcached.cli.kvctl_output import EXIT_OK, emit, fail, no_registry
from kvcached.cli.kvctl_steer import TARGET_HELP, cmd_clear_limit, cmd_set_limit, cmd_set_policy
from kvcached.cli.support import (
    EXIT_FAILED,
    REGISTRY_OPTIONS,
    OneLineArgumentParser,
    add_version_argument,
    check_settings,
    quiet_on_broken_pipe,
    report_failure,
    wants_json,
)
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
    resolve_device,
)
from kvcached.sizes import parse_bytes


def _device_summary(registry: DeviceRegistry) -> dict[str, Any]:
    return {
        "device": registry.device,
        "local_device": registry.local_device,
        "path": registry.path,
        "exists": True,
        "budget_bytes": registry.budget_bytes,
        "mapped_bytes": registry.mapped_bytes,  # KV caches only
        "weights_bytes": registry.weights_bytes,  # model weights awake now (docs/sleep.md)
        "available_bytes": registry.available_bytes,
    }


def _held_bytes(summary: dict[str, Any]) -> int:
    """What a device's instances hold of its budget: their KV caches and their awake weights."""
    return summary["mapped_bytes"] + summary["weights_bytes"]


def _state(entry: dict[str, Any]) -> str:
    """alive, asleep (alive, its weights sleeping) or dead."""
    if not entry["alive"]:
        return "dead"
    return "asleep" if entry["sleeping"] else "alive"


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _instances_table(entries: list[dict[str, Any]]) -> str:
    header = (
        "NAME", "PID", "USER", "AS", "STATE", "USED", "FREE-MAPPED", "MAPPED", "WEIGHTS", "MIN", "LIMIT", "PRIO", "SHRINK-TO",
        "WANTS", "ERRORS",
    )  # fmt: skip
    rows = [header] + [
        (
            printable(entry["name"]),
            str(entry["pid"]),
            _user_name(entry["uid"]),
            printable(entry["local_device"]) or "-",
            _state(entry),
            format_bytes(entry["used_bytes"]),
            format_bytes(entry["free_mapped_bytes"]),
            format_bytes(entry["mapped_bytes"]),
            format_bytes(entry["weights_bytes"]) if entry["weights_bytes"] else "-",
            format_bytes(entry["min_bytes"]) if entry["min_bytes"] else "-",
            format_bytes(entry["max_bytes"]),
            str(entry["priority"]),
            format_bytes(entry["reclaim_target_bytes"]) if entry["reclaim_target_bytes"] is not None else "-",
            format_bytes(entry["wanted_bytes"]) if entry["wanted_bytes"] else "-",
            str(entry["worker_errors"]) if entry["worker_errors"] else "-",
        )
        for entry in entries
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def _registry_label(registry: DeviceRegistry) -> str:
    """ "cuda-GPU-… (cuda:0 here)" or "cpu"."""
    local = registry.local_device
    return registry.device if not local or local == registry.device else f"{registry.device} ({local} here)"


def _device_listing(registry: DeviceRegistry) -> tuple[dict[str, Any], str]:
    """One device's summary and instances: the JSON payload and the human text."""
    payload = {**_device_summary(registry), "instances": registry.entries()}
    human = (
        f"{_registry_label(registry)}: budget {format_bytes(payload['budget_bytes'])}, "
        f"held {format_bytes(_held_bytes(payload))} (KV {format_bytes(payload['mapped_bytes'])}, "
        f"weights {format_bytes(payload['weights_bytes'])}), "
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
    emit(args.json, payload, "\n\n".join(blocks))
    return EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    if args.all:
        return _list_all(args)
    registry = open_existing(args.device)
    if registry is None:
        name = resolve_device(args.device)
        payload = {
            "device": name.registry,
            "local_device": name.local,
            "path": DeviceRegistry.segment_path(name.registry),
            "exists": False,
            "instances": [],
        }
        emit(args.json, payload, f"{name.registry}: no registry yet (no engine has registered)")
        return EXIT_OK
    payload, human = _device_listing(registry)
    emit(args.json, payload, human)
    return EXIT_OK


def cmd_set_budget(args: argparse.Namespace) -> int:
    budget_bytes = parse_bytes(args.size, "SIZE")
    registry = open_existing(args.device)
    if registry is None:
        # kvctl never creates a registry: a typo in KVCACHED_REGISTRY_DIR must not start a new one.
        raise RegistryNotFoundError(no_registry(args.device) + "; set its budget once it exists")
    previous = registry.budget_bytes
    registry.budget_bytes = budget_bytes
    payload = {**_device_summary(registry), "previous_budget_bytes": previous}
    over = _held_bytes(payload) > budget_bytes
    note = " (over budget: instances shrink as they free memory)" if over else ""
    emit(
        args.json, payload, f"{registry.device}: budget {format_bytes(previous)} -> {format_bytes(budget_bytes)}{note}"
    )
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
        return fail(args.json, payload, str(unusable))
    lines = [f"{device}: reclaimed {cleaned} stale entr{'y' if cleaned == 1 else 'ies'}"]
    lines += [f"removed {printable(file['path'])}: {printable(file['detail'])}" for file in removed]
    emit(args.json, payload, "\n".join(lines))
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
    emit(args.json, payload, "\n".join(lines))
    return EXIT_OK


def build_parser(json_errors: bool = False) -> argparse.ArgumentParser:
    """kvctl's parser; ``json_errors``: usage errors are also JSON on stdout (``--json`` given)."""
    # --device/--json are accepted both before and after the command; SUPPRESS
    # keeps a subcommand's unset copy from overwriting the top-level value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--device",
        default=argparse.SUPPRESS,
        help=f"device: cpu, cuda:0, or a registry name such as cuda-GPU-<uuid> (default {HOST_DEVICE})",
    )
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")

    parser = OneLineArgumentParser(
        prog="kvctl", description=__doc__.split("\n\n")[0], parents=[common], json_errors=json_errors
    )
    add_version_argument(parser)
    subparser = functools.partial(OneLineArgumentParser, json_errors=json_errors)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=subparser)
    list_ = commands.add_parser("list", parents=[common], help="list instances")
    list_.add_argument("--all", action="store_true", help="every device with a registry (not with --device)")
    list_.set_defaults(handler=cmd_list)
    set_limit = commands.add_parser("set-limit", parents=[common], help="set an instance's limit")
    set_limit.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    set_limit.add_argument("size", metavar="SIZE", help="e.g. 8G, 512MiB, 4096, 2GB")
    set_limit.set_defaults(handler=cmd_set_limit)
    clear_limit = commands.add_parser("clear-limit", parents=[common], help="remove an instance's limit")
    clear_limit.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    clear_limit.set_defaults(handler=cmd_clear_limit)
    set_policy = commands.add_parser(
        "set-policy", parents=[common], help="set an instance's memory policy: min, max (its limit), priority"
    )
    set_policy.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    set_policy.add_argument("--min", metavar="SIZE", help="memory guaranteed to it (0: none)")
    set_policy.add_argument("--max", metavar="SIZE", help="its limit, as set-limit ('none' clears it)")
    set_policy.add_argument("--priority", metavar="N", help="higher wins; lower gives back first")
    set_policy.set_defaults(handler=cmd_set_policy)
    set_budget = commands.add_parser("set-budget", parents=[common], help="set the device-wide budget")
    set_budget.add_argument("size", metavar="SIZE")
    set_budget.set_defaults(handler=cmd_set_budget)
    commands.add_parser(
        "clean",
        parents=[common],
        help="reclaim dead instances; remove old-style, damaged and unfinished registry files",
    ).set_defaults(handler=cmd_clean)
    commands.add_parser("files", parents=[common], help="list the registry directory's files").set_defaults(
        handler=cmd_files
    )
    return parser


@quiet_on_broken_pipe
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser(json_errors=wants_json(argv))
    args = parser.parse_args(argv)
    if getattr(args, "all", False) and hasattr(args, "device"):
        parser.error("list --all shows every device: give --device or --all, not both")
    args.all = getattr(args, "all", False)
    args.device = getattr(args, "device", HOST_DEVICE)
    args.json = getattr(args, "json", False)
    handler = getattr(args, "handler", cmd_list)
    failure = {"device": args.device}
    try:
        check_settings(REGISTRY_OPTIONS)
    except (KvcachedError, ValueError) as error:
        report_failure("kvctl", str(error), args.json, failure)
        return EXIT_FAILED
    try:
        return handler(args)
    except BrokenPipeError:
        raise  # the reader went away: nothing to report (quiet_on_broken_pipe)
    except (KvcachedError, ValueError, OSError, RuntimeError, TypeError) as error:
        return fail(args.json, failure, str(error))
    except KeyboardInterrupt:
        return EXIT_FAILED
    except Exception as error:  # a command line answers in one line, never a traceback
        return fail(args.json, failure, f"unexpected {type(error).__name__}: {error}")


if __name__ == "__main__":
    sys.exit(main())
