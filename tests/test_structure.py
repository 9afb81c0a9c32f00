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
    assert {"xla_train.train", "xla_train.core.roles", "gpu_fallback.strategies"} <= graph.keys()
    assert "xla_train.core.roles" in graph["gpu_fallback.strategies"]  # the walker sees cross-package arrows
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_interface_imports_no_implementation():
    graph = import_graph()
    assert graph["xla_train.core.roles"] <= {"xla_train.core.errors"}
    # the launchers (xmp.spawn's and torch.multiprocessing's, one failure channel) are shared too;
    # on several hosts a failure travels through the job's gs:// output (storage); the XLA ones
    # pick the PJRT device (core.xla, which imports no torch_xla at its top)
    assert graph["xla_train.core.launchers"] <= {"xla_train.core.errors", "xla_train.core.storage", "xla_train.core.roles",
                                            "xla_train.core.xla"}
    # the implementations import the roles, never each other
    assert graph["xla_train.core.xla"] <= {"xla_train.core.errors", "xla_train.core.roles"}
    fallback = [m for m in graph if m.startswith("gpu_fallback")]
    assert len(fallback) >= 4
    assert not any(m.startswith("xla_train") and m not in ("xla_train.core.roles", "xla_train.core.errors",
                                                           "xla_train.core.launchers")
                   for name in fallback for m in graph[name])


def test_strategies_are_chosen_in_one_place():
    """No comparison with a strategy's name outside the one selection place: a strategy is a class."""
    found = []
    for name, path in modules().items():
        if name == "xla_train.core.select":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and _compares_a_strategy_name(node):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def _compares_a_strategy_name(node):
    """A comparison with a strategy's name: a strategy's name as a literal, or anything called
    strategy compared as it is (`cfg.strategy == ...`; `engine.strategy.peers > 1` asks the strategy)."""
    literals = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    operands = [ast.unparse(o) for o in [node.left, *node.comparators]]
    return bool({"ddp", "spmd", "fsdp"} & literals) or any(o.endswith("strategy") for o in operands)


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
