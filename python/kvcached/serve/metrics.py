"""``/metrics`` of ``kvcached serve``, in Prometheus' text format (prometheus_client).

Per model: memory from the device registry (KV mapped and used, weights, min, max, and what it was
refused), whether its engine is up and how often it crashed or restarted, whether it sleeps and how
often it was put to sleep and woken (and how long a request waited for a wake), requests by
endpoint and status and their latency, how often and how long it waited for memory, and
hand-overs: the time from a refusal until memory moved to it (:mod:`kvcached.serve.handover`),
labelled with the giver.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvcached.errors import KvcachedError
from kvcached.serve.config import ModelSpec
from kvcached.serve.handover import Handover, HandoverTracker, WaitEnded, WaitStarted

logger = logging.getLogger(__name__)

#: How often the registry is sampled for waits and hand-overs (the hand-over figure's precision).
SAMPLE_INTERVAL_S = 0.01
# One label for every name not served, so clients cannot grow the series; no model can be named "".
UNKNOWN_MODEL = ""
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
WAKE_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
HANDOVER_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


class _StateCollector:
    """Gauges read at scrape time: memory from the registry, engine state from the supervisor."""

    def __init__(self, models: list[ModelSpec], memory: Any, engines: Optional[Mapping[str, Any]]) -> None:
        self._models, self._memory, self._engines = models, memory, engines
        self.sleep: Any = None  # the SleepManager, where models may sleep

    def _read(self, read: Any, without_memory: Any) -> Any:
        """``read(memory)``; ``without_memory`` when serve has none, None when the registry fails."""
        if self._memory is None:
            return without_memory
        try:
            return read(self._memory)
        except KvcachedError as exc:  # counted by the memory's errors; the scrape goes on without it
            logger.warning("/metrics: the device registry cannot be read: %s", exc)
            return None

    def collect(self) -> Iterable[Any]:
        label = ["model"]
        mapped = GaugeMetricFamily(
            "kvcached_serve_model_mapped_bytes", "KV memory the model's engine has mapped", labels=label
        )
        used = GaugeMetricFamily("kvcached_serve_model_used_bytes", "KV memory holding blocks in use", labels=label)
        minimum = GaugeMetricFamily("kvcached_serve_model_min_bytes", "KV memory guaranteed to the model", labels=label)
        maximum = GaugeMetricFamily(
            "kvcached_serve_model_max_bytes", "The model's cap on KV memory (absent: none)", labels=label
        )
        wanted = GaugeMetricFamily(
            "kvcached_serve_model_wanted_bytes", "KV memory the model was refused in the last second", labels=label
        )
        weights = GaugeMetricFamily(
            "kvcached_serve_model_weights_bytes", "Device memory the model's weights hold (0 asleep)", labels=label
        )
        usage = self._read(lambda memory: memory.usage(), {})
        for spec in self._models:
            model = usage.get(spec.name) if usage is not None else None
            if usage is not None:  # unknown while the registry cannot be read: left out, not shown as 0
                mapped.add_metric([spec.name], model.mapped_bytes if model else 0)
                used.add_metric([spec.name], model.used_bytes if model else 0)
                wanted.add_metric([spec.name], model.wanted_bytes if model else 0)
                weights.add_metric([spec.name], model.weights_bytes if model else 0)
            live = model is not None and model.entries > 0
            minimum.add_metric(
                [spec.name], model.min_bytes if live and model.min_bytes is not None else spec.memory.min_bytes
            )
            cap = model.max_bytes if live else spec.memory.max_bytes
            if cap is not None:
                maximum.add_metric([spec.name], cap)
        yield from (mapped, used, weights, minimum, maximum, wanted)
        if self.sleep is not None:
            sleeping = GaugeMetricFamily(
                "kvcached_serve_model_sleeping",
                "1 while the model is not awake (asleep, falling asleep or waking)",
                labels=label,
            )
            for spec in self._models:
                sleeping.add_metric([spec.name], 0 if self.sleep.state(spec.name).value == "awake" else 1)
            yield sleeping
        budget_bytes = self._read(lambda memory: memory.budget_bytes, None)
        if budget_bytes is not None:
            budget = GaugeMetricFamily("kvcached_serve_device_budget_bytes", "The device budget all models share")
            budget.add_metric([], budget_bytes)
            yield budget
        if self._memory is not None:
            yield CounterMetricFamily(
                "kvcached_serve_registry_errors",
                "Reads of the device registry that failed (its file removed or moved while serve ran, ...)",
                value=self._memory.errors,
            )
        if self._engines is not None:
            up = GaugeMetricFamily("kvcached_serve_engine_up", "1 while the model's engine is ready", labels=label)
            crashes = CounterMetricFamily(
                "kvcached_serve_engine_crashes", "Times the model's engine died while serving", labels=label
            )
            restarts = CounterMetricFamily(
                "kvcached_serve_engine_restarts", "Times the model's engine was started again", labels=label
            )
            for name, engine in self._engines.items():
                up.add_metric([name], 1 if engine.url is not None else 0)
                crashes.add_metric([name], engine.crashes)
                restarts.add_metric([name], engine.restarts)
            yield from (up, crashes, restarts)


class ServeMetrics:
    """Every metric of one ``kvcached serve``, in a registry of its own."""

    def __init__(
        self, models: list[ModelSpec], memory: Any = None, engines: Optional[Mapping[str, Any]] = None
    ) -> None:
        self.registry = CollectorRegistry()
        self._names = {spec.name for spec in models}
        self.requests = Counter(
            "kvcached_serve_requests",
            "Requests by model, endpoint and HTTP status (499: the client went away)",
            ["model", "endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvcached_serve_request_duration_seconds",
            "Time from a request's arrival to the end of its answer",
            ["model", "endpoint"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.refusals = Counter(
            "kvcached_serve_memory_refusals",
            "Times the model's engine was refused memory and began to wait",
            ["model"],
            registry=self.registry,
        )
        self.wait_seconds = Counter(
            "kvcached_serve_memory_wait_seconds",
            "Time the model's engine spent refused, waiting for memory",
            ["model"],
            registry=self.registry,
        )
        self.handovers = Histogram(
            "kvcached_serve_memory_handover_seconds",
            "Time from a model's refusal until its memory grew, by the model that gave most back ('' : the free budget)",
            ["to_model", "from_model"],
            buckets=HANDOVER_BUCKETS_S,
            registry=self.registry,
        )
        self.sleeps = Counter(
            "kvcached_serve_model_sleeps", "Times the model was put to sleep", ["model"], registry=self.registry
        )
        self.wakes = Counter(
            "kvcached_serve_model_wakes", "Times the model was woken", ["model"], registry=self.registry
        )
        self.wake_seconds = Histogram(
            "kvcached_serve_model_wake_seconds",
            "Time from the arrival of a request that found the model asleep to its engine answering",
            ["model"],
            buckets=WAKE_BUCKETS_S,
            registry=self.registry,
        )
        self._state = _StateCollector(models, memory, engines)
        self.registry.register(self._state)
        self._memory = memory
        self._tracker = HandoverTracker()
        self._stop = threading.Event()
        self._sampler: Optional[threading.Thread] = None

    def request_done(self, model: str, endpoint: str, status: int, started: float, known: bool = True) -> None:
        """Counts one answered request (``started``: its ``time.monotonic()`` on arrival)."""
        label = model if known and model in self._names else UNKNOWN_MODEL
        self.requests.labels(label, endpoint, str(status)).inc()
        self.latency.labels(label, endpoint).observe(time.monotonic() - started)

    def watch_sleep(self, sleep: Any) -> None:
        """Shows the models' sleep states (``kvcached_serve_model_sleeping``) from ``sleep``."""
        self._state.sleep = sleep

    def slept(self, model: str) -> None:
        self.sleeps.labels(model).inc()

    def woke(self, model: str, seconds: float) -> None:
        self.wakes.labels(model).inc()

    def request_waited_for_wake(self, model: str, started: float) -> None:
        """A request that found ``model`` asleep got its engine's answer (``started``: its arrival)."""
        self.wake_seconds.labels(model).observe(time.monotonic() - started)

    def apply(self, events: Iterable[object]) -> None:
        """Records what :class:`HandoverTracker` saw."""
        for event in events:
            if isinstance(event, WaitStarted):
                self.refusals.labels(event.model).inc()
            elif isinstance(event, WaitEnded):
                self.wait_seconds.labels(event.model).inc(event.seconds)
            elif isinstance(event, Handover):
                self.handovers.labels(event.to_model, event.from_model).observe(event.seconds)
                logger.info(
                    "memory moved to %s from %s in %.3f s",
                    event.to_model,
                    event.from_model or "the budget",
                    event.seconds,
                )

    def start_sampling(self, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        """Samples the registry every ``interval_s`` in a thread, for waits and hand-overs."""
        if self._memory is None:
            return
        self._sampler = threading.Thread(target=self._sample, args=(interval_s,), name="serve-memory", daemon=True)
        self._sampler.start()

    def stop_sampling(self) -> None:
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()

    def _sample(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.apply(self._tracker.observe(time.monotonic(), self._memory.usage()))
            except Exception as exc:  # the registry unusable for now must not end the sampling for good
                logger.warning("sampling the device registry failed: %s", exc)
                self._stop.wait(1.0)

    def exposition(self) -> tuple[bytes, str]:
        """The text a scrape of ``/metrics`` gets, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["SAMPLE_INTERVAL_S", "ServeMetrics"]
