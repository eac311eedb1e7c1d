"""Triton kernels for the fused fp8 cast + transpose (``@triton.jit`` only).

``safeops.ops.cast_transpose_launch`` picks the kernel, tiles and grids and launches them:
``cast_transpose_bf16_kernel`` (end of this file: the same layout with the element work in inline PTX) for
bf16 inputs on a GPU with M % 4 == 0, ``cast_transpose_kernel`` (described here) for everything else.

One program walks tiles of ``x`` (shape ``(M, K)``, any strides). Each tile is read once and gives:

- ``y``   (row-major ``(M, K)``): ``code((fp32(x) * scale).clamp(-max, max))``,
- ``y_t`` (the same bytes column-major, strides ``(1, M)``): the tile stored with the pointers transposed;
  Triton stages that layout change through shared memory so both stores are coalesced. With ``PACK`` the
  codes of 4 consecutive rows are first packed into one int32 word in registers, so only words (not bytes)
  go through shared memory (see the kernel's docstring),
- the largest ``|fp32(x)|`` of the tile, folded into a per-program running maximum.

The fp8 outputs are stored as raw bytes (the launcher passes ``uint8`` views), so the kernel decides every
bit itself:

- ``HW_CVT``: the hardware conversion (``cvt.rn.satfinite.e4m3x2/e5m2x2.f32`` on sm_90): round to
  nearest even, then saturate to +-max, which is exactly clamp-then-round, so no explicit clamp. NaN is
  then patched to torch's code (``0x7F`` with the sign of ``z``): ``satfinite`` and the interpreter may
  encode NaN differently;
- otherwise an integer round-to-nearest-even (the interpreter's fp8 casts are wrong, so CPU CI runs
  this one; GPU tests check both against eager torch bit for bit).

amax, deterministic without a second launch: ``max`` is order-independent, and the fp32 bit pattern of a
non-negative float orders like the float itself (a NaN's pattern is larger than ``inf``'s, so NaN wins, as
in ``x.abs().max()``). Each program does one integer ``atomic_max`` into a workspace, then counts itself
done; the last one moves the result to ``amax`` and puts the workspace back to zero for the next launch.
"""

import triton
import triton.language as tl

ABS_MASK = tl.constexpr(0x7FFFFFFF)
INF_BITS = tl.constexpr(0x7F800000)
# Strides and sizes that change with the tensor are not specialised by value except for Triton's usual
# "divisible by 16" and "== 1", which is what lets the byte stores become 16-byte vectors.


@triton.jit
def _fp8_magnitude_rne(a, MAN: tl.constexpr, BIAS: tl.constexpr):
    """|code| of a finite, non-negative fp32 given by its bit pattern ``a`` (int32, at most fp8 max).

    Normal range: drop ``23 - MAN`` mantissa bits rounding to nearest even on the integer pattern (a carry
    runs into the exponent, as it must), then rebias the exponent. Below the smallest normal fp8: add
    ``2**(23 + e_sub)`` (``e_sub`` the exponent of the smallest fp8 subnormal) in fp32, whose spacing there
    is exactly the fp8 subnormal step, so the IEEE adder rounds to nearest even at that step; the low bits
    of the sum are then the code (a result of ``2**MAN`` is the smallest normal, code ``1 << MAN``).
    """
    DROP: tl.constexpr = 23 - MAN
    HALF: tl.constexpr = 1 << (DROP - 1)
    LOW: tl.constexpr = (1 << DROP) - 1
    REBIAS: tl.constexpr = (127 - BIAS) << MAN
    MIN_NORMAL_BITS: tl.constexpr = (128 - BIAS) << 23
    MAGIC_BITS: tl.constexpr = (151 - BIAS - MAN) << 23
    r = a >> DROP
    rem = a & LOW
    up = (rem > HALF) | ((rem == HALF) & ((r & 1) == 1))
    normal = r + up.to(tl.int32) - REBIAS
    magic = tl.full([], MAGIC_BITS, tl.int32).to(tl.float32, bitcast=True)
    sub = (a.to(tl.float32, bitcast=True) + magic).to(tl.int32, bitcast=True) - MAGIC_BITS
    return tl.where(a >= MIN_NORMAL_BITS, normal, sub)


