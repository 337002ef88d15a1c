"""Two long-lived engines, one without kvcached and one with it, taking turns pass by pass.

The per-run benchmarks (``vllm_e2e.py``, ``sglang_e2e.py``) start a fresh engine
for every run, so an on/off pair is about a minute apart; on a shared VM the same
run moves by 15-40 % from one minute to the next, more than the effect being
measured. Here both engines start once and take turns: pass k runs the seeded
workload of ``e2e_common.py`` with prompt seed ``SEED + k`` on one engine and
then on the other (ABBA across passes), so a pair is seconds apart. Only one
engine works at a time; before each pass the harness waits ``gap_s`` so the other
engine is quiet (its queues parked). Between passes the engines are idle, as a
server between bursts. With kvcached's defaults an idle engine keeps its memory
for ``KVCACHED_IDLE_RELEASE_S`` (5 s) when nobody else wants it: in ABBA order
its two passes of a pair are one gap apart (memory kept) and its next pair starts
after the other engine's two passes (about 12 s: memory given back and mapped
again), so half of its passes map their memory afresh. ``--on-env
KVCACHED_IDLE_RELEASE_S=0`` gives it back before every pass.

One pair of engines is one draw of two processes, and a process can run a few
per cent faster than another for its whole life (on the 2-core VM, A/A runs of
one pair read from 0.998 to 1.078). ``--restarts R`` starts R pairs one after
the other, each serving its share of the passes, odd pairs started in the
opposite order; the intervals then resample the pairs before their passes.

Passes taken in turn are seconds apart, and a shared VM's speed drifts over
seconds too: with ``lockstep`` both engines serve each pass at once, in turns of
``TURN_S`` with the waiting one stopped, each timed on its own clock
(:func:`run_lockstep_pass`).

The engine scripts provide the child (:func:`serve_passes` with their own
``run_pass``) and call :func:`run_paired` in the parent.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from e2e_common import WORKLOAD, installed_kvcached, make_prompts, report

# ----------------------------------------------------------------------------- the child: one engine


def pass_prompts(k: int) -> list[list[int]]:
    """Pass ``k``'s prompts: the benchmark workload with seed ``SEED + k`` (no prefix shared between passes)."""
    return make_prompts(**dict(WORKLOAD, seed=WORKLOAD["seed"] + k))


#: How long one engine's turn lasts in a lockstep pass (at least one step): long enough that stopping and
#: resuming the engines (about 0.1 ms) is noise, short against the VM's drift.
TURN_S = 0.02


def serve_passes(result_fd: int, run_pass: Callable[..., dict]) -> None:
    """Answers ``run k`` and ``turns k`` lines on stdin with ``run_pass(k)``, one JSON line each on ``result_fd``.

    The engine is built and warmed up before this is called; a first line says it is
    ready. Results go to their own pipe because the engine's processes log to stdout.
    ``turns k`` serves pass ``k`` in lockstep with another engine:
    ``run_pass(k, take_turn)``; the engine calls ``take_turn()`` before each
    step, and once its turn has lasted ``TURN_S`` it says ``{"turn": "ready"}``
    and blocks until a ``go`` line comes (see :func:`run_lockstep_pass`).
    Any other line (or the end of stdin) ends the loop."""
    with os.fdopen(result_fd, "w") as results:

        def say(message: dict) -> None:
            results.write(json.dumps(message) + "\n")
            results.flush()

        turn_began: list[float] = []  # when this engine's current turn began (none: it has no turn)

        def take_turn() -> None:
            if turn_began and time.perf_counter() - turn_began[0] < TURN_S:
                return
            say({"turn": "ready"})
            if sys.stdin.readline().split()[:1] != ["go"]:
                raise RuntimeError("lockstep: expected 'go' from the benchmark")
            turn_began[:] = [time.perf_counter()]

        say({"ready": True})
        while True:
            words = sys.stdin.readline().split()
            if words[:1] not in (["run"], ["turns"]):
                break
            load_before = os.getloadavg()
            turn_began.clear()
            result = run_pass(int(words[1])) if words[0] == "run" else run_pass(int(words[1]), take_turn)
            result.update(load_before=load_before, load_after=os.getloadavg())
            say(result)


