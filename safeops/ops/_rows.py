"""View tensors reduced along any dim as rows that a strided kernel can address in place.

The reduced dimension keeps its own stride; the other dimensions are coalesced (jointly for every tensor
that takes part) into at most ``MAX_BATCH_DIMS`` batch dimensions. Only when more remain, which takes an
unusual interleaving of slices and permutes, are the inputs copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_BATCH_DIMS = 3


@dataclass(frozen=True)
class Rows:
    n_rows: int
    n_cols: int
    sizes: tuple[int, int, int]  # batch sizes, outermost first; rows are enumerated row-major over them
    strides: dict[str, tuple[int, int, int, int]]  # per tensor: three batch strides, then the column stride

    def args(self, name: str) -> tuple[int, int, int, int]:
        return self.strides[name]


def rows_of(shape: torch.Size, dim: int, tensors: dict[str, torch.Tensor | None]) -> Rows | None:
    """Row view of tensors of shape ``shape`` reduced over ``dim``; None if it needs > 3 batch dims.

    ``None`` entries in ``tensors`` get zero strides (their kernel argument is unused).
    """
    present = {k: t for k, t in tensors.items() if t is not None}
    for name, t in present.items():
        if tuple(t.shape) != tuple(shape):
            raise AssertionError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    batch = [d for d in range(len(shape)) if d != dim and shape[d] != 1]
    # Coalesce from the innermost dimension outwards: d_outer merges into d_inner when, for every tensor,
    # stepping d_outer equals stepping d_inner its full size.
    groups: list[tuple[int, dict[str, int]]] = []  # (size, stride per tensor), innermost first
    for d in reversed(batch):
        size = shape[d]
        st = {k: t.stride(d) for k, t in present.items()}
        if groups:
            g_size, g_st = groups[-1]
            if all(st[k] == g_st[k] * g_size for k in present):
                groups[-1] = (g_size * size, g_st)
                continue
        groups.append((size, st))
    if len(groups) > MAX_BATCH_DIMS:
        return None
    while len(groups) < MAX_BATCH_DIMS:
        groups.append((1, {k: 0 for k in present}))
    groups.reverse()  # outermost first
    n_rows = 1
    for size, _ in groups:
        n_rows *= size
    n_cols = shape[dim] if len(shape) else 1
    strides = {}
    for name in tensors:
        if name in present:
            t = present[name]
            col = t.stride(dim) if t.dim() else 1
            strides[name] = (groups[0][1][name], groups[1][1][name], groups[2][1][name], col)
        else:
            strides[name] = (0, 0, 0, 0)
    sizes = (groups[0][0], groups[1][0], groups[2][0])
    return Rows(n_rows=n_rows, n_cols=n_cols, sizes=sizes, strides=strides)
