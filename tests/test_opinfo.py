"""PyTorch's own OpInfo sample inputs through every CPU backend, against torch in float64.

The samples of ``torch.testing._internal.common_methods_invocations.op_db`` for softmax, log_softmax,
logsumexp and scaled_dot_product_attention (float32, bfloat16, float16 and float64, as OpInfo gives them on
the CPU; drawn with a fixed seed, so every run sees the same inputs) are mapped onto safeops' public
functions and run on the reference and on the Triton kernels (interpreted). Expected values are torch's own
ops on the same inputs converted to float64 (exact), gradients by float64 autograd through them.

Tolerances are the explicit ones of tests/oracle.py, per element: its ``TOLERANCE`` table (one rounding to
the output dtype plus the fp32 / fp64 internals, by dtype) for the row ops, and its attention bounds (the
unit roundoff of each dtype for P and dS and the fp32 error of the scores) for attention.

A sample safeops does not support must raise a TypeError or ValueError naming the argument. Which samples
those are is decided from the sample alone (:func:`unsupported`), so a new refusal fails here as much as a
wrong number does; run with ``-s`` to see each refusal's message.
"""

from __future__ import annotations

import oracle
import pytest
import torch

pytest.importorskip("expecttest", reason="torch's OpInfo database needs expecttest (the test extra)")
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

import safeops

F64 = torch.float64
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SDPA = "nn.functional.scaled_dot_product_attention"
OPS = ("softmax", "log_softmax", "logsumexp", SDPA)


def _samples():
    """(op name, variant, dtype, index, SampleInput) of every sample, with a fixed seed per op and dtype."""
    out = []
    for info in op_db:
        if info.name not in OPS:
            continue
        supported = info.supported_dtypes("cpu")
        for dtype in DTYPES:
            if dtype not in supported:
                continue
            torch.manual_seed(0)
            for i, sample in enumerate(info.sample_inputs("cpu", dtype, requires_grad=False)):
                out.append((info.name, info.variant_test_name, dtype, i, sample))
    return out


SAMPLES = _samples()


def _id(name: str, variant: str, dtype: torch.dtype, i: int) -> str:
    short = "sdpa" if name == SDPA else name
    return f"{short}{'-' + variant if variant else ''}-{str(dtype).removeprefix('torch.')}-{i}"


def _dim(dim):
    """OpInfo passes logsumexp's dim as a tuple; a one-element tuple is that int (the same reduction)."""
    return dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim


def unsupported(name: str, sample) -> tuple[str, str] | None:
    """(argument, reason) when safeops does not support the sample, else None; from the sample alone."""
    if name == SDPA:
        if sample.kwargs.get("dropout_p", 0.0) != 0.0:
            return "dropout_p", "safeops.attention has no dropout"
        if sample.input.dim() != 4:
            return "q", "safeops.attention takes (B, H, S, D) only"
        return None
    if not isinstance(_dim(sample.args[0]), int):
        return "dim", "safeops reduces over one dimension"
    return None


def _row_args(name: str, sample) -> tuple[int | tuple, bool, torch.dtype | None]:
    """(dim, keepdim, dtype) of a softmax / log_softmax / logsumexp sample."""
    dim = _dim(sample.args[0])
    keepdim = bool(sample.args[1]) if len(sample.args) > 1 else sample.kwargs.get("keepdim", False)
    return dim, keepdim, sample.kwargs.get("dtype")


def _call(name: str, sample, x, *tensors):
    """safeops' public function on ``x`` (and k, v) with the sample's other arguments mapped onto it."""
    if name == SDPA:
        kwargs = dict(sample.kwargs)
        if kwargs.get("dropout_p", 0.0) == 0.0:  # SDPA without dropout is what safeops computes
            kwargs.pop("dropout_p", None)
        return safeops.attention(x, *tensors, *sample.args[len(tensors):], **kwargs)
    dim, keepdim, dtype = _row_args(name, sample)
    if name == "logsumexp":
        return safeops.logsumexp(x, dim, keepdim=keepdim)
    return getattr(safeops, name)(x, dim, dtype=dtype)


def _grad_out(out: torch.Tensor, i: int) -> torch.Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(i), dtype=F64).to(out.dtype)


