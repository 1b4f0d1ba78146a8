#!/usr/bin/env bash
# Run the test suite against another torch / Triton pair than setup.sh's, by default the
# versions of the GPU machines the GPU figures come from (torch 2.11.0, Triton 3.6.0),
# in a virtual environment of its own (.venv-torch<version>; safe to run again):
#   bash scripts/check_versions.sh [TORCH_VERSION] [TRITON_VERSION] [pytest args...]
# PyPI's torch 2.11 wheel is the CUDA build: about 4.5 GB with its CUDA packages, which
# it does not need on a CPU. Triton before 3.7 runs its interpreter only with NumPy < 2.4.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${1:-2.11.0}
TRITON_VERSION=${2:-3.6.0}
shift $(( $# < 2 ? $# : 2 ))
PYTHON=${PYTHON:-python3}
venv=".venv-torch$TORCH_VERSION"
if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then  # absent or broken
  "$PYTHON" -m venv --clear "$venv"
fi
numpy="numpy"
if [ "$(printf '%s\n3.7\n' "$TRITON_VERSION" | sort -V | head -1)" != "3.7" ]; then
  numpy="numpy<2.4"
fi
"$venv/bin/python" -m pip install --quiet "torch==$TORCH_VERSION" "triton==$TRITON_VERSION" "$numpy"
"$venv/bin/python" -m pip install --quiet -e ".[hf,plot,dev,lra]" "torch==$TORCH_VERSION" \
    "triton==$TRITON_VERSION" "$numpy"
"$venv/bin/python" -c 'import torch, triton, numpy; print("torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__)'
"$venv/bin/python" -m pytest -q "$@"
