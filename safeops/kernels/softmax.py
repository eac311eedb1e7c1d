"""Triton kernels for softmax, log-softmax and logsumexp, forward and backward.

Only ``@triton.jit`` code lives here; ``safeops.ops.softmax_launch`` picks blocks and grids.

Every kernel sees the input as rows: a row index maps to a memory offset through up to three batch
dimensions (sizes ``B0 x B1 x B2``, per-tensor strides), and the reduced dimension has its own stride, so
the kernels can address any layout. The launcher gives them each tensor in one canonical form per row
length (the reduced dim unit-stride, 16-byte-aligned row starts where the length allows), copying the
others: Triton derives the order of every row reduction from the layout a kernel is compiled for, and a
row's bits must not depend on its memory layout (contract section 6; ``softmax_launch.canonical_layout``).

Numerics (docs/contract.md): each logit becomes ONE fp32 value ``z = fp32(x) * scale`` (excluded entries
``-inf``) that feeds both the row max and ``z - m``; the launcher compiles these kernels with
``enable_fp_fusion=False`` so ``x * scale - m`` is never contracted into an fma. The row max ``m`` and the
row sum ``l = sum(exp(z - m))`` are written as separate fp32 values, and the backward recomputes
``p = exp(z - m) / l`` from the input with the same instruction sequence.

logsumexp of a row holding +inf and no NaN is +inf, as torch.logsumexp gives (contract section 5): its
kernels (``LSE``, a constexpr, so the softmax and log-softmax code is untouched) count an entry equal to a
+inf max as ``exp(0) = 1``, the value every other row's max gets, where ``exp(inf - inf)`` would be NaN. Such
a row then has ``l`` = its number of +inf entries and ``m + log(l) = +inf``; a NaN still makes ``l`` NaN. The
backward needs nothing of its own: ``p = exp(z - m) / l`` is NaN at the +inf entries and 0 elsewhere, the
gradient torch gives.

Loaded values become fp32 through ``to_f32`` and results are rounded to their dtype through ``cast``
(``safeops.kernels.convert``): plain casts on the GPU, exact ones for bf16 under Triton's interpreter, whose
own bf16 casts truncate and get subnormals wrong.

Kinds: 0 softmax, 1 log-softmax, 2 logsumexp.
"""

import triton
import triton.language as tl

from safeops.kernels.convert import cast, to_f32

NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
# A load's default L2 eviction policy, as a default argument (a plain str one fails to compile on Triton 3.6).
NO_HINT = tl.constexpr("")
# Nothing that changes with the number of rows is specialised by value (the row count, batch sizes, batch
# strides; their alignment is stated by the launcher instead): a row alone and the same row in a batch then
# run the same compiled kernel, hence the same reduction order (contract section 6).
ROW_STRIDES = [f"s{t}{i}" for t in "gxodm" for i in range(3)] + ["n_rows", "B1", "B2"]


