#!/usr/bin/env bash
# The short GPU check, for a device lent for a few minutes: `SHORT=1 bash
# benchmarks/gpu.sh OUT_DIR`, whose header says what it runs and how (ONLY, STAGE_SECONDS,
# ARCHIVE, CODE; rerun with the same OUT_DIR to go on where a command limit stopped it).
#   bash benchmarks/gpu_short.sh OUT_DIR
set -uo pipefail
SHORT=1 exec bash "$(dirname "$0")/gpu.sh" "${1:?usage: bash benchmarks/gpu_short.sh OUT_DIR}"
