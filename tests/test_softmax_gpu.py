"""GPU-only tests of softmax, log_softmax and logsumexp: the compiled Triton kernels on CUDA.

Everything here needs a CUDA device and is skipped without one. CPU CI cannot check these clauses of
CONTRACT.md, because Triton's interpreter ignores ``enable_fp_fusion`` and rounds some casts its own way:

- numerics against a float64 oracle written here from the math (independent of ``safeops.reference``):
  fp16 / bf16 / fp32, N from 1 to 300,000 plus the single-block/split boundaries, many layouts (section 2);
- the seed scalar (x = 1134139801600.0, scale = 0.180336877703666687) exactly 1/N, log_softmax of a
  dominating logit exactly 0.0, on the single-block and the split paths (section 1);
- the fp-fusion regression: with ``safeops._config.fp_fusion = True`` the seed case breaks, with it off it
  is exact, so the test would notice contraction coming back; it FAILS (it does not skip) when fusion-on no
  longer breaks the seed case, because then it has lost its power. A second test reads Triton's JIT cache
  in a fresh process: every safeops kernel compiled with enable_fp_fusion=False, no fma.rn.f32 in its PTX
  (section 1);
- empty, all -inf, NaN and +inf rows with their gradients (sections 4 and 5);
- bf16 ``softmax(x).sum()`` backward is (nearly) zero (section 3);
- determinism, batch invariance and eager == torch.compile, bit for bit (section 6);
- a 4,194,304-column row and a tensor of more than 2**31 elements (sections 8 and the issue's row range).

``SAFEOPS_GPU_SMALL=1`` shrinks every shape and skips the huge tests (for compute-sanitizer runs).
Random inputs come from Hypothesis (a drawn seed; profiles in tests/conftest.py): a failure prints the
``CudaRng(n)`` that replays it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import examples

import safeops
from safeops import _config
from safeops._seed import FMA_SCALE, FMA_X, userland_inputs, userland_loss
from safeops.ops import softmax_launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
SMALL = os.environ.get("SAFEOPS_GPU_SMALL", "0").strip() not in ("", "0")

OPS = ("softmax", "log_softmax", "logsumexp")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NEG_INF = float("-inf")

# 1/sqrt(128): not a power of two, so z = fp32(x) * fp32(scale) really rounds. With X_STD the logits z have a
# standard deviation of about 2.7, so probabilities span many binades.
SCALE = 0.08838834764831845
X_STD = 30.0


def _split_boundaries() -> set[int]:
    """The single-block / split boundary of every element size (and one past it), read from the launcher
    so that retuning the table keeps both sides covered."""
    limits = [*getattr(softmax_launch, "ROW_RESIDENT_MAX_COLS", {}).values(),
              *getattr(softmax_launch, "ROW_RESIDENT_MAX_COLS_FWD", {}).values()]
    return {int(v) for v in limits} | {int(v) + 1 for v in limits}


BASE_N = (1, 7, 256, 1000, 4096, 16384, 16385, 65536, 300000)
N_LIST = (1, 7, 1000, 16385, 65536) if SMALL else tuple(sorted(set(BASE_N) | _split_boundaries()))
# Row lengths that take the split (long-row) path for every dtype today.
SPLIT_N = (65536,) if SMALL else (16385, 65536, 300000)


def _rows_for(n: int) -> int:
    """Few rows for long rows; more than one block of rows (and a ragged last block) for short ones."""
    return 3 if SMALL else max(3, min(513, 2**20 // n))


# --------------------------------------------------------------------------------------------------
# Tolerances (contract section 2), as data
# --------------------------------------------------------------------------------------------------

# Rounding of the result to its output dtype, in ulps of that dtype: "about one ulp".
OUT_ULPS = {torch.float16: 1.0, torch.bfloat16: 1.0, torch.float32: 1.0, torch.float64: 1.0}
# fp32 internals, in units of U32 (the fp32 unit roundoff), on top of OUT_ULPS:
U32 = 2.0**-24
ARG_FACTOR = 3.0  # exp(t) loses |t| * U32 to the rounding of z - m and of t * log2(e): relative error ~ |t|
EXP_TERMS = 8.0  # the approximate exp / log instructions and the division
SUM_SLACK = 32.0  # the row sum beyond log2(N): tree sums, the split path's rescales and partial combines
FLUSH_FLOOR = 2.0**-126  # fp32 results under the smallest normal may flush to zero

PRECISION_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}
MIN_NORMAL_EXP = {torch.float16: -14, torch.bfloat16: -126, torch.float32: -126, torch.float64: -1022}
INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
            torch.float64: torch.int64}


def ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at |ref| (float64 in, float64 out), subnormals included."""
    a = torch.where(torch.isfinite(ref), ref, torch.zeros_like(ref)).abs()
    _, e = torch.frexp(a)  # a = mantissa * 2**e, mantissa in [0.5, 1): a lies in [2**(e-1), 2**e)
    e = torch.clamp(e - 1, min=MIN_NORMAL_EXP[dtype])
    e = torch.where(a == 0, torch.full_like(e, MIN_NORMAL_EXP[dtype]), e)  # 0: the smallest subnormal
    return torch.ldexp(torch.ones_like(a), e - (PRECISION_BITS[dtype] - 1))


# --------------------------------------------------------------------------------------------------
# Random inputs on the GPU from a drawn seed (Hypothesis): a failure prints the CudaRng(n) that replays it
# --------------------------------------------------------------------------------------------------


class CudaRng:
    def __init__(self, value: int):
        self.value = value
        self.gen = torch.Generator(device=DEV)
        self.gen.manual_seed(value)

    def __str__(self) -> str:
        return f"seed={self.value}"

    def __repr__(self) -> str:
        return f"CudaRng({self.value})"

    def randn(self, shape, dtype=torch.float32, std: float = X_STD) -> torch.Tensor:
        if math.prod(shape) >= 2**26:  # huge: draw in the target dtype, no fp32 temporaries
            return torch.randn(shape, device=DEV, dtype=dtype, generator=self.gen).mul_(std)
        return (torch.randn(shape, device=DEV, dtype=torch.float32, generator=self.gen) * std).to(dtype)

    def rand(self, shape) -> torch.Tensor:
        return torch.rand(shape, device=DEV, dtype=torch.float32, generator=self.gen)


def rngs():
    return st.integers(0, 2**31 - 1).map(CudaRng)


@pytest.fixture(autouse=True)
def _compiled_kernels_on_cuda(monkeypatch):
    """Every test here runs the compiled kernels through the default backend choice."""
    monkeypatch.setenv("SAFEOPS_BACKEND", "auto")
    from triton.runtime.interpreter import InterpretedFunction

    module = softmax_launch.kernels()
    if any(isinstance(v, InterpretedFunction) for v in vars(module).values()):
        pytest.fail("Triton's interpreter is on in this process (TRITON_INTERPRET=1 was set before triton "
                    "was imported), so the GPU tests would not run the compiled kernels; run them in a "
                    "process without TRITON_INTERPRET")
    assert _config.fp_fusion is False, "safeops._config.fp_fusion must be False (the shipped setting)"
    yield
    _config.fp_fusion = False


@contextlib.contextmanager
def long_rows(mode: str):
    """'default', or 'two_launch': the two-launch long-row path where the loop backward would run."""
    if mode == "default":
        yield
        return
    assert mode == "two_launch", mode
    old = softmax_launch.LOOP_MAX_COLS_BWD
    softmax_launch.LOOP_MAX_COLS_BWD = {}
    try:
        yield
    finally:
        softmax_launch.LOOP_MAX_COLS_BWD = old


def call(op: str, x: torch.Tensor, dim: int = -1, **kwargs) -> torch.Tensor:
    return getattr(safeops, op)(x, dim, **kwargs)


