"""Launchers for the softmax-family Triton kernels: block sizes, grids and the long-row split.

Every choice here is keyed by the row length and the element size only, never by the number of rows:
that is what makes results batch-invariant (contract section 6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .. import _config
from ._launch import KernelLaunch, alignment_bits, check_triton_device
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
    if x.device.type != "cuda":
        check_triton_device(x, "x", kernels().softmax_fwd_rows_kernel)


# Longest row a single program keeps entirely in registers, by element size in bytes: the backward's limit
# (and the forward's where ROW_RESIDENT_MAX_COLS_FWD has no larger one).
ROW_RESIDENT_MAX_COLS = {1: 16384, 2: 16384, 4: 16384}
# The forward holds one value per element: a 32K row fits one 32-warp program without spilling (sm_90;
# 64K spills), and reading it once beats the split path, which reads it twice. The backward, holding x and
# grad, spills at 32K and keeps the 16K limit. Measurements: bench/RESULTS.md (softmax).
ROW_RESIDENT_MAX_COLS_FWD = {1: 32768, 2: 32768, 4: 32768}
# Short rows, by element size: (smallest tile of BLOCK_M x BLOCK_N elements, elements per thread).
ROWS_FWD = {1: (4096, 32), 2: (4096, 32), 4: (1024, 16)}
ROWS_BWD = {1: (1024, 16), 2: (1024, 16), 4: (1024, 8)}
# Backward of unit-stride rows of these block widths (BLOCK_N), by element size: a persistent grid of
# ROWS_BWD_PERSIST_PER_SM programs per SM whose loop Triton pipelines over ROWS_BWD_STAGES stages. The
# pipeline keeps ROWS_BWD_STAGES - 1 tiles of x and grad (and the mask) in shared memory: 131 KB at 16K
# bf16 (164 KB masked), so wider blocks would not fit.
# At 16K bf16 columns one 32-warp program fills an SM and nothing else hides its loads' latency; the
# pipeline does. fp32 rows do not fit two stages in shared memory, and shorter rows are faster with one
# tile per program (bench/RESULTS.md, softmax).
ROWS_BWD_PERSIST: dict[int, tuple[int, ...]] = {1: (16384,), 2: (16384,)}
ROWS_BWD_STAGES = 3
ROWS_BWD_PERSIST_PER_SM = 1
# Long rows: columns each program of a split row owns (the loop kernel's block).
SPLIT_BLOCK_N = {1: 4096, 2: 4096, 4: 2048}
SPLIT_NUM_WARPS = {1: 4, 2: 4, 4: 4}
SPLIT_MAXNREG: dict[int, int | None] = {1: None, 2: None, 4: None}
# Backward rows up to these lengths (by element size), longer than one program holds, run the loop kernel:
# one program walks a row twice, the second time from L2, in one launch, where one row of x and the gradient
# fits LOOP_L2_BYTES_PER_SM. Programs of LOOP_NUM_WARPS warps, as many per SM as that budget holds rows (at
# least one, at most LOOP_MAX_PROGRAMS_PER_SM: what is resident at once at 16 warps and up to 64 registers),
# so that every program's row stays in L2 between its two walks (132 x 256 KB = 33 MB of an H100 / H200's
# 50 MB). Longer rows (fp32 from 64K on), and the forward, measured no faster than the two-launch path
# (bench/RESULTS.md, softmax).
LOOP_MAX_COLS_BWD = {1: 65536, 2: 65536, 4: 32768}
LOOP_L2_BYTES_PER_SM = 256 << 10
LOOP_MAX_PROGRAMS_PER_SM = 2
LOOP_NUM_WARPS = 16


@dataclass(frozen=True)
class RowsConfig:
    block_m: int
    block_n: int
    num_warps: int
    maxnreg: int | None = None
    stages: int = 0  # backward only: 0 one tile per program; >= 2 a persistent, pipelined grid
    programs_per_sm: int = 0  # the persistent grid's programs per SM

    def grid(self, n_rows: int, device: torch.device) -> tuple[int]:
        blocks = triton.cdiv(n_rows, self.block_m)
        if self.stages:
            blocks = max(1, min(blocks, self.programs_per_sm * _multiprocessors(device)))
        return (blocks,)


def _multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device; 2 elsewhere (the interpreter: enough to make a persistent grid loop)."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class SplitConfig:
    block_n: int
    cols_per_split: int
    n_splits: int
    num_warps: int
    maxnreg: int | None = None


def rows_config(n_cols: int, elem_size: int, backward: bool = False) -> RowsConfig | None:
    """Whole rows per program. Tile and elements per thread are tuned on an H200 (bench/softmax.py). The
    kernels get every row unit-stride (``canonical_layout``), so the tile depends on the row length and
    the element size only."""
    limit = ROW_RESIDENT_MAX_COLS.get(elem_size, 8192)
    if not backward:
        limit = max(limit, ROW_RESIDENT_MAX_COLS_FWD.get(elem_size, 0))
    if n_cols > limit:
        return None
    block_n = triton.next_power_of_2(max(n_cols, 1))
    min_tile, per_thread = (ROWS_BWD if backward else ROWS_FWD).get(elem_size, (1024, 16))
    block_m = max(1, min(64, min_tile // block_n))
    num_warps = max(1, min(32, block_m * block_n // (32 * per_thread)))
    if backward and block_n in ROWS_BWD_PERSIST.get(elem_size, ()):
        return RowsConfig(block_m=block_m, block_n=block_n, num_warps=num_warps, stages=ROWS_BWD_STAGES,
                          programs_per_sm=ROWS_BWD_PERSIST_PER_SM)
    return RowsConfig(block_m=block_m, block_n=block_n, num_warps=num_warps)


def split_config(n_cols: int, elem_size: int) -> SplitConfig:
    """One block of columns per program."""
    block_n = min(SPLIT_BLOCK_N.get(elem_size, 4096), triton.next_power_of_2(max(n_cols, 1)))
    n_splits = triton.cdiv(n_cols, block_n)
    cols_per_split = block_n
    return SplitConfig(block_n=block_n, cols_per_split=cols_per_split, n_splits=n_splits,
                       num_warps=SPLIT_NUM_WARPS.get(elem_size, 8), maxnreg=SPLIT_MAXNREG.get(elem_size))


def _scale_args(scale: float | None, scale_tensor: torch.Tensor | None, like: torch.Tensor):
    if scale_tensor is not None:
        return 2, scale_tensor, 1.0
    if scale is not None:
        return 1, like, float(scale)
    return 0, like, 1.0


# Triton derives a kernel's register layout, and with it the order of every row reduction, from the
# strides and alignment the kernel is specialized for: a reduced dim that is not unit-stride, or (where the
# row length allows the 16-byte claim) row starts off the 16-byte grid, in an input or an output, can give
# the same row other bits than its contiguous copy. So every tensor the kernels address tile by tile is
# used in one canonical form per row length (contract section 6): inputs that are not are read from a
# rows-major copy, outputs that are not are written to rows-major scratch and copied back. Per row length,
# dtype and op, every call then runs one kernel specialization, up to the variations
# tests/test_softmax_layouts.py compiles for sm_90 and finds to leave the reductions' layouts unchanged.
_INPUTS = ("x", "mask", "grad")


def _rows_major(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A copy of ``t`` (always a fresh allocation) with the reduced dim innermost and the batch dims in
    order."""
    return t.movedim(dim, -1).clone(memory_format=torch.contiguous_format).movedim(-1, dim)


