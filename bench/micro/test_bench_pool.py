"""KV pools: set-up, growing and shrinking page ids, the block allocator, a
decode-like trace with the background worker, and reading one layer's blocks.

Geometry (the targets' in reference_figures.py): 32 layers, K and V (2 buffers), 32 KiB blocks,
2 MiB pages, 128 GiB of virtual space = 1024 page ids of 128 MiB each. The host
runs the same geometry: its reservation is PROT_NONE address space, and only the
physical pages a test maps count against the host backend's capacity.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from conftest import PAGE_BYTES, GiB, KiB, describe, is_gpu, time_each
from kvcached import config
from kvcached.layout import KVLayout, KVSpaceOptions
from kvcached.pool import KVPool, KVSpace

NUM_LAYERS = 32
NUM_BUFFERS = 2
BLOCK_BYTES = 32 * KiB
CAPACITY_BYTES = 128 * GiB
LAYOUTS = ("contiguous", "per_layer")

# Rounds per benchmark, chosen so the whole GPU suite stays within a few minutes.
ROUNDS_SETUP = {False: 20, True: 8}  # by zero_backing
ROUNDS_GROW = 16
ROUNDS_GROW64 = 5
ROUNDS_FAST, ITERATIONS_FAST = 200, 50  # alloc/free and available(): sub-microsecond to microseconds


KV_LAYOUTS = {
    kind: KVLayout.from_config(
        NUM_LAYERS,
        BLOCK_BYTES,
        num_buffers=NUM_BUFFERS,
        kind=kind,
        page_bytes=PAGE_BYTES,
        capacity_bytes=CAPACITY_BYTES,
    )
    for kind in LAYOUTS
}


def make_space(device_spec: str, layout: str, *, zero_backing: bool = True, max_spare_pages: int = 0) -> KVSpace:
    options = KVSpaceOptions(
        zero_backing=zero_backing, zero_chunk_bytes=config.get("zero_chunk_bytes"), max_spare_pages=max_spare_pages
    )
    return KVSpace(KV_LAYOUTS[layout], device_spec, options)


def make_pool(device_spec: str, layout: str, *, background_worker: bool) -> KVPool:
    # Reserve sizes left to the configuration (KVCACHED_MIN/MAX_RESERVE_PAGES), recorded in results.
    return KVPool(
        NUM_LAYERS,
        BLOCK_BYTES,
        NUM_BUFFERS,
        capacity_bytes=CAPACITY_BYTES,
        layout=layout,
        page_bytes=PAGE_BYTES,
        device=device_spec,
        zero_backing=True,
        background_worker=background_worker,
    )


def spread_pages(num_pages: int, count: int = 32):
    """Page ids far apart, cycling: each lands in a zero-backing chunk no earlier round split."""
    step = num_pages // count
    return itertools.cycle(range(0, step * count, step))


@pytest.fixture
def spaces():
    """Collects the KV spaces a test makes and closes them, so host capacity is never exceeded."""
    made: list[KVSpace] = []
    yield made
    for space in made:
        space.close()


# ---- set-up ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("zero_backing", [False, True], ids=["reserve_only", "zero_backed"])
def test_setup(benchmark, device_spec, layout, zero_backing):
    """Reserving 128 GiB laid out for 32 layers x K+V; with zero backing, covering it with zeros."""
    kind = "setup_zero" if zero_backing else "setup_reserve"
    describe(
        benchmark,
        f"pool.{kind}.{layout}",
        group="pool: set-up, 128 GiB virtual",
        layout=layout,
        zero_backing=zero_backing,
    )
    time_each(
        benchmark,
        lambda: make_space(device_spec, layout, zero_backing=zero_backing),
        undo=lambda space: space.close(),
        rounds=ROUNDS_SETUP[zero_backing],
    )


# ---- growing and shrinking page ids ----------------------------------------------------------


# "ahead": the page's zero chunks were split beforehand, as a pool's worker does
# for the next page ids it will grow; "on_grow": the grow splits a coarse zero
# chunk itself (a page far from anything mapped: the worst case).
ZERO_SPLITS = ("ahead", "on_grow")


def page_source(space: KVSpace, zero_split: str, num_pages: int):
    pages = spread_pages(num_pages)

    def next_page() -> tuple:
        page = next(pages)
        if zero_split == "ahead":
            space.prepare_pages([page])
        return ([page],)

    return next_page


@pytest.mark.parametrize("zero_split", ZERO_SPLITS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grow_cold(benchmark, device_spec, layout, zero_split, spaces):
    """map_pages of one page id with no spares: allocations created on the spot, zeros swapped out."""
    describe(benchmark, f"pool.grow_cold.{layout}.{zero_split}", group="pool: grow one page id", layout=layout)
    space = make_space(device_spec, layout, max_spare_pages=0)
    spaces.append(space)
    time_each(
        benchmark,
        space.map_pages,
        prepare=page_source(space, zero_split, space.num_pages),
        undo=lambda _, p: space.unmap_pages(p),
        rounds=ROUNDS_GROW,
    )


@pytest.mark.parametrize("zero_backing", (True, False))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grow_warm(benchmark, device_spec, layout, zero_backing, spaces):
    """map_pages of one page id whose allocations were created earlier (a spare).

    The spare is made by mapping and unmapping a page id outside the measured
    ones (KVSpace keeps up to max_spare_pages unmapped allocations); each round's
    unmap returns it to the spares, and the set-up checks one is there.
    """
    zeros = "zero_backed" if zero_backing else "no_zero_backing"
    describe(benchmark, f"pool.grow_warm.{layout}.{zeros}", group="pool: grow one page id", layout=layout)
    space = make_space(device_spec, layout, zero_backing=zero_backing, max_spare_pages=1)
    spaces.append(space)
    spare_source = [space.num_pages - 1]
    space.map_pages(spare_source)
    space.unmap_pages(spare_source)
    next_page = page_source(space, "ahead", space.num_pages - 1)

    def prepare():
        assert space.spare_pages == 1
        return next_page()

    time_each(benchmark, space.map_pages, prepare=prepare, undo=lambda _, p: space.unmap_pages(p), rounds=ROUNDS_GROW)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shrink(benchmark, device_spec, layout, spaces):
    """unmap_pages of one page id (device synchronised first; allocations released, zeros put back)."""
    describe(benchmark, f"pool.shrink.{layout}", group="pool: shrink one page id", layout=layout)
    space = make_space(device_spec, layout, max_spare_pages=0)
    spaces.append(space)
    pages = spread_pages(space.num_pages)

    def prepare():
        page = [next(pages)]
        space.map_pages(page)
        return (page,)

    time_each(benchmark, space.unmap_pages, prepare=prepare, rounds=ROUNDS_GROW)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grow_64_pages(benchmark, device_spec, layout, spaces):
    """map_pages of 64 page ids (8 GiB) in one call, cold; each round uses page ids no earlier round used."""
    describe(benchmark, f"pool.grow64.{layout}", group="pool: grow 64 page ids in one call", layout=layout, pages=64)
    space = make_space(device_spec, layout, max_spare_pages=0)
    spaces.append(space)
    batches = itertools.cycle([list(range(i, i + 64)) for i in range(0, space.num_pages, 64)])
    time_each(
        benchmark,
        space.map_pages,
        prepare=lambda: (next(batches),),
        undo=lambda _, p: space.unmap_pages(p),
        rounds=ROUNDS_GROW64,
        warmup_rounds=1,
    )


# ---- the block allocator ---------------------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["no_worker", "worker"])
def warm_pool(request, device_spec):
    """A pool whose first page id is mapped and free, so alloc never needs the driver."""
    pool = make_pool(device_spec, "contiguous", background_worker=request.param)
    pool.free(pool.alloc(16))
    yield pool
    pool.close()


def test_alloc16_free(benchmark, warm_pool):
    """alloc(16) then free of those ids, from mapped pages (one timed iteration does both)."""
    describe(benchmark, "pool.alloc16_free", group="pool: block allocator")
    pool = warm_pool

    def alloc_free():
        pool.free(pool.alloc(16))

    benchmark.pedantic(alloc_free, rounds=ROUNDS_FAST, iterations=ITERATIONS_FAST, warmup_rounds=5)
    assert pool.stats()["used_blocks"] == 0


def test_available(benchmark, warm_pool):
    describe(benchmark, "pool.available", group="pool: block allocator")
    benchmark.pedantic(warm_pool.available, rounds=ROUNDS_FAST, iterations=ITERATIONS_FAST, warmup_rounds=5)


# ---- decode-like trace with the background worker --------------------------------------------

TRACE_SEED = 20240601
TRACE_STEPS = 300  # scheduler steps
TRACE_STEP_SECONDS = 0.010  # pacing: one step every 10 ms (a step adds one 16-token block per sequence)
TRACE_MAX_ACTIVE = 48  # running sequences at the peak of the load
TRACE_FINISH_P = 1 / 40  # chance per step that a sequence finishes
TRACE_PROMPT_BLOCKS = (1, 8)  # prompt size in blocks, uniform, inclusive
TRACE_SAMPLE_EVERY = 5  # steps between stats() samples
IDLE_WAIT_SECONDS = 1.5  # longest wait for the reserve to settle after the trace


def percentile_us(latencies_ns: np.ndarray, q: float) -> float:
    return float(np.percentile(latencies_ns, q)) / 1000.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_trace(device_spec, layout, record_result):
    """Sequences arrive following a half-sine load (0 -> peak -> 0), each adds one
    block per step and finishes at random; every alloc is timed.

    The first alloc of a step follows a 10 ms pause and runs with cold caches
    (on a 2-core VM any call does: ~25 us for np.empty); its latencies are
    also reported apart from those within a step.

    Checks while running (sampled): mapped page ids <= page ids in use + the
    largest reserve. After the last sequence ends: how long until the worker
    brings the mapped free page ids back to the reserve bounds.
    """
    min_reserve, max_reserve = config.get("min_reserve_pages"), config.get("max_reserve_pages")
    rng = np.random.default_rng(TRACE_SEED)
    pool = make_pool(device_spec, layout, background_worker=True)
    try:
        time.sleep(0.1)  # let the worker fill the minimum reserve, as a serving engine would at start-up
        latencies_ns: list[int] = []
        first_in_step: list[bool] = []  # the first alloc after the pause between steps runs cold
        misses = 0  # allocs that found too few mapped free blocks (had to map pages themselves)
        samples: list[dict] = []
        active: dict[int, list[np.ndarray]] = {}
        next_seq = 0

        def alloc(n: int) -> np.ndarray:
            nonlocal misses
            if pool.free_mapped_blocks() < n:
                misses += 1
            start = time.perf_counter_ns()
            ids = pool.alloc(n)
            latencies_ns.append(time.perf_counter_ns() - start)
            first_in_step.append(len(latencies_ns) == step_start + 1)
            return ids

        tick = time.perf_counter()
        for step in range(TRACE_STEPS):
            load = math.sin(math.pi * (step + 0.5) / TRACE_STEPS)
            step_start = len(latencies_ns)
            for seq in [s for s in active if rng.random() < TRACE_FINISH_P]:
                pool.free(np.concatenate(active.pop(seq)))
            while len(active) < round(TRACE_MAX_ACTIVE * load):
                active[next_seq] = [alloc(int(rng.integers(TRACE_PROMPT_BLOCKS[0], TRACE_PROMPT_BLOCKS[1] + 1)))]
                next_seq += 1
            for blocks in active.values():
                blocks.append(alloc(1))
            if step % TRACE_SAMPLE_EVERY == 0:
                s = pool.stats()
                samples.append({k: s[k] for k in ("used_blocks", "used_pages", "mapped_pages", "spare_pages")})
            tick += TRACE_STEP_SECONDS
            time.sleep(max(0.0, tick - time.perf_counter()))

        for seq in list(active):
            pool.free(np.concatenate(active.pop(seq)))
        idle_start = time.perf_counter()
        to_max = to_min = None
        while time.perf_counter() - idle_start < IDLE_WAIT_SECONDS:
            free_pages = pool.stats()["free_pages"]
            elapsed_ms = (time.perf_counter() - idle_start) * 1000.0
            if to_max is None and free_pages <= max_reserve:
                to_max = elapsed_ms
            if free_pages <= min_reserve:
                to_min = elapsed_ms
                break
            time.sleep(0.001)
        final = pool.stats()
    finally:
        pool.close()

    lat = np.asarray(latencies_ns, dtype=np.float64)
    first = np.asarray(first_in_step)
    excess = [s["mapped_pages"] - (s["used_pages"] + max_reserve) for s in samples]
    result = {
        "layout": layout,
        "seed": TRACE_SEED,
        "steps": TRACE_STEPS,
        "step_ms": TRACE_STEP_SECONDS * 1000,
        "min_reserve_pages": min_reserve,
        "max_reserve_pages": max_reserve,
        "allocs": int(lat.size),
        "sequences": next_seq,
        "misses": misses,
        "alloc_p50_us": percentile_us(lat, 50),
        "alloc_p99_us": percentile_us(lat, 99),
        "alloc_p999_us": percentile_us(lat, 99.9),
        "alloc_max_us": float(lat.max()) / 1000.0,
        "first_in_step_p50_us": percentile_us(lat[first], 50),
        "first_in_step_p99_us": percentile_us(lat[first], 99),
        "within_step_p99_us": percentile_us(lat[~first], 99),
        "peak_used_blocks": max(s["used_blocks"] for s in samples),
        "peak_mapped_pages": max(s["mapped_pages"] for s in samples),
        "samples": len(samples),
        "samples_over_bound": sum(1 for e in excess if e > 0),
        "max_pages_over_bound": max(0, max(excess)),
        "idle_to_max_reserve_ms": to_max,
        "idle_to_min_reserve_ms": to_min,
        "idle_free_pages_at_end": final["free_pages"],
        "stats_samples": samples,
    }
    record_result("decode_trace", device_spec, result)


# ---- reading one layer's blocks --------------------------------------------------------------

GATHER_COUNTS = {"cpu": (512, 4096), "gpu": (512, 2048, 16384)}
GATHER_ROUNDS = {"cpu": 5, "gpu": 20}


class LayerView:
    """Layer 0's K blocks of a KV space, as a (blocks, elements) bf16 tensor view."""

    _current: LayerView | None = None  # one at a time: the host's capacity holds one mapped space

    def __init__(self, device_spec: str, layout: str, num_blocks: int) -> None:
        import torch

        self.key = (device_spec, layout, num_blocks)
        self.space = make_space(device_spec, layout)
        self.space.map_pages(list(range(num_blocks // self.space.blocks_per_page)))
        flat = torch.from_dlpack(self.space.tensor()).view(torch.bfloat16)
        elem = flat.element_size()
        self.blocks = flat.as_strided(
            (num_blocks, BLOCK_BYTES // elem),
            (self.space.block_stride_bytes // elem, 1),
            self.space.offset_of(0, 0, 0) // elem,
        )
        self.blocks.fill_(1.0)
        del flat

    @classmethod
    def get(cls, device_spec: str, layout: str, num_blocks: int) -> LayerView:
        key = (device_spec, layout, num_blocks)
        if cls._current is None or cls._current.key != key:
            cls.drop()
            cls._current = cls(device_spec, layout, num_blocks)
        return cls._current

    @classmethod
    def drop(cls) -> None:
        if cls._current is not None:
            current, cls._current = cls._current, None
            del current.blocks
            current.space.close()


@pytest.fixture(scope="module", autouse=True)
def _drop_layer_views():
    yield
    LayerView.drop()


def gather_params():
    from conftest import available_device_specs

    for spec in available_device_specs():
        kind = "gpu" if is_gpu(spec) else "cpu"
        for layout in LAYOUTS:
            for count in GATHER_COUNTS[kind]:
                yield pytest.param(spec, layout, count, id=f"{spec}-{layout}-{count}")


@pytest.mark.parametrize("spec,layout,count", list(gather_params()))
def test_gather_layer_blocks(benchmark, spec, layout, count):
    """index_select of `count` random 32 KiB blocks of one layer (a permutation of the mapped ones)."""
    torch = pytest.importorskip("torch")
    kind = "gpu" if is_gpu(spec) else "cpu"
    view = LayerView.get(spec, layout, max(GATHER_COUNTS[kind]))
    describe(
        benchmark,
        f"pool.gather.{layout}",
        group=f"pool: gather {count} random blocks of one layer",
        layout=layout,
        blocks=count,
        bytes=count * BLOCK_BYTES,
    )
    generator = torch.Generator().manual_seed(count)
    index = torch.randperm(view.blocks.shape[0], generator=generator)[:count].to(view.blocks.device)
    out = torch.empty((count, view.blocks.shape[1]), dtype=view.blocks.dtype, device=view.blocks.device)
    sync = torch.cuda.synchronize if view.blocks.device.type == "cuda" else (lambda: None)

    def gather():
        torch.index_select(view.blocks, 0, index, out=out)
        sync()

    benchmark.pedantic(gather, rounds=GATHER_ROUNDS[kind], iterations=1, warmup_rounds=2)
    assert bool((out[0] == 1.0).all())
