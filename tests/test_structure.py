"""The package's shape: no import circle among the modules of xla_train and gpu_fallback.

Every import counts, the ones inside functions too (a lazy import is still an arrow). Run as a
script to print each module's imports and the longest functions:
    python tests/test_structure.py
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("xla_train", "gpu_fallback")


def modules():
    """{dotted module name: path} of every module of the two packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph():
    """{module: set of the package's modules it imports}."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from . import x` names a module; `from .m import f` names module m
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def find_cycle(graph):
    """One import circle as a list of modules (first == last), or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_walker_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    graph = import_graph()
    assert {"xla_train.train", "xla_train.backend", "gpu_fallback.backend"} <= graph.keys()
    assert "xla_train.backend" in graph["gpu_fallback.backend"]  # the walker sees cross-package arrows
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_interface_imports_no_implementation():
    graph = import_graph()
    assert graph["xla_train.backend"] <= {"xla_train.errors"}
    # the launchers (xmp.spawn's and torch.multiprocessing's, one failure channel) are shared too;
    # on several hosts a failure travels through the job's gs:// output (storage)
    assert graph["xla_train.launchers"] <= {"xla_train.errors", "xla_train.storage"}
    assert not any(m.startswith("xla_train") and m not in ("xla_train.backend", "xla_train.errors",
                                                           "xla_train.launchers")
                   for m in graph["gpu_fallback.backend"])


def test_strategies_are_chosen_in_one_place():
    """No comparison with a strategy's name outside backend selection: a strategy is a class."""
    found = []
    for name, path in modules().items():
        if name == "xla_train.selection":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and "strategy" in ast.unparse(node):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_no_long_functions():
    assert [f for n, f in longest_functions(1000) if n > 60] == []


def longest_functions(n=8):
    out = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node.end_lineno - node.lineno + 1, f"{name}.{node.name}"))
    return sorted(out, reverse=True)[:n]


if __name__ == "__main__":
    graph = import_graph()
    for name in sorted(graph):
        lines = len(modules()[name].read_text(encoding="utf-8").splitlines())
        print(f"{name:28s} {lines:4d}  -> {', '.join(sorted(graph[name])) or '-'}")
    print("circle:", find_cycle(graph))
    print("longest functions:", ", ".join(f"{f} {n}" for n, f in longest_functions()))
    sys.exit(0)
