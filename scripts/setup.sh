#!/usr/bin/env bash
# Set up a virtual environment in .venv with skyformer and everything its tests,
# experiments and Hugging Face integration need. Safe to run again.
# torch is pinned to 2.13.0: an unpinned torch pulls GBs of CUDA packages. PyPI's Linux
# wheel of torch carries CUDA; TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the
# CPU build from PyTorch's own index instead (where pip can reach it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# made anew where it cannot run pip: absent, its interpreter gone (Python upgraded or
# removed), or cut short while being made
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  "$PYTHON" -m venv --clear .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
.venv/bin/python -m pip install --quiet -e ".[hf,plot,dev,lra]"
echo "skyformer is set up in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
