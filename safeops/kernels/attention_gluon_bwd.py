"""Attention backward dK / dV for Hopper (sm_90) in Gluon (Triton 3.6), warp-specialized.

Only Gluon code and the torch-free description of its launch configurations live here (the offline sm_90
compile test runs in a Python without torch); ``safeops.ops.attention_gluon`` builds the descriptors and
launches. dQ and delta = rowsum(dO * O) come from the Triton dq kernel (``safeops.kernels.attention``),
launched first; this kernel replaces the Triton dk/dv kernel for the problems the Gluon path takes.

Structure (one CTA per (key block of ``NUM_WG * 64`` keys, kv head)):

- a 1-warp producer partition loads the CTA's K and V rows once, then, for each query head of the kv head's
  group and each query block that can see the keys, Q and dO blocks of ``BLOCK_M`` rows by TMA into a
  ``NUM_STAGES``-deep ring (Q and dO with their own ``ready`` barriers, so S^T can start before dO lands);
- ``NUM_WG`` consumer warpgroups (the default partition and the workers), each owning 64 keys: per query
  block S^T = K Q^T and dP^T = V dO^T by async wgmma from shared memory, P^T and dS^T in registers, then
  dV += P^T dO and dK += dS^T Q with P^T / dS^T as register A operands. The two warpgroups share the Q /
  dO ring and run independently otherwise (with ``TURNS`` they take turns issuing S^T and dP^T, and with
  2 also dV and dK, through an mbarrier per warpgroup), so one's exponentials overlap the other's products.
- with ``CAUSAL`` the CTAs are numbered longest first (key block 0 of every head of a chunk of heads first).

Numerics: those of the Triton dk/dv kernel (CONTRACT.md sections 1-4), with the saved per-row ``m`` (base-2
row max) and ``l`` (row sum) kept apart:

    z  = s * C1                 ONE fp32 multiply, C1 = fp32(scale * log2(e)) from the host
    z  = -inf where excluded    a select (causal), never an add
    base = (m == -inf ? 0 : m);  inv_l = (l == 0 ? 0 : 1 / l)
    p  = exp2(min(z - base, 0)) * inv_l        (min: p <= 1 whatever the recomputed product rounds to)
    dV += p^T dO;  dS = p * (dP - delta);  dK += dS^T Q;  dK *= scale

launched with ``enable_fp_fusion=False`` (a PTX test checks no f32 fma). P and dS enter the tensor cores in
the input dtype. Each key's sums run over the query blocks in a fixed order (heads of the group, then query
blocks ascending), no atomics: deterministic, and batch-invariant. With the GQA split (``PARTIAL``) each CTA
takes a slice of the group and stores fp32 partials that one later launch adds in slice order.
"""

from dataclasses import dataclass

from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as _builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language import PropagateNan as _PropagateNan

NEG_INF = gl.constexpr(float("-inf"))
NAN_ALL = gl.constexpr(_PropagateNan.ALL)  # min(NaN, 0) is NaN: a NaN score stays NaN
SIZE_ARGS = ["n_heads", "group", "head_group", "seqlen_q", "seqlen_k", "n_n_blocks", "n_tiles"]
# The dK / dV and dQ kernels' packed-sequence and window arguments: runtime values (one compiled kernel serves
# dense and packed calls, with and without a window), pointers without alignment hints (dense calls pass any
# tensor there).
SEQ_ARGS = ["cu_q_ptr", "cu_k_ptr", "out0_ptr", "out1_ptr", "varlen", "window_left", "out0_stride_row",
            "out0_stride_head", "out1_stride_row", "out1_stride_head"]
# window_left of a call without a window: every key is within it (no overflow: sequences are < 2**25 rows).
NO_WINDOW = 1 << 30
BLOCK_N_WG = 64  # keys per consumer warpgroup: one m64 wgmma row block (Python side)
LOADER_REGS = gl.constexpr(24)


@dataclass(frozen=True)
class GluonBwdConfig:
    block_m: int  # query rows per step (the S^T tile is 64 keys x block_m queries per warpgroup)
    num_stages: int  # depth of the Q / dO ring
    num_wg: int = 2  # consumer warpgroups (2 or 3): keys per CTA = num_wg * 64
    consumer_regs: int = 240
    # Software-pipelined steps: a step's S^T and dP^T are issued before the previous step's dV / dK
    # products, and its exponentials run while those are on the tensor cores (registers for two steps'
    # P^T / dS^T: at D=64 only, where dK and dV take 64 of them).
    pipeline: bool = False
    # The per-row base (m, or 0 where m = -inf) and 1 / l come precomputed (attn_bwd_row_stats_kernel: the
    # same operations, so the same bits) instead of being derived from m and l at every step: 16 selects and
    # 16 reciprocals per thread and step fewer in the exponentials' critical path.
    row_stats: bool = False
    # Consumers release a Q / dO slot by a per-thread arrive (cp.async.mbarrier.arrive.noinc, the barrier
    # counting 128 arrivals per warpgroup) instead of one elected thread's: Triton 3.6's shared-memory
    # barrier analysis treats the elected arrive as touching all shared memory and brackets it with
    # warpgroup bar.syncs, the per-thread one it does not. On at D=64 (9% faster without causal, the same
    # bits); 2-4% slower at D=128.
    thread_arrive: bool = False
    # Consumer warpgroups take turns issuing their products (unpipelined steps only), through one mbarrier
    # per warpgroup with per-thread arrives: 1 = a turn around each step's S^T and dP^T, 2 = also around
    # its dV and dK. Same products in the same order: the same bits.
    turns: int = 0
    # Causal (unpipelined steps): a consumer warpgroup skips the products of the query blocks that precede
    # all of its keys (every pair masked) at the start of each head's steps; it only waits for their Q / dO,
    # takes its turns and releases their slots. The CTA's first query block is its first warpgroup's
    # diagonal, so warpgroup w skips w steps per head: 3% of the steps at D=64 (three warpgroups), 1.5% at
    # D=128, S=4K. The same bits for finite inputs (such a step adds P^T dO and dS^T Q with P = dS = 0).
    skip_masked: bool = False

    def __post_init__(self):
        if self.turns not in (0, 1, 2):
            raise ValueError(f"GluonBwdConfig.turns is 0, 1 or 2, not {self.turns!r}")
        if self.turns and self.pipeline:
            raise ValueError("GluonBwdConfig.turns applies to unpipelined steps: pipeline=True needs turns=0")
        if self.skip_masked and self.pipeline:
            raise ValueError("GluonBwdConfig.skip_masked applies to unpipelined steps: pipeline=True needs "
                             "skip_masked=False")

    @property
    def block_n(self) -> int:
        return self.num_wg * BLOCK_N_WG


# head dim -> configuration (bf16 and fp16, causal or not). D=64: 64-query steps (128 spilled and measured
# slower), three consumer warpgroups (192 keys per CTA) at 160 registers, unpipelined (pipelined, 160
# registers serialize the wgmma; two pipelined warpgroups measured 1.23x slower without causal, the same
# bits), slots released per thread, warpgroups taking turns at S^T / dP^T (+2.5% and +4% in two H100 runs,
# the same bits; around dV / dK too, or at D=128: no gain); D=128: a 3-deep Q / dO ring (166 KB of shared
# memory) measured 1-3% faster than 2, and the row statistics precomputed, 8-10% faster with the same bits
# (RESULTS.md). Causal D=64 skips the leading masked steps of warpgroups 1 and 2 (``skip_masked``: +0.5-2.9%
# in 8 of 9 H100 readings, -1.4% in the ninth, the same bits); at D=128 -2.2% to +1.1%, so off there.
BWD_CONFIGS: dict[int, GluonBwdConfig] = {
    64: GluonBwdConfig(block_m=64, num_stages=3, num_wg=3, consumer_regs=160, thread_arrive=True, turns=1,
                       skip_masked=True),
    128: GluonBwdConfig(block_m=64, num_stages=3, row_stats=True),
}
# Head dims whose backward takes this kernel (and the Gluon dQ kernel) by default (SAFEOPS_GLUON_BWD=auto):
# where they measured faster than the Triton kernels (bench/RESULTS.md). D=64 without causal: +6% on the
# H200, +7.5% on an H100; D=64 causal: with three warpgroups taking turns, +3.5-6% on the H200 (2026-12-06;
# before the turns, 0% on the H200 and -9% on an H100).
AUTO_HEAD_DIMS = (64, 128)  # causal
AUTO_HEAD_DIMS_NONCAUSAL = (64, 128)
HEAD_DIMS = tuple(BWD_CONFIGS)
DTYPES = ("bfloat16", "float16")
_GL_DTYPES = {"bfloat16": gl.bfloat16, "float16": gl.float16}
_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def shared_layout(rows: int, head_dim: int, dtype: str) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], _GL_DTYPES[dtype])


def stat_layout(cfg: GluonBwdConfig) -> gl.NVMMASharedLayout:
    """The shared layout of a (1, 1, block_m) block of fp32 row statistics (unswizzled)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, cfg.block_m], gl.float32)


def block_shapes(cfg: GluonBwdConfig, head_dim: int) -> dict[str, list[int]]:
    """TMA block shapes of the q / k / v / do / dk / dv descriptors over (B, H, S, D) tensors."""
    qb = [1, 1, cfg.block_m, head_dim]
    kb = [1, 1, BLOCK_N_WG, head_dim]
    return {"q": qb, "k": kb, "v": kb, "do": qb, "dk": kb, "dv": kb}


def constexprs(cfg: GluonBwdConfig, causal: bool, partial: bool = False) -> dict:
    """``partial``: the GQA split's form (fp32 partials; ``kv_split`` > 1)."""
    return dict(CAUSAL=causal, NUM_STAGES=cfg.num_stages, NUM_WG=cfg.num_wg, CONSUMER_REGS=cfg.consumer_regs,
                PIPELINE=cfg.pipeline, PRE_STATS=cfg.row_stats, THREAD_ARRIVE=cfg.thread_arrive,
                TURNS=cfg.turns, PARTIAL=partial, SKIP_MASKED=cfg.skip_masked)


LAUNCH_OPTIONS = {"num_warps": 4}


def _desc_types(shapes: dict[str, list[int]], head_dim: int, dtype: str) -> dict[str, str]:
    """``{name}_desc`` -> the tensordesc type of a TMA descriptor of each block shape."""
    types = {}
    for name, shape in shapes.items():
        layout = shared_layout(shape[2], head_dim, dtype)
        types[f"{name}_desc"] = f"tensordesc<{_SHORT[dtype]}[{', '.join(map(str, shape))}],{layout!r}>"
    return types


def signature(cfg: GluonBwdConfig, head_dim: int, dtype: str, partial: bool = False) -> dict[str, str]:
    """Runtime argument types as Triton's compiler spells them (offline compiles), in argument order
    (``partial``: the GQA split's fp32 outputs)."""
    types = _desc_types(block_shapes(cfg, head_dim), head_dim, dtype)
    stat = [1, 1, cfg.block_m]
    layout = stat_layout(cfg)
    for name in ("m", "l", "delta"):
        types[f"{name}_desc"] = f"tensordesc<fp32[{', '.join(map(str, stat))}],{layout!r}>"
    types.update(C1="fp32", scale_ds="fp32")
    types.update({name: "i32" for name in SIZE_ARGS})
    types.update(_seq_types(dtype))
    types["kv_split"] = "i32"
    if partial:
        types.update(out0_ptr="*fp32", out1_ptr="*fp32")
    return {name: types[name] for name in attn_bwd_dkdv_gluon_kernel.arg_names if name in types}


def _seq_types(dtype: str) -> dict[str, str]:
    """Types of the ``SEQ_ARGS``: cu_seqlens (int32), the outputs' pointers (the inputs' dtype), scalars."""
    types = {name: "i32" for name in SEQ_ARGS}
    types.update(cu_q_ptr="*i32", cu_k_ptr="*i32", out0_ptr=f"*{_SHORT[dtype]}", out1_ptr=f"*{_SHORT[dtype]}")
    return types


# ------------------------------------------------------------------------------------------------------
# The kernel.
# ------------------------------------------------------------------------------------------------------

