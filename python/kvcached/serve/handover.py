"""Memory moving between models, told from registry samples: who waited, for how long, and who gave.

The registry shows, per instance, its mapped bytes and the bytes it was refused in the last second
(``wanted_bytes``). A model *waits* from the first sample showing it refused; the wait is a
*hand-over* when its mapped bytes then grow (it got memory), timed from the first refused sample
to the first grown one, and credited to the model whose mapped bytes fell most meanwhile (``""``
when none fell: the memory came from the free budget). An engine refused once may not ask again
before it gets memory, so its refusal fades from the registry while it still waits: a wait ends
without a hand-over only ``linger_s`` after the refusal was last seen (the request finished or was
cancelled). After a hand-over, a refusal still shown is the one just served until the registry's
one-second window has passed. Precision is the sampling interval.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Optional, Protocol


class MemorySample(Protocol):
    mapped_bytes: int
    wanted_bytes: int


@dataclasses.dataclass(frozen=True)
class Handover:
    """``to_model`` was refused memory and got some ``seconds`` later, most of it from ``from_model``."""

    to_model: str
    from_model: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class WaitStarted:
    model: str


@dataclasses.dataclass(frozen=True)
class WaitEnded:
    """A wait is over (with or without a hand-over); ``seconds`` it lasted."""

    model: str
    seconds: float


#: How long the registry shows a refusal (``wanted_bytes``: refused in the last second).
REFUSAL_WINDOW_S = 1.0
#: How long a wait outlives the last sight of its refusal before it ends without a hand-over.
DEFAULT_LINGER_S = 10.0


@dataclasses.dataclass
class _Wait:
    since: float
    mapped_bytes: int
    others_mapped: dict[str, int]
    last_refused: float


class HandoverTracker:
    """Feeds on successive samples of every model's memory and reports waits and hand-overs."""

    def __init__(self, linger_s: float = DEFAULT_LINGER_S) -> None:
        self._linger_s = linger_s
        self._waits: dict[str, _Wait] = {}
        self._served_at: dict[str, float] = {}  # each model's last hand-over

    def observe(self, now: float, usage: Mapping[str, MemorySample]) -> list[object]:
        """The events between the previous sample and this one (taken at ``now``, in seconds)."""
        events: list[object] = []
        for name, memory in usage.items():
            wait = self._waits.get(name)
            if wait is not None:
                if memory.wanted_bytes:
                    wait.last_refused = now
                if memory.mapped_bytes > wait.mapped_bytes:
                    events.append(Handover(name, self._giver(wait, usage), now - wait.since))
                    events.append(WaitEnded(name, now - wait.since))
                    del self._waits[name]
                    self._served_at[name] = now
                    continue
                if now - wait.last_refused > self._linger_s:
                    events.append(WaitEnded(name, wait.last_refused - wait.since))
                    del self._waits[name]
                continue
            if not memory.wanted_bytes:
                self._served_at.pop(name, None)  # the refusal served last has faded
            elif now - self._served_at.get(name, -REFUSAL_WINDOW_S) >= REFUSAL_WINDOW_S:
                others = {other: m.mapped_bytes for other, m in usage.items() if other != name}
                self._waits[name] = _Wait(now, memory.mapped_bytes, others, now)
                events.append(WaitStarted(name))
        return events

    @staticmethod
    def _giver(wait: _Wait, usage: Mapping[str, MemorySample]) -> str:
        best: Optional[str] = None
        most = 0
        for other, before in wait.others_mapped.items():
            now_mapped = usage[other].mapped_bytes if other in usage else 0
            if before - now_mapped > most:
                best, most = other, before - now_mapped
        return best or ""


__all__ = [
    "DEFAULT_LINGER_S",
    "REFUSAL_WINDOW_S",
    "Handover",
    "HandoverTracker",
    "MemorySample",
    "WaitEnded",
    "WaitStarted",
]
