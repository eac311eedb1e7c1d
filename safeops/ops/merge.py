"""torch.library ops merging partial attention results: op, fake, autograd, backend choice.

Ops (namespace ``safeops``):

    merge_attention(outs, lses, sinks=None) -> (out, lse)
    merge_attention_backward(grad_out, grad_lse, outs, lses) -> (grad_outs, grad_lses)
    merge_attention_sinks_backward(grad_out, grad_lse, outs, lses, sinks)
        -> (grad_outs, grad_lses, grad_sinks)

``outs`` is the stack of partial outputs ``(P, ..., D)`` (any float dtype), ``lses`` their natural-log
logsumexps ``(P, ...)``, fp32 (fp64 with fp64 outputs). ``out`` has the outputs' dtype, ``lse`` the lses'.
``sinks``: None or ``(H,)`` attention-sink logits in the lses' dtype, for lses ``(P, ..., H, Sq)``: each row
of head h merges one more partial with output 0 and lse ``sinks[h]``, once (contract section 9).
The formulas (and why they cannot make NaN) are in ``safeops.kernels.merge`` and ``safeops.reference``.
Like the other ops these are opaque ops (registered through ``safeops.ops._launch.define_op``), so
compiled code runs the eager launcher's exact kernel.
"""

from __future__ import annotations

import torch

from .. import _config, reference
from ._launch import define_op
from .softmax import eager_fast_path, needs_autograd, no_double_backward


def _runs_reference(outs: torch.Tensor) -> bool:
    return outs.dtype == torch.float64 or not _config.use_triton(outs)


def _rows(t: torch.Tensor, lead: int) -> torch.Tensor:
    """(P, ..., D) -> (P, R, D) or (P, ...) -> (P, R): a view when the strides allow, else a copy."""
    if lead == 2:
        return t.reshape(t.shape[0], -1, t.shape[-1])
    return t.reshape(t.shape[0], -1)


