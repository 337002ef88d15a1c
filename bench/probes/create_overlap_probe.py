"""Can a grow of many allocations hide its cuMemCreate calls behind the mapping calls?

A grow of 64 contiguous page ids (64 allocations of 128 MiB) makes the same
driver calls in kvcached and in the reference: create, unmap the zero piece,
map, set_access, per allocation. This probe times, in one process with rounds
interleaved, a batch of ``--count`` allocations of ``--mib`` MiB over address
space whose zero pieces (one per allocation, given access) are in place, grown:

* ``inline``: create, unmap zero, map, set_access, one allocation after the other
  (the reference's order);
* ``create_first``: every create first, then unmap zero, map, set_access per
  allocation (kvcached's order for every grow of several page ids);
* ``overlapped``: a second thread creates while this one unmaps, maps and gives
  access as each allocation arrives (driver calls release the GIL);
* ``creates_only_1`` / ``creates_only_2``: the creates alone, on one thread or
  split over two (does cuMemCreate run concurrently at all?).

After each timed batch the allocations are unmapped and released and the zero
pieces put back, untimed.

    python bench/probes/create_overlap_probe.py --device cuda:0 [--mib 128 --count 64] [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time

import kvcached

VARIANTS = ("inline", "create_first", "overlapped", "creates_only_1", "creates_only_2")


def grow(device, variant: str, addresses: list[int], size: int) -> list:
    """One timed batch; returns the allocations (mapped unless only created)."""
    if variant == "creates_only_1":
        return [device.create(size) for _ in addresses]
    if variant == "creates_only_2":
        half = len(addresses) // 2
        other: list = []
        worker = threading.Thread(target=lambda: other.extend(device.create(size) for _ in range(half)))
        worker.start()
        mine = [device.create(size) for _ in range(len(addresses) - half)]
        worker.join()
        return mine + other
    if variant == "inline":
        made = []
        for address in addresses:
            made.append(device.create(size))
            device.unmap(address, size)
            device.map(address, made[-1])
            device.set_access(address, size)
        return made
    if variant == "create_first":
        made = [device.create(size) for _ in addresses]
    else:  # overlapped
        ready: queue.Queue = queue.Queue()
        worker = threading.Thread(target=lambda: [ready.put(device.create(size)) for _ in addresses])
        worker.start()
        made = []
    for i, address in enumerate(addresses):
        if variant == "overlapped":
            made.append(ready.get())
        device.unmap(address, size)
        device.map(address, made[i])
        device.set_access(address, size)
    if variant == "overlapped":
        worker.join()
    return made


def one_round(device, size: int, count: int, round_index: int) -> list[dict]:
    reservation = device.reserve(size * count)
    zero = device.create(size)
    addresses = [reservation.address + i * size for i in range(count)]
    for address in addresses:
        device.map_accessible(address, zero)
    device.synchronize()
    rows = []
    order = VARIANTS[round_index % len(VARIANTS) :] + VARIANTS[: round_index % len(VARIANTS)]
    for variant in order:
        start = time.perf_counter()
        made = grow(device, variant, addresses, size)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        if not variant.startswith("creates_only"):
            device.synchronize()
            for address in addresses:
                device.unmap(address, size)
                device.map_accessible(address, zero)
        del made  # released (RAII)
        device.synchronize()
        rows.append(dict(round=round_index, variant=variant, mib=size >> 20, count=count, ms=elapsed_ms))
        print(json.dumps(rows[-1]), flush=True)
    for address in addresses:
        device.unmap(address, size)
    del zero, reservation
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--mib", type=int, default=128, help="size of one allocation")
    parser.add_argument("--count", type=int, default=64, help="allocations per batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = kvcached.open_device(args.device)
    rows = [row for r in range(args.rounds) for row in one_round(device, args.mib << 20, args.count, r)]
    print(
        f"\n{device.name}: batches of {args.count} allocations of {args.mib} MiB; ms per batch, "
        "median over rounds (every round in brackets)\n"
    )
    print("| variant | ms per batch |")
    print("|---|---|")
    for variant in VARIANTS:
        values = [r["ms"] for r in rows if r["variant"] == variant]
        print(f"| {variant} | **{statistics.median(values):.2f}** ({', '.join(f'{v:.2f}' for v in values)}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
