"""End-to-end cost of kvcached inside SGLang: the same seeded workload with and without.

The workload of ``vllm_e2e.py`` (``e2e_common.py``): a tiny 6-layer Llama with
random weights, 96 requests of 16-400 prompt tokens (token ids, seeded) and 64
new tokens each, greedy, at most 32 running requests, the radix cache on. All
requests are submitted at once and streamed, so each request's first token and
finish are timed where they arrive. Each run is a fresh ``sglang.Engine`` in its
own process group; runs alternate without and with kvcached (ABBA), every run
reported, with the ratios per round.

    python bench/e2e/sglang_e2e.py --out DIR [--rounds 3]

Needs SGLang 0.5.23 and transformers in the interpreter. On a machine without a
GPU it runs SGLang's CPU engine with the test suite's import shims
(``kvcached.testing.sglang_env``; install as in ``.ci/install_sglang_cpu.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from e2e_common import (
    WARMUP_REQUESTS,
    WORKLOAD,
    make_model,
    make_prompts,
    run_child,
    run_rounds,
    summarize,
    without_kvcached_flags,
)

ENGINE = dict(
    skip_tokenizer_init=True,
    disable_cuda_graph=True,
    log_level="warning",
    max_running_requests=32,
    chunked_prefill_size=2048,
    max_prefill_tokens=2048,
    max_total_tokens=40_000,
    page_size=1,
    random_seed=0,
)
# On a CPU: SGLang's CPU engine with torch_native attention in float32, as the integration tests
# run it. 40 000 slots of 12 KiB (6 layers, K and V, 4 heads of 64, fp32) cap both modes alike.
CPU_ENGINE = dict(device="cpu", attention_backend="torch_native", dtype="float32")


async def stream_all(llm, prompts: list[list[int]], new_tokens: int) -> dict:
    """Submits every prompt at once and streams them; times each request's first token and finish."""
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    first: dict[int, float] = {}
    finish: dict[int, float] = {}
    tokens: dict[int, int] = {}

    async def one(i: int, prompt: list[int]) -> None:
        stream = await llm.async_generate(input_ids=prompt, sampling_params=params, stream=True)
        async for chunk in stream:
            now = time.perf_counter()
            count = chunk["meta_info"]["completion_tokens"]
            if count and i not in first:
                first[i] = now
            if chunk["meta_info"].get("finish_reason") is not None:
                finish[i], tokens[i] = now, count

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return summarize(start, time.perf_counter(), first, finish, tokens)


def use_sglang_cpu() -> None:
    """SGLang's CPU engine and the import shims it needs here (this process and the ones it starts)."""
    from kvcached.testing.sglang_env import use_sglang_cpu as prepare

    prepare()


def child(spec_path: str, out_path: str) -> None:
    """One engine: warm-up, then the timed workload."""
    spec = json.loads(Path(spec_path).read_text())
    if spec["cpu"]:
        use_sglang_cpu()
    import sglang as sgl

    t0 = time.perf_counter()
    llm = sgl.Engine(model_path=spec["model"], **ENGINE, **(CPU_ENGINE if spec["cpu"] else {"dtype": "bfloat16"}))
    init_s = time.perf_counter() - t0
    llm.loop.run_until_complete(stream_all(llm, make_prompts(WARMUP_REQUESTS, 32, 128, seed=1), 8))
    load_before = os.getloadavg()
    result = llm.loop.run_until_complete(stream_all(llm, make_prompts(**WORKLOAD), WORKLOAD["new_tokens"]))
    result.update(init_s=init_s, load_before=load_before, load_after=os.getloadavg())
    states = llm.get_server_info().get("internal_states") or [{}]
    if states[0].get("kvcached"):
        result["kvcached_stats"] = states[0]["kvcached"]
    Path(out_path).write_text(json.dumps(result))
    llm.shutdown()


def prepare_model(out: Path) -> tuple[str, bool]:
    """The benchmark model (written next to ``out`` once) and whether SGLang runs its CPU engine here."""
    import torch

    cpu = not torch.cuda.is_available()
    if cpu:
        use_sglang_cpu()  # transformers, which writes the model, imports torchvision
    return make_model(out.parent / "e2e-model"), cpu


def engine_env(kvcached_on: bool) -> dict[str, str]:
    """An engine's environment: its own registry (its own budget), kvcached switched on or off."""
    env = without_kvcached_flags(
        dict(
            KVCACHED_REGISTRY_DIR=tempfile.mkdtemp(prefix="kvcached-e2e-"),
            KVCACHED_VIRTUAL_CAPACITY_BYTES=str(1 << 30),
            PYTHONUNBUFFERED="1",
        )
    )
    if kvcached_on:
        env["KVCACHED_ENABLE"] = "1"
    return env


def run_engine(out: Path, label: str, model: str, kvcached_on: bool, timeout_s: float, cpu: bool) -> dict:
    return run_child(__file__, out, label, dict(model=model, cpu=cpu), engine_env(kvcached_on), timeout_s, kvcached_on)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        os._exit(0)  # the engine's processes are stopped; do not wait for leftover threads
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a running engine is stopped too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit per engine run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, cpu = prepare_model(out)
    run_rounds(out, args.rounds, lambda label, on: run_engine(out, label, model, on, args.timeout_s, cpu), "sglang_e2e")


if __name__ == "__main__":
    main()
