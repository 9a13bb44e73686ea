# `make demo`, `make test` and `make docs` work on a fresh machine with only python3 (>= 3.11).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DOCS_STAMP := $(VENV)/.docs-stamp

.PHONY: demo plot test docs docs-serve lint bench bench-scan bench-gpu clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,examples]'
	# The CUDA plugin of the installed jaxlib's exact version: compile-only GPU
	# meshes for the GPU-target tests and `make bench-gpu` (no GPU or driver needed).
	if [ "$$(uname -s)-$$(uname -m)" = "Linux-x86_64" ]; then \
	  v=$$($(PY) -c 'import jaxlib; print(jaxlib.__version__)'); \
	  $(PY) -m pip install -q "jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v"; fi
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_gpt.py --config configs/tiny.yaml --overwrite

# Re-makes the loss plot of a run (the demo's by default): make plot METRICS=runs/ddp/metrics.jsonl
METRICS ?= runs/tiny/metrics.jsonl
plot: $(STAMP)
	$(PY) examples/plot_metrics.py $(METRICS)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

# The docs site, strictly: a broken link, anchor or API reference fails the build.
# Writes build/site (mkdocs.yml's site_dir); `make docs-serve` serves it while you edit.
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) benchmarks/bench_optimizer.py

bench-scan: $(STAMP)
	$(PY) benchmarks/bench_scan.py

# The headline figure: steps compiled for 8 x H100 and priced by XLA (no GPU needed).
bench-gpu: $(STAMP)
	$(PY) benchmarks/bench_gpu.py

clean:
	rm -rf $(VENV) runs .pytest_cache build/site
