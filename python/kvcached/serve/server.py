"""One ``kvcached serve`` run: set up the device, start the engines, listen, and stop it all cleanly.

Order matters: the listening address is bound first (a port in use fails before any engine
starts) but accepts nothing until every engine is ready; SIGINT and SIGTERM, whenever they come,
stop every engine's process group and leave no registry entry behind.
"""

from __future__ import annotations

import functools
import logging
import signal
import socket
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Optional

import uvicorn

from kvcached.errors import ServeError
from kvcached.serve.config import ServeConfig
from kvcached.serve.memory import DeviceMemory
from kvcached.serve.metrics import ServeMetrics
from kvcached.serve.progress import StartupProgress
from kvcached.serve.router import create_app
from kvcached.serve.sleep_manager import SleepManager
from kvcached.serve.supervisor import Supervisor

logger = logging.getLogger(__name__)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeError(f"listen: cannot use {host}:{port}: {exc.strerror or exc}; choose another address") from None
    return sock


class _StopRequest:
    """SIGINT / SIGTERM while engines start: remembered, so the start stops and cleans up."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _StopRequest:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, _frame: Optional[FrameType]) -> None:
        logger.warning("%s received: stopping", signal.Signals(signum).name)
        self.requested.set()

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]


def _sleep_manager(
    config: ServeConfig, memory: DeviceMemory, supervisor: Supervisor, metrics: ServeMetrics
) -> Optional[SleepManager]:
    """Where models may sleep: the manager that decides who is awake, hooked to every engine."""
    if not config.can_sleep:
        return None
    sleep = SleepManager(config, memory, supervisor.engines, on_wake=metrics.woke, on_sleep=metrics.slept)
    for name, engine in supervisor.engines.items():
        engine.before_launch = functools.partial(sleep.before_launch, name)
        engine.on_ready = functools.partial(sleep.engine_ready, name)
        engine.sleep_state = functools.partial(lambda model: sleep.state(model).value, name)
    metrics.watch_sleep(sleep)
    return sleep


def run(config: ServeConfig, log_dir: Optional[str] = None, live_progress: Optional[bool] = None) -> int:
    """Serves ``config`` until SIGINT or SIGTERM; 0 after a clean stop. Raises :class:`ServeError`
    (every engine already stopped) when the engines cannot all be started."""
    logs = Path(log_dir or config.log_dir or tempfile.mkdtemp(prefix="kvcached-serve-"))
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ServeError(f"log_dir: cannot create {logs}: {exc.strerror or exc}") from None
    sock = _bind(config.host, config.port)
    memory = DeviceMemory(config)
    supervisor = Supervisor(config, memory, logs)
    metrics = ServeMetrics(list(config.models), memory, supervisor.engines)
    sleep = _sleep_manager(config, memory, supervisor, metrics)
    with _StopRequest() as stop:
        try:
            logger.info("engine logs in %s", logs)
            supervisor.start()
            with StartupProgress(supervisor.engines, live=live_progress) as progress:
                problem = supervisor.wait_ready(stop.requested.is_set, progress.tick)
            if problem is not None:
                if stop.requested.is_set():
                    return 0
                raise ServeError(f"engines could not all be started: {problem}")
            metrics.start_sampling()
            if sleep is not None:
                sleep.start()
            app = create_app(supervisor, [spec.name for spec in config.models], metrics, sleep=sleep)
            server = uvicorn.Server(
                uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
            )
            logger.info("serving %d models on http://%s:%d/v1", len(config.models), config.host, config.port)
            if not stop.requested.is_set():
                # uvicorn handles SIGINT / SIGTERM itself while it runs, then hands them back to _StopRequest.
                server.run(sockets=[sock])
            return 0
        finally:
            metrics.stop_sampling()
            if sleep is not None:
                sleep.stop()
            supervisor.stop()
            memory.restore_budget()
            sock.close()
            logger.info("stopped: every engine's processes are gone")


__all__ = ["run"]
