"""Runs the demo: spawns the engines, drives the elastic and static runs, samples memory.

Both runs serve the same seeded schedule with the same engine processes and the
same device budget; only the memory rule differs. The registry lives in a
private temporary directory (``KVCACHED_REGISTRY_DIR`` in this process and in
every engine), so concurrent demos and tests never share a budget; the demo prints
the ``kvctl`` command that lists it (:meth:`DemoSetup.kvctl_command`). Memory per
instance is sampled from that registry, exactly what ``kvtop`` would show.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from typing import Any, Optional, Protocol

from kvcached.demo.config import DemoConfig, Geometry
from kvcached.demo.engine import RunSpec
from kvcached.demo.fleet import EngineFleet, engine_name
from kvcached.demo.traffic import TrafficProfile, generate, make_profile
from kvcached.errors import ConfigurationError, DemoError, InvalidArgumentError, KvcachedError
from kvcached.registry import REGISTRY_DIR_ENV, DeviceRegistry, registry_for

logger = logging.getLogger(__name__)

RUN_NAMES = ("elastic", "static")
SAMPLE_INTERVAL_S = 0.1
# Engines start (importing torch on a GPU) and build their pools: allow for a slow, busy machine.
READY_TIMEOUT_S = 120.0
# Extra time a run may take past its schedule before the demo gives up on it.
RUN_GRACE_S = 60.0
START_DELAY_S = 0.3  # lets every engine see "go" before the clock starts


@dataclasses.dataclass
class RunRecord:
    """What one run produced: engine results and the memory samples."""

    name: str
    limit_bytes: Optional[int]
    times_s: list[float] = dataclasses.field(default_factory=list)
    mapped_bytes: list[list[int]] = dataclasses.field(default_factory=list)  # per engine, per sample
    used_bytes: list[list[int]] = dataclasses.field(default_factory=list)
    results: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    registry_mapped_after_bytes: int = 0
    registry_entries_after: int = 0
    wall_s: float = 0.0


class Observer(Protocol):
    """Watches the runs as they happen (the live view)."""

    def begin_run(self, run_name: str, profile: TrafficProfile, limit_bytes: Optional[int]) -> None:
        """A run is about to start; ``limit_bytes`` is each pool's cap (None: shared budget only)."""

    def sample(self, time_s: float, mapped_bytes: list[int], counters: list[dict[str, int]]) -> None:
        """Memory each engine holds (registry) and the engines' latest counters."""

    def end_run(self) -> None:
        """The run is over (every engine has reported)."""


