"""Shared fixtures: the devices the contract suite runs on, and byte access to them."""

from __future__ import annotations

import ctypes
import os

import pytest

import kvcached


@pytest.fixture(autouse=True, scope="session")
def private_registry(tmp_path_factory):
    """Pools register in a per-device shared-memory registry: give the test
    session its own, so tests never see (or fill) another process's budget."""
    previous = os.environ.get("KVCACHED_REGISTRY_DIR")
    os.environ["KVCACHED_REGISTRY_DIR"] = str(tmp_path_factory.mktemp("registry"))
    yield
    if previous is None:
        os.environ.pop("KVCACHED_REGISTRY_DIR", None)
    else:
        os.environ["KVCACHED_REGISTRY_DIR"] = previous


def available_device_specs() -> list[str]:
    """'cpu' always, plus the first device of each GPU backend usable here."""
    specs = ["cpu"]
    for status in kvcached.backends():
        if status.name != "host" and status.available:
            specs.append(f"{status.name}:0")
    return specs


def has_gpu() -> bool:
    return len(available_device_specs()) > 1 and not emulated_gpu()


def emulated_gpu() -> bool:
    """True when the GPU backends run over the test-only driver emulation (host memory)."""
    return os.environ.get("KVCACHED_EMULATED_GPU") == "1"


@pytest.fixture(params=available_device_specs())
def device(request) -> "kvcached._core.Device":
    return kvcached.open_device(request.param)


@pytest.fixture
def host_device() -> "kvcached._core.Device":
    return kvcached.open_device("cpu")


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


@pytest.fixture
def access(device) -> ByteAccess:
    return ByteAccess(device)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a real GPU (CUDA or HIP); none usable here")
    for item in items:
        if "gpu" in item.keywords and not has_gpu():
            item.add_marker(skip_gpu)
