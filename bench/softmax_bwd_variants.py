"""Experimental softmax / log-softmax backward kernels for short bf16 rows, checked and timed in one GPU run.

The shipped ``softmax_bwd_rows_kernel`` (safeops/kernels/softmax.py) with the launcher's ``ROWS_BWD``
config (safeops/ops/softmax_launch.py: one tile of BLOCK_M whole rows per program, no loop) reaches 3.48 /
3.70 / 3.54 / 2.65 TB/s at 256 / 1K / 4K / 16K bf16 columns against 4.3-4.4 for torch.compile and
Liger-Kernel (bench/RESULTS.md). Nsight Compute at 16K: 1,024 threads x 64 registers, one program per SM,
DRAM 47%, 14.4 cycles per issued instruction: nothing overlaps one row's load, reduction and store.

The variants below are self-contained Triton kernels cut down to the case the benchmark times: contiguous
(M, N) rows, bf16 (fp16 / fp32 under the interpreter), KIND 0 (softmax) and 1 (log-softmax), no scale, an
optional bool mask (for correctness). The numerics are the shipped ones (contract section 3): p is
recomputed from x and the saved fp32 row max and row sum with the shipped instruction sequence
(``exp(z - m_safe) * inv_l``, ``inv_l = div_rn(1, l)``, guarded empty rows), excluded entries give exactly 0,
fp32 inside, ``enable_fp_fusion=False``. What changes is the schedule:

- ``copy``: the shipped kernel specialised to this case with the shipped config (must give the shipped bits;
  its row addressing is ``row * stride``; the shipped kernel used a 3-level div/mod, 12-17% of its
  instructions, until session 6 took both this and its load order: shipped and copy now time alike; at 16K
  the shipped backward is the persistent grid, whose masked bits differ from this copy's);
- ``evict-first``: the copy with ``eviction_policy="evict_first"`` on the x / grad loads (streamed once);
- ``persist-s2`` / ``-s3`` / ``-s4``: a persistent grid (as many programs as fit) looping over row blocks
  with ``tl.range(..., num_stages=S)``. Triton 3.6 turns the loads into cp.async copies to shared memory
  (LDGSTS); with S=2 it keeps ONE buffer and drains it at the top of every iteration (no overlap of the next
  block's reads with this block's reduction), with S=3 (S=4) two (three) buffers and the next block's copies
  stay in flight during this block's reduction and store (``--compile-only`` shows both); same tile as the
  copy, so the same bits; ``persist-s3-4pm``: at most 4 programs per SM;
- ``prefetch`` / ``prefetch-4pm``: persistent, pipelined by hand: block i + nprog's x / grad / max / sum are
  loaded into registers (x, grad as bf16) before block i is reduced and stored (same tile, same bits);
- ``prefetch-w16`` (16K only): prefetch with 16 warps (32 elements per thread), room for the extra registers;
- ``half-warps``: the copy with half the warps (twice the elements per thread);
- ``w16-r64`` (16K only): 16 warps capped at 64 registers, so two programs fit per SM (spills offline);
- ``m2x``: two times BLOCK_M and two times the warps (N <= 8K);
- extras (``--variants all``): ``even`` / ``persist-s3-even`` (no column mask when N == BLOCK_N),
  ``persist-evict``, ``w16``, ``persist-w16-s3``.

Bits: every variant's dx is compared bit for bit with ``torch.ops.safeops.softmax_backward`` (the public
op, which runs the shipped kernel) on the full timed input; "same" is expected exactly when the per-row
tile layout is the shipped one (``same_bits_expected``); every variant is also checked against the float64
oracle of tests/test_softmax_gpu.py (its budget; ratio <= 1 passes) on a subset of rows, on a masked input
(first kind only; fully masked rows included; excluded entries must be exactly 0), and the persistent ones
for batch invariance: one row alone and a 5-row slice give the bits of the same rows inside the full batch.

GPU run (the lead; H200, Triton 3.6; under 3 minutes: the variant kernels compile in a process pool while
the shipped op and torch.compile compile in the main process):

    python3 bench/softmax_bwd_variants.py --out DIR [--n 256,1024,4096,16384] [--variants a,b|all]
                                          [--kinds 0,1] [--no-compile] [--workers N] [--budget-s 170]
    python3 bench/softmax_bwd_variants.py --list
    /tmp/t36/bin/python bench/softmax_bwd_variants.py --compile-only [--n ...]     (no GPU, no torch)
    TRITON_INTERPRET=1 .venv/bin/python bench/softmax_bwd_variants.py --interpret-check   (CPU, ~10 s)

M x N = 2**28 elements per shape; TB/s counts read x + read grad + write dx (3 x numel x 2 bytes, as
bench/softmax.py); "% copy" is against a device copy measured in the same run; times are the median of CUDA
events through bench/_harness.py (do_bench flushes the L2). Peers: the shipped op, and ``torch.compile`` of
``torch._softmax_backward_data`` / ``torch._log_softmax_backward_data`` (dynamic=False, per shape, as
bench/softmax.py). Writes DIR/softmax_bwd_variants.md. Notes: scratch/notes_softmax_bwd_variants.md.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import triton
import triton.language as tl

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:  # bench/ helpers (also in spawned pool workers, which import this module)
    sys.path.insert(0, str(HERE))
import _sm90  # noqa: E402

NEG_INF = tl.constexpr(float("-inf"))
TOTAL = 2**28
DEFAULT_N = (256, 1024, 4096, 16384)
# The launcher's ROWS_BWD for 2-byte elements (smallest tile, elements per thread), copied from
# safeops/ops/softmax_launch.py at the time of writing; the GPU run checks it against the launcher.
SHIPPED_TILE, SHIPPED_PER_THREAD = 1024, 16


# ------------------------------------------------------------------------------------------------------
# Kernels (triton only: this part also runs under /tmp/t36 for --compile-only, where torch is missing)
# ------------------------------------------------------------------------------------------------------


@triton.jit
def _rows_cols(blk, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    if EVEN:  # n_cols == BLOCK_N: no ragged column edge, the predicate is one per row (the same elements)
        valid = tl.broadcast_to(row_ok[:, None], [BLOCK_M, BLOCK_N])
    else:
        valid = row_ok[:, None] & (cols < n_cols)[None, :]
    return rows, cols, row_ok, valid


@triton.jit
def _ptrs(ptr, rows, cols, row_stride, ALIGN: tl.constexpr):
    # 64-bit row offsets, 32-bit column offsets, the row start's 16-byte alignment stated as the shipped
    # kernel states it (so the same vector width, hence the same per-thread element order).
    offsets = rows.to(tl.int64) * row_stride
    if ALIGN > 1:
        offsets = tl.multiple_of(offsets, ALIGN)
    return (ptr + offsets)[:, None] + cols[None, :]


@triton.jit
def _tile_load(grad_ptr, x_ptr, mask_ptr, row_max_ptr, row_sum_ptr, blk, n_rows, n_cols, row_stride,
               HAS_MASK: tl.constexpr, ALIGN: tl.constexpr, MALIGN: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, EVICT: tl.constexpr, EVEN: tl.constexpr):
    """The raw loads of one tile: x and grad in their own dtype, the mask byte, the fp32 row max / sum."""
    rows, cols, row_ok, valid = _rows_cols(blk, n_rows, n_cols, BLOCK_M, BLOCK_N, EVEN)
    if EVICT:
        xr = tl.load(_ptrs(x_ptr, rows, cols, row_stride, ALIGN), mask=valid, other=0.0,
                     eviction_policy="evict_first")
        gr = tl.load(_ptrs(grad_ptr, rows, cols, row_stride, ALIGN), mask=valid, other=0.0,
                     eviction_policy="evict_first")
    else:
        xr = tl.load(_ptrs(x_ptr, rows, cols, row_stride, ALIGN), mask=valid, other=0.0)
        gr = tl.load(_ptrs(grad_ptr, rows, cols, row_stride, ALIGN), mask=valid, other=0.0)
    if HAS_MASK:
        mk = tl.load(_ptrs(mask_ptr, rows, cols, row_stride, MALIGN), mask=valid, other=0)
    else:
        mk = 0
    m = tl.load(row_max_ptr + rows, mask=row_ok, other=0.0)
    l = tl.load(row_sum_ptr + rows, mask=row_ok, other=0.0)
    return xr, gr, mk, m, l


@triton.jit
def _tile_store(dx_ptr, xr, gr, mk, m, l, blk, n_rows, n_cols, row_stride, KIND: tl.constexpr,
                HAS_MASK: tl.constexpr, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                EVEN: tl.constexpr):
    """The shipped backward arithmetic on one loaded tile (SCALE_MODE 0), then the store of dx."""
    rows, cols, row_ok, valid = _rows_cols(blk, n_rows, n_cols, BLOCK_M, BLOCK_N, EVEN)
    x = xr.to(tl.float32)
    keep = valid
    if HAS_MASK:
        keep = keep & (mk != 0)
    z = tl.where(keep, x, NEG_INF)  # the shipped _materialize without a scale
    keep = z != NEG_INF
    m_safe = tl.where(m == NEG_INF, 0.0, m)  # _safe_max
    inv_l = tl.where(l == 0.0, 0.0, tl.math.div_rn(1.0, l))  # _inv_sum
    p = tl.exp(z - m_safe[:, None]) * inv_l[:, None]  # _probabilities
    g = gr.to(tl.float32)
    if KIND == 0:
        s = tl.sum(tl.where(keep, g * p, 0.0), 1)
        dz = p * (g - s[:, None])
    else:
        s = tl.sum(tl.where(keep, g, 0.0), 1)
        dz = g - p * s[:, None]
    dz = tl.where(keep, dz, 0.0)  # excluded entries: exactly 0
    tl.store(_ptrs(dx_ptr, rows, cols, row_stride, ALIGN), dz.to(dx_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _tile(grad_ptr, x_ptr, dx_ptr, mask_ptr, row_max_ptr, row_sum_ptr, blk, n_rows, n_cols, row_stride,
          KIND: tl.constexpr, HAS_MASK: tl.constexpr, ALIGN: tl.constexpr, MALIGN: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVICT: tl.constexpr, EVEN: tl.constexpr):
    xr, gr, mk, m, l = _tile_load(grad_ptr, x_ptr, mask_ptr, row_max_ptr, row_sum_ptr, blk, n_rows, n_cols,
                                  row_stride, HAS_MASK, ALIGN, MALIGN, BLOCK_M, BLOCK_N, EVICT, EVEN)
    _tile_store(dx_ptr, xr, gr, mk, m, l, blk, n_rows, n_cols, row_stride, KIND, HAS_MASK, ALIGN, BLOCK_M,
                BLOCK_N, EVEN)


# n_rows, the row stride and the block count are not specialised by value (as the shipped ROW_STRIDES): a
# row alone and the same row in a batch run the same compiled kernel. n_cols is specialised, as shipped.
@triton.jit(do_not_specialize=["n_rows", "row_stride", "n_blocks"])
def v_bwd_kernel(grad_ptr, x_ptr, dx_ptr, mask_ptr, row_max_ptr, row_sum_ptr,
                 n_rows, n_cols, row_stride, n_blocks,
                 KIND: tl.constexpr, HAS_MASK: tl.constexpr, ALIGN: tl.constexpr, MALIGN: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, STAGES: tl.constexpr,
                 EVICT: tl.constexpr, EVEN: tl.constexpr):
    """MODE 0: one tile per program (the shipped grid); 1: persistent, tl.range(num_stages=STAGES);
    2: persistent, the next tile loaded into registers before this one is reduced (hand pipelining).
    Every tile is BLOCK_M whole rows with the same layout whichever program handles it."""
    pid = tl.program_id(0)
    if MODE == 0:
        _tile(grad_ptr, x_ptr, dx_ptr, mask_ptr, row_max_ptr, row_sum_ptr, pid, n_rows, n_cols, row_stride,
              KIND, HAS_MASK, ALIGN, MALIGN, BLOCK_M, BLOCK_N, EVICT, EVEN)
    elif MODE == 1:
        nprog = tl.num_programs(0)
        for blk in tl.range(pid, n_blocks, nprog, num_stages=STAGES):
            _tile(grad_ptr, x_ptr, dx_ptr, mask_ptr, row_max_ptr, row_sum_ptr, blk, n_rows, n_cols,
                  row_stride, KIND, HAS_MASK, ALIGN, MALIGN, BLOCK_M, BLOCK_N, EVICT, EVEN)
    else:
        nprog = tl.num_programs(0)
        xr, gr, mk, m, l = _tile_load(grad_ptr, x_ptr, mask_ptr, row_max_ptr, row_sum_ptr, pid, n_rows,
                                      n_cols, row_stride, HAS_MASK, ALIGN, MALIGN, BLOCK_M, BLOCK_N, EVICT,
                                      EVEN)
        for blk in range(pid, n_blocks, nprog):
            # The next tile's loads first (rows past the end are masked off: no traffic), then this tile.
            xn, gn, mkn, mn, ln = _tile_load(grad_ptr, x_ptr, mask_ptr, row_max_ptr, row_sum_ptr, blk + nprog,
                                             n_rows, n_cols, row_stride, HAS_MASK, ALIGN, MALIGN, BLOCK_M,
                                             BLOCK_N, EVICT, EVEN)
            _tile_store(dx_ptr, xr, gr, mk, m, l, blk, n_rows, n_cols, row_stride, KIND, HAS_MASK, ALIGN,
                        BLOCK_M, BLOCK_N, EVEN)
            xr, gr, mk, m, l = xn, gn, mkn, mn, ln


# ------------------------------------------------------------------------------------------------------
# Variants
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cfg:
    block_m: int
    block_n: int
    warps: int
    mode: int = 0  # 0 one tile per program, 1 persistent tl.range pipelined, 2 persistent hand prefetch
    stages: int = 1  # mode 1: tl.range num_stages
    per_sm: int = 0  # modes 1, 2: at most this many programs per SM (0: as many as fit)
    evict: bool = False
    maxnreg: int | None = None
    even: bool = False  # no column mask (only launched when N == BLOCK_N)

    def label(self) -> str:
        extra = {0: "", 1: f" persist s{self.stages}", 2: " prefetch"}[self.mode]
        extra += f" <={self.per_sm}/SM" if self.mode and self.per_sm else ""
        extra += " evict" if self.evict else ""
        extra += " even" if self.even else ""
        extra += f" r{self.maxnreg}" if self.maxnreg else ""
        return f"({self.block_m}x{self.block_n},{self.warps}w{extra})"


def shipped_cfg(n: int) -> Cfg:
    """The launcher's rows_config(n, 2, True, backward=True) with ROWS_BWD[2] = (1024, 16)."""
    block_n = triton.next_power_of_2(max(n, 1))
    block_m = max(1, min(64, SHIPPED_TILE // block_n))
    warps = max(1, min(32, block_m * block_n // (32 * SHIPPED_PER_THREAD)))
    return Cfg(block_m, block_n, warps)


def _half_warps(n):
    c = shipped_cfg(n)
    return replace(c, warps=max(1, c.warps // 2))


def _m2x(n):
    c = shipped_cfg(n)
    return replace(c, block_m=2 * c.block_m, warps=2 * c.warps) if c.block_n <= 8192 else None


def _even(cfg, n):
    return replace(cfg, even=True) if n == cfg.block_n else None


def _only16k(cfg):
    return lambda n: cfg if triton.next_power_of_2(n) == 16384 else None


@dataclass(frozen=True)
class Variant:
    name: str
    why: str
    make: object  # n -> Cfg, or None where the variant does not run
    default: bool = True

    def cfg(self, n: int) -> Cfg | None:
        return self.make(n)


VARIANTS = [
    Variant("copy", "the shipped kernel and config specialised to contiguous bf16 rows (must give the "
            "shipped bits)", shipped_cfg),
    Variant("evict-first", "copy with evict_first on the x / grad loads", lambda n: replace(shipped_cfg(n),
                                                                                          evict=True)),
    Variant("persist-s2", "persistent grid (all that fit), tl.range num_stages=2 over row blocks",
            lambda n: replace(shipped_cfg(n), mode=1, stages=2)),
    Variant("persist-s3", "persistent grid, tl.range num_stages=3 (two cp.async buffers: the next block's "
            "copies run during this block's reduction)", lambda n: replace(shipped_cfg(n), mode=1, stages=3)),
    Variant("persist-s4", "persistent grid, tl.range num_stages=4 (three buffers)",
            lambda n: replace(shipped_cfg(n), mode=1, stages=4)),
    Variant("persist-s3-4pm", "persist-s3 with at most 4 programs per SM",
            lambda n: replace(shipped_cfg(n), mode=1, stages=3, per_sm=4)),
    Variant("prefetch", "persistent, next row block loaded into registers before this one is reduced",
            lambda n: replace(shipped_cfg(n), mode=2)),
    Variant("prefetch-4pm", "prefetch, at most 4 programs per SM", lambda n: replace(shipped_cfg(n), mode=2,
                                                                                    per_sm=4)),
    Variant("prefetch-w16", "prefetch at 16K with 16 warps (32 elements per thread: room for the prefetch)",
            _only16k(Cfg(1, 16384, 16, mode=2))),
    Variant("half-warps", "copy with half the warps (2x elements per thread)", _half_warps),
    Variant("w16-r64", "16K: 16 warps capped at 64 registers (2 programs per SM)",
            _only16k(Cfg(1, 16384, 16, maxnreg=64))),
    Variant("m2x", "2x BLOCK_M and 2x warps (N <= 8K)", _m2x),
    # Extras (--variants NAME or all):
    Variant("even", "copy without the column mask where N == BLOCK_N (offline: no fewer SASS instructions, "
            "the column predicate is already one per 8-element vector)", lambda n: _even(shipped_cfg(n), n),
            default=False),
    Variant("persist-s3-even", "persist-s3 without the column mask where N == BLOCK_N",
            lambda n: _even(replace(shipped_cfg(n), mode=1, stages=3), n), default=False),
    Variant("persist-evict", "persist-s3 with evict_first loads", lambda n: replace(shipped_cfg(n), mode=1,
                                                                                    stages=3, evict=True),
            default=False),
    Variant("w16", "16K: 16 warps (the best config of the session-2 sweep)", _only16k(Cfg(1, 16384, 16)),
            default=False),
    Variant("persist-w16-s3", "16K: persistent, 16 warps, num_stages=3", _only16k(Cfg(1, 16384, 16, mode=1,
                                                                                      stages=3)),
            default=False),
]
VARIANTS_BY_NAME = {v.name: v for v in VARIANTS}


def row_layout(cfg: Cfg, elem_bytes: int = 2) -> tuple[int, int]:
    """(warps along a row, 16-byte vectors per thread per row) of Triton's blocked layout for the tile: 8
    bf16 per vector, 32 threads along the row, the warps along the row first (as many as the row has
    256-element pieces), the rest over the rows. Observed in the TTGIR of these kernels (--compile-only):
    4 x 256 on 2 warps -> warpsPerCTA [2, 1]; 1 x 4096 on 8 warps -> [1, 8]; 2 x 4096 on 16 -> [1, 16]."""
    vec = 16 // elem_bytes
    w_cols = min(cfg.warps, max(1, cfg.block_n // (32 * vec)))
    return w_cols, max(1, cfg.block_n // (32 * vec * w_cols))


def same_bits_expected(cfg: Cfg, n: int) -> bool:
    """Each row's elements sit in the same threads and warps as in the shipped tile (the per-thread, shuffle
    and cross-warp steps of every row reduction are then the same); how tiles map to programs is free."""
    return cfg.block_n == shipped_cfg(n).block_n and row_layout(cfg) == row_layout(shipped_cfg(n))


# ------------------------------------------------------------------------------------------------------
# Launching (one function for real launches and for warm-up compiles, so both hit the same cache entry)
# ------------------------------------------------------------------------------------------------------

COMPILED: dict = {}  # (cfg, n, kind, has_mask) -> CompiledKernel of the last launch
RESIDENT: dict = {}  # (cfg, n, kind, has_mask, device) -> programs of it that fit on one SM


def _aligned(t, n: int) -> bool:
    per16 = max(1, 16 // t.dtype.itemsize)  # dtype.itemsize: real tensors and Triton's MockTensor
    return n % per16 == 0 and t.data_ptr() % 16 == 0


def kernel_args(cfg: Cfg, kind: int, grad, x, dx, mask, row_max, row_sum, n_rows: int, n_cols: int):
    """(positional args, keyword args) of v_bwd_kernel; the alignments the shipped _aligns would state."""
    per16 = max(1, 16 // x.dtype.itemsize)
    align = per16 if all(_aligned(t, n_cols) for t in (grad, x, dx)) else 1
    malign = 16 if mask is not None and _aligned(mask, n_cols) else 1
    n_blocks = triton.cdiv(n_rows, cfg.block_m)
    args = (grad, x, dx, x if mask is None else mask, row_max, row_sum, n_rows, n_cols, n_cols, n_blocks)
    kw = dict(KIND=kind, HAS_MASK=mask is not None, ALIGN=align, MALIGN=malign, BLOCK_M=cfg.block_m,
              BLOCK_N=cfg.block_n, MODE=cfg.mode, STAGES=cfg.stages, EVICT=cfg.evict, EVEN=cfg.even,
              num_warps=cfg.warps, enable_fp_fusion=False)
    if cfg.maxnreg:
        kw["maxnreg"] = cfg.maxnreg
    return args, kw


def resident_per_sm(compiled, props) -> int:
    """Programs of a compiled kernel that fit on one SM (registers, threads, shared memory), as the shipped
    softmax_launch._resident_programs counts them."""
    compiled._init_handles()
    warps = compiled.metadata.num_warps
    regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256
    by_regs = (getattr(props, "regs_per_multiprocessor", 65536) // regs_per_warp) // warps
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = smem // (compiled.metadata.shared + 1024) if compiled.metadata.shared else 32
    return max(1, min(by_regs, by_threads, by_smem, 32))


def grid_of(cfg: Cfg, n_blocks: int, n_sm: int, fit: int) -> int:
    if cfg.mode == 0:
        return n_blocks
    per_sm = min(fit, cfg.per_sm) if cfg.per_sm else fit
    return max(1, min(n_blocks, per_sm * n_sm))


def run_variant(cfg: Cfg, kind: int, grad, x, row_max, row_sum, mask=None, n_sm: int | None = None):
    """dx of the variant for contiguous (M, N) grad / x (bf16, fp16 or fp32), KIND 0 or 1."""
    import torch

    if x.dim() != 2 or not (x.is_contiguous() and grad.is_contiguous()) or grad.shape != x.shape:
        raise ValueError("x: the variants take contiguous (M, N) x and grad of one shape")
    if mask is not None and (mask.shape != x.shape or not mask.is_contiguous()):
        raise ValueError("mask: the variants take a contiguous mask of x's shape")
    n_rows, n_cols = x.shape
    if triton.next_power_of_2(n_cols) != cfg.block_n or (cfg.even and n_cols != cfg.block_n):
        raise ValueError(f"x: {n_cols} columns do not fit the tile {cfg.label()}")
    dx = torch.empty_like(x)
    mask_u8 = None if mask is None else mask.view(torch.uint8)
    args, kw = kernel_args(cfg, kind, grad, x, dx, mask_u8, row_max.contiguous(), row_sum.contiguous(),
                           n_rows, n_cols)
    n_blocks = args[-1]
    key = (cfg, n_cols, kind, mask is not None)
    fit = cfg.per_sm or 1
    if x.is_cuda and cfg.mode != 0:
        rkey = key + (x.device.index,)
        if rkey not in RESIDENT:
            props = torch.cuda.get_device_properties(x.device)
            RESIDENT[rkey] = (resident_per_sm(v_bwd_kernel.warmup(*args, grid=(1,), **kw), props),
                              props.multi_processor_count)
        fit, n_sm = RESIDENT[rkey]
    grid = (grid_of(cfg, n_blocks, n_sm or 3, fit),)
    COMPILED[key] = v_bwd_kernel[grid](*args, **kw)
    return dx


# ------------------------------------------------------------------------------------------------------
# Offline sm_90 compile (--compile-only; Triton 3.6 in /tmp/t36, no torch, no GPU)
# ------------------------------------------------------------------------------------------------------


def sass_stats(sass: str) -> dict:
    """Static SASS counts: all instructions, global loads / stores, cp.async (LDGSTS), shuffles, barriers,
    MUFU; and the loop with the most global loads or LDGSTS (a backward branch): its size and whether a
    global load (or LDGSTS) is issued in it before the first reduction shuffle (the next tile's loads run
    while this one reduces)."""
    ins = []
    for line in sass.splitlines():
        mt = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if mt:
            ins.append((int(mt.group(1), 16), mt.group(2).strip()))
    ops = [_sm90.opcode(t) for _, t in ins]

    def count(prefix, seq):
        return sum(o.startswith(prefix) for o in seq)

    st = {"sass": len(ops), "ldg": count("LDG.", ops) + ops.count("LDG"), "ldgsts": count("LDGSTS", ops),
          "stg": count("STG", ops), "shfl": count("SHFL", ops), "bar": count("BAR", ops),
          "mufu": count("MUFU", ops), "lds": count("LDS", ops), "ldg128": count("LDG.E.128", ops)
          + count("LDG.E.EF.128", ops) + count("LDG.E.EL.128", ops)}
    best = None
    for addr, text in ins:
        if "BRA" in _sm90.opcode(text):
            t = re.search(r"0x([0-9a-f]+)", text)
            if t and int(t.group(1), 16) < addr:
                body = [_sm90.opcode(x) for a, x in ins if int(t.group(1), 16) <= a <= addr]
                n_ld = count("LDG", body) + count("LDGSTS", body)
                if n_ld and (best is None or n_ld > best[0]):
                    best = (n_ld, body)
    if best is not None:
        body = best[1]
        first_shfl = next((i for i, o in enumerate(body) if o.startswith("SHFL")), len(body))
        st.update(loop=len(body), loop_ldg=count("LDG", body), loop_ldgsts=count("LDGSTS", body),
                  loads_before_reduce=sum(o.startswith(("LDG", "LDGSTS")) for o in body[:first_shfl]))
    else:
        st.update(loop=0, loop_ldg=0, loop_ldgsts=0, loads_before_reduce=0)
    return st


def _signature(fn, ce: dict, ptr_types: dict) -> tuple[dict, dict]:
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in ce:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr_types.get(name, "*fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "scale_value":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name == "n_cols":  # specialised by value at a real launch (N a multiple of 16 here)
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _stats_of(c) -> dict:
    ttgir = c.asm.get("ttgir", "")
    fma = len(re.findall(r"\bfma\.rn\.f32", c.asm["ptx"]))
    stats = {"ok": True, "shared": c.metadata.shared, "fma_ptx": fma,
             "async_ttgir": ttgir.count("async_copy_global_to_local"),
             # cp.async buffers per pipelined load (leading dim of the shared allocation) and the most
             # copy groups a wait leaves in flight: 0 means each wait drains every copy (no overlap)
             "buffers": max([int(b) for b in re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x", ttgir)]
                            or [0]),
             "wait_num": max([int(w) for w in re.findall(r"async_wait .*?\{num = (\d+)", ttgir)] or [0])}
    regs, stats["spill"], sass = _sm90.binary_stats(c)
    stats["regs"] = getattr(c, "n_regs", None) or regs
    stats.update(sass_stats(sass))
    return stats


def compile_stats(job) -> dict:
    """Compiles one (cfg, n, kind) job for sm_90 (bf16, aligned, no mask); cfg None: the shipped kernel
    safeops.kernels.softmax.softmax_bwd_rows_kernel with the shipped config, for comparison."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg, n, kind = job
    ptr_types = {"grad_ptr": "*bf16", "x_ptr": "*bf16", "dx_ptr": "*bf16", "mask_ptr": "*u8"}
    try:
        if cfg is None:
            sys.path.insert(0, str(ROOT))
            import importlib.util

            spec = importlib.util.spec_from_file_location("_shipped_softmax",
                                                          ROOT / "safeops" / "kernels" / "softmax.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            fn = mod.softmax_bwd_rows_kernel
            s = shipped_cfg(n)
            ce = dict(KIND=kind, SCALE_MODE=0, HAS_MASK=False, NEED_DSCALE=False, WIDE=False, GA=8, XA=8,
                      DA=8, MA=1, ROW_DIMS=1, STAGES=0, BLOCK_M=s.block_m, BLOCK_N=s.block_n, sgn=1, sxn=1,
                      sdn=1, smn=0)
            warps, maxnreg = s.warps, None
        else:
            fn = v_bwd_kernel
            ce = dict(KIND=kind, HAS_MASK=False, ALIGN=8, MALIGN=1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      MODE=cfg.mode, STAGES=cfg.stages, EVICT=cfg.evict, EVEN=cfg.even)
            warps, maxnreg = cfg.warps, cfg.maxnreg
        sig, attrs = _signature(fn, ce, ptr_types)
        options = {"num_warps": warps, "enable_fp_fusion": False}
        if maxnreg:
            options["maxnreg"] = maxnreg
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=options)
        return _stats_of(c)
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[-600:]}"}


def compile_jobs(variants, ns, kinds) -> list[tuple]:
    jobs = [(None, n, k) for n in ns for k in kinds]
    jobs += [(v.cfg(n), n, k) for n in ns for k in kinds for v in variants if v.cfg(n) is not None]
    return list(dict.fromkeys(jobs))


def compile_only(variants, ns, kinds, workers: int) -> int:
    from concurrent.futures import ProcessPoolExecutor

    jobs = compile_jobs(variants, ns, kinds)
    names: dict = {}
    for v in variants:
        for n in ns:
            if v.cfg(n) is not None:
                names.setdefault((v.cfg(n), n), []).append(v.name)
    print(f"triton {triton.__version__}: compiling {len(jobs)} kernels for sm_90 on {workers} processes",
          flush=True)
    with ProcessPoolExecutor(workers) as pool:
        results = list(pool.map(compile_stats, jobs))
    print("| N | kind | variant | config | regs | spill B | smem B | SASS | LDG (128-bit) | LDGSTS | async "
          "copies (TTGIR) | STG | SHFL | BAR | loop SASS | loads in loop before 1st SHFL | pipelined |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    bad = 0
    for (cfg, n, kind), r in zip(jobs, results, strict=True):
        name = "shipped kernel" if cfg is None else "/".join(names.get((cfg, n), ["?"]))
        label = shipped_cfg(n).label() if cfg is None else cfg.label()
        if not r["ok"]:
            bad += 1
            print(f"| {n} | {kind} | {name} | {label} | FAILED: {r['error']} |")
            continue
        mode = 0 if cfg is None else cfg.mode
        if mode == 1:
            piped = (f"cp.async, {r['buffers']} buffer(s), waits leave {r['wait_num']} groups in flight: "
                     + ("overlaps" if r["wait_num"] else "NO overlap with the reduction")
                     if r["ldgsts"] or r["async_ttgir"] else "NO")
        elif mode == 2:
            piped = "by hand" if r["loads_before_reduce"] else "NO"
        else:
            piped = "-"
        print(f"| {n} | {kind} | {name} | {label} | {r['regs']} | {r['spill']} | {r['shared']} | {r['sass']} "
              f"| {r['ldg']} ({r['ldg128']}) | {r['ldgsts']} | {r['async_ttgir']} | {r['stg']} | {r['shfl']} "
              f"| {r['bar']} | {r['loop']} | {r['loads_before_reduce']} | {piped} |", flush=True)
        bad += r["fma_ptx"] > 0
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------------------
# Checks shared by the GPU run and the CPU interpreter check
# ------------------------------------------------------------------------------------------------------

OPS = {0: "softmax", 1: "log_softmax"}


def gpu_oracle():
    """tests/test_softmax_gpu.py imported by path: its float64 oracle and error budget."""
    import importlib.util

    name = "test_softmax_gpu"
    if name not in sys.modules:
        sys.path.insert(0, str(ROOT / "tests"))
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def oracle_ratio(kind: int, x, g, dx, mask=None) -> float:
    """Largest |dx - oracle| / allowed over the rows given (the tolerance of assert_matches in
    tests/test_softmax_gpu.py: OUT_ULPS ulps of the dtype + the fp32 backward budget + the flush floor);
    inf when NaN / inf differ. <= 1 passes."""
    import torch

    T = gpu_oracle()
    op = OPS[kind]
    z = T.oracle_z(x, None, mask)
    _, st = T.oracle_forward(op, z, 1)
    ref = T.oracle_backward(op, st, z, g)
    budget = T.backward_budget(op, st, z, g, ref)
    o = dx.double()
    if (torch.isnan(o) != torch.isnan(ref)).any() or (torch.isinf(ref) & (o != ref)).any():
        return math.inf
    finite = torch.isfinite(ref)
    err = torch.where(finite, (o - ref).abs(), torch.zeros_like(o))
    tol = T.ulp(ref, dx.dtype) * T.OUT_ULPS[dx.dtype] + budget + T.FLUSH_FLOOR
    return float((err / tol).max()) if err.numel() else 0.0


def bits_equal(a, b) -> bool:
    import torch

    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def shipped_forward(x, mask=None):
    import torch

    return torch.ops.safeops.softmax(x=x, dim=1, scale=None, scale_tensor=None, mask=mask, out_dtype=None)


def shipped_backward(kind: int, g, x, row_max, row_sum, mask=None):
    import torch

    return torch.ops.safeops.softmax_backward(grad=g, x=x, row_max=row_max, row_sum=row_sum, dim=1, kind=kind,
                                              scale=None, scale_tensor=None, mask=mask, need_dscale=False)[0]


def masked_inputs(m: int, n: int, dtype, device, gen):
    """x, g and a mask with a fully masked row, a row with one kept entry and random rows; x holds NaN and
    -inf at some masked positions (they must not reach the row) and -inf at one kept position."""
    import torch

    x = (torch.randn(m, n, device=device, generator=gen) * 3.0).to(dtype)
    g = torch.randn(m, n, device=device, generator=gen).to(dtype)
    mask = torch.rand(m, n, device=device, generator=gen) < 0.7
    mask[0] = False
    if m > 1:
        mask[1] = False
        mask[1, n // 2] = True
    if m > 2:
        x[2, 0] = float("-inf")
        mask[2, 0] = True
    x = torch.where(mask | (torch.rand(m, n, device=device, generator=gen) < 0.5), x,
                    torch.full((), float("nan"), dtype=dtype, device=device))
    return x, g, mask


def check_variant(cfg: Cfg, kind: int, x, g, row_max, row_sum, ref_dx, rows_for_oracle, mask_case,
                  persistent_checks: bool, n_sm=None) -> dict:
    """Bits vs the shipped dx, oracle ratio on the given rows, the masked case (bits vs shipped, oracle,
    excluded entries exactly 0) and, for the persistent modes, batch invariance (one row alone and a 5-row
    slice against the same rows of the full batch). Returns a dict of results."""
    dx = run_variant(cfg, kind, g, x, row_max, row_sum, n_sm=n_sm)
    res = {"same": bits_equal(dx, ref_dx)}
    sl = rows_for_oracle
    res["oracle"] = oracle_ratio(kind, x[sl], g[sl], dx[sl])
    if persistent_checks:
        m = x.shape[0]
        ok = True
        for lo, hi in ((m // 2, m // 2 + 1), (max(0, m - 7), max(0, m - 7) + min(5, m))):
            # Fresh (aligned) copies: the same compiled kernel as the batch, as in a real separate call.
            part = run_variant(cfg, kind, g[lo:hi].clone(), x[lo:hi].clone(), row_max[lo:hi].clone(),
                               row_sum[lo:hi].clone(), n_sm=n_sm)
            ok = ok and bits_equal(part, dx[lo:hi])
        res["batch_invariant"] = ok
    del dx
    if mask_case is not None:
        mx, mg, mmask, mm, ml, mref = mask_case
        try:
            mdx = run_variant(cfg, kind, mg, mx, mm, ml, mask=mmask, n_sm=n_sm)
        except Exception as e:  # e.g. the masked build of a deep pipeline needs more shared memory
            res["masked_error"] = f"{type(e).__name__}: {str(e)[:120]}"
            return res
        zero = bool((mdx[~mmask] == 0).all()) and bool((mdx[0] == 0).all())
        res["masked"] = (bits_equal(mdx, mref), oracle_ratio(kind, mx, mg, mdx, mmask), zero)
    return res


def verdict(res: dict, want_same: bool) -> tuple[str, str, bool]:
    """(bits cell, masked cell, passed)."""
    bit = ("same" if res["same"] else "DIFF") + ("" if res["same"] == want_same else " (unexpected)")
    ok = res["oracle"] <= 1.0 and (res["same"] or not want_same) and res.get("batch_invariant", True)
    mcell = "-" if "masked_error" not in res else "n/a: " + res["masked_error"][:60]
    if "masked" in res:
        same, ratio, zero = res["masked"]
        mcell = f"{'same' if same else 'DIFF'} {ratio:.2f}{'' if zero else ' NONZERO'}"
        ok = ok and ratio <= 1.0 and zero and (same or not want_same)
    return bit, mcell, ok


# ------------------------------------------------------------------------------------------------------
# CPU self-check under Triton's interpreter (--interpret-check)
# ------------------------------------------------------------------------------------------------------


def small_cfg(var: Variant, n: int) -> Cfg | None:
    """The variant's config at a small interpreter N; a variant that only runs at the big shapes (16K) takes
    its config there with BLOCK_N cut to N (warps mean nothing to the interpreter; modes and stages stay)."""
    cfg = var.cfg(n)
    if cfg is not None:
        return cfg
    for big in DEFAULT_N[::-1]:
        cfg = var.cfg(big)
        if cfg is not None:
            bn = triton.next_power_of_2(n)
            return None if cfg.even and bn != n else replace(cfg, block_n=bn)
    return None


def interpret_check(variants, ns=(64, 200), dtypes=("float32", "float16"), kinds=(0, 1)) -> list[str]:
    """Every variant under the interpreter against the float64 oracle and, for ``copy``, bit for bit against
    safeops' interpreted shipped backward; the persistent ones also for batch invariance and with more row
    blocks than programs (2 fake SMs, 4 row blocks of the shipped tile); a masked case for each. Under the
    interpreter every reduction is numpy's, row by row, whatever the tile: every variant must give the
    shipped bits here (the GPU run is where layouts can differ). Returns the failures (empty: all passed)."""
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("--interpret-check: set TRITON_INTERPRET=1 before triton is imported")
    os.environ.setdefault("SAFEOPS_BACKEND", "triton")
    import safeops  # noqa: F401

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    failures = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for n in ns:
            m = 3 * shipped_cfg(n).block_m + 1
            x = (torch.randn(m, n, generator=gen) * 4.0).to(dtype)
            g = torch.randn(m, n, generator=gen).to(dtype)
            _, row_max, row_sum = shipped_forward(x)
            mx, mg, mmask = masked_inputs(5, n, dtype, "cpu", gen)
            _, mm, ml = shipped_forward(mx, mmask)
            for kind in kinds:
                ref = shipped_backward(kind, g, x, row_max, row_sum)
                mref = shipped_backward(kind, mg, mx, mm, ml, mmask)
                for var in variants:
                    cfg = small_cfg(var, n)
                    if cfg is None:
                        continue
                    res = check_variant(cfg, kind, x, g, row_max, row_sum, ref, slice(0, m),
                                        (mx, mg, mmask, mm, ml, mref), cfg.mode != 0, n_sm=2)
                    bit, mcell, ok = verdict(res, True)
                    tag = f"{dtype_name} N={n} kind={kind}"
                    inv = res.get("batch_invariant", "-")
                    print(f"interp {tag} {var.name:15s} {cfg.label():34s} oracle {res['oracle']:.3f} "
                          f"bits {bit} masked {mcell} batch-inv {inv}", flush=True)
                    if not ok:
                        failures.append(f"{var.name} {tag}: {res}")
    return failures


# ------------------------------------------------------------------------------------------------------
# GPU run
# ------------------------------------------------------------------------------------------------------


def _warm_job(job):
    """Process-pool worker: compile one kernel into Triton's cache for this GPU (nothing is launched);
    MockTensor stands in for the (16-byte aligned) tensors, so the cache key equals the timed launch's."""
    import torch
    from triton.runtime.jit import MockTensor

    cfg, n, kind, has_mask = job
    try:
        b, f = MockTensor(torch.bfloat16), MockTensor(torch.float32)
        mk = MockTensor(torch.uint8) if has_mask else None
        args, kw = kernel_args(cfg, kind, b, b, b, mk, f, f, 4096, n)
        v_bwd_kernel.warmup(*args, grid=(1,), **kw)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[-300:]}"


def _kernel_info(compiled) -> str:
    try:
        compiled._init_handles()
        return f"{compiled.n_regs}/{compiled.n_spills}/{compiled.metadata.shared}"
    except Exception as e:
        return f"(no metadata: {type(e).__name__})"


def _compiled_peer(kind: int, shape):
    import torch

    torch._dynamo.reset()
    if kind == 0:
        def fn(dy, y):
            return torch._softmax_backward_data(dy, y, 1, y.dtype)
    else:
        def fn(dy, y):
            return torch._log_softmax_backward_data(dy, y, 1, y.dtype)
    return torch.compile(fn, dynamic=False, fullgraph=True)


def gpu_shape(n: int, kinds, variants, args, H, gen, rows: list, wait_pool, device="cuda", dtype=None,
              m=None) -> None:
    """Checks and times the shipped op, torch.compile and every variant at one row length (M = 2**28 / N).
    A CPU dry run (tests/test_softmax_bwd_variants.py) passes device "cpu" and a small M."""
    import torch

    dtype = dtype or torch.bfloat16
    m = m or TOTAL // n
    nbytes = 3 * m * n * dtype.itemsize
    x = torch.randn(m, n, device=device, generator=gen).to(dtype)
    g = torch.randn(m, n, device=device, generator=gen).to(dtype)
    _, row_max, row_sum = shipped_forward(x)
    mx, mg, mmask = masked_inputs(64, n, dtype, device, gen)
    _, mm, ml = shipped_forward(mx, mmask)
    sub = slice(0, max(2, min(m, 2**20 // n)))  # oracle rows: about 1M elements

    def tb(ms):
        return nbytes / (ms * 1e-3) / 1e12

    for kind in kinds:
        ref = shipped_backward(kind, g, x, row_max, row_sum)
        # The masked case for the first kind only (each masked build is one more compile).
        masked = None
        if kind == kinds[0]:
            masked = (mx, mg, mmask, mm, ml, shipped_backward(kind, mg, mx, mm, ml, mmask))
        ratio = oracle_ratio(kind, x[sub], g[sub], ref[sub])
        ms = H.bench_ms(lambda kind=kind: shipped_backward(kind, g, x, row_max, row_sum), args.warmup_ms,
                        args.rep_ms)[0]
        rows.append((n, kind, "safeops (shipped)", ms, tb(ms), "ref", ratio, "-", "-", "", ""))
        print(f"N={n} kind={kind}: shipped {ms * 1e3:.1f} us {tb(ms):.2f} TB/s oracle {ratio:.3f}",
              flush=True)
        if not args.no_compile:
            try:
                y = torch.softmax(x, 1) if kind == 0 else torch.log_softmax(x, 1)
                fn = _compiled_peer(kind, x.shape)
                fn(g, y)
                ms = H.bench_ms(lambda fn=fn, y=y: fn(g, y), args.warmup_ms, args.rep_ms)[0]
                rows.append((n, kind, "torch.compile", ms, tb(ms), "-", math.nan, "-", "-", "", ""))
                print(f"N={n} kind={kind}: torch.compile {ms * 1e3:.1f} us {tb(ms):.2f} TB/s", flush=True)
                del y, fn
            except Exception as e:
                rows.append((n, kind, "torch.compile", math.nan, math.nan, "-", math.nan, "-", "-", "",
                             f"error: {type(e).__name__}: {str(e)[:160]}"))
        wait_pool()  # the variant kernels were compiling in the pool meanwhile
        for var in variants:
            cfg = var.cfg(n)
            if cfg is None:
                continue
            want = same_bits_expected(cfg, n)
            name = f"{var.name} {cfg.label()}"
            if time.time() > getattr(args, "deadline", math.inf):
                rows.append((n, kind, name, math.nan, math.nan, "-", math.nan, "-", "-", "",
                             "skipped: time budget"))
                continue
            try:
                res = check_variant(cfg, kind, x, g, row_max, row_sum, ref, sub, masked, cfg.mode != 0)
                bit, mcell, ok = verdict(res, want)
                if device == "cuda":
                    torch.cuda.synchronize()
                ms = H.bench_ms(lambda cfg=cfg, kind=kind: run_variant(cfg, kind, g, x, row_max, row_sum),
                                args.warmup_ms, args.rep_ms)[0]
                key = (cfg, n, kind, False)
                info = _kernel_info(COMPILED.get(key))
                fit = RESIDENT.get(key + (x.device.index,))
                if fit:
                    info += f" grid {grid_of(cfg, triton.cdiv(m, cfg.block_m), fit[1], fit[0])}"
                inv = res.get("batch_invariant")
                inv = "-" if inv is None else ("yes" if inv else "NO")
                rows.append((n, kind, name, ms, tb(ms), bit, res["oracle"], inv, mcell, info,
                             "" if ok else "FAILED"))
                print(f"N={n} kind={kind}: {var.name:15s} {ms * 1e3:8.1f} us {tb(ms):5.2f} TB/s bits {bit} "
                      f"oracle {res['oracle']:.3f} batch-inv {inv} masked {mcell} {info} "
                      f"{'' if ok else 'FAILED'}", flush=True)
            except Exception as e:
                why = f"error: {type(e).__name__}: {str(e)[:160]}"
                rows.append((n, kind, name, math.nan, math.nan, "-", math.nan, "-", "-", "", why))
                print(f"N={n} kind={kind}: {var.name}: {why}", flush=True)


def gpu_main(args, variants, ns, kinds) -> int:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch

    sys.path.insert(0, str(HERE))
    import _harness as H

    H.require_cuda("bench/softmax_bwd_variants.py")
    t_start = time.time()
    args.deadline = t_start + args.budget_s
    # One compile per kernel (programs per SM is a launch choice); the masked build for the first kind only.
    jobs = [(replace(v.cfg(n), per_sm=0), n, k, hm) for n in ns for k in kinds
            for hm in ((False, True) if k == kinds[0] else (False,))
            for v in variants if v.cfg(n) is not None]
    jobs = list(dict.fromkeys(jobs))
    pool = ProcessPoolExecutor(max(1, min(args.workers or (os.cpu_count() or 1), len(jobs))),
                               mp_context=multiprocessing.get_context("spawn"))
    futures = [pool.submit(_warm_job, j) for j in jobs]
    failures: dict = {}

    def wait_pool():
        if futures:
            for j, f in zip(jobs, futures, strict=True):
                err = f.result()
                if err:
                    failures[j] = err
                    print(f"compile FAILED {j}: {err}", flush=True)
            futures.clear()
            pool.shutdown()
            print(f"precompiled {len(jobs)} variant kernels ({len(failures)} failed): "
                  f"{time.time() - t_start:.1f} s", flush=True)

    import safeops  # noqa: F401  (registers torch.ops.safeops)
    from safeops.ops import softmax_launch as L

    launcher_note = ""
    for n in ns:
        c = L.rows_config(n, 2, True, backward=True)
        s = shipped_cfg(n)
        if c is None or (c.block_m, c.block_n, c.num_warps, c.maxnreg) != (s.block_m, s.block_n, s.warps,
                                                                          None):
            launcher_note += f" N={n}: launcher {c} != copied {s.label()};"
    if launcher_note:
        print("WARNING the launcher's config changed:" + launcher_note, flush=True)
    copy_gbps = H.copy_bandwidth_gbps(2**30, 10, 60)
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps / 1000:.2f} TB/s ({time.time() - t_start:.1f} s)",
          flush=True)
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    rows: list = []  # (N, kind, impl, ms, tbps, bits, oracle, batch-inv, masked, info, note)
    for n in ns:
        gpu_shape(n, kinds, variants, args, H, gen, rows, wait_pool)
        torch.cuda.empty_cache()
    wait_pool()
    head = (f"softmax / log-softmax backward variants, bf16, M x N = 2**28, {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}, triton {triton.__version__}, copy {copy_gbps / 1000:.2f} TB/s")
    lines = table(rows, head, copy_gbps / 1000)
    if failures:
        lines += ["", "compile failures:"] + [f"  {j}: {e}" for j, e in failures.items()]
    if launcher_note:
        lines += ["", "WARNING the launcher's config changed:" + launcher_note]
    lines.append(f"\ntotal {time.time() - t_start:.0f} s")
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "softmax_bwd_variants.md").write_text(text + "\n")
    return 0


def table(rows, head: str, copy_tbps: float) -> list[str]:
    lines = [head + "; TB/s = 3 x numel x 2 B / time (read x, read grad, write dx); bits = dx vs the shipped "
             "op on the whole input; oracle = max error / allowed (tests/test_softmax_gpu.py budget, <= 1 "
             "passes); batch-inv = one row alone and a 5-row slice give the batch's bits (persistent); "
             "masked = bits vs shipped and oracle ratio on a masked input; regs/spills/smem (grid)", "",
             "| N | kind | impl | us | TB/s | % copy | bits | oracle | batch-inv | masked | "
             "regs/spills/smem | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, kind, name, ms, tbps, bit, ratio, inv, mcell, info, note in rows:
        pct = f"{100 * tbps / copy_tbps:.0f}%" if copy_tbps and tbps == tbps else "-"
        lines.append(f"| {n} | {OPS[kind]} | {name} | {ms * 1e3:.1f} | {tbps:.2f} | {pct} | {bit} "
                     f"| {ratio:.3f} | {inv} | {mcell} | {info} | {note} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default=",".join(map(str, DEFAULT_N)))
    p.add_argument("--kinds", default="0,1")
    p.add_argument("--variants", default="", help="comma-separated names or 'all' (default: the defaults)")
    p.add_argument("--out", default="")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    p.add_argument("--warmup-ms", type=float, default=10.0)
    p.add_argument("--rep-ms", type=float, default=40.0)
    p.add_argument("--budget-s", type=float, default=170.0,
                   help="skip the remaining variants (still printing the table) after this many seconds")
    p.add_argument("--list", action="store_true")
    p.add_argument("--compile-only", action="store_true", help="offline sm_90 compile stats (no GPU)")
    p.add_argument("--interpret-check", action="store_true", help="CPU: oracle + bits vs the shipped path")
    args = p.parse_args(argv)
    ns = tuple(int(v) for v in args.n.split(",") if v)
    kinds = tuple(int(v) for v in args.kinds.split(",") if v)
    if args.variants == "all":
        variants = VARIANTS
    else:
        variants = [VARIANTS_BY_NAME[v] for v in args.variants.split(",") if v]
        variants = variants or [v for v in VARIANTS if v.default]
    if args.list:
        for var in VARIANTS:
            cfgs = "; ".join(f"{n}: {var.cfg(n).label()}" for n in DEFAULT_N if var.cfg(n) is not None)
            print(f"{var.name:15s} {cfgs}{'' if var.default else '  [extra]'}\n{'':15s} {var.why}")
        return 0
    if args.compile_only:
        return compile_only(variants, ns, kinds, args.workers or os.cpu_count() or 1)
    if args.interpret_check:
        failures = interpret_check(variants)
        print("interpret check:", "all passed" if not failures else "FAILED: " + "; ".join(failures))
        return 1 if failures else 0
    return gpu_main(args, variants, ns, kinds)


if __name__ == "__main__":
    # Run through the module name, so the process-pool workers (spawn) and this process define the kernel
    # in the same module (Triton's cache key) and pickle jobs by the same class names.
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    import softmax_bwd_variants

    sys.exit(softmax_bwd_variants.main())
