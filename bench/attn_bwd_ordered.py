"""Fused, deterministic attention backward with dq accumulated in a fixed order (issue 5 experiment).

The shipped backward (safeops/kernels/attention.py: ``attn_bwd_dkdv_kernel``, ``attn_bwd_dq_kernel``, and
when this experiment was written a separate delta kernel, now part of the dq kernel) is deterministic because
no float is ever accumulated by an atomic: a dk/dv kernel (per key block: ``k q^T``, ``v dO^T``, ``dv += p^T
dO``, ``dk += ds^T q``) and a separate dq kernel (per query block: ``q k^T``, ``dO v^T``, ``dq += ds k``)
recompute the two score products: 7 matrix products per (query block, key block) pair where
FlashAttention-2/3 do 5, accumulating dq with fp32 atomics in whatever
order the hardware picks (not allowed here: CONTRACT.md section 6).

This file builds the 5-product backward for the CAUSAL dense case ((B, H, S, D) contiguous, MHA, S a multiple
of the block, D in {64, 128}, bf16/fp16) and keeps it deterministic by making the order of the dq additions
fixed:

- ``ordered_bwd_kernel``: one program per (key block j, head). It loads K_j, V_j once and walks the query
  blocks i = j, j+1, ..., N-1 (BLOCK_M == BLOCK_N, so only the first step, the diagonal, is masked) with
  the shipped dk/dv numerics: ``z2 = fp32(k q^T) * C1`` materialised once, ``p = exp2(min(z2 - m, 0)) *
  (1 / l)`` from the saved row max and row sum, causal exclusion as a select to -inf, ``ds = p (dp -
  delta)``, dk and dv accumulated in registers, the scale applied to dk once at the end. Each step also
  computes its dq contribution ``ds_q k_j`` (BLOCK x D, fp32, from zero) where ``ds_q = e (dp - delta)``
  with the unnormalised ``e = exp2(min(z2 - m, 0))`` as the shipped dq kernel (DQ_NORM=0; the 1 / l row
  factor and the scale are applied once when dq is converted), or ``ds_q = ds`` (DQ_NORM=1: one ds tile for
  both dk and dq, as FlashAttention; only the scale at the end).
- dq of query block i receives contributions from key blocks i, i-1, ..., 0 IN THAT ORDER. Key block j
  reaches query block i at its step t = i - j, one step after key block j+1 did (its step t-1). One int32
  counter per (head, query block) says how many contributions the fp32 buffer holds: at step t program j
  computes the step's products first, then waits until counter == t (acquire), reads the buffer, adds its
  contribution, writes it back and releases counter = t + 1. The first contributor (t = 0, the diagonal)
  writes without reading (so the buffer needs no zeroing; x instead of 0 + x, identical except the sign of
  an exact zero), and the last one (key block 0) converts: ``dq = (buffer + c) * (1 / l * scale)`` to the
  output dtype, and puts the counter back to 0 for the next launch (the counters are zeroed once).
- Deadlock freedom: program ids run over the heads one after another and, within a head, over DESCENDING key
  blocks (``GROUP_HEADS`` G > 1: block-major inside groups of G heads, still descending), so program j only
  ever waits on program j+1 of the same head, which has a LOWER id. If the GPU dispatches blocks in id
  order (what CUDA does for a 1-D grid in practice, and what FlashAttention-3's deterministic backward relies
  on too), a waited-on program has been dispatched earlier and is resident or finished; by induction on the
  id it never waits forever. Under Triton's interpreter programs run one after another in id order, so every
  wait is already satisfied when it is reached. The spin is bounded (``max_spin`` reads): a wait that runs
  out sets ``status[0]`` (a reported error, not a hang) and goes on; the harness checks it.
- Memory ordering (whole CTA). Writer: every thread stores its part of the tile, ``bar.sync``, then ONE
  gpu-scope release of the counter (``atom.exch.release.gpu``, one thread; ptxas: MEMBAR.ALL.GPU + ATOMG
  .STRONG.GPU): the barrier puts every thread's stores before the release in causality order and the release
  is cumulative. Reader (SPIN=1, the GPU default): EVERY thread spins on ``ld.acquire.gpu`` itself (inline
  PTX; SASS LDG.E.STRONG.GPU + CCTL.IVALL), then a barrier that counts the threads whose bounded spin ran
  out (``bar.red.popc``, so any thread's give-up is reported), then reads the tile with ``ld.global.cg.v2``
  (L2; ``.v2`` pairs of adjacent columns, checked in the PTX by ``ptx_pairs_ok``). SPIN=0 (the
  interpreter, and a GPU control with stages 1): Triton's scalar ``atomic_add(cnt, 0, sem="acquire",
  scope="gpu")`` in a ``while`` loop.
- Triton's software pipeliner is the hazard (Triton 3.6, checked offline): (a) a ``debug_barrier`` in the
  loop body stops it pipelining the loop at all (no cp.async for q / dO); (b) a ``tl.load`` of the dq tile
  is pipelined like any load: a cp.async prefetch issued in the PREVIOUS iteration, before the spin (a
  stale read); (c) side-effecting ops with no data dependency between them are reordered (the spin landed
  after the tile's read and store); (d) ``dot(ds, k) + x`` is folded into ``dot(ds, k, acc=x)``; (e) a
  side-effecting inline-asm load is re-emitted once per layout it is used in. So with stages > 1
  (``ASM_SYNC``) the barriers, the tile's read-and-add and its stores are inline PTX, chained by data: spin
  -> counting barrier (returns the count) -> read (takes it as an operand) -> add (inside the asm) ->
  stores -> barrier -> release (its value goes through the barrier). ``loop_order`` checks the final
  TritonGPU IR of every compiled config (``--compile-only`` prints it; the GPU run refuses a config that
  fails it). With stages == 1 plain Triton loads / stores / ``debug_barrier`` are used (no pipeliner, order
  kept). Details, PTX / SASS excerpts and the PTX memory-model argument: scratch/notes_bwd_ordered.md and
  scratch/review_bwd_ordered.md.

dk/dv: the same per-step arithmetic as the shipped dk/dv kernel; the shipped one steps 32 queries at a time,
this one BLOCK (64 / 128): the bits agree if the accumulating wgmma chain over the query dimension adds the
16-wide chunks in the same order either way (the harness reports it; under the interpreter, BLOCK 16 = the
interpreter config gives the shipped bits). dq: a different summation order from the shipped dq kernel
(fresh fp32 partial per key block, added to the buffer in descending key order), so different bits, but
fixed: deterministic and batch-invariant (the order depends only on the query block's index).

    python3 bench/attn_bwd_ordered.py --out DIR [--d 64,128] [--block 64,128] [--configs all]
                                      [--no-cudnn] [--workers N] [--no-guard] [--guard-timeout S]
    /tmp/t36/bin/python bench/attn_bwd_ordered.py --compile-only [--configs all] [--ptx DIR]  (no GPU/torch)
    TRITON_INTERPRET=1 .venv/bin/python bench/attn_bwd_ordered.py --interpret-check          (CPU, ~5 s)

GPU run: precompiles every config in a spawn process pool (Triton ``warmup``, the timed launch's exact
specialization) while the shipped kernels compile in a thread; then a guard (``--no-guard`` skips it): each
config launches once on B=1 H=32 S=4096 (many more programs than fit at once, so dispatch order matters)
with a short spin bound, into NaN-filled buffers, in a SUBPROCESS with a timeout, so a deadlock is reported
instead of hanging the run (a hung config is marked and a fresh child runs the rest); then, for B4 H16 S4K
and B1 H32 S4K (Llama-1B's 32 query heads as MHA, as the shipped launcher's GQA split runs them), causal,
bf16, each D: the shipped backward (time, oracle), each config (oracle on one head with tests/oracle.py's
bounds, 3 runs into NaN-filled outputs and dq buffer -> identical bits and nothing left NaN, dk/dv bits vs
the shipped, status / counters after the runs, time of the whole backward: delta + fused kernel), cuDNN
(sdpa). TFLOP/s =
2.5 x forward flops, halved for causal. Writes DIR/attn_bwd_ordered.md. Notes: scratch/notes_bwd_ordered.md.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import re
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import triton
import triton.language as tl

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:  # bench/ helpers (also in spawned pool workers, which import this module)
    sys.path.insert(0, str(HERE))
import _sm90  # noqa: E402
from attn_bwd_variants import v_delta_kernel  # noqa: E402  (delta with the shipped fixed-order row sum)

NEG_INF = tl.constexpr(float("-inf"))

# ------------------------------------------------------------------------------------------------------
# Kernel (triton only: this part also runs under /tmp/t36 for --compile-only, where torch is missing)
# ------------------------------------------------------------------------------------------------------

# Spin until *ptr == target (gpu-scope acquire loads), at most $3 reads; returns the last value read. One
# copy per thread: each thread's own acquire orders its later loads. ${:uid} makes the labels unique per
# inlined copy (LLVM's inline-asm unique id).
_SPIN_ASM = tl.constexpr("""{
.reg .pred %p<2>;
.reg .b32 %n;
mov.b32 %n, $3;
SPIN${:uid}:
ld.acquire.gpu.global.b32 $0, [$1];
setp.eq.s32 %p0, $0, $2;
@%p0 bra DONE${:uid};
sub.s32 %n, %n, 1;
setp.gt.s32 %p1, %n, 0;
@%p1 bra SPIN${:uid};
DONE${:uid}:
}""")


@triton.jit
def _barrier(token, ASM_SYNC: tl.constexpr):
    """CTA barrier (bar.sync 0); returns ``token`` (int32) through it. ASM_SYNC: as inline PTX, which
    Triton's software pipeliner does not see (a ``debug_barrier`` in the loop body makes Triton 3.6 skip
    pipelining the loop altogether); the token makes what uses the result come after the barrier (the
    pipeliner reorders side-effecting ops that have no data dependency between them)."""
    if ASM_SYNC:
        token = tl.inline_asm_elementwise("bar.sync 0;\nmov.b32 $0, $1;", "=r,r", [token], dtype=tl.int32,
                                          is_pure=False, pack=1)
    else:
        tl.debug_barrier()
    return token


# CTA barrier that also counts the threads whose wait ran out (bar.red.popc: every thread gets the count):
# $1 the value this thread's spin read last, $2 the target. A barrier like bar.sync (same memory ordering).
_BAR_COUNT_ASM = tl.constexpr("""{
.reg .pred %p;
setp.ne.s32 %p, $1, $2;
bar.red.popc.u32 $0, 0, %p;
}""")


@triton.jit
def _wait(cnt_ptr, target, max_spin, status_ptr, SPIN: tl.constexpr, ASM_SYNC: tl.constexpr):
    """Wait until the counter equals ``target`` (acquire), then a CTA barrier; returns a token for the tile
    loads (the number of threads whose wait ran out, 0 normally). A bounded wait that runs out counts an
    error in ``status[0]`` and returns. SPIN 1: every thread spins itself and the barrier counts the threads
    that gave up (``bar.red.popc``), so a give-up by ANY thread is reported (the scalar status atomic runs
    on thread 0 only); the barrier is inline PTX whatever ASM_SYNC (the pipeliner does not see it and the
    count carries the data chain to the tile read)."""
    if SPIN == 1:
        seen = tl.inline_asm_elementwise(_SPIN_ASM, "=r,l,r,r", [cnt_ptr, target, max_spin], dtype=tl.int32,
                                         is_pure=False, pack=1)
        bad = tl.inline_asm_elementwise(_BAR_COUNT_ASM, "=r,r,r", [seen, target], dtype=tl.int32,
                                        is_pure=False, pack=1)
    else:  # Triton's scalar atomic: thread 0 reads, the value is broadcast to all threads (uniform)
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        n = 1
        while (seen != target) & (n < max_spin):
            seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
            n += 1
        bad = _barrier((seen != target).to(tl.int32), ASM_SYNC)
    if bad != 0:
        tl.atomic_add(status_ptr, 1, sem="relaxed")
    return bad


# buffer + part for TWO elements per asm (pack=2), one ``ld.global.cg.v2.f32``. It relies on the pair being
# adjacent in memory and 8-byte aligned: in the wgmma accumulator layout a thread's elements 2k, 2k+1 are
# adjacent columns (an even column: aligned), and Triton packs a thread's elements in order, but its docs
# leave the grouping unspecified, so the second pointer ($3) is named in a PTX comment and
# ``ptx_pairs_ok`` checks, in the PTX of every compiled config (offline and before any GPU launch), that
# it is the first + 4 bytes (a runtime check with a scalar fallback cost 88 bytes of spills at D=64).
# $0 $1: results; $2 $3: pointers; $4 $5: part (bits); $6 $7: token (unused).
_READ_ADD_V2 = tl.constexpr("""{
// v2pair $2 $3
.reg .f32 %t0, %t1, %u0, %u1;
ld.global.cg.v2.f32 {%t0, %t1}, [$2];
mov.b32 %u0, $4;
mov.b32 %u1, $5;
add.rn.f32 %u0, %t0, %u0;
add.rn.f32 %u1, %t1, %u1;
mov.b32 $0, %u0;
mov.b32 $1, %u1;
}""")

# Masked store of two fp32 elements (pack=2) at $2, $2 + 4 (checked as above), one ``st.global.cg.v2.b32``
# under the AND of the two masks: a pair needs ONE mask value (here the mask is uniform over the tile).
# $0 $1: dummy results; $2 $3: pointers; $4 $5: values (bits); $6 $7: masks.
_STORE_V2 = tl.constexpr("""{
// v2pair $2 $3
.reg .pred %p;
setp.ne.s32 %p, $6, 0;
setp.ne.and.s32 %p, $7, 0, %p;
@%p st.global.cg.v2.b32 [$2], {$4, $5};
mov.b32 $0, 0;
mov.b32 $1, 0;
}""")


@triton.jit
def _load_add(ptrs, part, token, live, ASM_SYNC: tl.constexpr):
    """buffer tile + ``part``, the buffer read after the wait. ASM_SYNC: inline-PTX ``ld.global.cg`` +
    ``add.rn.f32`` (ASM_SYNC 2: two elements per asm, one ``.v2`` load for an adjacent pair; 1: one element
    per asm), taking the wait's token as an (unused) operand: the software pipeliner can neither hoist it
    into the previous iteration (it does that to a ``tl.load`` here: a cp.async prefetch before the spin, a
    read of a stale tile) nor schedule it before the spin. The add inside the asm (and, without ASM_SYNC, the
    select on ``live``, always true) keeps Triton from folding ``dot(ds, k) + x`` into ``dot(ds, k,
    acc=x)``, which would put the dq product after the wait and change the summation."""
    if ASM_SYNC:
        tok = tl.zeros(ptrs.shape, tl.int32) + token
        # (part goes in as its bits: inline_asm_elementwise will not broadcast a pointer with a float)
        if ASM_SYNC == 2:
            total = tl.inline_asm_elementwise(
                _READ_ADD_V2, "=r,=r,l,l,r,r,r,r", [ptrs, part.to(tl.int32, bitcast=True), tok],
                dtype=tl.float32, is_pure=False, pack=2)
        else:
            total = tl.inline_asm_elementwise(
                "{\n.reg .f32 %t, %u;\nld.global.cg.f32 %t, [$1];\nmov.b32 %u, $2;\nadd.rn.f32 %u, %t, %u;\n"
                "mov.b32 $0, %u;\n}", "=r,l,r,r", [ptrs, part.to(tl.int32, bitcast=True), tok],
                dtype=tl.float32, is_pure=False, pack=1)
    else:
        total = tl.load(ptrs, cache_modifier=".cg") + tl.where(live, part, 0.0)
    return total


@triton.jit
def _store_tile(ptrs, x, ok, ASM_SYNC: tl.constexpr):
    """Masked store of an fp32 (to the buffer, ``.cg``) or 16-bit (dq) tile. ASM_SYNC: inline-PTX stores (fp32
    with ASM_SYNC 2: ``.v2`` pairs as ``_load_add``; 16-bit, the dq output, written once per query block:
    one element per asm), so every use of the tile made by ``_load_add`` is inline PTX and Triton keeps it
    in one layout (with a ``tl.store`` consumer it re-emits the side-effecting load once per layout: 3
    loads)."""
    if ASM_SYNC:
        okw = ok.to(tl.int32)
        if x.dtype == tl.float32:
            if ASM_SYNC == 2:
                tl.inline_asm_elementwise(_STORE_V2, "=r,=r,l,l,r,r,r,r",
                                          [ptrs, x.to(tl.int32, bitcast=True), okw], dtype=tl.int32,
                                          is_pure=False, pack=2)
            else:
                tl.inline_asm_elementwise(
                    "{\n.reg .pred %p;\nsetp.ne.s32 %p, $3, 0;\n@%p st.global.cg.b32 [$1], $2;\n"
                    "mov.b32 $0, 0;\n}", "=r,l,r,r", [ptrs, x.to(tl.int32, bitcast=True), okw],
                    dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{\n.reg .pred %p;\nsetp.ne.s32 %p, $3, 0;\n@%p st.global.b16 [$1], $2;\nmov.b32 $0, 0;\n}",
                "=r,l,h,r", [ptrs, x.to(tl.int16, bitcast=True), okw], dtype=tl.int32, is_pure=False, pack=1)
    else:
        if x.dtype == tl.float32:
            tl.store(ptrs, x, mask=ok, cache_modifier=".cg")
        else:
            tl.store(ptrs, x, mask=ok)


@triton.jit
def _release(cnt_ptr, value, ASM_SYNC: tl.constexpr):
    """Every thread's earlier stores of the tile, a CTA barrier, then the counter (gpu-scope release, by one
    thread); the value goes through the barrier, so the atomic cannot move above it."""
    value = _barrier(value, ASM_SYNC)
    tl.atomic_xchg(cnt_ptr, value, sem="release", scope="gpu")


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
def _step(dk, dv, k, v, q_ptrs, do_ptrs, acc_ptrs, dq_ptrs, cnt_ptr, status_ptr, stat_m, stat_l, stat_d,
          offs_n, start_m, j, C1, scale_ds, max_spin,
          HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, DIAGONAL: tl.constexpr, SPIN: tl.constexpr,
          DQ_NORM: tl.constexpr, ASM_SYNC: tl.constexpr):
    """One (query block i = start_m / BLOCK, key block j) step: dk, dv as the shipped dk/dv kernel, then this
    key block's dq contribution added to query block i's buffer in the fixed order."""
    offs_m = start_m + tl.arange(0, BLOCK)
    q = tl.load(q_ptrs + start_m * HEAD_DIM)
    do = tl.load(do_ptrs + start_m * HEAD_DIM)
    base, inv_l, delta = _stats(stat_m, stat_l, stat_d, offs_m)
    sT = tl.dot(k, tl.trans(q), tl.zeros([BLOCK, BLOCK], tl.float32))
    zT = sT * C1
    if DIAGONAL:
        zT = tl.where(offs_n[:, None] <= offs_m[None, :], zT, NEG_INF)
    # min(., 0): p <= 1 whatever the recomputed dot rounds to (the shipped _probs, same two steps)
    eT = tl.exp2(tl.minimum(zT - base[None, :], 0.0, propagate_nan=tl.PropagateNan.ALL))
    pT = eT * inv_l[None, :]
    dv = tl.dot(pT.to(do.dtype), do, dv)
    dpT = tl.dot(v, tl.trans(do), tl.zeros([BLOCK, BLOCK], tl.float32))
    dsT = pT * (dpT - delta[None, :])
    ds_lo = dsT.to(q.dtype)
    dk = tl.dot(ds_lo, q, dk)
    if DQ_NORM == 0:  # the shipped dq kernel's ds: unnormalised, 1 / l applied at the conversion
        dq_lo = (eT * (dpT - delta[None, :])).to(q.dtype)
        factor = inv_l * scale_ds
    else:
        dq_lo = ds_lo
        factor = tl.full([BLOCK], 1.0, tl.float32) * scale_ds
    # This key block's dq contribution (queries x D), computed before any wait.
    part = tl.dot(tl.trans(dq_lo), k, tl.zeros([BLOCK, HEAD_DIM], tl.float32))
    # Key block 0 is the last contributor of every query block: it converts to the output dtype and puts
    # the counter back to 0 (nobody reads it again in this launch). A uniform predicate on the stores, not
    # a branch (Triton 3.6's pipeliner fails on an scf.if holding these stores inside the loop).
    last = j == 0
    out_ok = tl.full([BLOCK, HEAD_DIM], 1, tl.int1) & last
    acc_ok = tl.full([BLOCK, HEAD_DIM], 1, tl.int1) & (j != 0)
    if DIAGONAL:  # t = 0: the first contribution, no wait, no read
        total = part
        t = 0
    else:
        t = start_m // BLOCK - j
        token = _wait(cnt_ptr, t, max_spin, status_ptr, SPIN, ASM_SYNC)
        total = _load_add(acc_ptrs + start_m * HEAD_DIM, part, token, j >= 0, ASM_SYNC)
    _store_tile(dq_ptrs + start_m * HEAD_DIM, (total * factor[:, None]).to(dq_ptrs.dtype.element_ty), out_ok,
                ASM_SYNC)
    _store_tile(acc_ptrs + start_m * HEAD_DIM, total, acc_ok, ASM_SYNC)
    _release(cnt_ptr, tl.where(last, 0, t + 1), ASM_SYNC)
    return dk, dv


@triton.jit(do_not_specialize=["seqlen", "max_spin"])
def ordered_bwd_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr,
                       acc_ptr, cnt_ptr, status_ptr, seqlen, C1, scale_ds, max_spin,
                       HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
                       GROUP_HEADS: tl.constexpr, SPIN: tl.constexpr, DQ_NORM: tl.constexpr,
                       ASM_SYNC: tl.constexpr, WRONG_ORDER: tl.constexpr = False):
    """dk, dv of one key block of one head and its dq contributions (causal, BLOCK_M == BLOCK_N == BLOCK).

    Program order: heads one after another (GROUP_HEADS <= 1) or block-major inside groups of GROUP_HEADS
    heads; key blocks DESCENDING, so the program this one waits on (key block j + 1, same head) always has
    a lower id: deadlock-free when programs are dispatched in id order (see the module docstring).
    ``WRONG_ORDER`` (tests only, under the interpreter): ascending key blocks, so every wait is on a HIGHER
    id; sequential programs then time out (``status``), which shows the check can fail."""
    pid = tl.program_id(0)
    n_blocks = seqlen // BLOCK
    if GROUP_HEADS <= 1:
        bh = pid // n_blocks
        j = n_blocks - 1 - pid % n_blocks
        if WRONG_ORDER:
            j = pid % n_blocks
    else:
        per = GROUP_HEADS * n_blocks
        r = pid % per
        bh = (pid // per) * GROUP_HEADS + r % GROUP_HEADS
        j = n_blocks - 1 - r // GROUP_HEADS
    n0 = j * BLOCK
    head = bh.to(tl.int64) * seqlen * HEAD_DIM
    offs_n = n0 + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_m0 = tl.arange(0, BLOCK)
    kv_rows = head + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(k_ptr + kv_rows)
    v = tl.load(v_ptr + kv_rows)
    rows0 = head + offs_m0[:, None] * HEAD_DIM + offs_d[None, :]
    q_ptrs = q_ptr + rows0
    do_ptrs = do_ptr + rows0
    acc_ptrs = acc_ptr + rows0
    dq_ptrs = dq_ptr + rows0
    st = bh.to(tl.int64) * seqlen
    cnt_base = cnt_ptr + bh * n_blocks
    dk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    dk, dv = _step(dk, dv, k, v, q_ptrs, do_ptrs, acc_ptrs, dq_ptrs, cnt_base + j, status_ptr, m_ptr + st,
                   l_ptr + st, delta_ptr + st, offs_n, n0, j, C1, scale_ds, max_spin,
                   HEAD_DIM, BLOCK, True, SPIN, DQ_NORM, ASM_SYNC)
    for start_m in tl.range(n0 + BLOCK, seqlen, BLOCK, num_stages=STAGES):
        dk, dv = _step(dk, dv, k, v, q_ptrs, do_ptrs, acc_ptrs, dq_ptrs, cnt_base + start_m // BLOCK,
                       status_ptr, m_ptr + st, l_ptr + st, delta_ptr + st, offs_n, start_m, j, C1, scale_ds,
                       max_spin, HEAD_DIM, BLOCK, False, SPIN, DQ_NORM, ASM_SYNC)
    dk = dk * scale_ds  # the constant factor once, after the loop (as the shipped kernel)
    tl.store(dk_ptr + kv_rows, dk.to(dk_ptr.dtype.element_ty))
    tl.store(dv_ptr + kv_rows, dv.to(dv_ptr.dtype.element_ty))


# ------------------------------------------------------------------------------------------------------
# Configurations and launching
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cfg:
    block: int  # BLOCK_M == BLOCK_N
    warps: int
    stages: int
    group_heads: int = 0  # 0/1: heads one after another; G: block-major inside groups of G heads
    spin: int = 1  # 1: inline-PTX acquire spin (GPU); 0: Triton atomics in a while loop (the interpreter)
    dq_norm: int = 0  # 0: the shipped dq numerics (unnormalised ds, 1/l at the end); 1: dk's ds tile
    vec: int = 2  # inline-PTX fp32 tile accesses: 2 = .v2 pairs (adjacent, aligned), 1 = one element each

    @property
    def asm_sync(self) -> int:
        """Barriers and dq-tile loads as inline PTX: needed for a pipelined loop (stages > 1), where Triton
        would hoist a tl.load of the tile above the wait; impossible under the interpreter (spin 0). The
        value is the elements per asm of the fp32 tile's read-add and store (``vec``); 0: no asm."""
        return self.vec if self.stages > 1 and self.spin == 1 else 0

    def label(self) -> str:
        extra = (f" g{self.group_heads}" if self.group_heads > 1 else "") + \
            (" spin0" if self.spin == 0 else "") + (" dsnorm" if self.dq_norm else "") + \
            (" scalar" if self.vec == 1 and self.asm_sync else "")
        return f"({self.block},{self.warps}w,{self.stages}s{extra})"


