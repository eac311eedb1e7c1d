"""safeops.nn: Softmax, LogSoftmax and MultiheadAttention against torch.nn's, option by option.

torch.nn.MultiheadAttention in float64 is the independent oracle: the same weights (state_dict copied
across), the same inputs, outputs and gradients compared. Where the two differ on purpose (a query with no key
left gives NaN in torch and 0 in safeops) the tests check both sides of that difference.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from strategies import seeds

import safeops
from safeops import nn as snn

F64 = torch.float64


# --------------------------------------------------------------------------------------------------
# Softmax / LogSoftmax
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [0, 1, -1])
@given(seed=seeds())
def test_softmax_modules_match_torch(kind, dim, seed, backend):
    stock_cls, safe_cls = {"softmax": (torch.nn.Softmax, snn.Softmax),
                           "log_softmax": (torch.nn.LogSoftmax, snn.LogSoftmax)}[kind]
    x = seed.randn(3, 5, 7, dtype=F64).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    safe, stock = safe_cls(dim), stock_cls(dim)
    assert isinstance(safe, stock_cls)
    y, y_ref = safe(x), stock(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    g = seed.randn(3, 5, 7, dtype=F64)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)


@given(seed=seeds())
def test_softmax_module_legacy_dim_none(seed):
    x = seed.randn(2, 3, 4)
    with pytest.warns(UserWarning, match="Implicit dimension"):
        y = snn.Softmax()(x)
    with pytest.warns(UserWarning, match="Implicit dimension"):
        y_ref = torch.nn.Softmax()(x)
    torch.testing.assert_close(y, y_ref)  # 3-D input: the legacy rule picks dim 0 in both


def test_softmax_module_empty_row_is_zero_not_nan():
    x = torch.full((2, 4), float("-inf"), requires_grad=True)
    assert torch.nn.Softmax(-1)(x).isnan().all()  # the stock behaviour we replace
    y = snn.Softmax(-1)(x)
    assert (y == 0).all()
    y.sum().backward()
    assert (x.grad == 0).all()
    assert (snn.LogSoftmax(-1)(x.detach()) == float("-inf")).all()


def test_softmax_module_state_dict_and_repr():
    assert snn.Softmax(1).state_dict() == {} and repr(snn.Softmax(1)) == "Softmax(dim=1)"
    assert snn.LogSoftmax(0).dim == 0


# --------------------------------------------------------------------------------------------------
# MultiheadAttention: helpers
# --------------------------------------------------------------------------------------------------

E, HEADS, L, S, N = 8, 2, 3, 5, 2


def make_pair(dtype=F64, **kwargs):
    """A torch MultiheadAttention and a safeops one with the same weights (state_dict copied across)."""
    stock = torch.nn.MultiheadAttention(E, HEADS, **kwargs).to(dtype)
    safe = snn.MultiheadAttention(E, HEADS, **kwargs).to(dtype)
    missing = safe.load_state_dict(stock.state_dict())
    assert not missing.missing_keys and not missing.unexpected_keys
    return stock, safe


def inputs(seed, kwargs, dtype=F64, self_attention=False, batched=True):
    bf = kwargs.get("batch_first", False)
    kdim, vdim = kwargs.get("kdim") or E, kwargs.get("vdim") or E

    def t(length, width):
        if not batched:
            return seed.randn(length, width, dtype=dtype)
        return seed.randn(N, length, width, dtype=dtype) if bf else seed.randn(length, N, width, dtype=dtype)

    q = t(L, E)
    if self_attention:
        k = v = q
    else:
        k, v = t(S, kdim), t(S, vdim)
    return q, k, v


def key_padding(seed, kind, batched=True, src_len=S):
    """A key padding mask that leaves every sample at least one key (torch would give NaN otherwise)."""
    if kind is None:
        return None
    pad = seed.mask(N, src_len, keep=0.4)
    pad[:, 0] = False
    if kind == "float":
        pad = torch.zeros(N, src_len, dtype=F64).masked_fill(pad, float("-inf")) + seed.randn(N, src_len,
                                                                                               dtype=F64)
    return pad if batched else pad[0]


def attention_mask(seed, kind, src_len=S):
    if kind is None:
        return None
    if kind == "bool2d":
        m = seed.mask(L, src_len, keep=0.6)
        m[:, 0] = True
        return ~m  # torch.nn.MultiheadAttention: True = do not attend
    if kind == "float2d":
        return seed.randn(L, src_len, dtype=F64)
    if kind == "float3d":
        return seed.randn(N * HEADS, L, src_len, dtype=F64)
    raise ValueError(kind)


def run(module, q, k, v, **kw):
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if k is q:
        ks = vs = qs
    out, w = module(qs, ks, vs, **kw)
    return out, w, (qs, ks, vs)


def grads_of(module, leaves):
    named = {n: p.grad for n, p in module.named_parameters()}
    return named, [t.grad for t in leaves]


def assert_same_results(stock, safe, q, k, v, seed, *, atol=1e-11, **kw):
    out_ref, w_ref, leaves_ref = run(stock, q, k, v, **kw)
    out, w, leaves = run(safe, q, k, v, **kw)
    torch.testing.assert_close(out, out_ref, rtol=1e-9, atol=atol)
    if w_ref is None:
        assert w is None
    else:
        torch.testing.assert_close(w, w_ref, rtol=1e-9, atol=atol)
    g = seed.randn(*out.shape, dtype=out.dtype)
    loss_ref = (out_ref * g).sum() + (0 if w_ref is None else (w_ref * w_ref).sum())
    loss = (out * g).sum() + (0 if w is None else (w * w).sum())
    loss_ref.backward()
    loss.backward()
    p_ref, in_ref = grads_of(stock, leaves_ref)
    p, ins = grads_of(safe, leaves)
    assert p.keys() == p_ref.keys()
    for name in p:
        torch.testing.assert_close(p[name], p_ref[name], rtol=1e-8, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")
    for a, b in zip(ins, in_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=atol)


# --------------------------------------------------------------------------------------------------
# MultiheadAttention: parity, option by option
# --------------------------------------------------------------------------------------------------

MODULE_OPTIONS = {
    "default": {},
    "batch_first": {"batch_first": True},
    "kdim_vdim": {"kdim": 6, "vdim": 3},
    "no_bias": {"bias": False},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "bias_kv_zero_attn_batch_first": {"add_bias_kv": True, "add_zero_attn": True, "batch_first": True},
}
MASKS = [(None, None), ("bool", None), ("float", None), (None, "bool2d"), (None, "float2d"),
         (None, "float3d"), ("bool", "bool2d"), ("float", "float3d")]


@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)],
                         ids=["weights_avg", "weights_per_head", "no_weights"])
@pytest.mark.parametrize("masks", MASKS, ids=[f"kpm_{a}-am_{b}" for a, b in MASKS])
@pytest.mark.parametrize("option", list(MODULE_OPTIONS))
@given(seed=seeds())
def test_mha_matches_torch(option, masks, need_weights, average, seed, reference_backend):
    kwargs = MODULE_OPTIONS[option]
    stock, safe = make_pair(**kwargs)
    q, k, v = inputs(seed, kwargs)
    kpm, am = key_padding(seed, masks[0]), attention_mask(seed, masks[1])
    with pytest.warns() if (kpm is not None and am is not None and kpm.dtype != am.dtype) else _nothing():
        assert_same_results(stock, safe, q, k, v, seed, key_padding_mask=kpm, attn_mask=am,
                            need_weights=need_weights, average_attn_weights=average)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("need_weights", [True, False])
@given(seed=seeds())
def test_mha_kernel_path_matches_torch(need_weights, seed, backend):
    """Both safeops backends (reference, and the Triton kernels under the interpreter) behind the module."""
    kwargs = {"batch_first": True}
    stock, safe = make_pair(dtype=torch.float32, **kwargs)
    stock64 = torch.nn.MultiheadAttention(E, HEADS, **kwargs).to(F64)
    stock64.load_state_dict(stock.state_dict())
    q, k, v = inputs(seed, kwargs, dtype=torch.float32)
    kpm = key_padding(seed, "bool")
    out, w = safe(q, k, v, key_padding_mask=kpm, need_weights=need_weights)
    out_ref, w_ref = stock64(q.double(), k.double(), v.double(), key_padding_mask=kpm, need_weights=True)
    torch.testing.assert_close(out.double(), out_ref, rtol=1e-5, atol=2e-6)
    if need_weights:
        torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=2e-6)


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("self_attention", [True, False])
@given(seed=seeds())
def test_mha_self_attention_and_unbatched(self_attention, seed, reference_backend):
    stock, safe = make_pair()
    q, k, v = inputs(seed, {}, self_attention=self_attention)
    assert_same_results(stock, safe, q, k, v, seed)
    q, k, v = inputs(seed, {}, self_attention=self_attention, batched=False)
    src_len = L if self_attention else S
    kpm = key_padding(seed, "bool", batched=False, src_len=src_len)
    assert_same_results(stock, safe, q, k, v, seed, key_padding_mask=kpm,
                        attn_mask=seed.randn(HEADS, L, src_len, dtype=F64))


@pytest.mark.parametrize("need_weights", [True, False])
@given(seed=seeds())
def test_mha_is_causal_hint(need_weights, seed, reference_backend):
    """torch reads is_causal as "attn_mask is the causal mask"; the results must agree either way."""
    stock, safe = make_pair(batch_first=True)
    x = seed.randn(N, L, E, dtype=F64)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)
    assert_same_results(stock, safe, x, x, x, seed, attn_mask=causal, is_causal=True,
                        need_weights=need_weights)
    with pytest.raises(ValueError, match="is_causal"):
        safe(x, x, x, is_causal=True)


@given(seed=seeds())
def test_mha_weights_are_the_probabilities_of_the_output(seed, reference_backend):
    """need_weights=True: the returned per-head weights times the projected values give the output."""
    _, safe = make_pair(batch_first=True, bias=False)
    q, k, v = inputs(seed, {"batch_first": True})
    out, w = safe(q, k, v, need_weights=True, average_attn_weights=False)
    w_v = safe.in_proj_weight[2 * E:]
    vh = (v @ w_v.T).reshape(N, S, HEADS, E // HEADS).transpose(1, 2)
    heads = (w @ vh).transpose(1, 2).reshape(N, L, E)
    torch.testing.assert_close(out, heads @ safe.out_proj.weight.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.sum(-1), torch.ones(N, HEADS, L, dtype=F64), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# Fully padded samples: NaN in torch, zeros and finite gradients in safeops
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@given(seed=seeds())
def test_mha_fully_padded_sample(need_weights, bias, seed, backend):
    stock, safe = make_pair(dtype=torch.float32, batch_first=True, bias=bias)
    q, k, v = inputs(seed, {"batch_first": True}, dtype=torch.float32)
    kpm = torch.zeros(N, S, dtype=torch.bool)
    kpm[1] = True  # every key of sample 1 is padding
    out_ref, _ = stock(q, k, v, key_padding_mask=kpm, need_weights=need_weights)
    if need_weights:  # torch's softmax path; its SDPA path gives 0 or NaN depending on version and device
        assert out_ref[1].isnan().all(), "stock torch was expected to give NaN for a fully padded sample"

    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out, w = safe(qs, ks, vs, key_padding_mask=kpm, need_weights=need_weights)
    expected = safe.out_proj.bias.detach().expand(L, E) if bias else torch.zeros(L, E)
    assert torch.equal(out[1].detach(), expected)  # attention 0, so out_proj gives its bias
    if need_weights:
        assert (w[1] == 0).all()
    torch.testing.assert_close(out[0], out_ref[0], rtol=1e-5, atol=2e-6)  # the other sample is unaffected
    out.square().sum().backward()
    for t in (qs, ks, vs, *safe.parameters()):
        assert t.grad is not None and t.grad.isfinite().all()
    assert (qs.grad[1] == 0).all() and (ks.grad[1] == 0).all() and (vs.grad[1] == 0).all()


# --------------------------------------------------------------------------------------------------
# Dropout
# --------------------------------------------------------------------------------------------------

@given(seed=seeds())
def test_mha_dropout_matches_torch_with_the_same_rng(seed, reference_backend):
    """need_weights=True: torch drops out the weights it returns; so do we, with the same random draws."""
    stock, safe = make_pair(dropout=0.4)
    q, k, v = inputs(seed, {})
    state = torch.random.get_rng_state()
    out_ref, w_ref = stock(q, k, v, average_attn_weights=False)
    torch.random.set_rng_state(state)
    out, w = safe(q, k, v, average_attn_weights=False)
    assert (w_ref == 0).any()
    torch.testing.assert_close(w, w_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)


@given(seed=seeds())
def test_mha_dropout_without_weights_and_eval(seed, reference_backend):
    stock, safe = make_pair(dropout=0.5, batch_first=True)
    q, k, v = inputs(seed, {"batch_first": True})
    torch.manual_seed(seed.value)
    _, w = safe(q, k, v, average_attn_weights=False)
    torch.manual_seed(seed.value)
    out, none = safe(q, k, v, need_weights=False)
    assert none is None
    heads = _heads_from_weights(safe, w, v)
    torch.testing.assert_close(out, heads, rtol=1e-12, atol=1e-12)  # the same dropped weights gave the output
    stock.eval(), safe.eval()
    assert_same_results(stock, safe, q, k, v, seed, need_weights=False)


def _heads_from_weights(safe, w, v):
    w_v, b_v = safe.in_proj_weight[2 * E:], safe.in_proj_bias[2 * E:]
    vh = (v @ w_v.T + b_v).reshape(N, S, HEADS, E // HEADS).transpose(1, 2)
    heads = (w @ vh).transpose(1, 2).reshape(N, L, E)
    return heads @ safe.out_proj.weight.T + safe.out_proj.bias


# --------------------------------------------------------------------------------------------------
# state_dict, construction, errors
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", list(MODULE_OPTIONS))
def test_mha_state_dict_round_trips(option):
    kwargs = MODULE_OPTIONS[option]
    safe = snn.MultiheadAttention(E, HEADS, **kwargs)
    stock = torch.nn.MultiheadAttention(E, HEADS, **kwargs)
    assert list(safe.state_dict()) == list(stock.state_dict())
    assert [n for n, _ in safe.named_parameters()] == [n for n, _ in stock.named_parameters()]
    stock.load_state_dict(safe.state_dict(), strict=True)
    for (name, a), b in zip(safe.state_dict().items(), stock.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    back = snn.MultiheadAttention(E, HEADS, **kwargs)
    back.load_state_dict(stock.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), stock.state_dict().values(),
                                                  strict=True))
    assert isinstance(safe, torch.nn.MultiheadAttention)


@given(seed=seeds())
def test_mha_errors(seed, reference_backend):
    safe = snn.MultiheadAttention(E, HEADS, batch_first=True)
    x = seed.randn(N, L, E)
    with pytest.raises(ValueError, match="key_padding_mask"):
        safe(x, x, x, key_padding_mask=torch.zeros(N, L + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask"):
        safe(x, x, x, attn_mask=torch.zeros(L, L + 1))
    with pytest.raises(TypeError, match="attn_mask"):
        safe(x, x, x, attn_mask=torch.zeros(L, L, dtype=torch.int64))
    with pytest.raises(ValueError, match="embed_dim"):
        safe(seed.randn(N, L, E + 1), x, x)
    with pytest.raises(ValueError, match="dimensions"):
        safe(x, x[0], x[0])


def test_every_mask_combination_has_a_test():
    combos = set(itertools.product([None, "bool", "float"], [None, "bool2d", "float2d", "float3d"]))
    tested = set(MASKS) | {(None, None)}
    assert len(tested) >= 8 and tested <= combos
    assert safeops.nn.MultiheadAttention is snn.MultiheadAttention


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@given(seed=seeds())
def test_mha_low_precision_against_float64(dtype, need_weights, seed, reference_backend):
    """Low-precision inputs: the same bf16/fp16 weights and inputs, evaluated by torch in float64."""
    stock, safe = make_pair(dtype=dtype, batch_first=True)
    stock = stock.double()
    q, k, v = inputs(seed, {"batch_first": True}, dtype=dtype)
    kpm = key_padding(seed, "bool")
    out, w = safe(q, k, v, key_padding_mask=kpm, need_weights=need_weights)
    ref, w_ref = stock(q.double(), k.double(), v.double(), key_padding_mask=kpm)
    assert out.dtype == dtype
    # The projections run in the low precision (as in torch); the attention itself in fp32.
    tol = {torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    if need_weights:
        assert w.dtype == dtype
        torch.testing.assert_close(w.double(), w_ref, rtol=tol, atol=tol)


@given(seed=seeds())
def test_mha_learned_float_mask_gets_its_gradient(seed, reference_backend):
    # A float attn_mask that requires grad (a learned bias) gets the same gradient as in torch, also with
    # need_weights=False (the fused kernel gives a mask no gradient, so that case takes the other path).
    stock, safe = make_pair()
    q, k, v = inputs(seed, {})
    bias = seed.randn(L, S, dtype=F64)
    grads = []
    for module in (stock, safe):
        b = bias.clone().requires_grad_(True)
        out, _ = module(q, k, v, attn_mask=b, need_weights=False)
        (db,) = torch.autograd.grad(out.sum(), b)
        grads.append(db)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-12)
