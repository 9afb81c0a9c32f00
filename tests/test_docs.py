"""README.md is the front door and docs/ holds one page per topic: README stays short, every
relative link in README.md and docs/*.md leads to a file that exists (and a `#anchor` to a heading
of that file, by GitHub's slug rules), and every docs page is linked from README.md or
docs/README.md. The package's files the pages name exist (paths, and dotted names down to the
module's own name), docs/layout.md names every module once, and docs/tests.md's map names every
module and every test file. Reads files only: no process, no torch."""

import ast
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


# ---------------------------------------------------------------------------------------------
# The package's files as the pages name them: `xla_train/core/engine.py`, `kernels/attention.py`
# (a room of xla_train/), `tests/test_docs.py`, `xla_train.core.engine.Engine`, `core.xla.pallas_layer`.

PACKAGES = ("xla_train", "gpu_fallback")
ROOMS = tuple(sorted(p.name for p in (ROOT / "xla_train").iterdir() if (p / "__init__.py").is_file()))
OWN_ROOTS = (*PACKAGES, "tests", "benchmarks", "scripts", "recipes", "docs", "notebooks")
PATH_NAMED = re.compile(r"(?<![\w/.~-])((?:[\w.-]+/)+[\w.-]*\w\.(?:py|md|yaml|yml|json|ipynb|sh|toml))(?![\w/])")
# xla_train's own modules (`job.prepare`, `models.seed_host`) are named without the package too
TOP_MODULES = tuple(sorted(p.stem for p in (ROOT / "xla_train").glob("*.py") if not p.stem.startswith("_")))
DOTTED = re.compile(r"(?<![\w./~-])((?:" + "|".join((*PACKAGES, *ROOMS, *TOP_MODULES)) + r")(?:\.\w+)+)")
# Names that look like ours and are not: other projects' paths, a key of the metrics JSON.
FOREIGN = {
    "core/xla_model.py": "torch_xla's",
    "core/xla_builder.py": "torch_xla's",
    "docs/source/perf/spmd_advanced.md": "torch_xla's",
    "docs/notebooks/distributed_training_101.py": "torch_tpu's",
    "xla_train.roles": "the entry-point group setup.py registers gpu_fallback's roles under",
    "memory.experts": "the metrics JSON's key",
}
EXTENSIONS = {"py", "md", "log", "json", "yaml"}  # `options.py`, `~/xla_train.log`: a file, not a dotted name
WRITTEN = ("benchmarks/out/",)  # what the benchmarks write when run (not in the repository)


def package_files():
    """Every .py of xla_train/ and gpu_fallback/, as 'xla_train/core/engine.py'."""
    return sorted(str(f.relative_to(ROOT)) for package in PACKAGES for f in (ROOT / package).rglob("*.py"))


def defined_names(path):
    """The names a module binds at its top level (in if/try blocks too): functions, classes,
    assignments, imports."""
    names = set()

    def visit(statements):
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, None) or [])

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return names


def stale_names(path, root=ROOT):
    """'FILE:LINE: NAME (why)' for every path of the repository and every dotted name of the
    package that `path` names and that is not there."""
    stale = []
    for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        for m in PATH_NAMED.finditer(line):
            named = m.group(1)
            first = named.split("/")[0]
            if named in FOREIGN or named.startswith(WRITTEN) or first not in (*OWN_ROOTS, *ROOMS):
                continue
            target = root / named if first in OWN_ROOTS else root / "xla_train" / named
            if not target.exists():
                stale.append(f"{path.name}:{n}: {named} (no such file: {target.relative_to(root)})")
        for m in DOTTED.finditer(line):
            named = m.group(1)
            parts = named.split(".")
            if named in FOREIGN or parts[-1] in EXTENSIONS:
                continue
            if parts[0] not in PACKAGES:
                parts = ["xla_train", *parts]
            for i in range(len(parts), 1, -1):
                module = root.joinpath(*parts[:i])
                found = next((f for f in (module.with_suffix(".py"), module / "__init__.py") if f.is_file()), None)
                if found or module.is_dir():
                    break
            else:
                stale.append(f"{path.name}:{n}: {named} (no such module)")
                continue
            if found and i < len(parts) and parts[i] not in defined_names(found):
                stale.append(f"{path.name}:{n}: {named} ({parts[i]} is not defined in {found.relative_to(root)})")
    return stale


