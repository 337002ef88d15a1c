"""Which registry a process lands in, and what kvctl and kvtop show: the landing check.

Processes started under different visible-devices masks register on every GPU
they see; each must land in the registry of the physical GPU behind each index
(one registry per physical GPU), and ``kvctl list --all`` / ``kvtop --once``
must show each GPU once with every instance and the index its process sees.
Used by the GPU tests and their emulated twins; run as a script, it prints the
check's kvctl / kvtop snapshot (bench/gpu/run_gpu_multi.sh keeps that output)::

    python tests/landing_check.py [--backend cuda] [--gpus N]

over whatever drivers its environment reaches (the emulation's when started over it).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from kvcached.registry import DeviceRegistry
from rank_processes import MASK_VARIABLES, Machine, Worker

# Processes for the check: every one registers on every GPU it sees.
LANDING_MASKS_ONE_GPU = (None, "0")
LANDING_MASKS_TWO_GPUS = (None, "0,1", "1,0", "1", "0")


def probe_name(mask: Optional[str]) -> str:
    return f"probe-{'unset' if mask is None else mask}"


def check_landing(machine: Machine, masks: Sequence[Optional[str]], registry_dir: Path) -> str:
    """Processes under ``masks`` register on every GPU they see. Each lands in the registry of
    the physical GPU behind each index; there is one registry per physical GPU; ``kvctl list
    --all`` and ``kvtop --once`` show each GPU once with every instance on it and the index its
    process sees. Returns the kvctl / kvtop snapshot."""
    assert None in masks, "an unmasked process tells the physical order"
    probes = [Worker(machine, mask, registry_dir) for mask in masks]
    try:
        seen = {mask: probe.call("register", probe_name(mask), machine.backend) for mask, probe in zip(masks, probes)}
        physical = [device["identity"] for device in seen[None]["devices"]]
        expected: dict[str, set[tuple[str, int, str]]] = {identity: set() for identity in physical}
        for mask, report in seen.items():
            order = list(range(len(physical))) if mask is None else [int(i) for i in mask.split(",")]
            assert len(report["devices"]) == len(order), f"{mask}: sees {report['devices']}"
            for ordinal, device in enumerate(report["devices"]):
                identity = physical[order[ordinal]]
                assert device["identity"] == identity, f"mask {mask}: {device['local']} is not {identity}"
                assert device["path"] == str(registry_dir / _file_name(identity)), f"mask {mask}: {device['path']}"
                expected[identity].add((probe_name(mask), report["pid"], device["local"]))
        files = sorted(p.name for p in registry_dir.iterdir())
        assert files == sorted(_file_name(identity) for identity in physical), f"registries: {files}"

        listing = json.loads(machine.tool(registry_dir, "kvctl", "list", "--all", "--json"))
        shown = [device["device"] for device in listing["devices"]]
        assert sorted(shown) == sorted(physical) and not listing["unusable"], listing
        for device in listing["devices"]:
            instances = {(e["name"], e["pid"], e["local_device"]) for e in device["instances"]}
            assert instances == expected[device["device"]], (device["device"], instances)
            assert all(e["alive"] for e in device["instances"])

        snapshot = ["$ kvctl list --all", machine.tool(registry_dir, "kvctl", "list", "--all")]
        if len(physical) > 1:  # a tool under a mask names the GPU behind its own index
            one = json.loads(
                machine.tool(registry_dir, "kvctl", "list", "--json", "--device", f"{machine.backend}:0", mask="1,0")
            )
            assert (one["device"], one["local_device"]) == (physical[1], f"{machine.backend}:0"), one
            snapshot += [
                f"$ {machine.mask_variable}=1,0 kvctl list --device {machine.backend}:0",
                machine.tool(registry_dir, "kvctl", "list", "--device", f"{machine.backend}:0", mask="1,0"),
            ]
        frame = machine.tool(registry_dir, "kvtop", "--once")
        check_kvtop_frame(frame, expected)
        snapshot += ["$ kvtop --once", frame]
        return "\n".join(snapshot)
    finally:
        for probe in probes:
            probe.close()


def _file_name(identity: str) -> str:
    """The registry file of a device, in whichever directory."""
    return Path(DeviceRegistry.segment_path(identity)).name


def check_kvtop_frame(frame: str, expected: dict[str, set[tuple[str, int, str]]]) -> None:
    """Each GPU's header once, and under it a row per instance: name, pid, the index its process sees."""
    starts = sorted((frame.find(identity), identity) for identity in expected)
    for position, identity in starts:
        assert position >= 0 and frame.count(identity) == 1, f"kvtop shows {identity} {frame.count(identity)} times"
    for k, (position, identity) in enumerate(starts):
        section = frame[position : starts[k + 1][0] if k + 1 < len(starts) else len(frame)]
        rows = {(m[0], int(m[1]), m[2]) for m in re.findall(r"(probe-\S+)\s+(\d+)\s+(\S+:\d+)", section)}
        assert rows == expected[identity], f"kvtop under {identity}: {rows}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="the landing check, with kvctl and kvtop snapshots")
    parser.add_argument("--backend", default="cuda", choices=sorted(MASK_VARIABLES))
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all, at most 2)")
    args = parser.parse_args(argv)
    machine = Machine.current(args.backend)
    gpus = args.gpus or min(2, len(machine.physical_identities()))
    masks = LANDING_MASKS_TWO_GPUS if gpus >= 2 else LANDING_MASKS_ONE_GPU
    print(
        f"landing check: {gpus} GPU(s), processes with {machine.mask_variable} = "
        + ", ".join("(unset)" if m is None else repr(m) for m in masks),
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="kvcached-landing-") as directory:
        print(check_landing(machine, masks, Path(directory)))  # raises AssertionError on a failure
    print("landing check passed: every process landed in the registry of the physical GPU it uses")
    return 0


if __name__ == "__main__":
    sys.exit(main())
