"""SGLang 0.5.23's tensor and pipeline ranks under kvcached: one decision for every rank's scheduler.

Every rank (tensor-parallel rank or pipeline stage) runs its own scheduler,
and SGLang keeps them in step by feeding them the same requests and relying on
identical decisions. kvcached therefore decides once: the engine's first rank
leads (:class:`~kvcached.integration.common.agreed_blocks.LeaderBlocks`, every
rank charged on its own device's budget, all or nothing) and the others replay
its answers (:class:`~kvcached.integration.common.agreed_blocks.FollowerBlocks`),
each mapping the same page ids in its own KV space (a pipeline stage: only its
layers). The ranks meet once, while SGLang builds its KV pools, over SGLang's
own CPU process group. Their allocators: :mod:`.agreed_allocators`.
"""

from __future__ import annotations

from typing import Any, Optional

from kvcached.errors import IntegrationError
from kvcached.integration.common.agreed_blocks import FollowerBlocks, LeaderBlocks
from kvcached.integration.common.rank_devices import RankDevice, require_one_host
from kvcached.layout import KVLayout


def engine_ranks(server_args: Any) -> tuple[int, int]:
    """(this scheduler's index, the number of schedulers deciding the same KV blocks)."""
    if (getattr(server_args, "tp_size", 1) or 1) * (getattr(server_args, "pp_size", 1) or 1) == 1:
        return 0, 1
    from sglang.srt.runtime_context import get_parallel

    world = get_parallel().world_group
    return world.rank_in_group, world.world_size


def _collectives() -> tuple[Any, Any, int]:
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    world = get_parallel().world_group
    return dist, world.cpu_group, world.ranks[0]


def agreed_virtual_bytes(own_bytes: int) -> int:
    """The smallest virtual capacity of every rank, so that every rank sizes the same pool."""
    import torch

    dist, group, _ = _collectives()
    value = torch.tensor([own_bytes], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return int(value.item())


def _check(ranks: list[RankDevice], layouts: list[KVLayout]) -> None:
    require_one_host(ranks, ranks_called="SGLang rank", decider="the deciding rank (rank 0)")
    first = layouts[0]
    for rank, layout in enumerate(layouts):
        if (layout.num_blocks, layout.blocks_per_page) != (first.num_blocks, first.blocks_per_page):
            raise IntegrationError(f"kvcached: rank {rank} plans {layout}, rank 0 {first}: the ranks must agree")


def first_ranks_value(value: Any) -> Any:
    """The first rank's ``value`` on every rank (a collective: every rank calls it at the same point)."""
    dist, group, leader_rank = _collectives()
    box = [value]
    dist.broadcast_object_list(box, src=leader_rank, group=group)
    return box[0]


def tensor_ranks_barrier() -> None:
    """Waits for every tensor rank of this pipeline stage (SGLang answers a caller from the first:
    what the others do for the same request is then done too)."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    dist.barrier(group=get_parallel().tp_group.cpu_group)


def open_agreed_blocks(plan: Any, layout: KVLayout) -> Any:
    """Every rank's blocks, decided by the first rank (a collective: every rank calls it while building its pool)."""
    dist, group, leader_rank = _collectives()
    me, size = plan.rank.rank, plan.num_ranks
    rank = plan.rank
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, (rank, layout), group=group)
    ranks = [found for found, _ in gathered]
    layouts = [found for _, found in gathered]
    leader: Optional[LeaderBlocks] = None
    answer: list[Any] = [None]
    if me == 0:
        try:
            _check(ranks, layouts)
            leader, setup = LeaderBlocks.open(
                layouts,
                ranks,
                name=plan.name,
                policy=plan.settings.policy,
                ack_timeout_s=plan.settings.rank_ack_timeout_s,
            )
            answer = [("ok", setup)]
        except BaseException as exc:
            answer = [("error", f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(answer, src=leader_rank, group=group)
    status, setup = answer[0]
    if status != "ok":
        raise IntegrationError(f"kvcached: the deciding rank could not set up the engine's KV cache: {setup}")
    blocks: Any = leader
    failure = None
    if me != 0:
        try:
            blocks = FollowerBlocks.open(setup, layouts, rank)
        except BaseException as exc:
            failure = f"rank {me}: {type(exc).__name__}: {exc}"
    failures: list[Any] = [None] * size
    dist.all_gather_object(failures, failure, group=group)
    problems = [found for found in failures if found]
    if problems:
        if blocks is not None:
            blocks.close()
        raise IntegrationError("kvcached: a rank could not attach to the deciding rank: " + "; ".join(problems))
    if leader is not None:
        leader.followers_attached()
    return blocks


__all__ = [
    "agreed_virtual_bytes",
    "engine_ranks",
    "first_ranks_value",
    "open_agreed_blocks",
    "tensor_ranks_barrier",
]
