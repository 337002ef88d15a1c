"""What a page costs on the host backend: map, first write, later write, unmap.

Memory mapped fresh is given to the process by the kernel on first touch (a
fault, and the memory zeroed): one fault per 2 MiB where transparent huge pages
apply to the host backend's anonymous allocations, one per 4 KiB otherwise;
unmapping a page whose allocation is released frees that memory at once. A
static KV cache pays the first touches once at start-up; kvcached pays them
whenever it maps memory it gave back. On a virtual machine whose host backs
guest memory lazily (free page reporting), memory the guest gave back pays the
host's faults as well: expect runs in two modes there. This measures both on a KV space shaped like the one vLLM's CPU build
makes for the end-to-end benchmarks' model (6 layers, K and V in one 128 KiB
block per layer, 2 MiB pages: a page id is 12 MiB), medians over ``--repeats``
pages.

Each case runs in fresh processes, rounds interleaved, with the host backend's
allocations as anonymous memory (the default) and as memfd files mapped shared
(``KVCACHED_HOST_SHARED_FILES=1``, the backend before huge pages).

    python bench/host_page_cost.py [--repeats 8] [--layers 6] [--rounds 3]
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


def measure(layout_kind: str, layers: int, repeats: int, keep_spares: bool) -> dict[str, float]:
    layout = kvcached.KVLayout(layers, 128 << 10, kind=layout_kind, num_buffers=1, capacity_bytes=4 << 30,
                               device="cpu")
    space = kvcached.KVSpace(layout, "cpu", kvcached.KVSpaceOptions(max_spare_pages=repeats if keep_spares else 0))
    import torch

    flat = torch.from_dlpack(space.tensor())
    page_bytes = space.page_id_bytes
    times: dict[str, list[float]] = {"map": [], "first write": [], "second write": [], "unmap": []}

    def timed(name: str, call, *args) -> None:
        start = time.perf_counter()
        call(*args)
        times[name].append((time.perf_counter() - start) * 1e3)

    for page in range(1, repeats + 1):
        timed("map", space.map_pages, [page])
        region = flat.narrow(0, space.offset_of(0, 0, page * space.blocks_per_page), page_bytes) \
            if layout_kind == "contiguous" else None
        targets = [region] if region is not None else [
            flat.narrow(0, space.offset_of(layer, buffer, page * space.blocks_per_page), layout.page_bytes)
            for layer in range(layers) for buffer in range(1)]
        timed("first write", lambda: [t.fill_(1) for t in targets])
        timed("second write", lambda: [t.fill_(2) for t in targets])
        timed("unmap", space.unmap_pages, [page])
    space.close()
    return {name: statistics.median(values) for name, values in times.items()} | {"page_mib": page_bytes / 2**20}


MEMORIES = {"anonymous": "0", "shared files": "1"}  # KVCACHED_HOST_SHARED_FILES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per case, cases interleaved")
    parser.add_argument("--one", nargs=2, metavar=("LAYOUT", "KEEP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a child: one case, JSON out
        print(json.dumps(measure(args.one[0], args.layers, args.repeats, args.one[1] == "1")))
        return
    cases = [(kind, keep, memory) for kind in ("contiguous", "per_layer") for keep in (False, True) for memory in MEMORIES]
    runs: dict[tuple, list[dict]] = {case: [] for case in cases}
    for round_index in range(args.rounds):
        for kind, keep, memory in cases if round_index % 2 == 0 else cases[::-1]:
            env = dict(os.environ, KVCACHED_HOST_SHARED_FILES=MEMORIES[memory])
            out = subprocess.run([sys.executable, __file__, "--one", kind, str(int(keep)), "--repeats",
                                  str(args.repeats), "--layers", str(args.layers)],
                                 env=env, check=True, capture_output=True, text=True).stdout
            runs[(kind, keep, memory)].append(json.loads(out.strip().splitlines()[-1]))
    print(f"host backend, {args.rounds} fresh processes per row (medians over {args.repeats} pages each); "
          "median of the processes in bold, then every process")
    print()
    print("| layout | page id (MiB) | allocation on unmap | memory | map (ms) | first write (ms) | second write (ms) "
          "| unmap (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, keep, memory in cases:
        rows = runs[(kind, keep, memory)]

        def cell(key: str, digits: int = 2) -> str:
            values = [r[key] for r in rows]
            return f"**{statistics.median(values):.{digits}f}** ({', '.join(f'{v:.{digits}f}' for v in values)})"

        print(f"| {kind} | {rows[0]['page_mib']:.0f} | {'kept as a spare' if keep else 'released'} | {memory} | "
              f"{cell('map', 3)} | {cell('first write')} | {cell('second write')} | {cell('unmap')} |")


if __name__ == "__main__":
    main()
