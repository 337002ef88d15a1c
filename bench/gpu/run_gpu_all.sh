#!/usr/bin/env bash
# Everything recorded from a GPU machine in one go, for one GPU backend: the
# backend's CMake preset built and its C++ tests run, kvcached installed for it,
# kvcached info, bench_vmm at 1/2/4/8 threads, (HIP) the fresh-mapping probe,
# bench/gpu/run_gpu_suite.sh (test suite, Python benchmarks, report), the demo on
# the GPU, and one results file, OUT_DIR/RESULTS-<backend>.md, in the form of
# a dated file in bench/results/. Each step is time-limited and the next runs anyway; the exit
# code is 1 if any step failed, and the results file says which and why.
#
#   bench/gpu/run_gpu_all.sh [--backend cuda|hip] [--quick] [--demo-device DEV] OUT_DIR
#
#   --backend      cuda (default; preset cuda-release) or hip (AMD; preset rocm-release)
#   --quick        short, for CI over the driver emulation: the contract and pool
#                  tests only, fewer iterations and benchmarks, a 3-second demo
#   --demo-device  where the demo runs (default: the backend's first GPU)
#   PYTHON=...     the interpreter (default python3); its torch must be the GPU build
#                  (ROCm build for hip) for the GPU tests and the demo
set -u
usage="usage: $0 [--backend cuda|hip] [--quick] [--demo-device DEV] OUT_DIR"
backend=cuda
quick=0
demo_device=""
out=""
arguments="$*"
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) backend=${2:?--backend needs cuda or hip}; shift 2 ;;
    --quick) quick=1; shift ;;
    --demo-device) demo_device=${2:?--demo-device needs a device}; shift 2 ;;
    -h|--help) source "$(dirname "$0")/steps.sh"; usage_from_header "$0"; exit 0 ;;
    -*) echo "$usage" >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done
case "$backend" in
  cuda) preset=cuda-release ;;
  hip) preset=rocm-release ;;
  *) echo "$0: --backend must be cuda or hip" >&2; exit 2 ;;
esac
[ -n "$out" ] || { echo "$usage" >&2; exit 2; }
demo_device=${demo_device:-$backend:0}
mkdir -p "$out"
out=$(cd "$out" && pwd)
repo=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=steps.sh
source "$repo/bench/gpu/steps.sh"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
cd "$repo"
steps_init "$out" 4

if [ "$quick" = 1 ]; then
  vmm_pages=8; vmm_iters=2; probe_iters=20; demo_args=(--duration 3 --engines 2)
else
  vmm_pages=64; vmm_iters=5; probe_iters=200; demo_args=()
fi

# C++: the preset's build (bench_vmm and the probe come from it) and its CTest.
step preset 900 bash -c "cmake --preset $preset > /dev/null && cmake --build --preset $preset && ctest --preset $preset"
step install 600 env KVCACHED_GPU_BACKENDS="$backend" "$py" -m pip install --no-build-isolation --no-deps -v \
  -C build-dir="build/gpu-$backend" .
step info 30 "$py" -m kvcached info
bench_vmm="build/$preset/bench/cpp/bench_vmm"
for threads in 1 2 4 8; do
  step "bench_vmm_t$threads" 60 "$bench_vmm" --backend "$backend" --threads "$threads" \
    --pages "$vmm_pages" --iters "$vmm_iters"
done
if [ "$backend" = hip ]; then
  step fresh_mapping_probe 120 "build/$preset/bench/cpp/probe_fresh_mapping" --iters "$probe_iters"
fi
suite_args=(--backend "$backend")
[ "$quick" = 1 ] && suite_args+=(--quick)
PYTHON="$py" step suite 900 bash bench/gpu/run_gpu_suite.sh "${suite_args[@]}" "$out/suite"
step demo 120 "$py" -m kvcached demo --device "$demo_device" "${demo_args[@]}" \
  --json "$out/demo.json" --plot "$out/demo.png" --no-live
echo "total seconds=$SECONDS" | tee -a "$out/exit_codes.txt"

# ---- one results file ------------------------------------------------------------------------
results="$out/RESULTS-$backend.md"
failed_steps=$(grep -hE ' rc=[1-9]' "$out/exit_codes.txt" "$out/suite/exit_codes.txt" 2>/dev/null | cut -d' ' -f1)
{
  title=$(cat "$out/suite/title.txt" 2>/dev/null)
  echo "# Results: $backend backend${title:+ — $title}"
  echo
  if [ "${KVCACHED_EMULATED_GPU:-0}" = 1 ]; then
    echo "**EMULATION: these figures come from the test-only driver emulation over host memory"
    echo "(tests/emulation), not from a GPU. They show that the run works end to end, nothing more.**"
    echo
  fi
  echo "Date: $(date -u '+%Y-%m-%d %H:%M UTC'). Host: $(uname -srm). Code: commit \`$(git rev-parse --short HEAD 2>/dev/null || echo unknown)\`$(git diff --quiet 2>/dev/null || echo ' (with local changes)')."
  echo "Command, from the repository root:"
  echo
  echo '```bash'
  echo "bash bench/gpu/run_gpu_all.sh $arguments"
  echo '```'
  echo
  echo "## Steps"
  echo
  echo "| step | exit code | seconds |"
  echo "|---|---|---|"
  grep -hE ' rc=' "$out/exit_codes.txt" "$out/suite/exit_codes.txt" 2>/dev/null |
    sed -E 's/^([^ ]+) rc=([0-9]+) seconds=([0-9]+)$/| \1 | \2 | \3 |/'
  echo
  if [ -n "$failed_steps" ]; then
    echo "**Failed: $(echo $failed_steps)** (the end of each log below; everything in $out)."
  else
    echo "Every step passed."
  fi
  echo
  echo "## Benchmarks against the targets (bench/micro/report.py)"
  echo
  cat "$out/suite/RESULTS-gpu.md" 2>/dev/null
  echo
  echo "## Tests"
  echo
  fence <(tail -n 15 "$out/suite/tests.log" 2>/dev/null)
  if [ "$backend" = hip ]; then
    echo
    echo "## Fresh mappings and GPU work (probe_fresh_mapping, C++)"
    echo
    fence "$out/fresh_mapping_probe.log"
  fi
  echo
  echo "## bench_vmm (C++), $vmm_pages pages per thread, $vmm_iters iterations"
  echo
  for threads in 1 2 4 8; do fence "$out/bench_vmm_t$threads.log"; echo; done
  echo "## The demo on $demo_device"
  echo
  fence "$out/demo.log"
  echo
  echo "## kvcached info"
  echo
  fence "$out/info.log"
  echo
  echo "## Environment"
  echo
  fence "$out/suite/environment.log"
  echo
  echo "## C++ build and tests ($preset)"
  echo
  fence <(tail -n 12 "$out/preset.log")
  for name in $failed_steps; do
    log="$out/$name.log"
    [ -f "$log" ] || log="$out/suite/$name.log"
    echo
    echo "## Failed step: $name (last 30 lines of $log)"
    echo
    fence <(tail -n 30 "$log")
  done
} > "$results"
echo "results: $results"
[ -z "$failed_steps" ]
