"""The fp8 cast + transpose's memory pattern with no arithmetic: a bound for bench/cast_transpose.py.

``pattern_kernel`` reads a 2-byte (M, K) tensor once and writes one byte per element twice: ``y`` row-major
(M, K) and ``y_t`` column-major (its (K, M) storage), i.e. the same bytes, in the same layouts, as
``safeops.cast_transpose``. The byte it writes is the input's high byte (no scale, clamp, rounding, NaN
rule or amax), so what it reaches is what the access pattern allows: a same-shape ``x.clone()`` moves the
same bytes but in one linear stream each way, and ``x.t().contiguous()`` is torch's transposing copy.

``best_pattern`` times every tile in ``PATTERN_TILES`` at a shape (one program per tile, tiles numbered
along K or along M) and returns the fastest, after checking its bytes. Not part of the package.
"""

from __future__ import annotations

import triton
import triton.language as tl

# (BLOCK_M, BLOCK_K, num_warps): 64-256 rows x 64-128 columns, 4 or 8 warps (the shipped kernel's tile
# is 128 x 64 on 4 warps).
PATTERN_TILES = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 4), (128, 128, 8), (256, 64, 8),
                 (128, 64, 8), (256, 128, 8)]


@triton.jit
def pattern_kernel(x_ptr, y_ptr, yt_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   M_FAST: tl.constexpr):
    """One (BLOCK_M, BLOCK_K) tile per program; M % BLOCK_M == 0 and K % BLOCK_K == 0 (no masks, as a
    bound should not pay for them)."""
    pid = tl.program_id(0)
    if M_FAST:
        n_m = M // BLOCK_M
        pm = pid % n_m
        pk = pid // n_m
    else:
        n_k = K // BLOCK_K
        pm = pid // n_k
        pk = pid % n_k
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + rm[:, None] * K + rk[None, :])
    b = (x.to(tl.uint16, bitcast=True) >> 8).to(tl.uint8)
    tl.store(y_ptr + rm[:, None] * K + rk[None, :], b)
    tl.store(yt_ptr + rk[:, None] * M + rm[None, :], tl.trans(b))


def tiles_for(m: int, k: int) -> list[tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_K, warps, m_fast) candidates that divide (m, k)."""
    return [(bm, bk, w, mf) for bm, bk, w in PATTERN_TILES if m % bm == 0 and k % bk == 0 for mf in (0, 1)]


def launch(x, y, y_t, tile) -> None:
    bm, bk, warps, m_fast = tile
    m, k = x.shape
    pattern_kernel[((m // bm) * (k // bk),)](x, y, y_t, m, k, BLOCK_M=bm, BLOCK_K=bk, M_FAST=m_fast,
                                            num_warps=warps)


def expected(x):
    """(y, y_t storage) the kernel must write: the high byte of each 2-byte element."""
    import torch

    hi = (x.view(torch.int16) >> 8).to(torch.uint8)
    return hi, hi.t().contiguous()


def check(x, tile) -> str | None:
    """None when the kernel at ``tile`` writes exactly ``expected(x)``."""
    import torch

    m, k = x.shape
    y = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    y_t = torch.empty(k, m, dtype=torch.uint8, device=x.device)
    launch(x, y, y_t, tile)
    want_y, want_t = expected(x)
    for name, got, want in (("y", y, want_y), ("y_t", y_t, want_t)):
        if not torch.equal(got, want):
            return f"{name}: {int((got != want).sum())} of {got.numel()} bytes differ"
    return None


def best_pattern(x, time_ms) -> tuple[tuple, float]:
    """(tile, ms) of the fastest checked tile for x's shape; ``time_ms(fn)`` times a callable."""
    import torch

    m, k = x.shape
    y = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    y_t = torch.empty(k, m, dtype=torch.uint8, device=x.device)
    best = None
    for tile in tiles_for(m, k):
        if check(x, tile) is not None:
            continue
        ms = time_ms(lambda tile=tile: launch(x, y, y_t, tile))
        if best is None or ms < best[1]:
            best = (tile, ms)
    if best is None:
        raise ValueError(f"no tile of PATTERN_TILES divides {m} x {k} and writes the right bytes")
    return best
