"""fp8 cast + transpose: the experimental kernel variants (issue 6 speed work) next to the shipped kernel.

Every variant in ``safeops.ops.cast_transpose_variants.VARIANTS`` (inline-PTX element path, TMA loads /
stores, tile sizes, register prefetch, NaN handling) is first checked bit for bit against the eager
expression

    y = (x.float() * s).clamp(-max, max).to(fp8);  y_t = y.t().contiguous().t();  amax = x.abs().max()

on all 65536 bf16 bit patterns times scales that include NaN, +-inf, 0, -7.5 and tiny ones (tensorwise and
rowwise, e4m3fn; e5m2 for the NaN-mode variants), then on every bench shape with random data salted with
NaN, +-inf, -0 and out-of-range values. A variant that differs anywhere is reported WRONG and not timed.
The rest are timed (median of CUDA events through bench/_harness.py, L2 flushed before each run) together
with the shipped ``safeops.cast_transpose`` (public API, and its launcher called directly: the same kernel
without the custom op's host path) and ``torch.compile`` of the expression, bf16 -> e4m3fn, both scalings,
at 4096x4096, 8192x8192, 16384x4096 and 3072x12288. TB/s = (read x + write y + write y_t) / time. The last
column, "wall us", is the time per call of 200 calls back to back without the L2 flush at the first shape:
well above the kernel time means that implementation is host-bound there.

    python3 bench/cast_transpose_variants.py [--out DIR] [--budget-s 170] [--quick] [--only SUBSTR]

About 2-3 minutes on an H200 (about 35 Triton compiles; ``--budget-s`` stops timing early and still
prints the table). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE.parent), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

import _harness as H  # noqa: E402
import torch  # noqa: E402

SHAPES = [(4096, 4096), (8192, 8192), (16384, 4096), (3072, 12288)]
QUICK_SHAPES = [(4096, 4096), (8192, 8192)]
FP8 = torch.float8_e4m3fn
SCALES = [1.0, 0.1, 0.3333333, 2.0**-10, 3.0e4, -7.5, 1e-30, 0.0, math.inf, -math.inf, math.nan]
TARGET_TBPS = 3.8


def eager(x, s, dtype=FP8):
    m = torch.finfo(dtype).max
    y = (x.float() * s).clamp(-m, m).to(dtype)
    return y, y.t().contiguous().t(), x.abs().max().float()


def mismatch(out, ref) -> str | None:
    """None when y, y_t (bits, layout) and amax (NaN-aware) equal eager's."""
    y, y_t, amax = out
    ry, _, ramax = ref
    if y_t.stride() != (1, max(y.shape[0], 1)):
        return f"y_t strides {y_t.stride()}"
    for name, t in (("y", y), ("y_t", y_t)):
        diff = t.view(torch.uint8) != ry.view(torch.uint8)
        if diff.any():
            i, j = diff.nonzero()[0].tolist()
            return (f"{name}: {int(diff.sum())} codes differ, first at ({i}, {j}): "
                    f"got {int(t.view(torch.uint8)[i, j]):#04x} eager {int(ry.view(torch.uint8)[i, j]):#04x}")
    if bool(torch.isnan(ramax)) != bool(torch.isnan(amax)) or (
            not torch.isnan(ramax) and not torch.equal(amax, ramax)):
        return f"amax {amax.item()} != {ramax.item()}"
    return None


def salted(m, k):
    x = torch.randn(m, k, device="cuda") * 300.0
    flat = x.view(-1)
    for v in (math.nan, -math.nan, math.inf, -math.inf, -0.0, 1e-6, 449.0, 464.0, 1e5):
        flat[torch.randint(0, flat.numel(), (4,), device="cuda")] = v
    return x.to(torch.bfloat16)


def scale_for(scaling, m):
    if scaling == "rowwise":
        return torch.exp2(torch.rand(m, 1, device="cuda") * 4 - 2)
    return torch.tensor(0.731, device="cuda")


def exact_on_patterns(run, rowwise: bool, fp8) -> str | None:
    """Every bf16 bit pattern x every scale (tensorwise: one launch per scale; rowwise: scales per row)."""
    x = torch.arange(-2**15, 2**15, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.bfloat16)
    x = x.reshape(256, 256)
    if rowwise:
        s = torch.tensor((SCALES * 24)[:256], dtype=torch.float32, device="cuda").reshape(256, 1)
        scales = [s, s.flip(0)]
    else:
        scales = [torch.tensor(v, dtype=torch.float32, device="cuda") for v in SCALES]
    for s in scales:
        bad = mismatch(run(x, s, fp8), eager(x, s, fp8))
        if bad:
            return f"all-bf16-patterns {fp8} rowwise={rowwise}: {bad}"
    return None


