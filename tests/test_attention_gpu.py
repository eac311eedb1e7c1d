"""GPU-only tests of safeops.attention / attention_varlen: the compiled kernels on CUDA, with the shipped
path choice (on an sm_90 GPU the forwards and backwards the Gluon kernels take run them, as
``safeops.attention_backend`` says, the rest the Triton kernels; tests/test_attention_gluon_gpu.py and
tests/test_attention_gluon_bwd_gpu.py test the Gluon kernels themselves).

Skipped without a CUDA device. What CPU CI cannot check (the interpreter ignores ``enable_fp_fusion``, has
no bf16 math and runs tiny blocks):

- every option against the float64 oracle (tests/oracle.py) at real sizes, bf16 / fp16 / fp32 in each
  precision mode (sections 1, 2, 7);
- bit-level checks: the largest score gets p exactly 1 (the output is exactly that key's v), fully
  masked rows are exactly 0 / -inf with zero dq, deterministic bits across runs, batch invariance and
  varlen == dense bits, eager == torch.compile bits (sections 1, 4, 6);
- the fp-fusion regression: with ``safeops._config.fp_fusion = True`` the huge-equal-score case breaks
  (so the test can see contraction), with it off it is exact; the test FAILS if fusion-on stops breaking it;
- fp16 inputs with |q.k| > 65504 stay finite; NaN at excluded keys does not leak (section 5);
- TF32: ``precision="tf32"`` errs like cuBLAS's TF32 matmul and less than truncation (section 7).

Random inputs come from Hypothesis (a drawn seed, see tests/conftest.py for the profiles); a failure prints
the ``Rng(n)`` that replays it.
"""

from __future__ import annotations

import math

import oracle
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import safeops
from safeops import _config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
NEG_INF = float("-inf")
F64 = torch.float64


class Rng:
    """A drawn seed and a CUDA generator on it (``rngs()``); ``Rng(n)`` in a falsifying example replays it."""

    def __init__(self, value: int):
        self.value = value
        self.gen = torch.Generator(device=DEV).manual_seed(value)

    def __str__(self):
        return f"seed={self.value}"

    def __repr__(self):
        return f"Rng({self.value})"

    def randn(self, *shape, dtype=torch.float32, std=1.0):
        return (torch.randn(shape, generator=self.gen, device=DEV) * std).to(dtype)


def seeded_rng(request) -> Rng:
    """A fixed seed per test (the same every run) for the GPU files' ``rng`` fixtures: the node name's crc32,
    shifted by ``SAFEOPS_GPU_SEED=n`` (how a test is run for fresh seeds before it lands)."""
    import os
    import zlib

    return Rng(zlib.crc32(request.node.name.encode()) + int(os.environ.get("SAFEOPS_GPU_SEED", "0")))


def rngs():
    return st.integers(0, 2**31 - 1).map(Rng)


@pytest.fixture(autouse=True)
def _shipped_settings(monkeypatch):
    monkeypatch.setenv("SAFEOPS_BACKEND", "auto")
    monkeypatch.delenv("SAFEOPS_GLUON", raising=False)
    assert _config.fp_fusion is False, "safeops._config.fp_fusion must be False (the shipped setting)"


def _run(q, k, v, g=None, **options):
    q_, k_, v_ = (t.detach().clone().requires_grad_(g is not None) for t in (q, k, v))
    out, lse = safeops.attention(q_, k_, v_, return_lse=True, **options)
    if g is None:
        return out.detach(), lse.detach(), None, None, None
    out.backward(g)
    return out.detach(), lse.detach(), q_.grad, k_.grad, v_.grad


def _cpu(t):
    return t if not isinstance(t, torch.Tensor) else t.detach().cpu()


