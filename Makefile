# make demo: build .venv and fine-tune MRPC with the defaults.  make test: build .venv and run the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e ".[xla,gcs,dev]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/xla-train train --metrics-out runs/demo/metrics.json

test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=15 tests

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_mrpc.py

clean:
	rm -rf $(VENV) runs
