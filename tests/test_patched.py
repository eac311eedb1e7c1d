"""safeops.patched(): routing of F/torch/Tensor softmax, log_softmax and SDPA, restore, nesting, threads."""

from __future__ import annotations

import random
import threading

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from strategies import seeds

import safeops
from safeops import patching

PATCHED = [(F, "softmax"), (F, "log_softmax"), (torch, "softmax"), (torch, "log_softmax"),
           (torch.Tensor, "softmax"), (torch.Tensor, "log_softmax"), (F, "scaled_dot_product_attention")]


def snapshot():
    return {(getattr(o, "__name__", str(o)), n): getattr(o, n) for o, n in PATCHED}


@pytest.fixture
def originals():
    before = snapshot()
    assert not patching.is_patched()
    yield before
    assert snapshot() == before, "patched() left torch modified"
    assert not patching.is_patched()


def empty_rows(seed, dtype=torch.float32):
    x = seed.randn(4, 6, dtype=dtype)
    x[1] = float("-inf")  # a row with nothing included (contract section 4)
    return x


# --------------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------------

SOFTMAX_CALLS = {
    "F.softmax": lambda x: F.softmax(x, dim=-1),
    "F.softmax_positional_stacklevel": lambda x: F.softmax(x, -1, 3),
    "torch.softmax": lambda x: torch.softmax(x, -1),
    "Tensor.softmax": lambda x: x.softmax(-1),
    "Tensor.softmax_kw": lambda x: x.softmax(dim=-1),
    "nn.Softmax": lambda x: torch.nn.Softmax(-1)(x),
}
LOG_SOFTMAX_CALLS = {
    "F.log_softmax": lambda x: F.log_softmax(x, dim=-1),
    "torch.log_softmax": lambda x: torch.log_softmax(x, -1),
    "Tensor.log_softmax": lambda x: x.log_softmax(-1),
    "nn.LogSoftmax": lambda x: torch.nn.LogSoftmax(-1)(x),
}


@pytest.mark.parametrize("call", list(SOFTMAX_CALLS))
@given(seed=seeds())
def test_softmax_calls_are_routed(call, seed, originals, backend):
    fn = SOFTMAX_CALLS[call]
    x = empty_rows(seed).requires_grad_()
    assert fn(x.detach())[1].isnan().all()  # stock: NaN for the empty row
    with safeops.patched():
        y = fn(x)
    expected = safeops.softmax(x.detach(), -1)
    assert torch.equal(y.detach(), expected)
    assert (y[1] == 0).all()
    y.sum().backward()
    assert x.grad.isfinite().all() and (x.grad[1] == 0).all()


@pytest.mark.parametrize("call", list(LOG_SOFTMAX_CALLS))
@given(seed=seeds())
def test_log_softmax_calls_are_routed(call, seed, originals, reference_backend):
    fn = LOG_SOFTMAX_CALLS[call]
    x = empty_rows(seed).requires_grad_()
    with safeops.patched():
        y = fn(x)
    assert torch.equal(y.detach(), safeops.log_softmax(x.detach(), -1))
    y[0].sum().backward()
    assert x.grad.isfinite().all()


@given(seed=seeds())
def test_dtype_argument_maps_to_output_dtype(seed, originals, reference_backend):
    x = seed.randn(3, 7, dtype=torch.bfloat16)
    with safeops.patched():
        a = F.softmax(x, -1, dtype=torch.float32)
        b = torch.softmax(x, -1, torch.float32)
        c = x.softmax(-1, dtype=torch.float64)
    assert a.dtype == b.dtype == torch.float32 and c.dtype == torch.float64
    assert torch.equal(a, safeops.softmax(x, -1, dtype=torch.float32)) and torch.equal(a, b)
    # widening dtype: the same answer torch gives, up to its own rounding
    torch.testing.assert_close(a, torch.softmax(x, -1, dtype=torch.float32), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# SDPA
# --------------------------------------------------------------------------------------------------

def qkv(seed, hq=4, hkv=4, sq=5, sk=5, d=8, dtype=torch.float32):
    return seed.randn(2, hq, sq, d, dtype=dtype), seed.randn(2, hkv, sk, d, dtype=dtype), \
        seed.randn(2, hkv, sk, d, dtype=dtype)


SDPA_CASES = ["plain", "bool_mask", "float_mask", "causal", "causal_rect", "gqa", "scale"]


@pytest.mark.parametrize("case", SDPA_CASES)
@given(seed=seeds())
def test_sdpa_is_routed(case, seed, originals, reference_backend):
    q, k, v = qkv(seed, hkv=2 if case == "gqa" else 4, sk=7 if case == "causal_rect" else 5)
    kwargs = {}
    if case == "bool_mask":
        kwargs["attn_mask"] = seed.mask(2, 1, 5, 5)
        kwargs["attn_mask"][..., 0] = True
    if case == "float_mask":
        kwargs["attn_mask"] = seed.randn(5, 5)
    if case in ("causal", "causal_rect"):
        kwargs["is_causal"] = True
    if case == "gqa":
        kwargs["enable_gqa"] = True
    if case == "scale":
        kwargs["scale"] = 0.3
    kwargs64 = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                for n, t in kwargs.items()}
    stock = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kwargs64)
    calls = []
    real = safeops.attention

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    safeops.attention = spy
    try:
        with safeops.patched():
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    finally:
        safeops.attention = real
    assert len(calls) == 1
    torch.testing.assert_close(out.double(), stock, rtol=1e-5, atol=1e-6)


