"""How kvctl answers: the JSON payload (``--json``) or a human line, and failures in one line."""

from __future__ import annotations

import json
from typing import Any

from kvcached.cli.support import EXIT_FAILED, report_failure
from kvcached.registry import registry_dir

EXIT_OK = 0


def emit(as_json: bool, payload: dict[str, Any], human: str) -> None:
    """Prints the payload as JSON, or the human text."""
    print(json.dumps(payload, indent=2, sort_keys=True) if as_json else human)


def fail(as_json: bool, payload: dict[str, Any], message: str) -> int:
    """Reports a failure (one line on stderr; with ``--json`` also ``{"error": ...}``); the exit code."""
    report_failure("kvctl", message, as_json, payload)
    return EXIT_FAILED


def no_registry(device: str) -> str:
    """What to say when ``device`` has no registry (kvctl never creates one)."""
    return (
        f"no registry for device {device!r} under {registry_dir()}: the first engine on the device "
        "creates it (check KVCACHED_REGISTRY_DIR)"
    )