@triton.jit
def _fp8_codes(z, FP8: tl.constexpr, MAX_BITS: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr,
               HW_CVT: tl.constexpr):
    """The fp8 byte of ``z.clamp(-max, max).to(fp8)``, as torch computes it (int32 in 0..255)."""
    bits = z.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & ABS_MASK
    is_nan = a > INF_BITS
    if HW_CVT:
        # No explicit clamp: ``satfinite`` rounds to nearest even and then saturates to +-max (inf
        # included), which is exactly clamp-then-round. NaN is patched below.
        if FP8 == 0:
            y = z.to(tl.float8e4nv)
        else:
            y = z.to(tl.float8e5)
        code = y.to(tl.uint8, bitcast=True).to(tl.int32)
        # OR-ing the sign back is a no-op for every finite result, and keeps -0 for a tiny negative z
        # should the conversion flush it to +0.
        code = tl.where(is_nan, 0x7F, code) | sign
    else:
        mag = _fp8_magnitude_rne(tl.minimum(a, MAX_BITS), MAN, BIAS)
        code = tl.where(is_nan, 0x7F, mag) | sign
    return code


@triton.jit
def _tile_codes(x_ptr, scale_ptr, M, K, sxm, sxk, s_scale, scale, rows, cols, x_off, valid,
                FP8: tl.constexpr, MAX_BITS: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr,
                ROWWISE: tl.constexpr, HW_CVT: tl.constexpr, X_BF16_BITS: tl.constexpr, EVEN: tl.constexpr):
    """(codes int32, per-row largest |x| bit pattern) of one block of x: ``x_off`` its offsets, ``rows`` its
    rows (the caller folds the row maxima into its running maximum)."""
    if EVEN:
        x = tl.load(x_ptr + x_off)
    else:
        x = tl.load(x_ptr + x_off, mask=valid, other=0)
    if X_BF16_BITS:
        # bf16 -> fp32 is exact: the 16 bits become the top half of the fp32 pattern (the same shift the
        # hardware conversion does; the interpreter's own bf16 conversion loses subnormals).
        xf = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        xf = x.to(tl.float32)
    # Row maxima only (within a warp: shuffles); the maximum over rows is taken once per program, at the end.
    big = tl.max(xf.to(tl.int32, bitcast=True) & ABS_MASK, 1)
    if ROWWISE:
        if EVEN:
            s = tl.load(scale_ptr + rows.to(tl.int64) * s_scale).to(tl.float32)
        else:
            s = tl.load(scale_ptr + rows.to(tl.int64) * s_scale, mask=rows < M, other=1.0).to(tl.float32)
        z = xf * s[:, None]
    else:
        z = xf * scale
    return _fp8_codes(z, FP8, MAX_BITS, MAN, BIAS, HW_CVT), big


@triton.jit
def _as(ptr, dtype: tl.constexpr):
    """``ptr`` as a pointer to ``dtype`` (the kernels take the tensors as the launcher passes them: their own
    dtypes from Inductor's generated code, same-size integer views from the eager launcher)."""
    return ptr.to(tl.pointer_type(dtype), bitcast=True)


@triton.jit
def _amax_out(ws_ptr, amax_ptr, run_max, pid, n_programs, PARTIALS: tl.constexpr):
    """A program's maximum magnitude bits ``run_max`` into the result. ``PARTIALS``: into ``ws_ptr[pid]`` (one
    int32 per program; the caller takes their maximum). Else the hand-off: every program adds its maximum
    before it counts itself done (release); the program that counts last (acquire) therefore reads the
    maximum over all tiles into ``amax_ptr`` and resets the workspace for the next launch."""
    if PARTIALS:
        tl.store(ws_ptr + pid, run_max)
    else:
        tl.atomic_max(ws_ptr, run_max, sem="relaxed")
        done = tl.atomic_add(ws_ptr + 1, 1, sem="acq_rel")
        if done == n_programs - 1:
            total = tl.atomic_xchg(ws_ptr, 0, sem="acq_rel")
            tl.store(amax_ptr, total)
            tl.atomic_xchg(ws_ptr + 1, 0, sem="relaxed")