# --------------------------------------------------------------------------------------------------
# The float64 oracle, from the math (contract sections 1-4)
# --------------------------------------------------------------------------------------------------


def _scale64(scale) -> float | None:
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        return float(scale.detach().float())
    return float(torch.tensor(scale, dtype=torch.float32))


def oracle_z(x: torch.Tensor, scale=None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The one materialized value per logit as float64: ``fp32(x) * fp32(scale)``, one fp32 rounding;
    excluded entries (mask False) are -inf whatever x holds there, NaN included."""
    z = x.detach().float()
    if scale is not None:
        s = scale.detach() if isinstance(scale, torch.Tensor) else torch.tensor(scale)
        z = z * s.to(device=z.device, dtype=torch.float32)  # one IEEE fp32 multiply, no fma
    z = z.double()
    if mask is not None:
        z = torch.where(mask.expand(z.shape), z, torch.full((), NEG_INF, dtype=z.dtype, device=z.device))
    return z


def oracle_stats(z: torch.Tensor, dim: int) -> dict:
    m = z.amax(dim, keepdim=True)  # NaN propagates, as it should
    zero = z.new_zeros(())
    m_safe = torch.where(m == NEG_INF, zero, m)
    t = z - m_safe
    e = torch.exp(t)
    l = e.sum(dim, keepdim=True)
    p = torch.where(l == 0, zero, e / l)
    return {"m": m, "t": t, "l": l, "p": p, "log_l": torch.log(l), "n": z.shape[dim], "dim": dim}


def oracle_forward(op: str, z: torch.Tensor, dim: int) -> tuple[torch.Tensor, dict]:
    st = oracle_stats(z, dim)
    if op == "softmax":
        ref = st["p"]
    elif op == "log_softmax":
        ref = torch.where(st["l"] == 0, z.new_full((), NEG_INF), st["t"] - st["log_l"])
    else:
        # A row whose max is +inf holds no NaN (amax propagates NaN): its lse is +inf, as torch.logsumexp
        # gives (section 5); m + log(l) would be NaN, l being NaN there.
        ref = torch.where(st["m"] == math.inf, math.inf, st["m"] + st["log_l"]).squeeze(dim)
    return ref, st


def oracle_backward(op: str, st: dict, z: torch.Tensor, g: torch.Tensor, scale=None) -> torch.Tensor:
    """d(sum(out * g)) / dx in float64, for the op as a function of z = x * scale."""
    dim = st["dim"]
    keep = z != NEG_INF
    p = st["p"]
    g = g.detach().double()
    zero = z.new_zeros(())
    if op == "softmax":
        dz = p * (g - torch.where(keep, g * p, zero).sum(dim, keepdim=True))
    elif op == "log_softmax":
        dz = g - p * torch.where(keep, g, zero).sum(dim, keepdim=True)
    else:
        dz = g.unsqueeze(dim) * p
    dz = torch.where(keep, dz, zero)  # excluded entries influence nothing
    s = _scale64(scale)
    return dz * s if s is not None else dz


def _finite_abs(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(t), t.abs(), torch.zeros_like(t))


def _row_sum_error(st: dict) -> torch.Tensor:
    """Relative error allowance of the fp32 row sum l, per row (keepdim)."""
    weighted = torch.nan_to_num(st["p"] * _finite_abs(st["t"]), nan=0.0).sum(st["dim"], keepdim=True)
    return U32 * (math.log2(max(st["n"], 2)) + SUM_SLACK + 2.0 * weighted)


def forward_budget(op: str, st: dict, ref: torch.Tensor) -> torch.Tensor:
    """Absolute float64 error the fp32 internals may add on top of the output rounding."""
    tt, L, ll = _finite_abs(st["t"]), _row_sum_error(st), _finite_abs(st["log_l"])
    if op == "softmax":
        b = st["p"] * (U32 * (ARG_FACTOR * tt + EXP_TERMS) + L)
    elif op == "log_softmax":
        b = U32 * (ARG_FACTOR * tt + 2.0 * _finite_abs(ref) + 2.0 * ll + EXP_TERMS) + L
    else:
        b = (U32 * (2.0 * _finite_abs(st["m"] + st["log_l"]) + 2.0 * ll + EXP_TERMS) + L).squeeze(st["dim"])
    return torch.nan_to_num(b, nan=0.0, posinf=0.0)


def backward_budget(op: str, st: dict, z: torch.Tensor, g: torch.Tensor, ref: torch.Tensor,
                    scale=None) -> torch.Tensor:
    dim = st["dim"]
    keep = z != NEG_INF
    p = torch.nan_to_num(st["p"], nan=0.0)
    e_p = U32 * (ARG_FACTOR * _finite_abs(st["t"]) + EXP_TERMS + 4.0) + _row_sum_error(st)
    log2n = math.log2(max(st["n"], 2))
    g = g.detach().double()
    if op == "logsumexp":
        g = g.unsqueeze(dim)
    ag = torch.where(keep, g.abs(), torch.zeros_like(p))
    s = abs(_scale64(scale)) if scale is not None else 1.0
    if op == "softmax":
        G = torch.where(keep, g * p, torch.zeros_like(p)).sum(dim, keepdim=True)
        G_err = (ag * p * e_p).sum(dim, keepdim=True) + U32 * (log2n + 4.0) * (ag * p).sum(dim, keepdim=True)
        b = s * (p * e_p * (g - G).abs() + p * G_err)
    elif op == "log_softmax":
        S = torch.where(keep, g, torch.zeros_like(p)).sum(dim, keepdim=True)
        S_err = U32 * (log2n + 4.0) * ag.sum(dim, keepdim=True)
        b = s * (p * e_p * S.abs() + p * S_err + U32 * (ag + p * S.abs()))
    else:
        b = s * ag * p * e_p
    b = b + 2.0 * U32 * _finite_abs(ref)
    return torch.nan_to_num(b, nan=0.0, posinf=0.0)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, budget: torch.Tensor, what: str) -> None:
    """NaN and +-inf exactly where the oracle has them; elsewhere within OUT_ULPS ulps of the output dtype
    plus the fp32 budget."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o = out.detach().double()
    ref_nan = torch.isnan(ref)
    nan_diff = torch.isnan(o) != ref_nan
    if nan_diff.any():
        idx = nan_diff.nonzero()[:4].tolist()
        raise AssertionError(f"{what}: {int(nan_diff.sum())} elements NaN in one of output/oracle only, "
                             f"first at {idx}: out={[o[tuple(i)].item() for i in idx]} "
                             f"oracle={[ref[tuple(i)].item() for i in idx]}")
    ref_inf = torch.isinf(ref)
    inf_diff = ref_inf & (o != ref)
    if inf_diff.any():
        idx = inf_diff.nonzero()[:4].tolist()
        raise AssertionError(f"{what}: oracle is infinite but output differs at {idx}: "
                             f"out={[o[tuple(i)].item() for i in idx]} "
                             f"oracle={[ref[tuple(i)].item() for i in idx]}")
    finite = ~(ref_nan | ref_inf)
    err = torch.where(finite, (o - ref).abs(), torch.zeros_like(o))
    tol = ulp(ref, out.dtype) * OUT_ULPS[out.dtype] + budget + FLUSH_FLOOR
    bad = finite & ~(err <= tol)
    if bad.any():
        ratio = torch.where(bad, torch.nan_to_num(err / tol, nan=math.inf), torch.zeros_like(err))
        flat = int(ratio.argmax())
        i = tuple(int(k) for k in torch.unravel_index(torch.tensor(flat), ratio.shape))
        ulps = (err[i] / ulp(ref, out.dtype)[i]).item()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {out.numel()} elements off; worst at {list(i)}: "
            f"out={o[i].item()!r} oracle={ref[i].item()!r} error={err[i].item():.3e} = {ulps:.2f} "
            f"ulp of {out.dtype} (allowed {tol[i].item():.3e})")


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), \
        f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    ai = a.detach().contiguous().view(INT_VIEW[a.dtype])
    bi = b.detach().contiguous().view(INT_VIEW[b.dtype])
    if not torch.equal(ai, bi):
        diff = ai != bi
        idx = diff.nonzero()[:3].tolist()
        raise AssertionError(f"{what}: {int(diff.sum())} of {a.numel()} elements differ in their bits, "
                             f"first at {idx}: {[a[tuple(i)].item() for i in idx]} vs "
                             f"{[b[tuple(i)].item() for i in idx]}")


