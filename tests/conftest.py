"""Shared fixtures: the devices the contract suite runs on, and byte access to them."""

from __future__ import annotations

import os

import pytest

import kvcached
from device_access import ByteAccess, available_device_specs, has_gpu


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


@pytest.fixture
def env_without_torch(tmp_path) -> dict[str, str]:
    """An environment for child processes in which ``import torch`` fails, as where it is not
    installed (a package of that name that raises ImportError comes first on the path)."""
    hidden = tmp_path / "torch-hidden"
    (hidden / "torch").mkdir(parents=True)
    (hidden / "torch" / "__init__.py").write_text('raise ImportError("torch is hidden by this test")\n')
    path = os.pathsep.join(filter(None, [str(hidden), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture(params=available_device_specs())
def device(request) -> kvcached._core.Device:
    return kvcached.open_device(request.param)


@pytest.fixture
def host_device() -> kvcached._core.Device:
    return kvcached.open_device("cpu")


@pytest.fixture
def access(device) -> ByteAccess:
    return ByteAccess(device)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a real GPU (CUDA or HIP); none usable here")
    for item in items:
        if "gpu" in item.keywords and not has_gpu():
            item.add_marker(skip_gpu)
