"""Triton kernels for softmax, log-softmax and logsumexp, forward and backward.

Only ``@triton.jit`` code lives here; ``safeops.ops.softmax_launch`` picks blocks and grids.

Every kernel sees the input as rows: a row index maps to a memory offset through up to three batch
dimensions (sizes ``B0 x B1 x B2``, per-tensor strides), and the reduced dimension has its own stride, so
transposed, sliced and broadcast (stride 0) tensors are read in place.

Numerics (CONTRACT.md): each logit becomes ONE fp32 value ``z = fp32(x) * scale`` (excluded entries
``-inf``) that feeds both the row max and ``z - m``; the launcher compiles these kernels with
``enable_fp_fusion=False`` so ``x * scale - m`` is never contracted into an fma. The row max ``m`` and the
row sum ``l = sum(exp(z - m))`` are written as separate fp32 values, and the backward recomputes
``p = exp(z - m) / l`` from the input with the same instruction sequence.

Kinds: 0 softmax, 1 log-softmax, 2 logsumexp.
"""

import triton
import triton.language as tl

NEG_INF: tl.constexpr = float("-inf")


@triton.jit
def _row_offsets(rows, B1, B2, s0, s1, s2):
    # 64-bit offsets: tensors past 2**31 elements must index correctly (contract section 8).
    r = rows.to(tl.int64)
    i2 = r % B2
    r = r // B2
    i1 = r % B1
    i0 = r // B1
    return i0 * s0 + i1 * s1 + i2 * s2


@triton.jit
def _scale_of(scale_ptr, scale_value, SCALE_MODE: tl.constexpr):
    if SCALE_MODE == 2:
        scale = tl.load(scale_ptr).to(tl.float32)
    else:
        scale = scale_value
    return scale


@triton.jit
def _logits(x_ptr, x_offs, mask_ptr, m_offs, valid, scale, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr):
    """Loads x and returns (fp32 x, z). z is the one materialized value per logit; excluded entries -inf."""
    x = tl.load(x_ptr + x_offs, mask=valid, other=0.0).to(tl.float32)
    if SCALE_MODE != 0:
        z = x * scale
    else:
        z = x
    keep = valid
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + m_offs, mask=valid, other=0) != 0)
    # A select, not an add: a NaN at a masked position must not reach the row (contract section 5).
    z = tl.where(keep, z, NEG_INF)
    return x, z


@triton.jit
def _safe_max(m):
    # An empty row has m = -inf, and -inf - -inf would be NaN (contract section 4).
    return tl.where(m == NEG_INF, 0.0, m)


@triton.jit
def _probabilities(z, m_safe, l):
    p = tl.math.div_rn(tl.exp(z - m_safe), l)
    return tl.where(l == 0.0, 0.0, p)


@triton.jit
def _combine_partials(ws_max_ptr, ws_sum_ptr, base, n_splits, SPLITS: tl.constexpr):
    """Row max and sum from per-split partials, in a fixed order (deterministic, batch-invariant)."""
    idx = tl.arange(0, SPLITS)
    ok = idx < n_splits
    pm = tl.load(ws_max_ptr + base + idx, mask=ok, other=NEG_INF)
    ps = tl.load(ws_sum_ptr + base + idx, mask=ok, other=0.0)
    m = tl.max(pm, 0)
    l = tl.sum(tl.where(ok, ps * tl.exp(pm - _safe_max(m)), 0.0), 0)
    return m, l


