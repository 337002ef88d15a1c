#!/usr/bin/env bash
# kvcached against the reference implementation on one GPU, in one run: builds both
# (each into its own --target directory), then the side-by-side benchmark with the
# driver floor and the driver-call counter, bench_vmm on one thread, the order of a
# 64-allocation grow's driver calls (bench/probes/create_overlap_probe.py), and the memory
# hand-over between two processes (8 GiB, both layouts, zero backing on and off).
#
#   bench/gpu/run_gpu_perf.sh OUT_DIR REF_TARBALL        (PYTHON=..., WORK=... to choose)
#
# ROUNDS=N (default 3) sets the side-by-side rounds (about 65 s each); HANDOVER=0
# leaves the hand-over steps out, to keep a run with more rounds under 10 minutes;
# CPUS (default auto: four of the GPU's local CPUs; none; a list) pins every measured process.
#
# REF_TARBALL: the reference's source (a .tar.gz with one top folder). Every step is
# time-limited (SIGINT, then SIGKILL 10 s later) and the next one runs anyway; the
# limits add up to about 8 minutes, a normal run takes about 5. OUT_DIR receives
# SUMMARY.md, exit_codes.txt, commands.txt, <step>.log and each step's own files.
set -u
case "${1:-}" in -h|--help) source "$(dirname "$0")/steps.sh"; usage_from_header "$0"; exit 0 ;; esac
out=${1:?usage: $0 OUT_DIR REF_TARBALL}
tarball=${2:?usage: $0 OUT_DIR REF_TARBALL}
mkdir -p "$out"
out=$(cd "$out" && pwd)
tarball=$(cd "$(dirname "$tarball")" && pwd)/$(basename "$tarball")
repo=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=steps.sh
source "$repo/bench/gpu/steps.sh"
py=${PYTHON:-python3}
work=${WORK:-/tmp/kvcached-perf}
rounds=${ROUNDS:-3}
handover=${HANDOVER:-1}
jobs=$(nproc 2>/dev/null || echo 8)
export PYTHONUNBUFFERED=1
cd "$repo"
steps_init "$out"

step environment 20 bash -c "date -u; uname -a; nvidia-smi || true; nvidia-smi topo -m || true; lscpu | grep -i -E 'numa|model name|^cpu\(s\)' || true; git -C '$repo' rev-parse HEAD || true
  $py -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available())'
  uptime"

# The two builds run side by side (different --target directories, different build dirs).
build_reference() {
  rm -rf "$work/ref" "$work/refsite" && mkdir -p "$work/ref" &&
    tar xzf "$tarball" -C "$work/ref" &&
    cd "$work/ref"/* &&
    { [ -e kvcached_autopatch.pth ] || : > kvcached_autopatch.pth; } &&  # its setup.py copies this file
    MAX_JOBS=$jobs "$py" -m pip install --no-build-isolation --no-deps --target "$work/refsite" .
}
build_kvcached() {
  rm -rf "$work/oursite" &&
    KVCACHED_GPU_BACKENDS=cuda CMAKE_BUILD_PARALLEL_LEVEL=$jobs "$py" -m pip install --no-build-isolation \
      --no-deps --target "$work/oursite" -C cmake.define.KVCACHED_BUILD_BENCH=ON -C build-dir=build/perf . &&
    "$py" bench/reference/driver_calls.py --build "$work/counter"
}
export -f build_reference build_kvcached
export work tarball py jobs
step build 150 bash -c "build_reference > '$out/build_reference.log' 2>&1 & ref=\$!
  build_kvcached > '$out/build_kvcached.log' 2>&1; ours=\$?
  wait \$ref; echo \"reference build rc=\$? kvcached build rc=\$ours\""
bench_vmm=$(find build/perf -name bench_vmm -type f -perm -u+x 2>/dev/null | head -n 1)
counter="$work/counter/libcuda_call_counter.so"

step side_by_side $(( 75 * rounds + 25 )) "$py" bench/reference/side_by_side.py --out "$out/side_by_side" --rounds "$rounds" \
  --ref-site "$work/refsite" --ours-site "$work/oursite" --device cuda:0 --cpus "${CPUS:-auto}" \
  ${bench_vmm:+--bench-vmm "$bench_vmm"} $( [ -f "$counter" ] && echo --call-counter "$counter" ) \
  --step-timeout-s 45 --deadline-s $(( 65 * rounds ))

step bench_vmm 15 bash -c "'${bench_vmm:-bench_vmm}' --backend cuda --threads 1 --pages 64 --iters 5 &&
  '${bench_vmm:-bench_vmm}' --backend cuda --threads 1 --page-mib 128 --pages 16 --iters 5 &&
  '${bench_vmm:-bench_vmm}' --backend cuda --threads 1 --page-mib 1024 --pages 4 --iters 3"

# The floor of a zero-backed set-up: 128 GiB covered by one zero allocation of each size.
step setup_floor 90 env PYTHONPATH="$work/oursite" "$py" bench/probes/set_access_probe.py --device cuda:0 --cover 128 \
  --rounds 3 --json "$out/setup_floor.json"

# The order of a many-allocation grow's driver calls: creates between the maps or first.
step create_overlap 60 env PYTHONPATH="$work/oursite" "$py" bench/probes/create_overlap_probe.py --device cuda:0 --mib 128 \
  --count 64 --rounds 7 --json "$out/create_overlap.json"

[ "$handover" = 0 ] || step handover 100 env PYTHONPATH="$work/oursite" "$py" bench/e2e/handover.py --device cuda:0 --size 8GiB \
  --handovers 20 --layouts contiguous,per_layer --zero-backing on,off --deadline-s 60 --out "$out/handover"

# The earlier waiter (plain alloc retried every 1 ms), for comparison in the same run.
[ "$handover" = 0 ] || step handover_retry 25 env PYTHONPATH="$work/oursite" "$py" bench/e2e/handover.py --device cuda:0 --size 8GiB \
  --handovers 20 --layouts contiguous --zero-backing on --retry-ms 1 --deadline-s 15 --out "$out/handover_retry"

step summary 5 bash -c "{
  echo '# kvcached vs reference on one GPU, one run'; echo; echo '\`\`\`'; cat '$out/exit_codes.txt'; echo '\`\`\`'; echo
  cat '$out/side_by_side/side_by_side.md' 2>/dev/null || echo '(no side-by-side report)'; echo
  echo '## Memory hand-over, 8 GiB, cuda:0'; echo; cat '$out/handover/handover.md' 2>/dev/null || echo '(none)'; echo
  cat '$out/handover_retry/handover.md' 2>/dev/null | tail -n 1; echo
  echo '## bench_vmm, 1 thread'; echo; echo '\`\`\`'; cat '$out/bench_vmm.log'; echo '\`\`\`'; echo
  echo '## Zero-backed set-up floor'; echo; tail -n 14 '$out/setup_floor.log' 2>/dev/null || echo '(none)'; echo
  echo '## Order of a 64-allocation grow'; echo; tail -n 10 '$out/create_overlap.log' 2>/dev/null || echo '(none)'
} > '$out/SUMMARY.md'; wc -l '$out/SUMMARY.md'"
echo "total seconds=$SECONDS" | tee -a "$out/exit_codes.txt"