def check_oracle(q, k, v, rng, grads=True, **options):
    g = rng.randn(*q.shape[:3], v.shape[-1], dtype=q.dtype) if grads else None
    out, lse, dq, dk, dv = _run(q, k, v, g, **options)
    oo = {n: _cpu(options[n]) for n in ("attn_mask", "is_causal", "scale", "softcap", "window", "precision")
          if n in options}
    qc, kc, vc = _cpu(q), _cpu(k), _cpu(v)
    shown = {n: (tuple(o.shape) if isinstance(o, torch.Tensor) else o) for n, o in options.items()}
    ctx = f"{rng}; {shown}"
    if grads:
        r, eq, ek, ev = oracle.attention_gradients(qc, kc, vc, _cpu(g), **oo)
    else:
        r = oracle.attention(qc, kc, vc, **oo)
    b = oracle.attention_bounds(r, qc, _cpu(g), scale=options.get("scale"), softcap=options.get("softcap"),
                                precision=options.get("precision"))
    oracle.assert_close(out.cpu(), r.out.detach(), b[0], "out", ctx)
    oracle.assert_close(lse.cpu(), r.lse.detach(), b[1], "lse", ctx)
    if grads:
        hkv = k.shape[1]
        oracle.assert_close(dq.cpu(), eq, oracle.add_rounding(b[2], eq, q.dtype), "dq", ctx)
        oracle.assert_close(dk.cpu(), ek, oracle.add_rounding(oracle.reduce_kv_bound(b[3], hkv), ek, k.dtype),
                            "dk", ctx)
        oracle.assert_close(dv.cpu(), ev, oracle.add_rounding(oracle.reduce_kv_bound(b[4], hkv), ev, v.dtype),
                            "dv", ctx)
    return out, lse, dq, dk, dv


OPTIONS = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "window": dict(window=(100, 17)),
    "causal_window": dict(is_causal=True, window=(129, None)),
    "softcap": dict(softcap=30.0, scale=0.2),
    "bool_mask": dict(attn_mask="bool"),
    "additive_mask": dict(attn_mask="add"),
    "everything": dict(attn_mask="add", is_causal=True, window=(200, None), softcap=20.0),
}
DTYPES = [pytest.param(torch.bfloat16, None, id="bf16"), pytest.param(torch.float16, None, id="fp16")] + [
    pytest.param(torch.float32, p, id=f"fp32-{p}") for p in ("ieee", "tf32", "tf32x3")]


def _mask(kind, rng, b, hq, sq, sk):
    if kind == "bool":
        m = torch.rand(b, 1, sq, sk, device=DEV, generator=rng.gen) < 0.8
        m[..., 7, :] = False
        return m
    m = rng.randn(1, hq, sq, sk)
    m[..., 9, :] = NEG_INF
    m[..., 3] = NEG_INF
    return m


def _oracle_case(case, dtype, precision, d, rng):
    b, hq, hkv, sq, sk = 2, 4, 2, 300, 333
    q, k, v = rng.randn(b, hq, sq, d, dtype=dtype), rng.randn(b, hkv, sk, d, dtype=dtype), \
        rng.randn(b, hkv, sk, d, dtype=dtype)
    options = dict(OPTIONS[case])
    if "attn_mask" in options:
        options["attn_mask"] = _mask(options["attn_mask"], rng, b, hq, sq, sk)
    if precision is not None:
        options["precision"] = precision
    check_oracle(q, k, v, rng, **options)


# Every distinct combination of options compiles its own kernels (seconds each on first use), so the
# matrix is every option in bf16 at D=128, and every dtype / precision on two option sets at D=64.
@pytest.mark.parametrize("case", list(OPTIONS))
@given(rng=rngs())
def test_options_match_oracle(case, rng):
    _oracle_case(case, torch.bfloat16, None, 128, rng)


@pytest.mark.parametrize("dtype,precision", DTYPES)
@pytest.mark.parametrize("case", ["plain", "everything"])
@given(rng=rngs())
def test_dtypes_match_oracle(case, dtype, precision, rng):
    _oracle_case(case, dtype, precision, 64, rng)


# (B, Hq, Sq, Sk, D, group): decoding, long GQA, Sq < Sk, D = 256 with Sq > Sk, D = 40.
@pytest.mark.parametrize("shape", [(1, 8, 1, 5000, 128, 1), (1, 4, 2048, 2048, 64, 4),
                                   (3, 2, 77, 1500, 96, 2), (2, 2, 129, 65, 256, 1), (1, 4, 100, 100, 40, 4)])
