#!/usr/bin/env bash
# Nsight Compute view of the FP8 block-scaled fprop at the anchor shape
# (8 experts x 4096 tokens, K 7168, N 4096): lpmoe's kernel (each
# configuration in FP8_CONFIGS, "width,cluster"), the CUTLASS kernel, and
# DeepGEMM's when .peers/DeepGEMM is present.  GPU machine, built lpmoe.
#   FP8_CONFIGS="192,1 128,1" bash tools/profile_fp8_gemm.sh
# FP8_KIND=wgrad profiles the weight gradient of the same shape instead
# (dW (N x K) = dy^T x, lpmoe's wgrad kernel at each configuration, fp32 out).
# FP8_SOURCE=1 also samples warp stalls per SASS instruction and writes them
# as $OUT/sass_<config>.csv (ncu's source page) for offline reading.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/lpmoe_out}"; mkdir -p "$OUT"
CONFIGS="${FP8_CONFIGS:-192,1 -1,0}"
KIND="${FP8_KIND:-fprop}"
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section MemoryWorkloadAnalysis"
[ "${FP8_SOURCE:-0}" = 1 ] && SECTIONS="$SECTIONS --section SourceCounters"
# ncu report and SASS table of one profiled launch: $1 = name, the rest = command
source_table() {
  local name="$1"; shift
  [ "${FP8_SOURCE:-0}" = 1 ] || return 0
  ncu --page source --csv --print-source sass -i "/tmp/lpmoe_$name.ncu-rep" > "$OUT/sass_$name.csv" 2>/dev/null
}
cat > /tmp/lpmoe_fp8_prof.py <<'PY'
import sys, torch, lpmoe
from lpmoe import Float8BlockQuantizer as Q
from lpmoe.gemm import fp8_kernel_config, fp8_wgrad_kernel_config
width, cluster = (int(v) for v in sys.argv[1].split(","))
kind = sys.argv[2]
g, k, n, m = 8, 7168, 4096, 4096
first = torch.tensor([m] * g, device="cuda")
x = torch.randn(g * m, k, device="cuda").bfloat16()
xq = lpmoe.group_quantize(x, Q(block_dim=1), num_tensors=g, first_dims=first)
if kind == "wgrad":
    dy = torch.randn(g * m, n, device="cuda").bfloat16()
    a, b = lpmoe.group_quantize(dy, Q(block_dim=1), num_tensors=g, first_dims=first), xq
    pin = fp8_wgrad_kernel_config(width, cluster)
else:
    w = (torch.randn(g, n, k, device="cuda") * 0.02).bfloat16()
    a, b = xq, lpmoe.group_quantize(w.view(g * n, k), Q(block_dim=2), num_tensors=g)
    pin = fp8_kernel_config(width, cluster)
with pin:
    for _ in range(3):  # the third call is profiled
        lpmoe.grouped_gemm(a, b, kind=kind, backend="grouped",
                           out_dtype=torch.float32 if kind == "wgrad" else None)
torch.cuda.synchronize()
PY
keep='Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Stall|Tensor|Registers|L1/TEX Hit|L2 Hit|smsp__pcsamp'
for cfg in $CONFIGS; do
  echo "== lpmoe $KIND config $cfg"
  regex='fp8_block_scaled'; [ "$KIND" = wgrad ] && regex='fp8_block_wgrad'
  [ "${cfg%%,*}" = "-1" ] && regex='device_kernel'
  name="${KIND}_${cfg/,/_}"
  PYTHONPATH=python ncu $SECTIONS -k regex:"$regex" --launch-skip 2 --launch-count 1 -f -o "/tmp/lpmoe_$name" \
    python3 /tmp/lpmoe_fp8_prof.py "$cfg" "$KIND" > /dev/null 2>&1
  ncu -i "/tmp/lpmoe_$name.ncu-rep" > "$OUT/ncu_fp8_$name.txt" 2>&1
  grep -E "$keep" "$OUT/ncu_fp8_$name.txt" | cut -c1-130 | head -40
  source_table "$name"
done
if [ -d .peers/DeepGEMM ] && [ "$KIND" = fprop ]; then
  echo "== DeepGEMM fprop (anchor)"
  ncu $SECTIONS -k regex:"fp8_gemm" --launch-skip 10 --launch-count 1 -f -o /tmp/lpmoe_deepgemm \
    python3 benchmarks/_deepgemm_peer.py --time > /dev/null 2>&1
  ncu -i /tmp/lpmoe_deepgemm.ncu-rep > "$OUT/ncu_fp8_deepgemm.txt" 2>&1
  grep -E "$keep" "$OUT/ncu_fp8_deepgemm.txt" | cut -c1-130 | head -40
  source_table deepgemm
fi
