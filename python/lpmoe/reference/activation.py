"""Bit-exact reference of lpmoe's expert-MLP activations (forward and backward).

The GPU kernels (csrc/activation/) compute exactly these fp32 operations in
this order, each one IEEE round-to-nearest-even (a fused multiply-add, ``fma32``,
only where the spec says fma: it is emulated exactly), so CPU and GPU agree
bit for bit (docs/activation-notes.md has the formulas).  The transcendental
part is lpmoe's own ``exp`` built from fused multiply-adds, a polynomial and a
power-of-two scaling, because library ``expf`` differs between CPU and GPU in
the last bits.

Layout: GLU activations read ``h = [gate | value]`` (gate first, as
TransformerEngine's SwiGLU), (rows, 2F) -> (rows, F); the others (rows, F)
-> (rows, F).  Optional ``probs`` (rows,) scale every output row.

Rounding: the activation is computed in fp32 and rounded once to the output
dtype; a fused FP8 kernel quantizes exactly that rounded value, so
"fused" == "activation, then lpmoe.group_quantize".
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["fma32", "exp_reduced", "exp_lp", "rcp_lp", "sigmoid_lp", "activation_forward", "activation_backward", "probs_grad_order_sum",
           "KINDS", "GLU_KINDS"]

KINDS = ("swiglu", "geglu", "gelu", "relu", "clamped_swiglu")
GLU_KINDS = ("swiglu", "geglu", "clamped_swiglu")


def _f32(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32)[0]


# fp32 constants, given by their bit patterns (the kernels use the same bits)
LOG2E = _f32(0x3FB8AA3B)      # 1/ln 2
LN2_HI = _f32(0x3F317200)     # ln 2, upper 15 bits: n * LN2_HI is exact for |n| < 512
LN2_LO = _f32(0x35BFBE8E)     # ln 2 - LN2_HI
# exp's polynomial on |r| <= ln2 / 2: 1 + r + c2 r^2 + ... + c6 r^6, minimax for
# relative error with the two lowest coefficients fixed at 1 (3.8e-9 with these
# fp32 coefficients); c6 .. c2
EXP_POLY = [_f32(b) for b in (0x3AB51226, 0x3C091CEA, 0x3D2AAC79, 0x3E2AAA49, 0x3EFFFFFE)]
GELU_C = _f32(0x3FCC422A)     # 2 * sqrt(2 / pi)
GELU_A = _f32(0x3D372713)     # 0.044715
GELU_3A = _f32(0x3E095D4F)    # 3 * 0.044715
ONE = torch.tensor(1.0)
MAGIC = torch.tensor(12582912.0)          # 1.5 * 2^23: x + MAGIC - MAGIC = rint(x) for |x| < 2^22
TWO_126 = torch.tensor(2.0 ** 126)


def fma32(a, b, c) -> torch.Tensor:
    """fp32 fused multiply-add a * b + c with one rounding (as the GPU's
    FFMA), computed exactly in fp64: the product of two fp32 values is exact
    in fp64, TwoSum gives the exact sum as s + err, and rounding s to fp32 is
    correct except when s lies exactly halfway between two fp32 values, where
    err decides the side."""
    a, b, c = (torch.as_tensor(v, dtype=torch.float32).double() for v in (a, b, c))
    prod = a * b
    s = prod + c
    bv = s - prod
    err = (prod - (s - bv)) + (c - bv)
    r = s.float()
    d = s - r.double()
    toward = torch.nextafter(r, torch.where(d > 0, torch.tensor(float("inf")), torch.tensor(-float("inf"))))
    tie = (d != 0) & (s == (r.double() + toward.double()) / 2)
    beyond = ((err > 0) & (d > 0)) | ((err < 0) & (d < 0))
    return torch.where(tie & beyond, toward, r)


def exp_reduced(xc: torch.Tensor):
    """(j, p) of exp for an already clamped fp32 xc: j = fma(xc, LOG2E,
    1.5 * 2^23), whose low mantissa bits hold n = rint(xc / ln 2), and p(r),
    r = fma(-n, LN2_LO, fma(-n, LN2_HI, xc)), so that e^xc = p * 2^n.  The
    spec's exp and the kernels' clamped shortcut differ only around it."""
    j = fma32(xc, LOG2E, MAGIC)                      # rint (half to even) in the low mantissa bits
    n = j - MAGIC
    r = fma32(-n, LN2_LO, fma32(-n, LN2_HI, xc))
    p = EXP_POLY[0]
    for c in EXP_POLY[1:] + [ONE, ONE]:
        p = fma32(p, r, c)
    return j, p


def exp_lp(x: torch.Tensor) -> torch.Tensor:
    """lpmoe's fp32 exp: x clamped to [-104, 88.75] (NaN kept); e^x =
    2^n * p(r) with n = rint(x / ln 2) (x * LOG2E + 1.5 * 2^23 as one fused
    multiply-add), r = fma(-n, LN2_LO, fma(-n, LN2_HI, x)), p the degree-6
    polynomial EXP_POLY by Horner's rule in fused multiply-adds, and 2^n
    applied as two exact power-of-two factors 2^floor(n/2) * 2^(n -
    floor(n/2)) so that only the last multiply rounds.  Within 0.9 ulp of
    e^x; overflows to +inf above 88.72 and rounds to 0 below -103.97
    through the clamp bounds alone."""
    j, p = exp_reduced(x.float().clamp(-104.0, 88.75))
    ni = j.view(torch.int32) - 0x4B400000
    n1 = torch.div(ni, 2, rounding_mode="floor")
    return (p * ((n1 + 127) << 23).view(torch.float32)) * ((ni - n1 + 127) << 23).view(torch.float32)


def rcp_lp(y: torch.Tensor) -> torch.Tensor:
    """1 / y for y >= 1, correctly rounded, and 0 where that is subnormal
    (y > 2^126: the kernels' reciprocal approximation flushes it)."""
    return torch.where(y > TWO_126, torch.tensor(0.0), ONE / y)


def sigmoid_lp(x: torch.Tensor) -> torch.Tensor:
    """rcp(1 + e^-x), the sum rounded once (0 below x of about -87.34)."""
    return rcp_lp(ONE + exp_lp(-x))


def _gelu_parts(x):
    """(gelu(x), sigmoid(y)) with y = GELU_C * (x + GELU_A * x^3): the tanh
    form 0.5 x (1 + tanh(y/2)) written as x * sigmoid(y)."""
    y = GELU_C * (x + GELU_A * ((x * x) * x))
    s = sigmoid_lp(y)
    return x * s, s


def _gelu_grad(x, s):
    """d gelu / dx = s + x * s (1 - s) * dy/dx, dy/dx = GELU_C (1 + GELU_3A x^2),
    the last product and sum as one fused multiply-add."""
    dy = GELU_C * (ONE + GELU_3A * (x * x))
    return fma32(x * (s * (ONE - s)), dy, s)


def _split(h: torch.Tensor, kind: str):
    if kind in GLU_KINDS:
        f = h.shape[-1] // 2
        return h[..., :f].float(), h[..., f:].float()
    return h.float(), None


def _clamp_gate(g, limit):
    return torch.where(g > limit, limit, g)          # NaN passes through


def _clamp_value(v, limit):
    return torch.where(v > limit, limit, torch.where(v < -limit, -limit, v))


def _unscaled(g, v, kind: str, alpha, limit) -> torch.Tensor:
    """u, the activation before the probs scaling, in fp32."""
    if kind == "swiglu":
        return (g * sigmoid_lp(g)) * v
    if kind == "geglu":
        return _gelu_parts(g)[0] * v
    if kind == "gelu":
        return _gelu_parts(g)[0]
    if kind == "relu":
        return torch.where(g < 0, torch.tensor(0.0), g)
    gc = _clamp_gate(g, limit)
    glu = gc * sigmoid_lp(alpha * gc)
    return glu * (_clamp_value(v, limit) + ONE)


def _params(alpha: float, limit: float):
    return torch.tensor(alpha, dtype=torch.float32), torch.tensor(limit, dtype=torch.float32)


def activation_forward(h: torch.Tensor, kind: str, probs: Optional[torch.Tensor] = None, alpha: float = 1.702,
                       limit: float = 7.0, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """a = round(u * probs) (rows, F) in ``out_dtype`` (default h's dtype)."""
    al, li = _params(alpha, limit)
    g, v = _split(h, kind)
    u = _unscaled(g, v, kind, al, li)
    if probs is not None:
        u = u * probs.float().reshape(-1, 1)
    return u.to(out_dtype or h.dtype)


def probs_grad_order_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row sums of a * b, both (rows, F) fp32, in the kernels' fixed order:
    per 128-column block, each group of 8 columns accumulated left to right
    from 0 by fused multiply-adds (acc = fma(a, b, acc)), the 16 group sums
    by a halving tree (i + 8, then i + 4, i + 2, i + 1), then the block sums
    left to right from 0.  Columns past F count as 0."""
    rows, f = a.shape
    nb = -(-f // 128)

    def grouped(t):
        padded = torch.zeros(rows, nb * 128, dtype=torch.float32)
        padded[:, :f] = t
        return padded.view(rows, nb, 16, 8)
    va, vb = grouped(a), grouped(b)
    acc = torch.zeros(rows, nb, 16)
    for e in range(8):
        acc = fma32(va[..., e], vb[..., e], acc)
    width = 16
    while width > 1:
        width //= 2
        acc = acc[..., :width] + acc[..., width:]
    blocks = acc[..., 0]
    total = torch.zeros(rows)
    for b in range(nb):
        total = total + blocks[:, b]
    return total


def activation_backward(da: torch.Tensor, h: torch.Tensor, kind: str, probs: Optional[torch.Tensor] = None,
                        alpha: float = 1.702, limit: float = 7.0
                        ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(dh, a, dprobs): dh (rows, W) and the recomputed forward output a
    (rows, F), both in h's dtype; dprobs (rows,) fp32 (None without probs).

    With q = da * probs (or da), per element (fma: one rounding):
      swiglu          s = sig(g); dv = q * (g s); dg = (q v) * fma(g s, 1 - s, s)
      geglu           dv = q * gelu(g); dg = (q v) * gelu'(g)
      gelu            dh = q * gelu'(h)
      relu            dh = h > 0 ? q : 0
      clamped_swiglu  gc = min(g, L), vc = clamp(v, -L, L), y = alpha gc, s = sig(y);
                      dv = (-L <= v <= L) ? q * (gc s) : 0
                      dg = (g <= L) ? (q (vc + 1)) * fma(y s, 1 - s, s) : 0
      dprobs[t] = sum_j da[t, j] * u[t, j]   (order: probs_grad_order_sum)
    """
    al, li = _params(alpha, limit)
    g, v = _split(h, kind)
    dA = da.float()
    q = dA * probs.float().reshape(-1, 1) if probs is not None else dA
    zero = torch.tensor(0.0)
    if kind == "swiglu":
        s = sigmoid_lp(g)
        si = g * s
        u = si * v
        dv = q * si
        dg = (q * v) * fma32(si, ONE - s, s)
    elif kind in ("geglu", "gelu"):
        ge, s = _gelu_parts(g)
        dge = _gelu_grad(g, s)
        if kind == "geglu":
            u = ge * v
            dv = q * ge
            dg = (q * v) * dge
        else:
            u, dg, dv = ge, q * dge, None
    elif kind == "relu":
        u = torch.where(g < 0, zero, g)
        dg, dv = torch.where(g > 0, q, zero), None
    else:
        gc = _clamp_gate(g, li)
        vc = _clamp_value(v, li)
        y = al * gc
        s = sigmoid_lp(y)
        glu = gc * s
        u = glu * (vc + ONE)
        dv = torch.where((v >= -li) & (v <= li), q * glu, zero)
        dg = torch.where(g <= li, (q * (vc + ONE)) * fma32(y * s, ONE - s, s), zero)
    dh = torch.cat([dg, dv], dim=-1) if dv is not None else dg
    a = u * probs.float().reshape(-1, 1) if probs is not None else u
    dprobs = probs_grad_order_sum(dA, u) if probs is not None else None
    return dh.to(h.dtype), a.to(h.dtype), dprobs
