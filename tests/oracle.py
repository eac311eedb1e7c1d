"""An independent float64 oracle for softmax, log-softmax and logsumexp, and the tolerances tests use.

Written from the math and CONTRACT.md, not from ``safeops.reference``:

- each logit becomes ONE value ``z``: ``fp32(x) * fp32(scale)`` rounded once to fp32 (contract section 1;
  the product of two fp32 numbers is exact in float64, so rounding it to fp32 is the IEEE fp32 multiply).
  fp64 inputs, or ``dtype=torch.float64``, compute ``z = x * scale`` in fp64 (section 2);
- an element is excluded when its mask is False or its ``z`` is exactly ``-inf``; excluded outputs are the
  constants 0 (softmax) and -inf (log-softmax), and a row with nothing included is the table of section 4;
- a NaN or +inf ``z`` makes its row NaN (section 5), except that logsumexp of a row holding +inf and no NaN
  is +inf, with torch.logsumexp's gradient ``exp(z - lse)``: NaN at the +inf entries, 0 at the others;
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
# "About one ulp" of the output dtype (contract section 2); the kernels round to nearest, half an ulp.
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
        # A row whose max is +inf holds no NaN (amax propagates NaN): its lse is +inf (section 5), and
        # d lse / dz = exp(z - lse) is NaN at its +inf entries and exp(-inf) = 0 at the others.
        inf_row = m == math.inf
        out = torch.where(inf_row, torch.full_like(m, math.inf), out)
        p = torch.where(inf_row, torch.where(z.detach() == math.inf, math.nan, 0.0), p)
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
    if op == "logsumexp":
        # Autograd through a +inf row's NaN row sum makes its whole gradient NaN; torch's gradient of its
        # +inf lse (see evaluate) is g * exp(z - inf) * scale: NaN at the +inf entries, 0 elsewhere, and
        # d/dscale sums a NaN.
        inf_rows = (r.m == math.inf).expand(r.z.shape)
        dz = torch.where(r.z == math.inf, math.nan, 0.0)
        dx = torch.where(inf_rows, dz, dx.reshape(r.z.shape)).reshape(x64.shape)
        if dscale is not None and inf_rows.any():
            dscale = torch.full((), math.nan, dtype=F64)
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
    # An exact value is within any bound, also where the bound is NaN (the NaN gradient terms of a +inf
    # logsumexp row make the bounds of its exact-zero entries NaN).
    ratio = torch.where(err == 0, torch.zeros_like(err), err / bound)
    idx = tuple(int(i) for i in torch.unravel_index(ratio.reshape(-1).argmax(), ratio.shape))
    return float(ratio[idx]), (f"at {list(idx)}: actual {a[idx].item()!r} expected {e[idx].item()!r}, "
                               f"|err| {err[idx].item():.3e} > bound {bound[idx].item():.3e}")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str,
                 context: object) -> None:
    ratio, where = max_violation(actual, expected, bound)
    assert ratio <= 1.0, f"{what}: error {ratio:.3g} x the allowed bound {where}; {context}"


# ---------------------------------------------------------------------------------------------------
# Attention: float64 oracle and forward-error bounds
# ---------------------------------------------------------------------------------------------------
#
# Written from the math (softmax(q k^T * scale [softcap] + mask) v), not from safeops.reference. Scores are
# in natural units; the kernels' base-2 score and fp32 dot accumulation differ from it by rounding, which
# the bounds below account for.


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest TF32 (ties to even), through float64 arithmetic on the exponent (not bit tricks)."""
    x = x.to(torch.float32)
    x64 = x.to(F64)
    finite = torch.isfinite(x64) & (x64 != 0)
    mant, expo = torch.frexp(torch.where(finite, x64, torch.ones_like(x64)))
    # mant in [0.5, 1): TF32 keeps 11 significant bits, so round mant * 2**11 to an integer (ties to even).
    rounded = torch.round(mant * 2048.0) / 2048.0
    return torch.where(finite, torch.ldexp(rounded, expo), x64).to(torch.float32)


