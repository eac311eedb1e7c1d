"""Cached launch plans are keyed on everything their launch depends on, and ``KernelLaunch`` refuses a
direct launch whose tensors have other dtypes than its compiled kernel was built for.

On a GPU a plan keeps the compiled kernel (``safeops.ops._launch.KernelLaunch``) and launches it directly,
so its key must hold everything Triton specializes on (every pointer's dtype and 16-byte alignment, the
integer arguments, the constexprs) and everything the plan precomputed. A key that missed the softmax
backward's ``grad.dtype`` made a default call after a ``dtype=torch.float32`` one read a bf16 gradient
through a kernel compiled for fp32 (NaN / garbage, found on the H200). Under Triton's interpreter the
kernel is re-specialized on every call, so on CPU these tests look at the plans themselves (white-box: two
calls that differ in one such property must get two plans) and check each call's results against the same
call with no plans kept and against an independent oracle. The attention launcher's keys are tested in
tests/test_attention_plans.py. The ``gpu`` tests run the same pairs on the compiled kernels.
"""

from __future__ import annotations

import types

import oracle
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from strategies import seeds

import safeops
from safeops.ops import _launch
from safeops.ops import attention_launch as AL
from safeops.ops import cast_transpose_launch as CL
from safeops.ops import softmax_launch as SL

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
E4M3 = torch.float8_e4m3fn


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with the same shape and strides whose data pointer is one element off 16 bytes."""
    buf = torch.empty(t.untyped_storage().nbytes() // t.element_size() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].as_strided(t.shape, t.stride())
    out.copy_(t)
    assert out.data_ptr() % 16 and out.stride() == t.stride()
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(_bits(a), _bits(b)), what


# --------------------------------------------------------------------------------------------------
# softmax / log_softmax / logsumexp (safeops/ops/softmax_launch.py)
# --------------------------------------------------------------------------------------------------

OPS = {"softmax": safeops.softmax, "log_softmax": safeops.log_softmax}


def _plans(direction: int) -> dict:
    return SL._plans(direction)


def _forward_backward(op: str, x: torch.Tensor, g: torch.Tensor, **kwargs):
    xx = x.detach().requires_grad_(True)  # the same storage: x's alignment is kept
    out = OPS[op](xx, -1, **kwargs)
    return out.detach(), torch.autograd.grad(out, xx, g.to(out.dtype))[0]


def _check_oracle(op, x, g, out, dx, context, out_dtype=None, scale=None) -> None:
    r = oracle.evaluate(op, x, -1, out_dtype=out_dtype, scale=scale)
    oracle.assert_close(out, r.out, oracle.output_bound(op, r, out.dtype), f"{op} out", context)
    expected, _ = oracle.gradients(op, x, g.to(out.dtype), -1, out_dtype=out_dtype, scale=scale)
    bound, _ = oracle.gradient_bounds(op, r, g.to(out.dtype), x, scale=scale)
    oracle.assert_close(dx, expected, bound, f"{op} dx", context)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("first", ["fp32 output", "default"])
@given(seed=seeds())
def test_softmax_gradient_dtype_gets_its_own_plan(triton_backend, seed, op, first):
    """``op(x, dtype=torch.float32)`` on bf16 ``x`` (an fp32 incoming gradient) and the default call (a bf16
    one) on the same shape: two backward (and forward) plans, each call's results those of the same call
    with no plans kept, and within the oracle's bounds."""
    x = seed.randn(6, 40, dtype=BF16, std=2.0)
    g = seed.randn(6, 40, dtype=F32)
    calls = {"fp32 output": {"dtype": F32}, "default": {}}
    order = [first, *(c for c in calls if c != first)]
    fresh = {}
    for name in order:
        SL.clear_plans()
        fresh[name] = _forward_backward(op, x, g, **calls[name])
    SL.clear_plans()
    for name in order * 2:  # the first of each builds its plan, the second uses it
        out, dx = _forward_backward(op, x, g, **calls[name])
        _same_bits(out, fresh[name][0], f"{op} {name} out after the other call; {seed}")
        _same_bits(dx, fresh[name][1], f"{op} {name} dx after the other call; {seed}")
    assert len(_plans(SL._FORWARD)) == 2 and len(_plans(SL._BACKWARD)) == 2
    assert {p.launch.kwargs["BLOCK_N"] for p in _plans(SL._BACKWARD).values()} == {64}  # rows path planned
    for name in order:
        _check_oracle(op, x, g, *fresh[name], seed, out_dtype=calls[name].get("dtype"))


