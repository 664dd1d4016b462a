#!/usr/bin/env bash
# Candor's GPU check: one run, under 8 minutes, on a machine with one NVIDIA GPU (written
# for the H200 image: python3 3.12, torch 2.11 cu130, nvcc 13.0, transformers, tokenizers,
# safetensors, jinja2, aiohttp, uvloop, prometheus-client, pyyaml, numpy, pytest, ninja).
# Results land in $OUT (default /tmp/candor-gpu-out): env.txt, pytest.txt, warm.json,
# parity.json, decode_bench.json, tp.json (two GPUs only), serve.json and the whole log,
# gpu_check.log.
# Each stage has its own time limit; a failed stage is logged and the next one runs.
#
# Missing on that image, carried as wheels in .whl/ (ignored by git: add `/.whl/` to
# .git/info/exclude), fetched on a machine with PyPI access, from the repo root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2 pyzmq==27.3.0 msgspec==0.23.0 \
#     llguidance==1.9.1 gguf==0.19.0 pyahocorasick==2.3.1 pillow==13.0.0
# (28 MB together; every runtime dependency of pyproject.toml the image lacks: the `imports`
# stage below stops the run at once if one is still missing, as llguidance and gguf were on
# 2026-12-04, which cost a whole lease; the device tool carries at most 64 MiB, so flashinfer-python 0.7.x,
# 62-101 MB wheels, does not fit. Candor's calls were read against 0.7.4 and 0.6.13, whose
# signatures agree for them; tests/unit/gpu_worker/test_cuda_graphs.py::test_fake_signatures_match_real
# re-checks against whichever is installed.)
# flashinfer-python 0.6.13's own Requires-Dist: apache-tvm-ffi (carried above), click,
# cuda-tile[tileiras], einops, ninja, numpy, nvidia-cudnn-frontend>=1.13, nvidia-cutlass-dsl
# >=4.5, nvidia-ml-py, packaging, requests, tabulate, torch, tqdm. Missing on the image:
# apache-tvm-ffi, cuda-tile, nvidia-cudnn-frontend, nvidia-cutlass-dsl. Only the first is
# needed to import flashinfer and JIT-build the FA2 prefill/decode kernels Candor uses (seen
# on CPU: `import flashinfer` 0.6.13 works with tvm-ffi + nvidia-ml-py + requests); the other
# three serve backends Candor does not select (cuDNN, CuTe-DSL, cuTile).
# The kernels are compiled at first use with the image's nvcc (a few minutes for the
# shapes here: the `warm` stage does it once, in the background, while pytest runs).
#
# The device tool's call (from the repo root of a checkout holding .whl/):
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/candor-gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
T0=$(date +%s)
stage() {  # stage NAME LIMIT_S LOG CMD...: timed, bounded, failure logged; LOG "-": no file
  local name=$1 limit=$2 log=$3 start rc
  shift 3
  start=$(date +%s)
  echo "=== $name: start at +$((start - T0))s (limit ${limit}s)"
  if [ "$log" = - ]; then timeout -k 15 "$limit" "$@"; else timeout -k 15 "$limit" "$@" >"$log" 2>&1; fi
  rc=$?
  echo "=== $name: rc=$rc after $(($(date +%s) - start))s"
}

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || echo "!!! wheel install failed"
fi
export PYTHONPATH=/tmp/site:$PWD
export CANDOR_CPU_DECODE_KERNEL=0  # CPU tests here: skip compiling the CPU kernel
export CANDOR_GPU_CHECK_DIR=/tmp/candor-gpu-check
export MAX_JOBS=${MAX_JOBS:-16}

stage env 60 "$OUT/env.txt" bash -c 'nvidia-smi; nvcc --version | tail -2; python3 -c "
import sys, torch; print(sys.version); print(\"torch\", torch.__version__, torch.version.cuda, torch.cuda.is_available())
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no CUDA device\")
for m in (\"flashinfer\", \"tvm_ffi\", \"zmq\", \"msgspec\", \"transformers\"):
    try:
        mod = __import__(m); print(m, getattr(mod, \"__version__\", \"?\"))
    except Exception as e:
        print(m, \"IMPORT FAILED:\", type(e).__name__, e)
"'
cat "$OUT/env.txt"

# Every module Candor's processes import at start, before any device time goes on kernels.
stage imports 60 - python3 -c "
import importlib, sys
missing = []
for m in ('zmq', 'msgspec', 'llguidance', 'gguf', 'ahocorasick', 'PIL', 'yaml', 'aiohttp', 'uvloop',
          'prometheus_client', 'jinja2', 'tokenizers', 'transformers', 'safetensors', 'ninja',
          'flashinfer', 'launch_cluster', 'gpu_worker.model_runner', 'api_frontend.app'):
    try:
        importlib.import_module(m)
    except Exception as e:
        missing.append(f'{m}: {type(e).__name__}: {e}')
print('\\n'.join(missing) or 'every import ok')
sys.exit(1 if missing else 0)
" || { echo "!!! imports missing: carry them in .whl/ (see the header); stopping"; exit 3; }

# Kernel builds in the background; pytest (CPU-side tests + the real-signature check) meanwhile.
timeout -k 15 240 python3 -m bench.gpu_check warm --out "$OUT/warm.json" >"$OUT/warm.log" 2>&1 &
WARM=$!
stage pytest 230 "$OUT/pytest.txt" python3 -m pytest -v -p no:cacheprovider tests/unit/gpu_worker/test_cuda_graphs.py \
  tests/unit/gpu_worker/test_attention_backend.py tests/unit/bench/test_bench_models.py
tail -5 "$OUT/pytest.txt"
echo "=== warm: waiting (started at +0s)"
wait $WARM
echo "=== warm: rc=$? at +$(($(date +%s) - T0))s"
tail -20 "$OUT/warm.log"

stage parity 120 - python3 -m bench.gpu_check parity --out "$OUT/parity.json"
stage decode-bench 50 - python3 -m bench.gpu_check decode-bench --out "$OUT/decode_bench.json"
# Tensor parallelism needs two GPUs: TP=1 vs TP=2 tokens and throughput (NCCL).
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
  stage tp 150 - python3 -m bench.gpu_check tp --out "$OUT/tp.json"
else
  echo "=== tp: skipped (fewer than two GPUs visible)"
fi
left=$((470 - ($(date +%s) - T0)))
if [ "$left" -gt 150 ]; then
  stage serve "$left" - python3 -m bench.gpu_check serve --out "$OUT/serve.json"
elif [ "$left" -gt 60 ]; then
  stage serve "$left" - python3 -m bench.gpu_check serve --graphs-only --requests 64 --out "$OUT/serve.json"
else
  echo "=== serve: skipped, ${left}s left"
fi
echo "=== done at +$(($(date +%s) - T0))s"
