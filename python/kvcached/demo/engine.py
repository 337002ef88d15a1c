"""One demo engine: a child process that serves its request schedule from a KVPool.

Each engine registers its pool in the device registry, so all engines draw on
one device budget (the elastic run); in the static run each pool also has a
fixed limit of ``budget / N``. The scheduler is a small copy of what serving
engines do (vLLM's, in spirit): requests are admitted first come, first served
when their prompt's blocks can be allocated; running requests add one block
per decode step and take priority over admissions; when a decode step finds no
memory the most recently admitted request is preempted (its blocks freed, it
goes back to the head of the queue to be recomputed). A queued request that is
still not admitted ``wait_timeout_s`` after it arrived is refused.

Every block a request holds is filled, through a view of the pool's DLPack
tensor (:mod:`kvcached.demo.block_pattern`), with a value unique to that request and block, and checked
before it is freed: any mismatch (a block shared with another request, a page
unmapped under a live block) counts as a data-check failure.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import os
import queue
import signal
import time
import traceback
from typing import Any, Optional

import numpy as np

from kvcached.demo.block_pattern import BlockPattern, needs_torch
from kvcached.demo.traffic import Request
from kvcached.errors import DemoError

logger = logging.getLogger(__name__)

# How often the scheduler runs; also the resolution of "admitted at once".
TICK_S = 0.01
# How often an engine tells the parent its counters and memory (live view, plot).
PROGRESS_INTERVAL_S = 0.1
# Each engine keeps one mapped free page ready and no pre-created spares. The
# library's defaults (up to 4 free pages and 2 spares per pool) suit one engine
# per device; with a shared budget an idle engine would sit on 6 page ids,
# because pools do not yet give their reserve back when others are refused.
RESERVE_PAGES = 1
SPARE_PAGES_ENV = "KVCACHED_MAX_SPARE_PAGES"
SPARE_PAGES = 0
# After the schedule ends, running requests finish; past this extra time the
# engine stops anyway (a safety net: it never triggers in a healthy run).
DRAIN_GRACE_S = 10.0
# While idle, an engine checks this often that the demo process still exists.
PARENT_POLL_S = 1.0


@dataclasses.dataclass(frozen=True)
class PoolShape:
    """The KV cache every engine builds (all engines alike)."""

    device: str
    num_layers: int
    num_buffers: int
    block_bytes: int
    num_blocks: int


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of one engine: its requests and the memory rules it runs under."""

    run_name: str
    limit_bytes: Optional[int]
    requests: list[Request]
    decode_step_s: float
    wait_timeout_s: float
    duration_s: float


@dataclasses.dataclass
class RequestState:
    """A request as the scheduler sees it."""

    request: Request
    queued_tick: int = -1  # scheduler step in which it joined the queue
    admitted_s: Optional[float] = None  # first admission, seconds from run start
    at_once: bool = False
    refused: bool = False
    completed: bool = False
    preemptions: int = 0
    decoded_blocks: int = 0
    next_decode_s: float = 0.0
    blocks: list[int] = dataclasses.field(default_factory=list)

    def pattern(self, first: int, count: int) -> np.ndarray:
        """The values blocks ``first .. first+count-1`` of this request must hold."""
        base = ((self.request.engine + 1) << 56) | (self.request.request_id << 16)
        return base + np.arange(first, first + count, dtype=np.int64)


