"""GPU-only tests of safeops.merge_attention: the compiled Triton merge kernels on CUDA, at real sizes.

- against a float64 merge written here from the definition, fp16/bf16/fp32, head dims 64..256 and one
  that is not a power of two, 2..8 partials, forward and gradients (contract sections 2 and 3);
- split-KV attention (safeops.attention on disjoint key blocks, some fully masked for some queries)
  merged, against safeops.attention over all keys (section 4 at scale);
- bit-level properties: deterministic, batch-invariant (a row alone = the row in a batch), stacked = list =
  non-contiguous stack, empty partials change no bit, eager == torch.compile (section 6);
- all-empty rows, NaN outputs of empty partials, lses near 1e11 (sections 4, 5).
- element offsets past 2**31 (a strided stack read in place: the 64-bit offset kernels, section 8).

``SAFEOPS_GPU_SMALL=1`` shrinks the shapes. Random inputs come from a seed Hypothesis draws (profiles in
tests/conftest.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import safeops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
SMALL = os.environ.get("SAFEOPS_GPU_SMALL", "0").strip() not in ("", "0")
NEG_INF = float("-inf")
F64 = torch.float64
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (B, H, S) of the rows; head dims.
ROWS = (1, 4, 512) if SMALL else (2, 16, 4096)
HEAD_DIMS = (64, 128) if SMALL else (64, 80, 128, 256)
U32 = torch.finfo(torch.float32).eps / 2


@pytest.fixture(autouse=True)
def _compiled_kernels_on_cuda(monkeypatch):
    monkeypatch.setenv("SAFEOPS_BACKEND", "auto")


def _gen(seed: int) -> torch.Generator:
    """The CUDA generator of a drawn seed (``@given(seed=SEEDS)``; the falsifying example prints it)."""
    return torch.Generator(device=DEV).manual_seed(seed)


SEEDS = st.integers(0, 2**31 - 1)


def _randn(gen, *shape, dtype=torch.float32, std=1.0):
    return (torch.randn(shape, generator=gen, device=DEV, dtype=torch.float32) * std).to(dtype)


def _naive64(outs, lses):
    """float64 merge from the definition. The max is subtracted first (exact: differences of fp32 values) and
    the weights come from ``z - logsumexp(z)``: with lses near 1e11, ``logsumexp(lses)`` itself is only
    resolved to float64's spacing there (2**-16), which would put 8e-6 relative errors into the weights."""
    lses64 = lses.to(F64)
    m = lses64.detach().amax(0)
    z = lses64 - torch.where(m == NEG_INF, torch.zeros_like(m), m)
    lse_z = torch.logsumexp(z, 0)
    w = torch.exp(z - lse_z)
    w = torch.where(lses == NEG_INF, torch.zeros_like(w), w)
    out = (w.unsqueeze(-1) * outs.to(F64)).sum(0)
    return out, torch.where(m == NEG_INF, m, m + lse_z)


# Error bounds against the float64 merge, derived from what the compiled kernel runs on sm_90 (its PTX:
# tl.exp is ``mul.rn.f32`` by log2(e) then ``ex2.approx.f32``; 1 / s is ``div.full.f32``; log(s) is computed
# in fp64 and rounded once to fp32; fp16/bf16 outputs are stored through ``cvt.rn``). In units of U32, with
# t_i = lse_i - M <= 0, s = sum_i exp(t_i) >= 1 (the max partial has t = 0), a_i = exp(t_i) / s, and
# omax = max_i |o_i| per element:
# - a weight exp(t_i) is off by at most (4 + 3|t_i|) relative: ex2.approx is within 2 ulp of 2**y (PTX ISA;
#   2 ulp <= 2**-22 relative = 4 U32), and the roundings of t_i, of the fp32 log2(e) and of t_i * log2(e)
#   each scale exp(t_i) by up to |t_i| U32. As a_i <= exp(t_i) and |t| exp(-|t|) <= 1/e,
#   sum_i a_i |err_i| <= 4 + 3(p - 1)/e <= 4 + 1.11(p - 1);
# - out = sum_i a_i o_i: the weight errors move this weighted mean by sum_i a_i err_i (o_i - out), and
#   |o_i - out| <= 2 omax, so 8 + 2.22(p - 1); the products 1, the p-term sum p - 1, the p - 1 additions of
#   s p - 1, div.full 2 ulp = 4, the final multiply 1: at most 9.8 + 4.2p <= 5p + 10, times omax. Then the
#   rounding to the output dtype: half an ulp (one ulp is allowed: "about one ulp"), and below fp16's
#   smallest normal (6.1e-5), where the spacing is a fixed subnormal step and eps * |out| no longer covers
#   half of it, one subnormal step (p = 2 merges of two small outputs land there a few times per 10**7);
# - lse = fp32(M + fp32(log s)): the two roundings |lse| + log p, plus the relative error of s,
#   4 + 1.11(p - 1) + (p - 1): at most |lse| + 3p + 2 (log p <= p - 1); the bound doubles the |lse| term.
# The reference backend (torch's expf, IEEE division, logf on CUDA) fits the same model.
def _bounds(ref_out, ref_lse, outs, dtype):
    """(out bound, lse bound) of a merge of ``outs`` (P, ..., D) against the float64 merge (see above)."""
    p = outs.shape[0]
    info = torch.finfo(dtype)
    omax = outs.abs().to(F64).amax(0)
    rounding = (info.eps / 2 if dtype == torch.float32 else info.eps) * ref_out.abs()
    out_bound = rounding + info.smallest_normal * info.eps + (5 * p + 10) * U32 * omax
    lse_bound = U32 * (2 * ref_lse.abs() + 3 * p + 4)
    return out_bound, lse_bound


