"""The documentation as a newcomer meets it: every relative link in a Markdown file points to a file
that exists, no document runs over 500 lines, and the README stays a page (≤ 150 lines, ≤ 1,500
words) that shows the budget picture `make bench` draws."""
from __future__ import annotations

import re
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".git", ".venv", "build", ".pytest_cache", "node_modules"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")   # [text](target) and ![alt](target)


def markdown_files() -> List[Path]:
    return sorted(p for p in ROOT.rglob("*.md")
                  if not SKIP.intersection(p.relative_to(ROOT).parts) and not p.name.startswith("."))


def relative_targets(text: str) -> List[str]:
    """The link targets of a Markdown text that name a file of the tree (no URL, no bare #anchor),
    outside code spans and fenced blocks."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def test_relative_links_point_to_existing_files():
    files = markdown_files()
    assert len(files) > 10
    broken = [f"{p.relative_to(ROOT)}: {t}" for p in files
              for t in relative_targets(p.read_text(encoding="utf-8")) if not (p.parent / t).exists()]
    assert not broken, "\n".join(broken)


def test_the_link_finder_finds_links():
    text = "see [a](docs/A.md#x), ![p](docs/p.png) and [web](https://x.org), [here](#top)\n" \
           "`[code](not/a/link.md)`\n```\n[fenced](nor/this.md)\n```\n"
    assert relative_targets(text) == ["docs/A.md", "docs/p.png"]


def test_no_document_over_500_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in markdown_files()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500]
    assert not long, long


def test_the_readme_is_a_page_with_the_budget_picture():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    assert len(text.split()) <= 1500
    assert "](docs/budget.png)" in text and (ROOT / "docs" / "budget.png").stat().st_size > 10_000
    assert "make demo" in text and "make test" in text
