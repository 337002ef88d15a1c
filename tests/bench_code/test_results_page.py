"""bench/results_page.py: bench/RESULTS.md is what it writes, and each target's latest figure is the current one."""

from __future__ import annotations

from pathlib import Path

import pytest

import results_page  # bench/, on the path through pyproject's pytest settings

HEADER = "| target | figure | measured (UTC) | command | machine | tree |\n|---|---|---|---|---|---|\n"


def _run(directory: Path, name: str, title: str, rows: list[str], raw: bool = False) -> None:
    table = HEADER + "".join(row + "\n" for row in rows) + "\n" if rows else ""
    (directory / f"{name}.md").write_text(f"{table}## {title}\n\nText as recorded.\n")
    if raw:
        (directory / f"{name}.raw.md").write_text("raw output\n")


def test_the_committed_page_is_what_results_page_writes():
    written = results_page.render(*results_page.read_results())
    assert results_page.PAGE.read_text() == written, "bench/RESULTS.md is stale: run python bench/results_page.py"


def test_every_committed_run_is_listed_and_every_figure_names_its_command_machine_and_tree():
    runs, figures = results_page.read_results()
    page = results_page.PAGE.read_text()
    assert len(runs) == len([p for p in results_page.RESULTS_DIR.glob("*.md") if not p.name.endswith(".raw.md")])
    for run in runs:
        assert f"(results/{run.name}.md)" in page
    assert figures
    for figure in figures:
        assert figure.command and figure.machine and figure.tree, figure


def test_the_latest_measurement_of_a_target_is_current_and_earlier_ones_are_listed_below(tmp_path):
    row = "| grow (target ≤ 1×) | {fig} | {when} | `python bench/x.py` | one H200 | `{tree}` |"
    _run(
        tmp_path,
        "2026-12-01-first",
        "First — 2026-12-01 10:00 UTC",
        [row.format(fig="1.30×", when="2026-12-01 10:00", tree="aaaaaaa")],
    )
    _run(
        tmp_path,
        "2026-12-03-third",
        "Third — 2026-12-03 09:00 UTC",
        [row.format(fig="0.90×", when="2026-12-03 09:00", tree="ccccccc")],
        raw=True,
    )
    _run(
        tmp_path,
        "2026-12-02-second",
        "Second — 2026-12-02 23:00 UTC",
        [row.format(fig="1.10×", when="2026-12-02 23:00", tree="bbbbbbb")],
    )
    _run(tmp_path, "2026-12-04-no-figures", "Notes — 2026-12-04 08:00 UTC", [])

    runs, figures = results_page.read_results(tmp_path)
    page = results_page.render(runs, figures)
    current, earlier = page.split("## Earlier measurements")
    assert "**0.90×**" in current and "`ccccccc`" in current and "`python bench/x.py`" in current
    assert "1.10×" not in current and "1.30×" not in current
    assert earlier.index("1.10×") < earlier.index("1.30×")  # latest first
    assert [run.name for run in runs] == [
        "2026-12-04-no-figures",
        "2026-12-03-third",
        "2026-12-02-second",
        "2026-12-01-first",
    ]
    assert "[raw](results/2026-12-03-third.raw.md)" in page
    assert "results/2026-12-01-first.raw.md" not in page


@pytest.mark.parametrize(
    "row, message",
    [
        ("| grow | 1.0× | 2026-12-01 10:00 | `cmd` | H200 |", "5 cells"),
        ("| grow | 1.0× | yesterday | `cmd` | H200 | `abc` |", "YYYY-MM-DD HH:MM"),
    ],
)
def test_a_malformed_figures_row_is_refused_with_its_file_and_line(tmp_path, row, message):
    _run(tmp_path, "2026-12-01-bad", "Bad — 2026-12-01 10:00 UTC", [row])
    with pytest.raises(ValueError, match=message) as raised:
        results_page.read_results(tmp_path)
    assert "2026-12-01-bad.md line 3" in str(raised.value)


def test_a_run_file_must_be_named_by_its_date(tmp_path):
    _run(tmp_path, "latest-results", "Undated", [])
    with pytest.raises(ValueError, match="<YYYY-MM-DD>-<topic>"):
        results_page.read_results(tmp_path)


def test_check_fails_on_a_stale_page_and_passes_on_a_fresh_one(tmp_path, monkeypatch):
    page = tmp_path / "RESULTS.md"
    monkeypatch.setattr(results_page, "PAGE", page)
    page.write_text("# an old page\n")
    assert results_page.main(["--check"]) == 1
    assert results_page.main([]) == 0
    assert results_page.main(["--check"]) == 0
