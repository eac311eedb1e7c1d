"""torch.compile routes softmax through safeops: ``register()``, ``registered()``, ``backend="safeops"``.

Issue 3.

What is checked, and how:

- which softmax the compiled graph runs: ``safeops.compile.stats`` (a Counter of rewrites by kind) plus
  behaviour that only safeops has (an all ``-inf`` row gives 0 / ``-inf`` and a zero gradient where stock
  Inductor gives NaN), so the tests do not depend on Inductor's internal graphs;
- calls of the library functions: bit-identical to eager safeops, forward and backward (contract section 6);
- hand-written softmax / log-softmax cores: the float64 oracle (tests/oracle.py) within the dtype tolerance;
- negatives (code that is not a softmax, or not this softmax): no rewrite, and the same bits as stock;
- the seed case 1c, fullgraph / dynamic shapes, unregister, the FX-graph / AOT-autograd caches, a training
  step of a small bf16 attention model, and the backend name.

Inductor's caches are off in every test but the cache tests: from torch 2.12 a pre-grad pass with a
``uuid()`` runs *after* the AOT-autograd cache lookup, so a graph served from the on-disk cache (from an
earlier run of this suite) is correct but is not rewritten again and does not count in ``stats``.
The cache tests turn them on, in a fresh cache directory.
"""

from __future__ import annotations

import contextlib
import copy
import math

import oracle as O
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from strategies import each_example, seeds
from torch import nn

import safeops
import safeops.compile as safeops_compile
from safeops import _seed

stats = safeops_compile.stats
NEG_INF = float("-inf")
FP32 = pytest.param(torch.float32, id="fp32")
BF16 = pytest.param(torch.bfloat16, id="bf16")
FP16 = pytest.param(torch.float16, id="fp16")
DTYPES = [FP32, BF16, FP16]
DTYPE_LIST = [torch.float32, torch.bfloat16, torch.float16]
DIMS = (-1, 0, 1)  # last, first and (for the 3-d inputs used here) the middle dim
SHAPE = (4, 5, 6)  # a different length along each dim
MODES = ["registered", "backend"]  # safeops.registered() + default Inductor, or backend="safeops"


# --------------------------------------------------------------------------------------------------
# Isolation and helpers
# --------------------------------------------------------------------------------------------------


def _inductor_config():
    import torch._inductor.config as config

    return config


def _functorch_config():
    import torch._functorch.config as config

    return config


@pytest.fixture(autouse=True)
def isolated():
    """Every test starts and ends unregistered, with Dynamo reset, stats cleared and the caches off.

    The teardown unregisters even when the test failed, and puts back the pre-grad pass slot if an
    ``unregister()`` bug left something there, so that one failure cannot leak into the other tests (the
    unregister tests assert the restoration themselves). Hypothesis tests run each example inside
    ``isolation()`` too (``@each_example``).
    """
    with isolation():
        yield


@contextlib.contextmanager
def isolation():
    config = _inductor_config()
    saved_pass = config.pre_grad_custom_pass
    if safeops.is_registered():
        safeops.unregister()
    torch._dynamo.reset()
    stats.clear()
    with config.patch(fx_graph_cache=False), _functorch_config().patch(enable_autograd_cache=False):
        try:
            yield
        finally:
            if safeops.is_registered():
                safeops.unregister()
            torch._dynamo.reset()
            config.pre_grad_custom_pass = saved_pass
            stats.clear()


@contextlib.contextmanager
def compile_mode(mode: str):
    """The context a compiled call of ``mode`` runs in (registration is global state, the backend is not)."""
    if mode == "registered":
        with safeops.registered():
            yield
    else:
        yield


def compiled(fn, how: str, **kwargs):
    """``torch.compile(fn, fullgraph=True)`` for a mode.

    "registered" and "stock" use the default Inductor backend (what it does depends on registration at the
    first call); "backend" uses ``backend="safeops"``.
    """
    backend = "safeops" if how == "backend" else "inductor"
    return torch.compile(fn, backend=backend, fullgraph=True, **kwargs)


def bits(t: torch.Tensor) -> torch.Tensor:
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}
    return t.detach().contiguous().view(ints[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str, context: object) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, \
        f"{what}: {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}; {context}"
    diff = bits(a) != bits(b)
    if diff.any():
        first = tuple(diff.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(diff.sum())} of {a.numel()} elements differ in their bits, first "
                             f"at {list(first)}: {a[first].item()!r} vs {b[first].item()!r}; {context}")


def line(dim: int, ndim: int = 3, at: int = 0) -> tuple:
    """Index of one whole row along ``dim`` (every other index ``at``)."""
    dim %= ndim
    return tuple(slice(None) if d == dim else at for d in range(ndim))


def fill_line(x: torch.Tensor, dim: int, value: float, at: int = 0) -> torch.Tensor:
    x = x.clone()
    x[line(dim, x.dim(), at)] = value
    return x


def rewrites() -> dict:
    return {k: v for k, v in stats.items() if v}


# --------------------------------------------------------------------------------------------------
# 1. Calls of softmax / log_softmax / logsumexp: rewritten, and the same bits as eager safeops
# --------------------------------------------------------------------------------------------------

SOFTMAX_MODULES = {d: nn.Softmax(dim=d) for d in DIMS}
LOG_SOFTMAX_MODULES = {d: nn.LogSoftmax(dim=d) for d in DIMS}
CALL_FORMS = {
    # name: (the user's call, the eager safeops call it must match bit for bit, stats kind)
    "torch.softmax": (lambda x, d: torch.softmax(x, d), lambda x, d: safeops.softmax(x, d), "softmax_call"),
    "F.softmax": (lambda x, d: F.softmax(x, dim=d), lambda x, d: safeops.softmax(x, d), "softmax_call"),
    "Tensor.softmax": (lambda x, d: x.softmax(d), lambda x, d: safeops.softmax(x, d), "softmax_call"),
    "torch.softmax_dtype_fp32": (lambda x, d: torch.softmax(x, d, dtype=torch.float32),
                                 lambda x, d: safeops.softmax(x, d, dtype=torch.float32), "softmax_call"),
    "torch.log_softmax": (lambda x, d: torch.log_softmax(x, d), lambda x, d: safeops.log_softmax(x, d),
                          "log_softmax_call"),
    "F.log_softmax": (lambda x, d: F.log_softmax(x, dim=d), lambda x, d: safeops.log_softmax(x, d),
                      "log_softmax_call"),
    "Tensor.log_softmax": (lambda x, d: x.log_softmax(dim=d), lambda x, d: safeops.log_softmax(x, d),
                           "log_softmax_call"),
    "F.log_softmax_dtype_fp32": (lambda x, d: F.log_softmax(x, d, dtype=torch.float32),
                                 lambda x, d: safeops.log_softmax(x, d, dtype=torch.float32),
                                 "log_softmax_call"),
    "nn.Softmax": (lambda x, d: SOFTMAX_MODULES[d](x), lambda x, d: safeops.softmax(x, d), "softmax_call"),
    "nn.LogSoftmax": (lambda x, d: LOG_SOFTMAX_MODULES[d](x), lambda x, d: safeops.log_softmax(x, d),
                      "log_softmax_call"),
    "torch.special.softmax": (lambda x, d: torch.special.softmax(x, d), lambda x, d: safeops.softmax(x, d),
                              "softmax_call"),
    "aten._softmax": (lambda x, d: torch.ops.aten._softmax.default(x, d, False),
                      lambda x, d: safeops.softmax(x, d), "softmax_call"),
    "aten.softmax.int": (lambda x, d: torch.ops.aten.softmax.int(x, d),
                         lambda x, d: safeops.softmax(x, d), "softmax_call"),
    "aten._log_softmax": (lambda x, d: torch.ops.aten._log_softmax.default(x, d, False),
                          lambda x, d: safeops.log_softmax(x, d), "log_softmax_call"),
    "aten.logsumexp_keepdim": (lambda x, d: torch.ops.aten.logsumexp.default(x, [d], True),
                               lambda x, d: safeops.logsumexp(x, d, keepdim=True), "logsumexp_call"),
    "torch.logsumexp_keepdim": (lambda x, d: torch.logsumexp(x, d, keepdim=True),
                                lambda x, d: safeops.logsumexp(x, d, keepdim=True), "logsumexp_call"),
    "torch.logsumexp": (lambda x, d: torch.logsumexp(x, d), lambda x, d: safeops.logsumexp(x, d),
                        "logsumexp_call"),
    "Tensor.logsumexp_keepdim": (lambda x, d: x.logsumexp(dim=d, keepdim=True),
                                 lambda x, d: safeops.logsumexp(x, d, keepdim=True), "logsumexp_call"),
}


