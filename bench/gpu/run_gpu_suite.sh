#!/usr/bin/env bash
# Run the test suite and every benchmark against the installed kvcached, and
# write logs, JSON and a markdown report into one directory.
#
#   bench/gpu/run_gpu_suite.sh [--backend cuda|hip] [--quick] OUT_DIR   (PYTHON=... chooses the interpreter)
#
# --backend names the GPU backend the run is for (default cuda): it picks the
# vendor tools in the environment step and the report's title. --quick (CI over
# the driver emulation) runs the contract and pool tests only and a few of the
# benchmarks, on the GPU device only.
#
# Every step has its own time limit (SIGINT first, so pytest still writes its
# JSON, then SIGKILL 10 s later); a failing step is recorded in OUT_DIR/exit_codes.txt
# and the next one runs anyway; the exit code is 1 if any step failed. Worst
# case about 6 minutes in all.
set -u

backend=cuda
quick=0
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) backend=${2:?--backend needs cuda or hip}; shift 2 ;;
    --quick) quick=1; shift ;;
    -h|--help) source "$(dirname "$0")/steps.sh"; usage_from_header "$0"; exit 0 ;;
    -*) echo "usage: $0 [--backend cuda|hip] [--quick] OUT_DIR" >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done
case "$backend" in cuda|hip) ;; *) echo "$0: --backend must be cuda or hip" >&2; exit 2 ;; esac
[ -n "$out" ] || { echo "usage: $0 [--backend cuda|hip] [--quick] OUT_DIR" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
repo=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=steps.sh
source "$repo/bench/gpu/steps.sh"
py=${PYTHON:-python}
suite_start=$(date +%s)
steps_init "$out"
cd "$repo"  # every step runs in the repository root

if [ "$backend" = hip ]; then
  vendor_tools="rocm-smi --showproductname --showmeminfo vram || true; rocminfo 2>/dev/null | grep -E 'Marketing Name|Uuid|Alloc (Recommended )?Granule' || true"
else
  vendor_tools="nvidia-smi || true"
fi
step environment 15 bash -c "
  date -u; echo; uname -a; echo
  lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Socket' ; echo
  $vendor_tools; echo
  git -C '$repo' rev-parse HEAD 2>/dev/null || true
  env | grep -E '^(KVCACHED_|CUDA_VISIBLE_DEVICES|HIP_VISIBLE_DEVICES|ROCR_VISIBLE_DEVICES)' | sort || true
  $py -c 'import sys, torch, numpy, pytest_benchmark; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"hip\", getattr(torch.version, \"hip\", None), torch.cuda.is_available()); print(\"numpy\", numpy.__version__, \"pytest-benchmark\", pytest_benchmark.__version__)'
  $py -c 'import kvcached; print(\"kvcached\", kvcached.__version__, kvcached.__file__); [print(s) for s in kvcached.backends()]'
  $py -m kvcached info || true"

if [ "$quick" = 1 ]; then
  # The contract suite and the pool tests, every backend usable here.
  step tests 180 "$py" -m pytest tests/test_contract.py tests/test_kv_space.py tests/test_pool.py \
    -q -rs -p no:cacheprovider
  vmm_selection=(-k "$backend and (test_create or test_map or test_set_access or test_reserve)")
  pool_selection=(-k "$backend and (test_grow_cold or test_shrink or test_alloc16_free or test_available)")
else
  step tests 420 "$py" -m pytest tests -q -rs -p no:cacheprovider
  vmm_selection=()
  pool_selection=()
fi

# Benchmarks: bench/micro is its own pytest root (bench/micro/pytest.ini); --benchmark-enable is
# repeated so the command also works where the repository's addopts apply.
step bench_vmm 120 "$py" -m pytest bench/micro/test_bench_vmm.py -p no:cacheprovider --benchmark-enable \
  --benchmark-json="$out/bench_vmm.json" "${vmm_selection[@]}"

step bench_pool 240 env KVCACHED_BENCH_RESULTS="$out/custom_results.json" \
  "$py" -m pytest bench/micro/test_bench_pool.py -p no:cacheprovider --benchmark-enable \
  --benchmark-json="$out/bench_pool.json" "${pool_selection[@]}"

# The report's title names what ran: the GPU, or the emulation standing in for one.
if [ "${KVCACHED_EMULATED_GPU:-0}" = 1 ]; then
  title="$backend driver emulation (host memory, not a GPU)"
else
  title=$("$py" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null || echo "$backend GPU")
fi
echo "$title" > "$out/title.txt"
report_inputs=()
for json in bench_vmm bench_pool; do
  [ -s "$out/$json.json" ] && report_inputs+=(--benchmark-json "$out/$json.json")
done
[ -s "$out/custom_results.json" ] && report_inputs+=(--results "$out/custom_results.json")
step report 15 "$py" bench/micro/report.py --title "$title" "${report_inputs[@]}"
cp "$out/report.log" "$out/RESULTS-gpu.md"

echo "total seconds=$(( $(date +%s) - suite_start ))" | tee -a "$out/exit_codes.txt"
echo "written to $out: exit_codes.txt, commands.txt, *.log, bench_*.json, custom_results.json, RESULTS-gpu.md"
exit "$steps_failed"
