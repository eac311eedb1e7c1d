"""Launchers for the softmax-family Triton kernels: block sizes, grids and the long-row split.

Every choice here is keyed by the row length and the element size only, never by the number of rows:
that is what makes results batch-invariant (contract section 6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from .. import _config
from ._rows import Rows, rows_of

_kernels = None


def kernels():
    """The kernel module, imported on first use (importing safeops must not compile anything)."""
    global _kernels
    if _kernels is None:
        from ..kernels import softmax as module

        _kernels = module
    return _kernels


def _check_device(x: torch.Tensor) -> None:
    if x.device.type == "cuda":
        return
    if x.device.type != "cpu":
        raise ValueError(f"x: the Triton kernels need a CUDA tensor (or a CPU tensor, interpreted), got {x.device}")
    if not isinstance(kernels().softmax_fwd_rows_kernel, InterpretedFunction):
        raise ValueError(
            "x: SAFEOPS_BACKEND=triton with a CPU tensor needs Triton's interpreter; set TRITON_INTERPRET=1 "
            "before importing triton, or use SAFEOPS_BACKEND=auto to run CPU tensors on the reference"
        )


# Longest row a single program keeps entirely in registers, by element size in bytes.
ROW_RESIDENT_MAX_COLS = {2: 16384, 4: 8192, 1: 16384}
# Long rows: columns per loop step and per program.
SPLIT_BLOCK_N = 4096
SPLIT_COLS_PER_PROGRAM = 32768


@dataclass(frozen=True)
class RowsConfig:
    block_m: int
    block_n: int
    num_warps: int


@dataclass(frozen=True)
class SplitConfig:
    block_n: int
    cols_per_split: int
    n_splits: int
    num_warps: int


def rows_config(n_cols: int, elem_size: int, col_stride_is_one: bool) -> RowsConfig | None:
    if n_cols > ROW_RESIDENT_MAX_COLS.get(elem_size, 8192):
        return None
    block_n = triton.next_power_of_2(max(n_cols, 1))
    if col_stride_is_one:
        block_m = max(1, min(64, 2048 // block_n))
    else:
        # The reduced dim is strided: take more rows per program so neighbouring rows share sectors.
        block_m = max(1, min(64, 8192 // block_n))
    tile = block_m * block_n
    num_warps = max(1, min(16, tile // 512))
    return RowsConfig(block_m=block_m, block_n=block_n, num_warps=num_warps)


def split_config(n_cols: int) -> SplitConfig:
    block_n = min(SPLIT_BLOCK_N, triton.next_power_of_2(max(n_cols, 1)))
    per_program = max(block_n, SPLIT_COLS_PER_PROGRAM)
    n_splits = triton.cdiv(n_cols, per_program)
    cols_per_split = triton.cdiv(triton.cdiv(n_cols, n_splits), block_n) * block_n
    n_splits = triton.cdiv(n_cols, cols_per_split)
    return SplitConfig(block_n=block_n, cols_per_split=cols_per_split, n_splits=n_splits, num_warps=8)


def _scale_args(scale: float | None, scale_tensor: torch.Tensor | None, like: torch.Tensor):
    if scale_tensor is not None:
        return 2, scale_tensor, 1.0
    if scale is not None:
        return 1, like, float(scale)
    return 0, like, 1.0


def _layout(shape, dim, tensors: dict[str, torch.Tensor | None]) -> tuple[Rows, dict[str, torch.Tensor]]:
    rows = rows_of(shape, dim, tensors)
    if rows is None:
        # More than three non-mergeable batch dims: read contiguous copies instead.
        tensors = {k: (t.contiguous() if t is not None and k in ("x", "mask", "grad") else t)
                   for k, t in tensors.items()}
        rows = rows_of(shape, dim, tensors)
        assert rows is not None
    return rows, tensors


def _launch_options(num_warps: int) -> dict:
    return {"num_warps": num_warps, "enable_fp_fusion": _config.fp_fusion}


def forward(
    kind: int,
    x: torch.Tensor,
    dim: int,
    scale: float | None,
    scale_tensor: torch.Tensor | None,
    mask: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_device(x)
    k = kernels()
    batch_shape = x.shape[:dim] + x.shape[dim + 1:]
    row_max = x.new_empty(batch_shape, dtype=torch.float32)
    row_sum = x.new_empty(batch_shape, dtype=torch.float32)
    if kind == 2:
        out = x.new_empty(batch_shape, dtype=out_dtype)
    else:
        out = torch.empty_like(x, dtype=out_dtype)
    if x.numel() == 0 and row_max.numel() == 0:
        return out, row_max, row_sum
    if x.shape[dim] == 0:
        # Rows with no columns are empty rows (contract section 4).
        row_max.fill_(float("-inf"))
        row_sum.zero_()
        if kind == 2:
            out.fill_(float("-inf"))
        return out, row_max, row_sum

    mask_u8 = mask.view(torch.uint8) if mask is not None else None
    rows, t = _layout(x.shape, dim, {"x": x, "out": out if kind != 2 else None, "mask": mask_u8})
    x_, mask_ = t["x"], t["mask"]
    scale_mode, scale_ptr, scale_value = _scale_args(scale, scale_tensor, x_)
    mask_arg = mask_ if mask_ is not None else x_
    B0, B1, B2 = rows.sizes
    del B0
    elem = x.element_size()
    cfg = rows_config(rows.n_cols, elem, rows.args("x")[3] == 1)
    if cfg is not None:
        grid = (triton.cdiv(rows.n_rows, cfg.block_m),)
        k.softmax_fwd_rows_kernel[grid](
            x_, out, mask_arg, scale_ptr, row_max, row_sum,
            rows.n_rows, rows.n_cols, B1, B2,
            *rows.args("x"), *rows.args("out"), *rows.args("mask"),
            scale_value,
            KIND=kind, SCALE_MODE=scale_mode, HAS_MASK=mask_ is not None,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            **_launch_options(cfg.num_warps),
        )
        return out, row_max, row_sum

    sc = split_config(rows.n_cols)
    ws_max = x.new_empty((rows.n_rows * sc.n_splits,), dtype=torch.float32)
    ws_sum = torch.empty_like(ws_max)
    grid = (rows.n_rows * sc.n_splits,)
    k.softmax_fwd_partial_kernel[grid](
        x_, mask_arg, scale_ptr, ws_max, ws_sum,
        rows.n_cols, B1, B2,
        *rows.args("x"), *rows.args("mask"),
        scale_value, sc.n_splits, sc.cols_per_split,
        SCALE_MODE=scale_mode, HAS_MASK=mask_ is not None, BLOCK_N=sc.block_n,
        **_launch_options(sc.num_warps),
    )
    k.softmax_fwd_finish_kernel[grid](
        x_, out, mask_arg, scale_ptr, ws_max, ws_sum, row_max, row_sum,
        rows.n_cols, B1, B2,
        *rows.args("x"), *rows.args("out"), *rows.args("mask"),
        scale_value, sc.n_splits, sc.cols_per_split,
        KIND=kind, SCALE_MODE=scale_mode, HAS_MASK=mask_ is not None,
        SPLITS=triton.next_power_of_2(sc.n_splits), BLOCK_N=sc.block_n,
        **_launch_options(sc.num_warps),
    )
    return out, row_max, row_sum


def backward(
    kind: int,
    grad: torch.Tensor,
    x: torch.Tensor,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    dim: int,
    scale: float | None,
    scale_tensor: torch.Tensor | None,
    mask: torch.Tensor | None,
    need_dscale: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_device(x)
    k = kernels()
    dx = torch.empty_like(x)
    dscale = x.new_zeros((), dtype=torch.float32)
    if x.numel() == 0:
        return dx, dscale
    row_max = row_max.contiguous()
    row_sum = row_sum.contiguous()
    mask_u8 = mask.view(torch.uint8) if mask is not None else None
    if kind == 2:
        grad_rows = grad.contiguous()
        rows, t = _layout(x.shape, dim, {"x": x, "dx": dx, "mask": mask_u8, "grad": None})
        t["grad"] = grad_rows
    else:
        rows, t = _layout(x.shape, dim, {"x": x, "dx": dx, "mask": mask_u8, "grad": grad})
    x_, mask_, grad_ = t["x"], t["mask"], t["grad"]
    scale_mode, scale_ptr, scale_value = _scale_args(scale, scale_tensor, x_)
    mask_arg = mask_ if mask_ is not None else x_
    _, B1, B2 = rows.sizes
    need_dscale = bool(need_dscale and scale_tensor is not None)
    cfg = rows_config(rows.n_cols, x.element_size(), rows.args("x")[3] == 1)
    if cfg is not None:
        dscale_rows = x.new_empty((rows.n_rows if need_dscale else 1,), dtype=torch.float32)
        grid = (triton.cdiv(rows.n_rows, cfg.block_m),)
        k.softmax_bwd_rows_kernel[grid](
            grad_, x_, dx, mask_arg, scale_ptr, row_max, row_sum, dscale_rows,
            rows.n_rows, rows.n_cols, B1, B2,
            *rows.args("grad"), *rows.args("x"), *rows.args("dx"), *rows.args("mask"),
            scale_value,
            KIND=kind, SCALE_MODE=scale_mode, HAS_MASK=mask_ is not None, NEED_DSCALE=need_dscale,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            **_launch_options(cfg.num_warps),
        )
    else:
        sc = split_config(rows.n_cols)
        grid = (rows.n_rows * sc.n_splits,)
        ws = x.new_empty((rows.n_rows * sc.n_splits,), dtype=torch.float32)
        dscale_rows = x.new_empty((rows.n_rows * sc.n_splits if need_dscale else 1,), dtype=torch.float32)
        if kind != 2:
            k.softmax_bwd_partial_kernel[grid](
                grad_, x_, mask_arg, scale_ptr, row_max, row_sum, ws,
                rows.n_cols, B1, B2,
                *rows.args("grad"), *rows.args("x"), *rows.args("mask"),
                scale_value, sc.n_splits, sc.cols_per_split,
                KIND=kind, SCALE_MODE=scale_mode, HAS_MASK=mask_ is not None, BLOCK_N=sc.block_n,
                **_launch_options(sc.num_warps),
            )
        k.softmax_bwd_finish_kernel[grid](
            grad_, x_, dx, mask_arg, scale_ptr, row_max, row_sum, ws, dscale_rows,
            rows.n_cols, B1, B2,
            *rows.args("grad"), *rows.args("x"), *rows.args("dx"), *rows.args("mask"),
            scale_value, sc.n_splits, sc.cols_per_split,
            KIND=kind, SCALE_MODE=scale_mode, HAS_MASK=mask_ is not None, NEED_DSCALE=need_dscale,
            SPLITS=triton.next_power_of_2(sc.n_splits), BLOCK_N=sc.block_n,
            **_launch_options(sc.num_warps),
        )
    if need_dscale:
        dscale = dscale_rows.sum()
    return dx, dscale
