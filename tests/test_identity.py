"""Physical device identity: processes that see one GPU under different ordinals name it alike.

Runs over the driver emulation with two physical GPUs, each configuration in a
process of its own (the drivers read their masks once).
"""

from __future__ import annotations

import functools
import re

import pytest

import kvcached
from emulated_process import run_emulated
from kvcached.devices import canonical_device_name, device_name_from_torch

pytestmark = pytest.mark.emulation

CUDA_UUID = re.compile(r"cuda-GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
HIP_UUID = re.compile(r"hip-GPU-[0-9a-f]{16}")
TWO_GPUS = {"KVCACHED_EMULATED_GPUS": "2"}

# Every ordinal the process sees, its identity without and with opening the device.
IDENTITIES = """
    import json, kvcached
    from kvcached.devices import backend_status, canonical_device_name
    status = backend_status("{backend}")
    names = [canonical_device_name(f"{backend}:{{i}}") for i in range(status.device_count)]
    opened = [kvcached.open_device(f"{backend}:{{i}}").canonical_name for i in range(status.device_count)]
    print(json.dumps(dict(names=names, opened=opened)))
"""


def identities(backend: str, **env: str) -> list[str]:
    """The identities of the devices a process sees, ordinal by ordinal."""
    return list(_identities(backend, tuple(sorted(env.items()))))


@functools.cache  # one process per configuration
def _identities(backend: str, env: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    seen = run_emulated(backend, IDENTITIES.format(backend=backend), {**TWO_GPUS, **dict(env)})
    assert seen["names"] == seen["opened"], "canonical_device_name and Device.canonical_name disagree"
    return tuple(seen["names"])


def test_host_identity_is_cpu():
    assert kvcached.open_device("cpu").canonical_name == "cpu"
    assert canonical_device_name("cpu") == "cpu"


def test_cpu_torch_device_stays_cpu():
    torch = pytest.importorskip("torch")
    assert device_name_from_torch(torch.device("cpu")) == "cpu"
    assert kvcached.parse_device(torch.device("cpu")) == ("host", 0)


def test_rocm_torch_names_amd_gpus_cuda_and_kvcached_says_hip(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.version, "hip", "7.0.51831", raising=False)
    assert device_name_from_torch(torch.device("cuda:1")) == "hip:1"
    assert device_name_from_torch("cuda:0") == "hip:0"
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert device_name_from_torch(torch.device("cuda:1")) == "cuda:1"


def test_rocm_name_is_an_explicit_hip_device():
    assert kvcached.parse_device("rocm:3") == ("hip", 3)
    assert kvcached.parse_device("hip:3") == ("hip", 3)


@pytest.mark.parametrize("backend, pattern", [("cuda", CUDA_UUID), ("hip", HIP_UUID)])
def test_each_physical_gpu_has_its_own_uuid_identity(backend, pattern):
    names = identities(backend)
    assert len(names) == 2 and names[0] != names[1]
    assert all(pattern.fullmatch(name) for name in names), names


@pytest.mark.parametrize(
    "backend, mask",
    [
        ("cuda", "CUDA_VISIBLE_DEVICES"),
        ("hip", "HIP_VISIBLE_DEVICES"),
        ("hip", "ROCR_VISIBLE_DEVICES"),
        ("hip", "CUDA_VISIBLE_DEVICES"),
    ],
)
def test_reordered_devices_keep_their_identity(backend, mask):
    physical = identities(backend)
    assert identities(backend, **{mask: "1,0"}) == [physical[1], physical[0]]
    assert identities(backend, **{mask: "1"}) == [physical[1]]


def test_hip_masks_compose_rocr_first_then_hip():
    physical = identities("hip")
    # ROCR_VISIBLE_DEVICES orders the runtime's devices; HIP_VISIBLE_DEVICES picks among those.
    assert identities("hip", ROCR_VISIBLE_DEVICES="1,0", HIP_VISIBLE_DEVICES="1") == [physical[0]]
    # HIP_VISIBLE_DEVICES wins over CUDA_VISIBLE_DEVICES.
    assert identities("hip", HIP_VISIBLE_DEVICES="0", CUDA_VISIBLE_DEVICES="1") == [physical[0]]


@pytest.mark.parametrize("backend, mask", [("cuda", "CUDA_VISIBLE_DEVICES"), ("hip", "ROCR_VISIBLE_DEVICES")])
def test_masks_name_devices_by_uuid_too(backend, mask):
    physical = identities(backend)
    uuid = physical[1].split("-", 1)[1]  # "GPU-..." as the drivers and rocminfo spell it
    assert identities(backend, **{mask: uuid[:12]}) == [physical[1]]


def test_a_mask_ends_at_its_first_unknown_entry():
    physical = identities("cuda")
    assert identities("cuda", CUDA_VISIBLE_DEVICES="1,7,0") == [physical[1]]


def test_hip_device_without_uuid_is_named_by_its_pci_address():
    names = identities("hip", KVCACHED_EMULATED_HIP_UUID="0")
    assert names == ["hip-pci-0000:0c:00.0", "hip-pci-0000:2c:00.0"]
    assert identities("hip", KVCACHED_EMULATED_HIP_UUID="0", HIP_VISIBLE_DEVICES="1") == [names[1]]


def test_rocm_torch_cuda_device_resolves_to_the_same_physical_gpu():
    pytest.importorskip("torch")
    physical = identities("hip")
    seen = run_emulated(
        "hip",
        """
        import json, torch
        from kvcached.devices import canonical_device_name, device_name_from_torch
        torch.version.hip = "7.0.51831"  # what PyTorch's ROCm build reports
        name = device_name_from_torch(torch.device("cuda:0"))
        print(json.dumps(dict(name=name, identity=canonical_device_name(torch.device("cuda:0")))))
        """,
        {**TWO_GPUS, "HIP_VISIBLE_DEVICES": "1"},
    )
    assert seen == {"name": "hip:0", "identity": physical[1]}


def test_info_shows_each_device_identity_beside_its_index():
    report = run_emulated(
        "hip",
        """
        import contextlib, io, json
        from kvcached.cli.main import collect_info, main
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            main(["info"])
        print(json.dumps(dict(report=collect_info(), text=text.getvalue())))
        """,
        {**TWO_GPUS, "HIP_VISIBLE_DEVICES": "1,0"},
    )
    hip = next(b for b in report["report"]["backends"] if b["name"] == "hip")
    devices = [(d["device"], d["identity"]) for d in hip["devices"]]
    physical = identities("hip")
    assert devices == [("hip:0", physical[1]), ("hip:1", physical[0])]
    assert f"hip:0 = {physical[1]}:" in report["text"]
