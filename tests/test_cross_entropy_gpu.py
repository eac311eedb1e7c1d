"""GPU-only tests of safeops.cross_entropy: the compiled Triton kernels on CUDA (skipped without a GPU).

What CPU CI cannot check (the interpreter ignores compile options and lays tiles out its own way):

- the float64 oracle (tests/oracle.py) on language-model shapes, vocabularies of 32K to 256K and rows of
  up to 4,194,304 classes, bf16 and fp32, every option (section 2 and the issue's row range);
- the same bits in every memory layout (contiguous, transposed, sliced, class-strided, (N, C, d)), for
  every batch around a row and every run, and eager equal to compiled (section 6);
- the in-place backward allocates no logits-sized buffer (torch.cuda.max_memory_allocated), where the
  out-of-place one does (so the check can fail);
- an out-of-range class index gives NaN in its row without a host sync (torch.cuda.set_sync_debug_mode);
- ignored rows holding NaN, all-ignored batches, 1e4-scale bf16 logits, and a logits tensor past 2**31
  elements (64-bit offsets, section 8).

``SAFEOPS_GPU_SMALL=1`` shrinks the shapes and skips the huge tests (for compute-sanitizer runs).
"""

from __future__ import annotations

import math
import os

import oracle as O
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from strategies import seeds

import safeops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
SMALL = os.environ.get("SAFEOPS_GPU_SMALL", "0").strip() not in ("", "0")
# Vocabularies: language-model heads (32K-256K) and the longest row, with rows to match.
VOCABS = (32768, 131072) if SMALL else (32768, 131072, 262144, 4194304)
OPTIONS = {
    "mean": dict(),
    "sum_smoothed_weighted_zloss": dict(reduction="sum", label_smoothing=0.1, z_loss=1e-4, weighted=True),
    "none_ignored": dict(reduction="none", ignore_index=0),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}
    return t.detach().contiguous().view(ints[t.element_size()])