@triton.jit
def cast_transpose_kernel(
    x_ptr, scale_ptr, y_ptr, yt_ptr, ws_ptr, amax_ptr,
    M, K, sxm, sxk, s_scale,
    n_tiles_k, n_tiles, MW,
    FP8: tl.constexpr, MAX_BITS: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr,
    ROWWISE: tl.constexpr, HW_CVT: tl.constexpr, X_BF16_BITS: tl.constexpr, WIDE: tl.constexpr,
    EVEN: tl.constexpr, NUM_STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PACK: tl.constexpr = False, PARTIALS: tl.constexpr = False,
):
    """``y``/``y_t`` (uint8 views), ``amax`` (int32 view of a 0-d fp32) and a 2-element int32 workspace
    ``ws`` = (running max bits, programs done) that is zero on entry and left zero on exit (with ``PARTIALS``
    instead one int32 slot per program for its maximum's bits, ``amax_ptr`` unused: ``_amax_out``);
    ``MW`` = M // 4 (used with ``PACK`` only; a separate argument so Triton sees when it is a multiple of
    16). With ``X_BF16_BITS``, ``x`` is a bf16 tensor passed as its int16 view.

    ``PACK`` (needs M % 4 == 0; ``yt_ptr`` is then the int32 view of y_t's storage, ``(K, M // 4)``): the
    tile is read as four blocks of rows ``4i + j`` (j = 0..3), each block in the same register layout, so
    the four codes of rows ``4i..4i+3`` of a column sit in one thread and pack into the little-endian
    int32 word that y_t holds there, with no data movement. Only those words (4x fewer elements than
    bytes) go through the layout change to y_t's contiguous dimension, and y_t leaves as 16-byte stores of
    words. Without ``PACK`` the byte tile itself is stored with transposed pointers and Triton moves bytes.
    """
    if X_BF16_BITS:
        x_ptr = _as(x_ptr, tl.int16)
    y_ptr = _as(y_ptr, tl.uint8)
    yt_ptr = _as(yt_ptr, tl.int32 if PACK else tl.uint8)
    amax_ptr = _as(amax_ptr, tl.int32)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    SUB_M: tl.constexpr = BLOCK_M // (1 + 3 * PACK)  # rows per block: BLOCK_M // 4 with PACK
    am = tl.arange(0, SUB_M)
    ak = tl.arange(0, BLOCK_K)
    if ROWWISE:
        scale = 1.0
    else:
        scale = tl.load(scale_ptr).to(tl.float32)
    run_max = tl.zeros([SUB_M], dtype=tl.int32)
    # NUM_STAGES > 1: Triton prefetches the next tiles' x with asynchronous copies (cp.async) while this one
    # is converted, so a persistent program keeps loads in flight without many co-resident programs.
    for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
        tm = tile // n_tiles_k
        m0 = tm * BLOCK_M
        k0 = (tile % n_tiles_k) * BLOCK_K
        cols = k0 + ak
        m0w = m0.to(tl.int64)
        k0w = k0.to(tl.int64)
        # Offsets inside the tile (recomputed per tile: kept live across the loop they cost registers).
        if WIDE:
            am_i = am.to(tl.int64)
            ak_i = ak.to(tl.int64)
        else:
            am_i = am
            ak_i = ak
        if PACK:
            # Block j holds rows m0 + 4i + j; word (k, i) of y_t's tile = codes of rows 4i..4i+3, column k.
            x_base = x_ptr + (m0w * sxm + k0w * sxk)
            x_off = (am_i * 4)[:, None] * sxm + ak_i[None, :] * sxk
            y_base = y_ptr + (m0w * K + k0w)
            y_off = (am_i * 4)[:, None] * K + ak_i[None, :]
            word = tl.zeros([SUB_M, BLOCK_K], dtype=tl.int32)
            for j in tl.static_range(4):
                rows = m0 + 4 * am + j
                if EVEN:
                    valid = None
                else:
                    valid = (rows < M)[:, None] & (cols < K)[None, :]
                code, big = _tile_codes(x_base + j * sxm, scale_ptr, M, K, sxm, sxk, s_scale, scale, rows,
                                        cols, x_off, valid, FP8, MAX_BITS, MAN, BIAS, ROWWISE, HW_CVT,
                                        X_BF16_BITS, EVEN)
                run_max = tl.maximum(run_max, big)
                tl.store(y_base + j * K + y_off, code.to(tl.uint8), mask=valid)
                word = word | (code << (8 * j))
            # M % 4 == 0, so a word is either wholly inside M or wholly outside.
            if EVEN:
                wvalid = None
            else:
                wvalid = ((m0 + 4 * am) < M)[:, None] & (cols < K)[None, :]
            yt_base = yt_ptr + (k0w * MW + tm.to(tl.int64) * SUB_M)
            tl.store(yt_base + (ak_i[None, :] * MW + am_i[:, None]), word, mask=wvalid)
        else:
            rows = m0 + am
            if EVEN:
                valid = None  # M and K are multiples of the tile: no bounds checks
            else:
                valid = (rows < M)[:, None] & (cols < K)[None, :]
            x_off = am_i[:, None] * sxm + ak_i[None, :] * sxk
            code, big = _tile_codes(x_ptr + (m0w * sxm + k0w * sxk), scale_ptr, M, K, sxm, sxk, s_scale,
                                    scale, rows, cols, x_off, valid, FP8, MAX_BITS, MAN, BIAS, ROWWISE,
                                    HW_CVT, X_BF16_BITS, EVEN)
            run_max = tl.maximum(run_max, big)
            code = code.to(tl.uint8)
            tl.store(y_ptr + (m0w * K + k0w) + (am_i[:, None] * K + ak_i[None, :]), code, mask=valid)
            tl.store(yt_ptr + (k0w * M + m0w) + (ak_i[None, :] * M + am_i[:, None]), code, mask=valid)
    _amax_out(ws_ptr, amax_ptr, tl.max(run_max, 0), pid, n_programs, PARTIALS)


