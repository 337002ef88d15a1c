"""Keeps every model's engine running: start, wait until it answers, watch, restart after a crash.

Each model has one :class:`Engine`, whose own thread runs its life: launch the engine's server
(its own process group, a fresh port), wait until it answers its readiness check, then wait for
it to exit. An engine that dies is reported, the rest of its process group is killed, its registry
entries are reclaimed (its memory returns to the budget) and it is started again after a backoff,
at most ``restart.max_attempts`` times in a row; meanwhile the router answers 503 for it and the
other models keep serving. An engine that fails before it was ever ready is not restarted: a bad
model or argument would fail again, so the start of ``kvcached serve`` fails and says why. So does
an engine that cannot even be launched (its log cannot be opened, its command cannot be run), and
whatever goes wrong in an engine's thread ends that engine as failed, never leaves it "starting".
"""

from __future__ import annotations

import enum
import logging
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import httpx

from kvcached.serve.config import ModelSpec, ServeConfig
from kvcached.serve.engine_logs import LAUNCH_HEADER, log_file_name, read_tail
from kvcached.serve.engines import ENGINE_HOST, ENGINES, engine_environment
from kvcached.serve.memory import DeviceMemory
from kvcached.serve.ports import PortBook
from kvcached.serve.processes import stop_group
from kvcached.sizes import format_bytes

logger = logging.getLogger(__name__)

READY_POLL_S = 1.0
READY_REQUEST_TIMEOUT_S = 30.0
# An engine that served this long before it died counts as healthy: its restart count starts over.
STABLE_AFTER_S = 300.0
LOG_TAIL_LINES = 30
STARTING_GRACE_S = 5.0
# What the start waits beyond startup_timeout_s for an engine's own verdict (killing a group takes up to 10 s).
STARTUP_SLACK_S = 15.0


class EngineState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"  # died; waiting out the backoff or starting again
    FAILED = "failed"  # given up: never ready, or too many restarts
    STOPPED = "stopped"


