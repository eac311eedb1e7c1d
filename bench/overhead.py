"""Host-side cost of one call: how long the CPU takes to launch each softmax path, layer by layer.

A training step whose kernels are short is bound by how fast the host enqueues them (bench/compile.py
shows it for the transformer block). On a GPU this measures, per call, the wall time of many back-to-back
calls on a 64 x 1024 bf16 input (GPU work per call is a few microseconds, so the host is the bottleneck),
one layer at a time:

- ``torch.softmax`` (one ATen kernel) as the yardstick, and an empty Triton kernel with 4 and 40 arguments
  (Triton's own launch cost through ``JITFunction.run``);
- the launcher: ``softmax_launch._forward_general`` / ``_backward_general`` (every decision made again,
  launched through ``JITFunction.run``: the launcher as it was), the cached plan launched through
  ``JITFunction.run`` (``_launch.DIRECT = False``), and the cached plan launching the compiled kernel
  directly (the default);
- the registered ops ``torch.ops.safeops.softmax`` / ``softmax_backward`` as compiled graphs call them
  (input not requiring grad; requiring grad; requiring grad under ``no_grad``, which is how a compiled
  training graph's forward calls it);
- ``safeops.softmax`` (the eager fast path), forward and forward + backward through autograd, against torch;
- a check that the direct launch gives the same bits as ``JITFunction.run`` and compiles nothing new.

``--cpu`` measures the Python part on a machine without a GPU: the launcher's decisions with the kernels
replaced by no-ops (the general path against the cached plan), the public function on that route (forward
with and without a gradient to record, forward + backward through ``torch.autograd.grad``, with torch's own
forward + backward on the CPU, its math included, for orientation), and the registered op's layers on a tiny
CPU tensor with the reference backend.

Then ``safeops.cast_transpose`` (fp8 cast + transpose), layer by layer: the public function (eager fast
path), the registered op as compiled graphs call it, its implementation, the launcher (cached route), and
pieces (output allocations, workspace lookup). On the GPU also
a check that the cached routes give the general path's and eager torch's bits and launch directly, and
at the benchmark's shapes the host time per public call next to the kernel's time. With ``--cpu`` the
GPU route's Python runs on the CPU (SAFEOPS_BACKEND=triton, launches replaced by no-ops, the GPU-only
checks told this is a GPU). ``--cast`` runs only these tables.

``--attention`` runs only the attention tables, at the shapes of bench/model.py's Llama layer (q (1, 32, S,
64), k / v (1, 4, S, 64) bf16 with the strides the layer gives them, causal), layer by layer: transformers'
attention function as the model calls it (module, mask and keyword arguments captured from a small
LlamaForCausalLM), ``safeops.attention`` forward and forward + backward through autograd, the registered
ops, their implementations, and the launcher's forward and backward (cached plans, and the general path that
makes every decision again); with ``--cpu`` a second table runs the same layers on the Gluon route (the
sm_90 default: the device check answering as on an H100 / H200, the Gluon plans' launches no-ops, their
TMA descriptors still built). On the GPU: torch's SDPA (and transformers' sdpa function) as the yardstick at
S = 256 (host-bound), then host vs GPU time per call at S = 4096, and a bit check of the plans against the
general path. With ``--cpu``: the GPU route's Python on CPU tensors (S = 32; launches replaced by no-ops,
the launcher's GPU-only branches told it is a GPU).

    python bench/overhead.py [--calls 2000] [--cast]
    python bench/overhead.py --cpu [--calls 3000] [--cast]
    python bench/overhead.py --attention [--cpu] [--calls N]
    python bench/overhead.py --cross-entropy [--cpu] [--calls N]

``--cross-entropy`` runs only the cross-entropy tables: the public function without and with a gradient to
record, forward + backward through autograd, and the launcher's forward and backward, at 64 x 1024 bf16
("mean"), next to ``F.cross_entropy``'s forward + backward; on the GPU also host against GPU time per
forward + backward at T = 8192, V = 32768 (language-model logits).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import safeops  # noqa: E402, I001
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from safeops.ops import _launch, softmax_launch  # noqa: E402
from safeops.ops import softmax as softmax_ops  # noqa: E402


@triton.jit
def _empty4(a, b, c, d):
    pass


@triton.jit
def _empty40(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9,
             c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, d0, d1, d2, d3, d4, d5, d6, d7, d8,
             N: tl.constexpr):
    pass


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_us(fn, calls: int, repeats: int = 3) -> float:
    """Best per-call wall time of ``repeats`` runs of ``calls`` back-to-back calls."""
    for _ in range(20):
        fn()
    _sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def _op_cases(x: torch.Tensor, prefix: str = "") -> list:
    """The registered op's layers on ``x``: impl, op (three grad situations), backward impl and op."""
    xr = x.clone().requires_grad_(True)
    op = torch.ops.safeops.softmax.default
    op_bwd = torch.ops.safeops.softmax_backward.default
    _, m, l = op(x, x.dim() - 1, None, None, None, None)
    g = torch.randn_like(x)
    d = x.dim() - 1

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    fwd_args = (d, None, None, None, None)
    bwd_args = (g, x, m, l, d, 0, None, None, None, False)
    return [
        (f"{prefix}op impl (_forward_impl)", lambda: softmax_ops._forward_impl(0, x, *fwd_args)),
        (f"{prefix}op, x no grad", lambda: op(x, *fwd_args)),
        (f"{prefix}op, x requires grad", lambda: op(xr, *fwd_args)),
        (f"{prefix}op, x requires grad, no_grad()", no_grad(lambda: op(xr, *fwd_args))),
        (f"{prefix}backward impl", lambda: softmax_ops._backward_impl(*bwd_args)),
        (f"{prefix}backward op", lambda: op_bwd(*bwd_args)),
    ]


