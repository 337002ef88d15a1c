"""vLLM 0.32's Scheduler and EngineCore with kvcached: blocks decided here, page ops to every rank.

The Scheduler of each engine owns one :class:`EngineKV`: a device-less block
manager with one mirror per worker rank (each charged on its own device's
budget, at its own layout's page cost), through
:class:`~kvcached.integration.common.blocks.EngineBlocks`. After every
``Scheduler.schedule`` the pending :class:`kvcached.PageOps` batch is attached
(as is: it pickles itself) to the ``SchedulerOutput``, which vLLM delivers to
every worker in step order; every rank acknowledges on the engine's
acknowledgement board, read at each ``schedule`` and ``update_from_output``.
An idle engine gives its memory back with one ``collective_rpc`` (ordered with
the steps on the same queue) carrying the pending ops to every worker. In an
EngineCore process that happens once its loop has queued the last step's
outputs and is about to wait for input, so the last tokens never wait for it,
and only once the idle hold has passed or the device wants the memory
(:class:`~kvcached.integration.common.idle.IdleRelease`; the loop is woken by a
``WAKEUP`` on its input queue). An in-process EngineCore has no loop to wake:
the same hold applies, and IdleRelease's thread runs the flush itself, under a
lock its steps take too. A busy engine asked to hold less than it does (a
higher-priority instance waits, ``docs/memory-policy.md``) drops cached
prefixes, then preempts, before its next step (:mod:`.shrink`).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from kvcached.errors import IntegrationError
from kvcached.integration.common.blocks import EngineBlocks
from kvcached.integration.common.idle import IdleRelease
from kvcached.integration.common.registration import register_ranks
from kvcached.registry import MemoryPolicy

from .block_pool import KVCachePoolExhausted, building
from .plan import PAGE_OPS_ATTR, PLAN_ATTR, EnginePlan, logger, refuse_unsupported, settings, take_board
from .shrink import shrink_to_limit


class EngineKV:
    """kvcached state of one Scheduler (EngineCore process)."""

    def __init__(self, blocks: EngineBlocks, plan: EnginePlan, name: str) -> None:
        self.blocks = blocks
        self.idle = IdleRelease(settings().idle_release_s, blocks.budgets, max_hold_s=settings().idle_release_max_s)
        self.plan = plan
        self.name = name
        self.num_exhausted = 0  # allocations kvcached refused after vLLM's check passed
        self.num_preempted = 0  # requests vLLM preempted (for lack of KV memory)
        self.short_of_blocks = False  # this step, vLLM saw too few blocks for a request
        self.block_pool: Any = None
        # An in-process EngineCore's steps and its idle flush (on IdleRelease's thread) take turns.
        self.lock = threading.RLock()

    def stats(self) -> dict[str, Any]:
        stats = self.blocks.stats()
        mirrors = stats["mirrors"]
        stats.update(
            name=self.name,
            pid=os.getpid(),
            sent_seq=stats["last_seq"],
            # The slowest live rank's acknowledgement (each rank's is in stats["mirrors"]).
            acked_seq=min((m["acked_seq"] for m in mirrors if m["alive"]), default=stats["last_seq"]),
            ranks=[
                dict(rank=r.rank, device=r.device, local_device=r.local_device, pid=r.pid, num_layers=layout.num_layers)
                for r, layout in zip(self.plan.ranks, self.plan.layouts)
            ],
            num_exhausted=self.num_exhausted,
            num_preempted=self.num_preempted,
            idle_release_s=self.idle.hold_s,
            idle_early_releases=self.idle.num_early,
            **{f"layout_{k}": v for k, v in self.blocks.layout.as_dict().items()},
        )
        return stats


def engine_name(vllm_config: Any) -> str:
    """The engine's name in the registries: ``KVCACHED_NAME``, else ``vllm:<model>:<EngineCore pid>``."""
    name = settings().name
    if name:
        return name
    model = os.path.basename(str(vllm_config.model_config.model).rstrip("/")) or "model"
    return f"vllm:{model}:{os.getpid()}"


