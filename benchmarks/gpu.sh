#!/usr/bin/env bash
# The GPU measurement, in one run on a CUDA machine from the repository root:
#   bash benchmarks/gpu.sh [OUT_DIR]            the whole measurement (issue goals: tests on
#                                               CUDA, tiles, profile, kernels, bench, LRA)
#   SHORT=1 bash benchmarks/gpu.sh OUT_DIR      the short check (or benchmarks/gpu_short.sh)
# (default OUT_DIR benchmarks/results/gpu). Needs torch with CUDA and Triton; skyformer
# from src/ (no install needed). Each stage has a time limit (below, SIGINT then SIGKILL)
# so that a slow stage cannot starve the later ones, and a stage that fails is recorded
# in OUT_DIR/stages.txt without stopping the rest. OUT_DIR/machine.txt records the GPU,
# the driver, torch, Triton and CODE=<commit> (a copy of the working tree may carry a
# stale .git: name the code measured); OUT_DIR/clocks.csv the GPU's clocks, power and
# temperature every 100 ms while the stages run (nvidia-smi, where it is installed).
#
# The whole measurement: the kernels' launch options timed first (tiles, ptiles,
# ftiles), then the profile and the kernel benchmark with the fastest of them (--tiles),
# as the library would with them as its defaults; `skyformer bench` at the LRA and model
# shapes; LRA training steps. About 8 minutes on an H100 before the profile and the core
# at two sizes were added.
# The short check (SHORT=1; about seven minutes on an H200, at most about ten with
# every stage at its limit), in order of what matters most: the CUDA tests (every method
# and path: causal, decoding, packed sequences, compiled layers, `skyformer lra train`
# with bf16 autocast, the Triton kernels); the model shape (B=4, H=16, D=64, bf16)
# against flash SDPA, eager and in a CUDA graph, each call timed in a block of its own
# after an idle second (`gpu_kernels.py --timing blocked`; exact kernelized attention
# at N = 4096 too, also with a model's padding as an attn_mask), then the same calls
# interleaved, as earlier runs timed them
# (interleaved with the 132 ms of flash SDPA at N = 32768 a Skyformer call measured
# 8.7 ms where alone it took 6.8-7.0); the implicit core's Newton steps against
# Razavi's; the LRA shape (B=1, H=2, D=32, float32); `skyformer bench --device cuda
# --causal` at the model shape; bfloat16 outputs and gradients against float64 on
# clustered inputs (`half_gradients.py --device cuda`), beside the interpreter's figures.
#
# Run it again with the same OUT_DIR to go on after a time limit, an interruption or a
# command limit of the machine: a stage that finished (passed or failed: see stages.txt;
# marker OUT_DIR/.done-STAGE, delete it to measure the stage again) is skipped, and the
# bench runs continue their JSON (--resume, written after every sequence length), so a
# second run measures only what is missing; a stage run again appends its earlier output
# to OUT_DIR/STAGE.earlier.log. Ctrl-C stops the running stage and the script, marking
# nothing done; so does a stage that could not be started at all (exit 125-127).
# STAGE_SECONDS=N gives every stage N seconds instead of its own limit.
# ONLY="NAME ..." runs those stages alone (a name not among the mode's stages, below, or
# tests with SKIP_TESTS set, stops the script before it starts): tests tiles ptiles
# ftiles profile split kernels bench_float32 bench_bfloat16 lra; with SHORT=1: tests
# kernels_model kernels_model_interleaved paired_steps kernels_lra bench_causal
# half_gradients.
# ARCHIVE=FILE.tar.gz packs OUT_DIR into that one file after every stage (and when
# interrupted): for a machine that hands back only a few files, put OUT_DIR elsewhere and
# FILE in the folder that comes back.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${SHORT:-}" ]; then
  stages="tests kernels_model kernels_model_interleaved paired_steps kernels_lra bench_causal half_gradients"
else
  stages="tests tiles ptiles ftiles profile split kernels bench_float32 bench_bfloat16 lra"
fi
if [ -n "${ONLY:-}" ] && [ -z "${ONLY//[[:space:]]/}" ]; then  # set to blanks: no stage
  echo "ONLY names no stage; name some of: $stages (or leave ONLY unset for all)" >&2
  exit 2
fi
for name in ${ONLY:-}; do  # a misspelt name would run nothing and exit 0
  if ! [[ " $stages " == *" $name "* ]]; then
    echo "ONLY names '$name', which is not a stage of this run$([ -n "${SHORT:-}" ] \
        && echo " (SHORT=1)"); its stages: $stages" >&2
    exit 2
  fi
done
if [ -n "${SKIP_TESTS:-}" ] && [[ " ${ONLY:-} " == *" tests "* ]]; then  # would run nothing
  echo "ONLY names 'tests' and SKIP_TESTS skips them: unset one of the two" >&2
  exit 2
fi
out=${1:-benchmarks/results/gpu}
mkdir -p "$out"
# PYTHON=... names the interpreter (default python3: the machine's own torch with CUDA).
export PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/src:$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" \
    || exit 1

