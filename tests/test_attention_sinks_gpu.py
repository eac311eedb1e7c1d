"""GPU-only tests of attention sinks (contract section 9): the compiled Triton kernels on CUDA at real sizes.

Skipped without a CUDA device. The float64 oracle (tests/oracle.py) for out, lse, dq, dk, dv and dsinks in
bf16 / fp16 / fp32 with the options; bits: rows that see no key (0, the sink's lse, dq 0), deterministic
over reruns (dsinks included), batch invariance, varlen == dense, eager == torch.compile; merge_attention
with sinks against one call; the path choice (sinks run the Triton forward, with the reason).
"""

from __future__ import annotations

import oracle
import pytest
import torch
from hypothesis import given
from test_attention_gpu import DEV, _shipped_settings, rngs  # noqa: F401  (_shipped_settings: autouse)

import safeops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEG_INF = float("-inf")
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _run(q, k, v, sinks, g=None, **options):
    leaves = [t.detach().clone().requires_grad_(g is not None) for t in (q, k, v, sinks)]
    out, lse = safeops.attention(*leaves[:3], sinks=leaves[3], return_lse=True, **options)
    if g is None:
        return out.detach(), lse.detach(), None, None, None, None
    out.backward(g)
    return (out.detach(), lse.detach(), *(t.grad for t in leaves))


def _cpu(t):
    return t if not isinstance(t, torch.Tensor) else t.detach().cpu()


def check_oracle(q, k, v, sinks, rng, **options):
    g = rng.randn(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    out, lse, dq, dk, dv, ds = _run(q, k, v, sinks, g, **options)
    oo = {n: _cpu(options[n]) for n in ("attn_mask", "is_causal", "scale", "softcap", "window", "precision")
          if n in options}
    qc, kc, vc, gc = _cpu(q), _cpu(k), _cpu(v), _cpu(g)
    ctx = f"{rng}; {options.keys()}"
    r, eq, ek, ev, es = oracle.attention_gradients(qc, kc, vc, gc, sinks=_cpu(sinks), **oo)
    b = oracle.attention_bounds(r, qc, gc, scale=options.get("scale"), softcap=options.get("softcap"),
                                precision=options.get("precision"))
    hkv = k.shape[1]
    oracle.assert_close(out.cpu(), r.out.detach(), b[0], "out", ctx)
    oracle.assert_close(lse.cpu(), r.lse.detach(), b[1], "lse", ctx)
    oracle.assert_close(dq.cpu(), eq, oracle.add_rounding(b[2], eq, q.dtype), "dq", ctx)
    oracle.assert_close(dk.cpu(), ek, oracle.add_rounding(oracle.reduce_kv_bound(b[3], hkv), ek, k.dtype),
                        "dk", ctx)
    oracle.assert_close(dv.cpu(), ev, oracle.add_rounding(oracle.reduce_kv_bound(b[4], hkv), ev, v.dtype),
                        "dv", ctx)
    ds_bound = oracle.sinks_bound(r, qc, gc, b[0], softcap=options.get("softcap"))
    oracle.assert_close(ds.cpu(), es, oracle.add_rounding(ds_bound, es, sinks.dtype), "dsinks", ctx)


OPTIONS = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "window": dict(window=(100, 17)),
    "softcap_mask": dict(softcap=30.0, attn_mask="bool"),
}


@pytest.mark.parametrize("dtype,precision", [(torch.bfloat16, None), (torch.float16, None),
                                             (torch.float32, "ieee")])
@pytest.mark.parametrize("case", list(OPTIONS))
@given(rng=rngs())
def test_options_match_oracle(case, dtype, precision, rng):
    b, hq, hkv, sq, sk, d = 2, 4, 2, 300, 333, 128
    q, k, v = (rng.randn(b, h, s, d, dtype=dtype) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    options = dict(OPTIONS[case])
    if "attn_mask" in options:
        mask = torch.rand(b, 1, sq, sk, device=DEV, generator=rng.gen) < 0.8
        mask[..., 7, :] = False
        options["attn_mask"] = mask
    if precision is not None:
        options["precision"] = precision
    check_oracle(q, k, v, rng.randn(hq, std=2.0), rng, **options)


@given(rng=rngs())
def test_rows_that_see_no_key_exact(rng):
    b, h, sq, sk, d = 2, 4, 257, 300, 64
    q, k, v = (rng.randn(b, h, s, d, dtype=torch.bfloat16) for s in (sq, sk, sk))
    sinks = rng.randn(h, std=3.0)
    mask = torch.ones(b, 1, sq, sk, dtype=torch.bool, device=DEV)
    mask[..., 5, :] = False
    mask[..., 200:, :] = False
    g = rng.randn(b, h, sq, d, dtype=torch.bfloat16)
    out, lse, dq, *_ = _run(q, k, v, sinks, g, attn_mask=mask)
    empty = ~mask[0, 0].any(-1)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    expected = ((sinks * torch.tensor(LOG2E, dtype=torch.float32, device=DEV)).double() * LN2).float()
    assert torch.equal(lse[:, :, empty], expected.view(1, h, 1).expand(b, h, int(empty.sum())))
    assert torch.equal(dq[:, :, empty], torch.zeros_like(dq[:, :, empty]))


@given(rng=rngs())
def test_deterministic_bits(rng):
    q = rng.randn(2, 8, 1000, 128, dtype=torch.bfloat16)
    k, v = (rng.randn(2, 2, 1000, 128, dtype=torch.bfloat16) for _ in range(2))
    g = rng.randn(2, 8, 1000, 128, dtype=torch.bfloat16)
    sinks = rng.randn(8, std=2.0)
    first = _run(q, k, v, sinks, g, is_causal=True)
    for _ in range(20):
        again = _run(q, k, v, sinks, g, is_causal=True)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)