class Engine:
    """One model's engine process and the thread that keeps it running."""

    def __init__(
        self, spec: ModelSpec, config: ServeConfig, memory: DeviceMemory, log_path: Path, ports: PortBook
    ) -> None:
        self.spec = spec
        self.log_path = log_path
        self._config = config
        self._memory = memory
        self._ports = ports  # shared by every engine of this serve: no two are given one port
        self._kind = ENGINES[spec.engine]
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._process: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()
        self.state = EngineState.STARTING
        self.port: Optional[int] = None
        self.started_at = time.monotonic()  # of the current launch
        self.ready_after_s: Optional[float] = None  # of the current launch
        self.restarts = 0  # launches after the first
        self.crashes = 0
        self.failure: Optional[str] = None
        self.ever_ready = False
        # Set by the sleep manager where models may sleep: room made before each launch, and the
        # fresh (awake) engine reported once it answers.
        self.before_launch: Callable[[], None] = lambda: None
        self.on_ready: Callable[[], None] = lambda: None
        self.sleep_state: Callable[[], str] = lambda: "awake"

    @property
    def url(self) -> Optional[str]:
        """The engine's base URL while it is ready, else None."""
        return self.base_url if self.state is EngineState.READY else None

    @property
    def base_url(self) -> str:
        """The engine's base URL (of its current launch), whatever its state."""
        return f"http://{ENGINE_HOST}:{self.port}"

    @property
    def shown_state(self) -> str:
        """The state people see: the engine's, a ready model's sleep state instead of "ready" when it
        is not awake ("asleep", "waking", ...), and "waiting" for one started in turn, not yet launched."""
        if not self.launched and self.state is EngineState.STARTING:
            return "waiting"
        if self.state is EngineState.READY:
            sleep_state = self.sleep_state()
            return "ready" if sleep_state == "awake" else sleep_state
        return self.state.value

    @property
    def launched(self) -> bool:
        """Whether :meth:`start` was called (models that may sleep are started in turn)."""
        return self._thread is not None

    @property
    def pid(self) -> Optional[int]:
        process = self._process
        return process.pid if process is not None else None

    def start(self) -> None:
        """Starts the engine's thread (which launches the engine at once)."""
        thread = threading.Thread(target=self._run, name=f"engine-{self.spec.name}", daemon=True)
        thread.start()
        self._thread = thread  # launched from here on: seen alive until it ends

    def stop(self) -> None:
        """Stops the engine's whole process group and its thread; reclaims its registry entries."""
        self._stopping.set()
        with self._lock:
            process = self._process
        if process is not None:
            # An engine still loading has nothing to finish: it gets a short grace.
            grace_s = self._config.stop_timeout_s if self.state is EngineState.READY else STARTING_GRACE_S
            stop_group(process.pid, min(grace_s, self._config.stop_timeout_s))
            process.wait()
            self._memory.reclaim(self.spec.name)
        if self._thread is not None:
            self._thread.join()
        self.state = EngineState.STOPPED

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the engine's log."""
        return read_tail(self.log_path, lines)

    @property
    def thread_alive(self) -> bool:
        """Whether the engine's thread runs (False before :meth:`start` and once it has ended)."""
        return self._thread is not None and self._thread.is_alive()

    def _launch(self) -> subprocess.Popen:
        if self.port is not None:  # the last launch's process group is gone
            self._ports.give_back(self.port)
        self.port = self._ports.take(ENGINE_HOST)
        command = self._kind.command(self.spec, self.port)
        env = engine_environment(self.spec, self._config.device)
        self.started_at = time.monotonic()
        self.ready_after_s = None
        with open(self.log_path, "a") as log:
            log.write(f"\n{LAUNCH_HEADER}{' '.join(command)} ({time.strftime('%Y-%m-%d %H:%M:%S')}) ===\n")
            log.flush()
            process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        logger.info(
            "%s: started %s (pid %d, port %d, log %s)",
            self.spec.name,
            self.spec.engine,
            process.pid,
            self.port,
            self.log_path,
        )
        return process

    def _answers(self, client: httpx.Client) -> bool:
        try:
            response = client.get(f"http://{ENGINE_HOST}:{self.port}{self._kind.ready_path}")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def _wait_ready(self, process: subprocess.Popen) -> Optional[str]:
        """Waits until the engine answers its readiness check; None when it does, else why not."""
        deadline = self.started_at + self._config.startup_timeout_s
        with httpx.Client(timeout=READY_REQUEST_TIMEOUT_S) as client:
            while not self._stopping.is_set():
                if process.poll() is not None:
                    return f"exited with {_exit_text(process.returncode)} while starting"
                if self._answers(client):
                    return None
                if time.monotonic() > deadline:
                    return f"not ready within startup_timeout_s ({self._config.startup_timeout_s:.0f} s)"
                self._stopping.wait(READY_POLL_S)
        return "stopped"

    def _clean_up(self, process: subprocess.Popen) -> None:
        """Kills what is left of the engine's group and returns its memory to the budget."""
        stop_group(process.pid, self._config.stop_timeout_s, force=True)
        process.wait()
        returned = self._memory.reclaim(self.spec.name)
        if returned:
            logger.warning("%s: %s of KV memory returned to the device budget", self.spec.name, format_bytes(returned))

    def _run(self) -> None:
        try:
            self._keep_running()
        except Exception as exc:  # a fault of serve's own: the model fails, the start or restart does not hang
            logger.exception("%s: the engine's supervision failed", self.spec.name)
            self.failure = f"{self.spec.name}: supervising the engine failed: {_reason(exc)} (log: {self.log_path})"
            self.state = EngineState.FAILED

    def _keep_running(self) -> None:
        attempts = 0
        while not self._stopping.is_set():
            problem, served_s = self._run_once()
            if self._stopping.is_set():
                return
            if problem is not None and not self.ever_ready:
                self.failure, self.state = (
                    f"{self.spec.name}: engine {problem} (log: {self.log_path})",
                    EngineState.FAILED,
                )
                return
            if served_s >= STABLE_AFTER_S:
                attempts = 0
            attempts += 1
            if attempts > self._config.restart.max_attempts:
                self.failure = f"{self.spec.name}: gave up after {attempts - 1} restarts (log: {self.log_path})"
                self.state = EngineState.FAILED
                logger.error("%s", self.failure)
                return
            delay_s = self._config.restart.delay_s(attempts)
            self.state = EngineState.RESTARTING
            logger.warning(
                "%s: restarting in %.1f s (attempt %d of %d)",
                self.spec.name,
                delay_s,
                attempts,
                self._config.restart.max_attempts,
            )
            if self._stopping.wait(delay_s):
                return
            self.restarts += 1

    def _run_once(self) -> tuple[Optional[str], float]:
        """Launches the engine and follows it to its end: why it never got ready (None: it was ready,
        then exited) and how long it served."""
        self.before_launch()
        with self._lock:
            if self._stopping.is_set():
                return None, 0.0
            try:
                process = self._process = self._launch()
            except (OSError, ValueError, subprocess.SubprocessError) as exc:
                problem = f"could not be launched: {_reason(exc)}"
                logger.error("%s: engine %s", self.spec.name, problem)
                return problem, 0.0
        self.state = EngineState.STARTING
        problem = self._wait_ready(process)
        if self._stopping.is_set():
            return problem, 0.0  # stop() cleans up
        served_s = 0.0
        if problem is None:
            self.ready_after_s = time.monotonic() - self.started_at
            self.state, self.ever_ready = EngineState.READY, True
            logger.info("%s: ready after %.1f s", self.spec.name, self.ready_after_s)
            self.on_ready()
            process.wait()
            if self._stopping.is_set():
                return None, 0.0
            self.state = EngineState.RESTARTING
            self.crashes += 1
            served_s = time.monotonic() - self.started_at
            logger.error(
                "%s: engine exited with %s after %.0f s", self.spec.name, _exit_text(process.returncode), served_s
            )
        else:
            logger.error(
                "%s: engine %s; last lines of %s:\n%s", self.spec.name, problem, self.log_path, self.log_tail()
            )
        self._clean_up(process)
        return problem, served_s


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _exit_text(returncode: Optional[int]) -> str:
    if returncode is not None and returncode < 0:
        return f"signal {-returncode}"
    return f"exit code {returncode}"


