#!/usr/bin/env bash
# One command for the GPU machine: build (all cores), GPU tests, benchmarks,
# and a short summary table printed last.
#
#   bash tools/gpu_check.sh [--no-bench] [--bench-only] [--no-examples]
#   LPMOE_TESTS="tests/x.py" LPMOE_BENCH="benchmarks/bench_y.py" narrow a run.
#
# A build from an earlier run can be reused: the script copies the built
# extension (stripped, xz-compressed) and a hash of the sources to $OUT/
# (when OUT is set); put them in .build_carry/ and carry that folder, and a
# run with unchanged sources skips the build.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}"
export PATH="/usr/local/cuda/bin:$PATH"
OUT="${OUT:-/tmp/lpmoe_out}"; mkdir -p "$OUT"
RUN_TESTS=1; RUN_BENCH=1; RUN_EXAMPLES=1
for a in "$@"; do
  case "$a" in
    --no-bench) RUN_BENCH=0 ;;
    --bench-only) RUN_TESTS=0 ;;
    --no-examples) RUN_EXAMPLES=0 ;;  # tests only: saves the examples' 2-4 min of device time
  esac
done
summary=()
# CUTLASS headers (nvidia-cutlass) travel as a wheel in .whl/ (no network there).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi

src_hash=$( (cat setup.py; find csrc -type f | LC_ALL=C sort | xargs cat) | sha256sum | cut -c1-16)
t0=$(date +%s)
so_glob="python/lpmoe/_C*.so"
if ls .build_carry/_C*.so.xz >/dev/null 2>&1 && [ "$(cat .build_carry/SRC_HASH 2>/dev/null)" = "$src_hash" ]; then
  for z in .build_carry/_C*.so.xz; do xz -dc "$z" > "python/lpmoe/$(basename "$z" .xz)"; done && build="reused ($src_hash)"
else
  if python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    build="built in $(( $(date +%s) - t0 )) s"
  else
    tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
  fi
fi
# Stripped and compressed, the extension fits what comes back through $OUT
# (16 MiB per file; the stripped .so alone is larger).
for so in $so_glob; do
  strip --strip-debug -o "/tmp/$(basename "$so")" "$so" 2>/dev/null || cp "$so" /tmp/
  xz -6 -T0 -c "/tmp/$(basename "$so")" > "$OUT/$(basename "$so").xz"
done
echo "$src_hash" > "$OUT/SRC_HASH"
summary+=("build|$build")
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

rc=0
if [ "$RUN_TESTS" = 1 ]; then
  PYTHONPATH=python python3 -m pytest -q -rfE -p no:cacheprovider ${LPMOE_TESTS:-tests} --maxfail=25 2>&1 | tee "$OUT/pytest.log" | tail -25
  rc=${PIPESTATUS[0]}
  summary+=("tests|$(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$OUT/pytest.log" | tail -1)")
fi
if [ "$RUN_TESTS" = 1 ] && [ "$RUN_EXAMPLES" = 1 ]; then
  PYTHONPATH=python python3 examples/demo.py 2>&1 | tee "$OUT/demo.log" | tail -8
  summary+=("demo (examples/demo.py)|exit ${PIPESTATUS[0]}")
  for extra in "" "--graphs"; do
    PYTHONPATH=python python3 examples/moe_mlp.py $extra 2>&1 | tee "$OUT/moe_mlp$extra.log" | tail -4
    summary+=("examples/moe_mlp.py $extra|exit ${PIPESTATUS[0]}: $(grep -i 'tokens/s' "$OUT/moe_mlp$extra.log" | tail -1 | cut -c1-60)")
  done
  for extra in "--graphs" "--graphs --fp8"; do
    PYTHONPATH=python python3 examples/moe_layer.py $extra 2>&1 | tee "$OUT/moe_layer.log" | tail -2
    summary+=("examples/moe_layer.py $extra|exit ${PIPESTATUS[0]}: $(grep -i 'tokens/s' "$OUT/moe_layer.log" | tail -1 | cut -c1-70)")
  done
fi
if [ "$RUN_BENCH" = 1 ]; then
  for b in ${LPMOE_BENCH:-benchmarks/bench_*.py}; do
    [ -f "$b" ] || continue
    name=$(basename "$b" .py)
    PYTHONPATH=python:benchmarks timeout 300 python3 "$b" --summary "$OUT/$name.summary" 2>&1 | tee "$OUT/$name.log" | tail -40
    [ -f "$OUT/$name.summary" ] && while IFS= read -r line; do summary+=("$line"); done < "$OUT/$name.summary"
  done
fi

echo
echo "================ lpmoe GPU summary ================"
for row in "${summary[@]}"; do printf '%-34s %s\n' "${row%%|*}" "${row#*|}"; done
exit $rc