def _print(cases, calls: int, repeats: int = 3) -> None:
    for name, fn in cases:
        print(f"  {name:48s} {per_call_us(fn, calls, repeats):8.1f} us", flush=True)


def _with_direct(flag: bool, fn):
    def run():
        old = _launch.DIRECT
        _launch.DIRECT = flag
        try:
            return fn()
        finally:
            _launch.DIRECT = old
    return run


def _check_direct_launch(x: torch.Tensor) -> None:
    """The direct launch gives the bits JITFunction.run gives, and compiles no new kernel."""
    g = torch.randn_like(x)
    k = softmax_launch.kernels()
    caches = [kern.device_caches[torch.cuda.current_device()][0]
              for kern in (k.softmax_fwd_rows_kernel, k.softmax_bwd_rows_kernel)]
    for kind in (0, 1, 2):
        fwd_args = (kind, x, 1, 0.5, None, None, x.dtype)
        ref = _with_direct(False, lambda a=fwd_args: softmax_launch.forward(*a))()
        n_compiled = [len(c) for c in caches]
        for _ in range(3):
            out = softmax_launch.forward(*fwd_args)
        gk = g if kind != 2 else torch.randn_like(ref[1]).to(x.dtype)
        bwd_args = (kind, gk, x, ref[1], ref[2], 1, 0.5, None, None, False)
        dref = _with_direct(False, lambda a=bwd_args: softmax_launch.backward(*a))()
        dx = softmax_launch.backward(*bwd_args)
        _sync()
        same = all(torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
                   for a, b in zip((*ref, dref[0]), (*out, dx[0]), strict=True))
        new = [len(c) - n for c, n in zip(caches, n_compiled, strict=True)]
        plans = [p for t in softmax_launch._plan_tables.values() for p in t[1].values()]
        direct = [bool(p.launch._compiled) for p in plans if p is not softmax_launch._GENERAL]
        print(f"  direct launch, kind {kind}: bits {'identical' if same else 'DIFFER'} to JITFunction.run; "
              f"new compiled kernels {new}; plans launching directly {sum(direct)}/{len(direct)}", flush=True)


def _general_calls(x: torch.Tensor, g: torch.Tensor, m: torch.Tensor, l: torch.Tensor):
    """The softmax launcher's general (uncached) forward and backward on a 64-row ``x``, as zero-argument
    calls."""
    def general_fwd():
        out = torch.empty_like(x)
        rm, rs = x.new_empty(64, dtype=torch.float32), x.new_empty(64, dtype=torch.float32)
        return softmax_launch._forward_general(0, x, 1, None, None, None, out, rm, rs)

    def general_bwd():
        return softmax_launch._backward_general(0, g, x, m, l, 1, None, None, None, False,
                                                torch.empty_like(x), x.new_zeros((), dtype=torch.float32))

    return general_fwd, general_bwd


def gpu(calls: int, device: str = "cuda") -> None:
    """The GPU tables (``device="cpu"`` runs them under Triton's interpreter: a smoke test of this script)."""
    x = torch.randn(64, 1024, device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    g = torch.randn_like(x)
    t = torch.empty(1, device=device)
    _, m, l = softmax_launch.forward(0, x, 1, None, None, None, x.dtype)

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(xg), xg, g)

    general_fwd, general_bwd = _general_calls(x, g, m, l)

    def launcher_fwd():
        return softmax_launch.forward(0, x, 1, None, None, None, x.dtype)

    def launcher_bwd():
        return softmax_launch.backward(0, g, x, m, l, 1, None, None, None, False)

    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"{name}: torch {torch.__version__}, triton {triton.__version__}; "
          f"wall time per call, {calls} back-to-back calls, best of 3; 64 x 1024 bf16")
    print("yardsticks")
    _print([
        ("torch.softmax", lambda: torch.softmax(x, -1)),
        ("empty Triton kernel, 4 args", lambda: _empty4[(1,)](t, 1, 2, 3)),
        ("empty Triton kernel, 40 args", lambda: _empty40[(1,)](t, *range(1, 39), N=4)),
    ], calls)
    print("launcher (no torch.library dispatch)")
    _print([
        ("forward, general path + JITFunction.run", general_fwd),
        ("forward, cached plan + JITFunction.run", _with_direct(False, launcher_fwd)),
        ("forward, cached plan + direct launch", launcher_fwd),
        ("forward without row statistics (eager, nothing recorded), direct launch",
         lambda: softmax_launch.forward(0, x, 1, None, None, None, x.dtype, False)),
        ("backward, general path + JITFunction.run", general_bwd),
        ("backward, cached plan + JITFunction.run", _with_direct(False, launcher_bwd)),
        ("backward, cached plan + direct launch", launcher_bwd),
    ], calls)
    print("registered ops (as compiled graphs call them)")
    _print(_op_cases(x), calls)
    print("public function and autograd")
    _print([
        ("safeops.softmax", lambda: safeops.softmax(x)),
        ("fwd+bwd torch.softmax", fwd_bwd(lambda t_: torch.softmax(t_, -1))),
        ("fwd+bwd safeops.softmax", fwd_bwd(safeops.softmax)),
        ("fwd+bwd safeops.softmax, via JITFunction.run", _with_direct(False, fwd_bwd(safeops.softmax))),
    ], calls)
    if device == "cuda":
        print("checks")
        _check_direct_launch(x)


