#!/usr/bin/env bash
# Which fresh processes are slow at VMM calls: by the CPU they are pinned to, and unpinned on 0-3 or
# 0-15. Each line: one fresh bench_vmm process (64 allocations of 128 MiB, 3 iterations), its p50 per call.
#
#   bash bench/probes/vmm_process_spread.sh [OUT_DIR]      (on the GPU machine, from the repository root)
set -u
P=${1:-/tmp/vmm-process-spread}; mkdir -p $P
# SUMMARY_ONLY=1: only (re)write OUT_DIR/summary.txt from its *.txt files.
# One line per process: its p50s and what 64 creates, maps and set_access calls cost at them.
summarize() {
  awk '{split($2,c,"="); split($4,p,"="); key=$1" "c[2]; v[key, $3]=p[2]; if (!(key in seen)) {seen[key]=1; order[n++]=key}}
       END {for (i=0; i<n; i++) {k=order[i]; printf "%-8s cpus %-5s create %5.1f  set_access %5.1f  unmap %5.1f  64 x (create+map+set_access) %.2f ms\n",
            substr(k,1,index(k," ")-1), substr(k,index(k," ")+1), v[k,"create"], v[k,"set_access"], v[k,"unmap"],
            64*(v[k,"create"]+v[k,"map"]+v[k,"set_access"])/1000}}' "$@"
}
if [ "${SUMMARY_ONLY:-0}" != 1 ]; then
date -u > $P/env.txt; nproc >> $P/env.txt; lscpu >> $P/env.txt; nvidia-smi topo -m >> $P/env.txt 2>&1
grep -i -E "nvidia|CPU0" /proc/interrupts > $P/irq.txt
for f in /proc/irq/*/smp_affinity_list; do echo "$f $(cat $f)"; done > $P/irq_affinity.txt 2>/dev/null
KVCACHED_GPU_BACKENDS=cuda CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps --target /tmp/os \
  -C cmake.define.KVCACHED_BUILD_BENCH=ON -C build-dir=build/perf . > $P/build.log 2>&1
bv=$(find build/perf -name bench_vmm -type f -perm -u+x | head -1)
echo "bench_vmm=$bv" >> $P/env.txt
run() {  # label cpus
  local out
  out=$(taskset -c "$2" "$bv" --backend cuda --threads 1 --page-mib 128 --pages 64 --iters 3 2>&1)
  echo "$out" | awk -v l="$1" -v c="$2" '$1=="create"||$1=="map"||$1=="set_access"||$1=="unmap"||$1=="release"{printf "%s cpus=%s %s p50=%s avg=%s\n", l, c, $1, $4, $3}'
}
for rep in 1 2; do
  for c in 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15; do run "rep$rep" $c; done
done > $P/pinned.txt
for rep in $(seq 1 24); do run "free$rep" 0-3; done > $P/free03.txt
for rep in $(seq 1 12); do run "all$rep" 0-15; done > $P/free_all.txt
date -u >> $P/env.txt
fi
summarize $P/pinned.txt $P/free03.txt $P/free_all.txt > $P/summary.txt
