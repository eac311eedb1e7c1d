"""Attention forward for Hopper (sm_90) in Gluon (Triton 3.6): FlashAttention-3's warp-specialized structure.

Only Gluon code and the torch-free description of its launch configurations live here (the offline sm_90
compile test runs in a Python without torch); ``safeops.ops.attention_gluon`` builds the descriptors and
launches.

Structure (one CTA per query tile of ``NUM_WG * BLOCK_M_WG`` rows, or persistent CTAs looping over tiles):

- a 1-warp producer partition issues TMA loads: each consumer's Q rows once per tile, and K and V blocks
  into a ``NUM_STAGES``-deep shared-memory ring, K and V with their own ``ready`` / ``empty`` mbarriers so
  QK^T of a block can start before its V has landed;
- ``NUM_WG`` consumer warpgroups (the default partition and ``NUM_WG - 1`` 4-warp workers, each with its
  own ``BLOCK_M_WG`` = 64 query rows of the tile) run async wgmma: S = Q K^T from shared memory, the online
  softmax in registers, O += P V with P in registers;
- inside a warpgroup, S_j = Q K_j^T is issued before O += P_{j-1} V_{j-1}, and the softmax of S_j runs
  while that PV product is on the tensor cores (FA3's intra-warpgroup overlap; ptxas keeps the wait for
  the PV product after the exponentials only with ``LATE_PV_WAIT``, else it hoists it above them); with
  ``PINGPONG`` the warpgroups take turns issuing their MMAs (an mbarrier per warpgroup), so one
  warpgroup's softmax runs while the other's MMAs use the tensor cores (FA3's inter-warpgroup overlap);
- causal tiles are numbered longest first (inside L2-sized chunks of heads); a persistent launch walks the
  tiles round-robin, one program per SM;
- ``VARLEN``: packed sequences (``attention_varlen``), the tiles of each sequence placed by cu_seqlens. A
  tile's TMA boxes may reach into the next sequence's rows: its keys there are selected away like any
  excluded key, its query rows are computed but never stored (O, m, l of a sequence's last tile go out by
  masked stores), so each sequence gets the bits it gets alone in a dense call.

Numerics (CONTRACT.md sections 1-4, 6), identical in meaning to ``safeops.kernels.attention``'s forward:

    s  = dot(q, k)                          fp32 accumulation (wgmma)
    z2 = s * C1                             ONE fp32 multiply, C1 = fp32(scale * log2(e)) from the host
    (``SOFTCAP``: z2 = (1 - 2 / (exp2(s * C1) + 1)) * C2, C1 = fp32(2 log2(e) scale / softcap),
     C2 = fp32(softcap * log2(e)): the Triton kernels' formula, the bracket tanh)
    z2 = -inf where the key is excluded     a select (causal, keys past seqlen_k), never an add
    m  = max(m, rowmax(z2)); base = (m == -inf ? 0 : m)   the guarded rescale: never -inf - -inf
    alpha = exp2(m_old - base); p = exp2(z2 - base); l = l * alpha + rowsum(p); o = o * alpha + p @ v

The same z2 feeds the row max and ``z2 - base`` (launched with ``enable_fp_fusion=False``; a PTX test checks
no f32 fma). P enters the PV wgmma in the input dtype; l is summed from the fp32 p. The kernel writes O
(input dtype, ``o / l`` rounded once; 0 for an empty row), and per row ``m`` (max of z2, -inf for an empty
row) and ``l`` (sum of exp2(z2 - m), 0 for an empty row) in fp32, kept apart, as the Triton forward saves
them, so the Triton backward consumes them unchanged. Each row's arithmetic depends only on its own tile's
blocks, whose shape is fixed by the configuration (head dim, dtype, causal): batch-invariant, and no
atomics, so deterministic.
"""

from dataclasses import dataclass

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

NEG_INF = gl.constexpr(float("-inf"))
LOG2E = gl.constexpr(1.4426950408889634)
# Values that change with the problem size are not specialised: one compiled kernel per configuration.
SIZE_ARGS = ["n_heads", "group", "head_group", "seqlen_q", "seqlen_k", "n_m_blocks", "n_tiles",
             "o_stride_row", "o_stride_head", "window_left", "has_sinks"]
# Pointers read only by the varlen kernel (dense launches pass the m pointer there): no alignment
# specialisation, so an offset cu_seqlens tensor gets the same compiled kernel.
UNALIGNED_ARGS = ["o_ptr", "cu_q_ptr", "cu_k_ptr", "sinks_ptr"]
BLOCK_M_WG = 64  # query rows per consumer warpgroup: one m64 wgmma row block
LOADER_REGS = gl.constexpr(24)  # registers per thread of the TMA producer warp (setmaxnreg)