def check_forward_backward(op, x, out, g, dim, what, scale=None, mask=None, wrt=None):
    """Forward vs the oracle; then d(sum(out * g))/d``wrt`` (default x) vs the oracle."""
    z = oracle_z(x, scale, mask)
    dim = dim % max(x.dim(), 1)
    ref, st = oracle_forward(op, z, dim)
    assert_matches(out, ref, forward_budget(op, st, ref), f"{what} forward")
    (dx,) = torch.autograd.grad(out, wrt if wrt is not None else x, g)
    ref_dx = oracle_backward(op, st, z, g, scale)
    assert_matches(dx, ref_dx, backward_budget(op, st, z, g, ref_dx, scale), f"{what} backward")
    return st, z


def uniform(n: int, dtype: torch.dtype) -> torch.Tensor:
    """1/N as the kernels must produce it: an IEEE fp32 division (l = N exactly), then one rounding."""
    return (torch.ones((), dtype=torch.float32) / n).to(dtype).to(DEV)


# --------------------------------------------------------------------------------------------------
# Numerics against the oracle: every dtype, op and row length (contract section 2)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", N_LIST)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
@given(rng=rngs())
def test_matches_oracle(op, dtype, n, rng):
    rows = _rows_for(n)
    x = rng.randn((rows, n), dtype).requires_grad_()
    out = call(op, x, scale=SCALE)
    assert out.dtype == dtype and out.device == x.device
    g = rng.randn(out.shape, dtype, std=1.0)
    check_forward_backward(op, x, out, g, -1, f"{op} {dtype} N={n} rows={rows} {rng}", scale=SCALE)


@pytest.mark.parametrize("n", SPLIT_N)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("op", OPS)
@given(rng=rngs())
def test_matches_oracle_two_launch_long_rows(op, dtype, n, rng):
    """The two-launch long-row path on the GPU, where the loop backward would take the 16K-32K rows."""
    x = rng.randn((3, n), dtype).requires_grad_()
    g = rng.randn((3, n) if op != "logsumexp" else (3,), dtype, std=1.0)
    with long_rows("two_launch"):
        out = call(op, x, scale=SCALE)
        check_forward_backward(op, x, out, g, -1, f"{op} {dtype} N={n} two-launch {rng}", scale=SCALE)


# Layouts: (name, dtypes). Each builds (leaf, view, dim, kwargs); the view is what the op sees.
LAYOUTS = {
    "transposed": (torch.bfloat16, torch.float32),
    "dim0": (torch.bfloat16, torch.float32),
    "strided_cols": (torch.bfloat16,),
    "sliced_rows": (torch.bfloat16,),
    "middle_dim": (torch.bfloat16,),
    "many_batch_dims": (torch.bfloat16,),
    "expanded_x": (torch.bfloat16,),
    "mask_broadcast": (torch.bfloat16, torch.float32),
    "mask_per_row": (torch.bfloat16,),
    "scale_none": (torch.bfloat16, torch.float16),
    "scale_tensor": (torch.bfloat16, torch.float32),
    "scale_cpu_tensor": (torch.bfloat16,),
    "out_dtype_fp32": (torch.bfloat16, torch.float16),
    "out_dtype_bf16": (torch.float32,),
    "offset_logits": (torch.bfloat16, torch.float32),
}


def build_layout(name: str, n: int, dtype: torch.dtype, rng: CudaRng):
    kw: dict = {"scale": SCALE}
    dim = -1
    if name == "transposed":
        leaf = rng.randn((n, 5), dtype)
        view = lambda b: b.t()  # the reduced dim has stride 5
    elif name == "dim0":
        leaf = rng.randn((n, 6), dtype)
        view, dim = (lambda b: b), 0
    elif name == "strided_cols":
        leaf = rng.randn((4, 2 * n + 3), dtype)
        view = lambda b: b[:, 1:2 * n + 1:2]  # column stride 2, storage offset 1
    elif name == "sliced_rows":
        leaf = rng.randn((9, n + 5), dtype)
        view = lambda b: b[1::2, 2:n + 2]
    elif name == "middle_dim":
        leaf = rng.randn((3, n, 4), dtype)
        view, dim = (lambda b: b), 1
    elif name == "many_batch_dims":
        # Four batch dims that do not merge: the launcher's contiguous-copy fallback.
        leaf = rng.randn((3, 4, 5, 6, n), dtype)
        view = lambda b: b.permute(3, 1, 0, 2, 4)[:, ::2]
    elif name == "expanded_x":
        leaf = rng.randn((4, 1, n), dtype)
        view = lambda b: b.expand(4, 3, n)  # a stride-0 batch dim
    elif name == "mask_broadcast":
        leaf = rng.randn((2, 3, 4, n), dtype)
        view = lambda b: b
        mask = rng.rand((2, 1, 1, n)) < 0.7
        mask[1] = False  # 12 fully masked rows, through a stride-0 mask
        kw["mask"] = mask
    elif name == "mask_per_row":
        leaf = rng.randn((2, 3, 4, n), dtype)
        view = lambda b: b
        kw["mask"] = rng.rand((2, 3, 4, 1)) < 0.6  # column stride 0: rows kept or dropped whole
    elif name == "scale_none":
        leaf = rng.randn((5, n), dtype, std=3.0)
        view = lambda b: b
        kw = {}
    elif name == "scale_tensor":
        leaf = rng.randn((5, n), dtype)
        view = lambda b: b
        kw["scale"] = torch.tensor(SCALE, device=DEV, requires_grad=True)
    elif name == "scale_cpu_tensor":
        leaf = rng.randn((5, n), dtype)
        view = lambda b: b
        kw["scale"] = torch.tensor(SCALE)
    elif name == "out_dtype_fp32":
        leaf = rng.randn((5, n), dtype)
        view = lambda b: b
        kw["dtype"] = torch.float32
    elif name == "out_dtype_bf16":
        leaf = rng.randn((5, n), dtype)
        view = lambda b: b
        kw["dtype"] = torch.bfloat16
    elif name == "offset_logits":
        # Shift invariance at magnitude: z ~ 1000 +- 3, where bf16 x is coarse (steps of ~5.6 in z).
        leaf = (rng.randn((5, n), torch.float32) + 1000.0 / SCALE).to(dtype)
        view = lambda b: b
    else:
        raise AssertionError(name)
    return leaf.requires_grad_(), view, dim, kw


LAYOUT_PARAMS = [
    pytest.param(op, name, dtype, n, id=f"{op}-{name}-{str(dtype).split('.')[-1]}-{n}")
    for name, dtypes in LAYOUTS.items()
    for dtype in (dtypes[:1] if SMALL else dtypes)
    for op in OPS
    for n in (1000, 65536)
    if not (op == "logsumexp" and name.startswith("out_dtype"))
]