class _NoLaunch:
    """Stands for a kernel: ``kernel[grid](*args, **kwargs)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _NoKernels:
    def __getattr__(self, name):
        return _NoLaunch()


def cpu(calls: int) -> None:
    print(f"CPU: torch {torch.__version__}, triton {triton.__version__}; wall time per call, {calls} "
          f"back-to-back calls, best of 10")
    x = torch.randn(64, 1024, dtype=torch.bfloat16)
    real = softmax_launch._kernels, softmax_launch._check_device
    softmax_launch._kernels, softmax_launch._check_device = _NoKernels(), lambda x: None
    try:
        _, m, l = softmax_launch.forward(0, x, 1, None, None, None, x.dtype)
        g = torch.randn_like(x)
        mask = torch.rand(1, 1024) > 0.1

        general_fwd, general_bwd = _general_calls(x, g, m, l)

        print("launcher's Python (kernels replaced by no-ops), 64 x 1024 bf16")
        _print([
            ("forward, general path (every decision again)", general_fwd),
            ("forward, cached plan", lambda: softmax_launch.forward(0, x, 1, None, None, None, x.dtype)),
            ("forward, cached plan, no row statistics",
             lambda: softmax_launch.forward(0, x, 1, None, None, None, x.dtype, False)),
            ("forward + scale + mask, cached plan",
             lambda: softmax_launch.forward(0, x, 1, 0.5, None, mask.expand(64, 1024), x.dtype)),
            ("backward, general path", general_bwd),
            ("backward, cached plan",
             lambda: softmax_launch.backward(0, g, x, m, l, 1, None, None, None, False)),
        ], calls, 10)
        xg = x.clone().requires_grad_(True)
        with _gpu_route_on_cpu([]):  # the public function on the launcher's route
            print("public safeops.softmax on the same route (kernels replaced by no-ops), 64 x 1024 bf16")
            _print([("safeops.softmax, x not requiring grad", lambda: safeops.softmax(x, -1)),
                    ("safeops.softmax, x requiring grad", lambda: safeops.softmax(xg, -1)),
                    ("fwd+bwd safeops.softmax (torch.autograd.grad)",
                     lambda: torch.autograd.grad(safeops.softmax(xg, -1), xg, g)),
                    ("fwd+bwd torch.softmax (CPU math included)",
                     lambda: torch.autograd.grad(torch.softmax(xg, -1), xg, g))], calls, 10)
    finally:
        softmax_launch._kernels, softmax_launch._check_device = real
    os.environ["SAFEOPS_BACKEND"] = "reference"
    xs = torch.randn(2, 8)
    # The layers alone: the reference's math replaced by returning precomputed results (the op bodies still
    # allocate and fill their outputs).
    reference = safeops.reference
    real = reference.forward, reference.backward
    fwd_result = reference.forward(0, xs, 1, None, None, None, None)
    bwd_result = (torch.randn_like(xs), None)
    reference.forward = lambda *args: fwd_result
    reference.backward = lambda *args: bwd_result
    try:
        print("registered op layers, 2 x 8 fp32, the reference's math replaced by precomputed results")
        _print([("torch.softmax", lambda: torch.softmax(xs, -1)), *_op_cases(xs)], calls, 10)
    finally:
        reference.forward, reference.backward = real
    print("registered op, 2 x 8 fp32, SAFEOPS_BACKEND=reference (end to end)")
    _print([("reference.forward", lambda: safeops.reference.forward(0, xs, 1, None, None, None, None)),
            *_op_cases(xs)[:4]], calls, 10)


# ---------------------------------------------------------------------------------------------------
# fp8 cast + transpose (safeops.cast_transpose)
# ---------------------------------------------------------------------------------------------------


def _cast_cases(x: torch.Tensor, s: torch.Tensor, rows: torch.Tensor) -> list:
    """The layers of one ``safeops.cast_transpose`` call, outermost first."""
    from safeops.ops import cast_transpose as ct_ops
    from safeops.ops import cast_transpose_launch as ct_launch

    fp8 = torch.float8_e4m3fn
    op = torch.ops.safeops.cast_transpose.default
    x16 = x.to(torch.float16)
    return [
        ("safeops.cast_transpose, bf16 tensorwise", lambda: safeops.cast_transpose(x, s, fp8)),
        ("safeops.cast_transpose, bf16 rowwise", lambda: safeops.cast_transpose(x, rows, fp8, rowwise=True)),
        ("safeops.cast_transpose, fp16 (non-bf16 kernel)", lambda: safeops.cast_transpose(x16, s, fp8)),
        ("op, as compiled graphs call it", lambda: op(x, s, fp8, False)),
        ("op implementation (ops.cast_transpose._impl)", lambda: ct_ops._impl(x, s, fp8, False)),
        ("launcher (cast_transpose_launch)", lambda: ct_launch.cast_transpose(x, s, fp8, False)),
        ("  pieces: the outputs' 3 allocations", lambda: _cast_outputs(x, fp8)),
        ("  pieces: amax workspace lookup", lambda: ct_launch._workspace(x.device)),
        ("  pieces: _config.use_triton (reads the env)", lambda: safeops._config.use_triton(x)),
    ]


def _cast_outputs(x: torch.Tensor, fp8: torch.dtype) -> tuple:
    """The launcher's three output allocations (y, y_t, amax), as its routes make them."""
    m, k = x.shape
    return (torch.empty(m, k, dtype=fp8, device=x.device),
            torch.empty_strided((m, k), (1, m), dtype=fp8, device=x.device),
            torch.empty(size=(), dtype=torch.float32, device=x.device))


