"""The attention launcher's plans (``attention_launch.forward`` / ``backward``) launch exactly what the
general path (``_forward_general`` / ``_backward_general``, every decision made again) launches.

A plan keeps a call's decisions per signature (shapes, strides, dtypes, 16-byte alignment, options); a
repeated call only allocates its outputs and launches. These tests run the launcher's GPU route on CPU
tensors (its GPU-only branches told this is a GPU, the kernels replaced by recorders), so nothing is
computed: each launch is recorded as kernel, grid, every argument (tensors by role -- which input or
output they are -- or, for fresh workspaces, by shape / strides / dtype), constexprs and options. The
first call of a signature builds the plan, the later ones use it; every call must record the general
path's launches. The bits on the interpreter are checked separately."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from strategies import seeds

from safeops.ops import attention_launch as L

BF16, F32 = torch.bfloat16, torch.float32


class _Recorder:
    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, tuple(grid), args, dict(kwargs)))
        return launch


@pytest.fixture
def gpu_route(monkeypatch):
    """The launcher's GPU route on CPU tensors, kernels replaced by recorders: yields the launch list."""
    launches: list = []
    kernels = type("Kernels", (), {n: _Recorder(n, launches) for n in L.KERNEL_NAMES})()
    monkeypatch.setattr(L, "_kernels", kernels)
    monkeypatch.setattr(L, "_gpu", lambda device: True)
    monkeypatch.setattr(L, "_check_device", lambda q: None)
    L.clear_plans()
    yield launches
    L.clear_plans()


def _describe(launches: list, roles: dict) -> list:
    """Launches with tensors named by role (the data pointer of a known tensor) or described as fresh."""
    def arg(a):
        if isinstance(a, torch.Tensor):
            role = roles.get((a.data_ptr(), a.dtype)) if a.numel() else None
            return ("tensor", role) if role else ("fresh", tuple(a.shape), a.stride(), a.dtype)
        return a
    return [(name, grid, tuple(arg(a) for a in args), kwargs) for name, grid, args, kwargs in launches]


def _roles(**tensors) -> dict:
    return {(t.data_ptr(), t.dtype): name for name, t in tensors.items() if t is not None and t.numel()}


