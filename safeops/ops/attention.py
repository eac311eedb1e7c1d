"""torch.library ops for attention: op, fake, autograd, backend choice.

Ops (namespace ``safeops``):

    attention(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              is_causal, scale, softcap, window_left, window_right, precision) -> (out, row_max, row_sum)
    attention_backward(grad, q, k, v, out, row_max, row_sum, <same options>) -> (dq, dk, dv)

Dense layout (``cu_seqlens_q is None``): q ``(B, Hq, Sq, D)``, k ``(B, Hkv, Sk, D)``, v ``(B, Hkv, Sk, Dv)``,
out ``(B, Hq, Sq, Dv)``, stats ``(B, Hq, Sq)``. Packed (varlen) layout: q ``(Tq, Hq, D)``,
k/v ``(Tk, Hkv, .)``,
out ``(Tq, Hq, Dv)``, stats ``(Hq, Tq)``. ``mask`` is already expanded to ``(B, Hq, Sq, Sk)`` (a strided
view, usually with zero strides); ``mask_kind`` is 0 (none), 1 (bool, True = attend) or 2 (additive).
``window_left``/``window_right`` < 0 mean unbounded. ``precision`` is 0 ieee, 1 tf32, 2 tf32x3 (fp32 only).

The stats are base 2 (``row_max`` = max of z2, ``row_sum`` = sum of exp2(z2 - row_max), see
``safeops.reference``), fp32 (fp64 for fp64 inputs), kept apart for the backward (contract section 3).
Like the softmax ops these are ``custom_op``s, so compiled code runs the eager launcher's exact kernels.
"""

from __future__ import annotations

import torch

from .. import _config, reference
from .softmax import eager_fast_path, no_double_backward

PRECISIONS = {"ieee": 0, "tf32": 1, "tf32x3": 2}


def _runs_reference(q: torch.Tensor) -> bool:
    return q.dtype == torch.float64 or not _config.use_triton(q)


def _empty_out(q: torch.Tensor, dv: int) -> torch.Tensor:
    if q.shape[-1] == dv:
        return torch.empty_like(q)  # keeps q's memory layout (e.g. (B, S, H, D) transposed)
    return q.new_empty(q.shape[:-1] + (dv,))


def _stats_shape(q: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    return (q.shape[1], q.shape[0]) if varlen else tuple(q.shape[:3])


def _fake_forward(q, v, varlen):
    acc = reference.compute_dtype(q.dtype)
    shape = _stats_shape(q, varlen)
    return _empty_out(q, v.shape[-1]), q.new_empty(shape, dtype=acc), q.new_empty(shape, dtype=acc)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """(S, H, D) slice of a packed tensor -> (1, H, S, D)."""
    return t.permute(1, 0, 2).unsqueeze(0)


def _reference_forward(q, k, v, mask, mask_kind, cu_q, cu_k, is_causal, scale, softcap, wl, wr):
    out, m, l = _fake_forward(q, v, cu_q is not None)
    if cu_q is None:
        o, mm, ll = reference.attention_forward(q, k, v, mask, mask_kind, is_causal, scale, softcap, wl, wr)
        return out.copy_(o), m.copy_(mm), l.copy_(ll)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(bq) - 1):
        qs, ks = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        o, mm, ll = reference.attention_forward(_dense(q[qs]), _dense(k[ks]), _dense(v[ks]), None, 0,
                                                is_causal, scale, softcap, wl, wr)
        out[qs] = o[0].permute(1, 0, 2)
        m[:, qs] = mm[0]
        l[:, qs] = ll[0]
    return out, m, l


def _reference_backward(grad, q, k, v, out, m, l, mask, mask_kind, cu_q, cu_k, is_causal, scale, softcap,
                        wl, wr):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if cu_q is None:
        a, b, c = reference.attention_backward(grad, q, k, v, out, m, l, mask, mask_kind, is_causal, scale,
                                               softcap, wl, wr)
        return dq.copy_(a), dk.copy_(b), dv.copy_(c)
    dk.zero_()
    dv.zero_()
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(bq) - 1):
        qs, ks = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        a, bb, c = reference.attention_backward(
            _dense(grad[qs]), _dense(q[qs]), _dense(k[ks]), _dense(v[ks]), _dense(out[qs]),
            m[:, qs].unsqueeze(0), l[:, qs].unsqueeze(0), None, 0, is_causal, scale, softcap, wl, wr)
        dq[qs] = a[0].permute(1, 0, 2)
        dk[ks] = bb[0].permute(1, 0, 2)
        dv[ks] = c[0].permute(1, 0, 2)
    return dq, dk, dv