def cast_gpu(calls: int) -> None:
    """Host time per ``safeops.cast_transpose`` call on the GPU: layer by layer on a tiny input (the GPU
    work is negligible, so the wall time per call is the host's), then at the benchmark's shapes the CPU
    time of back-to-back calls (no synchronisation inside) next to the kernel's own time."""
    import triton.testing

    from safeops.ops import cast_transpose_launch as ct_launch

    dev = "cuda"
    x = torch.randn(64, 128, device=dev).to(torch.bfloat16)
    s = torch.tensor(0.5, device=dev)
    rows = torch.rand(64, 1, device=dev) + 0.5
    print(f"fp8 cast + transpose, host time per call ({calls} back-to-back calls, best of 3); "
          f"64 x 128 bf16 -> e4m3fn")
    _print(_cast_cases(x, s, rows), calls)
    _print([
        ("  pieces: torch.cuda.current_stream()", torch.cuda.current_stream),
        ("  pieces: torch.empty((64, 128), fp8, cuda)",
         lambda: torch.empty((64, 128), dtype=torch.float8_e4m3fn, device=dev)),
    ], calls)
    print("checks")
    _check_cast_routes(dev)
    print("at the benchmark's shapes: host = CPU time per call of 200 back-to-back calls (no sync inside), "
          "kernel = do_bench of the same call (its L2 flush hides host time below ~70 us)")
    for m, k in ((4096, 4096), (3072, 12288), (8192, 8192)):
        big = torch.randn(m, k, device=dev).mul_(300).to(torch.bfloat16)
        for name, scale in (("tensorwise", s), ("rowwise", torch.rand(m, 1, device=dev) + 0.5)):
            rowwise = name == "rowwise"
            args = (big, scale, torch.float8_e4m3fn)

            def call(args=args, rowwise=rowwise):
                return safeops.cast_transpose(*args, rowwise=rowwise)

            def launcher(args=args, rowwise=rowwise):
                return ct_launch.cast_transpose(*args, rowwise)

            host = _host_us(call)
            host_launcher = _host_us(launcher)
            kernel = triton.testing.do_bench(call, warmup=10, rep=50) * 1e3
            wall = per_call_us(call, 200)
            verdict = "host-bound" if host > kernel else "GPU-bound"
            print(f"  {m}x{k} {name:10s} safeops.cast_transpose host {host:6.1f} us (launcher alone "
                  f"{host_launcher:5.1f}), kernel {kernel:6.1f} us, back-to-back wall {wall:6.1f} us/call: "
                  f"{verdict}, {m * k * 4 / wall * 1e-6:.2f} TB/s", flush=True)
        del big
        torch.cuda.empty_cache()


CAST_CHECKS = (((4096, 4096), torch.bfloat16, False), ((4096, 4096), torch.bfloat16, True),
               ((1000, 36), torch.bfloat16, False), ((1002, 40), torch.bfloat16, True),
               ((512, 768), torch.float16, False), ((64, 4096), torch.float32, True))


def _check_cast_routes(dev: str = "cuda", cases=CAST_CHECKS) -> None:
    """The cached routes give the bits the general path (every decision made again) and eager torch give,
    and launch the compiled kernel directly."""
    from safeops.ops import cast_transpose_launch as ct_launch

    fp8 = torch.float8_e4m3fn
    for (m, k), dtype, rowwise in cases:
        x = torch.randn(m, k, device=dev).mul_(300).to(dtype)
        s = torch.rand(m, 1, device=dev) + 0.5 if rowwise else torch.tensor(0.7, device=dev)
        ct_launch.clear_routes()
        outs = [safeops.cast_transpose(x, s, fp8, rowwise=rowwise) for _ in range(3)]
        routes = list(ct_launch._routes.values())
        general = ct_launch._general(x, s, fp8, rowwise, None, None)
        y = (x.float() * s).clamp(-448.0, 448.0).to(fp8)
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and a.stride() == b.stride()
                   for out in outs for a, b in ((out[0], general[0]), (out[1], general[1]), (out[0], y),
                                                (out[1], y.t().contiguous().t())))
        same = same and all(torch.equal(out[2], general[2]) for out in outs)
        route = routes[0] if len(routes) == 1 else routes
        if not isinstance(route, ct_launch._Route):
            what = f"route {route}"
        else:
            direct = bool(route.launch is not None and route.launch._compiled)
            what = f"route {route.kernel.fn.__name__}, launching directly: {direct}"
        print(f"  {m}x{k} {str(dtype)[6:]} {'rowwise' if rowwise else 'tensorwise'}: bits "
              f"{'identical' if same else 'DIFFER'} (route vs general path vs eager); {what}", flush=True)


def _host_us(fn, calls: int = 200) -> float:
    for _ in range(10):
        fn()
    _sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        _sync()
    return best


@contextlib.contextmanager
def _gpu_route_on_cpu(patches: list):
    """SAFEOPS_BACKEND=triton and ``setattr(obj, name, value)`` for each patch inside the block (the GPU
    route's Python run on the CPU), everything restored after."""
    saved_env = os.environ.get("SAFEOPS_BACKEND")
    os.environ["SAFEOPS_BACKEND"] = "triton"
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        if saved_env is None:
            os.environ.pop("SAFEOPS_BACKEND", None)
        else:
            os.environ["SAFEOPS_BACKEND"] = saved_env


