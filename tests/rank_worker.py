"""A rank-like process: one KV space on a GPU it sees under its own visible-devices mask.

Started by :class:`rank_processes.Worker` (``python -m rank_worker FD``), it answers
commands over the connection on file descriptor FD: it names the devices it
sees (local index and physical identity) and creates their registries, applies
the page ops a block manager in another process decides, writes and reads
blocks, and keeps registry entries alive for ``kvctl`` / ``kvtop`` to show.

Device access is the only part that differs between a real GPU and the driver
emulation: on a GPU, torch kernels write through the space's DLPack view,
queued behind a long matmul chain so they are still running when an unmap
arrives (the space must synchronise first); over the emulation, which runs no
kernels, the same writes go through the emulated runtime or host views
(``device_access.ByteAccess``).
"""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

import kvcached
from device_access import ByteAccess, emulated_gpu
from kvcached.devices import backend_status, canonical_device_name
from kvcached.registry import registry_for

# Matmuls queued ahead of the writes: long enough that they still run when the unmap is asked for.
BUSY_MATMULS = 20
BUSY_SIDE = 4096


class KernelAccess:
    """Blocks written and read by torch kernels on a real GPU, through the DLPack view."""

    def __init__(self, space: kvcached.KVSpace) -> None:
        import torch

        self.torch = torch
        self.flat = torch.from_dlpack(space.tensor())
        self.busy = torch.randn(BUSY_SIDE, BUSY_SIDE, device=self.flat.device)

    def keep_device_busy(self) -> None:
        for _ in range(BUSY_MATMULS):
            self.busy = self.busy @ self.busy
            self.busy /= self.busy.norm()

    def write(self, offset: int, size: int, value: int) -> None:
        self.flat[offset : offset + size].fill_(value)  # queued, not waited for

    def values(self, offset: int, size: int) -> list[int]:
        return sorted(self.flat[offset : offset + size].unique().tolist())

    def finish(self) -> None:
        """Waits for every kernel; raises if one touched memory that was not mapped."""
        self.torch.cuda.synchronize(self.flat.device)

    def close(self) -> None:
        del self.flat, self.busy


