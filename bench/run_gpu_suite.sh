#!/usr/bin/env bash
# Run the test suite and every benchmark against the installed kvcached, and
# write logs, JSON and a markdown report into one directory.
#
#   bench/run_gpu_suite.sh OUT_DIR        (PYTHON=/path/to/python to choose the interpreter)
#
# Every step has its own time limit (SIGINT first, so pytest still writes its
# JSON, then SIGKILL 10 s later); a failing step is recorded in OUT_DIR/exit_codes.txt
# and the next one runs anyway. Worst case about 6 minutes in all.
set -u

out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
bench_dir=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$bench_dir")
py=${PYTHON:-python}
suite_start=$(date +%s)

: > "$out/exit_codes.txt"

# step NAME LIMIT_SECONDS COMMAND...: run in the repository root, log to OUT_DIR/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  local start rc
  start=$(date +%s)
  echo "== $name (limit ${limit}s): $*" | tee -a "$out/commands.txt"
  (cd "$repo" && timeout -s INT -k 10 "$limit" "$@") > "$out/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc seconds=$(( $(date +%s) - start ))" | tee -a "$out/exit_codes.txt"
  tail -n 3 "$out/$name.log"
}

step environment 15 bash -c "
  date -u; echo; uname -a; echo
  lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Socket' ; echo
  nvidia-smi || true; echo
  git -C '$repo' rev-parse HEAD 2>/dev/null || true
  $py -c 'import sys, torch, numpy, pytest_benchmark; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available()); print(\"numpy\", numpy.__version__, \"pytest-benchmark\", pytest_benchmark.__version__)'
  $py -c 'import kvcached; print(\"kvcached\", kvcached.__version__, kvcached.__file__); [print(s) for s in kvcached.backends()]'
  $py -m kvcached info || true"

step tests 180 "$py" -m pytest tests -q -rs -p no:cacheprovider

# Benchmarks: bench/ is its own pytest root (bench/pytest.ini); --benchmark-enable is
# repeated so the command also works where the repository's addopts apply.
step bench_vmm 60 "$py" -m pytest bench/test_bench_vmm.py -p no:cacheprovider --benchmark-enable \
  --benchmark-json="$out/bench_vmm.json"

step bench_pool 120 env KVCACHED_BENCH_RESULTS="$out/custom_results.json" \
  "$py" -m pytest bench/test_bench_pool.py -p no:cacheprovider --benchmark-enable \
  --benchmark-json="$out/bench_pool.json"

step report 15 "$py" bench/report.py --title "NVIDIA H200" \
  --benchmark-json "$out/bench_vmm.json" --benchmark-json "$out/bench_pool.json" \
  --results "$out/custom_results.json"
cp "$out/report.log" "$out/RESULTS-gpu.md"

echo "total seconds=$(( $(date +%s) - suite_start ))" | tee -a "$out/exit_codes.txt"
echo "written to $out: exit_codes.txt, commands.txt, *.log, bench_*.json, custom_results.json, RESULTS-gpu.md"
