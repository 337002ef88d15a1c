"""Model weights asleep and awake: kvcached's sleep and wake against the plain copy of the same bytes.

    python bench/weights/sleep_wake.py --device cuda:0 --size 8GiB --rounds 5 [--chunk 256MiB ...] [--json PATH]

In one process, rounds interleaved: the floor (a pinned host buffer copied to a device
tensor of the same size and back, with torch; both allocated before timing) and kvcached (``ModelWeights`` of a module
holding ``--size`` bytes of bf16 parameters: level-1 sleep, wake, level-2 sleep, wake).
Every round is printed; the summary gives medians and the ratios the targets are about:
wake (level 1) / host->device copy, level-1 sleep / device->host copy, level-2 sleep in ms.
The first level-1 sleep of a ModelWeights allocates its pinned host buffer; it is timed
apart ("first sleep"), later sleeps reuse the buffer. ``--chunk`` repeats the kvcached side
for each size of the physical allocations behind the weights. After the rounds, on GPUs:
a CUDA graph captured before a sleep replays correctly after the wake, and the device's
free memory (``cudaMemGetInfo``) grows by the weights' size while they sleep.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

import kvcached
from kvcached.sizes import format_bytes, parse_bytes

GiB = 1 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, call) -> float:
    _sync(device)
    start = time.perf_counter()
    call()
    _sync(device)
    return time.perf_counter() - start


class Weights(torch.nn.Module):
    """``size`` bytes of bf16 parameters in tensors of at most 1 GiB, like a model's layers."""

    def __init__(self, size: int, device: torch.device) -> None:
        super().__init__()
        elements, part = size // 2, GiB // 2
        self.parts = torch.nn.ParameterList(
            torch.nn.Parameter(
                torch.full((min(part, elements - i),), 1.0 + i / part, dtype=torch.bfloat16, device=device),
                requires_grad=False,
            )
            for i in range(0, elements, part)
        )


class Floor:
    """The physical floor in this process: copies of ``size`` bytes between a pinned host
    buffer and a device tensor, both allocated (and touched) once, before any timing."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.device = device
        self.host = torch.ones(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.target = torch.zeros(size, dtype=torch.uint8, device=device)

    def round(self) -> dict:
        h2d = _timed(self.device, lambda: self.target.copy_(self.host, non_blocking=True))
        d2h = _timed(self.device, lambda: self.host.copy_(self.target, non_blocking=True))
        return {"h2d_s": h2d, "d2h_s": d2h}


def kvcached_round(weights: kvcached.ModelWeights, device: torch.device) -> dict:
    times = {}
    times["sleep1_s"] = _timed(device, lambda: weights.sleep(1))
    times["wake1_s"] = _timed(device, weights.wake_up)
    times["sleep2_s"] = _timed(device, lambda: weights.sleep(2))
    times["wake2_s"] = _timed(device, weights.wake_up)
    return times


def graph_and_memory_checks(weights: kvcached.ModelWeights, module: Weights, device: torch.device) -> dict:
    """A CUDA graph reading the weights replays right after a wake; asleep, the memory is free."""
    checks: dict = {}
    first = module.parts[0]
    x = torch.ones(first.numel(), dtype=torch.bfloat16, device=device)
    out = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.mul(first, x, out=out)  # warm-up on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            torch.mul(first, x, out=out)
    graph.replay()
    torch.cuda.synchronize()
    expected = out.clone()
    free_awake = torch.cuda.mem_get_info(device)[0]
    weights.sleep(1)
    free_asleep = torch.cuda.mem_get_info(device)[0]
    weights.wake_up()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    checks["graph_replays_after_level1_wake"] = bool(torch.equal(out, expected))
    weights.sleep(2)
    weights.wake_up()
    first.data.copy_(torch.full_like(first, 1.0))  # a reload after level 2, in place
    graph.replay()
    torch.cuda.synchronize()
    checks["graph_replays_after_level2_reload"] = bool(torch.equal(out, x))
    checks["free_bytes_gained_asleep"] = int(free_asleep - free_awake)
    checks["weights_bytes"] = weights.nbytes
    checks["memory_back_while_asleep"] = free_asleep - free_awake >= weights.nbytes
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--size", default="8GiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk", action="append", help="physical allocation size (repeatable; default 256MiB)")
    parser.add_argument("--json", help="write every round and the summary here")
    args = parser.parse_args()
    size = parse_bytes(args.size)
    chunks = [parse_bytes(c) for c in (args.chunk or ["256MiB"])]
    kv_device = kvcached.open_device(args.device)
    device = torch.device("cpu") if kv_device.backend == "host" else torch.device("cuda", kv_device.ordinal)
    report: dict = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "size_bytes": size,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(sys.argv),
        "by_chunk": {},
    }
    floor = Floor(size, device)
    for chunk in chunks:
        module = Weights(size, device)
        weights = kvcached.ModelWeights(
            module, device=kv_device, name="bench-weights", chunk_bytes=chunk, register=False
        )
        first_sleep = _timed(device, lambda: weights.sleep(1))
        weights.wake_up()
        rounds = []
        for index in range(args.rounds):
            copies = floor.round()
            ours = kvcached_round(weights, device)
            rounds.append({**copies, **ours})
            print(
                f"chunk {format_bytes(chunk)} round {index}: h2d {copies['h2d_s'] * 1e3:.1f} ms, wake1 "
                f"{ours['wake1_s'] * 1e3:.1f} ms | d2h {copies['d2h_s'] * 1e3:.1f} ms, sleep1 "
                f"{ours['sleep1_s'] * 1e3:.1f} ms | sleep2 {ours['sleep2_s'] * 1e3:.2f} ms, wake2 "
                f"{ours['wake2_s'] * 1e3:.1f} ms",
                flush=True,
            )
        median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        summary = {
            "chunks": weights.stats()["chunks"],
            "first_sleep1_s": first_sleep,
            "median": median,
            "wake1_over_h2d": median["wake1_s"] / median["h2d_s"],
            "sleep1_over_d2h": median["sleep1_s"] / median["d2h_s"],
            "sleep2_ms": median["sleep2_s"] * 1e3,
            "wake1_gb_per_s": size / median["wake1_s"] / 1e9,
            "rounds": rounds,
        }
        if device.type == "cuda" and chunk == chunks[-1]:
            summary["checks"] = graph_and_memory_checks(weights, module, device)
        weights.close()
        module = weights = None  # the next size starts from a clean device
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report["by_chunk"][format_bytes(chunk)] = summary
        print(
            f"chunk {format_bytes(chunk)} ({summary['chunks']} allocations): wake1/h2d {summary['wake1_over_h2d']:.3f}x, "
            f"sleep1/d2h {summary['sleep1_over_d2h']:.3f}x, sleep2 {summary['sleep2_ms']:.2f} ms, "
            f"first sleep1 {first_sleep * 1e3:.0f} ms, wake1 {summary['wake1_gb_per_s']:.1f} GB/s",
            flush=True,
        )
        if "checks" in summary:
            print(f"checks: {json.dumps(summary['checks'])}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
