"""fp8 cast + transpose bandwidth: safeops.cast_transpose against torch eager and torch.compile (issue 6).

The expression every implementation computes (bf16 x of shape (M, K) to float8_e4m3fn):

    y   = (x.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn)
    y_t = y.t().contiguous().t()                   # same values, column-major: strides (1, M)

with ``s`` one fp32 scale ("tensorwise") or an (M, 1) fp32 tensor of per-row scales ("rowwise"). Effective
bandwidth counts the bytes the op must move once each: read x (2 bytes) + write y (1) + write y_t (1) per
element; the scale is negligible. The "% of copy" column divides by a device-to-device copy measured in the
same process. Target (issue 6): >= 3.8 TB/s (~90% of copy) at every shape.

Implementations:

- safeops: ``safeops.cast_transpose`` (also computes amax = x.abs().max() in the same pass, for free);
- safeops, integer rounding: the same kernel with the integer round-to-nearest-even instead of the hardware
  ``cvt.rn.satfinite`` (a variant of ours, bit-identical);
- torch.compile + safeops.register(): the hand-written expression compiled while safeops is registered
  (the pre-grad rewrite turns it into the safeops op; a variant of ours, showing compiled code gets it);
- torch eager: the expression above, op by op;
- torch.compile: the same expression compiled by stock Inductor (dynamic=False, one compile per shape);
- copy of x (same bytes): ``x.clone()`` moves what the op must move (read 2 bytes, write 2 per element) at
  the same shape: the per-shape bound (small shapes do not reach the large-copy bandwidth); not a peer;
- transposing copy (same bytes): ``x.t().contiguous()``, torch's copy into the transposed layout;
- same pattern without arithmetic: ``bench/_transpose_bound.py``, a Triton kernel that reads x once and writes
  its high bytes row-major and column-major, i.e. the op's reads and writes with none of its arithmetic,
  at the fastest of its tiles for the shape (checked byte for byte, tile printed): what the access pattern
  allows.

Every output (y and y_t) is checked bit for bit against eager once per shape before it is timed.

    python3 bench/cast_transpose.py --out DIR [--budget-s S] [--quick] [--shapes 4096x4096,8192x8192]
                                    [--scaling tensorwise|rowwise|both] [--host]

After the tables, the host (CPU) time per back-to-back call of ``safeops.cast_transpose``, of the registered
op and of the launcher is printed per case next to the kernel's time; ``--host`` prints only that (a few
seconds).

Needs a CUDA GPU; without one it exits with a message. Writes cast_transpose.{csv,md,png} under --out.
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

SHAPES = [(4096, 4096), (8192, 8192), (16384, 4096), (3072, 12288)]
QUICK_SHAPES = [(4096, 4096), (8192, 8192)]
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def cast_bytes(case: H.Case) -> float:
    return case.numel * (torch.empty((), dtype=case.dtype).element_size() + 1 + 1)


def make_cases(shapes, scalings, dtype=torch.bfloat16) -> list[H.Case]:
    return [H.Case(sc, dtype, shape) for sc in scalings for shape in shapes]


def make_inputs(case: H.Case) -> dict:
    m, k = case.shape
    x = torch.randn(case.shape, device="cuda", dtype=torch.float32).mul_(300.0).to(case.dtype)
    if case.direction == "rowwise":
        s = torch.exp2(torch.rand(m, 1, device="cuda") * 4 - 2)
    else:
        s = torch.tensor(0.731, device="cuda")
    return {"x": x, "s": s}


def expression(x, s):
    y = (x.float() * s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return y, y.t().contiguous().t()


def reference(case: H.Case, t: dict):
    return expression(t["x"], t["s"])


_COPY_BOUND = object()  # marks the same-bytes copy's output (nothing to check against eager)


def check(case: H.Case, out, ref) -> str | None:
    if out[0] is _COPY_BOUND:
        return None
    y, y_t = out[0], out[1]
    if y.shape != ref[0].shape or y_t.shape != ref[1].shape:
        return f"shapes {tuple(y.shape)}, {tuple(y_t.shape)}"
    if y_t.stride() != ref[1].stride():
        return f"y_t strides {y_t.stride()} != {ref[1].stride()}"
    for name, a, b in (("y", y, ref[0]), ("y_t", y_t, ref[1])):
        diff = a.view(torch.uint8) != b.view(torch.uint8)
        if diff.any():
            return f"{name}: {int(diff.sum())} of {a.numel()} codes differ from eager"
    return None


# --------------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------------


def build_safeops(case: H.Case, t: dict, hardware_convert: bool | None = None):
    import safeops
    from safeops.ops import cast_transpose_launch as launch

    x, s, rowwise = t["x"], t["s"], case.direction == "rowwise"
    if hardware_convert is None:
        return lambda: safeops.cast_transpose(x, s, FP8, rowwise=rowwise)
    return lambda: launch.cast_transpose(x, s, FP8, rowwise, hardware_convert=hardware_convert)


def build_copy_bound(case: H.Case, t: dict):
    x = t["x"]
    if x.element_size() != 2:
        raise H.Refused("the same-bytes copy needs a 2-byte input (bf16 / fp16)")
    return lambda: (_COPY_BOUND, x.clone())


def build_transpose_copy(case: H.Case, t: dict):
    x = t["x"]
    if x.element_size() != 2:
        raise H.Refused("the same-bytes copy needs a 2-byte input (bf16 / fp16)")
    return lambda: (_COPY_BOUND, x.t().contiguous())


_pattern_tiles: dict = {}


def build_pattern_bound(case: H.Case, t: dict):
    import _transpose_bound as TB

    x = t["x"]
    if x.element_size() != 2:
        raise H.Refused("the pattern bound reads 2-byte elements (bf16 / fp16)")
    m, k = x.shape
    if (m, k) not in _pattern_tiles:
        tile, ms = TB.best_pattern(x, lambda fn: H.bench_ms(fn, 10, 40)[0])
        _pattern_tiles[(m, k)] = tile
        print(f"[cast_transpose] {m}x{k}: pattern bound's fastest tile (BLOCK_M, BLOCK_K, warps, m_fast) "
              f"{tile}: {ms * 1e3:.1f} us", flush=True)
    tile = _pattern_tiles[(m, k)]
    y = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    y_t = torch.empty(k, m, dtype=torch.uint8, device=x.device)
    return lambda: (_COPY_BOUND, TB.launch(x, y, y_t, tile))


def build_eager(case: H.Case, t: dict):
    x, s = t["x"], t["s"]
    return lambda: expression(x, s)


_compiled: dict = {}


def build_compiled(case: H.Case, t: dict, registered: bool = False):
    import safeops

    key = (registered, case.direction, case.dtype, case.shape)
    if key not in _compiled:
        # One compilation per shape and variant (dynamic=False); drop earlier graphs so that no recompile
        # limit turns a later shape into a silent eager fallback.
        torch._dynamo.reset()
        _compiled.clear()

        def fn(x, s):  # a fresh function object per compile
            return expression(x, s)

        compiled = torch.compile(fn, dynamic=False, fullgraph=True)
        if registered:
            with safeops.registered():
                compiled(t["x"], t["s"])  # compiles now, with the rewrite in force
        else:
            compiled(t["x"], t["s"])
        _compiled[key] = compiled
    fn = _compiled[key]
    x, s = t["x"], t["s"]
    return lambda: fn(x, s)


DIRECTIONS = ("tensorwise", "rowwise")


def build_benchmark(cases: list[H.Case], only: set[str] | None = None) -> H.Benchmark:
    bench = H.Benchmark(name="cast_transpose", metric=H.Metric("GB/s", cast_bytes), cases=cases,
                        make_inputs=make_inputs, reference=reference, check=check)
    bench.add("safeops", build_safeops, role="ours", directions=DIRECTIONS)
    bench.add("safeops int-rne", lambda c, t: build_safeops(c, t, hardware_convert=False), role="variant",
              directions=DIRECTIONS)
    bench.add("compile+safeops.register", lambda c, t: build_compiled(c, t, registered=True), role="variant",
              directions=DIRECTIONS)
    bench.add("torch eager", build_eager, tag="e", directions=DIRECTIONS)
    bench.add("torch.compile", build_compiled, tag="c", directions=DIRECTIONS)
    bench.add("copy of x (same bytes)", build_copy_bound, role="variant", directions=DIRECTIONS)
    bench.add("transposing copy (same bytes)", build_transpose_copy, role="variant", directions=DIRECTIONS)
    bench.add("same pattern without arithmetic", build_pattern_bound, role="variant", directions=DIRECTIONS)
    if only:
        bench.impls = [i for i in bench.impls if i.name in only]
    return bench


# --------------------------------------------------------------------------------------------------
# Host time per call
# --------------------------------------------------------------------------------------------------


def host_us(fn, calls: int = 200) -> float:
    """CPU time per call of back-to-back launches (no synchronisation inside): when this is above the
    kernel's GPU time, a stream of calls is launch-bound and do_bench's time includes host gaps."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def host_report(cases: list[H.Case], results: list | None = None, log=print) -> None:
    """Per case: CPU time per back-to-back call of the public function, of the registered op, of the launcher
    alone and of the compiled expression (under safeops.register() and stock), next to the kernel time the
    main table measured (do_bench; when the host time is above it, back-to-back calls are host-bound and
    the table's GB/s understates the kernel)."""
    from safeops.ops import cast_transpose_launch as launch

    kernel_us = {str(r.case): r.ms * 1e3 for r in results or [] if r.impl == "safeops" and r.status == "ok"}
    op = torch.ops.safeops.cast_transpose.default
    log("host time per call (CPU time of 200 back-to-back calls, no sync inside; best of 3), us:")
    for case in cases:
        t = make_inputs(case)
        x, s, rowwise = t["x"], t["s"], case.direction == "rowwise"
        public = min(host_us(build_safeops(case, t)) for _ in range(3))
        via_op = min(host_us(lambda a=(x, s, FP8, rowwise): op(*a)) for _ in range(3))
        launcher = min(host_us(lambda a=(x, s, FP8, rowwise): launch.cast_transpose(*a)) for _ in range(3))
        registered = min(host_us(build_compiled(case, t, registered=True)) for _ in range(3))
        stock = min(host_us(build_compiled(case, t)) for _ in range(3))
        k = kernel_us.get(str(case), math.nan)
        verdict = "" if math.isnan(k) else ("  host-bound" if public > k else "  GPU-bound")
        log(f"  {str(case):32s} safeops.cast_transpose {public:6.1f}  op {via_op:6.1f}  launcher "
            f"{launcher:6.1f}  compiled: registered {registered:6.1f} stock {stock:6.1f}  kernel {k:6.1f}"
            f"{verdict}")
        del t
        H._free()


