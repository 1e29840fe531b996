"""Grouped GEMM: the fprop / dgrad / wgrad products of an MoE layer.

``grouped_gemm`` (api.py) dispatches to the grouped kernels (device-side
group sizes, CUDA-graph safe: lpmoe's own FP8 block-scaled fprop/dgrad and
wgrad kernels, csrc/fp8_gemm, and CUTLASS for the rest), a cuBLASLt per-expert loop, or
the fp64 reference (reference.py, the CPU path); persistent workspaces live
in workspaces.py.
"""
from lpmoe.gemm.api import CALLS, fp8_kernel_config, fp8_kernel_key, fp8_wgrad_kernel_config, grouped_gemm
from lpmoe.gemm.reference import reference_grouped_gemm
from lpmoe.gemm.workspaces import WORKSPACE_BYTES, gemm_workspace, setup_workspace

__all__ = ["grouped_gemm", "reference_grouped_gemm", "gemm_workspace", "setup_workspace", "WORKSPACE_BYTES",
           "CALLS", "fp8_kernel_config", "fp8_wgrad_kernel_config", "fp8_kernel_key"]