def _memory_policy(vllm_config: Any) -> MemoryPolicy:
    """Each rank's memory policy; its max is KVCACHED_LIMIT_BYTES, else vLLM's per-worker KV size setting."""
    policy = settings().policy
    if policy.max_bytes is not None:
        return policy
    return MemoryPolicy(policy.min_bytes, vllm_config.cache_config.kv_cache_memory_bytes, policy.priority)


def wrap_scheduler_init(original: Any) -> Any:
    def __init__(self: Any, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        plan = getattr(kv_cache_config, PLAN_ATTR, None)
        if plan is None:  # not planned by kvcached (e.g. attention-free model)
            return original(self, vllm_config, kv_cache_config, *args, **kwargs)
        refuse_unsupported(vllm_config)
        name = engine_name(vllm_config)
        # One entry per rank in its device's registry, under the rank's own pid (gone with
        # it); the policy lives there, so that ``kvctl set-policy`` can change it while the
        # engine runs. A rank whose weights can sleep registered them already: joined.
        budgets = register_ranks(
            name, plan.ranks, policy=_memory_policy(vllm_config), logger=logger, owned_by_ranks=True, join=True
        )
        try:
            blocks = EngineBlocks.deciding(
                plan.layouts,
                budgets,
                ranks=plan.ranks,
                board=take_board(plan.board_path),
                name=name,
                ack_timeout_s=settings().rank_ack_timeout_s,
                logger=logger,
            )
        except BaseException:
            for budget in budgets:
                budget.unregister()
            raise
        engine = EngineKV(blocks, plan, name)
        token = building.set(engine)
        try:
            original(self, vllm_config, kv_cache_config, *args, **kwargs)
        finally:
            building.reset(token)
        pool = self.kv_cache_manager.block_pool
        if getattr(pool, "_kv", None) is not engine:
            raise IntegrationError("kvcached: vLLM did not build its BlockPool through kvcached's subclass")
        self._kvcached = engine
        engine.block_pool = pool

    return __init__


def wrap_allocate_slots(original: Any) -> Any:
    def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        # Runs for every scheduled request in every step: kvcached serves one
        # KV cache group (others are refused), so look at its manager directly.
        request_id = request.request_id
        managers = self.coordinator.single_type_managers
        if len(managers) == 1:
            had_blocks = request_id in managers[0].req_to_blocks
        else:
            had_blocks = any(request_id in manager.req_to_blocks for manager in managers)
        try:
            blocks = original(self, request, *args, **kwargs)
        except KVCachePoolExhausted as exc:
            if not had_blocks:
                # Undo the prefix-hit touches of a request that got nothing.
                self.coordinator.free(request_id)
            logger.debug("kvcached: %s waits or is preempted: %s", request_id, exc)
            return None
        if blocks is None:
            # vLLM saw too few free blocks and asked kvcached for none: the step's end says
            # how much this engine waits for (schedule), so that others give memory back.
            engine = getattr(self.block_pool, "_kv", None)
            if engine is not None:
                engine.short_of_blocks = True
        return blocks

    return allocate_slots


def wrap_schedule(original: Any) -> Any:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine = getattr(self, "_kvcached", None)
        if engine is None:
            return original(self, *args, **kwargs)
        engine.idle.busy()
        # What the ranks unmapped since the last step is released before this one allocates.
        engine.blocks.poll_acknowledgements()
        engine.block_pool.forget_available()
        if engine.blocks.asked_to_shrink():  # a higher priority waits, or kvctl lowered the limit
            shrink_to_limit(self, engine)
        engine.short_of_blocks = False
        output = original(self, *args, **kwargs)
        if engine.short_of_blocks:
            engine.blocks.want_more(_blocks_waited_for(self))
        ops = engine.blocks.take_page_ops()
        if ops is not None:
            setattr(output, PAGE_OPS_ATTR, ops)
        return output

    return schedule


def _blocks_waited_for(scheduler: Any) -> int:
    """Blocks this engine's requests still need to finish: what it asks the device for while it
    waits, all at once, so that lower priorities are asked for all of it, not a page a step.

    Each waiting request's whole length (prompt and ``max_tokens``, within ``max_model_len``), and
    what each running request has yet to grow: a burst admitted on what it got asks for its decode
    too, instead of letting the holder grow back and then preempting its own requests a page at a
    time."""
    block_size = scheduler.block_size
    cap = getattr(scheduler, "max_model_len", None)

    def blocks(tokens: int) -> int:
        return -(-int(tokens) // block_size)

    def final_tokens(request: Any) -> int:
        whole = getattr(request, "num_prompt_tokens", 0) + (getattr(request, "max_tokens", 0) or 0)
        whole = max(whole, getattr(request, "num_tokens", 0))
        return min(whole, cap) if cap else whole

    waiting = sum(blocks(final_tokens(request)) for request in scheduler.waiting)
    growing = sum(
        max(0, blocks(final_tokens(request)) - blocks(getattr(request, "num_tokens", 0)))
        for request in scheduler.running
    )
    return waiting + growing


def wrap_preempt_request(original: Any) -> Any:
    def _preempt_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine = getattr(self, "_kvcached", None)
        if engine is not None:
            engine.num_preempted += 1
        return original(self, *args, **kwargs)

    return _preempt_request


def wrap_update_from_output(original: Any) -> Any:
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        result = original(self, scheduler_output, model_runner_output)
        engine = getattr(self, "_kvcached", None)
        if engine is not None:
            engine.blocks.poll_acknowledgements()
        return result

    return update_from_output


def _engine_of(engine_core: Any) -> EngineKV | None:
    return getattr(getattr(engine_core, "scheduler", None), "_kvcached", None)


def _in_process(engine_core: Any) -> bool:
    """An EngineCore the caller steps itself (no EngineCoreProc loop of its own)."""
    return not hasattr(type(engine_core), "run_busy_loop")


def release_all_kv(engine_core: Any) -> dict[str, int] | None:
    """Sleep mode: gives all of the engine's KV memory back now, on every rank, the null block's
    page too, and maps none until :func:`resume_kv` (vLLM paused and emptied its prefix cache
    first). Returns the pages unmapped, or None when kvcached does not serve this engine."""
    engine = _engine_of(engine_core)
    if engine is None:
        return None
    with engine.lock:
        engine.block_pool.release_cached_blocks(keep_bytes=0)
        unmapped = engine.blocks.sleep()
        ops = engine.blocks.take_page_ops()
        if ops is not None:
            # Every rank applies and acknowledges on the board before the call returns.
            engine_core.model_executor.collective_rpc("kvcached_apply_page_ops", args=(ops,))
        engine.blocks.poll_acknowledgements()
    return {"unmapped_pages": int(unmapped)}


def resume_kv(engine_core: Any) -> None:
    """After sleep mode: the KV cache may map memory again (the null block's page first; its
    map op reaches the ranks with the next step)."""
    engine = _engine_of(engine_core)
    if engine is not None:
        with engine.lock:
            engine.blocks.wake_up()


def _flush_if_idle(engine_core: Any, *, hold: bool = True) -> None:
    """An idle engine gives its memory back (once its hold has passed, if ``hold``), sending
    the pending page ops to every worker, since no step will carry them."""
    scheduler = getattr(engine_core, "scheduler", None)
    engine = _engine_of(engine_core)
    # Unfinished requests mean another schedule() will carry the ops. Finished
    # ones whose ids are still to be reported do not: an in-process front end
    # stops stepping as soon as it has their outputs.
    if engine is None or scheduler.get_num_unfinished_requests() > 0 or getattr(engine_core, "batch_queue", None):
        return
    if hold and not engine.idle.due():
        wake = _flush_in_process if _in_process(engine_core) else _wake_to_flush
        engine.idle.wake_when_due(lambda: wake(engine_core))
        return
    engine.block_pool.release_cached_blocks(keep_bytes=settings().idle_cache_bytes)
    engine.blocks.trim()  # reserve pages too: an idle engine holds only the null block's page
    ops = engine.blocks.take_page_ops()
    if ops is not None:
        # Every rank applies and acknowledges on the board before the call returns.
        engine_core.model_executor.collective_rpc("kvcached_apply_page_ops", args=(ops,))
    engine.blocks.poll_acknowledgements()


def _wake_to_flush(engine_core: Any) -> None:
    """From IdleRelease's thread: have the EngineCore's loop run the idle flush again.

    The loop runs its idle callbacks, then blocks on its input queue; a WAKEUP
    request (which vLLM itself uses to wake the loop) makes it go round once more.
    """
    from vllm.v1.engine import EngineCoreRequestType

    if _flush_if_idle not in engine_core._idle_state_callbacks:
        engine_core._idle_state_callbacks.append(_flush_if_idle)
    engine_core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))


