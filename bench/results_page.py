"""Writes bench/RESULTS.md, the page of current figures, from the dated runs in bench/results/.

    python bench/results_page.py            # rewrite bench/RESULTS.md
    python bench/results_page.py --check    # exit 1 if bench/RESULTS.md is not what this writes

Each dated run is ``bench/results/<date>-<topic>.md``: its text as recorded (first heading
``## <title> — <date> <time> UTC``), raw output beside it in ``<date>-<topic>.raw.md`` where it
was split off. A run that measured a tracked target opens with a table of its figures:

    | target | figure | measured (UTC) | command | machine | tree |

one row per target, ``measured`` as ``YYYY-MM-DD HH:MM``. The page shows, for every target, the
latest measurement as the current figure (with its command, machine and tree) and the earlier
ones below it, then every dated run, newest first. To add a run: write its file (figures table
first), run this script, commit both.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
PAGE = BENCH_DIR / "RESULTS.md"

FIGURES_HEADER = ["target", "figure", "measured (UTC)", "command", "machine", "tree"]
MEASURED = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}$")
RUN_NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-[a-z0-9-]+$")

INTRO = """\
# Benchmark results

How to run and what each benchmark does: [`bench/README.md`](README.md). Targets and reference
figures: `bench/micro/reference_figures.py` (the reference implementation's figures were
measured on an H200 with driver 580 / CUDA 13; they are quoted, not re-measured).
All our figures are timed from Python, like the reference's, unless marked C++.

This page is written by `python bench/results_page.py` from the dated runs in
[`results/`](results/); `tests/bench_code/test_results_page.py` fails when it is out of date.
A figure here is the latest measurement of its target; each links the run it comes from, whose
file holds the run's text and raw output as recorded.
"""


@dataclass(frozen=True)
class Figure:
    """One measurement of one target, as a dated run's figures table gives it."""

    target: str
    figure: str
    measured: str
    command: str
    machine: str
    tree: str
    run: str  # the dated run's file name, without .md


@dataclass(frozen=True)
class Run:
    """One dated run: its file name (without .md), title, time and whether raw output sits beside it."""

    name: str
    title: str
    when: str  # "YYYY-MM-DD HH:MM" or "YYYY-MM-DD" where the title gives no time
    has_raw: bool


def split_row(line: str) -> list[str]:
    """The cells of a markdown table row (``\\|`` inside a cell is kept as ``|``)."""
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [cell.strip().replace("\\|", "|") for cell in cells]


def read_figures(name: str, text: str) -> list[Figure]:
    """The figures table at the top of a dated run (none if it has no table)."""
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith("| target |")), None)
    first_heading = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    if start is None or start > first_heading:
        return []
    if split_row(lines[start]) != FIGURES_HEADER:
        raise ValueError(f"{name}.md: the figures table's columns must be {' | '.join(FIGURES_HEADER)}")
    figures = []
    for number, line in enumerate(lines[start + 2 :], start + 3):
        if not line.startswith("|"):
            break
        cells = split_row(line)
        if len(cells) != len(FIGURES_HEADER):
            raise ValueError(f"{name}.md line {number}: {len(cells)} cells, expected {len(FIGURES_HEADER)}")
        target, figure, measured, command, machine, tree = cells
        if not MEASURED.match(measured):
            raise ValueError(f"{name}.md line {number}: measured {measured!r} is not 'YYYY-MM-DD HH:MM'")
        figures.append(Figure(target, figure, measured, command.strip("`"), machine, tree.strip("`"), name))
    return figures


def read_run(path: Path) -> tuple[Run, list[Figure]]:
    """A dated run file: what the page lists about it, and its figures."""
    name = path.stem
    match = RUN_NAME.match(name)
    if not match:
        raise ValueError(f"{path.name}: a dated run is named <YYYY-MM-DD>-<topic>.md (lower case, digits, '-')")
    text = path.read_text()
    title = next((line[3:] for line in text.split("\n") if line.startswith("## ")), None)
    if title is None:
        raise ValueError(f"{path.name}: no '## ' heading naming the run")
    date = match.group(1)
    time = re.search(re.escape(date) + r"\D{0,3}(\d{2}:\d{2})", title)
    when = f"{date} {time.group(1)}" if time else date
    has_raw = (path.parent / f"{name}.raw.md").exists()
    return Run(name, title, when, has_raw), read_figures(name, text)


def read_results(results_dir: Path = RESULTS_DIR) -> tuple[list[Run], list[Figure]]:
    """Every dated run (newest first) and every figure they hold."""
    runs, figures = [], []
    for path in sorted(results_dir.glob("*.md")):
        if path.name.endswith(".raw.md"):
            continue
        run, found = read_run(path)
        runs.append(run)
        figures += found
    runs.sort(key=lambda run: (run.when, run.name), reverse=True)
    return runs, figures


def by_target(figures: list[Figure]) -> dict[str, list[Figure]]:
    """Each target's measurements, latest first (the first is the current figure)."""
    targets: dict[str, list[Figure]] = {}
    for figure in figures:
        targets.setdefault(figure.target, []).append(figure)
    for measurements in targets.values():
        measurements.sort(key=lambda f: (f.measured, f.run), reverse=True)
    return dict(sorted(targets.items(), key=lambda item: item[0].lower()))


def link(run: str) -> str:
    return f"[{run}](results/{run}.md)"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def render(runs: list[Run], figures: list[Figure]) -> str:
    """The whole page."""
    targets = by_target(figures)
    current = [
        [t, f"**{m[0].figure}**", m[0].measured, m[0].machine, f"`{m[0].tree}`", link(m[0].run)]
        for t, m in targets.items()
    ]
    commands = [[t, f"`{m[0].command}`"] for t, m in targets.items()]
    earlier = [[t, f.figure, f.measured, f"`{f.tree}`", link(f.run)] for t, m in targets.items() for f in m[1:]]
    dated = [[r.when, link(r.name), r.title, f"[raw](results/{r.name}.raw.md)" if r.has_raw else ""] for r in runs]
    out = [
        INTRO,
        "## Current figures",
        "",
        "The latest measurement of each target (UTC times; trees are commits of this repository).",
        "",
        table(["target", "current figure", "measured (UTC)", "machine", "tree", "run"], current),
        "",
        "### The commands behind them",
        "",
        (
            "From the repository root; `DIR` / `OUT` a new directory, `REF` the reference's source tarball, "
            "each run's file says in which environment."
        ),
        "",
        table(["target", "command"], commands),
        "",
    ]
    if earlier:
        out += [
            "## Earlier measurements of the same targets",
            "",
            "Superseded by the figures above; kept to show how a figure moved between runs.",
            "",
            table(["target", "figure", "measured (UTC)", "tree", "run"], earlier),
            "",
        ]
    out += [
        "## Every dated run, newest first",
        "",
        table(["when (UTC)", "run", "what it measured", "raw output"], dated),
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if bench/RESULTS.md is out of date")
    args = parser.parse_args(argv)
    page = render(*read_results())
    if args.check:
        if PAGE.read_text() != page:
            print(f"{PAGE} is out of date: run python bench/results_page.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
