"""Memory handed over between models behind ``kvcached serve``, timed end to end.

Starts ``kvcached serve`` (a subprocess, SIGTERM at the end) on a config it writes: two tiny
random-weight Llamas (``kvcached.testing``) in vLLM's CPU build, on a 72 MiB budget where one
model's burst (16 sequences of 500 + 32 tokens, 44 MiB) fits only if the other gives back. Each
round, model B holds memory and model A (priority 1) gets a burst through the OpenAI endpoint:

* ``--mode idle``: B ran a burst and keeps its memory while idle (its idle hold is 600 s), so it
  gives back only because A was refused;
* ``--mode busy``: B (priority 0, min 24 MiB) is still serving a long load and shrinks towards its
  min while it runs.

Per round: *hand-over*, the mean of ``kvcached_serve_memory_handover_seconds`` observed for A in
that round (refusal until A's memory grew, from ``/metrics``), and *to need*, the time from sending
A's burst until A's blocks in use reach what that burst used when run alone (measured once before
the rounds; alone it also maps a few free pages kept ready, reported beside it but not needed),
sampling the registry every 10 ms. Then the median, p90 and max of both.

    python bench/e2e/serve_handover.py --rounds 10 --mode idle --json /tmp/serve-handover.json
    python bench/e2e/serve_handover.py --rounds 10 --mode busy

Needs vLLM in this Python and kvcached's serve extra (fastapi, uvicorn, httpx, PyYAML,
prometheus_client) and the ``openai`` client.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

from e2e_common import in_workdir

MiB = 1 << 20
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve-cpu.yaml"
BUDGET = "72MiB"
B_MIN_MIB = 24
BURST = dict(sequences=16, prompt_tokens=500, seed=11, max_tokens=32)
# More than B's 64 MiB max wants: B stays busy for many steps while A's burst comes.
LONG_LOAD = dict(sequences=16, prompt_tokens=500, seed=12, max_tokens=400)
SAMPLE_S = 0.01
SETTLE_TIMEOUT_S = 120


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=_positive_int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--mode", choices=("idle", "busy"), default="idle", help="what B does meanwhile")
    parser.add_argument("--json", metavar="PATH", help="write every round and the summary here")
    parser.add_argument("--workdir", help="keep the model, config and logs here (default: a temporary folder)")
    return parser.parse_args(argv)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1, got {value}")
    return value


def config_models(mode: str) -> dict[str, dict]:
    """Each model's env and memory policy over the example's: A gives back at once when idle; B
    holds its memory 600 s idle (so only A's refusal takes it); in busy mode B keeps a min."""
    b_memory = {"min": f"{B_MIN_MIB}MiB", "priority": 0} if mode == "busy" else {"priority": 0}
    return {
        "tiny-a": {"env": {"KVCACHED_IDLE_RELEASE_S": "0"}, "memory": {"priority": 1}},
        "tiny-b": {
            "env": {"KVCACHED_IDLE_RELEASE_S": "600", "KVCACHED_IDLE_RELEASE_MAX_S": "600"},
            "memory": b_memory,
        },
    }


def spread(values: list[float]) -> dict[str, Optional[float]]:
    """Median, p90 and max of ``values`` (None each when there are none)."""
    if not values:
        return {"median": None, "p90": None, "max": None}
    p90 = statistics.quantiles(values, n=10, method="inclusive")[8] if len(values) > 1 else values[0]
    return {"median": statistics.median(values), "p90": p90, "max": max(values)}


def summarize(rounds: list[dict]) -> dict[str, Any]:
    """The spread of both figures over the rounds that have them."""
    return {
        "handover_ms": spread([r["handover_ms"] for r in rounds if r["handover_ms"] is not None]),
        "to_need_ms": spread([r["to_need_ms"] for r in rounds if r["to_need_ms"] is not None]),
        "rounds_without_handover": sum(r["handover_ms"] is None for r in rounds),
        "rounds_short_of_need": sum(r["to_need_ms"] is None for r in rounds),
    }


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0f}"


def format_round(r: dict) -> str:
    return (
        f"round {r['round']}: B held {r['b_held_bytes'] / MiB:.0f} MiB, went down to "
        f"{r['b_low_bytes'] / MiB:.0f} MiB; A peaked at {r['a_peak_bytes'] / MiB:.0f} MiB "
        f"({r.get('a_peak_used_bytes', r['a_peak_bytes']) / MiB:.0f} MiB in use); "
        f"{r['handovers']} hand-over(s), mean {_ms(r['handover_ms'])} ms; "
        f"to need {_ms(r['to_need_ms'])} ms; burst {r['burst_ms']:.0f} ms"
    )


def format_summary(result: dict) -> str:
    lines = [
        f"serve hand-over ({result['mode']}, {len(result['rounds'])} rounds; A needs "
        f"{result['need_bytes'] / MiB:.0f} MiB in use for its burst, "
        f"{result.get('need_mapped_bytes', result['need_bytes']) / MiB:.0f} MiB mapped alone)"
    ]
    for key, label in (("handover_ms", "hand-over (refusal to growth)"), ("to_need_ms", "burst to need")):
        s = result["summary"][key]
        lines.append(f"  {label:32s} median {_ms(s['median'])} ms  p90 {_ms(s['p90'])} ms  max {_ms(s['max'])} ms")
    missed = result["summary"]["rounds_without_handover"], result["summary"]["rounds_short_of_need"]
    if any(missed):
        lines.append(f"  rounds with no hand-over: {missed[0]}; rounds where A never held its need: {missed[1]}")
    return "\n".join(lines)


