"""Draws the demo's memory over time: one panel per run, one line per instance."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

MIB = 1 << 20
FIGURE_SIZE_IN = (13, 7.5)
FIGURE_DPI = 110
# Busy phases are tinted in the busy engine's colour, faintly, behind the lines.
PHASE_ALPHA = 0.07
USED_ALPHA = 0.18


def plot_summary(summary: dict[str, Any], path: Union[str, Path]) -> Path:
    """Writes a PNG of memory per instance over time for both runs; returns its path.

    Solid lines: memory each instance's pool has mapped (what the device budget
    counts); shaded: the part its requests' blocks fill. Dashed: the budget;
    dotted: the static cap. Uses matplotlib's Agg backend (no display needed).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    config, traffic = summary["config"], summary["traffic"]
    budget_mib = config["budget_bytes"] / MIB
    colors = pyplot.rcParams["axes.prop_cycle"].by_key()["color"]
    figure, axes = pyplot.subplots(2, 1, figsize=FIGURE_SIZE_IN, sharex=True, sharey=True)
    for axis, run in zip(axes, (summary["runs"]["elastic"], summary["runs"]["static"])):
        samples = run["samples"]
        times = samples["times_s"]
        phase_s, engines = traffic["phase_s"], traffic["num_engines"]
        start = 0.0
        while start < traffic["duration_s"]:
            busy = int(round(start / phase_s)) % engines
            axis.axvspan(
                start,
                min(start + phase_s, traffic["duration_s"]),
                color=colors[busy % len(colors)],
                alpha=PHASE_ALPHA,
                linewidth=0,
            )
            start += phase_s
        for engine, stats in enumerate(run["engines"]):
            color = colors[engine % len(colors)]
            mapped = [value / MIB for value in samples["mapped_bytes"][engine]]
            used = [value / MIB for value in samples["used_bytes"][engine]]
            axis.fill_between(times, used, color=color, alpha=USED_ALPHA, linewidth=0)
            axis.plot(
                times,
                mapped,
                color=color,
                linewidth=1.6,
                label=f"{stats['name']} (peak {stats['peak_mapped_bytes'] / MIB:.0f} MiB)",
            )
        total = [sum(values) / MIB for values in zip(*samples["mapped_bytes"])]
        axis.plot(times, total, color="black", linewidth=0.8, alpha=0.6, label="all instances")
        axis.axhline(budget_mib, color="red", linestyle="--", linewidth=1, label="device budget")
        if run["limit_bytes_per_instance"] is not None:
            axis.axhline(
                run["limit_bytes_per_instance"] / MIB,
                color="gray",
                linestyle=":",
                linewidth=1.2,
                label="static cap per instance",
            )
        totals = run["totals"]
        if run["limit_bytes_per_instance"] is None:
            title = "elastic: every instance draws on one shared budget"
        else:
            title = f"static: budget split equally ({run['limit_bytes_per_instance'] / MIB:.0f} MiB each)"
        axis.set_title(
            f"{title}\n{totals['requests']} requests: {totals['at_once']} admitted at once, "
            f"{totals['delayed']} delayed, {totals['refused']} refused",
            fontsize=10,
        )
        axis.set_ylabel("memory (MiB)")
        axis.set_ylim(0, budget_mib * 1.12)
        axis.grid(alpha=0.3)
        axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    axes[-1].set_xlabel("time in the run (s); tinted bands: which engine is busy")
    figure.suptitle(
        f"kvcached demo: {config['engines']} engines on {config['device']}, same seeded traffic twice "
        f"(line: mapped, shaded: in use by requests)",
        fontsize=11,
    )
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=FIGURE_DPI, bbox_inches="tight")  # keeps the outside legends
    pyplot.close(figure)
    return path


__all__ = ["plot_summary"]
