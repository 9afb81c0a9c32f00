# make demo: build .venv and fine-tune MRPC with the defaults.  make test: build .venv and run every test.
# make test-fast: the tests that run in pytest's own process (no CLI runs, workers or emulator).
# make dist: build dist/xla_train-VERSION.tar.gz and dist/xla_train-VERSION-py3-none-any.whl and list the wheel's files.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast dist bench clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e ".[xla,gcs,dev,trackers,profile]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/xla-train train --metrics-out runs/demo/metrics.json

# Two test processes (pytest-xdist): most tests wait on one single-threaded XLA compilation or
# Python start-up at a time. Tests sharing an expensive run stay in one process (conftest.py).
test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadgroup tests

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q --durations=10 -m "not slow" tests

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
	rm -rf $(VENV) runs dist build
