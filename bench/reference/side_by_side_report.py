"""Tables for the side-by-side run (side_by_side.py): ratios, driver floors, calls, every round.

python bench/reference/side_by_side_report.py DIR      # reads DIR/raw.jsonl, writes DIR/summary.json, DIR/side_by_side.md
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Optional

from driver_calls import CALLS, FLOOR_CALLS

# (label, metric of the reference, kvcached's metric (case, metric), target ratio, unit)
Row = tuple[str, str, str, tuple[str, str], Optional[float], str]
ROWS: list[Row] = [
    ("set-up", "contiguous", "setup_ms", ("ours_pool", "setup_ms"), 0.1, "ms"),
    ("set-up", "per_layer", "setup_ms", ("ours_pool", "setup_ms"), 0.1, "ms"),
    ("grow 1 page id", "contiguous", "grow_us", ("ours_pool", "grow_us"), 1.0, "µs"),
    ("shrink 1 page id", "contiguous", "shrink_us", ("ours_pool", "shrink_us"), 1.0, "µs"),
    ("grow 64 page ids", "contiguous", "grow64_ms", ("ours_pool", "grow64_ms"), 1.0, "ms"),
    ("shrink 64 page ids", "contiguous", "shrink64_ms", ("ours_pool", "shrink64_ms"), None, "ms"),
    ("grow 1 page id", "per_layer", "grow_us", ("ours_pool", "grow_us"), 0.8, "µs"),
    ("shrink 1 page id", "per_layer", "shrink_us", ("ours_pool", "shrink_us"), 0.8, "µs"),
    ("grow 64 page ids", "per_layer", "grow64_ms", ("ours_pool", "grow64_ms"), 1.0, "ms"),
    ("shrink 64 page ids", "per_layer", "shrink64_ms", ("ours_pool", "shrink64_ms"), None, "ms"),
    ("grow 1, zero chunk not split ahead", "contiguous", "grow_us", ("ours_space", "cold_grow_us"), None, "µs"),
    ("grow 1, zero chunk not split ahead", "per_layer", "grow_us", ("ours_space", "cold_grow_us"), None, "µs"),
]
ALLOC_ROWS = [
    ("alloc(16)+free, KVCacheManager", "ours_alloc_manager", 0.05),
    ("alloc(16)+free, KVPool", "ours_alloc_pool", 0.05),
]
FLOOR_SIZE = {"contiguous": "128mib", "per_layer": "2mib"}


def load(out: Path) -> list[dict]:
    path = out / "raw.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def per_round(entries: list[dict], case: str, layout: Optional[str], metric: str) -> list[float]:
    """The metric's median of each timed (not counted) round, in round order."""
    values = []
    for e in sorted(entries, key=lambda e: e["round"]):
        if e["case"] == case and e.get("layout") == layout and not e.get("counted") and "result" in e:
            value = e["result"].get("medians", {}).get(metric)
            if value is not None:
                values.append(value)
    return values


def counted_calls(entries: list[dict], case: str, layout: Optional[str], metric: str) -> Optional[dict]:
    for e in entries:
        if e["case"] == case and e.get("layout") == layout and e.get("counted") and "result" in e:
            return e["result"].get("calls", {}).get(metric)
    return None


def floors(entries: list[dict]) -> dict[str, dict[str, float]]:
    """bench_vmm p50 per call and page size, median over the rounds of this run."""
    by_size: dict[str, dict[str, list[float]]] = {}
    for e in entries:
        if e["case"] == "bench_vmm" and "result" in e:
            for call, value in e["result"]["p50_us"].items():
                by_size.setdefault(e["layout"], {}).setdefault(call, []).append(value)
    return {size: {c: statistics.median(v) for c, v in calls.items()} for size, calls in by_size.items()}


def floor_us(calls: Optional[dict], per_call: Optional[dict]) -> Optional[float]:
    """Σ calls × bench_vmm p50 (create, map, set_access, unmap, release; zero ones alike).

    set_access and unmap count once per mapping they span: on CUDA one call over N
    mappings costs about N single calls (bench/RESULTS.md, "over N adjacent mappings").
    """
    if not calls or not per_call:
        return None
    total = 0.0
    for call in FLOOR_CALLS:
        for key in (call, call + "_zero"):
            count = calls.get(key + "_mappings", calls.get(key, 0))
            total += count * per_call.get(call, 0.0)
    return total