# --------------------------------------------------------------------------------------------------


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        if part.strip():
            m, k = part.lower().split("x")
            shapes.append((H.parse_sizes(m)[0], H.parse_sizes(k)[0]))
    return shapes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="", help="comma list MxK, e.g. 4096x4096,8192x8192 (default: all 4)")
    p.add_argument("--scaling", choices=("tensorwise", "rowwise", "both"), default="both")
    p.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, shorter timing")
    p.add_argument("--impl", default="", help="comma list of implementation names to run (default: all)")
    p.add_argument("--out", default=str(HERE / "out"), help="directory for cast_transpose.csv/.png/.md")
    p.add_argument("--warmup", type=float, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=100, help="do_bench repetitions, ms")
    p.add_argument("--budget-s", type=float, default=0,
                   help="stop starting new shapes after this many seconds (0: no limit)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--host", action="store_true",
                   help="only the host time per call of safeops.cast_transpose (seconds, not minutes)")
    args = p.parse_args(argv)

    H.require_cuda("bench/cast_transpose.py")
    import safeops  # noqa: F401

    t0 = time.time()
    deadline = t0 + args.budget_s if args.budget_s > 0 else math.inf
    shapes = parse_shapes(args.shapes) if args.shapes else (QUICK_SHAPES if args.quick else SHAPES)
    scalings = DIRECTIONS if args.scaling == "both" else (args.scaling,)
    warmup, rep = (10, 40) if args.quick else (args.warmup, args.rep)
    meta = H.device_meta()
    copy_gbps = H.copy_bandwidth_gbps()
    print(f"{meta['gpu']} ({meta['sms']} SMs, L2 {meta['l2_mb']} MB), torch {meta['torch']}, triton "
          f"{meta['triton']}, CUDA {meta['cuda']}: device-to-device copy {copy_gbps:.0f} GB/s", flush=True)
    out_dir = Path(args.out)
    cases = make_cases(shapes, scalings)
    if args.host:
        host_report(cases)
        return 0
    only = {s.strip() for s in args.impl.split(",") if s.strip()} or None
    bench = build_benchmark(cases, only)
    results = H.run(bench, warmup_ms=warmup, rep_ms=rep, deadline=deadline,
                    log=lambda s: print(s, flush=True))
    H.report(results, meta, copy_gbps, out_dir, "cast_transpose", plot=not args.no_plot)
    if only is None or "safeops" in only:
        host_report(cases, results, log=lambda s: print(s, flush=True))
    print("note: columns are labelled by K; M per column is in the header of each table "
          "(4K = 4096x4096 and 16384x4096).")
    print(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
