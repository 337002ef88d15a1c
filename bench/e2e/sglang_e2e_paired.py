"""kvcached on and off in SGLang: two long-lived engines taking turns, pass by pass.

The engines are ``sglang_e2e.py``'s (``sglang.Engine``, at most 32 running
requests, 40 000 KV slots, page size 1, the radix cache on; on a machine without
a GPU SGLang's CPU engine with the test suite's import shims), each told to sleep
when idle (``sleep_on_idle``) so the waiting one stays quiet; pass k streams the
96-request workload with prompt seed ``SEED + k`` through one, then the other,
ABBA across passes (``e2e_paired.py`` says why and how). Every pass is reported,
with the per-pass ratios on ÷ off, their medians and bootstrap 95 % intervals,
the ratio of the pooled throughput, and the CPU seconds each engine's processes
(front end, scheduler, detokenizer) spent in the pass.

``--torch-threads N`` sets ``OMP_NUM_THREADS`` of both engines. By default
SGLang's CPU engine computes on as many threads as there are cores; on the
2-core development VM that is both cores, shared with the engine's front end
and detokenizer, and one engine's throughput moved between 640 and 1200
tokens/s from pass to pass. With one thread it stayed within 600-870; A/A
runs of one engine pair still read 0.998 and 1.053 (a process's own speed), and
over four pairs (``--restarts 4``) 1.007, every pair within 1.004-1.021
(bench/RESULTS.md). One thread is also how vLLM's CPU backend runs there: it
keeps a core for its scheduler process and computes on the others.

``--model`` picks the model: the tiny Llama (default), or a tiny random-weight
model of another family from ``kvcached.testing.tiny_hybrids`` written next to
``DIR``: ``gemma3_attending`` (Gemma 3, 5 sliding-window layers to 1 full; SGLang serves it from its
plain pool) or ``deepseek_v2`` (MLA; on a CPU with the absorbed MLA path of
``kvcached.testing.sglang_mla_cpu`` in both engines).

``--tp N`` runs both engines with N tensor-parallel ranks (``tp_size``); under
kvcached the first rank decides for all of them. On a CPU each rank computes on
cores ÷ N torch threads (``OMP_NUM_THREADS``, unless ``--torch-threads`` says
otherwise). SGLang binds each rank to its share of the cores
(``SGLANG_CPU_OMP_THREADS_BIND``, set here unless it is set already) only where
its CPU kernels are built (AMX or arm64); elsewhere every rank would take
torch's default, one thread per core, and N ranks' threads would spin on the
same cores. On the 2-core development VM (no AMX) TP=2 that way ran at about
130 tokens/s, single passes from 87 to 178; with one thread a rank it ran at
about 460 (2026-12-06; single passes 335-537 as the VM's speed moved).

    python bench/e2e/sglang_e2e_paired.py --out DIR [--passes 30] [--torch-threads 1] [--model gemma3_attending] [--tp 2]

Needs SGLang 0.5.23 and transformers in the interpreter (see bench/README.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from e2e_common import WARMUP_REQUESTS, WORKLOAD, cpu_seconds, make_prompts, session_processes, timed_window
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
from sglang_e2e import CPU_ENGINE, ENGINE, engine_env, prepare_model, stream_all, use_sglang_cpu

from kvcached.testing import sglang_mla_cpu

#: --model -> the environment both engines get (the tiny Llama is ``llama``).
MODELS = {"llama": {}, "gemma3_attending": {}, "deepseek_v2": {sglang_mla_cpu.ENV: "1"}}

# SGLang's spawned scheduler re-imports this script; there (the CPU engine's shims
# already in place) an MLA model takes the absorbed path on torch_native.
if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sglang_mla_cpu.apply_from_env()


def serve(spec_path: str, result_fd: int) -> None:
    """The child: one engine, warmed up, serving passes until told to stop."""
    spec = json.loads(Path(spec_path).read_text())
    if spec["cpu"]:
        use_sglang_cpu()
    import sglang as sgl

    llm = sgl.Engine(
        model_path=spec["model"],
        sleep_on_idle=True,
        tp_size=spec.get("tp", 1),
        **ENGINE,
        **(CPU_ENGINE if spec["cpu"] else {"dtype": "bfloat16"}),
    )
    llm.loop.run_until_complete(stream_all(llm, make_prompts(WARMUP_REQUESTS, 32, 128, seed=1), 8))

    def run_pass(k: int) -> dict:
        if spec["flush_cache"]:
            llm.flush_cache()  # both engines start every pass with an empty radix cache
        before = session_processes()
        result = llm.loop.run_until_complete(stream_all(llm, pass_prompts(k), WORKLOAD["new_tokens"]))
        result["processes"] = timed_window(before, session_processes())
        result["cpu_s"] = cpu_seconds(result["processes"])
        states = llm.get_server_info().get("internal_states") or [{}]
        if states[0].get("kvcached"):
            result["kvcached_stats"] = states[0]["kvcached"]
        return result

    serve_passes(result_fd, run_pass)
    llm.shutdown()


def cpu_binding(ranks: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` giving each of ``ranks`` CPU ranks an equal share of this process's cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise SystemExit(f"--tp {ranks} needs at least {ranks} cores; this process may use {len(cores)}")
    share = len(cores) // ranks
    return "|".join(",".join(str(c) for c in cores[r * share : (r + 1) * share]) for r in range(ranks))


def main() -> None:
    serve_if_child(serve)
    parser = paired_parser(__doc__, passes=30, timeout_s=600.0, gap_help="idle time before each pass")
    parser.add_argument(
        "--flush-cache",
        action="store_true",
        help="empty both engines' radix caches before every pass (without it the engine without "
        "kvcached keeps every pass's prefixes, while kvcached's idle release evicts them)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        metavar="N",
        help="OMP_NUM_THREADS of both engines (default: SGLang's, as many threads as cores; "
        "with --tp N on a CPU, cores ÷ N)",
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="llama", help="the model both engines serve")
    parser.add_argument(
        "--tp", type=int, default=1, metavar="N", help="tensor-parallel ranks of both engines (default 1)"
    )
    add_setting_options(parser)
    args, out = parse_paired(parser)
    if args.torch_threads is not None and args.torch_threads < 1:
        parser.error("--torch-threads must be at least 1")
    if args.tp < 1:
        parser.error("--tp must be at least 1")
    model, cpu = prepare_model(out)
    if args.model != "llama":
        from kvcached.testing.tiny_hybrids import make_tiny_hybrid

        model = make_tiny_hybrid(args.model, out.parent / f"e2e-{args.model}")

    binding = {}
    torch_threads = args.torch_threads
    if cpu and args.tp > 1:
        if "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
            binding = {"SGLANG_CPU_OMP_THREADS_BIND": cpu_binding(args.tp)}
        if torch_threads is None:
            torch_threads = len(os.sched_getaffinity(0)) // args.tp  # the ranks' threads must not share cores

    def start_engine(on: bool) -> EngineProcess:
        kvcached_on, extra = engine_settings(args, on)
        threads = {} if torch_threads is None else {"OMP_NUM_THREADS": str(torch_threads)}
        env = dict(engine_env(kvcached_on), **threads, **MODELS[args.model], **binding, **extra)
        spec = dict(model=model, cpu=cpu, flush_cache=args.flush_cache, tp=args.tp)
        return EngineProcess(__file__, out, spec, env, on)

    threads_note = f"both engines with OMP_NUM_THREADS={torch_threads}" if torch_threads else ""
    tp_note = f"tp_size={args.tp}" + "".join(f", {k}={v}" for k, v in binding.items()) if args.tp > 1 else ""
    model_note = f"model: tiny {args.model}" if args.model != "llama" else ""
    run_paired(
        out,
        "sglang_e2e_paired",
        start_engine,
        args.passes,
        args.gap_s,
        args.timeout_s,
        note="; ".join(filter(None, [model_note, threads_note, tp_note, settings_note(args)])),
        restarts=args.restarts,
    )


if __name__ == "__main__":
    main()
