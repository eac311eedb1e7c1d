"""softmax, log_softmax and logsumexp against the float64 oracle, on both CPU backends.

Every test checks a clause of CONTRACT.md (cited as "section N") on inputs Hypothesis draws: a seed for the
values and, in ``test_drawn_calls_match_oracle``, the shape, dim, layout, dtypes, mask and scale too
(tests/strategies.py; the profiles are in tests/conftest.py). ``backend`` runs each test on the pure-torch
reference and on the real Triton kernels under Triton's interpreter.
"""

from __future__ import annotations

import math

import oracle as O
import pytest
import strategies as S
import torch
from hypothesis import given
from strategies import seeds

import safeops
from safeops import _seed
from safeops.ops import softmax_launch

FN = {"softmax": safeops.softmax, "log_softmax": safeops.log_softmax, "logsumexp": safeops.logsumexp}
OPS = [pytest.param(op, id=op) for op in O.OPS]
ROW_OPS = [pytest.param(op, id=op) for op in ("softmax", "log_softmax")]
FP32 = pytest.param(torch.float32, id="fp32")
FP16 = pytest.param(torch.float16, id="fp16")
BF16 = pytest.param(torch.bfloat16, id="bf16")
DTYPES = [FP32, FP16, BF16]


def call(op: str, x, dim=-1, *, scale=None, mask=None, dtype=None, keepdim=False):
    if op == "logsumexp":
        return safeops.logsumexp(x, dim, scale=scale, mask=mask, keepdim=keepdim)
    return FN[op](x, dim, scale=scale, mask=mask, dtype=dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so that equality is bitwise (and NaN == NaN)."""
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}
    return t.detach().contiguous().view(ints[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str, context: object) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    diff = bits(a) != bits(b)
    if diff.any():
        first = tuple(diff.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(diff.sum())} of {a.numel()} elements differ in their bits, first "
                             f"at {list(first)}: {a[first].item()!r} vs {b[first].item()!r}; {context}")


def run(op: str, x: torch.Tensor, dim=-1, *, seed, scale=None, mask=None, dtype=None, keepdim=False,
        grad=None):
    """Forward and backward through safeops with an incoming gradient (random unless given).

    Returns (y, grad_out, dx, dscale); dscale only for a tensor scale.
    """
    xg = x.detach().requires_grad_(True)  # detach keeps the strides: the op sees the same layout
    sg = scale.detach().clone().requires_grad_(True) if isinstance(scale, torch.Tensor) else scale
    y = call(op, xg, dim, scale=sg, mask=mask, dtype=dtype, keepdim=keepdim)
    g = grad if grad is not None else seed.randn(*y.shape, dtype=y.dtype)
    inputs = [xg] + ([sg] if isinstance(sg, torch.Tensor) else [])
    grads = torch.autograd.grad(y, inputs, g)
    return y, g, grads[0], grads[1] if len(grads) > 1 else None


def check(op: str, x: torch.Tensor, dim=-1, *, seed, scale=None, mask=None, dtype=None, keepdim=False,
          context: object = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Output, d/dx and d/dscale against the oracle, within the tolerance table. Returns (y, dx)."""
    ctx = f"{seed}; {context}; x {tuple(x.shape)} {x.dtype} strides {x.stride()} dim={dim}"
    y, g, dx, dscale = run(op, x, dim, seed=seed, scale=scale, mask=mask, dtype=dtype, keepdim=keepdim)
    out_dtype = dtype or x.dtype
    r = O.evaluate(op, x, dim, scale=scale, mask=mask, out_dtype=dtype, keepdim=keepdim)
    assert y.dtype == out_dtype, f"output dtype {y.dtype}, expected {out_dtype}; {ctx}"
    assert y.shape == r.out.shape, f"output shape {tuple(y.shape)}, expected {tuple(r.out.shape)}; {ctx}"
    O.assert_close(y, r.out, O.output_bound(op, r, out_dtype, keepdim), f"{op} output", ctx)
    ex, es = O.gradients(op, x, g, dim, scale=scale, mask=mask, out_dtype=dtype, keepdim=keepdim)
    bx, bs = O.gradient_bounds(op, r, g, x, scale=scale, keepdim=keepdim)
    assert dx.dtype == x.dtype and dx.shape == x.shape, f"d/dx is {dx.dtype} {tuple(dx.shape)}; {ctx}"
    O.assert_close(dx, ex, bx, f"{op} d/dx", ctx)
    if isinstance(scale, torch.Tensor):
        assert dscale.dtype == scale.dtype and dscale.shape == scale.shape, f"d/dscale {dscale}; {ctx}"
        O.assert_close(dscale.reshape(()), es, bs, f"{op} d/dscale", ctx)  # a (1,) scale: a (1,) gradient
    return y, dx


# --------------------------------------------------------------------------------------------------
# Property tests: shapes, dims and layouts (section 8: any dim, any strides, no silent wrong answers)
# --------------------------------------------------------------------------------------------------

LAYOUTS = {
    # name: (make(seed, dtype, std) -> x, dim)
    "one_column": (lambda s, d, std: s.randn(6, 1, dtype=d, std=std), -1),
    "odd_columns": (lambda s, d, std: s.randn(5, 37, dtype=d, std=std), -1),
    "many_rows": (lambda s, d, std: s.randn(64, 5, dtype=d, std=std), 1),
    "zero_rows": (lambda s, d, std: s.randn(0, 9, dtype=d, std=std), -1),
    "dim0": (lambda s, d, std: s.randn(23, 6, dtype=d, std=std), 0),
    "middle_dim": (lambda s, d, std: s.randn(3, 11, 4, dtype=d, std=std), 1),
    "middle_dim_negative": (lambda s, d, std: s.randn(2, 3, 9, 4, dtype=d, std=std), -2),
    "transposed": (lambda s, d, std: s.randn(13, 9, dtype=d, std=std).t(), -1),
    "sliced": (lambda s, d, std: s.randn(8, 40, dtype=d, std=std)[1::2, 3:36:2], -1),
    "sliced_dim0": (lambda s, d, std: s.randn(30, 10, dtype=d, std=std)[::3, 2:], 0),
    "expanded_batch": (lambda s, d, std: s.randn(1, 3, 21, dtype=d, std=std).expand(4, 3, 21), -1),
    "expanded_reduced_dim": (lambda s, d, std: s.randn(3, 1, dtype=d, std=std).expand(3, 16), -1),
    "permuted_5d_copy_path": (lambda s, d, std: s.randn(2, 2, 2, 2, 6, dtype=d, std=std)
                              .permute(3, 1, 4, 0, 2), 2),
    "one_d": (lambda s, d, std: s.randn(17, dtype=d, std=std), 0),
    "zero_d": (lambda s, d, std: s.randn(dtype=d, std=std), 0),
    "zero_d_dim_minus_1": (lambda s, d, std: s.randn(dtype=d, std=std), -1),
}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_layouts_match_oracle(backend, op, dtype, layout, seed):
    make, dim = LAYOUTS[layout]
    x = make(seed, dtype, 4.0)
    check(op, x, dim, seed=seed, context=f"{backend} {layout}")


@pytest.mark.parametrize("op", OPS)
@given(case=S.row_cases())
@S.examples(ci=50)
def test_drawn_calls_match_oracle(backend, op, case):
    """Any shape (0-d, size-0 and size-1 dims), dim, layout (permuted, sliced, broadcast views), x and
    output dtypes, mask (broadcast, strided, fully masked rows), scale (python float or tensor of any
    dtype, negative too) and -inf entries: output and gradients (d/dscale too) within the oracle's bounds."""
    std = 3.0
    x = case.layout.make(case.seed, case.shape, case.dtype, std=std, neg_inf=case.neg_inf)
    mask = case.mask.make(case.seed) if case.mask is not None else None
    check(op, x, case.dim, seed=case.seed, scale=case.scale.make(), mask=mask,
          dtype=None if op == "logsumexp" else case.out_dtype, keepdim=case.keepdim and op == "logsumexp",
          context=f"{backend} {case!r}")


SPLIT_CASES = {
    # Rows too long for one program take the split path (several programs per row; on CPU tensors the
    # two-launch kernels: the one-launch kernel is for CUDA only). Up to 32K columns the forward keeps a
    # row in one program and the backward takes the loop kernel (the 20000 cases: one program walks the
    # row twice, over the row's blocks); beyond, both take the two-launch kernels.
    "fp32_20000": (torch.float32, (2, 20000), -1),
    "fp32_40000": (torch.float32, (2, 40000), -1),
    "fp16_40000": (torch.float16, (2, 40000), -1),
    "fp32_20000_dim0": (torch.float32, (20000, 2), 0),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES), ids=list(SPLIT_CASES))