@pytest.mark.parametrize("op,name,dtype,n", LAYOUT_PARAMS)
@given(rng=rngs())
def test_layouts_match_oracle(op, name, dtype, n, rng):
    leaf, view, dim, kw = build_layout(name, n, dtype, rng)
    x = view(leaf)
    out = call(op, x, dim, **kw)
    expected_dtype = kw.get("dtype") or dtype
    assert out.dtype == expected_dtype
    g = rng.randn(out.shape, out.dtype, std=1.0)
    scale = kw.get("scale")
    what = f"{op} {name} {dtype} N={n} x{tuple(x.shape)} strides {x.stride()} dim={dim} {rng}"
    wrt = [x, scale] if isinstance(scale, torch.Tensor) and scale.requires_grad else [x]
    z = oracle_z(x, scale, kw.get("mask"))
    d = dim % x.dim()
    ref, st = oracle_forward(op, z, d)
    assert_matches(out, ref, forward_budget(op, st, ref), f"{what} forward")
    grads = torch.autograd.grad(out, wrt, g)
    ref_dx = oracle_backward(op, st, z, g, scale)
    assert_matches(grads[0], ref_dx, backward_budget(op, st, z, g, ref_dx, scale), f"{what} backward")
    if len(grads) == 2:
        # d/dscale = sum(dz * fp32(x)): compare with the oracle, allowing each dz its own budget.
        dz = oracle_backward(op, st, z, g, None)
        xf = x.detach().double()
        ref_ds = (dz * xf).sum()
        dz_budget = backward_budget(op, st, z, g, dz, None)
        tol = ((xf.abs() * dz_budget).sum() + U32 * (math.log2(x.numel()) + 8) * (dz * xf).abs().sum()
               + 2 * U32 * ref_ds.abs() + 1e-30)
        assert torch.isfinite(grads[1]), f"{what}: d/dscale is {grads[1].item()}"
        assert (grads[1].double() - ref_ds).abs() <= tol, \
            f"{what}: d/dscale {grads[1].item()!r} vs oracle {ref_ds.item()!r} (allowed {tol.item():.3e})"


# --------------------------------------------------------------------------------------------------
# The seed scalar and the fma hazard (contract section 1)
# --------------------------------------------------------------------------------------------------

SEED_N = (7, 65536) if SMALL else (1, 7, 1000, 4096, 8192, 16385, 65536)
SEED_SCALES = [
    pytest.param(torch.float32, "float", id="fp32-float"),
    pytest.param(torch.float32, "tensor_fp32", id="fp32-tensor"),
    pytest.param(torch.bfloat16, "float", id="bf16-float"),
    pytest.param(torch.bfloat16, "tensor_fp32", id="bf16-tensor_fp32"),
    pytest.param(torch.bfloat16, "tensor_like_x", id="bf16-tensor_bf16"),
]


def seed_scale(kind: str, dtype: torch.dtype):
    if kind == "float":
        return FMA_SCALE
    return torch.tensor(FMA_SCALE, dtype=torch.float32 if kind == "tensor_fp32" else dtype, device=DEV)


@pytest.mark.parametrize("n", SEED_N)
@pytest.mark.parametrize("dtype,scale_kind", SEED_SCALES)
def test_seed_scalar_row_is_exact(dtype, scale_kind, n):
    scale = seed_scale(scale_kind, dtype)
    what = f"seed scalar {dtype} scale={scale_kind} N={n}"
    x = torch.full((3, n), FMA_X, dtype=dtype, device=DEV, requires_grad=True)
    z = (x.detach().float() * torch.tensor(_scale64(scale), dtype=torch.float32, device=DEV))[0, 0]

    p = safeops.softmax(x, scale=scale)
    assert_bitwise(p, uniform(n, dtype).expand(3, n), f"{what}: softmax must be exactly 1/N")
    lsm = safeops.log_softmax(x, scale=scale)
    assert torch.isfinite(lsm).all() and (lsm <= 0).all(), f"{what}: log_softmax {lsm[0, :4].tolist()}"
    ref = torch.full((3, n), -math.log(n), dtype=torch.float64, device=DEV)
    assert_matches(lsm, ref, torch.full_like(ref, U32 * (math.log(n) + EXP_TERMS)), f"{what}: log_softmax")
    lse = safeops.logsumexp(x, scale=scale)
    # m + log(N) rounds back to m: log(N) is far below half an ulp of m ~ 2e11.
    assert_bitwise(lse, z.to(dtype).expand(3), f"{what}: logsumexp must be exactly the logit")

    (dx,) = torch.autograd.grad(p.sum(), x)
    assert torch.isfinite(dx).all() and dx.abs().max() <= 1e-6, \
        f"{what}: grad of softmax(x).sum() should be ~0, max |dx| = {dx.abs().max().item()}"
    (dx,) = torch.autograd.grad(safeops.log_softmax(x, scale=scale).sum(), x)
    assert torch.isfinite(dx).all(), f"{what}: log_softmax gradient not finite"

    # One dominating logit: softmax exactly 1 there and 0 elsewhere, log_softmax exactly 0.0 there.
    j = n // 3
    x2 = torch.full((2, n), FMA_X / 2, dtype=dtype, device=DEV)
    x2[:, j] = FMA_X
    p2 = safeops.softmax(x2, scale=scale)
    assert (p2[:, j] == 1.0).all(), f"{what}: dominating logit softmax {p2[:, j].tolist()} != 1.0"
    assert (p2.sum(-1) == 1.0).all(), f"{what}: other entries not exactly 0"
    l2 = safeops.log_softmax(x2, scale=scale)
    assert (l2[:, j] == 0.0).all(), f"{what}: log_softmax of the dominating logit {l2[:, j].tolist()} != 0.0"
    assert torch.isfinite(l2).all(), f"{what}: finite logits far below the max must stay finite"
    z2 = oracle_z(x2, scale)
    ref2, st2 = oracle_forward("log_softmax", z2, 1)
    assert_matches(l2, ref2, forward_budget("log_softmax", st2, ref2), f"{what}: log_softmax, dominating row")
    lse2 = safeops.logsumexp(x2, scale=scale)
    assert_bitwise(lse2, z2[:, j].float().to(dtype), f"{what}: logsumexp of the dominating row")


@functools.cache
def _fma_probe_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fma_probe(x_ptr, s_ptr, out_ptr, N: tl.constexpr):
        # The seed case as a plain kernel: z = x * s feeds both the max and the subtraction.
        offs = tl.arange(0, N)
        z = tl.load(x_ptr + offs) * tl.load(s_ptr)
        m = tl.max(z, 0)
        tl.store(out_ptr + offs, tl.exp(z - m))

    return fma_probe


def fma_probe(fusion: bool) -> float:
    """exp(x*s - max(x*s)) for the seed scalar in a minimal Triton kernel: 1.0 unless contracted."""
    x = torch.full((16,), FMA_X, dtype=torch.float32, device=DEV)
    s = torch.tensor([FMA_SCALE], dtype=torch.float32, device=DEV)
    out = torch.empty_like(x)
    _fma_probe_kernel()[(1,)](x, s, out, N=16, enable_fp_fusion=fusion)
    return float(out[0])


def test_fma_hazard_is_real_on_this_stack():
    """Control for the regression test below: on this Triton/GPU, contraction does break the seed case."""
    unfused, fused = fma_probe(False), fma_probe(True)
    assert unfused == 1.0, f"a plain kernel with enable_fp_fusion=False gave {unfused}, not 1.0"
    assert fused != 1.0, ("a plain kernel exp(x*s - max(x*s)) with enable_fp_fusion=True gave exactly 1.0: "
                          "this Triton no longer contracts the seed case, so the fp-fusion regression test "
                          "cannot show the hazard here")


FUSION_PARAMS = [
    pytest.param(4096, "default", id="single_block-4096"),
    pytest.param(65536, "default", id="split-65536"),
]


