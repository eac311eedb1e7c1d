"""torch.compile with safeops registration on CUDA (skipped without a GPU).

The fma hazard of seed case 1 only shows on CUDA Inductor: a softmax over ``x * scale`` written by hand
with logits near 1e12 gave tens of thousands of non-finite values under stock torch.compile. Under
registration the same code must give the float64 answer, bit-identical to eager safeops.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import safeops
from safeops._seed import FMA_SCALE, FMA_X

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def handwritten(x, scale):
    z = x * scale
    m = torch.amax(z, -1, keepdim=True)
    e = torch.exp(z - m)
    return e / torch.sum(e, -1, keepdim=True)


def _inputs(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # Logits near 1e12 with spread: the rounding error of x*scale (up to 8192 here) is what an fma exposes.
    x = FMA_X * (1 + 1e-6 * torch.randn(64, 1000, device="cuda", generator=g))
    return x.float(), torch.tensor(FMA_SCALE, device="cuda")


@given(seed=st.integers(0, 2**31 - 1))
def test_handwritten_softmax_near_1e12_is_finite_and_exact_under_registration(seed):
    x, scale = _inputs(seed)
    torch._dynamo.reset()
    stock = torch.compile(handwritten)(x, scale)
    stock_bad = int((~torch.isfinite(stock)).sum().item())
    with safeops.registered():
        torch._dynamo.reset()
        safe = torch.compile(handwritten)(x, scale)
    torch._dynamo.reset()
    assert torch.isfinite(safe).all(), f"seed={seed}: non-finite values under registration"
    # The core is rewritten; x * scale stays Inductor's (one fp32 multiply, as eager), so the reference is
    # safeops.softmax of that product.
    eager = safeops.softmax(x * scale)
    assert torch.equal(safe, eager), f"seed={seed}: compiled under registration differs from eager safeops"
    ref = torch.softmax((x * scale).double(), -1)
    assert (safe.double() - ref).abs().max().item() < 1e-6
    print(f"stock torch.compile gave {stock_bad} non-finite values of {stock.numel()} (seed={seed})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_registered_compile_matches_eager_bitwise(dtype):
    x = torch.randn(32, 3000, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(32, 3000, device="cuda", dtype=dtype)

    def f(t):
        return torch.softmax(t, -1)

    with safeops.registered():
        torch._dynamo.reset()
        out = torch.compile(f, fullgraph=True)(x)
        (dx,) = torch.autograd.grad(out, x, g)
    torch._dynamo.reset()
    x2 = x.detach().clone().requires_grad_()
    ref = safeops.softmax(x2)
    (dx2,) = torch.autograd.grad(ref, x2, g)
    assert torch.equal(out, ref)
    assert torch.equal(dx, dx2)


def test_seed_userland_backward_under_registration_on_cuda():
    from safeops._seed import userland_inputs, userland_loss, userland_softmax

    x, y = userland_inputs(device="cuda")
    with safeops.registered():
        torch._dynamo.reset()
        torch.compile(lambda a, b: userland_loss(userland_softmax, a, b))(x, y).backward()
    torch._dynamo.reset()
    assert torch.isfinite(y.grad).all()
    assert y.grad.abs().max().item() <= 1e-3


def test_folded_scale_and_mask_match_eager_safeops_on_cuda():
    # (s * c).masked_fill(drop, -inf) before a hand-written bf16 softmax folds into one safeops call.
    s = torch.randn(4, 8, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    drop = torch.ones(256, 256, device="cuda", dtype=torch.bool).triu(1)[None, None]
    c = 0.125 * 1.1

    def f(t, d):
        z = (t * c).masked_fill(d, float("-inf"))
        m = torch.amax(z, -1, keepdim=True)
        e = torch.exp(z - m)
        return e / torch.sum(e, -1, keepdim=True)

    with safeops.registered():
        torch._dynamo.reset()
        out = torch.compile(f, fullgraph=True)(s, drop)
    torch._dynamo.reset()
    assert sum(safeops.compile.stats.values()) >= 1
    want = safeops.softmax(s.detach(), -1, scale=c, mask=~drop)
    assert torch.equal(out, want)
    g = torch.randn_like(out)
    (ds,) = torch.autograd.grad(out, s, g)
    s2 = s.detach().clone().requires_grad_()
    (ds2,) = torch.autograd.grad(safeops.softmax(s2, -1, scale=c, mask=~drop), s2, g)
    assert torch.equal(ds, ds2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sdpa_under_registration_is_safeops_attention_on_cuda(dtype):
    import torch.nn.functional as F

    q = torch.randn(2, 8, 300, 64, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 333, 64, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 333, 64, device="cuda", dtype=dtype, requires_grad=True)
    keep = torch.rand(300, 333, device="cuda") < 0.8
    keep[7] = False  # a query that sees no key

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)

    safeops.compile.stats.clear()
    with safeops.registered():
        torch._dynamo.reset()
        out = torch.compile(f, fullgraph=True)(q, k, v)
    torch._dynamo.reset()
    assert safeops.compile.stats["attention_call"] == 1
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = safeops.attention(*leaves, attn_mask=keep)
    assert torch.equal(out, want)
    assert (out[:, :, 7] == 0).all()
    g = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, (q, k, v), g)
    for a, b in zip(got_grads, torch.autograd.grad(want, leaves, g), strict=True):
        assert torch.equal(a, b)