def canonical_layout(t: torch.Tensor, dim: int) -> bool:
    """Whether the kernels address ``t`` in place: the reduced dim unit-stride (or of size 1), and every row
    start 16-byte aligned when the row length is a multiple of 16 bytes (``_aligns`` then claims it)."""
    n = t.shape[dim]
    if n > 1 and t.stride(dim) != 1:
        return False
    per16 = max(1, 16 // t.element_size())
    if n % per16:
        return True  # no alignment is claimed for any tensor of this row length
    return t.data_ptr() % 16 == 0 and all(
        t.stride(d) % per16 == 0 for d in range(t.dim()) if d != dim and t.shape[d] > 1)


def _canonical(name: str, t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
    """``t`` itself if canonical, else a rows-major copy (inputs) or rows-major scratch (outputs)."""
    if t is None or canonical_layout(t, dim):
        return t
    return _rows_major(t, dim) if name in _INPUTS else _rows_major_shape(t, dim)


def _layout(shape, dim, tensors: dict[str, torch.Tensor | None]) -> tuple[Rows, dict[str, torch.Tensor]]:
    """Row view of the tensors, in their canonical forms (``_canonical``: inputs may be replaced by copies,
    outputs by scratch, which the caller copies back with ``_write_back``). When the layouts need more than
    three batch dims, every tensor goes rows-major (one batch dim)."""
    given = tensors
    tensors = {k: _canonical(k, t, dim) for k, t in tensors.items()}
    rows = rows_of(shape, dim, tensors)
    if rows is None:
        # A tensor replaced above is rows-major already; the others are replaced now.
        tensors = {k: (t if t is None or t is not given[k] else _rows_major(t, dim) if k in _INPUTS
                       else _rows_major_shape(t, dim)) for k, t in tensors.items()}
        rows = rows_of(shape, dim, tensors)
        assert rows is not None
    return rows, tensors


def _rows_major_shape(t: torch.Tensor, dim: int) -> torch.Tensor:
    """An uninitialised tensor like ``t`` laid out as ``_rows_major`` lays it out."""
    return torch.empty(t.movedim(dim, -1).shape, dtype=t.dtype, device=t.device).movedim(-1, dim)


def _write_back(result: torch.Tensor, written: torch.Tensor | None) -> None:
    if written is not None and written is not result:
        result.copy_(written)


def _loop_grid(n_rows: int, row_bytes: int, device: torch.device) -> tuple[int]:
    """The loop kernel's persistent grid (which program takes a row changes no result); ``row_bytes``: one
    row of x and of the gradient."""
    per_sm = min(LOOP_MAX_PROGRAMS_PER_SM, max(1, LOOP_L2_BYTES_PER_SM // max(row_bytes, 1)))
    return (max(1, min(n_rows, per_sm * _multiprocessors(device))),)


def _wide(rows: Rows) -> bool:
    """Whether per-element column offsets can pass 2**31 (then the kernels compute them in 64 bits)."""
    if rows.n_cols >= 2**31:
        raise ValueError(f"x: rows of {rows.n_cols} elements are not supported (at most 2**31 - 1)")
    if rows.n_rows >= 2**31 - 2**16:
        raise ValueError(f"x: {rows.n_rows} rows are not supported (at most 2**31 - 2**16)")
    return max(abs(st[3]) for st in rows.strides.values()) * rows.n_cols >= 2**31


def _row_dims(rows: Rows) -> int:
    """How many batch dims the rows kernels must decode (``ROW_DIMS``): the row view pads with size-1
    dims on the outside, and rows that lie one stride apart (one dim) need no division at all."""
    b0, b1, _ = rows.sizes
    return 1 if b0 == 1 and b1 == 1 else 2 if b0 == 1 else 3


_ALIGN_ARGS = {"x": "XA", "out": "OA", "mask": "MA", "grad": "GA", "dx": "DA"}


def _aligns(rows: Rows, tensors: dict[str, torch.Tensor | None]) -> dict[str, int]:
    """Per tensor, the alignment (in elements) that every row start is known to have: 16 bytes or 1.

    It is claimed only when the row length itself is a multiple of 16 bytes, so a row sliced out of a
    batch is aligned exactly when the batch is; the vector width, and so the reduction order, then does
    not depend on the rows around it (contract section 6).
    """
    aligns = {}
    for name, t in tensors.items():
        arg = _ALIGN_ARGS[name]
        if t is None or name not in rows.strides:
            aligns[arg] = 1
            continue
        per16 = max(1, 16 // t.element_size())
        ok = (rows.n_cols % per16 == 0 and t.data_ptr() % 16 == 0
              and all(st % per16 == 0 for st in rows.args(name)[:3]))
        aligns[arg] = per16 if ok else 1
    return aligns


def _launch_options(cfg) -> dict:
    options = {"num_warps": cfg.num_warps, "enable_fp_fusion": _config.fp_fusion}
    if cfg.maxnreg is not None:
        options["maxnreg"] = cfg.maxnreg
    return options


def forward(
    kind: int,
    x: torch.Tensor,
    dim: int,
    scale: float | None,
    scale_tensor: torch.Tensor | None,
    mask: torch.Tensor | None,
    out_dtype: torch.dtype,
    stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(out, row_max, row_sum)``. ``stats=False`` (a call that records no backward): the row statistics
    may be skipped, ``(out, None, None)``; the rows kernel then writes none (two allocations and their
    stores fewer per call), with the same arithmetic, hence the same ``out``."""
    if not x.is_cuda:
        _check_device(x)
    if kind == 2:
        out = x.new_empty(x.shape[:dim] + x.shape[dim + 1:], dtype=out_dtype)
    else:
        out = torch.empty_like(x, dtype=out_dtype)
    if x.numel() == 0:
        return _forward_general(kind, x, dim, scale, scale_tensor, mask, out, *_new_row_stats(x, dim))
    # Every tensor argument's dtype, strides and alignment, or what decides them: out (out_dtype; strides
    # follow x's), mask (its dtype: the op takes bool, viewed as uint8); row_max / row_sum are fp32, fresh
    # and 16-byte aligned (checked below), or, without stats, out in their place.
    key = (kind, dim, x.shape, x.stride(), x.dtype, x.get_device(), out_dtype,
           None if mask is None else (mask.stride(), mask.dtype),
           0 if scale_tensor is None else scale_tensor.dtype,
           scale is None, stats, alignment_bits(x, out, mask, scale_tensor))
    plan = _plans(_FORWARD).get(key)
    if plan is None:
        plan = _remember(_FORWARD, key, _forward_plan(kind, x, dim, scale, scale_tensor, mask, out, stats))
    if plan is _GENERAL:
        return _forward_general(kind, x, dim, scale, scale_tensor, mask, out, *_new_row_stats(x, dim))
    if stats:
        # The plan holds the statistics' shape (an int for one batch dim: the cheapest allocation call).
        row_max = x.new_empty(plan.stats_shape, dtype=torch.float32)
        row_sum = x.new_empty(plan.stats_shape, dtype=torch.float32)
        if (row_max.data_ptr() | row_sum.data_ptr()) & 15:
            # The plan's kernel is specialized for aligned statistics (which fresh allocations always are).
            return _forward_general(kind, x, dim, scale, scale_tensor, mask, out, row_max, row_sum)
    # The plan's launch with this call's tensors: the argument list _forward_general would build.
    plan.launch(x, out, x if mask is None else mask.view(torch.uint8),
                x if scale_tensor is None else scale_tensor,
                row_max if stats else out, row_sum if stats else out, *plan.scalars,
                1.0 if scale is None or scale_tensor is not None else float(scale))
    return (out, row_max, row_sum) if stats else (out, None, None)


def _new_row_stats(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch_shape = x.shape[:dim] + x.shape[dim + 1:]
    return x.new_empty(batch_shape, dtype=torch.float32), x.new_empty(batch_shape, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------
# Launch plans: per call signature, everything the rows path decides from shapes, strides, dtypes and
# pointer alignment (the row view, the config, the grid, the constexprs, the scalar arguments) is computed
# once; a repeated call does one dict lookup and launches. The key holds everything that decides the
# launch, including the 16-byte alignment of every pointer Triton specializes on, so the cached launch is
# the one the general path would make (same kernel, same arguments, same bits). Long rows and layouts that
# need copies take the general path every call.
# ---------------------------------------------------------------------------------------------------

_FORWARD, _BACKWARD = 0, 1
_GENERAL = object()  # a plan meaning: this signature takes the general path
_PLAN_LIMIT = 4096
_plan_tables: dict = {}


def _settings() -> tuple:
    """What plans depend on besides their key; benchmarks replace these module attributes to sweep them."""
    return (rows_config, ROW_RESIDENT_MAX_COLS, ROW_RESIDENT_MAX_COLS_FWD, ROWS_FWD, ROWS_BWD,
            ROWS_BWD_PERSIST, ROWS_BWD_STAGES, ROWS_BWD_PERSIST_PER_SM, _config.fp_fusion, kernels())


def _plans(direction: int) -> dict:
    table = _plan_tables.get(direction)
    settings = _settings()
    # Tuple equality compares identity first, then value: a replaced table with other values drops the plans.
    if table is None or table[0] != settings:
        table = _plan_tables[direction] = (settings, {})
    return table[1]


def _remember(direction: int, key, plan):
    table = _plans(direction)
    if len(table) >= _PLAN_LIMIT:
        table.clear()
    table[key] = plan
    return plan


def clear_plans() -> None:
    """Forget every cached launch plan (for code that mutates the tuning tables in place)."""
    _plan_tables.clear()


@dataclass(frozen=True)
class _RowsPlan:
    launch: KernelLaunch
    scalars: tuple
    n_rows: int
    stats_shape: int | tuple = ()  # the forward's row statistics: x's shape without dim


def _stats_shape(x: torch.Tensor, dim: int) -> int | tuple:
    batch = tuple(x.shape[:dim] + x.shape[dim + 1:])
    return batch[0] if len(batch) == 1 else batch


def _forward_plan(kind, x, dim, scale, scale_tensor, mask, out, stats=True):
    """The rows-path launch of :func:`_forward_general` for this signature (without the row statistics'
    stores unless ``stats``), or ``_GENERAL``."""
    if x.shape[dim] == 0:
        return _GENERAL
    mask_u8 = mask.view(torch.uint8) if mask is not None else None
    rows, t = _layout(x.shape, dim, {"x": x, "out": out if kind != 2 else None, "mask": mask_u8})
    if t["x"] is not x or (kind != 2 and t["out"] is not out) or t["mask"] is not mask_u8:
        return _GENERAL  # copies: the general path makes them every call
    cfg = rows_config(rows.n_cols, x.element_size())
    if cfg is None:
        return _GENERAL
    al = _aligns(rows, {"x": x, "out": t["out"], "mask": mask_u8})
    scale_mode = _scale_args(scale, scale_tensor, x)[0]
    _, B1, B2 = rows.sizes
    kwargs = dict(KIND=kind, SCALE_MODE=scale_mode, HAS_MASK=mask is not None, WIDE=_wide(rows), **al,
                  ROW_DIMS=_row_dims(rows), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STATS=stats,
                  **_launch_options(cfg))
    grid = cfg.grid(rows.n_rows, x.device)
    scalars = (rows.n_rows, rows.n_cols, B1, B2, *rows.args("x"), *rows.args("out"), *rows.args("mask"))
    return _RowsPlan(KernelLaunch(kernels().softmax_fwd_rows_kernel, grid, kwargs), scalars, rows.n_rows,
                     _stats_shape(x, dim))


def _backward_plan(kind, grad, x, dim, scale, scale_tensor, mask, dx, row_max, row_sum):
    """The rows-path launch of :func:`_backward_general` for this signature, or ``_GENERAL``."""
    mask_u8 = mask.view(torch.uint8) if mask is not None else None
    grad_in = None if kind == 2 else grad
    rows, t = _layout(x.shape, dim, {"x": x, "dx": dx, "mask": mask_u8, "grad": grad_in})
    if t["x"] is not x or t["dx"] is not dx or t["mask"] is not mask_u8 or t["grad"] is not grad_in:
        return _GENERAL
    cfg = rows_config(rows.n_cols, x.element_size(), backward=True)
    if cfg is None:
        return _GENERAL
    al = _aligns(rows, {"x": x, "dx": dx, "mask": mask_u8, "grad": grad_in})
    scale_mode = _scale_args(scale, scale_tensor, x)[0]
    _, B1, B2 = rows.sizes
    # NEED_DSCALE whenever there is a scale tensor: see _backward_general.
    kwargs = dict(KIND=kind, SCALE_MODE=scale_mode, HAS_MASK=mask is not None, NEED_DSCALE=scale_mode == 2,
                  WIDE=_wide(rows), **al, ROW_DIMS=_row_dims(rows), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  STAGES=cfg.stages, **_launch_options(cfg))
    grid = cfg.grid(rows.n_rows, x.device)
    scalars = (rows.n_rows, rows.n_cols, B1, B2,
               *rows.args("grad"), *rows.args("x"), *rows.args("dx"), *rows.args("mask"))
    return _RowsPlan(KernelLaunch(kernels().softmax_bwd_rows_kernel, grid, kwargs), scalars, rows.n_rows)


def _forward_general(kind, x, dim, scale, scale_tensor, mask, out, row_max, row_sum):
    """Every forward launch, deciding everything from scratch (long rows, copies, first calls)."""
    k = kernels()
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
    out_ = t["out"] if kind != 2 else out
    al = _aligns(rows, {"x": x_, "out": t["out"], "mask": mask_})
    scale_mode, scale_ptr, scale_value = _scale_args(scale, scale_tensor, x_)
    mask_arg = mask_ if mask_ is not None else x_
    _, B1, B2 = rows.sizes
    elem = x.element_size()
    cfg = rows_config(rows.n_cols, elem)
    if cfg is not None:
        grid = cfg.grid(rows.n_rows, x.device)
        k.softmax_fwd_rows_kernel[grid](
            x_, out_, mask_arg, scale_ptr, row_max, row_sum,
            rows.n_rows, rows.n_cols, B1, B2,
            *rows.args("x"), *rows.args("out"), *rows.args("mask"),
            scale_value,
            KIND=kind, SCALE_MODE=scale_mode, HAS_MASK=mask_ is not None, WIDE=_wide(rows), **al,
            ROW_DIMS=_row_dims(rows), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            **_launch_options(cfg),
        )
        _write_back(out, out_)
        return out, row_max, row_sum

    sc = split_config(rows.n_cols, elem)
    ws_max = x.new_empty((rows.n_rows * sc.n_splits,), dtype=torch.float32)
    ws_sum = torch.empty_like(ws_max)
    common = dict(KIND=kind, SCALE_MODE=scale_mode, HAS_MASK=mask_ is not None, WIDE=_wide(rows), **al,
                  SPLITS=triton.next_power_of_2(sc.n_splits), BLOCK_N=sc.block_n)
    grid = (rows.n_rows * sc.n_splits,)
    k.softmax_fwd_partial_kernel[grid](
        x_, mask_arg, scale_ptr, ws_max, ws_sum,
        rows.n_cols, B1, B2,
        *rows.args("x"), *rows.args("mask"),
        scale_value, sc.n_splits, sc.cols_per_split,
        SCALE_MODE=scale_mode, HAS_MASK=mask_ is not None, WIDE=common["WIDE"], BLOCK_N=sc.block_n,
        XA=al["XA"], MA=al["MA"], LSE=kind == 2, **_launch_options(sc),
    )
    k.softmax_fwd_finish_kernel[grid](
        x_, out_, mask_arg, scale_ptr, ws_max, ws_sum, row_max, row_sum,
        rows.n_cols, B1, B2,
        *rows.args("x"), *rows.args("out"), *rows.args("mask"),
        scale_value, sc.n_splits, sc.cols_per_split,
        **common, **_launch_options(sc),
    )
    _write_back(out, out_)
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
    dscale_placeholder: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dscale)``; ``dscale`` is a zero when no scale gradient is wanted, or None with
    ``dscale_placeholder=False``."""
    if not x.is_cuda:
        _check_device(x)
    dx = torch.empty_like(x)
    need_dscale = bool(need_dscale and scale_tensor is not None)
    if x.numel() == 0:
        return dx, x.new_zeros((), dtype=torch.float32) if need_dscale or dscale_placeholder else None
    # Returned as is only without need_dscale (both paths below replace it by the rows' sum otherwise).
    dscale = x.new_zeros((), dtype=torch.float32) if dscale_placeholder and not need_dscale else None
    row_max = row_max.contiguous()
    row_sum = row_sum.contiguous()
    if kind == 2:
        grad = grad.contiguous()
    # grad.dtype: the incoming gradient has the forward output's dtype, which need not be x's (dtype=...);
    # a kernel compiled for one pointer type must never be launched with another (reads garbage).
    # row_max / row_sum: their dtypes too (fp32 from the forward; the op does not check them).
    key = (kind, dim, x.shape, x.stride(), x.dtype, x.get_device(), grad.stride(), grad.dtype, dx.dtype,
           row_max.dtype, row_sum.dtype, None if mask is None else (mask.stride(), mask.dtype),
           0 if scale_tensor is None else scale_tensor.dtype,
           scale is None, alignment_bits(grad, x, dx, mask, scale_tensor, row_max, row_sum))
    plan = _plans(_BACKWARD).get(key)
    if plan is None:
        plan = _remember(_BACKWARD, key, _backward_plan(kind, grad, x, dim, scale, scale_tensor, mask, dx,
                                                         row_max, row_sum))
    if plan is _GENERAL:
        return _backward_general(kind, grad, x, row_max, row_sum, dim, scale, scale_tensor, mask, need_dscale,
                                 dx, dscale)
    # Without a scale tensor the kernel never touches dscale_ptr (NEED_DSCALE off): row_max stands in for
    # it (same dtype; its alignment is in the key, and an aligned pointer keeps the plan's launch), one
    # allocation fewer per call.
    if scale_tensor is None and row_max.data_ptr() % 16 == 0:
        dscale_rows = row_max
    elif scale_tensor is None:
        dscale_rows = x.new_empty((1,), dtype=torch.float32)
    else:
        dscale_rows = x.new_empty((plan.n_rows,), dtype=torch.float32)
    if dscale_rows.data_ptr() % 16:
        return _backward_general(kind, grad, x, row_max, row_sum, dim, scale, scale_tensor, mask, need_dscale,
                                 dx, dscale)
    plan.launch(grad, x, dx, x if mask is None else mask.view(torch.uint8),
                x if scale_tensor is None else scale_tensor, row_max, row_sum, dscale_rows, *plan.scalars,
                1.0 if scale is None or scale_tensor is not None else float(scale))
    if need_dscale:
        dscale = dscale_rows.sum()
    return dx, dscale


def _backward_general(kind, grad, x, row_max, row_sum, dim, scale, scale_tensor, mask, need_dscale, dx,
                      dscale):
    """Every backward launch, deciding everything from scratch (long rows, copies, first calls)."""
    k = kernels()
    mask_u8 = mask.view(torch.uint8) if mask is not None else None
    if kind == 2:
        grad_rows = grad.contiguous()
        rows, t = _layout(x.shape, dim, {"x": x, "dx": dx, "mask": mask_u8, "grad": None})
        t["grad"] = grad_rows
    else:
        rows, t = _layout(x.shape, dim, {"x": x, "dx": dx, "mask": mask_u8, "grad": grad})
    x_, mask_, grad_, dx_ = t["x"], t["mask"], t["grad"], t["dx"]
    al = _aligns(rows, {"x": x_, "dx": dx_, "mask": mask_, "grad": grad_ if kind != 2 else None})
    scale_mode, scale_ptr, scale_value = _scale_args(scale, scale_tensor, x_)
    mask_arg = mask_ if mask_ is not None else x_
    _, B1, B2 = rows.sizes
    need_dscale = bool(need_dscale and scale_tensor is not None)
    # With a scale tensor the kernels always compute the scale gradient's per-row terms, wanted or not:
    # whether it is wanted must not change the kernel, hence not dx's bits (contract section 6; the extra
    # reduction can change the tile layout, tests/test_softmax_layouts.py).
    dscale_terms = scale_tensor is not None
    cfg = rows_config(rows.n_cols, x.element_size(), backward=True)
    if cfg is not None:
        dscale_rows = x.new_empty((rows.n_rows if dscale_terms else 1,), dtype=torch.float32)
        grid = cfg.grid(rows.n_rows, x.device)
        k.softmax_bwd_rows_kernel[grid](
            grad_, x_, dx_, mask_arg, scale_ptr, row_max, row_sum, dscale_rows,
            rows.n_rows, rows.n_cols, B1, B2,
            *rows.args("grad"), *rows.args("x"), *rows.args("dx"), *rows.args("mask"),
            scale_value,
            KIND=kind, SCALE_MODE=scale_mode, HAS_MASK=mask_ is not None, NEED_DSCALE=dscale_terms,
            WIDE=_wide(rows), **al, ROW_DIMS=_row_dims(rows), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            STAGES=cfg.stages, **_launch_options(cfg),
        )
    else:
        dscale_rows = _backward_split(k, kind, rows, grad_, x_, dx_, mask_arg, mask_ is not None, scale_mode,
                                      scale_ptr, scale_value, row_max, row_sum, dscale_terms, al)
    _write_back(dx, dx_)
    if need_dscale:
        dscale = dscale_rows.sum()
    return dx, dscale


def _backward_split(k, kind, rows, grad_, x_, dx, mask_arg, has_mask, scale_mode, scale_ptr, scale_value,
                    row_max, row_sum, need_dscale, al) -> torch.Tensor:
    """Long-row backward; returns the per-program partials of the scale gradient."""
    _, B1, B2 = rows.sizes
    sc = split_config(rows.n_cols, x_.element_size())
    common = dict(KIND=kind, SCALE_MODE=scale_mode, HAS_MASK=has_mask, NEED_DSCALE=need_dscale,
                  WIDE=_wide(rows), **al, SPLITS=triton.next_power_of_2(sc.n_splits), BLOCK_N=sc.block_n)
    row_bytes = rows.n_cols * (x_.element_size() + grad_.element_size())
    if (kind != 2 and rows.n_cols <= LOOP_MAX_COLS_BWD.get(x_.element_size(), 0)
            and row_bytes <= LOOP_L2_BYTES_PER_SM):
        dscale_rows = x_.new_empty((rows.n_rows * sc.n_splits if need_dscale else 1,), dtype=torch.float32)
        k.softmax_bwd_loop_kernel[_loop_grid(rows.n_rows, row_bytes, x_.device)](
            grad_, x_, dx, mask_arg, scale_ptr, row_max, row_sum, dscale_rows,
            rows.n_rows, rows.n_cols, B1, B2,
            *rows.args("grad"), *rows.args("x"), *rows.args("dx"), *rows.args("mask"),
            scale_value, sc.n_splits,
            **common, num_warps=LOOP_NUM_WARPS, enable_fp_fusion=_config.fp_fusion,
        )
        return dscale_rows
    grid = (rows.n_rows * sc.n_splits,)
    ws = x_.new_empty((rows.n_rows * sc.n_splits,), dtype=torch.float32)
    dscale_rows = x_.new_empty((rows.n_rows * sc.n_splits if need_dscale else 1,), dtype=torch.float32)
    if kind != 2:
        k.softmax_bwd_partial_kernel[grid](
            grad_, x_, mask_arg, scale_ptr, row_max, row_sum, ws,
            rows.n_cols, B1, B2,
            *rows.args("grad"), *rows.args("x"), *rows.args("mask"),
            scale_value, sc.n_splits, sc.cols_per_split,
            KIND=kind, SCALE_MODE=scale_mode, HAS_MASK=has_mask, WIDE=common["WIDE"], BLOCK_N=sc.block_n,
            GA=al["GA"], XA=al["XA"], MA=al["MA"], **_launch_options(sc),
        )
    k.softmax_bwd_finish_kernel[grid](
        grad_, x_, dx, mask_arg, scale_ptr, row_max, row_sum, ws, dscale_rows,
        rows.n_cols, B1, B2,
        *rows.args("grad"), *rows.args("x"), *rows.args("dx"), *rows.args("mask"),
        scale_value, sc.n_splits, sc.cols_per_split,
        **common, **_launch_options(sc),
    )
    return dscale_rows