@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_long_rows_split_path_match_oracle(backend, op, case, seed):
    dtype, shape, dim = SPLIT_CASES[case]
    elem = torch.finfo(dtype).bits // 8
    assert softmax_launch.rows_config(shape[dim], elem, backward=True) is None, "no longer a split case"
    forward_rows = softmax_launch.rows_config(shape[dim], elem) is not None
    assert forward_rows == (shape[dim] <= 32768), "the forward's row-resident limit moved"
    assert softmax_launch.split_config(shape[dim], elem).n_splits > 1, "one program per row"
    x = seed.randn(*shape, dtype=dtype, std=3.0)
    mask = seed.mask(*shape, keep=0.9)
    mask.select(1 - (dim % 2), 1).fill_(False)  # the second row is empty (section 4)
    scale = torch.tensor(seed.uniform(0.5, 2.0))
    check(op, x, dim, seed=seed, scale=scale, mask=mask, context=f"{backend} {case}")


# --------------------------------------------------------------------------------------------------
# scale (one fp32 multiply, section 1) and masks of several broadcast shapes
# --------------------------------------------------------------------------------------------------

SCALES = {
    "none": lambda s: None,
    "float": lambda s: s.uniform(0.05, 3.0),
    "negative_float": lambda s: -s.uniform(0.05, 3.0),
    "tensor_fp32": lambda s: torch.tensor(s.uniform(0.05, 3.0)),
    "tensor_bf16": lambda s: torch.tensor(s.uniform(0.05, 3.0), dtype=torch.bfloat16),
    "tensor_fp64": lambda s: torch.tensor(s.uniform(0.05, 3.0), dtype=torch.float64),
}

MASK_SHAPES = {  # x is (2, 5, 19), reduced over the last dim
    "none": None,
    "full": (2, 5, 19),
    "keys": (19,),
    "per_row": (2, 5, 1),
    "leading_broadcast": (1, 5, 19),
    "transposed": (2, 19, 5),  # made (2, 5, 19) by a transpose: a strided mask
    "zero_d": (),
}


@pytest.mark.parametrize("mask_shape", list(MASK_SHAPES), ids=[f"mask_{k}" for k in MASK_SHAPES])
@pytest.mark.parametrize("scale_kind", list(SCALES), ids=[f"scale_{k}" for k in SCALES])
@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_scale_and_mask_match_oracle(backend, op, scale_kind, mask_shape, seed):
    x = seed.randn(2, 5, 19, std=3.0)
    scale = SCALES[scale_kind](seed)
    shape = MASK_SHAPES[mask_shape]
    mask = None
    if shape is not None:
        mask = seed.mask(*shape, keep=0.75)
        if shape == (2, 5, 19):
            mask[1, 2] = False  # one fully masked row
        if shape == ():
            mask = torch.tensor(True)
        if mask_shape == "transposed":
            mask = mask.transpose(1, 2)
    check(op, x, -1, seed=seed, scale=scale, mask=mask, context=f"{backend} scale={scale!r}")


@given(seed=seeds())
def test_zero_d_mask_false_gives_an_empty_row(backend, seed):
    x = seed.randn(4, 7)
    mask = torch.tensor(False)
    for op in O.OPS:
        y, dx = check(op, x, -1, seed=seed, mask=mask, context=backend)
        expected = {"softmax": 0.0, "log_softmax": -math.inf, "logsumexp": -math.inf}[op]
        assert (y == expected).all(), f"{op} of fully masked rows: {y}; {seed}"
        assert (dx == 0).all(), f"{op}: gradient of fully masked rows {dx}; {seed}"


@pytest.mark.parametrize("grad_layout", ["transposed", "expanded", "sliced"])
@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_strided_incoming_gradient(backend, op, grad_layout, seed):
    # Autograd hands the backward whatever layout the loss produced: stride 0 for y.sum(), transposed
    # for a loss computed on y.t(), a slice of a bigger tensor.
    x = seed.randn(6, 10, std=3.0)
    scale = torch.tensor(seed.uniform(0.5, 2.0))
    mask = seed.mask(6, 10)
    shape = (6,) if op == "logsumexp" else (6, 10)
    if grad_layout == "transposed":
        g = seed.randn(*reversed(shape)).t() if op != "logsumexp" else seed.randn(6, 1)[:, 0]
    elif grad_layout == "expanded":
        g = seed.randn(1).expand(shape) if op == "logsumexp" else seed.randn(1, 10).expand(shape)
    else:
        g = seed.randn(*[2 * d for d in shape])[tuple(slice(None, None, 2) for _ in shape)]
    assert g.shape == shape
    _, _, dx, dscale = run(op, x, -1, seed=seed, scale=scale, mask=mask, grad=g)
    r = O.evaluate(op, x, -1, scale=scale, mask=mask)
    ex, es = O.gradients(op, x, g, -1, scale=scale, mask=mask)
    bx, bs = O.gradient_bounds(op, r, g, x, scale=scale)
    ctx = f"{backend} grad strides {g.stride()}; {seed}"
    O.assert_close(dx, ex, bx, f"{op} d/dx", ctx)
    O.assert_close(dscale, es, bs, f"{op} d/dscale", ctx)


DTYPE_PAIRS = {  # (x dtype, output dtype)
    "fp16_to_fp32": (torch.float16, torch.float32),
    "bf16_to_fp32": (torch.bfloat16, torch.float32),
    "fp32_to_fp16": (torch.float32, torch.float16),
    "fp32_to_bf16": (torch.float32, torch.bfloat16),
    "fp32_to_fp64": (torch.float32, torch.float64),
    "fp16_to_fp64": (torch.float16, torch.float64),
}


@pytest.mark.parametrize("pair", list(DTYPE_PAIRS), ids=list(DTYPE_PAIRS))
@pytest.mark.parametrize("op", ROW_OPS)
@given(seed=seeds())
def test_dtype_argument(backend, op, pair, seed):
    x_dtype, out_dtype = DTYPE_PAIRS[pair]
    std = 3.0
    x = seed.randn(6, 33, dtype=x_dtype, std=std)
    scale = seed.uniform(0.2, 2.0)
    y, _ = check(op, x, -1, seed=seed, scale=scale, mask=seed.mask(6, 33), dtype=out_dtype,
                 context=f"{backend} dtype={out_dtype}")
    assert y.dtype == out_dtype


