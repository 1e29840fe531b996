#!/usr/bin/env bash
# Expert parallelism on a machine with >= 2 GPUs (nvidia-h200-x2): build and
# the MoE tests (tools/gpu_check.sh; the NCCL tests run when two GPUs are
# seen), the example under torchrun in every dispatch mode, and the EP
# benchmark.  Extra arguments go to benchmarks/bench_moe_ep.py; logs land in
# $OUT.
#
#   bash tools/gpu_ep_check.sh [--tokens 8192 16384]
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off on shared multi-GPU hosts (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OUT="${OUT:-/tmp/lpmoe_out}"; mkdir -p "$OUT"
nvidia-smi topo -m 2>&1 | head -6
rc=0
LPMOE_TESTS="${LPMOE_TESTS:-tests/test_moe_layer.py}" bash tools/gpu_check.sh --no-bench > "$OUT/gpu_check.log" 2>&1 || rc=1
echo "gpu_check exit $rc"; sed -n '/lpmoe GPU summary/,$p' "$OUT/gpu_check.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log"
# the failures' own lines here: $OUT holds too many files for all of them to come back
grep -E "^E  .*(Error|error|Exception|assert)" "$OUT/pytest.log" | grep -v "ProcessRaisedException" | head -20
nproc=$(python3 -c "import torch; print(torch.cuda.device_count())")
run="python3 -m torch.distributed.run --nproc_per_node $nproc"
i=0
for extra in "" "--capacity-factor 1.25" "--capacity-factor 1.25 --dispatch-fp8" "--fp8"; do
  i=$((i + 1))
  PYTHONPATH=python $run examples/moe_layer.py --ep $extra > "$OUT/example_ep_$i.log" 2>&1
  e=$?; [ $e = 0 ] || rc=1
  echo "examples/moe_layer.py --ep $extra: exit $e | $(grep 'tokens/s' "$OUT/example_ep_$i.log" | tail -1)"
done
PYTHONPATH=python:benchmarks $run benchmarks/bench_moe_ep.py --summary "$OUT/bench_moe_ep.summary" "$@" > "$OUT/bench_moe_ep.log" 2>&1
e=$?; [ $e = 0 ] || rc=1
echo "bench_moe_ep exit $e"
grep -E "^(T/GPU|all_to_all|[0-9] x )" "$OUT/bench_moe_ep.log" || tail -30 "$OUT/bench_moe_ep.log"
exit $rc