def serve_if_child(serve: Callable[[str, int], None]) -> None:
    """In an engine's process (``SCRIPT --serve SPEC FD``) runs ``serve(SPEC, FD)`` and exits; else returns."""
    if len(sys.argv) < 2 or sys.argv[1] != "--serve":
        return
    try:
        serve(sys.argv[2], int(sys.argv[3]))
    except BaseException:
        traceback.print_exc()
        os._exit(1)  # closes the result pipe: the benchmark stops at once, naming the log
    os._exit(0)  # the engines leave non-daemon threads behind: do not wait for them


# ----------------------------------------------------------------------------- the parent: two engines


def paired_parser(description: str, *, passes: int, timeout_s: float, gap_help: str) -> argparse.ArgumentParser:
    """The options every paired benchmark has: --out, --passes, --gap-s, --timeout-s."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--passes", type=int, default=passes)
    parser.add_argument("--gap-s", type=float, default=2.0, help=gap_help)
    parser.add_argument("--timeout-s", type=float, default=timeout_s, help="limit for an engine's start or one pass")
    parser.add_argument(
        "--restarts",
        type=int,
        default=1,
        metavar="R",
        help="start R pairs of engines one after the other, each serving its share of the passes "
        "(odd pairs started in the opposite order): one process can be a few per cent faster "
        "than another for its whole life, so one pair's ratio carries its draw",
    )
    return parser


def add_setting_options(parser: argparse.ArgumentParser) -> None:
    """--on-env, --off-env and --control: how the two engines differ besides kvcached (see :func:`engine_settings`)."""
    parser.add_argument(
        "--on-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an extra environment variable for the engine with kvcached (a setting to compare)",
    )
    parser.add_argument(
        "--off-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an extra environment variable for the engine without kvcached (with KVCACHED_ENABLE=1 "
        "it runs kvcached too: two settings compared)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="an A/A control: the second engine runs without kvcached too (its --on-env still "
        "applies), so what the harness itself gives one side shows",
    )


def engine_settings(args: argparse.Namespace, on: bool) -> tuple[bool, dict[str, str]]:
    """For the engine in the kvcached position (``on``) or not: whether kvcached is switched on, and the extra
    environment (applied after the engine's own)."""
    extra = dict(item.split("=", 1) for item in (args.on_env if on else args.off_env))
    return on and not args.control, extra


def settings_note(args: argparse.Namespace) -> str:
    """The report's words for :func:`engine_settings` ("" when the engines differ only by kvcached)."""
    on_env = args.on_env + (["no kvcached (--control: an A/A run)"] if args.control else [])
    return "; ".join(
        [f"the engine with kvcached also has {', '.join(on_env)}"] * bool(on_env)
        + [f"the engine without it has {', '.join(args.off_env)}"] * bool(args.off_env)
    )


def parse_paired(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, Path]:
    """The parsed options (at least one pass) and the output directory, created."""
    args = parser.parse_args()
    if args.passes < 1:
        parser.error("--passes must be at least 1")
    if not 1 <= args.restarts <= args.passes:
        parser.error("--restarts must be between 1 and --passes")
    if any("=" not in item for item in getattr(args, "on_env", []) + getattr(args, "off_env", [])):
        parser.error("--on-env and --off-env take NAME=VALUE")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return args, out


class EngineProcess:
    """One engine (``script --serve SPEC FD``) in its own session, and the pipe its results come back on."""

    def __init__(self, script: str, out: Path, spec: dict, env: dict[str, str], kvcached_on: bool) -> None:
        self.kvcached = kvcached_on
        self.label = "on" if kvcached_on else "off"
        spec_path = out / f"engine-{self.label}.spec.json"
        spec_path.write_text(json.dumps(dict(spec, kvcached=kvcached_on)))
        read_fd, write_fd = os.pipe()
        self.log_path = out / f"engine-{self.label}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, script, "--serve", str(spec_path), str(write_fd)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            start_new_session=True,
            text=True,
        )
        os.close(write_fd)
        self.results = os.fdopen(read_fd)

    def next_result(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.results], [], [], timeout_s)
        line = self.results.readline() if ready else ""
        if not line:
            raise RuntimeError(
                f"the {self.label} engine sent nothing within {timeout_s:.0f} s "
                f"(exit code {self.proc.poll()}); see engine-{self.label}.log "
                f"(engine-{self.label}.pairR.log with --restarts)"
            )
        return json.loads(line)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def run(self, k: int, timeout_s: float) -> dict:
        self.send(f"run {k}")
        return self.next_result(timeout_s)

    def pause(self) -> None:
        """Stops every process of the engine (its own session's process group)."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        try:
            self.resume()  # a failed lockstep pass may have left it stopped
        except ProcessLookupError:
            pass
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the engine is left
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def run_paired(
    out: Path,
    name: str,
    start_engine: Callable[[bool], EngineProcess],
    passes: int,
    gap_s: float,
    timeout_s: float,
    note: str = "",
    restarts: int = 1,
    lockstep: bool = False,
) -> list[dict]:
    """Runs ``passes`` ABBA passes on ``restarts`` pairs of engines in turn; writes runs.json and NAME.md.

    Each pair's two engines start one after the other (pair 0 the one without
    kvcached first, odd pairs the other way round) and serve an equal share of
    the passes; with several pairs each engine's log is kept as
    ``engine-LABEL.pairR.log``. ``note``: how the engines differ beyond
    kvcached on and off, for the report's first line. ``lockstep``: both
    engines serve each pass together, taking turns step by step
    (:func:`run_lockstep_pass`)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the engines are stopped too
    installed = installed_kvcached() + (f"; {note}" if note else "")
    installed += f"; {restarts} engine pairs, started one after the other" if restarts > 1 else ""
    print(installed, flush=True)
    runs: list[dict] = []
    first_pass = 0
    for pair in range(restarts):
        last_pass = passes * (pair + 1) // restarts
        engines: dict[bool, EngineProcess] = {}
        try:
            for on in (False, True) if pair % 2 == 0 else (True, False):  # one start-up at a time
                engines[on] = start_engine(on)
                engines[on].next_result(timeout_s)
            for k in range(first_pass, last_pass):
                order = (False, True) if k % 2 == 0 else (True, False)  # ABBA: drift cancels
                if lockstep:
                    time.sleep(gap_s)
                    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
                    results = run_lockstep_pass([engines[on] for on in order], k, timeout_s)
                for on in order:
                    if not lockstep:
                        time.sleep(gap_s)
                        uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
                    result = results[engines[on]] if lockstep else engines[on].run(k, timeout_s)
                    entry = dict(
                        label=f"p{k}-{engines[on].label}",
                        kvcached=on,
                        round=k,
                        engine_pair=pair,
                        uptime_before=uptime,
                        **result,
                    )
                    runs.append(entry)
                    print(
                        json.dumps(
                            {
                                key: entry.get(key)
                                for key in ("label", "tokens_per_s", "tpot_p99_ms", "ttft_p50_ms", "wall_s")
                            }
                        ),
                        flush=True,
                    )
                    (out / "runs.json").write_text(json.dumps(runs, indent=1))
        finally:
            for engine in engines.values():
                engine.stop()
                if restarts > 1:
                    engine.log_path.rename(engine.log_path.with_suffix(f".pair{pair}.log"))
        first_pass = last_pass
    text = installed + "\n\n" + summary(runs) + "\n" + report(runs)
    (out / f"{name}.md").write_text(text)
    print(text)
    return runs


