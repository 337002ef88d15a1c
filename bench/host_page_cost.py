"""What a page costs on the host backend: map, first write, later write, unmap.

Memory mapped fresh is given to the process by the kernel one 4 KiB page at a
time on first touch (a fault, and the page zeroed); unmapping a page whose
allocation is released frees that memory at once. A static KV cache pays the
first touches once at start-up; kvcached pays them whenever it maps memory it
gave back. This measures both on a KV space shaped like the one vLLM's CPU build
makes for the end-to-end benchmarks' model (6 layers, K and V in one 128 KiB
block per layer, 2 MiB pages: a page id is 12 MiB), medians over ``--repeats``
pages.

    python bench/host_page_cost.py [--repeats 8] [--layers 6]
"""

from __future__ import annotations

import argparse
import statistics
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    print("| layout | page id (MiB) | allocation on unmap | map (ms) | first write (ms) | second write (ms) | unmap (ms) |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("contiguous", "per_layer"):
        for keep in (False, True):
            r = measure(kind, args.layers, args.repeats, keep)
            print(f"| {kind} | {r['page_mib']:.0f} | {'kept as a spare' if keep else 'released'} | {r['map']:.3f} | "
                  f"{r['first write']:.2f} | {r['second write']:.2f} | {r['unmap']:.2f} |")


if __name__ == "__main__":
    main()
