#!/usr/bin/env bash
# GEMM tuning run for the GPU machine: builds the extension with the extra
# configurations (-DLPMOE_GEMM_EXPERIMENTS), checks every named variant
# against the FP8 GEMM tests, times them beside the cuBLASLt loop, and takes
# an Nsight Compute source-level (SASS) stall profile of the wgrad kernels.
#
#   VARIANTS=",pp,coop21+sw4" [FP32_VARIANTS=",pp"] [NCU_VARIANTS="pp default"] [MLP_PROFILE=0] \
#     bash tools/gemm_experiments.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}"
export PATH="/usr/local/cuda/bin:$PATH"
OUT="${OUT:-/tmp/lpmoe_out}"; mkdir -p "$OUT"
VARIANTS="${VARIANTS:-,pp,coop21}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
t0=$(date +%s)
LPMOE_NVCC_EXTRA="-DLPMOE_GEMM_EXPERIMENTS" python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "experiment build: $(( $(date +%s) - t0 )) s"
grep -E "ptxas (warning|info *: \(C75)" "$OUT/build.log" | cut -c1-160 | sort | uniq -c | head

export PYTHONPATH="python:benchmarks:${PYTHONPATH:-}"
IFS=',' read -ra vs <<< "$VARIANTS"
for v in "${vs[@]}"; do
  LPMOE_GEMM_VARIANT="$v" python3 -m pytest -q -x -p no:cacheprovider tests/test_grouped_gemm.py -k "fp8 or graph" \
    2>&1 | tail -2 | sed "s/^/tests variant '${v:-default}': /"
done
python3 benchmarks/bench_grouped_gemm.py --sweep "$VARIANTS" --kinds "${KINDS:-fprop,dgrad,wgrad}" 2>&1 | tee "$OUT/sweep.log"
# the fp32-output wgrad (main_grad accumulation) has its own configurations
[ -n "${FP32_VARIANTS:-}" ] && python3 benchmarks/bench_grouped_gemm.py --sweep "$FP32_VARIANTS" --kinds wgrad --fp32-out \
  2>&1 | sed 's/^sweep/sweep-fp32/' | tee -a "$OUT/sweep.log"

# Source-level stall profile of the wgrad kernel, per named variant.
cat > /tmp/lpmoe_wgrad_prof.py <<'PY'
import torch, lpmoe
from lpmoe import Float8BlockQuantizer as Q
g, k, n, m = 8, 7168, 4096, 4096
first = torch.tensor([m] * g, device="cuda")
x = torch.randn(g * m, k, device="cuda").bfloat16()
dy = torch.randn(g * m, n, device="cuda").bfloat16()
xq = lpmoe.group_quantize(x, Q(block_dim=1), num_tensors=g, first_dims=first)
dyq = lpmoe.group_quantize(dy, Q(block_dim=1), num_tensors=g, first_dims=first)
for _ in range(2):  # the second call is profiled
    lpmoe.grouped_gemm(dyq, xq, kind="wgrad", backend="grouped")
torch.cuda.synchronize()
PY
for v in ${NCU_VARIANTS-pp default}; do
  [ "$v" = default ] && vv="" || vv="$v"
  LPMOE_GEMM_VARIANT="$vv" ncu --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    --section ComputeWorkloadAnalysis -k regex:device_kernel --launch-skip 1 --launch-count 1 -f -o "/tmp/wgrad_$v" \
    python3 /tmp/lpmoe_wgrad_prof.py > "/tmp/ncu_run_$v.txt" 2>&1 || tail -5 "/tmp/ncu_run_$v.txt"
  ncu -i "/tmp/wgrad_$v.ncu-rep" --page details > "$OUT/ncu_details_$v.txt" 2>&1
  echo "== ncu wgrad ($v)"
  grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|Warp Cycles Per Issued|Stall|Tensor|pipe" \
    "$OUT/ncu_details_$v.txt" | cut -c1-150 | head -30
  ncu -i "/tmp/wgrad_$v.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_sass_$v.csv" 2>&1
  python3 - "$OUT/ncu_sass_$v.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
if len(rows) < 2:
    print("no source page:", rows[:3]); sys.exit()
hdr = rows[0]
print("columns:", [h for h in hdr][:40])
samp = next((i for i, h in enumerate(hdr) if "Sampling" in h and "All" in h), None)
src = next((i for i, h in enumerate(hdr) if h in ("Source", "Sass", "SASS")), 1)
if samp is None:
    sys.exit()
num = lambda x: float(x.replace(",", "")) if x.replace(",", "").replace(".", "").isdigit() else None
body = [r for r in rows[1:] if len(r) > samp and num(r[samp]) is not None]
tot = sum(num(r[samp]) for r in body) or 1
for r in sorted(body, key=lambda r: -num(r[samp]))[:36]:
    print(f"{100 * num(r[samp]) / tot:5.1f}%  {r[src][:120]}")
PY
done

# Kernel breakdown of one expert-MLP training step (fp8 and bf16).
[ "${MLP_PROFILE:-1}" = 1 ] && python3 tools/profile_mlp_step.py 8 65536 2>&1 | tail -42
