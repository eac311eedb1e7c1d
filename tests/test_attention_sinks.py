"""Attention sinks (contract section 9) on CPU: the reference and the Triton kernels (interpreted) against
the float64 oracle (tests/oracle.py, which appends each head's sink logit to every row of scores), and the
contract's exact cases: a row that sees no key gives 0 and lse = the sink, a -inf sink changes nothing, equal
scores and an equal sink give 1 / (N + 1). Plus varlen, determinism, dtypes, torch.compile, merge_attention
with sinks (counted once) and the nn entry points.
"""

from __future__ import annotations

import math

import oracle
import pytest
import strategies as S
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import seeds
from test_attention import CASES, _leaves, _mask, assert_sequence_matches, qkv

import safeops

F64 = torch.float64
NEG_INF = float("-inf")
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _run(q, k, v, sinks, grad_out=None, **options):
    """(out, lse, dq, dk, dv, dsinks) from safeops; gradients only when grad_out is given."""
    q_, k_, v_, s_ = _leaves(q, k, v, sinks)
    out, lse = safeops.attention(q_, k_, v_, return_lse=True, sinks=s_, **options)
    if grad_out is None:
        return out.detach(), lse.detach(), None, None, None, None
    out.backward(grad_out)
    return out.detach(), lse.detach(), q_.grad, k_.grad, v_.grad, s_.grad


def check_against_oracle(q, k, v, sinks, seed, *, grad_out=None, **options):
    """out, lse, dq, dk, dv and dsinks within the oracle's bounds."""
    if grad_out is None:
        grad_out = seed.randn(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    out, lse, dq, dk, dv, ds = _run(q, k, v, sinks, grad_out, **options)
    oracle_options = {name: options[name] for name in ("attn_mask", "is_causal", "scale", "softcap", "window",
                                                        "precision") if name in options}
    shown = {n: (tuple(o.shape) if isinstance(o, torch.Tensor) else o) for n, o in options.items()}
    ctx = f"{seed}; sinks={sinks.tolist()}; options={shown}"
    r, eq, ek, ev, es = oracle.attention_gradients(q, k, v, grad_out, sinks=sinks, **oracle_options)
    b = oracle.attention_bounds(r, q, grad_out, scale=options.get("scale"), softcap=options.get("softcap"),
                                precision=options.get("precision"))
    oracle.assert_close(out, r.out.detach(), b[0], "out", ctx)
    oracle.assert_close(lse, r.lse.detach(), b[1], "lse", ctx)
    hkv = k.shape[1]
    oracle.assert_close(dq, eq, oracle.add_rounding(b[2], eq, q.dtype), "dq", ctx)
    dk_bound = oracle.add_rounding(oracle.reduce_kv_bound(b[3], hkv), ek, k.dtype)
    dv_bound = oracle.add_rounding(oracle.reduce_kv_bound(b[4], hkv), ev, v.dtype)
    oracle.assert_close(dk, ek, dk_bound, "dk", ctx)
    oracle.assert_close(dv, ev, dv_bound, "dv", ctx)
    ds_bound = oracle.sinks_bound(r, q, grad_out, b[0], softcap=options.get("softcap"))
    oracle.assert_close(ds, es, oracle.add_rounding(ds_bound, es, sinks.dtype), "dsinks", ctx)
    return out, lse, dq, dk, dv, ds


def _sinks(seed, hq, std=2.0, dtype=torch.float32):
    return seed.randn(hq, std=std).to(dtype)


def _empty_row_lse(sinks: torch.Tensor) -> torch.Tensor:
    """The lse of a row that sees no key, as the contract's conversions give it: the base-2 sink score
    fp32(fp32(s) * fp32(log2 e)), then (m + log2(1)) * ln 2 in float64, rounded to fp32."""
    zs = sinks.float() * torch.tensor(LOG2E, dtype=torch.float32)
    return (zs.to(F64) * LN2).float()


def _ulp(x: torch.Tensor) -> torch.Tensor:
    x = x.float().abs()
    return torch.nextafter(x, torch.tensor(math.inf)) - x


# ------------------------------------------------------------------------------------------------------
# Against the oracle
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["plain", "causal", "window", "softcap", "bool_mask", "additive_mask",
                                  "everything"])