def needs_e5m2(name: str) -> bool:
    """e5m2 is checked too for the NaN-mode variants and the base inline-PTX one (not timed)."""
    return "nan" in name or name == "asm 128x64w4"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="directory for cast_transpose_variants.csv")
    ap.add_argument("--budget-s", type=float, default=170.0, help="stop timing after this many seconds")
    ap.add_argument("--quick", action="store_true", help="two shapes only")
    ap.add_argument("--only", default="", help="comma-separated substrings of variant names to keep")
    ap.add_argument("--warmup-ms", type=float, default=10.0)
    ap.add_argument("--rep-ms", type=float, default=40.0)
    ap.add_argument("--jobs", type=int, default=1,
                    help="threads compiling the variants up front (default 1: none; the bit-exactness pass "
                    "compiles them)")
    args = ap.parse_args()
    H.require_cuda("bench/cast_transpose_variants.py")
    t_start = time.time()
    deadline = t_start + args.budget_s

    import safeops
    from safeops.ops import cast_transpose_variants as CV

    variants = [v for v in CV.VARIANTS if not args.only or any(s in v.name for s in args.only.split(","))]
    shapes = QUICK_SHAPES if args.quick else SHAPES
    copy = H.copy_bandwidth_gbps(2**30, 10, 60)
    print(f"copy {copy / 1000:.2f} TB/s; {len(variants)} variants; shapes {shapes}", flush=True)

    def shipped(x, s, fp8):
        return safeops.cast_transpose(x, s, fp8, rowwise=s.dim() == 2)

    def variant_fn(v):
        return lambda x, s, fp8: CV.cast_transpose(x, s, fp8, s.dim() == 2, v)

    def shipped_launcher(x, s, fp8):  # the same kernel without the public API's host path (custom op)
        from safeops.ops import cast_transpose_launch

        return cast_transpose_launch.cast_transpose(x, s, fp8, s.dim() == 2)

    impls = [("shipped", shipped), ("shipped (launcher)", shipped_launcher)]
    impls += [(v.name, variant_fn(v)) for v in variants]
    # 0. compile every variant's kernels from several threads first (ptxas runs in parallel); any problem
    #    here is ignored: the check below compiles (and reports) it again
    if args.jobs > 1:
        from concurrent.futures import ThreadPoolExecutor

        t0 = time.time()
        xp = torch.zeros(256, 256, dtype=torch.bfloat16, device="cuda")
        rows = torch.ones(256, 1, device="cuda")
        jobs = [(v, rw, fp8) for v in variants for rw in (False, True)
                for fp8 in ((FP8, torch.float8_e5m2) if needs_e5m2(v.name) else (FP8,))]

        def compile_one(job):
            v, rw, fp8 = job
            try:
                CV.warmup(xp, rows if rw else rows[0, 0], fp8, rw, v)
            except Exception:
                pass

        with ThreadPoolExecutor(args.jobs) as ex:
            list(ex.map(compile_one, jobs))
        print(f"[compile] {len(jobs)} kernels in {time.time() - t0:.1f} s", flush=True)
    # 1. exactness on every bf16 pattern (cheap; also compiles each kernel once per scaling)
    wrong: dict[str, str] = {}
    for name, fn in impls:
        t0 = time.time()
        try:
            for rowwise in (False, True):
                for fp8 in ((FP8, torch.float8_e5m2) if needs_e5m2(name) else (FP8,)):
                    bad = exact_on_patterns(fn, rowwise, fp8)
                    if bad:
                        raise AssertionError(bad)
        except Exception as e:  # compile error or mismatch: never timed
            wrong[name] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"[patterns] {name:<34} {'ok' if name not in wrong else 'WRONG ' + wrong[name]} "
              f"({time.time() - t0:.1f} s)", flush=True)

    compiled: dict = {}

    def compiled_fn(scaling, shape):
        key = (scaling, shape)
        if key not in compiled:
            compiled.clear()
            import torch._dynamo

            torch._dynamo.reset()

            def expr(x, s):
                y = (x.float() * s).clamp(-448.0, 448.0).to(FP8)
                return y, y.t().contiguous().t()

            compiled[key] = torch.compile(expr, dynamic=False, fullgraph=True)
        return compiled[key]

    rows = []  # (impl, scaling, shape, status, ms, tbps, note)
    walls: dict[str, float] = {}  # impl -> wall us per call, back to back, first shape, tensorwise
    for scaling in ("tensorwise", "rowwise"):
        for shape in shapes:
            m, k = shape
            nbytes = m * k * 4
            x = salted(m, k)
            s = scale_for(scaling, m)
            ref = eager(x, s)
            xc = x.nan_to_num(0.0, 3e4, -3e4)  # amax of a NaN-free input must be exact too
            refc = eager(xc, s)
            case = []
            for name, fn in impls:
                if name in wrong:
                    case.append((name, "WRONG", math.nan, wrong[name]))
                    continue
                if time.time() > deadline:
                    case.append((name, "skipped", math.nan, "time budget"))
                    continue
                try:
                    bad = mismatch(fn(x, s, FP8), ref) or mismatch(fn(xc, s, FP8), refc)
                    if bad:
                        wrong[name] = f"{scaling} {shape}: {bad}"
                        case.append((name, "WRONG", math.nan, wrong[name]))
                        continue
                    ms = H.bench_ms(lambda fn=fn, xc=xc, s=s: fn(xc, s, FP8), args.warmup_ms, args.rep_ms)[0]
                    case.append((name, "ok", ms, ""))
                except Exception as e:
                    case.append((name, "error", math.nan, f"{type(e).__name__}: {str(e)[:200]}"))
            if time.time() <= deadline:
                try:
                    cfn = compiled_fn(scaling, shape)
                    out = cfn(xc, s)
                    bad = mismatch((*out, refc[2]), refc)
                    ms = H.bench_ms(lambda cfn=cfn, xc=xc, s=s: cfn(xc, s), args.warmup_ms, args.rep_ms)[0]
                    case.append(("torch.compile", "ok" if not bad else "WRONG", ms, bad or ""))
                except Exception as e:
                    case.append(("torch.compile", "error", math.nan, f"{type(e).__name__}: {str(e)[:200]}"))
            if scaling == "tensorwise" and shape == shapes[0]:
                # Wall time per call without the L2 flush, 200 calls back to back: above the kernel time
                # means the host (launch path) is the limit at this size.
                for name, fn in impls:
                    if name in wrong or time.time() > deadline:
                        continue
                    try:
                        for _ in range(20):
                            fn(xc, s, FP8)
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for _ in range(200):
                            fn(xc, s, FP8)
                        torch.cuda.synchronize()
                        walls[name] = (time.perf_counter() - t0) / 200 * 1e6
                    except Exception:
                        pass
            for name, status, ms, note in case:
                tbps = nbytes / (ms * 1e-3) / 1e12 if status == "ok" else math.nan
                rows.append((name, scaling, shape, status, ms, tbps, note))
                shown = f"{tbps:5.2f} TB/s {ms * 1000:8.1f} us" if status == "ok" else status
                print(f"[{scaling} {m}x{k}] {name:<34} {shown} {note}", flush=True)
            del x, xc, s, ref, refc
            torch.cuda.empty_cache()

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "cast_transpose_variants.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["impl", "scaling", "shape", "status", "ms", "tbps", "copy_tbps", "note"])
            for name, scaling, shape, status, ms, tbps, note in rows:
                w.writerow([name, scaling, f"{shape[0]}x{shape[1]}", status, f"{ms:.6f}", f"{tbps:.3f}",
                            f"{copy / 1000:.3f}", note])
    # the table: one row per implementation, one column per (scaling, shape)
    cols = [(sc, sh) for sc in ("tensorwise", "rowwise") for sh in shapes]
    by = {(r[0], r[1], r[2]): r for r in rows}
    names = list(dict.fromkeys(r[0] for r in rows))
    print(f"\nTB/s, bf16 -> e4m3fn (copy {copy / 1000:.2f} TB/s, target {TARGET_TBPS}); t = tensorwise, "
          "r = rowwise; WRONG = not bit-exact (not timed); wall us = per call back to back without the L2 "
          f"flush at {shapes[0][0]}x{shapes[0][1]} tensorwise (above the kernel time: host-bound)")
    head = " ".join(f"{sc[0]} {sh[0] // 1024}kx{sh[1] // 1024}k".rjust(10) for sc, sh in cols)
    print(f"{'impl':<34} {head} {'min':>6} {'wall us':>8}")
    for name in names:
        cells, vals = [], []
        for sc, sh in cols:
            r = by.get((name, sc, sh))
            if r is None:
                cells.append("-".rjust(10))
            elif r[3] == "ok":
                cells.append(f"{r[5]:10.2f}")
                vals.append(r[5])
            else:
                cells.append(r[3][:10].rjust(10))
        low = f"{min(vals):6.2f}" if vals and len(vals) == len(cols) else "-".rjust(6)
        wall = f"{walls[name]:8.1f}" if name in walls else "-".rjust(8)
        print(f"{name:<34} {' '.join(cells)} {low} {wall}")
    for name, why in wrong.items():
        print(f"WRONG {name}: {why}")
    print(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
