"""Helpers shared by the tests: which devices to run on, and byte access to their memory."""

from __future__ import annotations

import ctypes
import os

import kvcached


def available_device_specs() -> list[str]:
    """'cpu' always, plus the first device of each GPU backend usable here."""
    return kvcached.devices.usable_devices()


def has_gpu() -> bool:
    return len(available_device_specs()) > 1 and not emulated_gpu()


def emulated_gpu() -> bool:
    """True when the GPU backends run over the test-only driver emulation (host memory)."""
    return os.environ.get("KVCACHED_EMULATED_GPU") == "1"


class ByteAccess:
    """Reads and writes device memory: numpy on host, torch on a real GPU, raw
    pointers under the driver emulation (whose "device" memory is host memory)."""

    def __init__(self, device) -> None:
        self.device = device

    def write(self, address: int, data: bytes) -> None:
        if self.device.backend == "host" or emulated_gpu():
            ctypes.memmove(address, data, len(data))
            return
        import torch

        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        view = torch.from_dlpack(self.device.view(address, len(data), None))
        view.copy_(src.to(view.device))
        torch.cuda.synchronize(view.device)

    def read(self, address: int, size: int) -> bytes:
        if self.device.backend == "host" or emulated_gpu():
            return ctypes.string_at(address, size)
        import torch

        view = torch.from_dlpack(self.device.view(address, size, None))
        return bytes(view.cpu().numpy().tobytes())
