"""torch.compile turns a hand-written fp8 cast + transposed copy into ``safeops::cast_transpose`` (issue 6).

CPU Inductor. Under ``safeops.registered()`` and ``backend="safeops"``:

- the compiled function returns the same bits as eager (y, y_t and amax; y_t with its eager strides);
- the generated code (``run_and_get_code``) calls ``torch.ops.safeops.cast_transpose`` exactly once, and no
  Inductor kernel converts to fp8 (no ``Float8`` C++ type in any generated kernel);
- ``safeops.compile.stats`` counts the rewrite.

Negatives (a different clamp bound, an intermediate used elsewhere, no transposed copy, x requiring grad, a
python-float scale) are not rewritten and give the stock results.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given
from strategies import each_example, seeds
from torch._inductor.utils import run_and_get_code

import safeops
import safeops.compile as safeops_compile

stats = safeops_compile.stats
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
M4, M5 = torch.finfo(E4M3).max, torch.finfo(E5M2).max


@pytest.fixture(autouse=True)
def isolated():
    """Unregistered, Dynamo reset, stats cleared and the caches off, for each test and (``@each_example``)
    each Hypothesis example."""
    with isolation():
        yield


@contextlib.contextmanager
def isolation():
    import torch._functorch.config as fconfig
    import torch._inductor.config as config

    saved_pass = config.pre_grad_custom_pass
    if safeops.is_registered():
        safeops.unregister()
    torch._dynamo.reset()
    stats.clear()
    with config.patch(fx_graph_cache=False), fconfig.patch(enable_autograd_cache=False):
        try:
            yield
        finally:
            if safeops.is_registered():
                safeops.unregister()
            torch._dynamo.reset()
            config.pre_grad_custom_pass = saved_pass
            stats.clear()


def u8(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(p, q) for p, q in zip(a, b, strict=True))
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    if a.dtype.is_floating_point and a.element_size() > 1:
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return torch.equal(u8(a), u8(b))


def compile_and_run(fn, args, mode: str):
    backend = "safeops" if mode == "backend" else "inductor"
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    if mode == "registered":
        with safeops.registered():
            return run_and_get_code(compiled, *args)
    return run_and_get_code(compiled, *args)


def inputs(seed, m=48, k=40, dtype=torch.bfloat16, rowwise=False):
    x = seed.randn(m, k, dtype=torch.float32, std=300.0)
    x[0, 0], x[1, 2], x[2, 3], x[3, 1] = float("nan"), float("inf"), -float("inf"), -0.0
    scale = (torch.exp2(seed.rand(m, 1) * 6 - 3).float() if rowwise
             else torch.tensor(seed.uniform(0.3, 3.0), dtype=torch.float32))
    return x.to(dtype), scale


# The forms float8 code writes the cast in; each returns y, the transposed copy, and sometimes amax.
FORMS = {
    "float_mul_clamp_to": lambda x, s: _t(((x.float() * s).clamp(-M4, M4)).to(E4M3)),
    "torch_clamp_kwargs": lambda x, s: _t(torch.clamp(x.to(torch.float32) * s, min=-M4, max=M4)
                                          .to(dtype=E4M3)),
    "scale_first_e5m2": lambda x, s: _t((s * x.float()).clamp(-M5, M5).to(E5M2)),
    "int_bounds_clip": lambda x, s: _t(torch.clip(torch.mul(x.float(), s), -448, 448).to(E4M3)),
    "t_contiguous_only": lambda x, s: _t((x.float() * s).clamp(-M4, M4).to(E4M3), back=False),
    "with_amax": lambda x, s: (*_t((x.float() * s).clamp(-M4, M4).to(E4M3)), x.abs().max()),
    "with_torch_max_abs": lambda x, s: (*_t((x.float() * s).clamp(-M4, M4).to(E4M3)),
                                        torch.max(torch.abs(x))),
    "with_amax_of_float": lambda x, s: _amax_of_float(x, s),
    "transpose_permute": lambda x, s: _permute(x, s),
}


def _t(y, back=True):
    c = y.t().contiguous()
    return (y, c.t()) if back else (y, c)


def _amax_of_float(x, s):
    xf = x.float()
    y = (xf * s).clamp(-M4, M4).to(E4M3)
    return y, y.transpose(0, 1).contiguous().transpose(0, 1), torch.amax(xf.abs())


def _permute(x, s):
    y = (x.float() * s).clamp(-M4, M4).to(E4M3)
    return y, y.permute(1, 0).contiguous().t()


def assert_one_fused_op(code: str) -> None:
    assert code.count("torch.ops.safeops.cast_transpose.default(") == 1, code
    assert "Float8" not in code, "an Inductor kernel still converts to fp8:\n" + code


@pytest.mark.parametrize("mode", ["registered", "backend"])
@pytest.mark.parametrize("form", list(FORMS))
@given(seed=seeds())
@each_example(isolation)
def test_rewritten_to_one_op_with_eager_bits(seed, mode, form):
    x, s = inputs(seed, dtype=torch.float16 if form == "scale_first_e5m2" else torch.bfloat16)
    fn = FORMS[form]
    out, codes = compile_and_run(fn, (x, s), mode)
    assert same(out, fn(x, s)), f"{form}: compiled != eager ({seed})"
    assert stats["cast_transpose_pattern"] == 1
    assert_one_fused_op("\n".join(codes))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@given(seed=seeds())
@each_example(isolation)
def test_rowwise_scale(seed, x_dtype):
    x, s = inputs(seed, dtype=x_dtype, rowwise=True)

    def fn(x, s):
        xf = x if x.dtype == torch.float32 else x.float()
        y = (xf * s).clamp(-M4, M4).to(E4M3)
        return y, y.t().contiguous().t()

    out, codes = compile_and_run(fn, (x, s), "registered")
    assert same(out, fn(x, s)) and stats["cast_transpose_pattern"] == 1
    assert_one_fused_op("\n".join(codes))


@given(seed=seeds())
@each_example(isolation)
def test_delayed_scaling_keeps_its_own_amax(seed):
    """The scale comes from amax: the op cannot supply it (it would need itself). The cast is still fused."""
    x, _ = inputs(seed)

    def fn(x):
        amax = x.abs().max().float()
        s = M4 / torch.clamp(amax, min=1e-12)
        y = (x.float() * s).clamp(-M4, M4).to(E4M3)
        return y, y.t().contiguous().t(), amax

    x = x.nan_to_num(0.0, 0.0, 0.0)
    out, codes = compile_and_run(fn, (x,), "registered")
    assert same(out, fn(x)) and stats["cast_transpose_pattern"] == 1
    assert "\n".join(codes).count("torch.ops.safeops.cast_transpose.default(") == 1


NEGATIVES = {
    "bound_not_the_max": lambda x, s: _t((x.float() * s).clamp(-440.0, 440.0).to(E4M3)),
    "asymmetric_bound": lambda x, s: _t((x.float() * s).clamp(-M4, 440.0).to(E4M3)),
    "other_dtypes_max": lambda x, s: _t((x.float() * s).clamp(-M5, M5).to(E4M3)),
    "product_used_elsewhere": lambda x, s: (*_t(((z := x.float() * s).clamp(-M4, M4)).to(E4M3)), z.sum()),
    "clamped_used_elsewhere": lambda x, s: (*_t((c := (x.float() * s).clamp(-M4, M4)).to(E4M3)), c.sum()),
    "upcast_used_elsewhere": lambda x, s: (*_t(((xf := x.float()) * s).clamp(-M4, M4).to(E4M3)), xf.sum()),
    "no_transposed_copy": lambda x, s: (x.float() * s).clamp(-M4, M4).to(E4M3),
    "python_float_scale": lambda x, s: _t((x.float() * 2.5).clamp(-M4, M4).to(E4M3)),
    "no_clamp": lambda x, s: _t((x.float() * s).to(E4M3)),
}


@pytest.mark.parametrize("form", list(NEGATIVES))
@given(seed=seeds())
@each_example(isolation)
def test_not_rewritten(seed, form):
    x, s = inputs(seed)
    fn = NEGATIVES[form]
    out, codes = compile_and_run(fn, (x, s), "registered")
    assert stats["cast_transpose_pattern"] == 0
    assert "safeops.cast_transpose" not in "\n".join(codes)
    assert same(out, fn(x, s)), f"{form}: compiled != eager"


@given(seed=seeds())
@each_example(isolation)
def test_x_requiring_grad_is_not_rewritten(seed):
    x, s = inputs(seed, dtype=torch.float32)
    x = x.nan_to_num(0.0, 1.0, -1.0).requires_grad_()
    fn = FORMS["float_mul_clamp_to"]
    out, codes = compile_and_run(fn, (x, s), "registered")
    assert stats["cast_transpose_pattern"] == 0 and "safeops.cast_transpose" not in "\n".join(codes)
    assert same([o.detach() for o in out], [o.detach() for o in fn(x, s)])


@given(seed=seeds())
@each_example(isolation)
def test_rewrite_function_on_a_graph_module(seed):
    """``rewrite(gm)`` used directly on a traced GraphModule: one op, the same results."""
    from safeops.compile.cast_transpose import rewrite

    x, s = inputs(seed)
    captured = []

    def capture(gm, example_inputs):
        captured.append(rewrite(gm))
        return gm.forward

    fn = FORMS["with_amax"]
    out = torch.compile(fn, backend=capture, fullgraph=True)(x, s)
    assert captured == [1] and same(out, fn(x, s))