# Per head dim: the configs the GPU run times (all of them with --configs all; --block filters).
CONFIGS = {
    64: [Cfg(64, 4, 2), Cfg(64, 4, 2, dq_norm=1), Cfg(64, 4, 3), Cfg(128, 8, 2, dq_norm=1),
         Cfg(64, 4, 2, group_heads=8)],
    128: [Cfg(64, 8, 2), Cfg(64, 8, 2, dq_norm=1), Cfg(64, 8, 3), Cfg(64, 4, 2),
          Cfg(64, 8, 2, group_heads=8)],
}
# --configs all adds these: block 128 with the shipped dq numerics (spills 0.8 KB at D=64), no software
# pipelining (stages 1: plain Triton loads / stores / debug_barrier), the Triton-atomic spin of the
# interpreter (spin 0) on the GPU, and the default config with one 32-bit access per asm (scalar, the
# first version) instead of .v2 pairs.
EXTRA = {64: [Cfg(128, 8, 2), Cfg(64, 4, 1), Cfg(64, 4, 1, spin=0), Cfg(64, 4, 2, vec=1)],
         128: [Cfg(64, 8, 1), Cfg(64, 8, 1, spin=0), Cfg(64, 8, 2, vec=1)]}
MAX_SPIN = 1 << 20  # acquire reads before a wait gives up (about 0.5-1 s); legal waits are microseconds
DELTA_BLOCK_M = 64  # the delta kernel's block on the GPU


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def constants(scale: float) -> tuple[float, float]:
    """(C1, scale_ds) exactly as attention_launch.constants(scale, None)."""
    return _f32(scale * 1.4426950408889634), _f32(scale)


