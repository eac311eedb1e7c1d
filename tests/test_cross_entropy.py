"""safeops.cross_entropy against the float64 oracle, the contract's exact cases, the ops, the modules.

Every test checks a clause of CONTRACT.md (section 10, and sections 1-6 as they apply to cross-entropy) on
both CPU backends (``backend``: the pure-torch reference and the Triton kernels under the interpreter): drawn
calls against tests/oracle.py (an independent float64 statement of F.cross_entropy plus the contract's
cases), ignored rows selected away (NaN there changes no bit elsewhere), a mean over nothing, empty rows,
1e4-scale logits, bits independent of the batch and the memory layout, the gradient written into the
logits, the errors, the torch.library op (opcheck, fake, torch.compile) and ``safeops.nn.CrossEntropyLoss``.
"""

from __future__ import annotations

import math

import oracle as O
import pytest
import strategies as S
import torch
import torch.nn.functional as F
from conftest import INTERPRETER
from hypothesis import given
from strategies import seeds
from torch._subclasses.fake_tensor import FakeTensorMode

import safeops
from safeops.ops import cross_entropy_launch

NEG_INF = float("-inf")
FP32 = pytest.param(torch.float32, id="fp32")
BF16 = pytest.param(torch.bfloat16, id="bf16")
FP16 = pytest.param(torch.float16, id="fp16")
DTYPES = [FP32, BF16, FP16]
REDUCTIONS = ["mean", "sum", "none"]
DTYPE_REDUCTIONS = [(torch.float32, "mean"), (torch.bfloat16, "none"), (torch.float16, "sum")]
DTYPE_REDUCTION_IDS = ["fp32-mean", "bf16-none", "fp16-sum"]


