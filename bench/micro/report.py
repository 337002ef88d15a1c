"""Turn the micro benchmarks' results into markdown tables (a GPU run's dated file in bench/results/).

    python bench/micro/report.py --benchmark-json bench.json [--results custom.json] [--title "NVIDIA H200"]

Reads pytest-benchmark's JSON (``--benchmark-json``) and the custom results the
tests write to ``$KVCACHED_BENCH_RESULTS`` (the decode trace), and prints:
every benchmark per operation with its target and reference figure
(bench/micro/reference_figures.py, the one place they are written), the set_access and
allocation-size comparisons, the layer gather per layout, and the trace.

Targets and reference figures are H200 numbers: verdicts and ratios are given
for GPU rows only; host rows show the figures for information.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from collections.abc import Iterable
from typing import Optional

from reference_figures import figure

US = 1e6  # pytest-benchmark stores seconds


def fmt_time(us: Optional[float]) -> str:
    if us is None:
        return "—"
    if us >= 1_000_000:
        return f"{us / 1e6:.3g} s"
    if us >= 1000:
        return f"{us / 1000:.3g} ms" if us < 100_000 else f"{us / 1000:.0f} ms"
    if us >= 100:
        return f"{us:.0f} µs"
    return f"{us:.3g} µs"


def fmt_ratio(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.3g}×"


def table(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def device_of(bench: dict) -> str:
    params = bench.get("params") or {}
    return params.get("device_spec") or params.get("spec") or "cpu"


def is_gpu(device: str) -> bool:
    return device != "cpu"


def per_op_us(bench: dict, key: str = "median") -> float:
    ops = bench.get("extra_info", {}).get("ops_per_call", 1) or 1
    return bench["stats"][key] * US / ops


def short_name(bench: dict) -> str:
    """Test name without the device in its id: test_setup[zero_backed-contiguous]."""
    name = bench["name"]
    base, _, rest = name.partition("[")
    if not rest:
        return name
    parts = [p for p in rest.rstrip("]").split("-") if p != device_of(bench)]
    return f"{base}[{'-'.join(parts)}]" if parts else base


def natural(text: str) -> list:
    """Sort key putting test_x[8] before test_x[32]."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def load_benchmarks(paths: list[str]) -> tuple[list[dict], dict]:
    benches: list[dict] = []
    machine: dict = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        benches.extend(data.get("benchmarks", []))
        machine = machine or {**data.get("machine_info", {}), "datetime": data.get("datetime")}
    return benches, machine


# ---- sections ------------------------------------------------------------------------------


def main_table(benches: list[dict]) -> str:
    rows = []

    def order(b: dict) -> tuple:
        return (b["fullname"].split("::")[0], b.get("group") or "", device_of(b), natural(b["name"]))

    for b in sorted(benches, key=order):
        if b["extra_info"].get("metric", "").startswith("pool.gather"):
            continue  # its own table
        dev = device_of(b)
        fig = figure(b["extra_info"].get("metric", ""))
        median, best = per_op_us(b), per_op_us(b, "min")
        ops = b["extra_info"].get("ops_per_call", 1)
        ratio = verdict = "—"
        if is_gpu(dev):
            if fig.reference_us:
                ratio = fmt_ratio(median / fig.reference_us)
            if fig.target_us is not None:
                verdict = "yes" if median <= fig.target_us else "**no**"
        rows.append(
            [
                short_name(b) + (f" (per op, /{ops})" if ops != 1 else ""),
                dev,
                fmt_time(median),
                fmt_time(best),
                b["stats"]["rounds"],
                fmt_time(fig.target_us),
                fmt_time(fig.reference_us) + (f" ({fig.reference})" if fig.reference else ""),
                ratio,
                verdict,
            ]
        )
    return table(
        ["benchmark", "device", "median", "min", "rounds", "target", "reference", "ours / ref.", "meets target"],
        rows,
    )


def span_table(benches: list[dict]) -> str:
    """One set_access (or unmap) over N adjacent mappings vs N calls."""
    found = defaultdict(dict)
    for b in benches:
        metric = b["extra_info"].get("metric", "")
        if not (metric.startswith("vmm.set_access_span") or metric.startswith("vmm.unmap_span")):
            continue
        op, backing, calls = metric[len("vmm.") :].split(".")
        key = (device_of(b), op.replace("_span", ""), backing, b["extra_info"]["mappings"])
        found[key][calls] = per_op_us(b)
    rows = []
    for (dev, op, backing, n), v in sorted(found.items()):
        one, each = v.get("one_call"), v.get("per_mapping")
        rows.append(
            [
                dev,
                op,
                backing.replace("_", " "),
                n,
                fmt_time(one),
                fmt_time(each),
                fmt_time(one / n if one else None),
                fmt_ratio(each / one if one and each else None),
            ]
        )
    return table(
        ["device", "call", "backing", "mappings N", "one call over N", "N calls", "one call / N", "N calls ÷ one call"],
        rows,
    )


def size_table(benches: list[dict]) -> str:
    """create+map+access and unmap+release by allocation size, relative to 2 MiB."""
    found = defaultdict(dict)
    for b in benches:
        metric = b["extra_info"].get("metric", "")
        for kind in ("grow", "shrink"):
            prefix = f"vmm.{kind}_alloc_"
            if metric.startswith(prefix):
                found[(device_of(b), kind)][int(metric[len(prefix) : -3])] = per_op_us(b)
    rows = []
    for (dev, kind), by_size in sorted(found.items()):
        base = by_size.get(2)
        for size in sorted(by_size):
            rows.append(
                [
                    dev,
                    "create+map+access" if kind == "grow" else "unmap+release",
                    f"{size} MiB",
                    fmt_time(by_size[size]),
                    fmt_ratio(by_size[size] / base if base else None),
                ]
            )
    return table(["device", "operation", "allocation", "median", "vs 2 MiB"], rows)