@given(rng=rngs())
def test_batch_invariant_bits(rng):
    q, k, v = (rng.randn(5, 4, 700, 64, dtype=torch.bfloat16) for _ in range(3))
    g = rng.randn(5, 4, 700, 64, dtype=torch.bfloat16)
    sinks = rng.randn(4, std=2.0)
    full = _run(q, k, v, sinks, g, is_causal=True)
    alone = _run(q[3:4], k[3:4], v[3:4], sinks, g[3:4], is_causal=True)
    for a, b in zip(full[:5], alone[:5], strict=True):  # dsinks sums over the batch
        assert torch.equal(a[3:4], b)


@given(rng=rngs())
def test_varlen_equals_dense_bits(rng):
    lengths = [300, 1, 0, 1029, 64]
    h, d = 4, 128
    sinks = rng.randn(h, std=2.0)
    seqs = [[rng.randn(1, h, n, d, dtype=torch.bfloat16) for _ in range(3)] for n in lengths]
    packed = [torch.cat([s[i][0].transpose(0, 1) for s in seqs]) for i in range(3)]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=DEV)
    out, lse = safeops.attention_varlen(*packed, cu, cu, is_causal=True, return_lse=True, sinks=sinks)
    for b in range(len(lengths)):
        o, ls = safeops.attention(*seqs[b], is_causal=True, return_lse=True, sinks=sinks)
        sl = slice(int(cu[b]), int(cu[b + 1]))
        assert torch.equal(out[sl], o[0].transpose(0, 1)) and torch.equal(lse[:, sl], ls[0]), f"sequence {b}"


@given(rng=rngs())
def test_compiled_equals_eager_bits(rng):
    q, k, v = (rng.randn(2, 4, 500, 64, dtype=torch.bfloat16) for _ in range(3))
    g = rng.randn(2, 4, 500, 64, dtype=torch.bfloat16)
    sinks = rng.randn(4, std=2.0)

    def f(q, k, v, s):
        return safeops.attention(q, k, v, is_causal=True, sinks=s)

    compiled = torch.compile(f, fullgraph=True)
    results = []
    for fn in (f, compiled):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        out = fn(*leaves)
        out.backward(g)
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@given(rng=rngs())
def test_merge_counts_the_sink_once(rng):
    q = rng.randn(2, 8, 400, 128, dtype=torch.bfloat16)
    k, v = (rng.randn(2, 2, 1000, 128, dtype=torch.bfloat16) for _ in range(2))
    sinks = rng.randn(8, std=2.0)
    whole, whole_lse = safeops.attention(q, k, v, sinks=sinks, return_lse=True)
    parts = [safeops.attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True)
             for a, b in ((0, 333), (333, 700), (700, 1000))]
    out, lse = safeops.merge_attention([p[0] for p in parts], [p[1] for p in parts], sinks=sinks)
    # The partials are rounded to bf16 before the merge: about one bf16 ulp more than the single call.
    torch.testing.assert_close(out.float(), whole.float(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5)


def test_sinks_run_the_gluon_forward(monkeypatch):
    """Where the Gluon forward takes a call, it takes the call with sinks too (``GLUON_SINKS``); switched off,
    the call with sinks runs the Triton forward and says why."""
    from safeops.ops import attention_gluon

    q = torch.empty(1, 4, 128, 128, dtype=torch.bfloat16, device=DEV)
    if safeops.attention_backend(q, q, q, is_causal=True)[0] != "gluon":
        pytest.skip("the Gluon forward does not run on this device")
    sinks = torch.zeros(4, device=DEV)
    assert safeops.attention_backend(q, q, q, is_causal=True, sinks=sinks)[0] == "gluon"
    monkeypatch.setattr(attention_gluon, "GLUON_SINKS", False)
    assert safeops.attention_backend(q, q, q, is_causal=True, sinks=sinks) == (
        "triton", "the Gluon kernel does not take attention sinks")
