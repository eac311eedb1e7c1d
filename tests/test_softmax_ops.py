"""The torch.library ops: opcheck, fake implementations, torch.compile and torch.export (contract section 6).

Compiled code must run the same op as eager and give the same bits; the fake (meta) implementation must
describe the real outputs exactly (shape, dtype and strides), or compiled graphs would read them wrongly.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from strategies import Seed, seeds
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

import safeops

FORWARD_OPS = {
    "softmax": torch.ops.safeops.softmax.default,
    "log_softmax": torch.ops.safeops.log_softmax.default,
    "logsumexp": torch.ops.safeops.logsumexp.default,
}
KIND = {"softmax": 0, "log_softmax": 1, "logsumexp": 2}
OP_IDS = list(FORWARD_OPS)


def bits(t: torch.Tensor) -> torch.Tensor:
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}
    return t.detach().contiguous().view(ints[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    diff = bits(a) != bits(b)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {a.numel()} elements differ in their bits"


# --------------------------------------------------------------------------------------------------
# opcheck: schema, autograd registration, fake tensor, AOT dispatch (dynamic shapes)
# --------------------------------------------------------------------------------------------------

ARG_VARIANTS = ["plain", "scale_float", "scale_tensor", "mask", "scale_tensor_and_mask_fp16_to_fp32",
                "transposed_dim0_scale_float_and_mask"]


def forward_args(variant: str, seed, requires_grad: bool = True):
    """(x, dim, scale, scale_tensor, mask, out_dtype) as the op takes them: dim >= 0, mask expanded."""
    x = seed.randn(3, 4, 7)
    dim, scale, scale_tensor, mask, out_dtype = 2, None, None, None, None
    if variant == "scale_float":
        scale = seed.uniform(0.2, 2.0)
    if variant in ("scale_tensor", "scale_tensor_and_mask_fp16_to_fp32"):
        scale_tensor = torch.tensor(seed.uniform(0.2, 2.0)).requires_grad_(requires_grad)
    if variant in ("mask", "scale_tensor_and_mask_fp16_to_fp32"):
        mask = seed.mask(4, 7).expand(3, 4, 7)  # a broadcast mask reaches the op as an expanded view
    if variant == "scale_tensor_and_mask_fp16_to_fp32":
        x, out_dtype = x.half(), torch.float32
    if variant == "transposed_dim0_scale_float_and_mask":
        x, dim, scale = x.transpose(0, 2), 0, seed.uniform(0.2, 2.0)
        mask = seed.mask(7, 4, 3)
    return x.requires_grad_(requires_grad), dim, scale, scale_tensor, mask, out_dtype


def _opcheck(op, args) -> None:
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("variant", ARG_VARIANTS)
@pytest.mark.parametrize("name", OP_IDS)
@given(seed=seeds())
def test_opcheck_forward(reference_backend, name, variant, seed):
    _opcheck(FORWARD_OPS[name], forward_args(variant, seed))


@pytest.mark.parametrize("variant", ["plain", "transposed_dim0_scale_float_and_mask",
                                     "scale_tensor_and_mask_fp16_to_fp32"])
@pytest.mark.parametrize("name", OP_IDS)
@given(seed=seeds())
def test_opcheck_forward_triton(triton_backend, name, variant, seed):
    _opcheck(FORWARD_OPS[name], forward_args(variant, seed))


def backward_args(name: str, variant: str, seed):
    x, dim, scale, scale_tensor, mask, out_dtype = forward_args(variant, seed, requires_grad=False)
    out, row_max, row_sum = FORWARD_OPS[name](x, dim, scale, scale_tensor, mask, out_dtype)
    grad = seed.randn(*out.shape, dtype=out.dtype)
    return (grad, x, row_max, row_sum, dim, KIND[name], scale, scale_tensor, mask, scale_tensor is not None)


@pytest.mark.parametrize("variant", ["plain", "scale_float", "scale_tensor_and_mask_fp16_to_fp32",
                                     "transposed_dim0_scale_float_and_mask"])
@pytest.mark.parametrize("name", OP_IDS)
@given(seed=seeds())
def test_opcheck_backward(reference_backend, name, variant, seed):
    _opcheck(torch.ops.safeops.softmax_backward.default, backward_args(name, variant, seed))


@pytest.mark.parametrize("name", OP_IDS)
@given(seed=seeds())
def test_opcheck_backward_triton(triton_backend, name, seed):
    _opcheck(torch.ops.safeops.softmax_backward.default,
             backward_args(name, "scale_tensor_and_mask_fp16_to_fp32", seed))


# --------------------------------------------------------------------------------------------------
# Fake implementations describe the real outputs, strides included
# --------------------------------------------------------------------------------------------------

LAYOUTS = {
    "contiguous": lambda s: (s.randn(3, 5, 6), 2),
    "permuted": lambda s: (s.randn(3, 5, 6).permute(2, 0, 1), 1),
    "transposed_dim0": lambda s: (s.randn(6, 9).t(), 0),
    "sliced": lambda s: (s.randn(6, 10)[::2, 1:8], 1),
    "expanded": lambda s: (s.randn(1, 5, 6).expand(4, 5, 6), 2),
    "permuted_4d_middle_dim": lambda s: (s.randn(2, 3, 4, 5).permute(3, 1, 0, 2), 1),
    "permuted_5d_copy_path": lambda s: (s.randn(2, 2, 2, 2, 6).permute(3, 1, 4, 0, 2), 2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", OP_IDS)
@given(seed=seeds())
def test_fake_outputs_match_real_outputs(backend, name, layout, seed):
    x, dim = LAYOUTS[layout](seed)
    scale_tensor = torch.tensor(0.5)
    real = FORWARD_OPS[name](x, dim, None, scale_tensor, None, None)
    grad = seed.randn(*real[0].shape)
    real_bwd = torch.ops.safeops.softmax_backward(grad, x, real[1], real[2], dim, KIND[name], None,
                                                  scale_tensor, None, True)
    with FakeTensorMode() as mode:
        fx, fs, fg = mode.from_tensor(x), mode.from_tensor(scale_tensor), mode.from_tensor(grad)
        fake = FORWARD_OPS[name](fx, dim, None, fs, None, None)
        fake_bwd = torch.ops.safeops.softmax_backward(fg, fx, fake[1], fake[2], dim, KIND[name], None, fs,
                                                      None, True)
    for what, r, f in zip(("out", "row_max", "row_sum", "grad_x", "grad_scale"), (*real, *real_bwd),
                          (*fake, *fake_bwd), strict=True):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride()), (
            f"{name} {what} ({backend}, x strides {x.stride()}): real {tuple(r.shape)} {r.dtype} "
            f"{r.stride()} vs fake {tuple(f.shape)} {f.dtype} {f.stride()}")


# --------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True): no graph break, same bits as eager, bounded recompiles
# --------------------------------------------------------------------------------------------------


def all_three(x, scale, mask):
    p = safeops.softmax(x, -1, scale=scale, mask=mask)
    lp = safeops.log_softmax(x, 1, scale=scale)
    lse = safeops.logsumexp(x, -1, scale=scale, mask=mask, keepdim=True)
    return p, lp, lse


def eager_and_grads(fn, x, scale, mask, grads):
    xg = x.detach().requires_grad_(True)
    sg = scale.detach().requires_grad_(True)
    outs = fn(xg, sg, mask)
    loss = sum((torch.where(o.isinf(), 0, o) * g).sum() for o, g in zip(outs, grads, strict=True))
    dx, ds = torch.autograd.grad(loss, [xg, sg])
    return (*outs, dx, ds)


NAMES = ("softmax", "log_softmax(dim=1)", "logsumexp(keepdim)", "d/dx", "d/dscale")
SHAPES = [(4, 6, 8), (5, 3, 9), (2, 7, 17), (6, 5, 33)]


@pytest.mark.parametrize("dynamic", [pytest.param(None, id="automatic_dynamic"),
                                     pytest.param(True, id="dynamic_true")])
@given(seed=seeds())
def test_compile_fullgraph_matches_eager_bitwise(reference_backend, dynamic, seed):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(all_three, backend=counter, fullgraph=True, dynamic=dynamic)
    for shape in SHAPES:
        x = seed.randn(*shape, std=3.0)
        mask = seed.mask(shape[-1])
        scale = torch.tensor(seed.uniform(0.2, 2.0))
        grads = [seed.randn(*shape), seed.randn(*shape), seed.randn(*shape[:-1], 1)]
        want = eager_and_grads(all_three, x, scale, mask, grads)
        got = eager_and_grads(compiled, x, scale, mask, grads)
        for name, a, b in zip(NAMES, got, want, strict=True):
            assert_same_bits(a, b, f"compiled vs eager {name}, shape {shape}; {seed}")
    limit = 1 if dynamic else 2  # automatic dynamic: one static graph, then one with dynamic shapes
    assert counter.frame_count <= limit, f"{counter.frame_count} compiles for {len(SHAPES)} shapes"
    torch._dynamo.reset()


@given(seed=seeds())
def test_compile_fullgraph_matches_eager_bitwise_triton(triton_backend, seed):
    # The op body is the same launcher in eager and compiled code: same kernel, same bits (section 6).
    torch._dynamo.reset()
    compiled = torch.compile(all_three, backend="inductor", fullgraph=True)
    x = seed.randn(3, 5, 12, std=3.0)
    mask = seed.mask(12)
    scale = torch.tensor(seed.uniform(0.2, 2.0))
    grads = [seed.randn(3, 5, 12), seed.randn(3, 5, 12), seed.randn(3, 5, 1)]
    want = eager_and_grads(all_three, x, scale, mask, grads)
    got = eager_and_grads(compiled, x, scale, mask, grads)
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert_same_bits(a, b, f"compiled vs eager {name} (triton); {seed}")
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------------
# torch.export
# --------------------------------------------------------------------------------------------------


class Scorer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.temperature = torch.nn.Parameter(torch.tensor(0.75))

    def forward(self, x, mask):
        p = safeops.softmax(x, -1, scale=self.temperature, mask=mask)
        lp = safeops.log_softmax(x, 0, scale=0.5, dtype=torch.float32)
        lse = safeops.logsumexp(x, -1, mask=mask, keepdim=True)
        return p, lp, lse


@given(seed=seeds())
def test_export(reference_backend, seed):
    module = Scorer()
    x = seed.randn(4, 9, std=3.0)
    mask = seed.mask(4, 9)
    batch = torch.export.Dim("batch", min=2, max=64)
    ep = torch.export.export(module, (x, mask), dynamic_shapes={"x": {0: batch}, "mask": {0: batch}})
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    for op in FORWARD_OPS.values():
        assert op in targets, f"{op} is not in the exported graph: {targets}"
    for rows in (4, 7):
        x = seed.randn(rows, 9, std=3.0)
        mask = seed.mask(rows, 9)
        for name, a, b in zip(NAMES, ep.module()(x, mask), module(x, mask), strict=False):
            assert_same_bits(a, b.detach(), f"exported vs eager {name}, {rows} rows; {seed}")


# --------------------------------------------------------------------------------------------------
# The eager fast path (plain autograd.Function over the op implementations) behaves like the op
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [safeops.softmax, safeops.log_softmax, safeops.logsumexp],
                         ids=["softmax", "log_softmax", "logsumexp"])
@given(seed=seeds())
def test_double_backward_raises_like_the_registered_op(reference_backend, fn, seed):
    # A gradient penalty through a safeops op must fail loudly, not lose its second-order term.
    x = seed.randn(3, 7).requires_grad_(True)
    (g,) = torch.autograd.grad((fn(x, -1) ** 2).sum(), x)  # first order: fine
    assert torch.isfinite(g).all() and not g.requires_grad
    with pytest.raises(RuntimeError, match="double backward|derivative|autograd"):
        (g2,) = torch.autograd.grad((fn(x, -1) ** 2).sum(), x, create_graph=True)
        g2.sum().backward()


@given(seed=seeds())
def test_jit_trace_records_the_registered_op(reference_backend, tmp_path, seed):
    x = seed.randn(2, 5)
    traced = torch.jit.trace(lambda t: safeops.softmax(t, -1), (x,))
    assert "safeops::softmax" in str(traced.graph)
    path = tmp_path / "traced.pt"
    torch.jit.save(traced, str(path))
    assert torch.equal(torch.jit.load(str(path))(x), safeops.softmax(x, -1))


@given(seed=seeds())
def test_parameter_inputs_take_the_fast_path(reference_backend, seed):
    from safeops.ops import softmax as softmax_ops

    p = torch.nn.Parameter(seed.randn(3, 5))
    assert softmax_ops.eager_fast_path(p)
    out = safeops.log_softmax(p, -1)
    g = seed.randn(3, 5)
    out.backward(g)
    x = p.detach().clone().requires_grad_(True)
    torch.ops.safeops.log_softmax.default(x, 1, None, None, None, None)[0].backward(g)
    assert torch.equal(p.grad, x.grad)



# With nothing for autograd to record, the eager fast path calls the implementation directly (no
# autograd.Function per call): the same bits as through the Function and no graph node; whatever does need
# the Function still gets it (an input that requires grad, a scale tensor that does, a forward-AD level).
def _fast_path_call(name, seed, requires_grad: bool):
    def leaf(*shape):
        return seed.randn(*shape).requires_grad_(requires_grad)

    if name == "attention":
        q, k, v = leaf(1, 2, 5, 8), leaf(1, 2, 5, 8), leaf(1, 2, 5, 8)
        return lambda: safeops.attention(q, k, v, is_causal=True)
    if name == "merge_attention":
        outs, lses = leaf(2, 1, 2, 5, 8), leaf(2, 1, 2, 5)
        return lambda: safeops.merge_attention(outs, lses)[0]
    x = leaf(4, 6)
    if name == "cross_entropy":
        target = torch.tensor([0, 5, 2, -100])
        return lambda: safeops.cross_entropy(x, target, label_smoothing=0.1)
    fn = getattr(safeops, name)  # softmax, log_softmax, logsumexp
    return lambda: fn(x, -1, scale=0.5)


FAST_PATH_OPS = ["softmax", "log_softmax", "logsumexp", "attention", "merge_attention", "cross_entropy"]


@pytest.mark.parametrize("name", FAST_PATH_OPS)
@given(seed=seeds())
def test_fast_path_without_autograd_records_nothing(reference_backend, name, seed):
    out = _fast_path_call(name, Seed(seed.value), requires_grad=False)()
    assert out.grad_fn is None and not out.requires_grad
    recorded = _fast_path_call(name, Seed(seed.value), requires_grad=True)
    through_function = recorded()
    assert through_function.grad_fn is not None
    assert torch.equal(out, through_function.detach())
    with torch.no_grad():
        under_no_grad = recorded()
    assert under_no_grad.grad_fn is None and torch.equal(out, under_no_grad)


@given(seed=seeds())
def test_fast_path_records_a_scale_that_requires_grad(reference_backend, seed):
    # x needs no gradient, the scale does: the call must still record, and d/ds matches float64 autograd.
    x, g = seed.randn(3, 7), seed.randn(3, 7)
    s = torch.tensor(0.7, requires_grad=True)
    out = safeops.softmax(x, -1, scale=s)
    assert out.requires_grad
    (ds,) = torch.autograd.grad(out, s, g)
    s64 = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    (ds64,) = torch.autograd.grad(torch.softmax(x.double() * s64, -1), s64, g.double())
    torch.testing.assert_close(ds.double(), ds64, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["softmax", "cross_entropy", "attention"])
def test_forward_ad_still_raises_on_the_fast_path(reference_backend, name):
    # A dual input that does not require grad must not slip past the Function (it would lose its tangent).
    import torch.autograd.forward_ad as fwAD

    x = torch.randn(1, 2, 4, 8)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        with pytest.raises(NotImplementedError, match="jvp"):
            if name == "softmax":
                safeops.softmax(dual, -1)
            elif name == "cross_entropy":
                safeops.cross_entropy(dual.reshape(8, 8), torch.arange(8))
            else:
                safeops.attention(dual, x, x)


@given(seed=seeds())
def test_eager_backward_builds_no_placeholder_scale_gradient(triton_backend, seed):
    # The launcher's backward returns a zero dscale for the op's schema when no scale gradient is wanted; the
    # eager path asks for None there (one allocation and fill launch less per call). With a scale tensor
    # whose gradient is wanted the value is the same either way, and so is dx.
    from safeops.ops import softmax_launch

    x, g = seed.randn(5, 9), seed.randn(5, 9)
    s = torch.tensor(0.6)
    _, m, l = softmax_launch.forward(0, x, 1, None, s, None, x.dtype)
    for need in (False, True):
        dx, ds = softmax_launch.backward(0, g, x, m, l, 1, None, s, None, need)
        dx2, ds2 = softmax_launch.backward(0, g, x, m, l, 1, None, s, None, need, dscale_placeholder=False)
        assert torch.equal(dx, dx2)
        if need:
            assert torch.equal(ds, ds2)
        else:
            assert ds2 is None and torch.equal(ds, torch.zeros(()))
    # Through autograd: a scale tensor not requiring grad, then one requiring it (float64 autograd oracle).
    xg = x.clone().requires_grad_(True)
    (dx_eager,) = torch.autograd.grad(safeops.softmax(xg, -1, scale=s), xg, g)
    x64 = x.double().requires_grad_(True)
    (dx64,) = torch.autograd.grad(torch.softmax(x64 * 0.6, -1), x64, g.double())
    torch.testing.assert_close(dx_eager.double(), dx64, rtol=1e-5, atol=1e-6)
