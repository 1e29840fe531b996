"""ptxas's register report for the FP8 GEMM kernels (runs on the CPU: it
compiles, no GPU needed).

A K loop that spills costs the tensor pipe 5-25 % and nothing else notices
it: every correctness test still passes.  It happened twice (docs/
fp8-gemm-kernel-notes.md, stops 33-34): an unrolled loop with an exit on its
path (`__trap()`) was held to the launch bound's 168 registers instead of
the 224 that setmaxnreg then gave and spilled 0.7-3.8 KB per thread; a scale pair read one
step too early spilled inside the n192c1 loop.  Each configuration is
compiled alone for sm_90a with the extension's code-generation flags, and
ptxas must report no spill at all: the last small ones (28-108 bytes in the
width-192 fprop kernels, outside the K loop, with a 56 / 224 register split)
went with the 40 / 232 split, which (with the stmatrix strip) took 2.7-2.8 %
off those kernels' compute-only time (stop 35).
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess

import pytest

from _cuda_toolchain import CUTLASS, NVCC, ROOT

# Bytes of spill stores / loads per thread a configuration may report.
MAX_SPILL_BYTES = 0

# (kind, width, cluster, variant): the wgrad kernel has a main_grad
# (fp32 accumulate) instantiation beside the one every other output runs.
JOBS = ([("fprop", w, c, "") for w in (128, 160, 192) for c in (1, 2)] +
        [("wgrad", w, c, v) for w in (128, 192) for c in (1, 2) for v in ("false", "true")])


def _job_id(job):
    return f"{job[0]}-n{job[1]}c{job[2]}" + ("-fp32acc" if job[3] == "true" else "")


pytestmark = pytest.mark.skipif(NVCC is None or CUTLASS is None, reason="needs nvcc and the nvidia-cutlass headers")

SOURCES = {
    "fprop": ('#include "fp8_gemm/launch.cuh"\nnamespace lpmoe { namespace fp8_gemm {\n'
              "template cudaError_t launch_block_scaled<WIDTH, CLUSTER>(const CUtensorMap&, const CUtensorMap&, "
              "const CUtensorMap&, const BlockScaledParams&, int, cudaStream_t);\n} }\n"),
    "wgrad": ('#include "fp8_gemm/wgrad_launch.cuh"\nnamespace lpmoe { namespace fp8_gemm {\n'
              "template cudaError_t launch_wgrad<WIDTH, CLUSTER, VARIANT>(const WgradParams&, int, cudaStream_t);\n} }\n"),
}
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_spills(kind, width, cluster, variant, tmp):
    """(spill store bytes, spill load bytes) of one kernel configuration."""
    src = os.path.join(tmp, f"{kind}_{width}_{cluster}{variant}.cu")
    with open(src, "w") as f:
        f.write(SOURCES[kind].replace("WIDTH", str(width)).replace("CLUSTER", str(cluster)).replace("VARIANT", variant))
    # The code-generation flags of setup.py that change what ptxas sees.
    cmd = [NVCC, "-O3", "-std=c++20", "-DNDEBUG", "-diag-suppress=2908", "--expt-relaxed-constexpr",
           "-prec-div=true", "-ftz=false", "-gencode", "arch=compute_90a,code=sm_90a",
           f"-I{os.path.join(ROOT, 'csrc')}", f"-I{CUTLASS}", "-cubin", "-o", src + ".cubin", src, "-Xptxas", "-v"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    found = SPILLS.findall(out.stderr)
    # The cluster-1 main_grad launch instantiates two kernels: round-robin
    # tiles and tiles from the counter (tile_feed.cuh).
    kernels = 2 if (kind, cluster, variant) == ("wgrad", 1, "true") else 1
    assert len(found) == kernels, f"expected {kernels} kernel(s) in ptxas's report:\n{out.stderr[-2000:]}"
    serialized = [line for line in out.stderr.splitlines() if "wgmma" in line and "serialized" in line]
    return ([(int(a), int(b)) for a, b in found], serialized)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("spills"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        futures = {job: pool.submit(ptxas_spills, *job, tmp) for job in JOBS}
        return {job: f.result() for job, f in futures.items()}


@pytest.mark.parametrize("job", JOBS, ids=_job_id)
def test_fp8_gemm_kernel_spills_stay_small(reports, job):
    for kernel, (stores, loads) in enumerate(reports[job][0]):
        assert stores <= MAX_SPILL_BYTES and loads <= MAX_SPILL_BYTES, (
            f"{job}, kernel {kernel} in ptxas's report: spills {stores} bytes stored / {loads} loaded per thread "
            f"(bound {MAX_SPILL_BYTES}); a spilling K loop costs the tensor pipe 5-25 % (see this file's docstring)")


@pytest.mark.parametrize("job", JOBS, ids=_job_id)
def test_fp8_gemm_kernel_wgmmas_stay_asynchronous(reports, job):
    """ptxas serializes a kernel's wgmmas ("(C751x) Potential Performance
    Loss: wgmma.mma_async instructions are serialized due to ...") when it
    cannot keep the accumulator registers untouched between issue and wait;
    the wgrad K loop now releases a stage between the two (wgrad_kernel.cuh),
    and a change there that trips this would cost the tensor pipe its overlap
    silently.  (Checked that it fires: reading one accumulator register
    between the wgrad K loop's issue and wait gives C7511 on both width-192
    kernels.)"""
    assert not reports[job][1], f"{job}: " + "; ".join(reports[job][1])
