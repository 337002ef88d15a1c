"""Runs a real SGLang engine on a tiny random-weight Llama, for the SGLang integration tests.

Used as a script so that every engine lives in its own process (SGLang starts
its scheduler and detokenizer with ``spawn``, which re-imports ``__main__``):

    python tests/integration/sglang_harness.py SPEC.json RESULT.json

Needs ``SGLANG_USE_CPU_ENGINE=1`` and ``kvcached/testing/sglang_cpu`` on
``PYTHONPATH`` (the tests set both). SPEC is a JSON object (see ``run``);
RESULT receives the generated token ids, SGLang's prefix-cache hits and the
kvcached probes: this engine's mapped bytes read from the device registry
(what ``kvctl`` shows) while each phase runs, and kvcached's counters from the
scheduler (``get_server_info``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from kvcached.testing.sglang_mla_cpu import apply_from_env

# Module level: SGLang's spawned scheduler re-imports this script as __mp_main__.
apply_from_env()

ENGINE_DEFAULTS = dict(
    device="cpu",
    attention_backend="torch_native",
    skip_tokenizer_init=True,
    dtype="float32",
    disable_cuda_graph=True,
    log_level="warning",
    max_running_requests=16,
    chunked_prefill_size=512,
    max_prefill_tokens=2048,
    random_seed=0,
)


def registry_mapped_bytes(name: str | None) -> int | None:
    """Bytes the instance ``name`` has mapped, from the cpu registry (None: not registered)."""
    if not name:
        return None
    from kvcached.registry import open_existing

    registry = open_existing("cpu")
    if registry is None:
        return None
    sizes = [e["mapped_bytes"] for e in registry.entries() if e["name"] == name and e["alive"]]
    return sizes[0] if sizes else None


def registry_rank_bytes(name: str | None) -> dict[str, int]:
    """Bytes each rank of the instance ``name`` has mapped, by its local device ("rank1-cpu")."""
    if not name:
        return {}
    from kvcached.registry import open_existing

    registry = open_existing("cpu")
    if registry is None:
        return {}
    return {e["local_device"]: e["mapped_bytes"] for e in registry.entries() if e["name"] == name and e["alive"]}


def registry_rows(name: str | None, prefix: str | None = None) -> list[dict]:
    """The live rows of the instance ``name`` (its ranks' KV and weights), as the registry shows them;
    without a name, of every instance whose name starts with ``prefix`` (one SGLang derived)."""
    if not (name or prefix):
        return []
    from kvcached.registry import open_existing

    registry = open_existing("cpu")
    if registry is None:
        return []
    fields = ("name", "local_device", "pid", "mapped_bytes", "weights_bytes", "sleeping")
    return [
        {f: e[f] for f in fields}
        for e in registry.entries()
        if e["alive"] and (e["name"] == name if name else e["name"].startswith(prefix))
    ]


def kvcached_stats(llm) -> dict | None:
    """kvcached's counters in the scheduler process (None when kvcached is not active there)."""
    states = llm.get_server_info().get("internal_states") or [{}]
    return states[0].get("kvcached")


def _probe(label: str, llm, name: str | None, prefix: str | None = None) -> dict:
    """What the registry shows of this engine now, and kvcached's counters in its scheduler."""
    return {
        "label": label,
        "mapped_bytes": registry_mapped_bytes(name),
        "rank_bytes": registry_rank_bytes(name),
        "rows": registry_rows(name, prefix),
        "kvcached": kvcached_stats(llm),
    }


def _wait_for(path: str | None, timeout_s: float = 900.0) -> None:
    deadline = time.time() + timeout_s
    while path and not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {path}")
        time.sleep(0.2)


def _touch(path: str | None) -> None:
    if path:
        Path(path).write_text("done")


def _generate_probing(llm, prompts, params, name: str | None) -> tuple[list, list[int], dict[str, int]]:
    """Generates in a thread while sampling this engine's mapped bytes every 20 ms (and each rank's peak)."""
    box: dict = {}

    def work() -> None:
        try:
            box["outputs"] = llm.generate(input_ids=prompts, sampling_params=params)
        except BaseException as exc:  # re-raised below, in the harness's thread
            box["error"] = exc

    thread = threading.Thread(target=work)
    samples: list[int] = []
    rank_peaks: dict[str, int] = {}
    thread.start()
    while thread.is_alive():
        mapped = registry_mapped_bytes(name)
        if mapped is not None:
            samples.append(mapped)
        for rank, size in registry_rank_bytes(name).items():
            rank_peaks[rank] = max(size, rank_peaks.get(rank, 0))
        thread.join(0.02)
    if "error" in box:
        raise box["error"]
    return box["outputs"], samples, rank_peaks


def run(spec: dict) -> dict:
    """Runs the phases of ``spec`` on one engine.

    spec keys: model (dir), page_size, engine (extra ``sgl.Engine`` kwargs,
    e.g. max_total_tokens), phases: a list of {prompts: [[ids]],
    max_new_tokens, wait_for (file), signal (file), settle_s, engine_calls}. A
    phase without prompts only waits and signals (and probes after settle_s, if
    given). ``engine_calls`` ([method, kwargs] pairs on the engine, e.g.
    ``release_memory_occupation``) run first, then every rank's registry row is
    probed ("phase<i>_calls"). Rows are found by ``KVCACHED_NAME``, or without it by
    ``registry_name_prefix`` (the start of the name kvcached derives).
    """
    import sglang as sgl

    name = os.environ.get("KVCACHED_NAME")
    prefix = spec.get("registry_name_prefix")  # rows of an engine without KVCACHED_NAME
    t0 = time.time()
    kwargs = {**ENGINE_DEFAULTS, "model_path": spec["model"], "page_size": spec.get("page_size", 1)}
    kwargs.update(spec.get("engine", {}))
    llm = sgl.Engine(**kwargs)
    init_s = time.time() - t0
    info = llm.get_server_info()
    probes = [_probe("after_init", llm, name, prefix)]
    outputs, cached, peaks, rank_peaks, call_results = [], [], [], [], []
    for i, phase in enumerate(spec["phases"]):
        _wait_for(phase.get("wait_for"))
        if phase.get("engine_calls"):  # e.g. ["release_memory_occupation", {"tags": ["weights"]}]
            results = [getattr(llm, method)(**kwargs) for method, kwargs in phase["engine_calls"]]
            call_results.append([list(r) if isinstance(r, tuple) else r for r in results])
            probes.append(_probe(f"phase{i}_calls", llm, name, prefix))
        if not phase.get("prompts"):  # a pure synchronisation phase; with settle_s, a probe after it
            if "settle_s" in phase:
                time.sleep(phase["settle_s"])
                probes.append(_probe(f"phase{i}_done", llm, name, prefix))
            _touch(phase.get("signal"))
            outputs.append([])
            cached.append([])
            peaks.append(None)
            rank_peaks.append({})
            continue
        params = {"temperature": 0.0, "max_new_tokens": phase.get("max_new_tokens", 16), "ignore_eos": True}
        result, samples, peaks_by_rank = _generate_probing(llm, phase["prompts"], params, name)
        outputs.append([list(r["output_ids"]) for r in result])
        cached.append([r["meta_info"].get("cached_tokens", 0) for r in result])
        peaks.append(max(samples) if samples else None)
        rank_peaks.append(peaks_by_rank)
        time.sleep(phase.get("settle_s", 1.0))  # the scheduler goes idle and gives memory back
        probes.append(_probe(f"phase{i}_done", llm, name, prefix))
        _touch(phase.get("signal"))
    result = {
        "outputs": outputs,
        "cached_tokens": cached,
        "peak_mapped_bytes": peaks,
        "peak_rank_bytes": rank_peaks,
        "probes": probes,
        "call_results": call_results,
        "max_total_num_tokens": info.get("max_total_num_tokens"),
        "init_s": init_s,
        "total_s": time.time() - t0,
    }
    llm.shutdown()
    return result


if __name__ == "__main__":
    result = run(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # the engine's processes are stopped; do not wait for leftover threads