def _assert_merge_close(out, lse, outs, lses, what=""):
    """Empty rows exact (0, -inf), no NaN, out and lse within :func:`_bounds` of the float64 merge."""
    ref_out, ref_lse = _naive64(outs, lses)
    empty = torch.isinf(ref_lse)
    assert torch.equal(out[empty], torch.zeros_like(out[empty])), what
    assert (lse[empty] == NEG_INF).all(), what
    assert not out.isnan().any() and not lse.isnan().any(), what
    out_bound, lse_bound = _bounds(ref_out, ref_lse, outs, out.dtype)
    err = (out.to(F64) - ref_out).abs()
    worst = (err / out_bound).max().item()
    assert (err <= out_bound).all(), f"{what} out: max err {err.max().item():.3e}, worst ratio {worst:.2f}"
    fin = ~empty
    lse_err = (lse.to(F64)[fin] - ref_lse[fin]).abs()
    worst = (lse_err / lse_bound[fin]).max().item()
    assert (lse_err <= lse_bound[fin]).all(), \
        f"{what} lse: max err {lse_err.max().item():.3e}, worst ratio {worst:.2f}"


def _partials(gen, p, d, dtype, empty_frac=0.1):
    outs = _randn(gen, p, *ROWS, d, dtype=dtype)
    lses = _randn(gen, p, *ROWS, std=5.0)
    drop = torch.rand((p, *ROWS), generator=gen, device=DEV) < empty_frac
    lses = torch.where(drop, torch.full_like(lses, NEG_INF), lses)
    lses[:, 0, 0, :3] = NEG_INF  # a few all-empty rows
    return outs, lses


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("p", [2, 8])
@given(seed=SEEDS)
def test_forward_matches_float64(seed, dtype, d, p):
    gen = _gen(seed)
    outs, lses = _partials(gen, p, d, dtype)
    out, lse = safeops.merge_attention(outs, lses)
    _assert_merge_close(out, lse, outs, lses)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@given(seed=SEEDS)
def test_gradients_match_float64(seed, dtype, d):
    gen = _gen(seed)
    p = 4
    outs, lses = _partials(gen, p, d, dtype)
    outs.requires_grad_(True)
    lses.requires_grad_(True)
    g_out, g_lse = _randn(gen, *ROWS, d, dtype=dtype), _randn(gen, *ROWS)
    out, lse = safeops.merge_attention(outs, lses)
    d_outs, d_lses = torch.autograd.grad([out, lse], [outs, lses], [g_out, g_lse])
    assert torch.isfinite(d_outs).all() and torch.isfinite(d_lses).all()

    o64 = outs.detach().to(F64).requires_grad_(True)
    l64 = lses.detach().to(F64).requires_grad_(True)
    r_out, r_lse = _naive64(o64, l64)
    fin = torch.isfinite(r_lse)
    r_out = torch.where(fin.unsqueeze(-1), r_out, torch.zeros_like(r_out))
    r_lse = torch.where(fin, r_lse, torch.zeros_like(r_lse))
    r_do, r_dl = torch.autograd.grad([r_out, r_lse], [o64, l64], [g_out.to(F64), g_lse.to(F64)])
    r_do, r_dl = r_do.nan_to_num(0.0), r_dl.nan_to_num(0.0)
    excluded = lses.detach() == NEG_INF
    assert (d_outs[excluded] == 0).all() and (d_lses[excluded] == 0).all()
    finfo = torch.finfo(dtype)
    bound_o = finfo.eps * r_do.abs() + 8 * U32 * g_out.abs().to(F64) + 2 * finfo.smallest_normal * finfo.eps
    assert ((d_outs.to(F64) - r_do).abs() <= bound_o).all()
    scale = outs.detach().abs().to(F64).amax(0).amax(-1) * g_out.abs().to(F64).amax(-1) * d + g_lse.abs()
    bound_l = 16 * U32 * scale.unsqueeze(0) + 1e-30
    assert ((d_lses.to(F64) - r_dl).abs() <= bound_l).all()