COMPILED: dict = {}  # (cfg, d) -> the CompiledKernel of the last launch


def launch(cfg: Cfg, q, k, v, do, dq, dk, dv, m, l, delta, acc, cnt, status, seqlen, d, c1, sds, bh,
           max_spin=MAX_SPIN, warmup=False, wrong_order=False):
    if cfg.stages > 1 and not cfg.asm_sync:
        raise ValueError("stages > 1 needs the inline-PTX sync (spin 1): a pipelined tl.load of the dq tile "
                         "would be hoisted above the wait")
    n_blocks = seqlen // cfg.block
    grid = (n_blocks * bh,)
    args = (q, k, v, do, dq, dk, dv, m, l, delta, acc, cnt, status, seqlen, c1, sds, max_spin)
    kw = dict(HEAD_DIM=d, BLOCK=cfg.block, STAGES=cfg.stages, GROUP_HEADS=cfg.group_heads, SPIN=cfg.spin,
              DQ_NORM=cfg.dq_norm, ASM_SYNC=cfg.asm_sync, num_warps=cfg.warps, enable_fp_fusion=False)
    if wrong_order:
        kw["WRONG_ORDER"] = True
    if warmup:
        return ordered_bwd_kernel.warmup(*args, grid=grid, **kw)
    COMPILED[(cfg, d)] = ordered_bwd_kernel[grid](*args, **kw)
    return COMPILED[(cfg, d)]


