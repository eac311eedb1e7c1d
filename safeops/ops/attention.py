"""torch.library ops for attention: op, fake, autograd, backend choice.

Ops (namespace ``safeops``):

    attention(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              is_causal, scale, softcap, window_left, window_right, precision, sinks=None)
        -> (out, row_max, row_sum)
    attention_backward(grad, q, k, v, out, row_max, row_sum, <same options but sinks>) -> (dq, dk, dv)
    attention_sinks_backward(grad, q, k, v, out, row_max, row_sum, <same options>, sinks)
        -> (dq, dk, dv, dsinks)

Dense layout (``cu_seqlens_q is None``): q ``(B, Hq, Sq, D)``, k ``(B, Hkv, Sk, D)``, v ``(B, Hkv, Sk, Dv)``,
out ``(B, Hq, Sq, Dv)``, stats ``(B, Hq, Sq)``. Packed (varlen) layout: q ``(Tq, Hq, D)``,
k/v ``(Tk, Hkv, .)``,
out ``(Tq, Hq, Dv)``, stats ``(Hq, Tq)``. ``mask`` is already expanded to ``(B, Hq, Sq, Sk)`` (a strided
view, usually with zero strides); ``mask_kind`` is 0 (none), 1 (bool, True = attend) or 2 (additive).
``window_left``/``window_right`` < 0 mean unbounded. ``precision`` is 0 ieee, 1 tf32, 2 tf32x3 (fp32 only).
``sinks``: None or the ``(Hq,)`` attention-sink logits in the compute dtype (fp32; fp64 for fp64 inputs),
contract section 9. The row statistics include the sink, so ``attention_backward`` computes dq, dk, dv of
an attention with sinks unchanged; ``attention_sinks_backward`` also returns the sinks' gradient (the
autograd formula calls it only when the sinks require grad).

The stats are base 2 (``row_max`` = max of z2, ``row_sum`` = sum of exp2(z2 - row_max), see
``safeops.reference``), fp32 (fp64 for fp64 inputs), kept apart for the backward (contract section 3).
Like the softmax ops these are opaque ops (registered through ``safeops.ops._launch.define_op``, with the
schemas ``torch.library.custom_op`` would infer), so compiled code runs the eager launcher's exact kernels.
"""

from __future__ import annotations

import torch

from .. import _config, reference
from . import attention_gluon, attention_launch
from ._launch import define_op
from .softmax import eager_fast_path, needs_autograd, no_double_backward

PRECISIONS = {"ieee": 0, "tf32": 1, "tf32x3": 2}


def _runs_reference(q: torch.Tensor) -> bool:
    return q.dtype == torch.float64 or not _config.use_triton(q)


def path(q, k, v, mask, cu_q, is_causal: bool, softcap, wl: int, wr: int, sinks=None,
         backward: bool = False) -> tuple[str, str]:
    """(``"reference"`` / ``"triton"`` / ``"gluon"``, why): the forward's path as ``_forward_impl`` and
    ``attention_launch.forward`` choose it, by the same two checks (``_runs_reference``, then
    ``attention_launch.gluon_reason``); with ``backward`` the backward's path as ``attention_launch.backward``
    chooses it (the fused kernel, ``gluon_fused_reason``, else the dk / dv path, ``gluon_bwd_reason``).
    safeops.attention_backend reports it."""
    if _runs_reference(q):
        if q.dtype == torch.float64:
            return "reference", "float64 inputs run the float64 reference"
        if _config.backend_name() == "reference":
            return "reference", "SAFEOPS_BACKEND=reference"
        return "reference", f"{q.device.type} tensors run the pure-torch reference (SAFEOPS_BACKEND=auto)"
    if backward:
        why = attention_launch.gluon_bwd_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr)
        gluon_dq = not attention_launch.gluon_dq_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr)
        if not attention_launch.gluon_fused_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr):
            return "gluon", attention_gluon.describe_bwd(q, is_causal, fused=True)
        return ("triton", why) if why else ("gluon", attention_gluon.describe_bwd(q, is_causal, gluon_dq))
    why = attention_launch.gluon_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, sinks=sinks)
    if why:
        return "triton", why
    return "gluon", attention_gluon.describe(q, is_causal, cu_q is not None)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """(S, H, D) slice of a packed tensor -> (1, H, S, D)."""
    return t.permute(1, 0, 2).unsqueeze(0)


def _reference_forward(q, k, v, mask, mask_kind, cu_q, cu_k, is_causal, scale, softcap, wl, wr, sinks=None):
    out, m, l = attention_launch.empty_outputs(q, v, cu_q is not None)
    if cu_q is None:
        o, mm, ll = reference.attention_forward(q, k, v, mask, mask_kind, is_causal, scale, softcap, wl, wr,
                                                sinks)
        return out.copy_(o), m.copy_(mm), l.copy_(ll)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for b in range(len(bq) - 1):
        qs, ks = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        o, mm, ll = reference.attention_forward(_dense(q[qs]), _dense(k[ks]), _dense(v[ks]), None, 0,
                                                is_causal, scale, softcap, wl, wr, sinks)
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


