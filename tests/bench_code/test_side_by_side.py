"""The side-by-side benchmark's CPU placement (bench/reference/side_by_side.py): every process on the same CPUs."""

from __future__ import annotations

import os
import sys

import pytest
import side_by_side


def test_cpu_lists_parse_as_sysfs_writes_them():
    assert side_by_side.parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert side_by_side.parse_cpu_list("5") == {5}
    with pytest.raises(ValueError):
        side_by_side.parse_cpu_list("0-x")


def test_placement_choices(monkeypatch):
    assert side_by_side.resolve_cpus("none") is None
    assert side_by_side.resolve_cpus("1,3") == {1, 3}
    monkeypatch.setattr(side_by_side, "gpu_local_cpus", lambda ordinal=0: set(range(16, 32)))
    assert side_by_side.resolve_cpus("auto") == {16, 17, 18, 19}  # the first four of the GPU's
    monkeypatch.setattr(side_by_side, "gpu_local_cpus", lambda ordinal=0: None)
    assert side_by_side.resolve_cpus("auto") is None  # no GPU to ask: the scheduler places them


def test_no_gpu_means_no_local_cpus(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi
    assert side_by_side.gpu_local_cpus() is None


def test_runner_pins_its_children(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    args = side_by_side.argparse.Namespace(out=str(tmp_path), deadline_s=10.0, cpus=str(cpu))
    runner = side_by_side.Runner(args)
    assert (tmp_path / "cpus.txt").read_text() == f"--cpus {cpu}: every process on CPUs [{cpu}]\n"
    proc = side_by_side.subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=runner._pin,
    )
    assert proc.stdout.strip() == f"[{cpu}]"
