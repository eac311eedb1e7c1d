"""safeops.cast_transpose on CPU: the reference path and the Triton kernel under the interpreter (issue 6).

Every result is checked two ways:

- against an independent float64 oracle written here from the definitions: ``z`` is the exact product
  ``fp32(x) * fp32(scale)`` rounded once to fp32, clamped to the fp8 range, then rounded to the nearest fp8
  value (ties to the even code) found by searching a table of all fp8 values decoded from their bit
  fields; amax is ``max |x|`` in float64 (NaN if any NaN, 0 for an empty ``x``);
- bit for bit (NaN bits included) against the eager expression the op promises to equal,
  ``(x.float() * scale).clamp(-max, max).to(dtype)``, and ``y_t`` against ``y`` with strides ``(1, M)``.

Backends: ``reference`` (pure torch) and ``triton`` (the kernel, run by Triton's interpreter). Under the
interpreter the kernel converts to fp8 with its integer round-to-nearest-even, and that path is checked on
everything here, NaN / inf / -0 / subnormals / ties / saturation included.

GPU-only (tests/test_cast_transpose_gpu.py): the kernel's hardware conversion (``cvt.rn.satfinite``, the
GPU default) on values that must be rounded or saturated. Triton's interpreter implements fp8 casts wrongly
(no carry into the exponent, ties not to even, subnormals flushed, no saturation: NaN -> 0x7C, 500 -> 256
for e4m3fn), so here that variant is run only on values that need no rounding (fp8 values, +-0, NaN).
"""

from __future__ import annotations

import math
import textwrap

import pytest
import sm90
import torch
from hypothesis import given
from strategies import cast_cases, examples, seeds

import safeops
from safeops.ops import cast_transpose_launch as launch

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3fn"), pytest.param(torch.float8_e5m2, id="e5m2")]
X_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
            pytest.param(torch.float32, id="fp32")]
SHAPES = [(1, 1), (1000, 37), (33, 512), (64, 128), (70, 3)]
FIELDS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}  # mantissa bits, exponent bias


# --------------------------------------------------------------------------------------------------
# The oracle
# --------------------------------------------------------------------------------------------------


def fp8_values(dtype: torch.dtype) -> torch.Tensor:
    """float64 value of each of the 256 codes, decoded from sign / exponent / mantissa fields."""
    man, bias = FIELDS[dtype]
    code = torch.arange(256, dtype=torch.int64)
    sign, e, m = code >> 7, (code >> man) & ((1 << (7 - man)) - 1), code & ((1 << man) - 1)
    e64, m64 = e.double(), m.double()
    mag = torch.where(e == 0, m64 * 2.0 ** (1 - bias - man), (1 + m64 / 2**man) * torch.pow(2.0, e64 - bias))
    top = (1 << (7 - man)) - 1
    if dtype == torch.float8_e4m3fn:
        mag = torch.where((e == top) & (m == (1 << man) - 1), math.nan, mag)
    else:
        mag = torch.where(e == top, torch.where(m == 0, math.inf, math.nan), mag)
    return torch.where(sign == 1, -mag, mag)


