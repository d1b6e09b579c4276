"""The documentation's shape: every relative link and anchor in the README, the CHANGELOG and the
pages under docs/ resolves, the README stays a front page (at most 200 lines) and no page under docs/
grows past 500 lines; raw benchmark data lives beside the scripts, not under docs/."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, fragment = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif fragment and resolved.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", resolved.read_text(), flags=re.M)
                if fragment not in {anchor(heading) for heading in headings}:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_pages_stay_short_and_docs_holds_no_raw_data():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    long = {str(page.relative_to(ROOT)): n for page in PAGES[2:] if (n := len(page.read_text().splitlines())) > 500}
    assert not long, long
    data = [
        str(path.relative_to(ROOT)) for path in (ROOT / "docs").rglob("*") if path.suffix in {".json", ".jsonl", ".txt"}
    ]
    assert not data, data
