"""Experimental "looped" softmax / log-softmax kernels for long bf16 rows (32K-256K columns), forward and
backward, checked and timed in one GPU run.

Rows longer than ``ROW_RESIDENT_MAX_COLS`` (16K; the forward keeps up to 32K resident since session 7) take
the shipped split path (safeops/ops/softmax_launch.py, two launches: ``softmax_{fwd,bwd}_partial_kernel``
writes one (max, sum) or gradient partial per 4096-column block, ``softmax_{fwd,bwd}_finish_kernel``
combines a row's partials in a fixed order and writes it). Every
element is read twice from DRAM, so it tops out at 2/3 (forward) and 3/5 (backward) of copy bandwidth; an
H200 measures 55-59% from 32K to 4M columns, where torch.compile's "looped reduction" (one program per row,
a first loop over column blocks for the statistics, a second loop re-reading the row, which is still in L2)
reaches 101% of copy for the 32K bf16 backward.

The variants are that schedule with safeops' numerics: one jit kernel per direction, a row per program (the
grid is the rows, or a persistent grid of ``per_sm`` programs per SM looping over rows), two loops over
blocks of BLOCK_N columns. Pass 1 computes one partial per block exactly as the shipped partial kernel does
(forward: ``_online_step`` from (-inf, 0); backward: ``acc = 0; acc += where(keep, g * p, 0)`` (softmax) or
``where(keep, g, 0)`` (log-softmax), summed), keeps them in a vector of SPLITS = next_pow2(blocks) entries
(``ws``: in a global workspace, combined by the shipped ``_combine_partials`` itself) and combines them in
the shipped fixed order; pass 2 re-reads the row and writes it with the shipped instructions
(``_probabilities``, ``(z - m) - _log_sum(l)``, ``p * (g - s)``, ``g - p * s``, exact zeros where excluded).
The helpers are the shipped ones (safeops/kernels/softmax.py loaded by path: ``_materialize``,
``_online_step``, ``_safe_max``, ``_inv_sum``, ``_log_sum``, ``_probabilities``, ``_combine_partials``);
``enable_fp_fusion=False``. So with the shipped block (4096 bf16 / 2048 fp32 columns on 4 warps: the same
per-thread element order in every block reduction) the bits are the shipped op's ("same" expected); other
blocks or warp counts have their own order, fixed by the row length alone (deterministic and batch
invariant, "DIFF" expected). Contiguous (M, N) rows, no scale, an optional bool mask (correctness only).

Knobs: BLOCK_N, num_warps, ``per_sm`` (0: one program per row), the pass-1 / pass-2 loops' ``tl.range``
num_stages (cp.async pipelining, ``--compile-only`` shows it), eviction policies (``evict_last`` on pass-1
loads so pass 2 finds the row in L2, ``evict_first`` on pass 2), pass 2 in reverse block order (the blocks
read last are the likeliest still in L2). L2 arithmetic (50 MB): rows in flight x bytes per row must stay
well under it for pass 2 to hit, e.g. backward at 32K bf16 = 128 KB a row -> at most ~2 rows per SM; at
128K-256K even one row per SM does not fit (backward), so there the looped schedule can only win by
launching once.

Checks per variant (bf16 at full size): bits vs the shipped op on the whole input (forward: out, row max,
row sum; backward: dx), the float64 oracle of tests/test_softmax_gpu.py on ~1M elements (ratio <= 1
passes), batch invariance (one row alone and a 5-row slice give the batch's bits), a masked input (fully
masked row, one kept entry, NaN under the mask: exact zeros / -inf where the contract says).

    python3 bench/softmax_long_variants.py --out DIR [--n 32768,65536,131072,262144] [--fp32-n 32768]
        [--dirs fwd,bwd] [--kinds 0,1] [--variants a,b|all] [--no-compile] [--compile-n 32768,65536|all]
        [--no-liger] [--workers N] [--budget-s 140]
    python3 bench/softmax_long_variants.py --list
    /tmp/t36/bin/python bench/softmax_long_variants.py --compile-only [--n ...]     (no GPU, no torch)
    TRITON_INTERPRET=1 .venv/bin/python bench/softmax_long_variants.py --interpret-check   (CPU)

M x N = 2**28 elements per shape; TB/s counts 2 (forward: read x, write out) or 3 (backward: read x, grad,
write dx) x numel x element bytes; "% copy" against a device copy measured in the same run; medians of CUDA
events (bench/_harness.py). Peers: the shipped op, torch.compile (softmax / log_softmax, and
``torch._{,log_}softmax_backward_data``, dynamic=False) and Liger-Kernel's softmax when installed (it has
no log-softmax and refuses rows over 65,536). Writes DIR/softmax_long_variants.md.
Notes: scratch/notes_softmax_long.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
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
import softmax_bwd_variants as BV  # noqa: E402  (sass statistics, oracle import, bit comparison, inputs)


def _shipped_kernels():
    """safeops/kernels/softmax.py by path (triton only, so --compile-only needs no torch): its jit helpers
    are called from the kernels below, so they run the shipped instruction sequences."""
    name = "_safeops_softmax_kernels_bypath"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "safeops" / "kernels" / "softmax.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


SK = _shipped_kernels()
NEG_INF = tl.constexpr(float("-inf"))
TOTAL = 2**28
DEFAULT_N = (32768, 65536, 131072, 262144)
DIRS = ("fwd", "bwd")
OPS = {0: "softmax", 1: "log_softmax"}
# The launcher's split block (SPLIT_BLOCK_N) and warps (SPLIT_NUM_WARPS) by element size, copied from
# safeops/ops/softmax_launch.py at the time of writing; the GPU run and a CPU test compare them.
SHIPPED_BLOCK = {2: 4096, 4: 2048}
SHIPPED_WARPS = 4
EVICT = {0: "", 1: "evict_last", 2: "evict_first"}


# ------------------------------------------------------------------------------------------------------
# Kernels (triton only)
# ------------------------------------------------------------------------------------------------------


@triton.jit
def _row_ptr(ptr, row, row_stride, ALIGN: tl.constexpr):
    # 64-bit row offset with the 16-byte alignment stated as the shipped _row_offsets states it (same
    # vector width, hence the same per-thread element order as the shipped block reductions).
    offset = tl.cast(row, tl.int64) * row_stride  # tl.cast: row is a Python int under the interpreter
    if ALIGN > 1:
        offset = tl.multiple_of(offset, ALIGN)
    return ptr + offset


@triton.jit
def _load(ptrs, valid, other, EV: tl.constexpr):
    if EV == 1:
        v = tl.load(ptrs, mask=valid, other=other, eviction_policy="evict_last")
    elif EV == 2:
        v = tl.load(ptrs, mask=valid, other=other, eviction_policy="evict_first")
    else:
        v = tl.load(ptrs, mask=valid, other=other)
    return v


@triton.jit
def _z_of(x_row, m_row, cols, valid, EV: tl.constexpr, HAS_MASK: tl.constexpr):
    """The shipped _logits (no scale) with a chosen eviction policy: z = where(keep, fp32(x), -inf)."""
    x = _load(x_row + cols, valid, 0.0, EV).to(tl.float32)
    keep = valid
    if HAS_MASK:
        keep = keep & (_load(m_row + cols, valid, 0, EV) != 0)
    return SK._materialize(x, keep, 1.0, 0)


@triton.jit
def _block(j, n_blk, REVERSE: tl.constexpr):
    if REVERSE:
        b = n_blk - 1 - j
    else:
        b = j
    return b


# n_rows and the row stride are not specialised by value (as the shipped ROW_STRIDES): a row alone and the
# same row in a batch run the same compiled kernel. n_cols is specialised (divisibility), as shipped.
@triton.jit(do_not_specialize=["n_rows", "row_stride"])
def v_fwd_kernel(x_ptr, out_ptr, mask_ptr, row_max_ptr, row_sum_ptr, ws_max_ptr, ws_sum_ptr,
                 n_rows, n_cols, row_stride,
                 KIND: tl.constexpr, HAS_MASK: tl.constexpr, ALIGN: tl.constexpr, MALIGN: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                 EV1: tl.constexpr, EV2: tl.constexpr, REVERSE: tl.constexpr, WS: tl.constexpr):
    """Rows pid, pid + nprog, ...: pass 1 one (max, sum) partial per BLOCK_N block, combined in the shipped
    fixed order; pass 2 re-reads the row and writes softmax (KIND 0) or log-softmax (KIND 1)."""
    lanes = tl.arange(0, BLOCK_N)
    idx = tl.arange(0, SPLITS)
    n_blk = tl.cdiv(n_cols, BLOCK_N)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0), num_stages=1):
        x_row = _row_ptr(x_ptr, row, row_stride, ALIGN)
        m_row = _row_ptr(mask_ptr, row, row_stride, MALIGN)
        ws = tl.cast(row, tl.int64) * n_blk
        pm = tl.full([SPLITS], NEG_INF, tl.float32)
        ps = tl.zeros([SPLITS], tl.float32)
        for j in tl.range(0, n_blk, num_stages=S1):
            cols = j * BLOCK_N + lanes
            z = _z_of(x_row, m_row, cols, cols < n_cols, EV1, HAS_MASK)
            m_b, l_b = SK._online_step(tl.full((), NEG_INF, tl.float32), tl.zeros((), tl.float32), z)
            if WS:
                tl.store(ws_max_ptr + ws + j, m_b)
                tl.store(ws_sum_ptr + ws + j, l_b)
            else:
                pm = tl.where(idx == j, m_b, pm)
                ps = tl.where(idx == j, l_b, ps)
        if WS:
            # The partials one thread stored, visible to every thread of the program; read around L1 (as the
            # shipped one-launch kernel reads partials).
            tl.debug_barrier()
            m, l = SK._combine_partials(ws_max_ptr, ws_sum_ptr, ws, n_blk, SPLITS, True)
        else:
            # _combine_partials on the register vector (entries past n_blk: -inf and 0, as its masked load)
            m = tl.max(pm, 0)
            l = tl.sum(tl.where(idx < n_blk, ps * tl.exp(pm - SK._safe_max(m)), 0.0), 0)
        tl.store(row_max_ptr + row, m)
        tl.store(row_sum_ptr + row, l)
        m_safe = SK._safe_max(m)
        inv_l = SK._inv_sum(l)
        log_l = SK._log_sum(l)
        o_row = _row_ptr(out_ptr, row, row_stride, ALIGN)
        for j in tl.range(0, n_blk, num_stages=S2):
            cols = _block(j, n_blk, REVERSE) * BLOCK_N + lanes
            valid = cols < n_cols
            z = _z_of(x_row, m_row, cols, valid, EV2, HAS_MASK)
            if KIND == 0:
                out = SK._probabilities(z, m_safe, inv_l)
            else:
                out = tl.where(l == 0.0, NEG_INF, (z - m_safe) - log_l)
            tl.store(o_row + cols, out.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit(do_not_specialize=["n_rows", "row_stride"])
def v_bwd_kernel(grad_ptr, x_ptr, dx_ptr, mask_ptr, row_max_ptr, row_sum_ptr, ws_ptr,
                 n_rows, n_cols, row_stride,
                 KIND: tl.constexpr, HAS_MASK: tl.constexpr, ALIGN: tl.constexpr, MALIGN: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                 EV1: tl.constexpr, EV2: tl.constexpr, REVERSE: tl.constexpr, WS: tl.constexpr):
    """Rows pid, pid + nprog, ...: pass 1 one partial of sum(g * p) (KIND 0) or sum(g) (KIND 1) per BLOCK_N
    block, summed in the shipped fixed order; pass 2 re-reads x and grad and writes dx."""
    lanes = tl.arange(0, BLOCK_N)
    idx = tl.arange(0, SPLITS)
    n_blk = tl.cdiv(n_cols, BLOCK_N)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0), num_stages=1):
        x_row = _row_ptr(x_ptr, row, row_stride, ALIGN)
        g_row = _row_ptr(grad_ptr, row, row_stride, ALIGN)
        m_row = _row_ptr(mask_ptr, row, row_stride, MALIGN)
        m_safe = SK._safe_max(tl.load(row_max_ptr + row))
        inv_l = SK._inv_sum(tl.load(row_sum_ptr + row))
        ws = tl.cast(row, tl.int64) * n_blk
        parts = tl.zeros([SPLITS], tl.float32)
        for j in tl.range(0, n_blk, num_stages=S1):
            cols = j * BLOCK_N + lanes
            valid = cols < n_cols
            z = _z_of(x_row, m_row, cols, valid, EV1, HAS_MASK)
            keep = z != NEG_INF
            g = _load(g_row + cols, valid, 0.0, EV1).to(tl.float32)
            acc = tl.zeros((BLOCK_N,), tl.float32)
            if KIND == 0:
                acc += tl.where(keep, g * SK._probabilities(z, m_safe, inv_l), 0.0)
            else:
                acc += tl.where(keep, g, 0.0)
            if WS:
                tl.store(ws_ptr + ws + j, tl.sum(acc, 0))
            else:
                parts = tl.where(idx == j, tl.sum(acc, 0), parts)
        if WS:
            tl.debug_barrier()
            s = tl.sum(tl.load(ws_ptr + ws + idx, mask=idx < n_blk, other=0.0, volatile=True), 0)
        else:
            s = tl.sum(parts, 0)
        d_row = _row_ptr(dx_ptr, row, row_stride, ALIGN)
        for j in tl.range(0, n_blk, num_stages=S2):
            cols = _block(j, n_blk, REVERSE) * BLOCK_N + lanes
            valid = cols < n_cols
            z = _z_of(x_row, m_row, cols, valid, EV2, HAS_MASK)
            keep = z != NEG_INF
            g = _load(g_row + cols, valid, 0.0, EV2).to(tl.float32)
            p = SK._probabilities(z, m_safe, inv_l)
            if KIND == 0:
                dz = p * (g - s)
            else:
                dz = g - p * s
            dz = tl.where(keep, dz, 0.0)  # excluded entries: exactly 0
            tl.store(d_row + cols, dz.to(dx_ptr.dtype.element_ty), mask=valid)


# ------------------------------------------------------------------------------------------------------
# Variants
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cfg:
    block_n: int
    warps: int
    per_sm: int = 0  # 0: one program per row (grid = rows); k: persistent grid of k programs per SM
    s1: int = 1  # pass-1 loop tl.range num_stages (1: not pipelined)
    s2: int = 1  # pass-2 loop
    ev1: int = 0  # pass-1 loads' eviction policy (EVICT)
    ev2: int = 0
    reverse: bool = False  # pass 2 from the last block to the first
    ws: bool = False  # partials through a global workspace and the shipped _combine_partials

    def label(self) -> str:
        size = f"{self.block_n // 1024}K" if self.block_n >= 1024 else str(self.block_n)
        out = f"{size},{self.warps}w"
        out += f",{self.per_sm}/SM" if self.per_sm else ",row/prog"
        if self.s1 > 1 or self.s2 > 1:
            out += f",s{self.s1}/{self.s2}"
        if self.ev1 or self.ev2:
            out += ",ev" + "/".join(EVICT[e].replace("evict_", "") or "-" for e in (self.ev1, self.ev2))
        out += ",rev" if self.reverse else ""
        out += ",ws" if self.ws else ""
        return f"({out})"


def shipped_cfg(elem: int, **kw) -> Cfg:
    return Cfg(SHIPPED_BLOCK[elem], SHIPPED_WARPS, **kw)


def same_bits_expected(cfg: Cfg, elem: int) -> bool:
    """The shipped block and warps: every block partial has the shipped per-thread order, and the partials
    are combined as the shipped finish kernel combines them; the grid and the pipelining change no value."""
    return cfg.block_n == SHIPPED_BLOCK[elem] and cfg.warps == SHIPPED_WARPS


@dataclass(frozen=True)
class Variant:
    name: str
    why: str
    make: object  # (n, element bytes) -> Cfg, or None where the variant does not run
    default: bool = True

    def cfg(self, n: int, elem: int = 2) -> Cfg | None:
        cfg = self.make(n, elem)
        return None if cfg is None or cfg.block_n > triton.next_power_of_2(n) else cfg


def _blk(kb: int, warps: int, **kw):
    """A block of kb K columns at 2-byte elements (half as many columns at 4 bytes: the same bytes)."""
    return lambda n, elem: Cfg(kb * 1024 * 2 // elem, warps, **kw)


VARIANTS = [
    Variant("exact", "shipped block/warps, one program per row, loops not pipelined (shipped bits)",
            lambda n, e: shipped_cfg(e)),
    Variant("exact-ws", "exact with the partials in a workspace, combined by the shipped _combine_partials",
            lambda n, e: shipped_cfg(e, ws=True)),
    Variant("exact-s3", "exact, both loops pipelined (tl.range num_stages 3: cp.async, 2 buffers)",
            lambda n, e: shipped_cfg(e, s1=3, s2=3)),
    Variant("exact-p4-s3", "exact-s3 on a persistent grid of 4 programs per SM",
            lambda n, e: shipped_cfg(e, per_sm=4, s1=3, s2=3)),
    Variant("exact-p2-s3", "exact-s3 on a persistent grid of 2 programs per SM (32K backward rows in flight "
            "fit the L2)", lambda n, e: shipped_cfg(e, per_sm=2, s1=3, s2=3)),
    # cp.async copies carry no eviction policy (offline PTX: the hint is dropped in pipelined loops), so the
    # evict_last variants leave pass 1 unpipelined.
    Variant("exact-p2-ev", "persistent 2/SM, evict_last on pass 1, evict_first on pass 2, pass 2 reversed, "
            "no pipelining", lambda n, e: shipped_cfg(e, per_sm=2, ev1=1, ev2=2, reverse=True)),
    Variant("exact-p2-ev-s3", "exact-p2-ev with pass 2 pipelined (its evict_first hint is then dropped)",
            lambda n, e: shipped_cfg(e, per_sm=2, s2=3, ev1=1, ev2=2, reverse=True)),
    Variant("b4k-w8-p2-s3", "4K block on 8 warps, persistent 2/SM, pipelined (own order)",
            _blk(4, 8, per_sm=2, s1=3, s2=3)),
    Variant("b8k-w16-p1-s3", "8K block on 16 warps, 1/SM, pipelined, pass 2 reversed (own order)",
            _blk(8, 16, per_sm=1, s1=3, s2=3, reverse=True)),
    Variant("b8k-w8-row", "8K block on 8 warps, one program per row, no pipelining (Inductor-like)",
            _blk(8, 8)),
    Variant("b16k-w16-p1", "16K block on 16 warps, 1/SM, pass 1 pipelined (3 stages), pass 2 evict_first and "
            "reversed", _blk(16, 16, per_sm=1, s1=3, ev2=2, reverse=True)),
    # Extras (--variants NAME or all):
    Variant("exact-p2-s4", "exact-p2-s3 with num_stages 4", lambda n, e: shipped_cfg(e, per_sm=2, s1=4, s2=4),
            default=False),
    Variant("exact-p4-ev", "exact-p2-ev with 4 programs per SM",
            lambda n, e: shipped_cfg(e, per_sm=4, ev1=1, ev2=2, reverse=True), default=False),
    Variant("b4k-w8-row", "4K block on 8 warps, one program per row", _blk(4, 8), default=False),
    Variant("b8k-w32-p1-s3", "8K block on 32 warps, 1/SM, pipelined", _blk(8, 32, per_sm=1, s1=3, s2=3),
            default=False),
    Variant("b8k-w16-p2-s3", "8K on 16 warps, 2/SM, pipelined, pass 2 reversed",
            _blk(8, 16, per_sm=2, s1=3, s2=3, reverse=True), default=False),
    Variant("b8k-w16-p1-ev", "8K on 16 warps, 1/SM, evict_last pass 1, evict_first pass 2, reversed",
            _blk(8, 16, per_sm=1, ev1=1, ev2=2, reverse=True), default=False),
    # Wide programs, one per row (session 10): few rows in flight per SM (2-4 at 16-32 warps), so pass 2's
    # re-read finds the row in L2, while the hardware, not a persistent loop, overlaps one row's passes with
    # another's (Inductor's 32K looped reduction reaches copy speed with this shape).
    Variant("b8k-w16-row", "8K block on 16 warps, one program per row", _blk(8, 16), default=False),
    Variant("b8k-w16-row-ev", "8K on 16 warps, one program per row, evict_last pass 1, evict_first pass 2",
            _blk(8, 16, ev1=1, ev2=2), default=False),
    Variant("b4k-w16-row", "4K block on 16 warps, one program per row", _blk(4, 16), default=False),
    Variant("b16k-w32-row", "16K block on 32 warps, one program per row", _blk(16, 32), default=False),
    Variant("b8k-w32-row", "8K block on 32 warps, one program per row", _blk(8, 32), default=False),
]
VARIANTS_BY_NAME = {v.name: v for v in VARIANTS}


# ------------------------------------------------------------------------------------------------------
# Launching
# ------------------------------------------------------------------------------------------------------

COMPILED: dict = {}  # (direction, cfg, n, kind, has_mask, dtype) -> CompiledKernel of the last launch
RESIDENT: dict = {}  # (direction, cfg, n, kind, has_mask, dtype, device) -> (programs per SM, SMs)


def _aligned(t, n: int) -> bool:
    per16 = max(1, 16 // t.dtype.itemsize)
    return n % per16 == 0 and t.data_ptr() % 16 == 0


def kernel_args(direction: str, cfg: Cfg, kind: int, tensors: dict, n_rows: int, n_cols: int):
    """(kernel, positional args, keyword args). tensors: x, out (fwd) / grad, dx (bwd), mask (or None),
    row_max, row_sum, ws (fp32 workspaces: ws_max, ws_sum fwd, ws bwd)."""
    x, mask = tensors["x"], tensors["mask"]
    big = [x, tensors["out"]] if direction == "fwd" else [x, tensors["grad"], tensors["dx"]]
    per16 = max(1, 16 // x.dtype.itemsize)
    align = per16 if all(_aligned(t, n_cols) for t in big) else 1
    malign = 16 if mask is not None and _aligned(mask, n_cols) else 1
    mask_arg = x if mask is None else mask
    if direction == "fwd":
        kernel = v_fwd_kernel
        args = (x, tensors["out"], mask_arg, tensors["row_max"], tensors["row_sum"], tensors["ws_max"],
                tensors["ws_sum"], n_rows, n_cols, n_cols)
    else:
        kernel = v_bwd_kernel
        args = (tensors["grad"], x, tensors["dx"], mask_arg, tensors["row_max"], tensors["row_sum"],
                tensors["ws"], n_rows, n_cols, n_cols)
    kw = dict(KIND=kind, HAS_MASK=mask is not None, ALIGN=align, MALIGN=malign, BLOCK_N=cfg.block_n,
              SPLITS=triton.next_power_of_2(triton.cdiv(n_cols, cfg.block_n)), S1=cfg.s1, S2=cfg.s2,
              EV1=cfg.ev1, EV2=cfg.ev2, REVERSE=cfg.reverse, WS=cfg.ws, num_warps=cfg.warps,
              enable_fp_fusion=False)
    return kernel, args, kw


def grid_of(cfg: Cfg, n_rows: int, n_sm: int, fit: int) -> int:
    if not cfg.per_sm:
        return n_rows
    return max(1, min(n_rows, min(fit, cfg.per_sm) * n_sm))


def run_variant(direction: str, cfg: Cfg, kind: int, x, grad=None, row_max=None, row_sum=None, mask=None,
                n_sm: int | None = None):
    """Forward: (out, row_max, row_sum); backward: dx. Contiguous (M, N) x (and grad)."""
    import torch

    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError("x: the variants take a contiguous (M, N) x")
    if grad is not None and (grad.shape != x.shape or not grad.is_contiguous()):
        raise ValueError("grad: the variants take a contiguous grad of x's shape")
    if mask is not None and (mask.shape != x.shape or not mask.is_contiguous()):
        raise ValueError("mask: the variants take a contiguous mask of x's shape")
    n_rows, n_cols = x.shape
    n_blk = triton.cdiv(n_cols, cfg.block_n)
    f32 = dict(dtype=torch.float32, device=x.device)
    t = {"x": x, "mask": None if mask is None else mask.view(torch.uint8)}
    if direction == "fwd":
        t.update(out=torch.empty_like(x), row_max=torch.empty(n_rows, **f32),
                 row_sum=torch.empty(n_rows, **f32))
        t["ws_max"] = t["ws_sum"] = t["row_max"]
        if cfg.ws:
            t["ws_max"], t["ws_sum"] = torch.empty(n_rows * n_blk, **f32), torch.empty(n_rows * n_blk, **f32)
    else:
        t.update(grad=grad, dx=torch.empty_like(x), row_max=row_max.contiguous(),
                 row_sum=row_sum.contiguous())
        t["ws"] = torch.empty(n_rows * n_blk, **f32) if cfg.ws else t["row_max"]
    kernel, args, kw = kernel_args(direction, cfg, kind, t, n_rows, n_cols)
    key = (direction, cfg, n_cols, kind, mask is not None, x.dtype)
    fit = cfg.per_sm or 1
    if x.is_cuda and cfg.per_sm:
        rkey = key + (x.device.index,)
        if rkey not in RESIDENT:
            props = torch.cuda.get_device_properties(x.device)
            RESIDENT[rkey] = (BV.resident_per_sm(kernel.warmup(*args, grid=(1,), **kw), props),
                              props.multi_processor_count)
        fit, n_sm = RESIDENT[rkey]
    COMPILED[key] = kernel[(grid_of(cfg, n_rows, n_sm or 2, fit),)](*args, **kw)
    return (t["out"], t["row_max"], t["row_sum"]) if direction == "fwd" else t["dx"]


# ------------------------------------------------------------------------------------------------------
# Offline sm_90 compile (--compile-only; Triton 3.6 in /tmp/t36, no torch, no GPU)
# ------------------------------------------------------------------------------------------------------

PTR_TYPES = {"bf16": {"grad_ptr": "*bf16", "x_ptr": "*bf16", "dx_ptr": "*bf16", "out_ptr": "*bf16",
                      "mask_ptr": "*u8"},
             "fp32": {"grad_ptr": "*fp32", "x_ptr": "*fp32", "dx_ptr": "*fp32", "out_ptr": "*fp32",
                      "mask_ptr": "*u8"}}


def loop_stats(sass: str) -> list[dict]:
    """Every loop (a backward branch) that issues global loads or cp.async copies, in program order (the
    pass-1 block loop, the pass-2 block loop, the row loop around both): its size and LDG / LDGSTS / STG /
    SHFL / local-memory (spill) instruction counts."""
    ins = []
    for line in sass.splitlines():
        mt = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if mt:
            ins.append((int(mt.group(1), 16), mt.group(2).strip()))
    loops = []
    for addr, text in ins:
        if "BRA" in _sm90.opcode(text):
            t = re.search(r"0x([0-9a-f]+)", text)
            if t and int(t.group(1), 16) < addr:
                body = [_sm90.opcode(x) for a, x in ins if int(t.group(1), 16) <= a <= addr]
                n_ld = sum(o.startswith(("LDG", "LDGSTS")) for o in body)
                if n_ld:
                    loops.append({"size": len(body), "ldg": sum(o.startswith("LDG.") for o in body),
                                  "ldgsts": sum(o.startswith("LDGSTS") for o in body),
                                  "stg": sum(o.startswith("STG") for o in body),
                                  "shfl": sum(o.startswith("SHFL") for o in body),
                                  "local": sum(o.startswith(("LDL", "STL")) for o in body)})
    return loops


def compile_stats(job) -> dict:
    """Compiles one (direction, cfg, n, kind, dtype) job for sm_90 (aligned, no mask)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    direction, cfg, n, kind, dtype = job
    try:
        fn = v_fwd_kernel if direction == "fwd" else v_bwd_kernel
        ce = dict(KIND=kind, HAS_MASK=False, ALIGN=8 if dtype == "bf16" else 4, MALIGN=1, BLOCK_N=cfg.block_n,
                  SPLITS=triton.next_power_of_2(triton.cdiv(n, cfg.block_n)), S1=cfg.s1, S2=cfg.s2,
                  EV1=cfg.ev1, EV2=cfg.ev2, REVERSE=cfg.reverse, WS=cfg.ws)
        sig, attrs = BV._signature(fn, ce, PTR_TYPES[dtype])
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": cfg.warps, "enable_fp_fusion": False})
        ttgir = c.asm.get("ttgir", "")
        st = {"ok": True, "shared": c.metadata.shared,
              "fma_ptx": len(re.findall(r"\bfma\.rn\.f32", c.asm["ptx"])),
              "async_ttgir": ttgir.count("async_copy_global_to_local"),
              "buffers": max([int(b) for b in
                              re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x", ttgir)] or [0]),
              "wait_num": max([int(w) for w in re.findall(r"async_wait .*?\{num = (\d+)", ttgir)] or [0]),
              "evict_ptx": sorted(set(re.findall(r"L2::(evict_\w+)", c.asm["ptx"])))}
        regs, st["spill"], sass = _sm90.binary_stats(c)
        st["regs"] = getattr(c, "n_regs", None) or regs
        st.update(BV.sass_stats(sass))
        st["loops"] = loop_stats(sass)
        return st
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[-600:]}"}


def compile_jobs(variants, ns, kinds, dirs, fp32_ns=()) -> list[tuple]:
    jobs = []
    for dtype, elem, sizes in (("bf16", 2, ns), ("fp32", 4, fp32_ns)):
        for n in sizes:
            for d in dirs:
                for k in kinds:
                    for v in variants:
                        if v.cfg(n, elem) is not None:
                            jobs.append((d, v.cfg(n, elem), n, k, dtype))
    return list(dict.fromkeys(jobs))


def compile_only(variants, ns, kinds, dirs, workers: int, fp32_ns=()) -> int:
    from concurrent.futures import ProcessPoolExecutor

    jobs = compile_jobs(variants, ns, kinds, dirs, fp32_ns)
    names: dict = {}
    for v in variants:
        for n in (*ns, *fp32_ns):
            for elem in (2, 4):
                if v.cfg(n, elem) is not None:
                    names.setdefault((v.cfg(n, elem), n, elem), []).append(v.name)
    print(f"triton {triton.__version__}: compiling {len(jobs)} kernels for sm_90 on {workers} processes",
          flush=True)
    with ProcessPoolExecutor(workers) as pool:
        results = list(pool.map(compile_stats, jobs))
    print("| dir | dtype | N | kind | variant | config | regs | spill B | smem B | SASS | LDG (128-bit) "
          "| LDGSTS | cp.async buffers / wait leaves | evict (PTX) | loops: SASS LDG/LDGSTS/STG/SHFL/LDL+STL "
          "| pipelined |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    bad = 0
    for (d, cfg, n, kind, dtype), r in zip(jobs, results, strict=True):
        name = "/".join(dict.fromkeys(names.get((cfg, n, 2 if dtype == "bf16" else 4), ["?"])))
        if not r["ok"]:
            bad += 1
            print(f"| {d} | {dtype} | {n} | {kind} | {name} | {cfg.label()} | FAILED: {r['error']} |")
            continue
        loops = "; ".join(f"{lp['size']}: {lp['ldg']}/{lp['ldgsts']}/{lp['stg']}/{lp['shfl']}/{lp['local']}"
                          for lp in r["loops"])
        want = cfg.s1 > 1 or cfg.s2 > 1
        piped = ("yes" if r["ldgsts"] else "NO (wanted)") if want else ("no" if not r["ldgsts"] else "yes")
        if want and r["ldgsts"] and not r["wait_num"]:
            piped += ", waits drain all"
        spill = f"{r['spill']}" + (" SPILL" if r["spill"] else "")
        print(f"| {d} | {dtype} | {n} | {kind} | {name} | {cfg.label()} | {r['regs']} | {spill} "
              f"| {r['shared']} | {r['sass']} | {r['ldg']} ({r['ldg128']}) | {r['ldgsts']} "
              f"| {r['buffers']} / "
              f"{r['wait_num']} | {','.join(r['evict_ptx']) or '-'} | {loops} | {piped} |", flush=True)
        bad += r["fma_ptx"] > 0
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------------------
# Checks shared by the GPU run and the CPU interpreter check
# ------------------------------------------------------------------------------------------------------


def oracle_ratio(direction: str, kind: int, x, out, g=None, mask=None) -> float:
    """Largest |result - oracle| / allowed over the rows given (assert_matches of tests/test_softmax_gpu.py:
    OUT_ULPS ulps of the dtype + the fp32 budget + the flush floor); inf when NaN / inf placement differs.
    out: the forward output, or dx. <= 1 passes."""
    import torch

    T = BV.gpu_oracle()
    op = OPS[kind]
    z = T.oracle_z(x, None, mask)
    ref, st = T.oracle_forward(op, z, 1)
    if direction == "fwd":
        budget = T.forward_budget(op, st, ref)
    else:
        ref = T.oracle_backward(op, st, z, g)
        budget = T.backward_budget(op, st, z, g, ref)
    o = out.double()
    if (torch.isnan(o) != torch.isnan(ref)).any() or (torch.isinf(ref) & (o != ref)).any():
        return math.inf
    if (torch.isinf(o) & ~torch.isinf(ref)).any():
        return math.inf
    finite = torch.isfinite(ref)
    err = torch.where(finite, (o - ref).abs(), torch.zeros_like(o))
    tol = T.ulp(ref, out.dtype) * T.OUT_ULPS[out.dtype] + budget + T.FLUSH_FLOOR
    return float((err / tol).max()) if err.numel() else 0.0


def shipped_forward(kind: int, x, mask=None):
    import torch

    op = torch.ops.safeops.softmax if kind == 0 else torch.ops.safeops.log_softmax
    return op(x=x, dim=1, scale=None, scale_tensor=None, mask=mask, out_dtype=None)


def shipped_backward(kind: int, g, x, row_max, row_sum, mask=None):
    return BV.shipped_backward(kind, g, x, row_max, row_sum, mask)


def _same(a, b) -> bool:
    return all(BV.bits_equal(p, q) for p, q in zip(a, b, strict=True)) if isinstance(a, tuple) \
        else BV.bits_equal(a, b)


def _rows(r, lo, hi):
    return tuple(t[lo:hi] for t in r) if isinstance(r, tuple) else r[lo:hi]


def check_variant(direction: str, cfg: Cfg, kind: int, inputs: dict, ref, sub, mask_case, n_sm=None) -> dict:
    """Bits vs the shipped result (forward: out, row max, row sum), the oracle ratio on rows ``sub``, batch
    invariance (one row alone and a 5-row slice vs the same rows of the batch) and the masked case (bits vs
    shipped, oracle, exact 0 gradients / exact softmax 0 and log-softmax -inf at excluded entries)."""
    x, g, rm, rs = inputs["x"], inputs.get("g"), inputs.get("row_max"), inputs.get("row_sum")

    def run(xx, gg=None, mm=None, ll=None, mask=None):
        return run_variant(direction, cfg, kind, xx, gg, mm, ll, mask=mask, n_sm=n_sm)

    res_full = run(x, g, rm, rs)
    res = {"same": _same(res_full, ref)}
    out = res_full[0] if direction == "fwd" else res_full
    res["oracle"] = oracle_ratio(direction, kind, x[sub], out[sub], None if g is None else g[sub])
    m = x.shape[0]
    ok = True
    for lo, hi in ((m // 2, m // 2 + 1), (max(0, m - 7), max(0, m - 7) + min(5, m))):
        def part(t, lo=lo, hi=hi):
            return None if t is None else t[lo:hi].clone()  # fresh (aligned) copies: a separate call

        ok = ok and _same(run(part(x), part(g), part(rm), part(rs)), _rows(res_full, lo, hi))
    res["batch_invariant"] = ok
    del res_full, out
    if mask_case is not None:
        mx, mg, mmask, mm, ml, mref = mask_case
        try:
            mres = run(mx, mg, mm, ml, mask=mmask)
        except Exception as e:  # e.g. a deep pipeline's masked build needs more shared memory
            res["masked_error"] = f"{type(e).__name__}: {str(e)[:120]}"
            return res
        mout = mres[0] if direction == "fwd" else mres
        if direction == "bwd":
            zero = bool((mout[~mmask] == 0).all()) and bool((mout[0] == 0).all())
        else:
            excl = 0.0 if kind == 0 else float("-inf")
            zero = bool((mout[~mmask] == excl).all()) and bool((mout[0] == excl).all())
        res["masked"] = (_same(mres, mref), oracle_ratio(direction, kind, mx, mout, mg, mmask), zero)
    return res


def verdict(res: dict, want_same: bool) -> tuple[str, str, bool]:
    return BV.verdict(res, want_same)


# ------------------------------------------------------------------------------------------------------
# CPU self-check under Triton's interpreter (--interpret-check)
# ------------------------------------------------------------------------------------------------------


def small_cfg(cfg: Cfg) -> Cfg:
    """The interpreter's version of a config: blocks of 64 columns (warps mean nothing there)."""
    return replace(cfg, block_n=INTERP_BLOCK)


INTERP_BLOCK = 64


@contextlib.contextmanager
def interpreter_split(L, block: int = INTERP_BLOCK):
    """The launcher (module L) sends rows over 32 columns down the split path with ``block``-column blocks,
    the blocks of the interpreter's variants (small_cfg): the same partials in the same combine order."""
    limits = [L.ROW_RESIDENT_MAX_COLS, *([L.ROW_RESIDENT_MAX_COLS_FWD]
                                         if hasattr(L, "ROW_RESIDENT_MAX_COLS_FWD") else [])]
    saved = dict(L.SPLIT_BLOCK_N), [dict(d) for d in limits]
    try:
        for key in L.SPLIT_BLOCK_N:
            L.SPLIT_BLOCK_N[key] = block
        for d in limits:
            for key in d:
                d[key] = 32
        L.clear_plans()
        yield
    finally:
        L.SPLIT_BLOCK_N.update(saved[0])
        for d, old in zip(limits, saved[1], strict=True):
            d.update(old)
        L.clear_plans()


def interpret_check(variants, ns=(200, 256), dtypes=("float32", "float16"), kinds=(0, 1), dirs=DIRS
                    ) -> list[str]:
    """Every variant under the interpreter with 64-column blocks (N = 200: 4 blocks, the last ragged; 256:
    4 full ones), the grid of 2 fake SMs (persistent ones loop over rows), against the float64 oracle, bit
    for bit against safeops' interpreted split path run with the same 64-column block (the launcher's
    SPLIT_BLOCK_N patched for the call: the same partials and combine order), batch invariance and a masked
    case. Returns the failures (empty: all passed)."""
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("--interpret-check: set TRITON_INTERPRET=1 before triton is imported")
    os.environ.setdefault("SAFEOPS_BACKEND", "triton")
    import safeops  # noqa: F401
    from safeops.ops import softmax_launch as L

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    failures = []
    with interpreter_split(L):
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            for n in ns:
                m = 5
                inputs = {"x": (torch.randn(m, n, generator=gen) * 4.0).to(dtype),
                          "g": torch.randn(m, n, generator=gen).to(dtype)}
                mx, mg, mmask = BV.masked_inputs(4, n, dtype, "cpu", gen)
                for kind in kinds:
                    fwd = shipped_forward(kind, inputs["x"])
                    mfwd = shipped_forward(kind, mx, mmask)
                    for d in dirs:
                        if d == "fwd":
                            ins, ref = {"x": inputs["x"]}, fwd
                            mcase = (mx, None, mmask, None, None, mfwd)
                        else:
                            ins = dict(inputs, row_max=fwd[1], row_sum=fwd[2])
                            ref = shipped_backward(kind, inputs["g"], inputs["x"], fwd[1], fwd[2])
                            mref = shipped_backward(kind, mg, mx, mfwd[1], mfwd[2], mmask)
                            mcase = (mx, mg, mmask, mfwd[1], mfwd[2], mref)
                        for var in variants:
                            cfg = var.cfg(max(DEFAULT_N), 2)
                            if cfg is None:
                                continue
                            cfg = small_cfg(cfg)
                            res = check_variant(d, cfg, kind, ins, ref, slice(0, m), mcase, n_sm=2)
                            bit, mcell, ok = verdict(res, True)
                            tag = f"{d} {dtype_name} N={n} kind={kind}"
                            print(f"interp {tag} {var.name:18s} {cfg.label():36s} oracle {res['oracle']:.3f} "
                                  f"bits {bit} masked {mcell} batch-inv {res['batch_invariant']}", flush=True)
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

    direction, cfg, n, kind, has_mask, dtype_name = job
    try:
        dt = getattr(torch, dtype_name)
        b, f = MockTensor(dt), MockTensor(torch.float32)
        t = {"x": b, "out": b, "grad": b, "dx": b, "mask": MockTensor(torch.uint8) if has_mask else None,
             "row_max": f, "row_sum": f, "ws_max": f, "ws_sum": f, "ws": f}
        kernel, args, kw = kernel_args(direction, cfg, kind, t, 4096, n)
        kernel.warmup(*args, grid=(1,), **kw)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[-300:]}"


def _compiled_peer(direction: str, kind: int):
    import torch

    torch._dynamo.reset()
    if direction == "fwd":
        def fn(x):
            return torch.softmax(x, 1) if kind == 0 else torch.log_softmax(x, 1)
    elif kind == 0:
        def fn(dy, y):
            return torch._softmax_backward_data(dy, y, 1, y.dtype)
    else:
        def fn(dy, y):
            return torch._log_softmax_backward_data(dy, y, 1, y.dtype)
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _liger_fn(direction: str, x, dy):
    """Liger-Kernel's softmax (forward, or its backward launcher), or (None, why)."""
    try:
        from liger_kernel.ops import softmax as lsm
    except Exception as e:
        return None, f"not importable ({type(e).__name__})"
    try:
        if direction == "fwd":
            lsm.LigerSoftmaxFunction.apply(x)
            return (lambda: lsm.LigerSoftmaxFunction.apply(x)), ""
        y, *settings = lsm._softmax_forward(x)
        lsm._softmax_backward(dy, y, *settings)
        return (lambda: lsm._softmax_backward(dy, y, *settings)), ""
    except Exception as e:
        return None, f"refused/failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def gpu_shape(n: int, direction: str, kinds, variants, args, H, gen, rows: list, wait_pool, device="cuda",
              dtype=None, m=None) -> None:
    """Checks and times the shipped op, torch.compile, Liger and every variant at one row length and one
    direction (M = 2**28 / N). A CPU dry run (tests/test_softmax_long_variants.py) passes device "cpu", a
    small M and the interpreter's variants."""
    import torch

    dtype = dtype or torch.bfloat16
    elem = dtype.itemsize
    m = m or TOTAL // n
    nbytes = (2 if direction == "fwd" else 3) * m * n * elem
    x = torch.randn(m, n, device=device, generator=gen).to(dtype)
    g = torch.randn(m, n, device=device, generator=gen).to(dtype) if direction == "bwd" else None
    mx, mg, mmask = BV.masked_inputs(16, n, dtype, device, gen)
    sub = slice(0, max(2, min(m, 2**20 // n)))  # oracle rows: about 1M elements
    dt = str(dtype).replace("torch.", "")

    def tb(ms):
        return nbytes / (ms * 1e-3) / 1e12

    def add(kind, name, ms=math.nan, bit="-", ratio=math.nan, inv="-", mcell="-", info="", note=""):
        rows.append((n, dt, direction, kind, name, ms, tb(ms) if ms == ms else math.nan, bit, ratio, inv,
                     mcell, info, note))

    for kind in kinds:
        fwd = shipped_forward(kind, x)
        if direction == "fwd":
            ref, inputs = fwd, {"x": x}
            shipped = (lambda kind=kind: shipped_forward(kind, x))
            ratio = oracle_ratio("fwd", kind, x[sub], fwd[0][sub])
        else:
            ref = shipped_backward(kind, g, x, fwd[1], fwd[2])
            inputs = {"x": x, "g": g, "row_max": fwd[1], "row_sum": fwd[2]}
            shipped = (lambda kind=kind, fwd=fwd: shipped_backward(kind, g, x, fwd[1], fwd[2]))
            ratio = oracle_ratio("bwd", kind, x[sub], ref[sub], g[sub])
        masked = None
        if kind == kinds[0]:
            mfwd = shipped_forward(kind, mx, mmask)
            if direction == "fwd":
                masked = (mx, None, mmask, None, None, mfwd)
            else:
                mref = shipped_backward(kind, mg, mx, mfwd[1], mfwd[2], mmask)
                masked = (mx, mg, mmask, mfwd[1], mfwd[2], mref)
        ms = H.bench_ms(shipped, args.warmup_ms, args.rep_ms)[0]
        add(kind, "safeops (shipped)", ms, "ref", ratio)
        print(f"{direction} {dt} N={n} kind={kind}: shipped {ms * 1e3:.1f} us {tb(ms):.2f} TB/s "
              f"oracle {ratio:.3f}", flush=True)
        peers = []
        compile_ns = getattr(args, "compile_ns", None)
        if (not args.no_compile and time.time() < getattr(args, "deadline", math.inf)
                and (compile_ns is None or n in compile_ns)):
            peers.append("torch.compile")
        if kind == 0 and not getattr(args, "no_liger", False):
            peers.append("Liger-Kernel")
        for peer in peers:
            try:
                y = fwd[0]  # the op's output (softmax / log_softmax), what the backward peers take
                if peer == "torch.compile":
                    fn = _compiled_peer(direction, kind)
                    call = (lambda fn=fn: fn(x)) if direction == "fwd" else (lambda fn=fn, y=y: fn(g, y))
                    call()
                else:
                    call, why = _liger_fn(direction, x, g)
                    if call is None:
                        add(kind, peer, note=why)
                        continue
                ms = H.bench_ms(call, args.warmup_ms, args.rep_ms)[0]
                add(kind, peer, ms)
                print(f"{direction} {dt} N={n} kind={kind}: {peer} {ms * 1e3:.1f} us {tb(ms):.2f} TB/s",
                      flush=True)
                del call
            except Exception as e:
                add(kind, peer, note=f"error: {type(e).__name__}: {str(e)[:160]}")
        wait_pool()  # the variant kernels were compiling in the pool meanwhile
        for var in variants:
            cfg = var.cfg(n, elem) if device == "cuda" else var.cfg(max(DEFAULT_N), 2)
            if cfg is None:
                continue
            if device != "cuda":
                cfg = small_cfg(cfg)
            want = same_bits_expected(cfg, elem) if device == "cuda" else True
            name = f"{var.name} {cfg.label()}"
            if time.time() > getattr(args, "deadline", math.inf):
                add(kind, name, note="skipped: time budget")
                continue
            try:
                res = check_variant(direction, cfg, kind, inputs, ref, sub, masked)
                bit, mcell, ok = verdict(res, want)
                if device == "cuda":
                    torch.cuda.synchronize()
                rm, rs = inputs.get("row_max"), inputs.get("row_sum")
                def timed(cfg=cfg, kind=kind, rm=rm, rs=rs):
                    return run_variant(direction, cfg, kind, x, g, rm, rs)

                ms = H.bench_ms(timed, args.warmup_ms, args.rep_ms)[0]
                key = (direction, cfg, n, kind, False, dtype)
                info = BV._kernel_info(COMPILED.get(key)) if device == "cuda" else ""
                fit = RESIDENT.get(key + (x.device.index,))
                if fit:
                    info += f" grid {grid_of(cfg, m, fit[1], fit[0])}"
                inv = "yes" if res["batch_invariant"] else "NO"
                add(kind, name, ms, bit, res["oracle"], inv, mcell, info, "" if ok else "FAILED")
                print(f"{direction} {dt} N={n} kind={kind}: {var.name:18s} {ms * 1e3:8.1f} us "
                      f"{tb(ms):5.2f} TB/s "
                      f"bits {bit} oracle {res['oracle']:.3f} batch-inv {inv} masked {mcell} {info} "
                      f"{'' if ok else 'FAILED'}", flush=True)
            except Exception as e:
                add(kind, name, note=f"error: {type(e).__name__}: {str(e)[:160]}")
                print(f"{direction} {dt} N={n} kind={kind}: {var.name}: error {type(e).__name__}: {e}",
                      flush=True)


def warm_shipped(shapes, dirs, kinds) -> None:
    """Runs the shipped op once per (row length, dtype, direction, kind, mask) on 2 rows: its kernels are
    compiled before the timed shapes need them (row counts, strides and batch sizes are not specialised)."""
    import torch

    for n, dt in shapes:
        dtype = getattr(torch, dt)
        x = torch.randn(2, n, device="cuda").to(dtype)
        g = torch.randn(2, n, device="cuda").to(dtype)
        mask = torch.rand(2, n, device="cuda") < 0.7
        for kind in kinds:
            for mk in ((None, mask) if kind == kinds[0] else (None,)):
                _, rm, rs = shipped_forward(kind, x, mk)
                if "bwd" in dirs:
                    shipped_backward(kind, g, x, rm, rs, mk)
    torch.cuda.synchronize()


def launcher_note(L, ns, fp32_ns) -> str:
    """Where the launcher's split config no longer is the one copied here (SHIPPED_BLOCK / SHIPPED_WARPS)."""
    note = ""
    for elem, sizes in ((2, ns), (4, fp32_ns)):
        for n in sizes:
            resident = [d for d, bwd in (("fwd", False), ("bwd", True))
                        if L.rows_config(n, elem, True, backward=bwd) is not None]
            if resident:
                note += f" N={n} ({elem} B): the launcher keeps the row resident ({'+'.join(resident)});"
                continue
            sc = L.split_config(n, elem)
            if (sc.block_n, sc.cols_per_split, sc.num_warps, sc.maxnreg) != (SHIPPED_BLOCK[elem],
                                                                             SHIPPED_BLOCK[elem],
                                                                             SHIPPED_WARPS, None):
                note += f" N={n} ({elem} B): launcher {sc};"
    return note


def gpu_main(args, variants, ns, kinds, dirs, fp32_ns) -> int:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import _harness as H
    import torch

    H.require_cuda("bench/softmax_long_variants.py")
    t_start = time.time()
    args.deadline = t_start + args.budget_s
    shapes = [(n, "bfloat16") for n in ns] + [(n, "float32") for n in fp32_ns]
    jobs = []
    for n, dt in shapes:
        elem = 2 if dt == "bfloat16" else 4
        for d in dirs:
            for k in kinds:
                for hm in ((False, True) if k == kinds[0] else (False,)):
                    jobs += [(d, v.cfg(n, elem), n, k, hm, dt) for v in variants
                             if v.cfg(n, elem) is not None]
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
    from safeops import _config
    from safeops.ops import softmax_launch as L

    # The shipped kernels compile here (on 2-row inputs: the same specialisation as the timed ones) while
    # the pool compiles the variants.
    warm_shipped(shapes, dirs, kinds)
    print(f"shipped kernels compiled: {time.time() - t_start:.1f} s", flush=True)
    note = launcher_note(L, ns, fp32_ns)
    if _config.one_launch_long_rows:
        note += " the shipped op runs the one-launch kernels;"
    if note:
        print("WARNING the shipped long-row path is not the one copied here:" + note, flush=True)
    copy_gbps = H.copy_bandwidth_gbps(2**30, 10, 60)
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps / 1000:.2f} TB/s ({time.time() - t_start:.1f} s)",
          flush=True)
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    rows: list = []
    for n, dt in shapes:
        for d in dirs:
            gpu_shape(n, d, kinds, variants, args, H, gen, rows, wait_pool, dtype=getattr(torch, dt))
            torch.cuda.empty_cache()
    wait_pool()
    head = (f"long-row softmax / log-softmax variants, M x N = 2**28, {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}, triton {triton.__version__}, copy {copy_gbps / 1000:.2f} TB/s")
    lines = table(rows, head, copy_gbps / 1000)
    lines += [""] + summary(rows, copy_gbps / 1000)
    if failures:
        lines += ["", "compile failures:"] + [f"  {j}: {e}" for j, e in failures.items()]
    if note:
        lines += ["", "WARNING the shipped long-row path is not the one copied here:" + note]
    lines.append(f"\ntotal {time.time() - t_start:.0f} s")
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "softmax_long_variants.md").write_text(text + "\n")
    return 0


def table(rows, head: str, copy_tbps: float) -> list[str]:
    lines = [head + "; TB/s = (2 fwd | 3 bwd) x numel x element bytes / time; bits = vs the shipped op on "
             "the whole input (fwd: out, row max, row sum); oracle = max error / allowed "
             "(tests/test_softmax_gpu.py budget, <= 1 passes); batch-inv = one row alone and a 5-row slice "
             "give the batch's bits; "
             "masked = bits vs shipped and oracle ratio on a masked input; regs/spills/smem (grid)", "",
             "| N | dtype | dir | kind | impl | us | TB/s | % copy | bits | oracle | batch-inv | masked | "
             "regs/spills/smem | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, dt, d, kind, name, ms, tbps, bit, ratio, inv, mcell, info, note in rows:
        pct = f"{100 * tbps / copy_tbps:.0f}%" if copy_tbps and tbps == tbps else "-"
        lines.append(f"| {n} | {dt} | {d} | {OPS[kind]} | {name} | {ms * 1e3:.1f} | {tbps:.2f} | {pct} "
                     f"| {bit} | {ratio:.3f} | {inv} | {mcell} | {info} | {note} |")
    return lines


def summary(rows, copy_tbps: float) -> list[str]:
    """One line per (N, dtype, direction, kind): the shipped op, the best peer and the fastest variant that
    passed its checks (with its bits cell), in TB/s and % of copy."""
    def cell(r):
        if r is None:
            return "-"
        pct = f" ({100 * r[6] / copy_tbps:.0f}%)" if copy_tbps else ""
        return f"{r[6]:.2f}{pct}"

    groups: dict = {}
    for r in rows:
        groups.setdefault(r[:4], []).append(r)
    lines = ["| N | dtype | dir | kind | shipped TB/s | best peer | best passing variant | its bits |",
             "|---|---|---|---|---|---|---|---|"]
    for (n, dt, d, kind), rs in groups.items():
        timed = [r for r in rs if r[6] == r[6]]
        shipped = next((r for r in timed if r[4] == "safeops (shipped)"), None)
        peers = [r for r in timed if r[4] in ("torch.compile", "Liger-Kernel")]
        ok = [r for r in timed if r[7] != "ref" and r not in peers and not r[12]]
        peer = max(peers, key=lambda r: r[6], default=None)
        best = max(ok, key=lambda r: r[6], default=None)
        lines.append(f"| {n} | {dt} | {d} | {OPS[kind]} | {cell(shipped)} | "
                     f"{'-' if peer is None else peer[4] + ' ' + cell(peer)} | "
                     f"{'-' if best is None else best[4] + ' ' + cell(best)} | "
                     f"{'-' if best is None else best[7]} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default=",".join(map(str, DEFAULT_N)))
    p.add_argument("--fp32-n", default="32768", help="fp32 row lengths too (empty: none)")
    p.add_argument("--dirs", default="fwd,bwd")
    p.add_argument("--kinds", default="0,1")
    p.add_argument("--variants", default="", help="comma-separated names or 'all' (default: the defaults)")
    p.add_argument("--out", default="")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    p.add_argument("--compile-n", default="32768,65536",
                   help="row lengths with a torch.compile peer (one Inductor compile per length, direction, "
                        "kind and dtype; 'all': every length)")
    p.add_argument("--no-liger", action="store_true", help="skip the Liger-Kernel peer")
    p.add_argument("--warmup-ms", type=float, default=10.0)
    p.add_argument("--rep-ms", type=float, default=30.0)
    p.add_argument("--budget-s", type=float, default=140.0,
                   help="skip the remaining variants (still printing the table) after this many seconds")
    p.add_argument("--list", action="store_true")
    p.add_argument("--compile-only", action="store_true", help="offline sm_90 compile stats (no GPU)")
    p.add_argument("--interpret-check", action="store_true", help="CPU: oracle + bits vs the shipped path")
    args = p.parse_args(argv)
    ns = tuple(int(v) for v in args.n.split(",") if v)
    args.compile_ns = None if args.compile_n == "all" else {int(v) for v in args.compile_n.split(",") if v}
    fp32_ns = tuple(int(v) for v in args.fp32_n.split(",") if v)
    kinds = tuple(int(v) for v in args.kinds.split(",") if v)
    dirs = tuple(d for d in args.dirs.split(",") if d)
    if any(d not in DIRS for d in dirs):
        p.error(f"--dirs: expected a subset of {DIRS}")
    if args.variants == "all":
        variants = VARIANTS
    else:
        variants = [VARIANTS_BY_NAME[v] for v in args.variants.split(",") if v]
        variants = variants or [v for v in VARIANTS if v.default]
    if args.list:
        for var in VARIANTS:
            cfgs = "; ".join(f"{n}: {var.cfg(n).label()}" for n in DEFAULT_N if var.cfg(n) is not None)
            same = "shipped bits" if same_bits_expected(var.cfg(max(DEFAULT_N)), 2) else "own order (DIFF)"
            print(f"{var.name:18s} {cfgs}{'' if var.default else '  [extra]'}\n{'':18s} {var.why}; {same}")
        return 0
    if args.compile_only:
        return compile_only(variants, ns, kinds, dirs, args.workers or os.cpu_count() or 1, fp32_ns)
    if args.interpret_check:
        failures = interpret_check(variants)
        print("interpret check:", "all passed" if not failures else "FAILED: " + "; ".join(failures))
        return 1 if failures else 0
    return gpu_main(args, variants, ns, kinds, dirs, fp32_ns)


if __name__ == "__main__":
    # Run through the module name, so the process-pool workers (spawn) and this process define the kernels
    # in the same module (Triton's cache key) and pickle jobs by the same class names.
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    import softmax_long_variants

    sys.exit(softmax_long_variants.main())