# stage NAME SECONDS COMMAND...: output to OUT_DIR/NAME.log, followed on the terminal.
# timeout runs the command in a process group of its own, so an interruption of this
# script is passed on to that group (running: its id).
if [ -n "${STAGE_SECONDS:-}" ] && ! [[ $STAGE_SECONDS =~ ^[1-9][0-9]*$ ]]; then
  echo "STAGE_SECONDS must be a whole number of seconds, got '$STAGE_SECONDS'" >&2
  exit 2
fi
running=
interrupted=0
archive() {  # OUT_DIR as one file, replaced whole (ARCHIVE, above)
  [ -n "${ARCHIVE:-}" ] || return 0
  tar czf "$ARCHIVE.part" -C "$out" . && mv "$ARCHIVE.part" "$ARCHIVE"
}
# a signal while no stage runs ends the script at once; during a stage it is passed on
# to timeout, which stops the stage (SIGINT, SIGKILL 30 s later)
trap 'interrupted=1; if [ -n "$running" ]; then kill -INT "$running" 2>/dev/null; else
      archive; echo "interrupted: run again with the same folder to go on"; exit 130; fi' \
    INT TERM HUP
touch "$out/stages.txt"
stage() {
  local name=$1 seconds=${STAGE_SECONDS:-$2} start=$SECONDS rc follower note=
  shift 2
  if ! [[ " $stages " == *" $name "* ]]; then  # the list that ONLY is checked against
    echo "stage $name is missing from the stages listed at the top of $0" >&2
    exit 2
  fi
  if [ -n "${ONLY:-}" ] && ! [[ " $ONLY " == *" $name "* ]]; then
    echo "+ $name: not in ONLY"
    return 0
  fi
  if [ -e "$out/.done-$name" ]; then
    echo "+ $name: done in an earlier run (delete $out/.done-$name to measure it again)"
    return 0
  fi
  echo "+ $name (at most ${seconds} s): $*"
  # a stage run again (after a time limit) keeps the earlier runs' output beside its own
  [ -s "$out/$name.log" ] && cat "$out/$name.log" >> "$out/$name.earlier.log"
  : > "$out/$name.log"  # before tail follows it
  timeout --signal=INT --kill-after=30 "$seconds" "$@" >> "$out/$name.log" 2>&1 &
  running=$!
  tail -n +1 -f -s 0.2 --pid="$running" "$out/$name.log" 2>/dev/null &
  follower=$!
  while kill -0 "$running" 2>/dev/null; do  # wait returns early on a trapped signal
    wait "$running"
  done
  wait "$running"  # the stage's own status (bash keeps it after reaping)
  rc=$?
  running=
  wait "$follower" 2>/dev/null
  case $rc in
    0) ;;
    124) note=" (time limit)" ;;
    137) note=" (killed: 30 s past its time limit, or out of memory)" ;;
    125|126|127) note=" (could not run: see $name.log)" ;;
  esac
  [ "$interrupted" = 1 ] && note=" (interrupted)"
  sed -i "/^$name: /d" "$out/stages.txt"  # the latest run of each stage
  echo "$name: exit $rc after $((SECONDS - start)) s$note" | tee -a "$out/stages.txt"
  [ "$interrupted" = 1 ] || [ -n "$note" ] || touch "$out/.done-$name"
  archive
  if [ "$interrupted" = 1 ]; then
    echo "interrupted: run again with the same folder to go on"
    exit 130
  fi
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "code ${CODE:-(set CODE=<commit> to record it)}"; } > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
if command -v nvidia-smi > /dev/null; then  # appended: a rerun's samples follow
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv \
      -lms 100 >> "$out/clocks.csv" 2>&1 &
  sampler=$!
  trap 'kill $sampler 2>/dev/null' EXIT
fi

if [ -z "${SKIP_TESTS:-}" ]; then
  # CUDA test run: contract, every method in float32 and bfloat16, Triton kernels
  parallel=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n 8" || true)
  SKYFORMER_TEST_CUDA=1 stage tests "$([ -n "${SHORT:-}" ] && echo 180 || echo 220)" \
      "$PYTHON" -m pytest -q -p no:warnings -p no:cacheprovider $parallel tests/gpu \
      tests/test_contract.py tests/linalg tests/sketch/test_triton_draws.py \
      tests/ops/test_kernelized_flash.py tests/ops/test_kernelized_fold.py \
      tests/ops/test_skyformer_two_nodes.py \
      tests/reliability/test_marks_in_products.py
  [ -e "$out/tests.log" ] && tail -3 "$out/tests.log" > "$out/tests.txt"
fi

