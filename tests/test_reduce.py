"""safeops.kernels.reduce.row_sum_tree: the fixed order of additions (the columns folded in halves),
checked bit for bit against the same tree evaluated with numpy float32 adds (an independent emulation of the
documented order), on the interpreter here and on the GPU, where the input's memory layout (contiguous rows,
or a transposed view whose rows Triton lays out along the other dimension) must not change a bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from conftest import INTERPRETER
from hypothesis import given
from strategies import seeds

from safeops.kernels.reduce import row_sum_tree

DEVICES = [
    pytest.param("cpu", id="interpreter", marks=pytest.mark.skipif(
        not INTERPRETER, reason="needs Triton's interpreter (TRITON_INTERPRET=1; CPU machines)")),
    pytest.param("cuda", id="gpu", marks=pytest.mark.gpu),
]


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, s_r, s_c, R: tl.constexpr, N: tl.constexpr):
    rows = tl.arange(0, R)
    cols = tl.arange(0, N)
    x = tl.load(x_ptr + rows[:, None] * s_r + cols[None, :] * s_c)
    tl.store(out_ptr + rows, row_sum_tree(x, R, N))


def _halvings(x: np.ndarray) -> np.ndarray:
    """Column j plus column j + n/2 for j < n/2, then the same on those sums, in float32."""
    x = x.astype(np.float32)
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        x = (x[:, :half] + x[:, half:]).astype(np.float32)
    return x[:, 0]


def _values(r: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Magnitudes over many binades, so that a different order of additions rounds differently.
    return torch.randn(r, n, generator=g) * torch.exp2(torch.randint(-20, 20, (r, n), generator=g).float())


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("n", [1, 2, 16, 64, 256, 4096])
@pytest.mark.parametrize("layout", ["rows", "transposed"])
@given(seed=seeds())
def test_row_sum_tree_order(dev, n, layout, seed):
    r = 32
    x = _values(r, n, seed.value)
    expected = torch.from_numpy(_halvings(x.numpy()))
    # "transposed": an (r, n) view with row stride 1, which Triton lays out along the rows.
    src = x.to(dev) if layout == "rows" else x.t().contiguous().to(dev).t()
    out = torch.empty(r, device=dev)
    _row_sum_kernel[(1,)](src, out, src.stride(0), src.stride(1), R=r, N=n)
    assert torch.equal(out.cpu(), expected), seed
    if n >= 16:  # the order matters for these values: the naive left-to-right sum differs somewhere
        naive = x.numpy().astype(np.float32)
        acc = naive[:, 0].copy()
        for j in range(1, n):
            acc = (acc + naive[:, j]).astype(np.float32)
        assert not np.array_equal(acc, expected.numpy()), seed
