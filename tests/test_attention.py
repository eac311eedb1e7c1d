"""safeops.attention / attention_varlen on CPU: the reference and the Triton kernels (interpreted) against
the float64 oracle (tests/oracle.py), for every option, their combinations and the contract's exact cases.

Shapes are small (the interpreter is slow); the launcher uses 16 x 16 blocks on CPU, so these sequences
still span several query and key blocks, partial last blocks and the masked/unmasked block split.
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

import safeops

F64 = torch.float64
NEG_INF = float("-inf")


def _leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in ts]


def assert_sequence_matches(pairs, backend: str, b: int, seed, *, equal_nan: bool = False) -> None:
    """(packed, per-sequence call) pairs of sequence ``b``: the same bits on the Triton kernels (same kernels,
    same configuration), within fp32 rounding of each other on the reference."""
    for i, (a, e) in enumerate(pairs):
        if backend == "triton":
            assert torch.equal(a, e), f"sequence {b} output {i}; {seed}"
        else:
            close = torch.allclose(a, e, atol=1e-6, rtol=1e-5, equal_nan=equal_nan)
            assert close, f"sequence {b} output {i}; {seed}"


def _run(q, k, v, grad_out=None, **options):
    """(out, lse, dq, dk, dv) from safeops; gradients only when grad_out is given."""
    q_, k_, v_ = _leaves(q, k, v)
    out, lse = safeops.attention(q_, k_, v_, return_lse=True, **options)
    if grad_out is None:
        return out.detach(), lse.detach(), None, None, None
    out.backward(grad_out)
    return out.detach(), lse.detach(), q_.grad, k_.grad, v_.grad


def check_against_oracle(q, k, v, seed, *, grads=True, grad_out=None, **options):
    if grads and grad_out is None:
        grad_out = seed.randn(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    out, lse, dq, dk, dv = _run(q, k, v, grad_out, **options)
    oracle_options = {name: options[name] for name in ("attn_mask", "is_causal", "scale", "softcap", "window",
                                                        "precision") if name in options}
    shown = {n: (tuple(o.shape) if isinstance(o, torch.Tensor) else o) for n, o in options.items()}
    ctx = f"{seed}; options={shown}"
    if grads:
        r, eq, ek, ev = oracle.attention_gradients(q, k, v, grad_out, **oracle_options)
    else:
        r = oracle.attention(q, k, v, **oracle_options)
    b = oracle.attention_bounds(r, q, grad_out, scale=options.get("scale"), softcap=options.get("softcap"),
                                precision=options.get("precision"))
    oracle.assert_close(out, r.out.detach(), b[0], "out", ctx)
    oracle.assert_close(lse, r.lse.detach(), b[1], "lse", ctx)
    if grads:
        hkv = k.shape[1]
        oracle.assert_close(dq, eq, oracle.add_rounding(b[2], eq, q.dtype), "dq", ctx)
        dk_bound = oracle.add_rounding(oracle.reduce_kv_bound(b[3], hkv), ek, k.dtype)
        dv_bound = oracle.add_rounding(oracle.reduce_kv_bound(b[4], hkv), ev, v.dtype)
        oracle.assert_close(dk, ek, dk_bound, "dk", ctx)
        oracle.assert_close(dv, ev, dv_bound, "dv", ctx)
    return out, lse, dq, dk, dv


def qkv(seed, b=1, hq=2, hkv=1, sq=37, sk=45, d=24, dv=None, dtype=torch.float32, std=1.0):
    return (seed.randn(b, hq, sq, d, dtype=dtype, std=std), seed.randn(b, hkv, sk, d, dtype=dtype, std=std),
            seed.randn(b, hkv, sk, dv or d, dtype=dtype))


# ------------------------------------------------------------------------------------------------------
# Every option against the oracle
# ------------------------------------------------------------------------------------------------------

CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "window": dict(window=(6, 3)),
    "window_left_causal": dict(window=(9, None), is_causal=True),
    "window_right_only": dict(window=(None, 2)),
    "softcap": dict(softcap=1.5, scale=0.7),
    "bool_mask": dict(attn_mask="bool"),
    "additive_mask": dict(attn_mask="add"),
    "everything": dict(attn_mask="add", is_causal=True, window=(20, None), softcap=3.0, scale=0.4),
}


def _mask(kind, seed, b, hq, sq, sk):
    if kind == "bool":
        m = seed.mask(b, 1, sq, sk, keep=0.6)
        m[..., 5, :] = False  # a fully masked row
        return m
    m = seed.randn(1, hq, sq, sk).to(torch.float32)
    m[..., 3, :] = NEG_INF  # a fully masked row
    m[..., 7] = NEG_INF  # a masked key
    return m


@pytest.mark.parametrize("case", list(CASES))
@given(seed=seeds())
def test_options_match_oracle(backend, seed, case):
    options = dict(CASES[case])
    q, k, v = qkv(seed, b=1, hq=2, hkv=1)
    if "attn_mask" in options:
        options["attn_mask"] = _mask(options["attn_mask"], seed, 1, 2, q.shape[2], k.shape[2])
    check_against_oracle(q, k, v, seed, **options)


@given(data=st.data())
@S.examples(ci=8)
def test_drawn_calls_match_oracle(backend, data):
    """MHA / GQA / MQA, any Sq and Sk (none included), D != Dv, causal, windows, softcap, scale (negative
    too), bool and additive masks of every broadcast shape, transposed and sliced q / k / v and incoming
    gradients: out, lse, dq, dk, dv within the oracle's bounds. bf16 on the reference only: the interpreter's
    bf16 ``tl.dot`` is not right."""
    dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if backend == "reference" else ())
    case = data.draw(S.attention_cases(dtypes=dtypes), label="case")
    q, k, v, g, options = case.inputs()
    check_against_oracle(q, k, v, case.seed, grad_out=g, **options)


@pytest.mark.parametrize("shape", [
    dict(b=2, hq=4, hkv=4, sq=20, sk=20, d=16),  # MHA, equal lengths
    dict(b=1, hq=4, hkv=2, sq=33, sk=17, d=32),  # GQA, Sq > Sk
    dict(b=1, hq=3, hkv=1, sq=5, sk=50, d=8, dv=40),  # MQA, Dv != D, D not a multiple of 16
    dict(b=1, hq=2, hkv=1, sq=1, sk=35, d=24),  # decoding: one query
])
@given(seed=seeds())
def test_shapes_match_oracle(backend, seed, shape):
    q, k, v = qkv(seed, **shape)
    check_against_oracle(q, k, v, seed, is_causal=shape["sq"] > 1)


@given(seed=seeds())
def test_fp16_matches_oracle(backend, seed):
    q, k, v = qkv(seed, dtype=torch.float16, std=2.0)
    check_against_oracle(q, k, v, seed, is_causal=True)


@pytest.mark.parametrize("precision", ["ieee", "tf32", "tf32x3"])
@given(seed=seeds())
def test_fp32_precisions(backend, seed, precision):
    q, k, v = qkv(seed, sq=21, sk=26, d=16)
    if backend == "reference":
        # The CPU reference always computes at full precision.
        assert torch.equal(_run(q, k, v, precision=precision)[0], _run(q, k, v, precision="ieee")[0])
        return
    check_against_oracle(q, k, v, seed, precision=precision, grads=precision != "tf32x3")


@given(seed=seeds())
def test_tf32_rounds_inputs(triton_backend, seed):
    """precision='tf32' is the attention of the TF32-rounded inputs, visibly different from 'ieee'."""
    q, k, v = qkv(seed, sq=17, sk=19, d=16)
    tf32, _, _, _, _ = _run(q, k, v, precision="tf32")
    ieee, _, _, _, _ = _run(q, k, v, precision="ieee")
    q32, k32, v32 = (oracle.round_tf32(t) for t in (q, k, v))
    rounded, _, _, _, _ = _run(q32, k32, v32, precision="ieee")
    assert not torch.equal(tf32, ieee), f"tf32 did not change the result; {seed}"
    # What is left is the rounding of p to TF32 for the second matmul.
    assert (tf32 - rounded).abs().max() <= 2.0**-10 * v.abs().max(), f"{seed}"


@given(seed=seeds())
def test_float64_inputs_are_float64(backend, seed):
    q, k, v = qkv(seed, dtype=F64, sq=9, sk=11, d=8)
    out, lse, *_ = _run(q, k, v, is_causal=True)
    r = oracle.attention(q, k, v, is_causal=True)
    assert out.dtype == F64 and lse.dtype == F64
    assert (out - r.out).abs().max() < 1e-12


# ------------------------------------------------------------------------------------------------------
# The contract's exact cases
# ------------------------------------------------------------------------------------------------------


@given(seed=seeds())
def test_empty_rows_are_zero(backend, seed):
    """Fully masked queries: out 0, lse -inf, dq 0 exactly, and they add nothing to dk / dv."""
    q, k, v = qkv(seed, sq=20, sk=36)
    mask = seed.mask(1, 1, 20, 36, keep=0.5)
    mask[..., 2, :] = False
    mask[..., 17:, :] = False  # the last query block partly empty
    g = seed.randn(1, 2, 20, 24)
    out, lse, dq, dk, dv = _run(q, k, v, g, attn_mask=mask)
    empty = ~mask[0, 0].any(-1)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty])), f"{seed}"
    assert (lse[:, :, empty] == NEG_INF).all(), f"{seed}"
    assert torch.equal(dq[:, :, empty], torch.zeros_like(dq[:, :, empty])), f"{seed}"
    # The gradients at empty rows' dO do not matter: change them, dk and dv keep their bits.
    g2 = g.clone()
    g2[:, :, empty] = 1e4
    _, _, dq2, dk2, dv2 = _run(q, k, v, g2, attn_mask=mask)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2) and torch.equal(dq, dq2), f"{seed}"
    check_against_oracle(q, k, v, seed, attn_mask=mask)


@given(seed=seeds())
def test_everything_masked(backend, seed):
    q, k, v = qkv(seed, sq=18, sk=20)
    mask = torch.zeros(1, 1, 18, 20, dtype=torch.bool)
    out, lse, dq, dk, dv = _run(q, k, v, seed.randn(1, 2, 18, 24), attn_mask=mask)
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.equal(t, torch.zeros_like(t)), f"{name} not exactly 0; {seed}"
    assert (lse == NEG_INF).all()


@given(seed=seeds())
def test_no_keys(backend, seed):
    q, k, v = qkv(seed, sq=5, sk=0)
    out, lse, dq, dk, dv = _run(q, k, v, seed.randn(1, 2, 5, 24))
    assert torch.equal(out, torch.zeros_like(out)) and (lse == NEG_INF).all()
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.shape == k.shape and dv.shape == v.shape


@given(seed=seeds())
def test_no_queries(backend, seed):
    q, k, v = qkv(seed, sq=0, sk=7)
    out, lse, dq, dk, dv = _run(q, k, v, torch.zeros(1, 2, 0, 24))
    assert out.shape == (1, 2, 0, 24) and lse.shape == (1, 2, 0)
    assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


@given(seed=seeds())
def test_window_with_no_visible_key(backend, seed):
    """window=(0, 0) with more queries than keys: queries past the last key see nothing."""
    q, k, v = qkv(seed, sq=30, sk=12)
    out, lse, dq, _, _ = _run(q, k, v, seed.randn(1, 2, 30, 24), window=(0, 0))
    assert torch.equal(out[:, :, 12:], torch.zeros_like(out[:, :, 12:])) and (lse[:, :, 12:] == NEG_INF).all()
    assert torch.equal(dq[:, :, 12:], torch.zeros_like(dq[:, :, 12:]))
    check_against_oracle(q, k, v, seed, window=(0, 0))


@given(seed=seeds())
def test_window_longer_than_int32_arithmetic(backend, seed):
    """A window of 2**31 - 1 keys on either side is no window (the kernels' position + window sums would wrap
    in int32 unclamped): the results of the call without one."""
    q, k, v = qkv(seed, sq=40, sk=70)
    g = seed.randn(1, 2, 40, 24)
    big = 2**31 - 1
    for options, same in ((dict(window=(big, None)), dict()), (dict(window=(big, big)), dict()),
                          (dict(window=(big, None), is_causal=True), dict(is_causal=True))):
        for a, b in zip(_run(q, k, v, g, **options), _run(q, k, v, g, **same), strict=True):
            assert torch.equal(a, b), f"{options}; {seed}"


@given(seed=seeds())
def test_first_block_masked(backend, seed):
    """Rows whose first key blocks are all excluded: the online rescale starts from -inf without NaN."""
    q, k, v = qkv(seed, sq=20, sk=50)
    mask = torch.ones(1, 1, 20, 50, dtype=torch.bool)
    mask[..., :10, :35] = False  # first two 16-key blocks (and part of the third) excluded
    out, *_ = check_against_oracle(q, k, v, seed, attn_mask=mask)
    assert torch.isfinite(out).all()
    add = torch.where(mask, 0.0, NEG_INF)
    out2, *_ = check_against_oracle(q, k, v, seed, attn_mask=add)
    assert torch.equal(out, out2) or backend == "reference", f"bool and -inf masks differ; {seed}"


@given(seed=seeds())
def test_nan_at_excluded_keys_does_not_leak(backend, seed):
    q, k, v = qkv(seed, sq=20, sk=40)
    k[:, :, 30:] = float("nan")  # keys no query sees (causal, window) or masked out
    visible = torch.arange(40) < 30
    additive = torch.where(visible, 0.0, NEG_INF)
    cases = (dict(is_causal=True), dict(window=(5, 5)), dict(attn_mask=visible), dict(attn_mask=additive))
    for options in cases:
        out, lse, *_ = _run(q, k, v, **options)
        assert torch.isfinite(out).all() and not torch.isnan(lse).any(), f"NaN leaked with {options}; {seed}"
        clean = k.clone()
        clean[:, :, 30:] = 0.0
        ref, ref_lse, *_ = _run(q, clean, v, **options)
        assert torch.equal(out, ref) or backend == "reference", f"{options}; {seed}"


@given(seed=seeds())
def test_nan_score_poisons_its_row_only(backend, seed):
    q, k, v = qkv(seed, sq=20, sk=25)
    q[0, 0, 4, 0] = float("nan")
    out, lse, *_ = _run(q, k, v)
    assert torch.isnan(out[0, 0, 4]).all() and torch.isnan(lse[0, 0, 4])
    rest = torch.ones(20, dtype=torch.bool)
    rest[4] = False
    assert torch.isfinite(out[0, 0, rest]).all() and torch.isfinite(out[0, 1]).all()


@pytest.mark.parametrize("magnitude", [1e5, 1e11])
@given(seed=seeds())
def test_huge_logits(backend, seed, magnitude):
    """Scores of ~1e5 and ~1e11: finite, the largest score gets p = 1, results match the oracle."""
    q, k, v = qkv(seed, sq=18, sk=33, d=16)
    q = q * (math.sqrt(magnitude) * 4 / q.norm(dim=-1, keepdim=True))
    k = k * (math.sqrt(magnitude) / k.norm(dim=-1, keepdim=True))
    out, lse, *_ = check_against_oracle(q, k, v, seed, scale=1.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@given(seed=seeds())
def test_equal_huge_logits_gradient(backend, seed):
    """Equal scores near 1e11: p = 1/N exactly, so the gradient is not N times too big (the fold-lse bug)."""
    sq, sk, d = 9, 40, 16
    direction = torch.zeros(d)
    direction[0] = 1.0
    q = (direction * 3.0e5).expand(1, 1, sq, d).contiguous()
    k = (direction * 1.1e6).expand(1, 1, sk, d).contiguous()  # every score = 3.3e11, exactly equal
    v = seed.randn(1, 1, sk, d)
    g = seed.randn(1, 1, sq, d)
    out, lse, dq, dk, dv = _run(q, k, v, g, scale=1.0)
    mean_v = v.to(F64).mean(2, keepdim=True)
    assert (out.to(F64) - mean_v).abs().max() < 1e-6, f"{seed}"
    expected_dv = g.to(F64).sum(2, keepdim=True).expand(1, 1, sk, d) / sk
    assert (dv.to(F64) - expected_dv).abs().max() < 1e-5 * expected_dv.abs().max(), f"dv; {seed}"
    expected_lse = torch.tensor(3.3e11, dtype=torch.float32).to(F64) + math.log(sk)
    assert (lse.to(F64) - expected_lse).abs().max() <= 3.3e11 * 2**-23, f"lse; {seed}"


@given(seed=seeds())
def test_fp16_scores_beyond_fp16_range(backend, seed):
    """fp16 inputs whose q.k exceeds 65504 stay finite (scores are fp32)."""
    q, k, v = qkv(seed, sq=17, sk=20, d=16, dtype=torch.float16)
    q = (q.float() * 100).half()
    k = (k.float() * 100).half()
    out, lse, *_ = check_against_oracle(q, k, v, seed, scale=1.0, grads=False)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


# ------------------------------------------------------------------------------------------------------
# Same bits: determinism, batch invariance, varlen vs dense
# ------------------------------------------------------------------------------------------------------


@given(seed=seeds())
def test_deterministic(backend, seed):
    q, k, v = qkv(seed, b=1, hq=4, hkv=2, sq=25, sk=30)
    g = seed.randn(1, 4, 25, 24)
    first = _run(q, k, v, g, is_causal=True, softcap=2.0)
    second = _run(q, k, v, g, is_causal=True, softcap=2.0)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b), f"{seed}"


def test_gqa_dkdv_split_rule():
    """Two query heads per dk/dv program for a group of 4 or more (a divisor of the group), one below; the
    memory cap takes the next smaller divisor."""
    from safeops.ops import attention_launch

    assert [attention_launch.dkdv_split(g, 1) for g in (1, 2, 3, 4, 5, 6, 8, 16)] == [1, 2, 3, 2, 5, 3, 4, 8]
    cap = attention_launch.DKDV_SPLIT_MAX_BYTES
    assert attention_launch.dkdv_split(16, cap // 4 // 8) == 8
    assert attention_launch.dkdv_split(16, cap // 4 // 8 + 1) == 4
    assert attention_launch.dkdv_split(6, cap // 4 // 2 + 1) == 1


@pytest.mark.parametrize("cap_elements", [None, 2, 1], ids=["split4", "split2", "nosplit"])
@given(seed=seeds())
def test_gqa_dkdv_split(triton_backend, seed, monkeypatch, cap_elements):
    """The dk/dv kernel splits a kv head's query group over several programs (fp32 partials summed in a
    fixed order by one kernel); the memory cap shrinks the split down to the unsplit kernel. Every split
    matches the oracle."""
    from safeops.ops import attention_launch

    q, k, v = qkv(seed, b=2, hq=16, hkv=2, sq=23, sk=37, d=16)
    kv = k.numel() + v.numel()
    assert attention_launch.dkdv_split(8, kv) == 4
    with monkeypatch.context() as m:  # undone after each example
        if cap_elements is not None:  # room for fp32 partials of `cap_elements` x the k/v elements
            m.setattr(attention_launch, "DKDV_SPLIT_MAX_BYTES", kv * cap_elements * 4)
            assert attention_launch.dkdv_split(8, kv) == cap_elements
        check_against_oracle(q, k, v, seed, is_causal=True, window=(15, None))


@given(seed=seeds())
def test_batch_invariant(triton_backend, seed):
    q, k, v = qkv(seed, b=3, hq=2, hkv=1, sq=20, sk=21)
    out, lse, *_ = _run(q, k, v, is_causal=True)
    alone, alone_lse, *_ = _run(q[1:2], k[1:2], v[1:2], is_causal=True)
    assert torch.equal(out[1:2], alone) and torch.equal(lse[1:2], alone_lse), f"{seed}"


def _pack(t: torch.Tensor, lengths) -> torch.Tensor:
    """(B, H, S, D) padded -> (sum(lengths), H, D)."""
    return torch.cat([t[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])


@pytest.mark.parametrize("options", [dict(), dict(is_causal=True), dict(window=(4, 2), softcap=2.0)])
@given(seed=seeds())
def test_varlen_matches_per_sequence(backend, seed, options):
    lq, lk = [5, 0, 19, 3], [7, 4, 19, 0]
    hq, hkv, d = 2, 1, 16
    qs = [seed.randn(1, hq, n, d) for n in lq]
    ks = [seed.randn(1, hkv, n, d) for n in lk]
    vs = [seed.randn(1, hkv, n, d) for n in lk]
    cat = [torch.cat([t[0].transpose(0, 1) for t in ts]) for ts in (qs, ks, vs)]
    leaves = _leaves(*cat)
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    out, lse = safeops.attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lk), return_lse=True, **options)
    g = seed.randn(*out.shape)
    out.backward(g)
    assert lse.shape == (hq, sum(lq))
    for b in range(4):
        qs_, ks_ = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ql, kl, vl = _leaves(qs[b], ks[b], vs[b])
        o, ls = safeops.attention(ql, kl, vl, return_lse=True, **options)
        o.backward(g[qs_].transpose(0, 1).unsqueeze(0))
        pairs = [(out[qs_], o[0].transpose(0, 1)), (lse[:, qs_], ls[0]),
                 (leaves[0].grad[qs_], ql.grad[0].transpose(0, 1)),
                 (leaves[1].grad[ks_], kl.grad[0].transpose(0, 1)),
                 (leaves[2].grad[ks_], vl.grad[0].transpose(0, 1))]
        assert_sequence_matches(pairs, backend, b, seed, equal_nan=True)


@given(seed=seeds())
def test_tma_loads_same_bits(triton_backend, seed):
    """The optional TMA-descriptor loads (a tuning knob) compute the same bits as pointer loads."""
    from safeops.ops import attention_launch as L

    q, k, v = qkv(seed, b=2, hq=4, hkv=2, sq=37, sk=45, d=16)
    g = seed.randn(2, 4, 37, 16)
    tma_cfg = L.AttnConfig(16, 16, 1, 1, tma=True)
    for options in (dict(is_causal=True), dict(window=(7, 3), softcap=2.0)):
        plain = _run(q, k, v, g, **options)
        with L.config_override(fwd=tma_cfg, dkdv=tma_cfg, dq=tma_cfg):
            tma = _run(q, k, v, g, **options)
        for i, (a, b) in enumerate(zip(plain, tma, strict=True)):
            assert torch.equal(a, b), f"output {i} {options}; {seed}"
    # Packed sequences, one without keys: the descriptors stop at each sequence's end.
    qp, kp, vp = seed.randn(30, 4, 16), seed.randn(40, 2, 16), seed.randn(40, 2, 16)
    cu_q = torch.tensor([0, 12, 20, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 25, 25, 40], dtype=torch.int32)
    plain = safeops.attention_varlen(qp, kp, vp, cu_q, cu_k, is_causal=True)
    with L.config_override(fwd=L.AttnConfig(16, 16, 1, 1, tma=True)):
        tma = safeops.attention_varlen(qp, kp, vp, cu_q, cu_k, is_causal=True)
    assert torch.equal(plain, tma), f"varlen; {seed}"


# ------------------------------------------------------------------------------------------------------
# The forward's EVEN specialization (whole blocks: no bounds masks, no partial-last-block loop)
# ------------------------------------------------------------------------------------------------------


class _Seen(list):
    def fresh(self) -> None:
        """Each example starts with no launch seen and no plan kept (the fixture is shared by examples)."""
        from safeops.ops import attention_launch as L

        self.clear()
        L.clear_plans()


@pytest.fixture
def fwd_even(triton_backend, monkeypatch):
    """The ``EVEN`` flag of every forward launch the launcher's general path makes (a spy on its launch);
    plans are cleared before and after (and by ``fresh()`` before each example), so a forced ``_even`` is
    seen and does not outlive the test."""
    from safeops.ops import attention_launch as L

    seen = _Seen()
    launch = L._launch

    def spy(kernel, grid, *args, **kwargs):
        if kernel is L.kernels().attn_fwd_kernel:
            seen.append(kwargs["EVEN"])
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(L, "_launch", spy)
    L.kernels()  # loaded first: loading it later would drop the plans (a setting of theirs)
    L.clear_plans()
    yield seen
    L.clear_plans()


# Sequence lengths are multiples of the interpreter's 16 x 16 blocks; "d" 24 pads the head dim to 32.
EVEN_CASES = {
    "dense_fp32": dict(dtype=torch.float32),
    "causal": dict(is_causal=True, sk=48),
    "window_padded_d": dict(window=(20, 7), d=24),
    "gqa_causal_softcap": dict(is_causal=True, softcap=2.0, group=2),
    "bool_mask_window": dict(attn_mask="bool", window=(25, None)),
}


@pytest.mark.parametrize("case", list(EVEN_CASES))
@given(seed=seeds())
def test_forward_even_same_bits(fwd_even, seed, monkeypatch, case):
    """Whole blocks: the launcher compiles the forward EVEN (no bounds masks, no tail loop), and it gives
    the bits of the generic kernel (``_even`` forced False), on the general path and on a plan's launch;
    both agree with the float64 oracle."""
    from safeops.ops import attention_launch as L

    fwd_even.fresh()
    options = dict(EVEN_CASES[case])
    dtype, group = options.pop("dtype", torch.float16), options.pop("group", 1)
    sk, d = options.pop("sk", 64), options.pop("d", 16)
    q, k, v = qkv(seed, b=1, hq=2 * group, hkv=2, sq=48, sk=sk, d=d, dtype=dtype)
    if "attn_mask" in options:
        options["attn_mask"] = _mask(options["attn_mask"], seed, 1, 2 * group, 48, sk)
    even = check_against_oracle(q, k, v, seed, grads=False, **options)[:2]
    planned = _run(q, k, v, **options)[:2]  # the same signature again: the plan's launch
    assert fwd_even == [True], f"EVEN not chosen for whole blocks: {fwd_even}"
    with monkeypatch.context() as m:
        m.setattr(L, "_even", lambda p, cfg: False)
        L.clear_plans()
        generic = _run(q, k, v, **options)[:2]
    L.clear_plans()
    assert fwd_even == [True, False]
    for name, a, b, c in zip(("out", "lse"), even, planned, generic, strict=True):
        assert torch.equal(a, b), f"{name}: plan launch differs; {seed}"
        assert torch.equal(a, c), f"{name}: EVEN differs from the generic kernel; {seed}"


@pytest.mark.parametrize("sq,sk", [(40, 64), (48, 56)])
@given(seed=seeds())
def test_forward_ragged_is_not_even(fwd_even, seed, sq, sk):
    """A partial last query or key block: the generic kernel (EVEN False), still right."""
    fwd_even.fresh()
    q, k, v = qkv(seed, b=1, hq=2, hkv=1, sq=sq, sk=sk, d=16, dtype=torch.float16)
    check_against_oracle(q, k, v, seed, grads=False, is_causal=True)
    assert fwd_even == [False]


@given(seed=seeds())
def test_forward_varlen_not_even_matches_dense_even(fwd_even, seed):
    """Packed sequences are never EVEN (each has its own length); a sequence of whole blocks run alone is:
    the two kernels give it the same bits."""
    fwd_even.fresh()
    lq, lk = [32, 16], [48, 32]
    qs = [seed.randn(1, 2, n, 16, dtype=torch.float16) for n in lq]
    ks = [seed.randn(1, 1, n, 16, dtype=torch.float16) for n in lk]
    vs = [seed.randn(1, 1, n, 16, dtype=torch.float16) for n in lk]
    cat = [torch.cat([t[0].transpose(0, 1) for t in ts]) for ts in (qs, ks, vs)]
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    out, lse = safeops.attention_varlen(*cat, cu_q, cu_k, max(lq), max(lk), return_lse=True, is_causal=True)
    assert fwd_even == [False]
    for b in range(2):
        o, ls = safeops.attention(qs[b], ks[b], vs[b], return_lse=True, is_causal=True)
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert torch.equal(out[rows], o[0].transpose(0, 1)), f"sequence {b}; {seed}"
        assert torch.equal(lse[:, rows], ls[0]), f"sequence {b}; {seed}"
    assert fwd_even == [False, True, True]


@given(seed=seeds())
def test_transposed_layout(backend, seed):
    """(B, S, H, D) memory transposed to (B, H, S, D), as Hugging Face passes it: read in place."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv(seed, hq=2, hkv=2))
    out, *_ = check_against_oracle(q, k, v, seed, is_causal=True)
    assert out.shape == (1, 2, 37, 24)


