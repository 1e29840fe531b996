"""Pure-PyTorch, bit-exact references of lpmoe's low-precision formats (single tensor).

See formats.md §0-3, §8-9 (numerics spec).  Modules:
  numerics   shared primitives (FP8 satfinite cast, block scale, E8M0, E2M1)
  swizzle    GEMM 128x4 scale swizzle (§2.3)
  fp8_block  FP8 1x128 / 128x128 block scaling (§1)
  mxfp8      MXFP8 1x32 / 32x1 with E8M0 scales (§2)
  nvfp4      NVFP4 1x16 with E4M3 scales and a global amax (§3)
  optim      the fused AdamW step's arithmetic (lpmoe.optim)
"""
from .fp8_block import (
    Fp8BlockQuantized,
    block_scale_shape,
    dequantize_fp8_block,
    quantize_fp8_block,
)
from .mxfp8 import MXFP8Quantized, dequantize_mxfp8, mxfp8_scale_shape, quantize_mxfp8
from .numerics import (
    E2M1_MAX,
    FLT_MAX,
    FP8_MAX,
    INPUT_DTYPE_MAX,
    cast_to_fp8_satfinite,
    ceil_div,
    compute_block_scale,
    e2m1_decode,
    e2m1_encode,
    exp2f,
    exp2f_rcp,
    float_to_e8m0,
    nan_ignoring_amax,
    nan_to_zero_abs,
    pack_e2m1,
    round_up,
    unpack_e2m1,
)
from .nvfp4 import NVFP4Quantized, dequantize_nvfp4, nvfp4_scale_shape, quantize_nvfp4
from .optim import AdamWScalars, adamw_scalars, adamw_step_
from .swizzle import swizzle_scales, swizzled_index, unswizzle_scales

__all__ = [
    "AdamWScalars",
    "adamw_scalars",
    "adamw_step_",
    "E2M1_MAX", "FLT_MAX", "FP8_MAX", "INPUT_DTYPE_MAX",
    "nan_to_zero_abs", "nan_ignoring_amax", "cast_to_fp8_satfinite", "compute_block_scale",
    "float_to_e8m0", "exp2f_rcp", "exp2f", "e2m1_encode", "e2m1_decode", "pack_e2m1",
    "unpack_e2m1", "round_up", "ceil_div",
    "swizzle_scales", "unswizzle_scales", "swizzled_index",
    "Fp8BlockQuantized", "quantize_fp8_block", "dequantize_fp8_block", "block_scale_shape",
    "MXFP8Quantized", "quantize_mxfp8", "dequantize_mxfp8", "mxfp8_scale_shape",
    "NVFP4Quantized", "quantize_nvfp4", "dequantize_nvfp4", "nvfp4_scale_shape",
]
