"""Experimental attention-backward kernels, checked and timed against the shipped ones in one GPU run.

Self-contained Triton kernels started from copies of ``attn_bwd_delta_kernel``, ``attn_bwd_dkdv_kernel`` and
``attn_bwd_dq_kernel`` (safeops/kernels/attention.py), cut down to the dense case: (B, H, S, D) contiguous,
MHA, S a multiple of 128, D in {64, 128}, bf16/fp16, optional top-left causal, no mask / softcap / window /
varlen. The numerics are the shipped ones, instruction for instruction (contract sections 1, 3, 4, 6):
``z2 = fp32(k q^T) * C1`` materialised once, ``p = exp2(min(z2 - m, 0)) * (1 / l)`` from the separate row
max and row sum, excluded keys selected to -inf, ``ds = p (dp - delta)`` with the scale (and in dq the row
factor 1 / l) applied to the accumulator once after the loop, as the shipped kernels do since 2026-11-29
23:09; no atomics; launched with ``enable_fp_fusion=False``. What changes is only the schedule:

- tile shapes / warps / stages per kernel (the flex-like dk/dv tile: 128 keys x 64 queries, 8 warps);
- ORDER=1: the two score dots of a step (``k q^T`` and ``v dO^T``) issued back to back before any
  elementwise work, then ``dv`` and ``dk`` (the same arithmetic, so the same bits);
- ORDER=2 (dk/dv and dq): software pipelining by hand: step i issues ``dp_i``, computes ``p_i`` from the
  scores carried over from step i-1, issues the NEXT block's score dot, computes ``ds_i``, then the two
  accumulating dots: one wgmma wait per step instead of two, the exp2 / ds work under running wgmma chains
  (FlashAttention-3's intra-warpgroup overlap); same bits; a second (L2-hit) load of q (dk/dv) or k (dq);
- TMA: the looped-over tiles (q, dO for dk/dv; k, v for dq) through host-side tensor descriptors;
- GROUP_HEADS=G (causal): a 1-D grid ordered block-major inside groups of G heads, i.e. longest programs of G
  heads first, shortest last (the shipped grid is longest-first per head, so its tail mixes lengths), while
  G heads' q/dO (dk/dv) stay in L2;
- fused: one launch whose programs are either dk/dv programs (a key block) or dq programs (a query block),
  as FlexAttention does, so the two kernels' tails overlap;
- WS (``ws*`` variants): Triton 3.6's automatic warp specialization of the loop (Hopper: one TMA producer
  warpgroup + two consumer warpgroups of 64 tile rows each, 12 warps). It needs 4 warps, 128-row tiles,
  every dot operand through TMA (the split ones through in-kernel descriptors) and one loop per kernel, so
  causal runs one loop with the causal select in every step (a no-op on fully visible blocks: same bits);
  these variants' first launch runs in a subprocess with a timeout (``probe``) so a hang is only a row.
  Details: scratch/notes_attn_bwd_ws.md.

A variant keeps the shipped bits when its dk/dv BLOCK_M and dq BLOCK_N equal the shipped ones (the order of
every fp32 accumulation is then the same); the harness checks that bit for bit, and checks every variant
against a float64 oracle (tests/oracle.py bounds, as the GPU tests) on one head.

    python3 bench/attn_bwd_variants.py [--d 64,128] [--causal 0,1] [--variants a,b] [--no-flex]
                                       [--no-cudnn] [--out DIR] [--workers N]
    python3 bench/attn_bwd_variants.py --list
    /tmp/t36/bin/python bench/attn_bwd_variants.py --compile-only [--d 128] [--variants ...]
    TRITON_INTERPRET=1 .venv/bin/python bench/attn_bwd_variants.py --interpret-check     (CPU, ~1 min)

The GPU run precompiles every variant kernel in a process pool (one per CPU, into Triton's cache) while the
main process compiles the shipped kernels and FlexAttention, then checks and times each case: B=4 H=16 S=4K,
bf16; whole backward (delta + dk/dv + dq) TFLOP/s (2.5x the forward flops, halved for causal), plus each
kernel alone. ``--compile-only`` (no GPU, no torch) compiles every variant for sm_90 and prints registers,
spills, shared memory and the SASS HGMMA count. Notes: scratch/notes_attn_bwd.md.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import struct
import sys
import time
from dataclasses import dataclass, field, replace
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


def _load_reduce():
    """safeops/kernels/reduce.py by path (triton only), so --compile-only works without torch / safeops."""
    import importlib.util

    path = ROOT / "safeops" / "kernels" / "reduce.py"
    spec = importlib.util.spec_from_file_location("safeops_kernels_reduce", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


row_sum_tree = _load_reduce().row_sum_tree


# ------------------------------------------------------------------------------------------------------
# Kernels (triton only: this part also runs under /tmp/t36 for --compile-only, where torch is missing)
# ------------------------------------------------------------------------------------------------------


@triton.jit
def v_delta_kernel(o_ptr, do_ptr, delta_ptr, n_heads, seqlen, so_b, so_h, so_s, sd_b, sd_h, sd_s,
                   st_b, st_h, st_s, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O) in fp32 (the shipped numerics, dense; shipped inside the dq kernel since
    session 8)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_b = pid_bh // n_heads
    pid_h = pid_bh % n_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = (offs_m < seqlen)[:, None] & (offs_d[None, :] < HEAD_DIM)
    o_base = o_ptr + pid_b.to(tl.int64) * so_b + pid_h.to(tl.int64) * so_h
    d_base = do_ptr + pid_b.to(tl.int64) * sd_b + pid_h.to(tl.int64) * sd_h
    o = tl.load(o_base + offs_m[:, None] * so_s + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    do = tl.load(d_base + offs_m[:, None] * sd_s + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    delta = row_sum_tree(o * do, BLOCK_M, HEAD_DIM)  # the shipped fixed order
    st = pid_b.to(tl.int64) * st_b + pid_h.to(tl.int64) * st_h + offs_m.to(tl.int64) * st_s
    tl.store(delta_ptr + st, delta, mask=offs_m < seqlen)


@triton.jit
def _stats(m_ptr, l_ptr, delta_ptr, offs):
    """(base, 1 / l, delta) as the shipped _row_stats (rows are in bounds here)."""
    m = tl.load(m_ptr + offs)
    l = tl.load(l_ptr + offs)
    delta = tl.load(delta_ptr + offs)
    base = tl.where(m == NEG_INF, 0.0, m)
    inv_l = tl.where(l == 0.0, 0.0, 1.0 / tl.where(l == 0.0, 1.0, l))
    return base, inv_l, delta


@triton.jit
def _head_desc(base, seqlen, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """An in-kernel TMA descriptor over one head's (S, D) rows. In-kernel, not host-side: Triton 3.6's Hopper
    warp specialization splits a 128-row tile between two consumer warpgroups and can shrink the box of an
    in-kernel descriptor to the 64-row halves, not that of a host descriptor (whose 128-row box it keeps
    while expecting 64 rows per copy; upstream triton #7658 / #11587)."""
    return tl.make_tensor_descriptor(base, [seqlen, HEAD_DIM], [HEAD_DIM, 1], [ROWS, HEAD_DIM])


@triton.jit
def _stats_tma(m_ptr, l_ptr, delta_ptr, seqlen, m0, ROWS: tl.constexpr):
    """_stats through in-kernel 1-D TMA descriptors over one head's rows (dq with TMA=3: a 128-row tile's
    statistics are an 'expensive' load for the warp-specialization pass, so they must come through TMA)."""
    m = tl.make_tensor_descriptor(m_ptr, [seqlen], [1], [ROWS]).load([m0])
    l = tl.make_tensor_descriptor(l_ptr, [seqlen], [1], [ROWS]).load([m0])
    delta = tl.make_tensor_descriptor(delta_ptr, [seqlen], [1], [ROWS]).load([m0])
    base = tl.where(m == NEG_INF, 0.0, m)
    inv_l = tl.where(l == 0.0, 0.0, 1.0 / tl.where(l == 0.0, 1.0, l))
    return base, inv_l, delta


@triton.jit
def _p(z, base, inv_l):
    return tl.exp2(tl.minimum(z - base, 0.0, propagate_nan=tl.PropagateNan.ALL)) * inv_l


@triton.jit
def _map(pid, n_blocks, GROUP_HEADS: tl.constexpr):
    """(head, block) of a 1-D program id: head-major (the shipped 2-D grid's order) or, with G heads per
    group, block-major inside each group of G heads."""
    if GROUP_HEADS == 0:
        bh = pid // n_blocks
        blk = pid % n_blocks
    else:
        per = GROUP_HEADS * n_blocks
        grp = pid // per
        r = pid % per
        blk = r // GROUP_HEADS
        bh = grp * GROUP_HEADS + r % GROUP_HEADS
    return bh, blk


@triton.jit
def _dkdv_loop(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, row0, stat_ptrs_m, stat_ptrs_l, stat_ptrs_d,
               offs_n, lo, hi, C1, scale_ds,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, STAGES: tl.constexpr,
               ORDER: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr = False):
    """One key block's dk, dv over query blocks [lo, hi): sT = k q^T (keys x queries), as shipped.
    WS: Triton's automatic warp specialization of this loop (Hopper: the autoWS pass; see Kcfg.ws)."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=STAGES, warp_specialize=WS):
        offs_m = start_m + offs_m0
        if TMA:
            q = q_desc.load([row0 + start_m, 0])
            do = do_desc.load([row0 + start_m, 0])
        else:
            q = tl.load(q_ptrs + start_m * HEAD_DIM)
            do = tl.load(do_ptrs + start_m * HEAD_DIM)
        base, inv_l, delta = _stats(stat_ptrs_m, stat_ptrs_l, stat_ptrs_d, offs_m)
        sT = tl.dot(k, tl.trans(q), tl.zeros([k.shape[0], BLOCK_M], tl.float32))
        if ORDER == 1:
            dpT = tl.dot(v, tl.trans(do), tl.zeros([k.shape[0], BLOCK_M], tl.float32))
        zT = sT * C1
        if MASKED:
            zT = tl.where(offs_n[:, None] <= offs_m[None, :], zT, NEG_INF)
        pT = _p(zT, base[None, :], inv_l[None, :])
        if ORDER == 0:
            dv = tl.dot(pT.to(do.dtype), do, dv)
            dpT = tl.dot(v, tl.trans(do), tl.zeros([k.shape[0], BLOCK_M], tl.float32))
        dsT = pT * (dpT - delta[None, :])
        if ORDER == 1:
            dv = tl.dot(pT.to(do.dtype), do, dv)
        dk = tl.dot(dsT.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _dkdv_loop_pipelined(dk, dv, k, v, q_ptrs, do_ptrs, stat_ptrs_m, stat_ptrs_l, stat_ptrs_d, offs_n, lo, hi,
                         C1, scale_ds, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                         STAGES: tl.constexpr):
    """ORDER=2: the scores of the NEXT query block are computed inside this step (software pipelining by
    hand, FlashAttention-3's intra-warpgroup overlap): step i issues dpT_i, computes p_i (overlapping that
    wgmma chain), issues sT_{i+1}, computes ds_i (overlapping it), then dv, dk. Same arithmetic per element
    as the other orders, so the same bits; q is loaded twice (for sT_{i+1} here, for dk in the next step)."""
    offs_m0 = tl.arange(0, BLOCK_M)
    q0 = tl.load(q_ptrs + lo * HEAD_DIM, mask=(lo + offs_m0 < hi)[:, None], other=0.0)
    sT = tl.dot(k, tl.trans(q0), tl.zeros([k.shape[0], BLOCK_M], tl.float32))
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=STAGES):
        offs_m = start_m + offs_m0
        q = tl.load(q_ptrs + start_m * HEAD_DIM)
        do = tl.load(do_ptrs + start_m * HEAD_DIM)
        base, inv_l, delta = _stats(stat_ptrs_m, stat_ptrs_l, stat_ptrs_d, offs_m)
        dpT = tl.dot(v, tl.trans(do), tl.zeros([k.shape[0], BLOCK_M], tl.float32))
        zT = sT * C1
        if MASKED:
            zT = tl.where(offs_n[:, None] <= offs_m[None, :], zT, NEG_INF)
        pT = _p(zT, base[None, :], inv_l[None, :])
        nxt = start_m + BLOCK_M
        q_next = tl.load(q_ptrs + nxt * HEAD_DIM, mask=(nxt + offs_m0 < hi)[:, None], other=0.0)
        sT = tl.dot(k, tl.trans(q_next), tl.zeros([k.shape[0], BLOCK_M], tl.float32))
        dsT = pT * (dpT - delta[None, :])
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dk = tl.dot(dsT.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _dkdv_program(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, q_desc, do_desc,
                  bh, blk, seqlen, C1, scale_ds,
                  HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  STAGES: tl.constexpr, ORDER: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr = 0):
    n0 = blk * BLOCK_N
    head = bh.to(tl.int64) * seqlen * HEAD_DIM
    row0 = bh * seqlen
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_m0 = tl.arange(0, BLOCK_M)
    if TMA >= 2:  # k, v through in-kernel TMA descriptors (see Kcfg.ws)
        k = _head_desc(k_ptr + head, seqlen, HEAD_DIM, BLOCK_N).load([n0, 0])
        v = _head_desc(v_ptr + head, seqlen, HEAD_DIM, BLOCK_N).load([n0, 0])
    else:
        k = tl.load(k_ptr + head + offs_n[:, None] * HEAD_DIM + offs_d[None, :])
        v = tl.load(v_ptr + head + offs_n[:, None] * HEAD_DIM + offs_d[None, :])
    q_ptrs = q_ptr + head + offs_m0[:, None] * HEAD_DIM + offs_d[None, :]
    do_ptrs = do_ptr + head + offs_m0[:, None] * HEAD_DIM + offs_d[None, :]
    st = bh.to(tl.int64) * seqlen
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    if ORDER == 2:
        if CAUSAL:
            # The few masked diagonal steps with the plain loop (order 1): a second pipelined loop would
            # need its own smem buffers (123648 B instead of 115456 at D=128: 1 CTA/SM instead of 2).
            lo = (n0 // BLOCK_M) * BLOCK_M
            a = tl.minimum(tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, seqlen)
            dk, dv = _dkdv_loop(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, row0, m_ptr + st, l_ptr + st,
                                delta_ptr + st, offs_n, lo, a, C1, scale_ds, HEAD_DIM, BLOCK_M, True, STAGES,
                                1, TMA)
            dk, dv = _dkdv_loop_pipelined(dk, dv, k, v, q_ptrs, do_ptrs, m_ptr + st, l_ptr + st,
                                          delta_ptr + st, offs_n, a, seqlen, C1, scale_ds, HEAD_DIM, BLOCK_M,
                                          False, STAGES)
        else:
            dk, dv = _dkdv_loop_pipelined(dk, dv, k, v, q_ptrs, do_ptrs, m_ptr + st, l_ptr + st,
                                          delta_ptr + st, offs_n, 0, seqlen, C1, scale_ds, HEAD_DIM, BLOCK_M,
                                          False, STAGES)
    elif CAUSAL and WS == 3:
        # One loop over [lo, S), the causal select in every step (a no-op on the fully visible blocks, so the
        # same bits): Triton 3.6's Hopper warp specialization fails on a function with two loops.
        lo = (n0 // BLOCK_M) * BLOCK_M
        dk, dv = _dkdv_loop(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, row0, m_ptr + st, l_ptr + st,
                            delta_ptr + st, offs_n, lo, seqlen, C1, scale_ds, HEAD_DIM, BLOCK_M, True, STAGES,
                            ORDER, TMA, True)
    elif CAUSAL:
        # The shipped _block_ranges for "query i sees key j iff j <= i": [lo, a) masked, [a, S) full.
        lo = (n0 // BLOCK_M) * BLOCK_M
        a = tl.minimum(tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, seqlen)
        dk, dv = _dkdv_loop(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, row0, m_ptr + st, l_ptr + st,
                            delta_ptr + st, offs_n, lo, a, C1, scale_ds, HEAD_DIM, BLOCK_M, True, STAGES,
                            ORDER, TMA, WS == 1)
        dk, dv = _dkdv_loop(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, row0, m_ptr + st, l_ptr + st,
                            delta_ptr + st, offs_n, a, seqlen, C1, scale_ds, HEAD_DIM, BLOCK_M, False, STAGES,
                            ORDER, TMA, WS > 0)
    else:
        dk, dv = _dkdv_loop(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, row0, m_ptr + st, l_ptr + st,
                            delta_ptr + st, offs_n, 0, seqlen, C1, scale_ds, HEAD_DIM, BLOCK_M, False, STAGES,
                            ORDER, TMA, WS > 0)
    dk = dk * scale_ds  # the constant factor once, after the loop (as the shipped kernel since 23:09)
    out = head + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dk_ptr + out, dk.to(dk_ptr.dtype.element_ty))
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty))


@triton.jit
def _dq_loop(dq, q, do, base, inv_l, delta, k_ptrs, v_ptrs, k_desc, v_desc, row0, offs_m, lo, hi, C1,
             scale_ds, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
             STAGES: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr = False):
    """One query block's dq over key blocks [lo, hi): s = q k^T (queries x keys), as shipped."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        offs_n = start_n + offs_n0
        if TMA:
            k = k_desc.load([row0 + start_n, 0])
            v = v_desc.load([row0 + start_n, 0])
        else:
            k = tl.load(k_ptrs + start_n * HEAD_DIM)
            v = tl.load(v_ptrs + start_n * HEAD_DIM)
        s = tl.dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], tl.float32))
        z = s * C1
        if MASKED:
            z = tl.where(offs_n[None, :] <= offs_m[:, None], z, NEG_INF)
        p = tl.exp2(tl.minimum(z - base[:, None], 0.0, propagate_nan=tl.PropagateNan.ALL))  # 1/l later
        dp = tl.dot(do, tl.trans(v), tl.zeros([q.shape[0], BLOCK_N], tl.float32))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _dq_loop_pipelined(dq, q, do, base, inv_l, delta, k_ptrs, v_ptrs, offs_m, lo, hi, C1, scale_ds,
                       HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                       STAGES: tl.constexpr):
    """ORDER=2 for dq: step j issues dp_j, computes p_j from s_j (overlapping it), issues s_{j+1}, computes
    ds_j (overlapping it), then dq. Same bits; k is loaded twice."""
    offs_n0 = tl.arange(0, BLOCK_N)
    k0 = tl.load(k_ptrs + lo * HEAD_DIM, mask=(lo + offs_n0 < hi)[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k0), tl.zeros([q.shape[0], BLOCK_N], tl.float32))
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        offs_n = start_n + offs_n0
        k = tl.load(k_ptrs + start_n * HEAD_DIM)
        v = tl.load(v_ptrs + start_n * HEAD_DIM)
        dp = tl.dot(do, tl.trans(v), tl.zeros([q.shape[0], BLOCK_N], tl.float32))
        z = s * C1
        if MASKED:
            z = tl.where(offs_n[None, :] <= offs_m[:, None], z, NEG_INF)
        p = tl.exp2(tl.minimum(z - base[:, None], 0.0, propagate_nan=tl.PropagateNan.ALL))  # 1/l later
        nxt = start_n + BLOCK_N
        k_next = tl.load(k_ptrs + nxt * HEAD_DIM, mask=(nxt + offs_n0 < hi)[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k_next), tl.zeros([q.shape[0], BLOCK_N], tl.float32))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _dq_program(q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, m_ptr, l_ptr, delta_ptr, k_desc, v_desc,
                bh, blk, seqlen, C1, scale_ds,
                HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                STAGES: tl.constexpr, TMA: tl.constexpr, ORDER: tl.constexpr, WS: tl.constexpr = 0):
    m0 = blk * BLOCK_M
    head = bh.to(tl.int64) * seqlen * HEAD_DIM
    row0 = bh * seqlen
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n0 = tl.arange(0, BLOCK_N)
    rows = head + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    if TMA >= 2:  # q, dO through in-kernel TMA descriptors (see Kcfg.ws)
        q = _head_desc(q_ptr + head, seqlen, HEAD_DIM, BLOCK_M).load([m0, 0])
        do = _head_desc(do_ptr + head, seqlen, HEAD_DIM, BLOCK_M).load([m0, 0])
    else:
        q = tl.load(q_ptr + rows)
        do = tl.load(do_ptr + rows)
    if TMA >= 3:  # the row statistics through in-kernel 1-D TMA descriptors as well
        st0 = bh.to(tl.int64) * seqlen
        base, inv_l, delta = _stats_tma(m_ptr + st0, l_ptr + st0, delta_ptr + st0, seqlen, m0, BLOCK_M)
    else:
        base, inv_l, delta = _stats(m_ptr, l_ptr, delta_ptr, bh.to(tl.int64) * seqlen + offs_m)
    k_ptrs = k_ptr + head + offs_n0[:, None] * HEAD_DIM + offs_d[None, :]
    v_ptrs = v_ptr + head + offs_n0[:, None] * HEAD_DIM + offs_d[None, :]
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if ORDER == 2:
        if CAUSAL:  # the masked diagonal steps with the plain loop, as in dk/dv
            b = ((m0 + 1) // BLOCK_N) * BLOCK_N
            dq = _dq_loop_pipelined(dq, q, do, base, inv_l, delta, k_ptrs, v_ptrs, offs_m, 0, b, C1, scale_ds,
                                    HEAD_DIM, BLOCK_N, False, STAGES)
            dq = _dq_loop(dq, q, do, base, inv_l, delta, k_ptrs, v_ptrs, k_desc, v_desc, row0, offs_m, b,
                          m0 + BLOCK_M, C1, scale_ds, HEAD_DIM, BLOCK_N, True, STAGES, TMA)
        else:
            dq = _dq_loop_pipelined(dq, q, do, base, inv_l, delta, k_ptrs, v_ptrs, offs_m, 0, seqlen, C1,
                                    scale_ds, HEAD_DIM, BLOCK_N, False, STAGES)
    elif CAUSAL and WS == 3:  # one loop, the causal select in every step (see _dkdv_program)
        dq = _dq_loop(dq, q, do, base, inv_l, delta, k_ptrs, v_ptrs, k_desc, v_desc, row0, offs_m, 0,
                      m0 + BLOCK_M, C1, scale_ds, HEAD_DIM, BLOCK_N, True, STAGES, TMA, True)
    elif CAUSAL:
        # The shipped _block_ranges for "key j visible iff j <= i": [0, b) full, [b, m0 + BLOCK_M) masked.
        b = ((m0 + 1) // BLOCK_N) * BLOCK_N
        dq = _dq_loop(dq, q, do, base, inv_l, delta, k_ptrs, v_ptrs, k_desc, v_desc, row0, offs_m, 0, b, C1,
                      scale_ds, HEAD_DIM, BLOCK_N, False, STAGES, TMA, WS > 0)
        dq = _dq_loop(dq, q, do, base, inv_l, delta, k_ptrs, v_ptrs, k_desc, v_desc, row0, offs_m, b,
                      m0 + BLOCK_M, C1, scale_ds, HEAD_DIM, BLOCK_N, True, STAGES, TMA, WS == 1)
    else:
        dq = _dq_loop(dq, q, do, base, inv_l, delta, k_ptrs, v_ptrs, k_desc, v_desc, row0, offs_m, 0, seqlen,
                      C1, scale_ds, HEAD_DIM, BLOCK_N, False, STAGES, TMA, WS > 0)
    dq = dq * (inv_l * scale_ds)[:, None]  # row factor 1 / l and the scale once, after the loop (as shipped)
    tl.store(dq_ptr + rows, dq.to(dq_ptr.dtype.element_ty))


@triton.jit
def v_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, q_desc, do_desc,
                  seqlen, n_blocks, C1, scale_ds,
                  HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  STAGES: tl.constexpr, ORDER: tl.constexpr, TMA: tl.constexpr, GROUP_HEADS: tl.constexpr,
                  WS: tl.constexpr = 0):
    bh, blk = _map(tl.program_id(0), n_blocks, GROUP_HEADS)
    # Causal: key block 0 sees every query, so ascending blocks are longest first.
    _dkdv_program(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, q_desc, do_desc,
                  bh, blk, seqlen, C1, scale_ds, HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N, STAGES,
                  ORDER, TMA, WS)


@triton.jit
def v_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, m_ptr, l_ptr, delta_ptr, k_desc, v_desc,
                seqlen, n_blocks, C1, scale_ds,
                HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                STAGES: tl.constexpr, TMA: tl.constexpr, GROUP_HEADS: tl.constexpr, ORDER: tl.constexpr,
                WS: tl.constexpr = 0):
    bh, blk = _map(tl.program_id(0), n_blocks, GROUP_HEADS)
    if CAUSAL:  # the last query block sees every key: longest first (the shipped REVERSE)
        blk = n_blocks - 1 - blk
    _dq_program(q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, m_ptr, l_ptr, delta_ptr, k_desc, v_desc,
                bh, blk, seqlen, C1, scale_ds, HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N, STAGES, TMA,
                ORDER, WS)


