"""Two SGLang engines sharing one device's memory through kvcached.

Each engine runs in its own process with ``KVCACHED_ENABLE=1`` and SGLang's own
``sglang.Engine``. Neither gets a fixed KV partition: both plan for a large
virtual KV cache, and physical memory is mapped only for the token slots in use,
drawn from the device's shared budget. The second engine starts its load after
the first one finished, on memory the first one gave back.

    # GPU (CUDA build of SGLang 0.5.23), two real models:
    python examples/sglang_two_engines.py --model-a Qwen/Qwen2.5-0.5B-Instruct \\
        --model-b meta-llama/Llama-3.2-1B-Instruct

    # CPU, no download: two tiny random-weight Llamas on SGLang's CPU engine. With
    # SGLang from PyPI (no sgl-kernel CPU build) that needs the import stub and
    # torchvision shim the tests use:
    SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=python/kvcached/testing/sglang_cpu \\
        python examples/sglang_two_engines.py --tiny

Watch the device while it runs: ``kvtop`` (or ``kvctl list``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import threading
import time
from typing import Any


def mapped_bytes(device: str, name: str) -> int:
    """This engine's mapped KV memory, as ``kvctl`` sees it in the device registry."""
    from kvcached.registry import open_existing

    registry = open_existing(device)
    return sum(e["mapped_bytes"] for e in registry.entries() if e["name"] == name) if registry else 0


def run_engine(name: str, model: str, args: argparse.Namespace, turn: Any, done: Any) -> None:
    os.environ["KVCACHED_ENABLE"] = "1"  # read by the plugin in every SGLang process
    os.environ["KVCACHED_NAME"] = name  # how kvctl and kvtop show this engine
    import sglang as sgl

    if args.tiny:
        device = "cpu"
        engine = sgl.Engine(
            model_path=model,
            device="cpu",
            attention_backend="torch_native",
            skip_tokenizer_init=True,
            dtype="float32",
            disable_cuda_graph=True,
        )
        prompts = [[(7 * i + j) % 500 + 3 for j in range(300)] for i in range(24)]
        params = {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True}
        request = {"input_ids": prompts}
    else:
        import torch

        device = f"{'rocm' if torch.version.hip else 'cuda'}:0"
        engine = sgl.Engine(model_path=model)
        prompts = [f"Write a short story about engine number {i}." for i in range(64)]
        params = {"temperature": 0.0, "max_new_tokens": 256}
        request = {"prompt": prompts}
    print(f"[{name}] idle: {mapped_bytes(device, name) / 2**20:8.1f} MiB mapped", flush=True)
    turn.wait()  # our turn: the other engine has finished its load (or we go first)
    peak, running = 0, True

    def watch() -> None:
        nonlocal peak
        while running:
            peak = max(peak, mapped_bytes(device, name))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.time()
    outputs = engine.generate(**request, sampling_params=params)
    running = False
    watcher.join()
    print(f"[{name}] {len(outputs)} requests in {time.time() - t0:.1f} s, peak {peak / 2**20:.1f} MiB", flush=True)
    time.sleep(2.0)  # idle: the engine gives its KV memory back
    print(f"[{name}] idle again: {mapped_bytes(device, name) / 2**20:8.1f} MiB mapped", flush=True)
    done.set()
    engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-a", default=None)
    parser.add_argument("--model-b", default=None)
    parser.add_argument("--tiny", action="store_true", help="two tiny random Llamas on the CPU")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="kvcached-sglang-")
    if args.tiny:
        from kvcached.testing.tiny_llama import make_tiny_llama  # random weights: nothing downloaded

        models = [make_tiny_llama(os.path.join(workdir, f"tiny-{i}"), seed=i) for i in range(2)]
    elif args.model_a and args.model_b:
        models = [args.model_a, args.model_b]
    else:
        parser.error("give --model-a and --model-b, or --tiny")
    ctx = mp.get_context("spawn")
    go_a, a_done, b_done = ctx.Event(), ctx.Event(), ctx.Event()
    engines = [
        ctx.Process(target=run_engine, args=("engine-a", models[0], args, go_a, a_done)),
        ctx.Process(target=run_engine, args=("engine-b", models[1], args, a_done, b_done)),
    ]
    for process in engines:
        process.start()
    go_a.set()
    for process in engines:
        process.join()


if __name__ == "__main__":
    main()