@gluon.jit
def _tile_coords(tile, sizes, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr,
                 ORDERED: gl.constexpr):
    """(n0, b, hk, first query block, query blocks, key block) of CTA ``tile``. Causal: kv heads in chunks
    of ``head_group``; inside a chunk key blocks from the first (sees every query) on, heads innermost.
    Otherwise a kv head's key blocks are adjacent (they share its Q / dO in L2). ``ORDERED`` (the fused
    kernel, whose CTAs add into dQ in a fixed order of key blocks): chunks of heads with key blocks in that
    order, heads innermost, so a CTA's predecessors in the order have smaller tile numbers; causal: the last
    key block (the fewest queries) first. Query i sees key j iff j <= i (top-left aligned, as the Triton
    path)."""
    C1, scale_ds, n_heads, group, head_group, seqlen_q, seqlen_k, n_n_blocks, n_tiles = sizes
    n_bh = n_tiles // n_n_blocks
    if CAUSAL or ORDERED:
        chunk = tile // (head_group * n_n_blocks)
        r = tile % (head_group * n_n_blocks)
        heads_here = gl.minimum(head_group, n_bh - chunk * head_group)
        n_block = r // heads_here
        if ORDERED and CAUSAL:
            n_block = n_n_blocks - 1 - n_block
        bh = chunk * head_group + r % heads_here
    else:
        n_block = tile % n_n_blocks
        bh = tile // n_n_blocks
    n_kv = n_heads // group
    n0 = n_block * BLOCK_N
    n_m = gl.cdiv(seqlen_q, BLOCK_M)
    lo = 0
    if CAUSAL:
        lo = gl.minimum(n0 // BLOCK_M, n_m)
    return n0, bh // n_kv, bh % n_kv, lo, n_m, n_block


@gluon.jit
def _shift_start(n_block, n_m, n_n_blocks, SHIFT: gl.constexpr):
    """(The fused kernel, ``SHIFT``, not causal) the query block key block ``n_block`` visits first: the first
    of the query blocks it is the home of, ceil(n_block * n_m / n_n_blocks). Its steps then run through the
    query blocks from there, wrapping around, so that at any moment the CTAs of a head add into different
    query blocks."""
    start = 0
    if SHIFT:
        start = (n_block * n_m + n_n_blocks - 1) // n_n_blocks
    return start


@gluon.jit
def _query_block(i, start, n_m, SHIFT: gl.constexpr):
    """The query block of step ``i`` (of ``range(lo, n_m)``): ``i`` itself, or with ``SHIFT`` ``i`` places
    after the CTA's first one, wrapping around."""
    mb = i
    if SHIFT:
        mb = (i + start) % n_m
    return mb


@gluon.jit
def _sequence(b, seq, seqlen_q, seqlen_k):
    """(bc, q_start, k_start, rows_q, rows_k) of sequence ``b``: the batch coordinate of its TMA boxes, its
    first row and length in q and in k. Dense: bc = b, rows from 0 with the tensors' lengths; ``varlen``
    (descriptors over (1, H, T, D) views): bc = 0, starts and lengths from cu_seqlens."""
    cu_q_ptr, cu_k_ptr, out0_ptr, out1_ptr, varlen, window_left, s0r, s0h, s1r, s1h = seq
    bc = b
    q_start = b * 0
    k_start = b * 0
    rows_q = seqlen_q + b * 0
    rows_k = seqlen_k + b * 0
    if varlen != 0:
        q_start = gl.load(cu_q_ptr + b)
        rows_q = gl.load(cu_q_ptr + b + 1) - q_start
        k_start = gl.load(cu_k_ptr + b)
        rows_k = gl.load(cu_k_ptr + b + 1) - k_start
        bc = b * 0
    return bc, q_start, k_start, rows_q, rows_k


@gluon.jit
def _kv_tile(tile, sizes, seq, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """(The dK / dV kernel) where CTA ``tile`` is: (n0, bc, b, hk, q_start, k_start, rows_q, rows_k, lo, hi)
    = its first key in its sequence, the batch coordinate of its TMA boxes, its sequence and kv head, the
    first row and the length of its sequence in q and in k, and the query blocks it visits, lo .. hi - 1.
    Dense: bc = b, sequences start at row 0 with the tensors' lengths. ``varlen`` (descriptors over (1, H,
    T, D) views of packed tensors): bc = 0, starts and lengths from cu_seqlens; a CTA past its sequence's
    keys visits nothing (hi = lo). With a left window (``window_left`` < NO_WINDOW) query i sees key j only
    if i <= j + window_left: the query blocks stop at the last one that sees the CTA's last key."""
    cu_q_ptr, cu_k_ptr, out0_ptr, out1_ptr, varlen, window_left, s0r, s0h, s1r, s1h = seq
    C1, scale_ds, n_heads, group, head_group, seqlen_q, seqlen_k, n_n_blocks, n_tiles = sizes
    n0, b, hk, lo, n_m, _n = _tile_coords(tile, sizes, BLOCK_N, BLOCK_M, CAUSAL, False)
    bc, q_start, k_start, rows_q, rows_k = _sequence(b, seq, seqlen_q, seqlen_k)
    if varlen != 0:
        n_m = gl.cdiv(rows_q, BLOCK_M)
        if CAUSAL:
            lo = gl.minimum(n0 // BLOCK_M, n_m)
    hi = gl.minimum(gl.maximum((n0 + BLOCK_N - 1 + window_left) // BLOCK_M + 1, lo), n_m)
    if n0 >= rows_k:
        hi = lo
    return n0, bc, b, hk, q_start, k_start, rows_q, rows_k, lo, hi


@gluon.jit
def _producer(bufs, sizes, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr,
              ORDERED: gl.constexpr, SHIFT: gl.constexpr = False, seq=None, SEQ: gl.constexpr = False,
              kv_split=1):
    """The TMA warp: the CTA's K and V once, then Q, dO and the row statistics of each step. ``SEQ`` (the
    dK / dV kernel): the CTA and its steps from :func:`_kv_tile` (packed sequences, the window); otherwise
    (the fused kernel) from :func:`_tile_coords`, dense. ``kv_split`` (the dK / dV kernel's GQA split): the
    CTA's head is one of ``kv_split`` slices of a kv head's query group; K and V are the kv head's."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
     q_ready, do_ready, q_empty, m_desc, l_desc, delta_desc, m_smem, l_smem, delta_smem) = bufs
    C1, scale_ds, n_heads, group, head_group, seqlen_q, seqlen_k, n_n_blocks, n_tiles = sizes
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N_WG: gl.constexpr = k_desc.block_type.shape[2]
    if SEQ:
        n0, b, _b, hk, q_start, k_start, rows_q, rows_k, lo, hi = _kv_tile(
            gl.program_id(0), sizes, seq, NUM_WG * BLOCK_N_WG, BLOCK_M, CAUSAL)
        n_m = hi
        start = 0
        # Packed statistics come re-laid with each sequence's first row 16-byte aligned (a TMA box along a
        # tensor's innermost dimension must start there): sequence _b from column 4 ceil(q_start / 4) + 4 _b
        # (attention_gluon's _aligned_stats). Dense: q_start = 0.
        s_start = q_start
        cu_q_ptr, cu_k_ptr, out0_ptr, out1_ptr, varlen, window_left, s0r, s0h, s1r, s1h = seq
        if varlen != 0:
            s_start = gl.cdiv(q_start, 4) * 4 + 4 * _b
    else:
        n0, b, hk, lo, n_m, n_block = _tile_coords(gl.program_id(0), sizes, NUM_WG * BLOCK_N_WG, BLOCK_M,
                                                   CAUSAL, ORDERED)
        hi = n_m
        q_start = 0
        k_start = 0
        s_start = 0
        start = _shift_start(n_block, n_m, n_n_blocks, SHIFT)
    mbarrier.expect(kv_ready, 2 * NUM_WG * k_desc.block_type.nbytes)
    for w in gl.static_range(NUM_WG):
        tma.async_copy_global_to_shared(k_desc, [b, hk // kv_split, k_start + n0 + w * BLOCK_N_WG, 0],
                                        kv_ready, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [b, hk // kv_split, k_start + n0 + w * BLOCK_N_WG, 0],
                                        kv_ready, v_smem.index(w))
    c = 0
    for g in range(group):
        h = hk * group + g
        for i in range(lo, hi):
            mb = _query_block(i, start, n_m, SHIFT)
            row = q_start + mb * BLOCK_M
            srow = s_start + mb * BLOCK_M
            slot = c % NUM_STAGES
            mbarrier.wait(q_empty.index(slot), ((c // NUM_STAGES) & 1) ^ 1)
            ready = q_ready.index(slot)
            mbarrier.expect(ready, q_desc.block_type.nbytes + 2 * m_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, h, row, 0], ready, q_smem.index(slot))
            tma.async_copy_global_to_shared(m_desc, [b, h, srow], ready, m_smem.index(slot))
            tma.async_copy_global_to_shared(l_desc, [b, h, srow], ready, l_smem.index(slot))
            ready = do_ready.index(slot)
            mbarrier.expect(ready, do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [b, h, row, 0], ready, do_smem.index(slot))
            tma.async_copy_global_to_shared(delta_desc, [b, h, srow], ready, delta_smem.index(slot))
            c += 1


@gluon.jit
def _release(q_empty, slot, THREAD_ARRIVE: gl.constexpr):
    """Frees ring slot ``slot`` for the producer once this warpgroup's products reading it have retired:
    one elected arrive (the barrier counts warpgroups), or with ``THREAD_ARRIVE`` one per thread (it counts
    threads) that Triton 3.6 does not bracket with warpgroup barriers."""
    if THREAD_ARRIVE:
        async_copy.mbarrier_arrive(q_empty.index(slot), increment_count=False)
    else:
        mbarrier.arrive(q_empty.index(slot), count=1)


@gluon.jit
def _turn_wait(turn, w: gl.constexpr, rounds, ON: gl.constexpr):
    """Waits until the previous consumer warpgroup has issued its products of this round (warpgroup 0
    starts)."""
    if ON:
        if w == 0:
            mbarrier.wait(turn.index(0), (rounds & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(w), rounds & 1)


@gluon.jit
def _turn_pass(turn, w: gl.constexpr, NUM_WG: gl.constexpr, ON: gl.constexpr):
    """Passes the turn to the next warpgroup: one arrive per thread (the barrier counts 128), which Triton
    3.6 does not bracket with warpgroup barriers."""
    if ON:
        async_copy.mbarrier_arrive(turn.index((w + 1) % NUM_WG), increment_count=False)


@gluon.jit
def _issue_t(w_s, x_s, ready, slot, phase, s_layout: gl.constexpr):
    """Issues W X^T (async) once ring slot ``slot`` of ``ready`` has landed: S^T = K Q^T (``w_s`` this
    warpgroup's K, ``x_s`` the slot's Q) or dP^T = V dO^T."""
    ROWS: gl.constexpr = w_s.shape[0]
    COLS: gl.constexpr = x_s.shape[0]
    s_zero = gl.zeros([ROWS, COLS], gl.float32, s_layout)
    mbarrier.wait(ready.index(slot), phase)
    return warpgroup_mma(w_s, x_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)


@gluon.jit
def _issue_st_dpt(bufs, k_w, v_w, q_s, do_s, slot, phase, s_layout: gl.constexpr):
    """Issues S^T = K Q^T and dP^T = V dO^T (async, in that order) once ring slot ``slot`` (Q in ``q_s``,
    dO in ``do_s``) has landed."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
     q_ready, do_ready, q_empty, m_desc, l_desc, delta_desc, m_smem, l_smem, delta_smem) = bufs
    st = _issue_t(k_w, q_s, q_ready, slot, phase, s_layout)
    dpt = _issue_t(v_w, do_s, do_ready, slot, phase, s_layout)
    return st, dpt


@gluon.jit
def _probs_t(bufs, st, C1, slot, q_minus_k, MASKED: gl.constexpr, PRE_STATS: gl.constexpr,
             CAUSAL: gl.constexpr = True, BOUNDED: gl.constexpr = False, q_end=0, window_left=0, tail=False):
    """P^T from a retired S^T: z = s * C1, the select of excluded pairs (``MASKED``), p = exp2(min(z - base,
    0)) / l from the slot's saved row statistics. With ``MASKED``, in indices relative to the warpgroup's
    first key (``q_minus_k`` = the block's first query - that key): query i sees key j iff j <= i (causal);
    ``BOUNDED`` (the dK / dV kernel) also i <= j + ``window_left`` and i < ``q_end`` (its sequence's end:
    a packed block's rows past it are the next sequence's), the causal part only with ``CAUSAL``. Not
    ``MASKED`` but ``BOUNDED`` and ``tail`` (a runtime flag: a block below the diagonal that reaches past
    the window or the sequence's end): those two selects only."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
     q_ready, do_ready, q_empty, m_desc, l_desc, delta_desc, m_smem, l_smem, delta_smem) = bufs
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N_WG: gl.constexpr = k_desc.block_type.shape[2]
    s_layout: gl.constexpr = st.type.layout
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per query (a column of S^T)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # per key
    z = st * C1
    if MASKED:
        qi = gl.arange(0, BLOCK_M, layout=col_layout) + q_minus_k
        kj = gl.arange(0, BLOCK_N_WG, layout=row_layout)
        if BOUNDED:
            ok = (qi[None, :] <= kj[:, None] + window_left) & (qi < q_end)[None, :]
            if CAUSAL:
                ok = ok & (qi[None, :] >= kj[:, None])
            z = gl.where(ok, z, NEG_INF)
        else:
            z = gl.where(qi[None, :] >= kj[:, None], z, NEG_INF)
    elif BOUNDED:
        if tail:  # (a uniform branch)
            qi = gl.arange(0, BLOCK_M, layout=col_layout) + q_minus_k
            kj = gl.arange(0, BLOCK_N_WG, layout=row_layout)
            z = gl.where((qi[None, :] <= kj[:, None] + window_left) & (qi < q_end)[None, :], z, NEG_INF)
    # The row statistics come with Q (m, l) and dO (delta) through shared memory and are read where they
    # are used (16 values per thread each: held across the step they would crowd the accumulators). Rows
    # past seqlen_q read as 0 (TMA): l = 0 gives 1 / l = 0, so p = 0.
    m = m_smem.index(slot).reshape([BLOCK_M]).load(col_layout)
    if PRE_STATS:  # m_smem holds the base and l_smem 1 / l (attn_bwd_row_stats_kernel)
        e = gl.exp2(gl.minimum(z - m[None, :], 0.0, propagate_nan=NAN_ALL))
        return e * l_smem.index(slot).reshape([BLOCK_M]).load(col_layout)[None, :]
    e = gl.exp2(gl.minimum(z - gl.where(m == NEG_INF, 0.0, m)[None, :], 0.0, propagate_nan=NAN_ALL))
    l = l_smem.index(slot).reshape([BLOCK_M]).load(col_layout)
    return e * gl.where(l == 0.0, 0.0, 1.0 / gl.where(l == 0.0, 1.0, l))[None, :]


@gluon.jit
def _operands_t(bufs, pt, dpt, slot, a_layout: gl.constexpr):
    """P^T and dS^T = P^T (dP^T - delta) in the input dtype, as register A operands of dV / dK."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
     q_ready, do_ready, q_empty, m_desc, l_desc, delta_desc, m_smem, l_smem, delta_smem) = bufs
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    delta = delta_smem.index(slot).reshape([BLOCK_M]).load(gl.SliceLayout(0, pt.type.layout))
    dst = pt * (dpt - delta[None, :])
    return gl.convert_layout(pt.to(dtype), a_layout), gl.convert_layout(dst.to(dtype), a_layout)


@gluon.jit
def _step(bufs, C1, k_w, v_w, dk, dv, c, q_minus_k, bounds, tail, s_layout: gl.constexpr,
          a_layout: gl.constexpr, MASKED: gl.constexpr, NUM_STAGES: gl.constexpr, PRE_STATS: gl.constexpr,
          CAUSAL: gl.constexpr, THREAD_ARRIVE: gl.constexpr, turn, w: gl.constexpr, NUM_WG: gl.constexpr,
          TURNS: gl.constexpr):
    """One query block of a consumer warpgroup: S^T and dP^T, P^T and dS^T, dV += P^T dO, dK += dS^T Q.
    ``c``: the block's ring position; ``MASKED`` / ``tail``: apply the selects of :func:`_probs_t`
    (``bounds`` = its (q_end, window_left)), where ``q_minus_k`` = (the block's first query) - (the
    warpgroup's first key)."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
     q_ready, do_ready, q_empty, m_desc, l_desc, delta_desc, m_smem, l_smem, delta_smem) = bufs
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    slot = c % NUM_STAGES
    q_s = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    do_s = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    # (Turn rounds: TURNS per step, so the round of this step's first turn is c * TURNS.)
    _turn_wait(turn, w, c * TURNS, TURNS > 0)
    st, dpt = _issue_st_dpt(bufs, k_w, v_w, q_s, do_s, slot, (c // NUM_STAGES) & 1, s_layout)
    _turn_pass(turn, w, NUM_WG, TURNS > 0)
    st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
    pt = _probs_t(bufs, st, C1, slot, q_minus_k, MASKED, PRE_STATS, CAUSAL, True, bounds[0], bounds[1], tail)
    dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
    # Both products are issued from registers once S^T and dP^T have retired: P^T and dS^T are then all
    # that is live beside the accumulators.
    p16, ds16 = _operands_t(bufs, pt, dpt, slot, a_layout)
    _turn_wait(turn, w, c * TURNS + 1, TURNS > 1)
    dv = warpgroup_mma(p16, do_s, dv, is_async=True)
    dk = warpgroup_mma(ds16, q_s, dk, is_async=True)
    _turn_pass(turn, w, NUM_WG, TURNS > 1)
    dk, dv, p16, ds16 = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, p16, ds16))
    _release(q_empty, slot, THREAD_ARRIVE)
    return dk, dv


@gluon.jit
def _skip_step(bufs, c, NUM_STAGES: gl.constexpr, THREAD_ARRIVE: gl.constexpr, turn, w: gl.constexpr,
               NUM_WG: gl.constexpr, TURNS: gl.constexpr):
    """A step whose pairs are all masked (``GluonBwdConfig.skip_masked``): no products; its slot is waited
    for (both ready barriers, so that their parity phases stay in step: a parity wait cannot tell a phase
    from the one two later, and a release before the slot is filled would count towards its previous
    use), its turns taken, its slot released."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
     q_ready, do_ready, q_empty, m_desc, l_desc, delta_desc, m_smem, l_smem, delta_smem) = bufs
    slot = c % NUM_STAGES
    phase = (c // NUM_STAGES) & 1
    mbarrier.wait(q_ready.index(slot), phase)
    mbarrier.wait(do_ready.index(slot), phase)
    _turn_wait(turn, w, c * TURNS, TURNS > 0)
    _turn_pass(turn, w, NUM_WG, TURNS > 0)
    _turn_wait(turn, w, c * TURNS + 1, TURNS > 1)
    _turn_pass(turn, w, NUM_WG, TURNS > 1)
    _release(q_empty, slot, THREAD_ARRIVE)


@gluon.jit
def _pstep(bufs, C1, k_w, v_w, dk, dv, p_prev, ds_prev, c, q_minus_k, bounds, s_layout: gl.constexpr,
           a_layout: gl.constexpr, MASKED: gl.constexpr, FIRST: gl.constexpr, NUM_STAGES: gl.constexpr,
           PRE_STATS: gl.constexpr, CAUSAL: gl.constexpr, THREAD_ARRIVE: gl.constexpr):
    """Step ``c`` of the pipelined loop: issues S^T_c and dP^T_c, then (unless ``FIRST``) the previous
    step's dV += P^T dO and dK += dS^T Q from ``p_prev`` / ``ds_prev``; computes P^T_c and dS^T_c (as
    :func:`_step` does) while those run; waits for them and releases the previous step's Q / dO slot.
    Returns (dK, dV, P^T_c, dS^T_c) for the next step."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
     q_ready, do_ready, q_empty, m_desc, l_desc, delta_desc, m_smem, l_smem, delta_smem) = bufs
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    slot = c % NUM_STAGES
    q_s = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    do_s = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    st, dpt = _issue_st_dpt(bufs, k_w, v_w, q_s, do_s, slot, (c // NUM_STAGES) & 1, s_layout)
    # Async products retire in issue order: S^T_c, dP^T_c, then the previous step's dV and dK.
    if FIRST:
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
    else:
        prev = (c - 1) % NUM_STAGES
        dv = warpgroup_mma(p_prev, do_smem.index(prev).reshape([BLOCK_M, HEAD_DIM]), dv, is_async=True)
        dk = warpgroup_mma(ds_prev, q_smem.index(prev).reshape([BLOCK_M, HEAD_DIM]), dk, is_async=True)
        st = warpgroup_mma_wait(num_outstanding=3, deps=(st,))
    pt = _probs_t(bufs, st, C1, slot, q_minus_k, MASKED, PRE_STATS, CAUSAL, True, bounds[0], bounds[1])
    if FIRST:
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
    else:
        dpt = warpgroup_mma_wait(num_outstanding=2, deps=(dpt,))
    p16, ds16 = _operands_t(bufs, pt, dpt, slot, a_layout)
    if not FIRST:
        # P^T / dS^T of the previous step are those products' register operands: alive until they retire.
        dk, dv, p_prev, ds_prev = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, p_prev, ds_prev))
        _release(q_empty, (c - 1) % NUM_STAGES, THREAD_ARRIVE)
    return dk, dv, p16, ds16


@gluon.jit
def _pipelined_steps(bufs, C1, k_w, v_w, dk, dv, k0, lo, mid, umid, hi, bounds, group, s_layout: gl.constexpr,
                     a_layout: gl.constexpr, NUM_STAGES: gl.constexpr, PRE_STATS: gl.constexpr,
                     CAUSAL: gl.constexpr, THREAD_ARRIVE: gl.constexpr):
    """The consumer's steps (query heads of the group, then query blocks lo .. hi - 1; those before ``mid``
    and from ``umid`` on take the selects), software-pipelined (:func:`_pstep`): the same products in the
    same order as the unpipelined loop, so the same bits."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
     q_ready, do_ready, q_empty, m_desc, l_desc, delta_desc, m_smem, l_smem, delta_smem) = bufs
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N_WG: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    n_mb = hi - lo
    total = group * n_mb
    if total > 0:
        no_prev = gl.zeros([BLOCK_N_WG, BLOCK_M], dtype, a_layout)
        if lo < mid or lo >= umid:
            dk, dv, p16, ds16 = _pstep(bufs, C1, k_w, v_w, dk, dv, no_prev, no_prev, 0, lo * BLOCK_M - k0,
                                       bounds, s_layout, a_layout, True, True, NUM_STAGES, PRE_STATS, CAUSAL,
                                       THREAD_ARRIVE)
        else:
            dk, dv, p16, ds16 = _pstep(bufs, C1, k_w, v_w, dk, dv, no_prev, no_prev, 0, 0, bounds, s_layout,
                                       a_layout, False, True, NUM_STAGES, PRE_STATS, CAUSAL, THREAD_ARRIVE)
        for c in range(1, total):
            mb = lo + c % n_mb
            if mb < mid or mb >= umid:
                dk, dv, p16, ds16 = _pstep(bufs, C1, k_w, v_w, dk, dv, p16, ds16, c, mb * BLOCK_M - k0,
                                           bounds, s_layout, a_layout, True, False, NUM_STAGES, PRE_STATS,
                                           CAUSAL, THREAD_ARRIVE)
            else:
                dk, dv, p16, ds16 = _pstep(bufs, C1, k_w, v_w, dk, dv, p16, ds16, c, 0, bounds, s_layout,
                                           a_layout, False, False, NUM_STAGES, PRE_STATS, CAUSAL,
                                           THREAD_ARRIVE)
        last = (total - 1) % NUM_STAGES
        dv = warpgroup_mma(p16, do_smem.index(last).reshape([BLOCK_M, HEAD_DIM]), dv, is_async=True)
        dk = warpgroup_mma(ds16, q_smem.index(last).reshape([BLOCK_M, HEAD_DIM]), dk, is_async=True)
        dk, dv, p16, ds16 = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, p16, ds16))
        _release(q_empty, last, THREAD_ARRIVE)
    return dk, dv