def call_inputs(seed) -> list[tuple[torch.Tensor, int]]:
    """One leaf per (dtype, dim), so the gradients do not add up across calls: each has one all -inf row
    along its dim and a few scattered -inf entries (contract section 4 goes through the compiled code too)."""
    cases = []
    for dtype in DTYPE_LIST:
        for dim in DIMS:
            x = seed.randn(*SHAPE, dtype=dtype, std=4.0)
            x = torch.where(seed.mask(*SHAPE, keep=0.9), x, torch.full_like(x, NEG_INF))
            x = fill_line(x, dim, NEG_INF, at=1)
            cases.append((x.requires_grad_(True), dim))
    return cases


def forward_backward(fn, leaves, grads):
    outs = fn(*leaves)
    dxs = torch.autograd.grad(outs, leaves, grads)
    return outs, dxs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("form", list(CALL_FORMS))
@given(seed=seeds())
@each_example(isolation)
def test_call_is_rewritten_and_bit_identical_to_eager(reference_backend, form, mode, seed):
    user, eager, kind = CALL_FORMS[form]
    cases = call_inputs(seed)
    leaves = [x for x, _ in cases]
    dims = [d for _, d in cases]

    def f(*xs):
        return tuple(user(x, d) for x, d in zip(xs, dims, strict=True))

    want = [eager(x, d) for x, d in cases]
    grads = [seed.randn(*w.shape, dtype=w.dtype) for w in want]
    want_dx = torch.autograd.grad(want, leaves, grads)
    with compile_mode(mode):
        outs, dxs = forward_backward(compiled(f, mode), leaves, grads)
    assert safeops.is_registered() is False
    assert rewrites() == {kind: len(cases)}, f"{form} {mode}: stats {dict(stats)}; {seed}"
    for i, (x, dim) in enumerate(cases):
        ctx = f"{form} {mode} {x.dtype} dim={dim}; {seed}"
        assert_same_bits(outs[i], want[i], "output", ctx)
        assert_same_bits(dxs[i], want_dx[i], "d/dx", ctx)
        row = outs[i][line(dim, 3, 1)] if kind != "logsumexp_call" else None
        if row is not None:  # the all -inf row: 0 (softmax) or -inf (log_softmax), not NaN
            assert not torch.isnan(row).any(), ctx
        assert torch.isfinite(dxs[i]).all(), f"non-finite gradient; {ctx}"


@pytest.mark.parametrize("form", ["torch.softmax", "F.log_softmax", "torch.logsumexp_keepdim"])
@given(seed=seeds())
@each_example(isolation)
def test_call_is_bit_identical_to_eager_triton_kernels(triton_backend, form, seed):
    # The same check on the Triton kernels (interpreted on the CPU): compiled code calls the same launcher.
    user, eager, kind = CALL_FORMS[form]
    x = seed.randn(*SHAPE, dtype=torch.bfloat16, std=1.0)
    x = fill_line(x, 1, NEG_INF).requires_grad_(True)
    want = eager(x, 1)
    g = seed.randn(*want.shape, dtype=want.dtype)
    (want_dx,) = torch.autograd.grad(want, x, g)
    with safeops.registered():
        out = compiled(lambda t: user(t, 1), "registered")(x)
        (dx,) = torch.autograd.grad(out, x, g)
    assert rewrites() == {kind: 1}, dict(stats)
    assert_same_bits(out, want, "output", f"{form} triton; {seed}")
    assert_same_bits(dx, want_dx, "d/dx", f"{form} triton; {seed}")


@pytest.mark.parametrize("mode", MODES)
@given(seed=seeds())
@each_example(isolation)
def test_logsumexp_of_pos_inf_rows_compiled_is_eager(backend, mode, seed):
    """Contract section 5: logsumexp of a row holding +inf and no NaN is +inf, as eager torch.logsumexp
    gives, with its gradient (NaN at the +inf entries, 0 at the others); compiled code gives eager
    safeops' bits, forward and backward."""
    user, eager, kind = CALL_FORMS["torch.logsumexp"]
    x = seed.randn(4, 9, std=3.0)
    x[0, int(seed.randint(0, 9))] = math.inf
    x[1, :3] = math.inf
    x[1, 5] = NEG_INF
    x[2, 4], x[2, 7] = math.inf, math.nan  # NaN
    x.requires_grad_(True)
    want = eager(x, -1)
    g = seed.randn(*want.shape)
    (want_dx,) = torch.autograd.grad(want, x, g)
    with compile_mode(mode):
        out = compiled(lambda t: user(t, -1), mode)(x)
        (dx,) = torch.autograd.grad(out, x, g)
    ctx = f"{backend} {mode}; {seed}"
    assert rewrites() == {kind: 1}, f"{dict(stats)}; {ctx}"
    assert_same_bits(out, want, "output", ctx)
    assert_same_bits(dx, want_dx, "d/dx", ctx)
    assert (out[:2] == math.inf).all() and out[2].isnan() and torch.isfinite(out[3]), f"{out}; {ctx}"
    xt = x.detach().clone().requires_grad_(True)
    (torch_dx,) = torch.autograd.grad(torch.logsumexp(xt, -1), xt, g)
    assert torch.equal(dx[:3].isnan(), torch_dx[:3].isnan()), f"{dx} vs torch {torch_dx}; {ctx}"
    assert (dx[:2][~dx[:2].isnan()] == 0).all(), f"{dx}; {ctx}"


@given(seed=seeds())
@each_example(isolation)
def test_stock_call_gives_nan_on_all_inf_row(seed):
    # What the registered call fixes: stock Inductor's softmax of an all -inf row is NaN (0/0).
    x = fill_line(seed.randn(*SHAPE), -1, NEG_INF)
    out = compiled(lambda t: (torch.softmax(t, -1), torch.log_softmax(t, -1)), "stock")(x)
    assert not stats
    for o in out:
        assert torch.isnan(o[line(-1)]).all(), o[line(-1)]


# Forms the pre-grad pass does not see as a softmax call: torch._softmax & co. are bindings of the aten ops
# that Dynamo records as opaque torch functions, and F.softmin is one too. They reach Inductor's decomposition
# table as aten._softmax / aten._log_softmax, which registration maps to the safeops forward; autograd has
# already recorded the aten backward by then, so the backward is a formula on the forward output.
DECOMPOSED_FORMS = {
    # name: (user call, eager safeops equivalent, oracle op, oracle input from x)
    "torch._softmax": (lambda x: torch._softmax(x, -1, False), lambda x: safeops.softmax(x, -1), "softmax",
                       lambda x: x),
    "torch._log_softmax": (lambda x: torch._log_softmax(x, -1, False), lambda x: safeops.log_softmax(x, -1),
                           "log_softmax", lambda x: x),
    "F.softmin": (lambda x: F.softmin(x, -1), lambda x: safeops.softmax(-x, -1), "softmax", lambda x: -x),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@given(seed=seeds())
@each_example(isolation)
def test_decomposed_forward_ops_go_to_safeops(reference_backend, dtype, mode, seed):
    """aten._softmax / _log_softmax reached through decompositions run the safeops forward: the same bits as
    eager safeops, and an all -inf row gives 0 / -inf instead of NaN."""
    leaves = [fill_line(seed.randn(*SHAPE, dtype=dtype, std=4.0), -1, NEG_INF) for _ in DECOMPOSED_FORMS]
    forms = list(DECOMPOSED_FORMS.values())
    if "F.softmin" in DECOMPOSED_FORMS:  # softmin(x) = softmax(-x): its empty row is +inf
        i = list(DECOMPOSED_FORMS).index("F.softmin")
        leaves[i] = fill_line(leaves[i], -1, float("inf"))

    def f(*xs):
        return tuple(form[0](x) for form, x in zip(forms, xs, strict=True))

    want = [form[1](x) for form, x in zip(forms, leaves, strict=True)]
    with compile_mode(mode):
        outs = compiled(f, mode)(*leaves)
    for name, o, w in zip(DECOMPOSED_FORMS, outs, want, strict=True):
        ctx = f"{name} {mode} {dtype}; stats {dict(stats)}; {seed}"
        assert_same_bits(o, w, "output", ctx)
        assert not torch.isnan(o).any(), ctx


@given(seed=seeds())
@each_example(isolation)
def test_stock_decomposed_forms_give_nan_on_all_inf_row(seed):
    x = fill_line(seed.randn(*SHAPE), -1, NEG_INF)
    for name, (user, *_) in DECOMPOSED_FORMS.items():
        torch._dynamo.reset()
        xx = fill_line(x, -1, float("inf")) if name == "F.softmin" else x
        out = compiled(user, "stock")(xx)
        assert torch.isnan(out[line(-1)]).all(), f"stock {name}: {out[line(-1)]}"


def _decomposed_backward_params():
    # torch._softmax / torch._log_softmax / F.softmin are rewritten before autograd, so training uses the
    # safeops backward (contract section 3) in every dtype.
    return [pytest.param(name, dtype, id=f"{name}-{dtype_id}") for name in DECOMPOSED_FORMS
            for dtype, dtype_id in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))]