@given(seed=seeds())
def test_options_match_oracle(backend, seed, case):
    """GQA (4 query heads on 2 kv heads) with every option; the masks leave a row with no key."""
    options = dict(CASES[case])
    q, k, v = qkv(seed, b=2, hq=4, hkv=2)
    if "attn_mask" in options:
        options["attn_mask"] = _mask(options["attn_mask"], seed, 2, 4, q.shape[2], k.shape[2])
    check_against_oracle(q, k, v, _sinks(seed, 4), seed, **options)


@given(data=st.data())
@S.examples(ci=8)
def test_drawn_calls_match_oracle(backend, data):
    """The attention property test's drawn calls (MHA / GQA / MQA, any Sq and Sk (none included), D != Dv,
    causal, windows, softcap, scale, masks, layouts) with sinks of any magnitude and dtype, a -inf sink
    among them: out, lse, dq, dk, dv and dsinks within the oracle's bounds."""
    dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if backend == "reference" else ())
    case = data.draw(S.attention_cases(dtypes=dtypes), label="case")
    q, k, v, g, options = case.inputs()
    std = data.draw(st.sampled_from([0.5, 3.0, 30.0]), label="sink std")
    sinks = case.seed.randn(case.hq, std=std).to(data.draw(st.sampled_from(
        [torch.float32, torch.bfloat16, torch.float16]), label="sink dtype"))
    if data.draw(st.booleans(), label="a -inf sink"):
        sinks[-1] = NEG_INF
    check_against_oracle(q, k, v, sinks, case.seed, grad_out=g, **options)


@given(seed=seeds())
def test_float64_inputs_are_float64(backend, seed):
    q, k, v = qkv(seed, dtype=F64, b=1, hq=2, hkv=1, sq=9, sk=11, d=8)
    sinks = _sinks(seed, 2, dtype=F64)
    g = seed.randn(1, 2, 9, 8, dtype=F64)
    out, lse, dq, dk, dv, ds = _run(q, k, v, sinks, g, is_causal=True)
    r, eq, ek, ev, es = oracle.attention_gradients(q, k, v, g, sinks=sinks, is_causal=True)
    assert out.dtype == lse.dtype == ds.dtype == F64
    for name, a, e in (("out", out, r.out), ("lse", lse, r.lse), ("dq", dq, eq), ("dk", dk, ek),
                       ("dv", dv, ev), ("dsinks", ds, es)):
        assert (a - e).abs().max() < 1e-12, f"{name}; {seed}"


# ------------------------------------------------------------------------------------------------------
# The contract's exact cases
# ------------------------------------------------------------------------------------------------------


@given(seed=seeds())
def test_no_keys_give_zero_and_the_sink(backend, seed):
    """Sk = 0: out 0, lse the sink (the exact bits of the base-2 round trip, within one ulp of s), zero
    gradients for q and the sinks (the output is 0 whatever the sink is)."""
    q, k, v = qkv(seed, b=2, hq=4, hkv=2, sq=5, sk=0)
    sinks = _sinks(seed, 4, std=10.0)
    out, lse, dq, dk, dv, ds = _run(q, k, v, sinks, seed.randn(2, 4, 5, 24))
    assert torch.equal(out, torch.zeros_like(out)), f"{seed}"
    expected = _empty_row_lse(sinks).view(1, 4, 1).expand_as(lse)
    assert torch.equal(lse, expected), f"{seed}"
    assert ((lse - sinks.view(1, 4, 1)).abs() <= _ulp(sinks).view(1, 4, 1)).all(), f"{seed}"
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(ds, torch.zeros_like(ds)), f"{seed}"
    assert dk.shape == k.shape and dv.shape == v.shape


@given(s=st.floats(-2.0**100, 2.0**100, width=32, allow_subnormal=False))
def test_empty_row_lse_is_the_sink_within_one_ulp(reference_backend, s):
    """The lse of a row with no key: ``fp32(ln 2 * fp32(fp32(s) * fp32(log2 e)))``, two roundings, so the
    sink itself or a neighbour. (Both backends store the same m = zs2 and l = 1: see
    test_no_keys_give_zero_and_the_sink.)"""
    sinks = torch.tensor([s], dtype=torch.float32)
    q = torch.zeros(1, 1, 1, 8)
    _, lse = safeops.attention(q, q[:, :, :0], q[:, :, :0], sinks=sinks, return_lse=True)
    assert torch.equal(lse.view(1), _empty_row_lse(sinks))
    assert (lse.view(1) - sinks).abs() <= _ulp(sinks), (s, lse.item())


