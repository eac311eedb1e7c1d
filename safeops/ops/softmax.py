"""torch.library ops for softmax, log-softmax and logsumexp: op, fake, autograd, backend choice.

Ops (namespace ``safeops``), each with a fake implementation and autograd:

    softmax(x, dim, scale, scale_tensor, mask, out_dtype)     -> (out, row_max, row_sum)
    log_softmax(x, dim, scale, scale_tensor, mask, out_dtype) -> (out, row_max, row_sum)
    logsumexp(x, dim, scale, scale_tensor, mask, out_dtype)   -> (out, row_max, row_sum)
    softmax_backward(grad, x, row_max, row_sum, dim, kind, scale, scale_tensor, mask, need_dscale)
        -> (grad_x, grad_scale)

``dim`` is non-negative, ``mask`` (if any) is bool and already expanded to ``x.shape``. ``row_max`` and
``row_sum`` are fp32 (fp64 for fp64 inputs) with ``dim`` removed; the backward needs both, kept apart
(contract section 3).

These are opaque ops (defined through ``torch.library.Library``, see ``safeops.ops._launch.define_op``)
rather than ``triton_op``s on purpose: the op body is the exact launcher that eager mode runs, so compiled
code runs the same kernel with the same compile options (fp fusion off) and gets the same bits (contract
section 6); Inductor's re-emission of user kernels would not promise that.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad

from .. import _config, reference
from . import softmax_launch
from ._launch import _any_requires_grad, define_op

SOFTMAX, LOG_SOFTMAX, LOGSUMEXP = reference.SOFTMAX, reference.LOG_SOFTMAX, reference.LOGSUMEXP
KIND_NAMES = {SOFTMAX: "softmax", LOG_SOFTMAX: "log_softmax", LOGSUMEXP: "logsumexp"}


def _runs_reference(x: torch.Tensor, out_dtype: torch.dtype | None) -> bool:
    if x.dtype == torch.float64 or out_dtype == torch.float64:
        return True  # fp64 is computed in fp64, by the reference (contract section 2)
    return not _config.use_triton(x)


def _stats_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    return reference.compute_dtype(torch.float64 if out_dtype == torch.float64 else x.dtype)


def _fake_outputs(kind, x, dim, out_dtype):
    out_dtype = out_dtype or x.dtype
    batch_shape = x.shape[:dim] + x.shape[dim + 1:]
    acc = _stats_dtype(x, out_dtype)
    if kind == LOGSUMEXP:
        out = x.new_empty(batch_shape, dtype=out_dtype)
    else:
        out = torch.empty_like(x, dtype=out_dtype)
    return out, x.new_empty(batch_shape, dtype=acc), x.new_empty(batch_shape, dtype=acc)


def _forward_impl(kind, x, dim, scale, scale_tensor, mask, out_dtype, stats=True):
    """``(out, row_max, row_sum)``; with ``stats=False`` the statistics may be None (see
    ``softmax_launch.forward``)."""
    if _runs_reference(x, out_dtype):
        out, m, l = reference.forward(kind, x, dim, scale, scale_tensor, mask, out_dtype)
        # Same layout as the fake (and the Triton path): out like x, stats contiguous.
        like, m_like, l_like = _fake_outputs(kind, x, dim, out_dtype)
        return like.copy_(out), m_like.copy_(m), l_like.copy_(l)
    return softmax_launch.forward(kind, x, dim, scale, scale_tensor, mask, out_dtype or x.dtype, stats)


def _scale_grad(grad_scale, scale_tensor, need_dscale):
    """The backward's fp32 scale gradient in the scale tensor's dtype and shape (None when not wanted)."""
    return grad_scale.to(scale_tensor.dtype).reshape(scale_tensor.shape) if need_dscale else None


# The schemas torch.library.custom_op would infer from the implementations' type hints.
FORWARD_SCHEMA = ("(Tensor x, SymInt dim, float? scale, Tensor? scale_tensor, Tensor? mask, "
                  "ScalarType? out_dtype) -> (Tensor, Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor grad, Tensor x, Tensor row_max, Tensor row_sum, SymInt dim, SymInt kind, "
                   "float? scale, Tensor? scale_tensor, Tensor? mask, bool need_dscale) -> (Tensor, Tensor)")


def _make_forward_op(kind: int):
    name = KIND_NAMES[kind]

    def impl(x, dim, scale, scale_tensor, mask, out_dtype):
        return _forward_impl(kind, x, dim, scale, scale_tensor, mask, out_dtype)

    def fake(x, dim, scale, scale_tensor, mask, out_dtype):
        return _fake_outputs(kind, x, dim, out_dtype)

    def function(below):
        class Recorded(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, dim, scale, scale_tensor, mask, out_dtype, keyset):
                out = below(keyset, (x, dim, scale, scale_tensor, mask, out_dtype))
                ctx.dim, ctx.scale = dim, scale
                ctx.has_scale_tensor = scale_tensor is not None
                ctx.save_for_backward(x, out[1], out[2], scale_tensor, mask)
                return out

            @staticmethod
            def backward(ctx, grad_out, grad_max, grad_sum):
                x, row_max, row_sum, scale_tensor, mask = ctx.saved_tensors
                need_dscale = ctx.has_scale_tensor and ctx.needs_input_grad[3]
                grad_x, grad_scale = softmax_backward(
                    grad_out, x, row_max, row_sum, ctx.dim, kind, ctx.scale, scale_tensor, mask, need_dscale
                )
                grad_scale = _scale_grad(grad_scale, scale_tensor, need_dscale)
                return grad_x, None, None, grad_scale, None, None, None

        Recorded.__name__ = f"Recorded_{name}"
        return Recorded

    return define_op(name, FORWARD_SCHEMA, impl, fake, function)


def _backward_impl(grad, x, row_max, row_sum, dim, kind, scale, scale_tensor, mask, need_dscale,
                   dscale_placeholder=True):
    """``(dx, dscale)``. Without ``need_dscale`` the op still returns a zero ``dscale`` (its schema returns a
    tensor); ``dscale_placeholder=False`` (the eager path, which drops it) gives None there instead, which
    saves an allocation and a fill launch per call on the GPU."""
    if row_max.dtype == torch.float64 or not _config.use_triton(x):
        dx, dscale = reference.backward(
            kind, grad, x, row_max, row_sum, dim, scale, scale_tensor, mask, need_dscale
        )
        out = torch.empty_like(x).copy_(dx)
        dscale_out = x.new_zeros((), dtype=row_max.dtype)
        if dscale is not None:
            dscale_out.copy_(dscale)
        return out, dscale_out
    return softmax_launch.backward(
        kind, grad, x, row_max, row_sum, dim, scale, scale_tensor, mask, need_dscale,
        dscale_placeholder=dscale_placeholder,
    )


def _backward_fake(grad, x, row_max, row_sum, dim, kind, scale, scale_tensor, mask, need_dscale):
    return torch.empty_like(x), x.new_empty((), dtype=row_max.dtype)


# Registered through torch.library.Library (safeops.ops._launch.define_op) rather than
# torch.library.custom_op: the same schema, implementation, fake and autograd, with fewer Python layers on
# every call (compiled graphs call these ops at run time).
softmax_backward = define_op("softmax_backward", BACKWARD_SCHEMA, _backward_impl, _backward_fake)


softmax_op = _make_forward_op(SOFTMAX)
log_softmax_op = _make_forward_op(LOG_SOFTMAX)
logsumexp_op = _make_forward_op(LOGSUMEXP)


# ---------------------------------------------------------------------------------------------------
# Eager fast path
# ---------------------------------------------------------------------------------------------------
# A call through torch.library's Python custom-op layers costs more host time than the kernel itself
# takes for small and medium inputs (bench/RESULTS.md, host overhead). Eager calls on plain
# tensors skip those layers: the same forward and backward implementations behind a plain
# autograd.Function, so the same kernels run with the same arguments and give the same bits. Anything
# that traces or transforms (torch.compile / export, FakeTensor, make_fx, vmap, tensor subclasses, Python
# dispatch or function modes) keeps the registered op.


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PYTHON_KEY = torch._C.DispatchKey.Python


def eager_fast_path(*tensors) -> bool:
    # Every eager call runs this: the torch._C queries directly (torch.jit.is_tracing() is
    # torch._C._is_tracing() outside TorchScript, which never compiles this; a dispatch mode is current
    # exactly when the mode stack is not empty) and a plain loop, half the cost of the wrappers and all().
    C = torch._C
    if torch.compiler.is_compiling() or C._are_functorch_transforms_active() or C._is_tracing():
        return False
    if C._is_torch_function_mode_enabled() or C._dispatch_tls_is_dispatch_key_included(_PYTHON_KEY):
        return False
    if C._len_torch_dispatch_stack():
        return False
    for t in tensors:
        if t is not None and type(t) not in _PLAIN:
            return False
    return True


def no_double_backward(ctx, saved) -> None:
    """The registered ops have no derivative of their backward and raise under ``create_graph=True``; the
    fast path must raise too, not return a gradient that silently lacks its second-order part."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in saved):
        raise RuntimeError("safeops ops are differentiable once: double backward (create_graph=True through "
                           "a safeops op) is not supported")


