"""Triton kernels for cross-entropy over rows of logits, forward and backward (contract section 10).

Only ``@triton.jit`` code lives here; ``safeops.ops.cross_entropy_launch`` picks blocks and grids.

Rows: row ``r`` of the logits starts at ``(r // B2) * s1 + (r % B2) * s2`` and its classes are ``sc`` apart,
so ``(N, C)`` logits (``B2 = 1``) and the ``(N, C, d...)`` form (``B2 = prod(d)``, the class dim strided)
are read in place. Targets, per-row outputs and row stats are contiguous, indexed by ``r``.

Forward, one read of each row: a program walks its rows' classes in blocks of ``BLOCK_N`` and keeps, per
column lane, a running sum of ``exp(z - m)`` under the running row max ``m`` (rescaled by
``exp(m_old - m_new)``, guarded so that ``-inf - -inf`` never happens: contract section 4) and, with label
smoothing, the sum of ``w_c (z_c - z_t)``. The target logit ``z_t`` is one extra load per row; shifting by it
makes a large offset common to the whole row cancel exactly before anything is summed (1e4-scale bf16
logits keep their smoothing term). ``z = fp32(x)`` is the one materialized value per logit (section 1) and
the launcher compiles with ``enable_fp_fusion=False``. The row max ``m`` and sum ``l`` are written apart
(section 3), with the per-row loss; then

    nll = (m - z_t) + log(l),   smooth = W ((m - z_t) + log(l)) - sum_c w_c (z_c - z_t)

(``W = sum_c w_c``, ``C`` without weights), and ``lse = m + log(l)`` only for the z-loss.

Fixed order, whatever the layout (section 6): the per-lane sums are elementwise adds in column-block order,
and the lanes are then added in one fixed tree (``safeops.kernels.reduce.row_sum_tree``), so no sum
depends on how Triton distributes a tile over threads (which follows the memory layout); the row max is
exact in any order. The block width depends on the row length only, so a row's bits do not depend on the
batch, its position or the strides. The ``sum``/``mean`` reductions over rows run in one program with the
same per-lane-then-tree order (no atomics).

Backward, one write of the gradient: ``dz_c = p_c A - B [c == t] - K w_c`` with ``p = exp(z - m) / l``
recomputed from the logits and the saved ``m``, ``l``, and per-row ``A``, ``B``, ``K`` from the incoming
gradient (see ``safeops.reference.cross_entropy_backward``). ``dx`` may be the logits' own buffer: each
element is loaded and then stored by the same program in the same block step.

Ignored rows (target == ignore_index) are never loaded: their loss is 0 and their gradient 0, whatever their
logits hold. A counted target outside ``[0, C)`` gives a NaN loss and a NaN gradient row (no host sync).
"""

import triton
import triton.language as tl

from safeops.kernels.convert import cast, to_f32
from safeops.kernels.reduce import row_sum_tree
from safeops.kernels.softmax import _col_offsets, _safe_max

NEG_INF = tl.constexpr(float("-inf"))
# The row count and the row strides are not specialised by value (their alignment is stated by the launcher,
# ALIGN): a row alone and the same row in a batch run the same compiled kernel. The class stride is (a unit
# stride gives vector loads); that changes how a tile is spread over threads, which no result depends on.
ROW_ARGS = ["n_rows", "B2", "s1", "s2", "d1", "d2"]