@dataclass
class AttentionResult:
    out: torch.Tensor  # (B, Hq, Sq, Dv) float64
    lse: torch.Tensor  # (B, Hq, Sq) float64, -inf for empty rows
    p: torch.Tensor  # (B, Hq, Sq, Sk) probabilities, 0 where excluded and in empty rows
    zmag: torch.Tensor  # (B, Hq, Sq, 1): largest |score| term magnitude of the row (for the bounds)
    v_abs: torch.Tensor  # (B, Hq, Sk, Dv) |v| expanded to the q heads
    k_abs: torch.Tensor  # (B, Hq, Sk, D)
    q_abs: torch.Tensor  # (B, Hq, Sq, D)
    p_sink: torch.Tensor | None = None  # (B, Hq, Sq) each row's sink probability (attention sinks only)


def _heads(t: torch.Tensor, hq: int) -> torch.Tensor:
    return t.repeat_interleave(hq // t.shape[1], dim=1)


def attention_keep(sq: int, sk: int, attn_mask, is_causal: bool, window) -> torch.Tensor:
    """Bool (.., Sq, Sk) of the keys each query may see, from the bool mask, causal and window."""
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if is_causal:
        keep &= j <= i
    if window is not None:
        left, right = window
        if left is not None and left >= 0:
            keep &= j >= i - left
        if right is not None and right >= 0 and not is_causal:
            keep &= j <= i + right
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = keep & attn_mask
    return keep


def attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None, softcap=None, window=None,
              precision=None, sinks=None, leaves=None) -> AttentionResult:
    """Float64 attention. ``leaves`` = (q64, k64, v64) to differentiate through (default: detached copies),
    plus a fourth, the sinks' float64 leaf, when ``sinks`` is given.

    fp32 inputs with precision "tf32" are rounded to TF32 first (the contract's rounding, done here by
    float64 arithmetic). Probabilities are exact here; the kernels round them to the input dtype for the
    second matmul, which the bounds allow for.

    ``sinks`` (contract section 9): each row of head h gets one more logit, ``sinks[h]`` rounded to fp32
    (float64 for float64 inputs) and then exact, that enters the row's max and sum and carries no value.
    """
    if precision == "tf32" and q.dtype == torch.float32:
        q, k, v = round_tf32(q), round_tf32(k), round_tf32(v)
    acc = compute_dtype(q.dtype)
    s64 = None
    if sinks is not None:
        s64 = leaves[3] if leaves is not None else sinks.detach().to(acc).to(F64)
        leaves = None if leaves is None else leaves[:3]
    q64, k64, v64 = leaves if leaves is not None else (t.detach().to(F64) for t in (q, k, v))
    if leaves is not None and precision == "tf32" and q.dtype == torch.float32:
        # Values of the rounded inputs, gradient of the unrounded leaves (straight through the rounding).
        pairs = zip(leaves, (q, k, v), strict=True)
        q64, k64, v64 = (leaf + (r.to(F64) - leaf).detach() for leaf, r in pairs)
    hq, sq, sk, d = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    ke, ve = _heads(k64, hq), _heads(v64, hq)
    s = q64 @ ke.transpose(-1, -2)
    z = s * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    keep = attention_keep(sq, sk, attn_mask, is_causal, window).expand(z.shape)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        add = attn_mask.detach().to(F64).expand(z.shape)
        keep = keep & (add != NEG_INF)
        z = z + torch.where(keep, add, torch.zeros_like(add))
    z = torch.where(keep, z, torch.full_like(z, NEG_INF))
    m = torch.amax(z.detach(), -1, keepdim=True) if sk else z.new_full(z.shape[:-1] + (1,), NEG_INF)
    if s64 is not None:
        sink = s64.view(1, hq, 1, 1).expand(*m.shape)
        m = torch.maximum(m, sink.detach())
    empty = m == NEG_INF
    base = torch.where(empty, torch.zeros_like(m), m)
    e = torch.where(keep, torch.exp(z - base), torch.zeros_like(z))
    l = e.sum(-1, keepdim=True)
    p_sink = None
    if s64 is not None:
        e_sink = torch.where(sink == NEG_INF, torch.zeros_like(sink), torch.exp(sink - base))
        l = l + e_sink
        empty = l == 0
        p_sink = (e_sink / torch.where(empty, torch.ones_like(l), l)).squeeze(-1)
    p = e / torch.where(empty, torch.ones_like(l), l)
    out = p @ ve
    log_l = torch.log(torch.where(empty, torch.ones_like(l), l))
    lse = torch.where(empty, torch.full_like(m, NEG_INF), m + log_l)
    terms = q.detach().to(F64).abs() @ _heads(k.detach().to(F64).abs(), hq).transpose(-1, -2) * abs(scale)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        terms = terms + attn_mask.detach().to(F64).abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    terms = torch.where(keep, terms, torch.zeros_like(terms))
    zmag = terms.amax(-1, keepdim=True) if sk else terms.new_zeros(terms.shape[:-1] + (1,))
    if s64 is not None:  # the sink is a score of the row too (its base-2 conversion rounds like one)
        zmag = torch.maximum(zmag, s64.detach().abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
                             .view(1, hq, 1, 1))
    return AttentionResult(out=out, lse=lse.squeeze(-1), p=p.detach(), zmag=zmag,
                           v_abs=_heads(v.detach().to(F64).abs(), hq),
                           k_abs=_heads(k.detach().to(F64).abs(), hq),
                           q_abs=q.detach().to(F64).abs(),
                           p_sink=None if p_sink is None else p_sink.detach())


