"""Seeded, bursty request schedules for the demo: engine ``i`` is busy in phase ``i``.

Time is cut into phases of equal length; in phase ``p`` engine ``p mod N`` gets
the busy arrival rate and every other engine the idle rate, so the peaks take
turns. Arrivals are Poisson within each phase (exponential gaps, restarted at
phase boundaries, which is exact because the exponential is memoryless).

The rates are derived from the memory budget with Little's law, so the busy
engine's expected footprint is ``busy_fraction`` of the budget whatever the
budget, block size or engine count: above a static ``1/N`` share, below the
whole device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvcached.errors import InvalidArgumentError

# A request's prompt fills this many blocks at prefill (uniform, inclusive).
DEFAULT_PROMPT_BLOCKS = (8, 40)
# Decoding adds one block per step, this many steps (uniform, inclusive).
DEFAULT_DECODE_BLOCKS = (4, 16)
# Time between two decode blocks of one request (a block of tokens at demo speed).
DEFAULT_DECODE_STEP_S = 0.08
# Expected footprint of the busy engine and of each idle one, as a share of the budget.
DEFAULT_BUSY_FRACTION = 0.4
DEFAULT_IDLE_FRACTION = 0.04
# Every engine peaks up to this many times per run, in phases no shorter than
# MIN_PHASE_S: a phase must outlast the requests admitted in it, or the peaks
# of successive engines overlap and no longer take turns.
MAX_PEAKS_PER_ENGINE = 2
MIN_PHASE_S = 2.0


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of one engine; times are seconds from the start of the run."""

    request_id: int
    engine: int
    arrival_s: float
    prompt_blocks: int
    decode_blocks: int

    def total_blocks(self) -> int:
        """Blocks the request holds when it finishes."""
        return self.prompt_blocks + self.decode_blocks


@dataclasses.dataclass(frozen=True)
class TrafficProfile:
    """Everything that shapes the schedule, except the seed."""

    num_engines: int
    duration_s: float
    phase_s: float
    busy_rate_hz: float
    idle_rate_hz: float
    prompt_blocks: tuple[int, int] = DEFAULT_PROMPT_BLOCKS
    decode_blocks: tuple[int, int] = DEFAULT_DECODE_BLOCKS
    decode_step_s: float = DEFAULT_DECODE_STEP_S

    def busy_engine(self, time_s: float) -> int:
        """The engine at its peak at ``time_s``."""
        return int(time_s // self.phase_s) % self.num_engines


def _mean(bounds: tuple[int, int]) -> float:
    return (bounds[0] + bounds[1]) / 2


def mean_request_block_seconds(
    prompt_blocks: tuple[int, int] = DEFAULT_PROMPT_BLOCKS,
    decode_blocks: tuple[int, int] = DEFAULT_DECODE_BLOCKS,
    decode_step_s: float = DEFAULT_DECODE_STEP_S,
) -> float:
    """Expected blocks x seconds one request holds (its area under the memory curve)."""
    lifetime_s = _mean(decode_blocks) * decode_step_s
    # Prompt blocks are held the whole lifetime; decode blocks on average half of it.
    return lifetime_s * (_mean(prompt_blocks) + _mean(decode_blocks) / 2)


def make_profile(
    budget_blocks: int,
    num_engines: int,
    duration_s: float,
    busy_fraction: float = DEFAULT_BUSY_FRACTION,
    idle_fraction: float = DEFAULT_IDLE_FRACTION,
) -> TrafficProfile:
    """A profile whose busy engine needs ``busy_fraction`` of ``budget_blocks`` on average."""
    if budget_blocks <= 0 or num_engines <= 0 or duration_s <= 0:
        raise InvalidArgumentError("budget_blocks, num_engines and duration_s must be positive")
    block_seconds = mean_request_block_seconds()
    peaks = max(1, min(MAX_PEAKS_PER_ENGINE, int(duration_s // (num_engines * MIN_PHASE_S))))
    # Little's law: mean blocks in use = arrival rate x block-seconds per request.
    return TrafficProfile(
        num_engines=num_engines,
        duration_s=duration_s,
        phase_s=duration_s / (num_engines * peaks),
        busy_rate_hz=busy_fraction * budget_blocks / block_seconds,
        idle_rate_hz=idle_fraction * budget_blocks / block_seconds,
    )


def generate(profile: TrafficProfile, seed: int) -> list[list[Request]]:
    """The schedule: one arrival-ordered list of requests per engine.

    The same profile and seed always give the same schedule; each engine draws
    from its own stream, so engines do not perturb one another.
    """
    schedules: list[list[Request]] = []
    next_id = 0
    num_phases = int(np.ceil(profile.duration_s / profile.phase_s - 1e-9))
    for engine in range(profile.num_engines):
        rng = np.random.default_rng([seed, engine])
        requests: list[Request] = []
        for phase in range(num_phases):
            start_s = phase * profile.phase_s
            end_s = min(start_s + profile.phase_s, profile.duration_s)
            busy = phase % profile.num_engines == engine
            rate_hz = profile.busy_rate_hz if busy else profile.idle_rate_hz
            if rate_hz <= 0:
                continue
            time_s = start_s + rng.exponential(1.0 / rate_hz)
            while time_s < end_s:
                requests.append(
                    Request(
                        request_id=next_id,
                        engine=engine,
                        arrival_s=float(time_s),
                        prompt_blocks=int(rng.integers(profile.prompt_blocks[0], profile.prompt_blocks[1] + 1)),
                        decode_blocks=int(rng.integers(profile.decode_blocks[0], profile.decode_blocks[1] + 1)),
                    )
                )
                next_id += 1
                time_s += rng.exponential(1.0 / rate_hz)
        schedules.append(requests)
    return schedules


def total_requests(schedules: Sequence[Sequence[Request]]) -> int:
    """Requests across all engines."""
    return sum(len(requests) for requests in schedules)


__all__ = [
    "Request",
    "TrafficProfile",
    "generate",
    "make_profile",
    "mean_request_block_seconds",
    "total_requests",
]