@pytest.mark.parametrize("how", ["mask", "window"])
@given(seed=seeds())
def test_rows_that_see_no_key(backend, seed, how):
    """Fully masked rows (one inside the first query block, the tail of the last), or the rows of a window
    (0, 0) past the last key: out 0, lse the sink, dq 0; their dO changes nothing (dq, dk, dv and dsinks
    keep their bits); everything matches the oracle."""
    if how == "mask":
        q, k, v = qkv(seed, b=1, hq=2, hkv=1, sq=20, sk=36)
        mask = seed.mask(1, 1, 20, 36, keep=0.5)
        mask[..., 2, :] = False
        mask[..., 17:, :] = False
        options, empty = dict(attn_mask=mask), ~mask[0, 0].any(-1)
    else:
        q, k, v = qkv(seed, b=1, hq=2, hkv=1, sq=20, sk=12)
        options, empty = dict(window=(0, 0)), torch.arange(20) >= 12
    sinks = _sinks(seed, 2)
    g = seed.randn(1, 2, 20, 24)
    out, lse, dq, dk, dv, ds = _run(q, k, v, sinks, g, **options)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty])), f"{seed}"
    expected = _empty_row_lse(sinks).view(1, 2, 1).expand(1, 2, int(empty.sum()))
    assert torch.equal(lse[:, :, empty], expected), f"{seed}"
    assert torch.equal(dq[:, :, empty], torch.zeros_like(dq[:, :, empty])), f"{seed}"
    g2 = g.clone()
    g2[:, :, empty] = 1e4
    _, _, dq2, dk2, dv2, ds2 = _run(q, k, v, sinks, g2, **options)
    for name, a, b in (("dq", dq, dq2), ("dk", dk, dk2), ("dv", dv, dv2), ("dsinks", ds, ds2)):
        assert torch.equal(a, b), f"{name}; {seed}"
    check_against_oracle(q, k, v, sinks, seed, grad_out=g, **options)


@given(seed=seeds())
def test_negative_infinite_sink_changes_nothing(backend, seed):
    """A -inf sink has weight exactly 0: out, lse, dq, dk, dv have the bits of a call without sinks, and the
    sink's gradient is 0."""
    q, k, v = qkv(seed, b=1, hq=4, hkv=2, sq=19, sk=23)
    g = seed.randn(1, 4, 19, 24)
    mask = seed.mask(1, 1, 19, 23, keep=0.6)
    mask[..., 4, :] = False
    sinks = torch.full((4,), NEG_INF)
    with_sinks = _run(q, k, v, sinks, g, attn_mask=mask, is_causal=True)
    q_, k_, v_ = _leaves(q, k, v)
    out, lse = safeops.attention(q_, k_, v_, attn_mask=mask, is_causal=True, return_lse=True)
    out.backward(g)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), with_sinks,
                          (out.detach(), lse, q_.grad, k_.grad, v_.grad), strict=False):
        assert torch.equal(a, b), f"{name}; {seed}"
    assert torch.equal(with_sinks[5], torch.zeros(4)), f"{seed}"


@pytest.mark.parametrize("n_keys", [3, 7])
@given(seed=seeds())
def test_equal_scores_and_sink_give_one_over_n_plus_one(backend, seed, n_keys):
    """Every score equal to the sink (here near 7e10, exactly representable; scale 1 so the score's and the
    sink's base-2 values are the same fp32 product): each key and the sink weigh exactly 1 / (N + 1)."""
    d = 16
    q = torch.zeros(1, 1, 3, d)
    k = torch.zeros(1, 1, n_keys, d)
    q[..., 0] = 2.0**18
    k[..., 0] = 2.0**18  # every score 2**36, exact in fp32
    v = torch.zeros(1, 1, n_keys, n_keys)
    v[0, 0] = torch.eye(n_keys)  # output j = weight of key j
    sinks = torch.tensor([2.0**36])
    out, lse, *_ = _run(q, k, v, sinks, scale=1.0)
    expected = torch.full_like(out, 1.0 / (n_keys + 1))
    assert torch.equal(out, expected), f"{out}; {seed}"