class _EagerSoftmax(torch.autograd.Function):
    """The recorded eager call, ``apply(x, call)`` or ``apply(x, call, scale_tensor)`` with ``call = (kind,
    dim, scale, mask, out_dtype)``. Only the tensors that can have a gradient are inputs: every argument of
    ``apply`` and every saved slot costs autograd host time per call, and the bool mask has no gradient (it
    is still saved, so changing it in place before the backward raises as for any saved tensor). Only
    ``out`` is an output: the row statistics are kept for the backward as plain attributes (fresh tensors
    nothing else holds, so no version check is needed), which spares autograd wrapping two more outputs."""

    @staticmethod
    def forward(ctx, x, call, scale_tensor=None):
        kind, dim, scale, mask, out_dtype = call
        out, row_max, row_sum = _forward_impl(kind, x, dim, scale, scale_tensor, mask, out_dtype)
        ctx.call, ctx.stats = call, (row_max, row_sum)
        if scale_tensor is None and mask is None:
            ctx.save_for_backward(x)
        else:
            ctx.save_for_backward(x, scale_tensor, mask)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        kind, dim, scale, _, _ = ctx.call
        saved = ctx.saved_tensors
        x, scale_tensor, mask = saved if len(saved) == 3 else (saved[0], None, None)
        row_max, row_sum = ctx.stats
        no_double_backward(ctx, (x, scale_tensor, grad_out))
        need_dscale = scale_tensor is not None and ctx.needs_input_grad[2]
        grad_x, grad_scale = _backward_impl(
            grad_out, x, row_max, row_sum, dim, kind, scale, scale_tensor, mask, need_dscale,
            dscale_placeholder=False,
        )
        return grad_x, None, _scale_grad(grad_scale, scale_tensor, need_dscale)


