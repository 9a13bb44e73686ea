# `make demo` and `make test` work on a fresh machine with only python3 (>= 3.11).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo plot test lint bench bench-scan clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,examples]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_gpt.py --config configs/tiny.yaml --overwrite

# Re-makes the loss plot of a run (the demo's by default): make plot METRICS=runs/ddp/metrics.jsonl
METRICS ?= runs/tiny/metrics.jsonl
plot: $(STAMP)
	$(PY) examples/plot_metrics.py $(METRICS)

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) benchmarks/bench_optimizer.py

bench-scan: $(STAMP)
	$(PY) benchmarks/bench_scan.py

clean:
	rm -rf $(VENV) runs .pytest_cache
