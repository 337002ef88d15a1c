"""A high-priority pool squeezing a busy low-priority engine (the memory policy's engine tests).

The vLLM and SGLang tests start an engine registered as ``low`` with a min, wait until it is deep in
its load, then take all but its min for a pool of a higher priority in the test's own process.
What the engine then gives, and how fast, is what they check (docs/memory-policy.md).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Optional

__all__ = ["Squeeze", "live_entry", "squeeze_low", "wait_until_busy"]

LOW = "low"  # the engine's KVCACHED_NAME


@dataclasses.dataclass(frozen=True)
class Squeeze:
    handover_s: float  # from asking for all but the engine's min to holding it
    while_held: dict  # the engine's entry the moment the pool held it
    low_ran_on: bool  # the engine was still serving then: it gave while busy, not once done
    refused_beyond: bool  # one page id more was refused: the engine's min stayed its own
    a_second_later: dict  # the engine's entry after it ran on within its min a second

    def check_given_down_to(self, min_bytes: int, page_id_bytes: int) -> None:
        """The busy engine gave all but its min, kept it, and gave while it still served."""
        # Not a byte of the engine's min: more was refused while it ran.
        assert self.refused_beyond
        assert self.while_held["mapped_bytes"] <= min_bytes and self.a_second_later["mapped_bytes"] <= min_bytes
        # It gave while it served (more in use than the padding or null block's page), not once
        # its load was done (then it would be idle).
        assert self.low_ran_on and self.while_held["used_bytes"] > page_id_bytes, self.while_held


def live_entry(registry: Any, name: str = LOW) -> Optional[dict]:
    return next((entry for entry in registry.entries() if entry["name"] == name and entry["alive"]), None)


def wait_until_busy(registry: Any, procs: Sequence[Any], field: str, busy_bytes: int, timeout_s: float) -> None:
    """Waits until the engine's ``field`` (``mapped_bytes``, ``used_bytes``) reaches ``busy_bytes``."""
    deadline = time.monotonic() + timeout_s
    while True:
        entry = live_entry(registry)
        if entry is not None and entry[field] >= busy_bytes:
            return
        assert all(proc.poll() is None for proc in procs), "an engine ended before the low one was busy"
        assert time.monotonic() < deadline, "the low-priority engine never got busy"
        time.sleep(0.02)


def squeeze_low(
    registry: Any,
    low_proc: Any,
    *,
    budget_bytes: int,
    min_bytes: int,
    page_id_bytes: int,
    layers: int,
    buffers: int,
    block_bytes: int,
) -> Squeeze:
    """Takes all of the budget but the engine's min for a pool of priority 5, then gives it back.

    The pool's page id (``layers`` x ``buffers`` x a 2 MiB page) must equal the engine's, so that
    the budget divides the same way.
    """
    import kvcached
    from kvcached.registry import MemoryPolicy

    blocks_per_page_id = page_id_bytes // (layers * buffers * block_bytes)
    pool = kvcached.KVPool(
        num_layers=layers,
        block_bytes=block_bytes,
        num_buffers=buffers,
        num_blocks=64 * blocks_per_page_id,
        page_bytes=2 << 20,
        device="cpu",
        budget=registry.register("high", policy=MemoryPolicy(priority=5)),
        min_reserve_pages=0,
        max_reserve_pages=0,
    )
    try:
        began = time.monotonic()
        taken = pool.alloc((budget_bytes - min_bytes) // page_id_bytes * blocks_per_page_id, timeout_s=120.0)
        handover_s = time.monotonic() - began
        while_held, low_ran_on = live_entry(registry), low_proc.poll() is None
        try:
            pool.free(pool.alloc(blocks_per_page_id, timeout_s=0.5))
            refused_beyond = False
        except kvcached.OutOfMemoryError:
            refused_beyond = True
        time.sleep(1.0)  # the engine runs on within its min a while
        a_second_later = live_entry(registry)
        pool.free(taken)
    finally:
        pool.close()
    return Squeeze(handover_s, while_held, low_ran_on, refused_beyond, a_second_later)
