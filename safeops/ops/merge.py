"""torch.library ops merging partial attention results: op, fake, autograd, backend choice.

Ops (namespace ``safeops``):

    merge_attention(outs, lses) -> (out, lse)
    merge_attention_backward(grad_out, grad_lse, outs, lses) -> (grad_outs, grad_lses)

``outs`` is the stack of partial outputs ``(P, ..., D)`` (any float dtype), ``lses`` their natural-log
logsumexps ``(P, ...)``, fp32 (fp64 with fp64 outputs). ``out`` has the outputs' dtype, ``lse`` the lses'.
The formulas (and why they cannot make NaN) are in ``safeops.kernels.merge`` and ``safeops.reference``.
Like the other ops these are opaque ops (registered through ``safeops.ops._launch.define_op``), so
compiled code runs the eager launcher's exact kernel.
"""

from __future__ import annotations

import torch

from .. import _config, reference
from ._launch import define_op
from .softmax import eager_fast_path, no_double_backward


def _runs_reference(outs: torch.Tensor) -> bool:
    return outs.dtype == torch.float64 or not _config.use_triton(outs)


def _rows(t: torch.Tensor, lead: int) -> torch.Tensor:
    """(P, ..., D) -> (P, R, D) or (P, ...) -> (P, R): a view when the strides allow, else a copy."""
    if lead == 2:
        return t.reshape(t.shape[0], -1, t.shape[-1])
    return t.reshape(t.shape[0], -1)


def _forward_impl(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if _runs_reference(outs) or outs.shape[-1] == 0:
        out, lse = reference.merge_attention_forward(outs, lses)
        return out.contiguous(), lse.contiguous()
    from . import merge_launch

    out, lse = merge_launch.forward(_rows(outs, 2), _rows(lses, 1))
    return out.reshape(outs.shape[1:]), lse.reshape(lses.shape[1:])


def _backward_impl(grad_out, grad_lse, outs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    if _runs_reference(outs) or outs.shape[-1] == 0:
        go, gl = reference.merge_attention_backward(grad_out, grad_lse, outs, lses)
        return go.contiguous(), gl.contiguous()
    from . import merge_launch

    g = grad_out.reshape(-1, outs.shape[-1])
    glse = None if grad_lse is None else grad_lse.to(torch.float32).reshape(-1)
    go, gl = merge_launch.backward(g, glse, _rows(outs, 2), _rows(lses, 1))
    return go.reshape(outs.shape), gl.reshape(lses.shape)


def _forward_fake(outs, lses):
    return outs.new_empty(outs.shape[1:]), lses.new_empty(lses.shape[1:])


def _backward_fake(grad_out, grad_lse, outs, lses):
    return torch.empty_like(outs, memory_format=torch.contiguous_format), torch.empty_like(
        lses, memory_format=torch.contiguous_format)


def _merge_function(below):
    """The autograd.Function recorded when a gradient is wanted (see ``define_op``): the forward through
    the layers below autograd, the backward through ``merge_attention_backward``."""

    class Recorded_merge_attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, outs, lses, keyset):
            out, lse = below(keyset, (outs, lses))
            ctx.save_for_backward(outs, lses)
            # An unused output's gradient stays None: autograd would materialize it as a plain tensor even
            # for DTensor outputs, which the DTensor backward op cannot take (and zeros cost a pass).
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            outs, lses = ctx.saved_tensors
            if grad_out is None:
                grad_out = outs.new_zeros(outs.shape[1:])
            grad_outs, grad_lses = merge_attention_backward_op(grad_out, grad_lse, outs, lses)
            return grad_outs, grad_lses, None

    return Recorded_merge_attention


# Registered through torch.library.Library (safeops.ops._launch.define_op) rather than
# torch.library.custom_op: the schemas custom_op would infer, with fewer Python layers per call.
# merge_attention_backward has no derivative, so double backward raises.
merge_attention_backward_op = define_op("merge_attention_backward",
                                        "(Tensor grad_out, Tensor? grad_lse, Tensor outs, Tensor lses) -> "
                                        "(Tensor, Tensor)", _backward_impl, _backward_fake)
merge_attention_op = define_op("merge_attention", "(Tensor outs, Tensor lses) -> (Tensor, Tensor)",
                               _forward_impl, _forward_fake, _merge_function)


# Eager fast path: the same implementations behind a plain autograd.Function, without torch.library's
# per-call Python layers (see safeops/ops/softmax.py, "Eager fast path"; same bits, same kernels).


class _EagerMerge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, outs, lses):
        out, lse = _forward_impl(outs, lses)
        ctx.save_for_backward(outs, lses)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        outs, lses = ctx.saved_tensors
        no_double_backward(ctx, (outs, lses, grad_out, grad_lse))
        if grad_out is None:
            grad_out = outs.new_zeros(outs.shape[1:])
        return _backward_impl(grad_out, grad_lse, outs, lses)  # any strides: the launcher takes them


def forward(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: the eager fast path when it applies, else the registered op."""
    if eager_fast_path(outs, lses):
        return _EagerMerge.apply(outs, lses)
    return merge_attention_op(outs, lses)