@gluon.jit
def _store_rows(ptr, x, row0, n_rows, head, stride_row, stride_head):
    """A masked store of ``x``'s first ``n_rows`` rows (all if more, none if <= 0) to rows row0.. of head
    ``head`` of a packed (T, H, D) tensor: a TMA box store would also write the rows past a sequence's end,
    which are the next sequence's."""
    layout: gl.constexpr = x.type.layout
    ROWS: gl.constexpr = x.shape[0]
    COLS: gl.constexpr = x.shape[1]
    offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    offs_c = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    rows = head.to(gl.int64) * stride_head + (row0 + offs_r).to(gl.int64) * stride_row
    mask = (offs_r < n_rows)[:, None] & (offs_c < COLS)[None, :]
    gl.store(ptr + rows[:, None] + offs_c[None, :], x, mask=mask)


@gluon.jit
def _consumer(w: gl.constexpr, bufs, sizes, seq, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
              NUM_WG: gl.constexpr, PIPELINE: gl.constexpr, PRE_STATS: gl.constexpr,
              THREAD_ARRIVE: gl.constexpr, turn, TURNS: gl.constexpr, PARTIAL: gl.constexpr,
              SKIP_MASKED: gl.constexpr):
    """Consumer warpgroup ``w``: dK, dV of keys n0 + 64 w .. n0 + 64 w + 63. ``PARTIAL`` (the GQA split):
    stored in fp32 to head ``batch x heads + head`` of the partials (``dk_ptr`` / ``dv_ptr`` with their row
    and head strides), rows past the sequence's keys dropped."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
     q_ready, do_ready, q_empty, m_desc, l_desc, delta_desc, m_smem, l_smem, delta_smem) = bufs
    C1, scale_ds, n_heads, group, head_group, seqlen_q, seqlen_k, n_n_blocks, n_tiles = sizes
    cu_q_ptr, cu_k_ptr, dk_ptr, dv_ptr, varlen, window_left, dk_sr, dk_sh, dv_sr, dv_sh = seq
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N_WG: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    # wgmma register layouts of one warpgroup: S^T / dP^T (64 keys x BLOCK_M queries), dK / dV (64 x D).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    n0, bc, b, hk, q_start, k_start, rows_q, rows_k, lo, hi = _kv_tile(
        gl.program_id(0), sizes, seq, NUM_WG * BLOCK_N_WG, BLOCK_M, CAUSAL)
    k0 = n0 + w * BLOCK_N_WG
    dk = gl.zeros([BLOCK_N_WG, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N_WG, HEAD_DIM], gl.float32, acc_layout)
    k_w = k_smem.index(w).reshape([BLOCK_N_WG, HEAD_DIM])
    v_w = v_smem.index(w).reshape([BLOCK_N_WG, HEAD_DIM])
    mbarrier.wait(kv_ready, 0)
    # Query blocks [lo, mid) reach above this warpgroup's diagonal (some of their queries precede some of
    # its keys) and take the causal select (with the others); blocks from ``umid`` on reach past its window
    # (some query more than window_left after some key) or past a packed sequence's end and take those
    # selects. Unpipelined: two loops as without a window, the second with a uniform branch to the tail's
    # selects (the unmasked steps carry no select); pipelined: one loop, a uniform branch per step.
    mid = lo
    if CAUSAL:
        mid = gl.minimum(gl.cdiv(k0 + BLOCK_N_WG - 1, BLOCK_M), hi)
    umid = gl.minimum((k0 + window_left + 1) // BLOCK_M, hi)
    if varlen != 0:  # a dense block's rows past seqlen_q read as zeros (l = 0, so p = 0): no select needed
        umid = gl.minimum(umid, rows_q // BLOCK_M)
    umid = gl.maximum(umid, mid)
    bounds = (rows_q - k0, window_left)  # (the selects' query limit and window, relative to key k0)
    if PIPELINE:
        dk, dv = _pipelined_steps(bufs, C1, k_w, v_w, dk, dv, k0, lo, mid, umid, hi, bounds, group, s_layout,
                                  a_layout, NUM_STAGES, PRE_STATS, CAUSAL, THREAD_ARRIVE)
    else:
        # SKIP_MASKED (causal): the query blocks before ``first`` precede every key of this warpgroup
        # (query i sees key j iff j <= i).
        first = lo
        if CAUSAL and SKIP_MASKED:
            first = gl.minimum(gl.maximum(k0 // BLOCK_M, lo), mid)
        c = 0
        for _g in range(group):
            if CAUSAL and SKIP_MASKED:
                for _mb in range(lo, first):
                    _skip_step(bufs, c, NUM_STAGES, THREAD_ARRIVE, turn, w, NUM_WG, TURNS)
                    c += 1
            for mb in range(first, mid):
                dk, dv = _step(bufs, C1, k_w, v_w, dk, dv, c, mb * BLOCK_M - k0, bounds, False, s_layout,
                               a_layout, True, NUM_STAGES, PRE_STATS, CAUSAL, THREAD_ARRIVE, turn, w, NUM_WG,
                               TURNS)
                c += 1
            for mb in range(mid, hi):
                dk, dv = _step(bufs, C1, k_w, v_w, dk, dv, c, mb * BLOCK_M - k0, bounds, mb >= umid, s_layout,
                               a_layout, False, NUM_STAGES, PRE_STATS, CAUSAL, THREAD_ARRIVE, turn, w, NUM_WG,
                               TURNS)
                c += 1
    dk = dk * scale_ds
    # The tile's sequence again (two loads): not kept in registers across the steps.
    n0, bc, b, hk, q_start, k_start, rows_q, rows_k, lo, hi = _kv_tile(
        gl.program_id(0), sizes, seq, NUM_WG * BLOCK_N_WG, BLOCK_M, CAUSAL)
    k0 = n0 + w * BLOCK_N_WG
    if PARTIAL:
        n_v = n_heads // group
        _store_rows(dk_ptr, dk, k_start + k0, rows_k - k0, bc * n_v + hk, dk_sr, dk_sh)
        _store_rows(dv_ptr, dv, k_start + k0, rows_k - k0, bc * n_v + hk, dv_sr, dv_sh)
    elif varlen != 0 and k0 + BLOCK_N_WG > rows_k:
        # The warpgroup's keys reach past its sequence's end: only its own rows are stored.
        _store_rows(dk_ptr, dk.to(dtype), k_start + k0, rows_k - k0, hk, dk_sr, dk_sh)
        _store_rows(dv_ptr, dv.to(dtype), k_start + k0, rows_k - k0, hk, dv_sr, dv_sh)
    else:
        # dK, dV out through this warpgroup's K and V buffers (dead now) and TMA (rows past seqlen_k
        # dropped).
        k_w.store(dk.to(dtype))
        v_w.store(dv.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [bc, hk, k_start + k0, 0], k_smem.index(w))
        tma.async_copy_shared_to_global(dv_desc, [bc, hk, k_start + k0, 0], v_smem.index(w))
        tma.store_wait(pendings=0)


@gluon.jit
def _consumer0(bufs, sizes, seq, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr,
               PIPELINE: gl.constexpr, PRE_STATS: gl.constexpr, THREAD_ARRIVE: gl.constexpr, turn,
               TURNS: gl.constexpr, PARTIAL: gl.constexpr, SKIP_MASKED: gl.constexpr):
    _consumer(0, bufs, sizes, seq, CAUSAL, NUM_STAGES, NUM_WG, PIPELINE, PRE_STATS, THREAD_ARRIVE, turn,
              TURNS, PARTIAL, SKIP_MASKED)


@gluon.jit
def _consumer1(bufs, sizes, seq, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr,
               PIPELINE: gl.constexpr, PRE_STATS: gl.constexpr, THREAD_ARRIVE: gl.constexpr, turn,
               TURNS: gl.constexpr, PARTIAL: gl.constexpr, SKIP_MASKED: gl.constexpr):
    _consumer(1, bufs, sizes, seq, CAUSAL, NUM_STAGES, NUM_WG, PIPELINE, PRE_STATS, THREAD_ARRIVE, turn,
              TURNS, PARTIAL, SKIP_MASKED)


@gluon.jit
def _consumer2(bufs, sizes, seq, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr,
               PIPELINE: gl.constexpr, PRE_STATS: gl.constexpr, THREAD_ARRIVE: gl.constexpr, turn,
               TURNS: gl.constexpr, PARTIAL: gl.constexpr, SKIP_MASKED: gl.constexpr):
    _consumer(2, bufs, sizes, seq, CAUSAL, NUM_STAGES, NUM_WG, PIPELINE, PRE_STATS, THREAD_ARRIVE, turn,
              TURNS, PARTIAL, SKIP_MASKED)


@gluon.jit(do_not_specialize=SIZE_ARGS + SEQ_ARGS + ["kv_split"])
def attn_bwd_dkdv_gluon_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, m_desc, l_desc, delta_desc,
                               C1, scale_ds, n_heads, group, head_group, seqlen_q, seqlen_k, n_n_blocks,
                               n_tiles, cu_q_ptr, cu_k_ptr, out0_ptr, out1_ptr, varlen, window_left,
                               out0_stride_row, out0_stride_head, out1_stride_row, out1_stride_head,
                               kv_split, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
                               NUM_WG: gl.constexpr, CONSUMER_REGS: gl.constexpr, PIPELINE: gl.constexpr,
                               PRE_STATS: gl.constexpr, THREAD_ARRIVE: gl.constexpr = False,
                               TURNS: gl.constexpr = 0, PARTIAL: gl.constexpr = False,
                               SKIP_MASKED: gl.constexpr = False):
    """dk, dv of key block / kv head ``program_id(0)`` of ``n_tiles`` = n_n_blocks x batch x kv heads.
    Descriptors over (B, H, S, D): q / do (B, Hq, Sq, D), k / v / dk / dv (B, Hkv, Sk, D); m, l, delta
    (B, Hq, Sq) contiguous fp32; kv head = q head // group. ``varlen`` != 0: packed sequences, the
    descriptors over (1, H, T, D) views of (T, H, D) tensors and the statistics' over (1, Hq, Tq);
    sequence b is rows cu_q[b]:cu_q[b+1] of q and cu_k[b]:cu_k[b+1] of k; out0 / out1 = dk / dv (packed,
    with their row and head strides: a sequence's last key block is stored by masked stores). Dense calls
    pass any pointers there. ``window_left``: query i sees key j only if i <= j + window_left (NO_WINDOW:
    every key). ``PARTIAL`` (GQA split): each kv head's query group is split over ``kv_split`` CTAs per key
    block (``group`` and ``n_tiles`` count the slices: ``group`` query heads per CTA, ``n_tiles`` =
    n_n_blocks x batch x kv heads x kv_split), each storing fp32 dK / dV partials to out0 / out1: head
    ``kv head x kv_split + slice`` of (B, Hkv x kv_split, Sk, D) dense (the head stride passed spans a
    batch's heads) or (T, Hkv x kv_split, D) packed, summed afterwards in a fixed order."""
    gl.static_assert(NUM_WG == 2 or NUM_WG == 3)
    gl.static_assert(NUM_STAGES >= 2 or not PIPELINE)  # a pipelined step holds the previous step's slot
    gl.static_assert(TURNS == 0 or not PIPELINE)
    gl.static_assert(not (SKIP_MASKED and PIPELINE))
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [NUM_STAGES] + do_desc.block_type.shape,
                                        do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_WG] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_WG] + v_desc.block_type.shape, v_desc.layout)
    m_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + m_desc.block_type.shape, m_desc.layout)
    l_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + l_desc.block_type.shape, l_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + delta_desc.block_type.shape,
                                           delta_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        # Free once every consumer has read Q and dO: one arrive per warpgroup, or per thread (THREAD_ARRIVE).
        mbarrier.init(q_empty.index(i), count=NUM_WG * 128 if THREAD_ARRIVE else NUM_WG)
    for i in gl.static_range(NUM_WG):
        mbarrier.init(turn.index(i), count=128)  # a turn passes by one arrive per thread of a warpgroup
    fence_async_shared()  # the inits visible to the async proxy (TMA) before it signals the barriers
    bufs = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
            q_ready, do_ready, q_empty, m_desc, l_desc, delta_desc, m_smem, l_smem, delta_smem)
    sizes = (C1, scale_ds, n_heads, group, head_group, seqlen_q, seqlen_k, n_n_blocks, n_tiles)
    seq = (cu_q_ptr, cu_k_ptr, out0_ptr, out1_ptr, varlen, window_left, out0_stride_row, out0_stride_head,
           out1_stride_row, out1_stride_head)
    # (The argument tuples are written out: a tuple assigned to a name turns its constexprs into tensors.)
    if NUM_WG == 2:
        gl.warp_specialize([(_consumer0, (bufs, sizes, seq, CAUSAL, NUM_STAGES, NUM_WG, PIPELINE, PRE_STATS,
                                          THREAD_ARRIVE, turn, TURNS, PARTIAL, SKIP_MASKED)),
                            (_consumer1, (bufs, sizes, seq, CAUSAL, NUM_STAGES, NUM_WG, PIPELINE, PRE_STATS,
                                          THREAD_ARRIVE, turn, TURNS, PARTIAL, SKIP_MASKED)),
                            (_producer, (bufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, False, False, seq, True,
                                         kv_split))],
                           [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([(_consumer0, (bufs, sizes, seq, CAUSAL, NUM_STAGES, NUM_WG, PIPELINE, PRE_STATS,
                                          THREAD_ARRIVE, turn, TURNS, PARTIAL, SKIP_MASKED)),
                            (_consumer1, (bufs, sizes, seq, CAUSAL, NUM_STAGES, NUM_WG, PIPELINE, PRE_STATS,
                                          THREAD_ARRIVE, turn, TURNS, PARTIAL, SKIP_MASKED)),
                            (_consumer2, (bufs, sizes, seq, CAUSAL, NUM_STAGES, NUM_WG, PIPELINE, PRE_STATS,
                                          THREAD_ARRIVE, turn, TURNS, PARTIAL, SKIP_MASKED)),
                            (_producer, (bufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, False, False, seq, True,
                                         kv_split))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])


# ------------------------------------------------------------------------------------------------------
# dQ: the forward's shape (a query tile stays, key blocks stream), 3 products per block pair.
# ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GluonDqConfig:
    block_n: int  # keys per step
    num_stages: int  # depth of the K / V ring
    num_wg: int = 2  # consumer warpgroups: query rows per CTA = num_wg * 64
    consumer_regs: int = 240

    @property
    def block_m(self) -> int:
        return self.num_wg * BLOCK_N_WG


DQ_CONFIGS: dict[int, GluonDqConfig] = {
    64: GluonDqConfig(block_n=128, num_stages=3),
    128: GluonDqConfig(block_n=64, num_stages=3),
}
DQ_SIZE_ARGS = ["n_heads", "group", "seqlen_q", "seqlen_k", "n_m_blocks", "n_tiles"]


def dq_block_shapes(cfg: GluonDqConfig, head_dim: int) -> dict[str, list[int]]:
    """TMA block shapes of the q / k / v / do / dq descriptors over (B, H, S, D) tensors."""
    qb = [1, 1, BLOCK_N_WG, head_dim]
    kb = [1, 1, cfg.block_n, head_dim]
    return {"q": qb, "k": kb, "v": kb, "do": qb, "dq": qb}


def dq_constexprs(cfg: GluonDqConfig, causal: bool) -> dict:
    return dict(CAUSAL=causal, NUM_STAGES=cfg.num_stages, NUM_WG=cfg.num_wg, CONSUMER_REGS=cfg.consumer_regs)


def dq_signature(cfg: GluonDqConfig, head_dim: int, dtype: str) -> dict[str, str]:
    """Runtime argument types of the dQ kernel as Triton's compiler spells them, in argument order."""
    types = _desc_types(dq_block_shapes(cfg, head_dim), head_dim, dtype)
    types.update(m_ptr="*fp32", l_ptr="*fp32", delta_ptr="*fp32", C1="fp32", scale_ds="fp32")
    types.update({name: "i32" for name in DQ_SIZE_ARGS})
    types.update(_seq_types(dtype))
    return {name: types[name] for name in attn_bwd_dq_gluon_kernel.arg_names if name in types}


@gluon.jit
def _dq_tile(tile, sizes, seq, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(m0, bc, b, h, hk, q_start, k_start, rows_q, rows_k, lo, n_blocks) of CTA ``tile``: its first query
    row in its sequence, the batch coordinate of its TMA boxes, its sequence, query and kv head, the first
    row and length of its sequence in q and k, and its key blocks lo .. n_blocks - 1. Query blocks of a head
    adjacent (they share its K / V in L2); causal: the last query blocks (the most keys) first. Packed
    sequences (``varlen``) and the window as :func:`_kv_tile`; a CTA past its sequence's rows visits no key
    block."""
    cu_q_ptr, cu_k_ptr, out0_ptr, out1_ptr, varlen, window_left, s0r, s0h, s1r, s1h = seq
    C1, scale_ds, n_heads, group, seqlen_q, seqlen_k, n_m_blocks, n_tiles = sizes
    m_block = tile % n_m_blocks
    if CAUSAL:
        m_block = n_m_blocks - 1 - m_block
    bh = tile // n_m_blocks
    m0 = m_block * BLOCK_M
    h = bh % n_heads
    b = bh // n_heads
    bc, q_start, k_start, rows_q, rows_k = _sequence(b, seq, seqlen_q, seqlen_k)
    hi = rows_k
    if CAUSAL:
        hi = gl.minimum(rows_k, m0 + BLOCK_M)
    n_blocks = gl.cdiv(hi, BLOCK_N)
    if m0 >= rows_q:
        n_blocks = n_blocks * 0
    lo = gl.minimum(gl.maximum(m0 - window_left, 0) // BLOCK_N, n_blocks)
    return m0, bc, b, h, h // group, q_start, k_start, rows_q, rows_k, lo, n_blocks


@gluon.jit
def _dq_producer(bufs, sizes, seq, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr):
    (q_desc, k_desc, v_desc, do_desc, dq_desc, q_smem, k_smem, v_smem, do_smem, q_ready, k_ready, v_ready,
     kv_empty, m_ptr, l_ptr, delta_ptr) = bufs
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    BLOCK_M_WG: gl.constexpr = q_desc.block_type.shape[2]
    m0, b, _b, h, hk, q_start, k_start, rows_q, rows_k, lo, n_blocks = _dq_tile(
        gl.program_id(0), sizes, seq, NUM_WG * BLOCK_M_WG, BLOCK_N, CAUSAL)
    for w in gl.static_range(NUM_WG):
        mbarrier.expect(q_ready.index(w), 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, q_start + m0 + w * BLOCK_M_WG, 0], q_ready.index(w),
                                        q_smem.index(w))
        tma.async_copy_global_to_shared(do_desc, [b, h, q_start + m0 + w * BLOCK_M_WG, 0], q_ready.index(w),
                                        do_smem.index(w))
    for c in range(n_blocks - lo):
        slot = c % NUM_STAGES
        row = k_start + (lo + c) * BLOCK_N
        mbarrier.wait(kv_empty.index(slot), ((c // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, row, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, row, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _dq_issue(bufs, q_w, do_w, s_zero, j, NUM_STAGES: gl.constexpr):
    """Issues S_j = Q K_j^T and dP_j = dO V_j^T (async, in that order) once the key block at ring position
    ``j`` has landed."""
    (q_desc, k_desc, v_desc, do_desc, dq_desc, q_smem, k_smem, v_smem, do_smem, q_ready, k_ready, v_ready,
     kv_empty, m_ptr, l_ptr, delta_ptr) = bufs
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    slot = j % NUM_STAGES
    phase = (j // NUM_STAGES) & 1
    mbarrier.wait(k_ready.index(slot), phase)
    s = warpgroup_mma(q_w, k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                      use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(slot), phase)
    dp = warpgroup_mma(do_w, v_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                       use_acc=False, is_async=True)
    return s, dp


@gluon.jit
def _dq_ds(s, dp, C1, base, delta, j, limit, first, sfull, a_layout: gl.constexpr, dtype: gl.constexpr,
           MASKED: gl.constexpr, AFTER: gl.constexpr, WINDOW_BRANCH: gl.constexpr):
    """dS_j of key block ``j`` from S_j and dP_j, as the dQ product's register A operand (waits for both):
    e = exp2(z - base) (unnormalised; 1 / l is applied to dQ at the end, as the Triton dq kernel does),
    dS = e * (dP - delta). ``MASKED``: block ``j`` reaches past some row's ``limit`` (causal diagonal, keys
    past seqlen_k) or before its ``first`` key (the window), and its keys outside [first, limit) get
    z = -inf. ``AFTER``: products issued after S_j and dP_j (the previous block's dQ product, 1; none for
    the first block), which may stay in flight."""
    # Async products retire in issue order: S_j, dP_j, then AFTER more.
    s = warpgroup_mma_wait(num_outstanding=1 + AFTER, deps=(s,))
    BLOCK_N: gl.constexpr = s.shape[1]
    s_layout: gl.constexpr = s.type.layout
    z = s * C1
    if MASKED:
        keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        z = gl.where((keys[None, :] < limit[:, None]) & (keys[None, :] >= first[:, None]), z, NEG_INF)
    elif WINDOW_BRANCH and j < sfull:  # (a uniform branch) the window's first blocks: no key past a limit
        keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        z = gl.where(keys[None, :] >= first[:, None], z, NEG_INF)
    e = gl.exp2(gl.minimum(z - base[:, None], 0.0, propagate_nan=NAN_ALL))
    dp = warpgroup_mma_wait(num_outstanding=AFTER, deps=(dp,))
    return gl.convert_layout((e * (dp - delta[:, None])).to(dtype), a_layout)


@gluon.jit
def _dq_pipe_step(bufs, C1, q_w, do_w, s_zero, base, delta, dq, ds, j, lo, limit, first, sfull,
                  a_layout: gl.constexpr, MASKED: gl.constexpr, NUM_STAGES: gl.constexpr,
                  WINDOW_BRANCH: gl.constexpr):
    """Step j > lo of the pipelined dQ loop (key block j, ring position j - lo): issues S_j and dP_j, then
    dQ += dS_{j-1} K_{j-1}; computes dS_j while that product runs; waits for it and releases block j - 1's
    K / V slot. Returns (dQ, dS_j)."""
    (q_desc, k_desc, v_desc, do_desc, dq_desc, q_smem, k_smem, v_smem, do_smem, q_ready, k_ready, v_ready,
     kv_empty, m_ptr, l_ptr, delta_ptr) = bufs
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    c = j - lo
    s, dp = _dq_issue(bufs, q_w, do_w, s_zero, c, NUM_STAGES)
    k_prev = k_smem.index((c - 1) % NUM_STAGES).reshape([BLOCK_N, HEAD_DIM])
    dq = warpgroup_mma(ds, k_prev, dq, is_async=True)
    ds_next = _dq_ds(s, dp, C1, base, delta, j, limit, first, sfull, a_layout, q_desc.dtype, MASKED, 1,
                     WINDOW_BRANCH)
    # dS_{j-1} is the register A operand of the product in flight: kept alive until it retires.
    dq, ds = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds))
    mbarrier.arrive(kv_empty.index((c - 1) % NUM_STAGES), count=1)
    return dq, ds_next


@gluon.jit
def _dq_consumer(w: gl.constexpr, bufs, sizes, seq, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
                 NUM_WG: gl.constexpr):
    """Consumer warpgroup ``w``: dQ of rows m0 + 64 w .. m0 + 64 w + 63."""
    (q_desc, k_desc, v_desc, do_desc, dq_desc, q_smem, k_smem, v_smem, do_smem, q_ready, k_ready, v_ready,
     kv_empty, m_ptr, l_ptr, delta_ptr) = bufs
    C1, scale_ds, n_heads, group, seqlen_q, seqlen_k, n_m_blocks, n_tiles = sizes
    cu_q_ptr, cu_k_ptr, dq_ptr, _unused, varlen, window_left, dq_sr, dq_sh, s1r, s1h = seq
    BLOCK_M_WG: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    m0, bc, b, h, hk, q_start, k_start, rows_q, rows_k, lo, n_blocks = _dq_tile(
        gl.program_id(0), sizes, seq, NUM_WG * BLOCK_M_WG, BLOCK_N, CAUSAL)
    r0 = m0 + w * BLOCK_M_WG
    offs_m = r0 + gl.arange(0, BLOCK_M_WG, layout=row_layout)
    ok = offs_m < rows_q
    # The statistics: (B, Hq, Sq) dense, (Hq, Tq) packed (seqlen_q = Tq then).
    st = (bc * n_heads + h).to(gl.int64) * seqlen_q + q_start + offs_m
    # Two values per thread: the row statistics stay in registers for the whole tile. Rows past the
    # sequence get base 0, 1 / l = 0 (their dQ is 0 and not stored).
    m = gl.load(m_ptr + st, mask=ok, other=NEG_INF)
    l = gl.load(l_ptr + st, mask=ok, other=0.0)
    delta = gl.load(delta_ptr + st, mask=ok, other=0.0)
    base = gl.where(m == NEG_INF, 0.0, m)
    inv_l = gl.where(l == 0.0, 0.0, 1.0 / gl.where(l == 0.0, 1.0, l))
    # Per row, the keys it sees: [first, limit). Blocks from ``full`` on reach past some row's limit, blocks
    # before ``sfull`` before some row's first key (the window): both take the select.
    if CAUSAL:
        limit = gl.minimum(offs_m + 1, rows_k)
        full = gl.minimum(r0 + 1, rows_k) // BLOCK_N
    else:
        limit = gl.full([BLOCK_M_WG], 0, gl.int32, row_layout) + rows_k
        full = rows_k // BLOCK_N
    full = gl.minimum(full, n_blocks)
    first = offs_m - window_left
    sfull = gl.cdiv(gl.maximum(r0 + BLOCK_M_WG - 1 - window_left, 0), BLOCK_N)
    dq = gl.zeros([BLOCK_M_WG, HEAD_DIM], gl.float32, acc_layout)
    q_w = q_smem.index(w).reshape([BLOCK_M_WG, HEAD_DIM])
    do_w = do_smem.index(w).reshape([BLOCK_M_WG, HEAD_DIM])
    s_zero = gl.zeros([BLOCK_M_WG, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_ready.index(w), 0)
    # Software-pipelined over the key blocks (_dq_pipe_step): dS_j is computed while dQ += dS_{j-1} K_{j-1}
    # runs. The products accumulate into dQ in block order, as unpipelined: the same bits. Blocks before
    # ``sfull`` (the window) and from ``full`` on take the selects. At D=128 the window's blocks share the
    # unmasked loop behind a uniform branch (a loop of their own made ptxas copy dS between the loops at
    # every step, offline); at D=64 (128-key blocks) that branch spills, so there they get their own loop.
    WINDOW_LOOP: gl.constexpr = BLOCK_N > 64
    if n_blocks > lo:
        s, dp = _dq_issue(bufs, q_w, do_w, s_zero, 0, NUM_STAGES)
        if lo < full and (lo >= sfull or not WINDOW_LOOP):
            ds = _dq_ds(s, dp, C1, base, delta, lo, limit, first, sfull, a_layout, dtype, False, 0,
                        not WINDOW_LOOP)
        else:
            ds = _dq_ds(s, dp, C1, base, delta, lo, limit, first, sfull, a_layout, dtype, True, 0,
                        not WINDOW_LOOP)
        s1 = lo + 1
        if WINDOW_LOOP:
            s1 = gl.minimum(gl.maximum(sfull, lo + 1), n_blocks)
            for j in range(lo + 1, s1):
                dq, ds = _dq_pipe_step(bufs, C1, q_w, do_w, s_zero, base, delta, dq, ds, j, lo, limit, first,
                                       sfull, a_layout, True, NUM_STAGES, False)
        f1 = gl.minimum(gl.maximum(full, s1), n_blocks)
        for j in range(s1, f1):
            dq, ds = _dq_pipe_step(bufs, C1, q_w, do_w, s_zero, base, delta, dq, ds, j, lo, limit, first,
                                   sfull, a_layout, False, NUM_STAGES, not WINDOW_LOOP)
        for j in range(f1, n_blocks):
            dq, ds = _dq_pipe_step(bufs, C1, q_w, do_w, s_zero, base, delta, dq, ds, j, lo, limit, first,
                                   sfull, a_layout, True, NUM_STAGES, not WINDOW_LOOP)
        last = (n_blocks - 1 - lo) % NUM_STAGES
        dq = warpgroup_mma(ds, k_smem.index(last).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
        dq, ds = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds))
        mbarrier.arrive(kv_empty.index(last), count=1)
    dq = dq * gl.convert_layout(inv_l * scale_ds, gl.SliceLayout(1, acc_layout))[:, None]
    if varlen != 0 and r0 + BLOCK_M_WG > rows_q:
        # The warpgroup's rows reach past its sequence's end (or start past it): only its own rows are
        # stored.
        _store_rows(dq_ptr, dq.to(dtype), q_start + r0, rows_q - r0, h, dq_sr, dq_sh)
    else:
        # dQ out through this warpgroup's Q buffer (Q is dead: every product has retired) and TMA.
        q_w.store(dq.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dq_desc, [bc, h, q_start + r0, 0], q_smem.index(w))
        tma.store_wait(pendings=0)


@gluon.jit
def _dq_consumer0(bufs, sizes, seq, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr):
    _dq_consumer(0, bufs, sizes, seq, CAUSAL, NUM_STAGES, NUM_WG)


@gluon.jit
def _dq_consumer1(bufs, sizes, seq, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr):
    _dq_consumer(1, bufs, sizes, seq, CAUSAL, NUM_STAGES, NUM_WG)


@gluon.jit(do_not_specialize=DQ_SIZE_ARGS + SEQ_ARGS)
def attn_bwd_dq_gluon_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, m_ptr, l_ptr, delta_ptr, C1, scale_ds,
                             n_heads, group, seqlen_q, seqlen_k, n_m_blocks, n_tiles, cu_q_ptr, cu_k_ptr,
                             out0_ptr, out1_ptr, varlen, window_left, out0_stride_row, out0_stride_head,
                             out1_stride_row, out1_stride_head, CAUSAL: gl.constexpr,
                             NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """dq of query tile ``program_id(0)`` of ``n_tiles`` = n_m_blocks x batch x query heads, from delta
    (computed before, by the Triton dq kernel's delta-only launch). Descriptors over (B, H, S, D) views;
    m, l, delta (B, Hq, Sq) contiguous fp32. ``varlen`` != 0: packed sequences as in the dK / dV kernel
    (m, l, delta (Hq, Tq), ``seqlen_q`` = Tq; out0 = dq, packed, with its row and head strides; out1 is not
    read); ``window_left`` as there."""
    gl.static_assert(NUM_WG == 2)
    gl.static_assert(NUM_STAGES >= 2)  # the pipelined loop holds one block's slot while it waits for the next
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_WG] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [NUM_WG] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_WG):
        mbarrier.init(q_ready.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=NUM_WG)  # free once every consumer has read K and V
    fence_async_shared()  # the inits visible to the async proxy (TMA) before it signals the barriers
    bufs = (q_desc, k_desc, v_desc, do_desc, dq_desc, q_smem, k_smem, v_smem, do_smem, q_ready, k_ready,
            v_ready, kv_empty, m_ptr, l_ptr, delta_ptr)
    sizes = (C1, scale_ds, n_heads, group, seqlen_q, seqlen_k, n_m_blocks, n_tiles)
    seq = (cu_q_ptr, cu_k_ptr, out0_ptr, out1_ptr, varlen, window_left, out0_stride_row, out0_stride_head,
           out1_stride_row, out1_stride_head)
    gl.warp_specialize([(_dq_consumer0, (bufs, sizes, seq, CAUSAL, NUM_STAGES, NUM_WG)),
                        (_dq_consumer1, (bufs, sizes, seq, CAUSAL, NUM_STAGES, NUM_WG)),
                        (_dq_producer, (bufs, sizes, seq, CAUSAL, NUM_STAGES, NUM_WG))],
                       [4, 1], [CONSUMER_REGS, LOADER_REGS])


# ------------------------------------------------------------------------------------------------------
# The fused backward: dK / dV as above plus dQ from the same dS, added into an fp32 dQ in a fixed order.
# ------------------------------------------------------------------------------------------------------
# Each CTA (key block n, kv head) computes, per query block, dQ_part = dS K over its keys and adds it into an
# fp32 (B, Hq, Sq, D) accumulator. Fixed order: the additions into a query block follow a per-block counter
# (``sem``), key block ascending (non-causal) or descending (causal, whose shortest CTAs come first), so each
# element's sum runs in the same order on every run and in every batch. A CTA waits only for CTAs with
# smaller tile numbers (``_tile_coords`` with ORDERED), which a GPU dispatches first: no deadlock.
#
# Partitions: the two consumer warpgroups (dK, dV as in the dK / dV kernel, then dQ_w = dS_w K_w over the
# warpgroup's own 64 keys, into shared memory), the TMA producer warp, and a writer warp that waits for the
# query block's turn, adds dQ_0 + dQ_1 (in that order) into the accumulator with fp32 atomic adds (their
# order fixed by the turn) and passes the turn on.

@dataclass(frozen=True)
class GluonFusedConfig:
    block_m: int  # query rows per step
    num_stages: int  # depth of the Q / dO ring
    dq_bufs: int = 1  # dQ partials in shared memory between the consumers and the writer
    # dQ split by head-dim columns between the warpgroups (each over all the CTA's keys, dS of both through
    # shared memory, a barrier between them per step) instead of by keys (each over its own 64 keys, all
    # columns, the writer adding the two): half the dQ registers, so at D=128 dQ runs beside dK / dV.
    split_d: bool = False
    # The first key block in a query block's order stores its partial (no zeroed buffer), the last adds the
    # buffer to its own, multiplies by the scale and stores dq in the input dtype (no pass after the kernel).
    finalize: bool = True
    num_wg: int = 2
    consumer_regs: int = 240
    # (split_d, finalize off) The writer adds each warpgroup's dQ partial into the buffer with one TMA
    # reduce-add from shared memory (cp.reduce.async.bulk.tensor) instead of per-element atomic adds, and
    # passes the turn once the reduction has completed.
    tma_reduce: bool = False
    # (not causal) CTAs numbered head by head, each visiting the query blocks from its own first one and the
    # turns of a query block running from the key block that visits it first (FlashAttention-3's "shift"
    # order): without it every CTA of a head waits at its first step for the one before it. Used only where
    # a head's key blocks fit on half the GPU's SMs (fused_shift), else the plain order.
    shift: bool = False
    # The writer waits for the query block's turn before it waits for the step's dQ partials.
    early_turn: bool = False
    # S^T and dP^T issued together, P^T computed while dP^T runs (the dK / dV kernel's order; the fused step
    # issues them one after the other because the atomic writer's build spilled): same products, same bits.
    st_dpt_together: bool = False
    # (causal) CTAs numbered longest first (key block 0 first, as the dK / dV kernel) and each query block's
    # turns ascending from key block 0, instead of shortest first with turns descending from the diagonal:
    # the short CTAs come last, so the grid's tail is short; a CTA still waits only for earlier-numbered ones.
    causal_lpt: bool = False
    # (split_d) dK's dS^T operand from registers instead of shared memory (FlashAttention-3's choice): the
    # same products and bits, one register copy of dS^T more.
    ds_rs: bool = False
    # (split_d) dQ issued between dV and dK, and its partial stored for the writer while dK is still on the
    # tensor cores, instead of after all three products: the same products and bits, the store off the
    # critical path.
    dq_early: bool = False
    # Each row's base and 1 / l precomputed, as GluonBwdConfig.row_stats.
    row_stats: bool = False

    @property
    def block_n(self) -> int:
        return self.num_wg * BLOCK_N_WG


# D=64: 232 registers for the consumers leave the writer 48 (at 32 it spills 768 bytes, at 48 112).
# D=128 splits dQ by columns (by keys, dK, dV and dQ in flight at once need more registers than are left, and
# ptxas serializes the wgmmas; issuing dQ after dK / dV avoids that); a 3-deep ring would leave 144 bytes of
# shared memory.
FUSED_CONFIGS: dict[int, GluonFusedConfig] = {
    64: GluonFusedConfig(block_m=64, num_stages=3, dq_bufs=2, consumer_regs=232),
    # The default for non-causal D=128 (attention_gluon.FUSED_NONCAUSAL): the TMA writer, the shifted order
    # and the precomputed row statistics together (each alone gained 1-6% on the H200, all three 11-13%).
    128: GluonFusedConfig(block_m=64, num_stages=2, dq_bufs=1, split_d=True, tma_reduce=True, finalize=False,
                          shift=True, early_turn=True, row_stats=True),
}
REGISTERS_PER_SM = 65536


def writer_regs(consumer_regs: int) -> int:
    """Registers per thread of the writer warp and the TMA warp (one warpgroup): what the two consumer
    warpgroups leave of the SM's registers (240 -> 32, 232 -> 48)."""
    return (REGISTERS_PER_SM - 2 * 128 * consumer_regs) // 128


def fused_constexprs(cfg: GluonFusedConfig, causal: bool, shift: bool = False) -> dict:
    """The fused kernel's constexprs; ``shift`` as :func:`fused_shift` decides for the launch."""
    return dict(CAUSAL=causal, NUM_STAGES=cfg.num_stages, NUM_WG=cfg.num_wg, CONSUMER_REGS=cfg.consumer_regs,
                DQ_BUFS=cfg.dq_bufs, SPLIT_D=cfg.split_d, FINALIZE=cfg.finalize, TMA_REDUCE=cfg.tma_reduce,
                SHIFT=shift, EARLY_TURN=cfg.early_turn, TOGETHER=cfg.st_dpt_together,
                LPT=cfg.causal_lpt and causal, DS_RS=cfg.ds_rs,
                DQ_EARLY=cfg.dq_early and cfg.split_d, PRE_STATS=cfg.row_stats)


def fused_shift(cfg: GluonFusedConfig, causal: bool, n_n_blocks: int, sm_count: int) -> bool:
    """Whether the fused kernel takes the shifted order (``cfg.shift``): not causal, and a head's key blocks
    at most half the SMs (one CTA per SM). A CTA may wait for one of its head numbered after it, so a head
    must fit on the GPU at once; a GPU starts a grid's CTAs in order, so each grid holds at most one head
    partly started, and with half the SMs two launches at once (two streams) cannot both have all their
    started CTAs waiting for ones that have no SM (bench/gluon_attn_protocol_model.py checks both)."""
    return cfg.shift and not causal and 2 * n_n_blocks <= sm_count


def fused_signature(cfg: GluonFusedConfig, head_dim: int, dtype: str) -> dict[str, str]:
    """Runtime argument types of the fused kernel as Triton's compiler spells them, in argument order."""
    types = signature(GluonBwdConfig(block_m=cfg.block_m, num_stages=cfg.num_stages), head_dim, dtype)
    block = dqacc_block_shape(cfg, head_dim)
    types.update(dqacc_desc=f"tensordesc<fp32[{', '.join(map(str, block))}],{dqacc_layout(cfg, head_dim)!r}>",
                 dq_ptr="*fp32", out_ptr=f"*{_SHORT[dtype]}", sem_ptr="*i32")
    return {name: types[name] for name in attn_bwd_fused_gluon_kernel.arg_names if name in types}


def dqacc_block_shape(cfg: GluonFusedConfig, head_dim: int) -> list[int]:
    """TMA block of the fp32 dq buffer ((B, Hq, Sq, D)): one warpgroup's dQ partial (split by columns: its
    half of the head dim)."""
    return [1, 1, cfg.block_m, head_dim // cfg.num_wg if cfg.split_d else head_dim]


def dqacc_layout(cfg: GluonFusedConfig, head_dim: int) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(dqacc_block_shape(cfg, head_dim), gl.float32)


@_builtin
def _tma_reduce_add(desc, coord, src, _semantic=None):
    """TMA reduce-add of shared-memory tile ``src`` into ``desc``'s tensor at ``coord`` (Triton 3.6's Gluon
    builder has the operation; its Python API does not name it)."""
    offsets = _semantic._convert_to_ir_values(coord, require_i64=False)
    kind = _ir.DESCRIPTOR_REDUCE_KIND.ADD
    _semantic.builder.create_async_tma_reduce(kind, desc.handle, offsets, src.handle)


@gluon.jit
def _bulk_done(lanes):
    """Waits until this thread's bulk async operations have completed (their writes performed, not only
    their shared-memory reads), then orders them before the thread's later generic-proxy accesses."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;",
                              "=r,r", [lanes], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _async_after_acquire(lanes):
    """Orders this thread's acquired generic-proxy view before its later async-proxy (TMA) accesses."""
    gl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r,r", [lanes],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _issue_dq_split(k_smem, ds_all, ds_ready, b, c, w: gl.constexpr, NUM_WG: gl.constexpr,
                    BLOCK_M: gl.constexpr):
    """(SPLIT_D) Once the other warpgroup's dS^T rows are in buffer ``b``, issues (async) warpgroup ``w``'s
    dQ[:, w half] = dS_0 K_0[:, w half] + dS_1 K_1[:, w half]: both warpgroups' keys, in that order."""
    BLOCK_N_WG: gl.constexpr = k_smem.type.shape[3]  # (NUM_WG, 1, 1, keys, head dim)
    HEAD_DIM: gl.constexpr = k_smem.type.shape[4]
    HALF: gl.constexpr = HEAD_DIM // NUM_WG
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF, 16])
    mbarrier.wait(ds_ready.index(b), (c // 2) & 1)
    dq = gl.zeros([BLOCK_M, HALF], gl.float32, dq_layout)
    for u in gl.static_range(NUM_WG):
        k_u = k_smem.index(u).reshape([BLOCK_N_WG, HEAD_DIM]).slice(w * HALF, HALF, dim=1)
        dq = warpgroup_mma(ds_all.slice(u * BLOCK_N_WG, BLOCK_N_WG, dim=0).permute((1, 0)), k_u, dq,
                           use_acc=u > 0, is_async=True)
    return dq


@gluon.jit
def _hand_dq(fbufs, dq, c, w: gl.constexpr, NUM_WG: gl.constexpr, DQ_BUFS: gl.constexpr):
    """Warpgroup ``w``'s retired dQ partial of step ``c`` into dQ buffer ``c % DQ_BUFS`` for the writer."""
    ds_smem, ds_ready, dq_smem, dq_full, dq_empty, dq_ptr, out_ptr, sem_ptr, k_free, dqacc_desc = fbufs
    qb = c % DQ_BUFS
    mbarrier.wait(dq_empty.index(qb), ((c // DQ_BUFS) & 1) ^ 1)
    dq_smem.index(qb * NUM_WG + w).store(dq)
    fence_async_shared()  # (tma_reduce) the writer's TMA reads these stores through the async proxy
    gl.thread_barrier()  # every warp's part is in shared memory before the one arrive
    mbarrier.arrive(dq_full.index(qb), count=1)


@gluon.jit
def _fused_step(bufs, fbufs, C1, k_w, v_w, dk, dv, c, q_minus_k, w: gl.constexpr, s_layout: gl.constexpr,
                a_layout: gl.constexpr, MASKED: gl.constexpr, NUM_STAGES: gl.constexpr,
                NUM_WG: gl.constexpr, DQ_BUFS: gl.constexpr, SPLIT_D: gl.constexpr, DQ_AFTER: gl.constexpr,
                TOGETHER: gl.constexpr, DS_RS: gl.constexpr, DQ_EARLY: gl.constexpr, PRE_STATS: gl.constexpr):
    """One query block of consumer warpgroup ``w``: :func:`_step`'s dK / dV (dS^T entering dK from shared
    memory), and this warpgroup's dQ partial handed to the writer through dQ buffer ``c % DQ_BUFS``: by keys,
    dQ_w = dS_w K_w over its 64 keys and every column; ``SPLIT_D``, dQ[:, w half] = dS K[:, w half] over
    all the CTA's keys, both warpgroups' dS^T in the step's shared buffer ``c % 2`` (a barrier between
    them)."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
     q_ready, do_ready, q_empty, m_desc, l_desc, delta_desc, m_smem, l_smem, delta_smem) = bufs
    ds_smem, ds_ready, dq_smem, dq_full, dq_empty, dq_ptr, out_ptr, sem_ptr, k_free, dqacc_desc = fbufs
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N_WG: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    slot = c % NUM_STAGES
    q_s = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    do_s = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    # S^T first and P^T from it, then dP^T (not both products in flight beside dK / dV as in _step: there
    # the consumers spilled; 192 instead of 352 bytes offline at D=128, causal 6% faster on an H100).
    # ``TOGETHER``: both issued at once and P^T computed while dP^T runs (as _step), for measuring again.
    phase = (c // NUM_STAGES) & 1
    if TOGETHER:
        st, dpt = _issue_st_dpt(bufs, k_w, v_w, q_s, do_s, slot, phase, s_layout)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
        pt = _probs_t(bufs, st, C1, slot, q_minus_k, MASKED, PRE_STATS)
    else:
        st = warpgroup_mma_wait(num_outstanding=0, deps=(_issue_t(k_w, q_s, q_ready, slot, phase, s_layout),))
        pt = _probs_t(bufs, st, C1, slot, q_minus_k, MASKED, PRE_STATS)
        dpt = _issue_t(v_w, do_s, do_ready, slot, phase, s_layout)
    dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
    delta = delta_smem.index(slot).reshape([BLOCK_M]).load(gl.SliceLayout(0, s_layout))
    dst = (pt * (dpt - delta[None, :])).to(dtype)
    # dS^T to shared memory: dQ's A operand is its transpose (queries x keys).
    if SPLIT_D:
        b = c % 2
        ds_all = ds_smem.index(b)
        ds_w = ds_all.slice(w * BLOCK_N_WG, BLOCK_N_WG, dim=0)
    else:
        ds_w = ds_smem.index(w)
    ds_w.store(dst)
    fence_async_shared()
    if SPLIT_D:
        gl.thread_barrier()  # every warp's rows are in (and fenced) before the one arrive
        mbarrier.arrive(ds_ready.index(b), count=1)
    p16 = gl.convert_layout(pt.to(dtype), a_layout)
    dv = warpgroup_mma(p16, do_s, dv, is_async=True)
    if DQ_EARLY:  # (SPLIT_D) dV, dQ, dK; dQ's partial goes to the writer while dK runs
        gl.static_assert(SPLIT_D and not DS_RS)
        dq = _issue_dq_split(k_smem, ds_all, ds_ready, b, c, w, NUM_WG, BLOCK_M)
        dk = warpgroup_mma(ds_w, q_s, dk, is_async=True)
        dv, dq, p16 = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq, p16))  # all but dK retired
        _hand_dq(fbufs, dq, c, w, NUM_WG, DQ_BUFS)
        dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
        mbarrier.arrive(q_empty.index(slot), count=1)
        return dk, dv
    # dS^T enters both of its products from shared memory: no register copy beside P^T's. ``DS_RS``: dK's
    # from registers instead (FlashAttention-3's order; the same products, a register copy more).
    if DS_RS:
        ds16 = gl.convert_layout(dst, a_layout)
        dk = warpgroup_mma(ds16, q_s, dk, is_async=True)
    else:
        dk = warpgroup_mma(ds_w, q_s, dk, is_async=True)
    if SPLIT_D:
        dq = _issue_dq_split(k_smem, ds_all, ds_ready, b, c, w, NUM_WG, BLOCK_M)
        if DS_RS:
            dk, dv, dq, p16, ds16 = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, dq, p16, ds16))
        else:
            dk, dv, dq, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, dq, p16))
        mbarrier.arrive(q_empty.index(slot), count=1)
    else:
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])
        gl.static_assert(not DS_RS)  # (by keys: the configurations that split by columns only)
        if DQ_AFTER:  # registers for dK, dV and dQ in flight at once are more than D=128 leaves
            dk, dv, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, p16))
            mbarrier.arrive(q_empty.index(slot), count=1)
        dq = warpgroup_mma(ds_w.permute((1, 0)), k_w, gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout),
                           use_acc=False, is_async=True)
        if DQ_AFTER:
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        else:
            dk, dv, dq, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, dq, p16))
            mbarrier.arrive(q_empty.index(slot), count=1)
    _hand_dq(fbufs, dq, c, w, NUM_WG, DQ_BUFS)
    return dk, dv


@gluon.jit
def _fused_consumer(w: gl.constexpr, bufs, fbufs, sizes, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
                    NUM_WG: gl.constexpr, DQ_BUFS: gl.constexpr, SPLIT_D: gl.constexpr, ORDERED: gl.constexpr,
                    TOGETHER: gl.constexpr, DS_RS: gl.constexpr, DQ_EARLY: gl.constexpr,
                    PRE_STATS: gl.constexpr):
    """Consumer warpgroup ``w`` of the fused kernel: dK, dV of keys n0 + 64 w .. n0 + 64 w + 63, and their
    dQ partials."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
     q_ready, do_ready, q_empty, m_desc, l_desc, delta_desc, m_smem, l_smem, delta_smem) = bufs
    C1, scale_ds, n_heads, group, head_group, seqlen_q, seqlen_k, n_n_blocks, n_tiles = sizes
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N_WG: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    # (With SHIFT the steps' query blocks are rotated; the consumers do not need them: nothing is masked.)
    n0, b, hk, lo, n_m, _n = _tile_coords(gl.program_id(0), sizes, NUM_WG * BLOCK_N_WG, BLOCK_M, CAUSAL,
                                          ORDERED)
    k0 = n0 + w * BLOCK_N_WG
    DQ_AFTER: gl.constexpr = HEAD_DIM > 64
    dk = gl.zeros([BLOCK_N_WG, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N_WG, HEAD_DIM], gl.float32, acc_layout)
    k_w = k_smem.index(w).reshape([BLOCK_N_WG, HEAD_DIM])
    v_w = v_smem.index(w).reshape([BLOCK_N_WG, HEAD_DIM])
    mbarrier.wait(kv_ready, 0)
    mid = lo
    if CAUSAL:
        mid = gl.minimum(gl.cdiv(k0 + BLOCK_N_WG - 1, BLOCK_M), n_m)
    c = 0
    for _g in range(group):
        for mb in range(lo, mid):
            dk, dv = _fused_step(bufs, fbufs, C1, k_w, v_w, dk, dv, c, mb * BLOCK_M - k0, w, s_layout,
                                 a_layout, True, NUM_STAGES, NUM_WG, DQ_BUFS, SPLIT_D, DQ_AFTER, TOGETHER,
                                 DS_RS, DQ_EARLY, PRE_STATS)
            c += 1
        for _mb in range(mid, n_m):
            dk, dv = _fused_step(bufs, fbufs, C1, k_w, v_w, dk, dv, c, 0, w, s_layout, a_layout, False,
                                 NUM_STAGES, NUM_WG, DQ_BUFS, SPLIT_D, DQ_AFTER, TOGETHER, DS_RS,
                                 DQ_EARLY, PRE_STATS)
            c += 1
    if SPLIT_D:  # the other warpgroup's dQ products read this one's K: dK goes there once they are done
        ds_smem, ds_ready, dq_smem, dq_full, dq_empty, dq_ptr, out_ptr, sem_ptr, k_free, dqacc_desc = fbufs
        mbarrier.arrive(k_free, count=1)
        mbarrier.wait(k_free, 0)
    dk = dk * scale_ds
    k_w.store(dk.to(dtype))
    v_w.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, k0, 0], k_smem.index(w))
    tma.async_copy_shared_to_global(dv_desc, [b, hk, k0, 0], v_smem.index(w))
    tma.store_wait(pendings=0)


@gluon.jit
def _fused_consumer0(bufs, fbufs, sizes, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr,
                     DQ_BUFS: gl.constexpr, SPLIT_D: gl.constexpr, ORDERED: gl.constexpr,
                     TOGETHER: gl.constexpr, DS_RS: gl.constexpr, DQ_EARLY: gl.constexpr,
                     PRE_STATS: gl.constexpr):
    _fused_consumer(0, bufs, fbufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, DQ_BUFS, SPLIT_D, ORDERED, TOGETHER,
                    DS_RS, DQ_EARLY, PRE_STATS)


@gluon.jit
def _fused_consumer1(bufs, fbufs, sizes, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr,
                     DQ_BUFS: gl.constexpr, SPLIT_D: gl.constexpr, ORDERED: gl.constexpr,
                     TOGETHER: gl.constexpr, DS_RS: gl.constexpr, DQ_EARLY: gl.constexpr,
                     PRE_STATS: gl.constexpr):
    _fused_consumer(1, bufs, fbufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, DQ_BUFS, SPLIT_D, ORDERED, TOGETHER,
                    DS_RS, DQ_EARLY, PRE_STATS)


@gluon.jit
def _turn_count(sem_lanes, zeros):
    """The query block's counter, read with acquire by each lane (the fewest any lane saw)."""
    return gl.min(gl.atomic_add(sem_lanes, zeros, sem="acquire", scope="gpu"), axis=0)


@gluon.jit
def _wait_turn(sem_lanes, lanes, turn):
    """Polls the query block's counter with plain (volatile) loads until ``turn`` writers have passed it on
    (32 each), then reads it once per lane with acquire."""
    seen = gl.min(gl.load(sem_lanes, volatile=True), axis=0)
    while seen < turn * 32:
        seen = gl.min(gl.load(sem_lanes, volatile=True), axis=0)
    _turn_count(sem_lanes, lanes)


@gluon.jit
def _row_op(part, ptrs, out_ptrs, ok, has_prev, scale_ds, OP: gl.constexpr, MASKED: gl.constexpr):
    """One 8 x 32 piece of a dQ partial into the buffer: OP 0 adds (atomic), 1 stores (the first turn), 2
    finishes (the last turn: (buffer + partial) * scale into dq, the buffer read only ``has_prev``)."""
    if OP == 0:
        if MASKED:
            gl.atomic_add(ptrs, part, mask=ok, sem="relaxed", scope="gpu")
        else:
            gl.atomic_add(ptrs, part, sem="relaxed", scope="gpu")
    elif OP == 1:
        if MASKED:
            gl.store(ptrs, part, mask=ok)
        else:
            gl.store(ptrs, part)
    else:
        if MASKED:
            prev = gl.load(ptrs, mask=ok & has_prev, other=0.0)
            gl.store(out_ptrs, ((prev + part) * scale_ds).to(out_ptrs.dtype.element_ty), mask=ok)
        else:
            prev = gl.load(ptrs, mask=(ok | True) & has_prev, other=0.0)
            gl.store(out_ptrs, ((prev + part) * scale_ds).to(out_ptrs.dtype.element_ty))


@gluon.jit
def _write_rows(dq_smem, qb, base, out_base, rows, cols, n_rows, has_prev, scale_ds, NUM_WG: gl.constexpr,
                BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, MASKED: gl.constexpr, SPLIT_D: gl.constexpr,
                OP: gl.constexpr):
    """Dq buffer ``qb`` into the rows at ``base`` (``MASKED``: only the first ``n_rows``) by :func:`_row_op`,
    8 x 32 values (one swizzle pattern of the buffer's layout) at a time: by keys, dQ_0 + dQ_1 (in that
    order); split by columns (``SPLIT_D``), each warpgroup's columns."""
    ROWS: gl.constexpr = rows.shape[0]
    COLS: gl.constexpr = cols.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0])
    if SPLIT_D:
        HALF: gl.constexpr = HEAD_DIM // NUM_WG
        for w in gl.static_range(NUM_WG):
            for r in gl.static_range(0, BLOCK_M, ROWS):
                for c0 in gl.static_range(0, HALF, COLS):
                    tile = dq_smem.index(qb * NUM_WG + w).slice(r, ROWS, dim=0).slice(c0, COLS, dim=1)
                    offs = ((r + rows) * HEAD_DIM)[:, None] + (w * HALF + c0 + cols)[None, :]
                    ok = (r + rows < n_rows)[:, None] & (cols < COLS)[None, :]
                    part = tile.load(layout)
                    _row_op(part, base + offs, out_base + offs, ok, has_prev, scale_ds, OP, MASKED)
    else:
        for r in gl.static_range(0, BLOCK_M, ROWS):
            for c0 in gl.static_range(0, HEAD_DIM, COLS):
                part = dq_smem.index(qb * NUM_WG).slice(r, ROWS, dim=0).slice(c0, COLS, dim=1).load(layout)
                for w in gl.static_range(1, NUM_WG):
                    tile = dq_smem.index(qb * NUM_WG + w).slice(r, ROWS, dim=0).slice(c0, COLS, dim=1)
                    part = part + tile.load(layout)
                offs = ((r + rows) * HEAD_DIM)[:, None] + (c0 + cols)[None, :]
                ok = (r + rows < n_rows)[:, None] & (cols < COLS)[None, :]
                _row_op(part, base + offs, out_base + offs, ok, has_prev, scale_ds, OP, MASKED)


@gluon.jit
def _writer(bufs, fbufs, sizes, CAUSAL: gl.constexpr, NUM_WG: gl.constexpr, DQ_BUFS: gl.constexpr,
            SPLIT_D: gl.constexpr, FINALIZE: gl.constexpr, TMA_REDUCE: gl.constexpr, ORDERED: gl.constexpr,
            SHIFT: gl.constexpr, EARLY_TURN: gl.constexpr, LPT: gl.constexpr):
    """The writer warp: per step, waits for both consumers' dQ partials and the query block's turn, adds
    dQ_0 + dQ_1 into the fp32 accumulator (rows past seqlen_q dropped) and passes the turn on: each lane
    adds 1 to the counter with release after its own atomic adds, so the next CTA, waiting for 32 more,
    sees every one of them. ``SHIFT``: the query blocks come in the rotated order of :func:`_query_block`,
    and query block mb's turns go from its home key block (the one whose CTA visits it first) down, wrapping
    around: home, home - 1, ..., 0, n_n_blocks - 1, ..., home + 1, so each key block's CTA adds after one that
    visited the block earlier in its own steps. ``EARLY_TURN``: the writer waits for the turn before it waits
    for the consumers' partials, so a turn that came while they computed costs the step nothing. ``LPT``
    (causal): key blocks 0, 1, ..., n_hi add into query block mb, in that order, the CTAs numbered longest
    first (key block 0 first), so a CTA still waits only for CTAs numbered before it."""
    (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
     q_ready, do_ready, q_empty, m_desc, l_desc, delta_desc, m_smem, l_smem, delta_smem) = bufs
    ds_smem, ds_ready, dq_smem, dq_full, dq_empty, dq_ptr, out_ptr, sem_ptr, k_free, dqacc_desc = fbufs
    C1, scale_ds, n_heads, group, head_group, seqlen_q, seqlen_k, n_n_blocks, n_tiles = sizes
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N_WG: gl.constexpr = k_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = NUM_WG * BLOCK_N_WG
    ROWS: gl.constexpr = 8  # one swizzle pattern of the dQ buffers' layout
    COLS: gl.constexpr = 32  # 128 bytes of fp32: a lane's value per row
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0])
    lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    n0, b, hk, lo, n_m, n_block = _tile_coords(gl.program_id(0), sizes, BLOCK_N, BLOCK_M, CAUSAL, ORDERED)
    start = _shift_start(n_block, n_m, n_n_blocks, SHIFT)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    lanes = gl.zeros([32], gl.int32, lane_layout)
    c = 0
    for g in range(group):
        bh = b * n_heads + hk * group + g
        for i in range(lo, n_m):
            mb = _query_block(i, start, n_m, SHIFT)
            if CAUSAL:  # key blocks n_hi, n_hi - 1, ..., 0 add into query block mb, in that order
                gl.static_assert(not SHIFT)
                turns = gl.minimum(n_n_blocks - 1, (mb * BLOCK_M + BLOCK_M - 1) // BLOCK_N) + 1
                if LPT:  # (or 0, 1, ..., n_hi)
                    turn = n_block
                else:
                    turn = turns - 1 - n_block
            elif SHIFT:  # from the home key block down, wrapping around
                turns = n_n_blocks
                turn = ((mb * n_n_blocks) // n_m - n_block + n_n_blocks) % n_n_blocks
            else:  # key blocks 0, 1, ...
                turns = n_n_blocks
                turn = n_block
            sem_lanes = sem_ptr + (bh * n_m + mb) + lanes
            qb = c % DQ_BUFS
            if EARLY_TURN:
                _wait_turn(sem_lanes, lanes, turn)
            mbarrier.wait(dq_full.index(qb), (c // DQ_BUFS) & 1)
            if not EARLY_TURN:
                _wait_turn(sem_lanes, lanes, turn)
            row0 = mb * BLOCK_M
            if TMA_REDUCE:  # (SPLIT_D, not FINALIZE) each warpgroup's column half: one TMA reduce-add
                gl.static_assert(SPLIT_D and not FINALIZE)
                HALF: gl.constexpr = HEAD_DIM // NUM_WG
                _async_after_acquire(lanes)
                for w in gl.static_range(NUM_WG):
                    part = dq_smem.index(qb * NUM_WG + w).reshape([1, 1, BLOCK_M, HALF])
                    if turn == 0:  # the first turn stores: the buffer needs no zeroing
                        tma.async_copy_shared_to_global(dqacc_desc, [b, hk * group + g, row0, w * HALF], part)
                    else:
                        _tma_reduce_add(dqacc_desc, [b, hk * group + g, row0, w * HALF], part)
                tma.store_wait(pendings=0)  # the buffers have been read
                mbarrier.arrive(dq_empty.index(qb), count=1)
                _bulk_done(lanes)  # the additions are in memory before the turn passes
                gl.atomic_add(sem_lanes, lanes + 1, sem="release", scope="gpu")
            else:
                offset = (bh.to(gl.int64) * seqlen_q + row0) * HEAD_DIM
                base = dq_ptr + offset
                out_base = out_ptr + offset
                n_rows = gl.minimum(seqlen_q - row0, BLOCK_M)
                if FINALIZE and turn == turns - 1:  # the last turn: dq out
                    if n_rows == BLOCK_M:
                        _write_rows(dq_smem, qb, base, out_base, rows, cols, n_rows, turn > 0, scale_ds,
                                    NUM_WG, BLOCK_M, HEAD_DIM, False, SPLIT_D, 2)
                    else:
                        _write_rows(dq_smem, qb, base, out_base, rows, cols, n_rows, turn > 0, scale_ds,
                                    NUM_WG, BLOCK_M, HEAD_DIM, True, SPLIT_D, 2)
                elif FINALIZE and turn == 0:  # the first turn (of several): the buffer starts as its partial
                    if n_rows == BLOCK_M:
                        _write_rows(dq_smem, qb, base, out_base, rows, cols, n_rows, False, scale_ds, NUM_WG,
                                    BLOCK_M, HEAD_DIM, False, SPLIT_D, 1)
                    else:
                        _write_rows(dq_smem, qb, base, out_base, rows, cols, n_rows, False, scale_ds, NUM_WG,
                                    BLOCK_M, HEAD_DIM, True, SPLIT_D, 1)
                else:
                    if n_rows == BLOCK_M:
                        _write_rows(dq_smem, qb, base, out_base, rows, cols, n_rows, True, scale_ds, NUM_WG,
                                    BLOCK_M, HEAD_DIM, False, SPLIT_D, 0)
                    else:
                        _write_rows(dq_smem, qb, base, out_base, rows, cols, n_rows, True, scale_ds, NUM_WG,
                                    BLOCK_M, HEAD_DIM, True, SPLIT_D, 0)
                mbarrier.arrive(dq_empty.index(qb), count=1)
                gl.atomic_add(sem_lanes, lanes + 1, sem="release", scope="gpu")
            c += 1


@gluon.jit(do_not_specialize=SIZE_ARGS)
def attn_bwd_fused_gluon_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, m_desc, l_desc,
                                delta_desc, dqacc_desc, dq_ptr, out_ptr, sem_ptr, C1, scale_ds, n_heads,
                                group, head_group, seqlen_q, seqlen_k, n_n_blocks, n_tiles,
                                CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr, DQ_BUFS: gl.constexpr, SPLIT_D: gl.constexpr,
                                FINALIZE: gl.constexpr, TMA_REDUCE: gl.constexpr, SHIFT: gl.constexpr,
                                EARLY_TURN: gl.constexpr, TOGETHER: gl.constexpr, LPT: gl.constexpr,
                                DS_RS: gl.constexpr, DQ_EARLY: gl.constexpr, PRE_STATS: gl.constexpr):
    """dk, dv of key block / kv head ``program_id(0)`` (as ``attn_bwd_dkdv_gluon_kernel``), and that
    block's share of dq added into ``dq_ptr``: fp32 (B, Hq, Sq, D) contiguous, unscaled. ``FINALIZE``: the
    buffer needs no zeroing, and dq = scale_ds * (its sum) goes to ``out_ptr`` ((B, Hq, Sq, D) contiguous,
    the input dtype); otherwise the buffer holds the sum after the kernel (``TMA_REDUCE``: the first turn
    stores, so it needs no zeroing either; the atomic writer adds into a zeroed buffer). ``dqacc_desc``:
    a TMA descriptor over the same buffer (blocks of :func:`dqacc_block_shape`), which ``TMA_REDUCE`` adds
    into. ``sem_ptr``: int32 (B, Hq, cdiv(Sq, BLOCK_M)) zeroed turn counters. ``SHIFT`` (not causal): CTAs
    numbered head by head, each starting at its own query block (:func:`_writer`); a CTA may then wait for
    one of its head numbered after it, so the launch allows it only where a head's CTAs fit on the GPU at
    once. ``EARLY_TURN``, ``LPT`` (causal): see :func:`_writer`; ``TOGETHER``, ``DS_RS``, ``DQ_EARLY``: see
    :func:`_fused_step`."""
    gl.static_assert(NUM_WG == 2)
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N_WG: gl.constexpr = k_desc.block_type.shape[2]
    WRITER_REGS: gl.constexpr = (65536 - 2 * 128 * CONSUMER_REGS) // 128  # writer_regs()
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [NUM_STAGES] + do_desc.block_type.shape,
                                        do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_WG] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_WG] + v_desc.block_type.shape, v_desc.layout)
    m_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + m_desc.block_type.shape, m_desc.layout)
    l_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + l_desc.block_type.shape, l_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + delta_desc.block_type.shape,
                                           delta_desc.layout)
    if SPLIT_D:  # dS^T of all the CTA's keys, two steps' worth; dQ by columns
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NUM_WG * BLOCK_N_WG, BLOCK_M],
                                                                       q_desc.dtype)
        ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, NUM_WG * BLOCK_N_WG, BLOCK_M], ds_layout)
        dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM // NUM_WG],
                                                                       gl.float32)
        dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS * NUM_WG, BLOCK_M, HEAD_DIM // NUM_WG],
                                            dq_layout)
    else:  # each warpgroup's dS^T; dQ by keys
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N_WG, BLOCK_M], q_desc.dtype)
        ds_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_WG, BLOCK_N_WG, BLOCK_M], ds_layout)
        dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float32)
        dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS * NUM_WG, BLOCK_M, HEAD_DIM], dq_layout)
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=NUM_WG)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=NUM_WG)  # (SPLIT_D) both consumers' dS^T rows are in
    mbarrier.init(k_free, count=NUM_WG)  # (SPLIT_D) neither consumer's dQ reads K any more
    for i in gl.static_range(DQ_BUFS):
        mbarrier.init(dq_full.index(i), count=NUM_WG)  # both consumers' partials are in
        mbarrier.init(dq_empty.index(i), count=1)  # the writer has read them
    fence_async_shared()  # the inits visible to the async proxy (TMA) before it signals the barriers
    bufs = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_smem, k_smem, v_smem, do_smem, kv_ready,
            q_ready, do_ready, q_empty, m_desc, l_desc, delta_desc, m_smem, l_smem, delta_smem)
    fbufs = (ds_smem, ds_ready, dq_smem, dq_full, dq_empty, dq_ptr, out_ptr, sem_ptr, k_free, dqacc_desc)
    sizes = (C1, scale_ds, n_heads, group, head_group, seqlen_q, seqlen_k, n_n_blocks, n_tiles)
    # The tile order (_tile_coords): ORDERED (shortest first for causal), or head by head (SHIFT), or longest
    # first (LPT).
    ORDERED: gl.constexpr = not SHIFT and not LPT
    # (The constexprs go in literal tuples: a tuple assigned to a name first carries them as tensors.)
    gl.warp_specialize([(_fused_consumer0, (bufs, fbufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, DQ_BUFS,
                                            SPLIT_D, ORDERED, TOGETHER, DS_RS, DQ_EARLY, PRE_STATS)),
                        (_fused_consumer1, (bufs, fbufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, DQ_BUFS,
                                            SPLIT_D, ORDERED, TOGETHER, DS_RS, DQ_EARLY, PRE_STATS)),
                        (_producer, (bufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, ORDERED, SHIFT)),
                        (_writer, (bufs, fbufs, sizes, CAUSAL, NUM_WG, DQ_BUFS, SPLIT_D, FINALIZE,
                                   TMA_REDUCE, ORDERED, SHIFT, EARLY_TURN, LPT))],
                       [4, 1, 1], [CONSUMER_REGS, WRITER_REGS, WRITER_REGS])
