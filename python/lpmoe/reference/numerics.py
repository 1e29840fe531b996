"""Bit-exact scalar primitives shared by every reference format (formats.md §0).

Everything here is vectorised and device-agnostic (CPU or CUDA tensors).  All
arithmetic is done on explicit fp32 tensors of the operand's shape so that each
operation is a single IEEE round-to-nearest-even step, exactly like the CUDA
kernels.  In particular we never divide a tensor by a Python scalar: on CUDA
PyTorch turns ``t / scalar`` into ``t * (1 / scalar)``, which rounds twice.
"""
from __future__ import annotations

from typing import Tuple

import torch

__all__ = [
    "FP8_MAX",
    "E2M1_MAX",
    "FLT_MAX",
    "INPUT_DTYPE_MAX",
    "E2M1_VALUES",
    "check_float_matrix",
    "check_fp8_dtype",
    "round_up",
    "ceil_div",
    "zero_pad_2d",
    "nan_to_zero_abs",
    "nan_ignoring_amax",
    "fp32_rcp_of",
    "fp32_div",
    "cast_to_fp8_satfinite",
    "compute_block_scale",
    "float_to_e8m0",
    "exp2f_rcp",
    "exp2f",
    "e2m1_encode",
    "e2m1_decode",
    "pack_e2m1",
    "unpack_e2m1",
]

# Max finite values (§0, TE TypeExtrema).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
E2M1_MAX = 6.0
FLT_MAX = torch.finfo(torch.float32).max
INPUT_DTYPE_MAX = {
    torch.bfloat16: float.fromhex("0x1.FEp127"),
    torch.float16: 65504.0,
    torch.float32: FLT_MAX,
}
# E2M1 code -> value; codes 8..15 are the negatives of 0..7 (code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Bit patterns used by the kernels (§0); int32 views of fp32.
_NAN_BITS = 0x7FFFFFFF
_SUBNORMAL_2M127_BITS = 0x00400000  # 2^-127
_EXP_MASK = -0x800000  # 0xFF800000 as a signed int32: keep sign + exponent
_FP8_CANONICAL_NAN = 0x7F  # §0: satfinite cvt turns every NaN into +NaN 0x7F