# ---------------------------------------------------------------------------------------------------
# Short rows: a program holds BLOCK_M whole rows in registers, so the input is read exactly once.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def softmax_fwd_rows_kernel(
    x_ptr, out_ptr, mask_ptr, scale_ptr, row_max_ptr, row_sum_ptr,
    n_rows, n_cols, B1, B2,
    sx0, sx1, sx2, sxn,
    so0, so1, so2, son,
    sm0, sm1, sm2, smn,
    scale_value,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    row_ok = rows < n_rows
    valid = row_ok[:, None] & (cols < n_cols)[None, :]
    scale = _scale_of(scale_ptr, scale_value, SCALE_MODE)

    x_offs = _row_offsets(rows, B1, B2, sx0, sx1, sx2)[:, None] + cols[None, :] * sxn
    m_offs = _row_offsets(rows, B1, B2, sm0, sm1, sm2)[:, None] + cols[None, :] * smn
    x, z = _logits(x_ptr, x_offs, mask_ptr, m_offs, valid, scale, SCALE_MODE, HAS_MASK)

    m = tl.max(z, 1)
    m_safe = _safe_max(m)
    e = tl.exp(z - m_safe[:, None])
    l = tl.sum(e, 1)
    tl.store(row_max_ptr + rows, m, mask=row_ok)
    tl.store(row_sum_ptr + rows, l, mask=row_ok)

    if KIND == 2:
        tl.store(out_ptr + rows, (m + tl.log(l)).to(out_ptr.dtype.element_ty), mask=row_ok)
    else:
        o_offs = _row_offsets(rows, B1, B2, so0, so1, so2)[:, None] + cols[None, :] * son
        if KIND == 0:
            out = tl.where(l[:, None] == 0.0, 0.0, tl.math.div_rn(e, l[:, None]))
        else:
            out = (z - m_safe[:, None]) - tl.log(l)[:, None]
            out = tl.where(l[:, None] == 0.0, NEG_INF, out)
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def softmax_bwd_rows_kernel(
    grad_ptr, x_ptr, dx_ptr, mask_ptr, scale_ptr, row_max_ptr, row_sum_ptr, dscale_ptr,
    n_rows, n_cols, B1, B2,
    sg0, sg1, sg2, sgn,
    sx0, sx1, sx2, sxn,
    sd0, sd1, sd2, sdn,
    sm0, sm1, sm2, smn,
    scale_value,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, NEED_DSCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    row_ok = rows < n_rows
    valid = row_ok[:, None] & (cols < n_cols)[None, :]
    scale = _scale_of(scale_ptr, scale_value, SCALE_MODE)

    x_offs = _row_offsets(rows, B1, B2, sx0, sx1, sx2)[:, None] + cols[None, :] * sxn
    m_offs = _row_offsets(rows, B1, B2, sm0, sm1, sm2)[:, None] + cols[None, :] * smn
    x, z = _logits(x_ptr, x_offs, mask_ptr, m_offs, valid, scale, SCALE_MODE, HAS_MASK)
    keep = z != NEG_INF

    m = tl.load(row_max_ptr + rows, mask=row_ok, other=0.0)
    l = tl.load(row_sum_ptr + rows, mask=row_ok, other=0.0)
    p = _probabilities(z, _safe_max(m)[:, None], l[:, None])

    if KIND == 2:
        g = tl.load(grad_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        dz = g[:, None] * p
    else:
        g_offs = _row_offsets(rows, B1, B2, sg0, sg1, sg2)[:, None] + cols[None, :] * sgn
        g = tl.load(grad_ptr + g_offs, mask=valid, other=0.0).to(tl.float32)
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
    d_offs = _row_offsets(rows, B1, B2, sd0, sd1, sd2)[:, None] + cols[None, :] * sdn
    tl.store(dx_ptr + d_offs, dx.to(dx_ptr.dtype.element_ty), mask=valid)
    if NEED_DSCALE:
        tl.store(dscale_ptr + rows, tl.sum(tl.where(keep, dz * x, 0.0), 1), mask=row_ok)


# ---------------------------------------------------------------------------------------------------
# Long rows: a row is split into `n_splits` column ranges of `cols_per_split` columns, one program each.
# Pass 1 writes each range's (max, sum) or gradient partial; pass 2 combines the partials of its row in
# a fixed order and writes its range. The split depends only on the row length, so results do not
# depend on how many rows there are.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def softmax_fwd_partial_kernel(
    x_ptr, mask_ptr, scale_ptr, ws_max_ptr, ws_sum_ptr,
    n_cols, B1, B2,
    sx0, sx1, sx2, sxn,
    sm0, sm1, sm2, smn,
    scale_value, n_splits, cols_per_split,
    SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // n_splits
    split = pid % n_splits
    scale = _scale_of(scale_ptr, scale_value, SCALE_MODE)
    x_row = _row_offsets(row, B1, B2, sx0, sx1, sx2)
    m_row = _row_offsets(row, B1, B2, sm0, sm1, sm2)
    start = split.to(tl.int64) * cols_per_split
    lanes = tl.arange(0, BLOCK_N)

    m = tl.full((), NEG_INF, tl.float32)
    l = tl.zeros((), tl.float32)
    for c in range(0, cols_per_split, BLOCK_N):
        cols = start + c + lanes
        valid = (cols < n_cols) & (c + lanes < cols_per_split)
        x, z = _logits(x_ptr, x_row + cols * sxn, mask_ptr, m_row + cols * smn, valid, scale,
                       SCALE_MODE, HAS_MASK)
        m_new = tl.maximum(m, tl.max(z, 0))
        m_new_safe = _safe_max(m_new)
        # Guarded rescale: exp(-inf - 0) = 0, never exp(-inf - -inf) = NaN (contract section 4).
        l = l * tl.exp(m - m_new_safe) + tl.sum(tl.exp(z - m_new_safe), 0)
        m = m_new
    tl.store(ws_max_ptr + pid, m)
    tl.store(ws_sum_ptr + pid, l)


@triton.jit
def softmax_fwd_finish_kernel(
    x_ptr, out_ptr, mask_ptr, scale_ptr, ws_max_ptr, ws_sum_ptr, row_max_ptr, row_sum_ptr,
    n_cols, B1, B2,
    sx0, sx1, sx2, sxn,
    so0, so1, so2, son,
    sm0, sm1, sm2, smn,
    scale_value, n_splits, cols_per_split,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // n_splits
    split = pid % n_splits
    m, l = _combine_partials(ws_max_ptr, ws_sum_ptr, row.to(tl.int64) * n_splits, n_splits, SPLITS)
    if split == 0:
        tl.store(row_max_ptr + row, m)
        tl.store(row_sum_ptr + row, l)
        if KIND == 2:
            tl.store(out_ptr + row, (m + tl.log(l)).to(out_ptr.dtype.element_ty))
    if KIND != 2:
        scale = _scale_of(scale_ptr, scale_value, SCALE_MODE)
        m_safe = _safe_max(m)
        log_l = tl.log(l)
        x_row = _row_offsets(row, B1, B2, sx0, sx1, sx2)
        m_row = _row_offsets(row, B1, B2, sm0, sm1, sm2)
        o_row = _row_offsets(row, B1, B2, so0, so1, so2)
        start = split.to(tl.int64) * cols_per_split
        lanes = tl.arange(0, BLOCK_N)
        for c in range(0, cols_per_split, BLOCK_N):
            cols = start + c + lanes
            valid = (cols < n_cols) & (c + lanes < cols_per_split)
            x, z = _logits(x_ptr, x_row + cols * sxn, mask_ptr, m_row + cols * smn, valid, scale,
                           SCALE_MODE, HAS_MASK)
            if KIND == 0:
                out = _probabilities(z, m_safe, l)
            else:
                out = tl.where(l == 0.0, NEG_INF, (z - m_safe) - log_l)
            tl.store(out_ptr + o_row + cols * son, out.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def softmax_bwd_partial_kernel(
    grad_ptr, x_ptr, mask_ptr, scale_ptr, row_max_ptr, row_sum_ptr, ws_ptr,
    n_cols, B1, B2,
    sg0, sg1, sg2, sgn,
    sx0, sx1, sx2, sxn,
    sm0, sm1, sm2, smn,
    scale_value, n_splits, cols_per_split,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // n_splits
    split = pid % n_splits
    scale = _scale_of(scale_ptr, scale_value, SCALE_MODE)
    m_safe = _safe_max(tl.load(row_max_ptr + row))
    l = tl.load(row_sum_ptr + row)
    g_row = _row_offsets(row, B1, B2, sg0, sg1, sg2)
    x_row = _row_offsets(row, B1, B2, sx0, sx1, sx2)
    m_row = _row_offsets(row, B1, B2, sm0, sm1, sm2)
    start = split.to(tl.int64) * cols_per_split
    lanes = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for c in range(0, cols_per_split, BLOCK_N):
        cols = start + c + lanes
        valid = (cols < n_cols) & (c + lanes < cols_per_split)
        x, z = _logits(x_ptr, x_row + cols * sxn, mask_ptr, m_row + cols * smn, valid, scale,
                       SCALE_MODE, HAS_MASK)
        keep = z != NEG_INF
        g = tl.load(grad_ptr + g_row + cols * sgn, mask=valid, other=0.0).to(tl.float32)
        if KIND == 0:
            acc += tl.where(keep, g * _probabilities(z, m_safe, l), 0.0)
        else:
            acc += tl.where(keep, g, 0.0)
    tl.store(ws_ptr + pid, tl.sum(acc, 0))


@triton.jit
def softmax_bwd_finish_kernel(
    grad_ptr, x_ptr, dx_ptr, mask_ptr, scale_ptr, row_max_ptr, row_sum_ptr, ws_ptr, dscale_ptr,
    n_cols, B1, B2,
    sg0, sg1, sg2, sgn,
    sx0, sx1, sx2, sxn,
    sd0, sd1, sd2, sdn,
    sm0, sm1, sm2, smn,
    scale_value, n_splits, cols_per_split,
    KIND: tl.constexpr, SCALE_MODE: tl.constexpr, HAS_MASK: tl.constexpr, NEED_DSCALE: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // n_splits
    split = pid % n_splits
    scale = _scale_of(scale_ptr, scale_value, SCALE_MODE)
    m_safe = _safe_max(tl.load(row_max_ptr + row))
    l = tl.load(row_sum_ptr + row)
    if KIND == 2:
        g_row_value = tl.load(grad_ptr + row).to(tl.float32)
        s = 0.0
    else:
        idx = tl.arange(0, SPLITS)
        s = tl.sum(tl.load(ws_ptr + row.to(tl.int64) * n_splits + idx, mask=idx < n_splits, other=0.0), 0)
    g_row = _row_offsets(row, B1, B2, sg0, sg1, sg2)
    x_row = _row_offsets(row, B1, B2, sx0, sx1, sx2)
    d_row = _row_offsets(row, B1, B2, sd0, sd1, sd2)
    m_row = _row_offsets(row, B1, B2, sm0, sm1, sm2)
    start = split.to(tl.int64) * cols_per_split
    lanes = tl.arange(0, BLOCK_N)
    dscale_acc = tl.zeros((BLOCK_N,), tl.float32)
    for c in range(0, cols_per_split, BLOCK_N):
        cols = start + c + lanes
        valid = (cols < n_cols) & (c + lanes < cols_per_split)
        x, z = _logits(x_ptr, x_row + cols * sxn, mask_ptr, m_row + cols * smn, valid, scale,
                       SCALE_MODE, HAS_MASK)
        keep = z != NEG_INF
        p = _probabilities(z, m_safe, l)
        if KIND == 2:
            dz = g_row_value * p
        else:
            g = tl.load(grad_ptr + g_row + cols * sgn, mask=valid, other=0.0).to(tl.float32)
            if KIND == 0:
                dz = p * (g - s)
            else:
                dz = g - p * s
        dz = tl.where(keep, dz, 0.0)
        if SCALE_MODE != 0:
            dx = dz * scale
        else:
            dx = dz
        tl.store(dx_ptr + d_row + cols * sdn, dx.to(dx_ptr.dtype.element_ty), mask=valid)
        if NEED_DSCALE:
            dscale_acc += tl.where(keep, dz * x, 0.0)
    if NEED_DSCALE:
        tl.store(dscale_ptr + pid, tl.sum(dscale_acc, 0))