@triton.jit
def v_fused_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr,
                   seqlen, n_kv_blocks, n_q_blocks, C1, scale_ds,
                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                   BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, STAGES1: tl.constexpr, ORDER: tl.constexpr,
                   BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, STAGES2: tl.constexpr,
                   ORDER2: tl.constexpr, GROUP_HEADS: tl.constexpr):
    """One launch: each program is a dk/dv program (a key block) or a dq program (a query block).

    GROUP_HEADS == 0: per head, its n_kv_blocks dk/dv programs then its n_q_blocks dq programs (Flex's
    order). GROUP_HEADS > 0 (needs n_kv_blocks == n_q_blocks): per group of heads, slot t alternates dk/dv
    block t // 2 and dq block t // 2, both longest first under causal, block-major over the group's heads."""
    pid = tl.program_id(0)
    if GROUP_HEADS == 0:
        bh, t = _map(pid, n_kv_blocks + n_q_blocks, 0)
        is_kv = t < n_kv_blocks
        blk = tl.where(is_kv, t, t - n_kv_blocks)
    else:
        bh, t = _map(pid, 2 * n_kv_blocks, GROUP_HEADS)
        is_kv = (t % 2) == 0
        blk = t // 2
    if is_kv:
        _dkdv_program(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, q_ptr, do_ptr,
                      bh, blk, seqlen, C1, scale_ds, HEAD_DIM, CAUSAL, BLOCK_M1, BLOCK_N1,
                      STAGES1, ORDER, False)
    else:
        if CAUSAL:
            blk = n_q_blocks - 1 - blk
        _dq_program(q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, m_ptr, l_ptr, delta_ptr, k_ptr, v_ptr,
                    bh, blk, seqlen, C1, scale_ds, HEAD_DIM, CAUSAL, BLOCK_M2, BLOCK_N2, STAGES2, False,
                    ORDER2)


