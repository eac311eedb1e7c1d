"""A row sum whose order of additions is fixed by the program, not by the compiler's layout.

``tl.sum(x, axis=1)`` adds each thread's elements in turn and then combines threads with shuffles; which
elements a thread holds is the blocked layout Triton's coalescing pass picks from the memory layout of the
loads feeding ``x`` (which dimension is contiguous, and the vector width the pointer alignment allows). So
the same values read from a transposed view, or from a differently aligned one, can be added in a
different order and round differently (measured on the H200: merge_attention's lse gradient for a stack
with head-dim stride > 1 against its contiguous copy, 15-18% of rows off by an ulp). Contract section 6
asks for the same bits whatever the layout.

:func:`row_sum_tree` folds the columns in halves, ``x[:, j] + x[:, j + N/2]`` for ``j < N/2``, then folds
those sums the same way, down to one column. Each fold is spelled as a reshape to ``(R, 2, N/2)`` and a
``tl.sum`` over the axis of size 2: a sum of two values is a single addition, and fp addition is
commutative, so whichever thread holds which of the pair, and the interpreter too, give the same bits.
That spelling lets Triton keep the tensor spread over all threads: the earlier one (a permute and a split
per fold) compiled, with the launch's strides unspecialized, to one thread adding thousands of columns
serially (the cross-entropy forward at 4096 lanes, offline for sm_90 with Triton 3.6: 3,064 instructions,
2,091 of them FADD, at 8 warps; 5,632 and 4,138 at 16 warps, after 164 s of compiling; this form: 720 and
105 at 8 warps, 656 and 82 at 16, in under 2 s).
"""

import triton
import triton.language as tl


@triton.jit
def _halve(x, R: tl.constexpr, N: tl.constexpr):
    """(R, N) -> (R, N // 2): column j is x[:, j] + x[:, j + N // 2] (one addition each: no order to pick)."""
    return tl.sum(tl.reshape(x, (R, 2, N // 2)), 1)


@triton.jit
def row_sum_tree(x, R: tl.constexpr, N: tl.constexpr):
    """Sum over axis 1 of an (R, N) tensor, N a power of two up to 2**16, as a fixed tree of halvings."""
    tl.static_assert(N <= 65536, "row_sum_tree: at most 2**16 columns")
    for level in tl.static_range(16):  # unrolled at compile time: each level halves the columns
        if (N >> level) >= 2:
            x = _halve(x, R, N >> level)
    return tl.reshape(x, (R,))