@pytest.mark.parametrize("keepdim", [False, True], ids=["keepdim_false", "keepdim_true"])
@pytest.mark.parametrize("dim", [0, 1, -1], ids=["dim0", "dim1", "dim_last"])
@given(seed=seeds())
def test_logsumexp_keepdim(backend, dim, keepdim, seed):
    x = seed.randn(4, 6, 5, std=3.0)
    mask = seed.mask(4, 6, 5)
    y, _ = check("logsumexp", x, dim, seed=seed, mask=mask, scale=torch.tensor(0.7), keepdim=keepdim,
                 context=backend)
    assert y.shape == torch.logsumexp(x, dim, keepdim=keepdim).shape


# --------------------------------------------------------------------------------------------------
# Section 1: one materialized value per logit
# --------------------------------------------------------------------------------------------------


SEED_ROW_CASES = [
    pytest.param(dtype, scale_kind, n, id=f"{dtype_id}-{scale_kind}-n{n}")
    for dtype, dtype_id in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
    for scale_kind in ("float", "tensor")
    for n in (1, 8, 1024)
] + [  # rows past 16384 elements take the split path (two programs per row at 65536)
    pytest.param(torch.float32, "tensor", 65536, id="fp32-tensor-n65536_split"),
    pytest.param(torch.bfloat16, "float", 65536, id="bf16-float-n65536_split"),
]


@pytest.mark.parametrize("dtype,scale_kind,n", SEED_ROW_CASES)
@given(seed=seeds())
def test_seed_scalar_row_is_exactly_one_over_n(backend, dtype, scale_kind, n, seed):
    rows = 1 if n > 1024 else 3
    x = torch.full((rows, n), _seed.FMA_X, dtype=dtype)
    scale = _seed.FMA_SCALE if scale_kind == "float" else torch.tensor(_seed.FMA_SCALE)
    ctx = f"{backend} row of {x[0, 0].item()!r} * scale {_seed.FMA_SCALE!r}, N={n}; {seed}"
    y, dx = check("softmax", x, -1, seed=seed, scale=scale, context=ctx)
    assert (y == 1.0 / n).all(), f"softmax is not exactly 1/N: {y.unique().tolist()}; {ctx}"
    assert torch.isfinite(dx).all(), f"softmax gradient not finite; {ctx}"
    y, _ = check("log_softmax", x, -1, seed=seed, scale=scale, context=ctx)
    assert (y <= 0).all(), ctx
    if n == 1:
        assert (y == 0.0).all(), f"log_softmax of a one-element row is {y.tolist()}, not 0; {ctx}"
    lse, _ = check("logsumexp", x, -1, seed=seed, scale=scale, context=ctx)
    assert torch.isfinite(lse).all(), ctx


@pytest.mark.parametrize("dtype", [FP32, BF16])
@given(seed=seeds())
def test_dominating_logit_log_softmax_is_exactly_zero(backend, dtype, seed):
    # The seed value dominates rows of smaller values: exp(z_max - m) == 1 exactly and the others underflow
    # against it, so l == 1, log(l) == 0 and log_softmax at the max is 0.0, softmax 1.0 (section 1).
    x = seed.randn(5, 24, dtype=torch.float64, std=1e9).to(dtype)
    where = seed.randint(0, 24, 5)
    x[torch.arange(5), where] = _seed.FMA_X
    ctx = f"{backend}; {seed}"
    y, _ = check("log_softmax", x, -1, seed=seed, scale=_seed.FMA_SCALE, context=ctx)
    top = y[torch.arange(5), where]
    assert (top == 0.0).all() and not torch.signbit(top).any(), f"dominating logit: {top.tolist()}; {ctx}"
    assert (y <= 0).all(), ctx
    p, _ = check("softmax", x, -1, seed=seed, scale=_seed.FMA_SCALE, context=ctx)
    assert (p[torch.arange(5), where] == 1.0).all(), ctx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["softmax", "logsumexp"])
@given(seed=seeds())
def test_subnormal_results(backend, op, dtype, seed):
    # Rows spread over ~100 nats: probabilities and gradients far below the normal range of the dtype.
    spread = {torch.float32: 100.0, torch.float16: 14.0, torch.bfloat16: 100.0}[dtype]
    x = (seed.rand(6, 40) * spread).to(dtype)
    check(op, x, -1, seed=seed, context=f"{backend} values spread over {spread}")


@pytest.mark.parametrize("dtype", DTYPES)
@given(seed=seeds())
def test_log_softmax_is_never_positive(backend, dtype, seed):
    big = {torch.float32: 1e30, torch.float16: 1e4, torch.bfloat16: 1e30}[dtype]
    std = 10.0
    x = seed.randn(16, 45, dtype=torch.float64, std=std)
    x[:4] *= big / std / 10  # rows of huge logits
    x[4:8] = x[4:8].sign() * 1e-3  # rows of nearly equal logits: log(l) is close to log(N)
    x[8:12, ::3] += 50  # several maxima of a row close together
    x = x.to(dtype)
    y = safeops.log_softmax(x, -1, scale=seed.uniform(0.3, 1.5))
    assert (y <= 0).all(), f"log_softmax > 0 at {(y > 0).nonzero().tolist()}: {y[y > 0].tolist()}; {seed}"


@pytest.mark.parametrize("n", [1, 4, 256, 2048], ids=["n1", "n4", "n256", "n2048"])
@pytest.mark.parametrize("dtype", DTYPES)
@given(seed=seeds())
def test_equal_rows_give_exactly_one_over_n(backend, dtype, n, seed):
    # Any value, any scale: every z of the row is the same bits, so every exp(z - m) is exactly 1.
    values = seed.randn(6, dtype=torch.float64, std=100.0)
    values[0] = torch.finfo(dtype).max / 4  # times a scale < 4: z stays finite
    values[1] = torch.finfo(dtype).min / 4
    values[2] = 0.0
    x = values.to(dtype)[:, None].expand(6, n).contiguous()
    scale = seed.uniform(0.1, 3.0)
    ctx = f"{backend}; values {x[:, 0].tolist()} scale {scale!r} N={n}; {seed}"
    y, _ = check("softmax", x, -1, seed=seed, scale=scale, context=ctx)
    assert (y == 1.0 / n).all(), f"equal rows give {y.unique().tolist()}, not 1/N; {ctx}"
    check("log_softmax", x, -1, seed=seed, scale=scale, context=ctx)
    check("logsumexp", x, -1, seed=seed, scale=scale, context=ctx)


# --------------------------------------------------------------------------------------------------
# Section 3: backward recomputes fp32 probabilities from x and the separate row max and sum
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [8, 65536], ids=["n8", "n65536_split"])
@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_equal_logits_near_1e11_folded_lse_case(backend, op, dtype, n, seed):
    # fp32(m + log N) == m for m near 1e11: a backward or log_softmax built on a folded lse gets
    # exp(z - lse) == 1 instead of 1/N (gradients N times too big) and log_softmax 0 instead of -log N.
    rows = 1 if n > 8 else 4
    values = (1e11 * (1 + seed.rand(rows))).to(dtype)
    x = values[:, None].expand(rows, n).contiguous()
    ctx = f"{backend} rows of {values.tolist()}, N={n}"
    y, dx = check(op, x, -1, seed=seed, context=ctx)
    if op == "softmax":
        assert (y == 1.0 / n).all(), f"{y.unique().tolist()}; {ctx}; {seed}"
    if op == "log_softmax":
        assert (y < -1).all(), f"log_softmax of equal logits is {y.unique().tolist()}, not -log N; {ctx}"


