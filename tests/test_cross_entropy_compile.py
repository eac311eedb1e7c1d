"""torch.compile routes cross-entropy through safeops.cross_entropy under ``register()`` (and
``backend="safeops"``): ``F.cross_entropy``, ``nn.CrossEntropyLoss`` and ``nll_loss(log_softmax(x))``.

Checked: the rewrites performed (``safeops.compile.stats``), the bits of the loss and of d/dlogits against
eager ``safeops.cross_entropy`` with the same arguments (contract section 6), behaviour only safeops has (an
all-ignored batch gives a mean of 0, not NaN), the upcast of 16-bit logits folded in (the gradient reaches
the 16-bit logits with the same bits), and calls that must stay torch's (probability targets, a log-softmax
over another dim or used elsewhere, legacy arguments): not rewritten, the same bits as stock.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from strategies import each_example, seeds

import safeops
import safeops.compile as safeops_compile

stats = safeops_compile.stats


@contextlib.contextmanager
def isolation():
    """Unregistered, Dynamo reset, stats cleared and Inductor's caches off (as tests/test_compile_register.py:
    a graph served from a cache is not rewritten again)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if safeops.is_registered():
        safeops.unregister()
    torch._dynamo.reset()
    stats.clear()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        try:
            yield
        finally:
            if safeops.is_registered():
                safeops.unregister()
            torch._dynamo.reset()
            stats.clear()


@pytest.fixture(autouse=True)
def isolated():
    with isolation():
        yield


