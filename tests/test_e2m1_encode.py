"""The E2M1 encode of NVFP4 quantize, checked on the CPU for every fp32 input.

`common/mx_numerics.cuh` rounds to E2M1 with a few float and integer
operations and no branch (NVFP4 quantize on Hopper is bound by instruction
issue and encodes every element twice).
The same source compiles into a host program (tests/host/e2m1_encode_check.cu)
that compares it with formats.md §0's definition, a count of the rounding
thresholds, for all 2^32 bit patterns, and the eight-code packing against
single encodes.  The GPU tests compare the kernels' bytes with the Python
reference on chosen values; this covers the rest.
"""
from __future__ import annotations

import os
import subprocess

import pytest

from _cuda_toolchain import NVCC, ROOT

pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc")


def test_e2m1_encode_every_fp32(tmp_path):
    exe = tmp_path / "e2m1_encode_check"
    src = os.path.join(ROOT, "tests", "host", "e2m1_encode_check.cu")
    # No contraction on the host: Veltkamp's split needs its multiply and
    # subtraction rounded apart (the device code uses _rn intrinsics).
    build = subprocess.run([NVCC, "-O2", "-std=c++20", "--expt-relaxed-constexpr", "-Xcompiler", "-ffp-contract=off",
                            "-I", os.path.join(ROOT, "csrc"), "-o", str(exe), src, "-lpthread"],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
