#!/usr/bin/env bash
# The short GPU check (about seven minutes on an H200; at most about nine with every
# part at its time limit, so where a command may run 600 s at most, run it in two calls,
# e.g. ONLY="tests kernels_model kernels_model_interleaved" then ONLY="paired_steps
# kernels_lra bench_causal"), for a device lent for a few minutes; `bash
# benchmarks/gpu.sh` is the whole measurement. From the repository root:
#   bash benchmarks/gpu_short.sh OUT_DIR
# In order of what matters most, each part with its own time limit so that a slow part
# cannot starve the next: the CUDA tests (every method and path: causal, decoding,
# packed sequences, compiled layers, `skyformer lra train` with bf16 autocast, the
# Triton kernels); the model shape (B=4, H=16, D=64, bf16) against flash SDPA, eager and
# in a CUDA graph, each call timed in a block of its own after an idle second
# (`gpu_kernels.py --timing blocked`; exact kernelized attention at N = 4096 too), then
# the same calls interleaved, as earlier runs timed them (interleaved with the 132 ms of
# flash SDPA at N = 32768 a Skyformer call measured 8.7 ms where alone it took 6.8-7.0: the
# two parts show how much of that is the order); the GPU's clocks, power and
# temperature sampled every 100 ms meanwhile (clocks.csv); the implicit core's Newton
# steps against Razavi's; the LRA shape (B=1, H=2, D=32, float32); `skyformer bench
# --device cuda --causal` at the model shape.
# Logs and JSON go to OUT_DIR; OUT_DIR/summary.txt holds each part's exit status.
# A copy of the working tree may carry a stale .git: CODE=<commit> names the code measured.
# ONLY="NAME ..." runs those parts alone (tests kernels_model kernels_model_interleaved
# paired_steps kernels_lra bench_causal).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/gpu_short.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" \
    || exit 1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "code ${CODE:-(set CODE=<commit> to record it)}"; } | tee "$out/summary.txt"

part() {  # part NAME SECONDS COMMAND...: output to OUT_DIR/NAME.txt and the terminal
  local name=$1 seconds=$2 start=$SECONDS rc
  shift 2
  if [ -n "${ONLY:-}" ] && ! [[ " $ONLY " == *" $name "* ]]; then
    return 0
  fi
  echo "+ $name (at most $seconds s)"
  timeout --signal=INT --kill-after=15 "$seconds" "$@" 2>&1 | tee "$out/$name.txt" \
      | tail -n 25
  rc=${PIPESTATUS[0]}
  echo "$name: exit $rc after $((SECONDS - start)) s" | tee -a "$out/summary.txt"
}

parallel=$(python3 -c "import xdist" 2>/dev/null && echo "-n 12" || true)
SKYFORMER_TEST_CUDA=1 part tests 180 python3 -m pytest -q -p no:warnings \
    -p no:cacheprovider $parallel tests/gpu tests/test_contract.py tests/linalg \
    tests/sketch/test_triton_draws.py tests/ops/test_kernelized_flash.py \
    tests/ops/test_kernelized_fold.py \
    tests/reliability/test_marks_in_products.py
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv \
    -lms 100 > "$out/clocks.csv" 2>&1 &
sampler=$!
trap 'kill $sampler 2>/dev/null' EXIT
model_calls=('skyformer/triton+implicit' 'skyformer/triton+implicit+guard*'
             'skyformer/triton+implicit+cudagraphs')
part kernels_model 110 python3 -W ignore benchmarks/gpu_kernels.py --timing blocked \
    --pause 1 --shapes 4,16,64,bfloat16 --seq-lens 4096 32768 \
    --compile-seq-lens 4096 32768 --compile-kernels triton --max-exact-n 4096 \
    --calls "${model_calls[@]}" 'kernelized/*' --no-core --out "$out/kernels_model.json"
part kernels_model_interleaved 80 python3 -W ignore benchmarks/gpu_kernels.py \
    --shapes 4,16,64,bfloat16 --seq-lens 4096 32768 --compile-seq-lens 4096 32768 \
    --compile-kernels triton --max-exact-n 0 --calls "${model_calls[@]}" --no-core \
    --out "$out/kernels_model_interleaved.json"
part paired_steps 40 python3 -W ignore benchmarks/paired_steps.py --out "$out/paired_steps.txt"
part kernels_lra 50 python3 -W ignore benchmarks/gpu_kernels.py --timing blocked \
    --pause 1 --shapes 1,2,32,float32 --seq-lens 4096 --compile-seq-lens 4096 \
    --compile-kernels triton --max-exact-n 0 --calls 'skyformer/triton+implicit' \
    'skyformer/triton+implicit+cudagraphs' --no-core --out "$out/kernels_lra.json"
part bench_causal 60 python3 -W ignore -m skyformer bench --device cuda --causal \
    --shapes 4,16,64 --dtypes bfloat16 --seq-lens 4096 16384 \
    --methods softmax skyformer 'skyformer[pinv_gradient=implicit]' performer \
    --features 128 --repeats 5 --max-seconds 5 --no-error --no-plot --markdown \
    --timing blocked --pause 0.5 --out "$out/bench_causal"
echo "+ parts:"
cat "$out/summary.txt"
! grep -q ": exit [1-9]" "$out/summary.txt"
