"""The eager paths' host-cost shortcuts (bench/RESULTS.md, host overhead) change no result and drop no check.

- SAFEOPS_BACKEND is still read on every call: only the parsing of an entry already seen is cached, and an
  invalid value raises on every call, also after valid ones.
- ``eager_fast_path`` queries torch._C directly; it must answer as the public wrappers it replaced do, in
  every situation that must keep the registered op.
- A ``dim`` of type int skips the abstract-class check; other integral types still work, bools and floats
  still raise.
- The softmax launcher's forward allocates the row statistics from its plan after the lookup: the same
  bits as the general path, and statistics that are not 16-byte aligned take the general path.
- The recorded eager call passes only x (and a scale tensor) to its autograd.Function: same gradients as
  the registered op, the mask still version-checked.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given
from strategies import seeds
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

import safeops
from safeops import _config
from safeops.ops import softmax as softmax_ops
from safeops.ops import softmax_launch as SL


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), what
    assert torch.equal(_bits(a), _bits(b)), what


# --------------------------------------------------------------------------------------------------
# SAFEOPS_BACKEND
# --------------------------------------------------------------------------------------------------


def test_backend_follows_every_change_of_the_environment(monkeypatch):
    monkeypatch.delenv("SAFEOPS_BACKEND", raising=False)
    assert _config.backend_name() == "auto"
    for value, name in [("triton", "triton"), (" Reference ", "reference"), ("", "auto"), ("AUTO", "auto"),
                        ("reference", "reference"), ("triton", "triton")]:
        monkeypatch.setenv("SAFEOPS_BACKEND", value)
        assert _config.backend_name() == name, value
    os.environ["SAFEOPS_BACKEND"] = "reference"  # set directly, as users do
    assert _config.backend_name() == "reference"
    del os.environ["SAFEOPS_BACKEND"]
    assert _config.backend_name() == "auto"
    cpu = torch.zeros(1)
    assert not _config.use_triton(cpu)
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    assert _config.use_triton(cpu)


def test_invalid_backend_raises_on_every_call(monkeypatch):
    for value in ("bogus", "triton", "bogus", "tritonx", "reference", "bogus"):
        monkeypatch.setenv("SAFEOPS_BACKEND", value)
        if value in ("triton", "reference"):
            assert _config.backend_name() == value
            continue
        with pytest.raises(ValueError, match="SAFEOPS_BACKEND must be one of"):
            _config.backend_name()
        with pytest.raises(ValueError, match="SAFEOPS_BACKEND"):
            safeops.softmax(torch.zeros(2, 3))


# --------------------------------------------------------------------------------------------------
# eager_fast_path
# --------------------------------------------------------------------------------------------------


def _public_fast_path(*tensors) -> bool:
    """eager_fast_path as it was written with torch's public wrappers (the reference for the rewrite)."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    if torch.jit.is_tracing() or torch.jit.is_scripting():
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.Python):
        return False
    if _get_current_dispatch_mode() is not None:
        return False
    return all(t is None or type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


class _Subclass(torch.Tensor):
    pass


def test_eager_fast_path_answers_as_the_public_checks():
    x = torch.randn(2, 3)
    cases = {"plain": (x, None), "parameter": (torch.nn.Parameter(x), None), "no tensors": (),
             "subclass": (x.as_subclass(_Subclass), None), "subclass second": (x, x.as_subclass(_Subclass))}
    seen = []

    def both(*tensors):
        answer = softmax_ops.eager_fast_path(*tensors)
        assert answer == _public_fast_path(*tensors)
        seen.append(answer)
        return answer

    for tensors in cases.values():
        both(*tensors)
    assert seen == [True, True, True, False, False]

    class FunctionMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class DispatchMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with FunctionMode():
        assert not both(x)
    with DispatchMode():
        assert not both(x)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not both(x)
    traced = []
    torch.jit.trace(lambda t: (traced.append(both(t)), t + 1)[1], (x,), check_trace=False)
    assert traced == [False]
    vmapped = []
    torch.vmap(lambda t: (vmapped.append(both(t)), t * 2)[1])(x)
    assert vmapped and not any(vmapped)
    assert both(x)  # and back to eager


# --------------------------------------------------------------------------------------------------
# dim checking
# --------------------------------------------------------------------------------------------------


def test_dim_of_an_integral_type_other_than_int_still_works(reference_backend):
    x = torch.randn(3, 5)
    want = safeops.softmax(x, 1)
    for dim in (np.int64(1), np.int32(-1), torch.tensor(1).item()):
        assert torch.equal(safeops.softmax(x, dim), want)
    for dim in (True, 1.0, np.float64(1.0)):
        with pytest.raises(TypeError, match=r"\bdim\b"):
            safeops.softmax(x, dim)


# --------------------------------------------------------------------------------------------------
# The launcher's forward: row statistics allocated after the plan lookup
# --------------------------------------------------------------------------------------------------


def _general_only(monkeypatch):
    monkeypatch.setattr(SL, "_forward_plan", lambda *args, **kwargs: SL._GENERAL)
    monkeypatch.setattr(SL, "_backward_plan", lambda *args, **kwargs: SL._GENERAL)
    SL.clear_plans()


@pytest.mark.parametrize("shape,dim", [((6, 40), 1), ((2, 3, 40), 2), ((40,), 0), ((3, 1, 40), 2)])
@pytest.mark.parametrize("kind", [0, 1, 2])
@given(seed=seeds())
def test_planned_forward_gives_the_general_paths_bits(triton_backend, monkeypatch, shape, dim, kind, seed):
    x = (seed.randn(*shape) * 3).to(torch.bfloat16)
    SL.clear_plans()
    planned = [SL.forward(kind, x, dim, None, None, None, x.dtype, stats) for stats in (True, False, True)]
    assert any(p is not SL._GENERAL for p in SL._plans(SL._FORWARD).values())
    with monkeypatch.context() as m:
        _general_only(m)
        general = SL.forward(kind, x, dim, None, None, None, x.dtype, True)
    SL.clear_plans()
    batch = x.shape[:dim] + x.shape[dim + 1:]
    for out, row_max, row_sum in planned:
        _same_bits(out, general[0], "out")
        if row_max is not None:
            assert row_max.shape == row_sum.shape == batch
            _same_bits(row_max, general[1], "row_max")
            _same_bits(row_sum, general[2], "row_sum")
    assert planned[1][1] is None and planned[1][2] is None


def test_unaligned_row_statistics_take_the_general_path(triton_backend, monkeypatch):
    x = torch.randn(8, 32)
    SL.clear_plans()
    want = SL.forward(0, x, 1, None, None, None, x.dtype)
    plan = next(p for p in SL._plans(SL._FORWARD).values() if p is not SL._GENERAL)
    launches = []
    real_launch = plan.launch

    class Spy:
        def __call__(self, *args):
            launches.append(args)
            return real_launch(*args)

    object.__setattr__(plan, "launch", Spy())
    general_calls = []
    real_general = SL._forward_general

    def general(*args):
        general_calls.append(args)
        return real_general(*args)

    monkeypatch.setattr(SL, "_forward_general", general)
    real_new_empty = torch.Tensor.new_empty

    def unaligned_new_empty(self, size, *, dtype=None, **kwargs):
        if dtype == torch.float32:  # the row statistics: one element past a 16-byte boundary
            n = size if isinstance(size, int) else int(np.prod(size))
            return real_new_empty(self, n + 1, dtype=dtype)[1:].view(size)
        return real_new_empty(self, size, dtype=dtype, **kwargs)

    SL.forward(0, x, 1, None, None, None, x.dtype)
    assert len(launches) == 1 and not general_calls
    monkeypatch.setattr(torch.Tensor, "new_empty", unaligned_new_empty)
    got = SL.forward(0, x, 1, None, None, None, x.dtype)
    monkeypatch.undo()
    SL.clear_plans()
    assert len(launches) == 1 and len(general_calls) == 1
    assert got[1].data_ptr() % 16
    for a, b, what in zip(got, want, ("out", "row_max", "row_sum"), strict=True):
        _same_bits(a, b, what)


# --------------------------------------------------------------------------------------------------
# The recorded eager call
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", ["softmax", "log_softmax", "logsumexp"])
@pytest.mark.parametrize("extra", ["none", "scale", "scale tensor", "mask", "scale tensor + mask"])
@given(seed=seeds())
def test_recorded_eager_call_matches_the_registered_op(backend, fn, extra, seed):
    x, g_seed = seed.randn(4, 9), seed.randn(4, 9)
    s = torch.tensor(0.7)
    keep = seed.rand(4, 9) > 0.3
    op = getattr(torch.ops.safeops, fn).default

    def run(through_op: bool):
        xg = x.clone().requires_grad_(True)
        sg = s.clone().requires_grad_(True) if "scale tensor" in extra else None
        mask = keep if "mask" in extra else None
        scale = 0.7 if extra == "scale" else None
        if through_op:
            out = op(xg, 1, scale, None if sg is None else sg.reshape(()), mask, None)[0]
        else:
            out = getattr(safeops, fn)(xg, 1, scale=scale if sg is None else sg, mask=mask)
        g = g_seed if fn != "logsumexp" else g_seed[:, 0]
        return (out.detach(), *torch.autograd.grad(out, (xg,) if sg is None else (xg, sg), g))

    for a, b in zip(run(False), run(True), strict=True):
        _same_bits(a, b, f"{fn} {extra}")


def test_recorded_eager_call_checks_the_saved_mask(reference_backend):
    x = torch.randn(3, 5, requires_grad=True)
    keep = torch.ones(3, 5, dtype=torch.bool)
    out = safeops.softmax(x, -1, mask=keep)
    keep[0, 0] = False
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
