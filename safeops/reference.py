"""The numerics contract in plain torch.

This is the CPU implementation of every safeops op and the readable statement of ``CONTRACT.md``:
each logit becomes one value ``z`` (one multiply by the scale, then the mask), the row max ``m`` and the
row sum ``l = sum(exp(z - m))`` are kept apart, empty rows are defined, and gradients are recomputed from
the input, ``m`` and ``l``. The Triton kernels implement the same formulas; tests compare both with an
independent float64 oracle.
"""

from __future__ import annotations

import torch

SOFTMAX, LOG_SOFTMAX, LOGSUMEXP = 0, 1, 2
NEG_INF = float("-inf")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; every other floating dtype is computed in fp32 (contract section 2)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def logits(
    x: torch.Tensor,
    scale: float | None,
    scale_tensor: torch.Tensor | None,
    mask: torch.Tensor | None,
    acc: torch.dtype,
) -> torch.Tensor:
    """The one materialized value per logit: ``z = acc(x) * acc(scale)``, excluded entries -inf."""
    z = x.to(acc)
    if scale_tensor is not None:
        z = z * scale_tensor.to(acc)
    elif scale is not None:
        z = z * torch.tensor(scale, dtype=acc)
    if mask is not None:
        z = z.masked_fill(~mask, NEG_INF)
    return z


def _safe_max(m: torch.Tensor) -> torch.Tensor:
    # An empty row has m = -inf; subtracting it would give -inf - -inf = NaN.
    return torch.where(m == NEG_INF, torch.zeros_like(m), m)


def row_stats(z: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max and row sum of exp(z - max), kept apart (contract section 3), keepdim=True."""
    if z.shape[dim] == 0:
        # A row with no entries is an empty row (contract section 4); amax would refuse it.
        shape = z.shape[:dim] + (1,) + z.shape[dim + 1:]
        return z.new_full(shape, NEG_INF), z.new_zeros(shape)
    m = torch.amax(z, dim, keepdim=True)
    l = torch.exp(z - _safe_max(m)).sum(dim, keepdim=True)
    return m, l


def probabilities(z: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    p = torch.exp(z - _safe_max(m)) / l
    return torch.where(l == 0, torch.zeros_like(p), p)


def forward(
    kind: int,
    x: torch.Tensor,
    dim: int,
    scale: float | None = None,
    scale_tensor: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(out, row_max, row_sum)``; the stats have ``dim`` removed and are in the compute dtype."""
    acc = compute_dtype(out_dtype if out_dtype == torch.float64 else x.dtype)
    out_dtype = out_dtype or x.dtype
    z = logits(x, scale, scale_tensor, mask, acc)
    m, l = row_stats(z, dim)
    if kind == SOFTMAX:
        out = probabilities(z, m, l)
    elif kind == LOG_SOFTMAX:
        out = (z - _safe_max(m)) - torch.log(l)
        out = torch.where(l == 0, torch.full_like(out, NEG_INF), out)
    elif kind == LOGSUMEXP:
        out = (m + torch.log(l)).squeeze(dim)
    else:
        raise ValueError(f"unknown kind {kind}")
    return out.to(out_dtype), m.squeeze(dim), l.squeeze(dim)


def backward(
    kind: int,
    grad: torch.Tensor,
    x: torch.Tensor,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    dim: int,
    scale: float | None = None,
    scale_tensor: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    need_dscale: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradient w.r.t. ``x`` (and the tensor scale) from the saved input and fp32 row stats.

    ``grad`` has the shape of the forward output (for logsumexp: ``dim`` removed).
    """
    acc = row_max.dtype
    z = logits(x, scale, scale_tensor, mask, acc)
    m, l = row_max.unsqueeze(dim), row_sum.unsqueeze(dim)
    p = probabilities(z, m, l)
    keep = z != NEG_INF
    zero = torch.zeros((), dtype=acc, device=x.device)
    if kind == LOGSUMEXP:
        dz = grad.to(acc).unsqueeze(dim) * p
    else:
        dy = grad.to(acc)
        if kind == SOFTMAX:
            s = torch.where(keep, dy * p, zero).sum(dim, keepdim=True)
            dz = p * (dy - s)
        else:
            s = torch.where(keep, dy, zero).sum(dim, keepdim=True)
            dz = dy - p * s
    # Excluded entries do not influence any output: their gradient is exactly 0, whatever dy holds.
    dz = torch.where(keep, dz, zero)
    dscale = None
    if scale_tensor is not None:
        dx = dz * scale_tensor.to(acc)
        if need_dscale:
            dscale = torch.where(keep, dz * x.to(acc), zero).sum()
    elif scale is not None:
        dx = dz * torch.tensor(scale, dtype=acc)
    else:
        dx = dz
    return dx.to(x.dtype), dscale