@given(rng=rngs())
def test_shapes_match_oracle(shape, rng):
    b, hq, sq, sk, d, group = shape
    q = rng.randn(b, hq, sq, d, dtype=torch.bfloat16)
    k, v = (rng.randn(b, hq // group, sk, d, dtype=torch.bfloat16) for _ in range(2))
    check_oracle(q, k, v, rng, is_causal=sq > 1 and sq <= sk)


@given(rng=rngs())
def test_largest_score_gets_exactly_one(rng):
    """One key dominates every row by ~60 (natural units): the output is exactly that key's v (p == 1)."""
    b, h, s, d = 1, 2, 257, 64
    q = rng.randn(b, h, s, d, dtype=torch.bfloat16)
    k = rng.randn(b, h, s, d, dtype=torch.bfloat16)
    v = rng.randn(b, h, s, d, dtype=torch.bfloat16)
    q[..., 0] = 8.0
    k[..., 0] = 0.0
    k[:, :, 100] = 0.0
    k[:, :, 100, 0] = 64.0  # q_i . k_100 = 512 exactly; other scores are O(sqrt(d))
    for options in (dict(), dict(is_causal=False, window=(None, None)), dict(softcap=200.0)):
        out, lse, *_ = _run(q, k, v, **options)
        expected = v[:, :, 100:101].expand_as(out)
        assert torch.equal(out, expected), f"output is not exactly v of the dominating key ({options}); {rng}"


@given(rng=rngs())
def test_fully_masked_rows_exact(rng):
    b, h, s, d = 2, 4, 300, 64
    q, k, v = (rng.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.rand(b, 1, s, s, device=DEV, generator=rng.gen) < 0.5
    mask[:, :, 10:140] = False
    g = rng.randn(b, h, s, d, dtype=torch.bfloat16)
    out, lse, dq, dk, dv = _run(q, k, v, g, attn_mask=mask)
    empty = ~mask[0, 0].any(-1)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert (lse[:, :, empty] == NEG_INF).all()
    assert torch.equal(dq[:, :, empty], torch.zeros_like(dq[:, :, empty]))
    g2 = g.clone()
    g2[:, :, empty] = 100.0
    _, _, _, dk2, dv2 = _run(q, k, v, g2, attn_mask=mask)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2), "empty rows contributed to dk/dv"
    all_masked = torch.zeros(1, 1, s, s, dtype=torch.bool, device=DEV)
    out, lse, dq, dk, dv = _run(q, k, v, g, attn_mask=all_masked)
    for t in (out, dq, dk, dv):
        assert torch.equal(t, torch.zeros_like(t))


def _equal_huge_scores(dtype=torch.bfloat16, sk=1000, scale=0.180336877703666687):
    """Every score is s = 2**36 * 1.6875 (exact in fp32); z2 = s * fp32(scale * log2 e) rounds."""
    d = 16
    q = torch.zeros(1, 1, 64, d, device=DEV, dtype=dtype)
    k = torch.zeros(1, 1, sk, d, device=DEV, dtype=dtype)
    q[..., 0] = 2.0**18
    k[..., 0] = 2.0**18 * 1.6875
    v = torch.randn(1, 1, sk, d, device=DEV, generator=torch.Generator(device=DEV).manual_seed(0)).to(dtype)
    return q, k, v, scale


def test_equal_huge_scores_exact():
    q, k, v, scale = _equal_huge_scores()
    g = torch.ones(1, 1, 64, 16, device=DEV, dtype=torch.bfloat16)
    out, lse, dq, dk, dv = _run(q, k, v, g, scale=scale)
    mean_v = v.double().mean(2, keepdim=True)
    assert (out.double() - mean_v).abs().max() <= 2**-7 * mean_v.abs().max() + 1e-3
    # dv = sum over queries of p = 64 / 1000 each: the fold-lse bug would make it 1000x bigger.
    assert torch.allclose(dv.double(), torch.full_like(dv.double(), 64 / 1000), rtol=2**-7)


def test_fp_fusion_regression():
    """The hazard is real: with contraction on, z2 - m becomes fma(s, C1, -m) and the equal huge scores
    break (overflow or underflow of exp2 of the product's rounding error); with it off they are exact."""
    broke = []
    for scale in (0.180336877703666687, 0.0883883476483184, 0.125 * 1.1, 0.31):
        q, k, v, _ = _equal_huge_scores(scale=scale)
        safe, *_ = _run(q, k, v, scale=scale)
        mean_v = v.double().mean(2, keepdim=True)
        assert (safe.double() - mean_v).abs().max() <= 2**-7 * mean_v.abs().max() + 1e-3, f"scale {scale}"
        old = _config.fp_fusion
        try:
            _config.fp_fusion = True
            fused, *_ = _run(q, k, v, scale=scale)
        finally:
            _config.fp_fusion = old
        broke.append(not torch.allclose(fused.double(), mean_v.expand_as(fused), rtol=2**-6, atol=1e-3))
    assert any(broke), ("with enable_fp_fusion=True no case broke: this test can no longer see contraction "
                        "coming back (find inputs where fma(s, C1, -m) differs from s * C1 - m)")


@given(rng=rngs())
def test_deterministic_bits(rng):
    q = rng.randn(2, 8, 1000, 128, dtype=torch.bfloat16)
    k, v = (rng.randn(2, 2, 1000, 128, dtype=torch.bfloat16) for _ in range(2))
    g = rng.randn(2, 8, 1000, 128, dtype=torch.bfloat16)
    first = _run(q, k, v, g, is_causal=True)
    for _ in range(3):
        again = _run(q, k, v, g, is_causal=True)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)


@given(rng=rngs())
def test_batch_invariant_bits(rng):
    q, k, v = (rng.randn(5, 4, 700, 64, dtype=torch.bfloat16) for _ in range(3))
    g = rng.randn(5, 4, 700, 64, dtype=torch.bfloat16)
    full = _run(q, k, v, g, is_causal=True)
    alone = _run(q[3:4], k[3:4], v[3:4], g[3:4], is_causal=True)
    for a, b in zip(full, alone, strict=True):
        assert torch.equal(a[3:4], b)


@given(rng=rngs())
def test_varlen_equals_dense_bits(rng):
    lengths = [300, 1, 0, 1029, 64]
    h, d = 4, 128
    seqs = [[rng.randn(1, h, n, d, dtype=torch.bfloat16) for _ in range(3)] for n in lengths]
    packed = [torch.cat([s[i][0].transpose(0, 1) for s in seqs]) for i in range(3)]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=DEV)
    out, lse = safeops.attention_varlen(*packed, cu, cu, is_causal=True, return_lse=True)
    for b in range(len(lengths)):
        o, ls = safeops.attention(*seqs[b], is_causal=True, return_lse=True)
        sl = slice(int(cu[b]), int(cu[b + 1]))
        assert torch.equal(out[sl], o[0].transpose(0, 1)) and torch.equal(lse[:, sl], ls[0]), f"sequence {b}"


