"""Triton kernels for attention, forward and backward (FlashAttention-2 structure).

Only ``@triton.jit`` code lives here; ``safeops.ops.attention_launch`` picks blocks, grids and options.

Numerics (CONTRACT.md, attention column). Every score is ONE materialized fp32 value, in base 2:

    s  = dot(q, k)                                  fp32 accumulation
    z2 = s * C1                                     C1 = fp32(scale * log2(e))
    z2 = (1 - 2 / (exp2(s * C1) + 1)) * C2          softcap: C1 = fp32(2 log2(e) scale / softcap),
                                                    C2 = fp32(softcap * log2(e)); the bracket is tanh
    z2 = z2 + mask * log2(e)                        additive mask (an additive -inf excludes, see below)
    z2 = -inf where the key is excluded             bool mask False, causal, window, out of bounds

The same z2 bits feed the running max ``m`` and ``z2 - m`` (the launcher compiles with
``enable_fp_fusion=False``, and a PTX test checks no multiply-add contraction appears). Exclusion is a
select, never an add, so a NaN score at an excluded key never reaches the row. Every online rescale
``exp2(m_old - m_new)`` subtracts a guarded ``m_new`` (0 while the row has seen nothing), so an all-excluded
block never makes NaN, and an empty row ends with ``m = -inf``, ``l = 0``, output 0.

Attention sinks (``HAS_SINKS``, contract section 9): head h's sink logit enters every row as one more score
that carries no value, ``zs2 = fp32(sink[h]) * LOG2E`` (one multiply, not softcapped, not masked). The
forward starts each row's online softmax from it (``m = zs2``, ``l = exp2(zs2 - m)``: 1, or 0 for a -inf
sink, through the same guarded base as every rescale; ``acc = 0``), so ``m`` and ``l`` include it and a row
that sees no key ends with ``m = zs2``, ``l = 1``, output 0. The backward needs nothing new for dq, dk, dv
(``p`` from the saved ``m`` and ``l``); the dq kernel also stores ``p_sink * delta`` per row, ``p_sink =
exp2(zs2 - m) / l``, which the launcher sums in a fixed order into the sink's gradient. Without sinks the
constexpr branch is not compiled and the sink pointers are None: the kernels are what they were.

The forward writes ``m`` (max of z2) and ``l`` (sum of exp2(z2 - m)) per query row, kept apart. The
backward recomputes ``p = exp2(min(z2 - m, 0)) * (1 / l)`` from the same z2 formula; the clamp makes
``p <= 1`` hold even where the transposed dot of the dk/dv kernel rounds ``s`` differently from the
forward. ``dv = p^T dO``, ``dp = dO v^T``, ``ds = p * (dp - delta)`` with ``delta = rowsum(dO * O)``, then
the chain rule through the scale (and ``1 - tanh^2`` for softcap). dk/dv are computed per key block,
looping over the query heads of the group and the query blocks; dq per query block, looping over key
blocks: no atomics, so the backward is deterministic. The dq kernel runs first and also computes ``delta``
for its rows, which the dk/dv kernel reads.

Probabilities and ds enter the second matmul of each pair in the input dtype (bf16/fp16), as in every
flash kernel; the row sum ``l`` is accumulated from the fp32 probabilities.

Under Triton's interpreter (``INTERPRETED``, CPU tensors) numpy has no bf16: the interpreter holds bf16 as
its raw uint16 bits, so its ``tl.dot`` multiplies those integers (1.0 counts as 16256), its fp32 -> bf16
cast truncates and its bf16 <-> fp32 casts mangle subnormals. There every conversion goes through the exact
ones of ``safeops.kernels.convert`` (``to_f32``, ``cast``) and every dot gets fp32 operands (``_dot``): bf16
and fp16 values are exact in fp32 and so are their products, so the dots compute what the tensor cores
compute, P and dS still rounded to the input dtype first (nearest even, as on the GPU). On the GPU
``INTERPRETED`` is False, those branches are not compiled, and the kernels are the same code as without them.
"""

import triton
import triton.language as tl

from safeops.kernels.convert import INTERPRETED, cast, to_f32
from safeops.kernels.reduce import row_sum_tree

NEG_INF = tl.constexpr(float("-inf"))
LOG2E = tl.constexpr(1.4426950408889634)
# Values that change with the problem size are not specialised: one compiled kernel per configuration.
SIZE_ARGS = ["seqlen_q", "seqlen_k", "n_heads", "n_bh", "n_m_blocks", "window_left", "window_right"]


@triton.jit
def _round_tf32(x):
    """fp32 -> nearest TF32 (ties to even) with integer operations; inf and NaN pass unchanged.

    Triton's own TF32 path truncates the low 13 mantissa bits, which is 15-125x less accurate than
    cuBLAS's rounding (contract section 7); after this the truncation drops only zeros.
    """
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 13) & 1
    rounded = (bits + 0xFFF + lsb) & 0xFFFFE000
    finite = (bits & 0x7F800000) != 0x7F800000
    return tl.where(finite, rounded, bits).to(tl.float32, bitcast=True)