def _sink_rows(sinks: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """The sink logit of every row of one partial, ``(..., H, Sq)``: sinks[h] along the head dim."""
    return sinks.view(-1, 1).expand(lses.shape[1:])


def _sinks_gradient(rows: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """(H,) from the per-row d sink ``(..., H, Sq)``: summed per head in float64 by torch (a fixed order for
    a fixed shape: the same bits on every run), rounded once to the sinks' dtype."""
    dims = [d for d in range(rows.dim()) if d != rows.dim() - 2]
    return rows.sum(dims, dtype=torch.float64).to(sinks.dtype)


def _forward_impl(outs: torch.Tensor, lses: torch.Tensor, sinks: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    sink = None if sinks is None else _sink_rows(sinks, lses)
    if _runs_reference(outs) or outs.shape[-1] == 0:
        out, lse = reference.merge_attention_forward(outs, lses, sink)
        return out.contiguous(), lse.contiguous()
    from . import merge_launch

    sink = None if sink is None else sink.to(torch.float32).reshape(-1)
    out, lse = merge_launch.forward(_rows(outs, 2), _rows(lses, 1), sink)
    return out.reshape(outs.shape[1:]), lse.reshape(lses.shape[1:])


def _backward_impl(grad_out, grad_lse, outs, lses, sinks=None) -> tuple[torch.Tensor, ...]:
    sink = None if sinks is None else _sink_rows(sinks, lses)
    if _runs_reference(outs) or outs.shape[-1] == 0:
        go, gl, *gs = reference.merge_attention_backward(grad_out, grad_lse, outs, lses, sink)
        if sinks is None:
            return go.contiguous(), gl.contiguous()
        return go.contiguous(), gl.contiguous(), _sinks_gradient(gs[0], sinks)
    from . import merge_launch

    g = grad_out.reshape(-1, outs.shape[-1])
    glse = None if grad_lse is None else grad_lse.to(torch.float32).reshape(-1)
    sink = None if sink is None else sink.to(torch.float32).reshape(-1)
    go, gl, *gs = merge_launch.backward(g, glse, _rows(outs, 2), _rows(lses, 1), sink)
    if sinks is None:
        return go.reshape(outs.shape), gl.reshape(lses.shape)
    dsinks = _sinks_gradient(gs[0].reshape(lses.shape[1:]), sinks)
    return go.reshape(outs.shape), gl.reshape(lses.shape), dsinks


def _sinks_backward_impl(grad_out, grad_lse, outs, lses, sinks):
    return _backward_impl(grad_out, grad_lse, outs, lses, sinks)


def _forward_fake(outs, lses, sinks=None):
    return outs.new_empty(outs.shape[1:]), lses.new_empty(lses.shape[1:])


def _backward_fake(grad_out, grad_lse, outs, lses):
    return torch.empty_like(outs, memory_format=torch.contiguous_format), torch.empty_like(
        lses, memory_format=torch.contiguous_format)


def _sinks_backward_fake(grad_out, grad_lse, outs, lses, sinks):
    return (*_backward_fake(grad_out, grad_lse, outs, lses), torch.empty_like(sinks))


def _merge_backward(grad_out, grad_lse, outs, lses, sinks, backward_fn, sinks_backward_fn):
    """(grad_outs, grad_lses, grad_sinks or None): with sinks the weights include them, so every gradient
    comes from the sinks' backward."""
    if grad_out is None:
        grad_out = outs.new_zeros(outs.shape[1:])
    if sinks is None:
        return (*backward_fn(grad_out, grad_lse, outs, lses), None)
    return sinks_backward_fn(grad_out, grad_lse, outs, lses, sinks)


def _merge_function(below):
    """The autograd.Function recorded when a gradient is wanted (see ``define_op``): the forward through
    the layers below autograd, the backward through ``merge_attention_backward``."""

    class Recorded_merge_attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, outs, lses, *rest):
            # The dispatcher leaves out a trailing argument that has its default (sinks=None).
            *args, keyset = rest
            sinks = args[0] if args else None
            ctx.n_args = len(args)
            out, lse = below(keyset, (outs, lses, *args))
            ctx.save_for_backward(outs, lses, sinks)
            # An unused output's gradient stays None: autograd would materialize it as a plain tensor even
            # for DTensor outputs, which the DTensor backward op cannot take (and zeros cost a pass).
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            outs, lses, sinks = ctx.saved_tensors
            grads = _merge_backward(grad_out, grad_lse, outs, lses, sinks, merge_attention_backward_op,
                                    merge_attention_sinks_backward_op)
            return (*grads[:2 + ctx.n_args], None)

    return Recorded_merge_attention


# Registered through torch.library.Library (safeops.ops._launch.define_op) rather than
# torch.library.custom_op: the schemas custom_op would infer, with fewer Python layers per call.
# merge_attention_backward has no derivative, so double backward raises.
merge_attention_backward_op = define_op("merge_attention_backward",
                                        "(Tensor grad_out, Tensor? grad_lse, Tensor outs, Tensor lses) -> "
                                        "(Tensor, Tensor)", _backward_impl, _backward_fake)
merge_attention_sinks_backward_op = define_op(
    "merge_attention_sinks_backward",
    "(Tensor grad_out, Tensor? grad_lse, Tensor outs, Tensor lses, Tensor sinks) -> (Tensor, Tensor, Tensor)",
    _sinks_backward_impl, _sinks_backward_fake)
merge_attention_op = define_op("merge_attention",
                               "(Tensor outs, Tensor lses, Tensor? sinks=None) -> (Tensor, Tensor)",
                               _forward_impl, _forward_fake, _merge_function)


# Eager fast path: the same implementations behind a plain autograd.Function, without torch.library's
# per-call Python layers (see safeops/ops/softmax.py, "Eager fast path"; same bits, same kernels).


class _EagerMerge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, outs, lses, sinks):
        out, lse = _forward_impl(outs, lses, sinks)
        ctx.save_for_backward(outs, lses, sinks)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        outs, lses, sinks = ctx.saved_tensors
        no_double_backward(ctx, (outs, lses, sinks, grad_out, grad_lse))
        # any strides: the launcher takes them
        return _merge_backward(grad_out, grad_lse, outs, lses, sinks, _backward_impl, _sinks_backward_impl)


def forward(outs: torch.Tensor, lses: torch.Tensor, sinks: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: the eager fast path when it applies, else the registered op."""
    if eager_fast_path(outs, lses, sinks):
        if not needs_autograd(outs, lses, sinks):
            return _forward_impl(outs, lses, sinks)
        return _EagerMerge.apply(outs, lses, sinks)
    return merge_attention_op(outs, lses, sinks)