class Supervisor:
    """Every model's :class:`Engine`, started together (or in turn, where models may sleep) and stopped together."""

    def __init__(self, config: ServeConfig, memory: DeviceMemory, log_dir: Path) -> None:
        self.config = config
        self.ports = PortBook()
        self.engines = {
            spec.name: Engine(spec, config, memory, log_dir / log_file_name(spec.name), self.ports)
            for spec in config.models
        }
        self._stopping = threading.Event()

    def start(self) -> None:
        """Starts every engine: all at once, or, where models may sleep, each once the one before
        answers, so that room can be made for it by putting earlier ones to sleep (the engines'
        ``before_launch``) — the models' weights may add up to more than the budget."""
        if not self.config.can_sleep:
            for engine in self.engines.values():
                engine.start()
            return
        threading.Thread(target=self._start_in_turn, name="serve-start-in-turn", daemon=True).start()

    def _start_in_turn(self) -> None:
        for engine in self.engines.values():
            if self._stopping.is_set():
                return
            engine.start()
            while engine.state not in (EngineState.READY, EngineState.FAILED) and engine.thread_alive:
                if self._stopping.wait(READY_POLL_S):
                    return
            if engine.state is not EngineState.READY:
                return  # the start fails (wait_ready says why); the rest are never launched

    def wait_ready(self, should_stop: Callable[[], bool], on_tick: Callable[[], None] = lambda: None) -> Optional[str]:
        """Waits until every engine is ready; None then, else why not (a failure, or a stop request).

        Each engine applies ``startup_timeout_s`` to itself; this wait applies it too, to all of
        them, and notices an engine whose thread ended without a verdict, so it always ends."""
        in_turn = len(self.engines) if self.config.can_sleep else 1
        deadline = time.monotonic() + self.config.startup_timeout_s * in_turn + STARTUP_SLACK_S
        while True:
            on_tick()
            failed = [e.failure for e in self.engines.values() if e.state is EngineState.FAILED]
            if failed:
                return "; ".join(str(f) for f in failed)
            if should_stop():
                return "stopped by a signal while starting"
            waiting = [e for e in self.engines.values() if e.state is not EngineState.READY]
            if not waiting:
                return None
            ended = [
                e.spec.name for e in waiting if e.launched and not e.thread_alive and e.state is not EngineState.FAILED
            ]
            if ended:
                return f"{', '.join(ended)}: the engine's supervision ended before it was ready"
            if time.monotonic() > deadline:
                names = ", ".join(e.spec.name for e in waiting)
                return f"{names}: not ready within startup_timeout_s ({self.config.startup_timeout_s:g} s)"
            time.sleep(0.2)

    def route(self, name: str) -> Optional[Engine]:
        """The engine serving model ``name``, or None for a model not configured."""
        return self.engines.get(name)

    def stop(self) -> None:
        """Stops every engine at once (SIGTERM to every group, then SIGKILL after stop_timeout_s)."""
        self._stopping.set()  # no further engine is started in turn
        threads = [threading.Thread(target=engine.stop) for engine in self.engines.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


__all__ = ["Engine", "EngineState", "Supervisor"]
