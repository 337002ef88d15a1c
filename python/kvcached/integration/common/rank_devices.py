"""Which physical device each rank of an engine holds its KV tensors on.

The process that decides blocks (vLLM's EngineCore) never opens a device, so
it cannot tell which GPU a rank uses. Each rank describes its own device where
it has it open (:func:`describe_rank`); the deciding side registers the engine
in each of those devices' registries, keyed by the physical identity
(``cuda-GPU-<uuid>``, ``hip-GPU-<uuid>``, ``cpu``), with the rank and the index
it sees as the entry's local device (``rank0-cuda:0``). Pools, both engine
integrations, ``kvctl`` and ``kvtop`` therefore name a device alike, whatever
``CUDA_VISIBLE_DEVICES`` each process has.

Torch devices become kvcached device names through one function,
:func:`kvcached.devices.device_name_from_torch` (``cuda:N`` under a ROCm
torch is ``hip:N``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence
from typing import Any

from kvcached.errors import IntegrationError


@dataclasses.dataclass(frozen=True)
class RankDevice:
    """One rank's device, as that rank's process found it (picklable: it crosses processes)."""

    rank: int  # the rank's index among the engine's KV spaces (vLLM's global worker rank)
    device: str  # physical identity, the registry's key: "cpu", "cuda-GPU-<uuid>", ...
    local_device: str  # as the rank's process sees it: "cpu", "cuda:0", "hip:1"
    total_bytes: int  # the device's memory (host: kvcached's host capacity)
    pid: int  # the rank's process: the one that applies and acknowledges page ops
    host: str  # the machine it runs on (acknowledgements travel through shared memory)

    @property
    def label(self) -> str:
        """The registry entry's local device: the rank and the index it sees ("rank0-cuda:0")."""
        return f"rank{self.rank}-{self.local_device}"


def describe_rank(torch_device: Any, rank: int) -> RankDevice:
    """Describes this process's device for ``rank``; creates the device's registry if no engine has.

    Called in the process that holds the KV tensors (it may open the device).
    """
    from kvcached.devices import canonical_device_name, device_name_from_torch, open_device
    from kvcached.registry import HOST_DEVICE, registry_for

    local = device_name_from_torch(torch_device)
    total_bytes = int(open_device(local).memory_info()[1])
    registry_for(local, None if local == HOST_DEVICE else total_bytes)
    return RankDevice(
        rank=rank,
        device=canonical_device_name(local),
        local_device=local,
        total_bytes=total_bytes,
        pid=os.getpid(),
        host=socket.gethostname(),
    )


def require_one_host(
    ranks: Sequence[RankDevice], *, ranks_called: str, decider: str, error: type = IntegrationError
) -> None:
    """Raises ``error`` unless every rank runs on this host, the deciding process's: page ops and
    acknowledgements travel through shared memory (:mod:`kvcached.integration.common.acks`).

    ``ranks_called`` and ``decider`` name them as the engine does ("worker", "the EngineCore").
    """
    host = socket.gethostname()
    remote = sorted({rank.host for rank in ranks} - {host})
    if remote:
        raise error(
            f"kvcached needs every {ranks_called} on the host of {decider} ({host}); {ranks_called}s run on "
            f"{', '.join(remote)}. Unset KVCACHED_ENABLE for multi-node engines."
        )


__all__ = ["RankDevice", "describe_rank", "require_one_host"]
