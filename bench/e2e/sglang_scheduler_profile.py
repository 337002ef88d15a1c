"""Where kvcached's SGLang scheduler spends more (or less) than SGLang's own: ``py-spy`` on both schedulers.

Runs ``sglang_e2e_paired.py`` (every option after ``--`` goes to it), attaches
``py-spy record`` to both engines' scheduler processes once the first pass is
done (start-up and warm-up are left out), and when the run ends prints, per
pass, the milliseconds each scheduler spent in each Python function (inclusive:
the function anywhere on the stack), kvcached's beside SGLang's own and the
difference, and how much of the kvcached scheduler's time was inside kvcached's
own code (any ``kvcached`` frame on the stack, by the outermost one). SGLang's
CPU engine runs the model in the scheduler process, so its forward pass is in
these figures too. Samples of a waiting thread are left out (py-spy's default).

    python bench/e2e/sglang_scheduler_profile.py --out DIR [--rate 100] [--top 30] -- --passes 12 --flush-cache

Needs ``py-spy`` (``pip install py-spy``) and the right to read the schedulers'
memory (the same user, with ``ptrace`` allowed, or root). ``--nonblocking``
sampling does not stop the schedulers, but py-spy's own process takes CPU:
read the differences, not that run's throughput.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
from pathlib import Path

from e2e_paired import counted_after_first_pass, wait_for_first_pass

HERE = Path(__file__).resolve().parent
SCHEDULER = "sglang::schedul"  # the scheduler's process title, as /proc/PID/comm keeps it (15 characters)


def schedulers() -> dict[str, int]:
    """The two engines' scheduler processes, {"on": pid, "off": pid}, by the engine (parent) they belong to."""
    found = {}
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() != SCHEDULER:
                continue
            parent = comm.parent.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1]
            command = Path(f"/proc/{parent}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        for label in ("on", "off"):
            if f"engine-{label}.spec.json".encode() in command:
                found[label] = int(comm.parent.name)
    return found


def read_stacks(raw: str) -> list[tuple[str, list[str], int]]:
    """``py-spy record --threads --format raw`` output as (thread name, frames outermost first, samples)."""
    stacks = []
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[1] if frames[0].startswith("thread (") and ": " in frames[0] else ""
        stacks.append((thread, frames[1:] if thread else frames, int(count)))
    return stacks


def function(frame: str) -> str:
    """``Scheduler.run_batch (scheduler.py:123)`` -> ``Scheduler.run_batch (scheduler.py)``: lines apart are one."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


def inclusive(stacks: list[tuple[str, list[str], int]], main_only: bool) -> collections.Counter:
    """Samples per function, counted once per stack it is on."""
    counts: collections.Counter = collections.Counter()
    for thread, frames, count in stacks:
        if main_only and thread != "MainThread":
            continue
        for name in {function(frame) for frame in frames}:
            counts[name] += count
        counts["**all**"] += count
    return counts


def in_kvcached(stacks: list[tuple[str, list[str], int]]) -> collections.Counter:
    """Samples with a kvcached frame on the stack, by thread and the outermost kvcached function."""
    counts: collections.Counter = collections.Counter()
    for thread, frames, count in stacks:
        ours = [frame for frame in frames if "kvcached/" in frame]
        if ours:
            counts[f"{thread}: {function(ours[0])}"] += count
    return counts


def table(counts: dict[str, collections.Counter], passes: dict[str, int], ms_per_sample: float, top: int) -> str:
    rows = []
    for key in set(counts["on"]) | set(counts["off"]):
        on = counts["on"].get(key, 0) * ms_per_sample / passes["on"]
        off = counts["off"].get(key, 0) * ms_per_sample / passes["off"]
        rows.append((on - off, on, off, key))
    rows.sort(key=lambda row: (row[3] != "**all**", -abs(row[0])))
    lines = ["| on − off (ms per pass) | kvcached | SGLang's own | function |", "|---|---|---|---|"]
    lines += [f"| {d:+.1f} | {a:.1f} | {b:.1f} | `{k[:140]}` |" for d, a, b, k in rows[:top]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rate", type=int, default=100, help="samples per second")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("harness_args", nargs=argparse.REMAINDER, help="after --: sglang_e2e_paired.py's options")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        sys.exit("py-spy not found: pip install py-spy")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "harness.log"
    with open(log, "w") as sink:
        harness = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "sglang_e2e_paired.py"),
                "--out",
                str(out / "run"),
                *[a for a in args.harness_args if a != "--"],
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    wait_for_first_pass(log, harness)
    pids = schedulers()
    if set(pids) != {"on", "off"}:
        harness.kill()
        sys.exit(f"expected the two engines' schedulers, found {pids}")
    spies = {
        label: subprocess.Popen(
            [
                py_spy,
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(args.rate),
                "--nonblocking",
                "--threads",
                "--format",
                "raw",
                "--output",
                str(out / f"{label}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for label, pid in pids.items()
    }
    harness.wait()
    for spy in spies.values():
        spy.wait()  # py-spy stops when its process exits
    if harness.returncode != 0:
        sys.exit(f"the paired run failed ({harness.returncode}); see {log}")
    passes = counted_after_first_pass(out / "run" / "runs.json")
    stacks = {label: read_stacks((out / f"{label}.txt").read_text()) for label in pids}
    ms_per_sample = 1e3 / args.rate
    print(
        f"schedulers: kvcached pid {pids['on']}, SGLang's own pid {pids['off']}; passes in the window: {passes}; "
        f"{args.rate} samples/s\n"
    )
    ours = in_kvcached(stacks["on"])
    total = sum(count for _, _, count in stacks["on"])
    print(
        f"### inside kvcached's code: {sum(ours.values()) * ms_per_sample / passes['on']:.1f} ms per pass, "
        f"{sum(ours.values()) / max(total, 1):.2%} of the kvcached scheduler's samples (all threads)\n"
    )
    print("| ms per pass | thread: outermost kvcached function |\n|---|---|")
    for key, count in ours.most_common(args.top):
        print(f"| {count * ms_per_sample / passes['on']:.2f} | `{key}` |")
    for label, main_only in (("the main thread", True), ("all threads", False)):
        print(f"\n### by function, {label} (inclusive)\n")
        print(table({tag: inclusive(stacks[tag], main_only) for tag in stacks}, passes, ms_per_sample, args.top))


if __name__ == "__main__":
    main()