# ---------------------------------------------------------------------------------------------------------
# ``cast_transpose_bf16_kernel``: bf16 input on a GPU (the interpreter has no inline assembly), M % 4 == 0.
#
# The layout of ``cast_transpose_kernel`` with ``PACK`` (block j of a tile holds rows 4i + j; y_t leaves as
# int32 words of 4 codes), with the element work in PTX on packed registers. Per 4 elements: 2 shifts/ands
# (bf16 -> fp32), 4 ``mul.rn.f32``, 2 ``cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`` and the NaN rule; amax as
# ``max.u16x2`` of the bf16 magnitudes into a running tile (one instruction per 2 elements, reduced once per
# program); y_t's words from the 4 blocks' code registers by a 4 x 4 byte transpose (8 ``prmt`` per 16
# codes). The Triton-level element code costs ~17 SASS instructions per element (every fp8 pair unpacked to
# int32, the NaN select on every element, a per-row max with shuffles per tile); this one ~7 (tile loop).
#
# The NaN rule: a NaN must end as torch's code ``0x7F | sign(z)``. e4m3: ``code |= sign(z)`` suffices, since
# ``satfinite`` keeps NaN a NaN and e4m3's only NaN codes are 0x7F and 0xFF. e5m2 has other NaN codes, so
# first ``code |= 0x7F`` where z is NaN, then the sign. For every non-NaN z, OR-ing the sign byte is a no-op:
# the conversion keeps the sign (``-0`` included).
# ---------------------------------------------------------------------------------------------------------

