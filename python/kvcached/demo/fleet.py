"""The demo's engine processes: started fresh (forkserver, else spawn), one command queue each."""

from __future__ import annotations

import logging
import multiprocessing
import queue
from typing import Any, Optional

from kvcached.demo.block_pattern import needs_torch
from kvcached.demo.config import DemoConfig, Geometry
from kvcached.demo.engine import PoolShape, engine_main
from kvcached.errors import DemoError

logger = logging.getLogger(__name__)


def engine_name(engine: int) -> str:
    """The name an engine registers under."""
    return f"demo-engine-{engine}"


def _process_context(device: str) -> Any:
    """Fresh engine processes, with torch (on a GPU) imported once rather than once per engine.

    Like spawn, forkserver children never inherit this process's threads or
    device state; they are forked from a clean server that has imported torch
    and the engine code, which saves several seconds of CPU per engine (and
    their slow exit) on a small machine. Where forkserver is missing, spawn.
    """
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        preload = ["torch"] if needs_torch(device) else []
        context.set_forkserver_preload(preload + ["kvcached.demo.engine"])
        return context
    return multiprocessing.get_context("spawn")


class EngineFleet:
    """The engine processes and the two queues per engine that talk to them."""

    def __init__(self, config: DemoConfig, geometry: Geometry, registry_dir: str) -> None:
        context = _process_context(config.device)
        shape = PoolShape(
            device=config.device,
            num_layers=config.num_layers,
            num_buffers=config.num_buffers,
            block_bytes=config.block_bytes,
            num_blocks=geometry.num_blocks,
        )
        self.events = context.Queue()
        self.commands = [context.Queue() for _ in range(config.engines)]
        self.processes = [
            context.Process(
                target=engine_main,
                args=(
                    engine,
                    engine_name(engine),
                    shape,
                    registry_dir,
                    self.commands[engine],
                    self.events,
                    logging.getLogger().getEffectiveLevel(),
                ),
                name=engine_name(engine),
                daemon=True,
            )
            for engine in range(config.engines)
        ]
        for process in self.processes:
            process.start()

    def send(self, engine: int, message: tuple) -> None:
        self.commands[engine].put(message)

    def next_event(self, timeout_s: float) -> Optional[tuple]:
        """The next message from any engine, or None after ``timeout_s``; raises if one died."""
        try:
            event = self.events.get(timeout=timeout_s)
        except queue.Empty:
            event = None
        if event is not None and event[0] == "error":
            raise DemoError(f"{engine_name(event[1])} failed:\n{event[3]}")
        for process in self.processes:
            if event is None and process.exitcode not in (None, 0):
                raise DemoError(f"{process.name} exited with code {process.exitcode}")
        return event

    def stop(self) -> None:
        """Asks every engine to exit; terminates (only) our own engines that do not."""
        for engine, process in enumerate(self.processes):
            if process.is_alive():
                self.send(engine, ("stop",))
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                logger.warning("%s did not stop; terminating it", process.name)
                process.terminate()
                process.join(timeout=5)


__all__ = ["EngineFleet", "engine_name"]
