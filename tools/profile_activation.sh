#!/usr/bin/env bash
# ncu summary of the fused activation kernels (GPU machine): one FP8 forward
# and one FP8 backward launch at DeepSeek-V3 expert shapes (8 experts x 64k
# tokens, F = 2048, SwiGLU, probs), speed of light, occupancy, launch
# configuration and warp stall reasons.
#
#   bash tools/profile_activation.sh        (after a build; needs ncu)
# ACT_SOURCE=1 also writes ncu's per-SASS-instruction table of each launch
# (executed instructions, stall samples) to $OUT/sass_act_{forward,backward}.csv.gz
# for offline reading (tools/sass_stalls.py, or grouping by opcode).
set -uo pipefail
cd "$(dirname "$0")/.."
NCU=${NCU:-$(command -v ncu || echo /opt/nvidia/nsight-compute/2025.3.1/ncu)}
cat > /tmp/lpmoe_act_once.py <<'PY'
import torch
from lpmoe.activation import Activation, kernels
from lpmoe.quantizers import Float8BlockQuantizer
q = Float8BlockQuantizer(torch.float8_e4m3fn, block_dim=1)
t, f, g = 65536, 2048, 8
h = torch.randn(t, 2 * f, device="cuda", dtype=torch.bfloat16)
da = torch.randn(t, f, device="cuda", dtype=torch.bfloat16)
p = torch.rand(t, device="cuda")
sp = torch.full((g,), t // g, device="cuda")
kernels.forward(h, Activation("swiglu"), p, sp, write_hp=False, quantizer=q)
kernels.backward(da, h, Activation("swiglu"), p, sp, dh_quantizer=q, dbias=True)
torch.cuda.synchronize()
PY
SECTIONS="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis --section InstructionStats"
PYTHONPATH=python "$NCU" --clock-control none -k regex:"(forward|backward)_kernel" -c 2 $SECTIONS \
  python3 /tmp/lpmoe_act_once.py 2>&1 | grep -vE "^==PROF==|^\s*$|----" | cut -c1-160
if [ "${ACT_SOURCE:-0}" = 1 ]; then
  OUT="${OUT:-/tmp/lpmoe_out}"; mkdir -p "$OUT"
  for k in forward backward; do
    PYTHONPATH=python "$NCU" --clock-control none -k regex:"${k}_kernel" -c 1 --section SourceCounters \
      --section WarpStateStats -f -o "/tmp/lpmoe_act_$k" python3 /tmp/lpmoe_act_once.py > /dev/null 2>&1
    "$NCU" --page source --csv --print-source sass -i "/tmp/lpmoe_act_$k.ncu-rep" 2>/dev/null | gzip > "$OUT/sass_act_$k.csv.gz"
  done
fi