def _llama(s, hq, hkv, d, dtype, gen=None):
    """(B, H, S, D) views of (B, S, H, D) tensors, as a Llama layer passes them."""
    q = torch.randn(2, s, hq, d, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(2, s, hkv, d, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(2, s, hkv, d, generator=gen).to(dtype).transpose(1, 2)
    return q, k, v


def _case(name):
    """(q, k, v, grad, options, extra forward kwargs, extra backward kwargs) for a named combination."""
    s, d = 48, 64
    fwd_kw, bwd_kw = {}, {}
    mask, mask_kind, cu_q, cu_k, max_q, max_k = None, 0, None, None, s, s
    causal, wl, wr, precision, softcap = False, -1, -1, 0, None
    dtype, hq, hkv = BF16, 4, 4
    if name == "causal_gqa":
        hq, hkv, causal, wr = 8, 2, True, 0
    elif name == "window_softcap":
        wl, wr, softcap = 9, 3, 30.0
    elif name in ("bool_mask", "float_mask"):
        hq, hkv = 8, 4
        base = torch.rand(1, 1, s, s) > 0.3 if name == "bool_mask" else torch.randn(1, 1, s, s)
        mask, mask_kind = base.expand(2, hq, s, s), 1 if name == "bool_mask" else 2
    elif name.startswith("fp32"):
        dtype, precision = F32, {"fp32_ieee": 0, "fp32_tf32": 1, "fp32_tf32x3": 2}[name]
        causal, wr = True, 0
    elif name == "partials_fp32":
        fwd_kw, bwd_kw = {"out_dtype": F32}, {"grad_dtype": F32}
    elif name.startswith("sinks"):  # attention sinks: one more pointer for the forward and dq kernels
        hq, hkv, causal, wr = 8, 2, True, 0
        sinks = torch.randn(hq)
        fwd_kw, bwd_kw = {"sinks": sinks}, {"sinks": sinks}
    if name in ("varlen", "sinks_varlen"):
        lens = [17, 31]
        total = sum(lens)
        q, k, v = (torch.randn(total, h, d).to(BF16) for h in (8, 2, 2))
        cu_q = cu_k = torch.tensor([0, 17, 48], dtype=torch.int32)
        max_q = max_k = max(lens)
        causal, wr = True, 0
        g = torch.randn_like(q)
    elif name == "contiguous":
        q, k, v = (torch.randn(2, h, s, d).to(BF16) for h in (hq, hkv, hkv))
        g = torch.randn_like(q)
    elif name == "strided_head_dim":  # head dim not unit-stride: the general path copies, every call
        q, k, v = (torch.randn(2, h, s, d * 2).to(BF16)[..., ::2] for h in (hq, hkv, hkv))
        g = torch.randn(2, hq, s, d).to(BF16)
    elif name == "dv_differs":  # v's head dim differs from q's: out is allocated contiguous, not like q
        q, k, _ = _llama(s, hq, hkv, d, dtype)
        v = torch.randn(2, s, hkv, 32).to(dtype).transpose(1, 2)
        g = torch.randn(2, hq, s, 32).to(dtype)
    elif name == "empty_keys":
        q, k, v = _llama(s, hq, hkv, d, dtype)
        k, v = k[:, :, :0], v[:, :, :0]
        max_k = 0
        g = torch.randn_like(q)
    else:
        q, k, v = _llama(s, hq, hkv, d, dtype)
        g = torch.randn(2, s, hq, d).to(dtype).transpose(1, 2)
    options = (mask, mask_kind, cu_q, cu_k, max_q, max_k, causal, d**-0.5, softcap, wl, wr, precision)
    return q, k, v, g, options, fwd_kw, bwd_kw


CASES = ["llama", "contiguous", "causal_gqa", "window_softcap", "bool_mask", "float_mask", "varlen",
         "fp32_ieee", "fp32_tf32", "fp32_tf32x3", "partials_fp32", "dv_differs", "strided_head_dim",
         "empty_keys", "sinks", "sinks_varlen"]


@pytest.mark.parametrize("name", CASES)
def test_plan_launches_equal_the_general_path(gpu_route, name):
    launches = gpu_route
    q, k, v, g, options, fwd_kw, bwd_kw = _case(name)
    mask, cu = options[0], options[2]
    inputs = {"q": q, "k": k, "v": v, "grad": g, "mask": mask, "cu": cu, "sinks": fwd_kw.get("sinks")}
    if mask is not None and mask.dtype == torch.bool:
        inputs["mask_u8"] = mask.view(torch.uint8)

    def forward(fn):
        launches.clear()
        out, m, l = fn(q, k, v, *options, **fwd_kw)
        return _describe(launches, _roles(**inputs, out=out, row_max=m, row_sum=l)), (out, m, l)

    def backward(fn, out, m, l):
        launches.clear()
        grads = fn(g, q, k, v, out, m, l, *options, **bwd_kw)  # (dq, dk, dv), and dsinks with sinks
        assert len(grads) == (4 if "sinks" in bwd_kw else 3)
        dq, dk, dv = grads[:3]
        roles = _roles(**inputs, out=out, row_max=m, row_sum=l, dq=dq, dk=dk, dv=dv)
        return _describe(launches, roles), grads

    ref_fwd, ref_out = forward(L._forward_general)
    ref_bwd, ref_grads = backward(L._backward_general, *ref_out)
    assert ref_bwd or name == "empty_keys"
    for call in range(3):  # the first call builds the plan, the later ones use it
        got_fwd, out = forward(L.forward)
        assert got_fwd == ref_fwd, f"forward launch differs on call {call}"
        for a, b in zip(out, ref_out, strict=True):
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
        got_bwd, grads = backward(L.backward, *out)
        assert got_bwd == ref_bwd, f"backward launch differs on call {call}"
        for a, b in zip(grads, ref_grads, strict=True):
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
    fwd_plans, bwd_plans = L._tables()
    planned = name not in ("strided_head_dim", "empty_keys")
    assert all((p is not L._GENERAL) == planned for p in (*fwd_plans.values(), *bwd_plans.values()))
    assert len(fwd_plans) == len(bwd_plans) == 1


def test_plan_sees_replaced_settings(gpu_route, monkeypatch):
    """Plans are dropped when a setting they depend on is replaced (config overrides, the split cap)."""
    launches = gpu_route
    q, k, v, g, options, _, _ = _case("causal_gqa")
    out, m, l = L.forward(q, k, v, *options)
    L.backward(g, q, k, v, out, m, l, *options)
    cfg = L.AttnConfig(32, 32, 4, 1)
    with L.config_override(fwd=cfg):
        launches.clear()
        L.forward(q, k, v, *options)
        assert launches[-1][3]["BLOCK_M"] == 32
    launches.clear()
    L.forward(q, k, v, *options)
    assert launches[-1][3]["BLOCK_M"] == L.config("fwd", 64, BF16, True, torch.device("meta")).block_m
    monkeypatch.setattr(L, "DKDV_SPLIT_MAX_BYTES", 1)
    launches.clear()
    L.backward(g, q, k, v, out, m, l, *options)
    assert [x[3]["SPLIT"] for x in launches if x[0] == "attn_bwd_dkdv_kernel"] == [1]


def test_plan_errors_like_the_general_path(gpu_route, monkeypatch):
    """A check that raises on the general path raises on every call (no plan is kept for it)."""
    q, k, v, _, options, _, _ = _case("llama")
    def refuse(*args):
        raise ValueError("q: offsets")

    monkeypatch.setattr(L, "check_sequence_offsets", refuse)
    for _ in range(2):
        with pytest.raises(ValueError, match="q: offsets"):
            L.forward(q, k, v, *options)
    assert not L._tables()[0]


@pytest.mark.parametrize("sinks", [False, True])
@given(seed=seeds())
def test_plan_bits_on_the_interpreter(triton_backend, seed, sinks):
    """On Triton's interpreter the plan's launches give the general path's bits (GQA, causal, Llama strides,
    forward and backward, first and repeated call; with attention sinks too)."""
    q, k, v = _llama(40, 4, 2, 16, BF16, seed.gen)
    g = seed.randn(2, 40, 4, 16, dtype=BF16).transpose(1, 2)
    options = (None, 0, None, None, 40, 40, True, 0.25, None, -1, 0, 0)
    kw = {"sinks": seed.randn(4)} if sinks else {}
    L.clear_plans()
    ref = L._forward_general(q, k, v, *options, **kw)
    dref = L._backward_general(g, q, k, v, *ref, *options, **kw)
    for _ in range(2):
        out = L.forward(q, k, v, *options, **kw)
        grads = L.backward(g, q, k, v, *ref, *options, **kw)
        for a, b in zip((*out, *grads), (*ref, *dref), strict=True):
            assert torch.equal(a.view(torch.int16) if a.dtype == BF16 else a,
                               b.view(torch.int16) if b.dtype == BF16 else b)
    assert all(p is not L._GENERAL for t in L._tables() for p in t.values())


# ------------------------------------------------------------------------------------------------------
# Plan keys: two calls that differ only in one property the compiled kernel depends on (an output's or the
# incoming gradient's dtype, a pointer's 16-byte alignment) get two plans, each launching what the general
# path launches for its own call. On a GPU a plan keeps the compiled kernel (safeops.ops._launch): a key
# that missed such a property would launch a kernel compiled for the other call's pointers (the softmax
# backward's grad.dtype bug, found on the H200). Under the interpreter the kernel is re-specialized on every
# call, so only the plans' keys and launches show it here.
# ------------------------------------------------------------------------------------------------------


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with the same shape and strides whose data pointer is off 16 bytes by one element."""
    buf = torch.empty(t.untyped_storage().nbytes() // t.element_size() + 1, dtype=t.dtype)
    out = buf[1:].as_strided(t.shape, t.stride())
    out.copy_(t)
    assert out.data_ptr() % 16 and out.stride() == t.stride()
    return out


def _alternate(launches, calls: dict, rounds: int = 2) -> None:
    """Calls each ``name -> (fn, general)`` pair alternately; each call must record the general path's
    launches for its own arguments (first call of a key: plan built; later: plan used)."""
    for _ in range(rounds):
        for name, (fn, general) in calls.items():
            launches.clear()
            general()
            ref = _describe(launches, {})
            launches.clear()
            fn()
            assert _describe(launches, {}) == ref, f"{name}: the plan's launches differ from the general path"


def test_plan_keys_see_the_incoming_gradient_dtype(gpu_route):
    """Forward calls that differ only in the output dtype (fp32 partials, safeops.distributed), backward
    calls that differ only in grad's dtype (white-box: the kernels take grad in q's dtype, but the key must
    not rely on that) or only in dq / dk / dv's dtype get a plan each."""
    launches = gpu_route
    q, k, v, g, options, _, _ = _case("llama")
    out, m, l = L.forward(q, k, v, *options)
    g32 = g.float()
    fwd = {"default": (lambda: L.forward(q, k, v, *options), lambda: L._forward_general(q, k, v, *options)),
           "fp32 out": (lambda: L.forward(q, k, v, *options, out_dtype=F32),
                        lambda: L._forward_general(q, k, v, *options, out_dtype=F32))}
    bwd = {name: (lambda gr=gr: L.backward(gr, q, k, v, out, m, l, *options),
                  lambda gr=gr: L._backward_general(gr, q, k, v, out, m, l, *options))
           for name, gr in (("bf16 grad", g), ("fp32 grad", g32))}
    _alternate(launches, {**fwd, **bwd})
    fwd_plans, bwd_plans = L._tables()
    assert len(fwd_plans) == 2 and len(bwd_plans) == 2
    assert all(p is not L._GENERAL for p in (*fwd_plans.values(), *bwd_plans.values()))
    assert L.forward(q, k, v, *options, out_dtype=F32)[0].dtype == F32
    assert L.backward(g32, q, k, v, out, m, l, *options, grad_dtype=F32)[0].dtype == F32
    assert len(bwd_plans) == 3  # grad_dtype is in the key too


@pytest.mark.parametrize("which", ["q", "k", "v", "grad", "out"])
def test_plan_keys_see_pointer_alignment(gpu_route, which):
    """The same shapes, strides and dtypes with one tensor 16-byte aligned or not: two plans (Triton
    specializes every pointer on its alignment, TMA and EVEN aside)."""
    launches = gpu_route
    q, k, v, g, options, _, _ = _case("contiguous")
    out = L.forward(q, k, v, *options)[0]
    aligned = {"q": q, "k": k, "v": v, "grad": g, "out": out}
    off = dict(aligned, **{which: _unaligned(aligned[which])})
    calls = {}
    for name, t in (("aligned", aligned), ("unaligned", off)):
        m, l = L._forward_general(t["q"], t["k"], t["v"], *options)[1:]
        calls[name + " fwd"] = (lambda t=t: L.forward(t["q"], t["k"], t["v"], *options),
                                lambda t=t: L._forward_general(t["q"], t["k"], t["v"], *options))
        args = (t["grad"], t["q"], t["k"], t["v"], t["out"], m, l, *options)
        calls[name + " bwd"] = (lambda args=args: L.backward(*args),
                                lambda args=args: L._backward_general(*args))
    L.clear_plans()
    _alternate(launches, calls)
    fwd_plans, bwd_plans = L._tables()
    assert len(fwd_plans) == (2 if which in ("q", "k", "v") else 1)
    assert len(bwd_plans) == 2


@given(seed=seeds())
def test_plan_dtype_change_bits_on_the_interpreter(triton_backend, seed):
    """On the interpreter: the fp32-partials forward / backward (fp32 out, fp32 dq / dk / dv, as
    safeops.distributed runs them) and the default ones, alternated on the same shapes, each give the bits
    of the same call with no plans kept."""
    q, k, v = _llama(32, 2, 1, 16, BF16, seed.gen)
    g = seed.randn(2, 32, 2, 16, dtype=BF16).transpose(1, 2)
    options = (None, 0, None, None, 32, 32, True, 0.25, None, -1, 0, 0)

    def run(fp32: bool):
        out, m, l = L.forward(q, k, v, *options, out_dtype=F32 if fp32 else None)
        grads = L.backward(g, q, k, v, out.to(BF16), m, l, *options, grad_dtype=F32 if fp32 else None)
        return out, m, l, *grads

    fresh = {}
    for fp32 in (True, False):
        L.clear_plans()
        fresh[fp32] = run(fp32)
    L.clear_plans()
    for fp32 in (True, False, True, False):
        for a, b in zip(run(fp32), fresh[fp32], strict=True):
            assert a.dtype == b.dtype
            assert torch.equal(a.view(torch.int16) if a.dtype == BF16 else a,
                               b.view(torch.int16) if b.dtype == BF16 else b), f"fp32={fp32}"
    assert [r.dtype for r in fresh[True][:1] + fresh[True][3:]] == [F32] * 4
    assert [len(t) for t in L._tables()] == [2, 2]