@pytest.mark.parametrize("scale_kind", ["none", "tensor"])
@pytest.mark.parametrize("n", [16, 1000], ids=["n16", "n1000"])
@given(seed=seeds())
def test_bf16_softmax_sum_backward_is_nearly_zero(backend, n, scale_kind, seed):
    # sum(softmax(x)) == 1 for every x: the true gradient is 0. Recomputing fp32 probabilities keeps it
    # near 0; a backward from bf16-rounded outputs is off by ~eps(bf16) per element.
    x = seed.randn(8, n, dtype=torch.bfloat16, std=3.0)
    scale = torch.tensor(seed.uniform(0.5, 2.0), dtype=torch.bfloat16) if scale_kind == "tensor" else None
    grad = torch.ones(8, n, dtype=torch.bfloat16)
    y, g, dx, dscale = run("softmax", x, -1, seed=seed, scale=scale, grad=grad)
    ex, es = O.gradients("softmax", x, grad, -1, scale=scale)
    r = O.evaluate("softmax", x, -1, scale=scale)
    bx, bs = O.gradient_bounds("softmax", r, grad, x, scale=scale)

    xe = x.detach().clone().requires_grad_(True)
    torch.softmax(xe if scale is None else xe * scale, -1).sum().backward()
    eager_err = (xe.grad.double() - ex).abs().max().item()
    ours = (dx.double() - ex).abs().max().item()
    ctx = (f"{backend}: safeops max|dx - dx_f64| = {ours:.3e}; eager torch.softmax bf16 backward is off by "
           f"{eager_err:.3e} (float64 max|dx| = {ex.abs().max().item():.3e}); {seed}")
    O.assert_close(dx, ex, bx, "d/dx of softmax(x).sum()", ctx)
    if scale is not None:
        O.assert_close(dscale, es, bs, "d/dscale of softmax(x * scale).sum()", ctx)


# --------------------------------------------------------------------------------------------------
# Section 4: empty rows are defined, not NaN
# --------------------------------------------------------------------------------------------------

EMPTY_HOW = ["mask", "all_neg_inf", "mask_over_nan_and_inf"]


@pytest.mark.parametrize("loss", ["all_rows", "empty_row_sliced_away"])
@pytest.mark.parametrize("how", EMPTY_HOW)
@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_empty_rows(backend, op, dtype, how, loss, seed):
    x = seed.randn(4, 13, dtype=dtype, std=3.0)
    mask = seed.mask(4, 13, keep=0.8)
    mask[:, 0] = True
    if how == "mask":
        mask[1] = False
    elif how == "all_neg_inf":
        x[1] = -math.inf
        mask = None
    else:
        x[1, ::2] = math.nan
        x[1, 1::2] = math.inf
        mask[1] = False
    scale = torch.tensor(seed.uniform(0.5, 2.0))
    ctx = f"{backend} {how}, {loss}; {seed}"

    xg = x.detach().requires_grad_(True)
    sg = scale.clone().requires_grad_(True)
    y = call(op, xg, -1, scale=sg, mask=mask)
    expected_empty = {"softmax": 0.0, "log_softmax": -math.inf, "logsumexp": -math.inf}[op]
    assert (y[1] == expected_empty).all(), f"{op} of an empty row gives {y[1].tolist()}; {ctx}"
    g = seed.randn(*y.shape, dtype=y.dtype)
    keep_rows = [0, 2, 3]
    if loss == "all_rows":
        out = (y * g).sum() if op == "logsumexp" else (torch.where(y.isinf(), 0, y) * g).sum()
        g_eff = g
    else:
        out = (y[keep_rows] * g[keep_rows]).sum() if op == "logsumexp" else (
            torch.where(y[keep_rows].isinf(), 0, y[keep_rows]) * g[keep_rows]).sum()
        g_eff = g.clone()
        g_eff[1] = 0
    if op == "log_softmax":
        g_eff = torch.where(y.isinf(), 0, g_eff)
    dx, dscale = torch.autograd.grad(out, [xg, sg])
    assert not dx.isnan().any() and not dscale.isnan(), f"NaN gradient: {dx}, {dscale}; {ctx}"
    assert (dx[1] == 0).all(), f"empty row gradient {dx[1]}; {ctx}"

    r = O.evaluate(op, x, -1, scale=scale, mask=mask)
    O.assert_close(y, r.out, O.output_bound(op, r, dtype), f"{op} output", ctx)
    ex, es = O.gradients(op, x, g_eff, -1, scale=scale, mask=mask)
    bx, bs = O.gradient_bounds(op, r, g_eff, x, scale=scale)
    O.assert_close(dx, ex, bx, f"{op} d/dx", ctx)
    O.assert_close(dscale, es, bs, f"{op} d/dscale", ctx)


@pytest.mark.parametrize("op", OPS)
def test_zero_length_rows_are_empty_rows(backend, op):
    x = torch.zeros(3, 0, requires_grad=True)
    y = call(op, x, -1)
    if op == "logsumexp":
        assert y.shape == (3,) and (y == -math.inf).all(), y
    else:
        assert y.shape == (3, 0)
    (dx,) = torch.autograd.grad(y.sum(), [x], allow_unused=True)
    assert dx is None or dx.shape == (3, 0)


# --------------------------------------------------------------------------------------------------
# Section 4 (only exact -inf excludes) and shift invariance with huge negative finite logits
# --------------------------------------------------------------------------------------------------

OFFSETS = {
    "fp32_minus_1e30": (torch.float32, -1e30),
    "fp32_finfo_min": (torch.float32, torch.finfo(torch.float32).min),
    "fp16_minus_1e4": (torch.float16, -1e4),
    "fp16_finfo_min": (torch.float16, torch.finfo(torch.float16).min),
    "bf16_minus_1e30": (torch.bfloat16, -1e30),
    "bf16_finfo_min": (torch.bfloat16, torch.finfo(torch.bfloat16).min),
}


@pytest.mark.parametrize("offset", list(OFFSETS), ids=list(OFFSETS))
@pytest.mark.parametrize("op", ROW_OPS)
@given(seed=seeds())
def test_shift_invariance_with_huge_negative_logits(backend, op, offset, seed):
    # x = c + k * ulp(c) with scale = 1 / ulp(c) (a power of two): z = c / ulp(c) + k exactly, and z - m
    # is the same exact integer as for x = k * ulp(c). So the results must be the same bits.
    dtype, c = OFFSETS[offset]
    c = torch.tensor(c, dtype=dtype)
    ulp_exp = math.floor(math.log2(abs(c.item()))) + round(math.log2(torch.finfo(dtype).eps))
    scale = 2.0 ** -ulp_exp
    k = seed.randint(0, 20, 5, 11).to(torch.float64)
    shifted = (c.double() + k * 2.0 ** ulp_exp).to(dtype)
    base = (k * 2.0 ** ulp_exp).to(dtype)
    assert torch.equal(shifted.double() - c.double(), base.double()), "test construction is not exact"
    ctx = f"{backend} offset {c.item()!r}, scale 2**{-ulp_exp}; {seed}"
    g = seed.randn(5, 11, dtype=dtype)
    y_shift, _, dx_shift, _ = run(op, shifted, -1, seed=seed, scale=scale, grad=g)
    y_base, _, dx_base, _ = run(op, base, -1, seed=seed, scale=scale, grad=g)
    assert_same_bits(y_shift, y_base, f"{op}(c + x) vs {op}(x)", ctx)
    assert_same_bits(dx_shift, dx_base, f"d/dx {op}(c + x) vs {op}(x)", ctx)
    check(op, shifted, -1, seed=seed, scale=scale, context=ctx)


