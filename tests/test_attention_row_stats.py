"""``attention_launch.row_stats`` (kernel ``attn_bwd_row_stats_kernel``): per row of the saved statistics,
base = (m == -inf ? 0 : m) and rinv = (l == 0 ? 0 : 1 / l), which the Gluon dK / dV kernel's ``row_stats``
configuration reads instead of deriving them at every step. Checked against an independent float64 reciprocal
(exact under the interpreter, which divides in IEEE arithmetic; within 2 ulp on the GPU, whose ``1 / x`` is
``div.full.f32``, the operation the kernel it stands in for uses: that the two give the same bits is the GPU
test ``test_row_stats_same_bits``), with empty rows (m = -inf, l = 0), NaN, inf, a count that is not a
multiple of the block, and several blocks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from strategies import seeds

from safeops.ops import attention_launch as L

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 37), (1, 5, 70)])
@given(seed=seeds())
def test_row_stats(device, shape, seed):
    gen = seed.gen
    m = torch.randn(shape, generator=gen) * 1e3
    spread = torch.exp2(torch.randint(0, 40, shape, generator=gen).float())
    l = 1.0 + torch.rand(shape, generator=gen) * spread
    special_m = torch.tensor([float("-inf"), float("nan"), float("inf"), -0.0, 0.0, 3e38])
    # (l >= 1 in every row that sees a key: its largest score adds exp2(0) = 1; 1e30 keeps 1 / l normal)
    special_l = torch.tensor([0.0, float("nan"), float("inf"), 1.0, 1e30, 1.5])
    k = min(m.numel(), special_m.numel())
    m.view(-1)[:k], l.view(-1)[:k] = special_m[:k], special_l[:k]
    base, rinv = L.row_stats(m.to(device), l.to(device))
    base, rinv = base.cpu(), rinv.cpu()
    assert base.dtype == rinv.dtype == torch.float32 and base.shape == rinv.shape == m.shape
    want_base = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    assert torch.equal(base.isnan(), want_base.isnan())
    assert torch.equal(base[~base.isnan()], want_base[~want_base.isnan()])
    exact = torch.where(l == 0, torch.zeros_like(l, dtype=torch.float64), 1.0 / l.double()).float()
    assert torch.equal(rinv.isnan(), exact.isnan())
    assert torch.equal(rinv[l == 0], torch.zeros_like(rinv[l == 0]))
    ok = ~exact.isnan()
    if device == "cpu":  # IEEE division: the correctly rounded reciprocal
        assert torch.equal(rinv[ok], exact[ok]), seed
    else:  # div.full.f32: at most 2 ulp from it
        ulp = (exact[ok].abs().view(torch.int32) - rinv[ok].abs().view(torch.int32)).abs()
        assert int(ulp.max()) <= 2, seed


def test_row_stats_empty():
    base, rinv = L.row_stats(torch.empty(0, 2, 5), torch.empty(0, 2, 5))
    assert base.shape == rinv.shape == (0, 2, 5)
