"""One measurement of the side-by-side benchmark, run in a fresh process (see side_by_side.py).

Both kvcached and the reference implementation are packages called ``kvcached``;
the parent picks one per process with ``PYTHONPATH`` and runs

    python bench/reference/side_by_side_ops.py CASE '{"layout": "contiguous", ...}'

which prints one line ``RESULT {json}``. Every timed operation is also recorded
(``samples``), and when the driver-call counter is preloaded
(``bench/reference/driver_calls.py``) each operation's driver calls are summarised per operation.

Geometry (the targets', bench/micro/reference_figures.py): 32 layers, K and V, 2 MiB pages, 128 GiB virtual, zero-backed.
A page id is one 128 MiB compound page (contiguous) or 64 allocations of 2 MiB
(per-layer). The reference's allocator benchmark uses its ``bench_alloc`` geometry.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Callable, Optional

from driver_calls import CallRecorder, summarize

NUM_LAYERS = 32
NUM_BUFFERS = 2
PAGE_BYTES = 2 << 20
CAPACITY_BYTES = 128 << 30
BLOCK_BYTES = 32 << 10  # 64 blocks per page id
NUM_PAGE_PAIRS = 40  # grow one page id, then shrink it back, this many times
BATCH_PAGES = 64  # "grow 64 page ids in one call"
BATCH_REPEATS = 3  # grow 64 then shrink 64, this many times per process (one sample each is noisy)
COLD_PAGES = 6  # grows of page ids whose zero chunks were not split ahead (GPU)
# The reference's benchmarks/bench_alloc geometry, and (k, iterations) of alloc(k)+free.
ALLOC_GEOMETRY = dict(num_blocks=65536, block_size=16, cell_size=1024, num_layers=16)
ALLOC_LOOPS = ((1, 20000), (16, 20000), (64, 5000))


class Recorder:
    """Times operations; with the driver-call counter preloaded, also counts their calls."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}
        self.calls: dict[str, list] = {}
        self.driver_us: dict[str, list[float]] = {}  # per operation, with the counter
        self._counter = CallRecorder.attach()

    def time(self, name: str, operation: Callable[[], object], scale: float = 1e6) -> object:
        mark = self._counter.mark() if self._counter else 0
        start = time.perf_counter()
        result = operation()
        elapsed = time.perf_counter() - start
        self.samples.setdefault(name, []).append(elapsed * scale)
        if self._counter:
            events = self._counter.since(mark)
            self.calls.setdefault(name, []).extend(events)
            self.driver_us.setdefault(name, []).append(sum(e.driver_ns for e in events) / 1e3)
        return result

    def result(self, **extra: object) -> dict:
        out: dict = {"medians": {k: round(statistics.median(v), 3) for k, v in self.samples.items()}}
        out["samples"] = {k: [round(x, 3) for x in v] for k, v in self.samples.items()}
        if self._counter:
            out["calls"] = {k: summarize(v, len(self.samples[k])) for k, v in self.calls.items()}
            for name, values in self.driver_us.items():
                out["calls"][name]["driver_us_median"] = round(statistics.median(values), 2)
        out.update(extra)
        return out


def _stride_pages(num_pages: int, count: int) -> list[int]:
    """``count`` page ids spread over the space (so none shares a zero chunk with another)."""
    step = num_pages // (count + 1)
    return [step * (i + 1) for i in range(count)]


# --------------------------------------------------------------------------- reference


