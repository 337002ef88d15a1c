"""The demo's results: a JSON-ready summary of both runs and its plain-text rendering."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from kvcached.registry import format_bytes

OUTCOMES = ("at_once", "delayed", "refused")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _engine_summary(name: str, result: dict[str, Any], mapped: list[int], used: list[int]) -> dict[str, Any]:
    requests = result["requests"]
    counts = {outcome: sum(r["outcome"] == outcome for r in requests) for outcome in OUTCOMES}
    waits = [r["admitted_s"] - r["arrival_s"] for r in requests if r["outcome"] == "delayed"]
    return {
        "name": name,
        "requests": len(requests),
        **counts,
        # Neither admitted nor refused: only if an engine hit its safety deadline.
        "unserved": len(requests) - sum(counts.values()),
        "mean_wait_s": _mean(waits),
        "max_wait_s": max(waits, default=0.0),
        "completed": sum(r["completed"] for r in requests),
        "preemptions": result["preemptions"],
        "blocks_checked": result["blocks_checked"],
        "data_check_failures": result["data_check_failures"],
        "peak_mapped_bytes": max(mapped, default=0),
        "mean_mapped_bytes": int(_mean(mapped)),
        "peak_used_bytes": max(used, default=0),
        "mean_used_bytes": int(_mean(used)),
        "used_blocks_at_end": result["used_blocks_at_end"],
        "mapped_bytes_after_close": result["mapped_bytes_after_close"],
    }


def _run_summary(record: Any, limit_pages_bytes: Optional[int]) -> dict[str, Any]:
    engines = [
        _engine_summary(f"demo-engine-{index}", result, record.mapped_bytes[index], record.used_bytes[index])
        for index, result in enumerate(record.results)
    ]
    totals: dict[str, Any] = {
        key: sum(engine[key] for engine in engines)
        for key in (
            "requests",
            *OUTCOMES,
            "unserved",
            "completed",
            "preemptions",
            "blocks_checked",
            "data_check_failures",
            "used_blocks_at_end",
            "mapped_bytes_after_close",
        )
    }
    delayed_waits = sum(engine["mean_wait_s"] * engine["delayed"] for engine in engines)
    totals["mean_wait_s"] = delayed_waits / totals["delayed"] if totals["delayed"] else 0.0
    device_mapped = [sum(column) for column in zip(*record.mapped_bytes)]
    return {
        "name": record.name,
        # The cap each pool really had: budget / N rounded down to whole page ids.
        "limit_bytes_per_instance": limit_pages_bytes,
        "wall_s": record.wall_s,
        "totals": totals,
        "peak_device_mapped_bytes": max(device_mapped, default=0),
        "mean_device_mapped_bytes": int(_mean(device_mapped)),
        "registry_mapped_after_bytes": record.registry_mapped_after_bytes,
        "registry_entries_after": record.registry_entries_after,
        "engines": engines,
        "samples": {
            "times_s": [round(t, 3) for t in record.times_s],
            "mapped_bytes": record.mapped_bytes,
            "used_bytes": record.used_bytes,
        },
    }


def summarize(outcome: dict[str, Any]) -> dict[str, Any]:
    """The summary of :func:`kvcached.demo.run.run_demo`'s result, as plain data (JSON-ready)."""
    config, geometry, profile = outcome["config"], outcome["geometry"], outcome["profile"]
    runs = {}
    for record in outcome["runs"]:
        cap = None
        if record.limit_bytes is not None:
            cap = record.limit_bytes // geometry.page_id_bytes * geometry.page_id_bytes
        runs[record.name] = _run_summary(record, cap)
    clean = all(
        run["totals"]["data_check_failures"] == 0
        and run["totals"]["unserved"] == 0
        and run["totals"]["mapped_bytes_after_close"] == 0
        and run["registry_mapped_after_bytes"] == 0
        and run["registry_entries_after"] == 0
        for run in runs.values()
    )
    return {
        "config": dataclasses.asdict(config),
        "geometry": dataclasses.asdict(geometry),
        "traffic": {**dataclasses.asdict(profile), "requests_per_run": runs["elastic"]["totals"]["requests"]},
        "runs": runs,
        "elapsed_s": outcome["elapsed_s"],
        "ok": clean,
    }


