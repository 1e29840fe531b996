"""The E2M1 encode of NVFP4 quantize, checked on the CPU for every fp32 input.

`common/mx_numerics.cuh` rounds to E2M1 with bit arithmetic (NVFP4 quantize
on Hopper is bound by instruction issue, and this runs twice per element).
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
    subprocess.run([NVCC, "-O2", "-std=c++20", "-I", os.path.join(ROOT, "csrc"), "-o", str(exe), src, "-lpthread"],
                   check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