def ref_space(layout: str) -> dict:
    """The reference's ``vmm_ops``: set-up, grow / shrink one page id, grow 64 at once."""
    import torch

    from kvcached import vmm_ops

    contiguous = layout == "contiguous"
    torch.cuda.set_device(0)  # the reference reaches its context through torch
    rec = Recorder()

    def setup() -> None:
        vmm_ops.init_kvcached("cuda:0", 0, contiguous)
        vmm_ops.create_kv_tensors(CAPACITY_BYTES // NUM_LAYERS, 2, "cuda:0", NUM_LAYERS, NUM_BUFFERS, 0, False)
        torch.cuda.synchronize()

    rec.time("setup_ms", setup, scale=1e3)
    stride = PAGE_BYTES * (NUM_LAYERS * NUM_BUFFERS if contiguous else 1)
    for page in range(NUM_PAGE_PAIRS):
        rec.time("grow_us", lambda: vmm_ops.map_to_kv_tensors([page * stride], 0))
        rec.time("shrink_us", lambda: vmm_ops.unmap_from_kv_tensors([page * stride], 0))
    batch = [p * stride for p in range(BATCH_PAGES)]
    for _ in range(BATCH_REPEATS):
        rec.time("grow64_ms", lambda: vmm_ops.map_to_kv_tensors(batch, 0), scale=1e3)
        rec.time("shrink64_ms", lambda: vmm_ops.unmap_from_kv_tensors(batch, 0), scale=1e3)
    vmm_ops.shutdown_kvcached()
    return rec.result()


def _alloc_loops(manager: object) -> dict:
    rec = Recorder()
    for k, iterations in ALLOC_LOOPS:
        for _ in range(100):  # warm-up
            manager.free(manager.alloc(k))

        def loop() -> None:
            for _ in range(iterations):
                manager.free(manager.alloc(k))

        rec.time(f"alloc{k}_free_us", loop, scale=1e6 / iterations)
    return rec.result()


def ref_alloc() -> dict:
    """The reference's ``KVCacheManager`` in its ``bench_alloc`` geometry."""
    import torch

    from kvcached.integration.vllm.interfaces import alloc_kv_cache, init_kvcached, shutdown_kvcached
    from kvcached.kv_cache_manager import KVCacheManager
    from kvcached.vmm_ops import kv_tensors_created

    geometry = ALLOC_GEOMETRY
    torch.cuda.set_device(0)
    init_kvcached(tp_rank=0, world_size=1, is_worker=True, async_sched=False)
    alloc_kv_cache(
        kvcache_shape=(2, geometry["num_blocks"], geometry["block_size"], 8, 64),
        block_size=geometry["block_size"],
        dtype=torch.float16,
        device="cuda:0",
        num_layers=geometry["num_layers"],
    )
    deadline = time.time() + 30
    while not kv_tensors_created():
        if time.time() > deadline:
            raise RuntimeError("the reference did not create its KV tensors within 30 s")
        time.sleep(0.02)
    manager = KVCacheManager(world_size=1, **geometry)
    result = _alloc_loops(manager)
    shutdown_kvcached()
    return result


# --------------------------------------------------------------------------- kvcached


def _open(device: str, current_context: bool = True):
    """Opens the device outside the timing. With ``current_context`` its primary
    context is also made current on this thread, as ``torch.cuda.set_device`` does
    for the reference (and as it is on any engine's thread that has used CUDA)."""
    from kvcached.devices import open_device

    dev = open_device(device)
    if current_context and device.startswith("cuda:"):
        _make_primary_context_current(int(device.split(":")[1]))
    return dev


def _make_primary_context_current(ordinal: int) -> None:
    import ctypes

    driver = ctypes.CDLL("libcuda.so.1")
    handle, context = ctypes.c_int(), ctypes.c_void_p()
    for call, args in (
        ("cuDeviceGet", (ctypes.byref(handle), ordinal)),
        ("cuDevicePrimaryCtxRetain", (ctypes.byref(context), handle)),
        ("cuCtxSetCurrent", (context,)),
    ):
        code = getattr(driver, call)(*args)
        if code != 0:
            raise RuntimeError(f"{call} failed with CUresult {code}")


def ours_pool(layout: str, device: str, current_context: bool = True) -> dict:
    """kvcached the way a pool runs: ``KVPool.alloc`` maps the lowest unmapped page id,
    ``free`` + ``maintain`` (one round of the background worker's reserve keeping) unmaps it.

    Reserve targets are 0 so that each timed call does the mapping itself; between
    timed calls the worker's round runs untimed: ``maintain()`` (spares kept by the last
    round beyond the maximum are released, the minimum is pre-created) and
    ``prepare_ahead()`` (zero chunks of the next page ids split ahead of use). Spare
    allocations follow the defaults. ``grow_zero_splits``: zero chunks split on the
    timed grows (0 when the look-ahead kept up).
    """
    from kvcached.pool import KVPool
    from kvcached.registry import registry_for

    dev = _open(device, current_context)
    registry_for(dev.name)  # the device's registry exists before the timing (first user makes it)
    rec = Recorder()
    pool = rec.time(
        "setup_ms",
        lambda: KVPool(
            NUM_LAYERS,
            BLOCK_BYTES,
            NUM_BUFFERS,
            capacity_bytes=CAPACITY_BYTES,
            layout=layout,
            page_bytes=PAGE_BYTES,
            device=dev,
            zero_backing=True,
            min_reserve_pages=0,
            max_reserve_pages=0,
            background_worker=False,
        ),
        scale=1e3,
    )
    per_page = pool.space.blocks_per_page
    splits = 0

    def worker_round() -> None:  # untimed, as the background worker does between operations
        pool.maintain()
        pool.prepare_ahead()

    def timed_grow(name: str, blocks: int, scale: float = 1e6) -> object:
        nonlocal splits
        before = pool.space.zero_splits_on_map  # read outside the timed call
        ids = rec.time(name, lambda: pool.alloc(blocks), scale=scale)
        splits += pool.space.zero_splits_on_map - before
        return ids

    for _ in range(NUM_PAGE_PAIRS):
        worker_round()
        ids = timed_grow("grow_us", per_page)
        rec.time("shrink_us", lambda: (pool.free(ids), pool.maintain()))
    for _ in range(BATCH_REPEATS):
        worker_round()
        mapped_before = pool.stats()["mapped_pages"]
        ids = timed_grow("grow64_ms", BATCH_PAGES * per_page, scale=1e3)
        grown = pool.stats()["mapped_pages"] - mapped_before
        rec.time("shrink64_ms", lambda: (pool.free(ids), pool.maintain()), scale=1e3)
        left = pool.stats()["mapped_pages"]
        if grown != BATCH_PAGES or left != 0:
            pool.close()
            raise RuntimeError(f"pool grew {grown} page ids for {BATCH_PAGES}, {left} left mapped")
    pool.close()
    from kvcached import config

    return rec.result(
        max_spare_pages=config.get("max_spare_pages"),
        min_spare_pages=config.get("min_spare_pages"),
        zero_frontier_pages=config.get("zero_frontier_pages"),
        grow_zero_splits=splits,
    )


def _layout(kind: str, dev) -> kvcached.KVLayout:  # noqa: F821 (imported per function: two packages share the name)
    """The benchmark geometry as kvcached's one layout value."""
    from kvcached.layout import KVLayout

    return KVLayout.from_config(
        NUM_LAYERS,
        BLOCK_BYTES,
        num_buffers=NUM_BUFFERS,
        kind=kind,
        page_bytes=PAGE_BYTES,
        capacity_bytes=CAPACITY_BYTES,
        device=dev,
    )


def ours_space(layout: str, device: str, zero_backing: bool) -> dict:
    """kvcached's KV space alone (no block manager, no spares): the same driver work as
    the reference per grow. Zero-backed: each page id's zero chunks are split ahead
    (``prepare_pages``, untimed), and ``cold_grow`` maps page ids whose chunks were not."""
    from kvcached.layout import KVSpaceOptions
    from kvcached.pool import KVSpace

    dev = _open(device)
    rec = Recorder()
    space = rec.time(
        "setup_ms",
        lambda: KVSpace(_layout(layout, dev), dev, KVSpaceOptions(zero_backing=zero_backing, max_spare_pages=0)),
        scale=1e3,
    )
    spread = _stride_pages(space.num_pages, NUM_PAGE_PAIRS + BATCH_PAGES + COLD_PAGES)
    pairs, batch = spread[:NUM_PAGE_PAIRS], spread[NUM_PAGE_PAIRS : NUM_PAGE_PAIRS + BATCH_PAGES]
    for page in pairs:
        space.prepare_pages([page])
        rec.time("grow_us", lambda: space.map_pages([page]))
        rec.time("shrink_us", lambda: space.unmap_pages([page]))
    for _ in range(BATCH_REPEATS):
        space.prepare_pages(batch)
        rec.time("grow64_ms", lambda: space.map_pages(batch), scale=1e3)
        rec.time("shrink64_ms", lambda: space.unmap_pages(batch), scale=1e3)
    if zero_backing:
        for page in spread[NUM_PAGE_PAIRS + BATCH_PAGES :]:
            rec.time("cold_grow_us", lambda: space.map_pages([page]))
            space.unmap_pages([page])
    space.close()
    return rec.result()


ZERO_CHUNK_SIZES = (256 << 20, 1 << 30, 2 << 30)


def ours_setup_zero_chunks(device: str) -> dict:
    """Zero-backed set-up of both layouts with larger zero chunks (``KVCACHED_ZERO_CHUNK_BYTES``):
    fewer zero mappings to grant access to, at the price of larger zero allocations."""
    from kvcached.layout import KVSpaceOptions
    from kvcached.pool import KVSpace

    dev = _open(device)
    rec = Recorder()
    for chunk in ZERO_CHUNK_SIZES:
        for layout in ("contiguous", "per_layer"):
            space = rec.time(
                f"setup_{layout}_{chunk >> 20}mib_ms",
                lambda: KVSpace(
                    _layout(layout, dev),
                    dev,
                    KVSpaceOptions(zero_backing=True, zero_chunk_bytes=chunk, max_spare_pages=0),
                ),
                scale=1e3,
            )
            space.close()
            del space
    return rec.result()


def ours_alloc(kind: str, device: str) -> dict:
    """``alloc(k)+free`` in the reference's bench_alloc geometry: the KVCacheManager
    facade (reference-compatible names) or the KVPool underneath it."""
    import kvcached
    from kvcached.pool import KVPool

    g = ALLOC_GEOMETRY
    _open(device)
    if kind == "manager":
        manager = kvcached.KVCacheManager(device=device, **g)
    else:
        manager = KVPool(
            g["num_layers"], g["block_size"] * g["cell_size"], 2, num_blocks=g["num_blocks"], device=device
        )
    try:
        return _alloc_loops(manager)
    finally:
        manager.close()


CASES: dict[str, Callable[..., dict]] = {
    "ref_space": lambda a: ref_space(a["layout"]),
    "ref_alloc": lambda a: ref_alloc(),
    "ours_pool": lambda a: ours_pool(a["layout"], a["device"]),
    "ours_pool_nocontext": lambda a: ours_pool(a["layout"], a["device"], current_context=False),
    "ours_space": lambda a: ours_space(a["layout"], a["device"], zero_backing=True),
    "ours_space_nozero": lambda a: ours_space(a["layout"], a["device"], zero_backing=False),
    "ours_setup_zero_chunks": lambda a: ours_setup_zero_chunks(a["device"]),
    "ours_alloc_manager": lambda a: ours_alloc("manager", a["device"]),
    "ours_alloc_pool": lambda a: ours_alloc("pool", a["device"]),
}


def main(argv: Optional[list[str]] = None) -> None:
    argv = argv if argv is not None else sys.argv[1:]
    case, args = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    expected = args.get("expect_site")
    if expected:
        # An editable install of another copy hooks sys.meta_path ahead of PYTHONPATH.
        sys.meta_path[:] = [
            f for f in sys.meta_path if not type(f).__module__.startswith(("_editable", "__editable__"))
        ]
    import kvcached

    where = os.path.realpath(kvcached.__file__)
    if expected and not where.startswith(os.path.realpath(expected)):
        raise RuntimeError(f"imported kvcached from {where}, expected it under {expected}")
    result = CASES[case](args)
    result["kvcached_from"] = where
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