@pytest.mark.parametrize(("name", "dtype"), _decomposed_backward_params())
@given(seed=seeds())
@each_example(isolation)
def test_decomposed_backward_matches_oracle(reference_backend, name, dtype, seed):
    """Training through a decomposed softmax under registration: d/dx against the float64 oracle (the
    tolerance of a backward that recomputes fp32 probabilities, contract section 3), with one all -inf row
    whose gradient must be 0 whatever its incoming gradient (section 4)."""
    user, _, op, z_of = DECOMPOSED_FORMS[name]
    empty = float("inf") if name == "F.softmin" else NEG_INF
    x = fill_line(seed.randn(16, 64, dtype=dtype, std=3.0), -1, empty, at=3).requires_grad_(True)
    with safeops.registered():
        out = compiled(user, "registered")(x)
        g = seed.randn(*out.shape, dtype=out.dtype)
        (dx,) = torch.autograd.grad(out, x, g)
    z = z_of(x.detach())
    r = O.evaluate(op, z, -1)
    O.assert_close(out, r.out, O.output_bound(op, r, dtype), f"{name} output", seed)
    dz, _ = O.gradients(op, z, g, -1)
    expected = -dz if name == "F.softmin" else dz
    bound, _ = O.gradient_bounds(op, r, g, x)
    O.assert_close(dx, expected, bound, f"{name} d/dx", seed)


@pytest.mark.parametrize("dtype", [FP32, BF16])
@given(seed=seeds())
@each_example(isolation)
def test_cross_entropy_with_an_ignored_all_inf_row(reference_backend, dtype, seed):
    """F.cross_entropy decomposes into aten._log_softmax + nll_loss: with registration an ignored row of
    -inf logits (a padded position whose logits were all masked) has a zero gradient; stock gives NaN
    (the ignored row's loss is 0, but its log-softmax is NaN and the backward multiplies through it)."""
    logits = seed.randn(6, 10, dtype=dtype, std=3.0)
    logits = fill_line(logits, -1, NEG_INF, at=0)
    target = seed.randint(0, 10, 6)
    target[0] = -100  # ignore_index

    def loss_and_grad(how):
        torch._dynamo.reset()
        x = logits.clone().requires_grad_(True)
        with compile_mode(how):
            loss = compiled(lambda a, t: F.cross_entropy(a.float(), t), how)(x, target)
            (dx,) = torch.autograd.grad(loss, x)
        return loss, dx

    stock_loss, stock_dx = loss_and_grad("stock")
    assert torch.isnan(stock_dx[0]).all(), f"stock d/dlogits of the ignored row: {stock_dx[0]}"
    loss, dx = loss_and_grad("registered")
    ctx = f"{dtype}: stats {dict(stats)}; {seed}"
    assert torch.isfinite(dx).all() and (dx[0] == 0).all(), f"d/dlogits {dx}; {ctx}"
    torch.testing.assert_close(loss, stock_loss, rtol=4 * O.eps(torch.float32), atol=0, msg=ctx)
    # the valid rows: d/dlogits = (softmax - onehot) / n_valid, in float64
    x64 = logits.double().requires_grad_(True)
    valid = target != -100
    p64 = torch.softmax(x64[valid], -1)
    ref = torch.zeros_like(x64)
    ref[valid] = (p64 - F.one_hot(target[valid], 10).double()) / valid.sum()
    # fp32 inside (a.float()), then one rounding to the logits' dtype; exp of a rounded fp32 log-prob
    bound = 2 * O.eps(dtype) * ref.abs() + 16 * O.eps(torch.float32) * (ref.abs() + p64.max())
    assert ((dx.double() - ref).abs() <= bound).all(), f"d/dlogits {dx} vs float64 {ref}; {ctx}"


# --------------------------------------------------------------------------------------------------
# 2. Hand-written softmax and log-softmax cores: rewritten, and float64-accurate
# --------------------------------------------------------------------------------------------------


def softmax_amax(z, d):
    m = torch.amax(z, d, keepdim=True)
    e = torch.exp(z - m)
    return e / torch.sum(e, d, keepdim=True)


def softmax_max(z, d):
    m = torch.max(z, d, keepdim=True)[0]
    e = (z - m).exp()
    return e / e.sum(dim=d, keepdim=True)


def log_softmax_once(z, d):
    t = z - z.amax(d, keepdim=True)
    return t - torch.log(torch.sum(torch.exp(t), d, keepdim=True))


def log_softmax_twice(z, d):
    m = torch.amax(z, dim=d, keepdim=True)
    return z - m - torch.log(torch.exp(z - m).sum(d, keepdim=True))


CORES = {
    # name: (core, oracle op, stats kind)
    "softmax_amax": (softmax_amax, "softmax", "softmax_pattern"),
    "softmax_max": (softmax_max, "softmax", "softmax_pattern"),
    "log_softmax_once": (log_softmax_once, "log_softmax", "log_softmax_pattern"),
    "log_softmax_twice": (log_softmax_twice, "log_softmax", "log_softmax_pattern"),
}
CASTS = ("none", "upcast", "upcast_downcast")
# What computes the core's input z from x; the scales are powers of two so that z has the same bits in
# eager and compiled code (Inductor may turn a division by a constant into a multiply by its reciprocal).
PRES = {
    # name: (z from x and keep (True = keep), factor d z / d x on kept entries)
    "plain": (lambda x, keep: x, 1.0),
    "scale_mul": (lambda x, keep: x * 0.125, 0.125),
    "scale_div": (lambda x, keep: x / 8.0, 0.125),
    "masked_fill": (lambda x, keep: x.masked_fill(~keep, NEG_INF), 1.0),
    "where": (lambda x, keep: torch.where(keep, x, NEG_INF), 1.0),
}
MASKED_PRES = ("masked_fill", "where")


def hand_written(core, cast: str, pre: str, x, keep, dim):
    z = PRES[pre][0](x, keep)
    if cast == "upcast":
        z = z.float()
    elif cast == "upcast_downcast":
        z = z.to(torch.float32)
    out = core(z, dim)
    if cast == "upcast_downcast":
        out = out.to(x.dtype)
    return out


def pattern_cases(dtype, seed):
    """Every (cast, pre) pair once, each on one of the three dims, so that every cast and every pre meets
    every dim: (cast, pre, dim, x, keep). Masked pres get one fully masked row along the dim."""
    cases = []
    for i, cast in enumerate(CASTS):
        for j, pre in enumerate(PRES):
            dim = DIMS[(i + j) % len(DIMS)]
            x = seed.randn(*SHAPE, dtype=dtype, std=3.0).requires_grad_(True)
            keep = seed.mask(*SHAPE, keep=0.8)
            keep = fill_line(keep, dim, False, at=2) if pre in MASKED_PRES else keep
            cases.append((cast, pre, dim, x, keep))
    return cases


def check_core_against_oracle(op, cast, pre, dim, x, keep, out, g, dx, ctx):
    """out and dx of one hand-written core against the float64 oracle on its input z (an exact function
    of x: a power-of-two scale or a -inf fill), within the tolerance of the output / gradient dtype."""
    z = PRES[pre][0](x.detach(), keep)
    factor = PRES[pre][1]
    out_dtype = torch.float32 if cast == "upcast" else x.dtype
    assert out.dtype == out_dtype, f"output dtype {out.dtype}, expected {out_dtype}; {ctx}"
    r = O.evaluate(op, z, dim, out_dtype=out_dtype)
    O.assert_close(out, r.out, O.output_bound(op, r, out_dtype), f"{op} output", ctx)
    dz, _ = O.gradients(op, z, g, dim, out_dtype=out_dtype)
    bound, _ = O.gradient_bounds(op, r, g, x, scale=factor if factor != 1.0 else None)
    assert dx.dtype == x.dtype, f"d/dx dtype {dx.dtype}; {ctx}"
    O.assert_close(dx, dz * factor, bound, f"{op} d/dx", ctx)
    if pre in MASKED_PRES:  # the fully masked row: 0 / -inf, gradient exactly 0 (contract section 4)
        row = out[line(dim, 3, 2)]
        empty = 0.0 if op == "softmax" else NEG_INF
        assert (row == empty).all(), f"fully masked row gives {row.tolist()}; {ctx}"
        assert (dx[line(dim, 3, 2)] == 0).all(), f"its gradient is {dx[line(dim, 3, 2)].tolist()}; {ctx}"
    return r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", list(CORES))
