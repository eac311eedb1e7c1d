"""The numerics contract in plain torch.

This is the CPU implementation of every safeops op and the readable statement of the contract
(docs/contract.md):
each logit becomes one value ``z`` (one multiply by the scale, then the mask), the row max ``m`` and the
row sum ``l = sum(exp(z - m))`` are kept apart, empty rows are defined, and gradients are recomputed from
the input, ``m`` and ``l``. The Triton kernels implement the same formulas; tests compare both with an
independent float64 oracle.
"""

from __future__ import annotations

import einops
import torch

SOFTMAX, LOG_SOFTMAX, LOGSUMEXP = 0, 1, 2
NEG_INF = float("-inf")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; every other floating dtype is computed in fp32 (contract section 2)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def logits(
    x: torch.Tensor,
    scale: float | None,
    scale_tensor: torch.Tensor | None,
    mask: torch.Tensor | None,
    acc: torch.dtype,
) -> torch.Tensor:
    """The one materialized value per logit: ``z = acc(x) * acc(scale)``, excluded entries -inf."""
    z = x.to(acc)
    if scale_tensor is not None:
        z = z * scale_tensor.to(acc)
    elif scale is not None:
        z = z * torch.tensor(scale, dtype=acc)
    if mask is not None:
        z = z.masked_fill(~mask, NEG_INF)
    return z


def _safe_max(m: torch.Tensor) -> torch.Tensor:
    # An empty row has m = -inf; subtracting it would give -inf - -inf = NaN.
    return torch.where(m == NEG_INF, torch.zeros_like(m), m)


