"""Experimental attention-forward kernels, checked and timed against the shipped one in one GPU run (issue 4).

Self-contained Triton kernels started from a copy of ``attn_fwd_kernel`` / ``_fwd_inner``
(safeops/kernels/attention.py) with the launcher's FWD_CONFIGS (safeops/ops/attention_launch.py), cut down
to the dense case: (B, H, S, D) contiguous, MHA, S a multiple of 128, D in {64, 128}, bf16/fp16, optional
top-left causal; no mask / softcap / window / varlen / GQA. The numerics are the shipped ones (contract
section 1): ``z2 = fp32(q k^T) * C1`` materialised once and used for both the running max and ``z2 - m``;
``exp2`` throughout; the guarded base ``where(m_new == -inf, 0, m_new)`` so an all-excluded block makes no
NaN; excluded keys selected to -inf; the output ``acc / l`` with ``l == 0`` rows giving 0; launched with
``enable_fp_fusion=False``. What changes is the schedule:

- ``copy``: the shipped kernel specialised to this case (the baseline; must give the shipped bits);
- ``subtile2``: each program's BLOCK_M rows as two halves whose QK^T dots are issued back to back, then the
  two halves' softmax / PV in turn, so the second half's product can run under the first half's softmax
  (FlashAttention-3's ping-pong emulated inside one program). 4 warps on 128 rows: each half is one
  warpgroup-wide m64 tile with the copy's per-warp layout (16 rows per warp, whole key block per row);
  ``subtile2-w8``: 8 warps on 256 rows (each half is exactly the copy's 128-row tile);
- ``next-qk``: the next key block's QK^T issued before this block's softmax / PV, its scores carried to the
  next step in registers (hand software pipelining, FA3's intra-warpgroup overlap); the causal diagonal
  blocks keep the plain loop; k of the next block is loaded with a bounds mask (the last step's extra
  product is on zeros and unused);
- ``exact-skip``: ``acc *= alpha`` skipped by a block-uniform branch when every row's alpha is exactly 1
  (``min(alpha) == 1`` over the program's rows: then the multiply changes no bit). With random inputs the
  row maxima keep changing, so the skip is rare here (a row's max changes in block j with probability
  about 1 / j); the run reports the time anyway, and the SASS the cost of the test (a block reduction);
- config-only copies: other tiles / warps / stages (``--list``).

Same bits: the order of every fp32 accumulation per row is the shipped one when BLOCK_N is the shipped 64
and each warp holds whole rows of the score tile (as in the shipped 8-warp 128-row tile); the harness checks
o, m, l bit for bit against ``torch.ops.safeops.attention`` and flags a difference that was not expected,
and checks every variant against the float64 oracle (tests/oracle.py bounds, as the GPU tests) on one head.

GPU run (the lead; H200, Triton 3.6; about 60-90 s: the variant kernels compile in a process pool while
the shipped kernel and FlexAttention compile in the main process):

    python3 bench/attn_fwd_variants.py --out DIR [--d 64,128] [--causal 0,1] [--variants a,b|all]
                                       [--no-flex] [--no-cudnn] [--workers N] [--seq 4096]
    python3 bench/attn_fwd_variants.py --list
    /tmp/t36/bin/python bench/attn_fwd_variants.py --compile-only [--d 128] [--variants ...]   (no GPU)
    TRITON_INTERPRET=1 .venv/bin/python bench/attn_fwd_variants.py --interpret-check   (CPU, ~10 s)

It prints (and writes to DIR/attn_fwd_variants.md) one markdown table, rows per case (B=4 H=16 S=4K, D in
{64, 128}, causal and not): variant, ms, TFLOP/s (4 B H S^2 D, halved for causal), oracle ratio (max error
/ float64 bound, <= 1 passes), bits vs the shipped forward, registers / spills / shared memory of the
compiled kernel; cuDNN (sdpa) and Flex as peers. ``--compile-only`` compiles every variant for sm_90 with
Triton 3.6 (ptxas included, no torch needed) and prints registers, spill bytes, shared memory and the SASS
of the main loop (instructions, HGMMA, MUFU.EX2, wgmma waits, barriers, and how many exp2 sit between an
HGMMA and the wait that ends its chain, i.e. under a running product). Notes:
scratch/notes_attn_fwd_variants.md.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import struct
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
import _probes  # noqa: E402
import _sm90  # noqa: E402

NEG_INF = tl.constexpr(float("-inf"))


# ------------------------------------------------------------------------------------------------------
# Kernels (triton only: this part also runs under /tmp/t36 for --compile-only, where torch is missing)
# ------------------------------------------------------------------------------------------------------


@triton.jit
def _softmax_step(s, m_i, l_i, offs_m, offs_n, C1, MASKED: tl.constexpr):
    """The shipped online-softmax step on one score tile: (p, alpha, m_new, l_new)."""
    z = s * C1  # the one materialised score (no fusion: the launch disables fp contraction)
    if MASKED:  # top-left causal: key j visible from query i iff j <= i (the shipped select)
        z = tl.where(offs_n[None, :] <= offs_m[:, None], z, NEG_INF)
    m_new = tl.maximum(m_i, tl.max(z, 1))
    # Guarded base: a row that has seen only excluded keys keeps base 0, so no -inf - -inf.
    base = tl.where(m_new == NEG_INF, 0.0, m_new)
    alpha = tl.exp2(m_i - base)
    p = tl.exp2(z - base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _rescale(acc, alpha, SKIP: tl.constexpr):
    if SKIP:
        # Block-uniform: one value for the whole program. alpha == 1 for every row means acc * 1 == acc.
        if tl.min(alpha, 0) != 1.0:
            acc = acc * alpha[:, None]
    else:
        acc = acc * alpha[:, None]
    return acc


@triton.jit
def _loop(acc, m_i, l_i, q, k_ptrs, v_ptrs, offs_m, lo, hi, C1, HEAD_DIM: tl.constexpr,
          BLOCK_N: tl.constexpr, MASKED: tl.constexpr, STAGES: tl.constexpr, SKIP: tl.constexpr):
    """The shipped _fwd_inner over key blocks [lo, hi): load k, QK^T, softmax step, load v, PV."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        offs_n = start_n + offs_n0
        k = tl.load(k_ptrs + start_n * HEAD_DIM)
        s = tl.dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], tl.float32))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, offs_m, offs_n, C1, MASKED)
        acc = _rescale(acc, alpha, SKIP)
        v = tl.load(v_ptrs + start_n * HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_i, l_i


@triton.jit
def _loop_next(acc, m_i, l_i, q, k_ptrs, v_ptrs, offs_m, lo, hi, C1, HEAD_DIM: tl.constexpr,
               BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    """next-qk (unmasked blocks only): step j issues QK^T of block j + 1, then block j's softmax and PV from
    the scores carried over from step j - 1. Same arithmetic per element as _loop."""
    offs_n0 = tl.arange(0, BLOCK_N)
    k0 = tl.load(k_ptrs + lo * HEAD_DIM, mask=(lo + offs_n0 < hi)[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k0), tl.zeros([q.shape[0], BLOCK_N], tl.float32))
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        offs_n = start_n + offs_n0
        nxt = start_n + BLOCK_N
        k_next = tl.load(k_ptrs + nxt * HEAD_DIM, mask=(nxt + offs_n0 < hi)[:, None], other=0.0)
        s_next = tl.dot(q, tl.trans(k_next), tl.zeros([q.shape[0], BLOCK_N], tl.float32))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, offs_m, offs_n, C1, False)
        acc = acc * alpha[:, None]
        v = tl.load(v_ptrs + start_n * HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc)
        s = s_next
    return acc, m_i, l_i


@triton.jit
def _loop_sub2(acc0, m0_i, l0_i, q0, offs_m0, acc1, m1_i, l1_i, q1, offs_m1, k_ptrs, v_ptrs, lo, hi, C1,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, STAGES: tl.constexpr):
    """subtile2: both halves' QK^T back to back, then half 0's softmax / PV, then half 1's."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        offs_n = start_n + offs_n0
        k = tl.load(k_ptrs + start_n * HEAD_DIM)
        kt = tl.trans(k)
        s0 = tl.dot(q0, kt, tl.zeros([q0.shape[0], BLOCK_N], tl.float32))
        s1 = tl.dot(q1, kt, tl.zeros([q1.shape[0], BLOCK_N], tl.float32))
        v = tl.load(v_ptrs + start_n * HEAD_DIM)
        p0, alpha0, m0_i, l0_i = _softmax_step(s0, m0_i, l0_i, offs_m0, offs_n, C1, MASKED)
        acc0 = acc0 * alpha0[:, None]
        acc0 = tl.dot(p0.to(v.dtype), v, acc0)
        p1, alpha1, m1_i, l1_i = _softmax_step(s1, m1_i, l1_i, offs_m1, offs_n, C1, MASKED)
        acc1 = acc1 * alpha1[:, None]
        acc1 = tl.dot(p1.to(v.dtype), v, acc1)
    return acc0, m0_i, l0_i, acc1, m1_i, l1_i


@triton.jit
def _loop_ws(acc, m_i, l_i, q, k_desc, v_desc, offs_m, hi, C1, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
             STAGES: tl.constexpr):
    """ws: _loop with Triton 3.6's automatic warp specialization (Hopper: a TMA producer warpgroup and two
    consumer warpgroups of 64 rows each); one loop over [0, hi), causal with the select in every step (a
    no-op on the fully visible blocks: the pass fails on a function with two loops)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(0, hi, BLOCK_N, num_stages=STAGES, warp_specialize=True):
        offs_n = start_n + offs_n0
        k = k_desc.load([start_n, 0])
        s = tl.dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], tl.float32))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, offs_m, offs_n, C1, MASKED)
        acc = acc * alpha[:, None]
        v = v_desc.load([start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_i, l_i


@triton.jit
def _finish(acc, m_i, l_i, o_ptr, m_ptr, l_ptr, head, st, offs_m, offs_d, HEAD_DIM: tl.constexpr):
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # empty rows (l = 0) give 0, not 0/0
    tl.store(o_ptr + head + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out.to(o_ptr.dtype.element_ty))
    tl.store(m_ptr + st + offs_m, m_i)
    tl.store(l_ptr + st + offs_m, l_i)


@triton.jit(do_not_specialize=["seqlen", "n_m_blocks"])
def v_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr, seqlen, n_m_blocks, C1,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 STAGES: tl.constexpr, MODE: tl.constexpr, SKIP: tl.constexpr):
    """MODE 0: copy (SKIP: exact-skip); 1: subtile2; 2: next-qk; 3: ws (automatic warp specialization, every
    tile through in-kernel TMA descriptors over the head). Grid (n_m_blocks, B * H) as shipped."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    if CAUSAL:  # the shipped REVERSE: the longest query blocks (most keys) first
        pid_m = n_m_blocks - 1 - pid_m
    m0 = pid_m * BLOCK_M
    head = bh.to(tl.int64) * seqlen * HEAD_DIM
    st = bh.to(tl.int64) * seqlen
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n0 = tl.arange(0, BLOCK_N)
    k_ptrs = k_ptr + head + offs_n0[:, None] * HEAD_DIM + offs_d[None, :]
    v_ptrs = v_ptr + head + offs_n0[:, None] * HEAD_DIM + offs_d[None, :]
    # The shipped _block_ranges, dense: [0, S) fully visible; causal: [0, b) fully visible, [b, m0 + BLOCK_M)
    # on the diagonal (masked).
    if CAUSAL:
        b = ((m0 + 1) // BLOCK_N) * BLOCK_N
        hi = m0 + BLOCK_M
    else:
        b = seqlen
        hi = seqlen
    if MODE == 1:
        HALF: tl.constexpr = tl.constexpr(BLOCK_M // 2)
        offs_m0 = m0 + tl.arange(0, HALF)
        offs_m1 = m0 + HALF + tl.arange(0, HALF)
        q0 = tl.load(q_ptr + head + offs_m0[:, None] * HEAD_DIM + offs_d[None, :])
        q1 = tl.load(q_ptr + head + offs_m1[:, None] * HEAD_DIM + offs_d[None, :])
        acc0 = tl.zeros([HALF, HEAD_DIM], tl.float32)
        acc1 = tl.zeros([HALF, HEAD_DIM], tl.float32)
        m0_i = tl.full([HALF], NEG_INF, tl.float32)
        m1_i = tl.full([HALF], NEG_INF, tl.float32)
        l0_i = tl.zeros([HALF], tl.float32)
        l1_i = tl.zeros([HALF], tl.float32)
        acc0, m0_i, l0_i, acc1, m1_i, l1_i = _loop_sub2(acc0, m0_i, l0_i, q0, offs_m0, acc1, m1_i, l1_i, q1,
                                                        offs_m1, k_ptrs, v_ptrs, 0, b, C1, HEAD_DIM, BLOCK_N,
                                                        False, STAGES)
        if CAUSAL:
            acc0, m0_i, l0_i, acc1, m1_i, l1_i = _loop_sub2(acc0, m0_i, l0_i, q0, offs_m0, acc1, m1_i, l1_i,
                                                            q1, offs_m1, k_ptrs, v_ptrs, b, hi, C1, HEAD_DIM,
                                                            BLOCK_N, True, STAGES)
        _finish(acc0, m0_i, l0_i, o_ptr, m_ptr, l_ptr, head, st, offs_m0, offs_d, HEAD_DIM)
        _finish(acc1, m1_i, l1_i, o_ptr, m_ptr, l_ptr, head, st, offs_m1, offs_d, HEAD_DIM)
    elif MODE == 3:
        # Every dot operand through TMA (the pass lowers only TMA producer loads), in-kernel descriptors (the
        # pass splits q's 128 rows between the two consumers and can shrink only an in-kernel box).
        offs_m = m0 + tl.arange(0, BLOCK_M)
        q = tl.make_tensor_descriptor(q_ptr + head, [seqlen, HEAD_DIM], [HEAD_DIM, 1],
                                      [BLOCK_M, HEAD_DIM]).load([m0, 0])
        k_desc = tl.make_tensor_descriptor(k_ptr + head, [seqlen, HEAD_DIM], [HEAD_DIM, 1],
                                           [BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(v_ptr + head, [seqlen, HEAD_DIM], [HEAD_DIM, 1],
                                           [BLOCK_N, HEAD_DIM])
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc, m_i, l_i = _loop_ws(acc, m_i, l_i, q, k_desc, v_desc, offs_m, hi, C1, BLOCK_N, CAUSAL, STAGES)
        _finish(acc, m_i, l_i, o_ptr, m_ptr, l_ptr, head, st, offs_m, offs_d, HEAD_DIM)
    else:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        q = tl.load(q_ptr + head + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        if MODE == 2:
            acc, m_i, l_i = _loop_next(acc, m_i, l_i, q, k_ptrs, v_ptrs, offs_m, 0, b, C1, HEAD_DIM, BLOCK_N,
                                       STAGES)
        else:
            acc, m_i, l_i = _loop(acc, m_i, l_i, q, k_ptrs, v_ptrs, offs_m, 0, b, C1, HEAD_DIM, BLOCK_N,
                                  False, STAGES, SKIP)
        if CAUSAL:
            acc, m_i, l_i = _loop(acc, m_i, l_i, q, k_ptrs, v_ptrs, offs_m, b, hi, C1, HEAD_DIM, BLOCK_N,
                                  True, STAGES, SKIP)
        _finish(acc, m_i, l_i, o_ptr, m_ptr, l_ptr, head, st, offs_m, offs_d, HEAD_DIM)


# ------------------------------------------------------------------------------------------------------
# Variants
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cfg:
    block_m: int
    block_n: int
    warps: int
    stages: int
    mode: int = 0  # 0 copy, 1 subtile2, 2 next-qk, 3 ws (needs 4 warps, BLOCK_M 128)
    skip: bool = False  # exact-skip (mode 0 only)

    def label(self) -> str:
        extra = {0: "", 1: " sub2", 2: " nextqk", 3: " ws"}[self.mode] + (" skip" if self.skip else "")
        return f"({self.block_m},{self.block_n},{self.warps}w,{self.stages}s{extra})"


@dataclass(frozen=True)
class Variant:
    name: str
    why: str
    cfg: dict  # head dim -> Cfg
    default: bool = True

    def runs(self, d: int) -> bool:
        return d in self.cfg


# The shipped FWD_CONFIGS (safeops/ops/attention_launch.py at the time of writing), copied; the same for
# dense and causal.
SHIPPED = {64: Cfg(128, 64, 8, 3), 128: Cfg(128, 64, 8, 3)}


def _with(**kw) -> dict:
    return {d: replace(c, **kw) for d, c in SHIPPED.items()}


VARIANTS = [
    Variant("copy", "the shipped forward specialised to dense MHA: the baseline, must give the shipped bits",
            SHIPPED),
    Variant("subtile2", "two 64-row halves per 128-row program, QK^T of both issued back to back, 4 warps "
            "(one warpgroup), 2 stages", {d: Cfg(128, 64, 4, 2, mode=1) for d in (64, 128)}),
    Variant("subtile2-s3", "subtile2 with 3 stages", {d: Cfg(128, 64, 4, 3, mode=1) for d in (64, 128)}),
    Variant("subtile2-w8", "two 128-row halves (each the shipped tile) per 256-row program, 8 warps, "
            "2 stages",
            {d: Cfg(256, 64, 8, 2, mode=1) for d in (64, 128)}),
    Variant("next-qk", "next key block's QK^T issued before this block's softmax / PV; shipped tile",
            _with(mode=2)),
    Variant("next-qk-s2", "next-qk with 2 stages", _with(mode=2, stages=2)),
    Variant("next-qk-m64w4", "next-qk on a 64 x 64 tile, 4 warps, 2 stages (2 CTAs per SM at D=128)",
            {d: Cfg(64, 64, 4, 2, mode=2) for d in (64, 128)}),
    Variant("exact-skip", "acc *= alpha skipped (block-uniform branch) when every alpha is exactly 1",
            _with(skip=True)),
    Variant("m128n128s2", "128 x 128 tile, 8 warps, 2 stages (different BLOCK_N: different bits)",
            {d: Cfg(128, 128, 8, 2) for d in (64, 128)}),
    Variant("m128s2", "shipped tile with 2 stages", _with(stages=2)),
    Variant("m128s4", "shipped tile with 4 stages", _with(stages=4)),
    Variant("m64w4s2", "64 x 64 tile, 4 warps, 2 stages: small CTAs, 2+ per SM overlap each other",
            {d: Cfg(64, 64, 4, 2) for d in (64, 128)}),
    Variant("m64w4s3", "64 x 64 tile, 4 warps, 3 stages", {d: Cfg(64, 64, 4, 3) for d in (64, 128)}),
    # Extras (not in the default list; --variants NAME or all):
    Variant("m128w4s2", "shipped tile on 4 warps (32 rows a warp), 2 stages", {d: Cfg(128, 64, 4, 2)
            for d in (64, 128)}, default=False),
    Variant("m64n128w4s2", "64 x 128 tile, 4 warps, 2 stages (different bits)",
            {d: Cfg(64, 128, 4, 2) for d in (64, 128)}, default=False),
    Variant("subtile2-w8-s3", "subtile2-w8 with 3 stages", {d: Cfg(256, 64, 8, 3, mode=1) for d in (64, 128)},
            default=False),
    Variant("ws", "Triton 3.6 automatic warp specialization: 1 TMA producer + 2 consumer warpgroups of 64 "
            "rows (4 warps each), in-kernel TMA descriptors, 2 stages; causal as one loop (same bits "
            "expected)",
            {d: Cfg(128, 64, 4, 2, mode=3) for d in (64, 128)}, default=False),
    Variant("ws-s3", "ws with 3 stages", {d: Cfg(128, 64, 4, 3, mode=3) for d in (64, 128)}, default=False),
]
VARIANTS_BY_NAME = {v.name: v for v in VARIANTS}


def same_bits_expected(cfg: Cfg, d: int) -> bool:
    """Same key-block steps (BLOCK_N) and whole score rows per warp (a tile, or a subtile2 half, of at least
    16 rows per warp: the warps split the rows only); with fewer rows the wgmma layout splits the keys of
    a row over warps, and its max / sum would be combined in another order."""
    rows = cfg.block_m // 2 if cfg.mode == 1 else cfg.block_m
    return cfg.block_n == SHIPPED[d].block_n and rows >= 16 * cfg.warps


# ------------------------------------------------------------------------------------------------------
# Launching (one function for real launches and for warm-up compiles, so both hit the same cache entry)
# ------------------------------------------------------------------------------------------------------


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def c1_of(scale: float) -> float:
    """C1 exactly as attention_launch.constants(scale, None)[0]: fp32(scale * log2(e))."""
    return _f32(scale * 1.4426950408889634)


COMPILED: dict = {}  # (cfg, d, causal) -> the CompiledKernel of the last launch (for n_regs / n_spills)


def launch(cfg: Cfg, q, k, v, o, m, l, seqlen, d, causal, c1, bh, warmup=False):
    n_m = seqlen // cfg.block_m
    grid = (n_m, bh)
    args = (q, k, v, o, m, l, seqlen, n_m, c1)
    kw = dict(HEAD_DIM=d, CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
              MODE=cfg.mode, SKIP=cfg.skip, num_warps=cfg.warps, enable_fp_fusion=False)
    if warmup:
        return v_fwd_kernel.warmup(*args, grid=grid, **kw)
    COMPILED[(cfg, d, causal)] = v_fwd_kernel[grid](*args, **kw)
    return COMPILED[(cfg, d, causal)]


def check_shape(q, cfg: Cfg) -> None:
    b, h, s, d = q.shape
    if d not in (64, 128) or not q.is_contiguous():
        raise ValueError("q: the variants take contiguous (B, H, S, D) with D in {64, 128}")
    if s % cfg.block_m or s % cfg.block_n:
        raise ValueError(f"q: sequence length {s} is not a multiple of the blocks {cfg.label()}")


def forward(cfg: Cfg, q, k, v, causal: bool, scale: float):
    """(o, m, l) of the variant: m = max of z2 (base 2), l = sum of exp2(z2 - m), as the shipped forward."""
    import torch

    check_shape(q, cfg)
    b, h, s, d = q.shape
    if cfg.mode == 3 and q.is_cuda:
        from safeops.ops._launch import ensure_tma_allocator  # in-kernel descriptors need global scratch

        ensure_tma_allocator()
    o = torch.empty_like(q)
    m = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    launch(cfg, q, k, v, o, m, l, s, d, causal, c1_of(scale), b * h)
    return o, m, l


def kernel_jobs(variants, dims, causals) -> list[tuple]:
    jobs = [(var.cfg[d], d, causal) for d in dims for causal in causals for var in variants if var.runs(d)]
    return list(dict.fromkeys(jobs))


def job_label(job) -> str:
    cfg, d, causal = job
    return f"D={d} {'causal' if causal else 'dense '} {cfg.label()}"


# ------------------------------------------------------------------------------------------------------
# Offline sm_90 compile (--compile-only; Triton 3.6 in /tmp/t36, no torch, no GPU)
# ------------------------------------------------------------------------------------------------------


def loop_stats(sass: str) -> dict:
    """SASS of the main loop: the backward-branch loop with the most HGMMA instructions (the unmasked key
    loop). ``ex2_under``: MUFU.EX2 between an HGMMA and the next wgmma wait (exp2 under a running chain)."""
    ins = []
    for line in sass.splitlines():
        mt = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if mt:
            ins.append((int(mt.group(1), 16), mt.group(2).strip()))
    best = None
    for addr, text in ins:
        if "BRA" in _sm90.opcode(text):
            t = re.search(r"0x([0-9a-f]+)", text)
            if t and int(t.group(1), 16) < addr:
                body = [x for a, x in ins if int(t.group(1), 16) <= a <= addr]
                n_hg = sum(_sm90.opcode(x).startswith("HGMMA") for x in body)
                if best is None or n_hg > best[0]:
                    best = (n_hg, body)
    if best is None:
        return {"loop": 0}
    body = best[1]
    ops = [_sm90.opcode(x) for x in body]
    under, pending = 0, False
    for op in ops:
        if op.startswith("HGMMA"):
            pending = True
        elif op.startswith("WARPGROUP.DEPBAR") or op.startswith("WARPSYNC"):
            pending = False
        elif op.startswith("MUFU.EX2") and pending:
            under += 1
    return {"loop": len(ops), "hgmma": sum(o.startswith("HGMMA") for o in ops),
            "ex2": sum(o.startswith("MUFU.EX2") for o in ops),
            "waits": sum(o.startswith("WARPGROUP.DEPBAR") for o in ops),
            "bar": sum(o.startswith("BAR") for o in ops), "ex2_under": under,
            "fmul": sum(o.startswith("FMUL") for o in ops), "ffma": sum(o.startswith("FFMA") for o in ops)}


def compile_stats(job) -> dict:
    """Compiles one job for sm_90; registers, spill bytes, shared memory, loop SASS counts."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg, d, causal = job
    fn = v_fwd_kernel
    ce = dict(HEAD_DIM=d, CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
              MODE=cfg.mode, SKIP=cfg.skip)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in ce:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if name in ("m_ptr", "l_ptr") else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name == "C1" else "i32"  # seqlen, n_m_blocks: not specialised (as shipped)
    try:
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": cfg.warps, "enable_fp_fusion": False})
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[-600:]}"}
    fma = len(re.findall(r"\bfma\.rn\.f32", c.asm["ptx"]))  # contraction would break contract section 1
    stats = {"ok": True, "shared": c.metadata.shared, "fma_ptx": fma}
    stats["regs"], stats["spill"], sass = _sm90.binary_stats(c)
    stats.update(loop_stats(sass))
    return stats


