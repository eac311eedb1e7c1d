"""Softmax forward and backward bandwidth: safeops against torch eager, torch.compile and Liger-Kernel.

Shapes (issue 2): M * N = 2**28 elements, N in {256, 1K, 4K, 16K, 64K, 256K, 1M, 4M} (so M = 64 at 4M),
bf16 and fp32. GB/s counts the bytes a softmax must move: forward reads x and writes y (2 * numel * bytes),
backward reads two tensors and writes dx (3 * numel * bytes). What each backward timing measures:

- safeops: ``torch.ops.safeops.softmax_backward`` alone, from x, the upstream gradient and the saved fp32
  row max and row sum (it recomputes p from x; reads x and dy, writes dx: the same 3 tensors as the peers);
- safeops, fp fusion on: the same kernels compiled with fp contraction on (``safeops._config.fp_fusion``),
  to show that the safe setting costs nothing; it is our variant, not a peer;
- torch eager: ``torch._softmax_backward_data(dy, y, dim, dtype)``, the kernel autograd runs for softmax;
- torch.compile: ``torch.compile`` of that same call, compiled per shape (dynamic=False): the backward
  kernel Inductor generates for ``torch.compile(torch.softmax)`` (its decomposition of this aten op);
- Liger-Kernel: its backward kernel launcher (``_softmax_backward(dy, y, ...)``) when the installed
  version exposes it, else ``torch.autograd.grad`` through ``LigerSoftmaxFunction`` (its backward plus
  autograd's small overhead). Liger refuses rows longer than 65,536 columns: reported as "refused".

Every output is checked once per shape against torch in fp32 (loosely) before it is timed.

    python bench/softmax.py [--dtype bf16|fp32|both] [--n 256,4K,1M] [--direction fwd|bwd|both] [--quick]
                            [--out DIR] [--sweep] [--budget-s SECONDS]

``--sweep`` tunes safeops alone, on the same shapes: for each N, coordinate descent over the knobs of
``safeops.ops.softmax_launch`` that exist in the installed version: which path a row takes
(ROW_RESIDENT_MAX_COLS), rows_config's block_m and num_warps per direction (by monkeypatching rows_config),
SPLIT_BLOCK_N, SPLIT_NUM_WARPS, SPLIT_COLS_PER_PROGRAM, SPLIT_MAX_PROGRAMS_PER_ROW, SPLIT_MAXNREG and
``safeops._config.one_launch_long_rows``. Every configuration is checked against torch, timed forward and
backward, printed, and written to softmax_sweep.csv; the summary names the best per N. A full sweep of
both dtypes and all eight N takes longer than one 10-minute call: pick --dtype and --n.

Needs a CUDA GPU; without one it exits with a message.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
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


def make_inputs(case: H.Case) -> dict:
    x = torch.randn(case.shape, device="cuda", dtype=case.dtype)
    if case.direction == "fwd":
        return {"x": x}
    dy = torch.randn(case.shape, device="cuda", dtype=case.dtype)
    return {"x": x, "dy": dy, "y": torch.softmax(x, DIM)}


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


@contextlib.contextmanager
def fp_fusion(on: bool):
    from safeops import _config

    old = _config.fp_fusion
    _config.fp_fusion = on
    try:
        yield
    finally:
        _config.fp_fusion = old


def _softmax_kind() -> int:
    from safeops import reference as ref

    return getattr(ref, "SOFTMAX", 0)


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
        with fp_fusion(True):
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
    bench.add("torch eager", build_eager, tag="e")
    bench.add("torch.compile", build_compiled, tag="c")
    _, why = _liger_module()
    bench.add("Liger-Kernel", build_liger, tag="L", unavailable=why)
    if only:
        bench.impls = [i for i in bench.impls if i.name in only]
    return bench


# --------------------------------------------------------------------------------------------------
# --sweep: tune safeops' launcher knobs per N
# --------------------------------------------------------------------------------------------------

SPLIT_KNOBS = {  # knob -> candidate values; only knobs the installed launcher has are tried
    "SPLIT_BLOCK_N": (1024, 2048, 4096, 8192, 16384),
    "SPLIT_NUM_WARPS": (4, 8, 16),
    "SPLIT_COLS_PER_PROGRAM": (8192, 16384, 32768, 65536, 131072),
    "SPLIT_MAX_PROGRAMS_PER_ROW": (64, 128, 256, 512, 1024),
    "SPLIT_MAXNREG": (None, 128, 168, 255),
}
RESIDENT_KNOB = "ROW_RESIDENT_MAX_COLS"


@contextlib.contextmanager
def launch_config(cfg: dict, n: int, elem: int):
    """Apply a sweep configuration to safeops.ops.softmax_launch (and _config), then restore it.

    cfg keys: "path" ("rows" | "split"), "block_m" / "num_warps" (rows_config), split knob names, and
    "one_launch" (safeops._config.one_launch_long_rows). Dict-valued knobs are per element size.
    """
    from safeops import _config
    from safeops.ops import softmax_launch as L

    saved: list = []

    def set_attr(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def set_knob(name, value):
        cur = getattr(L, name)
        if isinstance(cur, dict):
            cur = dict(cur)
            cur[elem] = value
            set_attr(L, name, cur)
        else:
            set_attr(L, name, value)

    try:
        for knob in (RESIDENT_KNOB, RESIDENT_KNOB + "_FWD"):  # the second: the forward's own limit
            if "path" in cfg and hasattr(L, knob):
                limits = getattr(L, knob)
                cur = limits.get(elem, 8192) if isinstance(limits, dict) else limits
                set_knob(knob, max(cur, n) if cfg["path"] == "rows" else min(cur, n - 1))
        for name in SPLIT_KNOBS:
            if name in cfg:
                set_knob(name, cfg[name])
        if "one_launch" in cfg and hasattr(_config, "one_launch_long_rows"):
            set_attr(_config, "one_launch_long_rows", cfg["one_launch"])
        # rows_config overrides per direction: fwd_block_m, fwd_num_warps, bwd_block_m, bwd_num_warps. A
        # launcher whose rows_config has no `backward` argument shares one config: fwd_* then applies to both.
        over = {d: {k[4:]: v for k, v in cfg.items() if k.startswith(d + "_")} for d in ("fwd", "bwd")}
        if over["fwd"] or over["bwd"]:
            orig = L.rows_config
            has_direction = "backward" in inspect.signature(orig).parameters

            def rows_config(*args, **kwargs):
                c = orig(*args, **kwargs)
                backward = kwargs.get("backward", args[3] if len(args) > 3 else False)
                chosen = over["bwd"] if backward and has_direction else over["fwd"]
                return None if c is None or not chosen else dataclasses.replace(c, **chosen)

            set_attr(L, "rows_config", rows_config)
        if "split_num_warps" in cfg:  # launchers without a SPLIT_NUM_WARPS knob
            orig_split = L.split_config

            def split_config(*args, **kwargs):
                return dataclasses.replace(orig_split(*args, **kwargs), num_warps=cfg["split_num_warps"])

            set_attr(L, "split_config", split_config)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _label(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items()) or "default"


class ShapeSweep:
    """Every configuration tried for one (dtype, N): fwd and bwd timed, both checked against torch."""

    WARMUP_MS, REP_MS = 5, 30

    def __init__(self, dtype: torch.dtype, n: int, deadline: float):
        self.dtype, self.n, self.deadline = dtype, n, deadline
        self.elem = torch.empty((), dtype=dtype).element_size()
        m = max(1, TOTAL // n)
        self.fcase, self.bcase = H.Case("fwd", dtype, (m, n)), H.Case("bwd", dtype, (m, n))
        self.inputs = make_inputs(self.bcase)
        self.ref_f, self.ref_b = reference(self.fcase, self.inputs), reference(self.bcase, self.inputs)
        self.tried: dict[str, tuple[float, float, str]] = {}
        self.rows: list[list] = []

    def gbps(self, res) -> tuple[float, float]:
        return (softmax_bytes(self.fcase) / (res[0] * 1e-3) / 1e9,
                softmax_bytes(self.bcase) / (res[1] * 1e-3) / 1e9)

    def evaluate(self, cfg: dict):
        key = _label(cfg)
        if key in self.tried:
            return self.tried[key]
        if time.time() > self.deadline:
            return None
        try:
            with launch_config(cfg, self.n, self.elem):
                f, b = build_safeops(self.fcase, self.inputs), build_safeops(self.bcase, self.inputs)
                bad = check(self.fcase, f(), self.ref_f) or check(self.bcase, b(), self.ref_b)
                fm = H.bench_ms(f, self.WARMUP_MS, self.REP_MS)[0]
                bm = H.bench_ms(b, self.WARMUP_MS, self.REP_MS)[0]
            res = (fm, bm, bad or "")
        except Exception as e:
            res = (math.inf, math.inf, H._short(e))
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        self.tried[key] = res
        fg, bg = self.gbps(res)
        name = H.DTYPE_NAMES[self.dtype]
        print(f"  {name} N={H.size_label(self.n):>5} {key:<64} fwd {fg:7.0f} bwd {bg:7.0f} GB/s"
              + (f"  [{res[2]}]" if res[2] else ""), flush=True)
        self.rows.append([name, self.n, self.fcase.m, key, f"{res[0]:.5f}", f"{res[1]:.5f}", f"{fg:.1f}",
                          f"{bg:.1f}", res[2]])
        return res

    @staticmethod
    def cost(res, objective: str) -> float:
        if res is None or res[2]:
            return math.inf
        return {"fwd": res[0], "bwd": res[1], "total": res[0] + res[1]}[objective]

    def descend(self, start: dict, space: list[tuple[str, tuple]], objective: str) -> dict:
        """Coordinate descent: one knob at a time, keeping the value with the least fwd, bwd or total time
        (a value that is a dict sets several knobs at once)."""
        best, best_t = dict(start), self.cost(self.evaluate(start), objective)
        for knob, values in space:
            for v in values:
                cand = {**best, **v} if isinstance(v, dict) else {**best, knob: v}
                t = self.cost(self.evaluate(cand), objective)
                if t < best_t:
                    best, best_t = cand, t
        return best

    def run(self) -> str:
        from safeops import _config
        from safeops.ops import softmax_launch as L

        n = self.n
        default = self.evaluate({})
        if n <= 65536:  # whole rows held by one program: block_m (warps scaled to the tile), then warps
            block_n = 1 << max(0, (n - 1).bit_length())
            warps = tuple(w for w in (1, 2, 4, 8, 16, 32) if 32 * w <= max(32, block_n * 32))
            for d in ("fwd", "bwd"):  # one config per direction (the launcher keys them apart)
                tiles = tuple({f"{d}_block_m": bm, f"{d}_num_warps": max(1, min(32, bm * block_n // 512))}
                              for bm in (1, 2, 4, 8, 16, 32, 64) if bm * block_n <= 32768)
                self.descend({"path": "rows"}, [("block_m", tiles), (f"{d}_num_warps", warps)], d)
        if n > 4096:  # a row split across programs; fwd and bwd share these knobs
            space = [(k, tuple(v for v in vals if k != "SPLIT_BLOCK_N" or v <= max(1024, n)))
                     for k, vals in SPLIT_KNOBS.items() if hasattr(L, k)]
            if not hasattr(L, "SPLIT_NUM_WARPS"):
                space.append(("split_num_warps", (4, 8, 16)))
            if hasattr(_config, "one_launch_long_rows"):
                space.append(("one_launch", (True, False)))
            self.descend({"path": "split"}, space, "total")

        line = f"{H.DTYPE_NAMES[self.dtype]} N={H.size_label(n)}: "
        if default and not default[2]:
            fg, bg = self.gbps(default)
            line += f"default fwd {fg:.0f} bwd {bg:.0f} GB/s; "
        ok = {k: v for k, v in self.tried.items() if v and not v[2]}
        if ok:
            bt = min(ok, key=lambda k: ok[k][0] + ok[k][1])
            bf = min(ok, key=lambda k: ok[k][0])
            bb = min(ok, key=lambda k: ok[k][1])
            line += (f"best fwd+bwd [{bt}] fwd {self.gbps(ok[bt])[0]:.0f} bwd {self.gbps(ok[bt])[1]:.0f}; "
                     f"best fwd [{bf}] {self.gbps(ok[bf])[0]:.0f}; "
                     f"best bwd [{bb}] {self.gbps(ok[bb])[1]:.0f} GB/s")
        return line


def sweep(dtypes, ns, out_dir: Path, deadline: float, copy_gbps: float) -> None:
    import csv

    rows, summary = [], []
    for dtype in dtypes:
        for n in ns:
            if time.time() > deadline:
                summary.append(f"{H.DTYPE_NAMES[dtype]} N={H.size_label(n)}: not swept (time budget used up)")
                continue
            shape = ShapeSweep(dtype, n, deadline)
            summary.append(shape.run())
            rows += shape.rows
            del shape
            H._free()
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "softmax_sweep.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["dtype", "n", "m", "config", "fwd_ms", "bwd_ms", "fwd_gbps", "bwd_gbps", "problem"])
        w.writerows(rows)
    print(f"\nsweep summary (copy {copy_gbps:.0f} GB/s; config keys are softmax_launch knobs, rows_config "
          "fields, path=rows|split and one_launch):")
    for line in summary:
        print("  " + line)
    print(f"wrote {out_dir / 'softmax_sweep.csv'}")


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
    p.add_argument("--sweep", action="store_true", help="tune safeops' launcher knobs per N instead")
    args = p.parse_args(argv)

    H.require_cuda("bench/softmax.py")
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
    if args.sweep:
        sweep(dtypes, ns, out_dir, deadline, copy_gbps)
        return 0
    only = {s.strip() for s in args.impl.split(",") if s.strip()} or None
    bench = build_benchmark(make_cases(dtypes, ns, directions), only)
    results = H.run(bench, warmup_ms=warmup, rep_ms=rep, deadline=deadline,
                    log=lambda s: print(s, flush=True))
    H.report(results, meta, copy_gbps, out_dir, "softmax", plot=not args.no_plot)
    print(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
