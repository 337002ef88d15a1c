#!/usr/bin/env bash
# Everything recorded from a GPU machine in one go: build and install kvcached
# for CUDA (with the C++ benchmark), the test suite, bench_vmm, the Python
# benchmarks and report, and the demo on the GPU. Each step is time-limited
# and the next runs anyway; results land in OUT_DIR.
#
#   bench/run_gpu_all.sh OUT_DIR          (PYTHON=... to choose the interpreter)
set -u
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
cd "$repo"

run() {  # run NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local start=$(date +%s)
  echo "== $name (limit ${limit}s): $*" | tee -a "$out/commands.txt"
  timeout -s INT -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$? seconds=$(( $(date +%s) - start ))" | tee -a "$out/exit_codes.txt"
  tail -n 4 "$out/$name.log"
}

run install 200 env KVCACHED_GPU_BACKENDS=cuda "$py" -m pip install --no-build-isolation --no-deps -v \
  -C cmake.define.KVCACHED_BUILD_BENCH=ON -C build-dir=build/gpu .
run info 30 "$py" -m kvcached info
bench_vmm=$(find build/gpu -name bench_vmm -type f -perm -u+x | head -n 1)
for threads in 1 2 4 8; do
  run "bench_vmm_t$threads" 40 "$bench_vmm" --backend cuda --threads "$threads" --pages 64 --iters 5
done
PYTHON="$py" run suite 420 bash bench/run_gpu_suite.sh "$out/suite"
if "$py" -m kvcached demo --help > /dev/null 2>&1; then
  run demo 90 "$py" -m kvcached demo --device cuda:0 --json "$out/demo.json" --plot "$out/demo.png" --no-live
fi
echo "total seconds=$SECONDS" | tee -a "$out/exit_codes.txt"