def attention_gradients(q, k, v, grad_out, **options):
    """(out, dq, dk, dv) in float64 by autograd on the oracle; dk/dv summed over each kv head's q heads.
    With ``sinks``: (out, dq, dk, dv, dsinks)."""
    leaves = tuple(t.detach().to(F64).requires_grad_(True) for t in (q, k, v))
    sinks = options.get("sinks")
    if sinks is not None:
        acc = compute_dtype(q.dtype)
        leaves += (sinks.detach().to(acc).to(F64).requires_grad_(True),)
    r = attention(q, k, v, leaves=leaves, **options)
    grads = torch.autograd.grad((r.out * grad_out.detach().to(F64)).sum(), leaves, allow_unused=True)
    grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves, strict=True)]
    return (r, *grads)


def _unit(dtype: torch.dtype, precision) -> float:
    """Unit roundoff of a matmul operand as the kernels feed it (probabilities, ds, inputs)."""
    if dtype == torch.float32:
        return 2.0**-11 if precision == "tf32" else 2.0**-24
    return eps(dtype) / 2


def attention_bounds(r: AttentionResult, q, grad_out=None, *, scale=None, softcap=None, precision=None):
    """Allowed |error| of (out, lse) and, with ``grad_out``, of (dq, dk, dv), element-wise.

    The score of each key is off by E_z (fp32 rounding of the dot, of the scale product and of the base-2
    conversion: a few ulps of the row's largest score term, times log2(D) for the accumulation); softmax
    is shift invariant, so the output moves by at most 2 E_z sum_j p_j |v_j|. Each matmul operand that the
    kernels round (p and ds to the input dtype, or to TF32) adds its unit roundoff times the same sum.
    """
    out_dtype = q.dtype
    d = q.shape[-1]
    sk = r.p.shape[-1]
    u32 = eps(torch.float32) / 2
    c = 8 + 2 * math.log2(max(d, 2)) + math.log2(max(sk, 2))
    z_err = c * u32 * (r.zmag + 1.0)
    if softcap is not None:
        z_err = z_err + 16 * u32 * softcap
    u_op = _unit(out_dtype, precision)
    pv = r.p @ r.v_abs
    rel = 2 * z_err + 2 * u_op + c * u32
    # Rounding p and ds to fp16/bf16 for a matmul is relative (u_op) only in the normal range: a tiny p or ds
    # lands on a subnormal and is off by up to half a subnormal step, absolutely, for every key it touches.
    eta = subnormal_step(out_dtype) / 2 if out_dtype in (torch.float16, torch.bfloat16) else 0.0
    touched = (r.p != 0).to(r.p.dtype)
    out_b = (eps(out_dtype) * r.out.detach().abs() + rel * pv + eta * (touched @ r.v_abs)
             + 2 * subnormal_step(out_dtype))
    lse = r.lse.detach()
    lse_fin = torch.where(torch.isfinite(lse), lse.abs(), torch.zeros_like(lse))
    lse_b = 2 * z_err.squeeze(-1) + c * u32 * (lse_fin + 1)
    if grad_out is None:
        return out_b, lse_b
    g = grad_out.detach().to(F64)
    ga = g.abs()
    scale = 1.0 / math.sqrt(d) if scale is None else abs(scale)
    # Magnitude of each ds term: p (|dp| + |delta| + |dO| |v| + |dO| |O|).
    dp_abs = ga @ r.v_abs.transpose(-1, -2)
    delta_abs = (ga * r.out.detach().abs()).sum(-1, keepdim=True)
    a = r.p * (dp_abs + delta_abs)
    # delta comes from the output rounded to its dtype: eps(out) |dO| |O| per row.
    rel_ds = 2 * z_err + 3 * u_op + c * u32 + eps(out_dtype)
    # The relative errors are per query row: they weight each term inside the sums over rows.
    # The kernels round scale * ds (not ds) to the operand dtype, so its subnormal floor is not scaled.
    dq_b = scale * ((rel_ds * a) @ r.k_abs) + eta * (touched @ r.k_abs)
    dk_full = scale * ((rel_ds * a).transpose(-1, -2) @ r.q_abs) + eta * (touched.transpose(-1, -2) @ r.q_abs)
    dv_full = (((2 * z_err + 2 * u_op + c * u32) * r.p + eta * touched).transpose(-1, -2) @ ga)
    return out_b, lse_b, dq_b, dk_full, dv_full


