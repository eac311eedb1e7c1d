"""One measured call per case, for profilers: Nsight Compute (``ncu``) and torch.profiler.

Issue 19 asks, for a missed speed target, for the Nsight Compute profile of the gap (tensor-pipe use, stall
reasons); issues 20 and 22 need the same for the long-row softmax, cross-entropy and the registered
compiled fp8 path. Each case compiles and warms up its kernels first, then runs the measured call between
``cudaProfilerStart`` / ``cudaProfilerStop``, so ``ncu --profile-from-start off`` profiles exactly the
measured launches:

    ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --section WarpStateStats --section Occupancy python3 bench/profiling.py attn-fwd-d128

``bash bench/gpu_run.sh profile`` runs every ncu case that way (PROFILE_CASES picks them) and then
``python3 bench/profiling.py cast-compiled``, which needs no ncu: a torch.profiler trace of back-to-back
calls of the fp8 cast + transpose expression compiled by stock Inductor and under ``safeops.register()``
(host time per call, GPU kernels per call, and the gaps between them).

    python3 bench/profiling.py CASE [CASE ...]      (``--list`` names the cases)

(Not ``bench/profile.py``: run as a script, its folder comes first on sys.path, and a file of that name
shadows the standard library's ``profile``, which ``cProfile`` imports when torch._dynamo loads: the
cast-compiled case failed that way on the GPU.)

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE.parent), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402


def _attention(d: int, backward: bool, causal: bool = False, fused: bool = False, **fused_config):
    """``fused``: the fused Gluon backward for every case it takes (GLUON_FUSED; by default only non-causal
    D=128), its configuration at head dim ``d`` changed by ``fused_config`` (GluonFusedConfig fields)."""
    import safeops

    if fused:
        import dataclasses

        from safeops.kernels import attention_gluon_bwd
        from safeops.ops import attention_gluon

        attention_gluon.GLUON_FUSED = True
        configs = attention_gluon_bwd.FUSED_CONFIGS
        configs[d] = dataclasses.replace(configs[d], **fused_config)

    b, h, s = 4, 16, 4096
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
               for _ in range(3))
    if not backward:
        return lambda: safeops.attention(q, k, v, is_causal=causal)
    out = safeops.attention(q, k, v, is_causal=causal)
    g = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)


def _attention_cudnn(d: int, backward: bool, causal: bool = False):
    """The same shapes through SDPA's cuDNN backend: the yardstick of issue 19's gap, profiled alike."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    b, h, s = 4, 16, 4096
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
               for _ in range(3))

    def run(fn):
        def call():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return fn()
        return call

    if not backward:
        return run(lambda: sdpa(q, k, v, is_causal=causal))
    out = run(lambda: sdpa(q, k, v, is_causal=causal))()
    g = torch.randn_like(out)
    return run(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))