if [ -n "${SHORT:-}" ]; then
  model_calls=('skyformer/triton+implicit' 'skyformer/triton+implicit+composable'
               'skyformer/triton+implicit+guard*'
               'skyformer/triton+implicit+cudagraphs' 'skyformer/triton+implicit+rows-bf16*')
  stage kernels_model 140 "$PYTHON" -W ignore benchmarks/gpu_kernels.py --timing blocked \
      --pause 1 --shapes 4,16,64,bfloat16 --seq-lens 4096 32768 \
      --compile-seq-lens 4096 32768 --compile-kernels triton --max-exact-n 4096 \
      --calls "${model_calls[@]}" 'kernelized/*' 'sdpa+padding' --no-core \
      --out "$out/kernels_model.json"
  stage kernels_model_interleaved 80 "$PYTHON" -W ignore benchmarks/gpu_kernels.py \
      --shapes 4,16,64,bfloat16 --seq-lens 4096 32768 --compile-seq-lens 4096 32768 \
      --compile-kernels triton --max-exact-n 0 --calls "${model_calls[@]}" --no-core \
      --out "$out/kernels_model_interleaved.json"
  stage paired_steps 40 "$PYTHON" -W ignore benchmarks/paired_steps.py \
      --out "$out/paired_steps.txt"
  stage kernels_lra 50 "$PYTHON" -W ignore benchmarks/gpu_kernels.py --timing blocked \
      --pause 1 --shapes 1,2,32,float32 --seq-lens 4096 --compile-seq-lens 4096 \
      --compile-kernels triton --max-exact-n 0 --calls 'skyformer/triton+implicit' \
      'skyformer/triton+implicit+cudagraphs' --no-core --out "$out/kernels_lra.json"
  stage bench_causal 60 "$PYTHON" -W ignore -m skyformer bench --device cuda --causal \
      --shapes 4,16,64 --dtypes bfloat16 --seq-lens 4096 16384 \
      --methods softmax skyformer 'skyformer[pinv_gradient=implicit]' performer \
      --features 128 --repeats 5 --max-seconds 5 --no-error --no-plot --markdown \
      --timing blocked --pause 0.5 --resume --out "$out/bench_causal"
  stage half_gradients 45 "$PYTHON" -W ignore benchmarks/half_gradients.py --device cuda \
      --noise 0.1 0.0 --rows-one-bf16-pass --out "$out/half_gradients"
else
  # The launch options of the Lemma 3 kernels (m = 128) and of the product kernels (model
  # shape, N = 16384), timed (each option compiles its kernels)
  stage tiles 180 "$PYTHON" benchmarks/lemma3_tiles.py --out "$out/lemma3_tiles.json"
  stage ptiles 150 "$PYTHON" benchmarks/product_tiles.py --out "$out/product_tiles.json"
  stage ftiles 90 "$PYTHON" benchmarks/flash_tiles.py --out "$out/flash_tiles.json"
  tiles=()
  for file in "$out/lemma3_tiles.json" "$out/product_tiles.json" "$out/flash_tiles.json"; do
    [ -e "$file" ] && tiles+=("$file")
  done
  [ ${#tiles[@]} -gt 0 ] && tiles=(--tiles "${tiles[@]}")
  # Where the time goes: kernels, launches and idle time of one call (torch.profiler)
  stage profile 45 "$PYTHON" benchmarks/gpu_profile.py --seq-lens 4096 16384 "${tiles[@]}" \
      --out "$out/profile"
  # The eager call's host time split: Triton's launcher against the rest of the host path
  stage split 45 "$PYTHON" -W ignore benchmarks/gpu_host_split.py --out "$out/host_split.md"
  # Triton kernels vs PyTorch path vs flash SDPA, eager and compiled
  stage kernels 150 "$PYTHON" -W ignore benchmarks/gpu_kernels.py \
      --seq-lens 1024 2048 4096 8192 16384 32768 --compile-seq-lens 4096 \
      --max-exact-n 8192 "${tiles[@]}" --out "$out/kernels.json"
  # skyformer bench --device cuda: LRA shape (float32) and model shape (bfloat16); the
  # Markdown tables go to bench_DTYPE.md, one progress line per row to the log
  for spec in "1,2,32 float32 131072" "4,16,64 bfloat16 65536"; do
    set -- $spec
    stage "bench_$2" 90 sh -c '"$PYTHON" -m skyformer bench --device cuda --shapes "$1" \
        --dtypes "$2" --min-n 1024 --max-n "$3" --methods skyformer nystromformer performer \
        kernelized "kernelized[fold_key_norms=True]" --features 128 --repeats 5 \
        --max-seconds 5 --no-error --markdown \
        --timing blocked --pause 0.2 \
        --resume --out "$4/bench_$2" > "$4/bench_$2.md"; rc=$?; cat "$4/bench_$2.md"; exit $rc' \
        sh "$1" "$2" "$3" "$out"
  done
  # LRA training steps: ListOps (32 x 2000) and Image (256 x 1024), bf16 autocast
  stage lra 75 "$PYTHON" benchmarks/lra_gpu.py --out "$out/lra_gpu.json"
fi
echo "+ stages:"
cat "$out/stages.txt"
! grep -qv ": exit 0 " "$out/stages.txt"  # exit status 1 where any stage failed
