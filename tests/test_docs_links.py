"""Every relative link in the README and the docs leads somewhere: the file exists, and a
``#fragment`` into a markdown file names one of its headings (GitHub's anchors: lower case,
punctuation dropped but ``-`` and ``_``, spaces made ``-``, a repeated heading ``-1``, ``-2``).
Links to the web are not followed (no network in CI)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), not ![image](...)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
PAGES = [
    ROOT / "README.md",
    *sorted(p for d in ("docs", "bench", "examples") for p in (ROOT / d).rglob("*.md")),
]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text. Pure."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (outside code fences). Reads the file."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """``page``'s relative links whose file or heading does not exist, each with why."""
    bad = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    return bad


def test_the_anchors_are_githubs():
    assert slug("Ahead of DDP: the product's learner (`bench lan-table1 --x`, issue 42)") == (
        "ahead-of-ddp-the-products-learner-bench-lan-table1---x-issue-42"
    )
    assert slug("Rudra-adv\\* trees") == "rudra-adv-trees"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_leads_to_a_file_and_heading(page):
    assert not broken_links(page), broken_links(page)
