"""Lower-register variants of the attention backward's dk/dv kernel (``attn_bwd_dkdv_kernel``), GQA split.

With GQA the shipped dk/dv program loops over GROUP / SPLIT query heads of its kv head (an ``scf.for``
around the query-block loops). At the 1.1B Llama layer (B=1, 32 q / 4 kv heads, S=4K, D=64, causal, bf16,
(B, S, H, D) layout) the shipped tile (32, 128, 4, 2) needs 255 registers and spills 216 B at split 4 (two
heads per program, the launcher's default), none at split 8 (one head: the one-iteration head loop folds
away); but at split 8 ptxas serializes every wgmma instead (C7515). Offline (sm_90, Triton 3.6) the spill
traffic is outside the query-block loops (per head, not per step): index vectors and pointer tiles that
LICM hoists out of the head loop stay live across the unmasked loop. See scratch/notes_attn_dkdv_variants.md.

Every variant here is a full dk/dv kernel with the shipped kernel's launch arguments, the same arithmetic
per element and the same accumulation order (the same dk / dv bits); they differ in how the head loop and
the per-step addresses are built:

- ``copy``: the shipped kernel's structure through this file's helpers (checks the harness).
- ``unroll``: the head loop unrolled (``tl.static_range``).
- ``off32``: q / dO addressed as a scalar per-head base plus one int32 offset tile, not a 64-bit pointer tile.
- ``nolicm``: the shipped structure, ``tl.range(..., disable_licm=True)`` on the head loop.
- ``flat``: one pipelined loop over the program's (head, query block) steps in the shipped order, every step
  on the masked path (a fully visible block masks nothing: same values); int32 offset tiles.
- ``flat_if``: ``flat`` with the window / causal select under a run-time ``if`` of the masked steps.
- ``remat``: the row / key index vectors rebuilt per head from an opaque zero (``pid_h // n_heads``), so
  they and what derives from them are not hoisted out of the head loop.
- ``remat_nolicm``: ``remat`` + ``nolicm``. ``remat_all``: also the query-block ranges per head.
- ``remat_range_nolicm``: rebuilt per query-block range instead of per head. ``unroll_remat``: ``remat``
  with the head loop unrolled.

Modes (``python3 bench/attn_dkdv_variants.py ...``):

- ``--compile-only``: records the shipped launcher's dk/dv launch at the Llama layer (meta tensors, split
  forced to each ``--splits``), compiles the shipped kernel and each variant for sm_90 with Triton 3.6
  (/tmp/t36, no GPU) and prints registers / spill bytes / shared memory (``--dump DIR``: PTX and SASS).
- ``--interpret-check``: CPU, Triton's interpreter: dk / dv bits of every variant against the shipped
  kernel on small GQA shapes (fp16 / fp32, causal or not, EVEN or not, packed varlen).
- default (GPU): the whole backward (``torch.ops.safeops.attention_backward``: delta + dk/dv + split sum +
  dq) at the Llama layer (and ``--layer hq=32,hkv=8,d=128``) with the shipped kernel and with each variant
  swapped into ``attention_launch._kernels``; dk / dv bits against the shipped ones, whole-backward ms and
  dk/dv device us (torch.profiler). One line per variant and a summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# safeops first: on a machine without a GPU it turns on Triton's interpreter, which must happen before triton
# is imported. The offline compiler's Python has no torch: there ``safeops`` is a bare package module already.
import safeops  # noqa: E402, F401, I001
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from safeops.kernels.attention import (  # noqa: E402
    SIZE_ARGS,
    _apply_masks,
    _backward_program,
    _block_ranges,
    _dkdv_inner,
    _dot,
    _dsoftcap,
    _load_step,
    _prep,
    _probs,
    _row_stats,
    _scores,
    _sequence,
    _tail_end,
    attn_bwd_dkdv_kernel,
)

SHIPPED = "attn_bwd_dkdv_kernel"


# ---------------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _step(dk, dv, k, v, q, do, m_ptr, l_ptr, delta_ptr, offs_m, offs_n, q_ok, mask_ptr, seqlen_q, seqlen_k,
          smi, smj, window_left, window_right, C1, C2,
          MASKED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
          SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, EVEN: tl.constexpr):
    """One query block's contribution to dk / dv: the body of the shipped ``_dkdv_inner`` after its loads,
    operation for operation. ``m_ptr`` / ``l_ptr`` / ``delta_ptr``: this head's statistics rows (per-sequence
    base added), indexed by ``offs_m * sts`` already folded in by the caller."""
    q = _prep(q, PRECISION)
    sT = _dot(k, tl.trans(q), tl.zeros([k.shape[0], BLOCK_M], tl.float32), PRECISION)
    zT = _scores(sT, C1, C2, SOFTCAP)
    zT = _apply_masks(zT, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, window_left, window_right,
                      mask_ptr, smi, smj, MASKED, MASK_KIND, HAS_WL, HAS_WR, EVEN)
    base, inv_l, delta = _row_stats(m_ptr, l_ptr, delta_ptr, 0, q_ok, MASKED, EVEN)
    pT = _probs(zT, base[None, :], inv_l[None, :])
    do = _prep(do, PRECISION)
    dv = _dot(_prep(pT.to(do.dtype), PRECISION), do, dv, PRECISION)
    dpT = _dot(v, tl.trans(do), tl.zeros([k.shape[0], BLOCK_M], tl.float32), PRECISION)
    dsT = pT * (dpT - delta[None, :])
    dsT = _dsoftcap(dsT, sT, C1, SOFTCAP)
    dk = _dot(_prep(dsT.to(q.dtype), PRECISION), q, dk, PRECISION)
    return dk, dv


@triton.jit
def _step_rt(dk, dv, k, v, q, do, m_ptr, l_ptr, delta_ptr, offs_m, offs_n, q_ok, mask_ptr, seqlen_q, seqlen_k,
             smi, smj, window_left, window_right, C1, C2, need_mask,
             MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
             SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, EVEN: tl.constexpr):
    """``_step`` with the masked / unmasked choice made at run time (``need_mask``, a scalar): the dense
    mask (every step) and then, in a masked step only, the window / causal / bounds select, as
    ``_apply_masks`` orders them. The statistics are loaded as a masked step loads them (the same values in
    an unmasked step, whose rows are all in range)."""
    q = _prep(q, PRECISION)
    sT = _dot(k, tl.trans(q), tl.zeros([k.shape[0], BLOCK_M], tl.float32), PRECISION)
    zT = _scores(sT, C1, C2, SOFTCAP)
    zT = _apply_masks(zT, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, window_left, window_right,
                      mask_ptr, smi, smj, False, MASK_KIND, HAS_WL, HAS_WR, EVEN)
    if need_mask:
        zT = _apply_masks(zT, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, window_left, window_right,
                          mask_ptr, smi, smj, True, 0, HAS_WL, HAS_WR, EVEN)
    base, inv_l, delta = _row_stats(m_ptr, l_ptr, delta_ptr, 0, q_ok, True, EVEN)
    pT = _probs(zT, base[None, :], inv_l[None, :])
    do = _prep(do, PRECISION)
    dv = _dot(_prep(pT.to(do.dtype), PRECISION), do, dv, PRECISION)
    dpT = _dot(v, tl.trans(do), tl.zeros([k.shape[0], BLOCK_M], tl.float32), PRECISION)
    dsT = pT * (dpT - delta[None, :])
    dsT = _dsoftcap(dsT, sT, C1, SOFTCAP)
    dk = _dot(_prep(dsT.to(q.dtype), PRECISION), q, dk, PRECISION)
    return dk, dv


@triton.jit
def _flat_body(dk, dv, k, v, q_b, do_b, st_b, mask_b, m_ptr, l_ptr, delta_ptr, pid_h, start_m, q_off, do_off,
               offs_n, offs_m0, offs_d, offs_dv, a, b, q_len, k_len, sqh, sqs, sdh, sds, sth, sts, smh, smi,
               smj,
               window_left, window_right, C1, C2,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, MASK_KIND: tl.constexpr,
               HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN: tl.constexpr,
               RT_IF: tl.constexpr):
    """One step of the flat loop: query block ``start_m`` of query head ``pid_h`` (64-bit), loaded as a
    masked step loads it (the same values for any block of the shipped unmasked range)."""
    offs_m = start_m + offs_m0
    q_ok = offs_m < q_len
    q = _load_step(q_b + pid_h * sqh + start_m * sqs + q_off, q_ok, offs_d[None, :] < HEAD_DIM,
                   BLOCK_D == HEAD_DIM, True, EVEN)
    do = _load_step(do_b + pid_h * sdh + start_m * sds + do_off, q_ok, offs_dv[None, :] < HEAD_DIM_V,
                    BLOCK_DV == HEAD_DIM_V, True, EVEN)
    st_h = st_b + pid_h * sth
    rows = offs_m * sts
    if RT_IF:
        dk, dv = _step_rt(dk, dv, k, v, q, do, m_ptr + st_h + rows, l_ptr + st_h + rows,
                          delta_ptr + st_h + rows,
                          offs_m, offs_n, q_ok, mask_b + pid_h * smh, q_len, k_len, smi, smj, window_left,
                          window_right, C1, C2, (start_m < a) | (start_m >= b), MASK_KIND, HAS_WL, HAS_WR,
                          SOFTCAP, PRECISION, BLOCK_M, EVEN)
    else:
        dk, dv = _step(dk, dv, k, v, q, do, m_ptr + st_h + rows, l_ptr + st_h + rows, delta_ptr + st_h + rows,
                       offs_m, offs_n, q_ok, mask_b + pid_h * smh, q_len, k_len, smi, smj, window_left,
                       window_right, C1, C2, True, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION, BLOCK_M,
                       EVEN)
    return dk, dv


@triton.jit
def _inner_off32(dk, dv, k, v, q_head, do_head, q_off, do_off, m_ptr, l_ptr, delta_ptr, st_base, sts,
                 mask_ptr, offs_n, offs_m0, offs_d, offs_dv, lo, hi, seqlen_q, seqlen_k, sqs, sds, smi, smj,
                 window_left, window_right, C1, C2,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 MASKED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
                 SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_STAGES: tl.constexpr,
                 EVEN: tl.constexpr):
    """``_dkdv_inner`` (no TMA) with the q / dO tiles addressed as scalar head base + int32 offset tile."""
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=NUM_STAGES):
        offs_m = start_m + offs_m0
        q_ok = offs_m < seqlen_q
        q = _load_step(q_head + start_m * sqs + q_off, q_ok, offs_d[None, :] < HEAD_DIM, BLOCK_D == HEAD_DIM,
                       MASKED, EVEN)
        do = _load_step(do_head + start_m * sds + do_off, q_ok, offs_dv[None, :] < HEAD_DIM_V,
                        BLOCK_DV == HEAD_DIM_V, MASKED, EVEN)
        rows = offs_m * sts
        dk, dv = _step(dk, dv, k, v, q, do, m_ptr + st_base + rows, l_ptr + st_base + rows,
                       delta_ptr + st_base + rows, offs_m, offs_n, q_ok, mask_ptr, seqlen_q, seqlen_k, smi,
                       smj,
                       window_left, window_right, C1, C2, MASKED, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP,
                       PRECISION, BLOCK_M, EVEN)
    return dk, dv


@triton.jit
def _head_off32(dk, dv, k, v, q_ptr, do_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, pid_b, pid_h, q_start,
                q_off, do_off, offs_n, offs_m0, offs_d, offs_dv, lo, a, b, tail_hi, q_len, k_len,
                sqb, sqh, sqs, sdb, sdh, sds, stb, sth, sts, smb, smh, smi, smj,
                window_left, window_right, C1, C2,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, MASK_KIND: tl.constexpr,
                HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                NUM_STAGES: tl.constexpr, EVEN: tl.constexpr):
    """One query head's three query-block ranges (masked, full, masked tail), as the shipped head loop."""
    q_head = q_ptr + pid_b.to(tl.int64) * sqb + pid_h.to(tl.int64) * sqh + q_start.to(tl.int64) * sqs
    do_head = do_ptr + pid_b.to(tl.int64) * sdb + pid_h.to(tl.int64) * sdh + q_start.to(tl.int64) * sds
    st_base = pid_b.to(tl.int64) * stb + pid_h.to(tl.int64) * sth + q_start.to(tl.int64) * sts
    mask_base = mask_ptr + pid_b.to(tl.int64) * smb + pid_h.to(tl.int64) * smh
    dk, dv = _inner_off32(dk, dv, k, v, q_head, do_head, q_off, do_off, m_ptr, l_ptr, delta_ptr, st_base, sts,
                          mask_base, offs_n, offs_m0, offs_d, offs_dv, lo, a, q_len, k_len, sqs, sds, smi,
                          smj,
                          window_left, window_right, C1, C2, HEAD_DIM, HEAD_DIM_V, True, MASK_KIND, HAS_WL,
                          HAS_WR, SOFTCAP, PRECISION, BLOCK_M, BLOCK_D, BLOCK_DV, NUM_STAGES, EVEN)
    dk, dv = _inner_off32(dk, dv, k, v, q_head, do_head, q_off, do_off, m_ptr, l_ptr, delta_ptr, st_base, sts,
                          mask_base, offs_n, offs_m0, offs_d, offs_dv, a, b, q_len, k_len, sqs, sds, smi, smj,
                          window_left, window_right, C1, C2, HEAD_DIM, HEAD_DIM_V, False, MASK_KIND, HAS_WL,
                          HAS_WR, SOFTCAP, PRECISION, BLOCK_M, BLOCK_D, BLOCK_DV, NUM_STAGES, EVEN)
    dk, dv = _inner_off32(dk, dv, k, v, q_head, do_head, q_off, do_off, m_ptr, l_ptr, delta_ptr, st_base, sts,
                          mask_base, offs_n, offs_m0, offs_d, offs_dv, b, tail_hi, q_len, k_len, sqs, sds,
                          smi,
                          smj, window_left, window_right, C1, C2, HEAD_DIM, HEAD_DIM_V, True, MASK_KIND,
                          HAS_WL, HAS_WR, SOFTCAP, PRECISION, BLOCK_M, BLOCK_D, BLOCK_DV, NUM_STAGES, EVEN)
    return dk, dv


