"""Launchers for the attention-merge Triton kernels (``safeops.kernels.merge``).

Block sizes depend on the head dim only, never on the number of rows or partials, so a row's result is
batch-invariant (contract section 6).
"""

from __future__ import annotations

import torch
import triton

from .. import _config
from ._launch import check_triton_device, launch

_kernels = None


def kernels():
    """The kernel module, imported on first use (importing safeops must not compile anything)."""
    global _kernels
    if _kernels is None:
        from ..kernels import merge as module

        _kernels = module
    return _kernels


def _check_device(o: torch.Tensor) -> None:
    if o.device.type != "cuda":
        check_triton_device(o, "outs", kernels().merge_fwd_kernel)


def block_sizes(d: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for head dim ``d``. Interpreted (CPU), small tiles so that test shapes
    cross row blocks and head-dim tiles."""
    if device.type != "cuda":
        return 4, min(16, triton.next_power_of_2(max(d, 1))), 1
    block_d = min(128, triton.next_power_of_2(max(d, 1)))
    block_r = max(1, min(64, 4096 // block_d))
    return block_r, block_d, 4


def _wide(d: int, *head_strides: int) -> bool:
    """Whether head-dim offsets ``col * stride`` (col < d) can reach 2**31 for one of the tensors' head-dim
    strides: then the kernels compute them in 64 bits (contract section 8). They are the kernels' only
    32-bit index products (row offsets are 64-bit, partials are reached by bumping pointers), so e.g. a
    contiguous stack of more than 2**31 elements stays on the 32-bit code, which the common case runs.
    Same bits either way."""
    return (d - 1) * max(head_strides) >= 2**31  # torch strides are >= 0


def _check_head_dim(d: int) -> None:
    if d >= 2**31 - 2**16:
        raise ValueError(f"outs: a head dim of {d} is not supported (at most 2**31 - 2**16)")


def _launch_options(num_warps: int) -> dict:
    # Fusion off, as for every safeops kernel: w_i * o_i + acc must not become an fma with one rounding less
    # on some GPUs and not others (contract section 6: the same bits everywhere).
    return {"num_warps": num_warps, "enable_fp_fusion": _config.fp_fusion}


def _sinks_constexpr(sink: torch.Tensor | None) -> dict:
    return {} if sink is None else {"HAS_SINKS": True}  # without sinks: the kernels' default, as before


def forward(o: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``o`` (P, R, D), ``lse`` (P, R) fp32, ``sink`` None or the per-row sink logit (R,) fp32 contiguous ->
    (out (R, D) in o's dtype, lse (R,) fp32)."""
    _check_device(o)
    P, R, D = o.shape
    out = o.new_empty((R, D))
    lse_out = lse.new_empty((R,))
    if R == 0:
        return out, lse_out
    _check_head_dim(D)
    block_r, block_d, num_warps = block_sizes(D, o.device)
    launch(kernels().merge_fwd_kernel, (triton.cdiv(R, block_r),),
            o, lse, out, lse_out, sink, P, R, D,
            o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            WIDE=_wide(D, o.stride(2), out.stride(1)), BLOCK_R=block_r, BLOCK_D=block_d,
            **_sinks_constexpr(sink), **_launch_options(num_warps))
    return out, lse_out


def backward(grad_out: torch.Tensor, grad_lse: torch.Tensor | None, o: torch.Tensor, lse: torch.Tensor,
             sink: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``(d o (P, R, D) in o's dtype, d lse (P, R) fp32)`` from ``grad_out`` (R, D) and ``grad_lse`` (R,);
    with ``sink`` (see ``forward``) also ``d sink`` per row, (R,) fp32."""
    _check_device(o)
    P, R, D = o.shape
    go = o.new_empty((P, R, D))
    gl = lse.new_empty((P, R))
    gsink = None if sink is None else torch.empty_like(sink)
    if R == 0:
        return (go, gl) if sink is None else (go, gl, gsink)
    _check_head_dim(D)
    block_r, block_d, num_warps = block_sizes(D, o.device)
    has_glse = grad_lse is not None
    glse = grad_lse if has_glse else lse
    launch(kernels().merge_bwd_kernel, (triton.cdiv(R, block_r),),
            o, lse, grad_out, glse, go, gl, sink, gsink, P, R, D,
            o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
            grad_out.stride(0), grad_out.stride(1), glse.stride(-1), go.stride(0), go.stride(1), go.stride(2),
            HAS_GLSE=has_glse, WIDE=_wide(D, o.stride(2), grad_out.stride(1), go.stride(2)), BLOCK_R=block_r,
            BLOCK_D=block_d, **_sinks_constexpr(sink), **_launch_options(num_warps))
    return (go, gl) if sink is None else (go, gl, gsink)
