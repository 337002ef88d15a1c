"""Memory hand-over between two processes on one device budget: how fast memory moves.

Two processes, each with a KVPool registered in the same device registry, whose
budget holds N bytes plus what the default reserves keep (a free page id and
the spare allocations of each pool). One holds N bytes of blocks; the other
waits for them: by default with one ``alloc(n, timeout_s=...)``, which maps what
memory there is and polls the budget for more (``--retry-ms`` instead retries a
plain ``alloc`` with a pause in between, as before). Its refusals are recorded as
pressure, which tells the holder's worker to give memory back at once, in slices.
The holder frees; the hand-over time is from the holder's ``free`` to the waiter's
``alloc`` returning. Then the roles swap, so every hand-over starts from the same state.

Timestamps (CLOCK_MONOTONIC, comparable across processes) split each hand-over; the
holder polls its ``stats()`` every ~0.1 ms:

* ``first_release``: the holder's budget charge dropped (its worker woke and gave
  back a first slice),
* ``released``: all N bytes are back in the budget,
* ``done``: the waiter's ``alloc`` returned; ``waiter_tail`` = done - released is
  what the waiter still had to do once the last slice came back (with slices it
  maps while the holder unmaps, so this is short).

    python bench/e2e/handover.py --device cpu --size 1GiB --handovers 20 --out DIR
    python bench/e2e/handover.py --device cuda:0 --size 8GiB --handovers 20 --out DIR

Every configuration starts with ``--warmup`` hand-overs (default 1: the first
mapping of fresh memory in each process), reported apart from the percentiles.
Writes DIR/handover.json (every hand-over) and DIR/handover.md.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

NUM_LAYERS = 32
NUM_BUFFERS = 2
BLOCK_BYTES = 32 << 10
PAGE_BYTES = 2 << 20
POLL_S = 1e-4  # the holder's stats() polling while its worker unmaps
WAIT_TIMEOUT_S = 30.0  # the waiter's alloc(n, timeout_s) in the default mode
SLACK_PAGE_IDS = 6  # budget beyond N: each pool's free reserve page and spare allocations


def _pool(device: str, layout: str, zero_backing: bool, capacity_bytes: int, name: str):
    from kvcached.pool import KVPool

    return KVPool(
        NUM_LAYERS,
        BLOCK_BYTES,
        NUM_BUFFERS,
        capacity_bytes=capacity_bytes,
        layout=layout,
        page_bytes=PAGE_BYTES,
        device=device,
        zero_backing=zero_backing,
        name=name,
    )


def _hold(pool: Any, blocks: int) -> Any:
    return pool.alloc(blocks)


def _wait_and_alloc(pool: Any, blocks: int, retry_s: float, conn: Any) -> dict:
    """Gets ``blocks``: one refused attempt (reported as "waiting"), then a waiting
    alloc (``retry_s`` 0) or plain allocs retried every ``retry_s``."""
    import kvcached

    attempts = 0
    while True:
        start = time.perf_counter()
        try:
            wait = attempts > 0 and retry_s == 0
            ids = pool.alloc(blocks, timeout_s=WAIT_TIMEOUT_S) if wait else pool.alloc(blocks)
        except kvcached.OutOfMemoryError:
            attempts += 1
            if attempts == 1:
                conn.send(("waiting", time.perf_counter()))
            if retry_s > 0:
                time.sleep(retry_s)
            continue
        done = time.perf_counter()
        return dict(ids=ids, alloc_start=start, done=done, refusals=attempts)


def _free_and_watch(pool: Any, ids: Any, timeout_s: float = 30.0) -> dict:
    """Frees, then polls the pool until all the freed memory is back in the budget."""
    before = pool.stats()
    freed_bytes = len(ids) // pool.blocks_per_page * pool.page_id_bytes
    stamps: dict = {"free": time.perf_counter()}
    pool.free(ids)
    stamps["free_returned"] = time.perf_counter()
    deadline = stamps["free"] + timeout_s
    while time.perf_counter() < deadline:
        held = pool.stats()["held_bytes"]
        now = time.perf_counter()
        if "first_release" not in stamps and held < before["held_bytes"]:
            stamps["first_release"] = now
        if held <= before["held_bytes"] - freed_bytes:
            stamps.setdefault("first_release", now)
            stamps["released"] = now
            stamps["held_bytes_after"] = held
            break
        time.sleep(POLL_S)
    return stamps


def worker(conn: Any, device: str, layout: str, zero_backing: bool, capacity_bytes: int, name: str) -> None:
    """One of the two processes: obeys ("hold", n), ("wait", n, retry_s), ("free",), ("stop",)."""
    try:
        pool = _pool(device, layout, zero_backing, capacity_bytes, name)
        held = None
        conn.send(("ready", pool.stats()))
        while True:
            command = conn.recv()
            if command[0] == "hold":
                held = _hold(pool, command[1])
                conn.send(("held", pool.stats()))
            elif command[0] == "wait":
                result = _wait_and_alloc(pool, command[1], command[2], conn)
                held = result.pop("ids")
                conn.send(("got", result))
            elif command[0] == "free":
                stamps = _free_and_watch(pool, held)
                held = None
                conn.send(("freed", stamps))
            else:
                break
        pool.close()
        conn.send(("stopped", None))
    except BaseException as exc:  # report, never hang the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _expect(conn: Any, kind: str, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no '{kind}' within {timeout_s} s")
    got, payload = conn.recv()
    if got != kind:
        raise RuntimeError(f"expected '{kind}', got '{got}': {payload}")
    return payload


def run_config(
    device: str,
    layout: str,
    zero_backing: bool,
    size_bytes: int,
    handovers: int,
    retry_s: float,
    timeout_s: float,
    warmup: int = 1,
) -> dict:
    from kvcached.registry import registry_for

    page_id_bytes = NUM_LAYERS * NUM_BUFFERS * PAGE_BYTES
    blocks = size_bytes // (NUM_LAYERS * NUM_BUFFERS * BLOCK_BYTES)
    registry_dir = tempfile.mkdtemp(prefix="kvcached-handover-")
    os.environ["KVCACHED_REGISTRY_DIR"] = registry_dir  # inherited by the spawned children
    budget = size_bytes + SLACK_PAGE_IDS * page_id_bytes
    registry_for(device, budget_bytes=budget)  # the first user sets the device's budget
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for i in range(2):
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(
            target=worker, args=(child_end, device, layout, zero_backing, 4 * size_bytes, f"handover-{i}")
        )
        proc.start()
        pipes.append(parent_end)
        procs.append(proc)
    records = []
    try:
        for conn in pipes:
            _expect(conn, "ready", timeout_s)
        pipes[0].send(("hold", blocks))
        _expect(pipes[0], "held", timeout_s)
        for i in range(warmup + handovers):
            holder, waiter = pipes[i % 2], pipes[(i + 1) % 2]
            time.sleep(0.1)  # both workers settle (reserve topped up, nothing in flight)
            waiter.send(("wait", blocks, retry_s))
            waiting_since = _expect(waiter, "waiting", timeout_s)
            holder.send(("free",))
            freed = _expect(holder, "freed", timeout_s)
            got = _expect(waiter, "got", timeout_s)
            start = freed["free"]
            record = dict(
                handover=i - warmup,
                warmup=i < warmup,
                waiting_since_ms=(start - waiting_since) * 1e3,
                total_ms=(got["done"] - start) * 1e3,
                refusals=got["refusals"],
                free_call_ms=(freed["free_returned"] - start) * 1e3,
            )
            if "released" in freed:
                record.update(
                    holder_wake_ms=(freed["first_release"] - start) * 1e3,
                    holder_release_ms=(freed["released"] - freed["first_release"]) * 1e3,
                    waiter_tail_ms=(got["done"] - freed["released"]) * 1e3,
                )
            records.append(record)
        for conn in pipes:
            conn.send(("stop",))
            _expect(conn, "stopped", timeout_s)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    import kvcached

    return dict(
        device=device,
        layout=layout,
        zero_backing=zero_backing,
        size_bytes=size_bytes,
        kvcached_from=kvcached.__file__,
        waiter="retry" if retry_s > 0 else "waiting alloc",
        blocks=blocks,
        budget_bytes=budget,
        retry_s=retry_s,
        handovers=records,
        error=error,
        allocations_per_handover=(size_bytes // PAGE_BYTES) if layout == "per_layer" else size_bytes // page_id_bytes,
    )


def nearest_rank(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def summarize(config: dict) -> dict:
    """Percentiles over the measured hand-overs (warm-up ones are reported apart)."""
    rows = [r for r in config["handovers"] if not r.get("warmup")]
    out: dict = {"n": len(rows), "warmup_ms": [r["total_ms"] for r in config["handovers"] if r.get("warmup")]}
    if not rows:
        return out
    totals = [r["total_ms"] for r in rows]
    out.update(p50_ms=statistics.median(totals), p99_ms=nearest_rank(totals, 0.99), max_ms=max(totals))
    for phase in ("holder_wake_ms", "holder_release_ms", "waiter_tail_ms", "free_call_ms"):
        values = [r[phase] for r in rows if phase in r]
        if values:
            out[phase] = statistics.median(values)
    out["refusals_median"] = statistics.median(r["refusals"] for r in rows)
    return out


def markdown(configs: list[dict]) -> str:
    lines = [
        "| device | layout | zero backing | size | allocations moved | waiter | hand-overs | p50 (ms) | p99 (ms) | "
        "max (ms) | holder wake-up | holder release (first to last slice) | waiter after the last slice | "
        "refusals (median) | warm-up (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    f = lambda v: "—" if v is None else f"{v:.3g}" if v < 100 else f"{v:.0f}"  # noqa: E731
    for c in configs:
        s = summarize(c)
        lines.append(
            f"| {c['device']} | {c['layout']} | {'on' if c['zero_backing'] else 'off'} | {c['size_bytes'] / 2**30:g} GiB | "
            f"{c['allocations_per_handover']} | {c.get('waiter', 'retry')} | {s['n']} | {f(s.get('p50_ms'))} | "
            f"{f(s.get('p99_ms'))} | {f(s.get('max_ms'))} | {f(s.get('holder_wake_ms'))} | "
            f"{f(s.get('holder_release_ms'))} | {f(s.get('waiter_tail_ms'))} | {f(s.get('refusals_median'))} | "
            f"{', '.join(f(v) for v in s.get('warmup_ms', [])) or '—'} |"
            + (f" error: {c['error']}" if c.get("error") else "")
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default="1GiB", help="bytes handed over (e.g. 1GiB, 8GiB)")
    parser.add_argument("--handovers", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=1, help="hand-overs first, reported apart")
    parser.add_argument("--layouts", default="contiguous,per_layer")
    parser.add_argument("--zero-backing", default="on,off", help="on, off or on,off")
    parser.add_argument(
        "--retry-ms",
        type=float,
        default=0.0,
        help="0: the waiter makes one waiting alloc(n, timeout_s); > 0: it retries a plain alloc "
        "with this pause in between",
    )
    parser.add_argument("--timeout-s", type=float, default=60.0, help="limit on any one step")
    parser.add_argument("--deadline-s", type=float, default=600.0, help="no new configuration after this long")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from kvcached.registry import parse_bytes

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = []
    deadline = time.monotonic() + args.deadline_s
    for layout in args.layouts.split(","):
        for zero in args.zero_backing.split(","):
            if time.monotonic() > deadline:
                print(f"skipped {layout}, zero backing {zero}: past the deadline", flush=True)
                continue
            config = run_config(
                args.device,
                layout,
                zero == "on",
                parse_bytes(args.size),
                args.handovers,
                args.retry_ms / 1e3,
                args.timeout_s,
                args.warmup,
            )
            config["summary"] = summarize(config)
            configs.append(config)
            print(
                json.dumps(dict(layout=layout, zero_backing=zero, **config["summary"], error=config["error"])),
                flush=True,
            )
            (out / "handover.json").write_text(json.dumps(configs, indent=1))
            (out / "handover.md").write_text(markdown(configs) + "\n")  # a run cut short keeps what it measured
    print(markdown(configs))


if __name__ == "__main__":
    main()
