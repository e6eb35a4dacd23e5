"""Every relative link in the README and docs/ names a file that exists and, for a Markdown
target, a heading it has: the docs cite logs, CSVs, attempt diffs and each other's sections, and
files move (an attempt diff is deleted when it lands)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set:
    found, seen = set(), {}
    for line in re.sub(r"```.*?```", "", text, flags=re.S).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            seen[s] = seen.get(s, -1) + 1  # GitHub numbers repeats: s, s-1, s-2
            found.add(f"{s}-{seen[s]}" if seen[s] else s)
    return found


def broken_links(page: Path) -> list:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    bad = []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", link):  # http(s):, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.is_file():
            bad.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
            bad.append(f"{link}: no such heading")
    return bad


def test_slug_matches_github():
    assert slug("What limits v19, and what is left to try (2026-12-07)") == \
        "what-limits-v19-and-what-is-left-to-try-2026-12-07"
    assert slug("Floors (H100 80GB HBM3, 2.95–2.97 TB/s)") == "floors-h100-80gb-hbm3-295297-tbs"
    assert anchors("# A\n## A\n```\n# A\n```\n## A\n") == {"a", "a-1", "a-2"}


def test_the_checker_finds_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("# Here\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#here) [file](gone.diff) [heading](there.md#nowhere) "
                    "[self](#top) [web](https://example.com/x)\n# Top\n")
    assert broken_links(page) == ["gone.diff: no such file", "there.md#nowhere: no such heading"]


def test_readme_and_docs_links_resolve():
    assert len(PAGES) >= 5, PAGES
    bad = {page.name: b for page in PAGES if (b := broken_links(page))}
    assert not bad, bad
