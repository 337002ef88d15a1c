"""What the command-line tools (kvcached, kvctl, kvtop) share: one-line errors, --version,
settings checked up front, errors as JSON under ``--json``, and a quiet end when the reader of
their output goes away."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Callable, NoReturn, Optional

from kvcached import config
from kvcached.errors import ConfigurationError
from kvcached.registry import printable

EXIT_FAILED = 1
EXIT_USAGE = 2
# The settings every tool that reads a registry depends on (the group is checked on opening one).
REGISTRY_OPTIONS = ("registry_dir", "registry_group", "gpu_utilization")


def one_line(text: str) -> str:
    """``text`` as one printable line (whitespace runs joined, control characters escaped)."""
    return printable(" ".join(str(text).split()))


def wants_json(argv: Optional[Sequence[str]]) -> bool:
    """Whether the command line (``argv``, default ``sys.argv[1:]``) asks for JSON output,
    known before it is parsed, so that even a usage error can be answered in JSON."""
    return "--json" in (sys.argv[1:] if argv is None else list(argv))


def report_failure(prog: str, message: str, as_json: bool, payload: Optional[dict[str, Any]] = None) -> None:
    """The one way a tool reports a failure: one line on stderr, and with ``--json`` also a JSON
    object on stdout with the same line under ``"error"`` (plus ``payload``)."""
    line = one_line(message)
    if as_json:
        print(json.dumps({**(payload or {}), "error": line}, indent=2, sort_keys=True))
    print(f"{prog}: error: {line}", file=sys.stderr)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (and exit code 2) instead of usage + error.

    With ``json_errors`` (the command line asked for ``--json``, see :func:`wants_json`) the
    error is also a JSON object on stdout."""

    def __init__(self, *args: Any, json_errors: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.json_errors = json_errors

    def error(self, message: str) -> NoReturn:
        prog = self.prog.split()[0]
        report_failure(self.prog, f"{message} (see {prog} --help)", self.json_errors, {"usage_error": True})
        sys.exit(EXIT_USAGE)


def add_version_argument(parser: argparse.ArgumentParser) -> None:
    """``--version``: prints the tool's name and the kvcached package version."""
    from kvcached import __version__

    parser.add_argument(
        "--version",
        action="version",
        version=f"{parser.prog} {__version__}",
        help="print the kvcached version and exit",
    )


def check_settings(names: Optional[Iterable[str]] = None) -> None:
    """Reads every ``KVCACHED_*`` option in ``names`` (default: all of them), so a bad value is
    one ConfigurationError naming its variable before any work starts."""
    for name in config.OPTIONS if names is None else names:
        config.get(name)


def quiet_on_broken_pipe(main: Callable[..., int]) -> Callable[..., int]:
    """``main``, ended quietly with status 1 when the reader of its output goes away (``kvctl list
    --json | head``) instead of printing BrokenPipeError tracebacks, as Python's documentation of
    SIGPIPE recommends: stdout is pointed at /dev/null so the interpreter's last flush has nowhere to fail."""

    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> int:
        try:
            status = main(*args, **kwargs)
            sys.stdout.flush()  # a reader gone before the last buffered line is found here, not at exit
            return status
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return EXIT_FAILED

    return run


def names_a_setting(error: BaseException) -> bool:
    """Whether ``error`` is about a ``KVCACHED_*`` setting (kvcached's messages then start with its name)."""
    return isinstance(error, ConfigurationError) or str(error).startswith("KVCACHED_")


__all__ = [
    "EXIT_FAILED",
    "EXIT_USAGE",
    "REGISTRY_OPTIONS",
    "OneLineArgumentParser",
    "add_version_argument",
    "check_settings",
    "names_a_setting",
    "one_line",
    "quiet_on_broken_pipe",
    "report_failure",
    "wants_json",
]