def sinks_bound(r: AttentionResult, q, grad_out, out_bound: torch.Tensor, *, softcap=None) -> torch.Tensor:
    """Allowed |error| of d loss / d sinks, (Hq,): ``-sum over rows of p_sink * delta``. Per row, p_sink is
    off by the score error (relative 2 E_z, as every p) and fp32 roundings; delta = rowsum(dO * O) by the
    output's error |dO| . out_bound plus fp32 accumulation; the rows' sum adds fp32-order error."""
    d = q.shape[-1]
    sk = r.p.shape[-1]
    sq = r.p.shape[-2]
    u32 = eps(torch.float32) / 2
    c = 8 + 2 * math.log2(max(d, 2)) + math.log2(max(sk, 2))
    z_err = (c * u32 * (r.zmag + 1.0)).squeeze(-1)
    if softcap is not None:
        z_err = z_err + 16 * u32 * softcap
    g = grad_out.detach().to(F64).abs()
    delta_abs = (g * r.out.detach().abs()).sum(-1)
    delta_err = (g * out_bound).sum(-1) + c * u32 * delta_abs
    rows = r.p_sink * ((2 * z_err + c * u32) * delta_abs + delta_err)
    n = r.p_sink.shape[0] * sq
    return rows.sum((0, 2)) + (math.log2(max(n, 2)) + 2) * u32 * (r.p_sink * delta_abs).sum((0, 2))