# ------------------------------------------------------------------------------------------------------
# Same bits: varlen vs dense, determinism, batch invariance
# ------------------------------------------------------------------------------------------------------


def _pack(ts):
    return torch.cat([t[0].transpose(0, 1) for t in ts])


@pytest.mark.parametrize("options", [dict(), dict(is_causal=True), dict(window=(4, 2), softcap=2.0)])
@given(seed=seeds())
def test_varlen_matches_per_sequence(backend, seed, options):
    """Packed sequences (an empty one, one with no keys) with sinks: each sequence's out, lse, dq, dk, dv
    are its dense call's (the same bits on the kernels); dsinks is the sum of the sequences' dsinks."""
    lq, lk = [5, 0, 19, 3], [7, 4, 19, 0]
    hq, hkv, d = 2, 1, 16
    qs = [seed.randn(1, hq, n, d) for n in lq]
    ks = [seed.randn(1, hkv, n, d) for n in lk]
    vs = [seed.randn(1, hkv, n, d) for n in lk]
    sinks = _sinks(seed, hq)
    leaves = _leaves(_pack(qs), _pack(ks), _pack(vs), sinks)
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    out, lse = safeops.attention_varlen(*leaves[:3], cu_q, cu_k, max(lq), max(lk), return_lse=True,
                                        sinks=leaves[3], **options)
    g = seed.randn(*out.shape)
    out.backward(g)
    dsinks = torch.zeros(hq, dtype=F64)
    for b in range(4):
        qs_, ks_ = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ql, kl, vl, sl = _leaves(qs[b], ks[b], vs[b], sinks)
        o, ls = safeops.attention(ql, kl, vl, return_lse=True, sinks=sl, **options)
        o.backward(g[qs_].transpose(0, 1).unsqueeze(0))
        dsinks += sl.grad.to(F64)
        pairs = [(out[qs_], o[0].transpose(0, 1)), (lse[:, qs_], ls[0]),
                 (leaves[0].grad[qs_], ql.grad[0].transpose(0, 1)),
                 (leaves[1].grad[ks_], kl.grad[0].transpose(0, 1)),
                 (leaves[2].grad[ks_], vl.grad[0].transpose(0, 1))]
        assert_sequence_matches(pairs, backend, b, seed)
    assert torch.allclose(leaves[3].grad.to(F64), dsinks, rtol=1e-6, atol=1e-7), f"dsinks; {seed}"


@given(seed=seeds())
def test_deterministic(backend, seed):
    q, k, v = qkv(seed, b=2, hq=4, hkv=2, sq=25, sk=30)
    g = seed.randn(2, 4, 25, 24)
    sinks = _sinks(seed, 4)
    first = _run(q, k, v, sinks, g, is_causal=True, softcap=2.0)
    second = _run(q, k, v, sinks, g, is_causal=True, softcap=2.0)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b), f"{seed}"


@given(seed=seeds())
def test_batch_invariant(triton_backend, seed):
    q, k, v = qkv(seed, b=3, hq=2, hkv=1, sq=20, sk=21)
    sinks = _sinks(seed, 2)
    out, lse, *_ = _run(q, k, v, sinks, is_causal=True)
    alone, alone_lse, *_ = _run(q[1:2], k[1:2], v[1:2], sinks, is_causal=True)
    assert torch.equal(out[1:2], alone) and torch.equal(lse[1:2], alone_lse), f"{seed}"


# ------------------------------------------------------------------------------------------------------
# Dtypes, gradient combinations, registration
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@given(seed=seeds())
def test_sinks_dtype_is_converted_once(backend, seed, dtype):
    """Sinks of any float dtype run as their fp32 value (exact from bf16 / fp16, rounded once from fp64); the
    gradient comes back in their dtype, the fp32 gradient rounded once."""
    q, k, v = qkv(seed, b=1, hq=2, hkv=1, sq=9, sk=13)
    g = seed.randn(1, 2, 9, 24)
    sinks = _sinks(seed, 2).to(dtype)
    out, lse, dq, dk, dv, ds = _run(q, k, v, sinks, g, is_causal=True)
    ref = _run(q, k, v, sinks.float(), g, is_causal=True)
    for a, b in zip((out, lse, dq, dk, dv), ref, strict=False):
        assert torch.equal(a, b), f"{seed}"
    assert ds.dtype == dtype and torch.equal(ds, ref[5].to(dtype)), f"{seed}"