def measure_geometry(config: DemoConfig) -> Geometry:
    """Block and page sizes, from a throwaway pool on the demo's device (address space only)."""
    from kvcached.pool import KVPool

    try:
        probe = KVPool(
            num_layers=config.num_layers,
            block_bytes=config.block_bytes,
            num_buffers=config.num_buffers,
            num_blocks=1,
            layout="per_layer",
            device=config.device,
            background_worker=False,
        )
    except (KvcachedError, ValueError) as error:
        # The demo's own geometry always fits: what does not is a KVCACHED_* setting (a page size).
        settings = " ".join(
            f"{name}={value!r}"
            for name, value in sorted(os.environ.items())
            if name.startswith("KVCACHED_") and name != REGISTRY_DIR_ENV
        )
        if not settings:
            raise
        raise ConfigurationError(f"{error} (with {settings})") from None
    try:
        block_id_bytes, page_id_bytes = probe.block_id_bytes, probe.page_id_bytes
        blocks_per_page = probe.blocks_per_page
    finally:
        probe.close()
    if config.budget_bytes < page_id_bytes * config.engines:
        raise InvalidArgumentError(
            f"--budget {config.budget_bytes} bytes is too small: each of {config.engines} engines needs at "
            f"least one page id of {page_id_bytes} bytes in the static split, {page_id_bytes * config.engines} "
            "bytes in all"
        )
    # Every engine may grow to the whole budget: its virtual capacity is the budget, whole pages.
    budget_pages = -(-config.budget_bytes // page_id_bytes)
    return Geometry(
        block_id_bytes=block_id_bytes,
        page_id_bytes=page_id_bytes,
        blocks_per_page=blocks_per_page,
        num_blocks=budget_pages * blocks_per_page,
        budget_blocks=config.budget_bytes // block_id_bytes,
        static_limit_bytes=config.budget_bytes // config.engines,
    )


def _sample(
    registry: DeviceRegistry, names: list[str], counters: list[dict[str, int]], record: RunRecord, time_s: float
) -> list[int]:
    # Mapped bytes come from the registry (what the device budget counts);
    # used bytes from the engines' own latest report (the registry's can lag).
    by_name = {entry["name"]: entry for entry in registry.entries()}
    record.times_s.append(time_s)
    for engine, name in enumerate(names):
        entry = by_name.get(name)
        record.mapped_bytes[engine].append(entry["mapped_bytes"] if entry else 0)
        record.used_bytes[engine].append(counters[engine].get("used_block_bytes", 0) if entry else 0)
    return [column[-1] for column in record.mapped_bytes]


def _drive_run(
    fleet: EngineFleet,
    registry: DeviceRegistry,
    config: DemoConfig,
    profile: TrafficProfile,
    schedules: list,
    run_name: str,
    limit_bytes: Optional[int],
    observer: Optional[Observer],
) -> RunRecord:
    names = [engine_name(engine) for engine in range(config.engines)]
    record = RunRecord(
        name=run_name,
        limit_bytes=limit_bytes,
        mapped_bytes=[[] for _ in names],
        used_bytes=[[] for _ in names],
        results=[{} for _ in names],
    )
    for engine in range(config.engines):
        spec = RunSpec(
            run_name=run_name,
            limit_bytes=limit_bytes,
            requests=schedules[engine],
            decode_step_s=profile.decode_step_s,
            wait_timeout_s=config.wait_timeout_s,
            duration_s=config.duration_s,
        )
        fleet.send(engine, ("run", spec))
    ready: set[int] = set()
    ready_deadline = time.monotonic() + READY_TIMEOUT_S
    while len(ready) < config.engines:
        if time.monotonic() > ready_deadline:
            raise DemoError(f"engines not ready after {READY_TIMEOUT_S:.0f} s")
        event = fleet.next_event(timeout_s=1.0)
        if event is not None and event[0] == "ready":
            ready.add(event[1])
    if observer is not None:
        observer.begin_run(run_name, profile, limit_bytes)
    start = time.monotonic() + START_DELAY_S
    for engine in range(config.engines):
        fleet.send(engine, ("go", start))
    counters: list[dict[str, int]] = [{} for _ in names]
    finished: set[int] = set()
    next_sample = start
    run_deadline = start + config.duration_s + config.wait_timeout_s + RUN_GRACE_S
    while len(finished) < config.engines:
        now = time.monotonic()
        if now > run_deadline:
            raise DemoError(f"the {run_name} run did not finish in time")
        if now >= next_sample:
            mapped = _sample(registry, names, counters, record, now - start)
            if observer is not None:
                observer.sample(now - start, mapped, counters)
            next_sample += SAMPLE_INTERVAL_S
            if next_sample < now:  # fell behind (busy machine): skip, do not burst
                next_sample = now + SAMPLE_INTERVAL_S
        event = fleet.next_event(timeout_s=max(0.0, min(next_sample - time.monotonic(), SAMPLE_INTERVAL_S)))
        if event is None or event[2] != run_name:
            continue
        if event[0] == "progress":
            counters[event[1]] = event[3]
        elif event[0] == "result":
            record.results[event[1]] = event[3]
            finished.add(event[1])
    _sample(registry, names, counters, record, time.monotonic() - start)
    if observer is not None:
        observer.end_run()
    record.wall_s = time.monotonic() - start
    record.registry_mapped_after_bytes = registry.mapped_bytes
    record.registry_entries_after = len(registry.entries())
    return record


class DemoSetup:
    """Everything a demo needs before its engines start: its private registry directory (with
    the device's registry and budget) and the geometry; use as a context manager.

    Entering it checks the device and the budget against the page size, so a setting the
    demo cannot run with fails here, before any engine starts; leaving it removes the directory.
    """

    def __init__(self, config: DemoConfig) -> None:
        config.validate()
        self.config = config
        self.registry_dir = ""
        self.registry: Optional[DeviceRegistry] = None
        self.geometry: Optional[Geometry] = None
        self._previous_dir: Optional[str] = None

    def __enter__(self) -> DemoSetup:
        self._started = time.monotonic()
        self.registry_dir = tempfile.mkdtemp(prefix="kvcached-demo-")
        self._previous_dir = os.environ.get(REGISTRY_DIR_ENV)
        # Set here for anything this process opens; the engines get the directory
        # explicitly, because a forkserver started by an earlier demo would hand
        # them its own, older environment.
        os.environ[REGISTRY_DIR_ENV] = self.registry_dir
        try:
            self.registry = registry_for(self.config.device, budget_bytes=self.config.budget_bytes)
            self.geometry = measure_geometry(self.config)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.registry = None
        if self._previous_dir is None:
            os.environ.pop(REGISTRY_DIR_ENV, None)
        else:
            os.environ[REGISTRY_DIR_ENV] = self._previous_dir
        shutil.rmtree(self.registry_dir, ignore_errors=True)

    def kvctl_command(self) -> str:
        """The command that lists the demo's engines from another terminal while it runs."""
        device = "" if self.config.device == "cpu" else f" --device {self.config.device}"
        return f"{REGISTRY_DIR_ENV}={self.registry_dir} kvctl list{device}"

    def run(self, observer: Optional[Observer] = None) -> dict[str, Any]:
        """Runs both runs for real and returns their raw records (see :mod:`kvcached.demo.summary`)."""
        config, geometry, registry = self.config, self.geometry, self.registry
        if geometry is None or registry is None:
            raise DemoError("DemoSetup.run() needs the setup entered (use it as a context manager)")
        profile = make_profile(geometry.budget_blocks, config.engines, config.duration_s)
        schedules = generate(profile, config.seed)
        fleet: Optional[EngineFleet] = EngineFleet(config, geometry, self.registry_dir)
        try:
            runs = []
            for run_name in RUN_NAMES:
                limit = None if run_name == "elastic" else geometry.static_limit_bytes
                runs.append(_drive_run(fleet, registry, config, profile, schedules, run_name, limit, observer))
            fleet.stop()
            fleet = None
        finally:
            if fleet is not None:
                fleet.stop()
        return {
            "config": config,
            "geometry": geometry,
            "profile": profile,
            "runs": runs,
            "elapsed_s": time.monotonic() - self._started,
        }


def run_demo(config: DemoConfig, observer: Optional[Observer] = None) -> dict[str, Any]:
    """Sets the demo up, runs both runs and returns their raw records."""
    with DemoSetup(config) as setup:
        return setup.run(observer)


__all__ = ["DemoSetup", "RunRecord", "measure_geometry", "run_demo"]