def cast_cpu(calls: int) -> None:
    """The Python part of a GPU ``safeops.cast_transpose`` call, on the CPU: SAFEOPS_BACKEND=triton with
    the kernel launches replaced by no-ops and the launcher's GPU-only checks told this is a GPU, so the
    calls take the GPU's route (bf16: the bf16 kernel's; fp16: the other kernel's)."""
    from safeops.ops import cast_transpose_launch as ct_launch

    def bf16_kernel_fits(x, dtype):  # as on a GPU
        return x.dtype == torch.bfloat16 and x.numel() > 0 and x.shape[0] % 4 == 0

    patches = [(_launch.KernelLaunch, "__call__", lambda self, *args: None),
               (ct_launch, "_interpreted", lambda: False), (ct_launch, "_check_device", lambda x: None),
               (ct_launch, "_bf16_kernel_fits", bf16_kernel_fits)]
    with _gpu_route_on_cpu(patches):
        x = torch.randn(256, 512).to(torch.bfloat16)
        s = torch.tensor(0.5)
        rows = torch.rand(256, 1) + 0.5
        print("fp8 cast + transpose, the GPU route's Python on the CPU (kernel launches replaced by no-ops), "
              "256 x 512 bf16 -> e4m3fn")
        _print(_cast_cases(x, s, rows), calls, 10)


# ---------------------------------------------------------------------------------------------------
# Attention at the Llama layer's shapes (bench/model.py: q (1, 32, 4096, 64), k / v (1, 4, 4096, 64) bf16,
# causal)
# ---------------------------------------------------------------------------------------------------

ATTN_SHAPE = {"hq": 32, "hkv": 4, "d": 64}


def _llama_qkv(device, s: int, requires_grad: bool = False):
    """q (1, 32, S, 64), k and v (1, 4, S, 64), bf16, with the strides a Llama layer gives them: its
    projections' (B, S, H, D) outputs seen as (B, H, S, D) (``.view(...).transpose(1, 2)``; RoPE keeps that
    layout). Returns the leaves (B, S, H, D) too, for gradients."""
    leaves = []
    for h in (ATTN_SHAPE["hq"], ATTN_SHAPE["hkv"], ATTN_SHAPE["hkv"]):
        t = torch.empty(1, s, h, ATTN_SHAPE["d"], dtype=torch.bfloat16, device=device)
        if t.device.type != "meta":
            t.normal_()
        leaves.append(t.requires_grad_(requires_grad))
    q, k, v = (t.transpose(1, 2) for t in leaves)
    return q, k, v, leaves


_CAPTURE = "safeops_overhead_capture"


def _hf_call():
    """(module, attention_mask, kwargs) a Llama layer passes to its attention function in a training step
    like bench/model.py's (no padding): captured from one forward of a small LlamaForCausalLM with the same
    head layout, through a recording attention function registered with transformers (it runs sdpa). None
    when transformers is missing."""
    try:
        from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return None
    seen = []

    def capture(module, query, key, value, attention_mask, **kwargs):
        seen.append((module, attention_mask, kwargs))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_CAPTURE, capture)
    AttentionMaskInterface.register(_CAPTURE, sdpa_mask)
    d, hq, hkv = ATTN_SHAPE["d"], ATTN_SHAPE["hq"], ATTN_SHAPE["hkv"]
    config = LlamaConfig(hidden_size=hq * d, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=hq, num_key_value_heads=hkv, vocab_size=64,
                         max_position_embeddings=64)
    config._attn_implementation = _CAPTURE
    model = LlamaForCausalLM(config)
    model.train()
    ids = torch.randint(0, 64, (1, 16))
    model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    return seen[0]


def _attention_cases(q, k, v, leaves, g, hf, prefix: str = "") -> list:
    """The layers of one attention call, outermost first: HF attention function, public function, registered
    ops, their implementations, the launcher (forward and backward, cached state). ``q, k, v`` are views of
    ``leaves`` (which may require grad): forward-only cases get them detached."""
    qr, kr, vr = q, k, v
    q, k, v = (t.detach() for t in (q, k, v))
    from safeops.ops import attention as attn_ops
    from safeops.ops import attention_launch as L

    s = q.shape[2]
    scale = ATTN_SHAPE["d"] ** -0.5
    # The options safeops.attention passes for is_causal bf16: (mask, mask_kind, cu_q, cu_k, max_q, max_k,
    # is_causal, scale, softcap, window_left, window_right, precision).
    options = (None, 0, None, None, s, s, True, scale, None, -1, 0, 0)
    out, m, l = L.forward(q, k, v, *options)
    go = g.transpose(1, 2)  # the gradient reaching the op: the HF function's transpose(1, 2) undone
    op = torch.ops.safeops.attention.default
    op_bwd = torch.ops.safeops.attention_backward.default
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))

    def fwd_bwd(f, grad=g):
        return lambda: torch.autograd.grad(f(), leaves, grad)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    cases = []
    if hf is not None:
        from safeops import transformers as safe_tf

        module, mask, kwargs = hf
        cases += [
            (f"{prefix}HF attention_forward (safeops.transformers)",
             lambda: safe_tf.attention_forward(module, q, k, v, mask, **kwargs)),
            (f"{prefix}fwd+bwd HF attention_forward",
             fwd_bwd(lambda: safe_tf.attention_forward(module, qr, kr, vr, mask, **kwargs)[0])),
        ]
    cases += [
        (f"{prefix}safeops.attention", lambda: safeops.attention(q, k, v, is_causal=True)),
        (f"{prefix}fwd+bwd safeops.attention",
         fwd_bwd(lambda: safeops.attention(qr, kr, vr, is_causal=True), go)),
        (f"{prefix}op, inputs no grad", lambda: op(q, k, v, *options)),
        (f"{prefix}op, inputs require grad", lambda: op(qg, kg, vg, *options)),
        (f"{prefix}op, require grad, no_grad()", no_grad(lambda: op(qg, kg, vg, *options))),
        (f"{prefix}backward op", lambda: op_bwd(go, q, k, v, out, m, l, *options)),
        (f"{prefix}op impl (_forward_impl)", lambda: attn_ops._forward_impl(q, k, v, *options)),
        (f"{prefix}backward impl (_backward_impl)",
         lambda: attn_ops._backward_impl(go, q, k, v, out, m, l, *options)),
        (f"{prefix}launcher forward", lambda: L.forward(q, k, v, *options)),
        (f"{prefix}launcher backward", lambda: L.backward(go, q, k, v, out, m, l, *options)),
    ]
    general_fwd = getattr(L, "_forward_general", None)
    if general_fwd is not None:  # the launcher without its plans (every decision made again)
        cases += [
            (f"{prefix}launcher forward, uncached (_forward_general)",
             lambda: general_fwd(q, k, v, *options)),
            (f"{prefix}launcher backward, uncached (_backward_general)",
             lambda: L._backward_general(go, q, k, v, out, m, l, *options)),
        ]
    return cases