@given(seed=seeds())
def test_requires_grad_combinations(backend, seed):
    """Sinks alone, q/k/v alone, or both requiring grad: each gradient that is asked for has the same bits,
    and none is computed for a tensor that does not want one."""
    q, k, v = qkv(seed, b=1, hq=4, hkv=2, sq=11, sk=14)
    sinks = _sinks(seed, 4)
    g = seed.randn(1, 4, 11, 24)
    both = _run(q, k, v, sinks, g, is_causal=True)
    qk = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = safeops.attention(*qk, sinks=sinks, is_causal=True)
    out.backward(g)
    assert torch.equal(out.detach(), both[0])
    for a, b in zip((t.grad for t in qk), both[2:5], strict=True):
        assert torch.equal(a, b), f"{seed}"
    s_ = sinks.clone().requires_grad_(True)
    out = safeops.attention(q, k, v, sinks=s_, is_causal=True)
    out.backward(g)
    assert torch.equal(s_.grad, both[5]), f"{seed}"
    with torch.no_grad():
        assert torch.equal(safeops.attention(q, k, v, sinks=s_, is_causal=True), both[0])


@given(seed=seeds())
def test_gradcheck_reference(reference_backend, seed):
    q, k, v = (t.requires_grad_(True) for t in qkv(seed, b=1, hq=2, hkv=1, sq=6, sk=7, d=4, dtype=F64))
    sinks = _sinks(seed, 2, dtype=F64).requires_grad_(True)
    mask = seed.randn(1, 1, 6, 7, dtype=F64)
    mask[..., 0, :] = NEG_INF  # a row that sees no key: all its weight on the sink

    def f(q, k, v, sinks):
        return safeops.attention(q, k, v, attn_mask=mask, is_causal=True, softcap=2.0, scale=0.8, sinks=sinks)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks), eps=1e-6, atol=1e-7)


@given(seed=seeds())
def test_opcheck(reference_backend, seed):
    q, k, v = qkv(seed, b=1, hq=2, hkv=1, sq=6, sk=7, d=8)
    mask = seed.mask(1, 2, 6, 7)
    sinks = _sinks(seed, 2).requires_grad_(True)
    args = (q.requires_grad_(True), k, v, mask, 1, None, None, 6, 7, True, 0.5, 2.0, 3, 0, 0, sinks)
    torch.library.opcheck(torch.ops.safeops.attention.default, args)


@given(seed=seeds())
def test_opcheck_backward(backend, seed):
    """The sinks' backward op on its own: schema, fake, no derivative."""
    q, k, v = qkv(seed, b=1, hq=2, hkv=1, sq=6, sk=7, d=8)
    mask = seed.mask(1, 2, 6, 7)
    sinks = _sinks(seed, 2)
    out, row_max, row_sum = torch.ops.safeops.attention(q, k, v, mask, 1, None, None, 6, 7, True, 0.5, 2.0,
                                                         3, 0, 0, sinks)
    grad = seed.randn(*out.shape)
    args = (grad, q, k, v, out, row_max, row_sum, mask, 1, None, None, 6, 7, True, 0.5, 2.0, 3, 0, 0, sinks)
    torch.library.opcheck(torch.ops.safeops.attention_sinks_backward.default, args)


@given(seed=seeds())
def test_compiled_matches_eager(reference_backend, seed):
    q, k, v = qkv(seed, b=1, hq=2, hkv=1, sq=6, sk=9, d=8)
    g = seed.randn(1, 2, 6, 8)
    sinks = _sinks(seed, 2)

    def f(q, k, v, s):
        return safeops.attention(q, k, v, is_causal=True, softcap=5.0, sinks=s)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (f, compiled):
        leaves = _leaves(q, k, v, sinks)
        out = fn(*leaves)
        out.backward(g)
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b), f"{seed}"


