#!/usr/bin/env bash
# Nsight Compute metrics of every quantize/dequantize kernel family on one
# large grouped case (64k x 7168 bf16, 64 members), beside the device copy
# (GPU machine).  Prints one block per kernel: time, DRAM throughput, occupancy,
# registers, and the top warp-stall reasons (cycles per issued instruction).
#   OUT=/tmp/o bash tools/profile_quantize.sh [kernel-regex]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/lpmoe_out}"; mkdir -p "$OUT"
REGEX="${1:-quantize|dequantize|copy|elementwise}"
cat > /tmp/lpmoe_prof_q.py <<'PY'
import torch, lpmoe
from lpmoe import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer
x = torch.randn(65536, 7168, device="cuda", dtype=torch.bfloat16)
fd = torch.tensor([1024] * 64, device="cuda")
y = torch.empty_like(x); y.copy_(x)
for q in (Float8BlockQuantizer(block_dim=1), Float8BlockQuantizer(block_dim=2),
          Float8BlockQuantizer(columnwise=False), MXFP8Quantizer(swizzled_scales=True),
          NVFP4Quantizer(swizzled_scales=True)):
    g = lpmoe.group_quantize(x, q, 64, first_dims=fd)
lpmoe.group_quantize_dbias(x, Float8BlockQuantizer(block_dim=1), 64, first_dims=fd)
r = lpmoe.group_quantize(x, Float8BlockQuantizer(columnwise=False), 64, first_dims=fd)
lpmoe.group_dequantize(r, torch.bfloat16)
c = lpmoe.group_quantize(x, Float8BlockQuantizer(rowwise=False), 64, first_dims=fd)
lpmoe.group_dequantize(c, torch.bfloat16)
torch.cuda.synchronize()
PY
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum
M=$M,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers
M=$M,launch__occupancy_limit_shared_mem,launch__grid_size,launch__block_size,smsp__inst_executed.sum
M=$M,smsp__average_warp_latency_per_inst_issued.ratio,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
for s in long_scoreboard barrier lg_throttle mio_throttle short_scoreboard wait math_pipe_throttle not_selected selected drain membar stall_no_instruction tex_throttle dispatch_stall; do
  M=$M,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio
done
PYTHONPATH=python ncu --metrics "$M" -k regex:"$REGEX" python3 /tmp/lpmoe_prof_q.py > "$OUT/ncu_quantize.txt" 2>&1
grep -vE "^==PROF==" "$OUT/ncu_quantize.txt" | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -400