def _sdpa_cases(q, k, v, leaves, g, hf) -> list:
    import torch.nn.functional as F

    scale = ATTN_SHAPE["d"] ** -0.5

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    cases = [("F.scaled_dot_product_attention (enable_gqa)", sdpa),
             ("fwd+bwd F.scaled_dot_product_attention",
              lambda: torch.autograd.grad(sdpa(), leaves, g.transpose(1, 2)))]
    if hf is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        module, mask, kwargs = hf
        cases += [
            ("HF sdpa_attention_forward", lambda: sdpa_attention_forward(module, q, k, v, mask, **kwargs)),
            ("fwd+bwd HF sdpa_attention_forward",
             lambda: torch.autograd.grad(sdpa_attention_forward(module, q, k, v, mask, **kwargs)[0], leaves,
                                         g)),
        ]
    return cases


def _empty_function_fwd_bwd(q, k, v, leaves, g):
    """Forward + backward through autograd of an autograd.Function that only allocates its outputs: the floor
    under any custom attention's fwd+bwd row (autograd.grad, graph building, the engine)."""

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return torch.empty_like(q)

        @staticmethod
        def backward(ctx, grad):
            q, k, v = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    go = g.transpose(1, 2)
    return lambda: torch.autograd.grad(Empty.apply(q, k, v), leaves, go)


