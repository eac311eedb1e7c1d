"""A row sum whose order of additions is fixed by the program, not by the compiler's layout.

``tl.sum(x, axis=1)`` adds each thread's elements in turn and then combines threads with shuffles; which
elements a thread holds is the blocked layout Triton's coalescing pass picks from the memory layout of the
loads feeding ``x`` (which dimension is contiguous, and the vector width the pointer alignment allows). So
the same values read from a transposed view, or from a differently aligned one, can be added in a
different order and round differently (measured on the H200: merge_attention's lse gradient for a stack
with head-dim stride > 1 against its contiguous copy, 15-18% of rows off by an ulp). Contract section 6
asks for the same bits whatever the layout.

:func:`row_sum_tree` folds the columns in halves, ``x[:, j] + x[:, j + N/2]`` for ``j < N/2``, then folds
those sums the same way, down to one column: every addition is an elementwise fp32 add of two tensors
(spelled with a reshape, a permute and a split), and elementwise arithmetic means the same thing in every
layout (and under the interpreter). Halves rather than neighbouring columns: Triton 3.6 compiles this form
in about a second at 4096 columns, the neighbour form in minutes (CHANGELOG).
"""

import triton
import triton.language as tl


@triton.jit
def _halve(x, R: tl.constexpr, N: tl.constexpr):
    """(R, N) -> (R, N // 2): column j is x[:, j] + x[:, j + N // 2]."""
    a, b = tl.split(tl.permute(tl.reshape(x, (R, 2, N // 2)), (0, 2, 1)))
    return a + b


@triton.jit
def row_sum_tree(x, R: tl.constexpr, N: tl.constexpr):
    """Sum over axis 1 of an (R, N) tensor, N a power of two up to 2**16, as a fixed tree of halvings."""
    tl.static_assert(N <= 65536, "row_sum_tree: at most 2**16 columns")
    for level in tl.static_range(16):  # unrolled at compile time: each level halves the columns
        if (N >> level) >= 2:
            x = _halve(x, R, N >> level)
    return tl.reshape(x, (R,))