@triton.jit
def _head_ptrs(dk, dv, k, v, q_ptr, do_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, pid_b, pid_h, q_start,
               offs_n, offs_m0, offs_d, offs_dv, lo, a, b, tail_hi, q_len, k_len,
               sqb, sqh, sqs, sdb, sdh, sds, stb, sth, sts, smb, smh, smi, smj,
               window_left, window_right, C1, C2, scale_ds,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, MASK_KIND: tl.constexpr,
               HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               NUM_STAGES: tl.constexpr, EVEN: tl.constexpr):
    """One query head as the shipped head-loop body (pointer tiles, the shipped ``_dkdv_inner``; no TMA)."""
    q_base = q_ptr + pid_b.to(tl.int64) * sqb + pid_h.to(tl.int64) * sqh + q_start.to(tl.int64) * sqs
    do_base = do_ptr + pid_b.to(tl.int64) * sdb + pid_h.to(tl.int64) * sdh + q_start.to(tl.int64) * sds
    q_ptrs = q_base + offs_m0[:, None] * sqs + offs_d[None, :]
    do_ptrs = do_base + offs_m0[:, None] * sds + offs_dv[None, :]
    st_base = pid_b.to(tl.int64) * stb + pid_h.to(tl.int64) * sth + q_start.to(tl.int64) * sts
    mask_base = mask_ptr + pid_b.to(tl.int64) * smb + pid_h.to(tl.int64) * smh
    dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_ptrs, do_ptrs, m_ptr, l_ptr, delta_ptr, st_base,
                         sts, mask_base, offs_n, offs_m0, offs_d, offs_dv, lo, a, q_len, k_len, sqs, sds, smi,
                         smj, window_left, window_right, C1, C2, scale_ds, HEAD_DIM, HEAD_DIM_V, True,
                         MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION, BLOCK_M, BLOCK_D, BLOCK_DV,
                         NUM_STAGES, False, EVEN)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_ptrs, do_ptrs, m_ptr, l_ptr, delta_ptr, st_base,
                         sts, mask_base, offs_n, offs_m0, offs_d, offs_dv, a, b, q_len, k_len, sqs, sds, smi,
                         smj, window_left, window_right, C1, C2, scale_ds, HEAD_DIM, HEAD_DIM_V, False,
                         MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION, BLOCK_M, BLOCK_D, BLOCK_DV,
                         NUM_STAGES, False, EVEN)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_ptrs, do_ptrs, m_ptr, l_ptr, delta_ptr, st_base,
                         sts, mask_base, offs_n, offs_m0, offs_d, offs_dv, b, tail_hi, q_len, k_len, sqs, sds,
                         smi, smj, window_left, window_right, C1, C2, scale_ds, HEAD_DIM, HEAD_DIM_V, True,
                         MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION, BLOCK_M, BLOCK_D, BLOCK_DV,
                         NUM_STAGES, False, EVEN)
    return dk, dv


