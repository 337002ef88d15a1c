"""What bench/e2e/serve_sleep.py reports: its statistics, its table and its picture (no engine here).

A round is a dict with ``asleep_ms`` (time to first token of a sleeping model through serve),
``cold_ms`` (a fresh engine's start to its first token), ``awake_ms`` (an awake model through
serve) and whatever else the round recorded; a sample is ``(seconds, budget_bytes, {model:
(weights_bytes, kv_mapped_bytes)})``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, Optional

MiB = 1 << 20
FIGURES = (("asleep_ms", "asleep"), ("cold_ms", "cold start"), ("awake_ms", "awake"))


def spread(values: Sequence[float]) -> dict[str, Optional[float]]:
    """Median, min and max of ``values`` (None each when there are none)."""
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    """``numerator / denominator``, None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def summarize(rounds: Sequence[dict]) -> dict[str, Any]:
    """Each figure's spread over the rounds that have it, and the ratios of the medians: how many
    times a cold start's first token takes a sleeping model's, and a sleeping model's an awake one's."""
    summary: dict[str, Any] = {key: spread([r[key] for r in rounds if r.get(key) is not None]) for key, _ in FIGURES}
    summary["cold_over_asleep"] = ratio(summary["cold_ms"]["median"], summary["asleep_ms"]["median"])
    summary["asleep_over_awake"] = ratio(summary["asleep_ms"]["median"], summary["awake_ms"]["median"])
    summary["rounds"] = len(rounds)
    summary["rounds_with_other_text"] = sum(r.get("same_text") is False for r in rounds)
    return summary


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0f}"


def _times(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}x"


def format_table(levels: dict[int, dict]) -> str:
    """Every round of every level, then each level's medians and ratios, as a plain-text table.

    ``levels`` maps a sleep level to ``{"rounds": [...], "summary": summarize(rounds)}``."""
    header = f"{'level':>5}  {'round':>5}  {'model':8}  {'asleep ms':>9}  {'cold ms':>8}  {'awake ms':>8}  "
    header += f"{'cold/asleep':>11}  {'wake ms':>7}  same text"
    lines = [header, "-" * len(header)]
    for level, result in sorted(levels.items()):
        for r in result["rounds"]:
            lines.append(
                f"{level:>5}  {r['round']:>5}  {r['model']:8}  {_ms(r.get('asleep_ms')):>9}  "
                f"{_ms(r.get('cold_ms')):>8}  {_ms(r.get('awake_ms')):>8}  "
                f"{_times(ratio(r.get('cold_ms'), r.get('asleep_ms'))):>11}  {_ms(r.get('wake_ms')):>7}  "
                f"{'-' if r.get('same_text') is None else ('yes' if r['same_text'] else 'NO')}"
            )
        s = result["summary"]
        lines.append(
            f"{level:>5}  {'med':>5}  {'':8}  {_ms(s['asleep_ms']['median']):>9}  {_ms(s['cold_ms']['median']):>8}  "
            f"{_ms(s['awake_ms']['median']):>8}  {_times(s['cold_over_asleep']):>11}"
        )
    lines.append("")
    for level, result in sorted(levels.items()):
        s = result["summary"]
        line = (
            f"level {level}: time to first token of a sleeping model {_ms(s['asleep_ms']['median'])} ms "
            f"(median of {s['rounds']}; {_ms(s['asleep_ms']['min'])}-{_ms(s['asleep_ms']['max'])}), "
            f"a cold engine start {_ms(s['cold_ms']['median'])} ms ({_times(s['cold_over_asleep'])} as long), "
            f"an awake model {_ms(s['awake_ms']['median'])} ms (asleep is {_times(s['asleep_over_awake'])})"
        )
        if s["rounds_with_other_text"]:
            line += f"; {s['rounds_with_other_text']} round(s) answered other text than the cold engine"
        lines.append(line)
    return "\n".join(lines)


def plot_series(
    samples: Sequence[tuple[float, int, dict[str, tuple[int, int]]]], models: Sequence[str]
) -> dict[str, Any]:
    """The samples as plot series, in MiB and seconds from the first sample: ``t``, ``budget`` and,
    per model, ``weights`` and ``kv`` (0 where a sample lacks the model)."""
    if not samples:
        raise ValueError("no samples to plot: the sampler read nothing")
    start = samples[0][0]
    series: dict[str, Any] = {"t": [t - start for t, _, _ in samples], "budget": [b / MiB for _, b, _ in samples]}
    for model in models:
        series[model] = {
            "weights": [by_model.get(model, (0, 0))[0] / MiB for _, _, by_model in samples],
            "kv": [by_model.get(model, (0, 0))[1] / MiB for _, _, by_model in samples],
        }
    return series


def write_plot(
    path: str,
    samples: Sequence[tuple[float, int, dict[str, tuple[int, int]]]],
    models: Sequence[str],
    requests: Sequence[tuple[str, float, float]] = (),
    title: str = "",
) -> None:
    """Draws each model's weights and KV cache stacked over time, the budget as a line and each
    request (``(model, start, end)``, on the samples' clock) as a bar above them, to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = plot_series(samples, models)
    start = samples[0][0]
    colours = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=120)
    layers, labels, faces, hatches = [], [], [], []
    for k, model in enumerate(models):
        colour = colours[k % len(colours)]
        layers += [series[model]["weights"], series[model]["kv"]]
        labels += [f"{model} weights", f"{model} KV cache"]
        faces += [colour, (*colour[:3], 0.35)]
        hatches += [None, "//"]
    stacks = ax.stackplot(series["t"], *layers, labels=labels, colors=faces, linewidth=0)
    for stack, hatch in zip(stacks, hatches):
        if hatch:
            stack.set_hatch(hatch)
            stack.set_edgecolor("white")
    ax.plot(series["t"], series["budget"], color="black", linestyle="--", linewidth=1.5, label="budget")
    top = max(series["budget"]) * 1.25 if max(series["budget"]) > 0 else 1.0
    lane = top / 1.25 * 0.06
    for model, begin, end in requests:
        k = list(models).index(model)
        ax.broken_barh(
            [(begin - start, max(end - begin, 0.05))],
            (top / 1.25 * 1.04 + k * lane, lane * 0.8),
            color=colours[k % len(colours)],
        )
    ax.set_ylim(0, top / 1.25 * 1.04 + len(models) * lane + lane)
    ax.set_xlim(0, series["t"][-1])
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB of the device budget")
    ax.set_title(title or "kvcached serve: each model's weights and KV cache (bars above: its requests)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


__all__ = ["format_table", "plot_series", "ratio", "spread", "summarize", "write_plot"]