def assert_same_bits(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    diff = bits(a) != bits(b)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {a.numel()} elements differ in their bits"


def inputs(seed, rows, vocab, dtype, std=3.0, ignore_index=-100):
    g = torch.Generator(device=DEV).manual_seed(seed.value)
    x = (torch.randn(rows, vocab, device=DEV, generator=g) * std).to(dtype)
    target = torch.randint(0, vocab, (rows,), device=DEV, generator=g)
    target[[rows // 3, rows // 2]] = ignore_index
    return x, target


def run(x, target, weight=None, grad=None, **options):
    xg = x.detach().requires_grad_(True)
    loss = safeops.cross_entropy(xg, target, weight, **options)
    g = torch.ones_like(loss) if grad is None else grad
    (dx,) = torch.autograd.grad(loss, xg, g)
    return loss, g, dx


def check_oracle(x, target, weight=None, **options):
    loss, g, dx = run(x, target, weight, **options)
    xc, tc, gc = x.cpu(), target.cpu(), g.cpu()
    wc = None if weight is None else weight.cpu()
    r, expected = O.cross_entropy_gradient(xc, tc, gc, weight=wc, **options)
    ctx = f"x {tuple(x.shape)} {x.dtype}, {options}"
    O.assert_close(loss.cpu(), r.loss, O.cross_entropy_bound(r, x.dtype), "loss", ctx)
    O.assert_close(dx.cpu(), expected, O.cross_entropy_gradient_bound(r, gc, xc, expected), "d/dx", ctx)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(OPTIONS))
@given(seed=seeds())
def test_long_rows_match_oracle(vocab, dtype, name, seed):
    options = dict(OPTIONS[name])
    rows = 3 if vocab > 2**20 else 16
    x, target = inputs(seed, rows, vocab, dtype, ignore_index=options.get("ignore_index", -100))
    weight = torch.rand(vocab, device=DEV).to(dtype) if options.pop("weighted", False) else None
    check_oracle(x, target, weight, **options)


@pytest.mark.parametrize("classes", [1, 7, 100, 1000, 4095, 4096, 4097, 10000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@given(seed=seeds())
def test_short_rows_match_oracle(classes, dtype, seed):
    x, target = inputs(seed, 300, classes, dtype)
    for options in (dict(), dict(reduction="none", label_smoothing=0.2, z_loss=1e-3)):
        check_oracle(x, target, **options)


@pytest.mark.parametrize("offset", [0.0, 1e4])
@given(seed=seeds())
def test_1e4_scale_bf16_logits(offset, seed):
    x, target = inputs(seed, 64, 32768, torch.float32, std=1e4 if offset == 0 else 64.0)
    x = (x + offset).to(torch.bfloat16)
    for options in (dict(label_smoothing=0.1), dict(reduction="none", z_loss=1e-4)):
        check_oracle(x, target, **options)


def _layouts(x):
    n, c = x.shape
    big = torch.zeros(2 * n + 1, c + 8, dtype=x.dtype, device=DEV)
    big[1::2, 5:5 + c] = x
    return {"transposed": x.t().contiguous().t(), "sliced": big[1::2, 5:5 + c],
            "class-strided": torch.repeat_interleave(x, 2, dim=1)[:, ::2],
            "misaligned": torch.cat([x.new_zeros(n, 1), x], 1)[:, 1:]}


@pytest.mark.parametrize("classes", [100, 50000])
@pytest.mark.parametrize("reduction", ["none", "mean"])
@given(seed=seeds())
def test_layout_independent_bits(classes, reduction, seed):
    x, target = inputs(seed, 48, classes, torch.bfloat16)
    options = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    loss, g, dx = run(x, target, **options)
    for name, view in _layouts(x).items():
        got, _, dgot = run(view, target, grad=g, **options)
        assert_same_bits(got, loss, f"loss, {name}")
        assert_same_bits(dgot, dx, f"d/dx, {name}")
    spatial = x.reshape(6, 8, classes).permute(0, 2, 1)  # (N, C, d): rows (n, j) in order
    got, _, dgot = run(spatial, target.reshape(6, 8), grad=g.reshape(6, 8) if reduction == "none" else g,
                       **options)
    assert_same_bits(got.reshape(loss.shape), loss, "loss, (N, C, d)")
    assert_same_bits(dgot.permute(0, 2, 1).reshape(x.shape), dx, "d/dx, (N, C, d)")


@pytest.mark.parametrize("classes", [100, 131072])
@given(seed=seeds())
def test_batch_invariant_and_deterministic(classes, seed):
    x, target = inputs(seed, 257 if classes < 1000 else 33, classes, torch.bfloat16)
    options = dict(reduction="none", label_smoothing=0.1, z_loss=1e-3)
    loss, g, dx = run(x, target, **options)
    for _ in range(2):
        again, _, dx_again = run(x, target, grad=g, **options)
        assert_same_bits(again, loss, "loss, rerun")
        assert_same_bits(dx_again, dx, "d/dx, rerun")
    for rows in ([5], [0, 1, 2], list(range(7, 30))):
        part, _, dpart = run(x[rows], target[rows], grad=g[rows], **options)
        assert_same_bits(part, loss[rows], f"loss, rows {rows[0]}.. alone")
        assert_same_bits(dpart, dx[rows], f"d/dx, rows {rows[0]}.. alone")


@given(seed=seeds())
def test_nan_in_ignored_rows_and_all_ignored_batches(seed):
    x, target = inputs(seed, 64, 32768, torch.bfloat16)
    poisoned = x.clone()
    ignored = target == -100
    poisoned[ignored] = math.nan
    for reduction in ("mean", "sum", "none"):
        loss, g, dx = run(x, target, reduction=reduction, label_smoothing=0.1)
        loss_p, _, dx_p = run(poisoned, target, grad=g, reduction=reduction, label_smoothing=0.1)
        assert_same_bits(loss_p, loss, f"loss, NaN in ignored rows, {reduction}")
        assert_same_bits(dx_p, dx, f"d/dx, NaN in ignored rows, {reduction}")
        assert (bits(dx_p[ignored]) == 0).all()
        none = torch.full_like(target, -100)
        loss0, _, dx0 = run(poisoned, none, reduction=reduction, z_loss=1e-3)
        assert (bits(loss0) == 0).all() and (bits(dx0) == 0).all(), reduction


@given(seed=seeds())
def test_compiled_with_register_matches_eager_bits(seed):
    x, target = inputs(seed, 64, 32768, torch.bfloat16)
    torch._dynamo.reset()
    with safeops.registered():
        f = torch.compile(lambda a, t: F.cross_entropy(a.float(), t, label_smoothing=0.1), fullgraph=True)
        xg = x.clone().requires_grad_(True)
        loss = f(xg, target)
        (dx,) = torch.autograd.grad(loss, xg)
    torch._dynamo.reset()
    want, _, want_dx = run(x, target, label_smoothing=0.1, dtype=torch.float32)
    assert_same_bits(loss, want, "compiled loss")
    assert_same_bits(dx, want_dx, "compiled d/dx")


def _peak_during_backward(inplace: bool, rows: int, vocab: int) -> tuple[int, int, torch.Tensor]:
    torch.manual_seed(0)
    h = torch.randn(rows, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, vocab, device=DEV, dtype=torch.bfloat16) * 0.05
    target = torch.randint(0, vocab, (rows,), device=DEV)
    logits = h @ w
    loss = safeops.cross_entropy(logits, target, inplace_backward=inplace)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    (dlogits,) = torch.autograd.grad(loss, logits)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, logits.numel() * logits.element_size(), dlogits


def test_inplace_backward_allocates_no_logits_sized_buffer():
    rows, vocab = (1024, 32768) if SMALL else (4096, 131072)
    peak_out, size, dx_out = _peak_during_backward(False, rows, vocab)
    assert peak_out >= size, f"the out-of-place backward allocated {peak_out} bytes, under the logits' {size}"
    peak_in, size, dx_in = _peak_during_backward(True, rows, vocab)
    assert peak_in < size // 16, f"the in-place backward allocated {peak_in} bytes; the logits are {size}"
    assert_same_bits(dx_in, dx_out, "in-place vs out-of-place d/dlogits")


def test_out_of_range_targets_give_nan_without_a_host_sync():
    x = torch.randn(4, 1000, device=DEV, dtype=torch.bfloat16)
    target = torch.tensor([3, 1000, -7, -100], device=DEV)
    run(x, target.clamp(0, 999), reduction="none")  # compile the kernels outside the check
    run(x, target.clamp(0, 999), reduction="mean")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss_none, _, dx = run(x, target, reduction="none")
        loss_mean, _, _ = run(x, target, reduction="mean")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isnan(loss_none[1:3]).all() and torch.isfinite(loss_none[0]) and loss_none[3] == 0
    assert torch.isnan(dx[1:3]).all() and torch.isfinite(dx[0]).all() and (dx[3] == 0).all()
    assert torch.isnan(loss_mean)


@pytest.mark.skipif(SMALL, reason="SAFEOPS_GPU_SMALL")
def test_logits_past_2_to_the_31_elements():
    rows, vocab = 8200, 262144  # 2.15e9 elements, 4.3 GB of bf16
    x = torch.empty(rows, vocab, device=DEV, dtype=torch.bfloat16).normal_(0, 3)
    target = torch.randint(0, vocab, (rows,), device=DEV)
    loss, _, dx = run(x, target, reduction="none", label_smoothing=0.1)
    for r in (0, rows - 1):
        r_loss, _, r_dx = run(x[r:r + 1], target[r:r + 1], reduction="none", label_smoothing=0.1)
        assert_same_bits(loss[r:r + 1], r_loss, f"loss of row {r}")
        assert_same_bits(dx[r:r + 1], r_dx, f"d/dx of row {r}")
    check_oracle(x[-2:], target[-2:], reduction="none", label_smoothing=0.1)