@pytest.mark.parametrize("layout", ["bshd", "expanded"])
@given(seed=seeds())
def test_strided_incoming_gradient_same_bits(backend, seed, layout):
    """The backward reads the incoming gradient in place (Hugging Face's (B, S, H, D) memory seen as
    (B, H, S, D)), or copies it when the head dim is not unit-stride (an expanded gradient): the same bits
    as a contiguous gradient either way."""
    q, k, v = qkv(seed, b=2, hq=4, hkv=2)
    g = seed.randn(2, 4, 37, 24)
    if layout == "bshd":
        strided = g.transpose(1, 2).contiguous().transpose(1, 2)
    else:  # one row broadcast over batch, heads and rows: strides (0, 0, 0, 1) for a unit head dim
        g = g[:1, :1, :1].expand_as(g)
        strided = g
    assert not strided.is_contiguous()
    grads = [_run(q, k, v, grad)[2:] for grad in (g.contiguous(), strided)]
    for name, a, b in zip(("dq", "dk", "dv"), *grads, strict=True):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------------------------------
# Registration: gradcheck, opcheck, torch.compile
# ------------------------------------------------------------------------------------------------------


@given(seed=seeds())
def test_gradcheck_reference(reference_backend, seed):
    q, k, v = (t.requires_grad_(True) for t in qkv(seed, b=1, hq=2, hkv=1, sq=6, sk=7, d=4, dtype=F64))
    mask = seed.randn(1, 1, 6, 7, dtype=F64)
    mask[..., 0, :] = NEG_INF

    def f(q, k, v):
        return safeops.attention(q, k, v, attn_mask=mask, is_causal=True, softcap=2.0, scale=0.8)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7)