# ------------------------------------------------------------------------------------------------------
# Variants
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kcfg:
    block_m: int  # dk/dv: queries per step; dq: queries per program
    block_n: int  # dk/dv: keys per program; dq: keys per step
    warps: int
    stages: int
    order: int = 0  # 1 = both score dots first (dk/dv only); 2 = next block's scores inside this step
    # TMA: 1 (or True) the looped-over tiles through host descriptors; 2 also the program's fixed tiles (k, v
    # in dk/dv; q, dO in dq) through in-kernel descriptors; 3 (dq) also the row statistics (1-D, in-kernel)
    tma: int = 0
    group_heads: int = 0  # 0 = the shipped order; G = block-major over groups of G heads
    # tl.range(warp_specialize=...): 0 off; 1 on every loop; 2 causal: the unmasked loop only; 3 causal: one
    # loop with the causal select in every step, warp-specialized (the only causal form Triton 3.6 compiles)
    ws: int = 0

    def label(self) -> str:
        tma = " tma" if self.tma == 1 else f" tma{self.tma}" if self.tma else ""
        extra = (f" o{self.order}" if self.order else "") + tma + \
            (f" g{self.group_heads}" if self.group_heads else "") + (f" ws{self.ws}" if self.ws else "")
        return f"({self.block_m},{self.block_n},{self.warps}w,{self.stages}s{extra})"