def test_gluon_path_takes_sinks_unless_switched_off(monkeypatch):
    """The Gluon forward's capability check takes sinks (a runtime flag of its kernel); with
    ``attention_gluon.GLUON_SINKS`` off it declines them, and only them."""
    from safeops.ops import attention_gluon

    q = torch.empty(1, 2, 64, 64, dtype=torch.bfloat16)
    sinks = torch.zeros(2)
    declined = "the Gluon kernel does not take attention sinks"
    assert attention_gluon.reason(q, q, q, None, None, True, None, -1, 0, None, sinks) != declined
    monkeypatch.setattr(attention_gluon, "GLUON_SINKS", False)
    assert attention_gluon.reason(q, q, q, None, None, True, None, -1, 0, None, sinks) == declined
    assert attention_gluon.reason(q, q, q, None, None, True, None, -1, 0) != declined


def _bad_sinks():
    return [
        ("not a tensor", [0.0, 1.0, 2.0, 3.0], TypeError, "sinks must be None or a tensor"),
        ("integer", torch.zeros(4, dtype=torch.int64), TypeError, "sinks must be float"),
        ("bool", torch.zeros(4, dtype=torch.bool), TypeError, "sinks must be float"),
        ("kv heads", torch.zeros(2), ValueError, r"sinks must have shape \(Hq,\) = \(4,\)"),
        ("2-D", torch.zeros(1, 4), ValueError, r"sinks must have shape \(Hq,\)"),
        ("0-d", torch.zeros(()), ValueError, r"sinks must have shape \(Hq,\)"),
        ("device", torch.zeros(4, device="meta"), ValueError, "sinks is on meta"),
    ]


@pytest.mark.parametrize("case", _bad_sinks(), ids=lambda c: c[0])
def test_bad_sinks(case):
    _, sinks, exc, words = case
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    with pytest.raises(exc, match=words):
        safeops.attention(q, k, v, sinks=sinks)
    with pytest.raises(exc, match=words):
        safeops.attention_backend(q, k, v, sinks=sinks)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(exc, match=words):
        safeops.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu_k,
                                 sinks=sinks)


# ------------------------------------------------------------------------------------------------------
# merge_attention: the sink counted once
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True])
@given(seed=seeds())
def test_merge_counts_the_sink_once(backend, seed, is_causal):
    """Attention over three key shards computed without sinks, merged with them, is attention with sinks
    over all the keys: out, lse and the gradients of v and the sinks (the partials' lse carries no gradient
    back to q and k, as without sinks). Causal: each shard sees its keys through a bool mask (a shard's keys
    after a query give that row an empty partial)."""
    q, k, v = qkv(seed, b=2, hq=4, hkv=2, sq=20, sk=30)
    sinks = _sinks(seed, 4)
    g = seed.randn(2, 4, 20, 24)
    whole = _run(q, k, v, sinks, g, is_causal=is_causal)
    v_, s_ = _leaves(v, sinks)
    outs, lses = [], []
    i = torch.arange(20).view(20, 1)
    for a, b in ((0, 11), (11, 19), (19, 30)):
        mask = (a + torch.arange(b - a).view(1, b - a) <= i) if is_causal else None  # key a + j' <= query i
        o, lse = safeops.attention(q, k[:, :, a:b], v_[:, :, a:b], attn_mask=mask, return_lse=True)
        outs.append(o)
        lses.append(lse)
    out, lse = safeops.merge_attention(outs, lses, sinks=s_)
    out.backward(g)
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.detach(), whole[0], **tol)
    torch.testing.assert_close(lse, whole[1], **tol)
    torch.testing.assert_close(v_.grad, whole[4], **tol)
    torch.testing.assert_close(s_.grad, whole[5], **tol)


@given(seed=seeds())
def test_merge_of_empty_partials_is_the_sink(backend, seed):
    outs = seed.randn(2, 1, 3, 5, 8)
    lses = torch.full((2, 1, 3, 5), NEG_INF)
    sinks = _sinks(seed, 3, std=50.0)
    out, lse = safeops.merge_attention(outs, lses, sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sinks.view(1, 3, 1).expand(1, 3, 5))  # m = sink, s = 1: exactly the sink


@given(seed=seeds())
def test_merge_gradcheck_reference(reference_backend, seed):
    outs = seed.randn(3, 1, 2, 4, 5, dtype=F64).requires_grad_(True)
    lses = seed.randn(3, 1, 2, 4, dtype=F64)
    lses[1, 0, 0, 2] = NEG_INF  # an empty partial
    lses.requires_grad_(True)
    sinks = _sinks(seed, 2, dtype=F64).requires_grad_(True)

    def f(outs, lses, sinks):
        return safeops.merge_attention(outs, lses, sinks=sinks)

    assert torch.autograd.gradcheck(f, (outs, lses, sinks), eps=1e-6, atol=1e-7)


