"""Memory moved by priority: how long a high-priority pool waits for a lower priority's memory.

Two processes, each a KVPool registered in one device registry whose budget is N bytes plus the
low-priority holder's min. The holder (priority 0, ``--min``) maps the whole budget with blocks
in use. Then the high-priority pool (priority 1) asks for N bytes with one
``alloc(n, timeout_s=...)``: its refusal writes a reclaim target into the holder's entry
(docs/memory-policy.md), and the holder gives back as an engine would:

* ``--mode busy``: the holder's loop (every ``--poll-ms``, as an engine's step) reads its limit
  in force and frees a page id's worth of blocks in use at a time while it holds more (an
  engine preempting), never going below its min;
* ``--mode idle``: the holder is idle and gives everything back at once when the device wants it
  (kvcached's ``IdleRelease``, as the vLLM and SGLang integrations use it).

One hand-over is from the high pool's ``alloc`` call to its return. Then the high pool frees and
trims, the holder takes its memory back, and the next round starts from the same state.

    python bench/e2e/policy_handover.py --device cpu --size 1GiB --rounds 20
    python bench/e2e/policy_handover.py --device cuda:0 --size 8GiB --rounds 20 --mode idle

Prints the median, p90 and p99 of the hand-over in ms (the first round is a warm-up, reported
apart) and writes them as JSON with ``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

NUM_LAYERS = 32
NUM_BUFFERS = 2
BLOCK_BYTES = 32 << 10
PAGE_BYTES = 2 << 20
PAGE_ID_BYTES = NUM_LAYERS * NUM_BUFFERS * PAGE_BYTES
BLOCKS_PER_PAGE_ID = PAGE_BYTES // BLOCK_BYTES
WAIT_TIMEOUT_S = 60.0
SETTLE_S = 0.2


def _pool(device: str, capacity_bytes: int, budget: Any) -> Any:
    from kvcached.pool import KVPool

    # No reserve kept: what each pool maps is what its blocks need, so the figures are the policy's.
    return KVPool(
        NUM_LAYERS,
        BLOCK_BYTES,
        NUM_BUFFERS,
        capacity_bytes=capacity_bytes,
        page_bytes=PAGE_BYTES,
        device=device,
        budget=budget,
        min_reserve_pages=0,
        max_reserve_pages=0,
    )


def _register(device: str, name: str, **policy: int) -> Any:
    from kvcached.registry import MemoryPolicy, registry_for

    return registry_for(device).register(name, policy=MemoryPolicy(**policy))


def holder(conn: Any, device: str, mode: str, min_bytes: int, capacity_bytes: int, poll_s: float) -> None:
    """The low-priority process: fills its share, gives back when asked, takes it back on "refill"."""
    from kvcached.integration.common.idle import IdleRelease

    budget = _register(device, "low-priority", min_bytes=min_bytes, priority=0)
    pool = _pool(device, capacity_bytes, budget)
    held: list = []

    def refill() -> None:
        want = budget.available_bytes // PAGE_ID_BYTES * BLOCKS_PER_PAGE_ID
        held.extend(pool.alloc(want, timeout_s=WAIT_TIMEOUT_S).tolist() if want else [])

    refill()
    conn.send(("ready", budget.mapped_bytes))
    while True:
        idle = IdleRelease(600.0, [budget]) if mode == "idle" else None
        if idle is not None:
            idle.due()  # the idle spell starts: only the device's wanting ends it early

            def give_all() -> None:
                pool.free(held)
                held.clear()
                pool.trim()

            idle.wake_when_due(give_all)
        while not conn.poll(poll_s):
            limit = budget.external_limit_bytes
            if mode == "busy" and limit is not None and len(held) * BLOCK_BYTES * NUM_LAYERS * NUM_BUFFERS > limit:
                pool.free(held[-BLOCKS_PER_PAGE_ID:])  # the newest request's blocks: one page id
                del held[-BLOCKS_PER_PAGE_ID:]
        if idle is not None:
            idle.close()
        command = conn.recv()
        if command == "stop":
            break
        refill()
        conn.send(("refilled", budget.mapped_bytes))
    pool.free(held)
    pool.close()
    conn.send(("stopped", None))


def run(args: argparse.Namespace) -> dict:
    from kvcached.registry import registry_for

    size_bytes = args.size // PAGE_ID_BYTES * PAGE_ID_BYTES
    min_bytes = args.min // PAGE_ID_BYTES * PAGE_ID_BYTES
    capacity_bytes = 2 * (size_bytes + min_bytes)
    registry_for(args.device, budget_bytes=size_bytes + min_bytes).budget_bytes = size_bytes + min_bytes
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    low = ctx.Process(
        target=holder, args=(child_conn, args.device, args.mode, min_bytes, capacity_bytes, args.poll_ms / 1000)
    )
    low.start()
    assert conn.recv()[0] == "ready"
    high_budget = _register(args.device, "high-priority", priority=1)
    high = _pool(args.device, capacity_bytes, high_budget)
    blocks = size_bytes // PAGE_ID_BYTES * BLOCKS_PER_PAGE_ID
    times_ms = []
    try:
        for _ in range(args.rounds + 1):
            time.sleep(SETTLE_S)  # the holder is in its steady state (idle: its watcher polling)
            began = time.perf_counter()
            ids = high.alloc(blocks, timeout_s=WAIT_TIMEOUT_S)
            times_ms.append((time.perf_counter() - began) * 1e3)
            high.free(ids)
            high.trim()
            time.sleep(1.1)  # the refusal is no longer recent: the holder's target lapses
            conn.send("refill")
            assert conn.recv()[0] == "refilled"
        conn.send("stop")
        conn.recv()
    finally:
        high.close()
        low.join(60)
    warm = times_ms[1:]
    quantile = statistics.quantiles(warm, n=100, method="inclusive") if len(warm) > 1 else warm * 99
    return {
        "device": args.device,
        "mode": args.mode,
        "size_bytes": size_bytes,
        "min_bytes": min_bytes,
        "poll_ms": args.poll_ms,
        "rounds": args.rounds,
        "warmup_ms": times_ms[0],
        "p50_ms": statistics.median(warm),
        "p90_ms": quantile[89],
        "p99_ms": quantile[98],
        "all_ms": warm,
    }


def main() -> None:
    from kvcached.sizes import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("1GiB"), help="bytes moved per hand-over")
    parser.add_argument("--min", type=parse_bytes, default=parse_bytes("512MiB"), help="the holder's min")
    parser.add_argument("--mode", choices=("busy", "idle"), default="busy")
    parser.add_argument("--poll-ms", type=float, default=5.0, help="the busy holder's step period")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if "KVCACHED_REGISTRY_DIR" not in os.environ:
        os.environ["KVCACHED_REGISTRY_DIR"] = tempfile.mkdtemp(prefix="kvcached-policy-bench-")
    result = run(args)
    print(
        f"{result['device']} {result['mode']}: {result['size_bytes'] >> 20} MiB from priority 0 to 1 "
        f"(holder min {result['min_bytes'] >> 20} MiB): p50 {result['p50_ms']:.1f} ms, "
        f"p90 {result['p90_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms over {result['rounds']} rounds "
        f"(warm-up {result['warmup_ms']:.1f} ms)"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
