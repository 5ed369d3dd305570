"""The documentation a clone holds: every relative link in README.md and docs/*.md leads to a file of the
repository, and every `#anchor` to a heading of the file it names (as GitHub makes anchors of headings)."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
EXTERNAL = ("http://", "https://", "mailto:")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a shell block is no heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than `-` and `_` dropped, spaces as `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            name, n = base, 0
            while name in found:  # a repeated heading gets -1, -2, ...
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def broken_links(document: Path, repo: Path) -> list[str]:
    """Each relative link of `document` that does not resolve inside `repo`, with the reason."""
    broken = []
    for line in prose_lines(document.read_text()):
        for target in LINK.findall(line):
            if target.startswith(EXTERNAL):
                continue
            path_part, _, anchor = target.partition("#")
            path = (document.parent / path_part).resolve() if path_part else document.resolve()
            if not path.is_relative_to(repo.resolve()):
                broken.append(f"{target}: outside the repository")
            elif not path.exists():
                broken.append(f"{target}: no such file")
            elif anchor and (path.suffix != ".md" or anchor not in anchors(path)):
                broken.append(f"{target}: no heading #{anchor} in {path.name}")
    return broken


def documents(repo: Path) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def test_every_relative_link_of_the_docs_resolves_inside_the_repository() -> None:
    broken = {str(doc.relative_to(REPO)): broken_links(doc, REPO) for doc in documents(REPO)}
    assert {doc: links for doc, links in broken.items() if links} == {}


CITED = re.compile(r"docs/([\w.-]+\.md)(?:#([\w-]+))?")


def cited_in_code(repo: Path) -> dict[str, list[str]]:
    """Every `docs/FILE.md#anchor` the code, tests, benchmark, example configs and units cite, by citing file."""
    cited: dict[str, list[str]] = {}
    places = ("syncd/**/*", "tests/**/*.py", "bench/*", "config/*", "systemd/**/*")
    for path in sorted(path for place in places for path in repo.glob(place)):
        if path.suffix in (".py", ".yaml", ".md", ".c", ".service") and path.is_file() and path.name != "test_docs.py":
            found = [match.group(0) for match in CITED.finditer(path.read_text(errors="replace"))]
            if found:
                cited[str(path.relative_to(repo))] = found
    return cited


def test_every_docs_section_the_code_cites_exists() -> None:
    cited = cited_in_code(REPO)
    assert len(cited) > 20  # the formats, adapters, engine and daemon cite Burn's notes and the install page
    missing = {}
    for source, references in cited.items():
        for reference in references:
            name, _, anchor = reference.removeprefix("docs/").partition("#")
            doc = REPO / "docs" / name
            if not doc.exists() or (anchor and anchor not in anchors(doc)):
                missing.setdefault(source, []).append(reference)
    assert missing == {}


def test_the_link_check_finds_a_missing_file_a_missing_heading_and_a_link_out_of_the_repository(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "a.md").write_text("# A\n\n## Store options: `KeyRemapper`\n\n```sh\n# not a heading\n```\n")
    (repo / "README.md").write_text(
        "[ok](docs/a.md#store-options-keyremapper) [web](https://example.org/x.md)\n"
        "[gone](docs/b.md) [no heading](docs/a.md#not-a-heading) [out](../outside.md) [self](#nowhere)\n"
        "```\n[in code](docs/none.md)\n```\n"
    )
    (tmp_path / "outside.md").write_text("# outside\n")
    assert broken_links(repo / "README.md", repo) == [
        "docs/b.md: no such file",
        "docs/a.md#not-a-heading: no heading #not-a-heading in a.md",
        "../outside.md: outside the repository",
        "#nowhere: no heading #nowhere in README.md",
    ]