@triton.jit
def _prep(x, PRECISION: tl.constexpr):
    """A dot operand as the dot will see it (rounded to TF32 for precision 1)."""
    if PRECISION == 1:
        return _round_tf32(x)
    else:
        return x


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b. PRECISION: 0 ieee fp32, 1 TF32 on pre-rounded operands, 2 3xTF32, 3 fp16/bf16 inputs.
    The interpreter gets fp32 operands (exact; it ignores ``input_precision``): its bf16 dot is wrong."""
    if INTERPRETED:
        return tl.dot(to_f32(a), to_f32(b), acc, input_precision="ieee")
    elif PRECISION == 0:
        return tl.dot(a, b, acc, input_precision="ieee")
    elif PRECISION == 1:
        return tl.dot(a, b, acc, input_precision="tf32")
    elif PRECISION == 2:
        return tl.dot(a, b, acc, input_precision="tf32x3")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _scores(s, C1, C2, SOFTCAP: tl.constexpr):
    """z2 from the fp32 dot s: the one materialized score. Every kernel computes it here."""
    if SOFTCAP:
        e = tl.exp2(s * C1)
        return (1.0 - 2.0 / (e + 1.0)) * C2
    else:
        return s * C1


@triton.jit
def _sink_score(sinks_ptr, pid_h):
    """zs2 of head ``pid_h``'s sink: its fp32 logit times LOG2E, one multiply (fp32 sinks: the launcher's)."""
    return tl.load(sinks_ptr + pid_h) * LOG2E


@triton.jit
def _dsoftcap(ds, s, C1, SOFTCAP: tl.constexpr):
    """d loss / d (s * scale) from d loss / d z: 1 - tanh^2 for softcap (the tanh of _scores). The constant
    factor ``scale`` is applied once to the dk / dq accumulators at the end, not per score."""
    if SOFTCAP:
        e = tl.exp2(s * C1)
        t = 1.0 - 2.0 / (e + 1.0)
        return ds * (1.0 - t * t)
    else:
        return ds


@triton.jit
def _apply_masks(z, offs_m, offs_n, seqlen_q, seqlen_k, window_left, window_right, mask_ptr, smi, smj,
                 MASKED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr,
                 HAS_WR: tl.constexpr, EVEN: tl.constexpr = False):
    """Additive mask, then select excluded keys to -inf. ``offs_m``/``offs_n`` are row/column vectors
    already broadcast to z's orientation (queries x keys or keys x queries). ``EVEN``: the caller knows every
    key of the block is in bounds (whole blocks), so only the window decides."""
    if MASK_KIND != 0:
        in_bounds = (offs_m < seqlen_q) & (offs_n < seqlen_k)
        ptrs = mask_ptr + offs_m.to(tl.int64) * smi + offs_n.to(tl.int64) * smj
        if MASK_KIND == 1:
            keep = tl.load(ptrs, mask=in_bounds, other=0) != 0
            z = tl.where(keep, z, NEG_INF)
        else:
            add = to_f32(tl.load(ptrs, mask=in_bounds, other=0.0))
            # An additive -inf excludes the key (select): a NaN score there must not reach the row.
            z = tl.where(add == NEG_INF, NEG_INF, z + add * LOG2E)
    if MASKED:
        if EVEN:
            keep = tl.full(offs_n.shape, 1, tl.int1)
        else:
            keep = offs_n < seqlen_k
        if HAS_WR:
            keep = keep & (offs_n <= offs_m + window_right)
        if HAS_WL:
            keep = keep & (offs_n >= offs_m - window_left)
        z = tl.where(keep, z, NEG_INF)
    return z


@triton.jit
def _block_ranges(o0, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, n_inner, before, after,
                  HAS_BEFORE: tl.constexpr, HAS_AFTER: tl.constexpr):
    """Inner blocks for the outer block [o0, o0 + BLOCK_O), where inner j is visible from outer i iff
    ``i - before <= j <= i + after`` (and ``j < n_inner``).

    Returns (lo, a, b, hi): [lo, a) and [b, hi) need masking, [a, b) is fully visible and in bounds (whole
    blocks); blocks outside [lo, hi) are skipped entirely. lo, a and b are multiples of BLOCK_I.
    """
    lo = 0
    hi = n_inner
    full_lo = 0
    full_hi = (n_inner // BLOCK_I) * BLOCK_I
    if HAS_BEFORE:
        lo = (tl.maximum(o0 - before, 0) // BLOCK_I) * BLOCK_I
        full_lo = tl.cdiv(tl.maximum(o0 + BLOCK_O - 1 - before, 0), BLOCK_I) * BLOCK_I
    if HAS_AFTER:
        hi = tl.minimum(hi, o0 + BLOCK_O + after)
        full_hi = tl.minimum(full_hi, ((o0 + after + 1) // BLOCK_I) * BLOCK_I)
    hi = tl.maximum(hi, lo)
    a = tl.minimum(tl.maximum(full_lo, lo), hi)
    b = tl.minimum(tl.maximum(full_hi, a), hi)
    # a and b are multiples of BLOCK_I unless they equal hi (no fully visible block: [a, b) is empty); the
    # floor changes no block's loop (a block in [floor(a), hi) goes to the masked [b, hi) loop either way)
    # and lets the compiler see the multiple: start_m + arange in the unmasked loop is then known aligned
    # (vectorised loads of the row statistics; hi, a sequence length, is not specialised).
    a = (a // BLOCK_I) * BLOCK_I
    b = (b // BLOCK_I) * BLOCK_I
    return lo, a, b, hi


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, mask_ptr, offs_m, offs_n0, offs_d, offs_dv,
               lo, hi,
               seqlen_q, seqlen_k, sks, svs, smi, smj, window_left, window_right, C1, C2,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               MASKED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
               SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
               WARP_SPECIALIZE: tl.constexpr, USE_TMA: tl.constexpr, EVEN: tl.constexpr = False):
    """Key blocks [lo, hi) of one query block. ``MASKED``: the blocks need masking (window, causal diagonal,
    the partial last block). ``EVEN``: every key block is whole (the launcher's promise), so a masked step
    masks for the window / causal diagonal / attn_mask alone: no key-row bounds on the K/V loads or scores."""
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
        offs_n = start_n + offs_n0
        kv_ok = offs_n < seqlen_k
        if USE_TMA:
            # The descriptor's shape is this sequence's (keys, head dim): out-of-range rows and the padded
            # head dim read as zeros.
            k = k_desc.load([start_n, 0])
        else:
            # Key rows masked only in a masked step of a launch that is not EVEN; head-dim columns only
            # where the head dim is padded to the block.
            k = _load_step(k_ptrs + start_n * sks, kv_ok, offs_d[None, :] < HEAD_DIM, BLOCK_D == HEAD_DIM,
                           MASKED, EVEN)
        s = _dot(q, _prep(tl.trans(k), PRECISION), tl.zeros([q.shape[0], BLOCK_N], tl.float32), PRECISION)
        z = _scores(s, C1, C2, SOFTCAP)
        z = _apply_masks(z, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left, window_right,
                         mask_ptr, smi, smj, MASKED, MASK_KIND, HAS_WL, HAS_WR, EVEN)
        m_new = tl.maximum(m_i, tl.max(z, 1))
        # Guarded rescale: while a row has seen only excluded keys, m_new = -inf and the base is 0, so
        # neither exp2(m_i - base) nor exp2(z - base) is -inf - -inf.
        base = tl.where(m_new == NEG_INF, 0.0, m_new)
        alpha = tl.exp2(m_i - base)
        p = tl.exp2(z - base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_TMA:
            v = v_desc.load([start_n, 0])
        else:
            v = _load_step(v_ptrs + start_n * svs, kv_ok, offs_dv[None, :] < HEAD_DIM_V,
                           BLOCK_DV == HEAD_DIM_V, MASKED, EVEN)
        acc = _dot(_prep(cast(p, v.dtype), PRECISION), _prep(v, PRECISION), acc, PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _tail_end(b, hi, HAS_AFTER: tl.constexpr, EVEN: tl.constexpr):
    """End of the masked tail [b, hi) of _block_ranges. Without a window on that side it holds only the
    partial last block, which an ``EVEN`` launch (whole blocks) does not have: then the tail is [b, b), a loop
    the compiler removes (its registers and predicates stay out of the main loop)."""
    end = hi
    if not HAS_AFTER:
        if EVEN:
            end = b
    return end


@triton.jit
def _backward_program(n_bh):
    """(block, batch x head) of a backward program on the grid (G, n_blocks, cdiv(n_bh, G)): block-major
    inside groups of G heads, so a causal launch starts the longest programs of G heads first instead of
    one head's longest and shortest programs in turn (G = 1: one head after another). -1 past the end."""
    pid_bh = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    return tl.program_id(1), tl.where(pid_bh < n_bh, pid_bh, -1)


@triton.jit
def _sequence(pid_b, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """(first query row, query count, first key row, key count) of batch entry pid_b."""
    if VARLEN:
        q_start = tl.load(cu_q_ptr + pid_b)
        q_len = tl.load(cu_q_ptr + pid_b + 1) - q_start
        k_start = tl.load(cu_k_ptr + pid_b)
        k_len = tl.load(cu_k_ptr + pid_b + 1) - k_start
        return q_start, q_len, k_start, k_len
    else:
        zero = tl.full([], 0, tl.int32)
        return zero, seqlen_q, zero, seqlen_k


@triton.jit(do_not_specialize=SIZE_ARGS)
def attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr, mask_ptr, cu_q_ptr, cu_k_ptr, sinks_ptr,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos, stb, sth, sts, smb, smh, smi, smj,
    n_heads, seqlen_q, seqlen_k, n_m_blocks, window_left, window_right, C1, C2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr, REVERSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr = False, USE_TMA: tl.constexpr = False,
    EVEN: tl.constexpr = False, HAS_SINKS: tl.constexpr = False,
):
    """o, m, l of one query block, looping over the visible key blocks. ``EVEN`` (the launcher's promise: not
    varlen, seqlen_q % BLOCK_M == 0 and seqlen_k % BLOCK_N == 0): every block is whole, so the q / o / m / l
    rows and the K/V steps need no bounds masks and, without a right window, the masked tail [b, hi) (the
    partial last key block) is empty and not compiled. Same arithmetic in the same order: the same bits."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    if REVERSE:
        # Causal: the longest query blocks (most keys) start first, the short ones fill the tail.
        pid_m = n_m_blocks - 1 - pid_m
    pid_b = pid_bh // n_heads
    pid_h = pid_bh % n_heads
    q_start, q_len, k_start, k_len = _sequence(pid_b, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    kv_h = pid_h // GROUP
    q_base = q_ptr + pid_b.to(tl.int64) * sqb + pid_h.to(tl.int64) * sqh + q_start.to(tl.int64) * sqs
    k_base = k_ptr + pid_b.to(tl.int64) * skb + kv_h.to(tl.int64) * skh + k_start.to(tl.int64) * sks
    v_base = v_ptr + pid_b.to(tl.int64) * svb + kv_h.to(tl.int64) * svh + k_start.to(tl.int64) * svs
    mask_base = mask_ptr + pid_b.to(tl.int64) * smb + pid_h.to(tl.int64) * smh

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ok = offs_m < q_len
    q = _load_step(q_base + offs_m[:, None] * sqs + offs_d[None, :], q_ok, offs_d[None, :] < HEAD_DIM,
                   BLOCK_D == HEAD_DIM, True, EVEN)
    q = _prep(q, PRECISION)
    k_ptrs = k_base + offs_n0[:, None] * sks + offs_d[None, :]
    v_ptrs = v_base + offs_n0[:, None] * svs + offs_dv[None, :]
    if USE_TMA:
        # TMA loads (Hopper): needs 16-byte aligned bases and row strides (the launcher checks) and a
        # global scratch allocator for the descriptors (triton.set_allocator).
        rows = tl.maximum(k_len, 1)  # a sequence with no keys loads nothing, but a TMA dim must be >= 1
        k_desc = tl.make_tensor_descriptor(k_base, shape=[rows, HEAD_DIM], strides=[sks, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[rows, HEAD_DIM_V], strides=[svs, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
    else:
        k_desc = k_ptrs
        v_desc = v_ptrs

    if HAS_SINKS:  # the sink is the rows' first score: m = zs2, l = exp2(zs2 - guarded base)
        m_i = tl.zeros([BLOCK_M], tl.float32) + _sink_score(sinks_ptr, pid_h)
        l_i = tl.exp2(m_i - tl.where(m_i == NEG_INF, 0.0, m_i))
    else:
        m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, a, b, hi = _block_ranges(m0, BLOCK_M, BLOCK_N, k_len, window_left, window_right, HAS_WL, HAS_WR)
    # Masked blocks before the fully visible ones (window start), the fully visible ones, then masked
    # blocks after them (causal diagonal, window end, the partial last block: none when EVEN).
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, mask_base, offs_m, offs_n0,
                               offs_d, offs_dv,
                               lo, a, q_len, k_len, sks, svs, smi, smj, window_left, window_right, C1, C2,
                               HEAD_DIM, HEAD_DIM_V, True, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION,
                               BLOCK_D, BLOCK_DV, BLOCK_N, NUM_STAGES, WARP_SPECIALIZE, USE_TMA, EVEN)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, mask_base, offs_m, offs_n0,
                               offs_d, offs_dv,
                               a, b, q_len, k_len, sks, svs, smi, smj, window_left, window_right, C1, C2,
                               HEAD_DIM, HEAD_DIM_V, False, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION,
                               BLOCK_D, BLOCK_DV, BLOCK_N, NUM_STAGES, WARP_SPECIALIZE, USE_TMA, EVEN)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, mask_base, offs_m, offs_n0,
                               offs_d, offs_dv,
                               b, _tail_end(b, hi, HAS_WR, EVEN), q_len, k_len, sks, svs, smi, smj,
                               window_left, window_right, C1, C2,
                               HEAD_DIM, HEAD_DIM_V, True, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION,
                               BLOCK_D, BLOCK_DV, BLOCK_N, NUM_STAGES, WARP_SPECIALIZE, USE_TMA, EVEN)
    # Empty rows (l = 0) give 0, not 0/0.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_base = o_ptr + pid_b.to(tl.int64) * sob + pid_h.to(tl.int64) * soh + q_start.to(tl.int64) * sos
    o_ptrs = o_base + offs_m[:, None] * sos + offs_dv[None, :]
    st = pid_b.to(tl.int64) * stb + pid_h.to(tl.int64) * sth + (q_start + offs_m).to(tl.int64) * sts
    if EVEN:  # every row of the block is in range
        if BLOCK_DV == HEAD_DIM_V:
            tl.store(o_ptrs, cast(out, o_ptr.dtype.element_ty))
        else:
            tl.store(o_ptrs, cast(out, o_ptr.dtype.element_ty), mask=offs_dv[None, :] < HEAD_DIM_V)
        tl.store(m_ptr + st, m_i)
        tl.store(l_ptr + st, l_i)
    else:
        tl.store(o_ptrs, cast(out, o_ptr.dtype.element_ty),
                 mask=q_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
        tl.store(m_ptr + st, m_i, mask=q_ok)
        tl.store(l_ptr + st, l_i, mask=q_ok)


@triton.jit
def _delta_rows(o, do, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """delta = rowsum(dO * O) in fp32, per query row, from the tiles as loaded (before any TF32 rounding).
    A fixed addition order: tl.sum's would follow the memory layout of dO, which is read in place."""
    return row_sum_tree(to_f32(o) * to_f32(do), BLOCK_M, BLOCK_DV)


@triton.jit
def _base_inv_l(m, l):
    """(base, 1 / l) of query rows: empty and out-of-range rows (m = -inf, l = 0) get base 0 and 1 / l = 0,
    so p = 0."""
    base = tl.where(m == NEG_INF, 0.0, m)
    inv_l = tl.where(l == 0.0, 0.0, 1.0 / tl.where(l == 0.0, 1.0, l))
    return base, inv_l


@triton.jit
def _row_stats(m_ptr, l_ptr, delta_ptr, st, ok, MASKED: tl.constexpr = True, EVEN: tl.constexpr = False):
    """(base, 1 / l, delta) of query rows; empty and out-of-range rows get base 0 and 1 / l = 0, so p = 0.
    An unmasked step, or any step of an ``EVEN`` launch, has every row in range (a whole block inside the
    sequence): plain, vectorised loads. (``EVEN`` is only ever tested as ``if EVEN:``, so the kernels also
    compile where a harness passes it as a runtime integer.)"""
    if MASKED:
        if EVEN:
            m = tl.load(m_ptr + st)
            l = tl.load(l_ptr + st)
            delta = tl.load(delta_ptr + st)
        else:
            m = tl.load(m_ptr + st, mask=ok, other=NEG_INF)
            l = tl.load(l_ptr + st, mask=ok, other=0.0)
            delta = tl.load(delta_ptr + st, mask=ok, other=0.0)
    else:
        m = tl.load(m_ptr + st)
        l = tl.load(l_ptr + st)
        delta = tl.load(delta_ptr + st)
    base, inv_l = _base_inv_l(m, l)
    return base, inv_l, delta


@triton.jit
def _load_cols(ptrs, cols_ok, FULL_COLS: tl.constexpr):
    if FULL_COLS:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=cols_ok, other=0.0)
    return x