@dataclass(frozen=True)
class Fused:
    dkdv: Kcfg
    dq: Kcfg  # warps must equal dkdv's (one launch)
    group_heads: int = 0


@dataclass(frozen=True)
class Variant:
    name: str
    why: str
    dkdv: dict = field(default_factory=dict)  # head dim -> Kcfg (missing: the shipped-config copy)
    dq: dict = field(default_factory=dict)
    fused: dict = field(default_factory=dict)  # head dim -> Fused (replaces dkdv + dq)
    causal_only: bool = False
    dims: tuple = (64, 128)  # head dims it runs at
    default: bool = True  # in the default list
    probe: bool = False  # GPU run: first launch in a subprocess with a timeout (a hang or crash is a row)

    def runs(self, d: int, causal: bool) -> bool:
        return d in self.dims and (causal or not self.causal_only)


# The shipped configurations (safeops/ops/attention_launch.py at the time of writing), copied.
SHIPPED_DKDV = {64: Kcfg(32, 128, 4, 2), 128: Kcfg(32, 64, 4, 3)}
SHIPPED_DQ = {64: Kcfg(64, 64, 4, 2), 128: Kcfg(128, 64, 8, 2)}


def _both(cfg: Kcfg) -> dict:
    return {64: cfg, 128: cfg}


WS_DKDV = Kcfg(32, 128, 4, 2, tma=2, ws=3)  # k, v in-kernel TMA descriptors; q, dO host descriptors
WS_DQ = Kcfg(128, 64, 4, 2, tma=3, ws=3)  # q, dO, row statistics in-kernel descriptors; k, v host ones
ORDER2_DKDV = {128: Kcfg(32, 64, 4, 3, order=2), 64: Kcfg(32, 64, 4, 3, order=2)}
ORDER2_DQ = {128: Kcfg(128, 64, 8, 2, order=2), 64: Kcfg(64, 64, 4, 2, order=2)}
VARIANTS = [
    Variant("copy", "shipped configs in the simplified kernels: must give the shipped bits; kernel split"),
    Variant("order1", "dk/dv: both score dots first (sT, dpT), then dv, dk; shipped tiles, same bits",
            dkdv={d: replace(c, order=1) for d, c in SHIPPED_DKDV.items()}),
    Variant("order2", "dk/dv and dq: next block's scores issued inside this step (hand pipelining), same"
            " bits; D=64 dk/dv 64 keys x 32 queries, 3 stages (32x128 spills 0.2-0.5 KB with order 2)",
            dkdv=ORDER2_DKDV, dq=ORDER2_DQ),
    Variant("order2-w8", "dk/dv 128 keys x 32 queries, 8 warps, 3 stages, order 2, two warpgroups; same bits",
            dkdv=_both(Kcfg(32, 128, 8, 3, order=2))),
    Variant("kv-flex", "Flex's sm90 dk/dv tile: 128 keys x 64 queries, 8 warps, 3 stages",
            dkdv=_both(Kcfg(64, 128, 8, 3))),
    Variant("kv-flex-o2", "D=64: Flex's dk/dv tile with order 2 (no spill at D=64; 0.5 KB at D=128) and the"
            " order-2 dq", dkdv={64: Kcfg(64, 128, 8, 3, order=2)}, dq={64: ORDER2_DQ[64]}, dims=(64,)),
    Variant("dq128s3", "dq 128 queries x 64 keys, 8 warps, 3 stages (same dq bits); dk/dv shipped",
            dq=_both(Kcfg(128, 64, 8, 3))),
    Variant("fused-flex", "one launch, Flex's tiles (dk/dv 64x128, dq 128x64, 8 warps, 3 stages)",
            fused=_both(Fused(Kcfg(64, 128, 8, 3), Kcfg(128, 64, 8, 3)))),
    Variant("lpt8", "causal: longest-first over groups of 8 heads for both kernels (same bits)",
            dkdv={d: replace(c, group_heads=8) for d, c in SHIPPED_DKDV.items()},
            dq={d: replace(c, group_heads=8) for d, c in SHIPPED_DQ.items()}, causal_only=True),
    Variant("order2-lpt8", "causal: order2 with the longest-first order over groups of 8 heads (same bits)",
            dkdv={d: replace(c, group_heads=8) for d, c in ORDER2_DKDV.items()},
            dq={d: replace(c, group_heads=8) for d, c in ORDER2_DQ.items()}, causal_only=True),
    # Extras (not in the default list; --variants NAME):
    Variant("kv128x32w8", "dk/dv 128 keys x 32 queries, 8 warps, 3 stages, order 0 (control for order2-w8)",
            dkdv=_both(Kcfg(32, 128, 8, 3)), default=False),
    Variant("kv64x64", "D=64 dk/dv 64 x 64, 4 warps, 2 stages, order 0 (control for order2 at D=64)",
            dkdv={64: Kcfg(64, 64, 4, 2)}, dims=(64,), default=False),
    Variant("tma", "q/dO (dk/dv) and k/v (dq) through host TMA descriptors, shipped tiles (same bits)",
            dkdv={d: replace(c, tma=True) for d, c in SHIPPED_DKDV.items()},
            dq={d: replace(c, tma=True) for d, c in SHIPPED_DQ.items()}, default=False),
    # Triton 3.6 automatic warp specialization (Hopper: 1 TMA producer + 2 consumer warpgroups, each consumer
    # 64 of the 128 tile rows; 12 warps, setmaxnreg 40 / 232). Same bits as shipped expected (dk/dv BLOCK_M
    # 32, dq BLOCK_N 64); causal as one loop with the select in every step. scratch/notes_attn_bwd_ws.md.
    Variant("ws", "autoWS both kernels: dk/dv 128 keys x 32 queries, dq 128 queries x 64 keys, 4 warps per"
            " group, 2 stages, all dot operands via TMA (same bits)", dkdv=_both(WS_DKDV), dq=_both(WS_DQ),
            probe=True),
    Variant("ws-s3", "ws with 3 stages (TMA buffers) in both kernels (same bits)",
            dkdv=_both(replace(WS_DKDV, stages=3)), dq=_both(replace(WS_DQ, stages=3)), probe=True),
    Variant("ws-kv", "autoWS dk/dv only, shipped dq (same bits)", dkdv=_both(WS_DKDV), probe=True),
    Variant("ws-dq", "autoWS dq only, shipped dk/dv (same bits)", dq=_both(WS_DQ), probe=True),
    Variant("ws-kv64", "ws with 64 queries per dk/dv step (wider wgmma N; dk/dv bits differ)",
            dkdv=_both(replace(WS_DKDV, block_m=64)), dq=_both(WS_DQ), probe=True),
]
VARIANTS_BY_NAME = {v.name: v for v in VARIANTS}


