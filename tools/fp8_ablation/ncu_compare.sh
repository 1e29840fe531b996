#!/usr/bin/env bash
# On the GPU machine, from the repo root (the CUTLASS wheel in /tmp/site;
# .peers/DeepGEMM for the dg* variants): Nsight Compute at base clocks (so a
# time difference is a cycle difference, not power) of the anchor fprop on
# quantized-Gaussian operands, for each harness variant in VARS at each
# configuration in CFGS (index into the harness's list: 0 n192c2, 1 n192c1,
# 2 n160c2, 3 n128c2, 4 n128c1) and each DeepGEMM variant in DGS.
#   VARS="prev base prev_noload noload" CFGS="0 2" DGS="dgbase dgnoload" bash tools/fp8_ablation/ncu_compare.sh
set -u
OUT="${OUT:-/tmp/lpmoe_out}"; mkdir -p "$OUT"
VARS=${VARS:-"base noload"}; CFGS=${CFGS:-"0 2"}; DGS=${DGS:-}
NORUN=1 VARS="$VARS" CUTLASS_INC=/tmp/site/cutlass_library/source bash tools/fp8_ablation/build_run.sh
S="--section SpeedOfLight --section InstructionStats --section WarpStateStats"
keep='SM Frequency|Elapsed Cycles|Duration|Executed Instructions  |Warp Cycles Per Issued|Issue Slots Busy'
report() { ncu -i "$1" --print-details all 2>&1 | grep -E "$keep" | sed 's/  */ /g' | tr '\n' ';' | cut -c1-400; echo; }
for v in $VARS; do
  for c in $CFGS; do  # harness launches per configuration: 5 warm-up + 70 timed
    ncu $S -k regex:fp8_block_scaled --launch-skip $((75 * c + 40)) --launch-count 1 -f -o /tmp/ncu_${v}_$c \
      ./tools/fp8_ablation/bin_$v $v 8 4096 7168 4096 gauss > /dev/null 2>&1
    echo "== $v cfg $c: $(report /tmp/ncu_${v}_$c.ncu-rep)"
  done
done
if [ -n "$DGS" ]; then
  python3 tools/fp8_ablation/dg_patch.py > /dev/null
  for v in $DGS; do
    export LPMOE_DEEPGEMM_DIR=$PWD/tools/fp8_ablation/dg/$v DG_JIT_CACHE_DIR=/tmp/dgc_$v PYTHONPATH=/tmp/site:python:benchmarks
    python3 tools/fp8_ablation/dg_time.py $v | tail -1   # JIT build, and the unprofiled time
    ncu $S -k regex:fp8_gemm --launch-skip 10 --launch-count 1 -f -o /tmp/ncu_$v python3 tools/fp8_ablation/dg_time.py $v > /dev/null 2>&1
    echo "== $v: $(report /tmp/ncu_$v.ncu-rep)"
  done
fi