@given(seed=seeds())
@each_example(isolation)
def test_hand_written_core_is_rewritten_and_matches_oracle(reference_backend, form, dtype, seed):
    core, op, kind = CORES[form]
    cases = pattern_cases(dtype, seed)

    def f(*args):
        xs, keeps = args[: len(cases)], args[len(cases):]
        return tuple(hand_written(core, cast, pre, x, keep, dim)
                     for (cast, pre, dim, _, _), x, keep in zip(cases, xs, keeps, strict=True))

    leaves = [c[3] for c in cases]
    with safeops.registered():
        outs = compiled(f, "registered")(*leaves, *[c[4] for c in cases])
    assert rewrites() == {kind: len(cases)}, f"{form} {dtype}: stats {dict(stats)}; {seed}"
    # Random incoming gradients everywhere, also on excluded entries (a log-softmax output -inf there):
    # an excluded entry contributes nothing, whatever its incoming gradient (contract sections 4, 5).
    grads = [seed.randn(*out.shape, dtype=out.dtype) for out in outs]
    dxs = torch.autograd.grad(outs, leaves, grads)
    for (cast, pre, dim, x, keep), out, g, dx in zip(cases, outs, grads, dxs, strict=True):
        ctx = f"{form} {dtype} cast={cast} pre={pre} dim={dim}; {seed}"
        check_core_against_oracle(op, cast, pre, dim, x, keep, out, g, dx, ctx)


@pytest.mark.parametrize("form", list(CORES))
@given(seed=seeds())
@each_example(isolation)
def test_hand_written_core_with_backend_name(reference_backend, form, seed):
    # backend="safeops" rewrites the same cores, without registration.
    core, op, kind = CORES[form]
    x = seed.randn(*SHAPE, dtype=torch.bfloat16, std=3.0).requires_grad_(True)
    keep = fill_line(seed.mask(*SHAPE, keep=0.8), 1, False, at=2)
    fn = compiled(lambda t, k: hand_written(core, "upcast_downcast", "masked_fill", t, k, 1), "backend")
    out = fn(x, keep)
    assert not safeops.is_registered()
    assert rewrites() == {kind: 1}, dict(stats)
    g = seed.randn(*out.shape, dtype=out.dtype)
    (dx,) = torch.autograd.grad(out, x, g)
    check_core_against_oracle(op, "upcast_downcast", "masked_fill", 1, x, keep, out, g, dx,
                              f"{form} backend=safeops; {seed}")


@given(seed=seeds())
@each_example(isolation)
def test_stock_compile_gives_nan_on_fully_masked_rows(seed):
    """The same hand-written cores compiled stock: the fully masked row is NaN (the test above can fail)."""
    x = seed.randn(*SHAPE, dtype=torch.bfloat16, std=3.0).requires_grad_(True)
    keep = fill_line(seed.mask(*SHAPE, keep=0.8), -1, False, at=2)
    variants = [(name, pre) for name in CORES for pre in MASKED_PRES]

    def f(t, k):
        return tuple(hand_written(CORES[name][0], "upcast_downcast", pre, t, k, -1) for name, pre in variants)

    outs = compiled(f, "stock")(x, keep)
    assert not stats
    for (name, pre), out in zip(variants, outs, strict=True):
        assert torch.isnan(out[line(-1, 3, 2)]).all(), f"stock {name} {pre}: {out[line(-1, 3, 2)].tolist()}"


# --------------------------------------------------------------------------------------------------
# 3. Negatives: not a softmax (or not this one) -> no rewrite, same bits as stock
# --------------------------------------------------------------------------------------------------


def exp_used_elsewhere(x):
    m = torch.amax(x, -1, keepdim=True)
    e = torch.exp(x - m)
    return e / torch.sum(e, -1, keepdim=True), e.mean()


def sum_used_elsewhere(x):
    m = torch.amax(x, -1, keepdim=True)
    e = torch.exp(x - m)
    s = torch.sum(e, -1, keepdim=True)
    return e / s, s


def max_used_elsewhere(x):
    m = torch.amax(x, -1, keepdim=True)
    e = torch.exp(x - m)
    return e / torch.sum(e, -1, keepdim=True), m


def amax_over_other_dim(x):  # m varies along the summed dim: not shift-invariant, not a softmax
    m = torch.amax(x, 0, keepdim=True)
    e = torch.exp(x - m)
    return e / torch.sum(e, -1, keepdim=True)


def sum_without_keepdim(x):  # (6, 6) / (6,) broadcasts over the wrong axis
    x = x[0]
    m = torch.amax(x, -1, keepdim=True)
    e = torch.exp(x - m)
    return e / torch.sum(e, -1)


def max_of_other_tensor(x, w):  # shift by another tensor's max: not the row max
    m = torch.amax(w, -1, keepdim=True)
    e = torch.exp(x - m)
    return e / torch.sum(e, -1, keepdim=True)


def max_missing(x):
    e = torch.exp(x)
    return e / torch.sum(e, -1, keepdim=True)


def log_softmax_shift_used_elsewhere(x):
    t = x - torch.amax(x, -1, keepdim=True)
    return t - torch.log(torch.sum(torch.exp(t), -1, keepdim=True)), t * 2


def log_softmax_different_shifts(x, w):  # (x - m) - log(sum(exp(w - m))): two different z
    m = torch.amax(x, -1, keepdim=True)
    return (x - m) - torch.log(torch.sum(torch.exp(w - m), -1, keepdim=True))


def logsumexp_two_dims(x):
    return torch.logsumexp(x, (0, 1))


NEGATIVES = {
    # name: (fn, number of inputs, the stats kind that would be a wrong rewrite)
    "exp_used_elsewhere": (exp_used_elsewhere, 1, "softmax_pattern"),
    "sum_used_elsewhere": (sum_used_elsewhere, 1, "softmax_pattern"),
    "max_used_elsewhere": (max_used_elsewhere, 1, "softmax_pattern"),
    "amax_over_other_dim": (amax_over_other_dim, 1, "softmax_pattern"),
    "sum_without_keepdim": (sum_without_keepdim, 1, "softmax_pattern"),
    "max_of_other_tensor": (max_of_other_tensor, 2, "softmax_pattern"),
    "max_missing": (max_missing, 1, "softmax_pattern"),
    "log_softmax_shift_used_elsewhere": (log_softmax_shift_used_elsewhere, 1, "log_softmax_pattern"),
    "log_softmax_different_shifts": (log_softmax_different_shifts, 2, "log_softmax_pattern"),
    "logsumexp_two_dims": (logsumexp_two_dims, 1, "logsumexp_call"),
}


def assert_same_results(got, want, what):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_same_bits(a, b, f"{what} output {i}", "registered vs stock compile")


@pytest.mark.parametrize("name", list(NEGATIVES))
@given(seed=seeds())
@each_example(isolation)
def test_not_a_softmax_is_not_rewritten(reference_backend, name, seed):
    fn, n_inputs, wrong_kind = NEGATIVES[name]
    inputs = [seed.randn(4, 6, 6, std=3.0) for _ in range(n_inputs)]
    with safeops.registered():
        got = compiled(fn, "registered")(*inputs)
    assert stats[wrong_kind] == 0, f"{name}: rewritten as {dict(stats)}; {seed}"
    torch._dynamo.reset()
    want = compiled(fn, "stock")(*inputs)
    assert_same_results(got, want, name)


def test_case_1b_is_not_a_softmax(reference_backend):
    # Seed case 1b (exp of a rounded max minus the recomputed product) has no softmax in it: registration
    # does not touch it and does not claim to fix it.
    x, scale = _seed.fma_inputs(torch.bfloat16)
    with safeops.registered():
        got = compiled(_seed.fma_expression_bf16, "registered")(x, scale)
    assert not stats, dict(stats)
    torch._dynamo.reset()
    want = compiled(_seed.fma_expression_bf16, "stock")(x, scale)
    assert_same_bits(got, want, "case 1b", "registered vs stock compile")