@torch.library.custom_op("safeops::attention", mutates_args=())
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    mask_kind: int,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool,
    scale: float,
    softcap: float | None,
    window_left: int,
    window_right: int,
    precision: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_impl(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         is_causal, scale, softcap, window_left, window_right, precision)


def _forward_impl(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                  scale, softcap, window_left, window_right, precision):
    if _runs_reference(q):
        return _reference_forward(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, is_causal, scale,
                                  softcap, window_left, window_right)
    from . import attention_launch

    return attention_launch.forward(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, is_causal, scale, softcap, window_left, window_right,
                                    precision)


@attention_op.register_fake
def _(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
      softcap, window_left, window_right, precision):
    return _fake_forward(q, v, cu_seqlens_q is not None)


@torch.library.custom_op("safeops::attention_backward", mutates_args=())
def attention_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    mask: torch.Tensor | None,
    mask_kind: int,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool,
    scale: float,
    softcap: float | None,
    window_left: int,
    window_right: int,
    precision: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, is_causal, scale, softcap, window_left, window_right,
                          precision)


def _backward_impl(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, is_causal, scale, softcap, window_left, window_right,
                   precision):
    if row_max.dtype == torch.float64 or not _config.use_triton(q):
        return _reference_backward(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q,
                                   cu_seqlens_k, is_causal, scale, softcap, window_left, window_right)
    from . import attention_launch

    return attention_launch.backward(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q,
                                     cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, softcap,
                                     window_left, window_right, precision)


@attention_backward_op.register_fake
def _(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, is_causal, scale, softcap, window_left, window_right, precision):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_OPTION_NAMES = ("mask", "mask_kind", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                 "is_causal", "scale", "softcap", "window_left", "window_right", "precision")


def _setup_context(ctx, inputs, output):
    q, k, v, mask, *options = inputs
    out, row_max, row_sum = output
    ctx.options = options  # mask_kind .. precision (non-tensor except the cu_seqlens)
    ctx.save_for_backward(q, k, v, out, row_max, row_sum, mask, options[1], options[2])


def _backward(ctx, grad_out, grad_max, grad_sum):
    q, k, v, out, row_max, row_sum, mask, cu_q, cu_k = ctx.saved_tensors
    mask_kind, _, _, max_q, max_k, is_causal, scale, softcap, wl, wr, precision = ctx.options
    dq, dk, dv = torch.ops.safeops.attention_backward(
        grad_out.contiguous(), q, k, v, out, row_max, row_sum, mask, mask_kind, cu_q, cu_k, max_q, max_k,
        is_causal, scale, softcap, wl, wr, precision)
    # No gradient for the mask (an additive float mask is treated as a constant) or the cu_seqlens.
    return (dq, dk, dv) + (None,) * len(_OPTION_NAMES)


attention_op.register_autograd(_backward, setup_context=_setup_context)


# Eager fast path: the same implementations behind a plain autograd.Function, without torch.library's
# per-call Python layers (see safeops/ops/softmax.py, "Eager fast path"; same bits, same kernels).


class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, *options):
        out, row_max, row_sum = _forward_impl(q, k, v, mask, *options)
        ctx.options = options
        ctx.save_for_backward(q, k, v, out, row_max, row_sum, mask, options[1], options[2])
        ctx.mark_non_differentiable(row_max, row_sum)
        return out, row_max, row_sum

    @staticmethod
    def backward(ctx, grad_out, grad_max, grad_sum):
        q, k, v, out, row_max, row_sum, mask, cu_q, cu_k = ctx.saved_tensors
        no_double_backward(ctx, (q, k, v, grad_out))
        mask_kind, _, _, max_q, max_k, is_causal, scale, softcap, wl, wr, precision = ctx.options
        dq, dk, dv = _backward_impl(grad_out.contiguous(), q, k, v, out, row_max, row_sum, mask, mask_kind,
                                    cu_q, cu_k, max_q, max_k, is_causal, scale, softcap, wl, wr, precision)
        return (dq, dk, dv) + (None,) * len(_OPTION_NAMES)


def forward(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, *options):
    """``(out, row_max, row_sum)``: the eager fast path when it applies, else the registered op."""
    if eager_fast_path(q, k, v, mask, cu_seqlens_q, cu_seqlens_k):
        return _EagerAttention.apply(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, *options)
    return attention_op(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, *options)