def _softmax_bwd(n: int):
    import safeops

    x = torch.randn(2**28 // n, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = safeops.softmax(x, -1)
    g = torch.randn_like(y)
    return lambda: torch.autograd.grad(y, x, g, retain_graph=True)


def _softmax_fwd(n: int):
    import safeops

    x = torch.randn(2**28 // n, n, device="cuda", dtype=torch.bfloat16)
    return lambda: safeops.softmax(x, -1)


def _xent(v: int, backward: bool):
    import safeops

    x = torch.randn(8192, v, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
    t = torch.randint(0, v, (8192,), device="cuda")
    if not backward:
        return lambda: safeops.cross_entropy(x, t, reduction="none")
    loss = safeops.cross_entropy(x, t)
    return lambda: torch.autograd.grad(loss, x, retain_graph=True)


def _cast(rowwise: bool, n: int = 4096):
    import _harness as H
    import cast_transpose as CT

    import safeops

    t = CT.make_inputs(H.Case("rowwise" if rowwise else "tensorwise", torch.bfloat16, (n, n)))
    return lambda: safeops.cast_transpose(t["x"], t["s"], torch.float8_e4m3fn, rowwise=rowwise)


NCU_CASES = {
    "attn-fwd-d64": lambda: _attention(64, False),
    "attn-fwd-d128": lambda: _attention(128, False),
    "attn-fwd-d128-causal": lambda: _attention(128, False, causal=True),
    "attn-fwd-d64-causal": lambda: _attention(64, False, causal=True),
    "attn-bwd-d64": lambda: _attention(64, True),
    "attn-bwd-d128": lambda: _attention(128, True),
    "attn-bwd-d64-causal": lambda: _attention(64, True, causal=True),
    "attn-bwd-d128-causal": lambda: _attention(128, True, causal=True),
    "attn-bwd-d128-fused": lambda: _attention(128, True, fused=True),
    "attn-bwd-d64-fused": lambda: _attention(64, True, fused=True),
    # The TMA writer with three Q / dO stages (the fastest fused configuration measured so far) and with the
    # shifted order; causal takes the plain order.
    "attn-bwd-d128-fused-tma": lambda: _attention(128, True, fused=True, tma_reduce=True, finalize=False,
                                                  num_stages=3),
    "attn-bwd-d128-fused-tma-causal": lambda: _attention(128, True, causal=True, fused=True, tma_reduce=True,
                                                         finalize=False, num_stages=3),
    "attn-bwd-d128-fused-shift": lambda: _attention(128, True, fused=True, tma_reduce=True, finalize=False,
                                                    num_stages=3, shift=True, early_turn=True),
    "attn-bwd-d128-fused-lpt-causal": lambda: _attention(128, True, causal=True, fused=True, tma_reduce=True,
                                                         finalize=False, num_stages=3, causal_lpt=True,
                                                         early_turn=True),
    # D=64 in the branch fused64-default's form (dQ split by head-dim columns so the TMA writer applies, the
    # shifted order, the row statistics): what keeps it level with the Gluon pair although it runs 5 products
    # per block pair to the pair's 7. And the D=128 default with S^T and dP^T issued together (FA3's order).
    "attn-bwd-d64-fused-tma-shift-rs": lambda: _attention(64, True, fused=True, tma_reduce=True,
                                                          finalize=False, split_d=True, shift=True,
                                                          early_turn=True, row_stats=True),
    "attn-bwd-d128-together": lambda: _attention(128, True, fused=True, st_dpt_together=True),
    "cudnn-fwd-d64": lambda: _attention_cudnn(64, False),
    "cudnn-fwd-d128": lambda: _attention_cudnn(128, False),
    "cudnn-bwd-d128": lambda: _attention_cudnn(128, True),
    "cudnn-fwd-d64-causal": lambda: _attention_cudnn(64, False, causal=True),
    "cudnn-fwd-d128-causal": lambda: _attention_cudnn(128, False, causal=True),
    "cudnn-bwd-d64": lambda: _attention_cudnn(64, True),
    "cudnn-bwd-d64-causal": lambda: _attention_cudnn(64, True, causal=True),
    "cudnn-bwd-d128-causal": lambda: _attention_cudnn(128, True, causal=True),
    "softmax-fwd-256k": lambda: _softmax_fwd(2**18),
    "softmax-bwd-32k": lambda: _softmax_bwd(2**15),
    "xent-fwd-32k": lambda: _xent(2**15, False),
    "xent-bwd-128k": lambda: _xent(2**17, True),
    "cast-rowwise-4k": lambda: _cast(True),
    "cast-tensorwise-4k": lambda: _cast(False),
}


def profile_ncu_case(name: str) -> None:
    fn = NCU_CASES[name]()
    for _ in range(3):  # compile, autotune nothing, fill the plan caches
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"[profile] {name}: one measured call profiled", flush=True)


def cast_compiled(calls: int = 50) -> None:
    """torch.profiler over back-to-back calls of the compiled fp8 expression, stock vs registered: the
    expression, inputs and compiles of bench/cast_transpose.py."""
    import _harness as H
    import cast_transpose as CT
    from torch.profiler import ProfilerActivity, profile

    for n, scaling in ((4096, "rowwise"), (4096, "tensorwise"), (8192, "rowwise")):
        case = H.Case(scaling, torch.bfloat16, (n, n))
        t = CT.make_inputs(case)
        for registered in (False, True):
            call = CT.build_compiled(case, t, registered=registered)  # compiles it, once per variant
            for _ in range(10):
                call()
            torch.cuda.synchronize()
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            host = (time.perf_counter() - t0) / calls * 1e6
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / calls * 1e6
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    call()
                torch.cuda.synchronize()
            events = prof.key_averages()
            kernels = [e for e in events if getattr(e, "device_type", None) is not None
                       and str(e.device_type).endswith("CUDA") and e.count]
            label = f"{n}x{n} {scaling} {'registered' if registered else 'stock'}"
            recompiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
            print(f"[cast-compiled] {label}: host {host:.1f} us/call issued, {wall:.1f} us/call with the GPU "
                  f"done; graphs compiled while timed: {recompiles}")
            def device_us(e):
                return getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0))

            gpu_us = sum(device_us(e) for e in kernels) / calls
            per_call = sum(e.count for e in kernels) / calls
            print(f"  GPU time per call {gpu_us:.1f} us in {per_call:.1f} kernels:")
            for e in sorted(kernels, key=lambda e: -device_us(e))[:6]:
                print(f"    {e.count / calls:4.1f} x {device_us(e) / e.count:8.1f} us  {e.key[:90]}")
            print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
            bytes_moved = n * n * (2 + 1 + 1)
            print(f"  {bytes_moved / (wall * 1e-6) / 1e12:.2f} TB/s by wall time per call (x read once, "
                  f"y and y_t written once)", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*")
    p.add_argument("--list", action="store_true")
    args = p.parse_args(argv)
    names = [*NCU_CASES, "cast-compiled"]
    if args.list or not args.cases:
        print(" ".join(names))
        return 0
    unknown = [c for c in args.cases if c not in names]
    if unknown:
        p.error(f"unknown case(s) {unknown}; cases: {' '.join(names)}")
    if not torch.cuda.is_available():
        print("bench/profiling.py needs a CUDA GPU", file=sys.stderr)
        return 2
    for case in args.cases:
        if case == "cast-compiled":
            cast_compiled()
        else:
            profile_ncu_case(case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