def check_shape(q, cfg: Cfg):
    b, h, s, d = q.shape
    if not q.is_contiguous() or s % cfg.block or d & (d - 1) or d < 16:
        raise ValueError(f"q: contiguous (B, H, S, D) with S % {cfg.block} == 0 and D a power of two >= 16")
    if cfg.group_heads > 1 and (b * h) % cfg.group_heads:
        raise ValueError(f"batch x heads {b * h} is not a multiple of group_heads {cfg.group_heads}")


class Workspace:
    """The fp32 dq buffer, the counters (zeroed once; every launch leaves them at zero) and the status word,
    kept per (shape, block) like a launcher's plan."""

    def __init__(self):
        self.bufs = {}

    def get(self, q, block: int):
        import torch

        b, h, s, d = q.shape
        key = (b, h, s, d, block, q.device)
        if key not in self.bufs:
            self.bufs[key] = (torch.empty(b, h, s, d, dtype=torch.float32, device=q.device),
                              torch.zeros(b * h * (s // block), dtype=torch.int32, device=q.device),
                              torch.zeros(1, dtype=torch.int32, device=q.device))
        return self.bufs[key]


WORKSPACE = Workspace()


def launch_delta(o, do, delta, block_m: int):
    """delta = rowsum(dO * O) with the shipped numerics (attn_bwd_variants' copy of the shipped row sum),
    dense (B, H, S, D) strides."""
    b, h, s, d = o.shape
    strides = (h * s * d, s * d, d)
    v_delta_kernel[(triton.cdiv(s, block_m), b * h)](
        o, do, delta, h, s, *strides, *strides, h * s, s, 1, HEAD_DIM=d, BLOCK_M=block_m,
        num_warps=4 if o.is_cuda else 1, enable_fp_fusion=False)


def backward(cfg: Cfg, g, q, k, v, o, m, l, scale: float, max_spin: int = MAX_SPIN, ws: Workspace = WORKSPACE,
             delta=None, wrong_order: bool = False, poison: bool = False):
    """(dq, dk, dv) of the causal backward: delta (shipped numerics) + the ordered fused kernel. ``delta``:
    reuse a precomputed one (timing the fused kernel alone). ``poison`` (the checks, not the timing): dq,
    dk, dv AND the fp32 dq buffer are filled with NaN first, so an output element never written, or a
    buffer read that comes before this launch's store of it (an ordering bug; with a buffer left over from
    the previous launch of the same inputs such a read can even give the right bits), shows as NaN."""
    import torch

    check_shape(q, cfg)
    b, h, s, d = q.shape
    c1, sds = constants(scale)
    if delta is None:
        delta = torch.empty_like(m)
        launch_delta(o, g, delta, DELTA_BLOCK_M if q.is_cuda else 16)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    acc, cnt, status = ws.get(q, cfg.block)
    if poison:
        for t in (dq, dk, dv, acc):
            t.fill_(float("nan"))
    if wrong_order and q.is_cuda:
        raise ValueError("wrong_order is for the interpreter only: on a GPU it waits on later programs")
    launch(cfg, q, k, v, g, dq, dk, dv, m, l, delta, acc, cnt, status, s, d, c1, sds, b * h, max_spin,
           wrong_order=wrong_order)
    return dq, dk, dv


def same_bits(x, y) -> bool:
    """Bit-for-bit equality (torch.equal calls -0.0 == 0.0 and NaN != NaN)."""
    import torch

    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    ity = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return torch.equal(x.contiguous().view(ity), y.contiguous().view(ity))


def unwritten(grads) -> int:
    """Elements still NaN after a ``poison`` run (inputs are finite randn: a real gradient is finite)."""
    return int(sum(int(t.isnan().sum().item()) for t in grads))


def health(cfg: Cfg, q, ws: Workspace = WORKSPACE) -> str:
    """'' when every wait so far was satisfied and the counters are back at 0, else what is wrong."""
    acc, cnt, status = ws.get(q, cfg.block)
    bad = int(status.item())
    left = int((cnt != 0).sum().item())
    return "" if not bad and not left else f"{bad} timed-out waits, {left} counters not reset"


def reset(cfg: Cfg, q, ws: Workspace = WORKSPACE) -> None:
    acc, cnt, status = ws.get(q, cfg.block)
    cnt.zero_()
    status.zero_()


def config_list(dims, blocks, which: str) -> list[tuple[int, Cfg]]:
    out = []
    for d in dims:
        cfgs = CONFIGS[d] + (EXTRA[d] if which == "all" else [])
        out += [(d, c) for c in cfgs if c.block in blocks]
    return list(dict.fromkeys(out))


# ------------------------------------------------------------------------------------------------------
# Offline sm_90 compile (--compile-only; Triton 3.6 in /tmp/t36, no torch, no GPU)
# ------------------------------------------------------------------------------------------------------

_PTR_TYPES = {"m_ptr": "*fp32", "l_ptr": "*fp32", "delta_ptr": "*fp32", "acc_ptr": "*fp32",
              "cnt_ptr": "*i32", "status_ptr": "*i32"}


def compile_sm90(cfg: Cfg, d: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = ordered_bwd_kernel
    constexprs = dict(HEAD_DIM=d, BLOCK=cfg.block, STAGES=cfg.stages, GROUP_HEADS=cfg.group_heads,
                      SPIN=cfg.spin, DQ_NORM=cfg.dq_norm, ASM_SYNC=cfg.asm_sync)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = _PTR_TYPES.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("C1", "scale_ds"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"  # seqlen, max_spin: not specialised (do_not_specialize)
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.warps, "enable_fp_fusion": False})


def loop_order(ttgir: str) -> tuple[bool, str]:
    """Checks the order of the ordered-accumulation protocol in the main loop of the FINAL TritonGPU IR
    (after software pipelining; structured control flow, so text order is execution order within an
    iteration): the five products, the spin (acquire), a barrier, ONE read of the dq tile, its store, a
    barrier, the release; no asynchronous copy of an fp32 tile (a pipelined prefetch of the dq tile would be
    one). Returns (ok, a one-line summary)."""
    lines = ttgir.splitlines()
    start = next((i for i, ln in enumerate(lines) if "scf.for" in ln), None)
    if start is None:
        return False, "no loop"
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = next(i for i in range(start + 1, len(lines))
               if lines[i].strip().startswith("}") and len(lines[i]) - len(lines[i].lstrip()) == indent)
    body = lines[start + 1:end]

    def where(pattern: str) -> list[int]:
        return [i for i, ln in enumerate(body) if re.search(pattern, ln)]

    spin = where(r"ld\.acquire|atomic_rmw add, acquire")
    barrier = where(r"bar\.sync|bar\.red|gpu\.barrier")
    load = where(r"ld\.global\.cg|tt\.load .*cacheModifier = cg")
    store = where(r"st\.global\.cg|tt\.store .*cacheModifier = cg")
    release = where(r"atomic_rmw exch, release, gpu")
    dots = where(r"warp_group_dot |tt\.dot ")
    async_f32 = where(r"async_copy_global_to_local .*tensor<\d+x\d+x!tt\.ptr<f32>")
    problems = []
    if not (spin and load and store and release):
        return False, f"missing ops: spin {spin} load {load} store {store} release {release}"
    if len(load) != 1:
        problems.append(f"{len(load)} reads of the dq tile (rematerialised)")
    if async_f32:
        problems.append("an fp32 tile is prefetched asynchronously")
    if not spin[0] < load[0] < store[0]:
        problems.append("the tile read is not between the spin and the store")
    if not any(spin[-1] < b < load[0] for b in barrier):
        problems.append("no barrier between the spin and the read")
    if not any(store[-1] < b < release[0] for b in barrier):
        problems.append("no barrier between the store and the release")
    before = sum(d < spin[0] for d in dots)
    summary = (f"spin@{spin[0]} read@{load} store@{store} release@{release[0]}, {before}/{len(dots)} "
               "products before the spin")
    return not problems, summary + ("" if not problems else " -- " + "; ".join(problems))


def ptx_pairs_ok(ptx: str) -> tuple[bool, str]:
    """The ``.v2`` tile accesses (``_READ_ADD_V2``, ``_STORE_V2``) assume that the two pointers of each asm
    pair are ``p`` and ``p + 4``: resolves each pointer register of every ``// v2pair`` comment through the
    PTX's ``add.s64 reg, reg, imm`` / ``mov.b64`` definitions to (root register, byte offset) and checks same
    root, offsets differing by 4 and the first a multiple of 8 from the root. Fails closed: a register it
    cannot resolve, or one defined twice, fails. (True, ...) when there is no ``.v2`` access."""
    defs: dict[str, tuple[str, int] | None] = {}
    pattern = r"^\s*(?:add\.s64\s+(%rd\d+),\s*(%rd\d+),\s*(-?\d+)|mov\.b64\s+(%rd\d+),\s*(%rd\d+))\s*;"
    for m in re.finditer(pattern, ptx, re.M):
        if m.group(1):
            dst, src, off = m.group(1), m.group(2), int(m.group(3))
        else:
            dst, src, off = m.group(4), m.group(5), 0
        defs[dst] = None if dst in defs else (src, off)  # defined twice: ambiguous

    def resolve(reg: str) -> tuple[str, int] | None:
        off = 0
        for _ in range(64):
            if reg not in defs:
                return reg, off
            d = defs[reg]
            if d is None:
                return None
            reg, off = d[0], off + d[1]
        return None

    pairs = re.findall(r"// v2pair (%rd\d+) (%rd\d+)", ptx)
    for p0, p1 in pairs:
        r0, r1 = resolve(p0), resolve(p1)
        if r0 is None or r1 is None or r0[0] != r1[0] or r1[1] - r0[1] != 4 or r0[1] % 8:
            return False, f"v2 pair {p0} {p1} not adjacent/aligned: {r0} {r1}"
    return True, f"{len(pairs)} v2 pairs adjacent"


def ptx_sync_report(ptx: str) -> list[tuple[int, str]]:
    """(line, text) of the PTX instructions that matter for the protocol, in text order: acquire / release
    atomics, barriers, fences, the dq-tile loads and stores, labels and branches (to follow the control
    flow: text order is not execution order across basic blocks)."""
    keep = re.compile(r"\b(atom|red|bar\.sync|fence|membar|ld\.acquire|ld\.global\.cg|st\.global\.cg|bra)\b|"
                      r"^\$L__BB|SPIN|DONE|cp\.async\.(commit|wait)")
    return [(i + 1, ln.strip()) for i, ln in enumerate(ptx.splitlines()) if keep.search(ln.strip())]


def compile_stats(job) -> dict:
    d, cfg, want_ptx = job
    try:
        c = compile_sm90(cfg, d)
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[-800:]}"}
    ptx = c.asm["ptx"]
    stats = {"ok": True, "shared": c.metadata.shared}
    stats["order_ok"], stats["order"] = loop_order(c.asm["ttgir"])
    pairs_ok, pairs = ptx_pairs_ok(ptx)
    if not pairs_ok:
        stats["order_ok"] = False
    stats["order"] += "; " + pairs
    stats["regs"], stats["spill"], sass = _sm90.binary_stats(c)  # built with --fmad=false, as Triton does
    for op in ("HGMMA", "HMMA", "LDGSTS", "LDL", "BAR", "MEMBAR", "ATOM", "ATOMG", "RED", "LDG", "STG"):
        stats[op] = len(re.findall(rf"\b{op}\b", sass))
    # the dq tile's accesses (and the spin): strong (L2: .cg / acquire) global loads / stores by width
    for op in ("LDG", "STG"):
        widths = re.findall(rf"\b{op}\.E(?:\.(64|128))?\.STRONG\.GPU\b", sass)
        stats[op + ".STRONG"] = "/".join(str(widths.count(w)) for w in ("", "64", "128"))
    stats["ld.acquire"] = len(re.findall(r"ld\.acquire", ptx))
    stats["cp.async"] = len(re.findall(r"cp\.async\.(?:ca|cg)", ptx))
    stats["fma"] = len(re.findall(r"\bfma\.rn\.f32", ptx)) + len(re.findall(r"\bFFMA\b", sass))
    if want_ptx:
        stats["ptx"] = ptx
        stats["sass_sync"] = [ln.strip() for ln in sass.splitlines()
                              if re.search(r"\b(BAR|MEMBAR|ATOM|ATOMG|RED|LDG\.E\.STRONG|CCTL|ERRBAR|FENCE)",
                                           ln) or "LDG" in ln and ".STRONG.GPU" in ln]
    return stats


def compile_only(items, workers: int, ptx_dir: str = "") -> int:
    from concurrent.futures import ProcessPoolExecutor

    print(f"triton {triton.__version__}: compiling {len(items)} kernels for sm_90 on {workers} processes",
          flush=True)
    jobs = [(d, c, bool(ptx_dir)) for d, c in items]
    with ProcessPoolExecutor(workers) as pool:
        results = list(pool.map(compile_stats, jobs))
    bad = 0
    for (d, cfg), r in zip(items, results, strict=True):
        name = f"D={d} {cfg.label()}"
        if not r["ok"]:
            bad += 1
            print(f"{name:34s} FAILED: {r['error']}")
            continue
        print(f"{name:34s} regs={r['regs']:3d} spill={r['spill']:5d} smem={r['shared']:6d} "
              f"HGMMA={r['HGMMA']:3d} LDGSTS={r['LDGSTS']:3d} cp.async={r['cp.async']:3d} BAR={r['BAR']:3d} "
              f"MEMBAR={r['MEMBAR']} ATOMG={r['ATOMG']} RED={r['RED']} ld.acquire={r['ld.acquire']} "
              f"LDL={r['LDL']} fma={r['fma']}")
        print(f"{'':34s} SASS strong (L2) accesses, 32/64/128-bit: LDG {r['LDG.STRONG']} (the spin's "
              f"acquire + the dq tile reads) STG {r['STG.STRONG']} (the dq tile stores)")
        print(f"{'':34s} loop order {'ok' if r['order_ok'] else 'WRONG'}: {r['order']}")
        bad += not r["order_ok"]
        if ptx_dir:
            os.makedirs(ptx_dir, exist_ok=True)
            stem = os.path.join(ptx_dir, f"ordered_d{d}_b{cfg.block}_w{cfg.warps}_s{cfg.stages}"
                                f"_g{cfg.group_heads}_spin{cfg.spin}_n{cfg.dq_norm}")
            with open(stem + ".ptx", "w") as f:
                f.write(r["ptx"])
            with open(stem + ".sync.txt", "w") as f:
                f.write("\n".join(f"{i:6d}  {s}" for i, s in ptx_sync_report(r["ptx"])))
                f.write("\n\nSASS sync instructions:\n" + "\n".join(r["sass_sync"]) + "\n")
            print(f"{'':34s} PTX and sync listing: {stem}.ptx / .sync.txt")
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------------------
# CPU check under Triton's interpreter (--interpret-check; tests/test_attn_bwd_ordered.py)
# ------------------------------------------------------------------------------------------------------

INTERP_CFGS = (Cfg(16, 1, 1, spin=0), Cfg(32, 1, 1, spin=0), Cfg(16, 1, 1, spin=0, dq_norm=1))


def oracle_check(oracle, got, q, k, v, g, scale) -> float:
    """Max over dq / dk / dv of error / float64 bound (tests/oracle.py, as the GPU tests; <= 1 passes)."""
    r, e_q, e_k, e_v = oracle.attention_gradients(q, k, v, g, is_causal=True, scale=scale)
    bounds = oracle.attention_bounds(r, q, g, scale=scale)
    worst = 0.0
    for got_i, exp, bound in zip(got, (e_q, e_k, e_v), bounds[2:], strict=True):
        bd = oracle.add_rounding(bound, exp, q.dtype)
        worst = max(worst, oracle.max_violation(got_i.double(), exp, bd)[0])
    return worst


def interpret_check(shapes=((1, 2, 64, 32),), dtypes=None, cfgs=INTERP_CFGS, log=print) -> list[str]:
    """Every interpreter config on small causal problems (fp16 and fp32: the interpreter's bf16 tl.dot is
    wrong): oracle bound, two runs with identical bits, counters back at zero and no timed-out wait, dk/dv
    bits equal to safeops' interpreted backward when the query step is its 16; and the same kernel with
    ascending key blocks (waits on later programs) must report timed-out waits. Returns the failures."""
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpret_check: set TRITON_INTERPRET=1 before triton is imported")
    os.environ.setdefault("SAFEOPS_BACKEND", "triton")
    sys.path.insert(0, str(ROOT / "tests"))
    import oracle

    import safeops  # noqa: F401  (torch.ops.safeops, the shipped interpreted backward)

    dtypes = dtypes or (torch.float16, torch.float32)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    failures = []
    for b, h, s, d in shapes:
        for dt in dtypes:
            q, k, v, g = (torch.randn(b, h, s, d, dtype=dt, generator=gen) for _ in range(4))
            scale = 1.0 / math.sqrt(d)
            opts = (None, 0, None, None, s, s, True, scale, None, -1, 0, 0)
            o, m, l = torch.ops.safeops.attention(q, k, v, *opts)
            ref = torch.ops.safeops.attention_backward(g, q, k, v, o, m, l, *opts)
            for cfg in cfgs:
                name = f"B{b} H{h} S{s} D{d} {str(dt)[6:]} {cfg.label()}"
                reset(cfg, q)
                got = backward(cfg, g, q, k, v, o, m, l, scale, max_spin=4, poison=True)
                again = backward(cfg, g, q, k, v, o, m, l, scale, max_spin=4, poison=True)
                ratio = oracle_check(oracle, got, q, k, v, g, scale)
                same = all(same_bits(x, y) for x, y in zip(got, again, strict=True))
                kv_same = all(same_bits(x, y) for x, y in zip(got[1:], ref[1:], strict=True))
                nan = unwritten(got) + unwritten(again)
                hl = health(cfg, q)
                log(f"interp {name}: oracle {ratio:.3f} deterministic {same} dk/dv == shipped {kv_same} "
                    f"unwritten {nan} health {hl or 'ok'}")
                if nan:
                    failures.append(f"{name}: {nan} elements unwritten or read before written (NaN poison)")
                if ratio > 1.0:
                    failures.append(f"{name}: oracle ratio {ratio:.3f} > 1")
                if not same:
                    failures.append(f"{name}: two runs differ")
                if hl:
                    failures.append(f"{name}: {hl}")
                if cfg.block == 16 and not kv_same:
                    failures.append(f"{name}: dk/dv bits differ from the shipped backward (same query step)")
            cfg = cfgs[0]
            reset(cfg, q)
            bad = backward(cfg, g, q, k, v, o, m, l, scale, max_spin=4, wrong_order=True, poison=True)
            hl = health(cfg, q)
            nan = unwritten(bad)
            reset(cfg, q)
            log(f"interp ascending key blocks (waits on later ids): {hl or 'NOT DETECTED'}; "
                f"{nan} NaN (reads before the write)")
            if not hl:
                failures.append("waits on later program ids were not detected")
            if not nan:
                failures.append("reads of the dq buffer before its write left no NaN (the poison check)")
    return failures


# ------------------------------------------------------------------------------------------------------
# GPU run
# ------------------------------------------------------------------------------------------------------

CASES = ((4, 16, 4096), (1, 32, 4096))  # B4 H16 S4K; Llama-1B's 32 query heads at B1 S4K (as MHA)
# The guard's problem: many more programs than fit on the GPU at once (B1 H32 S4K: 2048 programs at block 64,
# 1024 at 128, vs 132-264 resident), so a wait on a program that was not dispatched yet (if dispatch were
# not in id order) really happens; B x H a multiple of the group_heads configs' 8. A small problem (all
# programs resident at once) could not deadlock whatever the order.
GUARD_SHAPE = (1, 32, 4096)
# The guard's spin bound: a legal wait is a few steps (microseconds; at most ~n_blocks steps down a head's
# chain); 2^16 acquire reads (~20-70 ms) turns a dispatch-order deadlock into reported timed-out waits in
# seconds instead of a hang of minutes.
GUARD_MAX_SPIN = 1 << 16


def _warm_job(job):
    """Process-pool worker: compile one config into Triton's cache (MockTensor arguments, the real integer
    arguments; seqlen and max_spin are not specialised, so one kernel serves every case)."""
    import torch
    from triton.runtime.jit import MockTensor

    d, cfg = job
    try:
        x, f32, i32 = MockTensor(torch.bfloat16), MockTensor(torch.float32), MockTensor(torch.int32)
        c1, sds = constants(1.0 / math.sqrt(d))
        launch(cfg, x, x, x, x, x, x, x, f32, f32, f32, f32, i32, i32, 4096, d, c1, sds, 64, warmup=True)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[-300:]}"


