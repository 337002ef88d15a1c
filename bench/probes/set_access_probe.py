"""Does a page's set_access cost depend on what was mapped at its address before, or where it lies?

The per-layer grow of 64 page ids makes the same driver calls in kvcached and in
the reference, yet kvcached's set_access calls took longer inside the driver (37
vs 29 µs on an H200). This probe times map + set_access of 2 MiB pages on one
device, in one process, rounds interleaved, varying one thing at a time.

What was there before (pages in runs of 64 consecutive slots):

* ``fresh``: address range never mapped;
* ``after_run_zero``: one zero mapping over the run unmapped just before (what
  kvcached's split-ahead zero pieces lead to);
* ``after_run_zero_settled``: the same, with a synchronize and 100 ms between the
  unmap and the maps;
* ``after_page_zeros``: a 2 MiB zero mapping per page, each unmapped right before
  its page is mapped (what the reference does).

Where the pages lie (fresh ranges): ``spread_page_major`` maps one page in each of
64 regions 2 GiB apart, then the next page in each (a per-layer page id: one slot
per layer and K/V, in kvcached's order); ``spread_region_major`` maps the same
pages region by region; ``spread_create_inline`` is ``spread_page_major`` with each
step's 64 allocations created at the start of the step (as kvcached's pool does
when it has no spares) instead of all before.

With ``--cover GIB`` it instead measures the floor of a zero-backed set-up: one
zero allocation of each chunk size mapped over and over until ``GIB`` GiB of
address space are covered, and set_access on each mapping (the cheapest cover
is the one with the fewest, largest mappings; the largest chunk that fits on the
device is the bound).

    python bench/probes/set_access_probe.py --device cuda:0 [--runs 16] [--rounds 3] [--json OUT]
    python bench/probes/set_access_probe.py --device cuda:0 --cover 128 [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import kvcached

PAGE = 2 << 20
PAGES_PER_RUN = 64
REGION = 2 << 30
VARIANTS = (
    "fresh",
    "after_run_zero",
    "after_run_zero_settled",
    "after_page_zeros",
    "spread_page_major",
    "spread_region_major",
    "spread_create_inline",
)


def timed(samples: list[float], call, *args) -> None:
    start = time.perf_counter()
    call(*args)
    samples.append((time.perf_counter() - start) * 1e6)


def addresses(variant: str, base: int, runs: int) -> list[list[int]]:
    """The pages' addresses in mapping order, in steps (a run; a per-layer page id; a region)."""
    if variant in ("spread_page_major", "spread_create_inline"):
        return [[base + p * REGION + r * PAGE for p in range(PAGES_PER_RUN)] for r in range(runs)]
    if variant == "spread_region_major":
        return [[base + p * REGION + r * PAGE for r in range(runs)] for p in range(PAGES_PER_RUN)]
    return [[base + r * PAGES_PER_RUN * PAGE + p * PAGE for p in range(PAGES_PER_RUN)] for r in range(runs)]


def one_variant(device, variant: str, runs: int) -> dict:
    """Maps ``runs`` x 64 pages after ``variant``'s predecessor / in its places; per-call times in µs."""
    run_bytes = PAGE * PAGES_PER_RUN
    spread = variant.startswith("spread")
    reservation = device.reserve(REGION * PAGES_PER_RUN if spread else run_bytes * runs)
    steps = addresses(variant, reservation.address, runs)
    run_zero = device.create(run_bytes) if variant.startswith("after_run_zero") else None
    page_zero = device.create(PAGE) if variant == "after_page_zeros" else None
    inline = variant == "spread_create_inline"
    pages = [] if inline else [device.create(PAGE) for _ in range(runs * PAGES_PER_RUN)]
    for step in steps:  # the predecessors, all in place before anything is timed
        if run_zero is not None:
            device.map_accessible(step[0], run_zero)
        for address in step if page_zero is not None else ():
            device.map_accessible(address, page_zero)
    device.synchronize()
    times: dict[str, list[float]] = {"create": [], "unmap_zero": [], "map": [], "set_access": []}
    step_total = []
    backing = iter(pages)
    for step in steps:
        begin = time.perf_counter()
        if inline:
            for _ in step:
                start = time.perf_counter()
                pages.append(device.create(PAGE))
                times["create"].append((time.perf_counter() - start) * 1e6)
            backing = iter(pages[-len(step) :])
        if run_zero is not None:
            timed(times["unmap_zero"], device.unmap, step[0], run_bytes)
            if variant == "after_run_zero_settled":
                device.synchronize()
                time.sleep(0.1)
                begin = time.perf_counter()
        for address in step:
            if page_zero is not None:
                timed(times["unmap_zero"], device.unmap, address, PAGE)
            timed(times["map"], device.map, address, next(backing))
            timed(times["set_access"], device.set_access, address, PAGE)
        step_total.append((time.perf_counter() - begin) * 1e3)
    for step in steps:
        for address in step:
            device.unmap(address, PAGE)
    del pages, run_zero, page_zero, reservation  # released (RAII) before the next variant
    result = {f"{k}_p50_us": statistics.median(v) for k, v in times.items() if v}
    result.update({f"{k}_p90_us": statistics.quantiles(v, n=10)[-1] for k, v in times.items() if len(v) > 1})
    result["per_64_pages_ms"] = sum(step_total) / runs  # runs x 64 pages in all
    return result