def plan(variant: Variant, d: int) -> tuple[Kcfg | None, Kcfg | None, Fused | None]:
    if d in variant.fused:
        return None, None, variant.fused[d]
    return variant.dkdv.get(d, SHIPPED_DKDV[d]), variant.dq.get(d, SHIPPED_DQ[d]), None


def same_bits_expected(variant: Variant, d: int) -> bool:
    kv, dq, fused = plan(variant, d)
    if fused is not None:
        kv, dq = fused.dkdv, fused.dq
    return kv.block_m == SHIPPED_DKDV[d].block_m and dq.block_n == SHIPPED_DQ[d].block_n


# ------------------------------------------------------------------------------------------------------
# Launching (one function for real launches and for warm-up compiles, so both hit the same cache entry)
# ------------------------------------------------------------------------------------------------------

DELTA_BLOCK_M = 64


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def constants(scale: float) -> tuple[float, float]:
    """(C1, scale_ds) exactly as attention_launch.constants(scale, None)."""
    return _f32(scale * 1.4426950408889634), _f32(scale)


def _opts(warps: int) -> dict:
    return {"num_warps": warps, "enable_fp_fusion": False}


def _desc(t, rows: int, d: int, block_rows: int):
    """Host-side TMA descriptor over the (B * H * S, D) rows of a contiguous (B, H, S, D) tensor."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, [rows, d], [d, 1], [block_rows, d])


COMPILED: dict = {}  # (kind, cfg, d, causal) -> the CompiledKernel of the last launch (for n_regs / n_spills)


def launch_dkdv(cfg: Kcfg, q, k, v, do, dk, dv, m, l, delta, seqlen, d, causal, c1, sds, bh, warmup=False):
    n_blocks = seqlen // cfg.block_n
    grid = (n_blocks * bh,)
    if cfg.tma:
        qd, dod = _desc(q, bh * seqlen, d, cfg.block_m), _desc(do, bh * seqlen, d, cfg.block_m)
    else:
        qd, dod = q, do
    args = (q, k, v, do, dk, dv, m, l, delta, qd, dod, seqlen, n_blocks, c1, sds)
    kw = dict(HEAD_DIM=d, CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
              ORDER=cfg.order, TMA=cfg.tma, GROUP_HEADS=cfg.group_heads, WS=cfg.ws, **_opts(cfg.warps))
    if warmup:
        return v_dkdv_kernel.warmup(*args, grid=grid, **kw)
    COMPILED[("dkdv", cfg, d, causal)] = v_dkdv_kernel[grid](*args, **kw)
    return COMPILED[("dkdv", cfg, d, causal)]


def launch_dq(cfg: Kcfg, q, k, v, do, dq, m, l, delta, seqlen, d, causal, c1, sds, bh, warmup=False):
    n_blocks = seqlen // cfg.block_m
    grid = (n_blocks * bh,)
    if cfg.tma:
        kd, vd = _desc(k, bh * seqlen, d, cfg.block_n), _desc(v, bh * seqlen, d, cfg.block_n)
    else:
        kd, vd = k, v
    args = (q, k, v, do, dq, m, l, delta, kd, vd, seqlen, n_blocks, c1, sds)
    kw = dict(HEAD_DIM=d, CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
              TMA=cfg.tma, GROUP_HEADS=cfg.group_heads, ORDER=cfg.order, WS=cfg.ws, **_opts(cfg.warps))
    if warmup:
        return v_dq_kernel.warmup(*args, grid=grid, **kw)
    COMPILED[("dq", cfg, d, causal)] = v_dq_kernel[grid](*args, **kw)
    return COMPILED[("dq", cfg, d, causal)]


def launch_fused(f: Fused, q, k, v, do, dq, dk, dv, m, l, delta, seqlen, d, causal, c1, sds, bh,
                 warmup=False):
    assert f.dkdv.warps == f.dq.warps, "one launch: one warp count"
    n_kv, n_q = seqlen // f.dkdv.block_n, seqlen // f.dq.block_m
    assert f.group_heads == 0 or n_kv == n_q, "interleaved order needs as many key blocks as query blocks"
    grid = ((n_kv + n_q) * bh,)
    args = (q, k, v, do, dq, dk, dv, m, l, delta, seqlen, n_kv, n_q, c1, sds)
    kw = dict(HEAD_DIM=d, CAUSAL=causal, BLOCK_M1=f.dkdv.block_m, BLOCK_N1=f.dkdv.block_n,
              STAGES1=f.dkdv.stages, ORDER=f.dkdv.order, BLOCK_M2=f.dq.block_m, BLOCK_N2=f.dq.block_n,
              STAGES2=f.dq.stages, ORDER2=f.dq.order, GROUP_HEADS=f.group_heads, **_opts(f.dkdv.warps))
    if warmup:
        return v_fused_kernel.warmup(*args, grid=grid, **kw)
    COMPILED[("fused", f, d, causal)] = v_fused_kernel[grid](*args, **kw)
    return COMPILED[("fused", f, d, causal)]


def launch_delta(o, do, delta, b, h, s, d, warmup=False):
    grid = (triton.cdiv(s, DELTA_BLOCK_M), b * h)
    strides = (h * s * d, s * d, d)  # contiguous (B, H, S, D); stats (B, H, S)
    args = (o, do, delta, h, s, *strides, *strides, h * s, s, 1)
    kw = dict(HEAD_DIM=d, BLOCK_M=DELTA_BLOCK_M, **_opts(4))
    if warmup:
        return v_delta_kernel.warmup(*args, grid=grid, **kw)
    return v_delta_kernel[grid](*args, **kw)


def check_shape(q, variant: Variant):
    b, h, s, d = q.shape
    if d not in (64, 128) or s % 128 or not q.is_contiguous():
        raise ValueError("q: the variants take contiguous (B, H, S, D) with D in {64, 128} and S % 128 == 0")
    for dd in (64, 128):
        kv, dq, fused = plan(variant, dd)
        for c in (kv, dq) + ((fused.dkdv, fused.dq) if fused else ()):
            g = c.group_heads if c else 0
            if g and (b * h) % g:
                raise ValueError(f"batch x heads {b * h} is not a multiple of group_heads {g}")


def backward(variant: Variant, g, q, k, v, o, m, l, causal: bool, scale: float, which: str = "all"):
    """(dq, dk, dv) of the variant; which = "all" | "delta" | "dkdv" | "dq" (one kernel alone, for timing:
    "dkdv"/"dq" reuse the delta of the previous call, held in m's ``_v_delta`` attribute)."""
    import torch

    b, h, s, d = q.shape
    c1, sds = constants(scale)
    kv, qc, fused = plan(variant, d)
    if q.is_cuda and any(c is not None and c.tma >= 2 for c in (kv, qc)):
        from safeops.ops._launch import ensure_tma_allocator  # in-kernel descriptors need global scratch

        ensure_tma_allocator()
    delta = getattr(m, "_v_delta", None)
    if delta is None or which in ("all", "delta"):
        delta = torch.empty_like(m)
        launch_delta(o, g, delta, b, h, s, d)
        m._v_delta = delta
    dq = dk = dv = None
    if which in ("all", "dkdv", "dq"):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if fused is not None and which != "delta":
        launch_fused(fused, q, k, v, g, dq, dk, dv, m, l, delta, s, d, causal, c1, sds, b * h)
        return dq, dk, dv
    if which in ("all", "dkdv"):
        launch_dkdv(kv, q, k, v, g, dk, dv, m, l, delta, s, d, causal, c1, sds, b * h)
    if which in ("all", "dq"):
        launch_dq(qc, q, k, v, g, dq, m, l, delta, s, d, causal, c1, sds, b * h)
    return dq, dk, dv


def kernel_jobs(variants, dims, causals) -> list[tuple]:
    """Distinct (kind, cfg, d, causal) kernels the run needs."""
    jobs = []
    for d in dims:
        for causal in causals:
            jobs.append(("delta", None, d, causal))
            for var in variants:
                if not var.runs(d, causal):
                    continue
                kv, qc, fused = plan(var, d)
                if fused is not None:
                    jobs.append(("fused", fused, d, causal))
                else:
                    jobs += [("dkdv", kv, d, causal), ("dq", qc, d, causal)]
    return list(dict.fromkeys(jobs))


# ------------------------------------------------------------------------------------------------------
# Offline sm_90 compile (--compile-only; Triton 3.6 in /tmp/t36, no torch, no GPU)
# ------------------------------------------------------------------------------------------------------


def _sig_compile(fn, constexprs: dict, num_warps: int, tensordescs: dict):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in tensordescs:
            sig[name] = tensordescs[name]
        elif name.endswith("_ptr") or name.endswith("_desc"):
            sig[name] = "*fp32" if name in ("m_ptr", "l_ptr", "delta_ptr") else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("C1", "scale_ds"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in ("seqlen", "so_h", "so_s", "sd_h", "sd_s", "st_h", "so_b", "sd_b", "st_b"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": False})


def compile_job(job):
    """The sm_90 CompiledKernel of one (kind, cfg, d, causal) job (Triton 3.6 offline; raises on failure)."""
    kind, cfg, d, causal = job
    if kind == "delta":
        return _sig_compile(v_delta_kernel, dict(HEAD_DIM=d, BLOCK_M=DELTA_BLOCK_M), 4, {})
    if kind == "dkdv":
        ce = dict(HEAD_DIM=d, CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                  ORDER=cfg.order, TMA=cfg.tma, GROUP_HEADS=cfg.group_heads, WS=cfg.ws)
        td = {n: f"tensordesc<bf16[{cfg.block_m}, {d}]>" for n in ("q_desc", "do_desc") if cfg.tma}
        return _sig_compile(v_dkdv_kernel, ce, cfg.warps, td)
    if kind == "dq":
        ce = dict(HEAD_DIM=d, CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                  TMA=cfg.tma, GROUP_HEADS=cfg.group_heads, ORDER=cfg.order, WS=cfg.ws)
        td = {n: f"tensordesc<bf16[{cfg.block_n}, {d}]>" for n in ("k_desc", "v_desc") if cfg.tma}
        return _sig_compile(v_dq_kernel, ce, cfg.warps, td)
    ce = dict(HEAD_DIM=d, CAUSAL=causal, BLOCK_M1=cfg.dkdv.block_m, BLOCK_N1=cfg.dkdv.block_n,
              STAGES1=cfg.dkdv.stages, ORDER=cfg.dkdv.order, BLOCK_M2=cfg.dq.block_m,
              BLOCK_N2=cfg.dq.block_n, STAGES2=cfg.dq.stages, ORDER2=cfg.dq.order,
              GROUP_HEADS=cfg.group_heads)
    return _sig_compile(v_fused_kernel, ce, cfg.dkdv.warps, {})


def compile_stats(job) -> dict:
    """Compiles one job for sm_90; returns registers, spill bytes, shared memory, HGMMA / HMMA counts."""
    try:
        c = compile_job(job)
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[-600:]}"}
    stats = {"ok": True, "shared": c.metadata.shared}
    stats["regs"], stats["spill"], sass = _sm90.binary_stats(c)
    for key, op in (("hgmma", "HGMMA"), ("hmma", "HMMA"), ("ffma", "FFMA"), ("ldl", "LDL")):
        stats[key] = len(re.findall(rf"\b{op}\b", sass))
    # warp specialization evidence: ttg.warp_specialize regions in the TTGIR, the warps actually launched
    # (12 = 1 producer + 2 consumer warpgroups) and the per-partition register limits set in the PTX
    stats["ws_regions"] = len(re.findall(r"partition\d+\(", c.asm["ttgir"]))
    stats["warps"] = c.metadata.num_warps
    stats["setmaxnreg"] = sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                             c.asm["ptx"])})
    return stats


