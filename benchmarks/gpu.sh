#!/usr/bin/env bash
# The whole GPU measurement (issue goals: tests on CUDA, profile, kernels, bench, LRA), in one run
# on a CUDA machine from the repository root (about 8 minutes on an H100 before the
# profile and the core at two sizes were added; not timed since):
#   bash benchmarks/gpu.sh [OUT_DIR]     (default benchmarks/results/gpu)
# Needs torch with CUDA and Triton; skyformer from src/ (no install needed).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "+ CUDA test run (contract, every method in float32 and bfloat16, Triton kernels)"
  parallel=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8" || true)
  SKYFORMER_TEST_CUDA=1 python3 -m pytest -q -p no:warnings -p no:cacheprovider $parallel \
      tests/gpu tests/test_contract.py tests/linalg tests/sketch/test_triton_draws.py 2>&1 \
      | tail -3 | tee "$out/tests.txt"
fi
echo "+ Where the time goes: kernels, launches and idle time of one call (torch.profiler)"
# never run on a GPU yet: a failure here must not cost the measurements after it
python3 benchmarks/gpu_profile.py --seq-lens 4096 16384 --out "$out/profile" \
    2>&1 | tee "$out/profile.txt" || echo "gpu_profile.py failed (see $out/profile.txt)"
echo "+ Triton kernels vs PyTorch path vs flash SDPA, eager and compiled"
python3 benchmarks/gpu_kernels.py --seq-lens 1024 2048 4096 8192 16384 32768 \
    --compile-seq-lens 4096 --max-exact-n 8192 --out "$out/kernels.json" \
    2>&1 | grep -v Warning | tee "$out/kernels.txt"
echo "+ skyformer bench --device cuda: LRA shape (float32) and model shape (bfloat16)"
for spec in "1,2,32 float32 131072" "4,16,64 bfloat16 65536"; do
  set -- $spec
  python3 -m skyformer bench --device cuda --shapes "$1" --dtypes "$2" --min-n 1024 \
      --max-n "$3" --methods skyformer nystromformer performer kernelized --features 128 \
      --repeats 5 --max-seconds 5 --no-error --markdown --out "$out/bench_${2}" \
      2>/dev/null | tee "$out/bench_${2}.md"
done
echo "+ LRA training steps: ListOps (32 x 2000) and Image (256 x 1024), bf16 autocast"
python3 benchmarks/lra_gpu.py --out "$out/lra_gpu.json" | tee "$out/lra_gpu.txt"