class Bench:
    """One serve process with tiny-a and tiny-b, and the round's steps on it."""

    def __init__(self, serve: Any) -> None:
        import openai

        self.serve = serve
        # No retries: a refused request must show, not be retried away.
        self.client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    def mapped(self) -> dict[str, int]:
        """Each model's mapped bytes, and A's bytes in use (``A used``)."""
        from kvcached.testing.serve_session import registry_entries

        usage = {"tiny-a": 0, "tiny-b": 0, "A used": 0}
        for entry in registry_entries(self.serve.registry_dir):
            if entry["name"] in usage and entry["alive"]:
                usage[entry["name"]] += entry["mapped_bytes"]
                if entry["name"] == "tiny-a":
                    usage["A used"] += entry["used_bytes"]
        return usage

    def complete(self, model: str, load: dict) -> None:
        from kvcached.testing.tiny_llama import prompt_ids

        self.client.completions.create(
            model=model,
            prompt=prompt_ids(load["sequences"], load["prompt_tokens"], seed=load["seed"]),
            max_tokens=load["max_tokens"],
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    def handovers_to_a(self) -> tuple[float, float]:
        from kvcached.testing.serve_session import metric_sum

        text = self.serve.metrics()
        name = "kvcached_serve_memory_handover_seconds"
        return metric_sum(text, name + "_count", to_model="tiny-a"), metric_sum(text, name + "_sum", to_model="tiny-a")

    def wait_for(self, what: str, ready: Callable[[dict[str, int]], bool]) -> None:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while not ready(self.mapped()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not seen in {SETTLE_TIMEOUT_S} s: {self.mapped()}")
            time.sleep(0.05)

    def need(self) -> dict[str, int]:
        """What A's burst uses and maps at its peak when nothing else holds memory (B has run nothing yet)."""
        from kvcached.testing.serve_session import Sampler

        with Sampler(self.mapped, SAMPLE_S) as sampler:
            self.complete("tiny-a", BURST)
        samples = [sample for _, sample in sampler.samples]
        return {"used": max(s["A used"] for s in samples), "mapped": max(s["tiny-a"] for s in samples)}

    def round(self, k: int, mode: str, need: dict[str, int]) -> dict:
        background = None
        if mode == "idle":
            self.complete("tiny-b", BURST)
        else:
            background = threading.Thread(target=self.complete, args=("tiny-b", LONG_LOAD), daemon=True)
            background.start()
            self.wait_for("tiny-b's long load growing", lambda m: m["tiny-b"] >= 48 * MiB)
        # A gave back its last burst when idle; B holds what it took.
        self.wait_for("tiny-a giving its memory back", lambda m: m["tiny-a"] <= 8 * MiB)
        held = self.mapped()["tiny-b"]
        count, total = self.handovers_to_a()
        from kvcached.testing.serve_session import Sampler

        with Sampler(self.mapped, SAMPLE_S) as sampler:
            sent = time.monotonic()
            self.complete("tiny-a", BURST)
            burst_s = time.monotonic() - sent
        if background is not None:
            background.join()
        count_after, total_after = self.handovers_to_a()
        handovers = int(count_after - count)
        reached = [at for at, sample in sampler.samples if sample["A used"] >= need["used"]]
        return {
            "round": k,
            "b_held_bytes": held,
            "b_low_bytes": min(sample["tiny-b"] for _, sample in sampler.samples),
            "a_peak_bytes": max(sample["tiny-a"] for _, sample in sampler.samples),
            "a_peak_used_bytes": max(sample["A used"] for _, sample in sampler.samples),
            "handovers": handovers,
            "handover_ms": (total_after - total) / handovers * 1000 if handovers else None,
            "to_need_ms": (reached[0] - sent) * 1000 if reached else None,
            "burst_ms": burst_s * 1000,
        }


def run(args: argparse.Namespace, workdir: Path) -> dict:
    from kvcached.serve.ports import free_port
    from kvcached.testing.serve_session import ServeProcess, serve_config
    from kvcached.testing.tiny_llama import make_tiny_llama
    from kvcached.testing.tiny_tokenizer import write_tiny_tokenizer

    model = Path(write_tiny_tokenizer(make_tiny_llama(workdir / "model")))
    registry = workdir / "registry"
    registry.mkdir(exist_ok=True)
    config = serve_config(EXAMPLE, model, None, free_port(), BUDGET, config_models(args.mode))
    serve = ServeProcess(workdir, config, registry)
    serve.start()
    try:
        serve.wait_healthy()
        bench = Bench(serve)
        need = bench.need()
        rounds = []
        for k in range(args.rounds):
            rounds.append(bench.round(k, args.mode, need))
            print(format_round(rounds[-1]), flush=True)
    finally:
        code = serve.stop()
        if code != 0:
            print(f"kvcached serve exited with {code}; its log: {serve.log_path}", file=sys.stderr)
    return {
        "mode": args.mode,
        "budget": BUDGET,
        "need_bytes": need["used"],
        "need_mapped_bytes": need["mapped"],
        "rounds": rounds,
        "summary": summarize(rounds),
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    result = in_workdir(args.workdir, "kvcached-serve-handover-", lambda workdir: run(args, workdir))
    print(format_summary(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
