"""The ``kvcached serve`` subcommand: read and check the config, then serve it (needs the ``serve`` extra)."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys

from kvcached.cli.support import check_settings
from kvcached.errors import ServeError

# What the serve extra (`pip install ".[serve]"` in a kvcached clone) brings: module name -> distribution name.
SERVE_REQUIREMENTS = {
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "httpx": "httpx",
    "yaml": "PyYAML",
    "prometheus_client": "prometheus_client",
}


def missing_requirements() -> list[str]:
    """The ``serve`` extra's distributions that are not installed here."""
    return [dist for module, dist in SERVE_REQUIREMENTS.items() if importlib.util.find_spec(module) is None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds serve's options to ``parser`` (the ``serve`` subparser of ``kvcached``)."""
    parser.add_argument("config", metavar="CONFIG.yaml", help="models, engines and memory policy (see docs/serve.md)")
    parser.add_argument(
        "--check", action="store_true", help="check the config and every model's Python, start nothing, and exit"
    )
    parser.add_argument(
        "--log-dir", metavar="DIR", help="engine logs (default: the config's log_dir, else a new temporary directory)"
    )


def _log_to_stderr(level: int) -> None:
    """Serve's own lines (engines started, ready, crashed, restarted; memory moved) on stderr, timed."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s kvcached serve: %(message)s", "%H:%M:%S"))
    serve_logger = logging.getLogger("kvcached.serve")
    serve_logger.addHandler(handler)
    serve_logger.setLevel(level)
    serve_logger.propagate = False


def run_command(args: argparse.Namespace) -> int:
    """Checks the whole config first (one error naming the key, before anything starts), then serves."""
    missing = missing_requirements()
    if missing:
        # Named one by one: "kvcached" on the package index is another project.
        raise ServeError(
            f"kvcached serve needs {', '.join(missing)}: pip install {' '.join(missing)} "
            '(or the whole serve extra: pip install ".[serve]" in a kvcached clone)'
        )
    from kvcached.serve.config import load_config
    from kvcached.serve.machine_checks import check_machine

    check_settings()  # a bad KVCACHED_* variable would fail in every engine
    config = load_config(args.config)
    check_machine(config, args.log_dir)  # log directory, model paths, every engine's Python
    if args.check:
        names = ", ".join(f"{spec.name} ({spec.engine})" for spec in config.models)
        print(f"{args.config}: ok: {len(config.models)} models on {config.device}: {names}")
        return 0
    _log_to_stderr(logging.DEBUG if args.verbose else logging.INFO)
    from kvcached.serve.server import run

    return run(config, args.log_dir, live_progress=sys.stderr.isatty())


__all__ = ["SERVE_REQUIREMENTS", "add_arguments", "missing_requirements", "run_command"]
