"""The README and docs a user reads: what they open with, and links that lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_opens_with_what_kvcached_does_and_the_picture_then_usage_then_what_ran_where():
    text = (ROOT / "README.md").read_text()
    headings = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    picture = text.index("](docs/demo-h200.png)")
    assert picture < text.index("\n## "), "the picture comes before the first section"
    assert headings.index("What has run where") > headings.index("Serving several models: `kvcached serve`")
    assert headings.index("What has run where") > headings.index("Weights that sleep and wake")
    assert len(text.split()) < 3200, "the README stays a front page; details belong in docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_every_anchor_to_a_heading(page):
    text = page.read_text()
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.relative_to(ROOT)}: {target} leads nowhere"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked.read_text()), f"{page.relative_to(ROOT)}: no heading for #{anchor}"


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors
