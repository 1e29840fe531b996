"""Independent scalar (per-element, per-block loop) models of the formats, for tests only.

Written from formats.md directly and deliberately sharing no code with
``lpmoe.reference``: FP8 / E2M1 / E8M0 conversions are done by exact table
search on Python floats (every fp32 value and every midpoint of two FP8 values is
exact in double precision), and fp32 arithmetic uses numpy float32 scalars
(IEEE round-to-nearest-even per operation).
"""
from __future__ import annotations

import bisect
import math

import numpy as np

F32 = np.float32
FLT_MAX = float(np.finfo(np.float32).max)


def _fp8_positive_values(mbits: int, bias: int, max_code: int):
    vals = []
    for code in range(max_code + 1):
        e, m = code >> mbits, code & ((1 << mbits) - 1)
        if e == 0:
            vals.append(m * 2.0 ** (1 - bias - mbits))
        else:
            vals.append((1 + m / 2 ** mbits) * 2.0 ** (e - bias))
    return vals


E4M3_VALUES = _fp8_positive_values(3, 7, 0x7E)   # 0 .. 448
E5M2_VALUES = _fp8_positive_values(2, 15, 0x7B)  # 0 .. 57344
E2M1_POS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _nearest_even(table, a: float) -> int:
    """Index of the nearest table entry to a (a <= table[-1]); ties go to the even index."""
    i = bisect.bisect_left(table, a)
    if i < len(table) and table[i] == a:
        return i
    lo, hi = i - 1, i
    dlo, dhi = a - table[lo], table[hi] - a
    if dlo < dhi:
        return lo
    if dhi < dlo:
        return hi
    return lo if lo % 2 == 0 else hi


def fp8_byte(v: float, e5m2: bool = False) -> int:
    """RN + satfinite fp32 -> FP8 byte; NaN -> 0x7F; sign of zero kept."""
    if math.isnan(v):
        return 0x7F
    table = E5M2_VALUES if e5m2 else E4M3_VALUES
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    code = len(table) - 1 if a >= table[-1] else _nearest_even(table, a)
    return sign | code


def fp8_value(byte: int, e5m2: bool = False) -> float:
    table = E5M2_VALUES if e5m2 else E4M3_VALUES
    code = byte & 0x7F
    if e5m2 and code == 0x7C:                # E5M2 keeps IEEE infinities
        return -math.inf if byte & 0x80 else math.inf
    if code >= len(table):
        return math.nan
    return -table[code] if byte & 0x80 else table[code]


def e2m1_code(v: float) -> int:
    if math.isnan(v):
        return 7
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    return sign | (7 if a >= 6.0 else _nearest_even(E2M1_POS, a))


def e8m0(v: float) -> int:
    """Smallest e in [0, 254] with 2^(e-127) >= v (v >= 0); inf -> 254, NaN -> 255."""
    if math.isnan(v):
        return 255
    if math.isinf(v):
        return 254
    if v == 0:
        return 0
    mant, exp = math.frexp(v)                 # v = mant * 2^exp, mant in [0.5, 1)
    ceil_log2 = exp - 1 if mant == 0.5 else exp
    return min(max(ceil_log2 + 127, 0), 254)


def nan0_amax(values) -> float:
    return max([abs(float(v)) for v in values if not math.isnan(float(v))], default=0.0)


# ----------------------------------------------------------------------------- formats
def block_scale(amax: float, fp8_max: float, pow2: bool, eps: float, in_max: float):
    """(scale, scale_inv) as numpy float32 following formats.md §1.1 step by step."""
    a = F32(amax)
    if a < F32(eps):
        a = F32(eps)
    if math.isinf(a) or a == 0 or math.isnan(a):
        return F32(1.0), F32(1.0)
    with np.errstate(over="ignore", divide="ignore"):
        s = F32(fp8_max) / a
    if math.isinf(s):
        s = F32(in_max)
    if pow2:
        s = np.array([s], dtype=np.float32).view(np.uint32)[0] & np.uint32(0xFF800000)
        s = np.array([s], dtype=np.uint32).view(np.float32)[0]
    return s, F32(1.0) / s


def quantize_vector_fp8(values, fp8_max, pow2, eps, in_max, e5m2):
    """One FP8 block: (bytes, scale_inv)."""
    s, s_inv = block_scale(nan0_amax(values), fp8_max, pow2, eps, in_max)
    with np.errstate(over="ignore", invalid="ignore"):
        out = [fp8_byte(float(F32(v) * s), e5m2) for v in values]
    return out, float(s_inv)


def mxfp8_block(values, e5m2):
    """One MXFP8 block: (bytes, e8m0)."""
    fp8_max = 57344.0 if e5m2 else 448.0
    rcp = F32(1.0 / fp8_max)
    e = e8m0(float(F32(nan0_amax(values)) * rcp))
    mult = 2.0 ** (127 - e) if e < 255 else math.nan   # exact power of two
    with np.errstate(over="ignore", invalid="ignore"):
        out = [fp8_byte(float(F32(v) * F32(mult)), e5m2) for v in values]
    return out, e


def nvfp4_block(values, amax):
    """One NVFP4 16-block with global amax: (codes, sf byte)."""
    a = F32(amax)
    with np.errstate(over="ignore", divide="ignore"):
        s_enc = F32(2688.0) / a
    s_enc = min(s_enc, F32(FLT_MAX))
    if a == 0 or s_enc == 0:
        s_enc = F32(1.0)
    s_dec = F32(1.0) / s_enc
    mult = s_enc * (F32(1.0) / F32(6.0))
    with np.errstate(over="ignore"):
        sf_byte = fp8_byte(float(min(F32(nan0_amax(values)) * mult, F32(FLT_MAX))))
    sf = F32(fp8_value(sf_byte))
    with np.errstate(divide="ignore"):
        enc = min(F32(1.0) / (sf * s_dec), F32(FLT_MAX))
    with np.errstate(over="ignore", invalid="ignore"):
        codes = [e2m1_code(float(F32(v) * enc)) for v in values]
    return codes, sf_byte