@pytest.mark.parametrize("tensor", ["x", "grad"])
@given(seed=seeds())
def test_softmax_alignment_gets_its_own_plan(triton_backend, seed, tensor):
    """The same shape, strides and dtype with ``x`` (or the gradient) 16-byte aligned or not: two plan
    entries, the aligned one a direct launch with the alignment claim, the misaligned one the general path
    (which reads a rows-major, aligned copy: the same kernel, contract section 6); same results as with
    no plans kept."""
    x = seed.randn(4, 40, dtype=BF16)
    g = seed.randn(4, 40, dtype=BF16)
    pairs = {"aligned": (x, g), "unaligned": (_unaligned(x), g) if tensor == "x" else (x, _unaligned(g))}
    fresh = {}
    for name, (xi, gi) in pairs.items():
        SL.clear_plans()
        fresh[name] = _forward_backward("softmax", xi, gi)
    SL.clear_plans()
    for name in [*pairs, *pairs]:
        out, dx = _forward_backward("softmax", *pairs[name])
        _same_bits(out, fresh[name][0], f"{tensor} {name}: out; {seed}")
        _same_bits(dx, fresh[name][1], f"{tensor} {name}: dx; {seed}")
        _check_oracle("softmax", pairs[name][0], pairs[name][1], out, dx, seed)
    arg = {"x": "XA", "grad": "GA"}[tensor]
    plans = list(_plans(SL._BACKWARD).values())
    assert len(plans) == 2
    direct = [p for p in plans if p is not SL._GENERAL]
    assert len(direct) == 1 and direct[0].launch.kwargs[arg] == 8
    forward = list(_plans(SL._FORWARD).values())
    assert len(forward) == (2 if tensor == "x" else 1)
    assert sum(p is SL._GENERAL for p in forward) == (1 if tensor == "x" else 0)


@given(seed=seeds())
def test_softmax_scale_tensor_dtype_gets_its_own_plan(triton_backend, seed):
    """A tensor scale in fp32 and in bf16 (its pointer's type): two plans, each as with none kept."""
    x = seed.randn(4, 40, dtype=F32)
    g = seed.randn(4, 40, dtype=F32)
    scales = {"fp32": torch.tensor(0.75, dtype=F32), "bf16": torch.tensor(0.75, dtype=BF16)}
    fresh = {}
    for name, s in scales.items():
        SL.clear_plans()
        fresh[name] = _forward_backward("log_softmax", x, g, scale=s)
    SL.clear_plans()
    for name in [*scales, *scales]:
        out, dx = _forward_backward("log_softmax", x, g, scale=scales[name])
        _same_bits(out, fresh[name][0], f"scale {name}: out; {seed}")
        _same_bits(dx, fresh[name][1], f"scale {name}: dx; {seed}")
    assert len(_plans(SL._FORWARD)) == 2 and len(_plans(SL._BACKWARD)) == 2
    _check_oracle("log_softmax", x, g, *fresh["bf16"], seed, scale=scales["bf16"])


# --------------------------------------------------------------------------------------------------
# cast_transpose (safeops/ops/cast_transpose_launch.py): routes
# --------------------------------------------------------------------------------------------------


def _eager_fp8(x, scale, dtype):
    """The expression safeops.cast_transpose promises to equal bit for bit."""
    m = torch.finfo(dtype).max
    return (x.float() * scale.float()).clamp(-m, m).to(dtype)


CAST_PAIRS = {
    "x dtype": lambda x, s: ((x.to(BF16), s), (x.to(F16), s)),
    "scale dtype": lambda x, s: ((x, s), (x, s.to(BF16))),
    "x alignment": lambda x, s: ((x, s), (_unaligned(x), s)),
    "scale alignment": lambda x, s: ((x, s), (x, _unaligned(s.reshape(1)).reshape(()))),
}


