"""Runs a real vLLM engine on a tiny random-weight Llama, for the vLLM integration tests.

Used as a script so that every engine lives in its own process (vLLM's CPU build
starts its EngineCore and worker with ``spawn``, which re-imports ``__main__``):

    python python/kvcached/testing/vllm_harness.py SPEC.json RESULT.json

SPEC is a JSON object (see ``run``); RESULT receives the generated token ids and
the kvcached probes taken along the way. The model is built with transformers
from a fixed seed, so no download is needed; prompts are token ids and
``skip_tokenizer_init=True``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from kvcached.testing.tiny_llama import TINY_LLAMA, make_tiny_llama, prompt_ids  # noqa: F401  (the tests use them from here)


def _kvcached_enabled() -> bool:
    return any(
        os.environ.get(n, "").lower() in ("1", "true", "yes", "on") for n in ("KVCACHED_ENABLE", "ENABLE_KVCACHED")
    )


def kvcached_engine_stats(llm) -> dict | None:
    """The EngineCore's kvcached statistics, or None when kvcached is not active."""
    if not _kvcached_enabled():
        return None
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):
        return client.call_utility("kvcached_stats")
    return client.engine_core.kvcached_stats()  # in-process client


def kvcached_worker_stats(llm) -> list | None:
    """Per-worker kvcached mapping statistics (pages mapped in that process)."""
    if not _kvcached_enabled():
        return None
    return llm.collective_rpc("kvcached_kv_stats")


def registry_entries(name: str | None) -> list | None:
    """This engine's entries (one per rank) in the cpu registry, as ``kvctl list`` reads them."""
    if not name or not _kvcached_enabled():
        return None
    from kvcached.registry import open_existing

    registry = open_existing("cpu")
    entries = registry.entries() if registry is not None else []
    return sorted((e for e in entries if e["name"] == name), key=lambda e: e["local_device"])


def _probe(llm, label: str, probes: list) -> None:
    probes.append(
        {
            "label": label,
            "time": time.time(),
            "engine": kvcached_engine_stats(llm),
            "workers": kvcached_worker_stats(llm),
            "entries": registry_entries(os.environ.get("KVCACHED_NAME")),
        }
    )


def _wait_for(path: str | None, timeout_s: float = 600.0) -> None:
    if not path:
        return
    deadline = time.time() + timeout_s
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {path}")
        time.sleep(0.2)


def _touch(path: str | None) -> None:
    if path:
        Path(path).write_text("done")


def run(spec: dict) -> dict:
    """Runs the phases of ``spec`` on one engine.

    spec keys: model (dir), prefix_caching (bool), kv_cache_bytes (vLLM's
    ``kv_cache_memory_bytes`` per worker: its KV size without kvcached, each
    rank's limit with it), max_num_seqs, tensor_parallel_size,
    pipeline_parallel_size, enforce_eager (default true), dtype (default float32),
    gpu_memory_utilization, audio (an encoder-decoder model on audio), phases: a
    list of {prompts: [[ids]], audio_seconds (per prompt: the encoder's clip; the
    ids are then the decoder's), max_tokens, probe_during (bool), wait_for
    (file), signal (file), settle_s}. A phase
    without prompts only waits, pauses ``settle_s`` and probes if given, and signals.
    """
    from vllm import LLM, SamplingParams

    t0 = time.time()
    optional = {key: spec[key] for key in ("gpu_memory_utilization",) if key in spec}
    if spec.get("audio"):  # an encoder-decoder model on audio (Whisper): its processor needs the tokenizer
        optional["limit_mm_per_prompt"] = {"audio": 1}
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=not spec.get("audio"),
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 2048),
        max_num_seqs=spec.get("max_num_seqs", 16),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048),
        enable_prefix_caching=spec.get("prefix_caching", True),
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 256 << 20),
        block_size=spec.get("block_size", 128),
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        pipeline_parallel_size=spec.get("pipeline_parallel_size", 1),
        enforce_eager=spec.get("enforce_eager", True),
        seed=0,
        **optional,
    )
    init_s = time.time() - t0
    probes: list = []
    _probe(llm, "after_init", probes)
    outputs = []
    for i, phase in enumerate(spec["phases"]):
        _wait_for(phase.get("wait_for"))
        if not phase.get("prompts"):  # a pure synchronisation phase
            if "settle_s" in phase:  # a pause, then a look at memory
                time.sleep(phase["settle_s"])
                _probe(llm, f"phase{i}_done", probes)
            _touch(phase.get("signal"))
            outputs.append([])
            continue
        params = SamplingParams(
            max_tokens=phase.get("max_tokens", 16),
            temperature=0.0,
            ignore_eos=True,
            detokenize=False,
        )
        prompts = [{"prompt_token_ids": ids} for ids in phase["prompts"]]
        if "audio_seconds" in phase:  # encoder input: one noise clip per prompt; the ids are the decoder's
            from kvcached.testing.tiny_hybrids import whisper_audio

            prompts = [
                {
                    "encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": whisper_audio(seconds, seed=j)}},
                    "decoder_prompt": prompt,
                }
                for j, (seconds, prompt) in enumerate(zip(phase["audio_seconds"], prompts))
            ]
        if phase.get("probe_during"):
            # Submit, then step the engine by hand, probing after every step.
            engine = llm.llm_engine
            for j, prompt in enumerate(prompts):
                engine.add_request(f"p{i}-{j}", prompt, params)
            done: dict[str, list[int]] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = list(out.outputs[0].token_ids)
                if engine.has_unfinished_requests():  # probe every step under load
                    _probe(llm, f"phase{i}_running", probes)
            result = [done[f"p{i}-{j}"] for j in range(len(prompts))]
        else:
            result = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        outputs.append(result)
        time.sleep(phase.get("settle_s", 0.5))  # let the idle flush reach the worker
        _probe(llm, f"phase{i}_done", probes)
        _touch(phase.get("signal"))
    result = {"outputs": outputs, "probes": probes, "init_s": init_s, "total_s": time.time() - t0}
    llm.llm_engine.engine_core.shutdown()  # stops the EngineCore and worker processes
    result["after_shutdown"] = _registry_after_shutdown(os.environ.get("KVCACHED_NAME"))
    return result


def _registry_after_shutdown(name: str | None, timeout_s: float = 60.0) -> dict | None:
    """Once the EngineCore is gone: this engine's entries and the device's mapped bytes.

    vLLM may kill an EngineCore that is slow to stop; its entries are then
    reclaimed as stale (what any kvcached process does when it registers).
    """
    if not name or not _kvcached_enabled():
        return None
    from kvcached.registry import open_existing

    deadline = time.time() + timeout_s
    while any(e["alive"] for e in registry_entries(name)) and time.time() < deadline:
        time.sleep(0.2)
    registry = open_existing("cpu")
    registry.clean_stale()
    return {"entries": registry_entries(name), "device_mapped_bytes": registry.mapped_bytes}


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = run(spec)
    Path(sys.argv[2]).write_text(json.dumps(result))
    sys.stdout.flush()
    # The engine processes are stopped; exit without waiting for vLLM's
    # leftover non-daemon threads.
    os._exit(0)
