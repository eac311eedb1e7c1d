"""GPU-only tests of safeops.cast_transpose: the compiled Triton kernel against eager torch, bit for bit.

The reference is the expression the op promises to equal, run by eager torch on the same GPU:
``(x.float() * scale).clamp(-max, max).to(dtype)``, its ``.t().contiguous().t()``, and ``x.abs().max()``.
Bits are compared as bytes, NaN included (a mismatch message prints x, z and both codes).

- every bf16 / fp16 bit pattern (65,536 inputs: NaN with both signs and payloads, +-inf, -0, subnormals,
  every tie and carry of both fp8 dtypes) at scales that round, saturate, underflow, and are 0 / inf /
  NaN; random fp32 bit patterns; both conversion paths (the hardware ``cvt.rn.satfinite`` default and the
  integer rounding) — these are the corners CPU CI cannot check (Triton's interpreter rounds fp8 wrongly);
- shapes that are not multiples of the tile (1x1, 1000x37, 33x512, ...), the benchmark shapes, tensorwise
  and rowwise scales, strided / transposed / broadcast inputs;
- every tile configuration of the launcher table and its candidates (SWEEP_CANDIDATES), persistent or not;
- ``y_t`` strides ``(1, M)``; amax exact, NaN when x has a NaN; determinism over repeated runs;
- a tensor of more than 2**31 elements (64-bit offsets), CUDA-graph capture and replay, two streams at once;
- ``torch.compile`` of the hand-written expression under ``safeops.registered()``: one safeops op, no Inductor
  fp8 kernel, eager bits.

``SAFEOPS_GPU_SMALL=1`` shrinks shapes and skips the huge test (for compute-sanitizer runs).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import safeops
from safeops.ops import cast_transpose_launch as launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
SMALL = os.environ.get("SAFEOPS_GPU_SMALL", "0").strip() not in ("", "0")
FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3fn"), pytest.param(torch.float8_e5m2, id="e5m2")]
X_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
            pytest.param(torch.float32, id="fp32")]
CONVERSIONS = [pytest.param(True, id="hw_cvt"), pytest.param(False, id="int_rne")]
SCALES = [1.0, 0.1, 0.3333333, 2.0**-10, 3.0e4, -7.5, 1e-30, 0.0, math.inf, math.nan]
SHAPES = [(1, 1), (1000, 37), (33, 512), (64, 64), (129, 257), (4096, 4096)]
BENCH_SHAPES = [(4096, 4096), (8192, 8192), (16384, 4096), (3072, 12288)]


def eager(x, scale, dtype):
    m = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-m, m).to(dtype)


def u8(t):
    return t.view(torch.uint8)


def assert_matches_eager(x, scale, dtype, out, context=""):
    y, y_t, amax = out
    m, k = x.shape
    ref = eager(x, scale, dtype)
    where = f"{context} x {tuple(x.shape)} {x.dtype} stride {x.stride()} -> {dtype}"
    assert y.shape == (m, k) and y.is_contiguous() and y.dtype == dtype, where
    assert y_t.shape == (m, k) and y_t.stride() == (1, max(m, 1)) and y_t.dtype == dtype, where
    diff = u8(y) != u8(ref)
    if diff.any():
        idx = diff.nonzero()[:6]
        rows = []
        for i, j in idx.tolist():
            s = scale[i] if scale.dim() == 2 and scale.shape[0] == m else scale
            z = x[i:i + 1, j:j + 1].float() * s
            rows.append(f"x={x[i, j].item()!r} z={z.item()!r} z_bits={z.view(torch.int32).item():#010x} "
                        f"got={u8(y)[i, j].item():#04x} eager={u8(ref)[i, j].item():#04x}")
        s_full = scale.reshape(-1, 1) if scale.dim() == 2 and scale.shape[0] == m else scale.reshape(())
        both_nan = int((diff & torch.isnan(x) & torch.isnan(s_full)).sum())
        raise AssertionError(f"{int(diff.sum())} of {y.numel()} codes differ from eager ({both_nan} of them "
                             f"where x and the scale are both NaN); {where}\n  " + "\n  ".join(rows))
    assert torch.equal(u8(y_t), u8(ref)), f"y_t differs from eager; {where}"
    ref_amax = x.abs().max().float() if x.numel() else torch.zeros((), device=x.device)
    assert amax.dtype == torch.float32 and amax.shape == ()
    if torch.isnan(ref_amax):
        assert torch.isnan(amax), f"amax {amax.item()} should be NaN; {where}"
    else:
        assert torch.equal(amax, ref_amax), f"amax {amax.item()} != {ref_amax.item()}; {where}"


def all_16bit(dtype):
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32, device=DEV).to(torch.int16)
    return bits.view(dtype).reshape(256, 256)


@pytest.mark.parametrize("hw", CONVERSIONS)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fp8", FP8)
def test_every_16bit_input_every_scale(fp8, x_dtype, hw):
    x = all_16bit(x_dtype)
    for s in SCALES:
        scale = torch.tensor(s, dtype=torch.float32, device=DEV)
        out = launch.cast_transpose(x, scale, fp8, False, hardware_convert=hw)
        assert_matches_eager(x, scale, fp8, out, f"scale={s} hw={hw}")
    rows = torch.tensor(SCALES * 26, dtype=torch.float32, device=DEV)[:256].reshape(256, 1)
    out = launch.cast_transpose(x, rows, fp8, True, hardware_convert=hw)
    assert_matches_eager(x, rows, fp8, out, f"rowwise hw={hw}")


@pytest.mark.parametrize("hw", CONVERSIONS)
@pytest.mark.parametrize("fp8", FP8)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_fp32_bit_patterns(fp8, hw, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    bits = torch.randint(-2**31, 2**31, (512, 768), device=DEV, generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    for s in (1.0, 0.37, 2.0**-100, 2.0**100):
        scale = torch.tensor(s, dtype=torch.float32, device=DEV)
        assert_matches_eager(x, scale, fp8, launch.cast_transpose(x, scale, fp8, False, hardware_convert=hw),
                             f"random bits of seed {seed}, scale={s}")


def random_input(m, k, dtype, std=300.0):
    x = torch.randn(m, k, device=DEV, dtype=torch.float32) * std
    if x.numel() > 8:
        flat = x.view(-1)
        for v in (math.nan, math.inf, -math.inf, -0.0, 1e-6, 449.0, 464.0, 57344.0 * 1.2):
            flat[torch.randint(0, flat.numel(), (1,), device=DEV)] = v
    return x.to(dtype)


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("fp8", FP8)
def test_shapes(fp8, x_dtype, rowwise):
    for m, k in (SHAPES[:4] if SMALL else SHAPES):
        x = random_input(m, k, x_dtype)
        scale = (torch.exp2(torch.rand(m, 1, device=DEV) * 8 - 4) if rowwise
                 else torch.tensor(0.731, device=DEV))
        assert_matches_eager(x, scale, fp8, safeops.cast_transpose(x, scale, fp8, rowwise=rowwise))


@pytest.mark.skipif(SMALL, reason="SAFEOPS_GPU_SMALL")
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("shape", BENCH_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_benchmark_shapes(shape, rowwise):
    m, k = shape
    x = random_input(m, k, torch.bfloat16)
    scale = torch.exp2(torch.rand(m, 1, device=DEV) * 8 - 4) if rowwise else torch.tensor(0.731, device=DEV)
    out = safeops.cast_transpose(x, scale, rowwise=rowwise)
    assert_matches_eager(x, scale, torch.float8_e4m3fn, out)


LAYOUTS = {
    "transposed": lambda b: b.t(),
    "sliced": lambda b: b[3:, ::3],
    "broadcast_rows": lambda b: b[:1].expand(b.shape[0], -1),
    "broadcast_cols": lambda b: b[:, :1].expand(-1, 300),
    "narrow_offset": lambda b: b[1:, 7:260],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts(layout):
    base = random_input(700, 520, torch.bfloat16)
    x = LAYOUTS[layout](base)
    scale = torch.tensor(1.7, device=DEV)
    assert_matches_eager(x, scale, torch.float8_e4m3fn, safeops.cast_transpose(x, scale), layout)
    rows = torch.exp2(torch.rand(x.shape[0], 1, device=DEV) * 8 - 4)
    assert_matches_eager(x, rows, torch.float8_e4m3fn, safeops.cast_transpose(x, rows, rowwise=True), layout)


def _candidate_id(candidate):
    cfg, hw = candidate
    grid = {None: "persistent", 0: "tiles"}.get(cfg.programs_per_sm, f"{cfg.programs_per_sm}perSM")
    conv = {None: "default", True: "hw", False: "int"}[hw]
    transpose = "pack" if cfg.pack else "bytes"
    return f"{cfg.block_m}x{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}-{grid}-{transpose}-{conv}"


@pytest.mark.parametrize("candidate", launch.SWEEP_CANDIDATES, ids=_candidate_id)
def test_every_config_the_sweep_can_choose(candidate):
    """Every (config, conversion) of launch.SWEEP_CANDIDATES, the candidates for CONFIGS:
    eager bits on ragged and even shapes, M % 4 == 0 (packed y_t words) and not (byte fallback), both
    scalings, amax included."""
    config, hw = candidate
    for m, k, rowwise in ((1000, 37, False), (1002, 200, True), (2048, 1024, True), (1536, 4096 + 64, False),
                          (512, 768, False)):
        x = random_input(m, k, torch.bfloat16)
        scale = torch.exp2(torch.rand(m, 1, device=DEV) * 8 - 4) if rowwise else torch.tensor(0.9, device=DEV)
        fp8 = torch.float8_e4m3fn
        out = launch.cast_transpose(x, scale, fp8, rowwise, config=config, hardware_convert=hw)
        assert_matches_eager(x, scale, fp8, out, _candidate_id(candidate))
        again = launch.cast_transpose(x, scale, fp8, rowwise, config=config, hardware_convert=hw)
        assert torch.equal(u8(out[0]), u8(again[0])) and torch.equal(u8(out[1]), u8(again[1]))
        assert torch.equal(out[2].view(torch.int32), again[2].view(torch.int32))


def test_deterministic_and_amax_nan():
    x = random_input(4096, 4096, torch.bfloat16).nan_to_num(0.0, 1e4, -1e4)
    scale = torch.tensor(0.5, device=DEV)
    first = safeops.cast_transpose(x, scale)
    for _ in range(5):
        again = safeops.cast_transpose(x, scale)
        assert torch.equal(u8(first[0]), u8(again[0])) and torch.equal(u8(first[1]), u8(again[1]))
        assert torch.equal(first[2].view(torch.int32), again[2].view(torch.int32))
    assert first[2].item() == x.abs().max().item()
    x[4000, 17] = math.nan
    assert torch.isnan(safeops.cast_transpose(x, scale)[2])
    x[4000, 17] = 0.0
    assert safeops.cast_transpose(x, scale)[2].item() == x.abs().max().item()  # the NaN did not stick


@pytest.mark.skipif(SMALL, reason="SAFEOPS_GPU_SMALL")
def test_more_than_2_to_the_31_elements():
    m, k = 2**16 + 1, 2**15 + 3
    need = m * k * (2 + 1 + 1) + 3 * 2**30
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB free on the GPU, {free / 2**30:.0f} GiB are")
    x = torch.empty(m, k, device=DEV, dtype=torch.bfloat16).uniform_(-600, 600)
    x[-1, -1] = 1000.0  # the largest magnitude sits at the very last element
    scale = torch.tensor(0.75, device=DEV)
    y, y_t, amax = safeops.cast_transpose(x, scale)
    assert amax.item() == 1000.0
    step = 4096
    for i in range(0, m, step):
        ref = eager(x[i:i + step], scale, torch.float8_e4m3fn)
        assert torch.equal(u8(y[i:i + step]), u8(ref)), f"rows {i}..{i + step}"
        assert torch.equal(u8(y_t[i:i + step]), u8(ref)), f"y_t rows {i}..{i + step}"


def test_cuda_graph_capture_and_replay():
    x = random_input(1024, 2048, torch.bfloat16).nan_to_num(0.0, 1.0, -1.0)
    scale = torch.tensor(0.25, device=DEV)
    safeops.cast_transpose(x, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = safeops.cast_transpose(x, scale)
    for value in (3.0, 700.0, 5.0):
        x.copy_(random_input(1024, 2048, torch.bfloat16).nan_to_num(0.0, 1.0, -1.0))
        x[5, 9] = value
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_eager(x, scale, torch.float8_e4m3fn, out, f"replay with {value}")


def test_two_streams_at_once():
    xs = [random_input(4096, 4096, torch.bfloat16).nan_to_num(0.0, 1.0, -1.0) for _ in range(2)]
    xs[1][0, 0] = 12345.0
    scale = torch.tensor(0.01, device=DEV)
    streams = [torch.cuda.Stream() for _ in xs]
    torch.cuda.synchronize()
    outs = []
    for _ in range(3):
        for x, stream in zip(xs, streams, strict=True):
            with torch.cuda.stream(stream):
                outs.append((x, safeops.cast_transpose(x, scale)))
    torch.cuda.synchronize()
    for x, out in outs:
        assert_matches_eager(x, scale, torch.float8_e4m3fn, out, "two streams")


@pytest.mark.parametrize(("x_dtype", "m", "rowwise", "fp8"), [
    (torch.bfloat16, 4096, False, torch.float8_e4m3fn),  # the bf16 kernel
    (torch.bfloat16, 1024, True, torch.float8_e5m2),
    (torch.float32, 2048, True, torch.float8_e4m3fn),  # the general kernel, y_t as packed words
    (torch.float16, 1022, False, torch.float8_e5m2),  # the general kernel, y_t as bytes (M % 4 != 0)
])
def test_torch_compile_rewrite_on_gpu(x_dtype, m, rowwise, fp8):
    """Under safeops.register() the compiled graph launches the safeops kernel from Inductor's own code
    (the triton_op: no opaque op, no Inductor kernel touching fp8) and gives the eager expression's bits."""
    import re

    from torch._inductor.utils import run_and_get_code

    import safeops.compile as safeops_compile

    big = torch.finfo(fp8).max

    def fn(x, s):
        y = (x.float() * s).clamp(-big, big).to(fp8)
        return y, y.t().contiguous().t(), x.abs().max()

    x = random_input(m, 768, x_dtype)  # NaN and infinities included
    s = (torch.rand(m, 1, device=DEV) + 0.1) if rowwise else torch.tensor(0.6, device=DEV)
    torch._dynamo.reset()
    safeops_compile.stats.clear()
    with safeops.registered():
        out, codes = run_and_get_code(torch.compile(fn, fullgraph=True), x, s)
    torch._dynamo.reset()
    code = "\n".join(codes)
    assert safeops_compile.stats["cast_transpose_pattern"] == 1
    assert "torch.ops.safeops.cast_transpose" not in code, "the opaque op is still in the graph"
    kernel = "cast_transpose_bf16_kernel" if x_dtype == torch.bfloat16 else "cast_transpose_kernel"
    assert kernel in code, f"Inductor does not launch {kernel}"
    # Inductor's own kernels: the workspace's zero fill and, for a 16-bit x, amax's cast to x's dtype (what
    # x.abs().max() returns); none casts to fp8.
    own = [src for src in code.split("async_compile.triton(")[1:] if re.search(r"def triton_\w+\(", src)]
    assert not any("float8" in src.split("\'\'\'")[1] for src in own), "an Inductor kernel still casts to fp8"
    assert len(own) <= (1 if x_dtype == torch.float32 else 2), code
    # Inductor read the kernel as writing its outputs and workspace only: no copy of x or the scale (what it
    # adds for inputs a user kernel may write).
    assert ".copy_(" not in code, code
    ref = fn(x, s)
    assert torch.equal(u8(out[0]), u8(ref[0])) and torch.equal(u8(out[1]), u8(ref[1]))
    assert out[1].stride() == ref[1].stride()
    assert torch.equal(out[2].isnan(), ref[2].isnan())
    eager = safeops.cast_transpose(x, s, fp8, rowwise=rowwise)  # the opaque op's launcher: the same bits
    assert torch.equal(u8(out[0]), u8(eager[0])) and torch.equal(u8(out[1]), u8(eager[1]))
    # The graph's amax is x.abs().max()'s, in x's dtype: the op's fp32 amax cast by Inductor.
    torch.testing.assert_close(out[2], eager[2].to(out[2].dtype), rtol=0, atol=0, equal_nan=True)