@given(seed=seeds())
def test_merge_kernels_match_reference(seed, monkeypatch):
    """The merge kernels (interpreted) and the reference agree on out, lse and every gradient."""
    outs = seed.randn(3, 2, 4, 5, 16)
    lses = seed.randn(3, 2, 4, 5) * 3
    lses[0, 1, 2] = NEG_INF
    sinks = _sinks(seed, 4)
    g, glse = seed.randn(2, 4, 5, 16), seed.randn(2, 4, 5)
    results = []
    for backend in ("reference", "triton"):
        with monkeypatch.context() as m:
            m.setenv("SAFEOPS_BACKEND", backend)
            leaves = _leaves(outs, lses, sinks)
            out, lse = safeops.merge_attention(leaves[0], leaves[1], sinks=leaves[2])
            torch.autograd.backward((out, lse), (g, glse))
            results.append([out.detach(), lse.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("out", "lse", "douts", "dlses", "dsinks"), *results, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@given(seed=seeds())
def test_merge_opcheck(backend, seed):
    outs = seed.randn(3, 2, 4, 5, 8).requires_grad_(True)
    lses = (seed.randn(3, 2, 4, 5) * 3).requires_grad_(True)
    sinks = _sinks(seed, 4).requires_grad_(True)
    torch.library.opcheck(torch.ops.safeops.merge_attention.default, (outs, lses, sinks))
    g, glse = seed.randn(2, 4, 5, 8), seed.randn(2, 4, 5)
    op = torch.ops.safeops.merge_attention_sinks_backward.default
    torch.library.opcheck(op, (g, glse, outs.detach(), lses.detach(), sinks.detach()))


@given(seed=seeds())
def test_merge_compiled_matches_eager(reference_backend, seed):
    outs, lses, sinks = seed.randn(2, 1, 4, 5, 8), seed.randn(2, 1, 4, 5), _sinks(seed, 4)
    g = seed.randn(1, 4, 5, 8)

    def f(o, l, s):
        return safeops.merge_attention(o, l, sinks=s)[0]

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (f, compiled):
        leaves = _leaves(outs, lses, sinks)
        out = fn(*leaves)
        out.backward(g)
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b), f"{seed}"


def test_merge_bad_sinks():
    outs, lses = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\) = \(3,\)"):
        safeops.merge_attention(outs, lses, sinks=torch.zeros(5))
    with pytest.raises(ValueError, match="head dim"):
        safeops.merge_attention(torch.randn(2, 5, 8), torch.randn(2, 5), sinks=torch.zeros(5))
    with pytest.raises(TypeError, match="sinks must be float"):
        safeops.merge_attention(outs, lses, sinks=torch.zeros(3, dtype=torch.int32))


# ------------------------------------------------------------------------------------------------------
# The nn entry points (materialized probabilities)
# ------------------------------------------------------------------------------------------------------


@given(seed=seeds())
def test_materialized_attention_with_sinks(reference_backend, seed):
    """attention_probabilities / materialized_attention take the sinks as one more column of the softmax:
    the probabilities of the keys match the oracle's, and the output safeops.attention's."""
    from safeops import nn as safe_nn

    q, k, v = qkv(seed, b=1, hq=4, hkv=2, sq=7, sk=9, d=8)
    sinks = _sinks(seed, 4)
    p = safe_nn.attention_probabilities(q, k, is_causal=True, sinks=sinks)
    r = oracle.attention(q, k, v, is_causal=True, sinks=sinks)
    assert (p.to(F64) - r.p).abs().max() < 1e-6, f"{seed}"
    assert (p.to(F64).sum(-1) + r.p_sink - 1).abs().max() < 1e-6, f"{seed}"
    out, _ = safe_nn.materialized_attention(q, k, v, is_causal=True, sinks=sinks)
    torch.testing.assert_close(out, safeops.attention(q, k, v, is_causal=True, sinks=sinks), rtol=1e-5,
                               atol=1e-6)