def fp8_is_nan(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.isnan(fp8_values(dtype)[codes.long()])


def oracle_codes(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> torch.Tensor:
    """Expected fp8 code per element (int64), -1 where the result is NaN."""
    s = scale.double().reshape(-1, 1) if rowwise else scale.double().reshape(())
    z = (x.double() * s).float().double()  # the exact product, rounded once to fp32
    values = fp8_values(dtype)
    positive = values[:128]
    finite = positive[torch.isfinite(positive)]  # codes 0 .. max_code, increasing
    top = finite[-1].item()
    zc = z.clamp(-top, top)
    a = zc.abs()
    hi = torch.searchsorted(finite, a.nan_to_num(0.0).contiguous()).clamp(max=finite.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - finite[lo], finite[hi] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    mag = torch.where(take_hi, hi, lo)
    code = mag | torch.where(torch.signbit(zc), 0x80, 0)
    return torch.where(torch.isnan(zc), -1, code)


def eager(x, scale, dtype, rowwise=False):
    """The expression the op promises to equal, written the way user code writes it."""
    m = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-m, m).to(dtype)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def check(x, scale, dtype, rowwise, out, context="") -> None:
    y, y_t, amax = out
    m, k = x.shape
    where = f"{context} x {tuple(x.shape)} {x.dtype} -> {dtype}, rowwise={rowwise}"
    assert y.shape == (m, k) and y.dtype == dtype and y.is_contiguous(), where
    assert y_t.shape == (m, k) and y_t.dtype == dtype and y_t.stride() == (1, max(m, 1)), where
    codes = oracle_codes(x, scale, dtype, rowwise)
    got = u8(y).long()
    nan = codes < 0
    bad = (got != codes) & ~nan
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{int(bad.sum())} codes differ from the oracle, first at {list(i)}: "
                             f"x={x[i].item()!r} -> {got[i].item():#04x}, "
                             f"expected {codes[i].item():#04x}; {where}")
    assert fp8_is_nan(got[nan], dtype).all(), f"NaN expected; {where}"
    # Bits as eager, NaN codes included, except where x and the scale are both NaN: IEEE leaves open which
    # operand's NaN a product returns, and numpy (the interpreter) and torch's CPU kernels pick differently.
    s = scale.reshape(-1, 1) if rowwise else scale.reshape(())
    both_nan = torch.isnan(x) & torch.isnan(s)
    differ = (u8(y) != u8(eager(x, scale, dtype))) & ~both_nan
    assert not differ.any(), f"{int(differ.sum())} codes differ from the eager expression; {where}"
    assert torch.equal(u8(y_t), u8(y)), f"y_t holds other values than y; {where}"
    expected_amax = x.double().abs().max() if x.numel() else torch.zeros((), dtype=torch.float64)
    assert amax.dtype == torch.float32 and amax.shape == (), where
    if torch.isnan(expected_amax):
        assert torch.isnan(amax), where
    else:
        assert amax.double() == expected_amax, f"amax {amax.item()} != {expected_amax.item()}; {where}"


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """fp32 values z that exercise every corner of the cast at scale 1: each fp8 value, each midpoint (a
    tie) and its fp32 neighbours, values just under a binade (a carry), beyond the max, subnormals, zeros,
    infinities and NaN, with both signs."""
    values = fp8_values(dtype)
    finite = values[:128][torch.isfinite(values[:128])]
    mids = (finite[1:] + finite[:-1]) / 2
    top = finite[-1].item()
    tiny = finite[1].item()  # the smallest subnormal
    extra = torch.tensor([top * 1.03, top * 1.5, top * 1e3, 3.4e38, math.inf, math.nan, 0.0,
                          tiny / 4, tiny / 2 * 1.01, 1e-40, 1e-45], dtype=torch.float64)
    base = torch.cat([finite, mids, extra]).float()
    up = torch.nextafter(base, torch.tensor(math.inf))
    down = torch.nextafter(base, torch.tensor(0.0))
    out = torch.cat([base, up, down])
    return torch.cat([out, -out])


def random_x(seed, m: int, k: int, dtype: torch.dtype, fp8: torch.dtype) -> torch.Tensor:
    """Magnitudes spread log-uniformly from below the fp8 subnormals to above the fp8 max."""
    man, bias = FIELDS[fp8]
    lo, hi = 1 - bias - man - 3, 2**(7 - man) - bias + 2
    if dtype == torch.float16:
        lo, hi = max(lo, -24), min(hi, 15)
    e = torch.floor(seed.rand(m, k) * (hi - lo) + lo)
    sign = torch.where(seed.rand(m, k) < 0.5, -1.0, 1.0)
    return (sign * torch.pow(2.0, e) * (1 + seed.rand(m, k))).to(dtype)


def sprinkle(seed, x: torch.Tensor, values: torch.Tensor, fraction: float = 0.05) -> torch.Tensor:
    """x with a fraction of its entries replaced by ``values`` (cast to x's dtype)."""
    x = x.clone()
    flat = x.view(-1)
    n = max(1, int(flat.numel() * fraction))
    where = seed.randint(0, flat.numel(), n)
    pick = seed.randint(0, values.numel(), n)
    flat[where] = values[pick].to(x.dtype)
    return x


def tensor_scale(seed, dtype=torch.float32) -> torch.Tensor:
    # Not a power of two, so z = x * scale really rounds in fp32.
    return torch.tensor(seed.uniform(0.3, 3.0), dtype=torch.float64).to(dtype)


def row_scales(seed, m: int) -> torch.Tensor:
    s = torch.exp2(seed.rand(m, 1) * 16 - 8).float()
    specials = torch.tensor([0.0, -1.0, math.inf, math.nan, 1e-30, 3.0e38, -0.5])
    rows = seed.randint(0, m, min(m, 7))
    s[rows, 0] = specials[: rows.numel()]
    return s


# --------------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@given(seed=seeds())
def test_matches_oracle_and_eager(backend, seed, fp8, x_dtype, rowwise):
    for m, k in SHAPES:
        x = sprinkle(seed, random_x(seed, m, k, x_dtype, fp8), special_values(fp8))
        scale = row_scales(seed, m) if rowwise else tensor_scale(seed)
        out = safeops.cast_transpose(x, scale, fp8, rowwise=rowwise)
        check(x, scale, fp8, rowwise, out, f"{backend} {seed}")


@given(case=cast_cases())
@examples(ci=50)
def test_drawn_calls_match_oracle_and_eager(backend, case):
    """Any (M, K) (empty sides included), x dtype, layout (transposed, sliced, broadcast views), fp8 dtype,
    tensorwise or rowwise scale of any scale dtype (rowwise with 0, negative, inf, NaN, huge and tiny
    rows), values across the fp8 range with the special values sprinkled in: the oracle's codes, the eager
    expression's bits and amax."""
    seed, m, k, fp8 = case.seed, case.m, case.k, case.fp8

    def fill(a, b):
        x = random_x(seed, a, b, case.x_dtype, fp8)
        return sprinkle(seed, x, special_values(fp8)) if x.numel() else x

    x = case.layout.build((m, k), fill)
    if case.rowwise:
        scale = (row_scales(seed, m) if m else torch.ones(0, 1)).to(case.scale_dtype)
    else:
        scale = tensor_scale(seed, case.scale_dtype)
    out = safeops.cast_transpose(x, scale, fp8, rowwise=case.rowwise)
    check(x, scale, fp8, case.rowwise, out, f"{backend} {case!r}")


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("x_dtype", X_DTYPES)
def test_every_corner_at_power_of_two_scales(backend, fp8, x_dtype):
    """Ties, carries, saturation, subnormals, NaN, inf, -0: z lands exactly on them (scale 2**j is exact)."""
    z = special_values(fp8)
    for j in (0, -3, 5):
        x = (z.double() * 2.0**-j).to(x_dtype)
        x = torch.cat([x, torch.zeros(-x.numel() % 64, dtype=x_dtype)]).reshape(-1, 64)
        scale = torch.tensor(2.0**j)
        check(x, scale, fp8, False, safeops.cast_transpose(x, scale, fp8), f"{backend} scale=2**{j}")


@pytest.mark.parametrize("x_dtype", X_DTYPES)
@given(seed=seeds())
def test_every_bf16_fp16_bit_pattern(backend, seed, x_dtype):
    """All 65536 inputs of a 16-bit dtype (random fp32 patterns for fp32), both fp8 dtypes."""
    if x_dtype == torch.float32:
        bits = seed.randint(-2**31, 2**31, 256 * 256).to(torch.int32)
        x = bits.view(torch.float32).reshape(256, 256)
    else:
        x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(x_dtype).reshape(256, 256)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = tensor_scale(seed)
        check(x, scale, fp8, False, safeops.cast_transpose(x, scale, fp8), f"{backend} {seed}")


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@given(seed=seeds())
def test_half_precision_scale_is_exactly_upcast(backend, seed, scale_dtype):
    x = random_x(seed, 40, 24, torch.bfloat16, torch.float8_e4m3fn)
    scale = tensor_scale(seed, scale_dtype).reshape(1)
    out = safeops.cast_transpose(x, scale)
    check(x, scale, torch.float8_e4m3fn, False, out, backend)
    rows = row_scales(seed, 40).to(scale_dtype)
    check(x, rows, torch.float8_e4m3fn, True, safeops.cast_transpose(x, rows, rowwise=True), backend)


# --------------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------------

LAYOUTS = {
    "transposed": lambda b: b.t(),  # column-major x
    "sliced": lambda b: b[3:, ::3],  # storage offset, row and column strides
    "broadcast_rows": lambda b: b[:1].expand(b.shape[0], -1),  # row stride 0
    "broadcast_cols": lambda b: b[:, :1].expand(-1, 40),  # column stride 0
    "narrow": lambda b: b[:, 5:45],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@given(seed=seeds())
def test_layouts(backend, seed, layout):
    base = sprinkle(seed, random_x(seed, 90, 70, torch.bfloat16, torch.float8_e4m3fn),
                    special_values(torch.float8_e4m3fn))
    x = LAYOUTS[layout](base)
    scale = tensor_scale(seed)
    out = safeops.cast_transpose(x, scale)
    check(x, scale, torch.float8_e4m3fn, False, out, f"{backend} {layout}")
    dense = safeops.cast_transpose(x.contiguous(), scale)
    assert torch.equal(u8(out[0]), u8(dense[0])) and torch.equal(u8(out[1]), u8(dense[1]))
    rows = row_scales(seed, x.shape[0])
    check(x, rows, torch.float8_e4m3fn, True, safeops.cast_transpose(x, rows, rowwise=True), backend)


@given(seed=seeds())
def test_rowwise_scale_with_strides(backend, seed):
    x = random_x(seed, 50, 30, torch.float32, torch.float8_e5m2)
    rows = row_scales(seed, 100)[::2]  # (50, 1) with row stride 2
    out = safeops.cast_transpose(x, rows, torch.float8_e5m2, rowwise=True)
    check(x, rows, torch.float8_e5m2, True, out, backend)


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0)])
def test_empty(backend, shape):
    x = torch.empty(shape, dtype=torch.bfloat16)
    y, y_t, amax = safeops.cast_transpose(x, torch.tensor(1.0))
    assert y.shape == shape and y_t.shape == shape and y.dtype == y_t.dtype == torch.float8_e4m3fn
    assert y_t.stride() == (1, max(shape[0], 1))
    assert amax.dtype == torch.float32 and amax.item() == 0.0