def test_torch_compile_rewrite_dynamic_shapes_on_gpu():
    """With dynamic shapes the triton_op's launch is traced from symbolic sizes (its grid and scalars follow
    them): one compiled function, three shapes (M % 4 == 0 or not, a partial tile), each with the eager
    expression's bits and the eager op's amax."""
    import safeops.compile as safeops_compile

    def fn(x, s):
        # The bound is written inside the function, as float8 code does (torchao's to_fp8_saturated): with
        # dynamic=True, Dynamo turns a float captured from outside into a graph input, which no rewrite
        # can prove equal to the fp8 max (docs/compile.md).
        big = torch.finfo(torch.float8_e4m3fn).max
        y = (x.float() * s).clamp(-big, big).to(torch.float8_e4m3fn)
        return y, y.t().contiguous().t(), x.abs().max()

    torch._dynamo.reset()
    safeops_compile.stats.clear()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    s = torch.tensor(0.6, device=DEV)
    with safeops.registered():
        for m, k in ((1024, 768), (2052, 640), (1030, 200)):
            x = random_input(m, k, torch.bfloat16)
            out = compiled(x, s)
            ref = fn(x, s)
            what = f"{m}x{k}"
            assert torch.equal(u8(out[0]), u8(ref[0])) and torch.equal(u8(out[1]), u8(ref[1])), what
            assert out[1].stride() == ref[1].stride(), what
            eager = safeops.cast_transpose(x, s)
            torch.testing.assert_close(out[2], eager[2].to(out[2].dtype), rtol=0, atol=0, equal_nan=True)
    torch._dynamo.reset()
    assert safeops_compile.stats["cast_transpose_pattern"] >= 1