def job_label(job) -> str:
    kind, cfg, d, causal = job
    if kind == "delta":
        what = ""
    elif kind == "fused":
        what = f"kv{cfg.dkdv.label()} dq{cfg.dq.label()}" + (f" g{cfg.group_heads}" * bool(cfg.group_heads))
    else:
        what = cfg.label()
    return f"{kind:5s} D={d} {'causal' if causal else 'dense '} {what}"


def compile_only(variants, dims, causals, workers: int) -> int:
    from concurrent.futures import ProcessPoolExecutor

    jobs = [j for j in kernel_jobs(variants, dims, causals) if j[0] != "delta"]
    print(f"triton {triton.__version__}: compiling {len(jobs)} kernels for sm_90 on {workers} processes",
          flush=True)
    with ProcessPoolExecutor(workers) as pool:
        results = list(pool.map(compile_stats, jobs))
    bad = 0
    for job, r in zip(jobs, results, strict=True):
        if r["ok"]:
            ws = (f" WS: {r['ws_regions']} consumer partitions, {r['warps']} warps, "
                  f"setmaxnreg {r['setmaxnreg']}" if r["ws_regions"] else "")
            print(f"{job_label(job):62s} regs={r['regs']:3d} spill={r['spill']:5d} smem={r['shared']:6d} "
                  f"HGMMA={r['hgmma']:3d} HMMA={r['hmma']} FFMA={r['ffma']} LDL={r['ldl']}{ws}")
        else:
            bad += 1
            print(f"{job_label(job):62s} FAILED: {r['error']}")
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------------------
# GPU run
# ------------------------------------------------------------------------------------------------------


def _warm_job(job):
    """Process-pool worker: compile one kernel into Triton's cache for this GPU (nothing is launched).

    Triton's MockTensor stands in for the tensors (16-byte aligned, like the real ones); the integer
    arguments are the real ones, so the specialization (and the cache key) equals the timed launch's."""
    import torch
    from triton.runtime.jit import MockTensor

    kind, cfg, d, causal = job
    try:
        b, h, s = 4, 16, 4096
        x, st = MockTensor(torch.bfloat16), MockTensor(torch.float32)
        c1, sds = constants(1.0 / math.sqrt(d))
        if kind == "delta":
            launch_delta(x, x, st, b, h, s, d, warmup=True)
        elif kind == "dkdv":
            launch_dkdv(cfg, x, x, x, x, x, x, st, st, st, s, d, causal, c1, sds, b * h, warmup=True)
        elif kind == "dq":
            launch_dq(cfg, x, x, x, x, x, st, st, st, s, d, causal, c1, sds, b * h, warmup=True)
        else:
            launch_fused(cfg, x, x, x, x, x, x, x, st, st, st, s, d, causal, c1, sds, b * h, warmup=True)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[-300:]}"


def _kernel_info(compiled) -> str:
    try:
        compiled._init_handles()
        return f"regs={compiled.n_regs} spills={compiled.n_spills} smem={compiled.metadata.shared}"
    except Exception as e:
        return f"(no metadata: {type(e).__name__})"


DEVICE, DTYPE = "cuda", None  # None: bf16 (a CPU dry run of run_case uses "cpu", float16, the interpreter)