def _inputs(b, h, s, d, seed=None, device="cuda", dtype=None):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed if seed is not None else
                                                     int.from_bytes(os.urandom(4), "little"))
    dtype = dtype or torch.bfloat16
    q, k, v, g = (torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen) for _ in range(4))
    scale = 1.0 / math.sqrt(d)
    opts = (None, 0, None, None, s, s, True, scale, None, -1, 0, 0)
    o, m, l = torch.ops.safeops.attention(q, k, v, *opts)
    return q, k, v, g, o, m, l, scale, opts


def guard_child(items) -> int:
    """Runs in a subprocess with a timeout: each config once on GUARD_SHAPE with the short GUARD_MAX_SPIN;
    prints a START line before and a GUARD line after each config, so the parent can tell which config hung
    (a deadlock hangs here, not in the main run)."""
    import torch

    import safeops  # noqa: F401

    b, h, s = GUARD_SHAPE
    inputs = {}
    for d, cfg in items:
        print(f"START {d} {cfg.label()}", flush=True)
        t = time.time()
        try:
            if d not in inputs:
                inputs[d] = _inputs(b, h, s, d, seed=0)
            q, k, v, g, o, m, l, scale, _ = inputs[d]
            reset(cfg, q)
            got = backward(cfg, g, q, k, v, o, m, l, scale, max_spin=GUARD_MAX_SPIN, poison=True)
            torch.cuda.synchronize()
            nan = unwritten(got)
            state = health(cfg, q) + (f" {nan} NaN outputs" if nan else "")
            state = "ok" if not state else state.strip() + " -"
            reset(cfg, q)
        except Exception as e:  # a CUDA error is sticky (every later launch here would fail): stop, the
            # parent runs the rest in a fresh process
            print(f"GUARD {d} {cfg.label()} {time.time() - t:.2f}s error {type(e).__name__}: "
                  f"{str(e)[:200]} -", flush=True)
            return 3
        print(f"GUARD {d} {cfg.label()} {time.time() - t:.2f}s {state}", flush=True)
    return 0