# ------------------------------------------------------------------------------------------------------
# Launch configurations: plain Python (no torch), shared by the launcher and the offline compile test.
# ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GluonFwdConfig:
    block_n: int  # keys per block
    num_stages: int  # depth of the K and V rings
    num_wg: int = 2  # consumer warpgroups: query rows per tile = num_wg * 64
    consumer_regs: int = 232  # registers per thread of the worker consumers (setmaxnreg); the default
    # partition (consumer 0) gets what the TMA warp and the workers leave (248 with 232 and 24)
    pingpong: bool = True  # consumer warpgroups take turns issuing their MMAs
    # O staged in its own shared buffers instead of Q's: a consumer releases its Q buffer after the tile's
    # last QK^T (the producer loads the next tile's Q during the last PV and the epilogue) and does not wait
    # for its O store (it overlaps the next tile). For the persistent grid; the same arithmetic, same bits.
    separate_o: bool = False
    # A warpgroup barrier whose id depends on the block's row sums, just before the wait for the previous
    # block's PV product: ptxas otherwise places that wait before the exponentials (it hoists the wgmma wait
    # up to the previous synchronizing instruction, and the O rescale it schedules early needs it), so the
    # softmax did not overlap the PV product. Same arithmetic, same bits.
    late_pv_wait: bool = False

    @property
    def block_m(self) -> int:
        return self.num_wg * BLOCK_M_WG


# head dim -> configuration, bf16 and fp16, causal or not, chosen on the H200 (bench/RESULTS.md, the
# forward configuration sweep): at D=64 three consumer warpgroups (192-row tiles, as FlashAttention-3's D=64
# tile) at 160 registers, two stages; at D=128 two warpgroups with a three-deep K / V ring (229 KB of shared
# memory) and the PV wait kept after the softmax (+1.2-2.1% on an H100 in two interleaved runs, the same bits;
# at D=64 -7% causal, so off there). tests/test_attention_gluon_offline.py compiles every entry for sm_90.
FWD_CONFIGS: dict[int, GluonFwdConfig] = {
    64: GluonFwdConfig(block_n=128, num_stages=2, num_wg=3, consumer_regs=160),
    128: GluonFwdConfig(block_n=128, num_stages=3, late_pv_wait=True),
    256: GluonFwdConfig(block_n=64, num_stages=2, consumer_regs=240),
}
HEAD_DIMS = tuple(FWD_CONFIGS)
# Head dims with a sliding-window build (HAS_WL): at 256 the window's per-row bounds made ptxas spill.
WINDOW_HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
_GL_DTYPES = {"bfloat16": gl.bfloat16, "float16": gl.float16}
_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def shared_layout(rows: int, head_dim: int, dtype: str) -> gl.NVMMASharedLayout:
    """The NVMMA (swizzled) shared layout of a (1, 1, rows, head_dim) TMA block."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], _GL_DTYPES[dtype])


def block_shapes(cfg: GluonFwdConfig, head_dim: int) -> dict[str, list[int]]:
    """TMA block shapes of the q / k / v / o descriptors over (B, H, S, D) tensors."""
    qo = [1, 1, BLOCK_M_WG, head_dim]
    kv = [1, 1, cfg.block_n, head_dim]
    return {"q": qo, "k": kv, "v": kv, "o": qo}


def constexprs(cfg: GluonFwdConfig, causal: bool, varlen: bool = False, window: bool = False,
               softcap: bool = False) -> dict:
    """The kernel's constexpr arguments for one configuration (block shapes come with the descriptors).
    ``window``: a left window bound (row i sees keys from i - window_left on); ``softcap``: scores softcapped
    (the constant C2 a runtime argument)."""
    return dict(CAUSAL=causal, NUM_STAGES=cfg.num_stages, NUM_WG=cfg.num_wg, CONSUMER_REGS=cfg.consumer_regs,
                PINGPONG=cfg.pingpong, VARLEN=varlen, SEPARATE_O=cfg.separate_o, HAS_WL=window,
                LATE_PV_WAIT=cfg.late_pv_wait,
                SOFTCAP=softcap)


LAUNCH_OPTIONS = {"num_warps": 4}  # the default partition is one consumer warpgroup


def signature(cfg: GluonFwdConfig, head_dim: int, dtype: str, varlen: bool = False) -> dict[str, str]:
    """The kernel's runtime argument types as Triton's compiler spells them (for offline compiles), in
    argument order. Dense launches pass the (fp32) m pointer for the cu_seqlens pointers, and launches
    without sinks the m pointer for the sinks'."""
    types = {}
    for name, shape in block_shapes(cfg, head_dim).items():
        layout = shared_layout(shape[2], head_dim, dtype)
        types[f"{name}_desc"] = f"tensordesc<{_SHORT[dtype]}[{', '.join(map(str, shape))}],{layout!r}>"
    cu = "*i32" if varlen else "*fp32"
    types.update(m_ptr="*fp32", l_ptr="*fp32", o_ptr=f"*{_SHORT[dtype]}", cu_q_ptr=cu, cu_k_ptr=cu,
                 sinks_ptr="*fp32", C1="fp32", C2="fp32")
    types.update({name: "i32" for name in SIZE_ARGS})
    return {name: types[name] for name in attn_fwd_gluon_kernel.arg_names if name in types}


# ------------------------------------------------------------------------------------------------------
# The kernel.
# ------------------------------------------------------------------------------------------------------

