"""kvctl's commands that change live instances: set-limit, clear-limit and set-policy.

TARGET names instances: ``pid:1234``, ``name:llama`` or bare (all digits: a pid). The memory
policy (min, max = the limit, priority) is ``docs/memory-policy.md``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional, Union

from kvcached.cli.kvctl_output import EXIT_OK, emit, fail, no_registry
from kvcached.errors import InvalidArgumentError
from kvcached.registry import format_bytes, open_existing, printable
from kvcached.sizes import parse_bytes

PID_PREFIX, NAME_PREFIX = "pid:", "name:"
# Process ids are positive and fit pid_t (Linux's own ceiling is 2**22).
MAX_PID = 2**31 - 1
TARGET_HELP = "pid:1234, name:NAME, or bare (all digits: a pid; else a name)"


def _target(text: str) -> Union[int, bytes]:
    """The instance(s) TARGET names: ``pid:N``, ``name:TEXT``, or bare (all digits: a pid).

    Names are bytes, so names that are not UTF-8 match as stored."""
    if text.startswith(NAME_PREFIX):
        name = text[len(NAME_PREFIX) :]
        if not name:
            raise InvalidArgumentError(f"{text!r} names no instance: give a name after {NAME_PREFIX!r}")
        return os.fsencode(name)
    digits = text.removeprefix(PID_PREFIX)
    if not (digits.isascii() and digits.isdigit()):
        if text.startswith(PID_PREFIX):
            raise InvalidArgumentError(f"{text!r} is not a process id: expected {PID_PREFIX}<digits>")
        return os.fsencode(text)
    pid = int(digits)
    if not 0 < pid <= MAX_PID:
        raise InvalidArgumentError(
            f"{text!r} is not a process id (1 to {MAX_PID}); for an instance named so, write {NAME_PREFIX}{digits}"
        )
    return pid


def _priority(text: str) -> int:
    """A priority as KVCACHED_PRIORITY reads it (one grammar for both)."""
    from kvcached.config import OPTIONS

    try:
        return int(OPTIONS["priority"].parse(text.strip()))
    except ValueError as exc:
        raise InvalidArgumentError(f"--priority {text!r} is invalid: {exc}") from None


def _matches(entry: dict[str, Any], target: Union[int, bytes]) -> bool:
    if isinstance(target, int):
        return entry["pid"] == target
    # entries() decodes names the way this does, so equal bytes give equal text.
    return entry["name"] == target.decode("utf-8", "backslashreplace")


def _steer(args: argparse.Namespace, change: dict[str, Any], shown: dict[str, Any], action: str) -> int:
    """Applies a policy ``change`` (keywords of ``DeviceRegistry.set_policy``) to the live
    instances TARGET names; ``shown`` goes into the JSON payload, ``action`` into the line."""
    target = _target(args.target)
    payload: dict[str, Any] = {"device": args.device, "target": args.target, **shown}
    registry = open_existing(args.device)
    if registry is None:
        return fail(args.json, {**payload, "matched": 0}, no_registry(args.device))
    payload["device"] = registry.device
    found = [entry for entry in registry.entries() if _matches(entry, target)]
    if not found:
        return fail(
            args.json, {**payload, "matched": 0}, f"no instance named or with pid {args.target!r} on {registry.device}"
        )
    if not any(entry["alive"] for entry in found):
        # Its process is gone: a change would change nothing (and say "done" for nothing).
        pids = ", ".join(sorted({str(entry["pid"]) for entry in found}))
        return fail(
            args.json,
            {**payload, "matched": 0},
            f"{args.target!r} on {registry.device} is a dead instance (pid {pids}): "
            "nothing to change; 'kvctl clean' reclaims its memory",
        )
    matched = registry.set_policy(target, **change)
    payload["matched"] = matched
    if matched == 0:  # every match exited meanwhile
        return fail(args.json, payload, f"no instance named or with pid {args.target!r} on {registry.device}")
    emit(args.json, payload, f"{registry.device}: {printable(args.target)}: {action} ({matched} instance(s))")
    return EXIT_OK


def _set_limit(args: argparse.Namespace, max_bytes: Optional[int]) -> int:
    """set-limit and clear-limit: set-policy's max under the verbs people know (``limit_bytes`` in
    the JSON answer is max_bytes under its older name)."""
    change = {"max_bytes": max_bytes} if max_bytes is not None else {"clear_max": True}
    action = f"limit {format_bytes(max_bytes)}" if max_bytes is not None else "limit cleared"
    return _steer(args, change, {"max_bytes": max_bytes, "limit_bytes": max_bytes}, action)


def cmd_set_policy(args: argparse.Namespace) -> int:
    if args.min is None and args.max is None and args.priority is None:
        raise InvalidArgumentError("set-policy changes nothing: give --min, --max and/or --priority")
    change: dict[str, Any] = {}
    shown: dict[str, Any] = {}
    actions: list[str] = []
    if args.min is not None:
        change["min_bytes"] = shown["min_bytes"] = parse_bytes(args.min, "--min")
        actions.append(f"min {format_bytes(change['min_bytes'])}")
    if args.max is not None:
        if args.max.strip().lower() == "none":
            change["clear_max"], shown["max_bytes"] = True, None
            actions.append("max cleared")
        else:
            change["max_bytes"] = shown["max_bytes"] = parse_bytes(args.max, "--max")
            actions.append(f"max {format_bytes(change['max_bytes'])}")
    if args.priority is not None:
        change["priority"] = shown["priority"] = _priority(args.priority)
        actions.append(f"priority {change['priority']}")
    return _steer(args, change, shown, ", ".join(actions))


def cmd_set_limit(args: argparse.Namespace) -> int:
    return _set_limit(args, parse_bytes(args.size, "SIZE"))


def cmd_clear_limit(args: argparse.Namespace) -> int:
    return _set_limit(args, None)