class EngineScheduler:
    """Serves one engine's schedule against its pool; counts everything the summary needs."""

    def __init__(self, engine: int, pool: Any, spec: RunSpec, events: Any) -> None:
        from kvcached.errors import OutOfMemoryError

        self._oom = OutOfMemoryError
        self.engine = engine
        self.pool = pool
        self.spec = spec
        self.events = events
        self.pattern = BlockPattern(pool)
        self.states = [RequestState(request) for request in spec.requests]
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.running: list[RequestState] = []  # in admission order
        self.tick = 0
        self.next_arrival = 0
        self.preemptions = 0
        self.blocks_checked = 0
        self.data_check_failures = 0

    # -- block life -------------------------------------------------------------------

    def _take_blocks(self, state: RequestState, count: int) -> None:
        ids = [int(i) for i in self.pool.alloc(count)]  # raises OutOfMemoryError
        self.pattern.write(ids, state.pattern(len(state.blocks), count))
        state.blocks.extend(ids)

    def _release_blocks(self, state: RequestState) -> None:
        if state.blocks:
            failures = self.pattern.count_mismatches(state.blocks, state.pattern(0, len(state.blocks)))
            if failures:
                logger.error(
                    "engine %d: request %d: %d block(s) failed the data check",
                    self.engine,
                    state.request.request_id,
                    failures,
                )
            self.data_check_failures += failures
            self.blocks_checked += len(state.blocks)
            self.pool.free(state.blocks)
            state.blocks = []

    # -- scheduling --------------------------------------------------------------------

    def _arrivals(self, now_s: float) -> None:
        requests = self.spec.requests
        while self.next_arrival < len(requests) and requests[self.next_arrival].arrival_s <= now_s:
            state = self.states[self.next_arrival]
            state.queued_tick = self.tick
            self.waiting.append(state)
            self.next_arrival += 1

    def _finish(self) -> None:
        for state in [s for s in self.running if s.decoded_blocks >= s.request.decode_blocks]:
            self._release_blocks(state)
            state.completed = True
            self.running.remove(state)

    def _preempt_newest(self) -> RequestState:
        victim = self.running.pop()
        self._release_blocks(victim)
        victim.preemptions += 1
        self.preemptions += 1
        # Recomputed first when memory comes back, like vLLM's recompute preemption.
        self.waiting.appendleft(victim)
        return victim

    def _decode(self, now_s: float) -> None:
        for state in list(self.running):
            if state not in self.running or now_s < state.next_decode_s:
                continue  # preempted by an earlier request in this step, or not due yet
            while True:
                try:
                    self._take_blocks(state, 1)
                    break
                except self._oom:
                    # Decode goes first: make room by preempting the newest request.
                    if self._preempt_newest() is state:
                        break
            if state in self.running:
                state.decoded_blocks += 1
                state.next_decode_s = now_s + self.spec.decode_step_s

    def _admit(self, now_s: float) -> None:
        while self.waiting:
            state = self.waiting[0]
            first_admission = state.admitted_s is None
            if first_admission and now_s - state.request.arrival_s > self.spec.wait_timeout_s:
                state.refused = True
                self.waiting.popleft()
                continue
            try:
                # A preempted request recomputes everything it had decoded.
                self._take_blocks(state, state.request.prompt_blocks + state.decoded_blocks)
            except self._oom:
                return  # first come, first served: nobody overtakes the head
            self.waiting.popleft()
            if first_admission:
                state.admitted_s = now_s
                state.at_once = state.queued_tick == self.tick
            state.next_decode_s = now_s + self.spec.decode_step_s
            self.running.append(state)

    def counters(self) -> dict[str, int]:
        """Running totals and memory in use, for the live view and the plot."""
        admitted = [s for s in self.states if s.admitted_s is not None]
        stats = self.pool.stats()
        return {
            # The pool's own figures: the registry's copy of "used" is refreshed
            # only when pages are mapped or unmapped, so it can lag behind.
            "used_block_bytes": stats["used_bytes"],  # blocks held by requests
            "used_page_bytes": stats["used_pages"] * stats["page_id_bytes"],  # pages holding them
            "arrived": self.next_arrival,
            "at_once": sum(s.at_once for s in admitted),
            "delayed": sum(not s.at_once for s in admitted),
            "refused": sum(s.refused for s in self.states),
            "waiting": len(self.waiting),
            "running": len(self.running),
            "preemptions": self.preemptions,
            "data_check_failures": self.data_check_failures,
        }

    def run(self, start_monotonic: float) -> None:
        """Serves the schedule from ``start_monotonic`` until every request is done or refused."""
        deadline_s = self.spec.duration_s + self.spec.wait_timeout_s + DRAIN_GRACE_S
        next_progress_s = 0.0
        while True:
            now_s = time.monotonic() - start_monotonic
            if now_s < 0:
                time.sleep(-now_s)
                continue
            self._arrivals(now_s)
            self._finish()
            self._decode(now_s)
            self._admit(now_s)
            if now_s >= next_progress_s:
                self.events.put(("progress", self.engine, self.spec.run_name, self.counters()))
                next_progress_s = now_s + PROGRESS_INTERVAL_S
            done = self.next_arrival == len(self.states) and not self.waiting and not self.running
            if done:
                break
            if now_s > deadline_s:
                logger.warning(
                    "engine %d: drain deadline passed with %d running, %d waiting",
                    self.engine,
                    len(self.running),
                    len(self.waiting),
                )
                break
            self.tick += 1
            # Sleep to the next tick boundary, not a fixed time, so work does not stretch the clock.
            time.sleep(max(0.0, TICK_S - ((time.monotonic() - start_monotonic) - now_s)))
        # Whatever the safety net left behind is checked and freed, never leaked.
        for state in self.running + list(self.waiting):
            self._release_blocks(state)
        self.events.put(("progress", self.engine, self.spec.run_name, self.counters()))

    def result(self) -> dict[str, Any]:
        """Per-request outcomes and counters, as plain data for the parent."""
        return {
            "requests": [
                {
                    "request_id": s.request.request_id,
                    "arrival_s": s.request.arrival_s,
                    "admitted_s": s.admitted_s,
                    "outcome": "refused"
                    if s.refused
                    else ("at_once" if s.at_once else ("delayed" if s.admitted_s is not None else "unserved")),
                    "completed": s.completed,
                    "preemptions": s.preemptions,
                }
                for s in self.states
            ],
            "preemptions": self.preemptions,
            "blocks_checked": self.blocks_checked,
            "data_check_failures": self.data_check_failures,
        }