def _flush_in_process(engine_core: Any) -> None:
    """From IdleRelease's thread: an in-process EngineCore's idle flush, run here.

    Nothing of an in-process EngineCore runs between the caller's steps, so the
    watching thread flushes itself, under the engine's lock: a step the caller
    starts meanwhile waits for it (and one that came first makes it a no-op)."""
    engine = _engine_of(engine_core)
    if engine is None:
        return
    with engine.lock:
        _flush_if_idle(engine_core)


def wrap_flushing(original: Any) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _in_process(self):
            # An in-process EngineCore: the caller steps it and nothing runs
            # after; its idle flush runs on IdleRelease's thread, under this lock.
            engine = _engine_of(self)
            if engine is None:
                return original(self, *args, **kwargs)
            with engine.lock:
                result = original(self, *args, **kwargs)
                _flush_if_idle(self)
            return result
        result = original(self, *args, **kwargs)
        if _flush_if_idle not in self._idle_state_callbacks:
            # EngineCoreProc: its loop calls these once it has no work, after this
            # step's outputs are in the output queue (sent by another thread).
            self._idle_state_callbacks.append(_flush_if_idle)
        return result

    return method


def wrap_serialized(original: Any) -> Any:
    """An in-process EngineCore's entry point that reads or changes what an idle flush does (its requests,
    block pool, workers): it runs under the engine's lock, so never beside a flush on IdleRelease's thread."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine = _engine_of(self)
        if engine is None or not _in_process(self):  # an EngineCoreProc runs all on its loop
            return original(self, *args, **kwargs)
        with engine.lock:
            return original(self, *args, **kwargs)

    return method


def wrap_scheduler_shutdown(original: Any) -> Any:
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        engine = getattr(self, "_kvcached", None)
        if engine is not None:  # the workers are gone: give every rank's budget back, leave the registries
            engine.idle.close()
            with engine.lock:  # an in-process idle flush finishes first
                engine.blocks.close()
        return result

    return shutdown


def engine_core_kvcached_stats(self: Any) -> dict[str, Any] | None:
    """EngineCore utility ``kvcached_stats``: kvcached's view of this engine (None if not active)."""
    engine = getattr(getattr(self, "scheduler", None), "_kvcached", None)
    if engine is None:
        return None
    with engine.lock:  # an in-process engine's idle flush may run on another thread
        engine.blocks.poll_acknowledgements()
        return engine.stats()


__all__ = [
    "EngineKV",
    "engine_core_kvcached_stats",
    "engine_name",
    "release_all_kv",
    "resume_kv",
    "wrap_allocate_slots",
    "wrap_flushing",
    "wrap_preempt_request",
    "wrap_schedule",
    "wrap_scheduler_init",
    "wrap_scheduler_shutdown",
    "wrap_serialized",
    "wrap_update_from_output",
]