@pytest.mark.parametrize("pair", list(CAST_PAIRS))
@given(seed=seeds())
def test_cast_transpose_route_keys(triton_backend, seed, pair):
    """Two calls that differ only in x's or scale's dtype or alignment: two routes, and each call's
    (y, y_t, amax) are the eager cast's, as with no routes kept."""
    x = seed.randn(8, 64, dtype=BF16, std=40.0)
    scale = torch.tensor(1.5, dtype=F32)
    calls = CAST_PAIRS[pair](x, scale)
    fresh = []
    for xi, si in calls:
        CL.clear_routes()
        fresh.append(safeops.cast_transpose(xi, si, E4M3))
    CL.clear_routes()
    for i in (0, 1, 0, 1):
        xi, si = calls[i]
        y, y_t, amax = safeops.cast_transpose(xi, si, E4M3)
        for a, b, what in zip((y, y_t, amax), fresh[i], ("y", "y_t", "amax"), strict=True):
            _same_bits(a, b, f"{pair} call {i}: {what} after the other call")
        expected = _eager_fp8(xi, si, E4M3)
        _same_bits(y, expected, f"{pair} call {i}: y vs eager; {seed}")
        assert torch.equal(_bits(y_t), _bits(expected)) and y_t.stride() == (1, 8)
        assert torch.equal(amax, xi.float().abs().max())
    assert len(CL._routes) == 2 and CL._GENERAL not in CL._routes.values()


# --------------------------------------------------------------------------------------------------
# KernelLaunch's dtype guard (safeops/ops/_launch.py), with a stand-in for Triton
# --------------------------------------------------------------------------------------------------


class _Param:
    def __init__(self, name, default=None):
        self.name, self.default = name, default


class _Compiled:
    """A CompiledKernel stand-in: its launcher records the direct launches."""

    function, packed_metadata = "fn", "packed"

    def __init__(self, log, dtypes):
        self.log, self.dtypes = log, dtypes
        self.launches: list = []  # each direct launch's arguments to the launcher

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream, args)

    def run(self, *launch_args):
        self.log.append(("direct", self.dtypes))
        self.launches.append(launch_args)


class _Kernel:
    """A JITFunction stand-in: ``kernel[grid](...)`` records a launch through JITFunction.run and returns a
    compiled kernel for the tensors' dtypes; its binder agrees with KernelLaunch's argument list."""

    params = [_Param("x"), _Param("y"), _Param("n"), _Param("BLOCK")]

    def __init__(self):
        self.log: list = []
        self.device_caches = {0: (None, None, None, None, self.binder)}

    def binder(self, x, y, n, BLOCK=None, **options):
        return {"x": x, "y": y, "n": n, "BLOCK": BLOCK}, [], options

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
            self.log.append(("jit", dtypes))
            return _Compiled(self.log, dtypes)
        return run


@pytest.fixture
def stub_runtime(monkeypatch):
    """Triton's driver as KernelLaunch reads it: current device 0, a stream, launch hooks."""
    hooks = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setitem(_launch._runtime, "value", (lambda: 0, lambda device: 0, hooks))
    monkeypatch.setattr(_launch, "DIRECT", True)


def test_kernel_launch_guard_falls_back_on_another_dtype(stub_runtime):
    """A direct launch whose tensors have other dtypes than the kept compiled kernel's goes through
    JITFunction.run (which specializes for them) and is counted; the kept kernel stays for its own dtypes."""
    kernel = _Kernel()
    launch = _launch.KernelLaunch(kernel, (3,), {"BLOCK": 64, "num_warps": 4})
    x32, y32 = torch.zeros(4), torch.zeros(4)
    x16, y16 = torch.zeros(4, dtype=BF16), torch.zeros(4, dtype=BF16)
    before = _launch.guard_fallbacks
    launch(x32, y32, 4)
    launch(x32, y32, 4)
    assert kernel.log == [("jit", (F32, F32)), ("direct", (F32, F32))]
    assert launch._dtypes == (F32, F32)
    kernel.log.clear()
    launch(x16, y16, 4)  # the key that built this launch missed the dtype: not the fp32 kernel
    launch(x32, y16, 4)  # one pointer differs
    launch(x32, y32, 4)  # its own dtypes: direct again
    assert kernel.log == [("jit", (BF16, BF16)), ("jit", (F32, BF16)), ("direct", (F32, F32))]
    assert _launch.guard_fallbacks == before + 2