def calls_text(calls: Optional[dict]) -> str:
    if not calls:
        return "—"
    parts = []
    for call in CALLS:
        for key, label in ((call, call), (call + "_zero", call + "(zero)")):
            if calls.get(key):
                parts.append(f"{label} {calls[key]:g}")
    return " · ".join(parts) or "none"


def fmt(value: Optional[float]) -> str:
    if value is None:
        return "—"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def rounds_text(values: list[float]) -> str:
    if not values:
        return "—"
    return f"**{fmt(statistics.median(values))}** ({', '.join(fmt(v) for v in values)})"


def ratio(ours: list[float], ref: list[float]) -> Optional[float]:
    if not ours or not ref:
        return None
    return statistics.median(ours) / statistics.median(ref)


def with_ratio(values: list[float], ref: list[float]) -> str:
    if not values:
        return "—"
    return f"{fmt(statistics.median(values))} ({fmt(ratio(values, ref))}×)"


def verdict(value: Optional[float], target: Optional[float]) -> str:
    if value is None or target is None:
        return ""
    return "met" if value <= target else "**missed**"


def build(entries: list[dict]) -> tuple[str, dict]:
    floor = floors(entries)
    summary: dict = {"rows": [], "floors_p50_us": floor}
    lines = [
        "| operation | layout | reference | kvcached (pool path) | kvcached ÷ ref. | target | "
        "driver floor of kvcached's calls | of the reference's calls | pool path, no current context (÷ ref.) | "
        "KV space alone (÷ ref.) | no zero backing |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, layout, metric, (case, ours_metric), target, unit in ROWS:
        ref = per_round(entries, "ref_space", layout, metric)
        ours = per_round(entries, case, layout, ours_metric)
        space = per_round(entries, "ours_space", layout, metric)
        nocontext = per_round(entries, "ours_pool_nocontext", layout, metric)
        nozero = per_round(entries, "ours_space_nozero", layout, metric)
        scale = 1e-3 if unit == "ms" else 1.0
        per_call = floor.get(FLOOR_SIZE[layout])
        ours_floor = floor_us(counted_calls(entries, case, layout, ours_metric), per_call)
        ref_floor = floor_us(counted_calls(entries, "ref_space", layout, metric), per_call)
        r = ratio(ours, ref)
        lines.append(
            f"| {label} ({unit}) | {layout} | {rounds_text(ref)} | {rounds_text(ours)} | {fmt(r)}× | "
            f"{'≤ ' + fmt(target) + '× ' + verdict(r, target) if target else '—'} | "
            f"{fmt(ours_floor * scale) if ours_floor is not None else '—'} | "
            f"{fmt(ref_floor * scale) if ref_floor is not None else '—'} | "
            f"{with_ratio(nocontext, ref) if case == 'ours_pool' else '—'} | "
            f"{with_ratio(space, ref) if case == 'ours_pool' else '—'} | "
            f"{fmt(statistics.median(nozero)) if nozero and case == 'ours_pool' else '—'} |"
        )
        summary["rows"].append(
            dict(
                operation=label,
                layout=layout,
                unit=unit,
                reference=ref,
                kvcached=ours,
                ratio=r,
                target=target,
                floor_kvcached=ours_floor,
                floor_reference=ref_floor,
                no_current_context=nocontext,
                space=space,
                no_zero=nozero,
            )
        )
    for label, case, target in ALLOC_ROWS:
        ref = per_round(entries, "ref_alloc", None, "alloc16_free_us")
        ours = per_round(entries, case, None, "alloc16_free_us")
        r = ratio(ours, ref)
        lines.append(
            f"| {label} (µs) | bench_alloc | {rounds_text(ref)} | {rounds_text(ours)} | {fmt(r)}× | "
            f"≤ {fmt(target)}× {verdict(r, target)} | — | — | — | — | — |"
        )
        summary["rows"].append(dict(operation=label, unit="µs", reference=ref, kvcached=ours, ratio=r, target=target))
    text = [
        "## Side by side: kvcached ÷ reference, one run",
        "",
        "Medians over rounds in bold, then every round in order. Floors: driver calls the operation "
        "made (counted round; set_access and unmap once per mapping spanned) × bench_vmm p50 of this run "
        "(2 MiB figures per-layer, 128 MiB contiguous; synchronize, mem_get_info and context calls not "
        "included). The pool path runs with the device's primary context current on the calling thread, "
        "as torch.cuda.set_device leaves it for the reference.",
        "",
        *lines,
        "",
    ]
    text += zero_chunk_section(entries)
    text += calls_section(entries, floor)
    text += every_round_section(entries)
    return "\n".join(text), summary


def zero_chunk_section(entries: list[dict]) -> list[str]:
    """Set-up time by largest zero chunk (KVCACHED_ZERO_CHUNK_BYTES), every round."""
    metrics: dict[str, list[float]] = {}
    for e in sorted(entries, key=lambda e: e["round"]):
        if e["case"] == "ours_setup_zero_chunks" and "result" in e:
            for metric, value in e["result"]["medians"].items():
                metrics.setdefault(metric, []).append(value)
    if not metrics:
        return []
    ref = {layout: per_round(entries, "ref_space", layout, "setup_ms") for layout in ("contiguous", "per_layer")}
    lines = [
        "## Zero-backed set-up by largest zero chunk (KV space alone)",
        "",
        "| layout | largest zero chunk | set-up (ms) | ÷ reference set-up |",
        "|---|---|---|---|",
    ]
    for metric, values in metrics.items():
        layout, chunk_mib = re.fullmatch(r"setup_(contiguous|per_layer)_(\d+)mib_ms", metric).groups()
        chunk = f"{chunk_mib} MiB"
        lines.append(f"| {layout} | {chunk} | {rounds_text(values)} | {fmt(ratio(values, ref[layout]))}× |")
    return lines + [""]


def calls_section(entries: list[dict], floor: dict) -> list[str]:
    lines = [
        "## Driver calls per operation (counted round)",
        "",
        "Driver time and the measured time are medians over the operations of the counted process "
        "(the shim's own cost is a few hundred ns per call); the calls are means per operation.",
        "",
        "| case | layout | operation | calls per operation | inside the driver (µs) | measured (µs) | driver share |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        if not e.get("counted") or "result" not in e:
            continue
        for metric, calls in e["result"].get("calls", {}).items():
            measured = e["result"]["medians"].get(metric)
            scale = 1e3 if metric.endswith("_ms") else 1.0
            total_us = measured * scale if measured is not None else None
            driver = calls.get("driver_us_median", calls["driver_us"])
            share = driver / total_us if total_us else None
            lines.append(
                f"| {e['case']} | {e.get('layout')} | {metric} | {calls_text(calls)} | "
                f"{fmt(driver)} | {fmt(total_us)} | {fmt(share * 100) + ' %' if share else '—'} |"
            )
    if floor:
        lines += [
            "",
            "bench_vmm p50 per call, this run (µs): "
            + "; ".join(
                f"{size}: " + ", ".join(f"{c} {fmt(v)}" for c, v in calls.items()) for size, calls in floor.items()
            ),
        ]
    return lines + [""]


def every_round_section(entries: list[dict]) -> list[str]:
    lines = ["## Every process", "", "| round | case | layout | seconds | medians / error |", "|---|---|---|---|---|"]
    for e in entries:
        if e["case"] == "bench_vmm":
            body = json.dumps(e.get("result", {}).get("p50_us")) if "result" in e else e.get("error")
        elif "result" in e:
            body = ", ".join(f"{k} {fmt(v)}" for k, v in e["result"].get("medians", {}).items())
        else:
            body = f"**{e.get('error')}**"
        lines.append(
            f"| {e['round']} | {e['case']}{' (counted)' if e.get('counted') else ''} | "
            f"{e.get('layout') or ''} | {e.get('seconds', '')} | {body} |"
        )
    return lines + [""]


def write_report(out: Path) -> str:
    """Writes side_by_side.md and summary.json into ``out``; returns the markdown."""
    text, summary = build(load(out))
    (out / "side_by_side.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return text


if __name__ == "__main__":
    print(write_report(Path(sys.argv[1])))
