"""Cross-entropy for language-model heads: safeops against torch eager, torch.compile and Liger-Kernel.

Shapes (issue 20): T tokens x V classes, T in {8K, 16K}, V in {32K, 128K, 256K}, bf16 (fp32 with
--dtype). Directions: "fwd" (the mean loss alone) and "fwd+bwd" (the loss and d/dlogits, as a training step
needs them). TB/s counts the bytes a fused cross-entropy must move: the logits read once, and for fwd+bwd
their gradient written once (``2 * T * V * bytes``); an implementation that reads the logits twice, or
writes an fp32 copy, moves more than it is credited for.

Implementations, each timed as the call a training step makes:

- safeops: ``safeops.cross_entropy(x, t)`` then ``torch.autograd.grad`` (forward reads each row once, the
  backward reads it again and writes the gradient);
- safeops in-place: the same with ``inplace_backward=True`` (the gradient overwrites the logits: no second
  logits-sized buffer); our variant, not a peer;
- torch eager: ``F.cross_entropy``; torch.compile: the same function compiled per shape (dynamic=False);
- Liger-Kernel: ``LigerCrossEntropyLoss`` when importable (it computes the gradient in its forward and
  writes it into the logits).

``--memory`` also prints each implementation's peak extra memory for one fwd+bwd call. Every result is
checked once per shape against torch in fp32 (loosely) before it is timed.

    python bench/cross_entropy.py [--dtype bf16|fp32] [--t 8K,16K] [--v 32K,128K,256K]
                                  [--direction fwd|fwd+bwd|both] [--quick] [--memory] [--out DIR]
                                  [--budget-s SECONDS]

Needs a CUDA GPU; without one it exits with a message.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE.parent), str(HERE)):  # the repo root (safeops) and bench/ (_harness)
    if path not in sys.path:
        sys.path.insert(0, path)

import _harness as H  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ALL_T = [2**13, 2**14]
ALL_V = [2**15, 2**17, 2**18]
DIRECTIONS = ("fwd", "fwd+bwd")
# Loose agreement with torch in fp32: |out - ref| <= rtol * |ref| + atol * max|ref| (bf16 rounds the loss and
# the gradient once; peers round their intermediates too).
TOLERANCE = {torch.bfloat16: (2**-6, 2**-8), torch.float32: (1e-4, 1e-6)}


def ce_bytes(case: H.Case) -> float:
    passes = 1 if case.direction == "fwd" else 2
    return passes * case.numel * torch.empty((), dtype=case.dtype).element_size()


def make_cases(dtypes, ts, vs, directions) -> list[H.Case]:
    return [H.Case(d, dt, (t, v)) for dt in dtypes for d in directions for t in ts for v in vs]


def make_inputs(case: H.Case) -> dict:
    t, v = case.shape
    x = torch.randn(case.shape, device="cuda", dtype=case.dtype) * 2
    target = torch.randint(0, v, (t,), device="cuda")
    target[::17] = -100  # padding
    return {"x": x, "target": target}


def reference(case: H.Case, inputs: dict):
    x = inputs["x"].float().requires_grad_(True)
    loss = F.cross_entropy(x, inputs["target"])
    if case.direction == "fwd":
        return loss.detach()
    (dx,) = torch.autograd.grad(loss, x)
    return loss.detach(), dx


def _close(out: torch.Tensor, ref: torch.Tensor, dtype) -> str | None:
    rtol, atol = TOLERANCE[dtype]
    err = (out.detach().float() - ref).abs()
    bound = ref.abs() * rtol + atol * float(ref.abs().max())
    bad = ~(err <= bound)
    if bad.any():
        return f"{int(bad.sum())} of {ref.numel()} off; max error {float(err.nan_to_num(math.inf).max()):.3e}"
    return None


def check(case: H.Case, out, ref) -> str | None:
    if case.direction == "fwd":
        return _close(out.reshape(()), ref, case.dtype)
    return _close(out[0].reshape(()), ref[0], case.dtype) or _close(out[1], ref[1], case.dtype)


# --------------------------------------------------------------------------------------------------
# Implementations: each returns the zero-argument call that is timed
# --------------------------------------------------------------------------------------------------


def _training_call(loss_fn, case: H.Case, inputs: dict, as_view: bool = False):
    """fwd: loss_fn(x, t). fwd+bwd: the loss and d/dx; ``as_view`` hands loss_fn a view of a private copy
    of the logits (a non-leaf tensor, like a linear head's output, which an in-place backward needs; the
    copy keeps the shared inputs intact for the other implementations)."""
    x, target = inputs["x"], inputs["target"]
    if case.direction == "fwd":
        return lambda: loss_fn(x, target)
    leaf = (x.detach().clone() if as_view else x.detach()).requires_grad_(True)

    def call():
        logits = leaf.view(leaf.shape) if as_view else leaf
        loss = loss_fn(logits, target)
        return loss, torch.autograd.grad(loss, logits)[0]

    return call


def build_safeops(case: H.Case, inputs: dict, inplace: bool = False):
    import safeops

    return _training_call(lambda a, t: safeops.cross_entropy(a, t, inplace_backward=inplace), case, inputs,
                          as_view=inplace)


def build_eager(case: H.Case, inputs: dict):
    return _training_call(F.cross_entropy, case, inputs)


_compiled: dict = {}


def build_compiled(case: H.Case, inputs: dict):
    key = (case.dtype, case.shape)
    if key not in _compiled:
        torch._dynamo.reset()  # one graph per shape; no recompile limit turns a shape into eager
        _compiled.clear()
        _compiled[key] = torch.compile(lambda a, t: F.cross_entropy(a, t), dynamic=False)
    return _training_call(_compiled[key], case, inputs)


def _liger_loss():
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
    except Exception as e:  # noqa: BLE001 - any import problem: the peer is unavailable
        return None, f"liger_kernel is not importable ({type(e).__name__}: {e})"
    return LigerCrossEntropyLoss(), None


def build_liger(case: H.Case, inputs: dict):
    fn, why = _liger_loss()
    if fn is None:
        raise H.Unavailable(why)
    if case.direction == "fwd":
        x, target = inputs["x"], inputs["target"]
        return lambda: fn(x, target)
    return _training_call(fn, case, inputs, as_view=True)  # Liger writes the gradient into its input


def build_benchmark(cases: list[H.Case], only: set[str] | None = None) -> H.Benchmark:
    bench = H.Benchmark(name="cross_entropy", metric=H.Metric("GB/s", ce_bytes), cases=cases,
                        make_inputs=make_inputs, reference=reference, check=check)
    both = DIRECTIONS
    bench.add("safeops", build_safeops, role="ours", directions=both)
    bench.add("safeops in-place", lambda c, t: build_safeops(c, t, inplace=True), role="variant", tag="",
              directions=("fwd+bwd",))
    bench.add("torch eager", build_eager, tag="e", directions=both)
    bench.add("torch.compile", build_compiled, tag="c", directions=both)
    bench.add("Liger-Kernel", build_liger, tag="L", unavailable=_liger_loss()[1], directions=both)
    if only:
        bench.impls = [i for i in bench.impls if i.name in only]
    return bench


def peak_memory(bench: H.Benchmark, case: H.Case, log=print) -> None:
    """Peak memory above the inputs of one fwd+bwd call, per implementation."""
    inputs = make_inputs(case)
    size = inputs["x"].numel() * inputs["x"].element_size()
    for impl in bench.impls:
        if impl.unavailable or case.direction not in impl.directions:
            continue
        try:
            call = impl.build(case, inputs)
            call()  # compile / warm up
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = call()
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base
            del out
            log(f"[memory] {case}: {impl.name:<20} +{extra / 2**30:.2f} GiB "
                f"({extra / size:.2f} x the logits)")
        except Exception as e:  # noqa: BLE001 - report and go on
            log(f"[memory] {case}: {impl.name:<20} {type(e).__name__}: {e}")
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--t", default="", help="comma list of token counts (default 8K,16K)")
    p.add_argument("--v", default="", help="comma list of vocabulary sizes (default 32K,128K,256K)")
    p.add_argument("--direction", choices=("fwd", "fwd+bwd", "both"), default="both")
    p.add_argument("--quick", action="store_true", help="T = 8K only, shorter timing")
    p.add_argument("--memory", action="store_true", help="also print each implementation's peak memory")
    p.add_argument("--impl", default="", help="comma list of implementation names to run (default: all)")
    p.add_argument("--out", default=str(HERE / "out"), help="where the csv/png/md go (default bench/out)")
    p.add_argument("--budget-s", type=float, default=0,
                   help="stop starting new shapes after this many seconds (0: no limit)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)

    H.require_cuda("bench/cross_entropy.py")
    t0 = time.time()
    dtypes = [H.DTYPES_BY_NAME[args.dtype]]
    ts = H.parse_sizes(args.t) if args.t else (ALL_T[:1] if args.quick else ALL_T)
    vs = H.parse_sizes(args.v) if args.v else ALL_V
    directions = DIRECTIONS if args.direction == "both" else (args.direction,)
    warmup, rep = (10, 40) if args.quick else (25, 100)
    meta = H.device_meta()
    copy_gbps = H.copy_bandwidth_gbps()
    print(f"{meta['gpu']} ({meta['sms']} SMs, L2 {meta['l2_mb']} MB), torch {meta['torch']}, triton "
          f"{meta['triton']}, CUDA {meta['cuda']}: device-to-device copy {copy_gbps:.0f} GB/s", flush=True)
    only = {s.strip() for s in args.impl.split(",") if s.strip()} or None
    bench = build_benchmark(make_cases(dtypes, ts, vs, directions), only)
    deadline = t0 + args.budget_s if args.budget_s > 0 else math.inf
    results = H.run(bench, warmup_ms=warmup, rep_ms=rep, deadline=deadline,
                    log=lambda s: print(s, flush=True))
    H.report(results, meta, copy_gbps, Path(args.out), "cross_entropy", plot=not args.no_plot)
    if args.memory:
        for case in bench.cases:
            if case.direction == "fwd+bwd":
                peak_memory(bench, case)
    print(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