@given(rng=rngs())
def test_compiled_equals_eager_bits(rng):
    q, k, v = (rng.randn(2, 4, 500, 64, dtype=torch.bfloat16) for _ in range(3))

    def f(q, k, v):
        return safeops.attention(q, k, v, is_causal=True, softcap=30.0)

    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(q, k, v), f(q, k, v))


@given(rng=rngs())
def test_fp16_scores_beyond_fp16_range(rng):
    q = rng.randn(1, 2, 200, 64, dtype=torch.float16, std=40.0)
    k = rng.randn(1, 2, 200, 64, dtype=torch.float16, std=40.0)
    v = rng.randn(1, 2, 200, 64, dtype=torch.float16)
    # Random scores reach ~5e4; plant one pair whose score is 64 * 40 * 40 = 102400 in every head, so the
    # fp16 range is exceeded whatever the seed.
    q[:, :, 7] = 40.0
    k[:, :, 11] = 40.0
    assert (q.float() @ k.float().transpose(-1, -2)).abs().max() > 65504
    out, lse, *_ = check_oracle(q, k, v, rng, grads=False, scale=1.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@given(rng=rngs())
def test_nan_at_excluded_keys_does_not_leak(rng):
    q, k, v = (rng.randn(1, 2, 300, 64, dtype=torch.bfloat16) for _ in range(3))
    k[:, :, 200:] = float("nan")
    for options in (dict(is_causal=True), dict(attn_mask=torch.arange(300, device=DEV) < 200),
                    dict(attn_mask=torch.where(torch.arange(300, device=DEV) < 200, 0.0, NEG_INF))):
        out, lse, *_ = _run(q[:, :, :200], k, v, **options)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), f"{options}"


