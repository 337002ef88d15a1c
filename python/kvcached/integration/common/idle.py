"""When an idle engine gives its KV memory back: after a hold, or at once when the device wants it.

Rationale. Giving KV memory back and taking it again is not free: on the host
every 4 KiB page is allocated, zeroed and faulted in again (on the 2-core
development VM about 8 ms per 12 MiB page id, ``bench/probes/host_page_cost.py``: near
0.1 s of CPU for the 144 MiB one pass of the end-to-end benchmark maps), on a
GPU every page id costs driver calls. An engine whose bursts come a few seconds apart would pay
it for every burst, while nobody else used the memory in between.

Approach. An idle engine keeps what it has mapped for a hold of
``KVCACHED_IDLE_RELEASE_S`` seconds (default 5), like an allocator's decay of
dirty pages. The hold learns the engine's cadence: when it ran out and work
came back within ``KVCACHED_IDLE_RELEASE_MAX_S`` (default 30 s) of the spell's
start, the release was too early, and the next hold covers 1.5 times that idle
spell (up to that maximum); a longer spell sets it back to the setting. The
spell before the engine's first work teaches nothing. (In the end-to-end
benchmark each engine idles about 10 s while the other serves; a fixed 5 s
hold made it take 100-150 MiB again every other pass.) It
gives the memory back at once when the device's budget is wanted: another instance on the same
device was refused memory in the last second (the registry's pressure), or
this instance holds more than the limit it now has (``kvctl set-limit`` /
``set-budget``). vLLM's loop blocks while idle: a thread of its own watches for
either (every 10 ms; it sleeps while the engine is busy) and wakes the loop,
which then releases on its own thread. SGLang's idle loop asks
:meth:`IdleRelease.due` every turn; when it sleeps (``--sleep-on-idle``) the
same thread ends its sleep. ``KVCACHED_IDLE_RELEASE_S=0`` gives memory
back as soon as the engine is idle.

Limitations. Memory held this way counts as mapped in the registry all along
(it is), so ``kvctl`` shows it; a process on the device that is not a kvcached
instance cannot signal that it wants memory, and waits for the hold to end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

from kvcached.errors import IntegrationError, InvalidArgumentError

__all__ = ["IdleRelease"]

logger = logging.getLogger(__name__)


class IdleRelease:
    """Decides when an idle engine gives its memory back, and wakes it then.

    Args:
        hold_s: how long an idle engine keeps its memory when nobody wants it
            (the first hold; later ones learn the engine's idle spells, see above).
        max_hold_s: the longest a learnt hold grows (at most ``hold_s``: a fixed hold).
        budgets: the engine's registry entries (one per rank), read for the
            device's pressure and their limits.
        clock: monotonic seconds (tests pass a fake one).
    """

    #: How often the watching thread reads the budgets while the engine is idle.
    POLL_S = 0.01
    #: A hold that ran out too early grows to this multiple of the idle spell it cut short.
    COVER = 1.5

    def __init__(
        self,
        hold_s: float,
        budgets: Sequence[Any],
        *,
        max_hold_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not hold_s >= 0.0:
            raise InvalidArgumentError(f"hold_s must be >= 0, got {hold_s!r}")
        if not max_hold_s >= 0.0:
            raise InvalidArgumentError(f"max_hold_s must be >= 0, got {max_hold_s!r}")
        self.base_hold_s = hold_s
        self.max_hold_s = max(hold_s, max_hold_s) if hold_s > 0.0 else 0.0
        self.hold_s = hold_s  # the current hold (see the module's docstring)
        self._budgets = list(budgets)
        self._clock = clock
        self._idle_since: Optional[float] = None
        self._hold_ran_out = False  # in this idle spell
        self._has_worked = False  # the spell before the first work teaches nothing
        self._cond = threading.Condition()
        self._armed: Optional[tuple[float, Callable[[], None]]] = None  # (deadline, wake)
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.num_early = 0  # releases brought forward because the device wanted the memory

    # ---- the engine's thread ----------------------------------------------------

    def busy(self) -> None:
        """The engine has work: the next idle period starts from zero (cheap when already busy)."""
        if self._idle_since is not None:
            if self._hold_ran_out and self._has_worked:
                self._learn(self._clock() - self._idle_since)
            self._hold_ran_out = False
            self._idle_since = None
            with self._cond:
                self._armed = None
        self._has_worked = True

    def _learn(self, idle_s: float) -> None:
        """After an idle spell of ``idle_s`` that outlasted the hold: the next hold."""
        if idle_s <= self.max_hold_s:
            self.hold_s = min(self.max_hold_s, max(self.hold_s, self.COVER * idle_s))
        else:
            self.hold_s = self.base_hold_s

    def due(self) -> bool:
        """Called while the engine is idle: whether to give its memory back now."""
        now = self._clock()
        if self._idle_since is None:
            self._idle_since = now
        if self.hold_s == 0.0 or now - self._idle_since >= self.hold_s:
            self._hold_ran_out = self.hold_s > 0.0
            return True
        if self.wanted():
            self.num_early += 1
            return True
        return False

    def wake_when_due(self, wake: Callable[[], None]) -> None:
        """Calls ``wake()`` once, from the watching thread, when :meth:`due` would say True.

        Nothing is called if the engine becomes busy first. ``wake`` must only
        ask the engine's own thread to look again (it runs on another thread).
        """
        if self._idle_since is None:
            raise IntegrationError("wake_when_due() outside an idle period (call due() first)")
        with self._cond:
            if self._closed:
                return
            self._armed = (self._idle_since + self.hold_s, wake)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="kvcached-idle-release", daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        """Stops the watching thread (idempotent)."""
        with self._cond:
            self._closed = True
            self._armed = None
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)

    # ---- what "wanted" means ------------------------------------------------------

    def wanted(self) -> bool:
        """Whether the device wants this engine's memory now (pressure, or a limit below what it holds)."""
        for budget in self._budgets:
            if budget.pressure_bytes > 0:
                return True
            limit = budget.external_limit_bytes
            if limit is not None and budget.mapped_bytes > limit:
                return True
        return False

    # ---- the watching thread ------------------------------------------------------

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                if self._armed is None:
                    self._cond.wait()
                    continue
                deadline, wake = self._armed
                now = self._clock()
                if now < deadline and not self._wanted_quietly():
                    self._cond.wait(timeout=min(self.POLL_S, deadline - now))
                    continue
                self._armed = None
                self._cond.release()
                try:
                    wake()
                except Exception:  # the engine then releases at its next idle moment
                    logger.exception("kvcached: waking an idle engine to give its memory back failed")
                finally:
                    self._cond.acquire()

    def _wanted_quietly(self) -> bool:
        try:
            return self.wanted()
        except Exception:  # a registry gone bad: the hold's end still releases
            return False