@pytest.mark.parametrize("dtype", [FP32, BF16])
@given(seed=seeds())
@each_example(isolation)
def test_masked_fill_with_finfo_min_stays_a_real_logit(reference_backend, dtype, seed):
    """masked_fill(mask, finfo.min) is a finite logit (contract section 4): only the core may be rewritten,
    and a row filled entirely with finfo.min is uniform (1/N), not 0 as an all -inf row would be."""
    n = 8  # 1/8 is exact
    x = seed.randn(3, 4, n, dtype=dtype, std=3.0).requires_grad_(True)
    drop = fill_line(~seed.mask(3, 4, n, keep=0.7), -1, True, at=1)
    lowest = torch.finfo(dtype).min

    def f(t, d):
        return softmax_amax(t.masked_fill(d, lowest).float(), -1).to(t.dtype)

    with safeops.registered():
        got = compiled(f, "registered")(x, drop)
    assert set(rewrites()) <= {"softmax_pattern"} and stats["softmax_pattern"] <= 1, dict(stats)
    assert (got[line(-1, 3, 1)] == 1.0 / n).all(), got[line(-1, 3, 1)]
    g = seed.randn(*got.shape, dtype=got.dtype)
    (dx,) = torch.autograd.grad(got, x, g)
    z = x.detach().masked_fill(drop, lowest)
    r = O.evaluate("softmax", z, -1, out_dtype=dtype)
    ctx = f"finfo.min fill {dtype}; {seed}"
    O.assert_close(got, r.out, O.output_bound("softmax", r, dtype), "softmax output", ctx)
    dz, _ = O.gradients("softmax", z, g, -1, out_dtype=dtype)
    dz = torch.where(drop, torch.zeros_like(dz), dz)  # masked_fill passes no gradient to filled entries
    bound, _ = O.gradient_bounds("softmax", r, g, x)
    O.assert_close(dx, dz, bound, "softmax d/dx", ctx)
    torch._dynamo.reset()
    want = compiled(f, "stock")(x, drop)
    tol = 2 * O.eps(dtype)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol,
                               msg=lambda m: f"registered vs stock: {m}; {ctx}")


# What computes the input -- a constant scale, a -inf fill -- is folded into the safeops op as ``scale=`` and
# ``mask=`` (one kernel reads the scores once), where that keeps the meaning of the user's code.


def scaled_masked(core, c, fill_first=False, upcast=False):
    def f(s, drop):
        z = s.masked_fill(drop, NEG_INF) * c if fill_first else (s * c).masked_fill(drop, NEG_INF)
        z = z.float() if upcast else z
        out = core(z, -1)
        return out.to(s.dtype) if upcast else out
    return f


def generated_kernels(fn, *args) -> str:
    from torch._inductor.utils import run_and_get_code
    _, codes = run_and_get_code(fn, *args)
    return "\n".join(codes)


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("form", ["softmax_amax", "log_softmax_once", "F.softmax", "logsumexp"])
@given(seed=seeds())
@each_example(isolation)
def test_scale_and_mask_fold_into_the_op(reference_backend, form, dtype, seed):
    """``(s * c).masked_fill(drop, -inf)`` before a softmax: the compiled code runs no separate kernel
    for the scale or the fill (the op gets ``scale=c, mask=~drop``), and the result is safeops' own
    ``softmax(s, scale=c, mask=~drop)``: for fp32 the same bits (torch multiplies by fp32(c) too), for
    bf16 the fp32 product is not rounded to bf16 first, which is the contract's z (section 1)."""
    core = {"softmax_amax": softmax_amax, "log_softmax_once": log_softmax_once,
            "F.softmax": lambda z, d: F.softmax(z, dim=d),
            "logsumexp": lambda z, d: torch.logsumexp(z, d, keepdim=True)}[form]
    want_fn = {"softmax_amax": safeops.softmax, "F.softmax": safeops.softmax,
               "log_softmax_once": safeops.log_softmax,
               "logsumexp": lambda *a, **k: safeops.logsumexp(*a, keepdim=True, **k)}[form]
    c = 0.1 + seed.uniform(0.0, 1.0)  # not a power of two
    s = seed.randn(3, 5, 16, dtype=dtype, std=4.0).requires_grad_(True)
    drop = fill_line(~seed.mask(3, 5, 16, keep=0.7), -1, True, at=2)  # row (2, 2) fully masked
    fn = compiled(scaled_masked(core, c), "registered")
    with safeops.registered():
        code = generated_kernels(fn, s, drop)
        got = fn(s, drop)
    assert sum(rewrites().values()) == 1, dict(stats)
    assert "masked_fill" not in code and "cpp_fused_mul" not in code, "a separate scale / fill kernel remains"
    want = want_fn(s.detach(), -1, scale=c, mask=~drop)
    assert_same_bits(got, want, form, f"folded vs eager safeops; {seed}")
    g = seed.randn(*got.shape, dtype=got.dtype)
    (ds,) = torch.autograd.grad(got, s, g)
    s2 = s.detach().clone().requires_grad_(True)
    (ds_want,) = torch.autograd.grad(want_fn(s2, -1, scale=c, mask=~drop), s2, g)
    assert_same_bits(ds, ds_want, f"{form} gradient", f"folded vs eager safeops; {seed}")
    assert torch.isfinite(ds).all() and (ds[2, 2] == 0).all(), seed


@given(seed=seeds())
@each_example(isolation)
def test_negative_scale_after_the_mask_does_not_fold_the_mask(reference_backend, seed):
    # (s.masked_fill(drop, -inf)) * -1 puts +inf at the masked entries: those rows are NaN in eager
    # (contract section 5); folding the fill as a mask would hide that.
    s = seed.randn(3, 5, 16, std=2.0)
    drop = ~seed.mask(3, 5, 16, keep=0.9)
    drop[0, 0] = False  # one row with nothing masked stays finite
    drop[1, 1, 3] = True
    f = scaled_masked(softmax_amax, -1.0, fill_first=True)
    with safeops.registered():
        got = compiled(f, "registered")(s, drop)
    want = safeops.softmax(s.masked_fill(drop, NEG_INF) * -1.0, -1)
    assert_same_bits(got, want, "negative scale after the fill", seed)
    assert torch.isnan(got[1, 1]).all() and torch.isfinite(got[0, 0]).all()


@given(seed=seeds())
@each_example(isolation)
def test_fp32_division_by_a_non_power_of_two_stays_a_division(reference_backend, seed):
    # s / 3 is not s * fp32(1/3) in fp32: the division stays in the graph, the op reads its result.
    s = seed.randn(4, 32, std=3.0)
    f = lambda t: F.softmax(t / 3.0, dim=-1)  # noqa: E731
    with safeops.registered():
        got = compiled(f, "registered")(s)
    assert rewrites() == {"softmax_call": 1}, dict(stats)
    assert_same_bits(got, safeops.softmax(s / 3.0, -1), "division by 3", seed)


@given(seed=seeds())
@each_example(isolation)
def test_fill_used_elsewhere_is_not_folded(reference_backend, seed):
    s = seed.randn(3, 16, std=3.0)
    drop = ~seed.mask(3, 16, keep=0.7)

    def f(t, d):
        z = (t * 0.3).masked_fill(d, NEG_INF)
        return F.softmax(z, dim=-1), z.clamp(min=-5.0).sum()

    with safeops.registered():
        got, other = compiled(f, "registered")(s, drop)
    assert_same_bits(got, safeops.softmax((s * 0.3).masked_fill(drop, NEG_INF), -1), "softmax", seed)
    torch.testing.assert_close(other, ((s * 0.3).masked_fill(drop, NEG_INF)).clamp(min=-5.0).sum())


def mutate_inside_core(z):
    m = torch.amax(z, -1, keepdim=True)
    e = torch.exp(z - m)
    z.mul_(2.0)  # an in-place change after exp(z - m) has read z
    return e / torch.sum(e, -1, keepdim=True)


def mutate_after_upcast(x):
    z = x.float()
    x.mul_(2.0)  # an in-place change of the source after the upcast has copied it
    m = torch.amax(z, -1, keepdim=True)
    e = torch.exp(z - m)
    return (e / torch.sum(e, -1, keepdim=True)).to(x.dtype)


@pytest.mark.parametrize(("fn", "dtype"), [
    # A core with an in-place write between its first and last nodes is left alone (the op would read
    # its input at the last node).
    pytest.param(mutate_inside_core, torch.float32, id="mutate_inside_core"),
    pytest.param(mutate_after_upcast, torch.bfloat16, id="mutate_after_upcast"),
])
@given(seed=seeds())
@each_example(isolation)
def test_in_place_change_of_the_input_around_the_core(reference_backend, fn, dtype, seed):
    # Rewritten or not, the result must be the softmax of the values the core read.
    x = seed.randn(3, 8, dtype=dtype, std=3.0)
    with safeops.registered():
        got = compiled(fn, "registered")(x.clone())
    r = O.evaluate("softmax", x, -1, out_dtype=dtype)
    O.assert_close(got, r.out, O.output_bound("softmax", r, dtype), "softmax", f"{dict(stats)}; {seed}")


