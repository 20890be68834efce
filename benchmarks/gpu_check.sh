#!/usr/bin/env bash
# Every GPU check of the project, for a machine lent for a few minutes (no internet there):
#
#     OUT=/some/folder bash benchmarks/gpu_check.sh          # QUICK=1: fewer rounds
#     OUT=/some/folder PARTS="environment tests_cuda mixed_precision" bash benchmarks/gpu_check.sh
#     OUT=/some/folder PARTS="layer_compile train_step benchmark_gpu" bash benchmarks/gpu_check.sh
#
# 1. environment: nvidia-smi, versions; the wheels of a `.whl` folder beside the checkout (packages the machine's image
#    lacks: datasets and its dill/multiprocess, lucidrains' product-key-memory and its chain) go to /tmp/site;
# 2. tests_cuda: `pytest -m cuda tests/layer/test_devices.py`;
# 3. mixed_precision: a few steps of run_mlm.py and run_glue.py in fp32, bf16 and fp16 compared
#    (benchmarks/speed/gpu_mixed_precision.py, $OUT/mixed_precision/mixed_precision.md);
# 4. layer_compile: the layer eager and compiled, fp32 and bf16, ours (dense, sparse) vs lucidrains
#    (benchmarks/speed/gpu_layer_compile.py, $OUT/layer_compile.log);
# 5. train_step: a bf16 (and fp32) masked-LM training step of ResM-BERT-base vs BERT-base (benchmarks/speed/gpu_train_step.py);
# 6. benchmark_gpu: the GPU section of the benchmarks (gathers, the layer vs its peers, Table 1), $OUT/gpu_results.md
#    (benchmarks/RESULTS.md is left alone).
# Each part has its own time limit and log in $OUT, and a failing part does not stop the next; $OUT/summary.txt lists
# each part's exit status and seconds. All parts at their limits take over 10 minutes: where one command may run at
# most 10 minutes, run them in the two calls above (PARTS: the names to run, default all). On a machine without CUDA
# it runs end to end too (the cuda tests skip, the benchmarks say there is no CUDA device); PYTHON picks the
# interpreter (default python3).
set -u

cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/gpu_check}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_NO_ADVISORY_WARNINGS=1
export HF_HOME=${HF_HOME:-/tmp/gpu_check_hf} PKM_BERT_CACHE=${PKM_BERT_CACHE:-/tmp/gpu_check_pkm}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

# part NAME LIMIT_SECONDS COMMAND...: runs COMMAND under `timeout`, output into $OUT/NAME.log and on the console
part() {
    local name=$1 limit=$2 start rc
    shift 2
    echo "=== $name (limit ${limit}s): $*" | tee "$OUT/$name.log"
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "=== $name: TIMED OUT after ${limit}s" | tee -a "$OUT/$name.log"
    printf '%-14s rc=%-4s %4ss  %s\n' "$name" "$rc" "$(($(date +%s) - start))" \
        "$(grep -E '(passed|failed|skipped|error)' "$OUT/$name.log" | tail -n 1)" >>"$SUMMARY"
}

environment() {
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
    if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
        echo "installing $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site"
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    fi
    "$PYTHON" - <<'EOF'
import importlib, importlib.metadata as metadata, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("torch", "triton", "transformers", "accelerate", "datasets", "huggingface_hub", "pyarrow", "fsspec",
             "safetensors", "tokenizers", "einops", "product_key_memory", "peft", "onnxruntime"):
    try:
        module = importlib.import_module(name)
        print(f"{name:20s} {getattr(module, '__version__', None) or metadata.version(name)}  {module.__file__}")
    except Exception as error:  # noqa: BLE001 (a missing package is reported, the next parts still run)
        print(f"{name:20s} NOT IMPORTABLE: {type(error).__name__}: {error}")
import torch
print("cuda available:", torch.cuda.is_available(), "| torch CUDA", torch.version.cuda,
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no device")
EOF
    if command -v cc >/dev/null; then echo "C compiler: $(command -v cc)"; else echo "C compiler: none (the native CPU selection falls back to torch)"; fi
}

if [ -d .whl ]; then export PYTHONPATH=/tmp/site:$PYTHONPATH; fi
export PYTHON
export -f environment
PARTS=${PARTS:-environment tests_cuda mixed_precision layer_compile train_step benchmark_gpu}
wanted() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
ROUNDS=$([ -n "${QUICK:-}" ] && echo 5 || echo 15)
wanted environment && part environment 60 bash -c environment
wanted tests_cuda && part tests_cuda 150 "$PYTHON" -m pytest -q -rs -p no:cacheprovider -m cuda tests/layer/test_devices.py
wanted mixed_precision && part mixed_precision 120 "$PYTHON" -m benchmarks.speed.gpu_mixed_precision \
    --output_dir "$OUT/mixed_precision" --steps 20
wanted layer_compile && part layer_compile 240 "$PYTHON" -m benchmarks.speed.gpu_layer_compile --rounds "$ROUNDS"
wanted train_step && part train_step 150 "$PYTHON" -m benchmarks.speed.gpu_train_step --rounds "$ROUNDS"
wanted benchmark_gpu && part benchmark_gpu 200 "$PYTHON" benchmarks/run_benchmarks.py --sections gpu overhead \
    --threads "$(nproc)" --output "$OUT/gpu_results.md" ${QUICK:+--quick}
cat "$SUMMARY"
