"""The persistent, pipelined softmax backward (``ROWS_BWD_PERSIST``) and the row decodings (``ROW_DIMS``).

On the GPU the persistent grid only serves rows of 16K columns; here the width threshold is lowered so the
interpreter runs it at a small size with more tiles than programs (the CPU grid has 2 programs). Every row
must be computed exactly once, as the one-tile-per-program grid computes it: the same bits, within the
float64 oracle's bounds, masks, a tensor scale's gradient and a ragged last tile included. The GPU side (the
real 16K grid, bit equality with the pipelined loads) is in tests/test_softmax_gpu.py.
"""

from __future__ import annotations

import oracle
import pytest
import torch
from hypothesis import given
from strategies import seeds

import safeops
from safeops.ops import softmax_launch as SL
from safeops.ops._rows import rows_of

OPS = ("softmax", "log_softmax", "logsumexp")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _backward(op, x, g, mask, scale):
    xs = x.detach().clone().requires_grad_(True)
    sc = scale.detach().clone().requires_grad_(True)
    out = getattr(safeops, op)(xs, -1, scale=sc, mask=mask)
    dx, dscale = torch.autograd.grad(out, (xs, sc), g)
    return dx, dscale


@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_persistent_backward_matches_one_tile_per_program(op, seed, triton_backend, monkeypatch):
    rows, n = 37, 48  # fp32: ROWS_BWD gives 16-row tiles, so 3 tiles (the last ragged) over 2 programs
    x = seed.randn(rows, n, std=3.0)
    g = seed.randn(rows) if op == "logsumexp" else seed.randn(rows, n)
    mask = seed.mask(rows, n)
    mask[5] = False  # a fully masked row
    scale = torch.tensor(seed.uniform(0.3, 1.5))

    cfg = SL.rows_config(n, 4, backward=True)
    assert cfg.stages == 0, "fp32 rows are not persistent by default"
    ref = _backward(op, x, g, mask, scale)

    with monkeypatch.context() as m:  # undone after each example
        m.setattr(SL, "ROWS_BWD_PERSIST", {**SL.ROWS_BWD_PERSIST, 4: (64,)})
        cfg = SL.rows_config(n, 4, backward=True)
        assert cfg.stages >= 2 and cfg.grid(rows, x.device)[0] < triton_cdiv(rows, cfg.block_m)
        got = _backward(op, x, g, mask, scale)

    what = f"{op}: persistent vs one tile per program; {seed}"
    assert torch.equal(bits(got[0]), bits(ref[0])), f"{what}: dx bits differ"
    assert torch.equal(bits(got[1]), bits(ref[1])), f"{what}: dscale bits differ"
    expected_dx, expected_ds = oracle.gradients(op, x, g, scale=scale, mask=mask)
    r = oracle.evaluate(op, x, scale=scale, mask=mask)
    dx_bound, ds_bound = oracle.gradient_bounds(op, r, g, x, scale=scale)
    oracle.assert_close(got[0], expected_dx, dx_bound, f"{op} dx", seed)
    oracle.assert_close(got[1], expected_ds, ds_bound, f"{op} dscale", seed)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_persistent_only_for_16k_half_rows(monkeypatch):
    cfg = SL.rows_config(16384, 2, backward=True)
    assert cfg.stages >= 2 and cfg.programs_per_sm >= 1
    assert SL.rows_config(16384, 2).stages == 0  # the forward
    assert SL.rows_config(4096, 2, backward=True).stages == 0
    assert SL.rows_config(16384, 4, backward=True).stages == 0
    # Wider rows (if the row-resident limit is ever raised) would not fit the pipeline's shared memory.
    monkeypatch.setattr(SL, "ROW_RESIDENT_MAX_COLS", {**SL.ROW_RESIDENT_MAX_COLS, 2: 65536})
    assert SL.rows_config(65536, 2, backward=True).stages == 0


@pytest.mark.parametrize("dims", (2, 3))
@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_row_decodings_match_contiguous_rows(op, dims, seed, triton_backend):
    """Rows that need one or two divisions to find (batch dims that do not merge) give the bits of the
    same rows laid out one stride apart, which need none (``ROW_DIMS`` 1)."""
    rows, n = 12, 40
    x = seed.randn(rows, n, std=3.0)
    g = seed.randn(rows) if op == "logsumexp" else seed.randn(rows, n)
    if dims == 2:
        buf = torch.full((3, rows // 3 + 2, n), float("nan"))
        view = buf[:, : rows // 3]
    else:
        buf = torch.full((2, 3, rows // 4 + 1, n), float("nan"))
        view = buf[:, :2, : rows // 4]
    view.copy_(x.view(view.shape))
    rows_view = rows_of(view.shape, view.dim() - 1, {"x": view})
    assert SL._row_dims(rows_view) == dims

    def run(t, gt):
        t = t.detach().clone() if t.is_contiguous() else t.detach()
        t.requires_grad_(True)
        out = getattr(safeops, op)(t, -1, scale=0.7)
        return out.detach(), torch.autograd.grad(out, t, gt)[0]

    flat_out, flat_dx = run(x, g)
    out, dx = run(view, g.view(view.shape[:-1]) if op == "logsumexp" else g.view(view.shape))
    assert torch.equal(bits(out.reshape(flat_out.shape)), bits(flat_out)), f"{op} forward; {seed}"
    assert torch.equal(bits(dx.reshape(rows, n)), bits(flat_dx)), f"{op} backward; {seed}"
    r = oracle.evaluate(op, x, scale=0.7)
    oracle.assert_close(flat_out, r.out, oracle.output_bound(op, r, torch.float32), f"{op} forward", seed)
    expected_dx, _ = oracle.gradients(op, x, g, scale=0.7)
    dx_bound, _ = oracle.gradient_bounds(op, r, g, x, scale=0.7)
    oracle.assert_close(flat_dx, expected_dx, dx_bound, f"{op} backward", seed)
