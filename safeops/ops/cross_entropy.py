"""torch.library ops for cross-entropy: op, fake, autograd, backend choice (contract section 10).

Ops (namespace ``safeops``):

    cross_entropy(x, target, weight, ignore_index, reduction, label_smoothing, z_loss, out_dtype)
        -> (loss, row_max, row_sum, denom)
    cross_entropy_backward(grad, x, target, weight, row_max, row_sum, denom, ignore_index, reduction,
                           label_smoothing, z_loss) -> grad_x

``x`` is ``(N, C, d...)`` (class dim 1), ``target`` ``(N, d...)`` of class indices, ``weight`` ``(C,)`` or
None, ``reduction`` 0 none / 1 mean / 2 sum (torch's enum). ``loss`` has ``out_dtype`` (default x's dtype;
x is not rounded to it), target's shape for "none" and 0-d otherwise; ``row_max`` and ``row_sum`` (target's
shape) are fp32 (fp64 for fp64 logits or an fp64 loss) and
stay apart for the backward (contract section 3); ``denom`` is ``(sum of the counted targets' weights,
count of counted targets)``, the mean's denominators, kept on the device so that nothing syncs.

Like the other ops these are opaque ops registered through ``safeops.ops._launch.define_op``, so compiled
code runs the eager launcher's exact kernels (the same bits, section 6). The backward op is functional;
writing the gradient into the logits' buffer (``inplace_backward``) is done by the eager path only (see
:func:`forward`).
"""

from __future__ import annotations

import torch

from .. import _config, reference
from . import cross_entropy_launch
from ._launch import define_op
from .softmax import eager_fast_path, needs_autograd, no_double_backward

REDUCTIONS = {"none": reference.CE_NONE, "mean": reference.CE_MEAN, "sum": reference.CE_SUM}


def _runs_reference(x: torch.Tensor, out_dtype: torch.dtype | None) -> bool:
    if torch.float64 in (x.dtype, out_dtype):
        return True  # fp64 is computed in fp64, by the reference (contract section 2)
    return not _config.use_triton(x)


def _stats_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    return reference.compute_dtype(torch.float64 if out_dtype == torch.float64 else x.dtype)


def check_targets(x: torch.Tensor, target: torch.Tensor, ignore_index: int) -> None:
    """Class indices outside [0, C) other than ignore_index raise, where that costs no device sync (CPU
    tensors) or the computation could not go on without it (the reference's gather). On CUDA the kernels
    instead give such a row a NaN loss and a NaN gradient."""
    if target.numel() == 0:
        return
    n = x.shape[1]
    bad = (target != ignore_index) & ((target < 0) | (target >= n))
    if bool(bad.any()):
        value = int(target[bad].reshape(-1)[0])
        raise ValueError(f"target holds class index {value}, outside [0, {n}) for input with {n} classes "
                         f"(and not ignore_index={ignore_index})")


def _forward_impl(x, target, weight, ignore_index, reduction, label_smoothing, z_loss, out_dtype):
    if _runs_reference(x, out_dtype):
        check_targets(x, target, ignore_index)
        loss, m, l, denom = reference.cross_entropy_forward(x, target, weight, ignore_index, reduction,
                                                            label_smoothing, z_loss, out_dtype)
        like = _forward_fake(x, target, weight, ignore_index, reduction, label_smoothing, z_loss, out_dtype)
        return tuple(a.copy_(b) for a, b in zip(like, (loss, m, l, denom), strict=True))
    if x.device.type == "cpu":
        check_targets(x, target, ignore_index)
    return cross_entropy_launch.forward(x, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                                        out_dtype or x.dtype)


def _forward_fake(x, target, weight, ignore_index, reduction, label_smoothing, z_loss, out_dtype):
    acc = _stats_dtype(x, out_dtype)
    loss = x.new_empty(target.shape if reduction == reference.CE_NONE else (), dtype=out_dtype or x.dtype)
    return (loss, x.new_empty(target.shape, dtype=acc), x.new_empty(target.shape, dtype=acc),
            x.new_empty((2,), dtype=acc))


def _backward_impl(grad, x, target, weight, row_max, row_sum, denom, ignore_index, reduction, label_smoothing,
                   z_loss, out=None):
    if row_max.dtype == torch.float64 or not _config.use_triton(x):
        dx = reference.cross_entropy_backward(grad, x, target, weight, row_max, row_sum, denom, ignore_index,
                                              reduction, label_smoothing, z_loss)
        return (out if out is not None else cross_entropy_launch.grad_buffer(x)[0]).copy_(dx)
    return cross_entropy_launch.backward(grad, x, target, weight, row_max, row_sum, denom, ignore_index,
                                         reduction, label_smoothing, z_loss, out)


def _backward_fake(grad, x, target, weight, row_max, row_sum, denom, ignore_index, reduction, label_smoothing,
                   z_loss):
    return cross_entropy_launch.grad_buffer(x)[0]