@pytest.mark.parametrize("scale_kind", ["float", "tensor_fp32"])
@pytest.mark.parametrize("n,mode", FUSION_PARAMS)
def test_seed_case_exact_with_fp_fusion_on_or_off(n, mode, scale_kind):
    """Two layers keep x*scale - m from becoming an fma: the kernels launch with enable_fp_fusion=False
    (test_kernels_compile_without_fp_contraction fails if that is turned back on: the rescale and the
    log_softmax backward then contract), and the select that excludes masked entries sits between the
    multiply and the subtraction. This checks the second layer: even with fusion on, the seed case is exact,
    while a plain kernel on this stack goes wrong (test_fma_hazard_is_real_on_this_stack)."""
    scale = seed_scale(scale_kind, torch.float32)
    x = torch.full((2, n), FMA_X, dtype=torch.float32, device=DEV)
    expected = uniform(n, torch.float32).expand(2, n)
    with long_rows(mode):
        safe = safeops.softmax(x, scale=scale)
        assert_bitwise(safe, expected, f"N={n} {mode}: fp fusion off must give exactly 1/N")
        old = _config.fp_fusion
        try:
            _config.fp_fusion = True
            fused = safeops.softmax(x, scale=scale)
            fused_log = safeops.log_softmax(x, scale=scale)
            torch.cuda.synchronize()
        finally:
            _config.fp_fusion = old
    assert _config.fp_fusion is False
    assert_bitwise(fused, expected, f"N={n} {mode}: with fp fusion on the code shape must still protect")
    assert torch.isfinite(fused_log).all()


_PTX_PROBE = r"""
import json, re, sys
import torch
import safeops
from safeops import _config
from safeops.ops import softmax_launch

assert _config.fp_fusion is False
torch.manual_seed(0)
for n in (1000, 20000, 65536):  # rows kernels, the loop backward, the two-launch kernels
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn((4, n), device="cuda", dtype=dtype, requires_grad=True)
        s = torch.tensor(0.125, device="cuda", requires_grad=True)
        mask = torch.rand((1, n), device="cuda") < 0.9
        for op in (safeops.softmax, safeops.log_softmax, safeops.logsumexp):
            for kw in ({"scale": 0.3}, {"scale": s, "mask": mask}):
                out = op(x, -1, **kw)
                torch.autograd.grad(out.float().sum(), [x] + ([s] if kw.get("scale") is s else []))
torch.cuda.synchronize()
found = []
for name, fn in vars(softmax_launch.kernels()).items():
    for entry in (getattr(fn, "device_caches", None) or {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        for kernel in getattr(cache, "values", lambda: [])():
            ptx = getattr(kernel, "asm", {}).get("ptx", "")
            found.append({"kernel": name, "fp_fusion": getattr(kernel.metadata, "enable_fp_fusion", None),
                          "fma": len(re.findall(r"\bfma\.rn\.f32", ptx))})
print("PTX_PROBE " + json.dumps(found))
"""