@triton.jit
def _range_remat(dk, dv, k, v, q_head, do_head, m_ptr, l_ptr, delta_ptr, st_base, mask_base, zero, offs_n,
                 offs_m0, offs_d, offs_dv, lo, hi, q_len, k_len, sqs, sds, sts, smi, smj, window_left,
                 window_right, C1, C2, scale_ds,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, MASKED: tl.constexpr,
                 MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN: tl.constexpr):
    """One query-block range of one head (the shipped ``_dkdv_inner``) with its index vectors and pointer
    tiles built from ``zero`` (0, opaque to the compiler, a different expression per range): they are
    computed right before this range's loop and die with it."""
    offs_m0 = offs_m0 + zero * BLOCK_M
    offs_n = offs_n + zero * BLOCK_N
    q_ptrs = q_head + offs_m0[:, None] * sqs + offs_d[None, :]
    do_ptrs = do_head + offs_m0[:, None] * sds + offs_dv[None, :]
    dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_ptrs, do_ptrs, m_ptr, l_ptr, delta_ptr, st_base,
                         sts,
                         mask_base, offs_n, offs_m0, offs_d, offs_dv, lo, hi, q_len, k_len, sqs, sds, smi,
                         smj,
                         window_left, window_right, C1, C2, scale_ds, HEAD_DIM, HEAD_DIM_V, MASKED, MASK_KIND,
                         HAS_WL, HAS_WR, SOFTCAP, PRECISION, BLOCK_M, BLOCK_D, BLOCK_DV, NUM_STAGES, False,
                         EVEN)
    return dk, dv


@triton.jit
def _head_any(dk, dv, k, v, q_ptr, do_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, pid_b, pid_h, n_heads, q_start,
              q_off, do_off, offs_n, offs_m0, offs_d, offs_dv, n0, lo, a, b, tail_hi, q_len, k_len,
              sqb, sqh, sqs, sdb, sdh, sds, stb, sth, sts, smb, smh, smi, smj,
              window_left, window_right, C1, C2, scale_ds,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, MASK_KIND: tl.constexpr,
              HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              NUM_STAGES: tl.constexpr, EVEN: tl.constexpr, OFF32: tl.constexpr, REMAT: tl.constexpr):
    """One query head of the head loop. ``REMAT`` 1: the row / key index vectors (and from them the offset
    tiles and the masks' per-element indices) are rebuilt per head from a zero the compiler cannot see
    through (``pid_h // n_heads``: 0 for every head of the launch; times the block, so the alignment facts
    survive), so they are not hoisted out of the head loop and kept live across the unmasked loop; 2: the
    same per query-block range (``_range_remat``). ``OFF32``: ``_head_off32``, else ``_head_ptrs``."""
    if REMAT == 2:
        q_head = q_ptr + pid_b.to(tl.int64) * sqb + pid_h.to(tl.int64) * sqh + q_start.to(tl.int64) * sqs
        do_head = do_ptr + pid_b.to(tl.int64) * sdb + pid_h.to(tl.int64) * sdh + q_start.to(tl.int64) * sds
        st_base = pid_b.to(tl.int64) * stb + pid_h.to(tl.int64) * sth + q_start.to(tl.int64) * sts
        mask_base = mask_ptr + pid_b.to(tl.int64) * smb + pid_h.to(tl.int64) * smh
        dk, dv = _range_remat(dk, dv, k, v, q_head, do_head, m_ptr, l_ptr, delta_ptr, st_base, mask_base,
                              pid_h // n_heads, offs_n, offs_m0, offs_d, offs_dv, lo, a, q_len, k_len, sqs,
                              sds,
                              sts, smi, smj, window_left, window_right, C1, C2, scale_ds, HEAD_DIM,
                              HEAD_DIM_V,
                              True, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D,
                              BLOCK_DV, NUM_STAGES, EVEN)
        dk, dv = _range_remat(dk, dv, k, v, q_head, do_head, m_ptr, l_ptr, delta_ptr, st_base, mask_base,
                              (pid_h + 1) // (n_heads + 1), offs_n, offs_m0, offs_d, offs_dv, a, b, q_len,
                              k_len,
                              sqs, sds, sts, smi, smj, window_left, window_right, C1, C2, scale_ds, HEAD_DIM,
                              HEAD_DIM_V, False, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION, BLOCK_M,
                              BLOCK_N,
                              BLOCK_D, BLOCK_DV, NUM_STAGES, EVEN)
        dk, dv = _range_remat(dk, dv, k, v, q_head, do_head, m_ptr, l_ptr, delta_ptr, st_base, mask_base,
                              (pid_h + 2) // (n_heads + 2), offs_n, offs_m0, offs_d, offs_dv, b, tail_hi,
                              q_len,
                              k_len, sqs, sds, sts, smi, smj, window_left, window_right, C1, C2, scale_ds,
                              HEAD_DIM, HEAD_DIM_V, True, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION,
                              BLOCK_M,
                              BLOCK_N, BLOCK_D, BLOCK_DV, NUM_STAGES, EVEN)
    else:
        if REMAT == 3:  # as 1, and the query-block ranges recomputed per head from the key block's start
            zero = pid_h // n_heads
            lo, a, b, hi = _block_ranges(n0 + zero * BLOCK_N, BLOCK_N, BLOCK_M, q_len, window_right,
                                         window_left,
                                         HAS_WR, HAS_WL)
            tail_hi = _tail_end(b, hi, HAS_WL, EVEN)
            offs_m0 = offs_m0 + zero * BLOCK_M
            offs_n = offs_n + zero * BLOCK_N
            q_off = offs_m0[:, None] * sqs + offs_d[None, :]
            do_off = offs_m0[:, None] * sds + offs_dv[None, :]
        if REMAT == 1:
            zero = pid_h // n_heads
            offs_m0 = offs_m0 + zero * BLOCK_M
            offs_n = offs_n + zero * BLOCK_N
            q_off = offs_m0[:, None] * sqs + offs_d[None, :]
            do_off = offs_m0[:, None] * sds + offs_dv[None, :]
        if OFF32:
            dk, dv = _head_off32(dk, dv, k, v, q_ptr, do_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, pid_b, pid_h,
                                 q_start, q_off, do_off, offs_n, offs_m0, offs_d, offs_dv, lo, a, b, tail_hi,
                                 q_len, k_len, sqb, sqh, sqs, sdb, sdh, sds, stb, sth, sts, smb, smh, smi,
                                 smj, window_left, window_right, C1, C2, HEAD_DIM, HEAD_DIM_V, MASK_KIND,
                                 HAS_WL, HAS_WR, SOFTCAP, PRECISION, BLOCK_M, BLOCK_D, BLOCK_DV, NUM_STAGES,
                                 EVEN)
        else:
            dk, dv = _head_ptrs(dk, dv, k, v, q_ptr, do_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, pid_b, pid_h,
                                q_start, offs_n, offs_m0, offs_d, offs_dv, lo, a, b, tail_hi, q_len, k_len,
                                sqb, sqh, sqs, sdb, sdh, sds, stb, sth, sts, smb, smh, smi, smj, window_left,
                                window_right, C1, C2, scale_ds, HEAD_DIM, HEAD_DIM_V, MASK_KIND, HAS_WL,
                                HAS_WR, SOFTCAP, PRECISION, BLOCK_M, BLOCK_D, BLOCK_DV, NUM_STAGES, EVEN)
    return dk, dv


