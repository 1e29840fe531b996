#!/usr/bin/env bash
# A/B timing of two builds on the GPU machine, in alternating processes:
# "old" is the extension carried in .build_carry/ (a previous gpu_check.sh
# run's output), "new" is the one in python/lpmoe (build it first, e.g. with
# `bash tools/gpu_check.sh --no-bench` after moving the old one aside).
#
#   bash tools/ab_builds.sh OLD_SO_XZ ROUNDS python3 benchmarks/bench_x.py [args]
#
# Logs: $OUT/ab_old_<i>.log, $OUT/ab_new_<i>.log (PYTHONPATH set to the
# build's python/ folder plus benchmarks/).
set -uo pipefail
cd "$(dirname "$0")/.."
old_so=$1; rounds=$2; shift 2
OUT="${OUT:-/tmp/lpmoe_out}"; mkdir -p "$OUT"
prev=/tmp/lpmoe_prev
rm -rf "$prev" && mkdir -p "$prev" && cp -r python "$prev/" && rm -f "$prev"/python/lpmoe/_C*.so
xz -dc "$old_so" > "$prev/python/lpmoe/$(basename "$old_so" .xz)"
for i in $(seq 1 "$rounds"); do
  for v in old new; do
    p=python; [ "$v" = old ] && p="$prev/python"
    PYTHONPATH="$p:benchmarks" "$@" > "$OUT/ab_${v}_$i.log" 2>&1 || echo "ab: $v round $i exit $?"
  done
done
