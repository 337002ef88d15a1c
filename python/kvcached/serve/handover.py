"""Memory moving between models, told from registry samples: who waited, for how long, and who gave.

The registry shows, per instance, its mapped bytes and the bytes it was refused in the last second
(``wanted_bytes``). A model *waits* from the first sample showing it refused; the wait is a
*hand-over* when its mapped bytes then grow (it got memory), timed from the first refused sample
to the first grown one, and credited to the model whose mapped bytes fell most meanwhile (``""``
when none fell: the memory came from the free budget). A wait that ends without growth (the
request finished or was cancelled) is not a hand-over. Precision is the sampling interval.
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


@dataclasses.dataclass
class _Wait:
    since: float
    mapped_bytes: int
    others_mapped: dict[str, int]


class HandoverTracker:
    """Feeds on successive samples of every model's memory and reports waits and hand-overs."""

    def __init__(self) -> None:
        self._waits: dict[str, _Wait] = {}

    def observe(self, now: float, usage: Mapping[str, MemorySample]) -> list[object]:
        """The events between the previous sample and this one (taken at ``now``, in seconds)."""
        events: list[object] = []
        for name, memory in usage.items():
            wait = self._waits.get(name)
            if wait is not None and memory.mapped_bytes > wait.mapped_bytes:
                events.append(Handover(name, self._giver(wait, usage), now - wait.since))
                events.append(WaitEnded(name, now - wait.since))
                del self._waits[name]
                wait = None
            elif wait is not None and not memory.wanted_bytes:
                events.append(WaitEnded(name, now - wait.since))
                del self._waits[name]
                continue
            if wait is None and memory.wanted_bytes:
                others = {other: m.mapped_bytes for other, m in usage.items() if other != name}
                self._waits[name] = _Wait(now, memory.mapped_bytes, others)
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


__all__ = ["Handover", "HandoverTracker", "MemorySample", "WaitEnded", "WaitStarted"]
