"""The package's shape in numbers, at one or more git revisions side by side (issue 43's before and
after): the task protocol's members, how far the options object reaches, the command-line flags
the core names, the annotated share of the parameters, and the longest functions.

    python benchmarks/bench_structure.py 03444dc HEAD          # prints a table, writes JSON
    python benchmarks/bench_structure.py WORKTREE               # the working tree as it is

Everything is read with `ast` from the revision's files (`git show REV:path`): nothing is imported.
"""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("xla_train", "gpu_fallback")
FLAG = re.compile(r"--[A-Za-z]")
OPTION_NAMES = ("cfg", "opts", "options")  # what the options object is called where it is passed


def files(rev):
    """{path: source} of every module of the packages at `rev` (WORKTREE: the checkout as it is)."""
    if rev == "WORKTREE":
        return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
                for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, *PACKAGES], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    return {p: subprocess.run(["git", "show", f"{rev}:{p}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout for p in listed if p.endswith(".py")}


def docstrings(tree):
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def task_protocol(trees):
    """Members of tasks/base.py's Task class: (methods and properties, attributes)."""
    tree = trees.get("xla_train/tasks/base.py")
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Task")
    methods = [n.name for n in cls.body if isinstance(n, ast.FunctionDef)]
    attributes = [t.id for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                  for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)]
    return methods, attributes


def measure(rev):
    sources = files(rev)
    trees = {p: ast.parse(s) for p, s in sources.items()}
    params = annotated = 0
    option_functions, option_modules, option_reads = [], set(), {}
    core_flags = []
    functions = []
    for path, tree in trees.items():
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                args = [a for a in args if a.arg not in ("self", "cls")]
                params += len(args)
                annotated += sum(a.annotation is not None for a in args)
                if any(a.arg in OPTION_NAMES for a in args):
                    option_functions.append(f"{path}:{node.name}")
                    option_modules.add(path)
                functions.append((node.end_lineno - node.lineno + 1, f"{path}:{node.name}"))
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in OPTION_NAMES:
                option_reads[path] = option_reads.get(path, 0) + 1
            elif path.startswith("xla_train/core/") and isinstance(node, ast.Constant) and \
                    isinstance(node.value, str) and id(node) not in skip and FLAG.search(node.value):
                core_flags.append(f"{path}:{node.lineno}")
    methods, attributes = task_protocol(trees)
    return {
        "rev": rev,
        "modules": len(trees),
        "task_protocol": {"methods": len(methods), "attributes": len(attributes)},
        "parameters": params, "annotated": annotated, "annotated_share": round(annotated / max(params, 1), 3),
        "functions_taking_options": len(option_functions), "modules_taking_options": len(option_modules),
        "option_reads": sum(option_reads.values()),
        "core_option_reads": sum(v for p, v in option_reads.items() if p.startswith("xla_train/core/")),
        "core_flag_strings": len(core_flags),
        "longest_functions": [f"{f} {n}" for n, f in sorted(functions, reverse=True)[:5]],
    }


def main(revs):
    results = [measure(rev) for rev in revs or ["WORKTREE"]]
    keys = [k for k in results[0] if k not in ("rev", "longest_functions")]
    print(f"{'':28s}" + "".join(f"{r['rev']:>16s}" for r in results))
    for key in keys:
        print(f"{key:28s}" + "".join(f"{json.dumps(r[key]):>16s}" for r in results))
    for r in results:
        print(f"{r['rev']}: longest functions {', '.join(r['longest_functions'])}")
    out = ROOT / "benchmarks" / "out" / "structure.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
