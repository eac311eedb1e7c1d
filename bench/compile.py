"""A transformer block under torch.compile: stock Inductor against safeops.register() (and backend="safeops").

The block (issue 3, "Performance"): pre-LayerNorm, a qkv projection, attention written by hand in bf16 --
``scores = q @ k^T * scale``, ``masked_fill(causal, -inf)``, a hand-written softmax (amax / exp / sum / div),
``p @ v`` -- an output projection and a GELU MLP, with residuals. Default shape B=8, H=16, S=1024, D=64
(width 1024), MLP ratio 4, bf16.

For each variant the script compiles the block (``fullgraph=True``, after ``torch._dynamo.reset()``), runs
one step to compile it, then measures:

- forward + backward time: one step is ``out = block(x)`` and ``torch.autograd.grad(out, params + [x], dy)``
  with a fixed random ``dy``; median (and 20th / 80th percentiles) of CUDA-event timings through
  ``triton.testing.do_bench`` (``bench/_harness.py``: warm-up and repetitions in ms, L2 flushed per run);
- peak memory: ``torch.cuda.max_memory_allocated()`` over one step, after ``reset_peak_memory_stats()``;
  reported in absolute terms and above what was allocated before the step (weights, inputs);
- compile time: wall time of the first step (Dynamo + Inductor, forward and backward);
- how many softmax rewrites ``safeops.compile.stats`` counted (0 for stock: if a safeops variant shows 0,
  its numbers compare stock with stock), whether the output and every gradient are finite, and the largest
  difference of the output and of the gradients from the stock variant's, relative to the stock maximum.

Inductor's FX-graph and AOT-autograd caches are off unless ``--keep-caches``: a graph served from a cache is
not rewritten again, so the rewrite count would read 0 (the graph is still the right one).

    python bench/compile.py [--batch 8] [--heads 16] [--seq 1024] [--head-dim 64] [--mlp-ratio 4]
                            [--softmax hand|hand_fp32|torch] [--pad 0] [--variants stock,registered,backend]
                            [--warmup-ms 100] [--rep-ms 500] [--out bench/out/compile.md] [--keep-caches]

Prints a Markdown table and writes it to ``--out``. Needs a CUDA GPU; without one it exits with a message.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE.parent), str(HERE)):  # the repo root (safeops) and bench/ (_harness)
    if path not in sys.path:
        sys.path.insert(0, path)

import safeops  # noqa: E402, I001  (before torch._dynamo: on a CPU machine it sets TRITON_INTERPRET)
import _harness as H  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

VARIANTS = ("stock", "registered", "backend")
VARIANT_NOTES = {
    "stock": "torch.compile, default Inductor",
    "registered": "torch.compile after safeops.register()",
    "backend": 'torch.compile(backend="safeops")',
}


# --------------------------------------------------------------------------------------------------
# The block
# --------------------------------------------------------------------------------------------------


def softmax_hand(z: torch.Tensor) -> torch.Tensor:
    """The user-land softmax of the seed case, in the input dtype (bf16)."""
    m = torch.amax(z, -1, keepdim=True)
    e = torch.exp(z - m)
    return e / torch.sum(e, -1, keepdim=True)


def softmax_hand_fp32(z: torch.Tensor) -> torch.Tensor:
    """The same with an explicit fp32 upcast and a cast back."""
    return softmax_hand(z.float()).to(z.dtype)


def softmax_torch(z: torch.Tensor) -> torch.Tensor:
    return torch.softmax(z, -1)


SOFTMAXES = {"hand": softmax_hand, "hand_fp32": softmax_hand_fp32, "torch": softmax_torch}
SOFTMAX_NOTES = {
    "hand": "amax / exp / sum / div written out, in the input dtype",
    "hand_fp32": "the same after an explicit .float(), cast back",
    "torch": "torch.softmax",
}
DEVICE = "cuda"


class Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: int, softmax: str):
        super().__init__()
        self.heads = heads
        self.scale = (width // heads) ** -0.5
        self.softmax = SOFTMAXES[softmax]
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, mlp_ratio * width)
        self.down = nn.Linear(mlp_ratio * width, width)

    def forward(self, x: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        p = self.softmax(scores.masked_fill(drop, float("-inf")))
        x = x + self.proj((p @ v).transpose(1, 2).reshape(b, s, w))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def drop_mask(batch: int, seq: int, pad: int, device) -> torch.Tensor:
    """True = masked: causal, plus ``pad`` left-padded keys in the first sequence (whose first ``pad`` queries
    then have fully masked rows: stock gives NaN there)."""
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
    padded = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    padded[0, :pad] = True
    return causal[None, None] | padded[:, None, None, :]


# --------------------------------------------------------------------------------------------------
# Measuring one variant
# --------------------------------------------------------------------------------------------------


def _variant_context(variant: str):
    return safeops.registered() if variant == "registered" else contextlib.nullcontext()


def _rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().float().cpu(), ref.float()
    ok = torch.isfinite(ref) & torch.isfinite(a)
    if not ok.any():
        return math.nan
    scale = ref[ok].abs().max().item() or 1.0
    return (a[ok] - ref[ok]).abs().max().item() / scale


def measure(variant: str, block: nn.Module, x: torch.Tensor, drop: torch.Tensor, dy: torch.Tensor,
            args, reference: dict | None) -> dict:
    row = {"variant": variant, "status": "ok", "note": ""}
    torch._dynamo.reset()
    safeops.compile.stats.clear()
    params = list(block.parameters())
    backend = "safeops" if variant == "backend" else "inductor"
    try:
        with _variant_context(variant):
            fn = torch.compile(block, backend=backend, fullgraph=True, mode=args.mode)

            def step():
                out = fn(x, drop)
                return out, torch.autograd.grad(out, [*params, x], dy)

            t0 = time.perf_counter()
            out, grads = step()
            torch.cuda.synchronize()
            row["compile_s"] = time.perf_counter() - t0
            row["rewrites"] = sum(safeops.compile.stats.values())
            row["finite"] = bool(torch.isfinite(out).all()) and all(
                bool(torch.isfinite(g).all()) for g in grads)
            if reference is not None:
                row["out_diff"] = _rel_diff(out, reference["out"])
                row["grad_diff"] = max(_rel_diff(g, r)
                                       for g, r in zip(grads, reference["grads"], strict=True))
            else:
                row["out_diff"] = row["grad_diff"] = 0.0
                # kept on the host, so that it does not count in the other variants' peak memory
                row["keep"] = {"out": out.detach().cpu(), "grads": [g.detach().cpu() for g in grads]}
            del out, grads
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            row["peak_mib"] = peak / 2**20
            row["step_mib"] = (peak - before) / 2**20
            row["ms"], row["ms_p20"], row["ms_p80"] = H.bench_ms(lambda: step(), args.warmup_ms, args.rep_ms)
            if args.profile:
                _profile(variant, step)
    except Exception as e:  # one variant failing must not lose the others' numbers
        row["status"], row["note"] = "error", H._short(e)
    return row


def _profile(variant: str, step, steps: int = 3) -> None:
    """Prints where one step's time goes: GPU kernels by total time, and GPU busy time against wall time
    (a step whose wall time is well above its kernel time is bound by launches on the host)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    events = prof.key_averages()
    attr = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
    kernels = [e for e in events if getattr(e, attr, 0) > 0 and e.device_type.name in ("CUDA", "PrivateUse1")]
    busy_ms = sum(getattr(e, attr) for e in kernels) / 1e3 / steps
    print(f"--- profile {variant}: wall {wall_ms:.3f} ms/step, GPU kernels {busy_ms:.3f} ms/step, "
          f"{sum(e.count for e in kernels) / steps:.0f} kernels/step", flush=True)
    for e in sorted(kernels, key=lambda e: -getattr(e, attr))[:14]:
        ms = getattr(e, attr) / 1e3 / steps
        print(f"    {ms:8.3f} ms  x{e.count // steps:<3d} {e.key[:100]}", flush=True)
    # Host side: the time to enqueue one step (no synchronization inside), and where it goes.
    import cProfile
    import io
    import pstats

    n = 20
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    host_ms = (time.perf_counter() - t0) * 1e3 / n
    torch.cuda.synchronize()
    print(f"--- host {variant}: {host_ms:.3f} ms/step to enqueue (GPU-bound if below the GPU kernel time)",
          flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:3000], flush=True)


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def markdown(rows: list[dict], meta: dict, args) -> str:
    width = args.heads * args.head_dim
    lines = [
        f"### Transformer block, torch.compile stock vs safeops: measured {meta.get('date')} on "
        f"{meta.get('gpu')} (torch {meta.get('torch')}, triton {meta.get('triton')}, "
        f"CUDA {meta.get('cuda')})",
        "",
        f"B={args.batch}, H={args.heads}, S={args.seq}, D={args.head_dim} (width {width}), "
        f"MLP x{args.mlp_ratio}, {args.dtype}, causal mask"
        + (f", torch.compile mode={args.mode}" if args.mode else "")
        + (f" + {args.pad} padded keys in sequence 0" if args.pad else "")
        + f", softmax `{args.softmax}` ({SOFTMAX_NOTES[args.softmax]}). One step = forward + backward "
        "(gradients of every parameter and of the input). Time: median of CUDA-event timings "
        "(triton.testing.do_bench), 20th-80th percentile in brackets. "
        "Peak: torch.cuda.max_memory_allocated() over one step; 'step' is the part above what was "
        "allocated before it. Diffs: max |x - stock| / max |stock| over finite entries.",
        "",
        "| variant | fwd+bwd ms | vs stock | peak MiB | step MiB | compile s | softmax rewrites | finite | "
        "out diff | grad diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    stock = next((r for r in rows if r["variant"] == "stock" and r["status"] == "ok"), None)
    for r in rows:
        name = f"{r['variant']} ({VARIANT_NOTES[r['variant']]})"
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['status']}: {r['note']} | | | | | | | | |")
            continue
        speed = f"{stock['ms'] / r['ms']:.2f}x" if stock else "-"
        lines.append(
            f"| {name} | {r['ms']:.3f} [{r['ms_p20']:.3f}-{r['ms_p80']:.3f}] | {speed} | "
            f"{r['peak_mib']:.0f} | {r['step_mib']:.0f} | {r['compile_s']:.1f} | {r['rewrites']} | "
            f"{'yes' if r['finite'] else 'NO'} | {_fmt(r['out_diff'], '.2e')} | "
            f"{_fmt(r['grad_diff'], '.2e')} |")
    lines.append("")
    lines.append("'vs stock' > 1 means faster than stock.")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="torch.compile of a transformer block with a hand-written bf16 attention softmax: stock "
                    "Inductor vs safeops.register() (and backend='safeops'); forward+backward time and peak "
                    "memory side by side, as a Markdown table. Needs a CUDA GPU.")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--mlp-ratio", type=int, default=4)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--softmax", choices=tuple(SOFTMAXES), default="hand",
                   help="hand: amax/exp/sum/div in the input dtype; hand_fp32: the same after .float(), cast "
                        "back; torch: torch.softmax (default: hand)")
    p.add_argument("--pad", type=int, default=0,
                   help="left-padded keys in sequence 0: its first PAD query rows are fully masked "
                        "(stock NaN)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list from {', '.join(VARIANTS)} (stock first; it is the reference)")
    p.add_argument("--warmup-ms", type=float, default=100, help="do_bench warm-up, ms")
    p.add_argument("--rep-ms", type=float, default=500, help="do_bench repetitions, ms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "out" / "compile.md"), help="Markdown file to write")
    p.add_argument("--mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    p.add_argument("--profile", action="store_true",
                   help="also print each variant's GPU kernels by time (torch.profiler) and GPU busy time "
                        "against wall time")
    p.add_argument("--keep-caches", action="store_true",
                   help="leave Inductor's FX-graph / AOT-autograd caches on (the rewrite count may then "
                        "read 0)")
    args = p.parse_args(argv)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {VARIANTS}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    H.require_cuda("bench/compile.py")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if not args.keep_caches:
        inductor_config.fx_graph_cache = False
        functorch_config.enable_autograd_cache = False
    dtype = H.DTYPES_BY_NAME[args.dtype]
    torch.manual_seed(args.seed)
    width = args.heads * args.head_dim
    block = Block(width, args.heads, args.mlp_ratio, args.softmax).to(device=DEVICE, dtype=dtype)
    x = torch.randn(args.batch, args.seq, width, device=DEVICE, dtype=dtype, requires_grad=True)
    dy = torch.randn(args.batch, args.seq, width, device=DEVICE, dtype=dtype)
    drop = drop_mask(args.batch, args.seq, args.pad, DEVICE)
    meta = H.device_meta()
    print(f"{meta['gpu']}: torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}", flush=True)

    order = sorted(args.variant_list, key=lambda v: v != "stock")  # stock first: the reference
    rows, reference = [], None
    for variant in order:
        row = measure(variant, block, x, drop, dy, args, reference)
        if reference is None and variant == "stock" and row["status"] == "ok":
            reference = row.pop("keep")
        row.pop("keep", None)
        rows.append(row)
        shown = (f"{row['ms']:.3f} ms, peak {row['peak_mib']:.0f} MiB, {row['rewrites']} rewrites, "
                 f"finite {row['finite']}" if row["status"] == "ok" else f"{row['status']}: {row['note']}")
        print(f"{variant}: {shown}", flush=True)
        if variant != "stock" and row["status"] == "ok" and row["rewrites"] == 0:
            print(f"warning: {variant} rewrote no softmax: its numbers compare stock with stock", flush=True)
    torch._dynamo.reset()

    table = markdown(rows, meta, args)
    print()
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    print(f"\nwrote {out}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
