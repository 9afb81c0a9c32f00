"""The package's shape, as rules that say what matters (not how long things are):

- no import circle among the modules of xla_train and gpu_fallback;
- layers: the library (xla_train/core/, kernels/, parallel/, io/) imports only the library, never
  gpu_fallback (which registers its roles through an entry point) nor the job's modules;
  gpu_fallback imports only the library's roles, errors, launchers and parallel plans;
- a kind (`--problem`) is named only in xla_train/tasks/; a strategy only where it is selected;
- the library knows no command-line flag: the CLI's words stay in the job and command layers.

Every import counts, the ones inside functions too (a lazy import is still an arrow). Run as a
script to print each module's imports and the longest functions (a report, not a rule):
    python tests/test_structure.py
"""

import ast
import re
import sys
from pathlib import Path

import pytest

from xla_train.core.errors import UserError

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
    assert {"xla_train.commands.train", "xla_train.core.roles", "gpu_fallback.strategies"} <= graph.keys()
    assert "xla_train.core.roles" in graph["gpu_fallback.strategies"]  # the walker sees cross-package arrows
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_interface_imports_no_implementation():
    graph = import_graph()
    # the roles take the mesh (a value: axis sizes, imports the errors only)
    assert graph["xla_train.core.roles"] <= {"xla_train.core.errors", "xla_train.parallel.mesh"}
    assert graph["xla_train.parallel.mesh"] <= {"xla_train.core.errors"}
    # the launchers (xmp.spawn's and torch.multiprocessing's, one failure channel) are shared too;
    # on several hosts a failure travels through the job's gs:// output (storage); the XLA ones
    # pick the PJRT device (core.xla, which imports no torch_xla at its top)
    assert graph["xla_train.parallel.launchers"] <= {"xla_train.core.errors", "xla_train.io.storage",
                                                 "xla_train.core.roles", "xla_train.core.xla"}
    # the implementations import the roles, never each other (kernels.experts: XLA's static mixture of
    # experts, a model adaptation that only the XLA device asks for; parallel.sharded_load: the weights
    # FSDPv2 reads into its shards, of a model the job built without them; parallel.tensor_parallel: the
    # partition specs of a model's tensor-parallel plan, names only)
    assert graph["xla_train.core.xla"] <= {"xla_train.core.errors", "xla_train.core.roles", "xla_train.kernels.experts"}
    assert graph["xla_train.parallel.xla_strategies"] <= {
        "xla_train.core.errors", "xla_train.core.roles", "xla_train.core.xla", "xla_train.parallel.sharded_load",
        "xla_train.parallel.tensor_parallel", "xla_train.parallel.mesh", "xla_train.kernels.experts"}
    assert graph["xla_train.parallel.tensor_parallel"] <= set()
    assert graph["xla_train.parallel.sharded_load"] <= {"xla_train.core.errors"}
    # gpu_fallback's FSDP2 takes the mesh, the tensor-parallel plan's refusals and axis name (names
    # only), context parallelism's attention function (kernels.context) and the experts' refusal,
    # keeps a model's ties through transformers' split (core.ties) and reads its shards from the
    # safetensors (parallel.sharded_load's Checkpoint)
    fallback = [m for m in graph if m.startswith("gpu_fallback")]
    assert len(fallback) >= 4
    assert not any(m.startswith("xla_train") and m not in (
        "xla_train.core.roles", "xla_train.core.errors", "xla_train.parallel.launchers",
        "xla_train.parallel.tensor_parallel", "xla_train.core.ties", "xla_train.parallel.sharded_load",
        "xla_train.parallel.mesh", "xla_train.kernels.context", "xla_train.kernels.attention",
        "xla_train.kernels.experts")
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


def test_the_core_imports_nothing_from_the_job():
    """The library (core/: Engine, roles, devices, batching; kernels/; parallel/: strategies,
    launchers, plans; io/: storage) is what the job is written on: it imports the library only.
    gpu_fallback (the torch-native roles) registers itself with the selection (an entry point),
    which never imports it."""
    graph = import_graph()
    core = [m for m in graph if m.startswith(LIBRARY)]
    assert {"xla_train.core.engine", "xla_train.kernels.attention", "xla_train.parallel.xla_strategies",
            "xla_train.io.storage"} <= set(core)
    upward = [f"{m} -> {t}" for m in core for t in sorted(graph[m]) if not t.startswith(LIBRARY)]
    assert upward == [], upward


def test_gpu_fallback_registers_its_roles():
    """The torch-native backends come from gpu_fallback's entry points (setup.py), found by the
    selection; a backend that no package registers is one line."""
    from importlib.metadata import entry_points

    from xla_train.core import select

    assert {p.name: p.value for p in entry_points(group=select.ROLES_GROUP)} == {
        "cuda": "gpu_fallback:roles", "cpu": "gpu_fallback:roles", "tpu": "gpu_fallback:roles"}
    import gpu_fallback

    assert select.registered_roles("cpu") is gpu_fallback.roles
    roles = select.select_roles("cpu", strategy="fsdp")
    assert type(roles.accelerator).__name__ == "TorchAccelerator" and type(roles.strategy).__name__ == "Fsdp2"
    saved = select._REGISTERED.pop("cpu")
    try:
        with pytest.raises(UserError, match=r"^`backend` nowhere: no package registers its roles"):
            select.registered_roles("nowhere")
        # a checkout on PYTHONPATH has no entry points: gpu_fallback beside xla_train is found all the same
        import importlib.metadata

        real = importlib.metadata.entry_points
        importlib.metadata.entry_points = lambda **kw: []
        try:
            assert select.registered_roles("cpu") is gpu_fallback.roles
        finally:
            importlib.metadata.entry_points = real
    finally:
        select._REGISTERED["cpu"] = saved


PROBLEMS = {"classification", "regression", "causal-lm", "dpo", "grpo"}  # --problem's kinds
KIND_ATTRIBUTES = {"problem", "generates", "packing", "kind"}  # a task's kind, asked as it is


def test_kinds_are_named_only_in_the_tasks():
    """Outside xla_train/tasks/, nothing names a kind or branches on one: no kind's name as a
    literal, and no test of a task's kind (`task.generates`, `task.packing`, `task.problem == ...`):
    the code asks the task to do the kind's part."""
    found = []
    for name, path in modules().items():
        if not name.startswith("xla_train") or name.startswith("xla_train.tasks"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if _names_a_kind(node):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def _names_a_kind(node):
    """A kind's name as a literal, or a test (if, while, x if c else y, and/or, not, assert, a
    comparison) that reads a task's kind attribute."""
    if isinstance(node, ast.Constant) and node.value in PROBLEMS:
        return True
    tests = []
    if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
        tests = [node.test]
    elif isinstance(node, ast.BoolOp):
        tests = node.values
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        tests = [node.operand]
    elif isinstance(node, ast.Compare):
        tests = [node.left, *node.comparators]
    return any(_task_kind(t) for t in tests)


def _task_kind(node):
    """`task.generates`, `self.task.packing`, `job.task.problem`: a kind attribute of a task."""
    return (isinstance(node, ast.Attribute) and node.attr in KIND_ATTRIBUTES
            and ast.unparse(node.value).split(".")[-1].endswith("task"))


# The library the job is written on: what it imports is the library only (and no flag's name)
LIBRARY = ("xla_train.core", "xla_train.kernels", "xla_train.parallel", "xla_train.io")
FLAG = re.compile(r"--[A-Za-z]")


def test_the_core_names_no_command_line_flag():
    """No string in the library (xla_train/core/, kernels/, parallel/, io/) or gpu_fallback/ names a
    flag (`--` and a letter): the library is used from the API and from other commands too, so its
    errors name its parameters in backticks (`num_processes`), and the command line shows each as
    its flag (cli.as_flags). Docstrings are documentation, not behaviour: left out."""
    found = []
    for name, path in modules().items():
        if name.startswith((*LIBRARY, "gpu_fallback")):
            found += [f"{name}:{line}: {text!r}" for line, text in flag_strings(path)]
    assert not found, "\n".join(found)


def flag_strings(path):
    """(line, text) of every string literal in `path` that names a flag, docstrings left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  for body in [n.body] if body and isinstance(body[0], ast.Expr)
                  and isinstance(body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docstrings and FLAG.search(n.value)]


def test_the_rules_see_what_they_look_for(tmp_path):
    """The walkers catch what they forbid, and pass what they allow."""
    def nodes(code):
        return list(ast.walk(ast.parse(code)))

    assert any(_names_a_kind(n) for n in nodes("if cfg.problem == 'causal-lm': pass"))
    assert any(_names_a_kind(n) for n in nodes("x = 1 if job.task.generates else 2"))
    assert any(_names_a_kind(n) for n in nodes("if self.task.packing and x: pass"))
    assert not any(_names_a_kind(n) for n in nodes("if cfg.packing: pass\ntask.loss(out, labels)"))
    assert not any(_names_a_kind(n) for n in nodes("help = 'causal-lm: the documents'"))
    code = tmp_path / "m.py"
    code.write_text('"""--lr in a docstring."""\ndef f():\n    """--epochs too."""\n'
                    '    raise ValueError(f"try a lower --lr than {1}")\nx = "a -- b --2"\n')
    assert [line for line, _ in flag_strings(code)] == [4]


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
    print("flags named in the core:", *(f"{p.relative_to(ROOT)}:{line}: {text!r}" for name, p in modules().items()
                                        if name.startswith(LIBRARY) for line, text in flag_strings(p)),
          sep="\n  ")
    sys.exit(0)
