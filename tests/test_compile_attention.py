"""torch.compile routes ``F.scaled_dot_product_attention`` to safeops.attention while registered.

Issue 3, part 3 (attention). The rewrite runs in the same pre-grad pass as the softmax rewrite: what it
rewrites is counted in ``safeops.compile.stats["attention_call"]``, and a rewritten call gives the same
bits as eager ``safeops.attention`` with the same arguments, forward and backward (contract section 6).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from strategies import each_example, seeds

import safeops
import safeops.compile as safeops_compile

stats = safeops_compile.stats


@pytest.fixture(autouse=True)
def isolated():
    """Unregistered, Dynamo reset, stats cleared and Inductor's caches off (a cached graph is not rewritten
    again, so it would not count in the stats), as in tests/test_compile_register.py; for each Hypothesis
    example too (``@each_example``)."""
    with isolation():
        yield


@contextlib.contextmanager
def isolation():
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    safeops.unregister()
    torch._dynamo.reset()
    stats.clear()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        try:
            yield
        finally:
            safeops.unregister()
            torch._dynamo.reset()
            stats.clear()


def compiled(fn, mode: str):
    return torch.compile(fn, backend="safeops" if mode == "backend" else "inductor", fullgraph=True)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def assert_same_bits(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    diff = bits(a) != bits(b)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {a.numel()} elements differ in their bits"


def inputs(seed, dtype, hq=4, hkv=4, sq=7, sk=9, d=16):
    q = seed.randn(2, hq, sq, d, dtype=dtype).requires_grad_(True)
    k = seed.randn(2, hkv, sk, d, dtype=dtype).requires_grad_(True)
    v = seed.randn(2, hkv, sk, d, dtype=dtype).requires_grad_(True)
    return q, k, v


# (name, SDPA keyword arguments from (seed, sq, sk), safeops.attention keyword arguments, kv heads)
def _bool_mask(seed, sq, sk):
    keep = seed.mask(sq, sk, keep=0.7)
    keep[3] = False  # a query row that sees no key: 0 output, zero gradient
    return keep


def _float_mask(seed, sq, sk):
    return torch.where(seed.mask(1, sq, sk, keep=0.8), seed.randn(1, sq, sk), torch.tensor(float("-inf")))


CASES = {
    "plain": (lambda s, sq, sk: {}, 4),
    "causal": (lambda s, sq, sk: {"is_causal": True}, 4),
    "scale": (lambda s, sq, sk: {"scale": 0.3}, 4),
    "bool_mask": (lambda s, sq, sk: {"attn_mask": _bool_mask(s, sq, sk)}, 4),
    "float_mask": (lambda s, sq, sk: {"attn_mask": _float_mask(s, sq, sk)}, 4),
    "gqa_causal": (lambda s, sq, sk: {"is_causal": True, "enable_gqa": True}, 2),
    "gqa_mask_scale": (lambda s, sq, sk: {"attn_mask": _bool_mask(s, sq, sk), "enable_gqa": True,
                                          "scale": 0.125}, 1),
}


@pytest.mark.parametrize("mode", ["registered", "backend"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
@given(seed=seeds())
@each_example(isolation)
def test_sdpa_is_rewritten_and_bit_identical_to_eager(reference_backend, case, dtype, mode, seed):
    make, hkv = CASES[case]
    q, k, v = inputs(seed, dtype, hkv=hkv)
    options = make(seed, q.shape[2], k.shape[2])
    if "attn_mask" in options and options["attn_mask"].dtype != torch.bool:
        options["attn_mask"] = options["attn_mask"].to(dtype)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **options)

    with safeops.registered() if mode == "registered" else contextlib.nullcontext():
        out = compiled(f, mode)(q, k, v)
    assert dict(stats) == {"attention_call": 1}, dict(stats)
    mine = {key: val for key, val in options.items() if key != "enable_gqa"}
    ql, kl, vl = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    want = safeops.attention(ql, kl, vl, **mine)
    assert_same_bits(out, want, f"{case} output; {seed}")
    g = seed.randn(*out.shape, dtype=out.dtype)
    got_grads = torch.autograd.grad(out, (q, k, v), g)
    want_grads = torch.autograd.grad(want, (ql, kl, vl), g)
    for name, a, b in zip("qkv", got_grads, want_grads, strict=True):
        assert_same_bits(a, b, f"{case} d{name}; {seed}")
    if case in ("bool_mask", "gqa_mask_scale"):  # the query row with no visible key (contract section 4)
        assert (out[:, :, 3] == 0).all() and (got_grads[0][:, :, 3] == 0).all(), seed


@given(seed=seeds())
@each_example(isolation)
def test_sdpa_with_the_triton_kernels(triton_backend, seed):
    # The same rewrite with safeops' Triton kernels (interpreted here; compiled on the GPU machine).
    q, k, v = inputs(seed, torch.float32, hq=2, hkv=1, sq=5, sk=6, d=16)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with safeops.registered():
        out = compiled(f, "registered")(q, k, v)
    assert dict(stats) == {"attention_call": 1}, dict(stats)
    assert_same_bits(out, safeops.attention(q, k, v, is_causal=True), f"interpreted kernels; {seed}")


NOT_REWRITTEN = {
    # dropout: safeops has none, so torch's own kernel stays
    "dropout": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5),
    # 3-D inputs (no head dimension): not safeops' layout
    "3d": lambda q, k, v: F.scaled_dot_product_attention(q[:, 0], k[:, 0], v[:, 0]),
}


@pytest.mark.parametrize("name", list(NOT_REWRITTEN))
@given(seed=seeds())
@each_example(isolation)
def test_sdpa_calls_safeops_cannot_serve_stay_stock(reference_backend, name, seed):
    q, k, v = inputs(seed, torch.float32)
    with safeops.registered():
        out = compiled(NOT_REWRITTEN[name], "registered")(q, k, v)
    assert stats["attention_call"] == 0, dict(stats)
    assert torch.isfinite(out).all()


@given(seed=seeds())
@each_example(isolation)
def test_sdpa_is_not_rewritten_when_unregistered(reference_backend, seed):
    q, k, v = inputs(seed, torch.float32)
    out = compiled(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), "stock")(q, k, v)
    assert not stats, dict(stats)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


@given(seed=seeds())
@each_example(isolation)
def test_sdpa_with_a_mask_that_requires_grad_stays_stock(reference_backend, seed):
    # safeops gives an additive mask no gradient; a learned bias passed as attn_mask must keep training.
    q, k, v = inputs(seed, torch.float32)
    bias = seed.randn(1, 1, q.shape[2], k.shape[2]).requires_grad_(True)

    def f(q, k, v, b):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=b)

    with safeops.registered():
        out = compiled(f, "registered")(q, k, v, bias)
    assert stats["attention_call"] == 0, dict(stats)
    (db,) = torch.autograd.grad(out.sum(), bias)
    b2 = bias.detach().clone().requires_grad_(True)
    (db_eager,) = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=b2).sum(), b2)
    torch.testing.assert_close(db, db_eager)


@given(seed=seeds())
@each_example(isolation)
def test_attention_refuses_a_float_mask_that_requires_grad(reference_backend, seed):
    q, k, v = inputs(seed, torch.float32)
    bias = seed.randn(q.shape[2], k.shape[2]).requires_grad_(True)
    with pytest.raises(ValueError, match="attn_mask requires grad"):
        safeops.attention(q, k, v, attn_mask=bias)
    with torch.no_grad():  # no gradient wanted: fine
        safeops.attention(q, k, v, attn_mask=bias)
    safeops.attention(q, k, v, attn_mask=bias.detach())


@given(seed=seeds())
@each_example(isolation)
def test_attention_double_backward_raises(reference_backend, seed):
    q, k, v = inputs(seed, torch.float32)
    with pytest.raises(RuntimeError, match="double backward|autograd formula"):
        (dq,) = torch.autograd.grad((safeops.attention(q, k, v) ** 2).sum(), q, create_graph=True)
        dq.sum().backward()
