"""The seed cases (shared/SEED_CASES.md) on the CPU: what they break, and that safeops does not break.

Case 1 / 1b: ``exp(x*scale - x*scale)`` must be 1; a softmax over a row of the seed value is exactly 1/N.
Case 1c: the gradient of ``sum(softmax(x @ x / y))`` with respect to ``y`` is 0 in exact arithmetic.
"""

from __future__ import annotations

import math

import oracle as O
import pytest
import torch

import safeops
from safeops import _seed


def safeops_softmax(x, dim):
    return safeops.softmax(x, dim)


def case_1c_grad(softmax_fn, compile_it: bool = False, dtype=torch.bfloat16) -> torch.Tensor:
    x, y = _seed.userland_inputs(dtype)
    fn = lambda x, y: _seed.userland_loss(softmax_fn, x, y)  # noqa: E731
    if compile_it:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="inductor", fullgraph=True)
    fn(x, y).backward()
    return y.grad.detach()


def case_1c_float64_reference() -> tuple[torch.Tensor, torch.Tensor]:
    """(d loss / dy in float64 on the same bf16 inputs, the fp32 error bound of a safe softmax backward).

    A backward that recomputes fp32 probabilities gets dL/dlogit_i = p_i * (1 - sum_j p_j) with
    |1 - sum_j p_j| within k fp32 roundings (k from the oracle's tolerance table), so
    |dL/dy| <= k * eps32 * sum_i p_i |logit_i / y| (times 2 for the bf16 roundings of that product).
    """
    x, y = _seed.userland_inputs(torch.bfloat16)
    x64, y64 = x.double(), y.detach().double().requires_grad_(True)
    logits = torch.matmul(x64, x64) / y64
    p = torch.softmax(logits, -1)
    p.sum().backward()
    mm = torch.matmul(x, x).double()  # the bf16 product the safeops run sees, exactly
    p_bf16 = torch.softmax((mm / y.detach().double()), -1)
    n = x.shape[-1]
    k = math.ceil(math.log2(n)) + O.TOLERANCE[torch.float32].reduction_terms
    natural = (p_bf16 * (mm / y.detach().double() ** 2).abs()).sum(dim=(0, 2, 3), keepdim=True).squeeze(0)
    bound = 2 * O.TOLERANCE[torch.float32].internal_ulps * k * O.eps(torch.float32) * natural
    return y64.grad.detach(), bound


def test_case_1c_float64_gradient_is_zero():
    # The premise of the case: the true gradient is 0 (float64 gives about 1e-15).
    grad64, _ = case_1c_float64_reference()
    assert grad64.abs().max() < 1e-12, grad64.flatten().tolist()


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_case_1c_with_safeops_softmax(backend, mode):
    grad = case_1c_grad(safeops_softmax, compile_it=mode == "compiled")
    grad64, bound = case_1c_float64_reference()
    userland = case_1c_grad(_seed.userland_softmax)
    torch_bf16 = case_1c_grad(lambda a, d: torch.softmax(a, d))
    ctx = (f"{backend} {mode}: safeops y.grad {grad.flatten().tolist()}, "
           f"float64 {grad64.flatten().tolist()}, allowed +-{bound.flatten().tolist()}; "
           f"eager user-land bf16 {userland.flatten().tolist()}, "
           f"eager torch.softmax bf16 {torch_bf16.flatten().tolist()}")
    assert torch.isfinite(grad).all(), ctx
    assert ((grad.double() - grad64).abs() <= bound).all(), ctx
    torch._dynamo.reset()


def test_case_1c_userland_softmax_compiled_is_not_finite():
    """Documents the bug safeops fixes: Inductor on the CPU turns the user-land bf16 backward into NaN."""
    grad = case_1c_grad(_seed.userland_softmax, compile_it=True)
    torch._dynamo.reset()
    if torch.isfinite(grad).all():
        pytest.xfail(f"seed case 1c did not reproduce on torch {torch.__version__}: compiled user-land "
                     f"y.grad = {grad.flatten().tolist()} is finite "
                     "(SEED_CASES.md reports NaN on CPU Inductor)")
    assert not torch.isfinite(grad).all()


def test_case_1b_bf16_expression_compiled_is_not_finite():
    """Documents case 1b: compiled, the bf16-rounded max minus the fp32 product gives inf on CPU Inductor."""
    x, scale = _seed.fma_inputs(torch.bfloat16)
    eager = _seed.fma_expression_bf16(x, scale)
    assert eager.item() == 1.0, eager
    torch._dynamo.reset()
    compiled = torch.compile(_seed.fma_expression_bf16, backend="inductor", fullgraph=True)(x, scale)
    torch._dynamo.reset()
    if torch.isfinite(compiled).all():
        pytest.xfail(f"seed case 1b did not reproduce on torch {torch.__version__}: compiled gives "
                     f"{compiled.item()!r} (SEED_CASES.md reports inf on CPU Inductor)")
    assert not torch.isfinite(compiled).all()


@pytest.mark.parametrize("n", [1, 4, 64], ids=["n1", "n4", "n64"])
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_case_1_seed_row_is_exactly_one_over_n(backend, dtype, scale_kind, n):
    x, scale = _seed.fma_inputs(dtype)  # case 1 (fp32) and case 1b (bf16) inputs
    if scale_kind == "float":
        scale = _seed.FMA_SCALE
    row = x.expand(n)
    ctx = f"{backend}: softmax of {n} x {x.item()!r} with scale {scale!r}"
    y = safeops.softmax(row, scale=scale)
    assert (y == 1.0 / n).all(), f"{ctx} gives {y.tolist()}"
    assert y.dtype == dtype
    lp = safeops.log_softmax(x, scale=scale)  # the 0-d case: exp(z - z) == 1, log_softmax == 0 exactly
    assert lp.item() == 0.0, f"{ctx}: log_softmax of the single logit is {lp.item()!r}"
    assert safeops.softmax(x, scale=scale).item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_case_1_seed_row_compiled(reference_backend, dtype):
    x, scale = _seed.fma_inputs(dtype)
    torch._dynamo.reset()
    fn = torch.compile(lambda x, s: safeops.softmax(x.expand(8), scale=s), backend="inductor", fullgraph=True)
    y = fn(x, scale)
    torch._dynamo.reset()
    assert (y == 1.0 / 8).all(), f"compiled safeops.softmax of the seed row: {y.tolist()}"