@triton.jit
def _load_step(ptrs, rows_ok, cols_ok, FULL_COLS: tl.constexpr, MASKED: tl.constexpr, EVEN: tl.constexpr):
    """The looped-over tile of one step. Rows need a mask only in a masked step of a launch that is not
    ``EVEN``; columns only where the head dim is padded to the block (FULL_COLS False)."""
    if MASKED:
        if EVEN:
            x = _load_cols(ptrs, cols_ok, FULL_COLS)
        else:
            x = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok, other=0.0)
    else:
        x = _load_cols(ptrs, cols_ok, FULL_COLS)
    return x


@triton.jit
def _probs(z, base, inv_l):
    # min(., 0): p <= 1 whatever rounding differences the recomputed dot has (contract section 3).
    return tl.exp2(tl.minimum(z - base, 0.0, propagate_nan=tl.PropagateNan.ALL)) * inv_l


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, m_ptr, l_ptr, delta_ptr, st_base, sts,
                mask_ptr,
                offs_n, offs_m0, offs_d, offs_dv, lo, hi, seqlen_q, seqlen_k, sqs, sds, smi, smj,
                window_left, window_right, C1, C2, scale_ds,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                MASKED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
                SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_STAGES: tl.constexpr,
                USE_TMA: tl.constexpr, EVEN: tl.constexpr = False):
    """Transposed orientation: sT = k q^T is (keys x queries). ``EVEN``: whole blocks only (every query row
    and key in bounds): a masked step then masks for the window / causal diagonal alone."""
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=NUM_STAGES):
        offs_m = start_m + offs_m0
        q_ok = offs_m < seqlen_q
        if USE_TMA:
            q = q_desc.load([start_m, 0])
            do = do_desc.load([start_m, 0])
        else:
            q = _load_step(q_ptrs + start_m * sqs, q_ok, offs_d[None, :] < HEAD_DIM, BLOCK_D == HEAD_DIM,
                           MASKED, EVEN)
            do = _load_step(do_ptrs + start_m * sds, q_ok, offs_dv[None, :] < HEAD_DIM_V,
                            BLOCK_DV == HEAD_DIM_V, MASKED, EVEN)
        q = _prep(q, PRECISION)
        sT = _dot(k, tl.trans(q), tl.zeros([k.shape[0], BLOCK_M], tl.float32), PRECISION)
        zT = _scores(sT, C1, C2, SOFTCAP)
        zT = _apply_masks(zT, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, window_left, window_right,
                          mask_ptr, smi, smj, MASKED, MASK_KIND, HAS_WL, HAS_WR, EVEN)
        # 32-bit row offsets from a per-sequence base (the statistics are contiguous: sts == 1), as the rows
        # of q / dO: a 64-bit offset here made the loop counter 64-bit.
        base, inv_l, delta = _row_stats(m_ptr + st_base, l_ptr + st_base, delta_ptr + st_base, offs_m * sts,
                                        q_ok, MASKED, EVEN)
        pT = _probs(zT, base[None, :], inv_l[None, :])
        do = _prep(do, PRECISION)
        dv = _dot(_prep(cast(pT, do.dtype), PRECISION), do, dv, PRECISION)
        dpT = _dot(v, tl.trans(do), tl.zeros([k.shape[0], BLOCK_M], tl.float32), PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dsT = _dsoftcap(dsT, sT, C1, SOFTCAP)
        dk = _dot(_prep(cast(dsT, q.dtype), PRECISION), q, dk, PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=SIZE_ARGS)
def attn_bwd_dkdv_kernel(
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
    """dk, dv of one key block of one kv head: loops over the group's query heads and their query blocks.

    With ``SPLIT > 1`` (GQA with few kv heads) the group's query heads are split over SPLIT programs, each
    writing an fp32 partial to output head ``kv_h * SPLIT + part``; the launcher sums the partials in a
    fixed order (deterministic), so a model with 4 kv heads still fills the GPU."""
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
    # Query i sees key j iff j - right <= i <= j + left: the roles of left and right swap.
    lo, a, b, hi = _block_ranges(n0, BLOCK_N, BLOCK_M, q_len, window_right, window_left, HAS_WR, HAS_WL)
    tail_hi = _tail_end(b, hi, HAS_WL, EVEN)
    # The head loop keeps LICM off, and each query-block range rebuilds its row / key index vectors (and
    # from them the pointer tiles and the masks' per-element indices) from a zero the compiler cannot see
    # through ((pid_h + r) // (n_heads + r): 0, pid_h < n_heads), so they die with the range's loop instead
    # of staying live across the others. Hoisted, they filled the registers of the unmasked loop, and ptxas
    # serialized every wgmma of a causal program holding one head (its warning C7515), a slower backward.
    # Same arithmetic, same order, same bits.
    for g in tl.range(GROUP // SPLIT, disable_licm=True):
        pid_h = kv_h * GROUP + part * (GROUP // SPLIT) + g
        q_base = q_ptr + pid_b.to(tl.int64) * sqb + pid_h.to(tl.int64) * sqh + q_start.to(tl.int64) * sqs
        do_base = do_ptr + pid_b.to(tl.int64) * sdb + pid_h.to(tl.int64) * sdh + q_start.to(tl.int64) * sds
        if USE_TMA:
            rows = tl.maximum(q_len, 1)
            q_desc = tl.make_tensor_descriptor(q_base, shape=[rows, HEAD_DIM], strides=[sqs, 1],
                                               block_shape=[BLOCK_M, BLOCK_D])
            do_desc = tl.make_tensor_descriptor(do_base, shape=[rows, HEAD_DIM_V], strides=[sds, 1],
                                                block_shape=[BLOCK_M, BLOCK_DV])
        st_base = pid_b.to(tl.int64) * stb + pid_h.to(tl.int64) * sth + q_start.to(tl.int64) * sts
        mask_base = mask_ptr + pid_b.to(tl.int64) * smb + pid_h.to(tl.int64) * smh
        for r in tl.static_range(3):
            zero = (pid_h + r) // (n_heads + r)
            offs_m0_r = offs_m0 + zero * BLOCK_M  # times the block: the alignment facts survive
            offs_n_r = offs_n + zero * BLOCK_N
            q_ptrs = q_base + offs_m0_r[:, None] * sqs + offs_d[None, :]
            do_ptrs = do_base + offs_m0_r[:, None] * sds + offs_dv[None, :]
            if not USE_TMA:
                q_desc = q_ptrs
                do_desc = do_ptrs
            if r == 0:  # the masked blocks before the fully visible ones, the visible ones, the masked tail
                r_lo, r_hi = lo, a
            elif r == 1:
                r_lo, r_hi = a, b
            else:
                r_lo, r_hi = b, tail_hi
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, m_ptr, l_ptr, delta_ptr,
                                 st_base, sts, mask_base, offs_n_r, offs_m0_r, offs_d, offs_dv, r_lo, r_hi,
                                 q_len, k_len, sqs, sds, smi, smj, window_left, window_right, C1, C2,
                                 scale_ds, HEAD_DIM, HEAD_DIM_V, r != 1, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP,
                                 PRECISION, BLOCK_M, BLOCK_D, BLOCK_DV, NUM_STAGES, USE_TMA, EVEN)
    dk = dk * scale_ds
    dk_base = dk_ptr + pid_b.to(tl.int64) * sdkb + out_h.to(tl.int64) * sdkh + k_start.to(tl.int64) * sdks
    dv_base = dv_ptr + pid_b.to(tl.int64) * sdvb + out_h.to(tl.int64) * sdvh + k_start.to(tl.int64) * sdvs
    tl.store(dk_base + offs_n[:, None] * sdks + offs_d[None, :], cast(dk, dk_ptr.dtype.element_ty),
             mask=k_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(dv_base + offs_n[:, None] * sdvs + offs_dv[None, :], cast(dv, dv_ptr.dtype.element_ty),
             mask=k_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _dq_inner(dq, q, do, base, inv_l, delta, k_ptrs, v_ptrs, k_desc, v_desc, mask_ptr, offs_m, offs_n0,
              offs_d, offs_dv, lo, hi, seqlen_q, seqlen_k, sks, svs, smi, smj, window_left, window_right,
              C1, C2, scale_ds,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              MASKED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
              SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr,
              EVEN: tl.constexpr = False):
    """Forward orientation: s = q k^T is (queries x keys), as in the forward kernel. ``EVEN``: whole blocks
    only (every key in bounds): a masked step then masks for the window / causal diagonal alone."""
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        offs_n = start_n + offs_n0
        kv_ok = offs_n < seqlen_k
        if USE_TMA:
            k = k_desc.load([start_n, 0])
            v = v_desc.load([start_n, 0])
        else:
            k = _load_step(k_ptrs + start_n * sks, kv_ok, offs_d[None, :] < HEAD_DIM, BLOCK_D == HEAD_DIM,
                           MASKED, EVEN)
            v = _load_step(v_ptrs + start_n * svs, kv_ok, offs_dv[None, :] < HEAD_DIM_V,
                           BLOCK_DV == HEAD_DIM_V, MASKED, EVEN)
        k = _prep(k, PRECISION)
        s = _dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], tl.float32), PRECISION)
        z = _scores(s, C1, C2, SOFTCAP)
        z = _apply_masks(z, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left, window_right,
                         mask_ptr, smi, smj, MASKED, MASK_KIND, HAS_WL, HAS_WR, EVEN)
        # Unnormalised: the row factor 1 / l is applied to the dq accumulator at the end (one row per query).
        e = tl.exp2(tl.minimum(z - base[:, None], 0.0, propagate_nan=tl.PropagateNan.ALL))
        dp = _dot(do, tl.trans(_prep(v, PRECISION)), tl.zeros([q.shape[0], BLOCK_N], tl.float32), PRECISION)
        ds = e * (dp - delta[:, None])
        ds = _dsoftcap(ds, s, C1, SOFTCAP)
        dq = _dot(_prep(cast(ds, k.dtype), PRECISION), k, dq, PRECISION)
    return dq


@triton.jit(do_not_specialize=SIZE_ARGS)
def attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, dq_ptr, m_ptr, l_ptr, delta_ptr, mask_ptr, cu_q_ptr, cu_k_ptr,
    sinks_ptr, dsink_ptr,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, sob, soh, sos, sdqb, sdqh, sdqs,
    stb, sth, sts, smb, smh, smi, smj,
    n_heads, n_bh, seqlen_q, seqlen_k, n_m_blocks, window_left, window_right, C1, C2, scale_ds,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr, PRECISION: tl.constexpr, REVERSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr = False, EVEN: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False, DELTA_ONLY: tl.constexpr = False,
):
    """dq of one query block, looping over the visible key blocks. First it computes delta = rowsum(dO * O) of
    its rows and stores it for the dk/dv kernel, which the launcher runs after this one (every query row
    belongs to exactly one program); with ``HAS_SINKS`` also ``p_sink * delta`` per row, into dsink_ptr
    (the stats' layout), for the sink's gradient. ``EVEN`` (the launcher's promise: not varlen, seqlen_q %
    BLOCK_M == 0 and seqlen_k % BLOCK_N == 0): every block is whole, so the steps need no bounds masks and,
    without a right window, the masked tail [b, hi) is empty and not compiled. ``DELTA_ONLY``: delta (and the
    sinks' per-row terms) alone, for a dq computed by another kernel."""
    pid_m, pid_bh = _backward_program(n_bh)
    if pid_bh < 0:
        return
    if REVERSE:
        pid_m = n_m_blocks - 1 - pid_m
    pid_b = pid_bh // n_heads
    pid_h = pid_bh % n_heads
    q_start, q_len, k_start, k_len = _sequence(pid_b, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    kv_h = pid_h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ok = offs_m < q_len
    q_base = q_ptr + pid_b.to(tl.int64) * sqb + pid_h.to(tl.int64) * sqh + q_start.to(tl.int64) * sqs
    do_base = do_ptr + pid_b.to(tl.int64) * sdb + pid_h.to(tl.int64) * sdh + q_start.to(tl.int64) * sds
    k_base = k_ptr + pid_b.to(tl.int64) * skb + kv_h.to(tl.int64) * skh + k_start.to(tl.int64) * sks
    v_base = v_ptr + pid_b.to(tl.int64) * svb + kv_h.to(tl.int64) * svh + k_start.to(tl.int64) * svs
    mask_base = mask_ptr + pid_b.to(tl.int64) * smb + pid_h.to(tl.int64) * smh
    q = tl.load(q_base + offs_m[:, None] * sqs + offs_d[None, :],
                mask=q_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    do = tl.load(do_base + offs_m[:, None] * sds + offs_dv[None, :],
                 mask=q_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    o_base = o_ptr + pid_b.to(tl.int64) * sob + pid_h.to(tl.int64) * soh + q_start.to(tl.int64) * sos
    o = tl.load(o_base + offs_m[:, None] * sos + offs_dv[None, :],
                mask=q_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    st = pid_b.to(tl.int64) * stb + pid_h.to(tl.int64) * sth + (q_start + offs_m).to(tl.int64) * sts
    delta = _delta_rows(o, do, BLOCK_M, BLOCK_DV)
    tl.store(delta_ptr + st, delta, mask=q_ok)
    q = _prep(q, PRECISION)
    do = _prep(do, PRECISION)
    base, inv_l = _base_inv_l(tl.load(m_ptr + st, mask=q_ok, other=NEG_INF),
                              tl.load(l_ptr + st, mask=q_ok, other=0.0))
    if HAS_SINKS:  # p_sink from the saved stats, as every p; 0 in a row with l = 0 (inv_l = 0)
        p_sink = tl.exp2(_sink_score(sinks_ptr, pid_h) - base) * inv_l
        tl.store(dsink_ptr + st, p_sink * delta, mask=q_ok)
    if DELTA_ONLY:
        return
    k_ptrs = k_base + offs_n0[:, None] * sks + offs_d[None, :]
    v_ptrs = v_base + offs_n0[:, None] * svs + offs_dv[None, :]
    if USE_TMA:
        rows = tl.maximum(k_len, 1)
        k_desc = tl.make_tensor_descriptor(k_base, shape=[rows, HEAD_DIM], strides=[sks, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[rows, HEAD_DIM_V], strides=[svs, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
    else:
        k_desc = k_ptrs
        v_desc = v_ptrs
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, a, b, hi = _block_ranges(m0, BLOCK_M, BLOCK_N, k_len, window_left, window_right, HAS_WL, HAS_WR)
    dq = _dq_inner(dq, q, do, base, inv_l, delta, k_ptrs, v_ptrs, k_desc, v_desc, mask_base, offs_m, offs_n0,
                   offs_d, offs_dv,
                   lo, a, q_len, k_len, sks, svs, smi, smj, window_left, window_right, C1, C2, scale_ds,
                   HEAD_DIM, HEAD_DIM_V, True, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION, BLOCK_N,
                   BLOCK_D, BLOCK_DV, NUM_STAGES, USE_TMA, EVEN)
    dq = _dq_inner(dq, q, do, base, inv_l, delta, k_ptrs, v_ptrs, k_desc, v_desc, mask_base, offs_m, offs_n0,
                   offs_d, offs_dv,
                   a, b, q_len, k_len, sks, svs, smi, smj, window_left, window_right, C1, C2, scale_ds,
                   HEAD_DIM, HEAD_DIM_V, False, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION, BLOCK_N,
                   BLOCK_D, BLOCK_DV, NUM_STAGES, USE_TMA, EVEN)
    dq = _dq_inner(dq, q, do, base, inv_l, delta, k_ptrs, v_ptrs, k_desc, v_desc, mask_base, offs_m, offs_n0,
                   offs_d, offs_dv,
                   b, _tail_end(b, hi, HAS_WR, EVEN), q_len, k_len, sks, svs, smi, smj, window_left,
                   window_right, C1, C2, scale_ds,
                   HEAD_DIM, HEAD_DIM_V, True, MASK_KIND, HAS_WL, HAS_WR, SOFTCAP, PRECISION, BLOCK_N,
                   BLOCK_D, BLOCK_DV, NUM_STAGES, USE_TMA, EVEN)
    dq = dq * (inv_l * scale_ds)[:, None]
    dq_base = dq_ptr + pid_b.to(tl.int64) * sdqb + pid_h.to(tl.int64) * sdqh + q_start.to(tl.int64) * sdqs
    tl.store(dq_base + offs_m[:, None] * sdqs + offs_d[None, :], cast(dq, dq_ptr.dtype.element_ty),
             mask=q_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _split_sum_tile(part_ptr, out_ptr, r0, rows, n_heads, inner, spo, sph, spi, soo, soh, soi,
                    DIM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows r0 .. r0 + BLOCK_R of the flattened (outer, kv head, inner) result: outer / inner are (batch,
    position) dense and (1, token) packed. Partial j of kv head h is head h * SPLIT + j of the partials; they
    are added in order j = 0, 1, ... from +0, then rounded once to the result's dtype."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_r < rows)[:, None] & (offs_d < DIM)[None, :]
    i = offs_r % inner
    t = offs_r // inner
    h = t % n_heads
    o = t // n_heads
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for j in tl.static_range(SPLIT):  # 64-bit offsets: the partials can pass 2**31 elements
        p_rows = o.to(tl.int64) * spo + (h * SPLIT + j).to(tl.int64) * sph + i.to(tl.int64) * spi
        acc = acc + tl.load(part_ptr + p_rows[:, None] + offs_d[None, :], mask=ok, other=0.0)
    o_rows = o.to(tl.int64) * soo + h.to(tl.int64) * soh + i.to(tl.int64) * soi
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], cast(acc, out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["rows", "n_heads", "inner", "n_blocks_k"])
def attn_bwd_split_sum_kernel(
    dkp_ptr, dvp_ptr, dk_ptr, dv_ptr, rows, n_heads, inner, n_blocks_k,
    skpo, skph, skpi, svpo, svph, svpi, sko, skh, ski, svo, svh, svi,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """The GQA split's fp32 dk / dv partials summed per kv head and stored in dk's / dv's dtype and layout,
    one launch for both: programs 0 .. n_blocks_k - 1 take dk, the rest dv."""
    pid = tl.program_id(0)
    if pid < n_blocks_k:
        _split_sum_tile(dkp_ptr, dk_ptr, pid * BLOCK_R, rows, n_heads, inner, skpo, skph, skpi, sko, skh, ski,
                        HEAD_DIM, SPLIT, BLOCK_R, BLOCK_D)
    else:
        _split_sum_tile(dvp_ptr, dv_ptr, (pid - n_blocks_k) * BLOCK_R, rows, n_heads, inner, svpo, svph, svpi,
                        svo, svh, svi, HEAD_DIM_V, SPLIT, BLOCK_R, BLOCK_DV)



# (The strides stay specialized: their divisibility by 16 lets the stores be vectorized along the head dim.)
@triton.jit(do_not_specialize=["rows", "seqlen", "n_heads"])
def attn_bwd_dq_scale_kernel(acc_ptr, dq_ptr, scale, rows, seqlen, n_heads, s_b, s_h, s_s,
                             HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    """dq = scale * acc, rounded once to dq's dtype: the fused Gluon backward's fp32 buffer (``rows`` = B * H
    * S rows of HEAD_DIM, contiguous: each query row's fixed-order sum) into dq, strides ``s_b``, ``s_h``,
    ``s_s`` and 1 along the head dim. One fp32 multiply and one rounding per element: the bits of
    ``dq.copy_(acc.mul_(scale))`` in one pass."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, HEAD_DIM)
    ok = (r < rows)[:, None]
    x = tl.load(acc_ptr + r[:, None] * HEAD_DIM + d[None, :], mask=ok, other=0.0)
    bh = r // seqlen
    dst = dq_ptr + (bh // n_heads) * s_b + (bh % n_heads) * s_h + (r % seqlen) * s_s
    tl.store(dst[:, None] + d[None, :], cast(x * scale, dq_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["n"])
def attn_bwd_row_stats_kernel(m_ptr, l_ptr, base_ptr, rinv_ptr, n, BLOCK: tl.constexpr):
    """The two per-row values a backward step derives from the saved statistics, once per row: base = (m ==
    -inf ? 0 : m) and rinv = (l == 0 ? 0 : 1 / l), with the operations (and so the bits) the Gluon dK / dV
    kernel otherwise repeats at every key block (``GluonBwdConfig.row_stats``). ``n`` values, contiguous."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = r < n
    m = tl.load(m_ptr + r, mask=ok, other=0.0)
    l = tl.load(l_ptr + r, mask=ok, other=1.0)
    tl.store(base_ptr + r, tl.where(m == float("-inf"), 0.0, m), mask=ok)
    tl.store(rinv_ptr + r, tl.where(l == 0.0, 0.0, 1.0 / tl.where(l == 0.0, 1.0, l)), mask=ok)