def bits(t: torch.Tensor) -> torch.Tensor:
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}
    return t.detach().contiguous().view(ints[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str, context: object) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    diff = bits(a) != bits(b)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {a.numel()} elements differ; {context}"


def rewrites() -> dict:
    return {k: v for k, v in stats.items() if v}


WEIGHT = torch.linspace(0.5, 1.5, 9)
MODULE = torch.nn.CrossEntropyLoss(weight=WEIGHT, ignore_index=2, label_smoothing=0.1)
FP32 = torch.float32
# name: (user code on (logits, target), eager safeops equivalent, logits dtype, ignore_index, stats label)
FORMS = {
    "F.cross_entropy": (lambda x, t: F.cross_entropy(x, t, label_smoothing=0.2, reduction="sum"),
                        lambda x, t: safeops.cross_entropy(x, t, label_smoothing=0.2, reduction="sum"),
                        torch.float32, -100, "cross_entropy_call"),
    "nn.CrossEntropyLoss": (lambda x, t: MODULE(x, t),
                            lambda x, t: safeops.cross_entropy(x, t, WEIGHT, 2, label_smoothing=0.1),
                            torch.float32, 2, "cross_entropy_call"),
    "F.cross_entropy(x.float())": (lambda x, t: F.cross_entropy(x.float(), t, reduction="none"),
                                   lambda x, t: safeops.cross_entropy(x, t, reduction="none", dtype=FP32),
                                   torch.bfloat16, -100, "cross_entropy_call"),
    "nll_loss(F.log_softmax)": (lambda x, t: F.nll_loss(F.log_softmax(x, -1), t),
                                lambda x, t: safeops.cross_entropy(x, t), torch.bfloat16, -100,
                                "cross_entropy_pattern"),
    "nll_loss(Tensor.log_softmax)": (lambda x, t: F.nll_loss(x.log_softmax(dim=1), t, reduction="sum"),
                                     lambda x, t: safeops.cross_entropy(x, t, reduction="sum"), torch.float32,
                                     -100, "cross_entropy_pattern"),
    "nll_loss(torch.log_softmax(dtype=fp32))": (
        lambda x, t: F.nll_loss(torch.log_softmax(x, 1, dtype=torch.float32), t, ignore_index=0),
        lambda x, t: safeops.cross_entropy(x, t, ignore_index=0, dtype=torch.float32), torch.float16, 0,
        "cross_entropy_pattern"),
    # What the reroute changes: a mean over no counted target is 0 with zero gradients (eager and stock
    # torch.compile: NaN), contract section 10.
    "F.cross_entropy, all ignored": (lambda x, t: F.cross_entropy(x, t),
                                     lambda x, t: safeops.cross_entropy(x, t), torch.float32, "all",
                                     "cross_entropy_call"),
}


def _inputs(seed, dtype, ignore_index):
    x = seed.randn(6, 9, dtype=dtype, std=3.0)
    target = seed.randint(0, 9, 6)
    if ignore_index == "all":
        target[:] = -100
    else:
        target[[1, 4]] = ignore_index
    return x, target


@given(seed=seeds())
@each_example(isolation)
def test_calls_and_patterns_are_rerouted_bit_identical_to_eager(reference_backend, seed):
    forms = list(FORMS.values())
    inputs = [_inputs(seed, dtype, ignore_index) for _, _, dtype, ignore_index, _ in forms]

    def f(*args):
        return tuple(user(args[2 * i], args[2 * i + 1]) for i, (user, *_) in enumerate(forms))

    flat = [t for pair in inputs for t in pair]
    leaves = [x.clone().requires_grad_(True) for x, _ in inputs]
    args = [a for leaf, (_, t) in zip(leaves, inputs, strict=True) for a in (leaf, t)]
    with safeops.registered():
        outs = torch.compile(f, backend="inductor", fullgraph=True)(*args)
    grads = [torch.ones_like(o) for o in outs]
    dxs = torch.autograd.grad(outs, leaves, grads)
    want_labels = {}
    for label in (form[4] for form in forms):
        want_labels[label] = want_labels.get(label, 0) + 1
    assert rewrites() == want_labels, f"stats {dict(stats)}; {seed}"
    for i, (name, (_, eager, _, _, _)) in enumerate(FORMS.items()):
        x = flat[2 * i].clone().requires_grad_(True)
        want = eager(x, flat[2 * i + 1])
        (want_dx,) = torch.autograd.grad(want, x, grads[i])
        assert_same_bits(outs[i], want, f"{name}: loss", seed)
        assert_same_bits(dxs[i], want_dx, f"{name}: d/dlogits", seed)
    x, target = inputs[-1]
    assert bits(outs[-1]) == 0 and (bits(dxs[-1]) == 0).all(), (outs[-1], dxs[-1])
    assert torch.isnan(F.cross_entropy(x, target)), "eager torch no longer gives NaN here: update the docs"


NOT_REWRITTEN = {
    "probability targets": lambda x, t: F.cross_entropy(x, torch.softmax(x.detach() * 0.5, 1)),
    "log_softmax over dim 0": lambda x, t: F.nll_loss(F.log_softmax(x, 0), t),
    "log_softmax used elsewhere": lambda x, t: (lambda lp: F.nll_loss(lp, t) + lp.mean())(
        F.log_softmax(x, 1)),
    "legacy size_average": lambda x, t: F.cross_entropy(x, t, size_average=False),
}


@given(seed=seeds())
@each_example(isolation)
def test_other_calls_stay_torch(reference_backend, seed):
    """Calls safeops would compute differently are left alone: no cross-entropy rewrite, and torch's values
    (a log-softmax left over is still taken by the softmax rewrite: it is one)."""
    x, target = _inputs(seed, torch.float32, -100)
    fns = list(NOT_REWRITTEN.values())

    def f(a, t):
        return tuple(fn(a, t) for fn in fns)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # size_average's deprecation warning
        want = f(x, target)
        with safeops.registered():
            got = torch.compile(f, backend="inductor", fullgraph=True)(x, target)
    labels = rewrites()
    assert "cross_entropy_call" not in labels and "cross_entropy_pattern" not in labels, labels
    assert labels.get("log_softmax_call") == 2, labels
    for name, a, b in zip(NOT_REWRITTEN, got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


@given(seed=seeds())
@each_example(isolation)
def test_rerouted_call_runs_the_triton_kernels_bit_identical_to_eager(triton_backend, seed):
    """backend="safeops" (no global registration) and the Triton kernels (interpreted): the (N, C, d) form
    with weights, z-loss through the module, and the upcast folded."""
    x = seed.randn(3, 9, 4, dtype=torch.bfloat16, std=3.0)
    target = seed.randint(0, 9, 3, 4)
    target[0, 1] = -100
    weight = torch.linspace(0.5, 1.5, 9)

    def f(a, t):
        return F.cross_entropy(a.float(), t, weight, label_smoothing=0.1)

    xg = x.clone().requires_grad_(True)
    loss = torch.compile(f, backend="safeops", fullgraph=True)(xg, target)
    (dx,) = torch.autograd.grad(loss, xg)
    assert rewrites() == {"cross_entropy_call": 1}, dict(stats)
    xe = x.clone().requires_grad_(True)
    want = safeops.cross_entropy(xe, target, weight, label_smoothing=0.1, dtype=torch.float32)
    (want_dx,) = torch.autograd.grad(want, xe)
    assert_same_bits(loss, want, "loss", seed)
    assert_same_bits(dx, want_dx, "d/dlogits", seed)