class EmulatedAccess:
    """The same operations over the driver emulation: synchronous host-side writes and reads."""

    def __init__(self, space: kvcached.KVSpace) -> None:
        self.base = space.base_address
        self.bytes = ByteAccess(space.device)

    def keep_device_busy(self) -> None:
        pass  # the emulation runs no kernels: every write is done when it returns

    def write(self, offset: int, size: int, value: int) -> None:
        self.bytes.write(self.base + offset, bytes([value]) * size)

    def values(self, offset: int, size: int) -> list[int]:
        counts = np.bincount(np.frombuffer(self.bytes.read(self.base + offset, size), dtype=np.uint8), minlength=256)
        return np.flatnonzero(counts).tolist()

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class Rank:
    """The worker's state: its KV space (once opened) and the registry entries it keeps."""

    def __init__(self) -> None:
        self.space: Any = None
        self.access: Any = None
        self.baseline_created_bytes = 0
        self.entries: list[Any] = []

    # ---- devices and registries ---------------------------------------------------------

    def identify(self, backend: str) -> dict[str, Any]:
        """Every device this process sees: local name, physical identity, registry file (created here)."""
        status = backend_status(backend)
        if not status.available:
            raise RuntimeError(f"no {backend} device here: {status.reason}")
        devices = []
        for ordinal in range(status.device_count):
            local = f"{backend}:{ordinal}"
            registry = registry_for(local)
            devices.append(
                {
                    "local": local,
                    "identity": canonical_device_name(local),
                    "registry": registry.device,
                    "path": registry.path,
                }
            )
        return {"pid": _pid(), "devices": devices}

    def register(self, name: str, backend: str) -> dict[str, Any]:
        """Registers ``name`` on every device this process sees, as an engine would (kept until
        close); returns :meth:`identify`'s answer."""
        seen = self.identify(backend)
        for device in seen["devices"]:
            self.entries.append(registry_for(device["local"]).register(name))
        return seen

    # ---- the KV space -------------------------------------------------------------------

    def open_space(self, layout: kvcached.KVLayout, local_device: str) -> dict[str, Any]:
        """A fresh KV space on ``local_device`` (page-op batches count from 1 for each block
        manager), and its device's registry (created if needed)."""
        if self.space is not None:
            left = self.close_space()
            if left != {"mapped_pages": 0, "device_mapped_bytes": 0, "device_created_bytes": 0}:
                raise RuntimeError(f"the previous KV space left memory behind: {left}")
        registry = registry_for(local_device)  # normally made by identify() already
        self.space = kvcached.KVSpace(layout, local_device, kvcached.KVSpaceOptions(zero_backing=True))
        self.access = EmulatedAccess(self.space) if emulated_gpu() else KernelAccess(self.space)
        self.baseline_created_bytes = self.space.device.counters()["created_bytes"]  # the zero backing
        return {
            "pid": _pid(),
            "identity": self.space.device.canonical_name,
            "registry_path": registry.path,
            **self.memory(),
        }

    def memory(self) -> dict[str, int]:
        """What the space holds, from the space and from the device's own allocation count."""
        created = self.space.device.counters()["created_bytes"] - self.baseline_created_bytes
        return {"mapped_pages": self.space.mapped_pages, "page_bytes_created": created}

    def regions(self, blocks: list[int]):
        layout = self.space.kv_layout
        for block in blocks:
            for layer in range(layout.num_layers):
                for buffer in range(layout.num_buffers):
                    yield block, layout.offset_of(layer, buffer, block)

    def write(self, blocks: list[int], value: int) -> None:
        size = self.space.kv_layout.block_bytes
        for _block, offset in self.regions(blocks):
            self.access.write(offset, size, value)

    def apply(self, ops: kvcached.PageOps) -> dict[str, Any]:
        seq = self.space.apply(ops)
        self.access.finish()
        return {"seq": seq, **self.memory()}

    def write_then_apply(self, blocks: list[int], value: int, ops: kvcached.PageOps) -> dict[str, Any]:
        """Kernels writing ``blocks`` are still queued (behind busy work) when ``ops`` unmaps some of them."""
        self.access.keep_device_busy()
        self.write(blocks, value)
        return self.apply(ops)  # apply fences before unmapping; finish() raises on a fault

    def read(self, blocks: list[int]) -> list[list[int]]:
        """Per block, the distinct byte values over all its layers and buffers."""
        size = self.space.kv_layout.block_bytes
        values: dict[int, set[int]] = {block: set() for block in blocks}
        for block, offset in self.regions(blocks):
            values[block].update(self.access.values(offset, size))
        return [sorted(values[block]) for block in blocks]

    def close_space(self) -> dict[str, int]:
        """Closes the space; returns what its device still counts once it is gone."""
        import gc

        device = self.space.device
        self.access.close()
        self.space.close()
        result = {"mapped_pages": self.space.mapped_pages}
        self.space = self.access = None
        gc.collect()  # the zero backing lives as long as the space or a view into it
        counters = device.counters()
        result.update(device_mapped_bytes=counters["mapped_bytes"], device_created_bytes=counters["created_bytes"])
        return result

    def close(self) -> dict[str, Any]:
        result = self.close_space() if self.space is not None else {}
        for entry in self.entries:
            entry.unregister()
        return result


def _pid() -> int:
    return os.getpid()


def serve(connection: Connection) -> None:
    rank = Rank()
    while True:
        command, *args = connection.recv()
        try:
            if command == "close":
                connection.send(("ok", rank.close()))
                return
            connection.send(("ok", getattr(rank, command)(*args)))
        except Exception as error:  # reported to the test, which fails with it
            connection.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
