"""Softmax forward and backward bandwidth: safeops against torch eager, torch.compile and Liger-Kernel.

Shapes (issue 2): M * N = 2**28 elements, N in {256, 1K, 4K, 16K, 64K, 256K, 1M, 4M} (so M = 64 at 4M),
bf16 and fp32. GB/s counts the bytes a softmax must move: forward reads x and writes y (2 * numel * bytes),
backward reads two tensors and writes dx (3 * numel * bytes). What each backward timing measures:

- safeops: ``torch.ops.safeops.softmax_backward`` alone, from x, the upstream gradient and the saved fp32
  row max and row sum (it recomputes p from x; reads x and dy, writes dx: the same 3 tensors as the peers);
- safeops, fp fusion on: the same kernels compiled with fp contraction on (``safeops._config.fp_fusion``),
  to show that the safe setting costs nothing; it is our variant, not a peer;
- safeops two-launch: the backward of long rows through the two-launch path where the loop kernel takes
  it (``softmax_launch.LOOP_MAX_COLS_BWD`` emptied); our variant, to show what the loop kernel buys;
- torch eager: ``torch._softmax_backward_data(dy, y, dim, dtype)``, the kernel autograd runs for softmax;
- torch.compile: ``torch.compile`` of that same call, compiled per shape (dynamic=False): the backward
  kernel Inductor generates for ``torch.compile(torch.softmax)`` (its decomposition of this aten op);
- Liger-Kernel: its backward kernel launcher (``_softmax_backward(dy, y, ...)``) when the installed
  version exposes it, else ``torch.autograd.grad`` through ``LigerSoftmaxFunction`` (its backward plus
  autograd's small overhead). Liger refuses rows longer than 65,536 columns: reported as "refused".

Every output is checked once per shape against torch in fp32 (loosely) before it is timed.

``--layout transposed`` gives every implementation the same values with the reduced dim strided (x, y and dy
are ``(N, M)``-contiguous tensors seen as ``(M, N)``): what a softmax over a non-innermost dim reads.
safeops reads such inputs through a rows-major copy (its bits then equal the contiguous input's, contract
section 6); the table shows what that costs against the peers' strided paths.

    python bench/softmax.py [--dtype bf16|fp32|both] [--n 256,4K,1M] [--direction fwd|bwd|both] [--quick]
                            [--layout contiguous|transposed] [--out DIR] [--budget-s SECONDS]

Needs a CUDA GPU; without one it exits with a message.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
for path in (str(HERE.parent), str(HERE)):  # the repo root (safeops) and bench/ (_harness)
    if path not in sys.path:
        sys.path.insert(0, path)

import _harness as H  # noqa: E402
import torch  # noqa: E402

ALL_N = [256, 2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22]
QUICK_N = [2**10, 2**14, 2**18, 2**22]
TOTAL = 2**28  # M * N
DIM = 1
# Loose agreement with torch in fp32, per (direction, dtype): |out - ref| <= rtol * |ref| + atol * max|ref|.
# Peers' bf16 backward works from bf16-rounded probabilities, hence the looser backward bounds.
TOLERANCE = {
    ("fwd", torch.bfloat16): (2**-6, 2**-8),
    ("fwd", torch.float32): (1e-4, 1e-6),
    ("bwd", torch.bfloat16): (2**-5, 2**-6),
    ("bwd", torch.float32): (1e-3, 1e-5),
}


def softmax_bytes(case: H.Case) -> float:
    tensors = 2 if case.direction == "fwd" else 3
    return tensors * case.numel * torch.empty((), dtype=case.dtype).element_size()


def make_cases(dtypes, ns, directions) -> list[H.Case]:
    return [H.Case(d, dt, (max(1, TOTAL // n), n)) for dt in dtypes for d in directions for n in ns]


LAYOUT = "contiguous"  # or "transposed" (--layout)


def _randn(shape, dtype) -> torch.Tensor:
    if LAYOUT == "transposed":
        return torch.randn(tuple(reversed(shape)), device="cuda", dtype=dtype).t()
    return torch.randn(shape, device="cuda", dtype=dtype)


def make_inputs(case: H.Case) -> dict:
    x = _randn(case.shape, case.dtype)
    if case.direction == "fwd":
        return {"x": x}
    dy = _randn(case.shape, case.dtype)
    y = torch.softmax(x, DIM)
    if LAYOUT == "transposed":
        y = y.t().contiguous().t()
    return {"x": x, "dy": dy, "y": y}


def reference(case: H.Case, t: dict) -> torch.Tensor:
    y = torch.softmax(t["x"].float(), DIM)
    if case.direction == "fwd":
        return y
    return torch._softmax_backward_data(t["dy"].float(), y, DIM, torch.float32)


def check(case: H.Case, out, ref: torch.Tensor) -> str | None:
    if isinstance(out, (tuple, list)):
        out = out[0]
    if tuple(out.shape) != tuple(ref.shape):
        return f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    rtol, atol = TOLERANCE[(case.direction, case.dtype)]
    err = (out.float() - ref).abs_()
    bound = ref.abs().mul_(rtol).add_(atol * float(ref.abs().max()))
    bad = ~(err <= bound)
    if bad.any():
        worst = float(err.nan_to_num(math.inf).max())
        return (f"{int(bad.sum())} of {ref.numel()} elements off; max error {worst:.3e}"
                f" (max |ref| {float(ref.abs().max()):.3e})")
    return None


# --------------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------------


def _softmax_kind() -> int:
    from safeops import reference as ref

    return getattr(ref, "SOFTMAX", 0)


def build_two_launch(case: H.Case, t: dict):
    from safeops.ops import softmax_launch as L

    call = build_safeops(case, t)

    def two_launch():
        with mock.patch.object(L, "LOOP_MAX_COLS_BWD", {}):
            return call()

    return two_launch


def build_safeops(case: H.Case, t: dict, fusion: bool = False):
    import safeops

    x = t["x"]
    if case.direction == "fwd":
        def call():
            return safeops.softmax(x, DIM)
    else:
        # The forward's saved fp32 row max and row sum, computed once here (not timed).
        if "row_max" not in t:
            _, t["row_max"], t["row_sum"] = torch.ops.safeops.softmax(
                x=x, dim=DIM, scale=None, scale_tensor=None, mask=None, out_dtype=None)
        op, kind = torch.ops.safeops.softmax_backward, _softmax_kind()
        dy, m, l = t["dy"], t["row_max"], t["row_sum"]

        def call():
            return op(grad=dy, x=x, row_max=m, row_sum=l, dim=DIM, kind=kind, scale=None, scale_tensor=None,
                      mask=None, need_dscale=False)[0]
    if not fusion:
        return call

    def fused():
        with H.config_set("fp_fusion", True):
            return call()

    return fused


def build_eager(case: H.Case, t: dict):
    x = t["x"]
    if case.direction == "fwd":
        return lambda: torch.softmax(x, DIM)
    dy, y = t["dy"], t["y"]
    return lambda: torch._softmax_backward_data(dy, y, DIM, x.dtype)


def _torch_softmax(x):
    return torch.softmax(x, DIM)


def _torch_softmax_backward(dy, y):
    return torch._softmax_backward_data(dy, y, DIM, y.dtype)


_compiled: dict = {}


def build_compiled(case: H.Case, t: dict):
    key = (case.direction, case.dtype, case.shape)
    if key not in _compiled:
        # One compilation per shape (dynamic=False); drop the previous shapes' graphs so no recompile
        # limit turns a later shape into a silent eager fallback.
        torch._dynamo.reset()
        _compiled.clear()
        fn = _torch_softmax if case.direction == "fwd" else _torch_softmax_backward
        _compiled[key] = torch.compile(fn, dynamic=False, fullgraph=True)
    fn = _compiled[key]
    if case.direction == "fwd":
        x = t["x"]
        return lambda: fn(x)
    dy, y = t["dy"], t["y"]
    return lambda: fn(dy, y)


def _liger_module():
    try:
        from liger_kernel.ops import softmax as liger_softmax
    except Exception as e:
        return None, f"liger_kernel is not importable ({type(e).__name__}: {e})"
    if not hasattr(liger_softmax, "LigerSoftmaxFunction"):
        return None, "liger_kernel.ops.softmax has no LigerSoftmaxFunction in this version"
    return liger_softmax, None


def _liger_refusal(e: Exception) -> bool:
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("exceeds" in text or "blocksize" in text or "block size" in text)


def build_liger(case: H.Case, t: dict):
    lsm, why = _liger_module()
    if lsm is None:
        raise H.Unavailable(why)
    x = t["x"]
    try:
        if case.direction == "fwd":
            lsm.LigerSoftmaxFunction.apply(x)  # first call: compiles, or refuses a long row
            return lambda: lsm.LigerSoftmaxFunction.apply(x)
        dy = t["dy"]
        if hasattr(lsm, "_softmax_forward") and hasattr(lsm, "_softmax_backward"):
            try:
                y, *settings = lsm._softmax_forward(x)
                lsm._softmax_backward(dy, y, *settings)
                return lambda: lsm._softmax_backward(dy, y, *settings)
            except TypeError:
                pass  # internals changed: fall back to autograd below
        xr = x.detach().requires_grad_()
        y = lsm.LigerSoftmaxFunction.apply(xr)
        return lambda: torch.autograd.grad(y, xr, dy, retain_graph=True)[0]
    except Exception as e:
        if _liger_refusal(e):
            raise H.Refused(str(e).splitlines()[0]) from e
        raise


def build_benchmark(cases: list[H.Case], only: set[str] | None = None) -> H.Benchmark:
    bench = H.Benchmark(name="softmax", metric=H.Metric("GB/s", softmax_bytes), cases=cases,
                        make_inputs=make_inputs, reference=reference, check=check)
    bench.add("safeops", build_safeops, role="ours")
    bench.add("safeops fp-fusion on", lambda c, t: build_safeops(c, t, fusion=True), role="variant", tag="")
    bench.add("safeops two-launch", build_two_launch, role="variant", tag="")
    bench.add("torch eager", build_eager, tag="e")
    bench.add("torch.compile", build_compiled, tag="c")
    _, why = _liger_module()
    bench.add("Liger-Kernel", build_liger, tag="L", unavailable=why)
    if only:
        bench.impls = [i for i in bench.impls if i.name in only]
    return bench


# --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=("bf16", "fp32", "both"), default="both")
    p.add_argument("--n", default="", help="comma list of row lengths, e.g. 256,4K,1M (default: all 8)")
    p.add_argument("--direction", choices=("fwd", "bwd", "both"), default="both")
    p.add_argument("--quick", action="store_true",
                   help=f"N in {[H.size_label(n) for n in QUICK_N]}, shorter timing")
    p.add_argument("--impl", default="", help="comma list of implementation names to run (default: all)")
    p.add_argument("--out", default=str(HERE / "out"),
                   help="directory for softmax.csv/.png/.md (default bench/out)")
    p.add_argument("--warmup", type=float, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=100, help="do_bench repetitions, ms")
    p.add_argument("--budget-s", type=float, default=0,
                   help="stop starting new shapes after this many seconds (0: no limit)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--layout", choices=("contiguous", "transposed"), default="contiguous",
                   help="transposed: the reduced dim strided (see above)")
    args = p.parse_args(argv)

    H.require_cuda("bench/softmax.py")
    global LAYOUT
    LAYOUT = args.layout
    import safeops  # noqa: F401

    t0 = time.time()
    deadline = t0 + args.budget_s if args.budget_s > 0 else math.inf
    dtypes = [H.DTYPES_BY_NAME[d] for d in (("bf16", "fp32") if args.dtype == "both" else (args.dtype,))]
    ns = H.parse_sizes(args.n) if args.n else (QUICK_N if args.quick else ALL_N)
    directions = ("fwd", "bwd") if args.direction == "both" else (args.direction,)
    warmup, rep = (10, 40) if args.quick else (args.warmup, args.rep)
    meta = H.device_meta()
    copy_gbps = H.copy_bandwidth_gbps()
    print(f"{meta['gpu']} ({meta['sms']} SMs, L2 {meta['l2_mb']} MB), torch {meta['torch']}, triton "
          f"{meta['triton']}, CUDA {meta['cuda']}: device-to-device copy {copy_gbps:.0f} GB/s", flush=True)
    out_dir = Path(args.out)
    only = {s.strip() for s in args.impl.split(",") if s.strip()} or None
    bench = build_benchmark(make_cases(dtypes, ns, directions), only)
    results = H.run(bench, warmup_ms=warmup, rep_ms=rep, deadline=deadline,
                    log=lambda s: print(s, flush=True))
    name = "softmax" if LAYOUT == "contiguous" else "softmax_transposed"
    H.report(results, meta, copy_gbps, out_dir, name, plot=not args.no_plot)
    print(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
