"""Build script for lpmoe.

The CUDA extension ``lpmoe._C`` is built with ``torch.utils.cpp_extension``.
Torch must be importable while building (it provides the headers, the ABI
flags and the CUDA arch handling), so install with build isolation off:

    pip install --no-build-isolation .

Environment:
  TORCH_CUDA_ARCH_LIST  GPU targets; defaults to "9.0a" (Hopper, wgmma/TMA).
                        Add Blackwell with "9.0a;10.0a".  No GPU is needed
                        to build: nothing is detected from the machine.
  MAX_JOBS              parallel compile jobs (honoured by torch's ninja
                        build).
  LPMOE_DEBUG=1         -O0 -G style device debug build (slow).
  LPMOE_NVCC_EXTRA      extra nvcc flags (-DLPMOE_GEMM_EXPERIMENTS: GEMM tuning build).
"""
import glob
import os

from setuptools import find_packages, setup

try:
    import torch  # noqa: F401
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    raise RuntimeError(
        "lpmoe needs PyTorch importable at build time. Install torch first, then "
        "build without isolation: pip install --no-build-isolation ."
    ) from exc

HERE = os.path.dirname(os.path.abspath(__file__))

# Never probe the (possibly absent) GPU: default to Hopper's arch-specific target.
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")


def _sources():
    # Pure CUDA kernels (no torch headers) live in family folders; the thin
    # ATen/pybind11 layer lives in csrc/binding.
    kernels = sorted(glob.glob(os.path.join("csrc", "*", "*.cu")))
    kernels += sorted(p for p in glob.glob(os.path.join("csrc", "*", "*.cpp")) if os.sep + "binding" + os.sep not in p)
    binding = sorted(glob.glob(os.path.join("csrc", "binding", "*.cpp")))
    return kernels + binding


def _cutlass_include():
    """Headers of the nvidia-cutlass PyPI package (found without importing it:
    its Python side needs packages a header-only build does not)."""
    import importlib.util

    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("lpmoe needs the CUTLASS headers of the nvidia-cutlass package: pip install nvidia-cutlass")
    base = list(spec.submodule_search_locations)[0]
    cands = [os.path.join(base, "source", "include"), os.path.join(base, "source", "tools", "util", "include")]
    return [c for c in cands if os.path.isdir(c)]


debug = os.environ.get("LPMOE_DEBUG", "0") == "1"
opt = ["-O0", "-g"] if debug else ["-O3"]
nvcc_flags = opt + [
    "-std=c++20",
    # No device asserts: CUTLASS's would turn into calls that serialize the
    # wgmma pipeline (ptxas C7510).
    "-DNDEBUG",
    "-diag-suppress=2908",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    # IEEE division/sqrt and no flush-to-zero: the formats rely on fp32
    # subnormal scales (2^-127) and exact division (formats.md §0, §1.1).
    "-prec-div=true",
    "-ftz=false",
    "-Xptxas=-warn-spills",
]
if debug:
    nvcc_flags.append("-G")
# Extra nvcc flags, e.g. -DLPMOE_GEMM_EXPERIMENTS for GEMM tuning builds.
nvcc_flags += os.environ.get("LPMOE_NVCC_EXTRA", "").split()

ext = CUDAExtension(
    name="lpmoe._C",
    sources=_sources(),
    include_dirs=[os.path.join(HERE, "csrc")] + _cutlass_include(),
    extra_compile_args={"cxx": opt + ["-std=c++20"], "nvcc": nvcc_flags},
    libraries=["cublasLt", "cublas"],
)

setup(
    name="lpmoe",
    version="0.1.0",
    description="Low-precision (FP8 block, MXFP8, NVFP4) grouped MoE layers for PyTorch on Hopper",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
)
