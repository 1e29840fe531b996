#!/usr/bin/env bash
# On the GPU machine, from the repo root, with .peers/DeepGEMM and the CUTLASS
# wheel in /tmp/site: DeepGEMM's anchor fprop under the same ablations,
# interleaved with ours.  OURS / DGS narrow the variant lists; DATA="bits gauss"
# times ours on both kinds of operands.
set -u
python3 tools/fp8_ablation/dg_patch.py > /dev/null
NORUN=1 VARS="${OURS:-base noload nopromo noload_nopromo}" CUTLASS_INC=/tmp/site/cutlass_library/source bash tools/fp8_ablation/build_run.sh > /tmp/ours.txt 2>&1 &
for v in ${DGS:-dgbase dgnoload dgnopromo dgnoload_nopromo}; do
  LPMOE_DEEPGEMM_DIR=$PWD/tools/fp8_ablation/dg/$v DG_JIT_CACHE_DIR=/tmp/dgc_$v PYTHONPATH=/tmp/site:python:benchmarks python3 -c "
import sys; sys.path.insert(0,'benchmarks'); import _deepgemm_peer as d; d.load(); d.precompile([([4096]*8, 7168, 4096)])" > /dev/null 2>&1 &
done
wait
for r in 1 2; do
  for v in ${DGS:-dgbase dgnoload dgnopromo dgnoload_nopromo}; do
    LPMOE_DEEPGEMM_DIR=$PWD/tools/fp8_ablation/dg/$v DG_JIT_CACHE_DIR=/tmp/dgc_$v PYTHONPATH=/tmp/site:python:benchmarks python3 tools/fp8_ablation/dg_time.py $v 2>&1 | tail -3
  done
  for data in ${DATA:-bits}; do  # DATA="bits gauss": ours on both kinds of operands (harness.cu)
    for v in ${OURS:-base noload nopromo noload_nopromo}; do ./tools/fp8_ablation/bin_$v $v 8 4096 7168 4096 $data; done
  done
done
grep -i "fail\|error" /tmp/ours.txt | head