def test_kernel_launch_guard_on_a_non_tensor_argument(stub_runtime):
    """A tensor position holding something else (or too few arguments) falls back too, never raises."""
    kernel = _Kernel()
    launch = _launch.KernelLaunch(kernel, (1,), {"BLOCK": 16})
    x, y = torch.zeros(2), torch.zeros(2)
    launch(x, y, 2)
    launch(x, y, 2)
    kernel.log.clear()
    launch(x, 7, 2)
    assert kernel.log == [("jit", (F32,))]
    launch(x, y, 2)
    assert kernel.log[-1] == ("direct", (F32, F32))


def test_direct_launch_passes_metadata_and_hooks_only_while_a_hook_is_set(monkeypatch):
    """Triton keeps its launch hooks in HookChains that are never None; with no hook in either chain a direct
    launch passes None for the metadata and both hooks (the launcher then calls nothing), otherwise exactly
    what JITFunction.run passes: the compiled kernel's launch metadata and the two chains."""
    from triton.knobs import HookChain

    hooks = types.SimpleNamespace(launch_enter_hook=HookChain(), launch_exit_hook=HookChain(reversed=True))
    monkeypatch.setitem(_launch._runtime, "value", (lambda: 0, lambda device: 7, hooks))
    monkeypatch.setattr(_launch, "DIRECT", True)
    kernel = _Kernel()
    launch = _launch.KernelLaunch(kernel, (3,), {"BLOCK": 64})
    x, y = torch.zeros(4), torch.zeros(4)
    launch(x, y, 4)  # through JITFunction.run, which keeps the compiled kernel
    compiled = launch._compiled[0][0]
    full = (x, y, 4, 64)
    metadata = ("metadata", (3,), 7, full)

    def last_launch():
        launch(x, y, 4)
        return compiled.launches[-1]

    assert last_launch() == (3, 1, 1, 7, "fn", "packed", None, None, None, *full)
    seen = []
    hooks.launch_exit_hook.add(seen.append)
    args = last_launch()
    assert args[:9] == (3, 1, 1, 7, "fn", "packed", metadata, hooks.launch_enter_hook, hooks.launch_exit_hook)
    args[8](args[6])  # what the launcher does after the kernel
    assert seen == [metadata]
    hooks.launch_exit_hook.remove(seen.append)
    assert last_launch()[6:9] == (None, None, None)
    hooks.launch_enter_hook = seen.append  # a plain callable (not a HookChain) is a hook
    assert last_launch()[6:9] == (metadata, seen.append, hooks.launch_exit_hook)
    hooks.launch_enter_hook = hooks.launch_exit_hook = None  # slots that hold None: Triton passes None too
    assert last_launch()[6:9] == (None, None, None)


def test_kernel_launch_guard_off_without_direct_launches(stub_runtime, monkeypatch):
    """With ``DIRECT = False`` every launch goes through JITFunction.run and the guard is not consulted."""
    monkeypatch.setattr(_launch, "DIRECT", False)
    kernel = _Kernel()
    launch = _launch.KernelLaunch(kernel, (1,), {"BLOCK": 16})
    before = _launch.guard_fallbacks
    for dtype in (F32, BF16, F32):
        launch(torch.zeros(2, dtype=dtype), torch.zeros(2, dtype=dtype), 2)
    assert [e[0] for e in kernel.log] == ["jit"] * 3 and _launch.guard_fallbacks == before


# A stand-in for Triton 3.6's launcher of a kernel with TMA descriptor arguments (driver.py's
# ``wrap_handle_tensordesc`` and ``make_tensordesc_arg``, written here in the same shape): KernelLaunch keeps
# the encoded tensor maps and calls the generated launcher with the list the wrapper would build.
_FAKE_DRIVER = """
_BASE_ARGS_FORMAT_LEN = 13
encoded = []


def make_tensordesc_arg(arg, metadata):
    encoded.append((arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), metadata["swizzle"]))
    return [("map", arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), metadata["swizzle"]),
            *arg.shape, *arg.strides]


def wrap_handle_tensordesc(launcher, tensordesc_indices, tensordesc_meta):
    def inner(*args):
        final_args = list(args[:_BASE_ARGS_FORMAT_LEN])
        tensordesc_idx = 0
        for i, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                tensordesc_idx += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)

    return inner
"""