def _check(actual, expected, bound, what: str) -> None:
    ratio, where = oracle.max_violation(actual, expected, bound)
    assert ratio <= 1.0, f"{what}: error {ratio:.3g} x the allowed bound {where}"


def _check_rows(name: str, sample, i: int) -> None:
    x = sample.input
    dim, keepdim, dtype = _row_args(name, sample)
    xg = x.detach().clone().requires_grad_(True)
    x64 = x.detach().to(F64).requires_grad_(True)
    out = _call(name, sample, xg)
    if name == "logsumexp":
        expected = torch.logsumexp(x64, dim, keepdim=keepdim)
        # torch.logsumexp's backward is exp(x - lse) with lse folded (contract section 3): off by |lse| ulps,
        # which for OpInfo's float64 logits near 2000 is more than safeops' fp64 error. The gradient comes
        # from the same value written with the row max apart, m + log(sum(exp(x - m))).
        m = x64.detach().amax(dim, keepdim=True)
        stable = m + torch.log(torch.exp(x64 - m).sum(dim, keepdim=True))
        stable = stable if keepdim else stable.squeeze(dim)
    else:
        expected = stable = getattr(torch, name)(x64, dim)
    assert out.dtype == (dtype or x.dtype), f"{name}: output dtype {out.dtype}"
    r = oracle.evaluate(name, x, dim, out_dtype=dtype, keepdim=keepdim)
    _check(out, expected, oracle.output_bound(name, r, out.dtype, keepdim), f"{name} output")
    g = _grad_out(out, i)
    (dx,) = torch.autograd.grad(out, xg, g)
    (ex,) = torch.autograd.grad(stable, x64, g.to(F64))
    bound, _ = oracle.gradient_bounds(name, r, g, x, keepdim=keepdim)
    _check(dx, ex, bound, f"{name} d/dx")


def _check_attention(sample, i: int) -> None:
    q, k, v = sample.input, sample.args[0], sample.args[1]
    mask = sample.kwargs.get("attn_mask")
    is_causal = sample.kwargs.get("is_causal", False)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    leaves64 = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v)]
    out = _call(SDPA, sample, *leaves)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *leaves64, attn_mask=None if mask is None else mask.to(F64), is_causal=is_causal)
    g = _grad_out(out, i)
    r = oracle.attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    out_b, _, dq_b, dk_b, dv_b = oracle.attention_bounds(r, q, g)
    hkv = k.shape[1]
    bounds = [out_b, dq_b, oracle.reduce_kv_bound(dk_b, hkv), oracle.reduce_kv_bound(dv_b, hkv)]
    if q.dtype == F64:
        # fp64 is computed in fp64 (contract section 2): the bounds' fp32 internals in fp64 units, plus the
        # one rounding of the result (added below).
        bounds = [b * (oracle.eps(F64) / oracle.eps(torch.float32)) for b in bounds]
        bounds[0] = oracle.add_rounding(bounds[0], expected, F64)
    _check(out, expected, bounds[0], "attention output")
    grads = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(expected, leaves64, g.to(F64))
    for what, got, e, b, t in zip(("dq", "dk", "dv"), grads, want, bounds[1:], (q, k, v), strict=True):
        _check(got, e, oracle.add_rounding(b, e, t.dtype), f"attention {what}")


@pytest.mark.parametrize(("name", "variant", "dtype", "i", "sample"),
                         [pytest.param(*s, id=_id(*s[:4])) for s in SAMPLES])
def test_opinfo_sample(backend, name, variant, dtype, i, sample):
    reason = unsupported(name, sample)
    if reason is not None:
        argument, why = reason
        tensors = sample.args[:2] if name == SDPA else ()
        with pytest.raises((TypeError, ValueError)) as err:
            _call(name, sample, sample.input, *tensors)
        assert argument in str(err.value), f"the error does not name {argument!r}: {err.value}"
        print(f"unsupported ({why}): {err.type.__name__}: {err.value}")
    elif name == SDPA:
        _check_attention(sample, i)
    else:
        _check_rows(name, sample, i)


def test_every_op_and_dtype_has_supported_samples():
    """The mapping is not vacuous: every op and dtype keeps samples that are computed and compared."""
    covered = {(name, dtype) for name, _, dtype, _, sample in SAMPLES if unsupported(name, sample) is None}
    assert covered == {(name, dtype) for name in OPS for dtype in DTYPES}