def _count_with_wait(totals: dict[str, Any]) -> str:
    if not totals["delayed"]:
        return "0"
    return f"{totals['delayed']} (mean wait {totals['mean_wait_s']:.2f} s)"


def _percent(part: int, whole: int) -> str:
    return f"{part} ({part / whole:.0%})" if whole else str(part)


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a few aligned plain-text tables (fits 100 columns)."""
    config, traffic, runs = summary["config"], summary["traffic"], summary["runs"]
    elastic, static = runs["elastic"], runs["static"]
    budget = config["budget_bytes"]
    lines = [
        f"kvcached demo: {config['engines']} engines on {config['device']}, budget {format_bytes(budget)}, "
        f"{config['duration_s']:g} s per run, seed {config['seed']}",
        f"traffic: {traffic['requests_per_run']} requests per run; the busy engine gets "
        f"{traffic['busy_rate_hz']:.1f} req/s, the others {traffic['idle_rate_hz']:.1f} req/s; "
        f"phases of {traffic['phase_s']:.2f} s",
        f"a request that finds no memory waits up to {config['wait_timeout_s']:g} s, then is refused",
        "",
    ]
    header = ("", "elastic (shared budget)", f"static ({format_bytes(static['limit_bytes_per_instance'])} each)")
    rows = [header]

    def both(label: str, render: Any) -> None:
        rows.append((label, render(elastic), render(static)))

    both("requests", lambda r: str(r["totals"]["requests"]))
    both("admitted at once", lambda r: _percent(r["totals"]["at_once"], r["totals"]["requests"]))
    both("delayed", lambda r: _count_with_wait(r["totals"]))
    both("refused", lambda r: _percent(r["totals"]["refused"], r["totals"]["requests"]))
    both("preempted (recomputed)", lambda r: str(r["totals"]["preemptions"]))
    both(
        "data-check failures",
        lambda r: f"{r['totals']['data_check_failures']} of {r['totals']['blocks_checked']} blocks",
    )
    both(
        "peak / mean device memory",
        lambda r: f"{format_bytes(r['peak_device_mapped_bytes'])} / {format_bytes(r['mean_device_mapped_bytes'])}",
    )
    both(
        "registry after the run",
        lambda r: (
            "0 B mapped, no entries"
            if not r["registry_mapped_after_bytes"] and not r["registry_entries_after"]
            else f"{format_bytes(r['registry_mapped_after_bytes'])} mapped, {r['registry_entries_after']} entries"
        ),
    )
    lines += _table(rows)
    lines.append("")
    rows = [("per instance", "elastic peak / mean", "static peak / mean", "elastic at once/delayed/refused", "static")]
    for mine, theirs in zip(elastic["engines"], static["engines"]):
        rows.append(
            (
                mine["name"],
                f"{format_bytes(mine['peak_mapped_bytes'])} / {format_bytes(mine['mean_mapped_bytes'])}",
                f"{format_bytes(theirs['peak_mapped_bytes'])} / {format_bytes(theirs['mean_mapped_bytes'])}",
                f"{mine['at_once']}/{mine['delayed']}/{mine['refused']}",
                f"{theirs['at_once']}/{theirs['delayed']}/{theirs['refused']}",
            )
        )
    lines += _table(rows)
    lines.append("(memory: bytes mapped by each instance's pool, sampled every 0.1 s from the device registry)")
    verdict = (
        "all data checks passed, every request accounted for, memory back to zero"
        if summary["ok"]
        else "PROBLEM: data-check failures, unaccounted requests or memory left mapped (see above)"
    )
    lines += ["", verdict, f"total time {summary['elapsed_s']:.1f} s"]
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


__all__ = ["format_summary", "summarize"]
