"""What the end-to-end engine benchmarks share: the model, the seeded workload, the runs, the report.

``vllm_e2e.py`` and ``sglang_e2e.py`` run the same workload through their engine
with and without kvcached. Each run is a fresh engine in its own process group
(the benchmark script re-run with ``--child``); runs alternate off / on in ABBA
order across rounds, and every run is reported next to the per-round ratios.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, TypeVar

from kvcached.testing.tiny_llama import TINY_LLAMA, make_tiny_llama

MODEL_LAYERS = 6  # the tests' tiny Llama with 6 layers, in bf16
WORKLOAD = dict(requests=96, min_prompt=16, max_prompt=400, new_tokens=64, seed=20241201)
WARMUP_REQUESTS = 8
Result = TypeVar("Result")


def in_workdir(workdir: Optional[str], prefix: str, run: Callable[[Path], Result]) -> Result:
    """``run`` in ``workdir`` (made if missing, kept afterwards) or, with none, in a temporary one."""
    if workdir:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        return run(Path(workdir))
    with tempfile.TemporaryDirectory(prefix=prefix) as temporary:
        return run(Path(temporary))


def make_model(path: Path, seed: int = 0) -> str:
    """Writes the random-weight checkpoint once (bf16) and returns its directory."""
    return make_tiny_llama(path, seed, layers=MODEL_LAYERS, dtype="bfloat16")


def make_prompts(requests: int, min_prompt: int, max_prompt: int, seed: int, **_: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(rng.randint(min_prompt, max_prompt))]
        for _ in range(requests)
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class BusyClock:
    """Seconds of one engine's own work: ``perf_counter`` stopped while the engine waits for its turn.

    With ``--lockstep`` two engines take turns step by step (``e2e_paired.py``);
    each one's times (TTFT, time per output token, tokens/s) are then read on
    this clock, so the other engine's steps are not counted as this one's."""

    def __init__(self) -> None:
        self._waited = 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self._waited

    def wait(self, turn: Callable[[], None]) -> None:
        """Runs ``turn()`` (which blocks until this engine may go on) with the clock stopped."""
        start = time.perf_counter()
        turn()
        self._waited += time.perf_counter() - start


def summarize(start: float, end: float, first: dict, finish: dict, tokens: dict, steps: int | None = None) -> dict:
    """One run's figures from per-request times (seconds, one clock): first token, finish, token count.

    TTFT counts from ``start`` (every request is submitted then); time per output
    token is (finish - first token) / (tokens - 1) per request.
    """
    ttft = [first[r] - start for r in finish]
    tpot = [(finish[r] - first[r]) / (tokens[r] - 1) for r in finish if tokens[r] > 1]
    return dict(
        wall_s=end - start,
        output_tokens=sum(tokens.values()),
        requests=len(finish),
        steps=steps,
        tokens_per_s=sum(tokens.values()) / (end - start),
        ttft_p50_ms=percentile(ttft, 0.5) * 1e3,
        ttft_p99_ms=percentile(ttft, 0.99) * 1e3,
        tpot_p50_ms=percentile(tpot, 0.5) * 1e3,
        tpot_p99_ms=percentile(tpot, 0.99) * 1e3,
        ttft_ms=[round(x * 1e3, 1) for x in ttft],
        tpot_ms=[round(x * 1e3, 2) for x in tpot],
    )


CHECKOUT_PACKAGE = Path(__file__).resolve().parents[2] / "python" / "kvcached"


def installed_kvcached() -> str:
    """A line on the kvcached the engines import: where, its host memory setting, and whether it is this checkout's.

    The engines run the *installed* package: one installed from an older tree
    measures old code. Its Python files are compared with the checkout's (the
    compiled core cannot be); any difference is named in the report."""
    import filecmp

    import kvcached
    from kvcached import config

    installed = Path(kvcached.__file__).resolve().parent
    names = [path.relative_to(CHECKOUT_PACKAGE) for path in sorted(CHECKOUT_PACKAGE.rglob("*.py"))]
    differing = [
        str(name)
        for name in names
        if not (installed / name).is_file() or not filecmp.cmp(CHECKOUT_PACKAGE / name, installed / name, shallow=False)
    ]
    line = f"kvcached imported from {installed} (KVCACHED_HOST_MEMORY in effect: {config.get('host_memory')})"
    if installed != CHECKOUT_PACKAGE and differing:
        line += (
            f"; **its Python files differ from this checkout's ({', '.join(differing[:5])}"
            f"{' ...' if len(differing) > 5 else ''}): reinstall before measuring**"
        )
    return line


def session_processes() -> dict[str, dict[str, float]]:
    """CPU seconds, page faults, context switches and threads of every process of this engine (its session), by name.

    vLLM's front end (this process), EngineCore and worker; SGLang's engine (this process),
    scheduler and detokenizer: where kvcached's time goes there, compared with a run without it."""
    ticks = os.sysconf("SC_CLK_TCK")
    sid, found = os.getsid(0), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) != sid:  # fields[3]: session id
            continue
        switches = {
            line.split(":")[0]: int(line.split()[1])
            for line in status.splitlines()
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches", "Threads"))
        }
        found[f"{name}[{pid}]"] = dict(
            cpu_s=(int(fields[11]) + int(fields[12])) / ticks,  # utime + stime
            minor_faults=int(fields[7]),
            major_faults=int(fields[9]),
            voluntary=switches.get("voluntary_ctxt_switches", 0),
            involuntary=switches.get("nonvoluntary_ctxt_switches", 0),
            threads=switches.get("Threads", 0),
        )
        for tid in os.listdir(f"/proc/{pid}/task"):  # per thread, by name: which threads the CPU went to
            try:
                tstat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            tfields = tstat[tstat.rindex(")") + 2 :].split()
            found[f"{name}[{pid}]"][f"thread {tstat[tstat.index('(') + 1 : tstat.rindex(')')]}[{tid}]"] = (
                int(tfields[11]) + int(tfields[12])
            ) / ticks
    return found