def bits(t: torch.Tensor) -> torch.Tensor:
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}
    return t.detach().contiguous().view(ints[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str, context: object = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    diff = bits(a) != bits(b)
    if diff.any():
        first = tuple(diff.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(diff.sum())} of {a.numel()} elements differ in their bits, first "
                             f"at {list(first)}: {a[first].item()!r} vs {b[first].item()!r}; {context}")


def run(x, target, weight=None, grad=None, seed=None, **options):
    """(loss, incoming gradient, d/dx) through safeops.cross_entropy."""
    xg = x.detach().requires_grad_(True)  # detach keeps the strides: the op sees the same layout
    loss = safeops.cross_entropy(xg, target, weight, **options)
    g = grad if grad is not None else (seed.randn(*loss.shape, dtype=loss.dtype) if seed is not None
                                       else torch.ones_like(loss))
    (dx,) = torch.autograd.grad(loss, xg, g)
    return loss, g, dx


def check(x, target, weight=None, *, seed, context="", **options):
    """Loss and d/dx against the oracle within its bounds. Returns (loss, dx)."""
    ctx = f"{seed}; {context}; x {tuple(x.shape)} {x.dtype} strides {x.stride()} options {options}"
    loss, g, dx = run(x, target, weight, seed=seed, **options)
    r, expected = O.cross_entropy_gradient(x, target, g, weight=weight, **options)
    assert loss.dtype == x.dtype and loss.shape == r.loss.shape, f"loss {loss.dtype} {loss.shape}; {ctx}"
    O.assert_close(loss, r.loss, O.cross_entropy_bound(r, x.dtype), "loss", ctx)
    assert dx.dtype == x.dtype and dx.shape == x.shape, f"d/dx is {dx.dtype} {tuple(dx.shape)}; {ctx}"
    O.assert_close(dx, expected, O.cross_entropy_gradient_bound(r, g, x, expected), "d/dx", ctx)
    return loss, dx


# --------------------------------------------------------------------------------------------------
# The oracle itself: F.cross_entropy in float64 where torch and the contract agree
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
@given(case=S.cross_entropy_cases())
@S.examples(ci=10)
def test_oracle_is_torch_in_float64(reduction, case):
    """Without z-loss, without -inf logits or NaN, with a counted target somewhere, the oracle is
    F.cross_entropy in float64 (it must not be safeops' own formula in disguise)."""
    x, target, weight = case.inputs()
    x = torch.where(x.isfinite(), x, torch.zeros_like(x))
    target = target.long()
    if (target == case.ignore_index).all() or x.numel() == 0:
        return
    options = dict(ignore_index=case.ignore_index, reduction=reduction, label_smoothing=case.label_smoothing)
    r = O.cross_entropy(x, target, weight, **options)
    w64 = None if weight is None else weight.to(torch.float32).double()
    want = F.cross_entropy(x.double(), target, w64, **options)
    torch.testing.assert_close(r.loss, want, rtol=1e-12, atol=1e-12, msg=repr(case))


# --------------------------------------------------------------------------------------------------
# Property tests: every option, dtype, shape form and layout
# --------------------------------------------------------------------------------------------------


@given(case=S.cross_entropy_cases())
@S.examples(ci=25)
def test_drawn_calls_match_oracle(backend, case):
    """(N, C), (C,) and (N, C, d) logits in fp32/bf16/fp16, permuted and sliced; int64/int32/uint8 targets,
    ignore_index -100 or a class, some or all ignored (with NaN logits there); weights in the logits' dtype
    or fp32; every reduction, label smoothing in [0, 1], z-loss, -inf logits: loss and d/dx."""
    x, target, weight = case.inputs()
    check(x, target, weight, seed=case.seed, context=f"{backend} {case!r}", ignore_index=case.ignore_index,
          reduction=case.reduction, label_smoothing=case.label_smoothing, z_loss=case.z_loss)


@pytest.mark.parametrize(("dtype", "reduction"), DTYPE_REDUCTIONS, ids=DTYPE_REDUCTION_IDS)
@given(seed=seeds())
def test_long_rows_cross_many_column_blocks(backend, dtype, reduction, seed):
    """Rows of 500 classes (16 column blocks under the interpreter) with smoothing, z-loss and weights."""
    x = seed.randn(4, 500, dtype=dtype, std=3.0)
    target = seed.randint(0, 500, 4)
    target[1] = -100
    weight = seed.rand(500).to(dtype)
    check(x, target, weight, seed=seed, context=backend, reduction=reduction, label_smoothing=0.2,
          z_loss=1e-3)


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("offset", [0.0, -1e4])
@given(seed=seeds())
def test_1e4_scale_logits(backend, dtype, offset, seed):
    """Logits of magnitude 1e4 in bf16 (spaced 64 apart there) and a large offset common to a row: the
    nll is (m - z_t) + log(l), and the smoothing sum is shifted by the target logit, so neither loses the
    row's small terms to the offset (an lse - z_t or a plain sum of the logits would, by far)."""
    spread = 1e4 if offset == 0 else 64.0
    x = (offset + seed.randn(6, 50, std=1.0) * spread).to(dtype)
    if dtype == torch.float32 and offset != 0:
        x = (offset + seed.randn(6, 50, std=2.0)).to(dtype)  # fp32 keeps a small spread at 1e4
    target = seed.randint(0, 50, 6)
    for options in (dict(label_smoothing=0.1), dict(z_loss=1e-4, reduction="sum"),
                    dict(label_smoothing=0.3, reduction="none", weight=seed.rand(50).to(dtype))):
        weight = options.pop("weight", None)
        check(x, target, weight, seed=seed, context=f"{backend} offset {offset}", **options)


# --------------------------------------------------------------------------------------------------
# Exact cases of the contract
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@given(seed=seeds())
def test_all_ignored_batch_gives_zero_and_zero_gradient(backend, reduction, weighted, seed):
    """Section 10: a mean over no counted target is 0 with zero gradients (eager torch: NaN), even with
    z-loss and smoothing, and even when the ignored rows' logits are NaN or inf."""
    x = seed.randn(5, 9, std=3.0)
    x[1] = math.nan
    x[3, 2] = math.inf
    target = torch.full((5,), -100)
    weight = seed.rand(9) if weighted else None
    loss, _, dx = run(x, target, weight, reduction=reduction, label_smoothing=0.1, z_loss=1e-2)
    assert (bits(loss) == 0).all(), f"{loss} ({backend})"  # +0.0 exactly
    assert (bits(dx) == 0).all(), f"{dx} ({backend})"
    if reduction == "mean" and not weighted:
        assert torch.isnan(F.cross_entropy(x, target)), "eager torch no longer gives NaN here: update docs"
    if reduction == "mean" and weighted:
        # counted targets whose weights are all 0: the weighted mean's denominator is 0 too
        counted = torch.tensor([0, 3, 0, 3, 0])
        zero_w = weight.clone()
        zero_w[[0, 3]] = 0.0
        loss, _, dx = run(x[[0, 2, 4, 2, 0]], counted, zero_w, reduction="mean")
        assert bits(loss) == 0 and (bits(dx) == 0).all(), (loss, dx)


@pytest.mark.parametrize(("dtype", "reduction"), DTYPE_REDUCTIONS, ids=DTYPE_REDUCTION_IDS)
@given(seed=seeds())
def test_nan_in_an_ignored_row_changes_no_bit(backend, dtype, reduction, seed):
    """Ignored rows are selected away, not multiplied by 0 (section 10): NaN, +inf and -inf logits there give
    exactly the loss and gradient bits of finite logits there, and the ignored rows' gradient is 0."""
    x = seed.randn(7, 40, dtype=dtype, std=3.0)
    target = seed.randint(0, 40, 7)
    target[[1, 4]] = -100
    poisoned = x.clone()
    poisoned[1] = math.nan
    poisoned[4, ::2] = math.inf
    poisoned[4, 1::2] = NEG_INF
    options = dict(reduction=reduction, label_smoothing=0.2, z_loss=1e-3, weight=seed.rand(40).to(dtype))
    loss, g, dx = run(x, target, seed=seed, **options)
    loss_p, _, dx_p = run(poisoned, target, grad=g, **options)
    assert_same_bits(loss_p, loss, "loss", backend)
    assert_same_bits(dx_p, dx, "d/dx", backend)
    assert (bits(dx_p[[1, 4]]) == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@given(seed=seeds())
def test_counted_row_of_all_minus_inf_is_an_empty_row(backend, dtype, seed):
    """Section 4: log-softmax of an all -inf row is -inf, so its nll is +inf, with a zero gradient; the
    other rows do not change."""
    x = seed.randn(4, 12, dtype=dtype, std=2.0)
    target = seed.randint(0, 12, 4)
    empty = x.clone()
    empty[2] = NEG_INF
    loss, g, dx = run(x, target, seed=seed, reduction="none", label_smoothing=0.1, z_loss=1e-3)
    loss_e, _, dx_e = run(empty, target, grad=g, reduction="none", label_smoothing=0.1, z_loss=1e-3)
    assert loss_e[2] == math.inf and (bits(dx_e[2]) == 0).all(), (loss_e, dx_e)
    keep = [0, 1, 3]
    assert_same_bits(loss_e[keep], loss[keep], "other rows' loss", backend)
    assert_same_bits(dx_e[keep], dx[keep], "other rows' d/dx", backend)
    assert torch.isnan(F.cross_entropy(empty.float(), target, reduction="none")[2])  # torch: NaN


@pytest.mark.parametrize("dtype", DTYPES)
@given(seed=seeds())
def test_nan_and_inf_in_a_counted_row_stay_in_that_row(backend, dtype, seed):
    """Section 5: a NaN or +inf logit makes its row's loss and gradient NaN, no other row's; a -inf target
    logit gives an infinite loss and the finite gradient p - onehot."""
    x = seed.randn(5, 10, dtype=dtype, std=2.0)
    target = torch.tensor([3, 1, 4, 1, 5])
    bad = x.clone()
    bad[0, 7] = math.nan
    bad[2, 0] = math.inf
    bad[4, 5] = NEG_INF  # the target logit
    loss, g, dx = run(x, target, seed=seed, reduction="none")
    loss_b, _, dx_b = run(bad, target, grad=g, reduction="none")
    assert torch.isnan(loss_b[[0, 2]]).all() and torch.isnan(dx_b[[0, 2]]).all(), (loss_b, dx_b)
    assert loss_b[4] == math.inf and torch.isfinite(dx_b[4]).all()
    assert_same_bits(loss_b[[1, 3]], loss[[1, 3]], "untouched rows' loss", backend)
    assert_same_bits(dx_b[[1, 3]], dx[[1, 3]], "untouched rows' d/dx", backend)
    r, expected = O.cross_entropy_gradient(bad[4:], target[4:], g[4:], reduction="none")
    bound = O.cross_entropy_gradient_bound(r, g[4:], bad[4:], expected)
    O.assert_close(dx_b[4:], expected, bound, "d/dx of the -inf target's row", backend)


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("n", [1, 7, 100])
def test_equal_logits_give_log_c_and_a_dominating_target_gives_zero(backend, dtype, n):
    """Exact values: a row of equal logits (any offset, 1e4 too) has loss fp32(log n) rounded once to the
    dtype; a target logit above the others by more than fp32's exp underflow gives exactly 0 and a gradient
    of exactly 0 (p = 1 at the target, 0 elsewhere)."""
    x = torch.full((3, n), 1e4).to(dtype)
    x[1] = -7.0
    x[2] = 0.0
    loss, _, _ = run(x, torch.zeros(3, dtype=torch.long), reduction="none")
    want = torch.tensor(math.log(n), dtype=torch.float32).to(dtype)
    assert (bits(loss) == bits(want)).all(), (loss, want)
    if n > 1:
        y = torch.zeros(2, n, dtype=dtype)
        y[:, 0] = 120.0  # exp(-120) is 0 in fp32
        loss, _, dx = run(y, torch.zeros(2, dtype=torch.long), reduction="sum")
        assert bits(loss) == 0 and (bits(dx) == 0).all(), (loss, dx)


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@given(seed=seeds())
def test_fp64_is_computed_in_fp64(backend, weighted, seed):
    """Section 2: fp64 logits are computed in fp64 (the reference, on both backends): torch's float64 loss
    and gradient to about fp64 rounding."""
    x = seed.randn(6, 11, dtype=torch.float64, std=3.0)
    target = seed.randint(0, 11, 6)
    target[0] = -100
    weight = seed.rand(11) if weighted else None
    for options in (dict(), dict(label_smoothing=0.3, reduction="sum")):
        loss, g, dx = run(x, target, weight, **options)
        xg = x.clone().requires_grad_(True)
        want = F.cross_entropy(xg, target, weight, **options)
        (want_dx,) = torch.autograd.grad(want, xg, g)
        assert loss.dtype == torch.float64
        torch.testing.assert_close(loss, want, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(dx, want_dx, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@given(seed=seeds())
def test_dtype_is_the_loss_dtype_without_converting_the_logits(backend, reduction, seed):
    """dtype=float32 on bf16 logits: the bits of the loss of logits.float() and of the gradient through that
    upcast (the same fp32 values inside, one rounding each); dtype=float64 computes in float64."""
    x = seed.randn(5, 30, dtype=torch.bfloat16, std=3.0)
    target = seed.randint(0, 30, 5)
    target[3] = -100
    options = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    loss, g, dx = run(x, target, seed=seed, dtype=torch.float32, **options)
    xg = x.clone().requires_grad_(True)
    want = safeops.cross_entropy(xg.float(), target, **options)
    (want_dx,) = torch.autograd.grad(want, xg, g)
    assert loss.dtype == torch.float32 and dx.dtype == torch.bfloat16
    assert_same_bits(loss, want, "loss", backend)
    assert_same_bits(dx, want_dx, "d/dx", backend)
    loss64 = safeops.cross_entropy(x, target, dtype=torch.float64, reduction=reduction, label_smoothing=0.1)
    want64 = F.cross_entropy(x.double(), target, reduction=reduction, label_smoothing=0.1)
    assert loss64.dtype == torch.float64
    torch.testing.assert_close(loss64, want64, rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------------------------------
# Same bits everywhere (section 6): runs, batches, layouts
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FP32, BF16])
@given(seed=seeds())
def test_batch_invariant_and_deterministic(backend, dtype, seed):
    """A row's loss and gradient bits do not depend on the rows around it, its position, or the run."""
    x = seed.randn(9, 40, dtype=dtype, std=3.0)
    target = seed.randint(0, 40, 9)
    options = dict(label_smoothing=0.1, z_loss=1e-3, weight=seed.rand(40).to(dtype))
    loss, g, dx = run(x, target, seed=seed, reduction="none", **options)
    again, _, dx_again = run(x, target, grad=g, reduction="none", **options)
    assert_same_bits(again, loss, "loss, second run", backend)
    assert_same_bits(dx_again, dx, "d/dx, second run", backend)
    for rows in ([4], list(range(3, 9))):
        part, _, dpart = run(x[rows], target[rows], grad=g[rows], reduction="none", **options)
        assert_same_bits(part, loss[rows], f"loss of rows {rows} alone", backend)
        assert_same_bits(dpart, dx[rows], f"d/dx of rows {rows} alone", backend)
    # sum: a row's gradient is its own (scale 1), whatever the batch
    _, _, dsum = run(x, target, reduction="sum", **options)
    _, _, dsum_part = run(x[2:5], target[2:5], reduction="sum", **options)
    assert_same_bits(dsum_part, dsum[2:5], "d/dx under sum, rows 2..4 alone", backend)


def _layouts(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same (N, C) values in other memory layouts."""
    n, c = x.shape
    big = torch.full((2 * n + 1, c + 5), 7.0, dtype=x.dtype)
    big[1::2, 3:3 + c] = x
    return {"transposed": x.t().contiguous().t(), "sliced": big[1::2, 3:3 + c],
            "class-strided": torch.repeat_interleave(x, 2, dim=1)[:, ::2]}


@pytest.mark.parametrize(("dtype", "reduction"), [(torch.float32, "mean"), (torch.bfloat16, "none")],
                         ids=["fp32-mean", "bf16-none"])
@given(seed=seeds())
def test_layout_independent_bits(backend, dtype, reduction, seed):
    """Transposed, sliced and class-strided logits, and the (N, C, d) form, give the contiguous tensor's
    loss and gradient bits."""
    x = seed.randn(6, 37, dtype=dtype, std=3.0)
    target = seed.randint(0, 37, 6)
    target[2] = -100
    options = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    loss, g, dx = run(x, target, seed=seed, **options)
    for name, view in _layouts(x).items():
        assert torch.equal(view, x)
        got, _, dgot = run(view, target, grad=g, **options)
        assert_same_bits(got, loss, f"loss, {name}", backend)
        assert_same_bits(dgot, dx, f"d/dx, {name}", backend)
    # (N, C, d): rows (n, j) are the (N * d, C) rows in order
    spatial = x.reshape(2, 3, 37).permute(0, 2, 1)
    got, _, dgot = run(spatial, target.reshape(2, 3), grad=g.reshape(2, 3) if reduction == "none" else g,
                       **options)
    assert_same_bits(got.reshape(loss.shape), loss, "loss, (N, C, d) form", backend)
    assert_same_bits(dgot.permute(0, 2, 1).reshape(6, 37), dx, "d/dx, (N, C, d) form", backend)


# --------------------------------------------------------------------------------------------------
# The gradient written into the logits
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
@given(seed=seeds())
def test_inplace_backward_writes_the_same_gradient_into_the_logits(backend, reduction, seed):
    h = seed.randn(6, 8, dtype=torch.bfloat16).requires_grad_(True)
    w = seed.randn(8, 50, dtype=torch.bfloat16)
    target = seed.randint(0, 50, 6)
    target[0] = -100
    options = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    logits = h @ w
    loss = safeops.cross_entropy(logits, target, **options)
    g = torch.ones_like(loss)
    want_dx, want_dh = torch.autograd.grad(loss, [logits, h], g)

    logits = h @ w
    ptr = logits.data_ptr()
    loss2 = safeops.cross_entropy(logits, target, **options, inplace_backward=True)
    version = logits._version
    (dh,) = torch.autograd.grad(loss2, h, g)
    assert_same_bits(loss2, loss, "loss", backend)
    assert_same_bits(dh, want_dh, "d/dh through the in-place gradient", backend)
    assert logits.data_ptr() == ptr
    assert_same_bits(logits.detach(), want_dx, "the logits' buffer holds d/dlogits", backend)
    assert logits._version > version  # anyone who saved the logits now fails loudly


@given(seed=seeds())
def test_inplace_backward_falls_back_where_it_cannot_write_in_place(backend, seed):
    """(N, C, d1, d2) logits whose d dims do not merge, and expanded logits: the gradient goes to a fresh
    buffer (the same bits), and the logits are left alone."""
    base = seed.randn(2, 3, 4, 5)
    h = base.clone().requires_grad_(True)
    target = seed.randint(0, 4, 2, 5, 3)
    for make in (lambda t: t.permute(0, 2, 3, 1), lambda t: t[:, :1].expand(2, 3, 4, 5).permute(0, 2, 3, 1)):
        logits = make(h * 1.0)
        before = logits.detach().clone()
        loss = safeops.cross_entropy(logits, target, inplace_backward=True, label_smoothing=0.1)
        (dx,) = torch.autograd.grad(loss, logits)
        want = safeops.cross_entropy(make(h * 1.0), target, label_smoothing=0.1)
        (want_dx,) = torch.autograd.grad(want, h)
        (dh,) = torch.autograd.grad(safeops.cross_entropy(make(h * 1.0), target, inplace_backward=True,
                                                          label_smoothing=0.1), h)
        assert_same_bits(dh, want_dx, "d/dh", backend)
        assert_same_bits(logits.detach(), before, "the logits, untouched", backend)
        assert dx.data_ptr() != logits.data_ptr()


@given(seed=seeds())
def test_inplace_backward_makes_other_savers_of_the_logits_fail_loudly(backend, seed):
    h = seed.randn(4, 6).requires_grad_(True)
    logits = h @ seed.randn(6, 10)
    target = seed.randint(0, 10, 4)
    # pow saves the logits; created first, its backward runs after the cross-entropy's has overwritten them
    penalty = (logits ** 2).sum()
    loss = safeops.cross_entropy(logits, target, inplace_backward=True) + penalty
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inplace_backward_refuses_a_leaf(backend):
    x = torch.randn(3, 5, requires_grad=True)
    with pytest.raises(ValueError, match="inplace_backward.*leaf"):
        safeops.cross_entropy(x, torch.zeros(3, dtype=torch.long), inplace_backward=True)


# --------------------------------------------------------------------------------------------------
# Errors (contract section 8): ValueError / TypeError naming the argument
# --------------------------------------------------------------------------------------------------

CE = safeops.cross_entropy
X = torch.zeros(4, 5)
T = torch.zeros(4, dtype=torch.long)
BAD_CALLS = {
    "input not a tensor": (TypeError, "input", lambda: CE([1.0], T)),
    "integer input": (TypeError, "input", lambda: CE(X.long(), T)),
    "0-d input": (ValueError, "input", lambda: CE(torch.tensor(1.0), T)),
    "float target": (TypeError, "target", lambda: CE(X, T.float())),
    "probability target": (TypeError, "probability", lambda: CE(X, torch.zeros(4, 5))),
    "bool target": (TypeError, "target", lambda: CE(X, T.bool())),
    "int16 target": (TypeError, "target", lambda: CE(X, T.to(torch.int16))),
    "target shape": (ValueError, "target must have shape", lambda: CE(X, T[:3])),
    "target rank": (ValueError, "target must have shape", lambda: CE(X, T[:, None])),
    "spatial target": (ValueError, r"\(4, 2\)", lambda: CE(torch.zeros(4, 5, 2), T)),
    "reduction": (ValueError, "reduction", lambda: CE(X, T, reduction="avg")),
    "reduction type": (ValueError, "reduction", lambda: CE(X, T, reduction=None)),
    "weight size": (ValueError, "weight", lambda: CE(X, T, torch.ones(4))),
    "weight rank": (ValueError, "weight", lambda: CE(X, T, torch.ones(1, 5))),
    "weight dtype": (TypeError, "weight", lambda: CE(X, T, torch.ones(5, dtype=torch.long))),
    "weight type": (TypeError, "weight", lambda: CE(X, T, [1.0] * 5)),
    "weight requires grad": (ValueError, "weight",
                             lambda: CE(X, T, torch.ones(5, requires_grad=True))),
    "smoothing < 0": (ValueError, "label_smoothing", lambda: CE(X, T, label_smoothing=-0.1)),
    "smoothing > 1": (ValueError, "label_smoothing", lambda: CE(X, T, label_smoothing=1.5)),
    "smoothing nan": (ValueError, "label_smoothing",
                      lambda: CE(X, T, label_smoothing=math.nan)),
    "smoothing type": (TypeError, "label_smoothing", lambda: CE(X, T, label_smoothing="0")),
    "negative z_loss": (ValueError, "z_loss", lambda: CE(X, T, z_loss=-1e-4)),
    "inf z_loss": (ValueError, "z_loss", lambda: CE(X, T, z_loss=math.inf)),
    "ignore_index type": (TypeError, "ignore_index", lambda: CE(X, T, ignore_index=1.0)),
    "inplace type": (TypeError, "inplace_backward", lambda: CE(X, T, inplace_backward=1)),
    "dtype": (TypeError, "dtype", lambda: CE(X, T, dtype=torch.int32)),
    "class index too large": (ValueError, "class index 5",
                              lambda: CE(X, torch.tensor([0, 5, 1, 2]))),
    "negative class index": (ValueError, "class index -1",
                             lambda: CE(X, torch.tensor([0, -1, 1, 2]))),
    "index too large, none": (ValueError, "class index 9",
                              lambda: CE(X, torch.tensor([9, 0, 0, 0]), reduction="none")),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_raise_naming_the_argument(reference_backend, name):
    error, match, call = BAD_CALLS[name]
    with pytest.raises(error, match=match):
        call()


@given(seed=seeds())
def test_expanded_gradient_and_strided_targets(backend, seed):
    """loss.sum().backward() of a "none" loss hands the backward an expanded (stride 0) gradient, and targets
    may be strided views: both are read as the values they hold."""
    x = seed.randn(6, 13, std=2.0)
    target = seed.randint(0, 13, 12)[::2]
    loss, _, dx = run(x, target, reduction="none", grad=torch.ones(()).expand(6))
    want, _, want_dx = run(x, target.contiguous(), reduction="none", grad=torch.ones(6))
    assert_same_bits(loss, want, "loss", backend)
    assert_same_bits(dx, want_dx, "d/dx", backend)


@pytest.mark.parametrize("target", [[0, 5, 1, 2], [0, -1, 1, 2]], ids=["5", "-1"])
def test_class_index_out_of_range_raises_on_cpu(triton_backend, target):
    with pytest.raises(ValueError, match=f"class index {target[1]}, outside"):
        safeops.cross_entropy(X, torch.tensor(target), reduction="sum")


def test_ignore_index_outside_the_classes_is_fine(backend):
    loss = safeops.cross_entropy(X, torch.tensor([0, 7, 7, 1]), ignore_index=7, reduction="none")
    assert loss[1] == 0 and loss[2] == 0 and loss[0] == math.log(5)


def test_out_of_range_targets_give_nan_in_the_kernels_without_a_check(triton_backend):
    """What the CUDA path does (no host sync there): the kernels, called without the CPU check, give the row
    a NaN loss and a NaN gradient row, and NaN sums and means; the other rows are untouched."""
    x = torch.randn(4, 6)
    target = torch.tensor([1, 6, -3, -100])
    for reduction in (0, 1, 2):
        loss, m, l, denom = cross_entropy_launch.forward(x, target, None, -100, reduction, 0.1, 1e-3)
        dx = cross_entropy_launch.backward(torch.ones_like(loss), x, target, None, m, l, denom, -100,
                                           reduction, 0.1, 1e-3)
        assert torch.isnan(dx[1:3]).all() and torch.isfinite(dx[0]).all() and (dx[3] == 0).all(), dx
        if reduction == 0:
            assert torch.isnan(loss[1:3]).all() and torch.isfinite(loss[0]) and loss[3] == 0, loss
        else:
            assert torch.isnan(loss), loss


class _RecordedLaunch:
    """Stands for KernelLaunch in the launcher's plans on the CPU: counts the plans built and runs each launch
    through ``kernel[grid]`` (the interpreter) with the arguments the plan passes."""

    built: list = []

    def __init__(self, kernel, grid, kwargs):
        self.kernel, self.grid, self.kwargs = kernel, grid, kwargs
        _RecordedLaunch.built.append((kernel, grid))

    def __call__(self, *args):
        self.kernel[self.grid](*args, **self.kwargs)


def test_launch_plans_give_the_general_path(triton_backend, monkeypatch):
    """The CUDA path's launch plans (kept per call signature, emulated here on the CPU) launch what the
    general path launches: the same loss, statistics and gradient bits for every option, one plan per
    signature reused by a repeated call, and a new plan when ignore_index, the alignment of x or an option
    changes."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 9, 2, generator=gen)
    target = torch.randint(0, 9, (6, 2), generator=gen)
    target[1, 0] = -100
    weight = torch.rand(9, generator=gen) + 0.5
    calls = [(w, red, ls, z) for w in (None, weight) for red in (0, 1, 2)
             for ls, z in ((0.0, 0.0), (0.1, 1e-3))]

    def run(xx, ignore_index=-100, options=calls[0]):
        w, red, ls, z = options
        loss, m, l, denom = cross_entropy_launch.forward(xx, target, w, ignore_index, red, ls, z)
        dx = cross_entropy_launch.backward(torch.ones_like(loss), xx, target, w, m, l, denom, ignore_index,
                                           red, ls, z)
        return loss, m, l, denom, dx

    general = {options: run(x, options=options) for options in calls}
    _RecordedLaunch.built = []
    monkeypatch.setattr(cross_entropy_launch, "_PLANS", {})
    monkeypatch.setattr(cross_entropy_launch, "_planned", lambda x: True)
    monkeypatch.setattr(cross_entropy_launch, "_compiled", lambda kernel: True)
    monkeypatch.setattr(cross_entropy_launch, "KernelLaunch", _RecordedLaunch)
    for options in calls:
        for _ in range(2):
            for got, want in zip(run(x, options=options), general[options], strict=True):
                assert torch.equal(got, want), options
    # One plan per signature and direction: the forward's (one launch, or two with a reduction) and the
    # backward's, each built once although every signature ran twice.
    launches = sum(2 if red else 1 for _, red, _, _ in calls) + len(calls)
    assert len(_RecordedLaunch.built) == launches
    n = len(cross_entropy_launch._PLANS)
    run(x, ignore_index=7)
    offset = torch.empty(x.numel() + 1)[1:].view(x.shape).copy_(x)  # 4-byte aligned, not 16
    run(offset)
    assert len(cross_entropy_launch._PLANS) == n + 4


# --------------------------------------------------------------------------------------------------
# The torch.library op: opcheck, fake outputs, torch.compile
# --------------------------------------------------------------------------------------------------

OP_VARIANTS = {
    # name: (x shape, target options, weight, reduction, smoothing, z_loss)
    "sum_weighted_smoothed": ((5, 7), None, True, 2, 0.2, 0.0),
    "none_zloss_ignored": ((5, 7), "ignored", False, 0, 0.0, 1e-2),
    "spatial_mean_all_options": ((3, 7, 2), "ignored", True, 1, 0.1, 1e-3),
}


def op_args(name, seed, dtype=torch.float32):
    shape, tgt, weighted, reduction, smoothing, z_loss = OP_VARIANTS[name]
    x = seed.randn(*shape, dtype=dtype, std=2.0).requires_grad_(True)
    target = seed.randint(0, shape[1], shape[0], *shape[2:])
    if tgt == "ignored":
        target.reshape(-1)[0] = -100
    weight = seed.rand(shape[1]) if weighted else None
    return (x, target, weight, -100, reduction, smoothing, z_loss, None)


def _opcheck(op, args) -> None:
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


# (backend, variant): the reference once, the kernels on every variant.
OPCHECK_CASES = [("reference", "spatial_mean_all_options"), *(("triton", name) for name in OP_VARIANTS)]
OPCHECK_IDS = [f"{b}-{n}" for b, n in OPCHECK_CASES]


@pytest.fixture
def op_backend(request, monkeypatch):
    name = request.param
    if name == "triton" and not INTERPRETER:
        pytest.skip("needs Triton's interpreter")
    monkeypatch.setenv("SAFEOPS_BACKEND", name)
    return name


@pytest.mark.parametrize(("op_backend", "name"), OPCHECK_CASES, ids=OPCHECK_IDS, indirect=["op_backend"])
@given(seed=seeds())
def test_opcheck_forward(op_backend, name, seed):
    _opcheck(torch.ops.safeops.cross_entropy.default, op_args(name, seed))


@pytest.mark.parametrize(("op_backend", "name"), OPCHECK_CASES[:2], ids=OPCHECK_IDS[:2],
                         indirect=["op_backend"])
@given(seed=seeds())
def test_opcheck_backward(op_backend, name, seed):
    x, target, weight, ii, reduction, smoothing, z_loss, _ = op_args(name, seed)
    x = x.detach()
    loss, m, l, denom = torch.ops.safeops.cross_entropy(x, target, weight, ii, reduction, smoothing, z_loss,
                                                        None)
    grad = seed.randn(*loss.shape)
    _opcheck(torch.ops.safeops.cross_entropy_backward.default,
             (grad, x, target, weight, m, l, denom, ii, reduction, smoothing, z_loss))


FAKE_LAYOUTS = {
    "contiguous": lambda s: s.randn(4, 9),
    "transposed": lambda s: s.randn(9, 4).t(),
    "sliced": lambda s: s.randn(8, 12)[::2, 1:10],
    "spatial": lambda s: s.randn(2, 9, 3),
    "spatial_permuted": lambda s: s.randn(2, 3, 9).permute(0, 2, 1),
}


@pytest.mark.parametrize("layout", list(FAKE_LAYOUTS))
@pytest.mark.parametrize(("reduction", "out_dtype"), [(0, None), (1, torch.float32), (2, torch.float64)],
                         ids=["none", "mean-fp32", "sum-fp64"])
@given(seed=seeds())
def test_fake_outputs_match_real_outputs(backend, layout, reduction, out_dtype, seed):
    x = FAKE_LAYOUTS[layout](seed).to(torch.bfloat16)
    target = seed.randint(0, 9, x.shape[0], *x.shape[2:])
    real = torch.ops.safeops.cross_entropy(x, target, None, -100, reduction, 0.1, 0.0, out_dtype)
    grad = seed.randn(*real[0].shape, dtype=real[0].dtype)
    real_bwd = torch.ops.safeops.cross_entropy_backward(grad, x, target, None, *real[1:], -100, reduction,
                                                        0.1, 0.0)
    with FakeTensorMode() as mode:
        fx, ft, fg = mode.from_tensor(x), mode.from_tensor(target), mode.from_tensor(grad)
        fake = torch.ops.safeops.cross_entropy(fx, ft, None, -100, reduction, 0.1, 0.0, out_dtype)
        fake_bwd = torch.ops.safeops.cross_entropy_backward(fg, fx, ft, None, *fake[1:], -100, reduction,
                                                            0.1, 0.0)
    for what, r, f in zip(("loss", "row_max", "row_sum", "denom", "grad_x"), (*real, real_bwd),
                          (*fake, fake_bwd), strict=True):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride()), (
            f"{what} ({backend}, {layout}): real {tuple(r.shape)} {r.dtype} {r.stride()} vs fake "
            f"{tuple(f.shape)} {f.dtype} {f.stride()}")


def _losses(x1, x2, x3, target, weight):
    return (safeops.cross_entropy(x1, target, weight, label_smoothing=0.1, z_loss=1e-3),
            safeops.cross_entropy(x2, target, reduction="none"),
            safeops.cross_entropy(x3, target.clamp(min=0), weight, reduction="sum", ignore_index=0))


@given(seed=seeds())
def test_compile_fullgraph_matches_eager_bitwise(triton_backend, seed):
    """Section 6: torch.compile(fullgraph=True) runs the same op and launcher, so the same loss and gradient
    bits (the reference's compiled path is checked with register() in test_cross_entropy_compile.py)."""
    torch._dynamo.reset()
    compiled = torch.compile(_losses, backend="inductor", fullgraph=True)
    x = seed.randn(6, 40, dtype=torch.bfloat16, std=3.0)
    target = seed.randint(0, 40, 6)
    target[1] = -100
    weight = seed.rand(40).to(torch.bfloat16)
    results = []
    for fn in (_losses, compiled):
        xs = [x.clone().requires_grad_(True) for _ in range(3)]
        outs = fn(*xs, target, weight)
        grads = torch.autograd.grad([o.float().sum() for o in outs], xs)  # each x feeds one loss
        results.append((*outs, *grads))
    names = ("mean", "none", "sum", "d/dx mean", "d/dx none", "d/dx sum")
    for what, a, b in zip(names, results[1], results[0], strict=True):
        assert_same_bits(a, b, f"compiled vs eager {what}", seed)
    torch._dynamo.reset()


@given(seed=seeds())
def test_double_backward_raises(backend, seed):
    x = seed.randn(3, 7).requires_grad_(True)
    target = seed.randint(0, 7, 3)
    (g,) = torch.autograd.grad(safeops.cross_entropy(x, target), x)
    assert torch.isfinite(g).all() and not g.requires_grad
    with pytest.raises(RuntimeError, match="double backward|derivative|autograd"):
        (g2,) = torch.autograd.grad(safeops.cross_entropy(x, target), x, create_graph=True)
        g2.sum().backward()


# --------------------------------------------------------------------------------------------------
# safeops.nn.CrossEntropyLoss and replace_modules
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [dict(), dict(reduction="sum", label_smoothing=0.2),
                                     dict(reduction="none", ignore_index=2)], ids=["default", "sum", "none"])
@given(seed=seeds())
def test_cross_entropy_loss_module_matches_torch(backend, options, seed):
    weight = seed.rand(9)
    ours = safeops.nn.CrossEntropyLoss(weight=weight, **options)
    theirs = torch.nn.CrossEntropyLoss(weight=weight, **options)
    assert isinstance(ours, torch.nn.CrossEntropyLoss)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = seed.randn(5, 9, dtype=torch.float64)
    target = seed.randint(0, 9, 5)
    target[0] = 2
    torch.testing.assert_close(ours(x, target), theirs(x, target), rtol=1e-12, atol=1e-12)
    z = safeops.nn.CrossEntropyLoss(z_loss=1e-2)
    assert z.z_loss == 1e-2 and "z_loss=0.01" in repr(z)
    torch.testing.assert_close(z(x, target), safeops.cross_entropy(x, target, z_loss=1e-2), rtol=0, atol=0)


def test_cross_entropy_loss_module_refuses_probability_targets():
    with pytest.raises(TypeError, match="probability"):
        safeops.nn.CrossEntropyLoss()(torch.zeros(2, 3), torch.zeros(2, 3))


def test_replace_modules_swaps_cross_entropy_loss(reference_backend):
    model = torch.nn.Sequential(torch.nn.Linear(4, 6))
    model.loss = torch.nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=3)
    safeops.replace_modules(model)
    assert type(model.loss) is safeops.nn.CrossEntropyLoss
    assert model.loss.label_smoothing == 0.1 and model.loss.ignore_index == 3
    x, target = torch.randn(5, 6), torch.tensor([0, 3, 1, 3, 5])
    x[1] = math.nan  # an ignored row
    assert torch.isfinite(model.loss(x, target))
    safeops.restore_modules(model)
    assert type(model.loss) is torch.nn.CrossEntropyLoss
