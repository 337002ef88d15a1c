#!/usr/bin/env bash
# The multi-GPU proofs on a GPU machine, in one directory: kvcached built for the
# backend, then the tensor-parallel rank tests on one GPU (tests/test_gpu_ranks.py:
# two ranks in two processes charged on one registry, kernels writing while unmaps
# arrive, budgets exact at every step; processes with the mask unset and "0" in one
# registry), the landing check with its kvctl / kvtop snapshots, and with two GPUs
# or more the rest of the file (ranks on cuda:0 and cuda:1 and in the other order,
# four masks landing in two registries, the demo on cuda:1, two demos at once).
# Each step is time-limited and the next runs anyway; the exit code is 1 if a step
# failed. OUT_DIR gets few files: SUMMARY.md (date, machine, command, steps, the
# results) and one raw log per step.
#
#   bench/gpu/run_gpu_multi.sh [--backend cuda|hip] [--target DIR | --no-install] [--emulated] OUT_DIR
#
#   --backend     cuda (default) or hip
#   --target DIR  install kvcached into DIR (pip --target) instead of the environment
#   --no-install  use the kvcached already installed
#   --emulated    a dry run over the test-only driver emulation (set LD_LIBRARY_PATH,
#                 KVCACHED_EMULATED_GPU=1 and KVCACHED_EMULATED_GPUS): the CPU twins
#                 (tests/test_emulated_ranks.py) stand in for the GPU tests; no demos
#   PYTHON=...    the interpreter (default python3); its torch must see the GPUs
#
# About 3 minutes on one H200 (most of it the build), 5 on two.
set -u
usage="usage: $0 [--backend cuda|hip] [--target DIR | --no-install] [--emulated] OUT_DIR"
backend=cuda
install=environment
target=""
emulated=0
out=""
arguments="$*"
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) backend=${2:?--backend needs cuda or hip}; shift 2 ;;
    --target) install=target; target=${2:?--target needs a directory}; shift 2 ;;
    --no-install) install=none; shift ;;
    --emulated) emulated=1; shift ;;
    -h|--help) source "$(dirname "$0")/steps.sh"; usage_from_header "$0"; exit 0 ;;
    -*) echo "$usage" >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done
case "$backend" in cuda|hip) ;; *) echo "$0: --backend must be cuda or hip" >&2; exit 2 ;; esac
[ -n "$out" ] || { echo "$usage" >&2; exit 2; }
if [ "$emulated" = 1 ] && [ "${KVCACHED_EMULATED_GPU:-0}" != 1 ]; then
  echo "$0: --emulated needs the emulation's environment (KVCACHED_EMULATED_GPU=1, LD_LIBRARY_PATH)" >&2
  exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
repo=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=steps.sh
source "$repo/bench/gpu/steps.sh"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# Every process starts from no mask; the tests set each process's own.
unset CUDA_VISIBLE_DEVICES HIP_VISIBLE_DEVICES ROCR_VISIBLE_DEVICES
cd "$repo"
steps_init "$out"
steps="$out/steps.txt"

case "$install" in
  environment)
    step install 300 env KVCACHED_GPU_BACKENDS="$backend" "$py" -m pip install --no-build-isolation --no-deps \
      -C build-dir="build/gpu-$backend" . ;;
  target)
    mkdir -p "$target"
    target=$(cd "$target" && pwd)
    step install 300 env KVCACHED_GPU_BACKENDS="$backend" "$py" -m pip install --no-build-isolation --no-deps \
      --upgrade --target "$target" -C build-dir="build/gpu-$backend" .
    export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" ;;
  none) skip_step install "--no-install: the kvcached already installed" ;;
esac

if [ "$backend" = hip ]; then vendor="rocm-smi --showproductname || true"; else vendor="nvidia-smi -L || true"; fi
step environment 60 bash -c "
  date -u; uname -srm; $vendor
  git rev-parse HEAD 2>/dev/null || true
  env | grep -E '^KVCACHED_' | sort || true
  $py -c 'import sys, torch; print(sys.version.split()[0], \"torch\", torch.__version__, \"GPUs\", torch.cuda.device_count())'
  $py -c 'import kvcached; print(\"kvcached\", kvcached.__version__, kvcached.__file__)'
  $py -m kvcached info"