# ----------------------------------------------------------------------------- validation
def check_float_matrix(x: torch.Tensor, name: str = "x") -> None:
    """Raise unless ``x`` is a 2-D fp32/bf16/fp16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (M, K), got shape {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def check_fp8_dtype(fp8_dtype: torch.dtype, name: str = "fp8_dtype") -> None:
    if fp8_dtype not in FP8_MAX:
        raise ValueError(
            f"{name} must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")


# ----------------------------------------------------------------------------- integer helpers
def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def zero_pad_2d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A zero (rows, cols) tensor of t's dtype with t in its top-left corner.

    Used for partial blocks (missing elements are zero, so they never change an
    amax) and for scale tensors, whose padding entries we always write as 0.
    """
    out = torch.zeros((rows, cols), dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out


# ----------------------------------------------------------------------------- fp32 helpers
def _f32_like(ref: torch.Tensor, value: float) -> torch.Tensor:
    """A full fp32 tensor shaped like ``ref`` (never a 0-dim 'scalar' operand)."""
    return torch.full(ref.shape, value, dtype=torch.float32, device=ref.device)


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def fp32_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """IEEE fp32 division, correctly rounded (both operands materialised, same shape)."""
    num, den = torch.broadcast_tensors(num.float(), den.float())
    return torch.div(num.contiguous(), den.contiguous())


def fp32_rcp_of(value: float) -> float:
    """``(float)(1.0 / value)``: double division rounded once to fp32 (§0 max_norm_rcp)."""
    return torch.tensor(1.0 / value, dtype=torch.float64).float().item()


# ----------------------------------------------------------------------------- amax
def nan_to_zero_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN -> 0, so amax reductions skip NaN but keep inf (§0)."""
    a = x.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def nan_ignoring_amax(x: torch.Tensor) -> torch.Tensor:
    """Global NaN-ignoring max|x| as an fp32 tensor of shape (1,); 0 for an empty tensor."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    return nan_to_zero_abs(x.float()).amax().reshape(1)


# ----------------------------------------------------------------------------- FP8 cast
def cast_to_fp8_satfinite(y: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> FP8 with RNE, saturate-to-finite and canonical NaN (§0 ``RN_fp8``).

    PyTorch's own cast does not saturate (E4M3 overflows to NaN, E5M2 to inf), so
    we clamp first; clamping is harmless for in-range values and maps ±inf to
    ±max.  NaN (either sign) becomes 0x7F, which is a NaN in both formats.
    """
    check_fp8_dtype(fp8_dtype)
    m = FP8_MAX[fp8_dtype]
    y = y.float()
    qb = y.clamp(-m, m).to(fp8_dtype).view(torch.uint8)
    qb = torch.where(torch.isnan(y), torch.full_like(qb, _FP8_CANONICAL_NAN), qb)
    return qb.view(fp8_dtype)


# ----------------------------------------------------------------------------- FP8 block scale
def compute_block_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, pow2: bool,
                        eps: float, input_dtype: torch.dtype
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-block (scale, scale_inv) in fp32, the kernel formula of §1.1.

    Order matters: eps first (so amax 0 with eps > 0 is NOT scale 1), then
    inf/0/NaN -> 1, IEEE division, inf -> input dtype max, pow2 by masking the
    mantissa (rounds DOWN), and finally scale_inv = fl(1/scale).
    """
    check_fp8_dtype(fp8_dtype)
    if input_dtype not in INPUT_DTYPE_MAX:
        raise ValueError(f"input_dtype must be one of {list(INPUT_DTYPE_MAX)}, got {input_dtype}")
    a = amax.float()
    eps32 = _f32_like(a, eps)  # kernel receives eps as a float
    a = torch.where(a < eps32, eps32, a)  # NaN < eps is false: NaN stays NaN
    scale = fp32_div(_f32_like(a, FP8_MAX[fp8_dtype]), a)
    scale = torch.where(torch.isinf(scale), _f32_like(a, INPUT_DTYPE_MAX[input_dtype]), scale)
    if pow2:
        scale = _from_bits(scale.view(torch.int32) & _EXP_MASK)
    one = _f32_like(a, 1.0)
    scale = torch.where(torch.isinf(a) | (a == 0) | torch.isnan(a), one, scale)
    scale_inv = fp32_div(one, scale)
    return scale, scale_inv


# ----------------------------------------------------------------------------- E8M0
def float_to_e8m0(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E8M0 byte rounding toward +inf (software path of §0), uint8.

    Normal v: ceil(log2 v) + 127, saturating at 254; (0, 2^-127] -> 0;
    (2^-127, 2^-126) -> 1; inf -> 254; NaN -> 255; 0 -> 0.  The sign bit is
    ignored (the kernel only feeds non-negative amax products).
    """
    v = v.float()
    b = v.view(torch.int32)
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    up = (m > 0) & (e != 0xFE) & ~((e == 0) & (m <= 0x400000))
    e = e + up.to(torch.int32)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isinf(v), torch.full_like(e, 254), e)
    e = torch.where(torch.isnan(v), torch.full_like(e, 255), e)
    return e.to(torch.uint8)


def exp2f_rcp(e: torch.Tensor) -> torch.Tensor:
    """fp32 2^(127-e), the QUANTIZE multiplier (§0): 254 -> subnormal 2^-127, 255 -> NaN."""
    ei = e.to(torch.int32)
    bits = (254 - ei.clamp(0, 253)) << 23
    bits = torch.where(ei == 254, torch.full_like(bits, _SUBNORMAL_2M127_BITS), bits)
    bits = torch.where(ei == 255, torch.full_like(bits, _NAN_BITS), bits)
    return _from_bits(bits)


def exp2f(e: torch.Tensor) -> torch.Tensor:
    """fp32 2^(e-127), the DEQUANTIZE multiplier (§0): 0 -> subnormal 2^-127, 255 -> NaN."""
    ei = e.to(torch.int32)
    bits = ei.clamp(1, 254) << 23
    bits = torch.where(ei == 0, torch.full_like(bits, _SUBNORMAL_2M127_BITS), bits)
    bits = torch.where(ei == 255, torch.full_like(bits, _NAN_BITS), bits)
    return _from_bits(bits)


# ----------------------------------------------------------------------------- E2M1 (FP4)
def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 code 0..15 (uint8): RNE with ties to the even code, saturate to ±6.

    Thresholds (§0): <=0.25 -> 0, <0.75 -> 0.5, <=1.25 -> 1, <1.75 -> 1.5,
    <=2.5 -> 2, <3.5 -> 3, <=5 -> 4, else 6.  The magnitude code is the number
    of thresholds passed ('>' at ties that round down, '>=' at ties that round
    up).  Sign is kept even for results that round to zero (-0.0 and tiny
    negatives -> code 8), NaN -> +6 (code 7).
    """
    y = y.float()
    a = y.abs()
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8)
           + (a > 1.25).to(torch.uint8) + (a >= 1.75).to(torch.uint8)
           + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
           + (a > 5.0).to(torch.uint8))
    code = mag | (torch.signbit(y).to(torch.uint8) << 3)
    return torch.where(torch.isnan(y), torch.full_like(code, 7), code)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> fp32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[(codes.to(torch.int64) & 0xF)]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes along the last dim: element 2i -> low nibble, 2i+1 -> high nibble (§0)."""
    if codes.dim() == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"codes must have an even last dimension, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: (..., n) bytes -> (..., 2n) codes."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("packed must have at least one dimension")
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
