"""Triton kernels merging partial attention results over disjoint key sets, forward and backward.

Only ``@triton.jit`` code lives here; ``safeops.ops.merge_launch`` picks blocks and grids.

Partials are stacked: outputs ``(P, R, D)`` and natural-log logsumexps ``(P, R)`` (any strides), one row
per query. For a row with ``M = max_i lse_i``:

    w_i = exp(lse_i - M)          (0 for a partial with lse_i = -inf: selected away, never multiplied)
    s   = sum_i w_i,   lse = M + log(s),   out = sum_i w_i out_i / s

all in fp32. Subtracting ``M`` first keeps ``exp`` finite for lses of any size (1e11 included); a row
where every partial is empty (``M = -inf``) uses 0 in place of ``M``, so ``-inf - (-inf)`` never happens,
and gives out 0, lse -inf (contract section 4). The backward, with ``a_i = w_i / s`` (the softmax weights
of the lses) and ``g``/``g_lse`` the incoming gradients:

    d out_i = a_i g,     d lse_i = a_i (g_lse + g . out_i - g . out)

where ``g . out = sum_j a_j (g . out_j)`` is the fp32 output, recomputed here, not the rounded one.
Attention sinks (``HAS_SINKS``, contract section 9) merge as one more partial with output 0 and lse
``sink`` (a natural-log logit per row, counted once): it enters ``M`` and ``s`` (first, before the
partials), not the output sum, and gets ``d sink = a_sink (g_lse - g . out)``, stored per row (the launcher
sums the rows of each head). Without sinks the sink pointers are None and the branches are not compiled.

Rows are independent and the loop order over partials and head-dim tiles is fixed, so a row's bits do not
depend on how many rows a launch has (contract section 6). Outputs and gradients become fp32 through
``to_f32`` and are rounded back through ``cast`` (``safeops.kernels.convert``: exact under Triton's
interpreter too).

Offsets (contract section 8): row offsets are 64-bit and partials are reached by bumping 64-bit pointers;
head-dim offsets ``col * stride`` are 32-bit unless ``WIDE``, which the launcher sets when ``(D - 1) *
stride`` reaches 2**31 for a head-dim stride (a view whose head dim is outermost in memory, say). ``WIDE``
changes only the addressing, never the arithmetic, so both variants give the same bits.
"""

import triton
import triton.language as tl

from safeops.kernels.convert import cast, to_f32
from safeops.kernels.reduce import row_sum_tree

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _cols(d0, BLOCK_D: tl.constexpr, WIDE: tl.constexpr):
    """The head-dim indices of the tile at ``d0``: 64-bit when WIDE, so ``cols * stride`` cannot wrap."""
    cols = d0 + tl.arange(0, BLOCK_D)
    if WIDE:
        return cols.to(tl.int64)
    else:
        return cols


@triton.jit
def _row_scale(lse_ptr, rows, row_ok, P, s_lp, s_lr, sink_ptr, HAS_SINKS: tl.constexpr):
    """(M, M with -inf replaced by 0, s) of each row: the max lse and the sum of exp(lse_i - M), the sink's
    term included (first) with ``HAS_SINKS``."""
    # Partials are reached by bumping 64-bit pointers, never by p * stride, which could pass 2**31 for a
    # large stack in 32-bit arithmetic (contract section 8).
    m = tl.full(rows.shape, NEG_INF, tl.float32)
    if HAS_SINKS:
        m = tl.load(sink_ptr + rows, mask=row_ok, other=NEG_INF)
    lse_p = lse_ptr + rows * s_lr
    for _ in range(P):
        m = tl.maximum(m, tl.load(lse_p, mask=row_ok, other=NEG_INF))
        lse_p += s_lp
    m_safe = tl.where(m == NEG_INF, 0.0, m)
    s = tl.zeros(rows.shape, tl.float32)
    if HAS_SINKS:
        sink = tl.load(sink_ptr + rows, mask=row_ok, other=NEG_INF)
        s += tl.where(sink == NEG_INF, 0.0, tl.exp(sink - m_safe))
    lse_p = lse_ptr + rows * s_lr
    for _ in range(P):
        lse = tl.load(lse_p, mask=row_ok, other=NEG_INF)
        s += tl.where(lse == NEG_INF, 0.0, tl.exp(lse - m_safe))
        lse_p += s_lp
    return m, m_safe, s