def run_lockstep_pass(engines: list[EngineProcess], k: int, timeout_s: float) -> dict[EngineProcess, dict]:
    """Pass ``k`` on both engines at once, in turns of ``TURN_S`` (whole steps); each engine's result.

    A shared VM's speed drifts by tens of per cent over seconds (on the 2-core
    development VM, passes seconds apart read from 0.6x to 1.7x of each other), so
    pass-by-pass turns cannot resolve a few per cent; turns of 20 ms see the same
    machine. Each engine submits the pass's requests (the first engine first), then
    they take turns. Outside its turn an engine's processes are stopped
    (``SIGSTOP`` to its process group): nothing of it runs, not a worker spinning on
    its queue, not an EngineCore running ahead, not a background thread, so each
    engine's own clock (:class:`~e2e_common.BusyClock`, stopped while it waits)
    counts exactly the machine time it had."""
    results: dict[EngineProcess, dict] = {}
    waiting: list[EngineProcess] = []
    for engine in engines:  # submitting runs on the engine's own clock, one engine at a time
        engine.send(f"turns {k}")
        reply = engine.next_result(timeout_s)
        if "turn" in reply:
            engine.pause()
            waiting.append(engine)
        else:
            results[engine] = reply
    while waiting:
        for engine in list(waiting):
            engine.resume()
            engine.send("go")
            reply = engine.next_result(timeout_s)
            if "turn" in reply:
                engine.pause()
            else:
                results[engine] = reply
                waiting.remove(engine)
    return results


