"""ModelWeights: a module's weights moved once into kvcached memory, then put to sleep and woken in place.

After adoption every parameter and buffer of the module lives in one
:class:`kvcached._core.WeightSpace` range (its ``data_ptr()`` changes once,
here); :meth:`ModelWeights.sleep` gives the device memory back (level 1 after
copying the contents to host memory, level 2 discarding them) and
:meth:`ModelWeights.wake_up` maps it again at the same addresses, so views,
compiled kernels and CUDA graphs captured before the sleep stay valid. The bytes
are charged to the device's budget beside the KV caches: on the registry entry
the weights register under (``weights_bytes``, ``sleeping``), so ``kvctl`` and
``kvtop`` show them. ``docs/sleep.md`` says more.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any, Optional, Union

from kvcached import _core, defaults
from kvcached.errors import InvalidArgumentError, InvalidTypeError, OutOfMemoryError
from kvcached.sizes import format_bytes
from kvcached.weights.placement import module_tensors, place, rebuild, storage_bytes

#: How long :meth:`ModelWeights.wake_up` waits by default for memory that other
#: instances give back (an idle engine gives its KV memory back within about 10 ms
#: of a refusal; a busy lower-priority one within a few of its steps).
DEFAULT_WAKE_TIMEOUT_S = 1.0
# Between two tries of a waiting wake: each refused try renews the demand in the registry.
_WAKE_RETRY_S = 0.005
_SLEEP_LEVELS = (1, 2)
_names = itertools.count()
# Module -> the ModelWeights holding its tensors (one at a time).
_adopted: weakref.WeakKeyDictionary[Any, ModelWeights] = weakref.WeakKeyDictionary()
_adopt_lock = threading.Lock()


def _device_for(tensors: list[Any], device: Union[str, _core.Device, None]) -> _core.Device:
    from kvcached.devices import open_device

    if isinstance(device, _core.Device):
        return device
    if device is None:
        first = tensors[0].device
        if first.type == "cpu":
            device = "cpu"
        else:
            import torch

            device = f"{'hip' if torch.version.hip else first.type}:{first.index or 0}"
    return open_device(device)


def _torch_device_of(device: _core.Device) -> Any:
    import torch

    return torch.device("cpu") if device.backend == "host" else torch.device("cuda", device.ordinal)


def _weights_budget(budget: Any) -> Any:
    """The WeightsBudget to charge: a WeightsBudget as it is, a registry entry's weights
    view, or a plain MemoryBudget (a FixedBudget) wrapped."""
    if budget is None or isinstance(budget, _core.WeightsBudget):
        return budget
    if isinstance(budget, _core.RegistryBudget):
        return budget.weights_budget()
    if isinstance(budget, _core.MemoryBudget):
        return _core.MemoryBudgetWeights(budget)
    raise InvalidTypeError(
        f"budget must be a WeightsBudget, RegistryBudget or MemoryBudget, got {type(budget).__name__}"
    )


class ModelWeights:
    """Every parameter and buffer of ``module`` in kvcached memory that can sleep and wake.

    Args:
        module: a ``torch.nn.Module`` whose tensors all live on ``device``.
        device: ``"cpu"``, ``"cuda:N"``, ``"hip:N"`` or an opened device (default: where
            the module's tensors are).
        name: the weights' name in the device registry (default ``weights-<pid>-<n>``).
        budget: what to charge: a ``RegistryBudget`` (an existing registry entry, e.g. an
            engine rank's: the weights go on that entry), a ``MemoryBudget`` or a
            ``WeightsBudget``. Default: a registry entry of their own, under ``name``.
        register: with no ``budget``, register in the device registry (False: no budget).
        chunk_bytes: size of each physical allocation behind the range (default 256 MiB):
            driver costs follow the number of allocations, not their size.

    Raises :class:`~kvcached.errors.InvalidArgumentError` (module untouched) for tensors on
    another device or of another layout, a module already adopted, or no tensors at all;
    :class:`~kvcached.errors.OutOfMemoryError` when the budget or the device has no room.
    """

    def __init__(
        self,
        module: Any,
        device: Union[str, _core.Device, None] = None,
        name: Optional[str] = None,
        *,
        budget: Any = None,
        register: bool = True,
        chunk_bytes: Optional[int] = None,
    ) -> None:
        import torch

        if not isinstance(module, torch.nn.Module):
            raise InvalidTypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        tensors = module_tensors(module)
        if not tensors:
            raise InvalidArgumentError("the module has no parameters or buffers to move")
        self.device = _device_for(tensors, device)
        self.name = name or f"weights-{os.getpid()}-{next(_names)}"
        placement = place(tensors, _torch_device_of(self.device))
        self.module = module
        self._registration = None
        with _adopt_lock:
            holder = _adopted.get(module)
            if holder is not None:
                raise InvalidArgumentError(f"the module's weights are already held by ModelWeights {holder.name!r}")
            if budget is None and register:  # an entry of their own, as a pool given no budget gets
                budget = self._registration = defaults.current().pool_budget(self.device.name, self.name)
            try:
                self._space = _core.WeightSpace(
                    self.device, placement.size_bytes, _weights_budget(budget), chunk_bytes or 0
                )
                self._adopt(placement)
            except BaseException:
                if getattr(self, "_space", None) is not None:
                    self._space.close()
                if self._registration is not None:
                    self._registration.unregister()
                raise
            _adopted[module] = self
        self._lock = threading.Lock()

    def _slot_bytes(self, slot: Any) -> Any:
        """A slot of the range as a uint8 tensor with a storage of its own (keeps the reservation alive)."""
        import torch

        space = self._space
        view = self.device.view(space.base_address + slot.offset, max(slot.nbytes, 1), space.memory_owner())
        return torch.from_dlpack(view)[: slot.nbytes]

    def _adopt(self, placement: Any) -> None:
        """Copies every storage into its slot, then points every tensor at it."""
        slots = [self._slot_bytes(slot) for slot in placement.slots]
        for slot, target in zip(placement.slots, slots):
            target.copy_(storage_bytes(slot.source))
        self._rebind(placement, slots)
        self._placement = placement
        base = self._space.base_address
        self._slot_by_address = {base + slot.offset: slot for slot in placement.slots}
        self._kept: set[int] = set()  # offsets of the slots whose contents the current sleep keeps
        if self.device.backend != "host":
            import torch

            torch.cuda.synchronize(slots[0].device)
            torch.cuda.empty_cache()  # the old storages go back to the device, not torch's cache

    @staticmethod
    def _rebind(placement: Any, slots: list[Any]) -> None:
        # `.data =` keeps each Parameter / buffer object (and what engines attached to it).
        rebuilt = [
            (tensor, rebuild(tensor, target)) for slot, target in zip(placement.slots, slots) for tensor in slot.tensors
        ]
        for tensor, new in rebuilt:
            tensor.data = new

    @property
    def nbytes(self) -> int:
        """Device memory the weights hold while awake (whole granules)."""
        return int(self._space.size_bytes)

    @property
    def is_sleeping(self) -> bool:
        return self._space.sleep_level != 0

    @property
    def sleep_level(self) -> int:
        """0 while awake, else 1 (contents kept in host memory) or 2 (discarded)."""
        return int(self._space.sleep_level)

    @property
    def closed(self) -> bool:
        return bool(self._space.closed)

    def sleep(self, level: int = 1, keep: Iterable[Any] = ()) -> None:
        """Gives the device memory back: level 1 keeps the contents in host memory, level 2
        discards them but for the storages of the tensors in ``keep`` (the module's own:
        buffers a weight update does not rewrite). Waits for the device's queued work first.
        A no-op when asleep."""
        if isinstance(level, bool) or not isinstance(level, int) or level not in _SLEEP_LEVELS:
            raise InvalidArgumentError(f"sleep level must be 1 or 2, got {level!r}")
        kept = {self._slot_of(tensor).offset: self._slot_of(tensor) for tensor in keep} if level == 2 else {}
        with self._lock:
            self._space.sleep(level, [(slot.offset, slot.nbytes) for slot in kept.values()])
            if self._space.sleep_level == level:  # not a no-op
                self._kept = set(kept) if level == 2 else {slot.offset for slot in self._placement.slots}

    def _slot_of(self, tensor: Any) -> Any:
        """The slot of one of the module's tensors; ValueError for any other tensor."""
        storage = getattr(tensor, "untyped_storage", None)
        slot = self._slot_by_address.get(storage().data_ptr()) if storage is not None else None
        if slot is None:
            raise InvalidArgumentError("keep: a tensor that is not one of the module's parameters or buffers")
        return slot

    def wake_up(self, timeout_s: float = DEFAULT_WAKE_TIMEOUT_S) -> None:
        """Maps the weights back at the same addresses (level 1: contents restored; level 2:
        zeros, for the engine to load again). A no-op when awake.

        Waits up to ``timeout_s`` for the device budget to have room (each refused try asks
        idle and lower-priority instances to give memory back); then raises
        :class:`~kvcached.errors.OutOfMemoryError` and the weights stay asleep."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s >= 0:
            raise InvalidArgumentError(f"timeout_s must be a number of seconds, 0 or more, got {timeout_s!r}")
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self._space.try_wake():
                if time.monotonic() >= deadline:
                    raise OutOfMemoryError(
                        f"waking the weights {self.name!r} needs {format_bytes(self.nbytes)}; the device budget "
                        f"did not have room within {timeout_s:g} s: put another model to sleep, lower another "
                        "instance's memory, or raise the budget (kvctl set-budget)"
                    )
                time.sleep(_WAKE_RETRY_S)

    def release_host_buffer(self) -> None:
        """Frees the host memory kept after a level-1 sleep for the next one (not while asleep at level 1)."""
        self._space.release_host_buffer()

    def stats(self) -> dict:
        """Sizes, state and counts (``mapped_bytes``, ``host_buffer_bytes``, ``sleeps``, ``wakes``, ...)."""
        stats = dict(self._space.stats())
        stats["name"] = self.name
        stats["tensors"] = len(self._placement.tensors)
        return stats

    def close(self) -> None:
        """Gives the module back to ordinary torch memory on its device (what a wake would give:
        the contents, or zeros after a level-2 sleep), then releases kvcached's range and
        registry entry. Idempotent."""
        import numpy as np
        import torch

        with self._lock:
            if self._space.closed:
                return
            level = self.sleep_level
            torch_device = _torch_device_of(self.device)
            plain = []
            for slot in self._placement.slots:
                if level == 0:
                    target = self._slot_bytes(slot).clone()
                elif slot.offset in self._kept:
                    host = np.empty(slot.nbytes, dtype=np.uint8)
                    self._space.copy_kept_contents(slot.offset, host)
                    target = torch.from_numpy(host).to(torch_device)
                else:
                    target = torch.zeros(slot.nbytes, dtype=torch.uint8, device=torch_device)
                plain.append(target)
            self._rebind(self._placement, plain)
            self._space.close()
            if self._registration is not None:
                self._registration.unregister()
            with _adopt_lock:
                if _adopted.get(self.module) is self:
                    del _adopted[self.module]

    def __enter__(self) -> ModelWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "awake" if self.sleep_level == 0 else f"asleep (level {self.sleep_level})"
        return f"ModelWeights({self.name!r}, {format_bytes(self.nbytes)} on {self.device.name}, {state})"


__all__ = ["DEFAULT_WAKE_TIMEOUT_S", "ModelWeights"]
