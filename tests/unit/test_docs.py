"""The documents stay short, linked and self-contained: pure file reads, no servers.

* README.md reads in ten minutes (at most 250 lines);
* every relative link in README.md and docs/*.md resolves to a file of the repository, and every ``#anchor``
  into a markdown file names one of its headings (GitHub's slug rules);
* no module cites the source documents ("seed 003") or the old design card ("design.md") instead of
  ``docs/design.md``, which is in the repository.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 250

# The project's own packages and scripts (the ones `make test` type-checks, plus the example plans).
PACKAGES = (
    "rules",
    "ledger",
    "runtime",
    "reconcile",
    "activities",
    "vendors",
    "artifacts",
    "media",
    "workflows",
    "ledgerflow",
    "worker.py",
    "examples",
)

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
# [text](target "title") and ![alt](target); the text may run over a line break.
_INLINE_LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\(\s*<?(?P<target>[^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(?P<target>\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
_HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose_lines(text: str) -> Iterator[str]:
    """The lines outside fenced code blocks (a fence's own lines are dropped too)."""
    fence: str | None = None
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            continue
        if fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = None
            continue
        yield line


def _prose(text: str) -> str:
    """The document without fenced code and with inline code spans reduced to their content, so that a link
    shown as code is not taken for a link."""
    return _CODE_SPAN.sub(lambda m: "code", "\n".join(_prose_lines(text)))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, punctuation except ``-`` and ``_``
    removed, each space a ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = re.sub(r"(\*\*|__)(.+?)\1", r"\2", text)  # strong emphasis markers are not rendered
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a link into ``path`` may name: its headings' slugs (a repeated slug numbered ``-1``,
    ``-2`` … as GitHub does) and explicit HTML anchors."""
    text = path.read_text(encoding="utf-8")
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in _prose_lines(text):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    found.update(_HTML_ANCHOR.findall(text))
    return found


def links(path: Path) -> list[str]:
    """The targets of every inline and reference link in ``path``, outside code."""
    prose = _prose(path.read_text(encoding="utf-8"))
    targets = [m.group("target") for m in _INLINE_LINK.finditer(prose)]
    targets += [m.group("target") for m in _REFERENCE_LINK.finditer(prose)]
    return targets


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``path`` that name no file under ``root``, or no heading of a markdown file."""
    problems: list[str] = []
    for target in links(path):
        if not target or _SCHEME.match(target) or target.startswith("//"):
            continue  # absolute URLs (https:, mailto:) are not checked here
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / unquote(file_part)).resolve() if file_part else path.resolve()
        if not resolved.is_relative_to(root) or not resolved.exists():
            problems.append(f"{target}: no such file")
            continue
        if fragment and resolved.suffix == ".md" and unquote(fragment) not in anchors(resolved):
            where = resolved.relative_to(root)
            problems.append(f"{target}: no heading with the anchor #{fragment} in {where}")
    return problems


def test_the_readme_reads_in_ten_minutes() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_the_docs_folder_holds_the_design_operations_results_and_testing() -> None:
    names = {p.name for p in DOCS}
    assert {"design.md", "operations.md", "results.md", "testing.md"} <= names


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_a_heading(doc: Path) -> None:
    assert links(doc), f"{doc.name} links nowhere: the docs should point into each other"
    assert broken_links(doc) == []


def test_the_slug_follows_githubs_rules() -> None:
    assert slug("Where this differs from the original design card, and why") == (
        "where-this-differs-from-the-original-design-card-and-why"
    )
    assert slug("Compensation: undoing a task's outputs") == "compensation-undoing-a-tasks-outputs"
    assert slug("Quotas — and `priority_aging`") == "quotas--and-priority_aging"
    assert slug("The [audit](x.md) that recomputes") == "the-audit-that-recomputes"


def test_a_link_to_a_missing_heading_or_file_or_outside_the_repository_is_caught(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "design.md").write_text("# Design\n\n## The loop\n\n```\n# not a heading\n```\n")
    doc = root / "docs" / "index.md"
    doc.write_text(
        "# Index\n\n[ok](design.md#the-loop) [self](#index) [bad](design.md#no-such-section)\n"
        "[gone](nowhere.md) [out](../../elsewhere.md) `[code](ignored.md)` [web](https://example.com/x)\n"
        "[wrapped\ntext](design.md#not-a-heading)\n"
    )
    assert broken_links(doc, root) == [
        "design.md#no-such-section: no heading with the anchor #no-such-section in docs/design.md",
        "nowhere.md: no such file",
        "../../elsewhere.md: no such file",
        "design.md#not-a-heading: no heading with the anchor #not-a-heading in docs/design.md",
    ]


def test_a_repeated_heading_gets_a_numbered_anchor(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text('# Doc\n\n## Notes\n\n## Notes\n\n<a id="custom"></a>\n')
    assert anchors(doc) == {"doc", "notes", "notes-1", "custom"}


# ── citations point into the repository ─────────────────────────────────────────────────────────────────────
# The source documents ("seeds") and the original design card are not in the repository, so a comment citing
# "seed 003 §58.4" or "design.md §7" sends the reader nowhere. docs/design.md restates what the code relies
# on: cite its sections instead.

_SEED_CITATION = re.compile(r"seed[\s_-]?0", re.IGNORECASE)
_CARD_CITATION = re.compile(r"(?<!docs/)\bdesign\.md")


def _package_sources() -> Iterator[Path]:
    for name in PACKAGES:
        top = ROOT / name
        if top.is_file():
            yield top
        elif top.is_dir():
            for path in sorted(top.rglob("*")):
                if path.suffix in {".py", ".yaml", ".yml"} and "__pycache__" not in path.parts:
                    yield path


def test_no_module_cites_the_seeds_or_the_old_design_card_but_docs_design_md() -> None:
    """Cite docs/design.md#section, never a seed or the old design card."""
    sources = list(_package_sources())
    assert sources, "no package sources found"
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sources
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if _SEED_CITATION.search(line) or _CARD_CITATION.search(line)
    ]
    assert offenders == [], "cite docs/design.md#section instead:\n" + "\n".join(offenders)
