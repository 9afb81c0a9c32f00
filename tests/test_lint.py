"""ruff and mypy, as pyproject.toml configures them, are clean on the package, its tests, the
benchmarks and the scripts (docs/tests.md, "Lint and types"). Both run from this environment's
bin folder (setup.py's test extra installs them); mypy keeps its cache per environment in
.mypy_cache, so a second run takes seconds.

They belong in `make test-fast` (issue 43): two tool processes, with no torch, device or training
run in them, and seconds once mypy's cache is warm. tests/conftest.py marks a test `slow` where its
source names `subprocess.` (or a function that does), so the module is imported as `sp`."""

import subprocess as sp
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RUFF_PATHS = ["xla_train", "gpu_fallback", "tests", "benchmarks", "scripts"]


def _tool(name):
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: install the test extra (pip install -e '.[test]'; make does)")
    return path


def _clean(cmd):
    proc = sp.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} found:\n{proc.stdout}{proc.stderr}"


def test_ruff_is_clean():
    _clean([_tool("ruff"), "check", "--no-cache", *RUFF_PATHS])


def test_mypy_is_clean():
    # the files and settings are pyproject.toml's; one cache per environment (.venv and .venv-torch
    # see different torch releases, and would otherwise invalidate each other's)
    _clean([_tool("mypy"), "--cache-dir", ROOT / ".mypy_cache" / Path(sys.prefix).name])