@given(seed=seeds())
@each_example(isolation)
def test_detached_max_is_still_a_softmax_or_left_alone(reference_backend, seed):
    # ``m = amax(z).detach()`` is common in user code. Rewriting it or not are both correct; whichever
    # happens, the result must match the oracle.
    x = seed.randn(*SHAPE, std=3.0)

    def f(z):
        m = torch.amax(z, -1, keepdim=True).detach()
        e = torch.exp(z - m)
        return e / torch.sum(e, -1, keepdim=True)

    with safeops.registered():
        got = compiled(f, "registered")(x)
    r = O.evaluate("softmax", x, -1)
    bound = O.output_bound("softmax", r, torch.float32)
    O.assert_close(got, r.out, bound, "softmax", f"{dict(stats)}; {seed}")


# --------------------------------------------------------------------------------------------------
# 4. Seed case 1c: the hand-written bf16 softmax backward under torch.compile
# --------------------------------------------------------------------------------------------------


def case_1c_grad(mode: str) -> torch.Tensor:
    x, y = _seed.userland_inputs(torch.bfloat16)
    fn = compiled(lambda a, b: _seed.userland_loss(_seed.userland_softmax, a, b), mode)
    with compile_mode(mode):
        fn(x, y).backward()
    return y.grad.detach()


def case_1c_float64_and_bound() -> tuple[torch.Tensor, torch.Tensor]:
    """(d loss / dy in float64 on the bf16 inputs, the allowed |error| of a safeops softmax backward).

    With the rewrite, the softmax input is the bf16 tensor L = bf16(bf16(x @ x) / y) and safeops returns
    dL_i = p_i (g_i - sum_j g_j p_j) with fp32 probabilities p and g = 1 (the loss is a sum), that is
    dL_i = p_i (1 - S) where S = sum_j p_j, computed in fp32. In exact arithmetic S = 1; in fp32, p_j and
    the sum carry at most k roundings of relative size u (k = ceil(log2 N) + reduction_terms, u =
    internal_ulps * eps32, both from the oracle's tolerance table), so |1 - S| <= k u and
    |dL_i| <= k u p_i. Then dy = sum_i dL_i * dL_i/dy = -sum_i dL_i L_i / y, so
    |dy| <= k u sum_i p_i |L_i / y|, summed over every row that y scales. The bf16 roundings of dL and of the
    products are relative (2**-8 each) and are covered by a factor 2. The float64 gradient is itself
    ~1e-15 (the true value is 0), which the bound leaves room for.
    """
    x, y = _seed.userland_inputs(torch.bfloat16)
    x64, y64 = x.double(), y.detach().double().requires_grad_(True)
    torch.softmax(torch.matmul(x64, x64) / y64, -1).sum().backward()
    logits = (torch.matmul(x, x) / y.detach()).double()  # the bf16 logits the compiled softmax sees
    p = torch.softmax(logits, -1)
    n = x.shape[-1]
    tol = O.TOLERANCE[torch.float32]
    k = math.ceil(math.log2(n)) + tol.reduction_terms
    natural = (p * (logits / y.detach().double()).abs()).sum(dim=(0, 2, 3), keepdim=True).squeeze(0)
    bound = 2 * k * tol.internal_ulps * O.eps(torch.float32) * natural
    return y64.grad.detach(), bound


@pytest.mark.parametrize("mode", MODES)
def test_case_1c_userland_softmax_backward_is_finite_and_accurate(reference_backend, mode):
    grad = case_1c_grad(mode)
    grad64, bound = case_1c_float64_and_bound()
    ctx = (f"{mode}: y.grad {grad.flatten().tolist()}, float64 {grad64.flatten().tolist()}, "
           f"allowed +-{bound.flatten().tolist()}, stats {dict(stats)}")
    assert rewrites() == {"softmax_pattern": 1}, ctx
    assert torch.isfinite(grad).all(), ctx
    assert ((grad.double() - grad64).abs() <= bound).all(), ctx


def test_case_1c_stock_compile_is_nan():
    """The same function compiled stock: the user-land bf16 backward is NaN on CPU Inductor (SEED_CASES)."""
    grad = case_1c_grad("stock")
    assert not stats
    if torch.isfinite(grad).all():
        pytest.xfail(f"seed case 1c did not reproduce on torch {torch.__version__}: stock compiled y.grad = "
                     f"{grad.flatten().tolist()} is finite (SEED_CASES.md reports NaN on CPU Inductor)")
    assert torch.isnan(grad).any(), grad


# --------------------------------------------------------------------------------------------------
# 5. fullgraph and dynamic shapes: no graph breaks, no recompile per shape
# --------------------------------------------------------------------------------------------------

# Every dim changes at the second call, so automatic dynamic marks them all dynamic at once.
SIZES = [(2, 3, 5), (3, 4, 8), (4, 2, 13), (5, 6, 32)]