@given(seed=seeds())
def test_outputs_never_require_grad(backend, seed):
    x = random_x(seed, 8, 16, torch.float32, torch.float8_e4m3fn).requires_grad_()
    scale = torch.tensor(2.0, requires_grad=True)
    y, y_t, amax = safeops.cast_transpose(x, scale)
    assert not (y.requires_grad or y_t.requires_grad or amax.requires_grad)
    check(x.detach(), scale.detach(), torch.float8_e4m3fn, False, (y, y_t, amax), backend)


# --------------------------------------------------------------------------------------------------
# The kernel's own paths (interpreter)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [
    launch.TileConfig(16, 32, 4, num_stages=1, programs_per_sm=None),  # persistent: 2 programs, many tiles
    launch.TileConfig(32, 16, 4, num_stages=2, programs_per_sm=3),
    launch.TileConfig(64, 64, 4, num_stages=1, programs_per_sm=0),
    launch.TileConfig(32, 32, 4, num_stages=1, programs_per_sm=None, pack=False),
], ids=["persistent", "k_per_sm", "one_tile_each", "byte_transpose"])
@pytest.mark.parametrize("wide", [False, True], ids=["offsets32", "offsets64"])
@given(seed=seeds())
def test_kernel_grids_and_offsets(triton_backend, seed, monkeypatch, config, wide):
    if wide:
        monkeypatch.setattr(launch, "_wide", lambda *args: True)
    for m, k, rowwise in ((96, 64, False), (70, 45, True)):  # even tiles, and ragged edges
        x = sprinkle(seed, random_x(seed, m, k, torch.bfloat16, torch.float8_e4m3fn),
                     special_values(torch.float8_e4m3fn))
        scale = row_scales(seed, m) if rowwise else tensor_scale(seed)
        out = launch.cast_transpose(x, scale, torch.float8_e4m3fn, rowwise, config=config)
        check(x, scale, torch.float8_e4m3fn, rowwise, out, f"{config} wide={wide}")
        assert torch.equal(launch._workspace(x.device), torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("candidate", launch.SWEEP_CANDIDATES[:len(launch.SWEEP_CANDIDATES) - 2],
                         ids=lambda c: f"{c[0].block_m}x{c[0].block_k}w{c[0].num_warps}s{c[0].num_stages}"
                                       f"-{c[0].programs_per_sm}-{'pack' if c[0].pack else 'bytes'}")
@given(seed=seeds())
def test_every_sweep_config_interpreted(triton_backend, seed, candidate):
    """The tiles the GPU sweep may choose, run by the interpreter (integer rounding; the GPU tests run the
    hardware one): packed y_t words (M % 4 == 0) with ragged edges, and the byte fallback (M % 4 != 0)."""
    config, _ = candidate
    for m, k, rowwise in ((config.block_m + 4, config.block_k + 8, False), (config.block_m - 2, 24, True)):
        x = sprinkle(seed, random_x(seed, m, k, torch.bfloat16, torch.float8_e4m3fn),
                     special_values(torch.float8_e4m3fn))
        scale = row_scales(seed, m) if rowwise else tensor_scale(seed)
        fp8 = torch.float8_e4m3fn
        out = launch.cast_transpose(x, scale, fp8, rowwise, config=config, hardware_convert=False)
        check(x, scale, fp8, rowwise, out, str(config))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@given(seed=seeds())
def test_hardware_convert_on_values_that_need_no_rounding(triton_backend, seed, fp8, x_dtype):
    """The HW_CVT variant under the interpreter: only exact fp8 values, +-0 and NaN (module docstring)."""
    values = fp8_values(fp8)
    finite = values[torch.isfinite(values)]
    pool = torch.cat([finite, torch.tensor([math.nan, -math.nan, 0.0, -0.0], dtype=torch.float64)])
    x = pool[seed.randint(0, pool.numel(), 48 * 40)].reshape(48, 40).to(x_dtype)
    scale = torch.tensor(1.0)
    out = launch.cast_transpose(x, scale, fp8, False, hardware_convert=True)
    check(x, scale, fp8, False, out, "hardware_convert")


@given(seed=seeds())
def test_amax_deterministic_and_workspace_reset(triton_backend, seed):
    x = random_x(seed, 130, 70, torch.float16, torch.float8_e4m3fn)
    scale = tensor_scale(seed)
    first = safeops.cast_transpose(x, scale)
    for _ in range(2):
        again = safeops.cast_transpose(x, scale)
        assert all(torch.equal(u8(a) if a.dtype.itemsize == 1 else a, u8(b) if b.dtype.itemsize == 1 else b)
                   for a, b in zip(first, again, strict=True))
    assert torch.equal(launch._workspace(x.device), torch.zeros(2, dtype=torch.int32))
    nan_x = x.clone()
    nan_x[77, 3] = math.nan
    assert torch.isnan(safeops.cast_transpose(nan_x, scale)[2])
    assert not torch.isnan(safeops.cast_transpose(x, scale)[2])  # the NaN did not stay in the workspace


def test_tile_table():
    assert launch.tile_config(4096, 4096, 2) == launch.CONFIGS["large"]
    assert launch.tile_config(1000, 37, 2) == launch.CONFIGS["small"]
    for cfg in launch.CONFIGS.values():
        assert cfg.block_m >= 16 and cfg.block_k >= 16  # 16-byte vector stores of one-byte codes


# --------------------------------------------------------------------------------------------------
# Bad input (contract section 8)
# --------------------------------------------------------------------------------------------------

X = torch.ones(4, 6, dtype=torch.bfloat16)
S = torch.tensor(1.0)
BAD = {
    "x_3d": (dict(x=torch.ones(2, 3, 4)), ValueError, "x"),
    "x_1d": (dict(x=torch.ones(6)), ValueError, "x"),
    "x_int": (dict(x=torch.ones(4, 6, dtype=torch.int32)), TypeError, "x"),
    "x_bool": (dict(x=torch.ones(4, 6, dtype=torch.bool)), TypeError, "x"),
    "x_fp64": (dict(x=torch.ones(4, 6, dtype=torch.float64)), TypeError, "x"),
    "x_fp8": (dict(x=torch.ones(4, 6).to(torch.float8_e4m3fn)), TypeError, "x"),
    "x_list": (dict(x=[[1.0]]), TypeError, "x"),
    "dtype_fp16": (dict(dtype=torch.float16), ValueError, "dtype"),
    "dtype_int8": (dict(dtype=torch.int8), ValueError, "dtype"),
    "dtype_fnuz": (dict(dtype=torch.float8_e4m3fnuz), ValueError, "dtype"),
    "dtype_str": (dict(dtype="float8_e4m3fn"), ValueError, "dtype"),
    "scale_float": (dict(scale=2.0), TypeError, "scale"),
    "scale_int": (dict(scale=torch.tensor(2)), TypeError, "scale"),
    "scale_fp64": (dict(scale=torch.tensor(2.0, dtype=torch.float64)), TypeError, "scale"),
    "scale_two": (dict(scale=torch.ones(2)), ValueError, "scale"),
    "scale_rows_without_rowwise": (dict(scale=torch.ones(4, 1)), ValueError, "scale"),
    "scale_3d": (dict(scale=torch.ones(1, 1, 1)), ValueError, "scale"),
    "rowwise_1d": (dict(scale=torch.ones(4), rowwise=True), ValueError, "scale"),
    "rowwise_wrong_rows": (dict(scale=torch.ones(5, 1), rowwise=True), ValueError, "scale"),
    "rowwise_one": (dict(scale=torch.ones(1, 1), rowwise=True), ValueError, "scale"),
    "rowwise_not_bool": (dict(rowwise=1), TypeError, "rowwise"),
    "scale_device": (dict(scale=torch.tensor(1.0, device="meta")), ValueError, "scale"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_naming_the_argument(backend, case):
    kwargs, exc, name = BAD[case]
    args = dict(x=X, scale=S, dtype=torch.float8_e4m3fn, rowwise=False)
    args.update(kwargs)
    with pytest.raises(exc, match=rf"\b{name}\b"):
        safeops.cast_transpose(args["x"], args["scale"], args["dtype"], rowwise=args["rowwise"])


# --------------------------------------------------------------------------------------------------
# The torch.library op
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@given(seed=seeds())
def test_opcheck(reference_backend, seed, rowwise):
    x = random_x(seed, 12, 20, torch.bfloat16, torch.float8_e4m3fn)
    # Finite results only: opcheck compares outputs with assert_close, which treats NaN as unequal.
    scale = torch.exp2(seed.rand(12, 1) * 4 - 2).float() if rowwise else tensor_scale(seed)
    torch.library.opcheck(torch.ops.safeops.cast_transpose.default, (x, scale, torch.float8_e5m2, rowwise))
    torch.library.opcheck(torch.ops.safeops.cast_transpose.default, (x.t(), scale[:1] if rowwise else scale,
                                                                     torch.float8_e4m3fn, False))


@given(seed=seeds())
def test_torch_compile_of_the_function_matches_eager(backend, seed):
    x = random_x(seed, 40, 72, torch.bfloat16, torch.float8_e4m3fn)
    scale = tensor_scale(seed)
    compiled = torch.compile(lambda x, s: safeops.cast_transpose(x, s), fullgraph=True)
    got, ref = compiled(x, scale), safeops.cast_transpose(x, scale)
    assert torch.equal(u8(got[0]), u8(ref[0])) and torch.equal(u8(got[1]), u8(ref[1]))
    assert got[1].stride() == (1, 40) and torch.equal(got[2], ref[2])
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------------
# The compiled kernel, for sm_90 (no GPU needed): conversion instruction, vector stores, no fma
# --------------------------------------------------------------------------------------------------

_PTX_SCRIPT = textwrap.dedent(
    r"""
    import json, re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from safeops.kernels import cast_transpose as k
    from safeops.ops import cast_transpose_launch as L
    from safeops import reference

    fn = k.cast_transpose_kernel
    out = {}
    for name, cfg in L.CONFIGS.items():
        for fp8 in reference.FP8_FORMATS.values():
            for hw in (True, False):
                const = dict(FP8=fp8.code, MAX_BITS=fp8.max_bits, MAN=fp8.mantissa_bits,
                             BIAS=fp8.exponent_bias, ROWWISE=False, HW_CVT=hw, X_BF16_BITS=True,
                             WIDE=False, EVEN=True, NUM_STAGES=cfg.num_stages, BLOCK_M=cfg.block_m,
                             BLOCK_K=cfg.block_k, PACK=cfg.pack, PARTIALS=False, sxk=1)
                types = {"x_ptr": "*i16", "scale_ptr": "*fp32", "y_ptr": "*u8",
                         "yt_ptr": "*i32" if cfg.pack else "*u8", "ws_ptr": "*i32", "amax_ptr": "*i32"}
                sig = {a: "constexpr" if a in const else types.get(a, "i32") for a in fn.arg_names}
                aligned = ("x_ptr", "scale_ptr", "y_ptr", "yt_ptr", "ws_ptr", "amax_ptr", "M", "K", "sxm",
                           "MW")
                attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
                src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
                options = {"num_warps": cfg.num_warps, "enable_fp_fusion": False}
                ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
                out[f"{name}/{fp8.code}/{int(hw)}"] = {
                    "cvt": len(re.findall(r"cvt\.rn\.satfinite\.e[45]m[23]x2\.f32", ptx)),
                    "st_v4": len(re.findall(r"st\.global(\.\w+)*\.v4\.b32", ptx)),
                    "st_all": len(re.findall(r"st\.global", ptx)),
                    "shared_bytes": len(re.findall(r"(?:ld|st)\.shared(?:\.\w+)*\.[ubs]8\b", ptx)),
                    "fma": len(re.findall(r"\bfma\.", ptx)),
                    "mul_no_rn": len(re.findall(r"\bmul(\.ftz)?\.f32\b", ptx)),
                    "elements": cfg.block_m * cfg.block_k // (32 * cfg.num_warps),
                }
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def ptx_counts():
    return sm90.run_script(_PTX_SCRIPT, what="cast_transpose_kernel")


def test_compiled_kernel_for_sm90(ptx_counts):
    assert len(ptx_counts) == 2 * 2 * len(launch.CONFIGS)
    for name, c in ptx_counts.items():
        hw = name.endswith("/1")
        # The hardware path converts two values per instruction (the pipelined loop may be peeled, which
        # repeats the body); the integer path uses none.
        half = c["elements"] // 2
        assert (c["cvt"] > 0 and c["cvt"] % half == 0) if hw else c["cvt"] == 0, (name, c)
        # Both outputs leave as 16-byte vectors: one v4 store per 16 one-byte codes, per output.
        assert c["st_v4"] == 2 * c["elements"] // 16 and c["st_all"] == c["st_v4"] + 1, (name, c)
        # y_t is transposed as 4-code words (PACK), never byte by byte through shared memory.
        assert c["shared_bytes"] == 0, (name, c)
        # One IEEE fp32 multiply per element, never contracted (contract section 1).
        assert c["fma"] == 0 and c["mul_no_rn"] == 0, (name, c)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("programs", [1, 3, 40])
def test_partials_give_the_hand_off_amax(x_dtype, rowwise, programs):
    """PARTIALS (how the compiled graph's triton_op takes amax: one maximum per program, reduced after the
    kernel, no zeroed workspace) gives the workspace hand-off's amax bits and the same y / y_t, with one
    program taking every tile, programs taking several, and more programs than tiles (their maximum 0)."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(200, 136, generator=gen) * 300).to(x_dtype)
    x[5, 7], x[9, 100], x[150, 3] = math.inf, -math.inf, -0.0
    if x_dtype == torch.bfloat16:
        x[77, 77] = math.nan
    s = torch.rand(200, 1, generator=gen) + 0.5 if rowwise else torch.tensor(0.37)
    fp8 = torch.float8_e4m3fn
    ref = launch.cast_transpose(x, s, fp8, rowwise)
    config, hardware_convert, pack = launch._choice(x, None, None, bf16=False)
    options, scalars = launch._options_and_scalars(x, s, fp8, rowwise, config, hardware_convert, pack, False)
    y, y_t, _ = launch.empty_outputs(x, fp8)
    partials = torch.full((programs,), -1, dtype=torch.int32)  # every slot must be written
    args = (x.view(torch.int16) if x_dtype == torch.bfloat16 else x, s, y.view(torch.uint8),
            launch._yt_arg(y_t, pack), partials, partials)
    launch.kernels().cast_transpose_kernel[(programs,)](*args, *scalars, **options, PARTIALS=True)
    assert (partials >= 0).all(), "a program left its slot unwritten"
    assert torch.equal(partials.max().view(torch.float32).view(torch.int32), ref[2].view(torch.int32))
    assert torch.equal(y.view(torch.uint8), ref[0].view(torch.uint8))
    assert torch.equal(y_t.view(torch.uint8), ref[1].view(torch.uint8))
