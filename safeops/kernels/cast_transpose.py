"""Triton kernel for the fused fp8 cast + transpose (``@triton.jit`` only).

``safeops.ops.cast_transpose_launch`` picks tiles and grids and launches it.

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
def cast_transpose_kernel(
    x_ptr, scale_ptr, y_ptr, yt_ptr, ws_ptr, amax_ptr,
    M, K, sxm, sxk, s_scale,
    n_tiles_k, n_tiles, MW,
    FP8: tl.constexpr, MAX_BITS: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr,
    ROWWISE: tl.constexpr, HW_CVT: tl.constexpr, X_BF16_BITS: tl.constexpr, WIDE: tl.constexpr,
    EVEN: tl.constexpr, NUM_STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PACK: tl.constexpr = False,
):
    """``y``/``y_t`` (uint8 views), ``amax`` (int32 view of a 0-d fp32) and a 2-element int32 workspace
    ``ws`` = (running max bits, programs done) that is zero on entry and left zero on exit; ``MW`` = M // 4
    (used with ``PACK`` only; a separate argument so Triton sees when it is a multiple of 16). With
    ``X_BF16_BITS``, ``x`` is a bf16 tensor passed as its int16 view.

    ``PACK`` (needs M % 4 == 0; ``yt_ptr`` is then the int32 view of y_t's storage, ``(K, M // 4)``): the
    tile is read as four blocks of rows ``4i + j`` (j = 0..3), each block in the same register layout, so
    the four codes of rows ``4i..4i+3`` of a column sit in one thread and pack into the little-endian
    int32 word that y_t holds there, with no data movement. Only those words (4x fewer elements than
    bytes) go through the layout change to y_t's contiguous dimension, and y_t leaves as 16-byte stores of
    words. Without ``PACK`` the byte tile itself is stored with transposed pointers and Triton moves bytes.
    """
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
    # Every program adds its maximum before it counts itself done (release); the program that counts last
    # (acquire) therefore reads the maximum over all tiles, and resets the workspace for the next launch.
    tl.atomic_max(ws_ptr, tl.max(run_max, 0), sem="relaxed")
    done = tl.atomic_add(ws_ptr + 1, 1, sem="acq_rel")
    if done == n_programs - 1:
        total = tl.atomic_xchg(ws_ptr, 0, sem="acq_rel")
        tl.store(amax_ptr, total)
        tl.atomic_xchg(ws_ptr + 1, 0, sem="relaxed")