def run_case(b, h, s, d, causal, variants, args, H, A, oracle, rows, infos, skip=None) -> None:
    """Checks and times the shipped backward, every variant and the peers on one (D, causal) case."""
    import torch

    label = f"D{d} {'causal' if causal else 'dense'}"
    DTYPE = globals()["DTYPE"] or torch.bfloat16
    case = H.Case("bwd", DTYPE, (b, h, s, d, int(causal), 3))
    flops = A.flops(case)
    gen = torch.Generator(device=DEVICE).manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, k, v, g = (torch.randn(b, h, s, d, device=DEVICE, dtype=DTYPE, generator=gen) for _ in range(4))
    scale = 1.0 / math.sqrt(d)
    opts = (None, 0, None, None, s, s, bool(causal), scale, None, -1, 0 if causal else -1, 0)
    o, m, l = torch.ops.safeops.attention(q, k, v, *opts)
    ref = torch.ops.safeops.attention_backward(g, q, k, v, o, m, l, *opts)
    # float64 oracle on one head, on the CPU like the GPU tests, with their element-wise bounds
    sl = (slice(0, 1), slice(0, 1))
    qc, kc, vc, gc = (t[sl].cpu() for t in (q, k, v, g))
    r, e_q, e_k, e_v = oracle.attention_gradients(qc, kc, vc, gc, is_causal=bool(causal))
    bounds = oracle.attention_bounds(r, qc, gc)
    exp = (e_q, e_k, e_v)
    bnds = [oracle.add_rounding(bounds[2 + i], exp[i], q.dtype) for i in range(3)]
    del r

    def err_ratio(grads) -> float:
        return max(oracle.max_violation(got[sl].cpu().double(), e, bd)[0]
                   for got, e, bd in zip(grads, exp, bnds, strict=True))

    def timed(fn) -> float:
        return H.bench_ms(fn)[0]

    def tflops(ms: float) -> float:
        return flops / ms * 1e-9

    ship_ratio = err_ratio(ref)
    ms = timed(lambda: torch.ops.safeops.attention_backward(g, q, k, v, o, m, l, *opts))
    rows.append((label, "safeops (shipped)", ms, tflops(ms), math.nan, math.nan, ship_ratio, "ref", ""))
    print(f"{label}: safeops shipped {ms:.3f} ms {tflops(ms):.0f} TFLOP/s  oracle {ship_ratio:.3f}",
          flush=True)
    for var in variants:
        if not var.runs(d, causal):
            continue
        if skip and (var.name, d, causal) in skip:  # failed to compile, or its probe crashed / hung
            rows.append((label, var.name, math.nan, math.nan, math.nan, math.nan, math.nan, "-",
                         f"skipped: {skip[(var.name, d, causal)][:200]}"))
            print(f"{label}: {var.name}: skipped: {skip[(var.name, d, causal)]}", flush=True)
            continue
        note = ""
        try:
            check_shape(q, var)

            def run(which="all", var=var):
                return backward(var, g, q, k, v, o, m, l, bool(causal), scale, which)
            got = run()
            torch.cuda.synchronize()
            ratio = err_ratio(got)
            same = all(torch.equal(x, y) for x, y in zip(got, ref, strict=True))
            want = same_bits_expected(var, d)
            bits = ("same" if same else "DIFF") + ("" if same == want else " (unexpected)")
            if not same:
                diffs = [(x.float() - y.float()).abs().max().item() for x, y in zip(got, ref, strict=True)]
                note = "max |diff| dq/dk/dv " + "/".join(f"{x:.2g}" for x in diffs)
            del got
            whole = timed(run)
            kv, qc, fused = plan(var, d)
            t_kv = t_dq = math.nan
            if fused is None:
                t_kv = timed(lambda run=run: run("dkdv"))
                t_dq = timed(lambda run=run: run("dq"))
            for key in (("dkdv", kv, d, causal), ("dq", qc, d, causal), ("fused", fused, d, causal)):
                if key in COMPILED:
                    infos.setdefault(key, _kernel_info(COMPILED[key]))
            status = "ok" if ratio <= 1.0 else "OVER BOUND"
            rows.append((label, var.name, whole, tflops(whole), t_kv, t_dq, ratio, bits,
                         status + (f"; {note}" if note else "")))
            print(f"{label}: {var.name:12s} {whole:.3f} ms {tflops(whole):5.0f} TFLOP/s  dkdv {t_kv:.3f} "
                  f"dq {t_dq:.3f} ms  oracle {ratio:.3f} bits {bits} {status} {note}", flush=True)
        except Exception as e:
            rows.append((label, var.name, math.nan, math.nan, math.nan, math.nan, math.nan, "-",
                         f"error: {type(e).__name__}: {str(e)[:160]}"))
            print(f"{label}: {var.name}: error {type(e).__name__}: {str(e)[:300]}", flush=True)
    t = {"q": q, "k": k, "v": v, "g": g, "causal": bool(causal)}
    peers = [] if args.no_cudnn else [("sdpa cudnn", A.sdpa_builder("CUDNN_ATTENTION"))]
    if not args.no_flex:
        peers.append(("flex", A.build_flex))
    for name, build in peers:
        try:
            fn = build(case, t)
            fn()
            ms = timed(fn)
            rows.append((label, name, ms, tflops(ms), math.nan, math.nan, math.nan, "-", ""))
            print(f"{label}: {name:12s} {ms:.3f} ms {tflops(ms):5.0f} TFLOP/s", flush=True)
            del fn
        except Exception as e:
            rows.append((label, name, math.nan, math.nan, math.nan, math.nan, math.nan, "-",
                         f"error: {type(e).__name__}: {str(e)[:160]}"))


def probe_variants(variants, dims, causals, failures, timeout: float) -> dict:
    """{(variant, d, causal): reason} for the variants not to launch in this process: a kernel that failed to
    precompile, or (``probe=True`` variants) a first launch that crashed, hung or gave non-finite gradients
    in a subprocess (``--probe``; a hung warp-specialized kernel would otherwise hang the whole run)."""
    skip = {}
    for var in variants:
        for d in dims:
            for causal in causals:
                if not var.runs(d, causal):
                    continue
                bad = [job_label(j) + ": " + e for j, e in failures.items()
                       if j[2] == d and j[3] == causal and j[1] in _cfgs(var, d)]
                if bad:
                    skip[(var.name, d, causal)] = "compile failed: " + bad[0]
    todo = [(v.name, d, c) for v in variants if v.probe for d in dims for c in causals
            if v.runs(d, c) and (v.name, d, c) not in skip]
    jobs = [((name, d, causal), ["--probe", f"{name},{d},{int(causal)}"]) for name, d, causal in todo]
    skip.update(_probes.run_probes(__file__, jobs, timeout, ROOT))
    return skip


def _cfgs(var: Variant, d: int) -> tuple:
    kv, qc, fused = plan(var, d)
    return (fused,) if fused is not None else (kv, qc)


def probe_main(spec: str) -> int:
    """--probe NAME,D,CAUSAL: one backward of the variant at the timed size (B4 H16 S4K bf16) on random
    inputs with made-up row statistics (no forward needed), synchronised; prints PROBE OK if it finished
    with finite gradients."""
    import torch

    import safeops  # noqa: F401  (the TMA allocator helper)

    name, d, causal = spec.split(",")
    d, causal, var = int(d), bool(int(causal)), VARIANTS_BY_NAME[name]
    b, h, s = 4, 16, 4096
    q, k, v, g, o = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(5))
    m = torch.full((b, h, s), 4.0, device="cuda")
    l = torch.full((b, h, s), float(s), device="cuda")
    grads = backward(var, g, q, k, v, o, m, l, causal, 1.0 / math.sqrt(d))
    torch.cuda.synchronize()
    ok = all(bool(torch.isfinite(x).all()) for x in grads)
    print("PROBE OK" if ok else "PROBE non-finite gradients", flush=True)
    return 0 if ok else 1