def run_guard(args, items, timeout: float) -> dict:
    """(d, label) -> '' (finished, healthy) or what went wrong. The child runs the configs in order; when it
    hangs (killed at the time limit) or dies (a CUDA error poisons its context), the config it had STARTED
    but not finished is marked, and a fresh child runs the rest, within ``timeout`` seconds in all."""
    base = [sys.executable, str(Path(__file__).resolve()), "--guard-child", "--d", args.d,
            "--block", args.block]
    if args.configs:
        base += ["--configs", args.configs]
    todo = [(d, cfg.label()) for d, cfg in items]
    result: dict = {}
    deadline = time.time() + timeout
    while todo:
        left = deadline - time.time()
        if left < 10:
            for key in todo:
                result[key] = f"guard: not run (the {timeout:.0f} s guard budget was spent)"
            break
        out, note = "", ""
        try:
            proc = subprocess.run(base + ["--guard-only", repr(todo)], capture_output=True, text=True,
                                  timeout=left)
            out = proc.stdout
            if proc.returncode:
                note = f"guard child exited {proc.returncode}: {proc.stderr[-300:]}"
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            note = f"guard child TIMED OUT after {left:.0f} s and was killed (deadlock?)"
        started = []
        for line in out.splitlines():
            if line.startswith(("START ", "GUARD ")):
                kind, d, rest = line.split(" ", 2)
                key = (int(d), rest[:rest.index(")") + 1])
                if kind == "START":
                    started.append(key)
                else:
                    result[key] = "" if rest.rsplit(" ", 1)[-1] == "ok" else line
        hung = [key for key in started if key not in result]
        for key in hung:
            result[key] = f"guard: {note or 'no result'}"
        if note:
            print(note, flush=True)
        rest_todo = [key for key in todo if key not in result]
        if len(rest_todo) == len(todo):  # no progress (the child died before its first config): give up
            for key in rest_todo:
                result[key] = f"guard: not reached ({note or 'child ended'})"
            break
        todo = rest_todo
    return result


