"""What a page costs on the host backend: map, first write, later write, unmap.

The kernel gives a process memory by faults (and zeroes it): for memfd files
on the first write, one fault per 4 KiB; for anonymous memory and huge pages
when the allocation is created (the cost shows under "map"); unmapping a page
whose allocation is released frees that memory at once. A static KV cache
pays the first touches once at start-up; kvcached pays them whenever it maps
memory it gave back. On a virtual machine whose host takes back the guest's
free 2 MiB blocks (free page reporting), a huge page the guest has not used
lately also pays the host's faults: the first process of a round shows it.
This measures both on a KV space shaped like the one vLLM's CPU build
makes for the end-to-end benchmarks' model (6 layers, K and V in one 128 KiB
block per layer, 2 MiB pages: a page id is 12 MiB), medians over ``--repeats``
pages.

Each case runs in fresh processes, rounds interleaved, for each kind of host
allocation (``KVCACHED_HOST_MEMORY``): anonymous memory allocated at create,
the same in huge pages, and memfd files mapped shared (the default), those
populated in the background as soon as they are mapped (the default,
``KVCACHED_HOST_POPULATE=background``: "populated" is the wait for that
thread after the map, work the caller does not do) or faulted in by the first
write (``on_touch``). Each process binds itself to one CPU first, as vLLM's
CPU worker is bound (the populating thread runs on the others).

    python bench/probes/host_page_cost.py [--repeats 8] [--layers 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import kvcached


def measure(layout_kind: str, layers: int, repeats: int, mode: str) -> dict[str, float]:
    """mode: ``recycled`` (page by page: map, write, unmap, release, so the next page reuses the memory),
    ``fresh`` (every page mapped first: memory the process never had) or ``spare`` (unmapped allocations kept)."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) > 1:
        os.sched_setaffinity(0, {min(cpus)})  # as a CPU engine's worker: the other CPUs are spare
    layout = kvcached.KVLayout.from_config(
        layers, 128 << 10, kind=layout_kind, num_buffers=1, capacity_bytes=4 << 30, device="cpu"
    )
    space = kvcached.KVSpace(layout, "cpu", kvcached.KVSpaceOptions(max_spare_pages=repeats if mode == "spare" else 0))
    import torch

    flat = torch.from_dlpack(space.tensor())
    page_bytes = space.page_id_bytes
    times: dict[str, list[float]] = {"map": [], "populated": [], "first write": [], "second write": [], "unmap": []}

    def timed(name: str, call, *args) -> None:
        start = time.perf_counter()
        call(*args)
        times[name].append((time.perf_counter() - start) * 1e3)

    def targets(page: int) -> list:
        if layout_kind == "contiguous":
            return [flat.narrow(0, space.offset_of(0, 0, page * space.blocks_per_page), page_bytes)]
        return [
            flat.narrow(0, space.offset_of(layer, 0, page * space.blocks_per_page), layout.page_bytes)
            for layer in range(layers)
        ]

    pages = range(1, repeats + 1)
    for page in pages if mode == "fresh" else ():
        timed("map", space.map_pages, [page])
        timed("populated", kvcached._core.wait_for_host_population)
    for page in pages:
        if mode != "fresh":
            timed("map", space.map_pages, [page])
            timed("populated", kvcached._core.wait_for_host_population)
        timed("first write", lambda: [t.fill_(1) for t in targets(page)])
        timed("second write", lambda: [t.fill_(2) for t in targets(page)])
        if mode != "fresh":
            timed("unmap", space.unmap_pages, [page])
    for page in pages if mode == "fresh" else ():
        timed("unmap", space.unmap_pages, [page])
    space.close()
    return {name: statistics.median(values) for name, values in times.items()} | {"page_mib": page_bytes / 2**20}


MEMORIES = {  # name: (KVCACHED_HOST_MEMORY, KVCACHED_HOST_POPULATE)
    "anonymous": ("anonymous", "background"),
    "huge_pages": ("huge_pages", "background"),
    "shared_files": ("shared_files", "background"),
    "shared_files, on_touch": ("shared_files", "on_touch"),
}
MODES = {"fresh": "fresh memory", "recycled": "released and created again", "spare": "kept as spares"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per case, cases interleaved")
    parser.add_argument("--one", nargs=2, metavar=("LAYOUT", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a child: one case, JSON out
        print(json.dumps(measure(args.one[0], args.layers, args.repeats, args.one[1])))
        return
    cases = [(kind, mode, memory) for kind in ("contiguous", "per_layer") for mode in MODES for memory in MEMORIES]
    runs: dict[tuple, list[dict]] = {case: [] for case in cases}
    for round_index in range(args.rounds):
        for kind, mode, memory in cases if round_index % 2 == 0 else cases[::-1]:
            env = dict(os.environ, KVCACHED_HOST_MEMORY=MEMORIES[memory][0], KVCACHED_HOST_POPULATE=MEMORIES[memory][1])
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    kind,
                    mode,
                    "--repeats",
                    str(args.repeats),
                    "--layers",
                    str(args.layers),
                ],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs[(kind, mode, memory)].append(json.loads(out.strip().splitlines()[-1]))
    print(
        f"host backend, {args.rounds} fresh processes per row (medians over {args.repeats} pages each); "
        "median of the processes in bold, then every process"
    )
    print()
    print(
        "| layout | page id (MiB) | pages | memory | map (ms) | populated, after the map (ms) | first write (ms) "
        "| second write (ms) | unmap (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, mode, memory in cases:
        rows = runs[(kind, mode, memory)]

        def cell(key: str, digits: int = 2) -> str:
            values = [r[key] for r in rows]
            return f"**{statistics.median(values):.{digits}f}** ({', '.join(f'{v:.{digits}f}' for v in values)})"

        print(
            f"| {kind} | {rows[0]['page_mib']:.0f} | {MODES[mode]} | {memory} | "
            f"{cell('map', 3)} | {cell('populated', 3)} | {cell('first write')} | {cell('second write')} | "
            f"{cell('unmap')} |"
        )


if __name__ == "__main__":
    main()