_OPS = {}


def needs_autograd(*tensors) -> bool:
    """Whether an eager fast-path call must go through its autograd.Function: grad mode on and an input
    requiring grad, or a forward-AD level open (dual inputs must reach the Function, which raises that it
    has no jvp). Otherwise the caller runs the implementation directly: what the Function would return then
    (no graph node), without its per-call host cost."""
    if torch.is_grad_enabled() and _any_requires_grad(*tensors):
        return True
    return getattr(_forward_ad, "_current_level", 0) >= 0  # unknown torch: assume a level is open


def forward(kind, x, dim, scale, scale_tensor, mask, out_dtype):
    """``(out, row_max, row_sum)`` of the op ``kind``: the eager fast path when it applies, else the op. An
    eager call that records nothing does not keep the row statistics: they may be None then."""
    if eager_fast_path(x, scale_tensor, mask):
        if not needs_autograd(x, scale_tensor):
            return _forward_impl(kind, x, dim, scale, scale_tensor, mask, out_dtype, stats=False)
        call = (kind, dim, scale, mask, out_dtype)
        if scale_tensor is None:
            return _EagerSoftmax.apply(x, call), None, None
        return _EagerSoftmax.apply(x, call, scale_tensor), None, None
    return _OPS[kind](x, dim, scale, scale_tensor, mask, out_dtype)


_OPS.update({SOFTMAX: softmax_op, LOG_SOFTMAX: log_softmax_op, LOGSUMEXP: logsumexp_op})
