"""Docs stay reachable: every relative link in README.md, BENCHMARKS.md and docs/ names a file that exists (and a
heading there, when it has an anchor), and every reference in the code to a section of a doc (`docs/engine.md
"Memory"`, `README "Layout"`) names a heading that doc has. Sections move; these fail when one does."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# `README "Section"`, `docs/engine.md "Section"`, possibly wrapped onto a comment's next line
SECTION_REF = re.compile(r'\b((?:docs/)?[\w-]+\.md|README|BENCHMARKS)\s*(?:\n\s*(?:#|//|\*)?\s*)?"([^"\n]+)"')


def headings(path: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in path.read_text().splitlines() if re.match(r"#{1,6} ", line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def broken_links(doc: Path) -> list[str]:
    bad = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{doc.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in {slug(h) for h in headings(dest)}:
            bad.append(f"{doc.name}: {target} (no such heading)")
    return bad


def broken_section_refs(source: Path) -> list[str]:
    bad = []
    for name, section in SECTION_REF.findall(source.read_text()):
        doc = ROOT / (name if name.endswith(".md") else name + ".md")
        if not doc.exists() and (ROOT / "docs" / name).exists():
            doc = ROOT / "docs" / name
        if not doc.exists():
            bad.append(f"{source.relative_to(ROOT)}: {name} (no such doc)")
        elif not any(section.lower() in h.lower() for h in headings(doc)):
            bad.append(f'{source.relative_to(ROOT)}: {name} "{section}" (no such heading)')
    return bad


def code_files() -> list[Path]:
    files = [ROOT / "Makefile", *(ROOT / "configs").glob("*.yaml")]
    for folder in ("domino_ray", "jobs", "benchmarks", "tests", "deploy"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".cpp", ".h", ".yaml", ".sh")]
    return sorted(files)


def test_every_relative_link_in_the_docs_resolves():
    assert [bad for doc in DOCS for bad in broken_links(doc)] == []


def test_every_section_the_code_names_exists():
    assert [bad for f in code_files() if f != Path(__file__) for bad in broken_section_refs(f)] == []


def test_the_checks_see_a_moved_section_and_a_dead_link(tmp_path):
    doc = tmp_path / "guide.md"
    doc.write_text("# Guide\n## Memory plan\nSee [x](missing.md), [y](#memory-plan), [z](#gone).\n")
    assert broken_links(doc) == ["guide.md: missing.md (no such file)", "guide.md: #gone (no such heading)"]
    source = ROOT / "tests" / "_probe_refs.py"
    try:
        source.write_text('# see docs/engine.md "Memory" and README\n# "No such section"\n')
        assert broken_section_refs(source) == ['tests/_probe_refs.py: README "No such section" (no such heading)']
    finally:
        source.unlink()