def timed_window(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """What each process did between two ``session_processes()`` snapshots."""
    return {
        name: {
            k: round(v - before.get(name, {}).get(k, 0), 3) if k != "threads" else v
            for k, v in figures.items()
            if not k.startswith("thread ") or v - before.get(name, {}).get(k, 0) >= 0.02
        }
        for name, figures in after.items()
    }


def cpu_seconds(processes: dict[str, dict[str, float]]) -> float:
    """All CPU seconds of a :func:`timed_window`."""
    return round(sum(process["cpu_s"] for process in processes.values()), 2)


def without_kvcached_flags(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without kvcached's switches, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVCACHED_ENABLE", "ENABLE_KVCACHED")}
    env.update(extra)
    return env


def run_child(
    script: str, out: Path, label: str, spec: dict, env: dict[str, str], timeout_s: float, kvcached_on: bool
) -> dict:
    """Runs ``script --child SPEC RESULT`` as one engine; its figures plus what the machine did meanwhile."""
    spec_path, result_path = out / f"{label}.spec.json", out / f"{label}.json"
    spec_path.write_text(json.dumps(spec))
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    with open(out / f"{label}.log", "w") as log:
        # Its own session: on a timeout (or if we are stopped) the engine's processes go with it.
        proc = subprocess.Popen(
            [sys.executable, script, "--child", str(spec_path), str(result_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever of the engine is left
            except ProcessLookupError:
                pass
            proc.wait()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the engine's processes, once reaped
    entry = dict(
        label=label,
        kvcached=kvcached_on,
        rc=rc,
        uptime_before=uptime,
        seconds=round(time.time() - start, 1),
        cpu_s=round(usage.ru_utime + usage.ru_stime - usage_before.ru_utime - usage_before.ru_stime, 1),
        minor_faults=usage.ru_minflt - usage_before.ru_minflt,
    )
    if rc == 0 and result_path.exists():
        entry.update(json.loads(result_path.read_text()))
    return entry


def run_rounds(out: Path, rounds: int, run_one: Callable[[str, bool], dict], name: str) -> list[dict]:
    """ABBA rounds of ``run_one(label, kvcached_on)``; writes runs.json as it goes and NAME.md at the end."""
    runs = []
    for i in range(rounds):
        order = (False, True) if i % 2 == 0 else (True, False)  # ABBA: drift cancels
        for on in order:
            entry = dict(run_one(f"r{i}-{'on' if on else 'off'}", on), round=i)
            runs.append(entry)
            print(
                json.dumps(
                    {
                        k: entry.get(k)
                        for k in (
                            "label",
                            "rc",
                            "tokens_per_s",
                            "tpot_p99_ms",
                            "ttft_p50_ms",
                            "seconds",
                            "cpu_s",
                            "scheduler_cpu_us_per_step",
                            "worker_ms_per_step",
                        )
                    }
                ),
                flush=True,
            )
            (out / "runs.json").write_text(json.dumps(runs, indent=1))
    write_report(out, runs, name)
    return runs


def write_report(out: Path, runs: list[dict], name: str) -> None:
    text = installed_kvcached() + "\n\n" + report(runs)
    (out / f"{name}.md").write_text(text)
    print(text)


def _optional(run: dict, key: str, fmt: str) -> str:
    return format(run[key], fmt) if run.get(key) is not None else "—"


def _worker(run: dict) -> str:
    if run.get("worker_ms_per_step") is None:
        return "—"
    apply = run.get("apply_ms_per_step")
    return f"{run['worker_ms_per_step']:.2f}" + (f" ({apply:.3f})" if apply is not None else "")


def _ratio(on: dict, off: dict, key: str) -> float:
    return on[key] / off[key] if on.get(key) and off.get(key) else float("nan")


def report(runs: list[dict]) -> str:
    lines = [
        "| run | kvcached | tokens/s | TPOT p50 (ms) | TPOT p99 (ms) | TTFT p50 (ms) | TTFT p99 (ms) | "
        "wall (s) | steps | scheduler CPU µs / step | worker ms / step (kvcached's page ops) | CPU s (whole run) | "
        "minor faults (timed run if in-process) | load before / after | uptime before |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['label']} | {'on' if r['kvcached'] else 'off'} | failed (rc {r['rc']}) |||||||||||||")
            continue
        lines.append(
            f"| {r['label']} | {'on' if r['kvcached'] else 'off'} | {r['tokens_per_s']:.1f} | {r['tpot_p50_ms']:.1f} | "
            f"{r['tpot_p99_ms']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['wall_s']:.1f} | "
            f"{_optional(r, 'steps', 'd')} | {_optional(r, 'scheduler_cpu_us_per_step', '.0f')} | {_worker(r)} | "
            f"{r.get('cpu_s', '—')} | {r.get('timed_minor_faults', r.get('minor_faults', '—'))} | "
            f"{r['load_before'][0]:.2f} / {r['load_after'][0]:.2f} | {r['uptime_before']} |"
        )
    timed = [r for r in runs if r.get("engine_step_ms_per_step") is not None]
    if timed:
        lines += [
            "",
            "Per step (each engine process timing its own part): the EngineCore's step (wall), the worker's "
            "execute_model + sample_tokens (wall, its thread's CPU and the kernel's part of it, minor faults), kvcached's page-op apply "
            "inside it, the scheduler's CPU in schedule / update_from_output.",
            "",
            "| run | EngineCore step (ms) | worker (ms) | worker CPU (ms) | of which kernel (ms) | worker faults | "
            "apply (ms) | schedule CPU (µs) | update CPU (µs) | pages mapped / unmapped |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in timed:
            ops = r.get("page_ops") or {}
            lines.append(
                f"| {r['label']} | {r['engine_step_ms_per_step']:.2f} | {r['worker_ms_per_step']:.2f} | "
                f"{r['worker_cpu_ms_per_step']:.2f} | {_optional(r, 'worker_sys_ms_per_step', '.2f')} | "
                f"{r['worker_faults_per_step']:.0f} | "
                f"{_optional(r, 'apply_ms_per_step', '.3f')} | {r['schedule_cpu_us_per_step']:.0f} | "
                f"{r['update_from_output_cpu_us_per_step']:.0f} | "
                f"{ops.get('mapped', '—')} / {ops.get('unmapped', '—')} |"
            )
    ratios = []
    for i in sorted({r["round"] for r in runs}):
        pair = {r["kvcached"]: r for r in runs if r["round"] == i and "tokens_per_s" in r}
        if len(pair) == 2:
            on, off = pair[True], pair[False]
            ratios.append(
                dict(
                    round=i,
                    tokens_per_s=on["tokens_per_s"] / off["tokens_per_s"],
                    sched_cpu=_ratio(on, off, "scheduler_cpu_us_per_step"),
                    worker=_ratio(on, off, "worker_ms_per_step"),
                    tpot_p99=on["tpot_p99_ms"] / off["tpot_p99_ms"],
                    ttft_p50=on["ttft_p50_ms"] / off["ttft_p50_ms"],
                    ttft_p99=on["ttft_p99_ms"] / off["ttft_p99_ms"],
                )
            )
    lines += [
        "",
        "| round | tokens/s on ÷ off (target ≥ 0.97) | TPOT p99 on ÷ off (target ≤ 1.05) | TTFT p50 on ÷ off | "
        "TTFT p99 on ÷ off | scheduler CPU / step on ÷ off | worker / step on ÷ off |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in ratios:
        lines.append(
            f"| {r['round']} | {r['tokens_per_s']:.3f} | {r['tpot_p99']:.3f} | {r['ttft_p50']:.3f} | "
            f"{r['ttft_p99']:.3f} | {r['sched_cpu']:.3f} | {r['worker']:.3f} |"
        )
    if ratios:
        med = {
            k: statistics.median(r[k] for r in ratios)
            for k in ("tokens_per_s", "tpot_p99", "ttft_p50", "ttft_p99", "sched_cpu", "worker")
        }
        lines.append(
            f"| median | **{med['tokens_per_s']:.3f}** | **{med['tpot_p99']:.3f}** | {med['ttft_p50']:.3f} | "
            f"{med['ttft_p99']:.3f} | {med['sched_cpu']:.3f} | {med['worker']:.3f} |"
        )
    return "\n".join(lines) + "\n"
