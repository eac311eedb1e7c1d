"""Launchers for the cross-entropy Triton kernels (``safeops.kernels.cross_entropy``): blocks and grids.

The column-block width ``BLOCK_N`` (the lanes of each row's running sums, so the order of its additions)
depends on the number of classes and the device type only, never on the number of rows or the strides:
a row's loss and gradient bits are batch-invariant and layout-independent (contract section 6). The rows per
program (``BLOCK_M``) and the warps may follow the layout; no result depends on them.
"""

from __future__ import annotations

import math

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .. import _config
from ..reference import CE_MEAN, CE_NONE
from ._launch import KernelLaunch, alignment_bits, check_triton_device, launch

_kernels = None


def kernels():
    """The kernel module, imported on first use (importing safeops must not compile anything)."""
    global _kernels
    if _kernels is None:
        from ..kernels import cross_entropy as module

        _kernels = module
    return _kernels


# By device type: the widest column block (lanes per row), the elements of one program's tile for short rows,
# elements per thread, and the rows-per-program cap. Under the interpreter (CPU) small blocks make the test
# rows cross several column blocks and programs several rows.
# On the GPU: 2048 lanes, 32 elements per thread (2 warps per long row), the fastest of 2048-8192 lanes at
# 8-32 elements per thread at V = 32K and 128K (bench/RESULTS.md, cross-entropy, 2026-12-06).
MAX_BLOCK_N = {"cuda": 2048, "cpu": 32}
TILE = {"cuda": 2048, "cpu": 64}
PER_THREAD = {"cuda": 32, "cpu": 16}
MAX_BLOCK_M = 64
# The backward on a GPU, for rows of at least this many classes: 8192 lanes, 16 elements per thread (16
# warps), 1.03-1.05x the forward's block at V = 32K and 128K (bench/RESULTS.md, cross-entropy, 2026-12-06).
# Given the row statistics, each gradient element is computed alone, so the block changes no bits.
BWD_BLOCK_N = {"cuda": 8192}
BWD_PER_THREAD = {"cuda": 16}
# The sum/mean over rows: one program, this many lanes.
REDUCE_BLOCK = {"cuda": 1024, "cpu": 16}