@triton.jit
def _program(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr, cu_k_ptr,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sdkb, sdkh, sdks, sdvb, sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj,
    n_heads, n_bh, seqlen_q, seqlen_k, window_left, window_right, C1, C2, scale_ds,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr,
    HEAD_LOOP: tl.constexpr, OFF32: tl.constexpr, REMAT: tl.constexpr = 0,
):
    """The dk/dv program (no TMA: the shipped dk/dv configs do not use it) with the variant's knobs.
    HEAD_LOOP: 0 ``range`` (shipped), 1 ``tl.static_range`` (unrolled), 2 one flat loop over (head, block),
    3 ``tl.range(..., disable_licm=True)``, 4 flat with the masked select under a run-time ``if``.
    OFF32: q / dO addressed as scalar base + int32 offset tile. REMAT: see ``_head_any``."""
    pid_n, pid_bh = _backward_program(n_bh)
    if pid_bh < 0:
        return
    n_kv_heads = n_heads // GROUP
    pid_b = pid_bh // (n_kv_heads * SPLIT)
    out_h = pid_bh % (n_kv_heads * SPLIT)
    kv_h = out_h // SPLIT
    part = out_h % SPLIT
    q_start, q_len, k_start, k_len = _sequence(pid_b, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= k_len:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_ok = offs_n < k_len
    k_base = k_ptr + pid_b.to(tl.int64) * skb + kv_h.to(tl.int64) * skh + k_start.to(tl.int64) * sks
    v_base = v_ptr + pid_b.to(tl.int64) * svb + kv_h.to(tl.int64) * svh + k_start.to(tl.int64) * svs
    k = tl.load(k_base + offs_n[:, None] * sks + offs_d[None, :],
                mask=k_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    v = tl.load(v_base + offs_n[:, None] * svs + offs_dv[None, :],
                mask=k_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    k = _prep(k, PRECISION)
    v = _prep(v, PRECISION)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, a, b, hi = _block_ranges(n0, BLOCK_N, BLOCK_M, q_len, window_right, window_left, HAS_WR, HAS_WL)
    tail_hi = _tail_end(b, hi, HAS_WL, EVEN)
    h0 = kv_h * GROUP + part * (GROUP // SPLIT)
    q_off = offs_m0[:, None] * sqs + offs_d[None, :]
    do_off = offs_m0[:, None] * sds + offs_dv[None, :]
    if HEAD_LOOP == 2 or HEAD_LOOP == 4:
        # One loop over the program's (head, query block) steps in the shipped order (head-major, blocks in
        # order). HEAD_LOOP 2: every step on the masked path: a fully visible block masks nothing
        # (where(True, z, -inf) is z, the loads read the same rows), so the values and their order are the
        # shipped ones. (Key rows past a partial last key block, which a shipped unmasked step leaves
        # unmasked, differ, but are never stored: a dk / dv row depends on its own key only.)
        # HEAD_LOOP 4: the select only in the masked steps (a run-time ``if``).
        n_steps = tl.cdiv(tail_hi - lo, BLOCK_M)
        q_b = q_ptr + pid_b.to(tl.int64) * sqb + q_start.to(tl.int64) * sqs
        do_b = do_ptr + pid_b.to(tl.int64) * sdb + q_start.to(tl.int64) * sds
        st_b = pid_b.to(tl.int64) * stb + q_start.to(tl.int64) * sts
        mask_b = mask_ptr + pid_b.to(tl.int64) * smb
        for it in tl.range(0, (GROUP // SPLIT) * n_steps, num_stages=NUM_STAGES):
            g = it // n_steps
            start_m = lo + (it - g * n_steps) * BLOCK_M
            dk, dv = _flat_body(dk, dv, k, v, q_b, do_b, st_b, mask_b, m_ptr, l_ptr, delta_ptr,
                                (h0 + g).to(tl.int64), start_m, q_off, do_off, offs_n, offs_m0, offs_d,
                                offs_dv, a, b, q_len, k_len, sqh, sqs, sdh, sds, sth, sts, smh, smi, smj,
                                window_left, window_right, C1, C2, HEAD_DIM, HEAD_DIM_V, MASK_KIND, HAS_WL,
                                HAS_WR, SOFTCAP, PRECISION, BLOCK_M, BLOCK_D, BLOCK_DV, EVEN, HEAD_LOOP == 4)
    elif HEAD_LOOP == 1:
        for g in tl.static_range(GROUP // SPLIT):
            dk, dv = _head_any(dk, dv, k, v, q_ptr, do_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, pid_b, h0 + g,
                               n_heads, q_start, q_off, do_off, offs_n, offs_m0, offs_d, offs_dv, n0, lo, a,
                               b, tail_hi, q_len, k_len, sqb, sqh, sqs, sdb, sdh, sds, stb, sth, sts, smb,
                               smh, smi, smj, window_left, window_right, C1, C2, scale_ds, HEAD_DIM,
                               HEAD_DIM_V, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION, BLOCK_M, BLOCK_N,
                               BLOCK_D, BLOCK_DV, NUM_STAGES, EVEN, OFF32, REMAT)
    else:
        for g in tl.range(GROUP // SPLIT, disable_licm=HEAD_LOOP == 3):
            dk, dv = _head_any(dk, dv, k, v, q_ptr, do_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, pid_b, h0 + g,
                               n_heads, q_start, q_off, do_off, offs_n, offs_m0, offs_d, offs_dv, n0, lo, a,
                               b, tail_hi, q_len, k_len, sqb, sqh, sqs, sdb, sdh, sds, stb, sth, sts, smb,
                               smh, smi, smj, window_left, window_right, C1, C2, scale_ds, HEAD_DIM,
                               HEAD_DIM_V, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION, BLOCK_M, BLOCK_N,
                               BLOCK_D, BLOCK_DV, NUM_STAGES, EVEN, OFF32, REMAT)
    dk = dk * scale_ds
    dk_base = dk_ptr + pid_b.to(tl.int64) * sdkb + out_h.to(tl.int64) * sdkh + k_start.to(tl.int64) * sdks
    dv_base = dv_ptr + pid_b.to(tl.int64) * sdvb + out_h.to(tl.int64) * sdvh + k_start.to(tl.int64) * sdvs
    tl.store(dk_base + offs_n[:, None] * sdks + offs_d[None, :], dk.to(dk_ptr.dtype.element_ty),
             mask=k_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(dv_base + offs_n[:, None] * sdvs + offs_dv[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=k_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


# ---------------------------------------------------------------------------------------------------------
# The variant kernels (launch arguments of attn_bwd_dkdv_kernel)
# ---------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=SIZE_ARGS)
def dkdv_copy(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr, cu_k_ptr,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sdkb, sdkh, sdks, sdvb, sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj,
    n_heads, n_bh, seqlen_q, seqlen_k, window_left, window_right, C1, C2, scale_ds,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    EVEN: tl.constexpr = False,
):
    """The shipped structure through this file's helpers: head loop ``range``, pointer tiles."""
    tl.static_assert(not USE_TMA, "the variants load q / dO with pointers (the shipped dk/dv configs do)")
    _program(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr,
             cu_k_ptr, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, sdkb, sdkh, sdks, sdvb,
             sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj, n_heads, n_bh, seqlen_q, seqlen_k, window_left,
             window_right, C1, C2, scale_ds, GROUP, HEAD_DIM, HEAD_DIM_V, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP,
             VARLEN, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, NUM_STAGES, SPLIT, EVEN, 0, False)


@triton.jit(do_not_specialize=SIZE_ARGS)
def dkdv_unroll(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr, cu_k_ptr,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sdkb, sdkh, sdks, sdvb, sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj,
    n_heads, n_bh, seqlen_q, seqlen_k, window_left, window_right, C1, C2, scale_ds,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    EVEN: tl.constexpr = False,
):
    """Head loop unrolled (``tl.static_range``), pointer tiles as shipped."""
    tl.static_assert(not USE_TMA, "the variants load q / dO with pointers (the shipped dk/dv configs do)")
    _program(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr,
             cu_k_ptr, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, sdkb, sdkh, sdks, sdvb,
             sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj, n_heads, n_bh, seqlen_q, seqlen_k, window_left,
             window_right, C1, C2, scale_ds, GROUP, HEAD_DIM, HEAD_DIM_V, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP,
             VARLEN, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, NUM_STAGES, SPLIT, EVEN, 1, False)


@triton.jit(do_not_specialize=SIZE_ARGS)
def dkdv_off32(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr, cu_k_ptr,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sdkb, sdkh, sdks, sdvb, sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj,
    n_heads, n_bh, seqlen_q, seqlen_k, window_left, window_right, C1, C2, scale_ds,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    EVEN: tl.constexpr = False,
):
    """Head loop as shipped; q / dO as scalar head base + int32 offset tile."""
    tl.static_assert(not USE_TMA, "the variants load q / dO with pointers (the shipped dk/dv configs do)")
    _program(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr,
             cu_k_ptr, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, sdkb, sdkh, sdks, sdvb,
             sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj, n_heads, n_bh, seqlen_q, seqlen_k, window_left,
             window_right, C1, C2, scale_ds, GROUP, HEAD_DIM, HEAD_DIM_V, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP,
             VARLEN, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, NUM_STAGES, SPLIT, EVEN, 0, True)


@triton.jit(do_not_specialize=SIZE_ARGS)
def dkdv_nolicm(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr, cu_k_ptr,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sdkb, sdkh, sdks, sdvb, sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj,
    n_heads, n_bh, seqlen_q, seqlen_k, window_left, window_right, C1, C2, scale_ds,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    EVEN: tl.constexpr = False,
):
    """Head loop ``tl.range(..., disable_licm=True)``, pointer tiles as shipped."""
    tl.static_assert(not USE_TMA, "the variants load q / dO with pointers (the shipped dk/dv configs do)")
    _program(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr,
             cu_k_ptr, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, sdkb, sdkh, sdks, sdvb,
             sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj, n_heads, n_bh, seqlen_q, seqlen_k, window_left,
             window_right, C1, C2, scale_ds, GROUP, HEAD_DIM, HEAD_DIM_V, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP,
             VARLEN, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, NUM_STAGES, SPLIT, EVEN, 3, False)


@triton.jit(do_not_specialize=SIZE_ARGS)
def dkdv_flat(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr, cu_k_ptr,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sdkb, sdkh, sdks, sdvb, sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj,
    n_heads, n_bh, seqlen_q, seqlen_k, window_left, window_right, C1, C2, scale_ds,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    EVEN: tl.constexpr = False,
):
    """One pipelined loop over (head, query block), every step masked; int32 offset tiles."""
    tl.static_assert(not USE_TMA, "the variants load q / dO with pointers (the shipped dk/dv configs do)")
    _program(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr,
             cu_k_ptr, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, sdkb, sdkh, sdks, sdvb,
             sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj, n_heads, n_bh, seqlen_q, seqlen_k, window_left,
             window_right, C1, C2, scale_ds, GROUP, HEAD_DIM, HEAD_DIM_V, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP,
             VARLEN, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, NUM_STAGES, SPLIT, EVEN, 2, True)


@triton.jit(do_not_specialize=SIZE_ARGS)
def dkdv_flat_if(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr, cu_k_ptr,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sdkb, sdkh, sdks, sdvb, sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj,
    n_heads, n_bh, seqlen_q, seqlen_k, window_left, window_right, C1, C2, scale_ds,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    EVEN: tl.constexpr = False,
):
    """As ``dkdv_flat``, the masked steps' select under a run-time ``if`` (unmasked steps skip it)."""
    tl.static_assert(not USE_TMA, "the variants load q / dO with pointers (the shipped dk/dv configs do)")
    _program(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr,
             cu_k_ptr, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, sdkb, sdkh, sdks, sdvb,
             sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj, n_heads, n_bh, seqlen_q, seqlen_k, window_left,
             window_right, C1, C2, scale_ds, GROUP, HEAD_DIM, HEAD_DIM_V, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP,
             VARLEN, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, NUM_STAGES, SPLIT, EVEN, 4, True)


@triton.jit(do_not_specialize=SIZE_ARGS)
def dkdv_remat(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr, cu_k_ptr,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sdkb, sdkh, sdks, sdvb, sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj,
    n_heads, n_bh, seqlen_q, seqlen_k, window_left, window_right, C1, C2, scale_ds,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    EVEN: tl.constexpr = False,
):
    """Head loop as shipped, index vectors rebuilt per head (``REMAT``), pointer tiles."""
    tl.static_assert(not USE_TMA, "the variants load q / dO with pointers (the shipped dk/dv configs do)")
    _program(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr,
             cu_k_ptr, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, sdkb, sdkh, sdks, sdvb,
             sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj, n_heads, n_bh, seqlen_q, seqlen_k, window_left,
             window_right, C1, C2, scale_ds, GROUP, HEAD_DIM, HEAD_DIM_V, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP,
             VARLEN, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, NUM_STAGES, SPLIT, EVEN, 0, False, 1)


@triton.jit(do_not_specialize=SIZE_ARGS)
def dkdv_remat_nolicm(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr, cu_k_ptr,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sdkb, sdkh, sdks, sdvb, sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj,
    n_heads, n_bh, seqlen_q, seqlen_k, window_left, window_right, C1, C2, scale_ds,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    EVEN: tl.constexpr = False,
):
    """``dkdv_remat`` with LICM off on the head loop."""
    tl.static_assert(not USE_TMA, "the variants load q / dO with pointers (the shipped dk/dv configs do)")
    _program(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr,
             cu_k_ptr, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, sdkb, sdkh, sdks, sdvb,
             sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj, n_heads, n_bh, seqlen_q, seqlen_k, window_left,
             window_right, C1, C2, scale_ds, GROUP, HEAD_DIM, HEAD_DIM_V, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP,
             VARLEN, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, NUM_STAGES, SPLIT, EVEN, 3, False, 1)


@triton.jit(do_not_specialize=SIZE_ARGS)
def dkdv_remat_all(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr, cu_k_ptr,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sdkb, sdkh, sdks, sdvb, sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj,
    n_heads, n_bh, seqlen_q, seqlen_k, window_left, window_right, C1, C2, scale_ds,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    EVEN: tl.constexpr = False,
):
    """``dkdv_remat_nolicm`` with the query-block ranges also recomputed per head."""
    tl.static_assert(not USE_TMA, "the variants load q / dO with pointers (the shipped dk/dv configs do)")
    _program(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr,
             cu_k_ptr, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, sdkb, sdkh, sdks, sdvb,
             sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj, n_heads, n_bh, seqlen_q, seqlen_k, window_left,
             window_right, C1, C2, scale_ds, GROUP, HEAD_DIM, HEAD_DIM_V, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP,
             VARLEN, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, NUM_STAGES, SPLIT, EVEN, 3, False, 3)


@triton.jit(do_not_specialize=SIZE_ARGS)
def dkdv_remat_range_nolicm(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr, cu_k_ptr,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sdkb, sdkh, sdks, sdvb, sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj,
    n_heads, n_bh, seqlen_q, seqlen_k, window_left, window_right, C1, C2, scale_ds,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    EVEN: tl.constexpr = False,
):
    """``dkdv_remat_range`` with LICM off on the head loop."""
    tl.static_assert(not USE_TMA, "the variants load q / dO with pointers (the shipped dk/dv configs do)")
    _program(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr,
             cu_k_ptr, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, sdkb, sdkh, sdks, sdvb,
             sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj, n_heads, n_bh, seqlen_q, seqlen_k, window_left,
             window_right, C1, C2, scale_ds, GROUP, HEAD_DIM, HEAD_DIM_V, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP,
             VARLEN, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, NUM_STAGES, SPLIT, EVEN, 3, False, 2)


@triton.jit(do_not_specialize=SIZE_ARGS)
def dkdv_unroll_remat(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr, cu_k_ptr,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
    sdkb, sdkh, sdks, sdvb, sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj,
    n_heads, n_bh, seqlen_q, seqlen_k, window_left, window_right, C1, C2, scale_ds,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    EVEN: tl.constexpr = False,
):
    """Head loop unrolled, index vectors rebuilt per head, pointer tiles."""
    tl.static_assert(not USE_TMA, "the variants load q / dO with pointers (the shipped dk/dv configs do)")
    _program(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr,
             cu_k_ptr, sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, sdkb, sdkh, sdks, sdvb,
             sdvh, sdvs, stb, sth, sts, smb, smh, smi, smj, n_heads, n_bh, seqlen_q, seqlen_k, window_left,
             window_right, C1, C2, scale_ds, GROUP, HEAD_DIM, HEAD_DIM_V, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP,
             VARLEN, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, NUM_STAGES, SPLIT, EVEN, 1, False, 1)

# name -> kernel function name; "shipped" is safeops' own kernel
VARIANTS = {name.removeprefix("dkdv_"): name for name in (
    "dkdv_copy", "dkdv_unroll", "dkdv_off32", "dkdv_nolicm", "dkdv_flat", "dkdv_flat_if", "dkdv_remat",
    "dkdv_remat_nolicm", "dkdv_remat_all", "dkdv_remat_range_nolicm", "dkdv_unroll_remat")}


# ---------------------------------------------------------------------------------------------------------
# Offline sm_90 compile (Triton 3.6 in /tmp/t36: no torch, no GPU)
# ---------------------------------------------------------------------------------------------------------

# Runs in the compiler's Python. Loads safeops.kernels.attention through bare package modules (no
# safeops/__init__, so no torch), then this file by path, and compiles each job with attention_launch's
# compile worker (Triton's own binder: the launch's exact specialization) with triton.compile wrapped to
# keep the kernel for bench/_sm90.binary_stats (ptxas -v --fmad=false, sm_90a).
_STATS_WORKER = r"""
import importlib.util, json, multiprocessing, os, sys, types
from concurrent.futures import ProcessPoolExecutor

import triton

request = json.load(sys.stdin)
root = request["root"]
sys.path.insert(0, os.path.join(root, "bench"))
import _sm90

for name, where in (("safeops", os.path.join(root, "safeops")),
                    ("safeops.kernels", os.path.join(root, "safeops", "kernels"))):
    package = types.ModuleType(name)
    package.__path__ = [where]
    sys.modules[name] = package
spec = importlib.util.spec_from_file_location("attn_dkdv_variants", request["variants_file"])
variants = importlib.util.module_from_spec(spec)
sys.modules["attn_dkdv_variants"] = variants
spec.loader.exec_module(variants)

worker = {"__name__": "safeops_compile_worker"}
exec(request["worker_source"], worker)
worker["_module"] = variants
_last = _sm90.keep_compiled()


def sass_loops(sass):
    # [instructions, HGMMA, WARPGROUP.ARRIVE, LDL + STL] of each innermost loop (a backward branch's range
    # holding no other) with HGMMAs.
    import re
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    spans = []
    for addr, text in ins:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            spans.append((int(m.group(1), 16), addr))
    loops = []
    for lo, hi in spans:
        body = [t for a, t in ins if lo <= a <= hi]
        if any(lo < l2 and h2 < hi for l2, h2 in spans):
            continue  # an outer loop
        n_mma = sum("HGMMA" in t for t in body)
        if n_mma:
            loops.append([len(body), n_mma, sum("WARPGROUP.ARRIVE" in t for t in body),
                          sum("LDL" in t or "STL" in t for t in body)])
    return loops


def wgmma_serialized(ptx_text):
    # Whether ptxas reports C7515: wgmma.mma_async serialized (each HGMMA waited for on its own).
    import subprocess, tempfile
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(ptx_text)
        for name in ("ptxas", "ptxas-blackwell"):
            if os.path.exists(_sm90.nvidia_bin(name)):
                report = subprocess.run([_sm90.nvidia_bin(name), "-v", "--fmad=false", "--gpu-name", "sm_90a",
                                         ptx, "-o", "/dev/null"], capture_output=True, text=True).stderr
                if "Used" in report:
                    return "C7515" in report
    return None


def stats(job):
    index, launch = job
    _last.clear()
    result = worker["compile_one"](("", 90, launch))
    if result.get("ok") and _last and not request.get("no_stats"):
        try:
            result["regs"], result["spill"], sass = _sm90.binary_stats(_last[-1])
            dump = request.get("dump")
            if dump:
                split = launch["kwargs"].get("SPLIT")
                stem = os.path.join(dump, f"{index:02d}_{launch['kernel']}_split{split}")
                with open(stem + ".ptx", "w") as f:
                    f.write(_last[-1].asm["ptx"])
                with open(stem + ".ttgir", "w") as f:
                    f.write(_last[-1].asm["ttgir"])
                with open(stem + ".sass", "w") as f:
                    f.write(sass)
            result["local"] = sum("LDL" in line or "STL" in line for line in sass.splitlines())
            result["loops"] = sass_loops(sass)
            result["serialized"] = wgmma_serialized(_last[-1].asm["ptx"])
        except Exception as e:
            result["regs"] = result["spill"] = -1
            result["stats_error"] = str(e)[-300:]
    return result


if __name__ == "__main__":
    jobs = list(enumerate(request["launches"]))
    workers = max(1, min(len(jobs), request.get("workers") or os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(stats, jobs, chunksize=1))
    print(json.dumps({"triton": triton.__version__, "results": results}))
"""

LLAMA = dict(b=1, hq=32, hkv=4, s=4096, d=64, causal=True, layout="bshd")


def compile_python() -> str | None:
    """$SAFEOPS_COMPILE_PYTHON or /tmp/t36/bin/python (Triton 3.6, the GPU machine's), if present."""
    for candidate in (os.environ.get("SAFEOPS_COMPILE_PYTHON"), "/tmp/t36/bin/python"):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def layer_shape(text: str) -> dict:
    """``LLAMA`` with ``key=value`` pairs (comma separated) replaced, e.g. 'hkv=8,d=128'."""
    shape = dict(LLAMA)
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, value = item.partition("=")
        if key not in shape:
            raise ValueError(f"--layer: unknown key {key!r} (keys: {sorted(shape)})")
        shape[key] = value if key == "layout" else int(value)
    return shape


def recorded_dkdv(shape: dict, split: int | None = None) -> dict:
    """The shipped launcher's dk/dv launch (kernel name, argument dtypes / values, constexprs, options) at
    ``shape`` on meta tensors, the GQA split forced to ``split`` (None: the launcher's own), on pointer
    loads (``pointer_loads``)."""
    import attention as bench_attention

    from safeops.ops import attention_launch as L

    t = bench_attention.llama_tensors(shape, "meta")
    options = bench_attention._llama_options(shape)
    cand = bench_attention.LlamaCand("split", split=split)
    with L.recording() as launches, bench_attention.llama_knobs(cand), pointer_loads():
        o, m, l = L.forward(t["q"], t["k"], t["v"], *options)
        L.backward(t["g"], t["q"], t["k"], t["v"], o, m, l, *options)
    (launch,) = [x for x in launches if x["kernel"] == SHIPPED]
    return launch


def compile_stats(launches: list[dict], python: str, dump: str | None = None, workers: int | None = None,
                  timeout: float = 900) -> list[dict]:
    """regs / spill bytes / smem / local-memory instruction count of each launch (its ``kernel`` a name in
    this file: SHIPPED or a VARIANTS value), compiled for sm_90 by ``python``'s Triton."""
    import subprocess

    from safeops.ops import attention_launch as L

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["TRITON_INTERPRET"] = "0"
    env["CUDA_VISIBLE_DEVICES"] = ""
    if dump:
        os.makedirs(dump, exist_ok=True)
    request = json.dumps({"root": str(ROOT), "variants_file": str(Path(__file__).resolve()),
                          "launches": launches, "worker_source": L._COMPILE_WORKER, "dump": dump,
                          "workers": workers})
    proc = subprocess.run([python, "-c", _STATS_WORKER], input=request, capture_output=True, text=True,
                          env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"offline compile worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["results"]


def tile(launch: dict) -> tuple:
    """(block_m, block_n, num_warps, num_stages) of a recorded dk/dv launch."""
    return tuple(launch["kwargs"][k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "NUM_STAGES"))


def compile_only(names: list[str], splits: tuple[int, ...], shape: dict, python: str, dump: str | None = None,
                 log=print) -> list[dict]:
    jobs, rows = [], []
    for split in splits:
        base = recorded_dkdv(shape, split)
        for name in names:
            launch = json.loads(json.dumps(base))
            launch["kernel"] = SHIPPED if name == "shipped" else VARIANTS[name]
            jobs.append(launch)
            rows.append({"variant": name, "split": split})
    start = time.time()
    results = compile_stats(jobs, python, dump)
    log(f"compiled {len(jobs)} dk/dv kernels for sm_90 in {time.time() - start:.0f} s "
        f"({' '.join(f'{k}={v}' for k, v in shape.items())}; tile {tile(jobs[0])})")
    for row, r in zip(rows, results, strict=True):
        row.update(ok=r["ok"], regs=r.get("regs"), spill=r.get("spill"), smem=r.get("shared"),
                   local=r.get("local"), loops=r.get("loops"), serialized=r.get("serialized"),
                   error=r.get("error", "")[-300:])
        if row["ok"]:
            loops = " ".join(f"{n}{'' if arrive < mma else '(serial)'}{f'+{ls}ldst' if ls else ''}"
                             for n, mma, arrive, ls in row["loops"] or [])
            status = (f"regs {row['regs']:3d}  spill {row['spill']:3d} B  local ld/st {row['local']:3d}  "
                      f"smem {row['smem']}  wgmma {'SERIALIZED' if row['serialized'] else 'async'}  "
                      f"hot-loop instructions {loops}")
        else:
            status = f"FAILED {row['error']}"
        log(f"  {row['variant']:18s} split={row['split']}: {status}")
    return rows


# ---------------------------------------------------------------------------------------------------------
# Swapping a variant into the shipped launcher
# ---------------------------------------------------------------------------------------------------------


def kernel(name: str):
    """The kernel of variant ``name`` ("shipped": safeops' own)."""
    return attn_bwd_dkdv_kernel if name == "shipped" else globals()[VARIANTS[name]]


class swapped:
    """Inside the block, ``attention_launch`` launches variant ``name``'s kernel instead of
    ``attn_bwd_dkdv_kernel`` (its plans are dropped on entry and exit: ``_kernels`` is one of their
    settings)."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        from types import SimpleNamespace

        from safeops.ops import attention_launch as L

        self.saved = L._kernels
        module = L.kernels()
        L._kernels = SimpleNamespace(**{n: getattr(module, n) for n in L.KERNEL_NAMES})
        L._kernels.attn_bwd_dkdv_kernel = kernel(self.name)
        L.clear_plans()
        return self

    def __exit__(self, *exc):
        from safeops.ops import attention_launch as L

        L._kernels = self.saved
        L.clear_plans()
        return False


def forced_split(split: int | None):
    """``attention_launch.dkdv_split`` forced to ``split`` inside the block (None: unchanged), and the dk/dv
    launch on pointer loads (``pointer_loads``)."""
    import contextlib

    from safeops.ops import attention_launch as L

    @contextlib.contextmanager
    def scope():
        saved = L.dkdv_split
        if split is not None:
            L.dkdv_split = lambda group, kv_elements: split
        try:
            with pointer_loads():
                yield
        finally:
            L.dkdv_split = saved
    return scope()


def pointer_loads():
    """The shipped dk/dv configs with q / dO loaded through pointers, not TMA (the causal D=64 tile loads them
    through TMA since session 8): the variants here are written for pointer loads, and the comparison is of
    the same load path. A replaced table (not edited in place), so the launcher's plans see it."""
    import contextlib
    import dataclasses

    from safeops.ops import attention_launch as L

    @contextlib.contextmanager
    def scope():
        saved = L.DKDV_CONFIGS
        L.DKDV_CONFIGS = {key: dataclasses.replace(cfg, tma=False) for key, cfg in saved.items()}
        try:
            yield
        finally:
            L.DKDV_CONFIGS = saved
    return scope()


# ---------------------------------------------------------------------------------------------------------
# CPU check under Triton's interpreter: dk / dv bits against the shipped kernel
# ---------------------------------------------------------------------------------------------------------

# (name, dict of the case) -- small GQA shapes; the interpreter's blocks are 16 x 16 (INTERPRETER_CONFIG).
# s = 48: EVEN (whole blocks), s = 40 / 37: partial last blocks; split: programs per kv head's group.
CPU_CASES = [
    ("fp16 causal even g4 split1", dict(dtype="float16", b=1, hq=4, hkv=1, s=48, d=16, causal=True, split=1)),
    ("fp16 causal odd g4 split2", dict(dtype="float16", b=2, hq=4, hkv=1, s=40, d=16, causal=True, split=2)),
    ("fp16 dense odd g2 split1", dict(dtype="float16", b=1, hq=4, hkv=2, s=37, d=16, causal=False, split=1)),
    ("fp32 causal even g4 split2 bshd", dict(dtype="float32", b=1, hq=8, hkv=2, s=32, d=16, causal=True,
                                            split=2, layout="bshd")),
    ("fp32 window dv24 g3 split1", dict(dtype="float32", b=1, hq=3, hkv=1, s=40, d=16, dv=24, causal=False,
                                        split=1, wl=9, wr=5)),
    ("fp16 varlen causal g2 split1", dict(dtype="float16", hq=4, hkv=2, lens=(23, 40), d=16, causal=True,
                                          split=1)),
    ("fp16 causal mha g1 odd", dict(dtype="float16", b=2, hq=2, hkv=2, s=45, d=16, causal=True, split=1)),
    ("fp16 softcap mask g4 split2", dict(dtype="float16", b=1, hq=4, hkv=1, s=32, d=16, causal=False, split=2,
                                         softcap=20.0, mask=True)),
]


def cpu_inputs(case: dict, seed: int = 0) -> dict:
    """q, k, v, grad on the CPU and the forward's (out, m, l), plus the call's options."""
    import torch

    from safeops.ops import attention_launch as L

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case["dtype"])
    hq, hkv, d, dv = case["hq"], case["hkv"], case["d"], case.get("dv", case["d"])

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    mask = None
    if "lens" in case:
        lens = case["lens"]
        total = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        q, g = rand(total, hq, d), rand(total, hq, dv)
        k, v = rand(total, hkv, d), rand(total, hkv, dv)
        cu_q = cu_k = cu
        max_q = max_k = max(lens)
    else:
        b, s = case["b"], case["s"]
        if case.get("layout") == "bshd":
            q, g = rand(b, s, hq, d).transpose(1, 2), rand(b, s, hq, dv).transpose(1, 2)
            k, v = rand(b, s, hkv, d).transpose(1, 2), rand(b, s, hkv, dv).transpose(1, 2)
        else:
            q, g = rand(b, hq, s, d), rand(b, hq, s, dv)
            k, v = rand(b, hkv, s, d), rand(b, hkv, s, dv)
        cu_q = cu_k = None
        max_q = max_k = s
        if case.get("mask"):
            mask = torch.rand(b, 1, s, s, generator=gen) > 0.2
            mask[..., 0] = True
            mask = mask.expand(b, hq, s, s)  # the launcher takes the mask broadcast (stride 0 over heads)
    causal = bool(case["causal"])
    wl = case.get("wl", -1)
    wr = 0 if causal else case.get("wr", -1)
    options = (mask, 1 if mask is not None else 0, cu_q, cu_k, max_q, max_k, causal, 1.0 / math.sqrt(d),
               case.get("softcap"), wl, wr, 0)
    out, m, l = L.forward(q, k, v, *options)
    return {"q": q, "k": k, "v": v, "g": g, "out": out, "m": m, "l": l, "options": options}


def backward_with(name: str, t: dict, split: int | None = None):
    """(dq, dk, dv) of the launcher's backward with variant ``name``'s dk/dv kernel."""
    from safeops.ops import attention_launch as L

    with swapped(name), forced_split(split):
        return L.backward(t["g"], t["q"], t["k"], t["v"], t["out"], t["m"], t["l"], *t["options"])


def same_bits(a, b) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(width), b.contiguous().view(width))


def interpret_check(names: list[str], cases=None, log=print) -> list[tuple[str, str, bool]]:
    """dk / dv bits of each variant against the shipped kernel (and dq, which the swap must not change),
    per case, under Triton's interpreter on the CPU. Returns (case, variant, equal) rows."""
    rows = []
    for label, case in cases or CPU_CASES:
        t = cpu_inputs(case)
        ref = backward_with("shipped", t, case["split"])
        for name in names:
            got = backward_with(name, t, case["split"])
            ok = all(same_bits(x, y) for x, y in zip(got, ref, strict=True))
            rows.append((label, name, ok))
            log(f"  {label:34s} {name:13s} {'same bits' if ok else 'DIFFERENT'}")
    return rows


# ---------------------------------------------------------------------------------------------------------
# GPU: the whole backward with each variant swapped in
# ---------------------------------------------------------------------------------------------------------

# Variants also timed at one query head per program (split = group) besides the launcher's split: there the
# shipped kernel's wgmma are serialized (ptxas C7515, offline) and these are not; the other head-loop
# variants compile to the shipped code at one head.
ONE_HEAD_VARIANTS = ("remat", "remat_nolicm", "remat_range_nolicm", "flat")


def precompile(launches: list[dict], log=print) -> None:
    """Compiles the launches' kernels in a process pool of this Python (Triton's cache then has them for the
    timed launches: same module name, specialization and options). A warm-up only: failures are logged."""
    import subprocess

    from safeops.ops import attention_launch as L

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    request = json.dumps({"root": str(ROOT), "variants_file": str(Path(__file__).resolve()),
                          "launches": launches, "worker_source": L._COMPILE_WORKER, "dump": None,
                          "workers": None, "no_stats": True})
    start = time.time()
    try:
        proc = subprocess.run([sys.executable, "-c", _STATS_WORKER], input=request, capture_output=True,
                              text=True, env=env, timeout=120)
        results = json.loads(proc.stdout.strip().splitlines()[-1])["results"] if proc.returncode == 0 else []
        failed = [r.get("error", "")[:200] for r in results if not r.get("ok")]
        log(f"precompiled {len(results)} of {len(launches)} kernels in {time.time() - start:.1f} s"
            + (f"; {len(failed)} failed: {failed[0]}" if failed else "")
            + ("" if proc.returncode == 0 else f"; worker failed: {proc.stderr[-300:]}"))
    except Exception as e:  # noqa: BLE001 - a warm-up
        log(f"precompile failed ({str(e).splitlines()[0][:200]}); compiling at first launch")


def dkdv_device_us(fn, names: set[str], iters: int = 10) -> tuple[float, float]:
    """(dk/dv kernel us, all kernels us) per call of ``fn``, from torch.profiler's device times."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    attr = "device_time_total" if events and hasattr(events[0], "device_time_total") else "cuda_time_total"
    dkdv = total = 0.0
    for e in events:
        us = getattr(e, attr, 0) or 0
        if us <= 0 or e.device_type.name not in ("CUDA", "PrivateUse1"):
            continue
        total += us / iters
        if any(e.key.startswith(n) for n in names):
            dkdv += us / iters
    return dkdv, total


def launched_stats() -> tuple:
    """(registers, spills) of the dk/dv kernel the launcher's (only) backward plan launched last, from
    Triton's CompiledKernel; (None, None) where the plan or Triton's attributes are not there."""
    from safeops.ops import attention_launch as L

    try:
        plan = list(L._bwd_plans.values())[-1]
        compiled = next(iter(plan.dkdv._compiled.values()))[0]
        return compiled.n_regs, compiled.n_spills
    except Exception:  # noqa: BLE001 - internals of this repo's plans / Triton's kernel object
        return None, None


def resolve_split(text: str, group: int) -> int | None:
    """'d': the launcher's own split (None); 'g': one query head per program (split = group); else an int."""
    if text == "d":
        return None
    split = group if text == "g" else int(text)
    if group % split:
        raise ValueError(f"--splits: {split} does not divide the query group {group}")
    return split


def gpu_rows(shape: dict, names: list[str], splits: list[str], warm: bool = True,
             profile_kernels: bool = True, log=print, device: str = "cuda", dtype=None, timer=None,
             deadline: float = math.inf) -> list[dict]:
    """Times the whole backward at ``shape`` for the shipped kernel and each variant, per split. ``device``,
    ``dtype`` (default bf16) and ``timer(fn) -> ms`` (default CUDA events) let the CPU tests run it under
    the interpreter (fp16: Triton 3.9's interpreter mishandles bf16). Rows past ``deadline`` (time.time())
    are skipped."""
    import attention as bench_attention
    import attn_dkdv_variants as self_module  # the kernels under this module's name (not __main__)
    import torch

    on_cuda = torch.device(device).type == "cuda"
    if timer is None:
        import _harness as H

        def timer(fn):
            return H.bench_ms(fn, 25, 100)[0]

    group = shape["hq"] // shape["hkv"]
    default_split = recorded_dkdv(shape, None)["kwargs"]["SPLIT"]
    plan = []  # (variant, split) in timing order
    for text in splits:
        split = resolve_split(text, group)
        if text != "d" and split == default_split and "d" in splits:
            continue  # the launcher's own split: already timed
        chosen = names if text == "d" else [n for n in names if n in ONE_HEAD_VARIANTS]
        # The shipped kernel again at the end: the drift of the timings (and a determinism check of its bits).
        plan += [("shipped", split)] + [(n, split) for n in chosen] + [("shipped", split)] * (len(chosen) > 2)
    if warm and on_cuda:
        launches = {}
        for name, split in plan:
            launch = json.loads(json.dumps(recorded_dkdv(shape, split)))
            launch["kernel"] = SHIPPED if name == "shipped" else VARIANTS[name]
            launches[json.dumps(launch, sort_keys=True)] = launch
        precompile(list(launches.values()), log)
    t = bench_attention.llama_tensors(shape, device, dtype or torch.bfloat16)
    options = bench_attention._llama_options(shape)
    q, k, v, g = t["q"], t["k"], t["v"], t["g"]
    out, m, l = torch.ops.safeops.attention(q, k, v, *options)

    def backward():
        return torch.ops.safeops.attention_backward(g, q, k, v, out, m, l, *options)

    kernel_names = {SHIPPED, *VARIANTS.values()}
    reference: dict = {}
    rows = []
    for name, split in plan:
        if time.time() > deadline:
            log(f"  time budget used up: {name} split={split or 'default'} and later rows skipped")
            break
        row = dict(shape=" ".join(f"{a}={b}" for a, b in shape.items()), variant=name,
                   split=split or "default", status="ok", ms=math.nan, dkdv_us=math.nan, total_us=math.nan,
                   bits="", regs=None, spill=None)
        try:
            with self_module.swapped(name), self_module.forced_split(split):
                grads = backward()
                if on_cuda:
                    torch.cuda.synchronize()
                if name == "shipped" and split not in reference:
                    reference[split] = [x.clone() for x in grads]
                elif name == "shipped":
                    row["variant"] = "shipped(again)"
                same = [same_bits(x, y) for x, y in zip(grads, reference[split], strict=True)]
                row["bits"] = " ".join(f"{n}={'same' if s else 'DIFF'}" for n, s in
                                       zip(("dq", "dk", "dv"), same, strict=True))
                if not all(same):
                    row["status"] = "BITS DIFFER"
                row["ms"] = timer(backward)
                if profile_kernels and on_cuda:
                    try:
                        row["dkdv_us"], row["total_us"] = dkdv_device_us(backward, kernel_names)
                    except Exception as e:  # noqa: BLE001 - the profiler is a bonus
                        log(f"  profiler failed ({str(e).splitlines()[0][:120]})")
                row["regs"], row["spill"] = launched_stats()
        except Exception as e:  # noqa: BLE001 - record and go on
            row["status"] = f"error: {str(e).splitlines()[0][:150]}"
        rows.append(row)
        log(f"  {row['variant']:19s} split={str(row['split']):7s} {row['status']:11s} backward "
            f"{row['ms']:.4f} ms | dk/dv {row['dkdv_us']:7.1f} us of {row['total_us']:7.1f} | "
            f"regs {row['regs']} spill {row['spill']} | {row['bits']}")
    return rows


def summary(rows: list[dict], log=print) -> None:
    """Per shape and split: each variant against the shipped kernel (whole backward and dk/dv)."""
    log("\nsummary (negative % = faster than the shipped kernel at the same split; bits must be 'same'):")
    for (shape, split) in dict.fromkeys((r["shape"], r["split"]) for r in rows):
        group = [r for r in rows if r["shape"] == shape and r["split"] == split]
        base = next((r for r in group if r["variant"] == "shipped" and r["status"] == "ok"), None)
        log(f"  {shape} split={split}: shipped {base['ms']:.4f} ms, dk/dv {base['dkdv_us']:.1f} us"
            if base else f"  {shape} split={split}: no shipped row")
        if base is None:
            continue
        for r in group:
            if r is base:
                continue
            dms = 100 * (r["ms"] / base["ms"] - 1)
            dus = 100 * (r["dkdv_us"] / base["dkdv_us"] - 1)
            log(f"    {r['variant']:19s} {r['status']:11s} {r['ms']:.4f} ms ({dms:+.1f}%)  dk/dv "
                f"{r['dkdv_us']:.1f} us ({dus:+.1f}%)")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        base = next((r for r in rows if r["shape"] == shape and r["variant"] == "shipped"
                     and r["split"] == "default" and r["status"] == "ok"), None)
        ok = [r for r in rows if r["shape"] == shape and r["status"] == "ok"
              and not r["variant"].startswith("shipped")]
        if base and ok:
            best = min(ok, key=lambda r: r["ms"])
            log(f"  {shape}: fastest variant {best['variant']} split={best['split']} {best['ms']:.4f} ms, "
                f"{100 * (best['ms'] / base['ms'] - 1):+.1f}% vs the shipped kernel at the launcher's split")
    bad = [r for r in rows if r["status"] != "ok"]
    log(f"  {len(bad)} row(s) not ok" + (": " + ", ".join(f"{r['variant']}/{r['split']}: {r['status']}"
                                                          for r in bad) if bad else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-only", action="store_true", help="offline sm_90 registers / spills (no GPU)")
    p.add_argument("--interpret-check", action="store_true", help="CPU bit check under Triton's interpreter")
    p.add_argument("--variants", default="", help=f"comma list of {list(VARIANTS)} (default: all)")
    p.add_argument("--layer", action="append", default=[],
                   help="another layer shape, e.g. 'hkv=8,d=128' or 'b=4,hq=16,hkv=16,layout=bhsd' (keys of "
                        "LLAMA, the rest as LLAMA); repeatable; after the Llama layer unless --skip-llama")
    p.add_argument("--skip-llama", action="store_true", help="only the --layer shapes")
    p.add_argument("--splits", default="",
                   help="GPU: 'd' (the launcher's split), 'g' (one head per program) or ints (default d,g); "
                        "--compile-only: ints (default 4,8)")
    p.add_argument("--compile-python", default="",
                   help="--compile-only: the compiler's Python (default /tmp/t36)")
    p.add_argument("--dump", default="", help="--compile-only: write PTX / TTGIR / SASS here")
    p.add_argument("--no-precompile", action="store_true", help="GPU: compile at first launch instead")
    p.add_argument("--no-profile", action="store_true", help="GPU: skip the dk/dv device times")
    p.add_argument("--budget-s", type=float, default=80, help="GPU: start no new row after this many seconds")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()] or list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; choose from {list(VARIANTS)}")
    shapes = ([] if args.skip_llama else [LLAMA]) + [layer_shape(text) for text in args.layer]
    if not shapes:
        p.error("--skip-llama: give a --layer")
    if args.compile_only:
        python = args.compile_python or compile_python()
        if python is None:
            p.error("--compile-only: no Triton 3.6 Python (/tmp/t36/bin/python or --compile-python)")
        splits = tuple(int(x) for x in (args.splits or "4,8").split(","))
        bad = 0
        for shape in shapes:
            group = shape["hq"] // shape["hkv"]
            usable = tuple(s for s in splits if group % s == 0)
            rows = compile_only(["shipped", *names], usable, shape, python, args.dump or None)
            bad += sum(not r["ok"] for r in rows)
        return 1 if bad else 0
    if args.interpret_check:
        rows = interpret_check(names)
        bad = [r for r in rows if not r[2]]
        print(f"{len(rows) - len(bad)} of {len(rows)} (case, variant) pairs give the shipped bits")
        return 1 if bad else 0
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/attn_dkdv_variants.py: the timing mode needs a CUDA GPU (see --compile-only and "
                 "--interpret-check for the CPU modes)")
    start = time.time()
    rows = []
    for shape in shapes:
        print(f"\n{' '.join(f'{a}={b}' for a, b in shape.items())}  (bf16, whole backward: delta + dk/dv + "
              "split sum + dq; CUDA-event median, dk/dv device us from torch.profiler)", flush=True)
        rows += gpu_rows(shape, names, [x.strip() for x in (args.splits or "d,g").split(",") if x.strip()],
                         warm=not args.no_precompile, profile_kernels=not args.no_profile,
                         deadline=start + args.budget_s)
    summary(rows)
    print(f"\ntotal {time.time() - start:.0f} s")
    return 1 if any(r["status"] != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