def compile_only(variants, dims, causals, workers: int) -> int:
    from concurrent.futures import ProcessPoolExecutor

    jobs = kernel_jobs(variants, dims, causals)
    names = {}
    for var in variants:
        for d in dims:
            if var.runs(d):
                names.setdefault(var.cfg[d], var.name)
    print(f"triton {triton.__version__}: compiling {len(jobs)} kernels for sm_90 on {workers} processes",
          flush=True)
    with ProcessPoolExecutor(workers) as pool:
        results = list(pool.map(compile_stats, jobs))
    print("| variant | kernel | regs | spill B | smem B | loop SASS | HGMMA | EX2 | EX2 under wgmma | waits "
          "| BAR | FFMA (loop) | fma.rn (PTX) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    bad = 0
    for job, r in zip(jobs, results, strict=True):
        name = names.get(job[0], "?")
        if r["ok"]:
            loop = " | ".join(str(r.get(x, 0)) for x in ("loop", "hgmma", "ex2", "ex2_under", "waits", "bar",
                                                         "ffma"))
            print(f"| {name} | {job_label(job)} | {r['regs']} | {r['spill']} | {r['shared']} | {loop} "
                  f"| {r['fma_ptx']} |")
            bad += r["fma_ptx"] > 0 or r["shared"] > 232448
        else:
            bad += 1
            print(f"| {name} | {job_label(job)} | FAILED: {r['error']} |")
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------------------
# Checks shared by the GPU run and the CPU interpreter check
# ------------------------------------------------------------------------------------------------------


def oracle_check(oracle, q, k, v, causal: bool, heads=1):
    """A function of a forward's (o, m, l): max error / float64 bound over (out, lse) on the first ``heads``
    heads of batch 0, on the CPU (the oracle and its bounds are computed once, here)."""
    import torch

    sl = (slice(0, 1), slice(0, heads))
    qc, kc, vc = (t[sl].cpu() for t in (q, k, v))
    r = oracle.attention(qc, kc, vc, is_causal=causal)
    out_b, lse_b = oracle.attention_bounds(r, qc)
    exp_o, exp_l = r.out.detach(), r.lse.detach()
    del r

    def ratio(got) -> float:
        o, m, l = got
        m64, l64 = m[sl].cpu().double(), l[sl].cpu().double()
        lse = torch.where(l64 > 0, (m64 + torch.log2(torch.where(l64 > 0, l64, 1.0))) * math.log(2.0),
                          torch.full_like(m64, float("-inf")))
        e_o = oracle.max_violation(o[sl].cpu().double(), exp_o, out_b)[0]
        e_l = oracle.max_violation(lse, exp_l, lse_b)[0]
        return max(e_o, e_l)
    return ratio


def bits(got, ref) -> tuple[bool, str]:
    import torch

    same = all(torch.equal(x, y) for x, y in zip(got, ref, strict=True))
    note = ""
    if not same:
        diffs = [(x.double() - y.double()).abs().nan_to_num(0.0).max().item() for x, y in zip(got, ref,
                                                                                               strict=True)]
        note = "max |diff| o/m/l " + "/".join(f"{x:.2g}" for x in diffs)
    return same, note


def shipped_forward(q, k, v, causal: bool, scale: float):
    import torch

    s = q.shape[2]
    opts = (None, 0, None, None, s, s, bool(causal), scale, None, -1, 0 if causal else -1, 0)
    return torch.ops.safeops.attention(q, k, v, *opts)


# ------------------------------------------------------------------------------------------------------
# CPU self-check under Triton's interpreter (--interpret-check)
# ------------------------------------------------------------------------------------------------------


def small(cfg: Cfg) -> Cfg:
    """The config under the interpreter: BLOCK_N 16 (safeops' INTERPRETER_CONFIG, so the same key steps as
    the shipped interpreted forward), BLOCK_M 32 (subtile2: two 16-row halves) or 16."""
    return replace(cfg, block_m=32 if cfg.mode == 1 else 16, block_n=16, warps=1, stages=1)


def skip_steps(q, k, scale: float, block_m: int, block_n: int) -> int:
    """(Dense) how many (program, key block) steps after the first have no row max change, i.e. where
    exact-skip skips the rescale (from float64 scores; the margins of the skewed input are large)."""
    z = (q.double() @ k.double().transpose(-1, -2)) * scale
    b, h, s, _ = z.shape
    blk = z.reshape(b, h, s // block_m, block_m, s // block_n, block_n).amax(-1)  # (.., prog, row, key block)
    run = blk.cummax(-1).values
    same = (run[..., 1:] == run[..., :-1]).all(-2)  # every row of the program unchanged
    return int(same.sum())


def interpret_check(variants, dims=(64,), causals=(False, True), b=1, h=2, s=64, control=False) -> list[str]:
    """Runs every variant under the interpreter (fp16: the interpreter's bf16 tl.dot is wrong,
    triton-lang/triton#11584) against the float64 oracle and, bit for bit, safeops' interpreted forward, on
    random inputs (dense and causal) and on a skewed dense input (the keys after the first block shrunk
    64x, so every row's max is set in block 0 and exact-skip takes its branch). ``control``: also run the
    copy with BLOCK_N 32 (other online-softmax steps), which must NOT give the same bits (the bit
    comparison is not vacuous). Returns the failures (empty: all passed)."""
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("--interpret-check: set TRITON_INTERPRET=1 before triton is imported")
    os.environ.setdefault("SAFEOPS_BACKEND", "triton")
    import safeops  # noqa: F401

    sys.path.insert(0, str(ROOT / "tests"))
    import oracle

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    failures = []
    inputs = [(d, causal, False) for d in dims for causal in causals] + [(d, False, True) for d in dims]
    for d, causal, skew in inputs:
        q, k, v = (torch.randn(b, h, s, d, generator=gen) for _ in range(3))
        if skew:
            k[:, :, 16:] /= 64.0
        q, k, v = (t.to(torch.float16) for t in (q, k, v))
        scale = 1.0 / math.sqrt(d)
        ref = shipped_forward(q, k, v, causal, scale)
        ratio_of = oracle_check(oracle, q, k, v, causal, heads=h)
        tag = f"D={d} causal={int(causal)}{' skew' if skew else ''}"
        if skew:
            n = skip_steps(q, k, scale, 16, 16)
            print(f"interp {tag}: exact-skip skips {n} of {b * h * (s // 16) * (s // 16 - 1)} steps")
            if n == 0:
                failures.append(f"{tag}: the skewed input skips no step")
        for var in variants:
            if not var.runs(d):
                continue
            got = forward(small(var.cfg[d]), q, k, v, causal, scale)
            ratio = ratio_of(got)
            same, note = bits(got, ref)
            print(f"interp {tag} {var.name:14s} oracle {ratio:.3f} same bits: {same} {note}", flush=True)
            if ratio > 1.0 or not same:
                failures.append(f"{var.name} {tag}: oracle {ratio:.3f}, same bits {same}")
        if control:
            got = forward(replace(small(SHIPPED[d]), block_n=32), q, k, v, causal, scale)
            same, note = bits(got, ref)
            print(f"interp {tag} control BLOCK_N=32 same bits: {same} {note}")
            if same or ratio_of(got) > 1.0:
                failures.append(f"control {tag}: same bits {same} (expected not), oracle {ratio_of(got)}")
    return failures


# ------------------------------------------------------------------------------------------------------
# GPU run
# ------------------------------------------------------------------------------------------------------


def _warm_job(job, seqlen=4096):
    """Process-pool worker: compile one kernel into Triton's cache for this GPU (nothing is launched);
    MockTensor stands in for the (16-byte aligned) tensors, so the cache key equals the timed launch's."""
    import torch
    from triton.runtime.jit import MockTensor

    cfg, d, causal = job
    try:
        x, st = MockTensor(torch.bfloat16), MockTensor(torch.float32)
        launch(cfg, x, x, x, x, st, st, seqlen, d, causal, c1_of(1.0 / math.sqrt(d)), 64, warmup=True)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[-300:]}"


def _kernel_info(compiled) -> str:
    try:
        compiled._init_handles()
        return f"{compiled.n_regs}/{compiled.n_spills}/{compiled.metadata.shared}"
    except Exception as e:
        return f"(no metadata: {type(e).__name__})"


def run_case(b, h, s, d, causal, variants, args, H, A, oracle, rows, device="cuda", dtype=None,
             shrink=False, skip=None) -> None:
    """Checks and times the shipped forward, every variant and the peers on one (D, causal) case. A CPU dry
    run (tests/test_attn_fwd_variants.py) passes device "cpu", fp16 and shrink=True (interpreter blocks)."""
    import torch

    label = f"D{d} {'causal' if causal else 'dense'}"
    dtype = dtype or torch.bfloat16
    case = H.Case("fwd", dtype, (b, h, s, d, int(causal), 3))
    flops = A.flops(case)
    gen = torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    ref = shipped_forward(q, k, v, causal, scale)

    def tflops(ms: float) -> float:
        return flops / ms * 1e-9

    oracle_ratio = oracle_check(oracle, q, k, v, causal)
    ratio = oracle_ratio(ref)
    ms = H.bench_ms(lambda: shipped_forward(q, k, v, causal, scale))[0]
    rows.append((label, "safeops (shipped)", ms, tflops(ms), ratio, "ref", "", ""))
    print(f"{label}: safeops shipped {ms:.3f} ms {tflops(ms):.0f} TFLOP/s oracle {ratio:.3f}", flush=True)
    for var in variants:
        if not var.runs(d):
            continue
        if skip and (var.name, d, causal) in skip:  # failed to compile, or its probe crashed / hung
            rows.append((label, var.name, math.nan, math.nan, math.nan, "-", "",
                         f"skipped: {skip[(var.name, d, causal)][:200]}"))
            print(f"{label}: {var.name}: skipped: {skip[(var.name, d, causal)]}", flush=True)
            continue
        cfg = small(var.cfg[d]) if shrink else var.cfg[d]
        try:
            got = forward(cfg, q, k, v, causal, scale)
            if device == "cuda":
                torch.cuda.synchronize()
            ratio = oracle_ratio(got)
            same, note = bits(got, ref)
            want = same_bits_expected(var.cfg[d], d)
            bit = ("same" if same else "DIFF") + ("" if same == want else " (unexpected)")
            del got
            ms = H.bench_ms(lambda cfg=cfg: forward(cfg, q, k, v, causal, scale))[0]
            info = _kernel_info(COMPILED.get((cfg, d, causal)))
            status = "ok" if ratio <= 1.0 else "OVER BOUND"
            rows.append((label, f"{var.name} {cfg.label()}", ms, tflops(ms), ratio, bit, info,
                         status + (f"; {note}" if note else "")))
            print(f"{label}: {var.name:14s} {ms:.3f} ms {tflops(ms):5.0f} TFLOP/s oracle {ratio:.3f} "
                  f"bits {bit} {info} {status} {note}", flush=True)
        except Exception as e:
            rows.append((label, var.name, math.nan, math.nan, math.nan, "-", "",
                         f"error: {type(e).__name__}: {str(e)[:160]}"))
            print(f"{label}: {var.name}: error {type(e).__name__}: {str(e)[:300]}", flush=True)
    t = {"q": q, "k": k, "v": v, "causal": bool(causal)}
    peers = [] if args.no_cudnn else [("sdpa cudnn", A.sdpa_builder("CUDNN_ATTENTION"))]
    if not args.no_flex:
        peers.append(("flex", A.build_flex))
    for name, build in peers:
        try:
            fn = build(case, t)
            fn()
            ms = H.bench_ms(fn)[0]
            rows.append((label, name, ms, tflops(ms), math.nan, "-", "", ""))
            print(f"{label}: {name:14s} {ms:.3f} ms {tflops(ms):5.0f} TFLOP/s", flush=True)
        except Exception as e:
            rows.append((label, name, math.nan, math.nan, math.nan, "-", "",
                         f"error: {type(e).__name__}: {str(e)[:160]}"))


def table(rows, head: str) -> list[str]:
    lines = [head + "; TFLOP/s = 4 B H S^2 D (halved for causal) / time; oracle = max error / float64 bound "
             "on one head (<= 1 passes); bits = o, m, l vs the shipped forward; regs/spills/smem of the "
             "compiled variant", "",
             "| case | impl | ms | TFLOP/s | oracle | bits | regs/spills/smem | note |",
             "|---|---|---|---|---|---|---|---|"]
    for label, name, ms, tf, ratio, bit, info, note in rows:
        lines.append(f"| {label} | {name} | {ms:.3f} | {tf:.0f} | {ratio:.3f} | {bit} | {info} | {note} |")
    return lines


def probe_variants(variants, dims, causals, failures, timeout: float, seq: int) -> dict:
    """{(variant, d, causal): reason} for variants not to launch in this process: a kernel that failed to
    precompile, or (ws variants, mode 3) a first launch that crashed, hung or gave non-finite output in a
    subprocess (``--probe``), so that a hung warp-specialized kernel cannot hang the whole run."""
    skip = {}
    for var in variants:
        for d in dims:
            for causal in causals:
                if var.runs(d) and (var.cfg[d], d, causal) in failures:
                    skip[(var.name, d, causal)] = "compile failed: " + failures[(var.cfg[d], d, causal)]
    todo = [(v.name, d, c) for v in variants for d in dims for c in causals
            if v.runs(d) and v.cfg[d].mode == 3 and (v.name, d, c) not in skip]
    jobs = [((name, d, causal), ["--probe", f"{name},{d},{int(causal)}", "--seq", str(seq)])
            for name, d, causal in todo]  # the kernels are in Triton's cache already
    skip.update(_probes.run_probes(__file__, jobs, timeout, ROOT))
    return skip


def probe_main(spec: str, seq: int) -> int:
    """--probe NAME,D,CAUSAL: one forward of the variant at the timed size (B4 H16, bf16) on random inputs,
    synchronised; prints PROBE OK when it finished with finite outputs."""
    import torch

    import safeops  # noqa: F401  (the TMA allocator helper)

    name, d, causal = spec.split(",")
    d, causal = int(d), bool(int(causal))
    q, k, v = (torch.randn(4, 16, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o, m, l = forward(VARIANTS_BY_NAME[name].cfg[d], q, k, v, causal, 1.0 / math.sqrt(d))
    torch.cuda.synchronize()
    ok = bool(torch.isfinite(o).all()) and bool(torch.isfinite(m).all()) and bool(torch.isfinite(l).all())
    print("PROBE OK" if ok else "PROBE non-finite output", flush=True)
    return 0 if ok else 1


def gpu_main(args, variants, dims, causals) -> int:
    from concurrent.futures import ProcessPoolExecutor

    import torch

    sys.path.insert(0, str(HERE))
    import _harness as H

    H.require_cuda("bench/attn_fwd_variants.py")
    t_start = time.time()
    b, h, s = 4, 16, args.seq
    jobs = kernel_jobs(variants, dims, causals)
    pool = ProcessPoolExecutor(max(1, min(args.workers or (os.cpu_count() or 1), len(jobs))),
                               mp_context=__import__("multiprocessing").get_context("spawn"))
    futures = [pool.submit(_warm_job, j, s) for j in jobs]

    import safeops  # noqa: F401  (registers torch.ops.safeops)

    sys.path.insert(0, str(ROOT / "tests"))
    import attention as A  # bench/attention.py: the peers exactly as the main benchmark builds them
    import oracle

    warm_err = {}
    for d in dims:  # the shipped kernel and Flex compile here while the pool compiles the variants
        for causal in causals:
            x = torch.randn(1, 1, s, d, device="cuda", dtype=torch.bfloat16)
            shipped_forward(x, x, x, causal, 1.0 / math.sqrt(d))
            if not args.no_flex:
                try:
                    case = H.Case("fwd", torch.bfloat16, (b, h, s, d, int(causal), 3))
                    A.build_flex(case, A.make_inputs(case))()
                except Exception as e:
                    warm_err[(d, causal)] = f"{type(e).__name__}: {str(e)[:200]}"
    torch.cuda.synchronize()
    print(f"shipped + flex compiled: {time.time() - t_start:.1f} s", flush=True)
    failures = {}
    for j, f in zip(jobs, futures, strict=True):
        try:
            err = f.result(timeout=max(1.0, 600 - (time.time() - t_start)))
        except Exception as e:  # a worker that died (BrokenProcessPool) or a compile still running
            err = f"{type(e).__name__}: {str(e)[:200]}"
        if err:
            failures[j] = err
            print(f"compile FAILED {job_label(j)}: {err}", flush=True)
    pool.shutdown(wait=False, cancel_futures=True)
    print(f"precompiled {len(jobs)} variant kernels ({len(failures)} failed): {time.time() - t_start:.1f} s",
          flush=True)
    skip = probe_variants(variants, dims, causals, failures, args.probe_timeout, s)

    rows = []  # (case, impl, ms, tflops, oracle ratio, bits, regs/spills/smem, note)
    for d in dims:
        for causal in causals:
            run_case(b, h, s, d, causal, variants, args, H, A, oracle, rows, skip=skip)
            torch.cuda.empty_cache()
    head = (f"attention forward variants, B={b} H={h} S={s} bf16, {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}, triton {triton.__version__}")
    lines = table(rows, head)
    if failures or warm_err:
        lines += ["", "failures:"] + [f"  {job_label(j)}: {e}" for j, e in failures.items()] + \
            [f"  flex {k}: {e}" for k, e in warm_err.items()]
    lines.append(f"\ntotal {time.time() - t_start:.0f} s")
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "attn_fwd_variants.md").write_text(text + "\n")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", default="64,128")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--variants", default="", help="comma-separated names or 'all' (default: the defaults)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--no-cudnn", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--list", action="store_true")
    p.add_argument("--compile-only", action="store_true", help="offline sm_90 compile stats (no GPU)")
    p.add_argument("--interpret-check", action="store_true", help="CPU: oracle + bits vs the shipped path")
    p.add_argument("--probe", default="", help=argparse.SUPPRESS)  # NAME,D,CAUSAL (internal, see probe_main)
    p.add_argument("--probe-timeout", type=float, default=90.0,
                   help="seconds for the subprocess first launches of the ws variants (all run at once)")
    args = p.parse_args(argv)
    dims = tuple(int(x) for x in args.d.split(","))
    causals = tuple(bool(int(x)) for x in args.causal.split(","))
    if args.variants == "all":
        variants = VARIANTS
    else:
        variants = [VARIANTS_BY_NAME[n] for n in args.variants.split(",") if n]
        variants = variants or [v for v in VARIANTS if v.default]
    if args.list:
        for var in VARIANTS:
            cfgs = "; ".join(f"D{d}: {c.label()}" for d, c in var.cfg.items())
            print(f"{var.name:14s} {cfgs}{'' if var.default else '  [extra]'}\n{'':14s} {var.why}")
        return 0
    if args.probe:
        return probe_main(args.probe, args.seq)
    if args.compile_only:
        return compile_only(variants, dims, causals, args.workers or os.cpu_count() or 1)
    if args.interpret_check:
        failures = interpret_check(variants, dims=(64,) if args.d == "64,128" else dims, causals=causals,
                                   control=True)
        print("interpret check:", "all passed" if not failures else "FAILED: " + "; ".join(failures))
        return 1 if failures else 0
    return gpu_main(args, variants, dims, causals)


if __name__ == "__main__":
    # Run through the module name, so the process-pool workers (spawn) and this process define the kernel
    # in the same module (Triton's cache key) and pickle jobs by the same class names.
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    import attn_fwd_variants

    sys.exit(attn_fwd_variants.main())