def _info(compiled) -> str:
    try:
        compiled._init_handles()
        return f"{compiled.n_regs}/{compiled.n_spills}/{compiled.metadata.shared}"
    except Exception as e:
        return f"(no metadata: {type(e).__name__})"


def run_case(b, h, s, d, cfgs, args, H, A, oracle, rows, guard, device="cuda", dtype=None) -> None:
    """Shipped backward, each config and cuDNN on one (B, H, S, D) causal bf16 case. (``device="cpu"`` with
    fp16 and interpreter configs: the CPU test of this code.)"""
    import torch

    label = f"B{b} H{h} S{s} D{d}"
    q, k, v, g, o, m, l, scale, opts = _inputs(b, h, s, d, device=device, dtype=dtype)
    on_gpu = q.is_cuda

    def sync():
        if on_gpu:
            torch.cuda.synchronize()
    flops = 2.5 * 4.0 * b * h * s * s * d / 2

    def tflops(ms):
        return flops / ms * 1e-9

    ref = torch.ops.safeops.attention_backward(g, q, k, v, o, m, l, *opts)
    sl = (slice(0, 1), slice(0, 1))
    qc, kc, vc, gc = (t[sl].cpu() for t in (q, k, v, g))
    r, e_q, e_k, e_v = oracle.attention_gradients(qc, kc, vc, gc, is_causal=True, scale=scale)
    bounds = oracle.attention_bounds(r, qc, gc, scale=scale)
    exp = (e_q, e_k, e_v)
    bnds = [oracle.add_rounding(bounds[2 + i], exp[i], q.dtype) for i in range(3)]
    del r

    def ratio(grads):
        return max(oracle.max_violation(x[sl].cpu().double(), e, bd)[0]
                   for x, e, bd in zip(grads, exp, bnds, strict=True))

    ship_ms = H.bench_ms(lambda: torch.ops.safeops.attention_backward(g, q, k, v, o, m, l, *opts))[0]
    rows.append((label, "safeops shipped", ship_ms, tflops(ship_ms), 1.0, math.nan, ratio(ref), "-", "ref",
                 "-", "", ""))
    print(f"{label}: shipped {ship_ms:.3f} ms {tflops(ship_ms):.0f} TFLOP/s", flush=True)
    for cfg in cfgs:
        name = cfg.label()
        bad = guard.get((d, name), "")
        if bad:
            rows.append((label, name, math.nan, math.nan, math.nan, math.nan, math.nan, "-", "-", "-", "-",
                         "skipped: " + bad[:160]))
            continue
        try:
            check_shape(q, cfg)
            acc, cnt, status = WORKSPACE.get(q, cfg.block)
            c1, sds = constants(scale)
            if on_gpu:  # the compiled loop must keep the protocol's order (checked before any launch)
                compiled = launch(cfg, q, k, v, g, q, k, v, m, l, m, acc, cnt, status, s, d, c1, sds, b * h,
                                  warmup=True)
                order_ok, order = loop_order(compiled.asm["ttgir"])
                pairs_ok, pairs = ptx_pairs_ok(compiled.asm["ptx"])
                order_ok, order = order_ok and pairs_ok, order + "; " + pairs
            else:
                order_ok, order = True, "interpreter, not compiled"
            if not order_ok:
                rows.append((label, name, math.nan, math.nan, math.nan, math.nan, math.nan, "-", "-", "-",
                             "-", "loop order check FAILED: " + order))
                continue
            reset(cfg, q)
            # 3 runs, each into NaN-filled outputs and a NaN-filled dq buffer (see backward's poison)
            runs = []
            for _ in range(3):
                runs.append(backward(cfg, g, q, k, v, o, m, l, scale, poison=True))
                sync()
            got = runs[0]
            nan = sum(unwritten(r) for r in runs)
            det = all(same_bits(x, y) for other in runs[1:] for x, y in zip(got, other, strict=True))
            det = det and not nan
            kv_same = all(same_bits(x, y) for x, y in zip(got[1:], ref[1:], strict=True))
            dq_diff = (got[0].float() - ref[0].float()).abs().max().item()
            rat = ratio(got)
            del runs
            ms = H.bench_ms(lambda cfg=cfg: backward(cfg, g, q, k, v, o, m, l, scale))[0]
            delta = torch.empty_like(m)
            launch_delta(o, g, delta, DELTA_BLOCK_M if on_gpu else 16)
            kms = H.bench_ms(lambda cfg=cfg, delta=delta: backward(cfg, g, q, k, v, o, m, l, scale,
                                                                   delta=delta))[0]
            sync()
            hl = health(cfg, q)
            note = ("ok" if rat <= 1 and det and not hl else "FAILED") + (f"; {hl}" if hl else "") + \
                (f"; {nan} NaN (unwritten / read before written)" if nan else "") + \
                f"; order: {order.split(',')[-1].strip()}"
            rows.append((label, name, ms, tflops(ms), ship_ms / ms, kms, rat, "yes" if det else "NO",
                         "same" if kv_same else "diff", f"{dq_diff:.2g}",
                         _info(COMPILED[(cfg, d)]) if on_gpu else "-", note))
            print(f"{label}: {name:26s} {ms:.3f} ms {tflops(ms):5.0f} TFLOP/s x{ship_ms / ms:.2f} kernel "
                  f"{kms:.3f} ms oracle {rat:.3f} det {det} dk/dv {'same' if kv_same else 'diff'} dq|diff| "
                  f"{dq_diff:.2g} {note}", flush=True)
        except Exception as e:
            rows.append((label, name, math.nan, math.nan, math.nan, math.nan, math.nan, "-", "-", "-", "-",
                         f"error: {type(e).__name__}: {str(e)[:200]}"))
            print(f"{label}: {name}: error {type(e).__name__}: {str(e)[:400]}", flush=True)
    if not args.no_cudnn:
        try:
            case = H.Case("bwd", torch.bfloat16, (b, h, s, d, 1, 3))
            fn = A.sdpa_builder("CUDNN_ATTENTION")(case, {"q": q, "k": k, "v": v, "g": g, "causal": True})
            fn()
            ms = H.bench_ms(fn)[0]
            rows.append((label, "sdpa cudnn", ms, tflops(ms), ship_ms / ms, math.nan, math.nan, "-", "-", "-",
                         "", ""))
            print(f"{label}: cudnn {ms:.3f} ms {tflops(ms):.0f} TFLOP/s", flush=True)
        except Exception as e:
            rows.append((label, "sdpa cudnn", math.nan, math.nan, math.nan, math.nan, math.nan, "-", "-", "-",
                         "", f"error: {type(e).__name__}: {str(e)[:160]}"))


