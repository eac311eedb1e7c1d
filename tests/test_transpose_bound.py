"""CPU check (Triton's interpreter) of bench/_transpose_bound.py, the no-arithmetic bound that
bench/cast_transpose.py times next to the fp8 cast + transpose: its kernel must write the op's bytes in the
op's layouts (y row-major, y_t column-major), or the bound it reports would not be a bound of this pattern.
The expected bytes are computed here with numpy (high byte of each 16-bit pattern), not by the module."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import bench_module

import safeops  # noqa: F401  (conftest imported it first: the interpreter is on on a CPU machine)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs Triton's interpreter")


@pytest.mark.parametrize("tile", [(64, 64, 4, 0), (64, 64, 4, 1), (128, 64, 4, 0)])
def test_pattern_kernel_writes_high_bytes_in_both_layouts(tile):
    TB = bench_module("_transpose_bound")
    g = torch.Generator().manual_seed(0)
    m, k = 256, 128
    x = (torch.randn(m, k, generator=g) * 300).to(torch.bfloat16)
    y = torch.zeros(m, k, dtype=torch.uint8)
    y_t = torch.zeros(k, m, dtype=torch.uint8)
    TB.launch(x, y, y_t, tile)
    hi = (x.view(torch.int16).numpy().view(np.uint16) >> 8).astype(np.uint8)
    assert np.array_equal(y.numpy(), hi)
    assert np.array_equal(y_t.numpy(), hi.T)
    assert TB.check(x, tile) is None


def test_check_reports_a_wrong_layout_and_tiles_divide_the_shape():
    TB = bench_module("_transpose_bound")
    x = (torch.randn(128, 64) * 300).to(torch.bfloat16)
    orig = TB.launch
    try:  # a launch that writes y_t with y's layout must be caught
        TB.launch = lambda x, y, y_t, tile: (orig(x, y, y_t, tile), y_t.copy_(y.view(y_t.shape)))
        assert "y_t" in TB.check(x, (64, 64, 4, 0))
    finally:
        TB.launch = orig
    assert TB.tiles_for(1000, 128) == []  # no tile divides 1000 rows: refused, not masked
    assert {t[:3] for t in TB.tiles_for(4096, 4096)} == set(TB.PATTERN_TILES)