# Inline PTX, one instance per 4 elements (``pack=4``): $0 = 4 codes (bytes, element 0 lowest), $1/$2 = the
# 4 bf16 inputs (2 per register, element 0 in the low half), $3..$6 = the 4 fp32 scales.
_CVT_HEAD = """{
.reg .b32 z0, z1, z2, z3, t0, t1;
.reg .b16 h0, h1;
.reg .pred p;
shl.b32 z0, $1, 16;
and.b32 z1, $1, 0xFFFF0000;
shl.b32 z2, $2, 16;
and.b32 z3, $2, 0xFFFF0000;
mul.rn.f32 z0, z0, $3;
mul.rn.f32 z1, z1, $4;
mul.rn.f32 z2, z2, $5;
mul.rn.f32 z3, z3, $6;
"""
_CVT_E4M3 = """cvt.rn.satfinite.e4m3x2.f32 h0, z1, z0;
cvt.rn.satfinite.e4m3x2.f32 h1, z3, z2;
mov.b32 $0, {h0, h1};
"""
_CVT_E5M2 = _CVT_E4M3.replace("e4m3x2", "e5m2x2")
# NaN -> 0x7F in its byte.
_NAN_OR = """setp.nan.f32 p, z0, z0;
@p or.b32 $0, $0, 0x0000007F;
setp.nan.f32 p, z1, z1;
@p or.b32 $0, $0, 0x00007F00;
setp.nan.f32 p, z2, z2;
@p or.b32 $0, $0, 0x007F0000;
setp.nan.f32 p, z3, z3;
@p or.b32 $0, $0, 0x7F000000;
"""
# The sign bytes of z0..z3 gathered into bytes 0..3 (prmt selectors: result byte i = nibble i), bit 7 kept.
_SIGN_OR = """prmt.b32 t0, z0, z1, 0x0073;
prmt.b32 t1, z2, z3, 0x7300;
prmt.b32 t0, t0, t1, 0x7610;
and.b32 t0, t0, 0x80808080;
or.b32 $0, $0, t0;
"""
_TAIL = "}"


def _one_line(asm: str) -> tl.constexpr:
    """The PTX on one line (statements end in ';'): Inductor embeds a kernel's source, constants included,
    in a triple-quoted string, where a '\\n' escape would become a line break inside a string literal."""
    return tl.constexpr(" ".join(asm.split()))


CVT_E4M3 = _one_line(_CVT_HEAD + _CVT_E4M3 + _SIGN_OR + _TAIL)
CVT_E5M2 = _one_line(_CVT_HEAD + _CVT_E5M2 + _NAN_OR + _SIGN_OR + _TAIL)
# Running max of bf16 magnitudes over the 4 blocks of a tile, 2 per register: $0 = max($1, |$2|, |$3|, |$4|,
# |$5|) per 16-bit half. The bf16 bit pattern of a magnitude orders like its value (NaN above inf), as the
# fp32 pattern does (= bf16 << 16).
AMAX4_U16X2 = _one_line("""{
.reg .b32 t0, t1, t2, t3;
and.b32 t0, $2, 0x7FFF7FFF;
and.b32 t1, $3, 0x7FFF7FFF;
and.b32 t2, $4, 0x7FFF7FFF;
and.b32 t3, $5, 0x7FFF7FFF;
max.u16x2 t0, t0, t1;
max.u16x2 t2, t2, t3;
max.u16x2 t0, t0, t2;
max.u16x2 $0, $1, t0;
}""")
# 4 x 4 byte transpose: $4..$7 = 4 codes each (blocks j = 0..3, elements e..e+3), $0..$3 = the words of
# elements e..e+3, byte j from block j (the int32 y_t holds there, little-endian).
TRANSPOSE_4X4 = _one_line("""{
.reg .b32 t0, t1, t2, t3;
prmt.b32 t0, $4, $5, 0x5140;
prmt.b32 t1, $6, $7, 0x5140;
prmt.b32 t2, $4, $5, 0x7362;
prmt.b32 t3, $6, $7, 0x7362;
prmt.b32 $0, t0, t1, 0x5410;
prmt.b32 $1, t0, t1, 0x7632;
prmt.b32 $2, t2, t3, 0x5410;
prmt.b32 $3, t2, t3, 0x7632;
}""")


@triton.jit
def _cvt(asm: tl.constexpr, x, s):
    return tl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r", [x, s], dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _bf16_codes(x, s, FP8: tl.constexpr):
    """uint8 codes of int16 (bf16 bit) block ``x`` times fp32 block ``s`` (see the PTX above)."""
    if FP8 == 0:
        code = _cvt(CVT_E4M3, x, s)
    else:
        code = _cvt(CVT_E5M2, x, s)
    return code