def two_softmaxes(x):
    z = x.float() * 0.125
    return torch.log_softmax(x, -1), softmax_amax(z, -1).to(x.dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic_dynamic"])
@given(seed=seeds())
@each_example(isolation)
def test_shapes_change_without_recompiles(reference_backend, mode, dynamic, seed):
    counters = torch._dynamo.utils.counters
    counters.clear()
    fn = compiled(two_softmaxes, mode, dynamic=dynamic)
    per_size_rewrites = []
    for shape in SIZES:
        x = seed.randn(*shape, dtype=torch.bfloat16, std=4.0)
        x = fill_line(x, -1, NEG_INF).requires_grad_(True)
        want = safeops.log_softmax(x, -1)
        with compile_mode(mode):
            got = fn(x)
            (dx,) = torch.autograd.grad(got[0], x, torch.ones_like(got[0]).masked_fill(got[0] == NEG_INF, 0))
        per_size_rewrites.append(dict(rewrites()))
        ctx = f"{mode} dynamic={dynamic} shape {shape}; {seed}"
        assert_same_bits(got[0], want, "log_softmax call", ctx)
        r = O.evaluate("softmax", x.detach().float() * 0.125, -1, out_dtype=torch.bfloat16)
        O.assert_close(got[1], r.out, O.output_bound("softmax", r, torch.bfloat16), "softmax core", ctx)
        assert torch.isfinite(dx).all(), ctx
    graphs = counters["stats"]["unique_graphs"]
    limit = 1 if dynamic else 2  # automatic dynamic: one static compile, then one dynamic
    assert graphs <= limit, f"{graphs} graphs compiled for {len(SIZES)} shapes; rewrites {per_size_rewrites}"
    assert stats["log_softmax_call"] == graphs and stats["softmax_pattern"] == graphs, dict(stats)


# --------------------------------------------------------------------------------------------------
# 6. unregister() restores stock torch.compile; register() is idempotent; a user's pass survives
# --------------------------------------------------------------------------------------------------


def userland_row(x):
    return _seed.userland_softmax(x, -1)


def all_inf_input() -> torch.Tensor:
    x = torch.randn(3, 8)
    x[1] = NEG_INF
    return x


def test_unregister_restores_stock_after_reset():
    x = all_inf_input()
    assert torch.isnan(compiled(userland_row, "stock")(x)[1]).all()
    safeops.register()
    assert safeops.is_registered()
    torch._dynamo.reset()
    got = compiled(userland_row, "stock")(x)  # default backend, now registered
    assert (got[1] == 0).all() and torch.isfinite(got).all(), got
    assert stats["softmax_pattern"] == 1
    safeops.unregister()
    assert not safeops.is_registered()
    assert _inductor_config().pre_grad_custom_pass is None
    torch._dynamo.reset()
    stats.clear()
    again = compiled(userland_row, "stock")(x)
    assert torch.isnan(again[1]).all(), f"after unregister(): {again}"
    assert not stats
    # the aten-level mapping (decomposition table) is undone too
    torch._dynamo.reset()
    aten_out = compiled(lambda t: torch._softmax(t, -1, False), "stock")(x)
    assert torch.isnan(aten_out[1]).all(), aten_out


class _UserlandModel(nn.Module):
    """A tiny model with the hand-written softmax of case 1c over masked scores."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, drop):
        return _seed.userland_softmax(self.lin(x).masked_fill(drop, NEG_INF), -1)


class _UserlandModelToo(_UserlandModel):
    def forward(self, x, drop):  # its own code object: Dynamo compiles it afresh
        return _seed.userland_softmax(self.lin(x).masked_fill(drop, NEG_INF) * 1.0, -1)


def test_models_compiled_with_and_without_registration_coexist():
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    drop = torch.zeros(3, 8, dtype=torch.bool)
    drop[1] = True  # row 1 fully masked
    a = torch.compile(_UserlandModel(), fullgraph=True)
    with safeops.registered():
        out_a = a(x, drop)  # forward compiled while registered; its backward runs after unregister
    assert (out_a[1] == 0).all() and torch.isfinite(out_a).all(), out_a
    assert stats["softmax_pattern"] == 1
    assert not safeops.is_registered()
    b = torch.compile(_UserlandModelToo(), fullgraph=True)
    out_b = b(x, drop)
    assert torch.isnan(out_b[1]).all(), f"model compiled after unregister is not stock: {out_b}"
    assert stats["softmax_pattern"] == 1  # b was not rewritten
    # a keeps its compiled safe code, and its lazily compiled backward is safe too
    out_a2 = a(x, drop)
    assert_same_bits(out_a2, out_a, "model a after unregister", "")
    out_a2.sum().backward()
    grads = [p.grad for p in a.parameters()]
    assert all(torch.isfinite(g).all() for g in grads), grads


def test_register_is_idempotent_and_registered_is_scoped():
    safeops.register()
    safeops.register()
    assert safeops.is_registered()
    safeops.unregister()
    assert not safeops.is_registered()
    assert _inductor_config().pre_grad_custom_pass is None
    safeops.unregister()  # unregistering twice is harmless
    assert not safeops.is_registered()
    with safeops.registered():
        assert safeops.is_registered()
        with safeops.registered():  # nested
            assert safeops.is_registered()
        assert safeops.is_registered()
    assert not safeops.is_registered()
    safeops.register()
    with safeops.registered():  # a scope inside a global registration leaves it registered
        pass
    assert safeops.is_registered()
    safeops.unregister()
    with pytest.raises(RuntimeError, match="boom"), safeops.registered():
        raise RuntimeError("boom")
    assert not safeops.is_registered()
    x = all_inf_input()
    assert torch.isnan(compiled(userland_row, "stock")(x)[1]).all()


def test_user_pre_grad_pass_is_kept_and_restored():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class CountingPass(CustomGraphPass):
        calls = 0

        def __call__(self, graph):
            CountingPass.calls += 1

        def uuid(self):
            return "test-counting-pass"

    config = _inductor_config()
    mine = CountingPass()
    config.pre_grad_custom_pass = mine
    x = all_inf_input()
    with safeops.registered():
        got = compiled(userland_row, "stock")(x)
    assert CountingPass.calls == 1, "the user's pass did not run while registered"
    assert stats["softmax_pattern"] == 1 and (got[1] == 0).all(), (dict(stats), got)
    assert config.pre_grad_custom_pass is mine, config.pre_grad_custom_pass
    torch._dynamo.reset()
    compiled(userland_row, "stock")(x)
    assert CountingPass.calls == 2
    # backend="safeops" runs both as well, and leaves the slot as it was
    torch._dynamo.reset()
    compiled(userland_row, "backend")(x)
    assert CountingPass.calls == 3 and stats["softmax_pattern"] == 2
    assert config.pre_grad_custom_pass is mine


# --------------------------------------------------------------------------------------------------
# 7. Inductor's FX-graph and AOT-autograd caches never serve one kind of graph to the other
# --------------------------------------------------------------------------------------------------


def _fresh_cache():
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache
    return fresh()


def userland_and_aten(x):
    # a hand-written core (the pre-grad rewrite) and an aten-level op (the decomposition table)
    return _seed.userland_softmax(x, -1), torch._softmax(x, -1, False)


def aten_only(x):
    return (torch._softmax(x, -1, False),)


def run_cache_sequence(steps, fn=userland_and_aten):
    """Compile ``fn`` afresh (Dynamo reset) for each mode in ``steps``.

    Inductor's FX-graph and AOT-autograd caches are on, in a fresh cache directory; each result must be the
    mode's own behaviour. Returns (cache hits per step, what was seen).
    """
    counters = torch._dynamo.utils.counters
    x = all_inf_input()
    config, fconfig = _inductor_config(), _functorch_config()
    seen, hits = [], []
    with _fresh_cache(), config.patch(fx_graph_cache=True), fconfig.patch(enable_autograd_cache=True):
        for step, mode in enumerate(steps):
            torch._dynamo.reset()
            counters.clear()
            with compile_mode(mode):
                outs = compiled(fn, mode)(x)
            hits.append(counters["aot_autograd"]["autograd_cache_hit"]
                        + counters["inductor"]["fxgraph_cache_hit"])
            seen.append((mode, [o[1, 0].item() for o in outs], hits[-1]))
            for what, out in zip(("hand-written", "aten._softmax")[-len(outs):], outs, strict=True):
                if mode == "stock":
                    assert torch.isnan(out[1]).all(), f"step {step}: {what} served a safeops graph; {seen}"
                else:
                    assert (out[1] == 0).all(), f"step {step}: {what} served a stock graph; {seen}"
    return hits, seen


def test_caches_do_not_cross_serve():
    hits, seen = run_cache_sequence(["stock", "registered", "stock", "registered", "backend"])
    # The caches were live: the repeated stock compile was served from them (else this proves nothing).
    assert hits[0] == 0 and hits[2] >= 1, f"(mode, row of -inf [hand-written, aten], cache hits): {seen}"


@pytest.mark.parametrize("trigger", [
    # With early pre-grad passes Inductor does not hash the pass; safeops then compiles without caches.
    pytest.param("user_pass_without_uuid"),
    pytest.param("timing_early"),
])
def test_caches_do_not_cross_serve_with_early_pre_grad_passes(trigger):
    config = _inductor_config()
    if trigger == "user_pass_without_uuid":
        config.pre_grad_custom_pass = lambda graph: None  # the fixture puts the slot back
        patch = contextlib.nullcontext()
    else:
        if not hasattr(config, "pre_grad_pass_timing"):
            pytest.skip("torch < 2.12 has no pre_grad_pass_timing")
        patch = config.patch(pre_grad_pass_timing="early")
    with patch:
        # aten only: with a hand-written core in the same graph the rewrite changes the graph, and so its key
        run_cache_sequence(["stock", "registered", "stock"], aten_only)


# --------------------------------------------------------------------------------------------------
# 8. Training step of a small bf16 attention model, compiled with registration
# --------------------------------------------------------------------------------------------------


def reference_softmax64(z, dim):
    """Float64 softmax with the contract's empty-row rule (section 4): a row of -inf gives 0."""
    m = torch.amax(z, dim, keepdim=True)
    empty = m == NEG_INF
    e = torch.exp(z - torch.where(empty, torch.zeros_like(m), m))
    s = torch.sum(e, dim, keepdim=True)
    return torch.where(empty, torch.zeros_like(e), e / torch.where(empty, torch.ones_like(s), s))


class Attention(nn.Module):
    """One block: hand-written attention (q @ k^T * scale, causal + padding masked_fill(-inf), softmax written
    out, @ v) and an MLP, with residuals."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.softmax = softmax_amax

    def forward(self, x, drop):
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) * (w // self.heads) ** -0.5
        p = self.softmax(scores.masked_fill(drop, NEG_INF), -1)
        x = x + self.proj((p @ v).transpose(1, 2).reshape(b, s, w))
        return x + self.down(F.gelu(self.up(x)))


class TinyModel(nn.Module):
    def __init__(self, width=16, heads=2, layers=2):
        super().__init__()
        self.blocks = nn.ModuleList(Attention(width, heads) for _ in range(layers))

    def forward(self, x, drop):
        for block in self.blocks:
            x = block(x, drop)
        return x


def attention_drop_mask(batch: int, seq: int, pad: list[int]) -> torch.Tensor:
    """True = masked: causal, plus left padding; a padded query sees only padded keys -> fully masked row."""
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    padded = torch.arange(seq)[None, :] < torch.tensor(pad)[:, None]  # (batch, seq) key is padding
    return causal[None, None] | padded[:, None, None, :]


@given(seed=seeds())
@each_example(isolation)
def test_training_step_bf16_attention_matches_float64(reference_backend, seed):
    """Gradients of a compiled bf16 training step are finite and within bf16 accuracy of float64.

    Stock torch.compile of the same step (measured on torch 2.13 CPU): the left-padded queries have fully
    masked rows, their hand-written softmax is 0/0 = NaN, the loss is NaN, and every parameter gradient but
    the last bias (which does not depend on the attention) comes out NaN.

    The bound, per parameter, normwise: ||g - g64|| <= C * u * ||g64||, u = 2**-8 the bf16 unit roundoff.
    Every stored activation and gradient of the bf16 model is rounded to bf16, a relative error of at most u
    and of root-mean-square u / sqrt(3) each; along the longest forward + backward path of two blocks there
    are about 2 x 2 x 11 = 44 such roundings, which add up like a random walk: sqrt(44) u / sqrt(3) ~ 3.8 u.
    C = 8 leaves a factor two over that (measured on torch 2.13 CPU: 0.4 u to 1.7 u, the same as the same
    model run eagerly with safeops.softmax). The float64 model is the same weights (bf16 values, exactly)
    in float64 with the contract's softmax, in eager mode.
    """
    torch.manual_seed(seed.value)
    model = TinyModel().to(torch.bfloat16)
    model64 = copy.deepcopy(model).double()  # the same (bf16) weights, exactly, in float64
    for blk in model64.blocks:
        blk.softmax = reference_softmax64
    batch, seq = 2, 8
    x = seed.randn(batch, seq, 16, dtype=torch.bfloat16)
    drop = attention_drop_mask(batch, seq, pad=[2, 0])
    target = seed.randn(batch, seq, 16)

    def step(m, inp):
        return (m(inp, drop).float() * target).sum() if inp.dtype != torch.float64 else \
            (m(inp, drop) * target.double()).sum()

    compiled_step = compiled(step, "registered")
    with safeops.registered():
        loss = compiled_step(model, x)
        loss.backward()
    assert stats["softmax_pattern"] == 2, dict(stats)
    step(model64, x.double()).backward()
    u = 2.0**-8
    for (name, p), p64 in zip(model.named_parameters(), model64.parameters(), strict=True):
        g, g64 = p.grad.double(), p64.grad
        assert torch.isfinite(g).all(), f"{name}: non-finite gradient; {seed}"
        err, ref = (g - g64).norm().item(), g64.norm().item()
        assert err <= 8 * u * ref, \
            f"{name}: ||g - g64|| = {err:.3g} > 8 u ||g64|| = {8 * u * ref:.3g}; {seed}"


# --------------------------------------------------------------------------------------------------
# 9. The backend name
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [
    pytest.param("registered", id="registered"),
    pytest.param("backend", id="backend"),
])
@pytest.mark.parametrize("kwargs", [{"mode": "max-autotune-no-cudagraphs"},
                                    {"options": {"epilogue_fusion": False}}], ids=["mode", "options"])
def test_compile_mode_and_options(mode, kwargs):
    # torch.compile(..., mode=..., options=...) works with registration and with the backend name.
    x = all_inf_input()
    with compile_mode(mode):
        got = compiled(userland_row, mode, **kwargs)(x)
    assert stats["softmax_pattern"] == 1 and (got[1] == 0).all(), (dict(stats), got)


def test_backend_name_is_listed_and_needs_no_registration():
    assert "safeops" in torch._dynamo.list_backends()
    assert "safeops" in torch._dynamo.list_backends(exclude_tags=())
    config = _inductor_config()
    before = config.pre_grad_custom_pass
    x = all_inf_input()
    got = compiled(userland_row, "backend")(x)
    assert not safeops.is_registered()
    assert config.pre_grad_custom_pass is before
    assert stats["softmax_pattern"] == 1 and (got[1] == 0).all(), (dict(stats), got)
    # no global state left behind: a default compile afterwards is stock
    torch._dynamo.reset()
    stats.clear()
    assert torch.isnan(compiled(userland_row, "stock")(x)[1]).all()
    assert not stats


# --------------------------------------------------------------------------------------------------
# A detached row max (common in stable softmax code: the gradient through the max cancels out)
# --------------------------------------------------------------------------------------------------


def softmax_detached_max(z, d):
    m = torch.amax(z, d, keepdim=True).detach()
    e = torch.exp(z - m)
    return e / torch.sum(e, d, keepdim=True)


def log_softmax_detached_max(z, d):
    m = z.max(d, keepdim=True)[0].detach()
    return z - m - torch.log(torch.sum(torch.exp(z - m), d, keepdim=True))


@pytest.mark.parametrize("dim", [-1, 0])
@pytest.mark.parametrize(("fn", "kind", "eager"), [
    (softmax_detached_max, "softmax_pattern", safeops.softmax),
    (log_softmax_detached_max, "log_softmax_pattern", safeops.log_softmax),
], ids=["softmax", "log_softmax"])
@given(seed=seeds())
@each_example(isolation)
def test_detached_row_max_is_rewritten(reference_backend, fn, kind, eager, dim, seed):
    torch._dynamo.reset()
    stats.clear()
    x = fill_line(seed.randn(*SHAPE, std=3.0), dim, NEG_INF).requires_grad_(True)
    with safeops.registered():
        out = compiled(lambda t: fn(t, dim), "registered")(x)
    g = seed.randn(*out.shape)
    (dx,) = torch.autograd.grad(out, x, g)
    x2 = x.detach().clone().requires_grad_(True)
    want = eager(x2, dim)
    (want_dx,) = torch.autograd.grad(want, x2, g)
    assert rewrites() == {kind: 1}, dict(stats)
    assert_same_bits(out, want, "output", seed)
    assert_same_bits(dx, want_dx, "d/dx", seed)
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------------
# Review findings: code the rewrite must leave to torch (or handle exactly as torch does)
# --------------------------------------------------------------------------------------------------


def _lse_out(x):
    o = torch.empty(x.shape[0], dtype=x.dtype)
    torch.logsumexp(x, 1, out=o)
    return o


def _setitem_in_core(z):
    z = z * 1.0
    m = torch.amax(z, -1, keepdim=True)
    e = torch.exp(z - m)
    z[:, 0] = 50.0
    return e / torch.sum(e, -1, keepdim=True) + 0 * z


def _relu_inplace_in_core(z):
    z = z * 1.0
    m = torch.amax(z, -1, keepdim=True)
    e = torch.exp(z - m)
    F.relu(z, inplace=True)
    return e / torch.sum(e, -1, keepdim=True) + 0 * z


def _downcast_call(x):
    return torch.softmax(x, -1, dtype=torch.float16)


def _sum_with_dtype(z):
    m = z.amax(-1, keepdim=True)
    e = torch.exp(z - m)
    return e / e.sum(-1, keepdim=True, dtype=torch.float16)


@pytest.mark.parametrize("fn", [_lse_out, _setitem_in_core, _relu_inplace_in_core, _downcast_call,
                                _sum_with_dtype], ids=lambda f: f.__name__.strip("_"))
@given(seed=seeds())
@each_example(isolation)
def test_left_to_torch(reference_backend, fn, seed):
    """out=, an in-place write inside a core, a lower dtype= (torch rounds the input first), a sum with
    dtype=: none is rewritten before autograd; the result is what torch's code computes (with aten-level
    softmax ops done by safeops while registered)."""
    x = seed.randn(4, 7, std=3.0)
    torch._dynamo.reset()
    want = compiled(fn, "stock")(x.clone())
    if fn is _downcast_call:
        # torch rounds x to fp16 first; the aten._softmax that follows is then safeops' (decomposition).
        want = safeops.softmax(x.to(torch.float16), -1)
    elif fn is _lse_out:
        # The call stays torch's; functionalization turns it into aten.logsumexp + copy, and that aten op
        # is safeops' while registered (decomposition table).
        want = safeops.logsumexp(x, 1)
    torch._dynamo.reset()
    stats.clear()
    with safeops.registered():
        got = compiled(fn, "registered")(x.clone())
    torch._dynamo.reset()
    assert not rewrites(), dict(stats)
    assert_same_bits(got, want, "output", seed)


@given(seed=seeds())
@each_example(isolation)
def test_cross_entropy_fp64_gradient_stays_fp64(seed):
    # F.cross_entropy reaches log_softmax inside AOT (decomposition table); its backward must keep fp64.
    x = seed.randn(5, 9, dtype=torch.float64, std=2.0).requires_grad_(True)
    target = torch.arange(5) % 9
    want = torch.autograd.grad(F.cross_entropy(x, target), x)[0]
    torch._dynamo.reset()
    with safeops.registered():
        got = torch.autograd.grad(compiled(lambda t: F.cross_entropy(t, target), "registered")(x), x)[0]
    torch._dynamo.reset()
    assert (got - want).abs().max().item() < 1e-14


@given(seed=seeds())
@each_example(isolation)
def test_division_by_a_tiny_power_of_two_is_not_folded(reference_backend, seed):
    # 1 / 2**-130 overflows fp32: the division must stay the user's (eager gives a finite softmax).
    s = seed.randn(3, 8, std=1e-37)
    f = lambda t: F.softmax(t / 2.0**-130, dim=-1)  # noqa: E731
    with safeops.registered():
        got = compiled(f, "registered")(s)
    assert torch.isfinite(got).all()
    assert_same_bits(got, safeops.softmax(s / 2.0**-130, -1), "tiny divisor", seed)


@given(seed=seeds())
@each_example(isolation)
def test_cast_to_fp64_after_an_fp32_core_is_not_folded(reference_backend, seed):
    # softmax computed in fp32 then widened: the fold would compute it in fp64 instead.
    x = seed.randn(4, 9, std=3.0)
    f = lambda t: softmax_amax(t, -1).to(torch.float64)  # noqa: E731
    with safeops.registered():
        got = compiled(f, "registered")(x)
    assert got.dtype == torch.float64
    assert_same_bits(got, safeops.softmax(x, -1).to(torch.float64), "fp32 core, fp64 cast", seed)