def test_kernels_compile_without_fp_contraction():
    """The power the seed-case test may lack: in a fresh process, run every op and path with the shipped
    settings, then read Triton's JIT cache: every safeops kernel variant must be compiled with
    enable_fp_fusion=False and its PTX must hold no fma.rn.f32 (contract section 1). Dropping the flag
    from any launch makes this fail even where the kernel's code shape happens to hide the hazard."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, SAFEOPS_BACKEND="auto")
    paths = [str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _PTX_PROBE], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"probe process failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PTX_PROBE ")), None)
    assert line is not None, f"probe printed no report:\n{proc.stdout[-2000:]}"
    found = json.loads(line[len("PTX_PROBE "):])
    assert found, ("found no compiled kernels in Triton's JIT cache (JITFunction.device_caches): this Triton "
                   "keeps them elsewhere; update _PTX_PROBE")
    fused = sorted({f["kernel"] for f in found if f["fp_fusion"] is not False})
    assert not fused, \
        f"compiled with fp fusion on (or unknown): {fused}; every launch needs enable_fp_fusion=False"
    with_fma = sorted({(f["kernel"], f["fma"]) for f in found if f["fma"]})
    assert not with_fma, (f"fma.rn.f32 in the PTX of {with_fma}: contraction (or an explicit fma) is back "
                          "in a safeops kernel; check that it cannot fuse x * scale with the subtraction of "
                          "the max")


# --------------------------------------------------------------------------------------------------
# Empty, -inf, NaN and +inf rows (contract sections 4 and 5)
# --------------------------------------------------------------------------------------------------

SPECIAL_N = (1000, 65536)


def special_rows(n: int, dtype: torch.dtype, rng: CudaRng):
    x = rng.randn((7, n), dtype)
    mask = torch.ones((7, n), dtype=torch.bool, device=DEV)
    x[1] = NEG_INF  # every logit -inf: an empty row
    mask[2] = False  # fully masked: an empty row
    x[3, 5] = float("nan")  # NaN row
    x[4, 9] = float("inf")  # +inf row: NaN, except logsumexp: +inf
    x[5, 11] = float("nan")  # excluded NaN: contributes nothing
    mask[5, 11] = False
    x[5, 13] = NEG_INF  # excluded by value
    x[6] = torch.finfo(dtype).min  # a real (finite) logit however negative: uniform
    return x, mask


@pytest.mark.parametrize("n", SPECIAL_N)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("op", OPS)
@given(rng=rngs())
def test_empty_nan_inf_rows(op, dtype, n, rng):
    x, mask = special_rows(n, dtype, rng)
    x.requires_grad_()
    what = f"{op} {dtype} N={n} {rng}"
    out = call(op, x, scale=SCALE, mask=mask)
    empty_value = 0.0 if op == "softmax" else NEG_INF
    for r in (1, 2):
        assert (out[r] == empty_value).all(), f"{what}: empty row {r} gives {out[r].flatten()[:4].tolist()}"
    for r in (3, 4) if op != "logsumexp" else (3,):
        assert torch.isnan(out[r]).all(), f"{what}: NaN/+inf row {r} must be NaN, got {out[r].flatten()[:4]}"
    if op == "logsumexp":
        assert out[4] == math.inf, f"{what}: logsumexp of a +inf row must be +inf, got {out[4]}"
    if op == "softmax":
        assert (out[5, [11, 13]] == 0).all(), f"{what}: excluded entries must be exactly 0"
        assert_bitwise(out[6], uniform(n, dtype).expand(n), f"{what}: row of finfo.min must be exactly 1/N")
    # Every row vs the oracle (NaN/+inf rows are NaN there too, logsumexp's +inf row +inf, empty rows 0 /
    # -inf).
    z = oracle_z(x, SCALE, mask)
    ref, st = oracle_forward(op, z, 1)
    assert_matches(out, ref, forward_budget(op, st, ref), f"{what} forward")
    g = rng.randn(out.shape, dtype, std=1.0)

    # Other rows are untouched by the NaN rows: the same bits as a batch with those rows made clean.
    clean = x.detach().clone()
    clean[3, 5] = 0.0
    clean[4, 9] = 0.0
    clean[5, 11] = 0.0  # masked: must not matter either
    clean.requires_grad_()
    out_clean = call(op, clean, scale=SCALE, mask=mask)
    for r in (0, 1, 2, 5, 6):
        assert_bitwise(out[r], out_clean[r], f"{what}: row {r} depends on NaN elsewhere")
    (dx,) = torch.autograd.grad(out, x, g)
    (dx_clean,) = torch.autograd.grad(out_clean, clean, g)
    for r in (0, 1, 2, 5, 6):
        assert_bitwise(dx[r], dx_clean[r], f"{what}: gradient of row {r} depends on NaN elsewhere")
    for r in (1, 2):
        assert (dx[r] == 0).all(), f"{what}: gradient of empty row {r} must be 0"
    assert (dx[5, [11, 13]] == 0).all(), f"{what}: excluded entries must get a zero gradient"
    if op == "logsumexp":
        # torch's gradient of a +inf row: exp(z - lse) * g is NaN at the +inf entry and 0 elsewhere.
        others = torch.arange(n, device=DEV) != 9
        assert dx[4, 9].isnan() and (dx[4, others] == 0).all(), f"{what}: gradient of the +inf row {dx[4]}"
    # Gradients of the rows without NaN/+inf vs the oracle (what a NaN row's own gradient holds is not
    # promised beyond "NaN stays in its row").
    rows = [0, 1, 2, 5, 6]
    ref_dx = oracle_backward(op, st, z, g, SCALE)
    budget = backward_budget(op, st, z, g, ref_dx, SCALE)
    assert_matches(dx[rows], ref_dx[rows], budget[rows], f"{what} backward")


@pytest.mark.parametrize("n", SPECIAL_N)
@pytest.mark.parametrize("op", OPS)
@given(rng=rngs())
def test_masked_rows_sliced_away_have_zero_gradient(op, n, rng):
    x = rng.randn((5, n), torch.bfloat16)
    x[2] = NEG_INF
    mask = torch.ones((5, n), dtype=torch.bool, device=DEV)
    mask[1] = False
    mask[3, ::2] = False
    x.requires_grad_()
    out = call(op, x, scale=SCALE, mask=mask)
    kept = [0, 3, 4]
    loss = (out[kept].float() * rng.randn(out[kept].shape, torch.float32, std=1.0)).sum()
    (dx,) = torch.autograd.grad(loss, x)
    assert torch.isfinite(dx).all(), f"{op} N={n}: non-finite gradient {rng}"
    assert (dx[1] == 0).all() and (dx[2] == 0).all(), \
        f"{op} N={n}: sliced-away empty rows need zero gradients"
    assert (dx[3, ::2] == 0).all(), f"{op} N={n}: masked entries need zero gradients"


@pytest.mark.parametrize("op", OPS)
def test_empty_tensors(op):
    for shape in ((0, 1000), (4, 0), (0, 0), (3, 0, 5)):
        x = torch.randn(shape, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        out = call(op, x, -1)
        expected_shape = shape[:-1] if op == "logsumexp" else shape
        assert tuple(out.shape) == expected_shape, f"{op} {shape}: shape {tuple(out.shape)}"
        if op == "logsumexp" and out.numel():
            assert (out == NEG_INF).all(), f"{op} {shape}: rows with no columns give -inf, got {out}"
        (dx,) = torch.autograd.grad(out.float().sum(), x)
        assert tuple(dx.shape) == shape
    # Reducing a zero-length middle dim with other dims present: empty rows, not NaN.
    x = torch.randn((3, 0, 5), device=DEV, requires_grad=True)
    if op == "logsumexp":
        out = call(op, x, 1)
        assert tuple(out.shape) == (3, 5) and (out == NEG_INF).all()


# --------------------------------------------------------------------------------------------------
# Backward from fp32 probabilities (contract section 3)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", (1000, 65536) if SMALL else (1000, 65536, 300000))
@given(rng=rngs())
def test_bf16_softmax_sum_backward_is_nearly_zero(n, rng):
    x = rng.randn((8, n), torch.bfloat16, std=3.0).requires_grad_()
    (dx,) = torch.autograd.grad(safeops.softmax(x).sum(), x)
    z = oracle_z(x)
    st = oracle_stats(z, 1)
    x64 = x.detach().double().requires_grad_()
    (dx64,) = torch.autograd.grad(torch.softmax(x64, -1).sum(), x64)
    err = (dx.double() - dx64).abs()
    # With g = 1 the budget is p * (error of the fp32 sum of the recomputed fp32 probabilities): ~1e-6 * p,
    # where a backward from bf16-rounded probabilities is off by ~1e-3 * p.
    allowed = backward_budget("softmax", st, z, torch.ones_like(z), dx64) + FLUSH_FLOOR
    xe = x.detach().clone().requires_grad_()
    (dx_eager,) = torch.autograd.grad(torch.softmax(xe, -1).sum(), xe)
    assert (err <= allowed).all(), (
        f"N={n}: bf16 softmax(x).sum() gradient should be ~0 (float64: max {dx64.abs().max().item():.1e}); "
        f"safeops max |dx| = {dx.abs().max().item():.3e}, eager bf16 torch.softmax max |dx| = "
        f"{dx_eager.abs().max().item():.3e} {rng}")


def test_seed_userland_bf16_backward():
    """SEED_CASES.md 1c on CUDA: sum(softmax(x @ x / y)) has a zero gradient w.r.t. y."""
    x, y = userland_inputs(torch.bfloat16, device=DEV)
    userland_loss(lambda t, d: safeops.softmax(t, d), x, y).backward()
    x2, y2 = userland_inputs(torch.bfloat16, device=DEV)
    userland_loss(lambda t, d: torch.softmax(t, d), x2, y2).backward()
    assert torch.isfinite(y.grad).all(), f"y.grad = {y.grad.flatten().tolist()}"
    assert y.grad.abs().max() <= 1e-3, (
        f"safeops y.grad = {y.grad.flatten().tolist()}; eager torch.softmax bf16 gives "
        f"{y2.grad.flatten().tolist()}, float64 about 1e-14")


# --------------------------------------------------------------------------------------------------
# Same bits everywhere it is the same op (contract section 6)
# --------------------------------------------------------------------------------------------------

# 16384: the persistent backward grid (one program per SM for a batch, one program for a row alone).
INVARIANCE_N = (1000, 16384, 65536) if SMALL else (1000, 4096, 16384, 65536)
BATCH_ROWS = 64 if SMALL else 4096


@pytest.mark.parametrize("n", INVARIANCE_N)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("op", OPS)
@given(rng=rngs())
def test_deterministic_and_batch_invariant(op, dtype, n, rng):
    x = rng.randn((BATCH_ROWS, n), dtype)
    g = rng.randn((BATCH_ROWS, n) if op != "logsumexp" else (BATCH_ROWS,), dtype, std=1.0)
    what = f"{op} {dtype} N={n} {rng}"

    def run(xs, gs):
        xs = xs.detach().clone().requires_grad_()
        out = call(op, xs, scale=SCALE)
        (dx,) = torch.autograd.grad(out, xs, gs)
        return out.detach(), dx

    out, dx = run(x, g)
    out2, dx2 = run(x, g)
    assert_bitwise(out2, out, f"{what}: forward differs between two runs")
    assert_bitwise(dx2, dx, f"{what}: backward differs between two runs")
    picks = [0, 1, BATCH_ROWS // 2 + 1, BATCH_ROWS - 1]
    for i in picks:
        o1, d1 = run(x[i:i + 1], g[i:i + 1])
        assert_bitwise(o1[0], out[i], f"{what}: row {i} alone, forward")
        assert_bitwise(d1[0], dx[i], f"{what}: row {i} alone, backward")
    trio = torch.tensor([picks[2], picks[0], picks[3]], device=DEV)
    o3, d3 = run(x[trio], g[trio])
    for k, i in enumerate(trio.tolist()):
        assert_bitwise(o3[k], out[i], f"{what}: row {i} at position {k} of a batch of 3, forward")
        assert_bitwise(d3[k], dx[i], f"{what}: row {i} at position {k} of a batch of 3, backward")


@pytest.mark.parametrize("n", (16385, 20000, 32768, 40000, 65536))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("op", ("softmax", "log_softmax"))
@given(rng=rngs())
def test_loop_backward_matches_two_launch_bitwise(op, dtype, n, rng, monkeypatch):
    """The loop backward (one program walks a row twice, softmax_launch.LOOP_MAX_COLS_BWD) gives the
    two-launch path's bits at the same number of warps: d/dx and the scale tensor's gradient, with a mask;
    1 to 600 rows, so the persistent grid's programs take one row or several. It really ran where the table
    sends the backward, and nowhere else."""
    launches = []
    real = softmax_launch._loop_grid

    def recording(n_rows, *args):
        launches.append(n_rows)
        return real(n_rows, *args)

    monkeypatch.setattr(softmax_launch, "_loop_grid", recording)
    # The two-launch kernels at the loop kernel's warps (the forward's too, the same in both modes).
    warps = softmax_launch.LOOP_NUM_WARPS
    monkeypatch.setattr(softmax_launch, "SPLIT_NUM_WARPS", {1: warps, 2: warps, 4: warps})
    elem = torch.empty((), dtype=dtype).element_size()
    expected = int(softmax_launch.rows_config(n, elem, backward=True) is None
                   and n <= softmax_launch.LOOP_MAX_COLS_BWD.get(elem, 0)
                   and 2 * n * elem <= softmax_launch.LOOP_L2_BYTES_PER_SM)
    for rows in (1, 3, 600):
        x = rng.randn((rows, n), dtype, std=3.0)
        g = rng.randn((rows, n), dtype)
        mask = rng.rand((1, n)) < 0.8
        for with_scale in (False, True):
            results = {}
            for mode in ("default", "two_launch"):
                xs = x.clone().requires_grad_()
                scale = torch.tensor(0.7, device="cuda", requires_grad=True)
                kw = {"scale": scale, "mask": mask} if with_scale else {}
                with long_rows(mode):
                    out = call(op, xs, **kw)
                    launches.clear()
                    grads = torch.autograd.grad(out, [xs, scale] if with_scale else [xs], g)
                    looped = len(launches)
                results[mode] = grads
                want = expected if mode == "default" else 0
                assert looped == want, f"{looped} loop launches ({mode}), expected {want}"
            what = f"{op} {dtype} {rows}x{n} scale/mask {with_scale} {rng}"
            for name, a, b in zip(("d/dx", "d/dscale"), results["default"], results["two_launch"],
                                  strict=False):
                assert_bitwise(a, b, f"{what}: {name}, loop vs two-launch")


@pytest.mark.parametrize("variant", ["scale_float", "scale_tensor_mask"])
@pytest.mark.parametrize("n", (1000, 65536))
@pytest.mark.parametrize("op", OPS)
@given(rng=rngs())
def test_compiled_matches_eager_bitwise(op, n, variant, rng):
    torch._dynamo.reset()
    fn = getattr(safeops, op)
    x = rng.randn((6, n), torch.bfloat16).requires_grad_()
    if variant == "scale_float":
        def f(x):
            return fn(x, -1, scale=SCALE)

        args, wrt = (x,), [x]
    else:
        s = torch.tensor(SCALE, device=DEV, requires_grad=True)
        mask = rng.rand((1, n)) < 0.8

        def f(x, s, mask):
            return fn(x, -1, scale=s, mask=mask)

        args, wrt = (x, s, mask), [x, s]
    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    out_eager = f(*args)
    out_compiled = compiled(*args)
    what = f"{op} N={n} {variant} {rng}"
    assert_bitwise(out_compiled, out_eager, f"{what}: compiled vs eager forward")
    g = rng.randn(out_eager.shape, out_eager.dtype, std=1.0)
    grads_eager = torch.autograd.grad(out_eager, wrt, g)
    grads_compiled = torch.autograd.grad(out_compiled, wrt, g)
    for k, (a, b) in enumerate(zip(grads_compiled, grads_eager, strict=True)):
        assert_bitwise(a, b, f"{what}: compiled vs eager gradient {k}")


# --------------------------------------------------------------------------------------------------
# Huge shapes: a 4M-entry vocabulary row and more than 2**31 elements (contract section 8)
# --------------------------------------------------------------------------------------------------


def need_free_gpu_memory(nbytes: int) -> None:
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes:
        pytest.skip(f"needs {nbytes / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


@pytest.mark.skipif(SMALL, reason="huge shapes are off (SAFEOPS_GPU_SMALL=1)")
@examples(ci=1, deep=3)  # minutes of GPU time and most of its memory per example
@given(rng=rngs())
def test_huge_row_4194304_columns(rng):
    n = 4 * 2**20
    need_free_gpu_memory(2 * 2**30)
    x = rng.randn((2, n), torch.bfloat16).requires_grad_()
    for op in OPS:
        out = call(op, x, scale=SCALE)
        g = rng.randn(out.shape, torch.bfloat16, std=1.0)
        check_forward_backward(op, x, out, g, -1, f"{op} bf16 N=4194304 {rng}", scale=SCALE)


@pytest.mark.skipif(SMALL, reason="huge shapes are off (SAFEOPS_GPU_SMALL=1)")
@pytest.mark.parametrize("n", (16384, 65536), ids=("single_block", "split"))
@examples(ci=1, deep=3)  # minutes of GPU time and most of its memory per example
@given(rng=rngs())
def test_huge_more_than_2_31_elements(n, rng):
    rows = 2**31 // n + 1  # the last row starts at element 2**31
    numel = rows * n
    assert numel > 2**31
    need_free_gpu_memory(3 * numel * 2 + 2 * 2**30)
    x = rng.randn((rows, n), torch.bfloat16, std=3.0)
    poison = torch.full_like(x, float("nan"))  # the caching allocator hands this block to the output
    del poison
    out = safeops.softmax(x)
    sums = out.sum(-1, dtype=torch.float32)
    bad = ~(torch.isfinite(sums) & ((sums - 1).abs() <= 2.0**-7))
    assert not bad.any(), (f"N={n} rows={rows}: {int(bad.sum())} rows not written or wrong, first "
                           f"{bad.nonzero()[:4].flatten().tolist()} with sums {sums[bad][:4].tolist()}")
    for r in (0, 1, rows // 2, rows - 2, rows - 1):
        z = oracle_z(x[r:r + 1])
        ref, st = oracle_forward("softmax", z, 1)
        assert_matches(out[r:r + 1], ref, forward_budget("softmax", st, ref),
                       f"softmax bf16 ({rows}, {n}) row {r} (offset {r * n}) {rng}")
    del x, out
    torch.cuda.empty_cache()


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.bfloat16, torch.float32),
                                               (torch.float32, torch.bfloat16)])
@given(rng=rngs())
def test_backward_plan_not_shared_across_gradient_dtypes(op, x_dtype, out_dtype, rng):
    """A cached backward launch plan must not serve a call whose incoming gradient has another dtype: the
    kernel is compiled for the gradient's pointer type. (Found on the H200: after an ``out_dtype`` call,
    the same-shape default call reused the plan and read the bf16 gradient as fp32: NaN / garbage.)"""
    x = rng.randn((5, 1000), x_dtype, std=3.0)
    fns = {"softmax": safeops.softmax, "log_softmax": safeops.log_softmax}

    def grad_of(dtype):
        xx = x.detach().clone().requires_grad_(True)
        out = fns[op](xx, dim=-1, dtype=dtype) if dtype is not None else fns[op](xx, dim=-1)
        g = torch.linspace(-1.0, 1.0, out.numel(), device=DEV).reshape(out.shape).to(out.dtype)
        return torch.autograd.grad(out, xx, g)[0]

    softmax_launch.clear_plans()
    fresh = grad_of(None)  # the default call with nothing cached
    softmax_launch.clear_plans()
    grad_of(out_dtype)  # caches a plan for a gradient of out_dtype
    again = grad_of(None)
    assert torch.equal(again, fresh), f"{op}: x {x_dtype}, after an out_dtype={out_dtype} call; {rng}"


def batch_views(x: torch.Tensor, dims: int) -> torch.Tensor:
    """The rows of ``x`` (R, N), R divisible by 4, as a view whose row view has ``dims`` batch dims (padding
    between groups of rows keeps them from merging), every row start 64-byte aligned, column stride 1."""
    r, n = x.shape
    fill = float("nan") if x.is_floating_point() else 0
    if dims == 1:
        return x.clone()
    if dims == 2:
        buf = x.new_full((4, r // 4 + 1, n), fill)
        view = buf[:, : r // 4]
        view.copy_(x.view(4, r // 4, n))
        return view
    buf = x.new_full((2, 3, r // 4 + 1, n), fill)
    view = buf[:, :2, : r // 4]
    view.copy_(x.view(2, 2, r // 4, n))
    return view


@pytest.mark.parametrize("n", (256, 1000, 4096) if SMALL else (256, 1000, 4096, 16384))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("op", OPS)
@given(rng=rngs())
def test_bits_same_for_every_batch_decoding(op, dtype, n, rng):
    """The rows kernels decode a row index with no division when the rows lie one stride apart (one batch
    dim) and with one or two divisions otherwise (``ROW_DIMS``). The same rows through the three decodings
    give the same bits, forward and backward, with and without a mask (contract section 6)."""
    rows = 64
    x = rng.randn((rows, n), dtype)
    g = rng.randn((rows,) if op == "logsumexp" else (rows, n), dtype, std=1.0)
    mask = rng.rand((rows, n)) > 0.3
    mask[3] = False  # a fully masked row

    def run(dims, with_mask):
        xs = batch_views(x, dims).requires_grad_(True)
        gs = g.view(xs.shape[:-1]) if op == "logsumexp" else batch_views(g, dims)
        ms = batch_views(mask, dims) if with_mask else None
        out = call(op, xs, -1, scale=SCALE, mask=ms)
        (dx,) = torch.autograd.grad(out, xs, gs)
        return out.detach().reshape(rows, -1), dx.reshape(rows, n)

    for with_mask in (False, True):
        ref = run(1, with_mask)
        for dims in (2, 3):
            got = run(dims, with_mask)
            for name, a, b in zip(("forward", "backward"), got, ref, strict=True):
                assert torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype])), (
                    f"{op} {dtype} N={n} mask={with_mask}: {dims} batch dims vs one, {name}: "
                    f"{int((a != b).sum())} elements differ; {rng}")


def _misaligned(t: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """The values of contiguous ``t`` at ``elements`` past a 16-byte-aligned allocation."""
    flat = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)[elements:]
    return flat.view(t.shape).copy_(t)


def _layouts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same values of a 2-D contiguous tensor, reduced over its last dim, in other memory layouts."""
    return {"transposed": t.t().contiguous().t(), "misaligned": _misaligned(t),
            "row stride off the 16-byte grid": torch.cat([t, t[:, :3]], 1)[:, :t.shape[1]]}