def one_cover(device, total_bytes: int, chunk_bytes: int) -> dict:
    """Covers ``total_bytes`` with mappings of one ``chunk_bytes`` allocation; times in ms."""
    start = time.perf_counter()
    reservation = device.reserve(total_bytes)
    reserved = time.perf_counter()
    try:
        chunk = device.create(chunk_bytes)
    except kvcached.DeviceOutOfMemoryError:
        del reservation
        return {"chunk_gib": chunk_bytes / 2**30, "error": "out of memory"}
    created = time.perf_counter()
    starts = range(reservation.address, reservation.address + total_bytes, chunk_bytes)
    map_s = access_s = 0.0
    for address in starts:
        t0 = time.perf_counter()
        device.map(address, chunk)
        t1 = time.perf_counter()
        device.set_access(address, chunk_bytes)
        access_s += time.perf_counter() - t1
        map_s += t1 - t0
    device.synchronize()
    total = (time.perf_counter() - start) - (created - reserved)  # creation is not part of a set-up's floor
    for address in starts:
        device.unmap(address, chunk_bytes)
    del chunk, reservation
    return {
        "chunk_gib": chunk_bytes / 2**30,
        "mappings": len(starts),
        "reserve_ms": (reserved - start) * 1e3,
        "map_ms": map_s * 1e3,
        "set_access_ms": access_s * 1e3,
        "total_ms": total * 1e3,
        "set_access_per_mapping_us": access_s * 1e6 / len(starts),
    }


def cover_main(device, cover_gib: int, rounds: int, json_path: str | None) -> None:
    total = cover_gib << 30
    chunks = [c << 20 for c in (256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072) if (c << 20) <= total]
    rows = []
    for round_index in range(rounds):
        order = chunks[::-1] if round_index % 2 else chunks
        for chunk in order:
            rows.append(dict(round=round_index, **one_cover(device, total, chunk)))
            print(json.dumps(rows[-1]), flush=True)
    print(
        f"\n{device.name}: {cover_gib} GiB of address space covered by one zero allocation of each size "
        "(map + set_access per mapping, reserve included, creation not); medians over rounds "
        "(every round in brackets)\n"
    )
    print(
        "| chunk (GiB) | mappings | set_access per mapping (µs) | map, all (ms) | set_access, all (ms) | total (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for chunk in chunks:
        mine = [r for r in rows if r["chunk_gib"] == chunk / 2**30 and "error" not in r]
        if not mine:
            print(f"| {chunk / 2**30:g} | — | out of memory | | | |")
            continue

        def cell(key: str) -> str:
            values = [r[key] for r in mine]
            return f"**{statistics.median(values):.2f}** ({', '.join(f'{v:.2f}' for v in values)})"

        print(
            f"| {chunk / 2**30:g} | {mine[0]['mappings']} | {cell('set_access_per_mapping_us')} | "
            f"{cell('map_ms')} | {cell('set_access_ms')} | {cell('total_ms')} |"
        )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--runs", type=int, default=16, help="steps of 64 pages per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--cover", type=int, metavar="GIB", help="measure the zero-backed set-up floor instead")
    args = parser.parse_args()
    device = kvcached.open_device(args.device)
    if args.cover:
        cover_main(device, args.cover, args.rounds, args.json)
        return
    rows = []
    for round_index in range(args.rounds):
        order = VARIANTS[round_index % len(VARIANTS) :] + VARIANTS[: round_index % len(VARIANTS)]
        for variant in order:
            rows.append(dict(round=round_index, variant=variant, **one_variant(device, variant, args.runs)))
            print(json.dumps(rows[-1]), flush=True)
    print(
        f"\n{device.name}: {args.runs} x {PAGES_PER_RUN} pages of 2 MiB per variant and round; "
        "medians over rounds (every round in brackets)\n"
    )
    print(
        "| variant | set_access p50 (µs) | map p50 (µs) | unmap of the zero mapping p50 (µs) "
        "| per 64 pages, all calls (ms) |"
    )
    print("|---|---|---|---|---|")
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]

        def cell(key: str) -> str:
            values = [r[key] for r in mine if key in r]
            if not values:
                return "—"
            return f"**{statistics.median(values):.1f}** ({', '.join(f'{v:.1f}' for v in values)})"

        print(
            f"| {variant} | {cell('set_access_p50_us')} | {cell('map_p50_us')} | {cell('unmap_zero_p50_us')} "
            f"| {cell('per_64_pages_ms')} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