@triton.jit
def merge_fwd_kernel(
    o_ptr, lse_ptr, out_ptr, lse_out_ptr, sink_ptr,
    P, R, D,
    s_op, s_or, s_od, s_lp, s_lr, s_outr, s_outd,
    WIDE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr = False,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    m, m_safe, s = _row_scale(lse_ptr, rows, row_ok, P, s_lp, s_lr, sink_ptr, HAS_SINKS)
    empty = s == 0.0
    inv_s = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, s))
    for d0 in range(0, D, BLOCK_D):
        cols = _cols(d0, BLOCK_D, WIDE)
        tile_ok = row_ok[:, None] & (cols < D)[None, :]
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        lse_p = lse_ptr + rows * s_lr
        o_p = o_ptr + rows[:, None] * s_or + cols[None, :] * s_od
        for _ in range(P):
            lse = tl.load(lse_p, mask=row_ok, other=NEG_INF)
            o = to_f32(tl.load(o_p, mask=tile_ok, other=0.0))
            w = tl.where(lse == NEG_INF, 0.0, tl.exp(lse - m_safe))
            # An empty partial contributes exactly nothing, whatever its output holds.
            acc += tl.where((lse == NEG_INF)[:, None], 0.0, w[:, None] * o)
            lse_p += s_lp
            o_p += s_op
        out = acc * inv_s[:, None]
        tl.store(out_ptr + rows[:, None] * s_outr + cols[None, :] * s_outd,
                 cast(out, out_ptr.dtype.element_ty), mask=tile_ok)
    # log in fp64, as the softmax kernels do: libdevice's fp32 logf is a polynomial written with fp32 fmas
    # (and Triton versions lower fp32 log differently); the fp64 one is accurate and the same everywhere.
    log_s = tl.log(tl.where(empty, 1.0, s).to(tl.float64)).to(tl.float32)
    lse_out = tl.where(empty, NEG_INF, m + log_s)
    tl.store(lse_out_ptr + rows, lse_out, mask=row_ok)


@triton.jit
def merge_bwd_kernel(
    o_ptr, lse_ptr, g_ptr, glse_ptr, go_ptr, gl_ptr, sink_ptr, gsink_ptr,
    P, R, D,
    s_op, s_or, s_od, s_lp, s_lr, s_gr, s_gd, s_glr, s_gop, s_gor, s_god,
    HAS_GLSE: tl.constexpr, WIDE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    m, m_safe, s = _row_scale(lse_ptr, rows, row_ok, P, s_lp, s_lr, sink_ptr, HAS_SINKS)
    empty = s == 0.0
    inv_s = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, s))
    g_dot_out = tl.zeros((BLOCK_R,), tl.float32)
    # First pass: d out_i, and g . out_i parked in the lse gradient (gl_ptr is a contiguous (P, R) fp32).
    lse_p = lse_ptr + rows * s_lr
    gl_p = gl_ptr + rows
    o_base = o_ptr
    go_base = go_ptr
    for _ in range(P):
        lse = tl.load(lse_p, mask=row_ok, other=NEG_INF)
        excluded = lse == NEG_INF
        a = tl.where(excluded, 0.0, tl.exp(lse - m_safe) * inv_s)
        dot = tl.zeros((BLOCK_R,), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = _cols(d0, BLOCK_D, WIDE)
            tile_ok = row_ok[:, None] & (cols < D)[None, :]
            g = to_f32(tl.load(g_ptr + rows[:, None] * s_gr + cols[None, :] * s_gd, mask=tile_ok, other=0.0))
            o = to_f32(tl.load(o_base + rows[:, None] * s_or + cols[None, :] * s_od, mask=tile_ok, other=0.0))
            # A fixed addition order: tl.sum's would follow the layout of o and g (contract section 6).
            dot += row_sum_tree(g * o, BLOCK_R, BLOCK_D)
            go = tl.where(excluded[:, None], 0.0, a[:, None] * g)
            tl.store(go_base + rows[:, None] * s_gor + cols[None, :] * s_god,
                     cast(go, go_ptr.dtype.element_ty), mask=tile_ok)
        g_dot_out += tl.where(excluded, 0.0, a * dot)
        tl.store(gl_p, dot, mask=row_ok)
        lse_p += s_lp
        gl_p += R
        o_base += s_op
        go_base += s_gop
    if HAS_GLSE:
        glse = to_f32(tl.load(glse_ptr + rows * s_glr, mask=row_ok, other=0.0))
    else:
        glse = tl.zeros((BLOCK_R,), tl.float32)
    lse_p = lse_ptr + rows * s_lr
    gl_p = gl_ptr + rows
    for _ in range(P):
        lse = tl.load(lse_p, mask=row_ok, other=NEG_INF)
        excluded = lse == NEG_INF
        a = tl.where(excluded, 0.0, tl.exp(lse - m_safe) * inv_s)
        dot = tl.load(gl_p, mask=row_ok, other=0.0)
        tl.store(gl_p, tl.where(excluded, 0.0, a * (glse + (dot - g_dot_out))), mask=row_ok)
        lse_p += s_lp
        gl_p += R
    if HAS_SINKS:  # the sink's output is 0: its "g . out_i" term is 0
        sink = tl.load(sink_ptr + rows, mask=row_ok, other=NEG_INF)
        a_sink = tl.where(sink == NEG_INF, 0.0, tl.exp(sink - m_safe) * inv_s)
        tl.store(gsink_ptr + rows, a_sink * (glse - g_dot_out), mask=row_ok)
