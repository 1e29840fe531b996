"""Where the CPU-side kernel checks (ptxas reports, PTX reads) find the CUDA
compiler and the CUTLASS headers; None where this machine has none."""
from __future__ import annotations

import importlib.util
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else None


def _cutlass_include():
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "source", "include")
    return path if os.path.isdir(path) else None


NVCC, CUTLASS = _nvcc(), _cutlass_include()
