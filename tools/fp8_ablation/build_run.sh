#!/usr/bin/env bash
# On the GPU machine (from anywhere): build every ablation variant of the
# fprop/dgrad kernel in parallel (patch.py), then time them in interleaved
# rounds on each shape.  Not part of lpmoe's build.
#   VARS="base noload" SHAPES="8 4096 7168 4096,8 4096 2048 7168" bash tools/fp8_ablation/build_run.sh
# A variant named old* is built from old_csrc/ (a copy of csrc/ at an earlier
# commit, e.g. git archive <commit> csrc) with the launcher signature of
# before the TMA-store epilogue (two maps).  A variant named prev is built
# from prev_csrc/ (git archive <commit> csrc, e.g. the parent of a kernel
# change) with today's launcher signature: before/after in one run.
set -u
cd "$(dirname "$0")"
python3 patch.py > /dev/null
if [ -d old_csrc ]; then rm -rf variants/old && mkdir -p variants/old && cp -r old_csrc variants/old/csrc; fi
if [ -d prev_csrc ]; then rm -rf variants/prev && mkdir -p variants/prev && cp -r prev_csrc variants/prev/csrc; fi
CUT=${CUTLASS_INC:-$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source}
FLAGS="-O3 -std=c++20 -DNDEBUG -diag-suppress=2908 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a -I$CUT/include -I$CUT/tools/util/include -lcuda"
VARS=${VARS:-"base nopromo nostore noload noload_nopromo nopromo_nostore"}
for v in $VARS; do
  ( /usr/local/cuda/bin/nvcc $FLAGS $( [[ $v == *trace* ]] && echo -DTRACE ) $( [[ $v == old* ]] && echo -DOLD_SIGNATURE ) -Ivariants/$v/csrc harness.cu variants/$v/csrc/fp8_gemm/tensor_map.cpp -o bin_$v > build_$v.log 2>&1 || echo "BUILD FAIL $v" ) &
done
wait
[ -n "${NORUN:-}" ] && exit 0
SHAPES=${SHAPES:-"8 4096 7168 4096"}
for r in 1 2 3; do while read -r sh; do for v in $VARS; do [ -x bin_$v ] && ./bin_$v $v $sh; done; done <<< "$(echo "$SHAPES" | tr ',' '\n')"; done