def test_every_file_and_module_the_pages_name_exists():
    stale = [s for f in markdown_files() for s in stale_names(f)]
    assert not stale, f"{len(stale)} name(s) of files or modules that are not there (moved?):\n" + "\n".join(stale)


def test_the_name_check_finds_moved_modules(tmp_path):
    """The checker itself, on a page of its own against this repository: a moved module's old
    path, a room-relative path, a dotted name whose function moved away are reported; the
    package's real files and names, other projects' paths and what runs write are not."""
    page = tmp_path / "page.md"
    page.write_text(
        "`xla_train/core/engine.py` `kernels/attention.py` `tests/test_docs.py` `xla_train.core.engine.Engine`\n"
        "`core.xla.pallas_layer` `torch_xla/core/xla_model.py` `core/xla_model.py` `benchmarks/out/x.json`\n"
        "`~/xla_train.log` `runs/demo/metrics.json` `options.py` `job.prepare`\n"
        "`core/attention.py` `xla_train/core/storage.py` `core.xla._no_such_function` `xla_train.nowhere.x`\n"
        "`job.host_seeding_only`\n")
    assert [s.split(": ", 1)[1].split(" (")[0] for s in stale_names(page)] == \
        ["core/attention.py", "xla_train/core/storage.py", "core.xla._no_such_function", "xla_train.nowhere.x",
         "job.host_seeding_only"]


def layout_names():
    """The modules docs/layout.md's drawing names, in order: a line's first word at column 0
    (`xla_train/job.py`, or a folder `xla_train/core/`, which stands for its __init__.py), and
    under a folder, a first word indented by two spaces (`  engine.py`)."""
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    drawing = text.split("```")[1]
    named, folder = [], None
    for line in drawing.split("\n"):
        word = line.split()[0] if line.strip() else ""
        if line[:1].strip():  # column 0
            folder = word if word.startswith(PACKAGES) and word.endswith("/") else None
            if folder:
                named.append(folder + "__init__.py")
            elif word.startswith(PACKAGES) and word.endswith(".py"):
                named.append(word)
        elif folder and line.startswith("  ") and line[2:3].strip() and word.endswith(".py"):
            named.append(folder + word)
    return named


def test_the_layout_names_every_module_once():
    named = layout_names()
    files = package_files()
    missing = sorted(set(files) - set(named))
    assert not missing, "docs/layout.md leaves out:\n" + "\n".join(missing)
    assert sorted(set(named) - set(files)) == [], "docs/layout.md names modules that are not there"
    assert sorted({n for n in named if named.count(n) > 1}) == [], "docs/layout.md names these twice"


def map_rows():
    """{module path: the test files its row names} of docs/tests.md's map."""
    text = (ROOT / "docs" / "tests.md").read_text(encoding="utf-8")
    section = text.split("## Which test file tests which module", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.split("\n"):
        cells = line.split("|")
        if len(cells) > 3 and cells[1].strip().startswith("`"):
            for module in re.findall(r"`((?:xla_train|gpu_fallback)/[\w/.]+\.py)`", cells[1]):
                rows[module] = set(re.findall(r"\btest_\w+\.py\b", cells[2]))
    return rows, set(re.findall(r"\btest_\w+\.py\b", section))


def test_the_test_map_names_every_module_and_every_test_file():
    """docs/tests.md maps each module with code (a package's __init__.py holding only its
    docstring aside) to the test files that test it, and names every test file, each one there."""
    rows, named_tests = map_rows()
    def docstring_only(f):
        return len(ast.parse((ROOT / f).read_text(encoding="utf-8")).body) <= 1

    with_code = [f for f in package_files() if not (f.endswith("__init__.py") and docstring_only(f))]
    missing = [f for f in with_code if not rows.get(f)]
    assert not missing, "docs/tests.md's map has no test file for:\n" + "\n".join(missing)
    assert sorted(set(rows) - set(package_files())) == [], "the map names modules that are not there"
    files = {f.name for f in (ROOT / "tests").glob("test_*.py")}
    assert sorted(files - named_tests) == [], "test files the map does not name"
    assert sorted(named_tests - files) == [], "the map names test files that are not there"