def _keyed_noop_launch(kernel, grid, *args, **kwargs) -> None:
    """``safeops.ops._launch.launch``'s per-call work on CUDA (its cache key over every argument and the
    lookup), without the launch: what the uncached launcher pays per kernel on the GPU besides Triton."""
    key = (kernel, grid, 0, tuple(
        (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args),
        tuple(kwargs.items()))
    _NOOP_PLANS.setdefault(key, None)


_NOOP_PLANS: dict = {}


def attention_cpu(calls: int, s: int = 32) -> None:
    """The Python part of a GPU attention call on the CPU: CPU tensors of the Llama layer's head layout and
    strides at a short sequence (``s``: the host work does not depend on it, and the torch ops the launcher
    runs besides the kernels -- allocations, the GQA partials' sum and copy -- then cost about their CUDA
    dispatch; meta tensors would not do: their allocations cost ~25 us each), SAFEOPS_BACKEND=triton, the
    launcher's GPU-only branches told this is a GPU (GPU configs, split, grids), the kernels replaced by
    no-ops, the launcher's generic ``launch`` by its CUDA key-building without the launch, and the plans'
    KernelLaunch calls by no-ops."""
    from safeops.ops import attention_launch as L

    patches = [(L, "_kernels", _NoKernels()), (L, "launch", _keyed_noop_launch),
               (L, "_gpu", lambda device: True), (L, "_check_device", lambda q: None),
               (_launch.KernelLaunch, "__call__", lambda self, *args: None)]
    with _gpu_route_on_cpu(patches):
        hf = _hf_call()
        q, k, v, leaves = _llama_qkv("cpu", s, requires_grad=True)
        g = torch.randn(1, s, ATTN_SHAPE["hq"], ATTN_SHAPE["d"], dtype=torch.bfloat16)
        if hf is not None:
            print(f"  (HF call as captured from LlamaForCausalLM: attention_mask {hf[1]!r}, "
                  f"kwargs {sorted(hf[2])}, module.is_causal {getattr(hf[0], 'is_causal', None)})")
        print("attention, the GPU path's Python on the CPU (launches replaced by no-ops): "
              f"q (1, 32, {s}, 64), k / v (1, 4, {s}, 64) bf16 with a Llama layer's strides, causal")
        qn, kn, vn = (t.detach() for t in (q, k, v))
        _print(_attention_cases(q, k, v, leaves, g, hf), calls, 10)
        _print([
            ("  pieces: fwd+bwd of an empty autograd.Function", _empty_function_fwd_bwd(q, k, v, leaves, g)),
            ("  pieces: torch.empty_like(q)", lambda: torch.empty_like(qn)),
            ("  pieces: eager_fast_path(q, k, v, ...)",
             lambda: softmax_ops.eager_fast_path(qn, kn, vn, None, None, None)),
            ("  pieces: _config.use_triton (reads the env)", lambda: safeops._config.use_triton(qn)),
        ], calls, 10)
    # The Gluon route (the sm_90 default): the device check answering as on an H100 / H200, the Gluon plans'
    # KernelLaunch calls no-ops (their TMA descriptors are still built; Triton's launcher, which encodes them,
    # is not run).
    from safeops.ops import attention_gluon as G

    gluon_patches = patches + [(G, "device_reason", lambda device: ""), (G, "_arch", lambda index: "sm_90"),
                               (G, "_num_sms", lambda index: 132)]
    with _gpu_route_on_cpu(gluon_patches):
        L.clear_plans()
        q, k, v, leaves = _llama_qkv("cpu", s, requires_grad=True)
        print("attention, the Gluon route's Python on the CPU (as on sm_90; launches replaced by no-ops): "
              f"forward {G.reason(q, k, v, None, None, True, None, -1, 0) or 'Gluon'}, backward "
              f"{safeops.attention_backend(q, k, v, is_causal=True, backward=True)[1]}")
        _print(_attention_cases(q, k, v, leaves, g, hf, "gluon: "), calls, 10)
        L.clear_plans()


def attention_gpu(calls: int) -> None:
    """Host time per attention call on the GPU: layer by layer at S = 256 (the kernels take a few
    microseconds, so back-to-back calls are host-bound and the wall time per call is the host's), next to
    torch's SDPA; then at the Llama layer's S = 4096 the CPU time of back-to-back calls (no synchronisation
    inside) next to the GPU time (do_bench) of the same call; and a check that the cached launcher gives
    the uncached one's bits."""
    import triton.testing

    dev = "cuda"
    hf = _hf_call()
    if hf is not None:
        module, mask, kwargs = hf
        hf = (module.to(dev), mask, kwargs)
    s = 256
    q, k, v, leaves = _llama_qkv(dev, s, requires_grad=True)
    g = torch.randn(1, s, ATTN_SHAPE["hq"], ATTN_SHAPE["d"], dtype=torch.bfloat16, device=dev)
    print(f"attention, host time per call ({calls} back-to-back calls, best of 3): q (1, 32, {s}, 64), "
          "k / v (1, 4, S, 64) bf16, causal, Llama strides")
    print("yardstick: torch SDPA")
    _print(_sdpa_cases(q, k, v, leaves, g, hf), calls)
    print("safeops")
    _print(_attention_cases(q, k, v, leaves, g, hf), calls)
    print("at the Llama layer's shape (S = 4096): host = CPU time per call of 20 back-to-back calls (no sync "
          "inside), gpu = do_bench of the same call")
    s = 4096
    q, k, v, leaves = _llama_qkv(dev, s, requires_grad=True)
    g = torch.randn(1, s, ATTN_SHAPE["hq"], ATTN_SHAPE["d"], dtype=torch.bfloat16, device=dev)
    big = _sdpa_cases(q, k, v, leaves, g, hf) + [
        c for c in _attention_cases(q, k, v, leaves, g, hf) if "HF" in c[0] or "safeops.attention" in c[0]]
    for name, fn in big:
        host = _host_us(fn, 20)
        gpu_us = triton.testing.do_bench(fn, warmup=5, rep=50) * 1e3
        print(f"  {name:48s} host {host:8.1f} us, gpu {gpu_us:8.1f} us", flush=True)
    _check_attention_plans(dev)


def _check_attention_plans(dev: str, s: int = 1024) -> None:
    """A repeated call (kept plans, direct launches) gives the first call's bits, forward and backward: the
    first call after the plans are cleared decides every launch (the path choice, the general path), the
    later ones replay what it kept."""
    from safeops.ops import attention_gluon as G
    from safeops.ops import attention_launch as L

    if not hasattr(L, "_forward_general"):
        return
    print("checks")
    for causal, window in ((True, -1), (False, -1), (True, 100)):
        q, k, v, _ = _llama_qkv(dev, s)
        options = (None, 0, None, None, s, s, causal, 0.125, None, window, 0 if causal else -1, 0)
        L.clear_plans()
        ref = L.forward(q, k, v, *options)
        g = torch.randn_like(ref[0])
        dref = L.backward(g, q, k, v, *ref, *options)
        for _ in range(2):
            out = L.forward(q, k, v, *options)
            dgot = L.backward(g, q, k, v, *ref, *options)
        same = all(torch.equal(a, b) for a, b in zip((*ref, *dref), (*out, *dgot), strict=True))
        verdict = "identical" if same else "DIFFER"
        plans = [p for table in L._tables() for p in table.values() if p is not L._GENERAL]
        launches = []
        for p in plans + list(L._gluon_bwd_plans.values()):
            for name in ("run", "delta", "dkdv", "dq", "launch"):
                r = getattr(p, name, None)
                if isinstance(r, (G.Plan, G.BwdPlan, G.DqPlan)):
                    continue  # counted through the Gluon plans' own table
                if isinstance(r, _launch.KernelLaunch):
                    launches.append(r)
        direct = sum(bool(r._compiled) for r in launches)
        maps = sum(bool(r._maps) for r in launches)
        print(f"  causal {causal} window {window}: kept plans' bits {verdict} to the first call's; launches "
              f"compiled-direct {direct}/{len(launches)}, with kept tensor maps {maps}", flush=True)


def _ce_cases(x: torch.Tensor, t: torch.Tensor) -> list:
    """The cross-entropy layers on logits ``x`` / targets ``t`` ("mean"): the public function (eager fast
    path) without and with a gradient to record, forward + backward through autograd, and the launcher."""
    from safeops.ops import cross_entropy_launch as ce_launch

    xg = x.clone().requires_grad_(True)
    loss, m, l, denom = ce_launch.forward(x, t, None, -100, 1, 0.0, 0.0, x.dtype)
    g = torch.ones_like(loss)
    return [
        ("safeops.cross_entropy, logits not requiring grad", lambda: safeops.cross_entropy(x, t)),
        ("safeops.cross_entropy, logits requiring grad", lambda: safeops.cross_entropy(xg, t)),
        ("fwd+bwd safeops.cross_entropy (torch.autograd.grad)",
         lambda: torch.autograd.grad(safeops.cross_entropy(xg, t), xg)),
        ("launcher forward (cross_entropy_launch.forward)",
         lambda: ce_launch.forward(x, t, None, -100, 1, 0.0, 0.0, x.dtype)),
        ("launcher backward", lambda: ce_launch.backward(g, x, t, None, m, l, denom, -100, 1, 0.0, 0.0)),
    ]


def ce_cpu(calls: int) -> None:
    """The Python part of a GPU ``safeops.cross_entropy`` call on the CPU: SAFEOPS_BACKEND=triton, the launch
    plans kept as on a GPU with their launches replaced by no-ops, the GPU-only checks told this is a GPU
    (and the CPU-only target check, which a GPU call does not make, skipped). The blocks are the CPU's."""
    from safeops.ops import cross_entropy as ce_ops
    from safeops.ops import cross_entropy_launch as ce_launch

    patches = [(ce_launch, "_kernels", _NoKernels()), (ce_launch, "_planned", lambda x: True),
               (ce_launch, "_compiled", lambda kernel: True),
               (_launch.KernelLaunch, "__call__", lambda self, *args: None),
               (ce_launch, "_check_device", lambda x: None), (ce_ops, "check_targets", lambda *a: None)]
    x = torch.randn(64, 1024, dtype=torch.bfloat16)
    t = torch.randint(0, 1024, (64,))
    with _gpu_route_on_cpu(patches):
        print("cross-entropy, the GPU route's Python on the CPU (launches replaced by no-ops), "
              "64 x 1024 bf16, 'mean'")
        _print(_ce_cases(x, t), calls, 10)
    xg = x.clone().requires_grad_(True)
    _print([("fwd+bwd F.cross_entropy (CPU math included)",
             lambda: torch.autograd.grad(torch.nn.functional.cross_entropy(xg, t), xg))], calls, 10)


def ce_gpu(calls: int) -> None:
    """Host time per cross-entropy call on the GPU: layer by layer at 64 x 1024 (host-bound), next to torch's
    ``F.cross_entropy``; then at T = 8192, V = 32768 the CPU time of back-to-back forward + backward calls
    (no synchronisation inside) next to their GPU time (do_bench)."""
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, 1024, (64,), device="cuda")
    xg = x.clone().requires_grad_(True)
    print(f"{torch.cuda.get_device_name()}: cross-entropy, wall time per call, {calls} back-to-back calls, "
          "best of 3; 64 x 1024 bf16, 'mean'")
    _print([("fwd+bwd F.cross_entropy",
             lambda: torch.autograd.grad(torch.nn.functional.cross_entropy(xg, t), xg))]
           + _ce_cases(x, t), calls)
    x = torch.randn(8192, 32768, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, 32768, (8192,), device="cuda")
    xg = x.clone().requires_grad_(True)

    def step():
        return torch.autograd.grad(safeops.cross_entropy(xg, t), xg)

    host = _host_us(step, 20)
    kernel = triton.testing.do_bench(step, warmup=25, rep=100) * 1e3
    print(f"  8192 x 32768 fwd+bwd safeops.cross_entropy: host {host:.0f} us per call issued, "
          f"GPU {kernel:.0f} us ({'host' if host > kernel else 'GPU'}-bound)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=None)
    p.add_argument("--cpu", action="store_true", help="measure the Python part on the CPU (no GPU needed)")
    p.add_argument("--cast", action="store_true", help="only the fp8 cast + transpose tables")
    p.add_argument("--attention", action="store_true", help="only the attention tables (Llama layer shapes)")
    p.add_argument("--cross-entropy", action="store_true", help="only the cross-entropy tables")
    args = p.parse_args()
    if args.cross_entropy:
        if args.cpu:
            ce_cpu(args.calls or 3000)
        elif not torch.cuda.is_available():
            sys.exit("bench/overhead.py: needs a CUDA GPU (or --cpu)")
        else:
            ce_gpu(args.calls or 1000)
        return
    if args.attention:
        if args.cpu:
            attention_cpu(args.calls or 300)
        elif not torch.cuda.is_available():
            sys.exit("bench/overhead.py: needs a CUDA GPU (or --cpu)")
        else:
            attention_gpu(args.calls or 1000)
        return
    if args.cpu:
        if not args.cast:
            cpu(args.calls or 3000)
        cast_cpu(args.calls or 3000)
        return
    if not torch.cuda.is_available():
        sys.exit("bench/overhead.py: needs a CUDA GPU (or --cpu)")
    if not args.cast:
        gpu(args.calls or 2000)
    cast_gpu(args.calls or 2000)


if __name__ == "__main__":
    main()
