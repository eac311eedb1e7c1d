"""torch.library op for the fused fp8 cast + transpose: op, fake, backend choice.

    safeops::cast_transpose(x, scale, dtype, rowwise) -> (y, y_t, amax)

``x`` is 2-D fp16/bf16/fp32 with any strides; ``scale`` has one element, or is ``(M, 1)`` when ``rowwise``
(fp16/bf16/fp32); ``dtype`` is ``float8_e4m3fn`` or ``float8_e5m2``. The public function
(:func:`safeops.cast_transpose`) checks all that; this op trusts it.

Outputs: ``y`` row-major ``(M, K)``; ``y_t`` the same values with strides ``(1, M)`` (the layout of
``y.t().contiguous().t()``); ``amax`` a 0-d fp32 tensor. Bit for bit ``y == (x.float() * scale).clamp(-max,
max).to(dtype)`` on every backend.

This op is opaque, like the softmax ops: it runs the eager launcher wherever it is called. Graphs compiled
under ``safeops.register()`` hold ``safeops::cast_transpose_compiled`` instead (end of this file), a
``triton_op`` whose kernel Inductor launches itself on a GPU. Neither has a derivative: the op is a cast to
fp8, which has no useful gradient; the public function detaches its inputs, so its outputs never require
grad.
"""

from __future__ import annotations

import torch

from .. import _config, reference
from . import _launch, cast_transpose_launch
from ._launch import define_op
from .softmax import eager_fast_path


def _impl(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool):
    if _config.use_triton(x):
        return cast_transpose_launch.cast_transpose(x, scale, dtype, rowwise)
    y, y_t, amax = reference.cast_transpose(x, scale, dtype, rowwise)
    # Same layouts as the fake and the kernel path.
    out = cast_transpose_launch.empty_outputs(x, dtype)
    return out[0].copy_(y), out[1].copy_(y_t), out[2].copy_(amax)


def _fake(x, scale, dtype, rowwise):
    return cast_transpose_launch.empty_outputs(x, dtype)


# The schema torch.library.custom_op inferred for the earlier definition; registered through
# torch.library.Library for fewer Python layers per call (safeops.ops._launch.define_op).
SCHEMA = "(Tensor x, Tensor scale, ScalarType dtype, bool rowwise) -> (Tensor, Tensor, Tensor)"
cast_transpose_op = define_op("cast_transpose", SCHEMA, _impl, _fake)


# ---------------------------------------------------------------------------------------------------
# Eager fast path
# ---------------------------------------------------------------------------------------------------
# For plain CPU/CUDA tensors in eager code the registered op's layers do nothing but reach _impl: the op
# has no derivative and its inputs are detached, so its Autograd kernel calls the implementation below
# autograd, outside any Dynamo frame hook. safeops.cast_transpose calls _impl itself then (the same
# launcher, the same kernel and arguments, the same fresh outputs), saving the dispatcher's ~10 us per call.
# Anything that traces or transforms (torch.compile / export, FakeTensor, make_fx, vmap, tensor
# subclasses, Python dispatch or function modes, jit tracing), other devices, and code running while
# Dynamo hooks Python frames keep the registered op.


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _no_frame_hook() -> bool:
    callback = _launch._dynamo_callback
    return callback is not None and callback() is None


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool):
    """What :func:`safeops.cast_transpose` runs once its arguments are checked."""
    # eager_fast_path before the frame-hook check: under Dynamo it is False at once (the check cannot be
    # traced). The exact-type checks first are eager_fast_path's own, cheaper here.
    if (type(x) in _PLAIN and type(scale) in _PLAIN and eager_fast_path() and (x.is_cuda or x.is_cpu)
            and _no_frame_hook()):
        if x.requires_grad or scale.requires_grad:
            x, scale = x.detach(), scale.detach()
        return _impl(x, scale, dtype, rowwise)
    return cast_transpose_op(x.detach(), scale.detach(), dtype, rowwise)


# ---------------------------------------------------------------------------------------------------
# The op compiled graphs hold
# ---------------------------------------------------------------------------------------------------
# safeops.register()'s rewrite (safeops.compile.cast_transpose) puts safeops::cast_transpose_compiled in the
# graphs it compiles. It is a torch.library.triton_op: AOTAutograd replaces it by its body, so Inductor
# launches the kernel from its own generated code, as it launches its own kernels, instead of calling the
# opaque op above through the dispatcher and the launcher (50-130 us of host time per call against a 20-30
# us kernel, bench/RESULTS.md). Inductor compiles a triton_op's kernel with its own options and drops
# enable_fp_fusion=False; that is safe here and only here: neither fp8 kernel has an fp32 add for a multiply
# to fuse into (tests/test_cast_transpose_configs.py compiles both with fusion on and finds no fma), so the
# compiled graph gives eager's bits. Inputs the kernels do not take (other devices, the reference
# backend, empty or oversized x) call the opaque op, which then stays in the graph. The backend
# (SAFEOPS_BACKEND) is read when the graph is compiled.


def _compiled_body(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   rowwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    launch = cast_transpose_launch.traced_launch(x, scale, dtype, rowwise)
    if launch is None:
        return cast_transpose_op(x, scale, dtype, rowwise)
    kernel, grid, scalars, constexprs = launch
    y, y_t, _ = cast_transpose_launch.empty_outputs(x, dtype)
    # Each program stores its maximum magnitude's bits (PARTIALS) instead of the eager launcher's hand-off
    # through a zeroed workspace, which Inductor would fill with a launch of its own; their maximum (an
    # integer max, which no order changes) is amax's bits, reduced by Inductor, which can fuse it with what
    # the graph does to amax next (x.abs().max() in x's dtype).
    partials = torch.empty(grid[0], dtype=torch.int32, device=x.device)
    torch.library.wrap_triton(kernel)[grid](x, scale, y, y_t, partials, partials, *scalars, **constexprs,
                                            PARTIALS=True)
    return y, y_t, partials.max().view(torch.float32)


_compiled: list = []


def compiled_op():
    """``safeops::cast_transpose_compiled.default``, defined on first use (``triton_op`` imports Dynamo,
    which ``import safeops`` must not)."""
    if not _compiled:
        torch.library.triton_op("safeops::cast_transpose_compiled", mutates_args=())(_compiled_body)
        _compiled.append(torch.ops.safeops.cast_transpose_compiled.default)
    return _compiled[0]
