"""Backend discovery and device strings, on a machine with or without GPUs."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvcached


def test_host_backend_is_always_available():
    host = kvcached.backends()[0]
    assert host.name == "host" and host.available and host.device_count == 1


def test_every_unavailable_backend_says_why():
    for status in kvcached.backends():
        if not status.available:
            assert status.reason


def test_cpu_device_is_opened_once_per_process():
    assert kvcached.open_device("cpu") is kvcached.open_device("CPU")
    assert kvcached.open_device("cpu").name == "cpu"


@pytest.mark.parametrize("spec", ["tpu:0", "cuda:x", "cuda:-1", ""])
def test_bad_device_strings_are_refused(spec):
    with pytest.raises(ValueError, match="bad device"):
        kvcached.parse_device(spec)


def test_gpu_request_without_a_gpu_names_what_is_missing():
    if any(s.available for s in kvcached.backends() if s.name != "host"):
        pytest.skip("a GPU backend is usable here")
    with pytest.raises(kvcached.BackendUnavailableError, match="cuda"):
        kvcached.open_device("cuda:0")
    with pytest.raises(kvcached.BackendUnavailableError, match="hip"):
        kvcached.open_device("hip:0")


def test_import_and_info_work_from_a_fresh_process():
    out = subprocess.run(
        [sys.executable, "-m", "kvcached", "info", "--json"], check=True, capture_output=True, text=True
    ).stdout
    import json

    report = json.loads(out)
    names = [b["name"] for b in report["backends"]]
    assert names == ["host", "cuda", "hip"]
    assert report["backends"][0]["devices"][0]["device"] == "cpu"


@pytest.mark.gpu
def test_gpu_device_reports_dlpack_type():
    spec = kvcached.default_device()
    device = kvcached.open_device(spec)
    assert device.dlpack_device_type in (2, 10)