FORWARD_SCHEMA = ("(Tensor x, Tensor target, Tensor? weight, int ignore_index, int reduction, "
                  "float label_smoothing, float z_loss, ScalarType? out_dtype) "
                  "-> (Tensor, Tensor, Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor grad, Tensor x, Tensor target, Tensor? weight, Tensor row_max, Tensor row_sum, "
                   "Tensor denom, int ignore_index, int reduction, float label_smoothing, float z_loss) "
                   "-> Tensor")


def _function(below):
    class Recorded_cross_entropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, target, weight, ignore_index, reduction, label_smoothing, z_loss, out_dtype,
                    keyset):
            args = (x, target, weight, ignore_index, reduction, label_smoothing, z_loss, out_dtype)
            out = below(keyset, args)
            ctx.options = (ignore_index, reduction, label_smoothing, z_loss)
            ctx.save_for_backward(x, target, weight, out[1], out[2], out[3])
            return out

        @staticmethod
        def backward(ctx, grad_loss, grad_max, grad_sum, grad_denom):
            x, target, weight, row_max, row_sum, denom = ctx.saved_tensors
            dx = cross_entropy_backward(grad_loss, x, target, weight, row_max, row_sum, denom, *ctx.options)
            return dx, None, None, None, None, None, None, None, None

    return Recorded_cross_entropy


# Registered through torch.library.Library (safeops.ops._launch.define_op): the schemas custom_op would infer,
# with fewer Python layers per call. cross_entropy_backward has no derivative, so double backward raises.
cross_entropy_backward = define_op("cross_entropy_backward", BACKWARD_SCHEMA, _backward_impl, _backward_fake)
cross_entropy_op = define_op("cross_entropy", FORWARD_SCHEMA, _forward_impl, _forward_fake, _function)


# ---------------------------------------------------------------------------------------------------
# Eager fast path, and the gradient written into the logits
# ---------------------------------------------------------------------------------------------------
# As for softmax (safeops/ops/softmax.py, "Eager fast path"): eager calls on plain tensors run the same
# implementations behind a plain autograd.Function. Only this path can write the gradient into the logits'
# own buffer: a registered op that returned its input would not be functional, and under torch.compile
# functionalization would copy it anyway.


def inplace_ok(x: torch.Tensor) -> bool:
    """Whether the gradient can overwrite x: no element of x shares memory with another, and the kernels'
    (N, C, D) row view of x is a view (not a copy, as for d dims that do not merge)."""
    if torch._debug_has_internal_overlap(x) != 0:
        return False
    rows = cross_entropy_launch.as_rows(x)
    same_storage = rows.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    return same_storage and rows.data_ptr() == x.data_ptr()


class _EagerCrossEntropy(torch.autograd.Function):
    """The recorded eager call. Only the loss is an output: the row statistics and the denominator are kept
    for the backward as plain attributes (fresh tensors nothing else holds, so no version check is needed),
    which spares autograd three more outputs and the zero gradients it would fill for them in every
    backward (as safeops.ops.softmax._EagerSoftmax)."""

    @staticmethod
    def forward(ctx, x, target, weight, ignore_index, reduction, label_smoothing, z_loss, out_dtype, inplace):
        loss, row_max, row_sum, denom = _forward_impl(x, target, weight, ignore_index, reduction,
                                                      label_smoothing, z_loss, out_dtype)
        ctx.options = (ignore_index, reduction, label_smoothing, z_loss)
        ctx.inplace = inplace
        ctx.stats = (row_max, row_sum, denom)
        ctx.save_for_backward(x, target, weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, target, weight = ctx.saved_tensors
        row_max, row_sum, denom = ctx.stats
        no_double_backward(ctx, (x, grad_loss))
        out = x if ctx.inplace else None
        dx = _backward_impl(grad_loss, x, target, weight, row_max, row_sum, denom, *ctx.options, out=out)
        if out is not None:
            # The logits now hold their gradient: anything else that saved them for its backward fails
            # loudly ("modified by an inplace operation") instead of reading the gradient as logits.
            torch.autograd.graph.increment_version(x)
        return dx, None, None, None, None, None, None, None, None


def forward(x, target, weight, ignore_index: int, reduction: int, label_smoothing: float, z_loss: float,
            out_dtype: torch.dtype | None = None, inplace_backward: bool = False):
    """``(loss, row_max, row_sum, denom)``: the eager fast path when it applies, else the registered op. A
    recorded eager call keeps the statistics on its autograd node: None here.

    ``inplace_backward``: the backward writes the gradient into x's buffer (eager fast path only, and only
    when x's elements do not overlap); elsewhere it goes to a fresh buffer."""
    if eager_fast_path(x, target, weight):
        options = (ignore_index, reduction, label_smoothing, z_loss, out_dtype)
        if not needs_autograd(x, weight):
            return _forward_impl(x, target, weight, *options)
        loss = _EagerCrossEntropy.apply(x, target, weight, *options, inplace_backward and inplace_ok(x))
        return loss, None, None, None
    return cross_entropy_op(x, target, weight, ignore_index, reduction, label_smoothing, z_loss, out_dtype)