def _reference_dsinks(grad, out, m, l, sinks, varlen: bool):
    """The sinks' gradient from the saved output and stats (``reference.attention_sinks_backward``)."""
    delta = (grad.to(torch.float64) * out.to(torch.float64)).sum(-1)
    return reference.attention_sinks_backward(delta.transpose(0, 1) if varlen else delta, m, l, sinks)


# The schemas torch.library.custom_op would infer from the implementations' type hints.
_OPTIONS_SCHEMA = ("Tensor? mask, SymInt mask_kind, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
                   "SymInt max_seqlen_q, SymInt max_seqlen_k, bool is_causal, float scale, float? softcap, "
                   "SymInt window_left, SymInt window_right, SymInt precision")
FORWARD_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, {_OPTIONS_SCHEMA}, Tensor? sinks=None) -> "
                  "(Tensor, Tensor, Tensor)")
_BACKWARD_ARGS = ("Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor row_max, Tensor row_sum, "
                  f"{_OPTIONS_SCHEMA}")
BACKWARD_SCHEMA = f"({_BACKWARD_ARGS}) -> (Tensor, Tensor, Tensor)"
SINKS_BACKWARD_SCHEMA = f"({_BACKWARD_ARGS}, Tensor sinks) -> (Tensor, Tensor, Tensor, Tensor)"


def _forward_impl(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                  scale, softcap, window_left, window_right, precision, sinks=None):
    if _runs_reference(q):
        return _reference_forward(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, is_causal, scale,
                                  softcap, window_left, window_right, sinks)
    return attention_launch.forward(
        q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
        softcap, window_left, window_right, precision, sinks=sinks)


def _forward_fake(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                  scale, softcap, window_left, window_right, precision, sinks=None):
    return attention_launch.empty_outputs(q, v, cu_seqlens_q is not None)


def _backward_impl(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, is_causal, scale, softcap, window_left, window_right,
                   precision):
    if row_max.dtype == torch.float64 or not _config.use_triton(q):
        return _reference_backward(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q,
                                   cu_seqlens_k, is_causal, scale, softcap, window_left, window_right)
    return attention_launch.backward(
        grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, is_causal, scale, softcap, window_left, window_right, precision)


def _backward_fake(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, is_causal, scale, softcap, window_left, window_right,
                   precision):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _sinks_backward_impl(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, is_causal, scale, softcap, window_left, window_right,
                         precision, sinks):
    if row_max.dtype == torch.float64 or not _config.use_triton(q):
        dq, dk, dv = _reference_backward(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q,
                                         cu_seqlens_k, is_causal, scale, softcap, window_left, window_right)
        return dq, dk, dv, _reference_dsinks(grad, out, row_max, row_sum, sinks, cu_seqlens_q is not None)
    return attention_launch.backward(
        grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, is_causal, scale, softcap, window_left, window_right, precision, sinks=sinks)


def _sinks_backward_fake(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, is_causal, scale, softcap, window_left, window_right,
                         precision, sinks):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(sinks)


_OPTION_NAMES = ("mask", "mask_kind", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                 "is_causal", "scale", "softcap", "window_left", "window_right", "precision")
_SINKS = len(_OPTION_NAMES) + 3  # the forward's argument index of sinks (after q, k, v and the options)


def _backward(ctx, backward_fn, sinks_backward_fn, grad_out):
    """(dq, dk, dv, dsinks or None) of a recorded forward: the sinks' gradient only when they want one (dq,
    dk and dv need no sinks: the saved stats include them)."""
    q, k, v, out, row_max, row_sum, mask, cu_q, cu_k, sinks = ctx.saved_tensors
    mask_kind, _, _, max_q, max_k, is_causal, scale, softcap, wl, wr, precision = ctx.options
    args = (grad_out, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_q, cu_k, max_q, max_k, is_causal,
            scale, softcap, wl, wr, precision)
    if sinks is not None and ctx.needs_input_grad[_SINKS]:
        return sinks_backward_fn(*args, sinks)
    return (*backward_fn(*args), None)


def _attention_function(below):
    """The autograd.Function recorded when a gradient is wanted (see ``define_op``): the forward saves q, k,
    v, the output and the row statistics; the backward calls the attention_backward op."""

    class Recorded_attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, mask, *rest):
            # The dispatcher leaves out a trailing argument that has its default (sinks=None).
            *args, keyset = rest
            options = args[:len(_OPTION_NAMES) - 1]
            sinks = args[len(options)] if len(args) > len(options) else None
            ctx.n_args = len(args)
            out, row_max, row_sum = below(keyset, (q, k, v, mask, *args))
            ctx.options = options  # mask_kind .. precision (non-tensor except the cu_seqlens)
            ctx.save_for_backward(q, k, v, out, row_max, row_sum, mask, options[1], options[2], sinks)
            return out, row_max, row_sum

        @staticmethod
        def backward(ctx, grad_out, grad_max, grad_sum):
            # grad_out as it comes: the launcher takes any strides with a unit head-dim stride and copies
            # only otherwise (with Hugging Face's (B, S, H, D) layout .contiguous() would copy it all).
            dq, dk, dv, dsinks = _backward(ctx, attention_backward_op, attention_sinks_backward_op, grad_out)
            # No gradient for the mask (an additive float mask is treated as a constant), the cu_seqlens or
            # the keyset.
            grads = (dq, dk, dv) + (None,) * len(_OPTION_NAMES) + (dsinks,)
            return grads[:4 + ctx.n_args] + (None,)

    return Recorded_attention


