"""Drives vLLM's sleep mode on a real engine with kvcached, for tests/integration/test_vllm_sleep.py.

    python vllm_sleep_drive.py SPEC.json RESULT.json

A script, so that the engine lives in its own process (vLLM's CPU build spawns its
EngineCore and workers, which re-import ``__main__``). SPEC: model, tensor_parallel_size,
pipeline_parallel_size, enforce_eager, scenarios (names below). RESULT: the generated
token ids after each step and what the registry and the workers showed.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    from kvcached.registry import open_existing
    from kvcached.testing.tiny_llama import prompt_ids

    spec = json.loads(open(spec_path).read())
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        kv_cache_memory_bytes=64 << 20,
        block_size=128,
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        pipeline_parallel_size=spec.get("pipeline_parallel_size", 1),
        enforce_eager=spec.get("enforce_eager", True),
        gpu_memory_utilization=0.15,
        enable_sleep_mode=True,
        seed=0,
    )
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(6, 200, seed=5, shared_prefix=100)]
    result: dict = {"outputs": {}, "probes": {}, "times": {}}

    def generate(label: str) -> None:
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        result["outputs"][label] = [list(o.outputs[0].token_ids) for o in outs]

    def probe(label: str) -> None:
        registry = open_existing("cpu")
        entries = [e for e in registry.entries() if e["name"] == os.environ["KVCACHED_NAME"]]
        result["probes"][label] = {
            "entries": sorted(
                (
                    {k: e[k] for k in ("local_device", "pid", "weights_bytes", "sleeping", "mapped_bytes")}
                    for e in entries
                ),
                key=lambda e: e["local_device"],
            ),
            "workers": llm.collective_rpc("kvcached_kv_stats"),
            "is_sleeping": llm.llm_engine.is_sleeping(),
        }

    def timed(label: str, call) -> None:
        start = time.perf_counter()
        call()
        result["times"][label] = time.perf_counter() - start

    generate("before")
    probe("awake")
    for scenario in spec["scenarios"]:
        if scenario == "level1":
            timed("sleep1", lambda: llm.sleep(level=1))
            probe("asleep1")
            timed("wake1", lambda: llm.wake_up())
            probe("woken1")
            generate("after_level1")
        elif scenario == "level2_reload":  # the RL flow: sleep 2, wake the weights, reload them, wake the KV cache
            llm.sleep(level=2)
            probe("asleep2")
            llm.wake_up(tags=["weights"])
            probe("weights_only")
            llm.collective_rpc("reload_weights")
            llm.wake_up(tags=["kv_cache"])
            probe("woken2")
            generate("after_level2_reload")
        elif scenario == "kv_cache_first":
            llm.sleep(level=1)
            llm.wake_up(tags=["kv_cache"])
            probe("kv_only")
            llm.wake_up(tags=["weights"])
            generate("after_kv_first")
        elif scenario == "release_kv_cache_memory":
            llm.sleep(level=0)
            llm.release_kv_cache_memory()
            probe("kv_released")
            llm.wake_up(tags=["kv_cache"])
            llm.wake_up(tags=["scheduling"])
            generate("after_kv_released")
        elif scenario == "cycles":
            for _ in range(20):
                llm.sleep(level=1)
                llm.wake_up()
            probe("after_cycles")
            generate("after_cycles")
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
    result["pid"] = os.getpid()
    with open(out_path, "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