@triton.jit
def _row_starts(x_ptr, rows, B2, s1, s2, ROW_DIMS: tl.constexpr, ALIGN: tl.constexpr):
    """Pointers to the first class of each row (64-bit offsets: tensors past 2**31 elements, section 8).
    ALIGN: a multiple (in elements) that every row offset is known to have, for vector loads."""
    if ROW_DIMS == 1:
        offsets = rows.to(tl.int64) * s1
    else:
        r = rows.to(tl.int64)
        offsets = (r // B2) * s1 + (r % B2) * s2
    if ALIGN > 1:
        offsets = tl.multiple_of(offsets, ALIGN)
    return x_ptr + offsets


@triton.jit
def _log_sum(l):
    # Once per row, in fp64 so that it is correctly rounded to fp32 on every Triton version (as softmax).
    return tl.log(l.to(tl.float64)).to(tl.float32)


@triton.jit
def _targets(target_ptr, rows, row_ok, n_cols, ignore_index):
    """(target as int64 with 0 for uncounted rows, counted, counted and in range) per row."""
    t = tl.load(target_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    counted = row_ok & (t != ignore_index)
    good = counted & (t >= 0) & (t < n_cols)
    return tl.where(good, t, 0), counted, good


@triton.jit
def _load_block(starts, cols, n_cols, rows_read, sc, WIDE: tl.constexpr):
    """The raw logits of columns ``cols`` of the rows ``rows_read`` says to read (0 elsewhere)."""
    mask = rows_read[:, None] & (cols < n_cols)[None, :]
    return tl.load(starts[:, None] + _col_offsets(cols, sc, WIDE)[None, :], mask=mask, other=0.0)


@triton.jit(do_not_specialize=ROW_ARGS)
def cross_entropy_fwd_kernel(
    x_ptr, target_ptr, weight_ptr, weight_sum_ptr, row_max_ptr, row_sum_ptr, loss_ptr, zl_ptr,
    n_rows, n_cols, B2, s1, s2, sc,
    ignore_index, n_classes, nll_scale, smooth_scale, z_loss,
    REDUCE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_NLL: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr, ROW_DIMS: tl.constexpr, WIDE: tl.constexpr, XA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """REDUCE 0 ("none"): ``loss_ptr`` gets each row's loss in its dtype. Else ``loss_ptr`` gets the fp32
    cross-entropy part and ``zl_ptr`` the fp32 z-loss part of each row, for the reduce kernel."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    t, counted, good = _targets(target_ptr, rows, row_ok, n_cols, ignore_index)
    starts = _row_starts(x_ptr, rows, B2, s1, s2, ROW_DIMS, XA)
    z_t = to_f32(tl.load(starts + t * sc, mask=good, other=0.0))
    # The shift of the smoothing sum: the target logit when finite (x - x is 0 only for finite x).
    shift = tl.where(z_t - z_t == 0.0, z_t, 0.0)

    lanes = tl.arange(0, BLOCK_N)
    m = tl.full((BLOCK_M,), NEG_INF, tl.float32)
    l_acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    s_acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # Each block's loads are issued one step ahead (registers for two blocks): the next block is in flight
    # while this one is reduced. The same values in the same order: the same bits.
    x_next = _load_block(starts, lanes, n_cols, good, sc, WIDE)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + lanes
        col_ok = cols < n_cols
        valid = good[:, None] & col_ok[None, :]
        x = to_f32(x_next)
        x_next = _load_block(starts, cols + BLOCK_N, n_cols, good, sc, WIDE)
        z = tl.where(valid, x, NEG_INF)
        m_new = tl.maximum(m, tl.max(z, 1))
        m_new_safe = _safe_max(m_new)
        alpha = tl.exp(m - m_new_safe)  # exp(-inf - 0) = 0 for the first block, never exp(-inf - -inf)
        l_acc = l_acc * alpha[:, None] + tl.exp(z - m_new_safe[:, None])
        if HAS_SMOOTHING:
            d = z - shift[:, None]
            if HAS_WEIGHT:
                d = d * tl.load(weight_ptr + cols, mask=col_ok, other=0.0)[None, :]
            s_acc += tl.where(valid, d, 0.0)
        m = m_new

    l = row_sum_tree(l_acc, BLOCK_M, BLOCK_N)
    tl.store(row_max_ptr + rows, m, mask=row_ok)
    tl.store(row_sum_ptr + rows, l, mask=row_ok)
    m_safe = _safe_max(m)
    empty = l == 0.0
    log_l = tl.where(empty, 0.0, _log_sum(l))
    gap = m_safe - z_t
    ce = tl.zeros((BLOCK_M,), tl.float32)
    if HAS_NLL:
        nll = gap + log_l
        if HAS_WEIGHT:
            nll = nll * tl.load(weight_ptr + t, mask=good, other=0.0)
        ce += nll_scale * nll
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            w_sum = tl.load(weight_sum_ptr)
        else:
            w_sum = n_classes
        smooth = w_sum * ((m_safe - shift) + log_l) - row_sum_tree(s_acc, BLOCK_M, BLOCK_N)
        ce += smooth_scale * smooth
    # An empty row (all logits -inf): log-softmax is -inf everywhere (section 4), so its loss is +inf.
    ce = tl.where(empty, float("inf"), ce)
    zl = tl.zeros((BLOCK_M,), tl.float32)
    if HAS_Z:
        lse = tl.where(empty, NEG_INF, m + log_l)
        zl = z_loss * (lse * lse)
    bad = counted & ~good
    ce = tl.where(bad, float("nan"), tl.where(counted, ce, 0.0))
    zl = tl.where(bad, float("nan"), tl.where(counted, zl, 0.0))
    if REDUCE == 0:
        tl.store(loss_ptr + rows, cast(ce + zl, loss_ptr.dtype.element_ty), mask=row_ok)
    else:
        tl.store(loss_ptr + rows, ce, mask=row_ok)
        if HAS_Z:
            tl.store(zl_ptr + rows, zl, mask=row_ok)


@triton.jit(do_not_specialize=["n_rows"])
def cross_entropy_reduce_kernel(
    ce_ptr, zl_ptr, target_ptr, weight_ptr, out_ptr, denom_ptr,
    n_rows, n_cols, ignore_index,
    MEAN: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_Z: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program: the sum (or mean) of the per-row parts, lane by lane in row-block order, then one fixed
    tree over the lanes. Writes the loss in its dtype and ``denom = (sum of w_t, count)`` (fp32)."""
    lanes = tl.arange(0, BLOCK)
    acc_ce = tl.zeros((BLOCK,), tl.float32)
    acc_z = tl.zeros((BLOCK,), tl.float32)
    acc_w = tl.zeros((BLOCK,), tl.float32)
    acc_n = tl.zeros((BLOCK,), tl.int32)
    for r0 in range(0, n_rows, BLOCK):
        rows = r0 + lanes
        row_ok = rows < n_rows
        acc_ce += tl.load(ce_ptr + rows, mask=row_ok, other=0.0)
        if HAS_Z:
            acc_z += tl.load(zl_ptr + rows, mask=row_ok, other=0.0)
        if MEAN:
            t, counted, good = _targets(target_ptr, rows, row_ok, n_cols, ignore_index)
            acc_n += counted.to(tl.int32)
            if HAS_WEIGHT:
                acc_w += tl.load(weight_ptr + t, mask=good, other=0.0)
    ce = row_sum_tree(tl.reshape(acc_ce, (1, BLOCK)), 1, BLOCK)
    zl = row_sum_tree(tl.reshape(acc_z, (1, BLOCK)), 1, BLOCK)
    if MEAN:
        count = tl.sum(tl.reshape(acc_n, (1, BLOCK)), 1).to(tl.float32)  # integer adds: any order is exact
        if HAS_WEIGHT:
            w_sum = row_sum_tree(tl.reshape(acc_w, (1, BLOCK)), 1, BLOCK)
        else:
            w_sum = count
        # A mean over nothing is 0 (contract section 10), never 0 / 0.
        ce = tl.where(w_sum == 0.0, 0.0, tl.math.div_rn(ce, tl.where(w_sum == 0.0, 1.0, w_sum)))
        zl = tl.where(count == 0.0, 0.0, tl.math.div_rn(zl, tl.where(count == 0.0, 1.0, count)))
        one = tl.arange(0, 1)
        tl.store(denom_ptr + one, w_sum)
        tl.store(denom_ptr + 1 + one, count)
    loss = ce
    if HAS_Z:
        loss = ce + zl
    tl.store(out_ptr + tl.arange(0, 1), cast(loss, out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=ROW_ARGS)
def cross_entropy_bwd_kernel(
    grad_ptr, x_ptr, dx_ptr, target_ptr, weight_ptr, weight_sum_ptr, row_max_ptr, row_sum_ptr, denom_ptr,
    n_rows, n_cols, B2, s1, s2, sc, d1, d2, dc,
    ignore_index, n_classes, nll_scale, smooth_scale, z_loss,
    REDUCE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_NLL: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr, ROW_DIMS: tl.constexpr, WIDE: tl.constexpr, XA: tl.constexpr, DA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """REDUCE 0: ``grad_ptr`` holds one incoming gradient per row; 1 (mean) / 2 (sum): one scalar."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    t, counted, good = _targets(target_ptr, rows, row_ok, n_cols, ignore_index)
    m = tl.load(row_max_ptr + rows, mask=row_ok, other=NEG_INF)
    l = tl.load(row_sum_ptr + rows, mask=row_ok, other=0.0)
    if REDUCE == 0:
        g_ce = to_f32(tl.load(grad_ptr + rows, mask=row_ok, other=0.0))
        g_z = g_ce
    else:
        g = to_f32(tl.load(grad_ptr + tl.zeros((BLOCK_M,), tl.int32)))
        if REDUCE == 1:
            w_sum = tl.load(denom_ptr + tl.zeros((BLOCK_M,), tl.int32))
            count = tl.load(denom_ptr + 1 + tl.zeros((BLOCK_M,), tl.int32))
            g_ce = tl.where(w_sum == 0.0, 0.0, tl.math.div_rn(g, tl.where(w_sum == 0.0, 1.0, w_sum)))
            g_z = tl.where(count == 0.0, 0.0, tl.math.div_rn(g, tl.where(count == 0.0, 1.0, count)))
        else:
            g_ce = g
            g_z = g
    # dz_c = p_c a - b [c == t] - k w_c, per row.
    a = tl.zeros((BLOCK_M,), tl.float32)
    b = tl.zeros((BLOCK_M,), tl.float32)
    if HAS_NLL:
        w_t = 1.0
        if HAS_WEIGHT:
            w_t = tl.load(weight_ptr + t, mask=good, other=0.0)
        b = g_ce * (nll_scale * w_t)
        a += b
    k = g_ce * smooth_scale
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            w_sum_all = tl.load(weight_sum_ptr)
        else:
            w_sum_all = n_classes
        a += g_ce * (smooth_scale * w_sum_all)
    if HAS_Z:
        lse = m + tl.where(l == 0.0, 0.0, _log_sum(l))
        a += g_z * ((2.0 * z_loss) * lse)
    m_safe = _safe_max(m)
    inv_l = tl.where(l == 0.0, 0.0, tl.math.div_rn(1.0, tl.where(l == 0.0, 1.0, l)))
    live = good & (l != 0.0)  # ignored rows, and empty rows (section 4), get 0
    bad = counted & ~good

    starts = _row_starts(x_ptr, rows, B2, s1, s2, ROW_DIMS, XA)
    d_starts = _row_starts(dx_ptr, rows, B2, d1, d2, ROW_DIMS, DA)
    lanes = tl.arange(0, BLOCK_N)
    x_next = _load_block(starts, lanes, n_cols, live, sc, WIDE)  # one block ahead, as the forward
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + lanes
        col_ok = cols < n_cols
        valid = live[:, None] & col_ok[None, :]
        x = to_f32(x_next)
        x_next = _load_block(starts, cols + BLOCK_N, n_cols, live, sc, WIDE)
        p = tl.exp(x - m_safe[:, None]) * inv_l[:, None]
        dz = p * a[:, None]
        if HAS_NLL:
            dz = dz - tl.where(cols[None, :] == t[:, None], b[:, None], 0.0)
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                dz = dz - k[:, None] * tl.load(weight_ptr + cols, mask=col_ok, other=0.0)[None, :]
            else:
                dz = dz - k[:, None]
        dz = tl.where(valid, dz, 0.0)
        dz = tl.where(bad[:, None], float("nan"), dz)
        tl.store(d_starts[:, None] + _col_offsets(cols, dc, WIDE)[None, :], cast(dz, dx_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