@pytest.mark.parametrize("dtype", DTYPES)
@given(seed=seeds())
def test_finite_huge_negative_logits_are_real_logits(backend, dtype, seed):
    lo = torch.finfo(dtype).min
    x = torch.tensor([
        [lo, lo, lo, lo],  # a real row: 1/4 each, not an empty row
        [lo, -math.inf, -math.inf, -math.inf],  # only -inf is excluded
        [lo, -1e30 if dtype != torch.float16 else -6e4, 0.0, -math.inf],
        [-1e30 if dtype != torch.float16 else -6e4, -1.0, -2.0, -3.0],
    ], dtype=dtype)
    ctx = f"{backend}; {seed}"
    for op in O.OPS:
        check(op, x, -1, seed=seed, context=ctx)
    y = safeops.softmax(x)
    assert (y[0] == 0.25).all() and y[1].tolist() == [1.0, 0.0, 0.0, 0.0], f"{y}; {ctx}"
    lse = safeops.logsumexp(x)
    assert torch.isfinite(lse).all(), f"logsumexp of finite rows {lse}; {ctx}"


# --------------------------------------------------------------------------------------------------
# Section 5: NaN and +inf follow IEEE in their row, and never leak out of it or out of a mask
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["nan", "pos_inf"])
@pytest.mark.parametrize("dtype", [FP32, FP16])
@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_nan_or_inf_poisons_only_its_row(backend, op, dtype, bad, seed):
    clean = seed.randn(5, 17, dtype=dtype, std=3.0)
    clean[3, ::4] = -math.inf  # excluded entries in another row stay excluded
    poisoned = clean.clone()
    col = int(seed.randint(0, 17))
    poisoned[2, col] = math.nan if bad == "nan" else math.inf
    scale = seed.uniform(0.5, 2.0)
    g = seed.randn(*call(op, clean, -1).shape, dtype=dtype)
    ctx = f"{backend} {bad} at [2, {col}]; {seed}"
    y_bad, _, dx_bad, _ = run(op, poisoned, -1, seed=seed, scale=scale, grad=g)
    y_ok, _, dx_ok, _ = run(op, clean, -1, seed=seed, scale=scale, grad=g)
    if op == "logsumexp" and bad == "pos_inf":
        # The exception of section 5, as torch.logsumexp: +inf, and the gradient exp(z - inf) * g is NaN at
        # the +inf entry and 0 at the others.
        assert y_bad[2] == math.inf, f"logsumexp of a row with +inf: {y_bad[2].item()}; {ctx}"
        rest = torch.arange(17) != col
        assert dx_bad[2, col].isnan() and (dx_bad[2, rest] == 0).all(), f"its gradient {dx_bad[2]}; {ctx}"
    else:
        assert y_bad[2].isnan().all(), f"row with {bad}: {y_bad[2].tolist()}; {ctx}"
    others = [0, 1, 3, 4]
    assert_same_bits(y_bad[others], y_ok[others], "other rows' outputs", ctx)
    assert_same_bits(dx_bad[others], dx_ok[others], "other rows' gradients", ctx)
    assert not dx_bad[others].isnan().any(), ctx
    check(op, clean, -1, seed=seed, scale=scale, context=ctx)


@pytest.mark.parametrize("poison", ["nan", "pos_inf", "neg_inf"])
@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_poison_at_masked_positions_does_not_leak(backend, op, poison, seed):
    # Masks select, they do not add (section 5): whatever sits at an excluded position, outputs and
    # gradients (d/dscale included) are those of any other value there.
    x = seed.randn(6, 21, std=3.0)
    mask = seed.mask(6, 21, keep=0.6)
    mask[:, 0] = True
    value = {"nan": math.nan, "pos_inf": math.inf, "neg_inf": -math.inf}[poison]
    poisoned = torch.where(mask, x, value)
    scale = torch.tensor(seed.uniform(0.5, 2.0))
    g = seed.randn(*call(op, x, -1).shape)
    ctx = f"{backend} {poison} at masked positions; {seed}"
    y_p, _, dx_p, ds_p = run(op, poisoned, -1, seed=seed, scale=scale, mask=mask, grad=g)
    y_c, _, dx_c, ds_c = run(op, x, -1, seed=seed, scale=scale, mask=mask, grad=g)
    assert_same_bits(y_p, y_c, "output", ctx)
    assert_same_bits(dx_p, dx_c, "d/dx", ctx)
    assert_same_bits(ds_p, ds_c, "d/dscale", ctx)
    assert torch.isfinite(dx_p).all() and torch.isfinite(ds_p), ctx
    check(op, poisoned, -1, seed=seed, scale=scale, mask=mask, context=ctx)


# --------------------------------------------------------------------------------------------------
# Section 5's exception: logsumexp of a row holding +inf and no NaN is +inf, as eager torch.logsumexp gives,
# and its gradient is torch's, exp(z - lse) * g: NaN at the +inf entries, 0 at the others. On every path:
# the rows kernels, and the split kernels (rows of 40000: the forward's per-range partials and their
# combination, the backward's finish kernel).
# --------------------------------------------------------------------------------------------------

INF, NAN = math.inf, math.nan
# row: (torch.logsumexp(row), d/d row of torch.logsumexp(row)), as eager torch 2.13 gives them.
TORCH_INF_ROWS = {
    "finite_inf_finite": ((1.0, INF, 2.0), INF, (0.0, NAN, 0.0)),
    "inf_inf": ((INF, INF), INF, (NAN, NAN)),
    "inf_neg_inf": ((INF, -INF), INF, (NAN, 0.0)),
    "inf_nan": ((INF, NAN), NAN, (NAN, NAN)),
}
# (row, length, dtype): length None, the row itself; else its values spread over that many columns. The split
# kernels' handling of +inf does not depend on the dtype: fp32 only there, and the two rows that reach their
# combination of partials with +inf in two ranges and with a NaN (the interpreter is slow; the other rows'
# entries meet the split kernels in test_logsumexp_pos_inf_rows_match_oracle).
INF_ROW_CASES = [pytest.param(row, None, dtype, id=f"{row}-rows-{dtype}") for row in TORCH_INF_ROWS
                 for dtype in ("fp32", "fp16", "bf16")]