def gather_table(benches: list[dict]) -> str:
    found = defaultdict(dict)
    for b in benches:
        info = b["extra_info"]
        if not info.get("metric", "").startswith("pool.gather"):
            continue
        found[(device_of(b), info["blocks"])][info["layout"]] = (per_op_us(b), info["bytes"])
    rows = []
    for (dev, n), v in sorted(found.items()):
        cont, per = v.get("contiguous"), v.get("per_layer")
        cells = []
        for entry in (cont, per):
            cells += [
                fmt_time(entry[0]) if entry else "—",
                f"{entry[1] / (entry[0] * 1e3):.1f}" if entry else "—",
            ]  # bytes/µs/1e3 = GB/s
        ratio = fmt_ratio(cont[0] / per[0]) if cont and per else "—"
        rows.append([dev, n, *cells, ratio])
    return table(["device", "blocks", "contiguous", "GB/s", "per_layer", "GB/s", "contiguous ÷ per_layer"], rows)


def trace_table(results: list[dict]) -> str:
    p99_target = figure("trace.alloc_p99").target_us
    idle_target = figure("trace.idle_to_min_reserve").target_us
    rows = []
    for r in results:
        if r.get("name") != "decode_trace":
            continue
        dev = r["device"]
        meets = "—"
        if is_gpu(dev):
            meets = "yes" if r["alloc_p99_us"] <= p99_target else "**no**"
        to_min = r.get("idle_to_min_reserve_ms")
        rows.append(
            [
                dev,
                r["layout"],
                r["allocs"],
                r["misses"],
                fmt_time(r["alloc_p50_us"]),
                fmt_time(r["alloc_p99_us"]),
                fmt_time(r["alloc_p999_us"]),
                fmt_time(r["alloc_max_us"]),
                meets,
                fmt_time(r.get("within_step_p99_us")),
                fmt_time(r.get("first_in_step_p50_us")),
                f"{r['samples_over_bound']}/{r['samples']} (max +{r['max_pages_over_bound']})",
                f"{r['peak_used_blocks']} / {r['peak_mapped_pages']}",
                fmt_time(r["idle_to_max_reserve_ms"] * 1000 if r["idle_to_max_reserve_ms"] is not None else None),
                fmt_time(to_min * 1000)
                if to_min is not None
                else f"not reached ({r['idle_free_pages_at_end']} free pages left)",
            ]
        )
    header = [
        "device",
        "layout",
        "allocs",
        "misses",
        "p50",
        f"p99 (target ≤ {fmt_time(p99_target)})",
        "p99.9",
        "max",
        "meets p99",
        "p99 within a step",
        "p50 first of a step",
        "samples mapped > used + max reserve",
        "peak used blocks / mapped page ids",
        "idle → ≤ max reserve",
        f"idle → min reserve (target ≤ {fmt_time(idle_target)})",
    ]
    return table(header, rows)


def render(benches: list[dict], machine: dict, results: list[dict], title: str) -> str:
    out = [f"### {title}", ""]
    if machine:
        cpu = machine.get("cpu", {}).get("brand_raw", machine.get("processor", ""))
        out.append(
            f"pytest-benchmark run {machine.get('datetime', '?')} on `{machine.get('node', '?')}` "
            f"({cpu}), Python {machine.get('python_version', '?')}."
        )
        out.append("")
    out.append(
        "Times are per operation: a benchmark timing a batch is divided by the operations in it "
        "(`/N`). Targets and references are H200 figures from bench/micro/reference_figures.py; the verdict and ratio "
        "columns are filled for GPU rows only."
    )
    sections = [
        ("All benchmarks", main_table(benches) if benches else ""),
        ("set_access / unmap over N adjacent 2 MiB mappings", span_table(benches)),
        ("One allocation by size (cost follows allocations, not bytes)", size_table(benches)),
        ("Gather of random 32 KiB blocks of one layer (bf16 index_select), by layout", gather_table(benches)),
        ("Decode-like trace with the background worker", trace_table(results)),
    ]
    for heading, body in sections:
        if body and body.count("\n") > 1:
            out += ["", f"#### {heading}", "", body]
    trace = [r for r in results if r.get("name") == "decode_trace"]
    if trace:
        r = trace[0]
        out += [
            "",
            f"Trace: seed {r['seed']}, {r['steps']} steps of {r['step_ms']:g} ms, reserve "
            f"{r['min_reserve_pages']}..{r['max_reserve_pages']} page ids; `misses` counts allocs "
            "that found too few mapped free blocks and had to map pages themselves.",
        ]
    return "\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmark-json", action="append", default=[], help="pytest-benchmark JSON (repeatable)")
    parser.add_argument("--results", action="append", default=[], help="custom results JSON (repeatable)")
    parser.add_argument("--title", default="Results")
    args = parser.parse_args(argv)
    benches, machine = load_benchmarks([p for p in args.benchmark_json if os.path.exists(p)])
    results: list[dict] = []
    for path in args.results:
        if os.path.exists(path):
            with open(path) as f:
                results.extend(json.load(f).get("results", []))
    if not benches and not results:
        print("no results found in the given files", file=sys.stderr)
        return 1
    sys.stdout.write(render(benches, machine, results, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