@given(seed=seeds())
def test_opcheck(reference_backend, seed):
    q, k, v = qkv(seed, b=1, hq=2, hkv=1, sq=6, sk=7, d=8)
    mask = seed.mask(1, 2, 6, 7)
    args = (q.requires_grad_(True), k, v, mask, 1, None, None, 6, 7, True, 0.5, 2.0, 3, 0, 0)
    torch.library.opcheck(torch.ops.safeops.attention.default, args)


@given(seed=seeds())
def test_opcheck_backward(backend, seed):
    """The backward op on its own: schema, fake, and (it has no derivative) no autograd registration
    surprises; causal + softcap + a bool mask, with the forward's saved row statistics."""
    q, k, v = qkv(seed, b=1, hq=2, hkv=1, sq=6, sk=7, d=8)
    mask = seed.mask(1, 2, 6, 7)
    out, row_max, row_sum = torch.ops.safeops.attention(q, k, v, mask, 1, None, None, 6, 7, True, 0.5, 2.0,
                                                         3, 0, 0)
    grad = seed.randn(*out.shape)
    args = (grad, q, k, v, out, row_max, row_sum, mask, 1, None, None, 6, 7, True, 0.5, 2.0, 3, 0, 0)
    torch.library.opcheck(torch.ops.safeops.attention_backward.default, args)


