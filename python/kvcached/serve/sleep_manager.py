"""Which models are awake: serve holds more models than fit by putting idle ones to sleep.

A model with ``sleep`` in its config may sleep: its engine gives its weights (level 1: to host
memory; level 2: discarded) and its KV cache back to the device (kvcached serves the engine's
own sleep API, :mod:`kvcached.serve.engine_sleep`). A request for a sleeping model is not
refused: it waits while the model wakes. When the device budget cannot hold the model awake,
other models are put to sleep first: never one with requests in flight, lower priority before
higher, then the least recently used. Requests for awake models go on meanwhile. A model with
``idle_s`` sleeps on its own after that many idle seconds. Whatever cannot be woken (a model
larger than what the budget leaves beside the models that never sleep, an engine that fails to
wake, no model idle to make room within ``wake_timeout_s``) is a :class:`WakeRefused`.

Threads: requests claim a model under ``_lock`` (short: states, requests in flight, last use);
the memory decisions and the engines' sleep and wake calls run one at a time under
``_transition``, on the waiting request's own thread, so a sleeping model's requests wait for
that transition and no other.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, Callable, Optional

import httpx

from kvcached.errors import KvcachedError, ServeError
from kvcached.serve.engine_sleep import CALL_TIMEOUT_S, EngineSleepError, put_to_sleep, wake
from kvcached.serve.fit import checkpoint_bytes
from kvcached.serve.spec import ModelSpec, ServeConfig
from kvcached.sizes import format_bytes

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5
ROOM_POLL_S = 0.05  # while waiting for a busy model to become idle (so it can be put to sleep)


class SleepState(str, enum.Enum):
    AWAKE = "awake"
    FALLING_ASLEEP = "falling asleep"
    ASLEEP = "asleep"
    WAKING = "waking"


class WakeRefused(ServeError):
    """A sleeping model could not be woken; the message says why (it is the 503's text)."""


class SleepManager:
    """Every model's sleep state, and the decisions that keep the device's budget holding the awake ones."""

    def __init__(
        self,
        config: ServeConfig,
        memory: Any,
        engines: Mapping[str, Any],
        *,
        on_wake: Callable[[str, float], None] = lambda model, seconds: None,
        on_sleep: Callable[[str], None] = lambda model: None,
    ) -> None:
        self._config = config
        self._memory = memory
        self._engines = engines
        self._specs = {spec.name: spec for spec in config.models}
        self._on_wake, self._on_sleep = on_wake, on_sleep
        self._lock = threading.Lock()
        self._transition = threading.Lock()
        # Engines not started yet hold nothing, as if asleep; each is awake once it answers (engine_ready).
        self._states = {name: SleepState.ASLEEP for name in self._specs}
        self._in_flight = {name: 0 for name in self._specs}
        self._last_used = {name: time.monotonic() for name in self._specs}
        self._weights_bytes = {name: 0 for name in self._specs}  # as last seen awake
        self._stop = threading.Event()
        self._idle_thread: Optional[threading.Thread] = None
        # One client for every sleep and wake call: a new one costs tens of ms (its TLS context).
        self._http = httpx.Client(timeout=CALL_TIMEOUT_S)

    # ---- what the router and the views ask ------------------------------------------------------

    def state(self, name: str) -> SleepState:
        return self._states[name]

    def claim(self, name: str) -> bool:
        """Counts one request in flight for ``name`` if it is awake (True); False: it must wake first."""
        with self._lock:
            if self._states[name] is not SleepState.AWAKE:
                return False
            self._in_flight[name] += 1
            self._last_used[name] = time.monotonic()
            return True

    def done(self, name: str) -> None:
        """A request claimed for ``name`` ended."""
        with self._lock:
            self._in_flight[name] -= 1
            self._last_used[name] = time.monotonic()

    def engine_ready(self, name: str) -> None:
        """An engine (re)started: a fresh engine is awake; its weights are read from the registry."""
        with self._lock:
            self._states[name] = SleepState.AWAKE
            self._last_used[name] = time.monotonic()
        self._note_weights(name)

    # ---- waking ---------------------------------------------------------------------------------------

    def wake_and_claim(self, name: str) -> None:
        """Blocks until ``name`` is awake (putting others to sleep if need be), within the config's
        ``wake_timeout_s``, and counts one request in flight for it, as :meth:`claim` does (end it
        with :meth:`done`); raises :class:`WakeRefused` when it cannot be woken. Claimed before the
        next wake may run: a model woken for a request is never put to sleep before it gets it."""
        deadline = time.monotonic() + self._config.wake_timeout_s
        if not self._transition.acquire(timeout=self._config.wake_timeout_s):
            raise WakeRefused(
                f"the model `{name}` is asleep and other models' wakes took longer than "
                f"{self._config.wake_timeout_s:g} s; retry later"
            )
        try:
            if self._states[name] is not SleepState.AWAKE:
                self._make_room(name, self._need(name), deadline)
                self._wake(name)
            if not self.claim(name):
                raise WakeRefused(f"the model `{name}` was woken but is not awake")
        finally:
            self._transition.release()

    def put_to_sleep(self, name: str) -> bool:
        """Puts ``name`` to sleep now if it may sleep and is awake and idle; whether it did."""
        with self._transition:
            with self._lock:
                idle = (
                    self._specs[name].sleep is not None
                    and self._states[name] is SleepState.AWAKE
                    and self._in_flight[name] == 0
                )
                if idle:
                    self._states[name] = SleepState.FALLING_ASLEEP
            if idle:
                self._put_to_sleep(name)
            return self._states[name] is SleepState.ASLEEP

    def before_launch(self, name: str) -> None:
        """An engine is about to be (re)started, awake: room is made for what it will take."""
        spec = self._specs[name]
        weights = self._weights_bytes[name] or checkpoint_bytes(spec.model)
        self.make_room_to_start(spec, None if weights is None else weights + spec.memory.min_bytes)

    def make_room_to_start(self, spec: ModelSpec, need_bytes: Optional[int]) -> None:
        """Before ``spec``'s engine starts (awake): others sleep until ``need_bytes`` fit (None: an
        unknown size, so every model that may sleep does)."""
        with self._transition:
            if need_bytes is None:
                for name in self._sleepable_awake(exclude=spec.name):
                    self._put_to_sleep(name)
            else:
                self._make_room(spec.name, need_bytes, time.monotonic() + self._config.wake_timeout_s)

    def _need(self, name: str) -> int:
        """What ``name`` takes awake: its weights as last seen, and its guaranteed KV memory."""
        return self._weights_bytes[name] + self._specs[name].memory.min_bytes

    def _make_room(self, name: str, need: int, deadline: float) -> None:
        """Puts other models to sleep until ``need`` bytes fit beside the rest, or raises WakeRefused."""
        while True:
            budget, held = self._budget_and_held(exclude=name)
            if budget - held >= need:
                return
            never = self._held_by_models_that_never_sleep(exclude=name)
            if need > budget - never:
                raise WakeRefused(
                    f"the model `{name}` needs {format_bytes(need)} awake (weights and its min), more than the "
                    f"device budget of {format_bytes(budget)} leaves beside the models that never sleep "
                    f"({format_bytes(never)})"
                )
            victim = self._pick_victim(exclude=name)
            if victim is not None:
                self._put_to_sleep(victim)
                continue
            if time.monotonic() > deadline:
                raise WakeRefused(
                    f"the model `{name}` needs {format_bytes(need)} awake and only {format_bytes(budget - held)} is "
                    f"free; no other model was idle to sleep within {self._config.wake_timeout_s:g} s; retry later"
                )
            time.sleep(ROOM_POLL_S)  # models that may sleep are busy: wait for one to finish

    def _budget_and_held(self, exclude: str) -> tuple[int, int]:
        """The budget, and what every other awake model holds of it: its weights and the KV memory its
        requests use or its min guarantees (idle KV memory goes back when a wake asks for it)."""
        usage = self._memory.usage()
        with self._lock:
            awake = {name for name, state in self._states.items() if state is not SleepState.ASLEEP}
        held = 0
        for name, model in usage.items():
            if name == exclude or name not in awake:
                continue  # asleep (or not started): it holds nothing and its min claims nothing
            held += model.weights_bytes + max(model.used_bytes, self._specs[name].memory.min_bytes)
        return self._memory.budget_bytes, held

    def _held_by_models_that_never_sleep(self, exclude: str) -> int:
        usage = self._memory.usage()
        return sum(
            model.weights_bytes + max(model.used_bytes, self._specs[name].memory.min_bytes)
            for name, model in usage.items()
            if name != exclude and self._specs[name].sleep is None
        )

    def _sleepable_awake(self, exclude: str) -> list[str]:
        with self._lock:
            return [
                name
                for name, spec in self._specs.items()
                if name != exclude and spec.sleep is not None and self._states[name] is SleepState.AWAKE
            ]

    def _pick_victim(self, exclude: str) -> Optional[str]:
        """The model to put to sleep next, marked falling asleep (so no request claims it): idle, lower
        priority first, then least recently used. None when every candidate is busy."""
        with self._lock:
            idle = [
                name
                for name in self._sleepable_awake_locked(exclude)
                if self._in_flight[name] == 0 and self._engine_ready(name)
            ]
            if not idle:
                return None
            victim = min(idle, key=lambda n: (self._specs[n].memory.priority, self._last_used[n]))
            self._states[victim] = SleepState.FALLING_ASLEEP
            return victim

    def _sleepable_awake_locked(self, exclude: str) -> list[str]:
        return [
            name
            for name, spec in self._specs.items()
            if name != exclude and spec.sleep is not None and self._states[name] is SleepState.AWAKE
        ]

    def _engine_ready(self, name: str) -> bool:
        return str(getattr(self._engines[name].state, "value", self._engines[name].state)) == "ready"

    def _put_to_sleep(self, name: str) -> None:
        """Puts ``name`` (idle, marked falling asleep or awake) to sleep; back to awake if its engine refuses."""
        engine = self._engines[name]
        with self._lock:
            self._states[name] = SleepState.FALLING_ASLEEP
        self._note_weights(name)
        try:
            put_to_sleep(self._specs[name], engine.base_url, self._http)
        except EngineSleepError as exc:
            logger.error("%s: could not be put to sleep: %s", name, exc)
            with self._lock:
                self._states[name] = SleepState.AWAKE
            return
        with self._lock:
            self._states[name] = SleepState.ASLEEP
        logger.info("%s: asleep (level %d)", name, self._specs[name].sleep.level)
        self._on_sleep(name)

    def _wake(self, name: str) -> None:
        engine = self._engines[name]
        if not self._engine_ready(name):
            raise WakeRefused(f"the model `{name}` is not available now (its engine is {engine.state.value})")
        with self._lock:
            self._states[name] = SleepState.WAKING
        started = time.monotonic()
        try:
            wake(self._specs[name], engine.base_url, self._http)
        except EngineSleepError as exc:
            with self._lock:
                self._states[name] = SleepState.ASLEEP
            raise WakeRefused(f"the model `{name}` could not be woken: {exc}") from None
        with self._lock:
            self._states[name] = SleepState.AWAKE
            self._last_used[name] = time.monotonic()
        seconds = time.monotonic() - started
        logger.info("%s: awake after %.2f s", name, seconds)
        self._note_weights(name)
        self._on_wake(name, seconds)

    def _note_weights(self, name: str) -> None:
        """Remembers what ``name``'s weights hold awake (what waking it needs)."""
        try:
            weights = self._memory.usage()[name].weights_bytes
        except (KvcachedError, KeyError):
            return
        if weights > 0:
            self._weights_bytes[name] = weights

    # ---- idle models sleep on their own -------------------------------------------------------------

    def start(self) -> None:
        """Starts the thread that puts models with ``idle_s`` to sleep once they idle that long."""
        if any(spec.sleep is not None and spec.sleep.idle_s is not None for spec in self._specs.values()):
            self._idle_thread = threading.Thread(target=self._idle_loop, name="serve-idle-sleep", daemon=True)
            self._idle_thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._idle_thread is not None:
            self._idle_thread.join()
        self._http.close()

    def _idle_loop(self) -> None:
        while not self._stop.wait(IDLE_POLL_S):
            for name in self._idle_too_long():
                if not self._transition.acquire(blocking=False):
                    break  # a wake is deciding: it may need this model's memory anyway
                try:
                    with self._lock:
                        due = name in self._idle_too_long_locked()
                        if due:
                            self._states[name] = SleepState.FALLING_ASLEEP
                    if due:
                        self._put_to_sleep(name)
                finally:
                    self._transition.release()

    def _idle_too_long(self) -> list[str]:
        with self._lock:
            return self._idle_too_long_locked()

    def _idle_too_long_locked(self) -> list[str]:
        now = time.monotonic()
        return [
            name
            for name, spec in self._specs.items()
            if spec.sleep is not None
            and spec.sleep.idle_s is not None
            and self._states[name] is SleepState.AWAKE
            and self._in_flight[name] == 0
            and now - self._last_used[name] >= spec.sleep.idle_s
            and self._engine_ready(name)
        ]


__all__ = ["SleepManager", "SleepState", "WakeRefused"]