class _Desc:
    def __init__(self, t, padding="zero"):
        self.base, self.shape, self.strides, self.padding = t, list(t.shape), list(t.stride()), padding


@pytest.fixture
def fake_driver(monkeypatch):
    module = types.ModuleType("safeops_test_fake_driver")
    exec(compile(_FAKE_DRIVER, "<fake driver>", "exec"), module.__dict__)
    monkeypatch.setitem(__import__("sys").modules, module.__name__, module)
    return module


class _DescLauncher:
    """Triton 3.6's CudaLauncher, as far as KernelLaunch reads it: ``launch`` is the wrapper; calling it
    goes through the wrapper (JITFunction.run's path)."""

    def __init__(self, module, raw, indices, metas, scratch=0):
        self.launch = module.wrap_handle_tensordesc(raw, indices, metas)
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def __call__(self, g0, g1, g2, stream, function, *args):
        self.launch(g0, g1, g2, stream, function, False, True, None, None, *args)


class _DescKernel(_Kernel):
    """A kernel (x_desc, n, y_desc, BLOCK) whose compiled launcher is a _DescLauncher recording what reaches
    the generated launcher (``raw_calls``)."""

    params = [_Param("x_desc"), _Param("n"), _Param("y_desc"), _Param("BLOCK")]
    METAS = [{"swizzle": 1}, {"swizzle": 2}]

    def __init__(self, module, scratch=0):
        super().__init__()
        self.raw_calls: list = []
        self.module, self.scratch = module, scratch

    def binder(self, x_desc, n, y_desc, BLOCK=None, **options):
        return {"x_desc": x_desc, "n": n, "y_desc": y_desc, "BLOCK": BLOCK}, [], options

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit",))
            compiled = types.SimpleNamespace(function="fn", packed_metadata="packed",
                                             launch_metadata=lambda *a: ("metadata",))
            compiled.run = _DescLauncher(self.module, lambda *a: self.raw_calls.append(a), {0, 2}, self.METAS,
                                         self.scratch)
            compiled.run(*grid, 1, 1, 0, "fn", "packed", None, None, None, *args, kwargs.get("BLOCK"))
            return compiled
        return run


def test_descriptor_kernels_launch_with_kept_tensor_maps(stub_runtime, fake_driver):
    """A direct launch of a kernel with TMA descriptor arguments passes the generated launcher exactly the
    list Triton's wrapper builds, and encodes each (position, base address, shape, strides) only once."""
    kernel = _DescKernel(fake_driver)
    launch = _launch.KernelLaunch(kernel, (3,), {"BLOCK": 64})
    a, b, c = torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(2, 8)
    launch(_Desc(a), 5, _Desc(b))  # through JITFunction.run
    assert kernel.log == [("jit",)] and launch._maps, "Triton 3.6's structure: the tensor maps are kept"
    fake_driver.encoded.clear()
    calls = [(a, b), (a, b), (b, a), (a, c), (a, b), (c, c)]
    for x, y in calls:
        launch(_Desc(x), 5, _Desc(y))
    assert kernel.log == [("jit",)]  # every later launch was direct
    direct_encodes = list(fake_driver.encoded)
    # Triton's wrapper, encoding afresh at every call: the same lists reach the generated launcher.
    expected: list = []
    wrapper = fake_driver.wrap_handle_tensordesc(lambda *a: expected.append(a), {0, 2}, kernel.METAS)
    base = (3, 1, 1, 0, "fn", False, True, None, None, "packed", None, None, None)
    for x, y in [(a, b)] + calls:
        wrapper(*base, _Desc(x), 5, _Desc(y), 64)
    assert kernel.raw_calls == expected
    # One encode per new (position, address, shape, strides), in launch order.
    def enc(t, swizzle):
        return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), swizzle)
    assert direct_encodes == [enc(a, 1), enc(b, 2), enc(b, 1), enc(a, 2), enc(c, 2), enc(c, 1)]