def _next_command(commands: Any) -> tuple:
    """The parent's next message; exits quietly if the parent has gone away."""
    while True:
        try:
            return commands.get(timeout=PARENT_POLL_S)
        except queue.Empty:
            parent = multiprocessing.parent_process()
            if parent is not None and not parent.is_alive():
                raise SystemExit(0) from None


def _serve_one_run(engine: int, name: str, shape: PoolShape, spec: RunSpec, commands: Any, events: Any) -> None:
    from kvcached.pool import KVPool
    from kvcached.registry import registry_for

    os.environ[SPARE_PAGES_ENV] = str(SPARE_PAGES)  # read when the pool is built
    budget = registry_for(shape.device).register(name)
    try:
        pool = KVPool(
            num_layers=shape.num_layers,
            block_bytes=shape.block_bytes,
            num_buffers=shape.num_buffers,
            num_blocks=shape.num_blocks,
            layout="per_layer",
            device=shape.device,
            limit_bytes=spec.limit_bytes,
            budget=budget,
            name=name,
            min_reserve_pages=RESERVE_PAGES,
            max_reserve_pages=RESERVE_PAGES,
        )
        try:
            scheduler = EngineScheduler(engine, pool, spec, events)
            events.put(("ready", engine, spec.run_name, None))
            command, start_monotonic = _next_command(commands)
            if command != "go":
                raise DemoError(f"engine {engine}: expected 'go', got {command!r}")
            scheduler.run(start_monotonic)
            result = scheduler.result()
            result["used_blocks_at_end"] = pool.stats()["used_blocks"]
        finally:
            pool.close()
        # Closing unmaps every page: the registry must no longer count any of it.
        result["mapped_bytes_after_close"] = budget.mapped_bytes
    finally:
        budget.unregister()
    events.put(("result", engine, spec.run_name, result))


def engine_main(
    engine: int, name: str, shape: PoolShape, registry_dir: str, commands: Any, events: Any, log_level: int
) -> None:
    """Entry point of an engine process: serves runs until told to stop."""
    from kvcached.registry import REGISTRY_DIR_ENV

    logging.basicConfig(level=log_level, format=f"engine {engine}: %(levelname)s %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group; the parent handles it and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ[REGISTRY_DIR_ENV] = registry_dir  # the demo's private registry, before any pool
    try:
        if needs_torch(shape.device):
            import torch

            # The engines share a few cores with each other and the parent.
            torch.set_num_threads(1)
        while True:
            message = _next_command(commands)
            if message[0] == "stop":
                return
            if message[0] != "run":
                raise DemoError(f"engine {engine}: unknown command {message[0]!r}")
            _serve_one_run(engine, name, shape, message[1], commands, events)
    except BaseException:
        events.put(("error", engine, None, traceback.format_exc()))
        raise


__all__ = ["BlockPattern", "EngineScheduler", "PoolShape", "RunSpec", "engine_main"]