@triton.jit
def _bf16_load(x_ptr, m0, k0, j, M, K, sxm, sxk, WIDE: tl.constexpr, EVEN: tl.constexpr,
               SUB_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Block j of a tile of x: rows m0 + 4i + j, columns k0.. (int16 bf16 patterns)."""
    am = tl.arange(0, SUB_M)
    ak = tl.arange(0, BLOCK_K)
    if WIDE:
        am_i = am.to(tl.int64)
        ak_i = ak.to(tl.int64)
    else:
        am_i = am
        ak_i = ak
    x_off = (m0.to(tl.int64) + j) * sxm + k0.to(tl.int64) * sxk + ((am_i * 4)[:, None] * sxm
                                                                    + ak_i[None, :] * sxk)
    if EVEN:
        x = tl.load(x_ptr + x_off)
    else:
        rows = m0 + 4 * am + j
        valid = (rows < M)[:, None] & ((k0 + ak) < K)[None, :]
        x = tl.load(x_ptr + x_off, mask=valid, other=0)
    return x


@triton.jit
def _bf16_row_scales(scale_ptr, m0, j, M, s_scale, SUB_M: tl.constexpr, EVEN: tl.constexpr):
    """The fp32 scales of block j's rows (m0 + 4i + j)."""
    rows = m0 + 4 * tl.arange(0, SUB_M) + j
    if EVEN:
        return tl.load(scale_ptr + rows.to(tl.int64) * s_scale).to(tl.float32)
    else:
        return tl.load(scale_ptr + rows.to(tl.int64) * s_scale, mask=rows < M, other=1.0).to(tl.float32)


@triton.jit
def _bf16_block(x, y_ptr, s, m0, k0, j, M, K, FP8: tl.constexpr, ROWWISE: tl.constexpr, WIDE: tl.constexpr,
                EVEN: tl.constexpr, SUB_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Block j of a tile (rows m0 + 4i + j), loaded as ``x``, scaled by ``s`` (its rows' scales, or the one
    scale): stores its y rows, returns its codes."""
    am = tl.arange(0, SUB_M)
    ak = tl.arange(0, BLOCK_K)
    rows = m0 + 4 * am + j
    if ROWWISE:
        s2 = tl.broadcast_to(s[:, None], [SUB_M, BLOCK_K])
    else:
        s2 = tl.full([SUB_M, BLOCK_K], s, tl.float32)
    code = _bf16_codes(x, s2, FP8)
    if WIDE:
        am_i = am.to(tl.int64)
        ak_i = ak.to(tl.int64)
    else:
        am_i = am
        ak_i = ak
    if EVEN:
        valid = None
    else:
        valid = (rows < M)[:, None] & ((k0 + ak) < K)[None, :]
    y_off = (m0.to(tl.int64) + j) * K + k0.to(tl.int64) + ((am_i * 4)[:, None] * K + ak_i[None, :])
    tl.store(y_ptr + y_off, code, mask=valid)
    return code


@triton.jit
def _bf16_tile(x0, x1, x2, x3, y_ptr, yt_ptr, scale_ptr, scale, acc, m0, k0, tm, M, K, MW, s_scale,
               FP8: tl.constexpr, ROWWISE: tl.constexpr, WIDE: tl.constexpr, EVEN: tl.constexpr,
               SUB_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Converts one loaded tile, stores its y and y_t, returns the running max."""
    if ROWWISE:
        # All 4 blocks' row scales first (loaded between two blocks' stores they would wait a latency each).
        s0 = _bf16_row_scales(scale_ptr, m0, 0, M, s_scale, SUB_M, EVEN)
        s1 = _bf16_row_scales(scale_ptr, m0, 1, M, s_scale, SUB_M, EVEN)
        s2 = _bf16_row_scales(scale_ptr, m0, 2, M, s_scale, SUB_M, EVEN)
        s3 = _bf16_row_scales(scale_ptr, m0, 3, M, s_scale, SUB_M, EVEN)
    else:
        s0 = scale
        s1 = scale
        s2 = scale
        s3 = scale
    # One instruction sequence reads all 4 blocks first: it needs every load of the tile, so ptxas issues
    # them all before any conversion (with per-block maxima it issued 2-3, converted, then issued more).
    acc = tl.inline_asm_elementwise(AMAX4_U16X2, "=r,r,r,r,r,r", [acc, x0, x1, x2, x3], dtype=tl.int16,
                                    is_pure=True, pack=2)
    c0 = _bf16_block(x0, y_ptr, s0, m0, k0, 0, M, K, FP8, ROWWISE, WIDE, EVEN, SUB_M, BLOCK_K)
    c1 = _bf16_block(x1, y_ptr, s1, m0, k0, 1, M, K, FP8, ROWWISE, WIDE, EVEN, SUB_M, BLOCK_K)
    c2 = _bf16_block(x2, y_ptr, s2, m0, k0, 2, M, K, FP8, ROWWISE, WIDE, EVEN, SUB_M, BLOCK_K)
    c3 = _bf16_block(x3, y_ptr, s3, m0, k0, 3, M, K, FP8, ROWWISE, WIDE, EVEN, SUB_M, BLOCK_K)
    word = tl.inline_asm_elementwise(TRANSPOSE_4X4, "=r,=r,=r,=r,r,r,r,r", [c0, c1, c2, c3],
                                     dtype=tl.int32, is_pure=True, pack=4)
    am = tl.arange(0, SUB_M)
    ak = tl.arange(0, BLOCK_K)
    if WIDE:
        am_i = am.to(tl.int64)
        ak_i = ak.to(tl.int64)
    else:
        am_i = am
        ak_i = ak
    if EVEN:
        wvalid = None
    else:
        wvalid = ((m0 + 4 * am) < M)[:, None] & ((k0 + ak) < K)[None, :]
    yt_base = yt_ptr + (k0.to(tl.int64) * MW + tm.to(tl.int64) * SUB_M)
    tl.store(yt_base + (ak_i[None, :] * MW + am_i[:, None]), word, mask=wvalid)
    return acc


@triton.jit
def cast_transpose_bf16_kernel(
    x_ptr, scale_ptr, y_ptr, yt_ptr, ws_ptr, amax_ptr,
    M, K, sxm, sxk, s_scale,
    n_tiles_k, n_tiles, MW,
    FP8: tl.constexpr, ROWWISE: tl.constexpr, WIDE: tl.constexpr, EVEN: tl.constexpr,
    NUM_STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PARTIALS: tl.constexpr = False,
):
    """Same arguments and results as ``cast_transpose_kernel`` with ``PACK`` and ``X_BF16_BITS`` (``x`` the
    int16 view of a bf16 tensor, ``yt_ptr`` = int32 words ``(K, M // 4)``, ``MW`` = M // 4, the same amax
    workspace protocol); the conversion is always the hardware one. GPU only (inline PTX)."""
    x_ptr = _as(x_ptr, tl.int16)
    y_ptr = _as(y_ptr, tl.uint8)
    yt_ptr = _as(yt_ptr, tl.int32)
    amax_ptr = _as(amax_ptr, tl.int32)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    SUB_M: tl.constexpr = BLOCK_M // 4
    if ROWWISE:
        scale = 1.0
    else:
        scale = tl.load(scale_ptr).to(tl.float32)
    # The running max of bf16 magnitudes (int16 patterns), elementwise over every block this program reads
    # (reduced at the end).
    acc = tl.zeros([SUB_M, BLOCK_K], dtype=tl.int16)
    for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
        tm = tile // n_tiles_k
        m0 = tm * BLOCK_M
        k0 = (tile % n_tiles_k) * BLOCK_K
        # All four blocks' loads first (stores in between could alias x, so the compiler would not hoist
        # them): 4x the bytes in flight per thread.
        x0 = _bf16_load(x_ptr, m0, k0, 0, M, K, sxm, sxk, WIDE, EVEN, SUB_M, BLOCK_K)
        x1 = _bf16_load(x_ptr, m0, k0, 1, M, K, sxm, sxk, WIDE, EVEN, SUB_M, BLOCK_K)
        x2 = _bf16_load(x_ptr, m0, k0, 2, M, K, sxm, sxk, WIDE, EVEN, SUB_M, BLOCK_K)
        x3 = _bf16_load(x_ptr, m0, k0, 3, M, K, sxm, sxk, WIDE, EVEN, SUB_M, BLOCK_K)
        acc = _bf16_tile(x0, x1, x2, x3, y_ptr, yt_ptr, scale_ptr, scale, acc, m0, k0, tm, M, K, MW, s_scale,
                         FP8, ROWWISE, WIDE, EVEN, SUB_M, BLOCK_K)
    _amax_out(ws_ptr, amax_ptr, tl.max(tl.max(acc.to(tl.int32), 1), 0) << 16, pid, n_programs, PARTIALS)