def test_descriptor_kernels_pass_metadata_and_hooks_while_a_hook_is_set(stub_runtime, fake_driver):
    """With a launch hook set, the kept-maps launch passes the compiled kernel's launch metadata and both
    hook slots, where Triton's wrapper would put them, and the same descriptor entries."""
    hooks = _launch._runtime["value"][2]
    kernel = _DescKernel(fake_driver)
    launch = _launch.KernelLaunch(kernel, (2,), {"BLOCK": 32})
    a, b = torch.zeros(4, 8), torch.zeros(2, 8)
    launch(_Desc(a), 7, _Desc(b))
    seen = []
    hooks.launch_enter_hook = seen.append
    launch(_Desc(a), 7, _Desc(b))
    hooks.launch_enter_hook = None
    launch(_Desc(a), 7, _Desc(b))
    assert kernel.log == [("jit",)]
    expected: list = []
    wrapper = fake_driver.wrap_handle_tensordesc(lambda *x: expected.append(x), {0, 2}, kernel.METAS)
    for metadata, enter in ((("metadata",), seen.append), (None, None)):
        wrapper(2, 1, 1, 0, "fn", False, True, None, None, "packed", metadata, enter, None,
                _Desc(a), 7, _Desc(b), 32)
    assert kernel.raw_calls[1:] == expected


def test_descriptor_kernels_with_scratch_or_another_shape_keep_tritons_path(stub_runtime, fake_driver):
    """A launcher that needs global scratch, or a wrapper of another shape, is called as before."""
    kernel = _DescKernel(fake_driver, scratch=128)
    launch = _launch.KernelLaunch(kernel, (1,), {"BLOCK": 64})
    a = torch.zeros(4, 8)
    launch(_Desc(a), 1, _Desc(a))
    launch(_Desc(a), 1, _Desc(a))
    assert not launch._maps and len(kernel.raw_calls) == 2
    assert kernel.raw_calls[0] == kernel.raw_calls[1]
    assert _launch._tensor_map_launcher(types.SimpleNamespace(launch=lambda *a: None), 4) is None
    launcher = _DescLauncher(fake_driver, print, {0, 2}, _DescKernel.METAS)
    assert _launch._tensor_map_launcher(launcher, 4) is not None
    assert _launch._tensor_map_launcher(launcher, 2) is None  # a descriptor position past the arguments
    fake_driver._BASE_ARGS_FORMAT_LEN = 14  # another launcher layout
    assert _launch._tensor_map_launcher(launcher, 4) is None
    fake_driver._BASE_ARGS_FORMAT_LEN = 13
    fake_driver.make_tensordesc_arg = lambda arg, metadata, device: None  # Triton 3.9's signature
    assert _launch._tensor_map_launcher(launcher, 4) is None