@given(rng=rngs())
def test_tf32_error_like_cublas_not_truncation(rng):
    """precision='tf32' rounds inputs to nearest: its score error (seen through the lse) is about cuBLAS
    TF32's, and below what truncating the inputs to TF32 (Triton's plain tf32) would give."""
    q = rng.randn(2, 4, 512, 128, std=3.0)
    k = rng.randn(2, 4, 512, 128, std=3.0)
    v = rng.randn(2, 4, 512, 128)
    scale = 0.125
    exact = torch.logsumexp((q.double() @ k.double().transpose(-1, -2)) * scale, -1)
    _, lse, *_ = _run(q, k, v, precision="tf32", scale=scale)
    err_ours = (lse.double() - exact).abs().mean().item()
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        cublas = torch.logsumexp((q @ k.transpose(-1, -2)).double() * scale, -1)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    err_cublas = (cublas - exact).abs().mean().item()

    def truncate(x):
        return (x.view(torch.int32) & ~0x1FFF).view(torch.float32)

    trunc = torch.logsumexp((truncate(q).double() @ truncate(k).double().transpose(-1, -2)) * scale, -1)
    err_trunc = (trunc - exact).abs().mean().item()
    msg = f"mean |lse error|: ours {err_ours:.3g}, cuBLAS tf32 {err_cublas:.3g}, truncated {err_trunc:.3g}"
    assert err_ours <= 2 * err_cublas + 1e-6, msg
    assert err_ours < err_trunc, msg


@given(rng=rngs())
def test_long_sequence_causal_gqa(rng):
    """Real sizes: 8K keys, causal, GQA 4:1, a few query rows checked against a float64 computation."""
    b, hq, hkv, s, d = 1, 8, 2, 8192, 128
    q = rng.randn(b, hq, s, d, dtype=torch.bfloat16)
    k, v = (rng.randn(b, hkv, s, d, dtype=torch.bfloat16) for _ in range(2))
    out, lse, *_ = _run(q, k, v, is_causal=True)
    rows = torch.tensor([0, 1, 127, 128, 4095, 8191], device=DEV)
    kk = k.double().repeat_interleave(4, 1)
    vv = v.double().repeat_interleave(4, 1)
    z = (q.double()[:, :, rows] @ kk.transpose(-1, -2)) / math.sqrt(d)
    z = torch.where(torch.arange(s, device=DEV)[None, :] <= rows[:, None], z, torch.full_like(z, NEG_INF))
    expected = torch.softmax(z, -1) @ vv
    err = (out[:, :, rows].double() - expected).abs().max().item()
    assert err <= 2**-7 * vv.abs().max().item(), f"max error {err}"
    assert torch.allclose(lse[:, :, rows].double(), torch.logsumexp(z, -1), atol=1e-3)


@pytest.mark.parametrize("d", [64, 128])
@given(rng=rngs())
def test_tma_same_bits(d, rng):
    """The TMA-descriptor loads give the pointer path's bits, forward and backward, on the first call (the
    general path) and on a repeated one (the cached plan, whose launches set the scratch allocator)."""
    from safeops.ops import attention_launch as L

    q = rng.randn(2, 8, 777, d, dtype=torch.bfloat16)
    k, v = (rng.randn(2, 2, 901, d, dtype=torch.bfloat16) for _ in range(2))
    g = rng.randn(2, 8, 777, d, dtype=torch.bfloat16)
    fwd, dkdv, dq = L.AttnConfig(128, 64, 8, 3), L.AttnConfig(32, 128, 8, 2), L.AttnConfig(128, 64, 8, 2)
    tma = {name: L.AttnConfig(c.block_m, c.block_n, c.num_warps, c.num_stages, tma=True)
           for name, c in (("fwd", fwd), ("dkdv", dkdv), ("dq", dq))}
    for options in (dict(), dict(is_causal=True), dict(window=(300, 5), softcap=30.0)):
        with L.config_override(fwd=fwd, dkdv=dkdv, dq=dq):
            plain = _run(q, k, v, g, **options)
        with L.config_override(**tma):
            L.clear_plans()
            got = _run(q, k, v, g, **options)
            planned = [p for p in (*L._fwd_plans.values(), *L._bwd_plans.values()) if p is not L._GENERAL]
            assert len(planned) == 2 and all(p.tma for p in planned), "TMA launches kept as plans"
            again = _run(q, k, v, g, **options)
        for i, (a, b, c) in enumerate(zip(plain, got, again, strict=True)):
            assert torch.equal(a, b), f"output {i} differs with TMA loads ({options})"
            assert torch.equal(a, c), f"output {i} differs with TMA loads from the plan ({options})"


