"""Placement: mapped bytes per used byte, old policy (fullest page first) vs new (fewest pages).

A device-less BlockManager (no memory is mapped; its own page accounting is what is measured)
replays two seeded traces with both policies. After every step the manager gives back every
entirely free page (no reserve: only placement decides what stays mapped), and the step's
mapped and used bytes are recorded. The figure is sum(mapped) / sum(used) over the trace:
how many bytes stay mapped per byte of blocks in use (1.0 would be perfect packing).

* decode: the decode-like trace of test_bench_pool.py (half-sine load up to 48 sequences,
  prompts of 1-8 blocks, one block per sequence per step, each finishing with p = 1/40).
* prefix_cache: requests (Poisson arrivals) with prompts of 8-96 blocks decode 10-60 steps
  and finish; a finished request's blocks stay resident as a prefix-cache entry until the
  cache (3000 blocks) evicts it, least recently finished first — so the runs of a request
  outlive the neighbours they were placed among, as in an engine with prefix caching.

Geometry as elsewhere in bench/: 32 layers, K+V, 2 MiB pages, with 32 KiB blocks (64 per page,
the bench's usual geometry) and 128 KiB blocks (16 per page: runs span more pages).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcached.layout import BlockManagerOptions, KVLayout
from kvcached.pool import BlockManager

NUM_LAYERS, PAGE_BYTES = 32, 2 << 20
BLOCKS_PER_PAGE = (64, 16)
NUM_PAGES = 4096  # never the limit here
SEED = 20240601
POLICIES = ("fullest_first", "fewest_pages")


class Replay:
    """Runs a trace on one policy; the trace calls alloc / free, then end_step()."""

    def __init__(self, placement: str, blocks_per_page: int) -> None:
        self.layout = KVLayout(
            NUM_LAYERS,
            PAGE_BYTES // blocks_per_page,
            NUM_PAGES * blocks_per_page,
            page_bytes=PAGE_BYTES,
            kind="contiguous",
        )
        options = BlockManagerOptions(placement=placement)  # no reserve, no worker
        self.manager = BlockManager(self.layout, options)
        self.mapped_bytes: list[int] = []
        self.used_bytes: list[int] = []

    def alloc(self, n: int) -> np.ndarray:
        return self.manager.alloc(n)

    def free(self, ids) -> None:
        self.manager.free(np.concatenate(ids) if isinstance(ids, list) else ids)

    def end_step(self) -> None:
        self.manager.trim()  # every entirely free page goes back: placement alone decides the rest
        ops = self.manager.take_page_ops()
        if ops:
            self.manager.acknowledge(0, ops.seq)
        s = self.manager.stats()
        self.mapped_bytes.append(s["mapped_bytes"])
        self.used_bytes.append(s["used_bytes"])

    def result(self) -> dict:
        mapped, used = np.asarray(self.mapped_bytes, float), np.asarray(self.used_bytes, float)
        busy = used > 0
        return {
            "mapped_per_used": float(mapped[busy].sum() / used[busy].sum()),
            "mean_mapped_gib": float(mapped.mean() / (1 << 30)),
            "mean_used_gib": float(used.mean() / (1 << 30)),
            "peak_mapped_pages": int(mapped.max() // self.layout.page_id_bytes),
            "peak_used_blocks": int(used.max() // self.layout.block_id_bytes),
            "steps": len(mapped),
        }


def decode_trace(replay: Replay, rng: np.random.Generator) -> None:
    steps, peak, finish_p = 300, 48, 1 / 40
    active: dict[int, list[np.ndarray]] = {}
    next_seq = 0
    for step in range(steps):
        load = math.sin(math.pi * (step + 0.5) / steps)
        for seq in [s for s in active if rng.random() < finish_p]:
            replay.free(active.pop(seq))
        while len(active) < round(peak * load):
            active[next_seq] = [replay.alloc(int(rng.integers(1, 9)))]
            next_seq += 1
        for blocks in active.values():
            blocks.append(replay.alloc(1))
        replay.end_step()
    for seq in list(active):
        replay.free(active.pop(seq))


def prefix_cache_trace(replay: Replay, rng: np.random.Generator) -> None:
    steps, arrivals_per_step, cache_blocks = 800, 0.35, 3000
    active: dict[int, tuple[list[np.ndarray], int]] = {}  # blocks so far, steps left
    cached: list[list[np.ndarray]] = []  # finished requests, oldest first (LRU)
    cached_blocks = 0
    next_seq = 0
    for _ in range(steps):
        for seq in [s for s, (_, left) in active.items() if left == 0]:
            blocks, _ = active.pop(seq)
            cached.append(blocks)  # a finished request stays resident as a prefix-cache entry
            cached_blocks += sum(len(b) for b in blocks)
        while cached_blocks > cache_blocks:  # evict least recently used entries
            oldest = cached.pop(0)
            cached_blocks -= sum(len(b) for b in oldest)
            replay.free(oldest)
        for _ in range(rng.poisson(arrivals_per_step)):
            active[next_seq] = ([replay.alloc(int(rng.integers(8, 97)))], int(rng.integers(10, 61)))
            next_seq += 1
        for seq, (blocks, left) in active.items():
            blocks.append(replay.alloc(1))
            active[seq] = (blocks, left - 1)
        replay.end_step()
    for blocks, _ in active.values():
        replay.free(blocks)
    for blocks in cached:
        replay.free(blocks)


TRACES = {"decode": decode_trace, "prefix_cache": prefix_cache_trace}


@pytest.mark.parametrize("blocks_per_page", BLOCKS_PER_PAGE)
@pytest.mark.parametrize("trace", list(TRACES))
def test_placement(trace, blocks_per_page, record_result):
    """Both policies on the same seeded trace; the new one must not be worse."""
    results = {}
    for policy in POLICIES:
        replay = Replay(policy, blocks_per_page)
        TRACES[trace](replay, np.random.default_rng(SEED))
        assert replay.manager.stats()["used_blocks"] == 0
        results[policy] = replay.result()
        replay.manager.close()
    for policy, r in results.items():
        record_result(f"placement.{trace}", "host", {"policy": policy, "blocks_per_page": blocks_per_page, **r})
        print(
            f"{trace:>12} {blocks_per_page:>2} blocks/page {policy:>13}: mapped/used {r['mapped_per_used']:.3f}  mean mapped "
            f"{r['mean_mapped_gib']:.2f} GiB  mean used {r['mean_used_gib']:.2f} GiB  peak mapped "
            f"{r['peak_mapped_pages']} pages  peak used {r['peak_used_blocks']} blocks"
        )
    assert results["fewest_pages"]["mapped_per_used"] <= results["fullest_first"]["mapped_per_used"] * 1.01
