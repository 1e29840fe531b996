"""The dequantize kernels' output stores, read from the PTX (runs on the CPU:
it compiles, no GPU needed).

Every output vector of the FP8 block, MXFP8 and NVFP4 dequantize kernels is
meant as one 16-byte store.  NVVM had quietly split `*(uint4*)p = v` into
four 4-byte `st.global.u32` (and NVFP4's 16-bit outputs into 4-byte
`st.global.v2.u16`) where the index arithmetic hid the alignment; the
kernels ran at 0.88-0.93 of copy instead of 0.92-0.97 and every bit-exact
test still passed (docs/perf-notes.md, issue 13 stop 58).  They now write
through `store16` (common/vec_io.cuh); this test keeps it that way, and
keeps ptxas from spilling in them (the MXFP8 kernels spilled while a 64-bit
division subroutine was called in their tile lookup).  The activation
backward's high-precision dh goes through `store16` too (stop 60: 534 -> 501
us at 8 x 64k tokens on the H100), and is checked the same way.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess

import pytest

from _cuda_toolchain import CUTLASS, NVCC, ROOT

FILES = ["fp8_block/dequantize.cu", "mxfp8/dequantize.cu", "nvfp4/dequantize.cu"]
# Checked for spills only: NVFP4 quantize holds its 16-bit kernels to 80
# registers (3 CTAs per SM), where a spill would cost quietly.
SPILL_ONLY = ["nvfp4/quantize.cu"]
# Checked for whole 16-byte stores of the high-precision dh only.
ACTIVATION_BACKWARD = "activation/backward.cu"
ENTRY = re.compile(r"^(?:\.visible\s+)?\.entry\s+([^\s(]+)\(")
GLOBAL_STORE = re.compile(r"\bst\.global(?:\.[a-z0-9]+)*")
SIXTEEN_BYTES = re.compile(r"^st\.global(?:\.wb)?\.v4\.(?:u32|b32|f32)$")
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")

pytestmark = pytest.mark.skipif(NVCC is None or CUTLASS is None, reason="needs nvcc and the nvidia-cutlass headers")


def global_stores_by_kernel(ptx: str) -> dict:
    """{kernel entry: [global store instruction, ...]} of a PTX file."""
    stores, entry = {}, None
    for line in ptx.splitlines():
        m = ENTRY.match(line)
        if m:
            entry = m.group(1)
            stores[entry] = []
        elif entry is not None:
            stores[entry] += GLOBAL_STORE.findall(line)
    return stores


def compile_file(rel: str, csrc: str, tmp: str):
    """(PTX text, ptxas's spill report [(stores, loads), ...]) of one source."""
    ptx = os.path.join(tmp, rel.replace("/", "_") + ".ptx")
    # The code-generation flags of setup.py that change the PTX.
    cmd = [NVCC, "-O3", "-std=c++20", "-DNDEBUG", "-diag-suppress=2908", "--expt-relaxed-constexpr",
           "-prec-div=true", "-ftz=false", "-arch=sm_90a", f"-I{csrc}", f"-I{CUTLASS}", "-ptx", "-o", ptx,
           os.path.join(csrc, rel)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    ptxas = os.path.join(os.path.dirname(NVCC), "ptxas")
    rep = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", ptx + ".cubin"], capture_output=True, text=True,
                         timeout=600)
    assert rep.returncode == 0, rep.stderr[-2000:]
    with open(ptx) as f:
        return f.read(), [(int(a), int(b)) for a, b in SPILLS.findall(rep.stderr)]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("stores"))
    csrc = os.path.join(ROOT, "csrc")
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(3, os.cpu_count() or 1))) as pool:
        futures = {rel: pool.submit(compile_file, rel, csrc, tmp) for rel in FILES + SPILL_ONLY + [ACTIVATION_BACKWARD]}
        return {rel: f.result() for rel, f in futures.items()}


@pytest.mark.parametrize("rel", FILES)
def test_dequantize_outputs_leave_as_16_byte_stores(compiled, rel):
    kernels = global_stores_by_kernel(compiled[rel][0])
    dequantize = {k: v for k, v in kernels.items() if "dequantize" in k}
    assert dequantize, f"{rel}: no dequantize kernel found in the PTX"
    for kernel, stores in dequantize.items():
        assert stores, f"{rel}: {kernel} has no global store"
        narrow = sorted({s for s in stores if not SIXTEEN_BYTES.match(s)})
        assert not narrow, (f"{rel}: {kernel} writes its output with {narrow}, not 16-byte vectors: "
                            "write through store16 (see this file's docstring)")


@pytest.mark.parametrize("rel", FILES + SPILL_ONLY)
def test_kernels_do_not_spill(compiled, rel):
    report = compiled[rel][1]
    assert report, f"{rel}: no kernel in ptxas's report"
    assert all(s == 0 and l == 0 for s, l in report), f"{rel}: ptxas spills {report}"


def test_activation_backward_writes_dh_as_16_byte_stores(compiled):
    """The high-precision backward kernels (no FP8 outputs, no sigmoid table:
    ``...ELb0ELb0EE`` in the mangled name) store dh and the d probs partials
    only: dh as whole 16-byte vectors, the partials as fp32 scalars."""
    kernels = global_stores_by_kernel(compiled[ACTIVATION_BACKWARD][0])
    hp = {k: v for k, v in kernels.items() if "backward_kernel" in k and "ELb0ELb0EE" in k}
    assert len(hp) == 10, sorted(hp)  # five kinds x bf16 / fp16
    for kernel, stores in hp.items():
        assert any(SIXTEEN_BYTES.match(s) for s in stores), f"{kernel}: no 16-byte store"
        narrow = sorted({s for s in stores if not SIXTEEN_BYTES.match(s) and s != "st.global.f32"})
        assert not narrow, f"{kernel} writes dh with {narrow}: store_tile<IType, true> (act_tiles.cuh)"
