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


class EmulatedHipWork:
    """Device work (hipMemcpy) through the HIP runtime loaded in this process,
    the emulation's under the emulated suite: it sees what a GPU kernel would
    (a mapping inside its visibility window reads zeros; a range spanning two
    reservations is refused)."""

    HOST_TO_DEVICE, DEVICE_TO_HOST = 1, 2

    def __init__(self) -> None:
        import kvcached._hip  # noqa: F401  (loads the runtime)

        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libamdhip64.so" in line}
        if len(paths) != 1:
            raise RuntimeError(f"expected one libamdhip64 in this process, found {sorted(paths)}")
        self.runtime = ctypes.CDLL(paths.pop())
        self.runtime.hipMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.runtime.hipMemcpy.restype = ctypes.c_int

    def copy(self, destination: int, source: int, size: int, kind: int) -> int:
        """hipMemcpy's result code (0: hipSuccess)."""
        return int(self.runtime.hipMemcpy(destination, source, size, kind))

    def write(self, address: int, data: bytes) -> None:
        source = ctypes.create_string_buffer(data, len(data))
        code = self.copy(address, ctypes.addressof(source), len(data), self.HOST_TO_DEVICE)
        if code != 0:
            raise RuntimeError(f"hipMemcpy to the device returned {code}")

    def read(self, address: int, size: int) -> bytes:
        target = ctypes.create_string_buffer(size)
        code = self.copy(ctypes.addressof(target), address, size, self.DEVICE_TO_HOST)
        if code != 0:
            raise RuntimeError(f"hipMemcpy from the device returned {code}")
        return target.raw


class ByteAccess:
    """Reads and writes device memory: numpy on host, torch on a real GPU, the
    emulated runtime's hipMemcpy under the HIP emulation, raw pointers under
    the CUDA one (whose "device" memory is host memory)."""

    def __init__(self, device) -> None:
        self.device = device
        self.hip = EmulatedHipWork() if device.backend == "hip" and emulated_gpu() else None

    def write(self, address: int, data: bytes) -> None:
        if self.hip is not None:
            self.hip.write(address, data)
            return
        if self.device.backend == "host" or emulated_gpu():
            ctypes.memmove(address, data, len(data))
            return
        import torch

        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        view = torch.from_dlpack(self.device.view(address, len(data), None))
        view.copy_(src.to(view.device))
        torch.cuda.synchronize(view.device)

    def read(self, address: int, size: int) -> bytes:
        if self.hip is not None:
            return self.hip.read(address, size)
        if self.device.backend == "host" or emulated_gpu():
            return ctypes.string_at(address, size)
        import torch

        view = torch.from_dlpack(self.device.view(address, size, None))
        return bytes(view.cpu().numpy().tobytes())