# ---------------------------------------------------------------------------------------------------
# Partials in fp32 (for merging, e.g. safeops.distributed): contract section 2 asks for one rounding of the
# final result, so partial outputs and gradients that are summed afterwards must not be rounded to bf16/fp16
# first (shards whose contributions cancel would lose everything). Not ops: plain functions for callers
# that merge inside their own autograd.Function.
# ---------------------------------------------------------------------------------------------------


def partial_forward(q, k, v, is_causal, scale, softcap, window_left, window_right, precision, sinks=None):
    """(out, row_max, row_sum) of dense attention with ``out`` in fp32 (fp64 for fp64 inputs); ``sinks``
    (compute dtype, (Hq,)) enter the stats as in the attention op."""
    acc = reference.compute_dtype(q.dtype)
    args = (None, 0, None, None, q.shape[2], k.shape[2], is_causal, scale, softcap, window_left,
            window_right)
    if _runs_reference(q):  # the reference computes in fp32 anyway: give it fp32 inputs (exact upcast)
        return _forward_impl(q.to(acc), k.to(acc), v.to(acc), *args, 0 if acc == torch.float32 else precision,
                             sinks)
    return attention_launch.forward(q, k, v, *args, precision, out_dtype=acc, sinks=sinks)


def partial_backward(grad, q, k, v, out, row_max, row_sum, is_causal, scale, softcap, window_left,
                     window_right, precision):
    """(dq, dk, dv) of dense attention in fp32 (fp64 for fp64 inputs), from the given output and row
    statistics (which may be those of a larger, merged attention)."""
    acc = reference.compute_dtype(q.dtype)
    args = (None, 0, None, None, q.shape[2], k.shape[2], is_causal, scale, softcap, window_left,
            window_right)
    if _runs_reference(q):
        return _backward_impl(grad.to(acc), q.to(acc), k.to(acc), v.to(acc), out.to(acc), row_max, row_sum,
                              *args, 0 if acc == torch.float32 else precision)
    return attention_launch.backward(grad, q, k, v, out, row_max, row_sum, *args, precision, grad_dtype=acc)


# Registered through torch.library.Library (safeops.ops._launch.define_op) rather than
# torch.library.custom_op: the same schemas, implementations, fakes and autograd, with fewer Python layers
# on every call (compiled graphs call these ops at run time). attention_backward has no derivative: a
# double backward raises, as for a custom_op without register_autograd.
attention_backward_op = define_op("attention_backward", BACKWARD_SCHEMA, _backward_impl, _backward_fake)
attention_sinks_backward_op = define_op("attention_sinks_backward", SINKS_BACKWARD_SCHEMA,
                                        _sinks_backward_impl, _sinks_backward_fake)
attention_op = define_op("attention", FORWARD_SCHEMA, _forward_impl, _forward_fake, _attention_function)


# Eager fast path: the same implementations behind a plain autograd.Function, without torch.library's
# per-call Python layers (see safeops/ops/softmax.py, "Eager fast path"; same bits, same kernels).


class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, *rest):
        *options, sinks = rest
        out, row_max, row_sum = _forward_impl(q, k, v, mask, *options, sinks)
        ctx.options = options
        ctx.save_for_backward(q, k, v, out, row_max, row_sum, mask, options[1], options[2], sinks)
        ctx.mark_non_differentiable(row_max, row_sum)
        return out, row_max, row_sum

    @staticmethod
    def backward(ctx, grad_out, grad_max, grad_sum):
        no_double_backward(ctx, (*ctx.saved_tensors[:3], ctx.saved_tensors[-1], grad_out))
        dq, dk, dv, dsinks = _backward(ctx, _backward_impl, _sinks_backward_impl, grad_out)
        return (dq, dk, dv) + (None,) * len(_OPTION_NAMES) + (dsinks,)


def forward(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
            scale, softcap, window_left, window_right, precision, sinks=None):
    """``(out, row_max, row_sum)``: the eager fast path when it applies, else the registered op. With nothing
    to record for autograd (no input requires grad, or grad mode off, and no forward-mode AD level) the fast
    path calls the implementation directly: what ``_EagerAttention.apply`` returns then, without its
    per-call cost."""
    args = (q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
            scale, softcap, window_left, window_right, precision, sinks)
    if eager_fast_path(q, k, v, mask, cu_seqlens_q, cu_seqlens_k, sinks):
        if needs_autograd(q, k, v, mask, sinks):
            return _EagerAttention.apply(*args)
        return _forward_impl(*args)
    return attention_op(*args)