@given(seed=SEEDS)
def test_split_kv_attention_matches_full(seed):
    """Attention over 4 key blocks (some fully masked for some queries), merged = attention over all keys."""
    gen = _gen(seed)
    b, h, sq, sk, d = (1, 4, 256, 1024, 128) if SMALL else (2, 16, 2048, 8192, 128)
    q, k, v = (_randn(gen, b, h, s, d, dtype=torch.bfloat16) for s in (sq, sk, sk))
    mask = torch.rand((b, 1, sq, sk), generator=gen, device=DEV) < 0.9
    mask[:, :, : sq // 4, : sk // 4] = False  # the first block is empty for the first queries
    full, full_lse = safeops.attention(q, k, v, attn_mask=mask, return_lse=True)
    outs, lses = [], []
    for blk in torch.arange(sk, device=DEV).chunk(4):
        o, lse = safeops.attention(q, k[:, :, blk], v[:, :, blk], attn_mask=mask[..., blk], return_lse=True)
        outs.append(o)
        lses.append(lse)
    out, lse = safeops.merge_attention(outs, lses)
    eps = torch.finfo(torch.bfloat16).eps
    vmax = v.abs().float().amax()
    assert (out.float() - full.float()).abs().max() <= 3 * eps * vmax
    assert ((lse - full_lse).abs() <= 64 * U32 * (full_lse.abs() + 1)).all()


@given(seed=SEEDS)
def test_bits_deterministic_batch_invariant_and_layouts(seed):
    gen = _gen(seed)
    outs, lses = _partials(gen, 4, 128, torch.bfloat16)
    a = safeops.merge_attention(outs, lses)
    b = safeops.merge_attention(outs, lses)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # One batch row alone and a slice of rows: the same bits.
    row = (slice(None), slice(1, 2), slice(3, 4), slice(100, 101))
    one = safeops.merge_attention(outs[row].contiguous(), lses[row].contiguous())
    assert torch.equal(one[0], a[0][1:2, 3:4, 100:101]) and torch.equal(one[1], a[1][1:2, 3:4, 100:101])
    # A list, and a stack with the partials dim innermost in memory.
    c = safeops.merge_attention(list(outs.unbind(0)), list(lses.unbind(0)))
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
    outs_t = outs.permute(1, 2, 3, 4, 0).contiguous().permute(4, 0, 1, 2, 3)
    lses_t = lses.permute(1, 2, 3, 0).contiguous().permute(3, 0, 1, 2)
    e = safeops.merge_attention(outs_t, lses_t)
    assert torch.equal(a[0], e[0]) and torch.equal(a[1], e[1])


@given(seed=SEEDS)
def test_empty_partials_change_no_bit(seed):
    gen = _gen(seed)
    outs, lses = _partials(gen, 3, 128, torch.float16, empty_frac=0.0)
    base = safeops.merge_attention(outs, lses)
    nan_out = torch.full_like(outs[:1], float("nan"))
    empty = torch.full_like(lses[:1], NEG_INF)
    more = safeops.merge_attention(torch.cat([outs[:1], nan_out, outs[1:], nan_out]),
                                   torch.cat([lses[:1], empty, lses[1:], empty]))
    assert torch.equal(base[0], more[0]) and torch.equal(base[1], more[1])


@given(seed=SEEDS)
def test_huge_lses(seed):
    gen = _gen(seed)
    outs = _randn(gen, 4, *ROWS, 128)
    steps = torch.randint(-3, 1, (4, *ROWS), generator=gen, device=DEV).to(torch.float32)
    lses = 1e11 + 8192.0 * steps
    out, lse = safeops.merge_attention(outs, lses)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # The lse differences are 0 or <= -8192 (exact in fp32), so the weights are exactly 1 or 0.
    _assert_merge_close(out, lse, outs, lses, "lses near 1e11:")
    # log(s) <= log(4) is far below half the fp32 spacing (8192) at 1e11: the merged lse rounds to the max.
    assert torch.equal(lse, lses.amax(0))
    values = torch.stack([torch.full((8, 128), float(i), device=DEV) for i in range(4)])
    same = safeops.merge_attention(values, torch.full((4, 8), 1e11, device=DEV))
    assert torch.equal(same[0], torch.full((8, 128), 1.5, device=DEV))


@given(seed=SEEDS)
def test_eager_equals_compiled(seed):
    gen = _gen(seed)
    outs, lses = _partials(gen, 3, 128, torch.bfloat16)
    eager = safeops.merge_attention(outs, lses)
    compiled = torch.compile(lambda o, lse: safeops.merge_attention(o, lse), fullgraph=True)(outs, lses)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


@given(seed=SEEDS)
def test_reference_agrees(seed, monkeypatch):
    """The kernel and the reference (torch ops on CUDA) both within the float64 merge's bounds, hence within
    twice those of each other. (Not a relative check between the two: near lse = M + log(s) = 0, absolute
    errors of a few U32, from ex2.approx against torch's expf and the roundings of log(s), are large relative
    ones.)"""
    gen = _gen(seed)
    outs, lses = _partials(gen, 4, 96, torch.float32)
    kernel = safeops.merge_attention(outs, lses)
    monkeypatch.setenv("SAFEOPS_BACKEND", "reference")
    ref = safeops.merge_attention(outs, lses)
    _assert_merge_close(*kernel, outs, lses, "kernel:")
    _assert_merge_close(*ref, outs, lses, "reference:")


@pytest.mark.parametrize("wide", [
    pytest.param(False, id="head-dim-stride-32bit"),
    pytest.param(True, id="offsets-past-2-31",
                 marks=pytest.mark.skipif(SMALL, reason="SAFEOPS_GPU_SMALL: a 4.3 GB buffer (too slow under "
                                                        "compute-sanitizer)")),
])
@given(seed=SEEDS)
def test_strided_stack_same_bits(seed, wide):
    """Contract sections 6 and 8: a stack and an incoming gradient whose head dim is their outermost
    dimension (head-dim stride ``stride``, rows contiguous) give, forward and backward, the same bits as
    their contiguous copies, and a slice of rows matches the float64 merge. ``offsets-past-2-31``: the
    stride puts element offsets past 2**31 ((d - 1) * stride >= 2**31, one 4.3 GB bf16 buffer), so the
    kernels address the head dim in 64 bits (WIDE); ``head-dim-stride-32bit``: the same layout with a
    small stride, 32-bit kernels. Both layouts make Triton lay the tiles out along rows, where the
    contiguous copy is laid out along the head dim: the lse gradient's dot product must not depend on
    that (on the H200, ``tl.sum`` there gave 15-18% of rows a different last bit)."""
    gen = _gen(seed)
    from safeops.ops import merge_launch

    p, d = 2, 64
    r = 2**22 if wide else (4096 if SMALL else 2**20)
    stride = 2**31 // (d - 1) + 1 if wide else (p + 1) * r
    assert ((d - 1) * stride >= 2**31) == wide and (p + 1) * r <= stride  # the two views never overlap
    buf = torch.empty((d - 1) * stride + (p + 1) * r, dtype=torch.bfloat16, device=DEV)
    outs = buf.as_strided((p, r, d), (r, 1, stride))
    g_out = buf.as_strided((r, d), (1, stride), p * r)
    outs.copy_(_randn(gen, p, r, d, dtype=torch.bfloat16))
    g_out.copy_(_randn(gen, r, d, dtype=torch.bfloat16))
    lses = _randn(gen, p, r, std=5.0)
    lses[0, ::7] = NEG_INF
    lses[:, 3] = NEG_INF  # an all-empty row
    g_lse = _randn(gen, r)
    outs_c, g_out_c = outs.contiguous(), g_out.contiguous()
    assert merge_launch._wide(d, outs.stride(2)) == wide and merge_launch._wide(d, g_out.stride(1)) == wide
    assert not merge_launch._wide(d, outs_c.stride(2), g_out_c.stride(1))

    strided = safeops.merge_attention(outs, lses)
    narrow = safeops.merge_attention(outs_c, lses)
    assert torch.equal(strided[0], narrow[0]) and torch.equal(strided[1], narrow[1])
    rows = slice(0, 8192)
    _assert_merge_close(strided[0][rows], strided[1][rows], outs_c[:, rows], lses[:, rows], "strided stack:")
    bwd = torch.ops.safeops.merge_attention_backward.default
    for glse in (g_lse, None):
        d_strided = bwd(g_out, glse, outs, lses)
        d_narrow = bwd(g_out_c, glse, outs_c, lses)
        assert torch.equal(d_strided[0], d_narrow[0]), "d outs differ from the contiguous run"
        assert torch.equal(d_strided[1], d_narrow[1]), (
            f"d lses: {int((d_strided[1] != d_narrow[1]).sum())} of {d_narrow[1].numel()} differ from the "
            "contiguous run")
    del buf, outs, g_out