gpus=$("$py" -c "from kvcached.devices import backend_status as s; print(s('$backend').device_count)" 2>/dev/null || echo 0)
echo "$backend GPUs visible: $gpus"

# The one-GPU proofs, then everything else in the file: each test runs in exactly one step.
one_gpu="(same_gpu and not reordered) or unset_and_0"
if [ "$emulated" = 1 ]; then
  # The twins of this backend only (the build has no other).
  tests=tests/test_emulated_ranks.py
  other=$([ "$backend" = cuda ] && echo hip || echo cuda)
  only=" and not $other"
else
  tests=tests/test_gpu_ranks.py
  only=""
fi
pytest_args=(-v -rA -p no:cacheprovider)
if [ "$gpus" -ge 1 ]; then
  step tests_one_gpu 180 "$py" -m pytest "$tests" -k "($one_gpu)$only" "${pytest_args[@]}"
  step landing 90 "$py" tests/landing_check.py --backend "$backend"
else
  skip_step tests_one_gpu "no $backend GPU visible"
  skip_step landing "no $backend GPU visible"
fi
if [ "$gpus" -ge 2 ]; then
  step tests_two_gpus 360 "$py" -m pytest "$tests" -k "not ($one_gpu)$only" "${pytest_args[@]}"
else
  skip_step tests_two_gpus "$gpus $backend GPU(s) visible; needs 2"
fi

# ---- SUMMARY.md ------------------------------------------------------------------------------
summary="$out/SUMMARY.md"
{
  echo "# Multi-GPU proofs ($backend)"
  echo
  if [ "$emulated" = 1 ]; then
    echo "**EMULATION: a dry run over the test-only driver emulation (tests/emulation), not on GPUs;"
    echo "the CPU twins (tests/test_emulated_ranks.py) stand in for the GPU tests.**"
    echo
  fi
  echo "Date: $(date -u '+%Y-%m-%d %H:%M UTC'). Code: commit \`$(git rev-parse --short HEAD 2>/dev/null || echo unknown)\`$(git diff --quiet 2>/dev/null || echo ' (with local changes)'). $backend GPUs visible: $gpus."
  echo
  echo "Machine:"
  echo
  if [ "$backend" = hip ]; then fence <(rocm-smi --showproductname 2>&1); else fence <(nvidia-smi -L 2>&1); fi
  echo
  echo "Command, from the repository root:"
  echo
  echo '```bash'
  echo "bash bench/gpu/run_gpu_multi.sh $arguments"
  echo '```'
  echo
  echo "## Steps"
  echo
  echo "| step | exit code | seconds | limit | raw output |"
  echo "|---|---|---|---|---|"
  while read -r name rc seconds limit; do
    if [ "$rc" = skipped ]; then
      echo "| $name | skipped: $limit | | | |"
    else
      echo "| $name | $rc | $seconds | $limit | \`$out/$name.log\` |"
    fi
  done < "$steps"
  echo
  if [ "$steps_failed" = 1 ]; then echo "**Some step failed**: see its log (the end of each is below)."; else echo "Every step that ran passed."; fi
  for name in tests_one_gpu tests_two_gpus; do
    [ -f "$out/$name.log" ] || continue
    echo
    echo "## $name: $tests"
    echo
    fence <(grep -E '^(PASSED|FAILED|ERROR|SKIPPED)|^=+ .*(passed|failed|skipped|error)' "$out/$name.log")
  done
  if [ -f "$out/landing.log" ]; then
    echo
    echo "## Landing: processes under each mask, and what kvctl / kvtop show"
    echo
    fence "$out/landing.log"
  fi
  for name in $(awk '$2 != "0" && $2 != "skipped" {print $1}' "$steps"); do
    echo
    echo "## Failed step: $name (last 40 lines)"
    echo
    fence <(tail -n 40 "$out/$name.log")
  done
} > "$summary"
echo "summary: $summary"
exit "$steps_failed"