INF_ROW_CASES += [pytest.param(row, 40000, "fp32", id=f"{row}-split-fp32") for row in ("inf_inf", "inf_nan")]
DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other is NaN (whatever the NaN's sign or payload)."""
    a, b = a.detach().double(), b.detach().double()
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("row,n,dtype_name", INF_ROW_CASES)
def test_logsumexp_of_inf_rows_is_torchs(backend, row, n, dtype_name):
    values, lse, grad = TORCH_INF_ROWS[row]
    dtype = DTYPE_NAMES[dtype_name]
    if n is None:
        x = torch.tensor(values, dtype=dtype)
    else:  # the values far apart (in different split ranges), finite logits between them
        x = torch.linspace(-3.0, 3.0, n, dtype=torch.float64).to(dtype)
        at = torch.arange(len(values)) * (n // len(values)) + 5
        x[at] = torch.tensor(values, dtype=dtype)
    ctx = f"{backend} {values} in {x.shape[0]} columns, {dtype}"
    xs = x.clone().requires_grad_(True)
    y = safeops.logsumexp(xs, 0)
    (dx,) = torch.autograd.grad(y, xs)
    xt = x.clone().requires_grad_(True)
    yt = torch.logsumexp(xt, 0)
    (dxt,) = torch.autograd.grad(yt, xt)
    assert same_values(yt.double(), torch.tensor(lse)), f"eager torch changed: {yt}; {ctx}"
    assert same_values(y, yt), f"logsumexp {y.item()}, torch gives {yt.item()}; {ctx}"
    assert same_values(dx, dxt), f"d/dx {dx[dx != dxt]}, torch gives {dxt[dx != dxt]}; {ctx}"
    if n is None:
        assert same_values(dx, torch.tensor(grad)), f"d/dx {dx.tolist()}; {ctx}"


# (row length, dtype): short rows, and long rows (forward and backward both split) in fp32 only, as the split
# kernels' handling of +inf does not depend on the dtype.
POS_INF_CASES = [pytest.param(37, FP32.values[0], id="rows-fp32"),
                 pytest.param(37, BF16.values[0], id="rows-bf16"),
                 pytest.param(40000, FP32.values[0], id="split-fp32")]


@pytest.mark.parametrize("n,dtype", POS_INF_CASES)
@given(seed=seeds())
def test_logsumexp_pos_inf_rows_match_oracle(backend, n, dtype, seed):
    """+inf at random positions (several in a row, sometimes in one block or range) among finite, -inf and
    masked entries: +inf with torch's gradient; +inf and NaN: NaN; a masked-out +inf is no +inf of its row
    (section 5: masks select). Rows without an included +inf keep the bits they have without it."""
    x = seed.randn(6, n, dtype=torch.float64, std=3.0)
    x[1][seed.rand(n) < 0.2] = -INF
    mask = seed.mask(6, n, keep=0.8)
    for r in (0, 1, 2, 3):
        k = int(seed.randint(1, 4))
        at = seed.randint(0, n, k)
        if seed.rand() < 0.5:  # neighbours: the same block of a row, the same range of a split row
            at = (at[:1] + torch.arange(k)) % n
        x[r, at] = INF
        mask[r, at] = r != 3  # row 3: every +inf masked out, a finite row
    x[2, int(seed.randint(0, n))] = NAN
    mask[2] = True  # row 2: +inf and NaN, both included: NaN
    x = x.to(dtype)  # rows 4, 5: finite
    scale = torch.tensor(seed.uniform(0.5, 2.0))
    ctx = f"{backend} {dtype} N={n}; {seed}"
    # Against the float64 oracle: the +inf rows exactly, the finite ones within bounds. (The NaN row is
    # checked below: the oracle's gradient holds no NaN at non-finite inputs, which it takes as constants.)
    # Long rows: only the +inf row among finite, -inf and masked entries, and the masked-out +inf (the
    # interpreter is slow).
    number, inf_rows = ([0, 1, 3, 4, 5], 2) if n < 1000 else ([1, 3], 1)
    y, dx = check("logsumexp", x[number], -1, seed=seed, scale=scale, mask=mask[number], context=ctx)
    assert (y[:inf_rows] == INF).all() and torch.isfinite(y[inf_rows:]).all(), f"{y}; {ctx}"
    included_inf = mask[number][:inf_rows] & (x[number][:inf_rows] == INF)
    d = dx[:inf_rows]
    assert d[included_inf].isnan().all() and (d[~included_inf] == 0).all(), f"d/dx {d}; {ctx}"
    if n >= 1000:
        return
    clean = torch.where(torch.isfinite(x) | (x == -INF), x, torch.zeros_like(x))
    g = seed.randn(6, dtype=dtype)
    y_bad, _, dx_bad, _ = run("logsumexp", x, -1, seed=seed, scale=scale.item(), mask=mask, grad=g)
    y_ok, _, dx_ok, _ = run("logsumexp", clean, -1, seed=seed, scale=scale.item(), mask=mask, grad=g)
    # +inf and NaN: NaN, and a NaN gradient, as torch.logsumexp gives.
    assert y_bad[2].isnan() and dx_bad[2].isnan().all(), f"the NaN row: {y_bad[2]}, {dx_bad[2]}; {ctx}"
    # The other rows: the bits they have in a batch without any +inf or NaN (section 5: never leaks).
    assert_same_bits(y_bad[3:], y_ok[3:], "rows without an included +inf", ctx)
    assert_same_bits(dx_bad[3:], dx_ok[3:], "gradients of rows without an included +inf", ctx)


@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
@pytest.mark.parametrize("scale", [2.0, -1.0, 0.0], ids=["overflow", "negative", "zero"])
def test_logsumexp_inf_from_the_scale(backend, scale, scale_kind):
    """z = fp32(x) * scale is what is +inf or NaN: finite x that overflow to +inf (scale 2), -inf x turned
    +inf by a negative scale, 0 * inf = NaN (scale 0); as torch.logsumexp(x * scale) gives."""
    x = torch.tensor([[3e38, 1.0, -2.0],  # scale 2: +inf
                      [1e38, 2e38, 0.5],  # scale 2: +inf
                      [-INF, 1.0, 2.0],  # scale -1: +inf; scale 0: NaN
                      [INF, 1.0, 2.0],  # scale 2: +inf; scale 0: NaN
                      [1.0, 2.0, 3.0]])
    s = torch.tensor(scale) if scale_kind == "tensor" else scale
    ctx = f"{backend} scale {scale} ({scale_kind})"
    g = torch.tensor([1.0, -0.5, 2.0, 0.25, -1.0])
    y, _, dx, dscale = run("logsumexp", x, -1, seed=None, scale=s, grad=g)
    xt = x.clone().requires_grad_(True)
    st = torch.tensor(scale, requires_grad=True)
    yt = torch.logsumexp(xt * st, -1)
    dxt, dst = torch.autograd.grad(yt, [xt, st], g)
    assert same_values(y.isnan(), yt.isnan()) and same_values(y.isinf(), yt.isinf()), f"{y} vs {yt}; {ctx}"
    assert same_values(dx.isnan(), dxt.isnan()) and same_values(dx == 0, dxt == 0), f"{dx} vs {dxt}; {ctx}"
    if scale_kind == "tensor":
        assert same_values(dscale.isnan(), dst.isnan()), f"d/dscale {dscale} vs {dst}; {ctx}"
    # The rows that are not NaN against the float64 oracle: +inf ones exactly, finite ones within bounds.
    # (A NaN row's gradient is promised only to stay in its row.)
    number = ~yt.isnan()
    check("logsumexp", x[number], -1, seed=S.Seed(0), scale=s, context=ctx)


# --------------------------------------------------------------------------------------------------
# Section 2: fp64 is computed in fp64
# --------------------------------------------------------------------------------------------------


def _fp64_fn(op, mask):
    def fn(x, scale):
        y = call(op, x, -1, scale=scale, mask=mask)
        return torch.where(torch.isinf(y), 0, y)  # gradcheck's finite differences cannot take -inf - -inf
    return fn


@pytest.mark.parametrize("variant", ["plain", "tensor_scale_and_mask", "float_scale_and_mask"])
@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_fp64_gradcheck(backend, op, variant, seed):
    x = seed.randn(3, 7, dtype=torch.float64, std=2.0)
    mask, scale = None, None
    if variant != "plain":
        mask = seed.mask(3, 7)
        mask[:, 0] = True
        mask[2] = False  # an empty row: gradient 0
    if variant == "tensor_scale_and_mask":
        scale = torch.tensor(seed.uniform(0.5, 2.0), dtype=torch.float64)
        inputs = (x.clone().requires_grad_(True), scale.clone().requires_grad_(True))
        fn = _fp64_fn(op, mask)
    else:
        scale = seed.uniform(0.5, 2.0) if variant != "plain" else None
        inputs = (x.clone().requires_grad_(True),)
        with_scale = _fp64_fn(op, mask)
        fn = lambda x: with_scale(x, scale)  # noqa: E731
    eps = 1e-6
    atol = _finite_difference_atol(fn, inputs, eps, x, scale)
    assert torch.autograd.gradcheck(fn, inputs, eps=eps, atol=atol, rtol=1e-7), f"{backend} {atol=}; {seed}"
    check(op, x, -1, seed=seed, scale=scale, mask=mask, context=f"{backend} {variant}")


def _finite_difference_atol(fn, inputs, eps: float, x: torch.Tensor, scale) -> float:
    """The rounding noise in gradcheck's numerical Jacobian, (f(x + eps) - f(x - eps)) / (2 eps), in fp64.

    Each fp64 evaluation is off by a few roundings (z = x * scale, z - m, log l, the final subtraction), each
    at most u = 2**-53 times max|z| or max|y|; the difference of two evaluations divided by 2 eps turns that
    into an absolute error of about 8 u (max|z| + max|y|) / eps on every Jacobian entry, however small the
    entry. log_softmax outputs reach |y| ~ 20 here, where that is above a flat 1e-9 (seed 572660860: 1.5e-9
    on an entry of -1.4e-4 at y = -16.6, on both backends). Still ~1e-8 at most: a wrong gradient formula
    is off by far more, and check() below holds the gradients to the contract's bound against the oracle.
    """
    with torch.no_grad():
        y = fn(*inputs)  # finite: fn maps -inf to 0
    s = 1.0 if scale is None else abs(float(scale))
    magnitude = x.abs().max().item() * s + y.abs().max().item()
    return 1e-9 + 8 * 2.0**-53 * magnitude / eps


def test_fp64_is_computed_in_fp64(backend):
    # Differences far below fp32 resolution survive only if nothing is rounded to fp32.
    x = torch.tensor([[0.0, 1e-10, 2e-10]], dtype=torch.float64)
    y = safeops.softmax(x)
    assert y[0, 0] < y[0, 1] < y[0, 2], f"fp64 softmax lost fp64 resolution: {y.tolist()}"
    # The python float scale is applied in fp64 too: a one-element row's logsumexp is z itself.
    lse = safeops.logsumexp(torch.tensor([1.0], dtype=torch.float64), 0, scale=0.1)
    assert lse.item() == 0.1, f"logsumexp([1.0]) with scale 0.1 in fp64 is {lse.item()!r}, not 0.1"
    lse32 = safeops.logsumexp(torch.tensor([1.0]), 0, scale=0.1)
    assert lse32.item() == torch.tensor(0.1, dtype=torch.float32).item(), "fp32 uses fp32(scale)"


# --------------------------------------------------------------------------------------------------
# Section 6: deterministic and batch-invariant, bit for bit
# --------------------------------------------------------------------------------------------------

SHAPES_BITS = {
    "rows": (torch.float32, 48, 37),
    "rows_fp16": (torch.float16, 48, 300),
    "rows_bf16": (torch.bfloat16, 48, 300),
    "split_fp32": (torch.float32, 4, 20000),
    "split_fp16": (torch.float16, 3, 40000),
}


@pytest.mark.parametrize("case", list(SHAPES_BITS), ids=list(SHAPES_BITS))
@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_deterministic(backend, op, case, seed):
    dtype, m, n = SHAPES_BITS[case]
    x = seed.randn(m, n, dtype=dtype, std=3.0)
    mask = seed.mask(m, n, keep=0.9)
    scale = torch.tensor(seed.uniform(0.5, 2.0))
    g = seed.randn(*call(op, x, -1).shape, dtype=dtype)
    first = run(op, x, -1, seed=seed, scale=scale, mask=mask, grad=g)
    second = run(op, x, -1, seed=seed, scale=scale, mask=mask, grad=g)
    for name, i in (("output", 0), ("d/dx", 2), ("d/dscale", 3)):
        assert_same_bits(first[i], second[i], f"{op} {name}, run twice", f"{backend}; {seed}")


@pytest.mark.parametrize("case", list(SHAPES_BITS), ids=list(SHAPES_BITS))
@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_batch_invariant(triton_backend, op, case, seed):
    # A row's bits do not depend on how many rows are in the batch or where it sits (section 6).
    dtype, m, n = SHAPES_BITS[case]
    x = seed.randn(m, n, dtype=dtype, std=3.0)
    mask = seed.mask(m, n, keep=0.9)
    g = seed.randn(*call(op, x, -1).shape, dtype=dtype)
    scale = seed.uniform(0.5, 2.0)
    y, _, dx, _ = run(op, x, -1, seed=seed, scale=scale, mask=mask, grad=g)
    ctx = f"triton {case}; {seed}"
    picks = sorted({0, m - 1, int(seed.randint(0, m))})
    for i in picks:
        yi, _, dxi, _ = run(op, x[i:i + 1], -1, seed=seed, scale=scale, mask=mask[i:i + 1], grad=g[i:i + 1])
        assert_same_bits(yi[0], y[i], f"row {i} alone vs in a batch of {m}", ctx)
        assert_same_bits(dxi[0], dx[i], f"d/dx of row {i} alone vs in a batch of {m}", ctx)
    lo = m // 3
    sub = slice(lo, lo + max(1, m // 4))
    ys, _, dxs, _ = run(op, x[sub], -1, seed=seed, scale=scale, mask=mask[sub], grad=g[sub])
    assert_same_bits(ys, y[sub], f"rows {sub} as their own batch", ctx)
    assert_same_bits(dxs, dx[sub], f"d/dx of rows {sub} as their own batch", ctx)
    flip = torch.arange(m - 1, -1, -1)
    yf, _, dxf, _ = run(op, x[flip], -1, seed=seed, scale=scale, mask=mask[flip], grad=g[flip])
    assert_same_bits(yf, y[flip], "rows in reversed order", ctx)
    assert_same_bits(dxf, dx[flip], "d/dx of rows in reversed order", ctx)


@pytest.mark.parametrize("op", OPS)
@given(seed=seeds())
def test_row_bits_do_not_depend_on_memory_layout(triton_backend, op, seed):
    # The reduction order depends only on the row length, dtype and op (section 6), not on strides.
    x = seed.randn(24, 300, std=3.0)
    g = seed.randn(*call(op, x, -1).shape)
    y, _, dx, _ = run(op, x, -1, seed=seed, grad=g)
    column_major = x.t().contiguous().t()
    yc, _, dxc, _ = run(op, column_major, -1, seed=seed, grad=g)
    assert_same_bits(yc, y, "row-major vs column-major input", f"triton; {seed}")
    assert_same_bits(dxc, dx, "d/dx row-major vs column-major input", f"triton; {seed}")


# --------------------------------------------------------------------------------------------------
# Section 2, bf16 at the edges: subnormal inputs and results, and round-to-nearest-even outputs. Fixed bit
# patterns, no random draws. Under Triton's interpreter numpy has no bf16 (it holds the raw 16 bits): the
# kernels' conversions must not go through its truncating, subnormal-mangling casts (section 8: no silent
# wrong answer). Each row of values sits in a row of -inf (excluded) padding, short (the row-resident
# kernels) or 40000 long (the split kernels, forward and backward).
# --------------------------------------------------------------------------------------------------

BF16_EDGE_LAYOUTS = {"rows": 24, "split": 40000}
BF16_SUBNORMALS = [1e-39, -1e-39, 3e-40, -2e-40, 9.2e-41, -9.2e-41, 5e-39, 1.1e-38]  # all below 2**-126
BF16_GRADS = [1.0, -2e-39, 0.5, 3e-39, -1.0, 1e-39, -0.75, 2.0]  # normal and subnormal incoming gradients


def _bf16_edge_rows(values: list[list[float]], n: int, padding: float = -math.inf) -> torch.Tensor:
    """(rows, n) bf16: row i holds values[i] spread over its length (in several split ranges), padding
    elsewhere."""
    k = len(values[0])
    x = torch.full((len(values), n), padding, dtype=torch.float64)
    x[:, torch.arange(k) * (n // k)] = torch.tensor(values, dtype=torch.float64)
    return x.to(torch.bfloat16)


def _bf16_edge_check(op: str, x: torch.Tensor, scale, g: torch.Tensor, ctx: str):
    """Output, d/dx and (tensor scale) d/dscale against the oracle; returns (y, dx, oracle result)."""
    y, _, dx, dscale = run(op, x, -1, seed=None, scale=scale, grad=g)
    r = O.evaluate(op, x, -1, scale=scale)
    O.assert_close(y, r.out, O.output_bound(op, r, x.dtype), f"{op} output", ctx)
    ex, es = O.gradients(op, x, g, -1, scale=scale)
    bx, bs = O.gradient_bounds(op, r, g, x, scale=scale)
    O.assert_close(dx, ex, bx, f"{op} d/dx", ctx)
    if isinstance(scale, torch.Tensor):
        O.assert_close(dscale, es, bs, f"{op} d/dscale", ctx)
    return y, dx, r


def _incoming(op: str, x: torch.Tensor, values: list[float]) -> torch.Tensor:
    """A bf16 gradient of op's output shape: the values at the positions _bf16_edge_rows filled, 0 elsewhere
    (logsumexp: one value per row)."""
    if op == "logsumexp":
        return torch.tensor(values[:x.shape[0]], dtype=torch.bfloat16)
    return _bf16_edge_rows([values] * x.shape[0], x.shape[1], padding=0.0)


def _subnormal_case(case: str, op: str, n: int):
    """(x, scale, incoming gradient) of a named case."""
    if case == "subnormal_x":  # subnormal logits scaled into the normal range, subnormal incoming gradients
        x = _bf16_edge_rows([BF16_SUBNORMALS, BF16_SUBNORMALS[::-1]], n)
        return x, 1e38, _incoming(op, x, BF16_SUBNORMALS[2:] + BF16_SUBNORMALS[:2])
    if case == "subnormal_scale_tensor":
        x = _bf16_edge_rows([[1e38, 0.0, -5e37, 2e38, -1e38, 3e37, 0.0, 1e37]], n)
        return x, torch.tensor(1e-39, dtype=torch.bfloat16), _incoming(op, x, BF16_GRADS)
    if case == "subnormal_results":  # probabilities exp(-88) .. exp(-92) and gradients through them
        x = _bf16_edge_rows([[0.0, -88.5, -89.0, -90.0, -91.0, -92.0, -88.0, -80.0],
                             [-1.0, -89.5, 0.0, -90.5, -91.5, -88.25, -87.5, -2.0]], n)
        return x, None, _incoming(op, x, BF16_GRADS)
    # one subnormal logit per row (logsumexp stores it back)
    x = _bf16_edge_rows([[v] for v in BF16_SUBNORMALS[::2]], n)
    return x, None, _incoming(op, x, BF16_GRADS)


# The scale tensor is read by the same code in every kernel: the short rows cover it.
SUBNORMAL_CASES = [pytest.param(op, case, layout, id=f"{op}-{case}-{layout}") for op in O.OPS
                   for case in ("subnormal_x", "subnormal_scale_tensor", "subnormal_results")
                   for layout in BF16_EDGE_LAYOUTS if (case, layout) != ("subnormal_scale_tensor", "split")]
SUBNORMAL_CASES += [pytest.param("logsumexp", "one_logit", layout, id=f"logsumexp-one_logit-{layout}")
                    for layout in BF16_EDGE_LAYOUTS]


@pytest.mark.parametrize("op,case,layout", SUBNORMAL_CASES)
def test_bf16_subnormals_forward_and_backward(backend, op, case, layout):
    x, scale, g = _subnormal_case(case, op, BF16_EDGE_LAYOUTS[layout])
    ctx = f"{backend} {case} {layout}"
    y, _, r = _bf16_edge_check(op, x, scale, g, ctx)
    if case == "subnormal_results" and op == "softmax":
        tiny = r.keep & (r.p < torch.finfo(torch.bfloat16).tiny)
        assert tiny.sum() >= 10 and (y.double()[tiny] > 0).all(), f"subnormal probabilities: {y[tiny]}; {ctx}"
    if case == "one_logit":  # the logsumexp of one logit is that logit, bit for bit
        assert_same_bits(y, x.amax(-1), "logsumexp of one subnormal logit", ctx)


# x * NEAREST_SCALE is exact in fp32 for these bf16 x, so the one rounding to bf16 decides: above, below
# and exactly halfway (1.5 and 3.0: the even neighbour is the one above, truncation gives the odd one).
NEAREST_SCALE = 1.0 + 2.0**-7
NEAREST_X = [1.5, 1.25, 1.75, 1.0078125, 3.0, -1.5]


@pytest.mark.parametrize("layout", list(BF16_EDGE_LAYOUTS))
@pytest.mark.parametrize("op", OPS)
def test_bf16_outputs_round_to_nearest_even(backend, op, layout):
    # Where the fp32 result is exact, the bf16 output is its nearest-even rounding (section 2: rounded once,
    # at the end), bit for bit; a truncating conversion is an ulp off in several of these.
    n = BF16_EDGE_LAYOUTS[layout]
    ctx = f"{backend} {layout}"
    if op == "softmax":
        # Rows of N equal logits: every exp(z - m) is 1, l = N, p = fp32(1 / N) (one correctly rounded
        # division), none of them halfway between bf16 values.
        sizes = [3, 7, 9, 13]
        x = torch.full((len(sizes), n), -math.inf, dtype=torch.bfloat16)
        for i, size in enumerate(sizes):
            x[i, torch.arange(size) * (n // size)] = 0.0
        y, _, _ = _bf16_edge_check(op, x, None, _incoming(op, x, BF16_GRADS), ctx)
        expected = (1.0 / torch.tensor(sizes, dtype=torch.float64)).to(torch.float32).to(torch.bfloat16)
        assert_same_bits(y.amax(-1), expected, "softmax of N equal logits", f"{ctx}; N = {sizes}")
    elif op == "logsumexp":
        # One logit per row: lse = z = x * scale exactly, d/dx = g * scale exactly.
        x = _bf16_edge_rows([[v] for v in NEAREST_X], n)
        g = torch.tensor(NEAREST_X[::-1], dtype=torch.bfloat16)
        y, dx, _ = _bf16_edge_check(op, x, NEAREST_SCALE, g, ctx)
        z = x.amax(-1).double() * NEAREST_SCALE
        assert_same_bits(y, z.to(torch.bfloat16), "logsumexp of one logit times the scale", ctx)
        assert_same_bits(dx.sum(-1), (g.double() * NEAREST_SCALE).to(torch.bfloat16),
                         "d/dx of logsumexp of one logit", ctx)
    else:
        # log_softmax of [0, x_1, x_2, ...]: every z_j = x_j * scale <= -128 underflows exp to 0, so l = 1,
        # log(l) = 0 and output j is z_j exactly; with incoming gradient [1, g_1, g_2, ...], d/dx is
        # [-sum(g), g_1, g_2, ...] * scale exactly.
        x = _bf16_edge_rows([[0.0] + [-128.0 * abs(v) for v in NEAREST_X]], n)
        g = _incoming(op, x, [1.0] + NEAREST_X)
        y, dx, _ = _bf16_edge_check(op, x, NEAREST_SCALE, g, ctx)
        kept = torch.isfinite(x[0])
        z = x[0, kept][1:].double() * NEAREST_SCALE
        assert_same_bits(y[0, kept][1:], z.to(torch.bfloat16), "log_softmax of dominated logits", ctx)
        d = g[0, kept].double() * NEAREST_SCALE
        d[0] = -d[1:].sum()
        assert_same_bits(dx[0, kept], d.to(torch.bfloat16), "d/dx of log_softmax", ctx)
