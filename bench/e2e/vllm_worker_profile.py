"""Where kvcached's vLLM worker spends more (or less) than vLLM's own: ``perf`` on both workers of a paired run.

Runs ``vllm_e2e_paired.py`` (every option after ``--`` goes to it), attaches
``perf record`` to both engines' worker processes once the first pass is done
(so start-up and warm-up are left out), and when the run ends prints, for each
worker thread and each symbol (and each shared object), the milliseconds per
engine step (``cpu-clock``) or the events per step (``page-faults``), kvcached's
worker beside vLLM's own and the difference. Steps are those of the passes
inside the window (the harness's ``runs.json``). With ``--event sched-switch``
it instead counts, per step, each time a worker's main thread stopped running
to wait (``sched:sched_switch`` in state D or S), by the kernel functions it
waited in: a lock another thread of the process held, a futex, a poll.

    python bench/e2e/vllm_worker_profile.py --out DIR [--event cpu-clock|page-faults|sched-switch] [--top 30] -- --passes 16

Needs ``perf`` (software events are enough: a VM without a PMU will do) and the
right to record kernel samples and tracepoints of one's own processes (root or
``CAP_PERFMON``; the figures in bench/RESULTS.md were taken as root).
Sampling perturbs both engines: read the differences, not the throughput of
that run.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

from e2e_paired import counted_after_first_pass, wait_for_first_pass

HERE = Path(__file__).resolve().parent
FREQUENCY_HZ = 1999


def workers() -> dict[str, int]:
    """The two engines' worker processes: {"on": pid, "off": pid} (kvcached's has KVCACHED_ENABLE=1)."""
    found = {}
    for pid in subprocess.run(["pgrep", "-x", "VLLM::Worker"], capture_output=True, text=True).stdout.split():
        try:
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        found["on" if b"KVCACHED_ENABLE=1" in environment else "off"] = int(pid)
    return found


def perf_script(data: Path, *fields: str) -> str:
    command = ["perf", "script", "-i", str(data)] + (["-F", ",".join(fields)] if fields else [])
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def samples_by(script: str, pids: dict[str, int]) -> dict[str, dict[str, collections.Counter]]:
    """Sample counts per worker ("on"/"off"), by "dso" and by "sym"; threads other than the main one apart.

    ``script``: ``perf script -F pid,tid,ip,sym,dso`` output.
    """
    by_pid = {pid: tag for tag, pid in pids.items()}
    counts = {tag: {"dso": collections.Counter(), "sym": collections.Counter()} for tag in pids}
    for line in script.splitlines():
        match = re.match(r"\s*(\d+)/(\d+)\s+\S+\s+(.*?)\s+\((.*)\)\s*$", line)
        if not match or int(match.group(1)) not in by_pid:
            continue
        pid, tid, symbol, dso = int(match.group(1)), int(match.group(2)), match.group(3), match.group(4)
        thread = "" if tid == pid else "(other threads) "
        tag = by_pid[pid]
        dso = re.sub(r"perf-\d+\.map$", "perf-PID.map (JIT code)", os.path.basename(dso))  # one name for both
        counts[tag]["dso"][thread + dso] += 1
        counts[tag]["sym"][thread + symbol] += 1
    return counts


WAIT_NOISE = ("__schedule", "schedule", "__traceiter", "__perf", "perf_", "trace_", "preempt_schedule")


def waits_by_reason(script: str, pids: dict[str, int]) -> dict[str, collections.Counter]:
    """Times each worker's main thread went off the CPU to wait, by the first kernel functions it waited in.

    ``script``: ``perf script`` output of ``sched:sched_switch`` recorded with call graphs.
    """
    by_pid = {str(pid): tag for tag, pid in pids.items()}
    counts: dict[str, collections.Counter] = {tag: collections.Counter() for tag in pids}
    for event in script.split("\n\n"):
        lines = event.strip().splitlines()
        match = re.search(r"prev_pid=(\d+) .*?prev_state=(\S+)", lines[0]) if lines else None
        if not match or match.group(1) not in by_pid or match.group(2)[0] not in "DS":
            continue
        frames = [line.split(None, 2)[1].split("+")[0] for line in lines[1:] if len(line.split(None, 2)) > 1]
        reason = " < ".join([f for f in frames if not f.startswith(WAIT_NOISE)][:3])
        counts[by_pid[match.group(1)]][f"{match.group(2)[0]}: {reason}"] += 1
    return counts


def table(
    counts: dict[str, collections.Counter], steps: dict[str, int], per_sample: float, unit: str, top: int, what: str
) -> str:
    rows = []
    for key in set(counts["on"]) | set(counts["off"]):
        on = counts["on"].get(key, 0) * per_sample / steps["on"]
        off = counts["off"].get(key, 0) * per_sample / steps["off"]
        rows.append((on - off, on, off, key))
    rows.sort(key=lambda row: -abs(row[0]))
    lines = [f"| on − off ({unit}) | kvcached | vLLM's own | {what} |", "|---|---|---|---|"]
    for label, main_only in (("**all threads**", False), ("**the main thread**", True)):
        on, off = (
            sum(n for k, n in counts[tag].items() if not (main_only and k.startswith("(other threads)")))
            * per_sample
            / steps[tag]
            for tag in ("on", "off")
        )
        lines.append(f"| {on - off:+.4f} | {on:.4f} | {off:.4f} | {label} |")
    lines += [f"| {d:+.4f} | {a:.4f} | {b:.4f} | `{k[:120]}` |" for d, a, b, k in rows[:top]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--event", choices=("cpu-clock", "page-faults", "sched-switch"), default="cpu-clock")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("harness_args", nargs=argparse.REMAINDER, help="after --: vllm_e2e_paired.py's options")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = [a for a in args.harness_args if a != "--"]
    log = out / "harness.log"
    with open(log, "w") as sink:
        harness = subprocess.Popen(
            [sys.executable, str(HERE / "vllm_e2e_paired.py"), "--out", str(out / "run"), *extra],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    wait_for_first_pass(log, harness)
    pids = workers()
    if set(pids) != {"on", "off"}:
        harness.kill()
        sys.exit(f"expected one worker with kvcached and one without, found {pids}")
    data = out / "perf.data"
    event = {
        "cpu-clock": ["-e", "cpu-clock", "-F", str(FREQUENCY_HZ)],
        "page-faults": ["-e", "page-faults", "-c", "1"],
        "sched-switch": ["-e", "sched:sched_switch", "-g"],
    }[args.event]
    perf = subprocess.Popen(
        ["perf", "record", *event, "-o", str(data), "-p", f"{pids['on']},{pids['off']}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    harness.wait()
    perf.wait()
    if harness.returncode != 0:
        sys.exit(f"the paired run failed ({harness.returncode}); see {log}")
    steps = counted_after_first_pass(out / "run" / "runs.json", "steps")
    per_sample, unit = (1e3 / FREQUENCY_HZ, "ms per step") if args.event == "cpu-clock" else (1.0, "per step")
    print(
        f"workers: kvcached pid {pids['on']}, vLLM's own pid {pids['off']}; steps in the window: {steps}; "
        f"event {args.event}\n"
    )
    if args.event == "sched-switch":
        print("### waits of the main thread (D: uninterruptible, S: interruptible), by where it waited\n")
        print(table(waits_by_reason(perf_script(data), pids), steps, 1.0, "per step", args.top, "waited in"))
        return
    counts = samples_by(perf_script(data, "pid", "tid", "ip", "sym", "dso"), pids)
    for sort, what in (("dso", "shared object"), ("sym", "symbol")):
        print(f"### by {what} (the main thread; other threads apart)\n")
        print(table({tag: counts[tag][sort] for tag in counts}, steps, per_sample, unit, args.top, what))
        print()


if __name__ == "__main__":
    main()
