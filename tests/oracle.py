"""An independent float64 oracle for softmax, log-softmax and logsumexp, and the tolerances tests use.

Written from the math and CONTRACT.md, not from ``safeops.reference``:

- each logit becomes ONE value ``z``: ``fp32(x) * fp32(scale)`` rounded once to fp32 (contract section 1;
  the product of two fp32 numbers is exact in float64, so rounding it to fp32 is the IEEE fp32 multiply).
  fp64 inputs, or ``dtype=torch.float64``, compute ``z = x * scale`` in fp64 (section 2);
- an element is excluded when its mask is False or its ``z`` is exactly ``-inf``; excluded outputs are the
  constants 0 (softmax) and -inf (log-softmax), and a row with nothing included is the table of section 4;
- everything after ``z`` is float64, and gradients come from ``torch.autograd`` on that float64 formula.

Tolerances are data (:data:`TOLERANCE`): the rounding of the result to its output dtype, in units of that
dtype's eps (about one ulp, section 2), plus the error the fp32 (or fp64) internals may add, in units of the
compute dtype's eps times a forward-error magnitude derived from the formula (section 2: "plus fp32
reduction error for fp32 outputs").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

F64 = torch.float64
NEG_INF = float("-inf")
OPS = ("softmax", "log_softmax", "logsumexp")


@dataclass(frozen=True)
class Tolerance:
    out_ulps: float  # rounding to the output dtype, in eps of the output dtype, relative to |expected|
    internal_ulps: float  # compute-dtype error, in eps of the compute dtype, times the op's error magnitude
    reduction_terms: float  # extra roundings of exp, log, division, per element, in the same unit


# Keyed by the output dtype (the compute dtype is fp64 for fp64 outputs/inputs, fp32 otherwise).
# "About one ulp" of the output dtype: correct rounding is half an ulp; the interpreter's fp32 -> bf16
# store truncates, which is still under one ulp.
TOLERANCE: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(out_ulps=1.0, internal_ulps=2.0, reduction_terms=4.0),
    torch.float32: Tolerance(out_ulps=1.0, internal_ulps=2.0, reduction_terms=4.0),
    torch.float16: Tolerance(out_ulps=1.0, internal_ulps=2.0, reduction_terms=4.0),
    torch.bfloat16: Tolerance(out_ulps=1.0, internal_ulps=2.0, reduction_terms=4.0),
}


def compute_dtype(x_dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> torch.dtype:
    """Contract section 2: fp64 is computed in fp64, every other floating dtype in fp32."""
    return F64 if torch.float64 in (x_dtype, out_dtype) else torch.float32


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def subnormal_step(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


@dataclass
class Result:
    """Float64 values of one op, plus what the tolerance needs."""

    out: torch.Tensor  # the op's output, float64 (logsumexp: ``dim`` removed)
    z: torch.Tensor  # the materialized logits, float64 holding compute-dtype values, -inf where excluded
    keep: torch.Tensor  # included elements
    m: torch.Tensor  # row max of z (keepdim), -inf for an empty row
    log_l: torch.Tensor  # log of the row sum of exp(z - m) (keepdim), -inf for an empty row
    p: torch.Tensor  # probabilities, 0 where excluded and in empty rows
    n: int  # row length
    dim: int  # the reduced dimension (non-negative)
    acc: torch.dtype  # compute dtype


def _scale_value(scale, acc: torch.dtype) -> torch.Tensor | None:
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        return scale.detach().reshape(()).to(acc).to(F64)
    return torch.tensor(float(scale), dtype=acc).to(F64)


def _logits(x64: torch.Tensor, shape, scale, mask, acc: torch.dtype, scale_var: torch.Tensor | None):
    """z (float64 values of the one compute-dtype product), differentiable w.r.t. x64 and scale_var."""
    s = _scale_value(scale, acc)
    finite = torch.isfinite(x64.detach())
    if s is None:
        z_value = x64.detach().to(acc).to(F64)
        product = x64
    else:
        # fp32 * fp32 is exact in float64; one rounding to fp32 is then the IEEE fp32 multiply.
        z_value = (x64.detach() * s).to(acc).to(F64)
        x_safe = torch.where(finite, x64, torch.zeros_like(x64))
        product = x_safe * (scale_var if scale_var is not None else s)
    # Value of z, gradient of the exact product (straight-through the rounding). Non-finite inputs are
    # constants: their z carries no gradient, so a NaN or inf there cannot poison d(scale).
    z = torch.where(finite, product + (z_value - product).detach(), z_value)
    keep = z != NEG_INF
    if mask is not None:
        keep = keep & mask.expand(shape)
    z = torch.where(keep, z, torch.full_like(z, NEG_INF))
    return z, keep


def evaluate(op: str, x: torch.Tensor, dim: int = -1, *, scale=None, mask=None, out_dtype=None,
             keepdim: bool = False, scale_var: torch.Tensor | None = None,
             x64: torch.Tensor | None = None) -> Result:
    """Float64 value of ``op`` following the contract.

    Differentiable w.r.t. ``x64`` (a float64 copy of ``x``, default ``x.to(float64)``) and ``scale_var``
    (a float64 leaf holding the tensor scale's value). ``x`` itself gives the dtype that z is rounded to.
    """
    acc = compute_dtype(x.dtype, out_dtype)
    if x64 is None:
        x64 = x.detach().to(F64)
    if x.dim() == 0:
        r = evaluate(op, x.reshape(1), 0, scale=scale, mask=None if mask is None else mask.reshape(1),
                     out_dtype=out_dtype, scale_var=scale_var, x64=x64.reshape(1))
        r.out = r.out.reshape(())
        return r
    dim = dim % x.dim()
    z, keep = _logits(x64, x.shape, scale, mask, acc, scale_var)
    n = x.shape[dim]
    # The true gradient does not flow through the max (softmax is shift invariant), so it is a constant.
    m = torch.amax(z.detach(), dim, keepdim=True) if n > 0 else z.new_full(
        x.shape[:dim] + (1,) + x.shape[dim + 1:], NEG_INF)
    empty = m == NEG_INF
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    e = torch.where(keep, torch.exp(z - m_safe), torch.zeros_like(z))
    l = e.sum(dim, keepdim=True)
    l_safe = torch.where(empty, torch.ones_like(l), l)
    log_l = torch.where(empty, torch.full_like(l, NEG_INF), torch.log(l_safe))
    p = torch.where(keep & ~empty, e / l_safe, torch.zeros_like(e))
    if op == "softmax":
        out = p
    elif op == "log_softmax":
        out = torch.where(keep & ~empty, (z - m_safe) - torch.log(l_safe), torch.full_like(z, NEG_INF))
    elif op == "logsumexp":
        out = torch.where(empty, torch.full_like(m, NEG_INF), m_safe + torch.log(l_safe))
        if not keepdim:
            out = out.squeeze(dim)
    else:
        raise ValueError(op)
    return Result(out=out, z=z.detach(), keep=keep, m=m, log_l=log_l.detach(), p=p.detach(), n=n, dim=dim,
                  acc=acc)


def gradients(op: str, x: torch.Tensor, grad_out: torch.Tensor, dim: int = -1, *, scale=None, mask=None,
              out_dtype=None, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float64 d(sum(grad_out * op(x)))/dx and, for a tensor scale, d/dscale, by autograd on the oracle."""
    x64 = x.detach().to(F64).requires_grad_(True)
    scale_var = None
    if isinstance(scale, torch.Tensor):
        acc = compute_dtype(x.dtype, out_dtype)
        scale_var = scale.detach().reshape(()).to(acc).to(F64).requires_grad_(True)
    r = evaluate(op, x, dim, scale=scale, mask=mask, out_dtype=out_dtype, keepdim=keepdim,
                 scale_var=scale_var, x64=x64)
    g = grad_out.detach().to(F64)
    finite_out = torch.where(g == 0, torch.zeros_like(r.out), r.out)  # 0 * -inf must not be NaN
    loss = (g * finite_out).sum()
    inputs = [x64] + ([scale_var] if scale_var is not None else [])
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    dx = grads[0] if grads[0] is not None else torch.zeros_like(x64)
    dscale = None
    if scale_var is not None:
        dscale = grads[1] if grads[1] is not None else torch.zeros((), dtype=F64)
    return dx, dscale


# ---------------------------------------------------------------------------------------------------
# Tolerances: forward-error bounds of each formula, term by term, in absolute units
# ---------------------------------------------------------------------------------------------------


def _k(n: int, tol: Tolerance) -> float:
    # A tree or cascade sum of n terms is off by about log2(n) roundings; exp, log and the division add a
    # few more per element.
    return math.ceil(math.log2(max(n, 2))) + tol.reduction_terms


def _terms(r: Result, tol: Tolerance):
    """(u, k, tiny, |z - m|, absolute error bound of p) of the compute dtype for this result."""
    u = tol.internal_ulps * eps(r.acc)
    k = _k(r.n, tol)
    tiny = 2 * subnormal_step(r.acc)
    m_safe = torch.where(r.m == NEG_INF, torch.zeros_like(r.m), r.m)
    dzm = torch.where(r.keep, (r.z - m_safe).abs(), torch.zeros_like(r.z))
    # p = exp(z - m) / l: (z - m) rounds (relative u), exp amplifies that by |z - m|, l carries k roundings.
    p_err = torch.where(r.keep, u * r.p * (dzm + k) + tiny, torch.zeros_like(r.p))
    return u, k, tiny, m_safe, dzm, p_err


def _rounding(tol: Tolerance, dtype: torch.dtype, expected: torch.Tensor) -> torch.Tensor:
    finite = expected.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    return tol.out_ulps * eps(dtype) * finite + 2 * subnormal_step(dtype)


def output_bound(op: str, r: Result, out_dtype: torch.dtype, keepdim: bool = False) -> torch.Tensor:
    """Allowed |actual - expected| for each element of ``op``'s output (shape of ``r.out``)."""
    tol = TOLERANCE[out_dtype]
    u, k, tiny, m_safe, dzm, p_err = _terms(r, tol)
    log_l = torch.where(torch.isfinite(r.log_l), r.log_l.abs(), torch.zeros_like(r.log_l))
    if op == "softmax":
        internal = p_err
    elif op == "log_softmax":
        internal = torch.where(r.keep, u * (dzm + log_l + k), torch.zeros_like(dzm))
    else:
        internal = u * (m_safe.abs() + log_l + k)
        if not keepdim:
            internal = internal.squeeze(r.dim)
    return (_rounding(tol, out_dtype, r.out) + internal).reshape(r.out.shape)


def gradient_bounds(op: str, r: Result, grad_out: torch.Tensor, x: torch.Tensor, *, scale=None,
                    keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Allowed |actual - expected| for d/dx (shape of x) and, for a tensor scale, d/dscale (0-d).

    ``r`` is the oracle result of the forward, ``grad_out`` the incoming gradient (shape of the output).
    """
    tol = TOLERANCE[x.dtype]
    u, k, tiny, _, _, p_err = _terms(r, tol)
    dim = r.dim
    g = grad_out.detach().to(F64).reshape(r.out.shape)
    if op == "logsumexp" and not keepdim:
        g = g.unsqueeze(dim)
    g = torch.where(r.keep, g.expand(r.z.shape), torch.zeros_like(r.z))  # excluded entries are ignored
    ga, p = g.abs(), r.p
    if op == "softmax":
        s = (g * p).sum(dim, keepdim=True)
        s_err = (ga * p_err).sum(dim, keepdim=True) + u * k * (ga * p).sum(dim, keepdim=True)
        dz = p * (g - s)
        dz_err = p_err * (ga + s.abs()) + p * (s_err + u * (ga + s.abs()))
    elif op == "log_softmax":
        s = g.sum(dim, keepdim=True)
        s_err = u * k * ga.sum(dim, keepdim=True)
        dz = g - p * s
        dz_err = p_err * s.abs() + p * s_err + 2 * u * (ga + p * s.abs())
    else:
        dz = g * p
        dz_err = ga * p_err
    dz_err = torch.where(r.keep, dz_err + u * dz.abs() + tiny, torch.zeros_like(dz_err))
    s_value = _scale_value(scale, r.acc)
    s_abs = 1.0 if s_value is None else float(s_value.abs())
    dx = dz * s_abs
    dx_err = dz_err * s_abs + u * dx.abs() + tiny
    dx_bound = (_rounding(tol, x.dtype, dx) + dx_err).reshape(x.shape)
    dscale_bound = None
    if isinstance(scale, torch.Tensor):
        xv = torch.where(r.keep, x.detach().to(F64).reshape(r.z.shape), torch.zeros_like(r.z))
        kk = _k(r.z.numel(), tol)
        expected = (dz * xv).sum()
        err = (xv.abs() * dz_err).sum() + u * kk * (dz * xv).abs().sum()
        dscale_bound = _rounding(TOLERANCE[scale.dtype], scale.dtype, expected) + err
    return dx_bound, dscale_bound


# ---------------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------------


def max_violation(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> tuple[float, str]:
    """(largest |actual - expected| / bound, where); NaN, inf and the shape must match exactly."""
    a = actual.detach().to(F64)
    e = expected.detach().to(F64)
    if a.shape != e.shape:
        return math.inf, f"shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    if a.numel() == 0:
        return 0.0, "empty"
    bound = bound.expand(e.shape)
    nan_mismatch = torch.isnan(a) != torch.isnan(e)
    inf_mismatch = (torch.isinf(a) | torch.isinf(e)) & (a != e) & ~torch.isnan(a) & ~torch.isnan(e)
    bad = nan_mismatch | inf_mismatch
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        return math.inf, f"at {list(idx)}: actual {a[idx].item()!r} expected {e[idx].item()!r} (non-finite)"
    err = torch.where(torch.isfinite(e), (a - e).abs(), torch.zeros_like(a))
    ratio = err / bound
    idx = tuple(int(i) for i in torch.unravel_index(ratio.reshape(-1).argmax(), ratio.shape))
    return float(ratio[idx]), (f"at {list(idx)}: actual {a[idx].item()!r} expected {e[idx].item()!r}, "
                               f"|err| {err[idx].item():.3e} > bound {bound[idx].item():.3e}")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str,
                 context: object) -> None:
    ratio, where = max_violation(actual, expected, bound)
    assert ratio <= 1.0, f"{what}: error {ratio:.3g} x the allowed bound {where}; {context}"
