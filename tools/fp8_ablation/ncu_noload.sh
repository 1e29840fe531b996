#!/usr/bin/env bash
# On the GPU machine, from the repo root (.peers/DeepGEMM, the CUTLASS wheel in
# /tmp/site, built lpmoe): Nsight Compute at base clocks of the compute-only
# ("noload") anchor fprop, lpmoe's n160c2 (DeepGEMM's tile) and DeepGEMM's, on
# quantized-Gaussian operands; reports to $OUT/ncu_{ours,dg}.txt.  With the
# clock locked, a time difference is a cycle difference, not power.
set -u
OUT="${OUT:-/tmp/lpmoe_out}"; mkdir -p "$OUT"
python3 tools/fp8_ablation/dg_patch.py > /dev/null
NORUN=1 VARS="noload" CUTLASS_INC=/tmp/site/cutlass_library/source bash tools/fp8_ablation/build_run.sh
export LPMOE_DEEPGEMM_DIR=$PWD/tools/fp8_ablation/dg/dgnoload DG_JIT_CACHE_DIR=/tmp/dgc_dgnoload PYTHONPATH=/tmp/site:python:benchmarks
python3 tools/fp8_ablation/dg_time.py dgnoload | tail -1   # JIT build, and the unprofiled time
S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats --section LaunchStats --section Occupancy"
# harness launches per configuration: 5 warm-up + 70 timed; n160c2 is the third
ncu $S -k regex:fp8_block_scaled --launch-skip 155 --launch-count 1 -f -o /tmp/ncu_ours \
  ./tools/fp8_ablation/bin_noload noload 8 4096 7168 4096 gauss > /dev/null 2>&1
ncu $S -k regex:fp8_gemm --launch-skip 10 --launch-count 1 -f -o /tmp/ncu_dg python3 tools/fp8_ablation/dg_time.py dgnoload > /dev/null 2>&1
keep='Duration|SM Frequency|Elapsed Cycles|Executed Ipc A|Issue Slots Busy|Warp Cycles Per Issued|Executed Instructions  |Registers Per|Block Size|Grid Size|Stall|Tensor|No Eligible|Active Warps Per'
for r in ours dg; do
  ncu -i /tmp/ncu_$r.ncu-rep --print-details all > "$OUT/ncu_$r.txt" 2>&1
  echo "== $r"; grep -E "$keep" "$OUT/ncu_$r.txt" | sed 's/  */ /g' | cut -c1-110 | head -40
done
