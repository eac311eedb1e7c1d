"""The GQA split's sum (``attention_launch.split_sum``, kernel ``attn_bwd_split_sum_kernel``).

When the dk/dv kernel splits a kv head's query group over SPLIT programs, each writes an fp32 partial; one
launch adds each kv head's SPLIT partials in a fixed order (j = 0, 1, ... from +0) and rounds once to dk's /
dv's dtype and layout. Checked here, against an fp32 emulation of that order written with torch adds and
against a float64 sum, on dense (contiguous and (B, S, H, D)-transposed) and packed layouts, splits 2 to 8,
unequal and padded head dims, signed zeros and partials that cancel, for fp32, fp16 and bf16 results under
the interpreter (the kernel rounds through ``safeops.kernels.convert.cast``, exact there) and on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from strategies import seeds

from safeops.ops import attention_launch as L


def make_case(b, hkv, s, d, dv, split, dtype, device, varlen, layout="bhsd", seed=0, signed_zeros=False):
    """(dk_part, dv_part, dk, dv): random fp32 partials, contiguous as the launcher allocates them, and empty
    results of ``dtype`` ("bshd": a (B, S, H, D) tensor transposed, as a transformers model's k / v)."""
    gen = torch.Generator().manual_seed(seed)

    def part(dim):
        shape = (b * s, hkv * split, dim) if varlen else (b, hkv * split, s, dim)
        x = torch.randn(shape, generator=gen) * 3.0
        # a wide spread of exponents makes the order of the adds visible in the low bits
        x = x * torch.exp2(torch.randint(-12, 13, shape, generator=gen).float())
        if signed_zeros:  # columns [0, c): +-0 in every partial; [c, 2c): second half = -first half
            grp = x.view(b * s, hkv, split, dim) if varlen else x.view(b, hkv, split, s, dim)
            c = max(1, dim // 8)
            grp[..., :c] = torch.where(torch.rand(grp[..., :c].shape, generator=gen) < 0.5, 0.0, -0.0)
            half = split // 2
            grp[:, :, split - half:][..., c:2 * c] = -grp[:, :, :half][..., c:2 * c]
        return x.to(device)

    def result(dim):
        if varlen:
            return torch.empty(b * s, hkv, dim, dtype=dtype, device=device)
        if layout == "bshd":
            return torch.empty(b, s, hkv, dim, dtype=dtype, device=device).transpose(1, 2)
        return torch.empty(b, hkv, s, dim, dtype=dtype, device=device)

    return part(d), part(dv), result(d), result(dv)


def _groups(part, split, varlen):
    """The partials with the split as dim 2: (T, Hkv, split, D) packed, (B, Hkv, split, S, D) dense."""
    if varlen:
        t, h, d = part.shape
        return part.view(t, h // split, split, d)
    b, h, s, d = part.shape
    return part.view(b, h // split, split, s, d)


def emulate(part, split, varlen, dtype):
    """fp32 adds in the kernel's order, from +0, then one rounding to ``dtype``."""
    x, dim = _groups(part, split, varlen), 2
    acc = torch.zeros_like(x.select(dim, 0))
    for j in range(split):
        acc = acc + x.select(dim, j)
    return acc.to(dtype)


def same_bits(a, b) -> bool:
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.contiguous().view(view), b.contiguous().view(view))


# (B, Hkv, S, D, DV, split, varlen, layout): rows not a multiple of the block, padded / unequal head dims
CASES = [(2, 2, 24, 16, 16, 2, False, "bhsd"), (1, 2, 40, 32, 32, 4, False, "bshd"),
         (1, 1, 33, 24, 40, 8, False, "bhsd"), (2, 2, 20, 16, 16, 3, True, "bhsd"),
         (1, 2, 17, 16, 32, 8, True, "bhsd"), (1, 1, 8, 16, 16, 6, False, "bhsd")]


def _check(device, dtypes, seed):
    for i, (b, hkv, s, d, dv, split, varlen, layout) in enumerate(CASES):
        for dtype in dtypes:
            for zeros in (False, True):
                dkp, dvp, dk, dvt = make_case(b, hkv, s, d, dv, split, dtype, device, varlen, layout,
                                              seed=seed + i, signed_zeros=zeros)
                L.split_sum(dkp, dvp, dk, dvt, split, varlen, None)
                for name, got, part in (("dk", dk, dkp), ("dv", dvt, dvp)):
                    want = emulate(part, split, varlen, dtype)
                    label = f"{name} case {i} {dtype} zeros={zeros} seed={seed}"
                    assert same_bits(got, want), label
                    # and it is a sum of the partials: within (split - 1) u sum|x| of the float64 sum,
                    # plus the final rounding
                    x, dim = _groups(part.double(), split, varlen), 2
                    exact = x.sum(dim)
                    bound = ((split - 1) * 2.0**-24 * x.abs().sum(dim) + exact.abs() * torch.finfo(dtype).eps
                             + torch.finfo(dtype).tiny)
                    fi = torch.finfo(dtype)
                    close = (got.double() - exact).abs() <= bound
                    overflow = torch.isinf(got) & (exact.abs() >= fi.max) & (torch.sign(got) == exact.sign())
                    assert (close | overflow).all(), label
                    if zeros:  # +-0 everywhere: +0, as adds from +0 give
                        c = max(1, got.shape[-1] // 8)
                        assert (got[..., :c] == 0).all() and not torch.signbit(got[..., :c]).any(), label


@given(seed=seeds())
def test_split_sum_bits_interpreter(triton_backend, seed):
    _check("cpu", (torch.float32, torch.float16, torch.bfloat16), seed.value)


@given(seed=seeds())
def test_split_sum_order_is_visible(seed):
    """The emulated order is not any order: adding the partials last to first changes bits at split 8."""
    dkp, _, _, _ = make_case(1, 2, 64, 32, 32, 8, torch.float32, "cpu", False, seed=seed.value)
    x, dim = _groups(dkp, 8, False), 2
    backwards = torch.zeros_like(x.select(dim, 0))
    for j in reversed(range(8)):
        backwards = backwards + x.select(dim, j)
    assert not same_bits(backwards, emulate(dkp, 8, False, torch.float32))


@pytest.mark.gpu
@given(seed=seeds())
def test_split_sum_bits_gpu(seed):
    _check("cuda", (torch.float32, torch.float16, torch.bfloat16), seed.value)