@pytest.mark.parametrize("op", OPS)
# 1000 and 4096: rows paths both ways; 1001: no alignment claim at this length; 16384: the persistent
# pipelined backward (bf16); 20000: rows forward, split backward; 40000: split both ways.
@pytest.mark.parametrize("n", [1000, 1001, 4096, 16384, 20000, 40000])
@given(rng=rngs())
def test_bits_independent_of_memory_layout(op, n, rng):
    """Contract section 6: the same values in another memory layout (the reduced dim strided, a misaligned
    start, row starts off the 16-byte grid), and an incoming gradient in another layout, give the same
    bits, forward and backward, as the contiguous tensors (the launcher reads such inputs from rows-major
    copies; tests/test_softmax_layouts.py checks offline that nothing else changes the kernels' reduction
    layouts)."""
    for dtype in (torch.float32, torch.bfloat16):
        x = rng.randn((64, n), dtype, std=4.0)
        g_shape = (64,) if op == "logsumexp" else (64, n)
        g = rng.randn(g_shape, dtype, std=1.0)

        def run(t, grad):
            t = t.detach().requires_grad_(True)
            out = call(op, t, -1)
            return out, torch.autograd.grad(out, t, grad)[0]

        ref = run(x, g)
        for name, view in _layouts(x).items():
            got = run(view, g)
            for part, a, b in zip(("forward", "backward"), got, ref, strict=True):
                assert torch.equal(a.view(INT_VIEW[dtype]), b.view(INT_VIEW[dtype])), (
                    f"{op} {dtype} N={n} {name} {part}: {int((a != b).sum())} elements differ; {rng}")
        if op != "logsumexp":
            for name, g_view in _layouts(g).items():
                got = run(x, g_view)[1]
                differ = int((got != ref[1]).sum())
                assert torch.equal(got.view(INT_VIEW[dtype]), ref[1].view(INT_VIEW[dtype])), (
                    f"{op} {dtype} N={n} gradient {name}: {differ} elements differ; {rng}")