def row_stats(z: torch.Tensor, dim: int, lse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max and row sum of exp(z - max), kept apart (contract section 3), keepdim=True.

    ``lse`` (logsumexp): an entry equal to a +inf max counts exp(0) = 1 instead of exp(inf - inf) = NaN, so
    a row holding +inf and no NaN has ``l`` = its number of +inf entries and ``m + log(l) = +inf``, as
    ``torch.logsumexp`` gives (contract section 5); a NaN (amax propagates it) still makes the row NaN.
    """
    if z.shape[dim] == 0:
        # A row with no entries is an empty row (contract section 4); amax would refuse it.
        shape = z.shape[:dim] + (1,) + z.shape[dim + 1:]
        return z.new_full(shape, NEG_INF), z.new_zeros(shape)
    m = torch.amax(z, dim, keepdim=True)
    shifted = z - _safe_max(m)
    if lse:
        shifted = torch.where(z == float("inf"), torch.zeros_like(shifted), shifted)
    l = torch.exp(shifted).sum(dim, keepdim=True)
    return m, l


def probabilities(z: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    p = torch.exp(z - _safe_max(m)) / l
    return torch.where(l == 0, torch.zeros_like(p), p)


def forward(
    kind: int,
    x: torch.Tensor,
    dim: int,
    scale: float | None = None,
    scale_tensor: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(out, row_max, row_sum)``; the stats have ``dim`` removed and are in the compute dtype."""
    acc = compute_dtype(out_dtype if out_dtype == torch.float64 else x.dtype)
    out_dtype = out_dtype or x.dtype
    z = logits(x, scale, scale_tensor, mask, acc)
    m, l = row_stats(z, dim, lse=kind == LOGSUMEXP)
    if kind == SOFTMAX:
        out = probabilities(z, m, l)
    elif kind == LOG_SOFTMAX:
        out = (z - _safe_max(m)) - torch.log(l)
        out = torch.where(l == 0, torch.full_like(out, NEG_INF), out)
    elif kind == LOGSUMEXP:
        out = (m + torch.log(l)).squeeze(dim)
    else:
        raise ValueError(f"unknown kind {kind}")
    return out.to(out_dtype), m.squeeze(dim), l.squeeze(dim)


def backward(
    kind: int,
    grad: torch.Tensor,
    x: torch.Tensor,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    dim: int,
    scale: float | None = None,
    scale_tensor: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    need_dscale: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradient w.r.t. ``x`` (and the tensor scale) from the saved input and fp32 row stats.

    ``grad`` has the shape of the forward output (for logsumexp: ``dim`` removed).
    """
    acc = row_max.dtype
    z = logits(x, scale, scale_tensor, mask, acc)
    m, l = row_max.unsqueeze(dim), row_sum.unsqueeze(dim)
    p = probabilities(z, m, l)
    keep = z != NEG_INF
    zero = torch.zeros((), dtype=acc, device=x.device)
    if kind == LOGSUMEXP:
        dz = grad.to(acc).unsqueeze(dim) * p
    else:
        dy = grad.to(acc)
        if kind == SOFTMAX:
            s = torch.where(keep, dy * p, zero).sum(dim, keepdim=True)
            dz = p * (dy - s)
        else:
            s = torch.where(keep, dy, zero).sum(dim, keepdim=True)
            dz = dy - p * s
    # Excluded entries do not influence any output: their gradient is exactly 0, whatever dy holds.
    dz = torch.where(keep, dz, zero)
    dscale = None
    if scale_tensor is not None:
        dx = dz * scale_tensor.to(acc)
        if need_dscale:
            dscale = torch.where(keep, dz * x.to(acc), zero).sum()
    elif scale is not None:
        dx = dz * torch.tensor(scale, dtype=acc)
    else:
        dx = dz
    return dx.to(x.dtype), dscale


# --------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------
#
# The kernels work in base 2 with log2(e) folded into the one scale multiply (contract section 1 allows
# it as long as the same bits feed the max and the subtraction): the materialized score is
#
#     z2 = fp32(s * fp32(scale * log2e))                              no softcap
#     z2 = fp32(tanh(fp32(s * fp32(scale / softcap))) * fp32(softcap * log2e))   with softcap
#     z2 = z2 + fp32(fp32(mask) * fp32(log2e))                        additive mask
#     z2 = -inf where a boolean / causal / window mask excludes the key (selected, never added)
#
# with s the fp32 dot product q.k. The row stats are m2 = max z2 and l = sum exp2(z2 - m2), kept apart;
# the user-visible lse is ln(2) * (m2 + log2(l)). This reference computes s in float64 and rounds it once
# (more accurate than any kernel's fp32 accumulation), then follows the same formulas; everything after
# z2 is float64. It ignores ``precision`` (CPU tensors are always computed at full precision).
#
# Attention sinks (contract section 9): one logit s[h] per query head, in the units of the scaled scores,
# that carries no value. Its base-2 score is zs2 = fp32(s[h]) * fp32(log2e), one multiply (fp64 for fp64
# inputs); it is not softcapped or masked. It enters every row of head h like a key's score: m2 = max(max
# z2, zs2) and l = sum exp2(z2 - m2) + exp2(zs2 - m2). A row that sees no key then has m2 = zs2, l = 1,
# output 0 and lse = fp32(ln2 * fp64(zs2)): s[h] up to one ulp (the base-2 round trip rounds twice).

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
ATTN_MASK_NONE, ATTN_MASK_BOOL, ATTN_MASK_ADD = 0, 1, 2


def attention_constants(scale: float, softcap: float | None) -> tuple[float, float]:
    """(c1, c2) for ``z2 = s * c1`` or ``z2 = tanh(s * c1) * c2``, each rounded once to fp32."""
    f32 = torch.float32
    if softcap is None:
        return float(torch.tensor(scale * LOG2E, dtype=f32)), 1.0
    return float(torch.tensor(scale / softcap, dtype=f32)), float(torch.tensor(softcap * LOG2E, dtype=f32))


def attention_visible(sq: int, sk: int, is_causal: bool, window_left: int, window_right: int,
                      device) -> torch.Tensor | None:
    """Bool (sq, sk): key j visible from query i (top-left aligned); None when everything is visible.

    ``window_left``/``window_right`` < 0 mean unbounded; ``is_causal`` caps the right side at 0.
    """
    right = 0 if is_causal else window_right
    if right < 0 and window_left < 0:
        return None
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(sk, device=device).unsqueeze(0)
    visible = torch.ones((sq, sk), dtype=torch.bool, device=device)
    if right >= 0:
        visible &= j <= i + right
    if window_left >= 0:
        visible &= j >= i - window_left
    return visible


def _expand_kv(t: torch.Tensor, hq: int) -> torch.Tensor:
    """GQA: kv head h serves q heads h * g ... h * g + g - 1."""
    return einops.repeat(t, "b h s d -> b (h g) s d", g=hq // t.shape[1])


def attention_scores(q, k, mask, mask_kind, is_causal, scale, softcap, window_left, window_right):
    """z2 (B, Hq, Sq, Sk) in the compute dtype (fp32, or fp64 for fp64 inputs), -inf where excluded."""
    acc = compute_dtype(q.dtype)
    k = _expand_kv(k, q.shape[1])
    s = (q.to(torch.float64) @ k.to(torch.float64).transpose(-1, -2)).to(acc)
    c1, c2 = attention_constants(scale, softcap)
    if acc == torch.float64:
        c1, c2 = (scale * LOG2E, 1.0) if softcap is None else (scale / softcap, softcap * LOG2E)
    c1 = torch.tensor(c1, dtype=acc)
    c2 = torch.tensor(c2, dtype=acc)
    z = s * c1 if softcap is None else torch.tanh(s * c1) * c2
    if mask_kind == ATTN_MASK_ADD:
        # An additive -inf excludes the key: selected, so a NaN score there does not reach the row.
        add = mask.to(acc)
        z = torch.where(add == NEG_INF, NEG_INF, z + add * torch.tensor(LOG2E, dtype=acc))
    keep = None
    if mask_kind == ATTN_MASK_BOOL:
        keep = mask
    visible = attention_visible(q.shape[2], k.shape[2], is_causal, window_left, window_right, q.device)
    if visible is not None:
        keep = visible if keep is None else keep & visible
    if keep is not None:
        z = torch.where(keep, z, torch.full((), NEG_INF, dtype=acc))
    return z


def sink_scores(sinks: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """zs2 = acc(sinks) * acc(log2e) per head: the sinks' one materialized base-2 score, (Hq,)."""
    return sinks.to(acc) * torch.tensor(LOG2E, dtype=acc)


def _attention_probs(z: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """float64 p = exp2(z - m) / l, exactly 0 in empty rows (m = -inf, l = 0)."""
    m = m.to(torch.float64).unsqueeze(-1)
    l = l.to(torch.float64).unsqueeze(-1)
    e = torch.exp2(z.to(torch.float64) - _safe_max(m))
    p = e / torch.where(l == 0, torch.ones_like(l), l)
    return torch.where(l == 0, torch.zeros_like(p), p)


def attention_forward(q, k, v, mask, mask_kind, is_causal, scale, softcap, window_left, window_right,
                      sinks=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense attention, ``(B, H, S, D)`` layout. Returns ``(out, m2, l)``; the stats are (B, Hq, Sq).
    ``sinks``: None or (Hq,) logits (see "Attention sinks" above)."""
    acc = compute_dtype(q.dtype)
    B, Hq, Sq, _ = q.shape
    if k.shape[2] == 0 and sinks is None:
        out = q.new_zeros((B, Hq, Sq, v.shape[3]))
        return out, q.new_full((B, Hq, Sq), NEG_INF, dtype=acc), q.new_zeros((B, Hq, Sq), dtype=acc)
    z = attention_scores(q, k, mask, mask_kind, is_causal, scale, softcap, window_left, window_right)
    m = torch.amax(z, -1) if k.shape[2] else z.new_full((B, Hq, Sq), NEG_INF)
    if sinks is not None:
        zs = sink_scores(sinks, acc).view(1, Hq, 1)
        m = torch.maximum(m, zs)  # NaN propagates: a NaN sink makes its head's rows NaN
    base = _safe_max(m.to(torch.float64))
    e = torch.exp2(z.to(torch.float64) - base.unsqueeze(-1))
    l64 = e.sum(-1)
    if sinks is not None:
        l64 = l64 + torch.exp2(zs.to(torch.float64) - base)
    l = l64.to(acc)
    o = e @ _expand_kv(v, Hq).to(torch.float64)
    o = o / torch.where(l64 == 0, torch.ones_like(l64), l64).unsqueeze(-1)
    o = torch.where((l64 == 0).unsqueeze(-1), torch.zeros_like(o), o)
    return o.to(q.dtype), m, l


def attention_lse(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Natural-log logsumexp from the base-2 stats; -inf for empty rows."""
    lse = (m.to(torch.float64) + torch.log2(l.to(torch.float64))) * LN2
    return torch.where(l == 0, torch.full_like(lse, NEG_INF), lse).to(m.dtype)


def attention_sinks_backward(delta: torch.Tensor, m: torch.Tensor, l: torch.Tensor,
                             sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks = -sum over rows of p_sink * delta, ``p_sink = exp2(zs2 - m2) / l`` from the saved
    stats, ``delta = rowsum(dO * O)``. ``delta``, ``m``, ``l``: the stats' layout, heads second to last
    ((B, Hq, Sq) dense, (Hq, Tq) packed); summed in float64, returned in the stats' dtype, (Hq,)."""
    f64 = torch.float64
    zs = sink_scores(sinks, m.dtype).to(f64).unsqueeze(-1)
    m64, l64 = m.to(f64), l.to(f64)
    p = torch.exp2(zs - _safe_max(m64)) / torch.where(l64 == 0, torch.ones_like(l64), l64)
    term = torch.where(l64 == 0, torch.zeros_like(p), p * delta.to(f64))
    dims = [d for d in range(term.dim()) if d != term.dim() - 2]
    return (-term.sum(dims)).to(m.dtype)


def _reduce_heads(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """Sum the gradients of the q heads of one group onto their kv head."""
    return einops.reduce(t, "b (h g) s d -> b h s d", "sum", h=hkv)


def attention_backward(grad, q, k, v, out, m, l, mask, mask_kind, is_causal, scale, softcap,
                       window_left, window_right) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the saved inputs, output and base-2 stats (contract section 3)."""
    f64 = torch.float64
    Hq, Hkv = q.shape[1], k.shape[1]
    if k.shape[2] == 0 or q.shape[2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    z = attention_scores(q, k, mask, mask_kind, is_causal, scale, softcap, window_left, window_right)
    p = _attention_probs(z, m, l)
    do = grad.to(f64)
    ve = _expand_kv(v, Hq).to(f64)
    ke = _expand_kv(k, Hq).to(f64)
    dv = p.transpose(-1, -2) @ do
    dp = do @ ve.transpose(-1, -2)
    delta = (do * out.to(f64)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    # Chain rule through z = s * scale (or softcap * tanh(s * scale / softcap)); excluded keys have p = 0.
    if softcap is None:
        ds = ds * scale
    else:
        t = torch.tanh(q.to(f64) @ ke.transpose(-1, -2) * (scale / softcap))
        ds = ds * (scale * (1 - t * t))
    ds = torch.where(p == 0, torch.zeros_like(ds), ds)
    dq = ds @ ke
    dk = ds.transpose(-1, -2) @ q.to(f64)
    return (dq.to(q.dtype), _reduce_heads(dk, Hkv).to(k.dtype), _reduce_heads(dv, Hkv).to(v.dtype))


# --------------------------------------------------------------------------------------------------
# Merging partial attention results (stacked partials: outs (P, ..., D), natural-log lses (P, ...))
# --------------------------------------------------------------------------------------------------


def merge_weights(lses: torch.Tensor, acc: torch.dtype, sink: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, m, s): softmax weights ``a_i = exp(lse_i - m) / s`` of the partials (0 for an empty partial and in
    rows where every partial is empty), the max lse ``m`` and ``s = sum_i exp(lse_i - m)``. ``sink`` (None, or
    a per-row logit broadcastable to a row of ``lses``) is one more partial with output 0: it enters ``m``
    and ``s``; append ``a_sink = exp(sink - m) / s`` as the last of ``a``."""
    lses = lses.to(acc)
    if sink is not None:
        lses = torch.cat([lses, sink.to(acc).expand(lses.shape[1:]).unsqueeze(0)])
    m = torch.amax(lses, 0)
    excluded = lses == NEG_INF
    w = torch.where(excluded, torch.zeros_like(lses), torch.exp(lses - _safe_max(m)))
    s = w.sum(0)
    a = torch.where(excluded | (s == 0), torch.zeros_like(w), w / torch.where(s == 0, torch.ones_like(s), s))
    return a, m, s


def merge_attention_forward(outs: torch.Tensor, lses: torch.Tensor, sink: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of attention over the union of the partials' key sets, computed in fp32 (fp64 for
    fp64 outputs); an empty partial (lse -inf) is selected away, an all-empty row gives 0 and -inf. ``sink``:
    see ``merge_weights`` (counted once, whatever the number of partials)."""
    acc = compute_dtype(outs.dtype)
    a, m, s = merge_weights(lses, acc, sink)
    a = a[: lses.shape[0]]
    excluded = (lses == NEG_INF).unsqueeze(-1)
    out = torch.where(excluded, torch.zeros((), dtype=acc), a.unsqueeze(-1) * outs.to(acc)).sum(0)
    log_s = torch.log(torch.where(s == 0, torch.ones_like(s), s))
    lse = torch.where(s == 0, torch.full_like(m, NEG_INF), m + log_s)
    return out.to(outs.dtype), lse.to(lses.dtype)


def merge_attention_backward(grad_out: torch.Tensor, grad_lse: torch.Tensor | None, outs: torch.Tensor,
                             lses: torch.Tensor, sink: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, ...]:
    """``d out_i = a_i g`` and ``d lse_i = a_i (g_lse + g . (out_i - out))``, ``out`` the unrounded merge;
    with ``sink`` also ``d sink = a_sink (g_lse - g . out)`` per row (the sink's output is 0), fp32 (fp64)."""
    acc = compute_dtype(outs.dtype)
    a, _, _ = merge_weights(lses, acc, sink)
    a, a_sink = a[: lses.shape[0]], a[lses.shape[0]:]
    excluded = lses == NEG_INF
    g = grad_out.to(acc)
    dots = (g.unsqueeze(0) * outs.to(acc)).sum(-1)
    g_dot_out = torch.where(excluded, torch.zeros_like(dots), a * dots).sum(0)
    glse = torch.zeros_like(g_dot_out) if grad_lse is None else grad_lse.to(acc)
    d_lse = torch.where(excluded, torch.zeros_like(dots), a * (glse + (dots - g_dot_out)))
    d_outs = torch.where(excluded.unsqueeze(-1), torch.zeros((), dtype=acc), a.unsqueeze(-1) * g)
    if sink is None:
        return d_outs.to(outs.dtype), d_lse.to(lses.dtype)
    return d_outs.to(outs.dtype), d_lse.to(lses.dtype), a_sink[0] * (glse - g_dot_out)


# --------------------------------------------------------------------------------------------------
# fp8 cast + transpose
# --------------------------------------------------------------------------------------------------


class Fp8Format:
    """What the cast kernel needs to know about an fp8 dtype; the one home of these constants."""

    def __init__(self, dtype: torch.dtype, code: int, mantissa_bits: int, exponent_bias: int):
        self.dtype, self.code = dtype, code
        self.mantissa_bits, self.exponent_bias = mantissa_bits, exponent_bias
        self.max = torch.finfo(dtype).max  # 448 for e4m3fn, 57344 for e5m2
        self.max_bits = int(torch.tensor(self.max, dtype=torch.float32).view(torch.int32))


FP8_FORMATS = {
    torch.float8_e4m3fn: Fp8Format(torch.float8_e4m3fn, 0, 3, 7),
    torch.float8_e5m2: Fp8Format(torch.float8_e5m2, 1, 2, 15),
}


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   rowwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``y = (x.float() * scale).clamp(-max, max).to(dtype)``, ``y_t`` its column-major copy, and
    ``amax = x.abs().max()`` in fp32 (0 for an empty ``x``). ``scale`` is one element, or ``(M, 1)``
    when ``rowwise``; it is converted to fp32 first (exact for fp16/bf16/fp32, as torch's promotion does).
    """
    fmax = FP8_FORMATS[dtype].max
    s = scale.to(torch.float32).reshape(-1, 1) if rowwise else scale.to(torch.float32).reshape(())
    y = (x.float() * s).clamp(-fmax, fmax).to(dtype)
    y_t = y.t().contiguous().t()
    amax = x.abs().max().float() if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
    return y, y_t, amax


# --------------------------------------------------------------------------------------------------
# Cross-entropy (contract section 10)
# --------------------------------------------------------------------------------------------------
#
# Logits ``x`` are ``(N, C, d...)`` (class dim 1, as F.cross_entropy takes them), ``target`` is ``(N, d...)``
# of class indices. Per counted row (target != ignore_index), with z = the logits in the compute dtype,
# m = max z, l = sum exp(z - m) (kept apart, section 3), w the class weights (1 without), W = sum w,
# eps the label smoothing and C the number of classes:
#
#     nll    = (m - z_t) + log(l)                       (never lse - z_t: a large m would swallow log(l))
#     smooth = sum_c w_c ((m - z_c) + log(l))            (= sum_c w_c (lse - z_c), torch's smoothing term)
#     ce     = (1 - eps) w_t nll + (eps / C) smooth
#     zl     = z_loss * lse**2,  lse = m + log(l)
#
# A term whose factor is 0 (eps = 0, eps = 1, z_loss = 0) is left out rather than multiplied by 0, so an
# infinite nll or smoothing sum cannot turn into NaN through it. Reductions: "none" gives ce + zl per row;
# "sum" the sum over rows; "mean" sum(ce) / sum(w_t) + sum(zl) / count, each part 0 when its denominator is
# 0 (eager PyTorch gives NaN for a mean over no counted row). Ignored rows contribute exactly 0 and get a
# zero gradient, whatever their logits hold: they are selected away. A counted row whose logits are all
# -inf is an empty row (section 4): log-softmax -inf, so nll = +inf, with a zero gradient.

CE_NONE, CE_MEAN, CE_SUM = 0, 1, 2  # torch's Reduction enum


def cross_entropy_rows(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """(N, C, d...) logits -> (N, d..., C) in the compute dtype, contiguous: the class dim last, and the same
    memory layout whatever x's, so that torch's reductions add in the same order (contract section 6)."""
    return (x.movedim(1, -1) if x.dim() > 2 else x).to(acc).contiguous()


def _log(l: torch.Tensor) -> torch.Tensor:
    """log of row sums, correctly rounded (in fp64, as the kernels do it); 0 where l = 0."""
    return torch.log(torch.where(l == 0, torch.ones_like(l), l).double()).to(l.dtype)


def _ce_row_terms(x, target, weight, ignore_index, label_smoothing, z_loss, acc):
    z = cross_entropy_rows(x, acc)
    n_classes = z.shape[-1]
    target = target.long()  # int32 / uint8 indices; a uint8 tensor would index as a mask
    counted = target != ignore_index
    t = torch.where(counted, target, torch.zeros_like(target)).unsqueeze(-1)
    m, l = row_stats(z, -1)
    m_safe = _safe_max(m)
    empty = l == 0
    log_l = _log(l)
    w = None if weight is None else weight.to(acc)
    w_t = torch.ones_like(m) if w is None else w[t]
    zero = torch.zeros((), dtype=acc, device=x.device)
    ce = torch.zeros_like(m)
    if label_smoothing < 1:
        nll = (m_safe - torch.gather(z, -1, t)) + log_l
        ce = ce + torch.tensor(1 - label_smoothing, dtype=acc) * (w_t * nll)
    if label_smoothing > 0:
        per_class = (m_safe - z) + log_l
        smooth = (per_class if w is None else w * per_class).sum(-1, keepdim=True)
        ce = ce + torch.tensor(label_smoothing / n_classes, dtype=acc) * smooth
    ce = torch.where(empty, torch.full_like(ce, float("inf")), ce)
    zl = torch.zeros_like(m)
    if z_loss > 0:
        lse = torch.where(empty, torch.full_like(m, NEG_INF), m + log_l)
        zl = torch.tensor(z_loss, dtype=acc) * (lse * lse)
    keep = counted.unsqueeze(-1)
    return (z, m, l, empty, keep, t, w, w_t, torch.where(keep, ce, zero), torch.where(keep, zl, zero),
            torch.where(keep, w_t, zero))


def cross_entropy_forward(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                          ignore_index: int, reduction: int, label_smoothing: float, z_loss: float,
                          out_dtype: torch.dtype | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, row_max, row_sum, denom)``: the loss in ``out_dtype`` (default x's; target-shaped for "none",
    else 0-d), the row stats (target-shaped, compute dtype: fp64 for fp64 logits or loss) and
    ``denom = (sum of w_t, count)`` over counted rows."""
    acc = compute_dtype(torch.float64 if out_dtype == torch.float64 else x.dtype)
    _, m, l, _, keep, _, _, _, ce, zl, w_t = _ce_row_terms(x, target, weight, ignore_index, label_smoothing,
                                                           z_loss, acc)
    acc = m.dtype
    count = keep.sum().to(acc)
    w_sum = w_t.sum() if weight is not None else count
    denom = torch.stack([w_sum, count])
    if reduction == CE_NONE:
        loss = (ce + zl).squeeze(-1)
    elif reduction == CE_SUM:
        loss = ce.sum() + zl.sum()
    else:
        loss = _ratio(ce.sum(), w_sum) + _ratio(zl.sum(), count)
    return loss.to(out_dtype or x.dtype), m.squeeze(-1), l.squeeze(-1), denom


def _ratio(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(b == 0, torch.zeros_like(a), a / torch.where(b == 0, torch.ones_like(b), b))


def cross_entropy_backward(grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor,
                           weight: torch.Tensor | None, row_max: torch.Tensor, row_sum: torch.Tensor,
                           denom: torch.Tensor, ignore_index: int, reduction: int, label_smoothing: float,
                           z_loss: float) -> torch.Tensor:
    """d loss / d x from the saved logits and row stats: per counted, non-empty row

        dz_c = p_c (s_ce ((1 - eps) w_t + eps W / C) + s_z 2 z_loss lse) - s_ce (1 - eps) w_t [c == t]
               - s_ce (eps / C) w_c

    with ``s_ce``, ``s_z`` the incoming gradient divided by the mean's denominators (sum of w_t, count)."""
    acc = row_max.dtype
    z = cross_entropy_rows(x, acc)
    n_classes = z.shape[-1]
    target = target.long()
    counted = (target != ignore_index).unsqueeze(-1)
    t = torch.where(counted.squeeze(-1), target, torch.zeros_like(target)).unsqueeze(-1)
    m, l = row_max.unsqueeze(-1), row_sum.unsqueeze(-1)
    p = probabilities(z, m, l)
    g = grad.to(acc)
    if reduction == CE_NONE:
        s_ce = s_z = g.unsqueeze(-1)
    elif reduction == CE_SUM:
        s_ce = s_z = g
    else:
        s_ce, s_z = _ratio(g, denom[0]), _ratio(g, denom[1])
    w = None if weight is None else weight.to(acc)
    w_t = torch.ones_like(m) if w is None else w[t]
    w_all = torch.tensor(float(n_classes), dtype=acc) if w is None else w.sum()
    a = torch.zeros_like(m)
    onehot = torch.zeros_like(z)
    if label_smoothing < 1:
        b = s_ce * (torch.tensor(1 - label_smoothing, dtype=acc) * w_t)
        a = a + b
        onehot = torch.zeros_like(z).scatter_(-1, t, 1.0) * b
    per_class = torch.zeros_like(z)
    if label_smoothing > 0:
        k = torch.tensor(label_smoothing / n_classes, dtype=acc)
        a = a + s_ce * (k * w_all)
        per_class = s_ce * k * (torch.ones_like(z) if w is None else w)
    if z_loss > 0:
        lse = m + _log(l)
        a = a + s_z * (torch.tensor(2 * z_loss, dtype=acc) * lse)
    dz = p * a - onehot - per_class
    live = counted & (l != 0)
    dz = torch.where(live, dz, torch.zeros((), dtype=acc, device=x.device))
    return dz.movedim(-1, 1).to(x.dtype) if x.dim() > 2 else dz.to(x.dtype)