def wait_for_first_pass(log: Path, harness: subprocess.Popen) -> None:
    """Returns once a paired run writing ``log`` has finished its first pass (``p0-off``); exits if it ended."""
    while '"p0-off"' not in (log.read_text() if log.exists() else ""):
        if harness.poll() is not None:
            sys.exit(f"the paired run ended before its first pass; see {log}")
        time.sleep(0.2)


def counted_after_first_pass(runs_json: Path, key: str | None = None) -> dict[str, int]:
    """Per engine ("on" / "off"), the sum of ``key`` (None: 1 per pass) over every pass but the first (``p0-off``):
    what a profiler attached by :func:`wait_for_first_pass` saw."""
    counts = {"on": 0, "off": 0}
    for run in json.loads(runs_json.read_text()):
        if run["label"] != "p0-off":
            counts["on" if run["kvcached"] else "off"] += 1 if key is None else run[key]
    return counts


# ----------------------------------------------------------------------------- the figures


def median_interval(
    ratios: list[float], resamples: int = 10_000, seed: int = 0, groups: list[int] | None = None
) -> tuple[float, float]:
    """Bootstrap 95 % interval of the median of ``ratios`` (passes resampled with replacement).

    ``groups``: each ratio's engine pair. With more than one, the pairs are
    resampled first and then the passes within each pair drawn, so a pair's
    own offset (its processes' draw) widens the interval as it should."""
    rng = random.Random(seed)
    by_group: dict[int, list[float]] = {}
    for ratio, group in zip(ratios, groups or [0] * len(ratios)):
        by_group.setdefault(group, []).append(ratio)
    members = list(by_group.values())

    def resample() -> list[float]:
        if len(members) == 1:
            return rng.choices(ratios, k=len(ratios))
        return [
            ratio for chosen in rng.choices(members, k=len(members)) for ratio in rng.choices(chosen, k=len(chosen))
        ]

    medians = sorted(statistics.median(resample()) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def minor_faults(run: dict) -> int | None:
    """The minor page faults all of a pass's engine processes took (None where not recorded)."""
    counts = [process.get("minor_faults") for process in run.get("processes", {}).values()]
    return sum(counts) if counts and None not in counts else None


def summary(runs: list[dict]) -> str:
    """Per-pass ratios on ÷ off: their medians with a bootstrap interval, and the pooled throughput."""
    by_pass: dict[int, dict[bool, dict]] = {}
    for run in runs:
        by_pass.setdefault(run["round"], {})[run["kvcached"]] = run
    pairs = [pair for _, pair in sorted(by_pass.items()) if len(pair) == 2]
    if not pairs:
        return "no complete pass\n"
    groups = [pair[False].get("engine_pair", 0) for pair in pairs]
    engine_pairs = sorted(set(groups))
    lines = [
        f"{len(pairs)} passes, each on both engines"
        + (
            f", over {len(engine_pairs)} engine pairs (intervals resample the pairs, then their passes)"
            if len(engine_pairs) > 1
            else ""
        )
        + "; ratios kvcached on ÷ off:"
    ]
    for key, name, target in (
        ("tokens_per_s", "output tokens/s", "target ≥ 0.97"),
        ("tpot_p99_ms", "TPOT p99", "target ≤ 1.05"),
        ("ttft_p50_ms", "TTFT p50", None),
        ("ttft_p99_ms", "TTFT p99", None),
    ):
        ratios = [pair[True][key] / pair[False][key] for pair in pairs]
        low, high = median_interval(ratios, groups=groups)
        lines.append(
            f"- {name}: median **{statistics.median(ratios):.3f}** (bootstrap 95 % interval "
            f"{low:.3f}–{high:.3f})" + (f"; {target}" if target else "")
        )
    pooled = {
        on: sum(pair[on]["output_tokens"] for pair in pairs) / sum(pair[on]["wall_s"] for pair in pairs)
        for on in (False, True)
    }
    lines.append(
        f"- pooled output tokens/s (all tokens ÷ all timed seconds): off {pooled[False]:.1f}, "
        f"on {pooled[True]:.1f}, on ÷ off **{pooled[True] / pooled[False]:.3f}**"
    )
    if len(engine_pairs) > 1:
        per_pair = []
        for group in engine_pairs:
            ratios = [
                pair[True]["tokens_per_s"] / pair[False]["tokens_per_s"]
                for pair, of in zip(pairs, groups)
                if of == group
            ]
            per_pair.append(f"{group}: {statistics.median(ratios):.3f} ({len(ratios)})")
        lines.append("- output tokens/s by engine pair (median, passes): " + ", ".join(per_pair))
    if all(pair[on].get("cpu_s") for pair in pairs for on in (False, True)):
        ratios = [pair[True]["cpu_s"] / pair[False]["cpu_s"] for pair in pairs]
        low, high = median_interval(ratios, groups=groups)
        lines.append(
            f"- CPU seconds of the engine's processes per pass (the same work on both): median "
            f"**{statistics.median(ratios):.3f}** (bootstrap 95 % interval {low:.3f}–{high:.3f})"
        )
    faults = {on: [minor_faults(pair[on]) for pair in pairs] for on in (False, True)}
    if all(count is not None for counts in faults.values() for count in counts):
        lines.append(
            f"- minor page faults of the engine's processes per pass (median): off "
            f"{statistics.median(faults[False]):.0f}, on {statistics.median(faults[True]):.0f}"
        )
    if all(pair[on].get("engine_step_ms_per_step") is not None for pair in pairs for on in (False, True)):

        def added(key: str) -> float:
            return statistics.median(pair[True][key] - pair[False][key] for pair in pairs)

        def timed_on_both(key: str) -> bool:
            return all(pair[on].get(key) is not None for pair in pairs for on in (False, True))

        apply_ms = statistics.median(pair[True]["apply_ms_per_step"] or 0.0 for pair in pairs)
        worker_cpu = ""
        if timed_on_both("worker_cpu_ms_per_step"):
            worker_cpu = f"; worker thread CPU {added('worker_cpu_ms_per_step'):+.3f} ms"
            if timed_on_both("worker_sys_ms_per_step"):
                worker_cpu += f" (in the kernel {added('worker_sys_ms_per_step'):+.3f} ms)"
        lines.append(
            f"- per step, on − off (medians over the passes): EngineCore step {added('engine_step_ms_per_step'):+.3f} ms "
            f"(off {statistics.median(p[False]['engine_step_ms_per_step'] for p in pairs):.2f} ms), worker "
            f"{added('worker_ms_per_step'):+.3f} ms, of which kvcached's page-op apply {apply_ms:.3f} ms{worker_cpu}; "
            f"worker page faults {added('worker_faults_per_step'):+.0f}; scheduler CPU "
            f"{added('scheduler_cpu_us_per_step'):+.0f} µs"
        )
    return "\n".join(lines) + "\n"


__all__ = [
    "EngineProcess",
    "add_setting_options",
    "counted_after_first_pass",
    "engine_settings",
    "median_interval",
    "minor_faults",
    "paired_parser",
    "parse_paired",
    "pass_prompts",
    "run_paired",
    "serve_if_child",
    "serve_passes",
    "settings_note",
    "summary",
    "wait_for_first_pass",
]
