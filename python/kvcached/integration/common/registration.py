"""How an engine integration enters the per-device registries (kvctl, kvtop).

An engine registers once per rank, before it creates the block manager that
decides its blocks: each rank's entry is in the registry of that rank's
physical device (:class:`~kvcached.integration.common.rank_devices.RankDevice`),
named after the engine, with the rank and the index it sees as its local device.
Each entry's budget is the one that rank's memory is charged on (a
:class:`kvcached.layout.Mirror` each), so ``kvctl list`` shows every rank and
``kvctl set-limit NAME`` steers all of them. This module is the one place that
adapts the engine integrations to the registry.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

from kvcached import registry
from kvcached.errors import IntegrationError
from kvcached.integration.common.rank_devices import RankDevice
from kvcached.registry import MemoryPolicy

_logger = logging.getLogger(__name__)


def register_rank(
    name: str,
    rank: RankDevice,
    *,
    policy: MemoryPolicy,
    logger: Optional[logging.Logger] = None,
    owned_by_rank: bool = False,
    join: bool = False,
) -> Any:
    """Registers rank ``rank`` of engine ``name`` in its device's registry; returns the entry's budget.

    With ``owned_by_rank`` the entry carries the rank's own process id (not
    this process's): ``kvctl set-limit pid:N`` then steers that rank alone,
    and the entry goes stale when the rank's process dies.

    With ``join`` a live entry of the same name and process id is joined, not
    duplicated: the rank's model weights (:class:`kvcached.ModelWeights`) may
    have registered it first, and a rank's weights and KV cache are one row.
    Only where each rank's entry has a process id of its own.

    The registry exists already: the rank's process created it
    (:func:`~kvcached.integration.common.rank_devices.describe_rank`), so this
    process never opens the device. The memory ``policy`` (``docs/memory-policy.md``)
    lives in the registry, so ``kvctl set-policy`` can change it later.

    With ``join`` an entry the rank already has under ``name`` (its model weights,
    registered by the rank's own process when it loaded them) is joined, so the
    rank's weights and KV cache are one entry.
    """
    existing = registry.open_existing(rank.device)
    if existing is None:
        if rank.device != registry.HOST_DEVICE:
            raise IntegrationError(
                f"kvcached: no registry for {rank.device}; the rank holding it should have created it"
            )
        existing = registry.registry_for(rank.device)
    pid = rank.pid if owned_by_rank else None
    budget = existing.register(name, pid=pid, policy=policy, local_device=rank.label, join=join)
    (logger or _logger).info(
        "kvcached: registered %r (%s) on %s (device budget %d B, %s)",
        name,
        rank.label,
        rank.device,
        existing.budget_bytes,
        policy,
    )
    return budget


def register_ranks(
    name: str,
    ranks: Sequence[RankDevice],
    *,
    policy: MemoryPolicy,
    logger: Optional[logging.Logger] = None,
    owned_by_ranks: bool = False,
    join: bool = False,
) -> list[Any]:
    """One entry per rank (see :func:`register_rank`), all or nothing."""
    budgets: list[Any] = []
    try:
        for rank in ranks:
            budgets.append(
                register_rank(name, rank, policy=policy, logger=logger, owned_by_rank=owned_by_ranks, join=join)
            )
    except BaseException:
        for budget in budgets:
            budget.unregister()
        raise
    return budgets


__all__ = ["register_rank", "register_ranks"]