@given(seed=seeds())
def test_sdpa_empty_row_and_gradients(seed, originals, backend):
    q, k, v = (t.requires_grad_() for t in qkv(seed))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    mask[0, :, 2] = False  # query 2 of batch 0 sees no key
    with safeops.patched():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (out[0, :, 2] == 0).all()
    out.square().sum().backward()
    assert all(t.grad.isfinite().all() for t in (q, k, v))
    assert (q.grad[0, :, 2] == 0).all()


@given(seed=seeds())
def test_sdpa_dropout_uses_the_materialized_path(seed, originals, reference_backend):
    q, k, v = qkv(seed)
    torch.manual_seed(seed.value)
    with safeops.patched():
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(seed.value)
    p = safeops.softmax(q @ k.transpose(-1, -2), -1, scale=8 ** -0.5)
    expected = F.dropout(p, 0.5) @ v
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Fallbacks: the original function answers (or raises) as it would without patched()
# --------------------------------------------------------------------------------------------------

@given(seed=seeds())
def test_fallbacks(seed, originals, reference_backend):
    ints = torch.arange(6).reshape(2, 3)
    with pytest.raises(RuntimeError) as stock_err:
        torch.softmax(ints, -1)
    patching.fallback_counts.clear()
    x = seed.randn(3, 4, 5)
    with safeops.patched():
        with pytest.raises(type(stock_err.value)):
            torch.softmax(ints, -1)  # integer input: torch's own error
        with pytest.warns(UserWarning, match="Implicit dimension"):
            legacy = F.softmax(x)  # dim=None keeps torch's legacy rule
        three_d = F.scaled_dot_product_attention(x, x, x)  # 3-D SDPA inputs: stock
        out_of_range = None
        with pytest.raises(IndexError):
            out_of_range = torch.softmax(x, 5)
    assert out_of_range is None
    with pytest.warns(UserWarning, match="Implicit dimension"):
        torch.testing.assert_close(legacy, F.softmax(x))  # torch's CPU kernels are not bit-reproducible
    torch.testing.assert_close(three_d, F.scaled_dot_product_attention(x, x, x))
    reasons = set(patching.fallback_counts)
    assert {"dtype torch.int64", "dim None is not an int", "inputs are not 4-D (B, H, S, D)",
            "rejected by safeops: ValueError"} <= reasons, reasons


@given(seed=seeds())
def test_backend_without_device_support_falls_back(seed, originals, monkeypatch):
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = empty_rows(seed)
    with safeops.patched():
        y = F.softmax(x, -1)
    assert y[1].isnan().all()  # the stock answer: safeops had no way to run on this device


# --------------------------------------------------------------------------------------------------
# Restore, nesting, exceptions, threads
# --------------------------------------------------------------------------------------------------

def test_restored_after_exception(originals):
    with pytest.raises(KeyError):
        with safeops.patched():
            assert patching.is_patched() and F.softmax is not originals[("torch.nn.functional", "softmax")]
            raise KeyError("boom")


@given(seed=seeds())
def test_nesting_is_reentrant(seed, originals, reference_backend):
    x = empty_rows(seed)
    with safeops.patched():
        inner_fn = F.softmax
        with safeops.patched():
            assert F.softmax is inner_fn  # the inner block does not patch twice
        assert patching.is_patched() and (F.softmax(x, -1)[1] == 0).all()  # still patched after inner exit
    assert F.softmax(x, -1)[1].isnan().all()


@given(seed=seeds())
def test_decorator_form(seed, originals, reference_backend):
    @safeops.patched()
    def f(x):
        return torch.softmax(x, -1)

    assert (f(empty_rows(seed))[1] == 0).all()


def test_threads_enter_and_exit_concurrently(originals, reference_backend):
    errors: list[BaseException] = []
    start = threading.Barrier(8)
    x = torch.full((2, 3), float("-inf"))

    def worker(i):
        rng = random.Random(i)
        try:
            start.wait()
            for _ in range(40):
                with safeops.patched():
                    assert patching.is_patched()
                    assert (F.softmax(x, -1) == 0).all()  # routed for as long as this thread is inside
                    if rng.random() < 0.3:
                        with safeops.patched():
                            assert (x.softmax(-1) == 0).all()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert patching._depth == 0


@given(seed=seeds())
def test_stock_mha_inside_patched_is_finite(seed, originals, reference_backend):
    """F.multi_head_attention_forward looks softmax/SDPA up at call time, so stock MHA becomes safe."""
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = seed.randn(2, 3, 8)
    kpm = torch.zeros(2, 3, dtype=torch.bool)
    kpm[1] = True
    assert mha(x, x, x, key_padding_mask=kpm)[0][1].isnan().all()
    with safeops.patched():
        out, w = mha(x, x, x, key_padding_mask=kpm)
    assert out.isfinite().all() and (w[1] == 0).all()


def test_sdpa_with_a_learned_float_mask_falls_back_and_keeps_its_gradient(reference_backend):
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    with safeops.patched():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    (db,) = torch.autograd.grad(out.sum(), bias)
    b2 = bias.detach().clone().requires_grad_(True)
    (want,) = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=b2).sum(), b2)
    torch.testing.assert_close(db, want)