EVEN_CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "window_softcap_gqa": dict(window=(300, 17), softcap=30.0, group=4),
    "bool_mask_causal": dict(attn_mask="bool", is_causal=True),
}


@pytest.mark.parametrize("d,case", [(128, c) for c in EVEN_CASES] + [(64, "plain"), (64, "causal")])
@given(rng=rngs())
def test_even_same_bits(d, case, rng, monkeypatch):
    """Whole blocks (the shipped configs at S=1024): the launcher compiles the EVEN kernels (no bounds masks,
    no partial-last-block loop; forward, dk/dv, dq), and they give the bits of the generic kernels
    (``_even`` forced False): out, lse, dq, dk, dv. The Triton forward is the one under test, so the Gluon
    path is off here (it would take the forwards without a mask or window)."""
    from safeops.ops import attention_launch as L

    monkeypatch.setenv("SAFEOPS_GLUON", "0")

    options = dict(EVEN_CASES[case])
    group = options.pop("group", 1)
    b, hkv, s = 2, 2, 1024
    q = rng.randn(b, hkv * group, s, d, dtype=torch.bfloat16)
    k, v = (rng.randn(b, hkv, s, d, dtype=torch.bfloat16) for _ in range(2))
    g = rng.randn(b, hkv * group, s, d, dtype=torch.bfloat16)
    if "attn_mask" in options:
        options["attn_mask"] = _mask(options["attn_mask"], rng, b, hkv * group, s, s)
    seen, sums = [], []
    launch = L._launch
    split_sum = L.kernels().attn_bwd_split_sum_kernel

    def spy(kernel, grid, *args, **kwargs):
        (sums if kernel is split_sum else seen).append(kwargs.get("EVEN"))
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(L, "_launch", spy)
    L.clear_plans()
    try:
        even = _run(q, k, v, g, **options)
        assert seen == [True, True, True], f"launches' EVEN: {seen}"  # fwd, dq (+ delta), dk/dv
        assert len(sums) == (group > 1), "the GQA split's sum: launched exactly when dk/dv is split"
        monkeypatch.setattr(L, "_even", lambda p, cfg: False)
        L.clear_plans()
        generic = _run(q, k, v, g, **options)
        assert seen[3:] == [False, False, False], f"launches' EVEN: {seen}"
    finally:
        L.clear_plans()
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), even, generic, strict=True):
        assert torch.equal(a, e), f"{name}: EVEN differs from the generic kernels; {rng}"


@pytest.mark.parametrize("layout", ["bshd", "expanded", "odd-row-stride"])
@given(rng=rngs())
def test_incoming_gradient_layout_same_bits(rng, layout):
    """Contract section 6: the backward reads the incoming gradient in place, so its memory layout reaches
    the kernels; the result must not depend on it. ``odd-row-stride``: rows of D + 1 elements (a slice of
    a wider buffer), where Triton cannot vectorise the loads and lays the dq kernel's delta tile out
    differently from a contiguous gradient's (tl.sum's addition order would follow)."""
    b, h, s, d = 2, 4, 1000, 64
    q, k, v = (rng.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(3))
    g = rng.randn(b, h, s, d, dtype=torch.bfloat16)
    if layout == "bshd":
        strided = g.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "expanded":
        g = g[:1, :1, :1].expand_as(g)
        strided = g
    else:
        strided = torch.empty(b, h, s, d + 1, dtype=g.dtype, device=DEV)[..., :d]
        strided.copy_(g)
    assert not strided.is_contiguous() and torch.equal(strided, g)
    ref = _run(q, k, v, g.contiguous(), is_causal=True)
    got = _run(q, k, v, strided, is_causal=True)
    for name, a, c in zip(("out", "lse", "dq", "dk", "dv"), ref, got, strict=True):
        assert torch.equal(a, c), f"{name} ({layout}); {rng}"