def reduce_kv_bound(bound: torch.Tensor, hkv: int) -> torch.Tensor:
    """Sum a (B, Hq, Sk, .) bound over the q heads of each kv head."""
    b, hq, s, d = bound.shape
    return bound.reshape(b, hkv, hq // hkv, s, d).sum(2)


def add_rounding(bound: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Plus the final rounding of the result to ``dtype`` (about one ulp)."""
    finite = expected.detach().abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    return bound + eps(dtype) * finite + 2 * subnormal_step(dtype)


# ---------------------------------------------------------------------------------------------------
# Cross-entropy: float64 oracle and forward-error bounds (contract section 10)
# ---------------------------------------------------------------------------------------------------
#
# Written from the math and torch's definition of F.cross_entropy, not from safeops.reference: logits
# (N, C, d...) or (N, C) with the class dim 1, the log-softmax in float64 of the compute-dtype values, the
# negative log-likelihood of the target times its weight, torch's label smoothing
# ``-(eps / C) sum_c w_c log p_c`` next to ``(1 - eps)`` times the nll, the weighted mean
# ``sum(w_t loss) / sum(w_t)``, and the z-loss ``z_loss * lse**2`` per counted row (averaged over the count
# for "mean"). The contract's cases: ignored rows are selected away (0 loss, 0 gradient, whatever they hold),
# a mean over nothing is 0, an all -inf counted row is an empty row: log-softmax -inf (loss +inf) with a
# zero gradient. A term whose factor is 0 is left out, not multiplied (no 0 * inf).


@dataclass
class CrossEntropyResult:
    loss: torch.Tensor  # float64: target-shaped ("none") or 0-d
    rows: dict  # per-row float64 quantities for the bounds, class dim last: z, m, log_l, p, t, w_t, ...
    reduction: str


def _ce_classes_last(x: torch.Tensor) -> torch.Tensor:
    return x.movedim(1, -1) if x.dim() > 2 else x


def cross_entropy(x: torch.Tensor, target: torch.Tensor, weight=None, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                  x64: torch.Tensor | None = None) -> CrossEntropyResult:
    """Float64 cross-entropy of ``x`` ((N, C, d...) or (C,) with a 0-d target), differentiable w.r.t.
    ``x64`` (a float64 copy of x, default ``x.to(float64)``)."""
    if x.dim() == 1:
        r = cross_entropy(x.unsqueeze(0), target.unsqueeze(0), weight, ignore_index, reduction,
                          label_smoothing, z_loss, None if x64 is None else x64.unsqueeze(0))
        if reduction == "none":
            r.loss = r.loss.squeeze(0)
        return r
    acc = compute_dtype(x.dtype)
    if x64 is None:
        x64 = x.detach().to(F64)
    # fp16/bf16/fp32 logits are exact in fp32, the compute dtype (and fp64 in fp64): z is x itself.
    z_all = _ce_classes_last(x64)
    n_classes = z_all.shape[-1]
    counted = target != ignore_index
    t = torch.where(counted, target, torch.zeros_like(target)).long()
    # Ignored rows are selected away before anything touches them (their NaNs must not reach a gradient).
    z = torch.where(counted.unsqueeze(-1), z_all, torch.zeros_like(z_all))
    m = (torch.amax(z.detach(), -1, keepdim=True) if n_classes else
         z.new_full(z.shape[:-1] + (1,), NEG_INF))
    empty = (m == NEG_INF) & counted.unsqueeze(-1)
    zs = torch.where(empty, torch.zeros_like(z), z)  # empty rows: a constant result, no NaN in autograd
    ms = torch.where(empty, torch.zeros_like(m), m)
    e = torch.exp(zs - ms)
    l = e.sum(-1, keepdim=True)
    logp = torch.where(empty, torch.full_like(zs, NEG_INF), (zs - ms) - torch.log(l))
    w = torch.ones(n_classes, dtype=F64) if weight is None else weight.detach().to(acc).to(F64)
    w_t = w[t].unsqueeze(-1)
    ce = torch.zeros_like(m)
    nll = -torch.gather(logp, -1, t.unsqueeze(-1))
    if label_smoothing < 1:
        ce = ce + (1 - label_smoothing) * w_t * nll
    if label_smoothing > 0:
        ce = ce + (label_smoothing / n_classes) * -(w * logp).sum(-1, keepdim=True)
    lse = torch.where(empty, torch.full_like(m, NEG_INF), ms + torch.log(l))
    zl = z_loss * lse * lse if z_loss > 0 else torch.zeros_like(m)
    keep = counted.unsqueeze(-1)
    ce = torch.where(keep, ce, torch.zeros_like(ce)).squeeze(-1)
    zl = torch.where(keep, zl, torch.zeros_like(zl)).squeeze(-1)
    w_counted = torch.where(counted, w_t.squeeze(-1), torch.zeros_like(ce))
    count = counted.sum().to(F64)
    if reduction == "none":
        loss = ce + zl
    elif reduction == "sum":
        loss = ce.sum() + zl.sum()
    else:
        # A mean over nothing is 0 (selected: no 0 / 0, no 0 * inf).
        w_sum = w_counted.sum()
        loss = (torch.where(w_sum != 0, ce.sum() / torch.where(w_sum != 0, w_sum, 1.0), 0.0)
                + torch.where(count != 0, zl.sum() / torch.where(count != 0, count, 1.0), 0.0))
    p = torch.where(keep & ~empty, torch.exp(logp.detach()), torch.zeros_like(logp))
    rows = dict(z=z.detach(), m=m, log_l=torch.log(l.detach()), p=p, t=t, w=w, w_t=w_t.detach(), keep=keep,
                empty=empty, ce=ce.detach(), zl=zl.detach(), lse=lse.detach(), w_counted=w_counted.detach(),
                count=count, n_classes=n_classes, smoothing=label_smoothing, z_loss=z_loss, acc=acc)
    return CrossEntropyResult(loss=loss, rows=rows, reduction=reduction)


def cross_entropy_gradient(x: torch.Tensor, target: torch.Tensor, grad: torch.Tensor, **options):
    """(oracle result, float64 d(sum(grad * loss))/dx) by autograd on the oracle."""
    x64 = x.detach().to(F64).requires_grad_(True)
    r = cross_entropy(x, target, x64=x64, **options)
    g = grad.detach().to(F64)
    finite = torch.where(g == 0, torch.zeros_like(r.loss), r.loss)  # 0 * inf must not be NaN
    (dx,) = torch.autograd.grad((g * finite).sum(), x64, allow_unused=True)
    return r, torch.zeros_like(x64) if dx is None else dx


def _ce_row_errors(r: CrossEntropyResult) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Per row (class dim kept, size 1): absolute error bounds of the fp32 cross-entropy part, of the z-loss
    part, and of lse; plus u."""
    q = r.rows
    acc, n = q["acc"], max(q["n_classes"], 1)
    u = 2 * eps(acc)
    k = math.ceil(math.log2(max(n, 2))) + 4
    keep = q["keep"] & ~q["empty"]
    m = torch.where(keep, q["m"], torch.zeros_like(q["m"]))
    z = torch.where(keep, q["z"], m)
    finite = torch.isfinite(z)
    dzm = torch.where(finite, (z - m).abs(), torch.zeros_like(z))
    p = q["p"]
    log_l = torch.where(keep, q["log_l"], torch.zeros_like(q["log_l"])).abs()
    # log l: the roundings of z - m (amplified by exp), of exp and of the k-term sum, relative to l.
    err_log_l = u * ((p * (dzm + k)).sum(-1, keepdim=True) + log_l + 1)
    z_t = torch.gather(z, -1, q["t"].unsqueeze(-1))
    gap = torch.where(torch.isfinite(z_t), (m - z_t).abs(), torch.zeros_like(z_t))
    err_nll = u * (gap + log_l) + err_log_l
    eps_ls = q["smoothing"]
    w_abs = q["w"].abs()
    err = torch.zeros_like(m)
    if eps_ls < 1:
        err = err + (1 - eps_ls) * q["w_t"].abs() * (err_nll + u * (gap + log_l))
    if eps_ls > 0:
        # sum_c w_c ((m - z_c) + log l), however it is arranged: k roundings of terms no larger than
        # |w_c| (|z_c - m| + |m - z_t| + log l), plus W times the error of log l.
        terms = (w_abs * (dzm + gap + log_l)).sum(-1, keepdim=True)
        err = err + (eps_ls / n) * (u * k * terms + w_abs.sum() * err_log_l + u * terms)
    err = err + u * q["ce"].unsqueeze(-1).abs().nan_to_num(0.0, posinf=0.0)
    lse = q["lse"]
    lse_abs = torch.where(torch.isfinite(lse), lse.abs(), torch.zeros_like(lse))
    err_lse = u * (m.abs() + lse_abs) + err_log_l
    err_z = q["z_loss"] * (2 * lse_abs * err_lse + err_lse ** 2) + u * q["zl"].unsqueeze(-1).abs().nan_to_num(
        0.0, posinf=0.0)
    return torch.where(keep, err, 0.0), torch.where(keep, err_z, 0.0), torch.where(keep, err_lse, 0.0), u


def cross_entropy_bound(r: CrossEntropyResult, out_dtype: torch.dtype) -> torch.Tensor:
    """Allowed |actual - expected| of the loss (shape of ``r.loss``)."""
    q = r.rows
    err_ce, err_z, _, u = _ce_row_errors(r)
    err_ce, err_z = err_ce.squeeze(-1), err_z.squeeze(-1)
    k_rows = math.ceil(math.log2(max(q["ce"].numel(), 2))) + 2
    ce_abs = q["ce"].abs().nan_to_num(0.0, posinf=0.0)
    zl_abs = q["zl"].abs().nan_to_num(0.0, posinf=0.0)
    if r.reduction == "none":
        internal = err_ce + err_z + u * (ce_abs + zl_abs)
    elif r.reduction == "sum":
        internal = (err_ce + err_z).sum() + u * k_rows * (ce_abs + zl_abs).sum()
    else:
        w_sum, count = q["w_counted"].sum(), q["count"]
        internal = torch.zeros((), dtype=F64)
        if w_sum != 0:
            w_err = u * k_rows * q["w_counted"].abs().sum()
            ce_sum = q["ce"].sum().nan_to_num(0.0, posinf=0.0)
            internal = internal + (err_ce.sum() + u * k_rows * ce_abs.sum()) / w_sum.abs() + (
                ce_sum.abs() / w_sum.abs()) * (w_err / w_sum.abs() + u)
        if count:
            internal = internal + (err_z.sum() + u * k_rows * zl_abs.sum()) / count + u * zl_abs.sum() / count
    return _rounding(TOLERANCE[out_dtype], out_dtype, r.loss.detach()) + internal.reshape(r.loss.shape)


def cross_entropy_gradient_bound(r: CrossEntropyResult, grad: torch.Tensor, x: torch.Tensor,
                                 expected: torch.Tensor) -> torch.Tensor:
    """Allowed |actual - expected| of d/dx (x's shape), ``expected`` the oracle's gradient."""
    q = r.rows
    _, _, err_lse, u = _ce_row_errors(r)
    n = max(q["n_classes"], 1)
    k = math.ceil(math.log2(max(n, 2))) + 4
    keep = q["keep"] & ~q["empty"]
    g = grad.detach().to(F64)
    if r.reduction == "none":
        s_ce = s_z = g.unsqueeze(-1) if g.dim() else g.reshape(1, 1)
        rel = 0.0
    elif r.reduction == "sum":
        s_ce = s_z = g
        rel = 0.0
    else:
        w_sum, count = q["w_counted"].sum(), q["count"]
        s_ce = g / w_sum if w_sum != 0 else g * 0
        s_z = g / count if count else g * 0
        k_rows = math.ceil(math.log2(max(q["ce"].numel(), 2))) + 2
        rel = u * k_rows * (q["w_counted"].abs().sum() / w_sum.abs() if w_sum != 0 else 1.0) + 2 * u
    m = torch.where(keep, q["m"], torch.zeros_like(q["m"]))
    z = torch.where(keep, q["z"], m)
    dzm = torch.where(torch.isfinite(z), (z - m).abs(), torch.zeros_like(z))
    p = q["p"]
    eps_ls = q["smoothing"]
    w_abs = q["w"].abs()
    b = (1 - eps_ls) * q["w_t"].abs() * s_ce.abs() if eps_ls < 1 else torch.zeros_like(m)
    kk = (eps_ls / n) * s_ce.abs() * w_abs if eps_ls > 0 else torch.zeros_like(z)
    lse = q["lse"]
    lse_abs = torch.where(torch.isfinite(lse), lse.abs(), torch.zeros_like(lse))
    a = b + 2 * q["z_loss"] * s_z.abs() * lse_abs
    if eps_ls > 0:
        a = a + (eps_ls / n) * w_abs.sum() * s_ce.abs()
    err_a = 4 * u * a + 2 * q["z_loss"] * s_z.abs() * err_lse
    p_err = u * p * (dzm + k) + 2 * subnormal_step(q["acc"])
    onehot = torch.zeros_like(z).scatter_(-1, q["t"].unsqueeze(-1), 1.0)
    terms = p * a + onehot * b + kk  # no smaller than |dz|
    err = p_err * a + p * err_a + 4 * u * terms + rel * terms
    err = torch.where(keep, err, torch.zeros_like(err))
    err = err.movedim(-1, 1) if x.dim() > 2 else err.reshape(x.shape)
    return _rounding(TOLERANCE[x.dtype], x.dtype, expected) + err