def gpu_main(args, variants, dims, causals) -> int:
    import threading
    from concurrent.futures import ProcessPoolExecutor

    import torch

    sys.path.insert(0, str(HERE))
    import _harness as H

    H.require_cuda("bench/attn_bwd_variants.py")
    t_start = time.time()
    jobs = kernel_jobs(variants, dims, causals)
    pool = ProcessPoolExecutor(max(1, min(args.workers or (os.cpu_count() or 1), len(jobs))),
                               mp_context=__import__("multiprocessing").get_context("spawn"))
    futures = [pool.submit(_warm_job, j) for j in jobs]

    import safeops  # noqa: F401  (registers torch.ops.safeops)
    from safeops.ops import attention_launch as L

    b, h, s = 4, 16, 4096
    shipped_thread = None
    try:
        # Shipped kernels: plan their launches on meta tensors and compile them in parallel as well.
        with L.recording() as launches:
            for d in dims:
                for causal in causals:
                    qm = torch.empty(b, h, s, d, dtype=torch.bfloat16, device="meta")
                    opts = (None, 0, None, None, s, s, bool(causal), 1.0 / math.sqrt(d), None, -1,
                            0 if causal else -1, 0)
                    out, mm, ll = L.forward(qm, qm, qm, *opts)
                    L.backward(qm, qm, qm, qm, out, mm, ll, *opts)
        import json

        unique = list({json.dumps(x, sort_keys=True): x for x in launches}.values())
        shipped_thread = threading.Thread(target=lambda: L.compile_launches(unique, timeout=300), daemon=True)
        shipped_thread.start()
    except Exception as e:
        print(f"shipped precompile skipped: {e}", flush=True)

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(HERE))
    import attention as A  # bench/attention.py: the peers exactly as the main benchmark builds them
    import oracle

    flex_warm = {}
    if not args.no_flex:  # compile Flex (fwd + bwd) while the pool compiles our kernels
        for d in dims:
            for causal in causals:
                try:
                    case = H.Case("bwd", torch.bfloat16, (b, h, s, d, int(causal), 3))
                    t = A.make_inputs(case)
                    A.build_flex(case, t)()
                    torch.cuda.synchronize()
                except Exception as e:
                    flex_warm[(d, causal)] = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"flex compiled: {time.time() - t_start:.1f} s", flush=True)
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
    if shipped_thread is not None:
        shipped_thread.join(timeout=240)
    print(f"precompiled {len(jobs)} variant kernels ({len(failures)} failed): {time.time() - t_start:.1f} s",
          flush=True)
    skip = probe_variants(variants, dims, causals, failures, args.probe_timeout)
    print(f"probes done: {time.time() - t_start:.1f} s", flush=True)

    rows = []  # (case label, impl, whole ms, tflops, dkdv ms, dq ms, error ratio, bits, note)
    infos = {}
    for d in dims:
        for causal in causals:
            run_case(b, h, s, d, causal, variants, args, H, A, oracle, rows, infos, skip)
            torch.cuda.empty_cache()

    lines = [f"attention backward variants, B={b} H={h} S={s} bf16, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, triton {triton.__version__}; TFLOP/s = 2.5 x forward flops "
             "(halved for causal) / whole-backward time; dkdv/dq = that kernel alone (ms); oracle = max "
             "error / float64 bound (<= 1 passes); bits = vs the shipped backward",
             "",
             "| case | impl | ms | TFLOP/s | dkdv ms | dq ms | oracle | bits | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        label, name, ms, tf, tkv, tdq, ratio, bits, note = row
        lines.append(f"| {label} | {name} | {ms:.3f} | {tf:.0f} | {tkv:.3f} | {tdq:.3f} | {ratio:.3f} "
                     f"| {bits} | {note} |")
    if infos:
        lines += ["", "compiled kernels (on the GPU):"] + [f"  {job_label(k)}: {v}" for k, v in infos.items()]
    if failures or flex_warm:
        lines += ["", "failures:"] + [f"  {job_label(j)}: {e}" for j, e in failures.items()] + \
            [f"  flex {k}: {e}" for k, e in flex_warm.items()]
    lines.append(f"\ntotal {time.time() - t_start:.0f} s")
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "attn_bwd_variants.md").write_text(text + "\n")
    return 0


# ------------------------------------------------------------------------------------------------------
# CPU self-check under Triton's interpreter (--interpret-check): variants vs the shipped kernels, small shapes
# ------------------------------------------------------------------------------------------------------


def interpret_check(variants) -> int:
    """Runs every variant with small blocks under the interpreter against safeops' interpreted backward
    (whose config is INTERPRETER_CONFIG = 16 x 16): a variant with 16 x 16 blocks must give the same bits."""
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--interpret-check: run with TRITON_INTERPRET=1 in the environment (before triton loads)")
    os.environ.setdefault("SAFEOPS_BACKEND", "triton")
    import safeops  # noqa: F401

    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    bad = 0
    for d in (64,):
        for causal in (False, True):
            b, h, s = 2, 2, 128
            # fp16: the interpreter computes bf16 kernels wrongly (garbage forward stats with Triton 3.9)
            q, k, v, g = (torch.randn(b, h, s, d, dtype=torch.float16) for _ in range(4))
            scale = 1.0 / math.sqrt(d)
            opts = (None, 0, None, None, s, s, causal, scale, None, -1, 0 if causal else -1, 0)
            o, m, l = torch.ops.safeops.attention(q, k, v, *opts)
            ref = torch.ops.safeops.attention_backward(g, q, k, v, o, m, l, *opts)
            for var in variants:
                if not var.runs(d, causal):
                    continue
                small = _small(var)
                got = backward(small, g, q, k, v, o, m, l, causal, scale)
                same = all(torch.equal(a, b_) for a, b_ in zip(got, ref, strict=True))
                worst = max((x.float() - y.float()).abs().max().item() for x, y in zip(got, ref, strict=True))
                print(f"interp D={d} causal={causal} {var.name:12s} same bits: {same}  max|diff| {worst:.2g}")
                bad += not same
    return 1 if bad else 0


def _small(var: Variant) -> Variant:
    """The variant with 16 x 16 blocks (the interpreter config), keeping its order / grouping / fusion."""
    def shrink_kv(c: Kcfg) -> Kcfg:  # dk/dv bits depend on BLOCK_M only: keep 16, keep BLOCK_N > BLOCK_M
        return replace(c, block_m=16, block_n=32 if c.block_n > c.block_m else 16, warps=1, stages=1,
                       group_heads=min(c.group_heads, 2))

    def shrink_dq(c: Kcfg) -> Kcfg:  # dq bits depend on BLOCK_N only
        return replace(c, block_m=32 if c.block_m > c.block_n else 16, block_n=16, warps=1, stages=1,
                       group_heads=min(c.group_heads, 2))
    return Variant(var.name, var.why,
                   dkdv={dd: shrink_kv(c) for dd, c in var.dkdv.items()} or {64: shrink_kv(SHIPPED_DKDV[64])},
                   dq={dd: shrink_dq(c) for dd, c in var.dq.items()} or {64: shrink_dq(SHIPPED_DQ[64])},
                   fused={dd: Fused(replace(shrink_kv(f.dkdv), block_n=16),
                                    replace(shrink_dq(f.dq), block_m=16), min(f.group_heads, 2))
                          for dd, f in var.fused.items()})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", default="64,128")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--variants", default="", help="comma-separated names or 'all' (default: the 8 defaults)")
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--no-cudnn", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--list", action="store_true")
    p.add_argument("--compile-only", action="store_true", help="offline sm_90 compile stats (no GPU)")
    p.add_argument("--interpret-check", action="store_true", help="CPU: bits vs the shipped interpreter path")
    p.add_argument("--probe", default="", help=argparse.SUPPRESS)  # NAME,D,CAUSAL (internal, see probe_main)
    p.add_argument("--probe-timeout", type=float, default=90.0,
                   help="seconds for the subprocess first launches of probe=True variants (all run at once)")
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
            def show(d, var=var):
                kv, qc, fu = plan(var, d)
                if d not in var.dims:
                    return "-"
                if fu:
                    return f"fused kv{fu.dkdv.label()} dq{fu.dq.label()}"
                return f"kv{kv.label()} dq{qc.label()}"
            cfgs = "; ".join(f"D{d}: {show(d)}" for d in (64, 128))
            print(f"{var.name:12s} {cfgs}{'' if var.default else '  [extra]'}\n{'':12s} {var.why}")
        return 0
    if args.probe:
        return probe_main(args.probe)
    if args.compile_only:
        return compile_only(variants, dims, causals, args.workers or os.cpu_count() or 1)
    if args.interpret_check:
        return interpret_check(variants)
    return gpu_main(args, variants, dims, causals)


if __name__ == "__main__":
    # Run through the module name, so the process-pool workers (spawn) and this process define the kernels
    # in the same module (Triton's cache key) and pickle jobs by the same class names.
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    import attn_bwd_variants

    sys.exit(attn_bwd_variants.main())
