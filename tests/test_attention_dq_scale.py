"""The fused Gluon backward's last pass (``attention_launch.dq_scale``, kernel
``attn_bwd_dq_scale_kernel``): dq = scale * (the fp32 buffer), one fp32 multiply rounded once to dq's dtype,
in dq's layout. Checked bit for bit against torch's ``dq.copy_(acc.mul_(scale))`` (the pass it replaces: one
IEEE fp32 multiply, one round to nearest even) and against a float64 product rounded once, for bf16 / fp16 /
fp32 results, contiguous and (B, S, H, D)-transposed dq, a row count that is not a multiple of the block, a
scale that is not a power of 2, products that overflow the result dtype, subnormal results, signed zeros, inf
and NaN; under the interpreter (the kernel rounds through ``safeops.kernels.convert.cast``, exact there) and
on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from strategies import seeds

from safeops.ops import attention_launch as L

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def _case(b, h, s, d, seed, device):
    gen = seed.gen
    spread = torch.exp2(torch.randint(-30, 31, (b, h, s, d), generator=gen).float())
    acc = torch.randn(b, h, s, d, generator=gen) * spread
    flat = acc.view(-1)
    n = flat.numel()
    inf, nan = float("inf"), float("nan")
    special = torch.tensor([0.0, -0.0, inf, -inf, nan, 3e38, -3e38, 1e-40, 7e4, -7e4])
    flat[: min(n, special.numel())] = special[: min(n, special.numel())]
    return acc.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@given(seed=seeds())
def test_dq_scale_bits(device, dtype, layout, seed):
    b, h, s, d = 2, 3, 37, 64
    scale = 0.08838834764831845  # 1 / sqrt(128): not a power of 2, so the product rounds
    acc = _case(b, h, s, d, seed, device)
    if layout == "bhsd":
        dq = torch.empty(b, h, s, d, dtype=dtype, device=device)
    else:
        dq = torch.empty(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)
    L.dq_scale(acc.clone(), dq, scale)
    expected = torch.empty_like(dq).copy_(acc.clone().mul_(scale))
    got, exp = dq.cpu(), expected.cpu()
    same = (got == exp) | (got.isnan() & exp.isnan())
    where = (~same).nonzero()[:5].tolist()
    assert same.all(), f"dq differs from dq.copy_(acc.mul_(scale)) at {where}; {seed}"
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits)[~got.isnan()], exp.view(bits)[~exp.isnan()]), "signed zeros differ"
    # Independently: the float64 product rounded to fp32 (exact: a product of two fp32 values fits in
    # float64), then to dtype.
    ref = (acc.cpu().double() * torch.tensor(scale, dtype=torch.float32).double()).float().to(dtype)
    same = (got == ref) | (got.isnan() & ref.isnan())
    assert same.all(), f"dq differs from the float64 reference; {seed}"