@given(seed=seeds())
def test_compiled_matches_eager(reference_backend, seed):
    q, k, v = qkv(seed, b=1, hq=2, hkv=1, sq=6, sk=9, d=8)

    def f(q, k, v):
        return safeops.attention(q, k, v, is_causal=True, softcap=5.0)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v), f(q, k, v))


# ------------------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument
# ------------------------------------------------------------------------------------------------------


def _bad_cases():
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 9, 16)
    v = torch.randn(1, 2, 9, 16)
    return [
        ("head mismatch", (q, k3 := torch.randn(1, 3, 9, 16), k3), {}, ValueError, "multiple"),
        ("k v heads", (q, k, torch.randn(1, 4, 9, 16)), {}, ValueError, "heads"),
        ("D mismatch", (q, torch.randn(1, 2, 9, 8), v), {}, ValueError, "head dim"),
        ("head dim too big", (big := torch.randn(1, 2, 3, 300), big, big), {}, ValueError, "head dim"),
        ("kv length", (q, k, torch.randn(1, 2, 8, 16)), {}, ValueError, "keys"),
        ("integer", (q.long(), k.long(), v.long()), {}, TypeError, "q must be float"),
        ("dtype mix", (q, k.half(), v), {}, TypeError, "k has dtype"),
        ("rank", (q[0], k[0], v[0]), {}, ValueError, "4 dimensions"),
        ("batch", (q, torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)), {}, ValueError, "batch"),
        ("not a tensor", (q.tolist(), k, v), {}, TypeError, "q must be a torch.Tensor"),
        ("mask shape", (q, k, v), dict(attn_mask=torch.ones(8, 8).bool()), ValueError, "attn_mask"),
        ("mask dtype", (q, k, v), dict(attn_mask=torch.ones(8, 9).int()), TypeError, "attn_mask"),
        ("window type", (q, k, v), dict(window=3), ValueError, "window"),
        ("window negative", (q, k, v), dict(window=(-2, 0)), ValueError, "window left"),
        ("window float", (q, k, v), dict(window=(1.5, 0)), TypeError, "window left"),
        ("softcap", (q, k, v), dict(softcap=-1.0), ValueError, "softcap"),
        ("scale", (q, k, v), dict(scale=float("nan")), ValueError, "scale"),
        ("scale type", (q, k, v), dict(scale="x"), TypeError, "scale"),
        ("precision", (q, k, v), dict(precision="fp16"), ValueError, "precision"),
        ("is_causal", (q, k, v), dict(is_causal=1), TypeError, "is_causal"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input(case):
    _, args, kwargs, exc, words = case
    with pytest.raises(exc, match=words):
        safeops.attention(*args, **kwargs)


def _varlen_args():
    q = torch.randn(10, 2, 16)
    k = torch.randn(12, 1, 16)
    v = torch.randn(12, 1, 16)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("case", [
    ("int64", dict(cu_seqlens_q=torch.tensor([0, 4, 10])), TypeError, "cu_seqlens_q must be int32"),
    ("end", dict(cu_seqlens_q=torch.tensor([0, 4, 9]).int()), ValueError, "cu_seqlens_q must start"),
    ("decreasing", dict(cu_seqlens_k=torch.tensor([0, 13, 12]).int()), ValueError, "non-decreasing"),
    ("batch", dict(cu_seqlens_k=torch.tensor([0, 2, 5, 12]).int()), ValueError, "one batch size"),
    ("2-D", dict(cu_seqlens_q=torch.tensor([[0, 4, 10]]).int()), ValueError, "1-D"),
    ("max too small", dict(max_seqlen_q=3), ValueError, "max_seqlen_q"),
    ("layout", dict(q=torch.randn(1, 10, 2, 16)), ValueError, "3 dimensions"),
], ids=lambda c: c[0])
def test_bad_varlen_input(case):
    _, change, exc, words = case
    q, k, v, cu_q, cu_k = _varlen_args()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    args.update(change)
    with pytest.raises(exc, match=words):
        safeops.attention_varlen(**args)


@pytest.mark.parametrize("which", ["q", "k"])
def test_sequence_offsets_past_32_bits_are_refused(which):
    """The kernels step along a sequence with 32-bit offsets: a (B, S, H, D) layout whose S x H x D passes
    2**31 is refused with a ValueError naming the tensor (meta tensors: nothing is allocated)."""
    from safeops.ops import attention_launch

    s, h, d = 1 << 20, 32, 128  # sequence stride H x D = 4096: offsets up to 2**32
    big = torch.empty(1, s, h, d, device="meta", dtype=torch.bfloat16).transpose(1, 2)
    small = torch.empty(1, h, 64, d, device="meta", dtype=torch.bfloat16)
    q, k = (big, small) if which == "q" else (small, big)
    max_q, max_k = q.shape[2], k.shape[2]
    with pytest.raises(ValueError, match=f"^{which}: sequence offsets"):
        attention_launch.forward(q, k, k, None, 0, None, None, max_q, max_k, False, 0.1, None, -1, -1, 3)
    # The same sizes contiguous as (B, H, S, D) pass the check (stride D along the sequence).
    attention_launch.check_sequence_offsets({which: big.contiguous()}, max_q, max_k, False)
