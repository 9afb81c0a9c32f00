"""README.md is the front door and docs/ holds one page per topic: README stays short, every
relative link in README.md and docs/*.md leads to a file that exists (and a `#anchor` to a heading
of that file, by GitHub's slug rules), and every docs page is linked from README.md or
docs/README.md. Reads files only: no process, no torch."""

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)  # `code`, ``co`de``; may wrap lines
INLINE_LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\(\s*<?(?P<target>[^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(?P<target>[^\s>]+)>?", re.MULTILINE)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(?P<text>.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, any other scheme


def prose(text):
    """The text outside fenced code blocks and code spans: what GitHub renders as markdown."""
    kept, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            kept.append("")
        else:
            kept.append("" if fenced else line)
    return CODE_SPAN.sub("", "\n".join(kept))


def slug(heading):
    """GitHub's anchor for a heading: link markup dropped to its text, lowercase, punctuation
    other than '-' and '_' dropped, each space a dash."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    """Every heading's anchor in a markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen, found = {}, set()
    fenced = False
    for line in path.read_text(encoding="utf-8").split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group("text"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path):
    """The link targets of a markdown file, outside code: inline links, images and reference
    definitions."""
    text = prose(path.read_text(encoding="utf-8"))
    return [m.group("target") for m in INLINE_LINK.finditer(text)] + \
        [m.group("target") for m in REFERENCE_DEF.finditer(text)]


def broken_links(path):
    """'FILE: TARGET (why)' for every relative link of `path` that leads nowhere."""
    broken = []
    for target in links(path):
        if not target or EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file: {dest})")
        elif anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
            broken.append(f"{where} (no heading with anchor #{anchor} in {dest.name})")
    return broken


def markdown_files():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, (f"README.md has {lines} lines; keep it under {README_MAX_LINES}: "
                                      "move topics to docs/")


def test_every_relative_link_resolves():
    files = markdown_files()
    assert len(files) > 2, "docs/*.md not found"
    broken = [b for f in files for b in broken_links(f)]
    assert not broken, f"{len(broken)} broken link(s):\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_readme_or_the_docs_index():
    index_files = [ROOT / "README.md", ROOT / "docs" / "README.md"]
    linked = set()
    for f in index_files:
        for target in links(f):
            if target and not EXTERNAL.match(target) and target.partition("#")[0]:
                linked.add((f.parent / unquote(target.partition("#")[0])).resolve())
    pages = sorted((ROOT / "docs").glob("*.md"))
    orphans = [str(p.relative_to(ROOT)) for p in pages if p.resolve() not in linked]
    assert not orphans, "docs page(s) linked from neither README.md nor docs/README.md:\n" + "\n".join(orphans)


def test_the_link_check_finds_broken_links(tmp_path):
    """The checker itself: a missing file, a missing anchor in another file and a missing anchor
    in the same file are each reported; links in code, external links and good anchors are not."""
    (tmp_path / "other.md").write_text("# Models bigger than one chip: `--strategy fsdp`\n\n## Install\n\n## Install\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Own heading\n\n"
        "[ok](other.md#models-bigger-than-one-chip---strategy-fsdp) [ok](other.md#install-1) [ok](#own-heading)\n"
        "[ok](https://example.com/missing.md) [ok](mailto:someone@example.com) `[not a link](missing.md)`\n"
        "```\n[not a link either](missing.md)\n```\n"
        "[gone](missing.md) [bad anchor](other.md#no-such-heading)\n[bad own anchor](#nowhere)\n")
    broken = broken_links(page)
    assert [b.split(": ", 1)[1].split(" (")[0] for b in broken] == \
        ["missing.md", "other.md#no-such-heading", "#nowhere"], broken