def _device_kind(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


def _pow2(n: int) -> int:
    """The smallest power of 2 >= n (>= 1): triton.next_power_of_2's value, without its per-call cost (a
    ConstexprFunction call costs ~2 us of host time, several per launch)."""
    return 1 << max(n - 1, 0).bit_length()


def block_n(n_cols: int, device: torch.device) -> int:
    """Lanes of a row's running sums: a function of the row length (and the device type) alone."""
    return min(_pow2(n_cols), MAX_BLOCK_N[_device_kind(device)])


def config(n_cols: int, device: torch.device, backward: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps)."""
    kind = _device_kind(device)
    lanes = BWD_BLOCK_N.get(kind) if backward else None
    if lanes is not None and n_cols >= lanes:
        return 1, lanes, _pow2(min(16, lanes // (32 * BWD_PER_THREAD[kind])))
    bn = block_n(n_cols, device)
    bm = max(1, min(MAX_BLOCK_M, TILE[kind] // bn))
    num_warps = max(1, min(16, bm * bn // (32 * PER_THREAD[kind])))
    return bm, bn, _pow2(num_warps)


def _check_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda":
        check_triton_device(x, "input", kernels().cross_entropy_fwd_kernel)


def _launch_options(num_warps: int) -> dict:
    # Fusion off, as for every safeops kernel (contract section 1).
    return {"num_warps": num_warps, "enable_fp_fusion": _config.fp_fusion}


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """(N, C, d...) -> (N, C, prod(d)): a view for every layout whose d dims merge (all the usual ones)."""
    return x.reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:]))


def grad_buffer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, its (N, C, D) view): a fresh gradient buffer, laid out like x when x is dense."""
    dx3 = torch.empty_like(as_rows(x))
    return dx3.view(x.shape), dx3


def _row_dims(x3: torch.Tensor) -> int:
    return 1 if x3.shape[2] == 1 else 2


def _align(t3: torch.Tensor) -> int:
    """The multiple (in elements) of every row offset, when 16 bytes: vector loads and stores."""
    per16 = max(1, 16 // t3.element_size())
    strides = (t3.stride(0),) if t3.shape[2] == 1 else (t3.stride(0), t3.stride(2))
    return per16 if all(s % per16 == 0 for s in strides) else 1


def _wide(n_cols: int, *class_strides: int) -> bool:
    return max(n_cols - 1, 0) * max(abs(s) for s in class_strides) >= 2**31


def _per_row(t: torch.Tensor) -> torch.Tensor:
    """A per-row tensor (targets, gradients of a "none" loss, row stats) as the contiguous vector the kernels
    index by row (a copy only when it is strided or expanded: N elements, not N * C)."""
    return t.reshape(-1).contiguous()


def _check_rows(n_rows: int, n_cols: int) -> None:
    if n_rows >= 2**31 - 2**16:
        raise ValueError(f"target: {n_rows} rows are not supported (at most 2**31 - 2**16)")
    if n_cols >= 2**31:
        raise ValueError(f"input: {n_cols} classes are not supported (at most 2**31 - 1)")


def _flags(label_smoothing: float, z_loss: float) -> dict:
    return dict(HAS_NLL=label_smoothing < 1, HAS_SMOOTHING=label_smoothing > 0, HAS_Z=z_loss > 0)


def _scalars(label_smoothing: float, z_loss: float, n_cols: int) -> tuple[float, float, float, float]:
    # (C, 1 - eps, eps / C, z_loss), each rounded once to fp32 when passed (Triton's float arguments).
    return float(n_cols), 1.0 - label_smoothing, label_smoothing / max(n_cols, 1), float(z_loss)


def _weights(weight: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 contiguous weight, its sum as a 1-element tensor): no host sync; stand-ins without weight."""
    if weight is None:
        return like, like
    w = weight.to(torch.float32).contiguous()
    return w, w.sum().reshape(1)


def forward(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int,
            reduction: int, label_smoothing: float, z_loss: float, out_dtype: torch.dtype | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, row_max, row_sum, denom)`` for (N, C, d...) logits and (N, d...) targets; the loss in
    ``out_dtype`` (default x's)."""
    _check_device(x)
    n_cols = x.shape[1]
    n_rows = target.numel()
    row_max = x.new_empty(target.shape, dtype=torch.float32)
    row_sum = x.new_empty(target.shape, dtype=torch.float32)
    denom = x.new_zeros((2,), dtype=torch.float32)
    loss = x.new_empty(target.shape if reduction == CE_NONE else (), dtype=out_dtype or x.dtype)
    if n_rows == 0:
        if reduction != CE_NONE:
            loss.zero_()  # the sum of nothing, and a mean over nothing (contract section 10)
        return loss, row_max, row_sum, denom
    _check_rows(n_rows, n_cols)
    x3 = as_rows(x)
    t = _per_row(target)
    w, w_sum = _weights(weight, x)
    reduce = reduction != CE_NONE
    ce = x.new_empty((n_rows,), dtype=torch.float32) if reduce else loss
    zparts = x.new_empty((n_rows,), dtype=torch.float32) if reduce and z_loss > 0 else ce
    cfg = config(n_cols, x.device)
    tensors = (x3, t, w, w_sum, row_max, row_sum, ce, zparts, loss, denom)
    key = None
    if _planned(x):
        key = (_FWD, x3.shape, x3.stride(), x.dtype, t.dtype, w.dtype, loss.dtype, weight is None, reduction,
               label_smoothing, z_loss, ignore_index, cfg, x.device.index, _config.fp_fusion, kernels(),
               alignment_bits(*tensors))
    runs = _plans(key, lambda: _forward_launches(x3, n_rows, weight is not None, ignore_index, reduction,
                                                 label_smoothing, z_loss, cfg))
    run, scalars = runs[0]
    run(x3, t, w, w_sum, row_max, row_sum, ce, zparts, *scalars)
    if reduce:
        run, scalars = runs[1]
        run(ce, zparts, t, w, loss, denom, *scalars)
    return loss, row_max, row_sum, denom


def _forward_launches(x3: torch.Tensor, n_rows: int, has_weight: bool, ignore_index: int, reduction: int,
                      label_smoothing: float, z_loss: float, cfg: tuple[int, int, int]) -> list:
    """The forward's launches: [(kernel, grid, scalar arguments after the tensors, keyword arguments)];
    ``n_rows``: the rows of the (N, C, D) view x3, N * D."""
    k = kernels()
    n_cols = x3.shape[1]
    bm, bn, num_warps = cfg
    flags = _flags(label_smoothing, z_loss)
    launches = [(k.cross_entropy_fwd_kernel, (-(-n_rows // bm),),
                 (n_rows, n_cols, x3.shape[2], x3.stride(0), x3.stride(2), x3.stride(1), ignore_index,
                  *_scalars(label_smoothing, z_loss, n_cols)),
                 dict(REDUCE=reduction, HAS_WEIGHT=has_weight, **flags, ROW_DIMS=_row_dims(x3),
                      WIDE=_wide(n_cols, x3.stride(1)), XA=_align(x3), BLOCK_M=bm, BLOCK_N=bn,
                      **_launch_options(num_warps)))]
    if reduction != CE_NONE:
        launches.append((k.cross_entropy_reduce_kernel, (1,), (n_rows, n_cols, ignore_index),
                         dict(MEAN=reduction == CE_MEAN, HAS_WEIGHT=has_weight, HAS_Z=flags["HAS_Z"],
                              BLOCK=REDUCE_BLOCK[_device_kind(x3.device)], **_launch_options(4))))
    return launches


# ---------------------------------------------------------------------------------------------------------
# Launch plans (CUDA): per call signature, the grids, the constexprs and the scalar arguments are decided
# once and kept with a KernelLaunch per kernel, so a repeated call builds one small key and launches the
# compiled kernels directly. The key holds everything that decides a launch: shapes and strides (the scalar
# arguments, with the integers Triton specializes on), dtypes, the options, ignore_index, the block (which
# the tuning tables above give), the kernels module, fp fusion, and the 16-byte alignment of every tensor
# argument (Triton specializes pointers on it). Elsewhere (CPU, the interpreter, tests' stand-ins) every call
# decides again and launches as kernel[grid].
# ---------------------------------------------------------------------------------------------------------

_FWD, _BWD = 0, 1
_PLANS: dict = {}
_PLAN_LIMIT = 1024


def _planned(x: torch.Tensor) -> bool:
    """Whether calls on ``x`` keep launch plans (CUDA; bench/overhead.py's CPU emulation says yes)."""
    return x.is_cuda


def _compiled(kernel) -> bool:
    """A JIT kernel that compiles (not the interpreter's, not a stand-in): a KernelLaunch can keep it."""
    return isinstance(kernel, JITFunction) and not isinstance(kernel, InterpretedFunction)


def _plain(kernel, grid, kwargs):
    return lambda *args: launch(kernel, grid, *args, **kwargs)


def _plans(key, build) -> list:
    """[(run, scalars)] for the launches ``build()`` describes; kept under ``key`` (None: not kept)."""
    runs = _PLANS.get(key) if key is not None else None
    if runs is None:
        runs = []
        for kernel, grid, scalars, kwargs in build():
            direct = key is not None and _compiled(kernel)
            runs.append((KernelLaunch(kernel, grid, kwargs) if direct else _plain(kernel, grid, kwargs),
                         scalars))
        if key is not None:
            if len(_PLANS) >= _PLAN_LIMIT:
                _PLANS.clear()
            _PLANS[key] = runs
    return runs


def backward(grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
             row_max: torch.Tensor, row_sum: torch.Tensor, denom: torch.Tensor, ignore_index: int,
             reduction: int, label_smoothing: float, z_loss: float, out: torch.Tensor | None = None
             ) -> torch.Tensor:
    """d loss / d x, written once: into ``out`` (which may be ``x`` itself) or a fresh buffer."""
    _check_device(x)
    if out is None:
        dx, dx3 = grad_buffer(x)
    else:
        dx, dx3 = out, as_rows(out)
    n_cols = x.shape[1]
    n_rows = target.numel()
    if n_rows == 0 or n_cols == 0:
        return dx
    _check_rows(n_rows, n_cols)
    x3 = as_rows(x)
    t = _per_row(target)
    # The gradient of a "none" loss is often expanded (loss.sum().backward() gives stride 0).
    g = _per_row(grad) if reduction == CE_NONE else grad
    w, w_sum = _weights(weight, x)
    cfg = config(n_cols, x.device, backward=True)
    tensors = (g, x3, dx3, t, w, w_sum, _per_row(row_max), _per_row(row_sum), denom)
    key = None
    if _planned(x):
        key = (_BWD, x3.shape, x3.stride(), dx3.stride(), x.dtype, dx3.dtype, t.dtype, w.dtype, g.dtype,
               weight is None, reduction, label_smoothing, z_loss, ignore_index, cfg, x.device.index,
               _config.fp_fusion, kernels(), alignment_bits(*tensors))
    options = (weight is not None, ignore_index, reduction, label_smoothing, z_loss, cfg)
    (run, scalars), = _plans(key, lambda: _backward_launches(x3, dx3, n_rows, *options))
    run(*tensors, *scalars)
    return dx


def _backward_launches(x3: torch.Tensor, dx3: torch.Tensor, n_rows: int, has_weight: bool, ignore_index: int,
                       reduction: int, label_smoothing: float, z_loss: float, cfg: tuple[int, int, int]
                       ) -> list:
    """The backward's launch, as ``_forward_launches`` describes them."""
    n_cols = x3.shape[1]
    bm, bn, num_warps = cfg
    return [(kernels().cross_entropy_bwd_kernel, (-(-n_rows // bm),),
             (n_rows, n_cols, x3.shape[2], x3.stride(0), x3.stride(2), x3.stride(1),
              dx3.stride(0), dx3.stride(2), dx3.stride(1), ignore_index,
              *_scalars(label_smoothing, z_loss, n_cols)),
             dict(REDUCE=reduction, HAS_WEIGHT=has_weight, **_flags(label_smoothing, z_loss),
                  ROW_DIMS=_row_dims(x3), WIDE=_wide(n_cols, x3.stride(1), dx3.stride(1)), XA=_align(x3),
                  DA=_align(dx3), BLOCK_M=bm, BLOCK_N=bn, **_launch_options(num_warps)))]