# --------------------------------------------------------------------------------------------------
# GPU: the same pairs on the compiled kernels (plans keep them and launch them directly)
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def cuda_plans(monkeypatch):
    """Compiled kernels through the default backend, plans cleared before and after; the dtype guard must
    not have fired (every key holds the dtypes)."""
    monkeypatch.setenv("SAFEOPS_BACKEND", "auto")
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(SL.kernels().softmax_fwd_rows_kernel, InterpretedFunction):
        pytest.fail("Triton's interpreter is on in this process: run the GPU tests without TRITON_INTERPRET")
    for clear in (SL.clear_plans, AL.clear_plans, CL.clear_routes):
        clear()
    before = _launch.guard_fallbacks
    yield torch.device("cuda")
    for clear in (SL.clear_plans, AL.clear_plans, CL.clear_routes):
        clear()
    assert _launch.guard_fallbacks == before, "KernelLaunch's dtype guard fired: a plan key misses a dtype"


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
def test_gpu_softmax_dtype_and_alignment_pairs(cuda_plans, op):
    """bf16 x: the fp32-output call, the default call, and the default call on an unaligned copy, each
    repeated after the others (direct launches of kept kernels), equal the same call with no plans kept."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    x = (torch.randn(64, 1024, device="cuda", generator=gen) * 3).to(BF16)
    g32 = torch.randn(64, 1024, device="cuda", generator=gen)
    g16 = g32.to(BF16)
    calls = {"fp32 out": (x, g32, {"dtype": F32}), "default": (x, g16, {}),
             "unaligned x": (_unaligned(x), g16, {}), "unaligned grad": (x, _unaligned(g16), {})}
    fresh = {}
    for name, (xi, gi, kw) in calls.items():
        SL.clear_plans()
        fresh[name] = _forward_backward(op, xi, gi, **kw)
    SL.clear_plans()
    for name in [*calls, *calls, *reversed(calls)]:
        xi, gi, kw = calls[name]
        out, dx = _forward_backward(op, xi, gi, **kw)
        _same_bits(out, fresh[name][0], f"{op} {name}: out")
        _same_bits(dx, fresh[name][1], f"{op} {name}: dx")
    # (An unaligned gradient is copied on every call: its signature holds the general-path marker, no launch.)
    assert all(p.launch._compiled for p in _plans(SL._BACKWARD).values() if p is not SL._GENERAL), \
        "plans not launched directly"


@pytest.mark.gpu
def test_gpu_attention_fp32_partials_then_default(cuda_plans):
    """The fp32-partials attention (fp32 out; fp32 dq / dk / dv) and the default one on the same shapes,
    alternated: each equals the same call with no plans kept."""
    gen = torch.Generator(device="cuda").manual_seed(99)
    q, k, v = (torch.randn(2, 256, h, 64, device="cuda", generator=gen).to(BF16).transpose(1, 2)
               for h in (8, 2, 2))
    g = torch.randn(2, 8, 256, 64, device="cuda", generator=gen).to(BF16)
    options = (None, 0, None, None, 256, 256, True, 0.125, None, -1, 0, 0)

    def run(fp32: bool):
        out, m, l = AL.forward(q, k, v, *options, out_dtype=F32 if fp32 else None)
        grads = AL.backward(g, q, k, v, out.to(BF16), m, l, *options, grad_dtype=F32 if fp32 else None)
        return out, m, l, *grads

    fresh = {}
    for fp32 in (True, False):
        AL.clear_plans()
        fresh[fp32] = run(fp32)
    AL.clear_plans()
    for fp32 in (True, False, True, False):
        for i, (a, b) in enumerate(zip(run(fp32), fresh[fp32], strict=True)):
            _same_bits(a, b, f"fp32 partials={fp32}: output {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("pair", list(CAST_PAIRS))
def test_gpu_cast_transpose_route_pairs(cuda_plans, pair):
    """Two calls that differ in x's or scale's dtype or alignment, alternated: each gives the eager cast's
    bits and the bits of the same call with no routes kept."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = (torch.randn(512, 768, device="cuda", generator=gen) * 40).to(BF16)
    calls = CAST_PAIRS[pair](x, torch.tensor(1.5, dtype=F32, device="cuda"))
    fresh = []
    for xi, si in calls:
        CL.clear_routes()
        fresh.append(safeops.cast_transpose(xi, si, E4M3))
    CL.clear_routes()
    for i in (0, 1, 0, 1, 1, 0):
        xi, si = calls[i]
        out = safeops.cast_transpose(xi, si, E4M3)
        for a, b, what in zip(out, fresh[i], ("y", "y_t", "amax"), strict=True):
            _same_bits(a, b, f"{pair} call {i}: {what}")
        _same_bits(out[0], _eager_fp8(xi, si, E4M3), f"{pair} call {i}: y vs eager")


@triton.jit
def _twice_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """y = 2 x: its compiled code depends on the pointers' element types."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=keep) * 2, mask=keep)


@pytest.mark.gpu
def test_gpu_kernel_launch_guard(cuda_plans):
    """A KernelLaunch first launched on fp32 tensors, then (as a key missing the dtype would) on bf16 ones:
    the guard sends that launch through JITFunction.run, so it computes 2 x right; the fp32 one stays
    direct."""
    launch = _launch.KernelLaunch(_twice_kernel, (4,), {"BLOCK": 256})
    x32 = torch.linspace(-3, 3, 1000, device="cuda")
    y32 = torch.empty_like(x32)
    launch(x32, y32, 1000)
    assert launch._compiled, "the first launch did not keep its compiled kernel"
    launch(x32, y32, 1000)
    assert torch.equal(y32, x32 * 2)
    before = _launch.guard_fallbacks
    x16 = x32.to(BF16)
    y16 = torch.full_like(x16, float("nan"))
    launch(x16, y16, 1000)
    assert _launch.guard_fallbacks == before + 1
    _launch.guard_fallbacks = before  # expected here: not a key's miss (cuda_plans checks the count)
    assert torch.equal(y16, x16 * 2)