@pytest.mark.parametrize("kernels", ["default", "triton"])
@pytest.mark.parametrize("group", [4, 8, 16])
@given(rng=rngs())
def test_gqa_split_backward_bits(group, kernels, rng, monkeypatch):
    """GQA backward, D=64 causal: dq / dk / dv match the oracle, and their bits are the same for a sequence
    in a batch, alone, and packed (varlen), with q / k / v / grad in a transformers model's (B, S, H, D)
    layout. ``triton``: the Triton kernels' dk/dv split (two query heads per program, the partials summed by
    one launch). ``default``: what the launcher picks (on sm_90 the Gluon pair, dense and packed alike; when
    packed D=64 stayed on Triton, its split sums gave other bits than the dense Gluon call, 2026-12-07)."""
    from safeops.ops import attention_launch

    if kernels == "triton":
        monkeypatch.setenv("SAFEOPS_GLUON_BWD", "0")
    else:
        monkeypatch.delenv("SAFEOPS_GLUON_BWD", raising=False)

    hkv, d, lengths = 2, 64, [700, 1, 333]
    hq = hkv * group
    assert attention_launch.dkdv_split(group, 1) == group // 2
    b, s = len(lengths), max(lengths)

    def bshd(h):
        return rng.randn(b, s, h, d, dtype=torch.bfloat16).transpose(1, 2)
    q, k, v, g = bshd(hq), bshd(hkv), bshd(hkv), bshd(hq)
    check_oracle(q[:1, :, :300], k[:1, :, :300], v[:1, :, :300], rng, is_causal=True)
    full = _run(q, k, v, g, is_causal=True)
    packed = [torch.cat([t[i, :, :n].transpose(0, 1) for i, n in enumerate(lengths)]) for t in (q, k, v, g)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    leaves = [t.detach().clone().requires_grad_(True) for t in packed[:3]]
    out = safeops.attention_varlen(*leaves, cu, cu, is_causal=True)
    out.backward(packed[3])
    for i, n in enumerate(lengths):
        alone = _run(q[i:i + 1, :, :n], k[i:i + 1, :, :n], v[i:i + 1, :, :n], g[i:i + 1, :, :n],
                     is_causal=True)
        sl = slice(int(cu[i]), int(cu[i + 1]))
        for name, a, c, p in zip(("dq", "dk", "dv"), full[2:], alone[2:], leaves, strict=True):
            if n == s:  # a sequence as long as the batch's: the same bits in the batch as alone
                assert torch.equal(a[i:i + 1], c), f"{name} batch vs alone, sequence {i}; {rng}"
            got = p.grad[sl]
            assert torch.equal(got, c[0].transpose(0, 1)), f"{name} packed vs alone, sequence {i}; {rng}"


@pytest.mark.parametrize(("d", "causal"), [(64, True), (128, True), (128, False)])
@given(rng=rngs())
def test_cuda_graph_capture_and_replay(d, causal, rng):
    """Attention forward + backward as a training step runs it (GQA, q / k / v / grad in a transformers
    model's (B, S, H, D) layout) captured in one CUDA graph: replays with new inputs give the bits of eager
    calls on the same inputs. So nothing on the launch path synchronizes, allocates outside the graph's
    memory pool or keeps per-call host state (D=64 plans TMA loads, whose descriptors live in scratch memory
    allocated at launch; non-causal D=128 runs the fused Gluon backward on an sm_90 GPU, whose turn counters
    are zeroed inside the graph)."""
    b, s, hq, hkv = 2, 1024, 8, 2

    def bshd(h):
        return rng.randn(b, s, h, d, dtype=torch.bfloat16)
    leaves = [bshd(hq).requires_grad_(), bshd(hkv).requires_grad_(), bshd(hkv).requires_grad_()]
    grad = bshd(hq)

    def step():
        for t in leaves:
            t.grad = None
        out = safeops.attention(*(t.transpose(1, 2) for t in leaves), is_causal=causal)
        out.backward(grad.transpose(1, 2))
        return out

    side = torch.cuda.Stream()  # warm-up (plans, compiles) off the capture, as torch's docs ask
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for replay in range(3):
        with torch.no_grad():
            for t in (*leaves, grad):
                t.copy_(rng.randn(*t.shape, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        ref = _run(*(t.detach().transpose(1, 2) for t in leaves), grad.transpose(1, 2), is_causal=causal)
        assert torch.equal(out, ref[0]), f"out, replay {replay}; {rng}"
        for name, t, r in zip(("dq", "dk", "dv"), leaves, ref[2:], strict=True):
            assert torch.equal(t.grad.transpose(1, 2), r), f"{name}, replay {replay}; {rng}"