@pytest.mark.parametrize("n", [1000, 1024, 16384, 40000])  # 1000: a length with no mask alignment claim
@given(rng=rngs())
def test_bits_independent_of_the_masks_layout(n, rng):
    """A mask is used like x: broadcast or materialized, transposed or misaligned, the same bits."""
    x = rng.randn((64, n), torch.bfloat16, std=4.0)
    row = rng.rand((1, n)) > 0.3
    keep = (rng.rand((64, n)) > 0.3) & row
    g = rng.randn((64, n), torch.bfloat16, std=1.0)

    def run(mask):
        t = x.detach().requires_grad_(True)
        out = safeops.softmax(t, -1, mask=mask)
        return out, torch.autograd.grad(out, t, g)[0]

    cases = ((keep, {"transposed": keep.t().contiguous().t(), "misaligned": _misaligned(keep, 3)}),
             (row.expand(64, n).contiguous(), {"broadcast": row, "expanded": row.expand(64, n)}))
    for ref_mask, views in cases:
        ref = run(ref_mask)
        for name, view in views.items():
            for part, a, b in zip(("forward", "backward"), run(view), ref, strict=True):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (
                    f"N={n} mask {name} {part}: {int((a != b).sum())} elements differ; {rng}")


@pytest.mark.parametrize("n", [1024, 16384, 40000])
@given(rng=rngs())
def test_dx_bits_do_not_depend_on_the_scale_gradient(n, rng):
    """With a scale tensor, dx is the same whether the scale's gradient is wanted or not (the kernels
    compute its terms either way: wanting it must not change the kernel)."""
    x = rng.randn((64, n), torch.bfloat16, std=4.0)
    g = rng.randn((64, n), torch.bfloat16, std=1.0)
    scale = torch.tensor(0.75, device=DEV)
    keep = rng.rand((64, n)) > 0.2
    results = []
    for wanted in (False, True):
        t = x.detach().requires_grad_(True)
        s = scale.detach().requires_grad_(wanted)
        out = safeops.softmax(t, -1, scale=s, mask=keep)
        results.append(torch.autograd.grad(out, t, g)[0])
    assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16)), f"N={n}; {rng}"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [256, 1000, 4096, 32768])  # the rows forward (longer rows always keep them)
@given(rng=rngs())
def test_forward_bits_do_not_depend_on_recording(op, n, rng):
    """An eager call that records nothing skips the row statistics (a kernel without their stores); its
    output has the bits of a recording call and of the registered op, which compiled graphs call."""
    from safeops.ops import _launch
    from safeops.ops import softmax_launch as SL

    fallbacks = _launch.guard_fallbacks
    SL.clear_plans()
    for dtype in (torch.bfloat16, torch.float32):
        x = rng.randn((32, n), dtype, std=4.0)
        plain = call(op, x, -1)
        recorded = call(op, x.detach().requires_grad_(True), -1).detach()
        registered = getattr(torch.ops.safeops, op)(x, 1, None, None, None, None)[0]
        for name, other in (("recording", recorded), ("registered op", registered)):
            assert torch.equal(plain.view(INT_VIEW[dtype]), other.view(INT_VIEW[dtype])), (
                f"{op} {dtype} N={n}: no-record vs {name}: {int((plain != other).sum())} differ; {rng}")
    kinds = {p.launch.kwargs["STATS"] for p in SL._plans(SL._FORWARD).values() if p is not SL._GENERAL}
    assert kinds == {False, True}, "both rows kernels ran"
    assert _launch.guard_fallbacks == fallbacks
