"""kvcached vs the reference implementation on one GPU, in one run.

Both packages are called ``kvcached``: each measurement runs in a fresh process
whose ``PYTHONPATH`` names one of them (installed with ``pip install --target``).
Rounds are interleaved (reference, kvcached, reference, kvcached, ...; odd rounds in
the opposite order), every round is kept, and the report gives medians over rounds and the ratio
kvcached ÷ reference next to the driver floor measured in the same run
(``bench_vmm``, C++) and, with the driver-call counter, the calls each operation made.

    python bench/reference/side_by_side.py --out DIR --ref-site /tmp/refsite --ours-site /tmp/oursite \\
        --bench-vmm build/gpu/bench/cpp/bench_vmm --call-counter /tmp/libcuda_call_counter.so
    python bench/reference/side_by_side.py --out DIR --only ours --device cpu --rounds 1   # host smoke test
    python bench/reference/side_by_side.py --out DIR --report-only                        # tables from raw.jsonl

Every process (both sides, bench_vmm too) runs on the same CPUs: by default the
first four of those sysfs lists as local to the GPU (``--cpus auto``), so that
neither side's driver calls run on another socket or on other virtual CPUs than
the other's; ``--cpus none`` leaves placement to the scheduler, ``--cpus 0-3``
names them.

Writes DIR/raw.jsonl (one line per process: case, round, result or error),
DIR/bench_vmm_*.txt, DIR/summary.json and DIR/side_by_side.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from driver_calls import preload_env
from side_by_side_report import write_report

BENCH_DIR = Path(__file__).resolve().parent  # this folder: side_by_side_ops.py and driver_calls.py

SYSTEM_LIBSTDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"
LAYOUTS = ("contiguous", "per_layer")
OURS_SPACE_CASES = ("ours_pool", "ours_pool_nocontext", "ours_space", "ours_space_nozero")
ALLOC_CASES = ("ref_alloc", "ours_alloc_manager", "ours_alloc_pool", "ours_setup_zero_chunks")
# bench_vmm floors: 2 MiB (per-layer allocations) and 128 MiB (a contiguous compound page).
BENCH_VMM_RUNS = {
    "2mib": ["--pages", "64", "--iters", "3"],
    "128mib": ["--page-mib", "128", "--pages", "16", "--iters", "3"],
}


class Runner:
    """Spawns measurements, each in a fresh process, and appends every outcome to raw.jsonl."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.raw = self.out / "raw.jsonl"
        self.deadline = time.monotonic() + args.deadline_s
        self.registry_dir = tempfile.mkdtemp(prefix="kvcached-sbs-registry-")
        self.cpus = resolve_cpus(args.cpus)
        placement = f"CPUs {sorted(self.cpus)}" if self.cpus else "left to the scheduler"
        (self.out / "cpus.txt").write_text(f"--cpus {args.cpus}: every process on {placement}\n")
        print(f"every process on {placement}", flush=True)

    def _pin(self) -> None:  # runs in each child before it starts
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def record(self, entry: dict) -> None:
        with self.raw.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        status = "ok" if "result" in entry else f"FAILED ({entry.get('error')})"
        print(
            f"[{entry.get('seconds', 0):6.1f} s] round {entry['round']} {entry['case']} "
            f"{entry.get('layout', '')} {'(call counter)' if entry.get('counted') else ''}: {status}",
            flush=True,
        )

    def spawn(self, case: str, round_index: int, layout: Optional[str] = None, counted: bool = False) -> None:
        if self.out_of_time():
            self.record(dict(case=case, round=round_index, layout=layout, counted=counted, error="skipped: deadline"))
            return
        ref = case.startswith("ref_")
        site = self.args.ref_site if ref else self.args.ours_site
        env = dict(os.environ, KVCACHED_REGISTRY_DIR=self.registry_dir, PYTHONUNBUFFERED="1")
        if site:
            env["PYTHONPATH"] = os.pathsep.join([site, str(BENCH_DIR)])
        libstdcxx = self.args.ref_preload if ref and Path(self.args.ref_preload).exists() else ""
        env = preload_env(env, self.args.call_counter if counted else None, libstdcxx)
        payload = dict(layout=layout, device="cuda:0" if ref else self.args.device, expect_site=site)
        command = [sys.executable, str(BENCH_DIR / "side_by_side_ops.py"), case, json.dumps(payload)]
        entry = dict(case=case, round=round_index, layout=layout, counted=counted)
        start = time.monotonic()
        try:
            proc = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=self.args.step_timeout_s, preexec_fn=self._pin
            )
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode == 0 and lines:
                entry["result"] = json.loads(lines[-1][len("RESULT ") :])
            else:
                entry["error"] = f"exit code {proc.returncode}"
                entry["output_tail"] = (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            entry["error"] = f"timed out after {self.args.step_timeout_s} s"
            entry["output_tail"] = str(exc.stdout or "")[-1500:] + str(exc.stderr or "")[-1500:]
        entry["seconds"] = round(time.monotonic() - start, 2)
        self.record(entry)

    def bench_vmm(self, round_index: int) -> None:
        if not self.args.bench_vmm:
            return
        for label, extra in BENCH_VMM_RUNS.items():
            command = [self.args.bench_vmm, "--backend", "cuda", "--threads", "1", *extra]
            path = self.out / f"bench_vmm_{label}_round{round_index}.txt"
            try:
                proc = subprocess.run(command, capture_output=True, text=True, timeout=60, preexec_fn=self._pin)
                path.write_text(proc.stdout + proc.stderr)
                entry = dict(case="bench_vmm", round=round_index, layout=label, file=path.name)
                entry["result" if proc.returncode == 0 else "error"] = (
                    {"p50_us": parse_bench_vmm(proc.stdout)} if proc.returncode == 0 else f"exit code {proc.returncode}"
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                entry = dict(case="bench_vmm", round=round_index, layout=label, error=str(exc))
            self.record(entry)


def parse_cpu_list(text: str) -> set[int]:
    """CPUs from a list such as ``0-7,16-23`` (sysfs's ``local_cpulist`` format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def gpu_local_cpus(ordinal: int = 0) -> Optional[set[int]]:
    """The CPUs sysfs lists as local to GPU ``ordinal`` (None when that cannot be read)."""
    try:
        bus = subprocess.run(
            ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", str(ordinal)],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.strip()
        domain, rest = bus.lower().split(":", 1)
        text = Path(f"/sys/bus/pci/devices/{domain[-4:]}:{rest}/local_cpulist").read_text()
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return parse_cpu_list(text) & os.sched_getaffinity(0) or None


AUTO_CPUS = 4  # a measurement is one thread calling the driver, plus the driver's own threads


def resolve_cpus(choice: str) -> Optional[set[int]]:
    if choice == "none":
        return None
    if choice == "auto":
        local = gpu_local_cpus()
        return set(sorted(local)[:AUTO_CPUS]) if local else None
    return parse_cpu_list(choice)


def parse_bench_vmm(text: str) -> dict:
    """p50 per call (µs) from bench_vmm's table."""
    p50 = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 7 and fields[0] in ("reserve", "create", "map", "set_access", "unmap", "release"):
            p50[fields[0]] = float(fields[3])
    return p50


def run(args: argparse.Namespace) -> None:
    runner = Runner(args)
    want_ref = args.only in ("both", "ref")
    want_ours = args.only in ("both", "ours")
    # One list per round, reference and kvcached alternating case by case; odd rounds run the
    # list backwards (ABBA), so that neither side always runs first: per-process driver times
    # drift over a run (the reference's grow of 64 page ids read 3.1 ms in the first round and
    # 5.3 ms in the fifth of one run).
    for round_index in range(args.rounds):
        runner.bench_vmm(round_index)
        processes = []
        for layout in LAYOUTS:
            if want_ref:
                processes.append(("ref_space", layout))
            processes += [(case, layout) for case in (OURS_SPACE_CASES if want_ours else ())]
        processes += [
            (case, None)
            for case in ALLOC_CASES
            if (case.startswith("ref_") and want_ref) or (case.startswith("ours_") and want_ours)
        ]
        for case, layout in processes[::-1] if round_index % 2 else processes:
            runner.spawn(case, round_index, layout)
    # One more round with the driver-call counter preloaded: calls per operation.
    if args.call_counter:
        for layout in LAYOUTS:
            if want_ref:
                runner.spawn("ref_space", args.rounds, layout, counted=True)
            if want_ours:
                runner.spawn("ours_pool", args.rounds, layout, counted=True)
                runner.spawn("ours_pool_nocontext", args.rounds, layout, counted=True)
                runner.spawn("ours_space", args.rounds, layout, counted=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--ref-site", help="directory the reference was pip-installed into (--target)")
    parser.add_argument("--ours-site", help="directory kvcached was pip-installed into (default: this interpreter's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda:0", help="kvcached's device (cpu for a host smoke test)")
    parser.add_argument("--only", choices=("both", "ours", "ref"), default="both")
    parser.add_argument("--bench-vmm", help="path of the C++ bench_vmm (driver floor, same run)")
    parser.add_argument("--call-counter", help="libcuda_call_counter.so (bench/reference/driver_calls.py --build)")
    parser.add_argument("--ref-preload", default=SYSTEM_LIBSTDCXX, help="LD_PRELOAD for the reference's processes")
    parser.add_argument("--step-timeout-s", type=float, default=90.0, help="limit per process")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="no new process after this long")
    parser.add_argument(
        "--cpus",
        default="auto",
        help="CPUs every process runs on: auto (four of the GPU's local CPUs), none, or a list such as 0-3",
    )
    parser.add_argument("--report-only", action="store_true", help="only rebuild the tables from raw.jsonl")
    args = parser.parse_args()
    if args.only != "ours" and not args.ref_site and not args.report_only:
        parser.error("--ref-site is needed unless --only ours")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        (Path(args.out) / "raw.jsonl").unlink(missing_ok=True)
        run(args)
    print(write_report(Path(args.out)))


if __name__ == "__main__":
    main()