@gluon.jit
def _tile_coords(tile, sizes, cu_q_ptr, cu_k_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr, VARLEN: gl.constexpr, HAS_WL: gl.constexpr):
    """Where tile number ``tile`` is: (m0, bc, b, h, hk, n_blocks, q_start, k_start, rows_q, rows_k) = its
    first query row in its sequence, the batch coordinate of its TMA boxes, its sequence, query head and kv
    head, its key blocks, and the first row and the length of its sequence in q and in k. Dense: bc = b, the
    sequences start at row 0 with the tensors' lengths. ``VARLEN`` (descriptors over (1, H, T, D) views of
    the packed tensors): bc = 0, starts and lengths from cu_seqlens. The order changes no result (each tile
    is computed alone), only the schedule.

    Causal: heads in chunks of ``head_group`` (whose K/V fit in L2 together); inside a chunk, query blocks
    from the last (most keys) down, the chunk's heads innermost: the longest tiles start first and the
    short ones fill the tail. Otherwise the query blocks of one head are adjacent (they share K/V in L2).
    Query row i sees key j iff j <= i (top-left aligned within each sequence, as the Triton path)."""
    (C1, n_heads, group, head_group, seqlen_q, seqlen_k, n_m_blocks, n_tiles, o_stride_row,
     o_stride_head, window_left, has_sinks, C2) = sizes
    n_bh = n_tiles // n_m_blocks
    if CAUSAL:
        chunk = tile // (head_group * n_m_blocks)
        r = tile % (head_group * n_m_blocks)
        heads_here = gl.minimum(head_group, n_bh - chunk * head_group)
        m_block = n_m_blocks - 1 - r // heads_here
        bh = chunk * head_group + r % heads_here
    else:
        m_block = tile % n_m_blocks
        bh = tile // n_m_blocks
    m0 = m_block * BLOCK_M
    h = bh % n_heads
    b = bh // n_heads
    if VARLEN:
        q_start = gl.load(cu_q_ptr + b)
        rows_q = gl.load(cu_q_ptr + b + 1) - q_start
        k_start = gl.load(cu_k_ptr + b)
        rows_k = gl.load(cu_k_ptr + b + 1) - k_start
        bc = 0
    else:
        q_start = 0
        rows_q = seqlen_q
        k_start = 0
        rows_k = seqlen_k
        bc = b
    hi = rows_k
    if CAUSAL:
        hi = gl.minimum(rows_k, m0 + BLOCK_M)
    n_blocks = gl.cdiv(hi, BLOCK_N)
    lo = 0
    if HAS_WL:  # the tile's first row sees keys from m0 - window_left on; at least one block (all masked
        # when no row of the tile sees a key, which gives them the empty rows' results)
        lo = gl.maximum(gl.minimum(gl.maximum(m0 - window_left, 0) // BLOCK_N, n_blocks - 1), 0)
    return m0, bc, b, h, h // group, lo, n_blocks, q_start, k_start, rows_q, rows_k


@gluon.jit
def _load_block(desc, bufs, ready, empty, b, hk, n0, count, NUM_STAGES: gl.constexpr):
    """Block number ``count`` of a ring: wait until its slot is free, then TMA rows n0.. of head (b, hk).
    Rows past the tensor read as zeros (the descriptor's shape is the tensor's); in a packed (varlen)
    tensor, rows past a sequence's end are the next sequence's, which the consumers select away."""
    slot = count % NUM_STAGES
    mbarrier.wait(empty.index(slot), ((count // NUM_STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [b, hk, n0, 0], ready.index(slot), bufs.index(slot))


@gluon.jit
def _produce_tile(bufs, bc, h, hk, q_row, k_start, lo, n_blocks, c, t, NUM_STAGES: gl.constexpr,
                  NUM_WG: gl.constexpr):
    """One tile's loads of key blocks lo .. n_blocks - 1: K_lo, each consumer's Q rows (from row ``q_row``),
    then K_j before V_{j-1}, the order the consumers use. Returns the ring position and the Q phase after
    the tile."""
    (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, k_empty,
     v_ready, v_empty, turn, m_ptr, l_ptr, o_ptr, cu_q_ptr, cu_k_ptr, sinks_ptr) = bufs
    BLOCK_M_WG: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    _load_block(k_desc, k_smem, k_ready, k_empty, bc, hk, k_start + lo * BLOCK_N, c, NUM_STAGES)
    for w in gl.static_range(NUM_WG):
        mbarrier.wait(q_empty.index(w), (t & 1) ^ 1)
        mbarrier.expect(q_ready.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [bc, h, q_row + w * BLOCK_M_WG, 0], q_ready.index(w),
                                        q_smem.index(w))
    n = n_blocks - lo
    for i in range(1, n):
        j = lo + i
        _load_block(k_desc, k_smem, k_ready, k_empty, bc, hk, k_start + j * BLOCK_N, c + i, NUM_STAGES)
        _load_block(v_desc, v_smem, v_ready, v_empty, bc, hk, k_start + (j - 1) * BLOCK_N, c + i - 1,
                    NUM_STAGES)
    _load_block(v_desc, v_smem, v_ready, v_empty, bc, hk, k_start + (n_blocks - 1) * BLOCK_N, c + n - 1,
                NUM_STAGES)
    return c + n, t + 1


@gluon.jit
def _producer(bufs, sizes, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr,
              PINGPONG: gl.constexpr, VARLEN: gl.constexpr, SEPARATE_O: gl.constexpr,
              HAS_WL: gl.constexpr):
    """The TMA warp: every tile of this program, in order (``_produce_tile``)."""
    (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, k_empty,
     v_ready, v_empty, turn, m_ptr, l_ptr, o_ptr, cu_q_ptr, cu_k_ptr, sinks_ptr) = bufs
    BLOCK_M_WG: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    (C1, n_heads, group, head_group, seqlen_q, seqlen_k, n_m_blocks, n_tiles, o_stride_row, o_stride_head,
     window_left, has_sinks, C2) = sizes
    c = 0  # K/V blocks loaded so far (ring position, across this program's tiles)
    t = 0  # tiles loaded so far (phase of the Q barriers)
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        m0, bc, b, h, hk, lo, n_blocks, q_start, k_start, rows_q, rows_k = _tile_coords(
            tile, sizes, cu_q_ptr, cu_k_ptr, NUM_WG * BLOCK_M_WG, BLOCK_N, CAUSAL, VARLEN, HAS_WL)
        if VARLEN:
            # A tile past its sequence's end loads nothing, nor does one of a sequence without keys (its
            # consumers write the empty rows directly): the consumers skip the same tiles.
            if m0 < rows_q:
                if n_blocks > 0:
                    c, t = _produce_tile(bufs, bc, h, hk, q_start + m0, k_start, lo, n_blocks, c, t,
                                         NUM_STAGES, NUM_WG)
        else:
            c, t = _produce_tile(bufs, bc, h, hk, m0, k_start, lo, n_blocks, c, t, NUM_STAGES, NUM_WG)


@gluon.jit
def _softmax_block(s, m_i, l_i, n0, offs_n0, limit, start, C1, C2, masked, masked_start, HAS_WL: gl.constexpr,
                   SOFTCAP: gl.constexpr):
    """One key block of the online softmax (the contract's arithmetic, as in the Triton forward):
    returns (p, m_new, l_new, alpha). ``limit``: per row, the first key it does not see (keys >= limit get
    -inf by select); ``masked``: whether some key of the block can be at or past some row's limit. With
    ``HAS_WL`` also keys before each row's ``start`` (its sliding window's first key) where
    ``masked_start`` says the block reaches before some row's start."""
    if SOFTCAP:  # z = softcap * tanh(s * scale / softcap) in base 2: the Triton kernels' formula and order
        e = gl.exp2(s * C1)
        z = (1.0 - 2.0 / (e + 1.0)) * C2
    else:
        z = s * C1
    keys = (n0 + offs_n0)[None, :]
    if HAS_WL:
        if masked or masked_start:
            z = gl.where((keys < limit[:, None]) & (keys >= start[:, None]), z, NEG_INF)
    else:
        if masked:
            z = gl.where(keys < limit[:, None], z, NEG_INF)
    m_new = gl.maximum(m_i, gl.max(z, 1))
    # Guarded rescale: while a row has seen only excluded keys, m_new = -inf and the base is 0, so neither
    # exp2(m_i - base) nor exp2(z - base) is -inf - -inf.
    base = gl.where(m_new == NEG_INF, 0.0, m_new)
    alpha = gl.exp2(m_i - base)
    p = gl.exp2(z - base[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _turn_wait(turn, w: gl.constexpr, count, PINGPONG: gl.constexpr):
    """Pingpong: wait until the previous warpgroup has issued its MMAs of this round (warpgroup 0 starts)."""
    if PINGPONG:
        if w == 0:
            mbarrier.wait(turn.index(0), (count & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(w), count & 1)


@gluon.jit
def _turn_pass(turn, w: gl.constexpr, NUM_WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index((w + 1) % NUM_WG), count=1)


@gluon.jit
def _store_rows(o_ptr, out, row0, n_rows, h, o_stride_row, o_stride_head):
    """A masked store of ``out``'s first ``n_rows`` rows (all if more, none if <= 0) to rows row0.. of head
    ``h`` of the packed o: a varlen tile's rows past its sequence's end belong to the next sequence, which
    a TMA box store would overwrite."""
    layout: gl.constexpr = out.type.layout
    BLOCK_M: gl.constexpr = out.shape[0]
    HEAD_DIM: gl.constexpr = out.shape[1]
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    rows = h.to(gl.int64) * o_stride_head + (row0 + offs_m).to(gl.int64) * o_stride_row
    mask = (offs_m < n_rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
    gl.store(o_ptr + rows[:, None] + offs_d[None, :], out, mask=mask)


@gluon.jit
def _sink_score(sinks_ptr, h, has_sinks):
    """zs2 of head ``h``'s sink: its fp32 logit times LOG2E, one multiply (as the Triton kernels); -inf
    without sinks (``has_sinks`` 0: sinks_ptr is not read), which starts a row as m = -inf, l = 0."""
    return gl.load(sinks_ptr + h, mask=has_sinks != 0, other=NEG_INF) * LOG2E


@gluon.jit
def _store_empty_rows(o_ptr, m_ptr, l_ptr, sinks_ptr, has_sinks, row0, n_rows, h, total_q, o_stride_row,
                      o_stride_head, zeros, HAS_WL: gl.constexpr):
    """Empty rows (a packed sequence without keys): O = 0, m = -inf, l = 0 (contract section 4), or with
    sinks the sink alone (m = zs2, l = exp2(zs2 - guarded zs2)), for the first ``n_rows`` rows of
    ``zeros``'s height, from packed row ``row0`` of head ``h``."""
    _store_rows(o_ptr, zeros, row0, n_rows, h, o_stride_row, o_stride_head)
    BLOCK_M: gl.constexpr = zeros.shape[0]
    row_layout: gl.constexpr = gl.SliceLayout(1, zeros.type.layout)
    offs = gl.arange(0, BLOCK_M, layout=row_layout)
    st = h.to(gl.int64) * total_q + row0 + offs
    ok = offs < n_rows
    m = gl.full([BLOCK_M], 0.0, gl.float32, row_layout) + _sink_score(sinks_ptr, h, has_sinks)
    l = gl.exp2(m - gl.where(m == NEG_INF, 0.0, m))  # 0 for m = -inf
    gl.store(m_ptr + st, m, mask=ok)
    gl.store(l_ptr + st, l, mask=ok)


# Named barriers 12 + w (one per consumer warpgroup; Triton 3.6's warp specialization uses the low ids) whose
# id a PRMT makes depend on the first input register: ptxas cannot hoist the barrier above that register's
# definition, nor a wgmma wait above the barrier. The value passes through unchanged.
_ORDER_ASM = [f"{{ .reg .b32 t; mov.b32 t, {12 + w}; prmt.b32 t, t, $2, 0x3210; bar.sync t, 128; }} "
              "mov.b32 $0, $2; mov.b32 $1, $3;" for w in range(3)]
_ORDER_ASM0 = gl.constexpr(_ORDER_ASM[0])
_ORDER_ASM1 = gl.constexpr(_ORDER_ASM[1])
_ORDER_ASM2 = gl.constexpr(_ORDER_ASM[2])


@gluon.jit
def _order_point(x, w: gl.constexpr):
    """``x`` (a per-row fp32 tensor, two values per thread), unchanged, after warpgroup ``w``'s barrier
    ordered after x's computation: the instructions that follow in the PTX stay after x's."""
    if w == 0:
        y = gl.inline_asm_elementwise(_ORDER_ASM0, "=r,=r,r,r", [x], gl.float32, is_pure=False, pack=2)
    elif w == 1:
        y = gl.inline_asm_elementwise(_ORDER_ASM1, "=r,=r,r,r", [x], gl.float32, is_pure=False, pack=2)
    else:
        y = gl.inline_asm_elementwise(_ORDER_ASM2, "=r,=r,r,r", [x], gl.float32, is_pure=False, pack=2)
    return y


@gluon.jit
def _consume_tile(w: gl.constexpr, bufs, sizes, s_zero, offs_n0, m0, bc, b, h, lo, n_blocks, q_start,
                  rows_q, rows_k, c, t, rounds, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
                  NUM_WG: gl.constexpr, PINGPONG: gl.constexpr, VARLEN: gl.constexpr,
                  SEPARATE_O: gl.constexpr, HAS_WL: gl.constexpr, SOFTCAP: gl.constexpr,
                  LATE_PV_WAIT: gl.constexpr):
    """Consumer warpgroup ``w``'s rows m0 + 64 w .. m0 + 64 w + 63 of one tile (key blocks lo .. n_blocks - 1,
    at least one): the online softmax, then O, m and l out. Returns (c, t, rounds) after the tile."""
    (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, k_empty,
     v_ready, v_empty, turn, m_ptr, l_ptr, o_ptr, cu_q_ptr, cu_k_ptr, sinks_ptr) = bufs
    (C1, n_heads, group, head_group, seqlen_q, seqlen_k, n_m_blocks, n_tiles, o_stride_row,
     o_stride_head, window_left, has_sinks, C2) = sizes
    BLOCK_M_WG: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = s_zero.type.layout
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    r0 = m0 + w * BLOCK_M_WG
    offs_m = r0 + gl.arange(0, BLOCK_M_WG, layout=row_layout)
    # Per row, the first key it does not see; a block needs the select only where it reaches past the
    # smallest row's limit (the causal diagonal, the partial last block).
    if CAUSAL:
        limit = gl.minimum(offs_m + 1, rows_k)
        full_end = gl.minimum(r0 + 1, rows_k)
    else:
        limit = gl.full([BLOCK_M_WG], 0, gl.int32, row_layout) + rows_k
        full_end = rows_k
    # HAS_WL: per row also the first key it sees (i - window_left); a block needs the select where it
    # starts before the largest row's first key.
    start = offs_m - window_left
    full_start = r0 + BLOCK_M_WG - 1 - window_left
    # The sink is each row's first score (no value): m = zs2, l = exp2(zs2 - guarded base); without sinks
    # zs2 = -inf gives m = -inf, l = exp2(-inf) = 0.
    m_i = gl.full([BLOCK_M_WG], 0.0, gl.float32, row_layout) + _sink_score(sinks_ptr, h, has_sinks)
    l_i = gl.exp2(m_i - gl.where(m_i == NEG_INF, 0.0, m_i))
    o = gl.zeros([BLOCK_M_WG, HEAD_DIM], gl.float32, o_layout)

    mbarrier.wait(q_ready.index(w), t & 1)
    q = q_smem.index(w).reshape([BLOCK_M_WG, HEAD_DIM])

    # Block lo: S_lo = Q K_lo^T and its softmax.
    slot = c % NUM_STAGES
    mbarrier.wait(k_ready.index(slot), (c // NUM_STAGES) & 1)
    _turn_wait(turn, w, rounds, PINGPONG)
    s = warpgroup_mma(q, k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                      use_acc=False, is_async=True)
    _turn_pass(turn, w, NUM_WG, PINGPONG)
    rounds += 1
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    mbarrier.arrive(k_empty.index(slot), count=1)
    n0 = lo * BLOCK_N
    p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, n0, offs_n0, limit, start, C1, C2,
                                        n0 + BLOCK_N > full_end,
                                        HAS_WL and n0 < full_start, HAS_WL, SOFTCAP)
    p = gl.convert_layout(p.to(dtype), p_layout)

    # Block j: issue S_j = Q K_j^T, rescale O, issue O += P_{j-1} V_{j-1}; the softmax of S_j runs while
    # the PV product is on the tensor cores.
    for j in range(lo + 1, n_blocks):
        kc = c + j - lo
        kslot = kc % NUM_STAGES
        vslot = (kc - 1) % NUM_STAGES
        mbarrier.wait(k_ready.index(kslot), (kc // NUM_STAGES) & 1)
        _turn_wait(turn, w, rounds, PINGPONG)
        s = warpgroup_mma(q, k_smem.index(kslot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        o = o * gl.convert_layout(alpha, o_row_layout)[:, None]
        mbarrier.wait(v_ready.index(vslot), ((kc - 1) // NUM_STAGES) & 1)
        o = warpgroup_mma(p, v_smem.index(vslot).reshape([BLOCK_N, HEAD_DIM]), o, is_async=True)
        _turn_pass(turn, w, NUM_WG, PINGPONG)
        rounds += 1
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        mbarrier.arrive(k_empty.index(kslot), count=1)
        n0 = j * BLOCK_N
        p_next, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, n0, offs_n0, limit, start, C1, C2,
                                                 n0 + BLOCK_N > full_end, HAS_WL and n0 < full_start, HAS_WL,
                                                 SOFTCAP)
        if LATE_PV_WAIT:
            l_i = _order_point(l_i, w)
        # P_{j-1} is a register operand of the PV wgmma: keep it alive until that wgmma has retired.
        o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
        mbarrier.arrive(v_empty.index(vslot), count=1)
        p = gl.convert_layout(p_next.to(dtype), p_layout)

    if SEPARATE_O:  # every QK^T of the tile has retired: the producer may load the next tile's Q rows
        mbarrier.arrive(q_empty.index(w), count=1)

    # The last block's PV.
    vc = c + n_blocks - lo - 1
    vslot = vc % NUM_STAGES
    o = o * gl.convert_layout(alpha, o_row_layout)[:, None]
    mbarrier.wait(v_ready.index(vslot), (vc // NUM_STAGES) & 1)
    _turn_wait(turn, w, rounds, PINGPONG)
    o = warpgroup_mma(p, v_smem.index(vslot).reshape([BLOCK_N, HEAD_DIM]), o, is_async=True)
    _turn_pass(turn, w, NUM_WG, PINGPONG)
    rounds += 1
    o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))
    mbarrier.arrive(v_empty.index(vslot), count=1)

    # Empty rows (l = 0) give 0, not 0/0. O goes out through this warpgroup's O buffer (its Q buffer, Q
    # being dead now, unless SEPARATE_O) and TMA, which drops rows past the tensor; a packed sequence's last
    # rows go out by a masked store.
    l_o = gl.convert_layout(l_i, o_row_layout)
    out = (o / gl.where(l_o == 0.0, 1.0, l_o)[:, None]).to(dtype)
    if SEPARATE_O:
        tma.store_wait(pendings=0)  # the previous tile's O store has read the buffer
    if VARLEN:
        if r0 + BLOCK_M_WG <= rows_q:
            o_smem.index(w).reshape([BLOCK_M_WG, HEAD_DIM]).store(out)
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [bc, h, q_start + r0, 0], o_smem.index(w))
        else:
            _store_rows(o_ptr, out, q_start + r0, rows_q - r0, h, o_stride_row, o_stride_head)
        row_ok = offs_m < rows_q
        st = h.to(gl.int64) * seqlen_q + q_start + offs_m  # stats (H, T): seqlen_q is T here
    else:
        o_smem.index(w).reshape([BLOCK_M_WG, HEAD_DIM]).store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [bc, h, r0, 0], o_smem.index(w))
        row_ok = offs_m < seqlen_q
        st = (b * n_heads + h).to(gl.int64) * seqlen_q + offs_m
    gl.store(m_ptr + st, m_i, mask=row_ok)
    gl.store(l_ptr + st, l_i, mask=row_ok)
    if not SEPARATE_O:
        tma.store_wait(pendings=0)
        mbarrier.arrive(q_empty.index(w), count=1)  # the producer may load the next tile's Q rows
    return c + n_blocks - lo, t + 1, rounds


@gluon.jit
def _consumer(w: gl.constexpr, bufs, sizes, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
              NUM_WG: gl.constexpr, PINGPONG: gl.constexpr, VARLEN: gl.constexpr, SEPARATE_O: gl.constexpr,
              HAS_WL: gl.constexpr, SOFTCAP: gl.constexpr, LATE_PV_WAIT: gl.constexpr):
    """Consumer warpgroup ``w``: rows m0 + 64 w .. m0 + 64 w + 63 of each tile of this program."""
    (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, k_empty,
     v_ready, v_empty, turn, m_ptr, l_ptr, o_ptr, cu_q_ptr, cu_k_ptr, sinks_ptr) = bufs
    (C1, n_heads, group, head_group, seqlen_q, seqlen_k, n_m_blocks, n_tiles, o_stride_row,
     o_stride_head, window_left, has_sinks, C2) = sizes
    BLOCK_M_WG: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    # wgmma register layouts of one warpgroup: S (64 x BLOCK_N) and O (64 x HEAD_DIM) accumulators (P, the
    # register A operand of the PV product, takes O's; see _consume_tile).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    s_zero = gl.zeros([BLOCK_M_WG, BLOCK_N], gl.float32, s_layout)
    offs_n0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    c = 0  # K/V blocks consumed so far (ring position)
    t = 0  # tiles consumed (Q barrier phase)
    rounds = 0  # MMA turns taken (pingpong barrier phase)
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        m0, bc, b, h, hk, lo, n_blocks, q_start, k_start, rows_q, rows_k = _tile_coords(
            tile, sizes, cu_q_ptr, cu_k_ptr, NUM_WG * BLOCK_M_WG, BLOCK_N, CAUSAL, VARLEN, HAS_WL)
        if VARLEN:
            if m0 < rows_q:  # the producer skips the same tiles
                if n_blocks > 0:
                    c, t, rounds = _consume_tile(w, bufs, sizes, s_zero, offs_n0, m0, bc, b, h, lo, n_blocks,
                                                 q_start, rows_q, rows_k, c, t, rounds, CAUSAL, NUM_STAGES,
                                                 NUM_WG, PINGPONG, VARLEN, SEPARATE_O, HAS_WL, SOFTCAP,
                                                 LATE_PV_WAIT)
                else:  # a sequence without keys: its rows are empty, and nothing was loaded for them
                    _store_empty_rows(o_ptr, m_ptr, l_ptr, sinks_ptr, has_sinks,
                                      q_start + m0 + w * BLOCK_M_WG, rows_q - m0 - w * BLOCK_M_WG, h,
                                      seqlen_q, o_stride_row, o_stride_head,
                                      gl.zeros([BLOCK_M_WG, HEAD_DIM], dtype, o_layout), HAS_WL)
        else:
            c, t, rounds = _consume_tile(w, bufs, sizes, s_zero, offs_n0, m0, bc, b, h, lo, n_blocks, q_start,
                                         rows_q, rows_k, c, t, rounds, CAUSAL, NUM_STAGES, NUM_WG, PINGPONG,
                                         VARLEN, SEPARATE_O, HAS_WL, SOFTCAP, LATE_PV_WAIT)
    if SEPARATE_O:
        tma.store_wait(pendings=0)  # the last O store has read its buffer before the program ends


@gluon.jit
def _consumer0(bufs, sizes, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr,
               PINGPONG: gl.constexpr, VARLEN: gl.constexpr, SEPARATE_O: gl.constexpr,
               HAS_WL: gl.constexpr, SOFTCAP: gl.constexpr, LATE_PV_WAIT: gl.constexpr):
    _consumer(0, bufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, PINGPONG, VARLEN, SEPARATE_O, HAS_WL, SOFTCAP,
              LATE_PV_WAIT)


@gluon.jit
def _consumer1(bufs, sizes, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr,
               PINGPONG: gl.constexpr, VARLEN: gl.constexpr, SEPARATE_O: gl.constexpr,
               HAS_WL: gl.constexpr, SOFTCAP: gl.constexpr, LATE_PV_WAIT: gl.constexpr):
    _consumer(1, bufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, PINGPONG, VARLEN, SEPARATE_O, HAS_WL, SOFTCAP,
              LATE_PV_WAIT)


@gluon.jit
def _consumer2(bufs, sizes, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WG: gl.constexpr,
               PINGPONG: gl.constexpr, VARLEN: gl.constexpr, SEPARATE_O: gl.constexpr,
               HAS_WL: gl.constexpr, SOFTCAP: gl.constexpr, LATE_PV_WAIT: gl.constexpr):
    _consumer(2, bufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, PINGPONG, VARLEN, SEPARATE_O, HAS_WL, SOFTCAP,
              LATE_PV_WAIT)


@gluon.jit(do_not_specialize=SIZE_ARGS, do_not_specialize_on_alignment=UNALIGNED_ARGS)
def attn_fwd_gluon_kernel(q_desc, k_desc, v_desc, o_desc, m_ptr, l_ptr, o_ptr, cu_q_ptr, cu_k_ptr, sinks_ptr,
                          C1, n_heads, group, head_group, seqlen_q, seqlen_k, n_m_blocks, n_tiles,
                          o_stride_row, o_stride_head, window_left, has_sinks, C2, CAUSAL: gl.constexpr,
                          NUM_STAGES: gl.constexpr,
                          NUM_WG: gl.constexpr, CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
                          VARLEN: gl.constexpr, SEPARATE_O: gl.constexpr, HAS_WL: gl.constexpr,
                          SOFTCAP: gl.constexpr = False, LATE_PV_WAIT: gl.constexpr = False):
    """o, m, l of the query tiles program_id(0), program_id(0) + num_programs(0), ... of ``n_tiles`` =
    n_m_blocks x batch x heads. kv head = q head // group; ``head_group``: heads per chunk of the causal
    tile order (``_tile_coords``).

    Dense: descriptors over (B, H, S, D) views of q / o ((B, Hq, Sq, D)) and k / v ((B, Hkv, Sk, D)); m and
    l are (B, Hq, Sq) contiguous fp32; ``seqlen_q`` / ``seqlen_k`` are Sq / Sk; o_ptr, cu_q_ptr, cu_k_ptr
    and the o strides are not read. ``VARLEN``: descriptors over (1, H, T, D) views of the packed q / o
    ((Tq, Hq, D)) and k / v ((Tk, Hkv, D)); sequence b is rows cu_q[b]:cu_q[b+1] of q and cu_k[b]:cu_k[b+1]
    of k / v; m and l are (Hq, Tq) contiguous and ``seqlen_q`` is Tq; o_ptr with its row and head strides
    takes the rows a TMA box store would write past a sequence's end; ``n_m_blocks`` covers the longest
    sequence (tiles past a sequence's end do nothing). ``has_sinks`` != 0: sinks_ptr holds the (Hq,) fp32
    sink logits, each row's first score (m, l include it); otherwise it is not read (a runtime flag, so
    calls with and without sinks share one compiled kernel). ``HAS_WL``: query row i
    sees keys from i - window_left on (a sliding window, as the Triton kernels' left bound); a tile's key
    blocks start at its first row's window."""
    gl.static_assert(q_desc.block_type.shape[2] == 64)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_WG] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_WG):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # A K/V slot is free once every consumer warpgroup has read it.
        mbarrier.init(k_empty.index(i), count=NUM_WG)
        mbarrier.init(v_empty.index(i), count=NUM_WG)
    fence_async_shared()  # the inits visible to the async proxy (TMA) before it signals the barriers
    if SEPARATE_O:
        o_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_WG] + q_desc.block_type.shape, q_desc.layout)
    else:
        o_smem = q_smem  # O goes out through the Q buffers (Q is dead by then)
    bufs = (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready,
            k_empty, v_ready, v_empty, turn, m_ptr, l_ptr, o_ptr, cu_q_ptr, cu_k_ptr, sinks_ptr)
    sizes = (C1, n_heads, group, head_group, seqlen_q, seqlen_k, n_m_blocks, n_tiles, o_stride_row,
             o_stride_head, window_left, has_sinks, C2)
    # (The argument tuples are written out: a tuple assigned to a name turns its constexprs into tensors.)
    if NUM_WG == 2:
        gl.warp_specialize([(_consumer0, (bufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, PINGPONG, VARLEN,
                                          SEPARATE_O, HAS_WL, SOFTCAP, LATE_PV_WAIT)),
                            (_consumer1, (bufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, PINGPONG, VARLEN,
                                          SEPARATE_O, HAS_WL, SOFTCAP, LATE_PV_WAIT)),
                            (_producer, (bufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, PINGPONG, VARLEN,
                                         SEPARATE_O, HAS_WL))],
                           [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.static_assert(NUM_WG == 3)
        gl.warp_specialize([(_consumer0, (bufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, PINGPONG, VARLEN,
                                          SEPARATE_O, HAS_WL, SOFTCAP, LATE_PV_WAIT)),
                            (_consumer1, (bufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, PINGPONG, VARLEN,
                                          SEPARATE_O, HAS_WL, SOFTCAP, LATE_PV_WAIT)),
                            (_consumer2, (bufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, PINGPONG, VARLEN,
                                          SEPARATE_O, HAS_WL, SOFTCAP, LATE_PV_WAIT)),
                            (_producer, (bufs, sizes, CAUSAL, NUM_STAGES, NUM_WG, PINGPONG, VARLEN,
                                         SEPARATE_O, HAS_WL))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