def gpu_main(args, items) -> int:
    import threading
    from concurrent.futures import ProcessPoolExecutor

    import torch

    sys.path.insert(0, str(HERE))
    import _harness as H

    H.require_cuda("bench/attn_bwd_ordered.py")
    t_start = time.time()
    pool = ProcessPoolExecutor(max(1, min(args.workers or (os.cpu_count() or 1), len(items))),
                               mp_context=__import__("multiprocessing").get_context("spawn"))
    futures = [pool.submit(_warm_job, it) for it in items]

    import safeops  # noqa: F401
    from safeops.ops import attention_launch as L

    shipped_thread = None
    try:  # the shipped forward + backward launches of every case, compiled in parallel (as the variants file)
        import json

        with L.recording() as launches:
            for b, h, s in CASES + (GUARD_SHAPE,):
                for d in sorted({d for d, _ in items}):
                    qm = torch.empty(b, h, s, d, dtype=torch.bfloat16, device="meta")
                    opts = (None, 0, None, None, s, s, True, 1.0 / math.sqrt(d), None, -1, 0, 0)
                    out, mm, ll = L.forward(qm, qm, qm, *opts)
                    L.backward(qm, qm, qm, qm, out, mm, ll, *opts)
        unique = list({json.dumps(x, sort_keys=True): x for x in launches}.values())
        shipped_thread = threading.Thread(target=lambda: L.compile_launches(unique, timeout=300), daemon=True)
        shipped_thread.start()
    except Exception as e:
        print(f"shipped precompile skipped: {e}", flush=True)
    failures = {}
    for it, f in zip(items, futures, strict=True):
        err = f.result()
        if err:
            failures[it] = err
            print(f"compile FAILED D={it[0]} {it[1].label()}: {err}", flush=True)
    pool.shutdown()
    if shipped_thread is not None:
        shipped_thread.join(timeout=240)
    print(f"precompiled {len(items)} kernels ({len(failures)} failed): {time.time() - t_start:.1f} s",
          flush=True)
    items = [it for it in items if it not in failures]
    guard = {} if args.no_guard else run_guard(args, items, timeout=args.guard_timeout)
    print(f"guard: {sum(not v for v in guard.values())}/{len(guard)} ok, {time.time() - t_start:.1f} s",
          flush=True)

    sys.path.insert(0, str(ROOT / "tests"))
    import attention as A
    import oracle

    rows = []
    for b, h, s in CASES:
        for d in sorted({d for d, _ in items}):
            run_case(b, h, s, d, [c for dd, c in items if dd == d], args, H, A, oracle, rows, guard)
            torch.cuda.empty_cache()
    lines = [f"ordered fused attention backward (bench/attn_bwd_ordered.py), causal bf16, "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}. "
             "ms / TFLOP/s: whole backward (delta + fused kernel; shipped: its 3 kernels), TFLOP/s = 2.5 x "
             "forward flops halved for causal; x shipped = speed-up; kernel ms: the fused kernel alone; "
             "oracle: max error / float64 bound on head 0 (<= 1 passes); det: 3 runs bit-identical; dk/dv: "
             "bits vs the shipped; dq |diff|: max vs the shipped dq (different summation order); "
             "regs/spills/smem.",
             "",
             "| case | impl | ms | TFLOP/s | x shipped | kernel ms | oracle | det | dk/dv | dq diff | "
             "regs/spill/smem | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        label, name, ms, tf, sp, kms, rat, det, kv, dqd, info, note = row
        lines.append(f"| {label} | {name} | {ms:.3f} | {tf:.0f} | {sp:.2f} | {kms:.3f} | {rat:.3f} | {det} | "
                     f"{kv} | {dqd} | {info} | {note} |")
    if failures:
        lines += ["", "compile failures:"] + [f"  D={d} {c.label()}: {e}" for (d, c), e in failures.items()]
    bad_guard = {k: v for k, v in guard.items() if v}
    if bad_guard:
        lines += ["", "guard (small problem in a subprocess with a timeout):"] + \
            [f"  D={d} {lab}: {v}" for (d, lab), v in bad_guard.items()]
    lines.append(f"\ntotal {time.time() - t_start:.0f} s")
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "attn_bwd_ordered.md").write_text(text + "\n")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", default="64,128")
    p.add_argument("--block", default="64,128")
    p.add_argument("--configs", default="", help="'all': also the extra configs")
    p.add_argument("--out", default="")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--no-cudnn", action="store_true")
    p.add_argument("--no-guard", action="store_true", help="skip the subprocess deadlock guard")
    p.add_argument("--guard-timeout", type=float, default=60.0, help="the guard's budget (s), all configs")
    p.add_argument("--compile-only", action="store_true", help="offline sm_90 compile stats (no GPU)")
    p.add_argument("--ptx", default="", help="with --compile-only: write PTX + sync listings to this folder")
    p.add_argument("--interpret-check", action="store_true", help="CPU: oracle + determinism, interpreter")
    p.add_argument("--guard-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--guard-only", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    dims = tuple(int(x) for x in args.d.split(","))
    blocks = tuple(int(x) for x in args.block.split(","))
    items = config_list(dims, blocks, args.configs)
    if args.compile_only:
        return compile_only(items, args.workers or os.cpu_count() or 1, args.ptx)
    if args.interpret_check:
        failures = interpret_check()
        print("interpret check:", "all passed" if not failures else "FAILED: " + "; ".join(failures))
        return 1 if failures else 0
    if args.guard_child:
        if args.guard_only:
            keep = set(ast.literal_eval(args.guard_only))
            items = [(d, c) for d, c in items if (d, c.label()) in keep]
        return guard_child(items)
    return gpu_main(args, items)


if __name__ == "__main__":
    # Run through the module name, so the process-pool workers (spawn) and this process define the kernel in
    # the same module (Triton's cache key) and pickle configs by the same class name.
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    import attn_bwd_ordered

    sys.exit(attn_bwd_ordered.main())
