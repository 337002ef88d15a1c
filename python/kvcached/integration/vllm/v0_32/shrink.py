"""A busy vLLM engine asked to hold less gives memory back: cached prefixes first, then preemption.

The memory policy (``docs/memory-policy.md``): a refused higher-priority instance on the
device lowers this engine's limit (its reclaim target), as ``kvctl set-limit`` or a lowered
budget does. An idle engine gives everything back at once (``common/idle.py``); a busy one
would give back only as its requests end, or when one needs a block it cannot have, which
in decode comes once every block of tokens. So before each step an engine holding more than
its limit drops unused prefix-cache blocks (least recently used first), then preempts running
requests (the one vLLM's own scheduler would preempt first) until its blocks in use fit. A
preempted request waits and is recomputed, as after any preemption: outputs do not change.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["shrink_to_limit"]


def _next_victim(scheduler: Any) -> Any:
    """The running request vLLM preempts first: the last admitted, or the lowest priority."""
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    if scheduler.policy == SchedulingPolicy.PRIORITY:
        return max(scheduler.running, key=lambda request: (request.priority, request.arrival_time))
    return scheduler.running[-1]


def shrink_to_limit(scheduler: Any, engine: Any) -> int:
    """Frees blocks until the engine's blocks in use fit its limit; returns requests preempted."""
    blocks, pool = engine.blocks, engine.block_pool
    blocks_per_page = int(blocks.layout.blocks_per_page)
    preempted = 0
    while (excess_pages := blocks.pages_over_limit()) > 0:
        if pool.drop_cached_blocks(excess_pages * blocks_per_page) > 0:
            continue
        if not scheduler.running:
            break  # nothing left to preempt: what remains is the null block or set aside
        request = _next_victim(scheduler)
        scheduler.running.remove(request)
        # As vLLM's own reset_prefix_cache preempts between steps: in-flight output is
        # dropped, and (0.32, 0.33) the request is no longer "scheduled in the previous
        # step", so its resumption sends the worker all of its tokens; 0.34 tracks no such set.
        scheduler._preempt_request(request, time.monotonic(), drop_stale_output=True)
        previous_step = getattr(scheduler, "prev_step_scheduled_req_ids", None)
        if previous_step is not None:
            previous_step.discard(request.request_id)
        preempted += 1
    blocks.give_back_beyond_limit()  # the unmaps ride on this step's output to every rank
    pool.forget_available()
    return preempted
