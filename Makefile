# make demo: build .venv and fine-tune MRPC with the defaults.  make test: build .venv and run every test.
# make test-fast: the tests that run in pytest's own process (no CLI runs, workers or emulator).
# make test-torch: build .venv-torch (the newest torch, no torch_xla) and run the tests that need no XLA.
# make dist: build dist/xla_train-VERSION.tar.gz and dist/xla_train-VERSION-py3-none-any.whl and list the wheel's files.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The second environment: the newest torch the tests ran on (setup.py caps torch just above it), without
# torch_xla, which holds torch at 2.9. A CPU build of it is in /opt/wheels here (pip's find-links).
NEWEST_TORCH := 2.13.0
TORCH_VENV := .venv-torch
TORCH_PY := $(TORCH_VENV)/bin/python

.PHONY: demo test test-fast test-torch dist bench clean

# --no-cache-dir: torch 2.9.0 from PyPI brings 4.4 GB of CUDA libraries (nvidia-*), and pip's cache
# would keep a second copy of their wheels beside the venv: a CI machine ran out of disk (2026-11-28).
$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --no-cache-dir -e ".[xla,gcs,dev,trackers,profile]"
	touch $@

$(TORCH_VENV)/.installed: setup.py
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_PY) -m pip install --no-cache-dir "torch==$(NEWEST_TORCH)" -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/xla-train train --metrics-out runs/demo/metrics.json

# Two test processes (pytest-xdist): most tests wait on one single-threaded XLA compilation or
# Python start-up at a time. Tests sharing an expensive run stay in one process (conftest.py).
test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadgroup tests

# The fast tier in the same two processes (mypy's cold run alone is 40 s of it).
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q --durations=10 -n 2 --dist loadgroup -m "not slow" tests

# The newest torch: the in-process tests (those that need torch_xla skip, and run under make test),
# then the CLI runs marked `torch_native` (a CPU MRPC run, gloo workers under ddp and fsdp, LoRA, predict).
test-torch: $(TORCH_VENV)/.installed
	$(TORCH_PY) -m pytest -q --durations=10 -m "not slow" tests
	$(TORCH_PY) -m pytest -q --durations=10 -m "slow and torch_native" tests

# setup.py is the build script; --no-isolation builds with .venv's setuptools and wheel (the dev
# extra), as tests/test_install.py does. The wheel is built from the sdist, so nothing stale in the
# checkout (build/) gets into it.
dist: $(VENV)/.installed
	rm -rf dist build xla_train.egg-info  # a stale egg-info SOURCES.txt would add old files to the sdist
	$(PY) -m build --no-isolation --outdir dist .
	$(PY) -m zipfile -l dist/*.whl

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_mrpc.py

clean:
	rm -rf $(VENV) $(TORCH_VENV) runs dist build