@triton.jit
def _row_offsets(rows, B1, B2, s0, s1, s2, ALIGN: tl.constexpr, ROW_DIMS: tl.constexpr = 3):
    # ROW_DIMS: how many of the three batch dims the launcher's row view uses (the unused ones are the
    # outer ones, of size 1). One dim, the common case of rows that lie one stride apart, needs no
    # division: a row's offset is `row * s2`. The division is a large share of the short-row kernels'
    # instructions, so this is worth a compile of its own; the offsets, and so the tile layout and every
    # result bit, are the same either way (GPU test).
    # Row indices and batch sizes fit 32 bits (the launcher checks), so the division is 32-bit, which is
    # several times cheaper than 64-bit; the offsets are 64-bit: tensors past 2**31 elements must index
    # correctly (contract section 8).
    if ROW_DIMS == 1:
        offsets = rows.to(tl.int64) * s2
    elif ROW_DIMS == 2:
        r = rows.to(tl.int32)
        offsets = (r // B2).to(tl.int64) * s1 + (r % B2).to(tl.int64) * s2
    else:
        r = rows.to(tl.int32)
        i2 = r % B2
        r = r // B2
        i1 = r % B1
        i0 = r // B1
        offsets = i0.to(tl.int64) * s0 + i1.to(tl.int64) * s1 + i2.to(tl.int64) * s2
    # Row strides are not specialised by value (ROW_STRIDES); the launcher states their 16-byte alignment,
    # so the vector width, and with it the order of every row reduction, depends on the row length and
    # the layout, never on how many rows a launch has (contract section 6).
    if ALIGN > 1:
        offsets = tl.multiple_of(offsets, ALIGN)
    return offsets


@triton.jit
def _col_offsets(cols, stride, WIDE: tl.constexpr):
    # 32-bit per-element offsets keep register use low; WIDE when column offsets can pass 2**31.
    if WIDE:
        return cols.to(tl.int64) * stride
    else:
        return cols * stride


@triton.jit
def _tile_ptrs(ptr, rows, cols, B1, B2, s0, s1, s2, sn, WIDE: tl.constexpr, ALIGN: tl.constexpr,
               ROW_DIMS: tl.constexpr):
    """[BLOCK_M, BLOCK_N] pointers: 64-bit row offsets, 32-bit column offsets unless WIDE."""
    row_ptrs = ptr + _row_offsets(rows, B1, B2, s0, s1, s2, ALIGN, ROW_DIMS)
    return row_ptrs[:, None] + _col_offsets(cols, sn, WIDE)[None, :]


@triton.jit
def _scale_of(scale_ptr, scale_value, SCALE_MODE: tl.constexpr):
    if SCALE_MODE == 2:
        scale = to_f32(tl.load(scale_ptr))
    else:
        scale = scale_value
    return scale


@triton.jit
def _materialize(x, keep, scale, SCALE_MODE: tl.constexpr):
    """z, the one materialized value per logit (fp32 x times the scale); excluded entries -inf.

    Every kernel computes z here, so a recomputation is the same instruction sequence (contract
    section 1). A select, not an add: a NaN at a masked position must not reach the row (section 5).
    """
    if SCALE_MODE != 0:
        z = x * scale
    else:
        z = x
    return tl.where(keep, z, NEG_INF)


@triton.jit
def _logits(x_ptrs, mask_ptrs, valid, scale, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr,
            EVICT: tl.constexpr = NO_HINT):
    """Loads x and returns (fp32 x, z). EVICT: the loads' L2 eviction policy (a hint; no result changes)."""
    x_raw = tl.load(x_ptrs, mask=valid, other=0.0, eviction_policy=EVICT)
    mask_raw = valid
    if HAS_MASK:
        mask_raw = tl.load(mask_ptrs, mask=valid, other=0, eviction_policy=EVICT)
    return _logits_of(x_raw, mask_raw, valid, scale, SCALE_MODE, HAS_MASK)


@triton.jit
def _logits_of(x_raw, mask_raw, valid, scale, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr):
    """(fp32 x, z) from loaded x and mask values (`_logits` without the loads)."""
    x = to_f32(x_raw)
    keep = valid
    if HAS_MASK:
        keep = keep & (mask_raw != 0)
    return x, _materialize(x, keep, scale, SCALE_MODE)


@triton.jit
def _safe_max(m):
    # An empty row has m = -inf, and -inf - -inf would be NaN (contract section 4).
    return tl.where(m == NEG_INF, 0.0, m)


@triton.jit
def _exp_shifted(z, m_safe, LSE: tl.constexpr):
    """exp(z - m). LSE (logsumexp): an entry equal to a +inf max gives exp(0) = 1, not exp(inf - inf) = NaN
    (see the module docstring); for every other entry it is exp(z - m) bit for bit."""
    if LSE:
        return tl.exp(tl.where(z == POS_INF, 0.0, z - m_safe))
    else:
        return tl.exp(z - m_safe)


@triton.jit
def _log_sum(l):
    # log of the row sum, once per row, in fp64 so it is correctly rounded to fp32 on every Triton
    # version (fp32 tl.log lowers to an approximate lg2 on some); log_softmax of a dominating logit
    # then comes out within an ulp of its tiny true value.
    return tl.log(l.to(tl.float64)).to(tl.float32)


@triton.jit
def _inv_sum(l):
    # One correctly rounded division per row; an empty row (l = 0) gives probabilities of exactly 0.
    return tl.where(l == 0.0, 0.0, tl.math.div_rn(1.0, l))


@triton.jit
def _probabilities(z, m_safe, inv_l):
    return tl.exp(z - m_safe) * inv_l


@triton.jit
def _combine_partials(ws_max_ptr, ws_sum_ptr, base, n_splits, SPLITS: tl.constexpr,
                      LSE: tl.constexpr = False):
    """Row max and sum from per-split partials, in a fixed order (deterministic, batch-invariant). LSE: see
    `_exp_shifted` (a split whose max is +inf keeps its sum)."""
    idx = tl.arange(0, SPLITS)
    ok = idx < n_splits
    pm = tl.load(ws_max_ptr + base + idx, mask=ok, other=NEG_INF)
    ps = tl.load(ws_sum_ptr + base + idx, mask=ok, other=0.0)
    m = tl.max(pm, 0)
    l = tl.sum(tl.where(ok, ps * _exp_shifted(pm, _safe_max(m), LSE), 0.0), 0)
    return m, l


@triton.jit
def _online_step(m, l, z, LSE: tl.constexpr = False):
    """Folds a block of logits into a running (max, sum) with a guarded rescale (contract section 4).

    LSE: see `_exp_shifted` (a running max already +inf keeps its sum)."""
    m_new = tl.maximum(m, tl.max(z, 0))
    m_new_safe = _safe_max(m_new)
    # exp(-inf - 0) = 0, never exp(-inf - -inf) = NaN.
    l = l * _exp_shifted(m, m_new_safe, LSE) + tl.sum(_exp_shifted(z, m_new_safe, LSE), 0)
    return m_new, l


# ---------------------------------------------------------------------------------------------------
# Short rows: a program holds BLOCK_M whole rows in registers, so the input is read exactly once.
# ---------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=ROW_STRIDES)
def softmax_fwd_rows_kernel(
    x_ptr, out_ptr, mask_ptr, scale_ptr, row_max_ptr, row_sum_ptr,
    n_rows, n_cols, B1, B2,
    sx0, sx1, sx2, sxn,
    so0, so1, so2, son,
    sm0, sm1, sm2, smn,
    scale_value,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, WIDE: tl.constexpr,
    XA: tl.constexpr, OA: tl.constexpr, MA: tl.constexpr, ROW_DIMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STATS: tl.constexpr = True,
):
    """STATS: write the row max and sum (a call that records no backward does not need them; the same
    arithmetic either way)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    valid = row_ok[:, None] & (cols < n_cols)[None, :]
    scale = _scale_of(scale_ptr, scale_value, SCALE_MODE)

    x_ptrs = _tile_ptrs(x_ptr, rows, cols, B1, B2, sx0, sx1, sx2, sxn, WIDE, XA, ROW_DIMS)
    m_ptrs = _tile_ptrs(mask_ptr, rows, cols, B1, B2, sm0, sm1, sm2, smn, WIDE, MA, ROW_DIMS)
    x, z = _logits(x_ptrs, m_ptrs, valid, scale, SCALE_MODE, HAS_MASK)

    m = tl.max(z, 1)
    m_safe = _safe_max(m)
    e = _exp_shifted(z, m_safe[:, None], KIND == 2)
    l = tl.sum(e, 1)
    if STATS:
        tl.store(row_max_ptr + rows, m, mask=row_ok)
        tl.store(row_sum_ptr + rows, l, mask=row_ok)

    if KIND == 2:
        tl.store(out_ptr + rows, cast(m + _log_sum(l), out_ptr.dtype.element_ty), mask=row_ok)
    else:
        o_ptrs = _tile_ptrs(out_ptr, rows, cols, B1, B2, so0, so1, so2, son, WIDE, OA, ROW_DIMS)
        if KIND == 0:
            out = e * _inv_sum(l)[:, None]
        else:
            out = (z - m_safe[:, None]) - _log_sum(l)[:, None]
            out = tl.where(l[:, None] == 0.0, NEG_INF, out)
        tl.store(o_ptrs, cast(out, out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _bwd_rows_tile(
    blk, grad_ptr, x_ptr, dx_ptr, mask_ptr, row_max_ptr, row_sum_ptr, dscale_ptr,
    n_rows, n_cols, B1, B2,
    sg0, sg1, sg2, sgn, sx0, sx1, sx2, sxn, sd0, sd1, sd2, sdn, sm0, sm1, sm2, smn,
    scale,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, NEED_DSCALE: tl.constexpr,
    WIDE: tl.constexpr,
    GA: tl.constexpr, XA: tl.constexpr, DA: tl.constexpr, MA: tl.constexpr, ROW_DIMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The backward of rows ``blk * BLOCK_M ...``: the same instructions whichever program runs them."""
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    valid = row_ok[:, None] & (cols < n_cols)[None, :]

    # Every load is issued before any loaded value is used: a use stalls the in-order issue until its load
    # lands, so loading the gradient after computing p would wait for two memory round trips, not one.
    x_ptrs = _tile_ptrs(x_ptr, rows, cols, B1, B2, sx0, sx1, sx2, sxn, WIDE, XA, ROW_DIMS)
    x_raw = tl.load(x_ptrs, mask=valid, other=0.0)
    if HAS_MASK:
        m_ptrs = _tile_ptrs(mask_ptr, rows, cols, B1, B2, sm0, sm1, sm2, smn, WIDE, MA, ROW_DIMS)
        kept = tl.load(m_ptrs, mask=valid, other=0)
    if KIND == 2:
        g_raw = tl.load(grad_ptr + rows, mask=row_ok, other=0.0)
    else:
        g_ptrs = _tile_ptrs(grad_ptr, rows, cols, B1, B2, sg0, sg1, sg2, sgn, WIDE, GA, ROW_DIMS)
        g_raw = tl.load(g_ptrs, mask=valid, other=0.0)
    m = tl.load(row_max_ptr + rows, mask=row_ok, other=0.0)
    l = tl.load(row_sum_ptr + rows, mask=row_ok, other=0.0)

    x = to_f32(x_raw)
    keep = valid
    if HAS_MASK:
        keep = keep & (kept != 0)
    z = _materialize(x, keep, scale, SCALE_MODE)
    keep = z != NEG_INF
    p = _probabilities(z, _safe_max(m)[:, None], _inv_sum(l)[:, None])

    g = to_f32(g_raw)
    if KIND == 2:
        dz = g[:, None] * p
    else:
        if KIND == 0:
            s = tl.sum(tl.where(keep, g * p, 0.0), 1)
            dz = p * (g - s[:, None])
        else:
            s = tl.sum(tl.where(keep, g, 0.0), 1)
            dz = g - p * s[:, None]
    # Excluded entries influence no output: their gradient is exactly 0 whatever the incoming grad holds.
    dz = tl.where(keep, dz, 0.0)
    if SCALE_MODE != 0:
        dx = dz * scale
    else:
        dx = dz
    d_ptrs = _tile_ptrs(dx_ptr, rows, cols, B1, B2, sd0, sd1, sd2, sdn, WIDE, DA, ROW_DIMS)
    tl.store(d_ptrs, cast(dx, dx_ptr.dtype.element_ty), mask=valid)
    if NEED_DSCALE:
        tl.store(dscale_ptr + rows, tl.sum(tl.where(keep, dz * x, 0.0), 1), mask=row_ok)


@triton.jit(do_not_specialize=ROW_STRIDES)
def softmax_bwd_rows_kernel(
    grad_ptr, x_ptr, dx_ptr, mask_ptr, scale_ptr, row_max_ptr, row_sum_ptr, dscale_ptr,
    n_rows, n_cols, B1, B2,
    sg0, sg1, sg2, sgn,
    sx0, sx1, sx2, sxn,
    sd0, sd1, sd2, sdn,
    sm0, sm1, sm2, smn,
    scale_value,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, NEED_DSCALE: tl.constexpr,
    WIDE: tl.constexpr,
    GA: tl.constexpr, XA: tl.constexpr, DA: tl.constexpr, MA: tl.constexpr, ROW_DIMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr = 0,
):
    """STAGES 0: one tile of BLOCK_M rows per program. STAGES >= 2: a persistent grid, each program looping
    over tiles ``pid, pid + nprog, ...`` with Triton's software pipeline (``num_stages=STAGES``): the next
    tile's loads are copied to shared memory while this one is reduced and stored (with one program per SM
    at 16K columns, nothing else would hide the load latency). A tile is computed the same way whichever
    program takes it, so results do not depend on the grid or the number of rows (contract section 6)."""
    scale = _scale_of(scale_ptr, scale_value, SCALE_MODE)
    if STAGES == 0:
        _bwd_rows_tile(tl.program_id(0), grad_ptr, x_ptr, dx_ptr, mask_ptr, row_max_ptr, row_sum_ptr,
                       dscale_ptr, n_rows, n_cols, B1, B2,
                       sg0, sg1, sg2, sgn, sx0, sx1, sx2, sxn, sd0, sd1, sd2, sdn, sm0, sm1, sm2, smn,
                       scale, KIND, SCALE_MODE, HAS_MASK, NEED_DSCALE, WIDE, GA, XA, DA, MA, ROW_DIMS,
                       BLOCK_M, BLOCK_N)
    else:
        n_blocks = tl.cdiv(n_rows, BLOCK_M)
        for blk in tl.range(tl.program_id(0), n_blocks, tl.num_programs(0), num_stages=STAGES):
            _bwd_rows_tile(blk, grad_ptr, x_ptr, dx_ptr, mask_ptr, row_max_ptr, row_sum_ptr,
                           dscale_ptr, n_rows, n_cols, B1, B2,
                           sg0, sg1, sg2, sgn, sx0, sx1, sx2, sxn, sd0, sd1, sd2, sdn, sm0, sm1, sm2, smn,
                           scale, KIND, SCALE_MODE, HAS_MASK, NEED_DSCALE, WIDE, GA, XA, DA, MA, ROW_DIMS,
                           BLOCK_M, BLOCK_N)


# ---------------------------------------------------------------------------------------------------
# Long rows: a row is split into `n_splits` column ranges of `cols_per_split` columns, one program each.
# Pass 1 writes each range's (max, sum) or gradient partial; pass 2 combines the partials of its row in
# a fixed order and writes its range. The split depends only on the row length, so results do not
# depend on how many rows there are.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _range_base(ptr, row, B1, B2, s0, s1, s2, first_col, sn, ALIGN: tl.constexpr):
    """Pointer to column `first_col` of row `row` (64-bit arithmetic on the scalar part only)."""
    return ptr + _row_offsets(row, B1, B2, s0, s1, s2, ALIGN) + first_col.to(tl.int64) * sn


@triton.jit
def _fwd_range_stats(x_base, m_base, limit, cols_per_split, scale, sxn, smn,
                     SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, WIDE: tl.constexpr,
                     BLOCK_N: tl.constexpr, LSE: tl.constexpr, EVICT: tl.constexpr = NO_HINT):
    """(max, sum) of one column range (``limit`` columns valid), blocks of BLOCK_N folded in order."""
    lanes = tl.arange(0, BLOCK_N)
    m = tl.full((), NEG_INF, tl.float32)
    l = tl.zeros((), tl.float32)
    for c in range(0, cols_per_split, BLOCK_N):
        cols = c + lanes
        x, z = _logits(x_base + _col_offsets(cols, sxn, WIDE), m_base + _col_offsets(cols, smn, WIDE),
                       cols < limit, scale, SCALE_MODE, HAS_MASK, EVICT)
        m, l = _online_step(m, l, z, LSE)
    return m, l


@triton.jit
def _fwd_range_write(x_base, m_base, o_base, limit, cols_per_split, scale, m, l, sxn, smn, son,
                     KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, WIDE: tl.constexpr,
                     BLOCK_N: tl.constexpr, EVICT: tl.constexpr = NO_HINT):
    """Writes one column range of a softmax / log-softmax row from the row's (max, sum)."""
    m_safe = _safe_max(m)
    log_l = _log_sum(l)
    inv_l = _inv_sum(l)
    lanes = tl.arange(0, BLOCK_N)
    for c in range(0, cols_per_split, BLOCK_N):
        cols = c + lanes
        valid = cols < limit
        x, z = _logits(x_base + _col_offsets(cols, sxn, WIDE), m_base + _col_offsets(cols, smn, WIDE),
                       valid, scale, SCALE_MODE, HAS_MASK, EVICT)
        if KIND == 0:
            out = _probabilities(z, m_safe, inv_l)
        else:
            out = tl.where(l == 0.0, NEG_INF, (z - m_safe) - log_l)
        tl.store(o_base + _col_offsets(cols, son, WIDE), cast(out, o_base.dtype.element_ty), mask=valid,
                 eviction_policy=EVICT)


@triton.jit
def _bwd_range_sum(g_base, x_base, m_base, limit, cols_per_split, scale, m_safe, inv_l, sgn, sxn, smn,
                   KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, WIDE: tl.constexpr,
                   BLOCK_N: tl.constexpr, EVICT: tl.constexpr = NO_HINT):
    """One column range's part of the backward's row sum: sum(g * p) (softmax) or sum(g) (log-softmax)."""
    lanes = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for c in range(0, cols_per_split, BLOCK_N):
        cols = c + lanes
        valid = cols < limit
        x, z = _logits(x_base + _col_offsets(cols, sxn, WIDE), m_base + _col_offsets(cols, smn, WIDE),
                       valid, scale, SCALE_MODE, HAS_MASK, EVICT)
        g = to_f32(tl.load(g_base + _col_offsets(cols, sgn, WIDE), mask=valid, other=0.0,
                           eviction_policy=EVICT))
        acc += _bwd_sum_terms(z, g, m_safe, inv_l, KIND)
    return tl.sum(acc, 0)


@triton.jit
def _bwd_sum_terms(z, g, m_safe, inv_l, KIND: tl.constexpr):
    """Each column's term of the backward's row sum: g p (softmax) or g (log-softmax); 0 where excluded."""
    keep = z != NEG_INF
    if KIND == 0:
        return tl.where(keep, g * _probabilities(z, m_safe, inv_l), 0.0)
    else:
        return tl.where(keep, g, 0.0)


@triton.jit
def _bwd_dz(z, g, m_safe, inv_l, s, g_row_value, KIND: tl.constexpr):
    """d/dz of each column from the row sum ``s`` (``g_row_value``: logsumexp's incoming gradient, KIND 2,
    which reads no per-column gradient); 0 where excluded."""
    p = _probabilities(z, m_safe, inv_l)
    if KIND == 2:
        dz = g_row_value * p
    elif KIND == 0:
        dz = p * (g - s)
    else:
        dz = g - p * s
    return tl.where(z != NEG_INF, dz, 0.0)


@triton.jit
def _bwd_range_write(g_base, x_base, d_base, m_base, limit, cols_per_split, scale, m_safe, inv_l, s,
                     g_row_value, sgn, sxn, sdn, smn,
                     KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr,
                     NEED_DSCALE: tl.constexpr, WIDE: tl.constexpr, BLOCK_N: tl.constexpr,
                     EVICT: tl.constexpr = NO_HINT):
    """Writes one column range of dx from the row sum ``s`` (``g_row_value``: logsumexp's incoming gradient);
    returns the range's part of the scale gradient (0 without NEED_DSCALE)."""
    lanes = tl.arange(0, BLOCK_N)
    dscale_acc = tl.zeros((BLOCK_N,), tl.float32)
    for c in range(0, cols_per_split, BLOCK_N):
        cols = c + lanes
        valid = cols < limit
        x, z = _logits(x_base + _col_offsets(cols, sxn, WIDE), m_base + _col_offsets(cols, smn, WIDE),
                       valid, scale, SCALE_MODE, HAS_MASK, EVICT)
        g = g_row_value
        if KIND != 2:
            g = to_f32(tl.load(g_base + _col_offsets(cols, sgn, WIDE), mask=valid, other=0.0,
                               eviction_policy=EVICT))
        dz = _bwd_dz(z, g, m_safe, inv_l, s, g_row_value, KIND)
        tl.store(d_base + _col_offsets(cols, sdn, WIDE), _dx_of(dz, scale, SCALE_MODE, d_base), mask=valid,
                 eviction_policy=EVICT)
        if NEED_DSCALE:
            dscale_acc += tl.where(z != NEG_INF, dz * x, 0.0)
    return tl.sum(dscale_acc, 0)


@triton.jit
def _dx_of(dz, scale, SCALE_MODE: tl.constexpr, d_base):
    """dx = dz * scale (the scale's chain rule), rounded to dx's dtype."""
    if SCALE_MODE != 0:
        dx = dz * scale
    else:
        dx = dz
    return cast(dx, d_base.dtype.element_ty)


@triton.jit(do_not_specialize=ROW_STRIDES)
def softmax_fwd_partial_kernel(
    x_ptr, mask_ptr, scale_ptr, ws_max_ptr, ws_sum_ptr,
    n_cols, B1, B2,
    sx0, sx1, sx2, sxn,
    sm0, sm1, sm2, smn,
    scale_value, n_splits, cols_per_split,
    SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, WIDE: tl.constexpr,
    XA: tl.constexpr, MA: tl.constexpr, BLOCK_N: tl.constexpr, LSE: tl.constexpr = False,
):
    """Each range's (max, sum) partial. LSE for logsumexp (see `_exp_shifted`); softmax and log-softmax
    share the kernel without it."""
    pid = tl.program_id(0)
    row = pid // n_splits
    split = pid % n_splits
    scale = _scale_of(scale_ptr, scale_value, SCALE_MODE)
    first = split * cols_per_split
    m, l = _fwd_range_stats(_range_base(x_ptr, row, B1, B2, sx0, sx1, sx2, first, sxn, XA),
                            _range_base(mask_ptr, row, B1, B2, sm0, sm1, sm2, first, smn, MA),
                            tl.minimum(n_cols - first, cols_per_split), cols_per_split, scale, sxn, smn,
                            SCALE_MODE, HAS_MASK, WIDE, BLOCK_N, LSE)
    tl.store(ws_max_ptr + pid, m)
    tl.store(ws_sum_ptr + pid, l)


@triton.jit(do_not_specialize=ROW_STRIDES)
def softmax_fwd_finish_kernel(
    x_ptr, out_ptr, mask_ptr, scale_ptr, ws_max_ptr, ws_sum_ptr, row_max_ptr, row_sum_ptr,
    n_cols, B1, B2,
    sx0, sx1, sx2, sxn,
    so0, so1, so2, son,
    sm0, sm1, sm2, smn,
    scale_value, n_splits, cols_per_split,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, WIDE: tl.constexpr,
    XA: tl.constexpr, OA: tl.constexpr, MA: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // n_splits
    split = pid % n_splits
    m, l = _combine_partials(ws_max_ptr, ws_sum_ptr, row.to(tl.int64) * n_splits, n_splits, SPLITS, KIND == 2)
    if split == 0:
        tl.store(row_max_ptr + row, m)
        tl.store(row_sum_ptr + row, l)
        if KIND == 2:
            tl.store(out_ptr + row, cast(m + _log_sum(l), out_ptr.dtype.element_ty))
    if KIND != 2:
        first = split * cols_per_split
        _fwd_range_write(_range_base(x_ptr, row, B1, B2, sx0, sx1, sx2, first, sxn, XA),
                         _range_base(mask_ptr, row, B1, B2, sm0, sm1, sm2, first, smn, MA),
                         _range_base(out_ptr, row, B1, B2, so0, so1, so2, first, son, OA),
                         tl.minimum(n_cols - first, cols_per_split), cols_per_split,
                         _scale_of(scale_ptr, scale_value, SCALE_MODE), m, l, sxn, smn, son,
                         KIND, SCALE_MODE, HAS_MASK, WIDE, BLOCK_N)


@triton.jit(do_not_specialize=ROW_STRIDES)
def softmax_bwd_partial_kernel(
    grad_ptr, x_ptr, mask_ptr, scale_ptr, row_max_ptr, row_sum_ptr, ws_ptr,
    n_cols, B1, B2,
    sg0, sg1, sg2, sgn,
    sx0, sx1, sx2, sxn,
    sm0, sm1, sm2, smn,
    scale_value, n_splits, cols_per_split,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, WIDE: tl.constexpr,
    GA: tl.constexpr, XA: tl.constexpr, MA: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // n_splits
    split = pid % n_splits
    first = split * cols_per_split
    part = _bwd_range_sum(_range_base(grad_ptr, row, B1, B2, sg0, sg1, sg2, first, sgn, GA),
                          _range_base(x_ptr, row, B1, B2, sx0, sx1, sx2, first, sxn, XA),
                          _range_base(mask_ptr, row, B1, B2, sm0, sm1, sm2, first, smn, MA),
                          tl.minimum(n_cols - first, cols_per_split), cols_per_split,
                          _scale_of(scale_ptr, scale_value, SCALE_MODE),
                          _safe_max(tl.load(row_max_ptr + row)), _inv_sum(tl.load(row_sum_ptr + row)),
                          sgn, sxn, smn, KIND, SCALE_MODE, HAS_MASK, WIDE, BLOCK_N)
    tl.store(ws_ptr + pid, part)


@triton.jit(do_not_specialize=ROW_STRIDES)
def softmax_bwd_finish_kernel(
    grad_ptr, x_ptr, dx_ptr, mask_ptr, scale_ptr, row_max_ptr, row_sum_ptr, ws_ptr, dscale_ptr,
    n_cols, B1, B2,
    sg0, sg1, sg2, sgn,
    sx0, sx1, sx2, sxn,
    sd0, sd1, sd2, sdn,
    sm0, sm1, sm2, smn,
    scale_value, n_splits, cols_per_split,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, NEED_DSCALE: tl.constexpr,
    WIDE: tl.constexpr,
    GA: tl.constexpr, XA: tl.constexpr, DA: tl.constexpr, MA: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // n_splits
    split = pid % n_splits
    if KIND == 2:
        g_row_value = to_f32(tl.load(grad_ptr + row))
        s = 0.0
    else:
        g_row_value = 0.0
        idx = tl.arange(0, SPLITS)
        s = tl.sum(tl.load(ws_ptr + row.to(tl.int64) * n_splits + idx, mask=idx < n_splits, other=0.0), 0)
    first = split * cols_per_split
    part = _bwd_range_write(_range_base(grad_ptr, row, B1, B2, sg0, sg1, sg2, first, sgn, GA),
                            _range_base(x_ptr, row, B1, B2, sx0, sx1, sx2, first, sxn, XA),
                            _range_base(dx_ptr, row, B1, B2, sd0, sd1, sd2, first, sdn, DA),
                            _range_base(mask_ptr, row, B1, B2, sm0, sm1, sm2, first, smn, MA),
                            tl.minimum(n_cols - first, cols_per_split), cols_per_split,
                            _scale_of(scale_ptr, scale_value, SCALE_MODE),
                            _safe_max(tl.load(row_max_ptr + row)), _inv_sum(tl.load(row_sum_ptr + row)),
                            s, g_row_value, sgn, sxn, sdn, smn,
                            KIND, SCALE_MODE, HAS_MASK, NEED_DSCALE, WIDE, BLOCK_N)
    if NEED_DSCALE:
        tl.store(dscale_ptr + pid, part)


# ---------------------------------------------------------------------------------------------------
# Long rows, looped (backward): one program walks a whole row twice, a block of BLOCK_N columns at a time.
# The first walk reads x and the gradient with an evict-last hint and keeps each block's partial of the row
# sum in a register vector, exactly as the partial kernel writes it with one block per range; the second
# walk reads them again, from L2 (the launcher's grid is small enough to keep every program's row there),
# and writes dx. Each walk issues a block's loads one block ahead, so they are in flight while the block
# before is computed and reduced (the per-block reduction's barriers would otherwise hold every load back).
# A persistent grid (programs take rows pid, pid + nprog, ...); a row is computed the same way whichever
# program takes it. The arithmetic is the two-launch path's with cols_per_split == BLOCK_N at the same
# number of warps, with no workspace and no second launch.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _block_loads(g_base, x_base, m_base, first, limit, sgn, sxn, smn, HAS_MASK: tl.constexpr,
                 WIDE: tl.constexpr, BLOCK_N: tl.constexpr, EVICT: tl.constexpr):
    """The loaded (not yet converted) x, gradient and mask of the block at column ``first`` of a row whose
    bases are given; ``limit`` = the row's columns from ``first`` on (<= 0: nothing is read)."""
    cols = tl.arange(0, BLOCK_N)
    valid = cols < limit
    first = first.to(tl.int64)
    x_raw = tl.load(x_base + first * sxn + _col_offsets(cols, sxn, WIDE), mask=valid, other=0.0,
                    eviction_policy=EVICT)
    g_raw = tl.load(g_base + first * sgn + _col_offsets(cols, sgn, WIDE), mask=valid, other=0.0,
                    eviction_policy=EVICT)
    mask_raw = valid
    if HAS_MASK:
        mask_raw = tl.load(m_base + first * smn + _col_offsets(cols, smn, WIDE), mask=valid, other=0,
                           eviction_policy=EVICT)
    return x_raw, g_raw, mask_raw


@triton.jit(do_not_specialize=ROW_STRIDES)
def softmax_bwd_loop_kernel(
    grad_ptr, x_ptr, dx_ptr, mask_ptr, scale_ptr, row_max_ptr, row_sum_ptr, dscale_ptr,
    n_rows, n_cols, B1, B2,
    sg0, sg1, sg2, sgn,
    sx0, sx1, sx2, sxn,
    sd0, sd1, sd2, sdn,
    sm0, sm1, sm2, smn,
    scale_value, n_splits,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, NEED_DSCALE: tl.constexpr,
    WIDE: tl.constexpr,
    GA: tl.constexpr, XA: tl.constexpr, DA: tl.constexpr, MA: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """KIND 0 softmax, 1 log-softmax. ``dscale_ptr`` gets one scale-gradient part per (row, block), where the
    finish kernel writes them."""
    scale = _scale_of(scale_ptr, scale_value, SCALE_MODE)
    idx = tl.arange(0, SPLITS)
    cols = tl.arange(0, BLOCK_N)
    zero = tl.zeros((), tl.int32)
    row = tl.program_id(0)
    while row < n_rows:  # a loop variable that stays a tensor under the interpreter too
        m_safe = _safe_max(tl.load(row_max_ptr + row))
        inv_l = _inv_sum(tl.load(row_sum_ptr + row))
        g_base = _range_base(grad_ptr, row, B1, B2, sg0, sg1, sg2, zero, sgn, GA)
        x_base = _range_base(x_ptr, row, B1, B2, sx0, sx1, sx2, zero, sxn, XA)
        m_base = _range_base(mask_ptr, row, B1, B2, sm0, sm1, sm2, zero, smn, MA)
        d_base = _range_base(dx_ptr, row, B1, B2, sd0, sd1, sd2, zero, sdn, DA)
        # First walk: the row sum's per-block partials (`_bwd_range_sum` with one block per range).
        x_raw, g_raw, mask_raw = _block_loads(g_base, x_base, m_base, zero, n_cols, sgn, sxn, smn, HAS_MASK,
                                              WIDE, BLOCK_N, "evict_last")
        parts = tl.zeros((SPLITS,), tl.float32)
        for split in range(0, n_splits):
            first = split * BLOCK_N
            ahead = _block_loads(g_base, x_base, m_base, first + BLOCK_N, n_cols - first - BLOCK_N, sgn, sxn,
                                 smn, HAS_MASK, WIDE, BLOCK_N, "evict_last")
            x, z = _logits_of(x_raw, mask_raw, cols < n_cols - first, scale, SCALE_MODE, HAS_MASK)
            acc = tl.zeros((BLOCK_N,), tl.float32)
            acc += _bwd_sum_terms(z, to_f32(g_raw), m_safe, inv_l, KIND)
            parts = tl.where(idx == split, tl.sum(acc, 0), parts)
            x_raw, g_raw, mask_raw = ahead
        s = tl.sum(parts, 0)
        # Second walk: dx (`_bwd_range_write` with one block per range).
        x_raw, g_raw, mask_raw = _block_loads(g_base, x_base, m_base, zero, n_cols, sgn, sxn, smn, HAS_MASK,
                                              WIDE, BLOCK_N, "evict_first")
        for split in range(0, n_splits):
            first = split * BLOCK_N
            ahead = _block_loads(g_base, x_base, m_base, first + BLOCK_N, n_cols - first - BLOCK_N, sgn, sxn,
                                 smn, HAS_MASK, WIDE, BLOCK_N, "evict_first")
            valid = cols < n_cols - first
            x, z = _logits_of(x_raw, mask_raw, valid, scale, SCALE_MODE, HAS_MASK)
            dz = _bwd_dz(z, to_f32(g_raw), m_safe, inv_l, s, 0.0, KIND)
            d_ptrs = d_base + first.to(tl.int64) * sdn + _col_offsets(cols, sdn, WIDE)
            tl.store(d_ptrs, _dx_of(dz, scale, SCALE_MODE, d_base), mask=valid, eviction_policy="evict_first")
            if NEED_DSCALE:
                dscale_acc = tl.zeros((BLOCK_N,), tl.float32)
                dscale_acc += tl.where(z != NEG_INF, dz * x, 0.0)
                tl.store(dscale_ptr + row.to(tl.int64) * n_splits + split, tl.sum(dscale_acc, 0))
            x_raw, g_raw, mask_raw = ahead
        row += tl.num_programs(0)
