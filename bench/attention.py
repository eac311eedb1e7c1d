"""Attention forward and backward TFLOP/s: safeops against SDPA (flash, cuDNN, efficient, math) and
FlexAttention (torch.compile'd), with the same masks, plus a "fusion on" variant of our kernels.

FLOPs: forward 4 * B * H * Sq * Sk * D (halved for causal), backward 2.5x the forward. Shapes: bf16 for D in
{64, 128}, S in {1K, 4K, 16K}, causal and not, B * H * S = 2**18 (H = 16; B = 16, 4, 1); fp16 and fp32
(per precision mode, against SDPA math/efficient) on fewer shapes. What each backward timing measures:

- safeops: ``torch.ops.safeops.attention_backward`` alone (dq with delta, dk/dv kernels) from saved tensors;
- safeops, fusion on: the same kernels compiled with ``enable_fp_fusion=True``
  (``safeops._config.fp_fusion``), to measure what the contraction-free build costs (target < 3%); it is
  our variant, not a peer;
- safeops triton dq (backward only): dq from the Triton dq kernel (``attention_gluon.GLUON_DQ`` off, the
  default until 2026-12-05) where the backward's dk / dv take the Gluon dK / dV kernel (the fused kernel,
  the non-causal D=128 default, switched off for it); "safeops" takes dq from the Gluon dQ kernel there;
- safeops gluon fused (backward only): the fused Gluon backward (``attention_gluon.GLUON_FUSED``) where the
  default does not take it (the default for non-causal D=128: since 2026-12-06 where a head's key blocks fit
  on half the SMs, since 2026-12-07 at every key length): dk, dv and dq in one kernel, dq added in a fixed
  order of key blocks;
- safeops gluon bwd (backward only): the Gluon dK / dV kernel where the backward does not take it by default
  (``SAFEOPS_GLUON_BWD=1``; D=64 causal; D=64 without causal takes it by default since 2026-12-06);
- safeops gluon softcap (forward only, with ``--softcap``): the Gluon forward's softcap build
  (``attention_gluon.GLUON_SOFTCAP``, off by default until measured); "safeops" runs the Triton forward there;
- SDPA backends and FlexAttention: ``torch.autograd.grad`` of the output w.r.t. (q, k, v) on a retained
  graph, which runs their backward kernels only.

``--softcap C``: every case's scores softcapped (``C * tanh(s / C)``, Gemma 2's attention): safeops and
FlexAttention (a score_mod) run it, SDPA cannot (refused), the check's reference is fp32 math.

The dense bf16 matmul ceiling (8192^3 ``torch.mm``) is measured in the same run; "% ceil" is ours against it.

    python3 bench/attention.py --out DIR [--budget-s S] [--quick] [--impl safeops,flex] [--d 128]
                               [--causal 0,1] [--directions fwd,bwd] [--softcap 50]

Needs a CUDA GPU; without one it exits with a message.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import sys
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
for path in (str(HERE.parent), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

import _harness as H  # noqa: E402
import torch  # noqa: E402

HEADS = 16
TOKENS_HEADS = 2**18  # B * H * S
MATMUL_LABEL = "dense bf16 matmul ceiling (8192^3 torch.mm, same run)"


# A case's shape is (B, H, S, D, causal, precision code); precision only matters for fp32.
SOFTCAP: float | None = None  # --softcap: every case softcapped
PRECISION_NAMES = {0: "ieee", 1: "tf32", 2: "tf32x3", 3: "-"}


def flops(case: H.Case) -> float:
    b, h, s, d, causal, _ = case.shape
    f = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return f * (2.5 if case.direction == "bwd" else 1.0)


def make_cases(quick: bool, dims=(64, 128), causals=(0, 1), directions=("fwd", "bwd")) -> list[H.Case]:
    """--quick: bf16 S=4K only (no fp16 / fp32 cases)."""
    cases = []
    seqs = [2**12] if quick else [2**10, 2**12, 2**14]
    for direction in directions:
        for d in dims:
            for s in seqs:
                for causal in causals:
                    cases.append(H.Case(direction, torch.bfloat16, (TOKENS_HEADS // (HEADS * s), HEADS, s, d,
                                                                    causal, 3)))
        if not quick:
            for causal in causals:
                cases.append(H.Case(direction, torch.float16, (4, HEADS, 2**12, 128, causal, 3)))
            for prec in (0, 1, 2):
                cases.append(H.Case(direction, torch.float32, (2, HEADS, 2**11, 64, 0, prec)))
    return cases


def make_inputs(case: H.Case) -> dict:
    b, h, s, d, causal, _ = case.shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, g = (torch.randn(b, h, s, d, device="cuda", dtype=case.dtype, generator=gen) for _ in range(4))
    return {"q": q, "k": k, "v": v, "g": g, "causal": bool(causal), "softcap": SOFTCAP}


def reference(case: H.Case, t: dict) -> torch.Tensor:
    """fp32 SDPA (efficient backend) output, or the q gradient for bwd: a loose check only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t[n].float().requires_grad_(case.direction == "bwd") for n in ("q", "k", "v"))
    if t["softcap"] is not None:  # fp32 math, one head at a time on the stack of scores
        cap = t["softcap"]
        z = torch.tanh((q @ k.transpose(-1, -2)) / (math.sqrt(q.shape[-1]) * cap)) * cap
        if t["causal"]:
            z = z.masked_fill(torch.ones_like(z[0, 0], dtype=torch.bool).triu(1), float("-inf"))
        out = torch.softmax(z, -1) @ v
    else:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=t["causal"])
    if case.direction == "fwd":
        return out.detach()
    (dq,) = torch.autograd.grad(out, (q,), t["g"].float())
    return dq


def check(case: H.Case, out, ref: torch.Tensor) -> str | None:
    out = out[0] if isinstance(out, (tuple, list)) else out
    err = (out.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    tol = (0.02 if case.dtype != torch.float32 else 0.005) * scale + 1e-3
    return None if err <= tol else f"max error {err:.3g} > {tol:.3g}"


def fp_fusion(on: bool):
    return H.config_set("fp_fusion", on)


@contextlib.contextmanager
def gluon_switch(name: str, value):
    """A switch of safeops.ops.attention_gluon (GLUON_DQ: on by default; GLUON_FUSED: off; FUSED_NONCAUSAL:
    head dims), set to ``value`` for the block."""
    from safeops.ops import attention_gluon

    with mock.patch.object(attention_gluon, name, value):
        yield


@contextlib.contextmanager
def gluon_bwd_everywhere(on: bool):
    """SAFEOPS_GLUON_BWD=1 for the block: the Gluon dK / dV kernel at every head dim it has."""
    with mock.patch.dict(os.environ, {"SAFEOPS_GLUON_BWD": "1"} if on else {}):
        yield


def build_safeops(case: H.Case, t: dict, fusion: bool = False, triton_dq: bool = False, bwd: bool = False,
                  fused: bool = False, softcap_gluon: bool = False):
    import safeops

    q, k, v, causal, cap = t["q"], t["k"], t["v"], t["causal"], t["softcap"]
    prec = PRECISION_NAMES[case.shape[5]] if case.dtype == torch.float32 else None
    scale = 1.0 / math.sqrt(q.shape[-1])
    if case.direction == "fwd":
        if triton_dq or bwd or fused:
            raise H.Refused("a backward variant")
        if softcap_gluon and cap is None:
            raise H.Refused("a softcap variant (--softcap)")

        def call():
            with (fp_fusion(fusion),
                  gluon_switch("GLUON_SOFTCAP", True) if softcap_gluon else contextlib.nullcontext()):
                return safeops.attention(q, k, v, is_causal=causal, precision=prec, softcap=cap)
        return call
    if softcap_gluon:
        raise H.Refused("a forward variant")
    code = case.shape[5] if case.dtype == torch.float32 else 0
    s = q.shape[2]
    if bwd:
        from safeops.ops import attention_gluon

        def why():
            return attention_gluon.bwd_reason(q, k, v, None, None, causal, None, -1, 0 if causal else -1)

        if not why():
            raise H.Refused("the default backward already takes the Gluon dK / dV kernel here")
        with gluon_bwd_everywhere(True):
            if why():
                raise H.Refused(f"the Gluon dK / dV kernel does not take this backward: {why()}")
    if fused:
        from safeops.ops import attention_gluon

        if not attention_gluon.fused_reason(q, k, v, None, None, causal, None, -1, 0 if causal else -1):
            raise H.Refused("the default backward already takes the fused Gluon kernel here")
        with gluon_switch("GLUON_FUSED", True):
            why = attention_gluon.fused_reason(q, k, v, None, None, causal, None, -1, 0 if causal else -1)
        if why:
            raise H.Refused(f"the fused Gluon backward does not take this backward: {why}")
    with fp_fusion(fusion):
        out, m, l = torch.ops.safeops.attention(q, k, v, None, 0, None, None, s, s, causal, scale, cap, -1,
                                                0 if causal else -1, code)

    def backward():
        with (fp_fusion(fusion), gluon_switch("GLUON_DQ", False) if triton_dq else contextlib.nullcontext(),
              gluon_switch("FUSED_NONCAUSAL", ()) if triton_dq else contextlib.nullcontext(),
              gluon_bwd_everywhere(bwd), gluon_switch("GLUON_FUSED", fused)):
            return torch.ops.safeops.attention_backward(t["g"], q, k, v, out, m, l, None, 0, None, None, s, s,
                                                        causal, scale, cap, -1, 0 if causal else -1, code)[0]
    return backward


def _autograd_call(case: H.Case, t: dict, forward):
    if case.direction == "fwd":
        def call():
            with torch.no_grad():
                return forward(t["q"], t["k"], t["v"])
        return call
    q, k, v = (t[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
    out = forward(q, k, v)

    def backward():
        return torch.autograd.grad(out, (q, k, v), t["g"], retain_graph=True)[0]
    return backward


def sdpa_builder(backend_name: str):
    def build(case: H.Case, t: dict):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        if t["softcap"] is not None:
            raise H.Refused("SDPA has no softcap")

        def forward(q, k, v):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=t["causal"])
        try:
            return _autograd_call(case, t, forward)
        except RuntimeError as e:
            if "No available kernel" in str(e) or "not supported" in str(e).lower():
                raise H.Refused(str(e).splitlines()[0][:120]) from e
            raise
    return build


_flex = {}


def _flex_fn():
    if "fn" not in _flex:
        import torch._functorch.config as functorch_config
        from torch.nn.attention.flex_attention import flex_attention

        # The backward is timed on a retained graph (autograd.grad(..., retain_graph=True)); a compiled
        # backward that donates its saved buffers refuses that ("non-empty donated buffers").
        functorch_config.donated_buffer = False

        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        # One compile per mask type and dtype / head dim; sequence lengths are dynamic.
        _flex["fn"] = torch.compile(flex_attention, dynamic=True)
    return _flex["fn"]


def _block_mask(s: int, causal: bool):
    key = (s, causal)
    if key not in _flex:
        from torch.nn.attention.flex_attention import create_block_mask

        def causal_mask(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        _flex[key] = create_block_mask(causal_mask, None, None, s, s, device="cuda") if causal else None
    return _flex[key]


def build_flex(case: H.Case, t: dict):
    fn = _flex_fn()
    mask = _block_mask(t["q"].shape[2], t["causal"])
    cap = t["softcap"]

    def softcap(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    def forward(q, k, v):
        return fn(q, k, v, block_mask=mask, score_mod=None if cap is None else softcap)
    return _autograd_call(case, t, forward)


def build_benchmark(cases: list[H.Case], only: set[str] | None = None) -> H.Benchmark:
    bench = H.Benchmark(name="attention", metric=H.Metric("TFLOP/s", flops, scale=1e-12), cases=cases,
                        make_inputs=make_inputs, reference=reference, check=check)
    impls = [
        ("safeops", build_safeops, dict(role="ours")),
        ("safeops fusion on", lambda c, t: build_safeops(c, t, fusion=True), dict(role="variant")),
        ("safeops triton dq", lambda c, t: build_safeops(c, t, triton_dq=True), dict(role="variant")),
        ("safeops gluon bwd", lambda c, t: build_safeops(c, t, bwd=True), dict(role="variant")),
        ("safeops gluon fused", lambda c, t: build_safeops(c, t, fused=True), dict(role="variant")),
        ("safeops gluon softcap", lambda c, t: build_safeops(c, t, softcap_gluon=True), dict(role="variant")),
        ("sdpa flash", sdpa_builder("FLASH_ATTENTION"), dict(tag="F")),
        ("sdpa cudnn", sdpa_builder("CUDNN_ATTENTION"), dict(tag="C")),
        ("sdpa efficient", sdpa_builder("EFFICIENT_ATTENTION"), dict(tag="E")),
        ("sdpa math", sdpa_builder("MATH"), dict(tag="M")),
        ("flex", build_flex, dict(tag="X")),
    ]
    for name, build, kw in impls:
        if only and name not in only:
            continue
        bench.add(name, build, **kw)
    return bench


# --quick's default set: the peers the targets name (cuDNN, FlexAttention), SDPA flash, and our
# fusion-on variant for the safety cost. SDPA efficient / math only in the full run.
QUICK_IMPLS = {"safeops", "safeops fusion on", "safeops triton dq", "safeops gluon bwd",
               "safeops gluon fused", "safeops gluon softcap", "sdpa cudnn", "sdpa flash", "flex"}


def _skip_slow_peers(bench: H.Benchmark) -> None:
    """SDPA math on bf16/fp16 and long sequences is slow and memory hungry: only fp32 runs it."""
    for impl in bench.impls:
        if impl.name == "sdpa math":
            build = impl.build

            def guarded(case, t, build=build):
                if case.dtype != torch.float32:
                    raise H.Refused("math backend timed on fp32 inputs only")
                return build(case, t)
            impl.build = guarded


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms, _, _ = H.bench_ms(lambda: torch.mm(a, b), 25, 200)
    return 2 * 8192**3 / (ms * 1e-3) * 1e-12


# ------------------------------------------------------------------------------------------------------
# Reports (TFLOP/s tables; the harness's own tables are for bandwidth-bound ops)
# ------------------------------------------------------------------------------------------------------


def _label(case: H.Case) -> str:
    b, h, s, d, causal, prec = case.shape
    tail = f" {PRECISION_NAMES[prec]}" if case.dtype == torch.float32 else ""
    return f"B{b} S{H.size_label(s)} D{d}{' causal' if causal else ''}{tail}"


def tables(results: list[H.Result], ceiling: float, meta: dict) -> str:
    lines = [f"### attention: measured {meta.get('date')} on {meta.get('gpu')} (torch {meta.get('torch')}, "
             f"triton {meta.get('triton')}, CUDA {meta.get('cuda')}); TFLOP/s, H={HEADS}; "
             f"{MATMUL_LABEL}: {ceiling:.0f} TFLOP/s", ""]
    groups: dict[tuple[str, str], list[H.Result]] = {}
    for r in results:
        groups.setdefault((r.case.direction, H.DTYPE_NAMES[r.case.dtype]), []).append(r)
    for (direction, dtype), rs in groups.items():
        impls = list(dict.fromkeys(r.impl for r in rs))
        cases = list(dict.fromkeys(r.case for r in rs))
        lines.append(f"**{direction} {dtype}**")
        lines.append("")
        lines.append("| shape | " + " | ".join(impls) + " | ours % ceil | ours / best peer | fusion cost |")
        lines.append("|---|" + "---|" * (len(impls) + 3))
        for case in cases:
            row = {r.impl: r for r in rs if r.case == case}
            cells = []
            for impl in impls:
                r = row.get(impl)
                cells.append("-" if r is None else f"{r.value:.0f}{'!' if r.status == 'wrong' else ''}"
                             if not math.isnan(r.value) else r.status)
            mine, peer = H.ours(list(row.values())), H.best_peer(list(row.values()))
            fused = row.get("safeops fusion on")
            ok = mine is not None and mine.status == "ok"
            pct = f"{100 * mine.value / ceiling:.0f}%" if ok else "-"
            ratio = f"{mine.value / peer.value:.2f}x {peer.tag or peer.impl}" if ok and peer else "-"
            cost = (f"{100 * (fused.value / mine.value - 1):+.1f}%"
                    if ok and fused is not None and fused.status == "ok" else "-")
            lines.append(f"| {_label(case)} | " + " | ".join(cells) + f" | {pct} | {ratio} | {cost} |")
        lines.append("")
    lines.append("'!' = output failed the loose check against fp32 SDPA; 'fusion cost' = how much faster the "
                 "same kernels run with fp contraction on (the price of the safe build).")
    return "\n".join(lines)



def write_csv(path: Path, results: list[H.Result], ceiling: float, meta: dict) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["direction", "dtype", "B", "H", "S", "D", "causal", "precision", "impl", "role",
                    "status", "ms_median", "ms_p20", "ms_p80", "tflops", "pct_of_matmul", "matmul_tflops",
                    "note", "gpu", "torch", "triton", "cuda", "date"])
        for r in results:
            b, h, s, d, causal, prec = r.case.shape
            w.writerow([r.case.direction, H.DTYPE_NAMES[r.case.dtype], b, h, s, d, causal,
                        PRECISION_NAMES[prec], r.impl, r.role, r.status, f"{r.ms:.6f}", f"{r.ms_p20:.6f}",
                        f"{r.ms_p80:.6f}", f"{r.value:.2f}", f"{100 * r.value / ceiling:.1f}",
                        f"{ceiling:.1f}", r.note,
                        *(meta.get(n) for n in ("gpu", "torch", "triton", "cuda", "date"))])


def write_png(path: Path, results: list[H.Result], ceiling: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"no plot: {e}")
        return
    groups = sorted({(r.case.direction, H.DTYPE_NAMES[r.case.dtype]) for r in results})
    fig, axes = plt.subplots(1, len(groups), figsize=(7 * len(groups), 5), squeeze=False)
    for ax, (direction, dtype) in zip(axes[0], groups, strict=True):
        rs = [r for r in results if r.case.direction == direction and H.DTYPE_NAMES[r.case.dtype] == dtype]
        cases = list(dict.fromkeys(r.case for r in rs))
        impls = list(dict.fromkeys(r.impl for r in rs))
        width = 0.8 / max(len(impls), 1)
        for i, impl in enumerate(impls):
            vals = [next((r.value for r in rs if r.case == c and r.impl == impl and r.status == "ok"), 0.0)
                    for c in cases]
            ax.bar([j + i * width for j in range(len(cases))], vals, width, label=impl)
        ax.axhline(ceiling, color="gray", linestyle=":", label=f"matmul {ceiling:.0f}")
        ax.set_xticks([j + 0.4 for j in range(len(cases))], [_label(c) for c in cases], rotation=60,
                      fontsize=7, ha="right")
        ax.set_title(f"attention {direction} {dtype} (TFLOP/s)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(HERE / "out"))
    p.add_argument("--budget-s", type=float, default=0, help="stop timing new cases after this many seconds")
    p.add_argument("--quick", action="store_true",
                   help="bf16 S=4K only; unless --impl: safeops (+ fusion on), cuDNN, SDPA flash, flex")
    p.add_argument("--d", default="64,128", help="head dims")
    p.add_argument("--causal", default="0,1", help="0 and/or 1")
    p.add_argument("--directions", default="fwd,bwd", help="fwd and/or bwd")
    p.add_argument("--impl", default="", help="comma list of implementation names (default: all)")
    p.add_argument("--warmup", type=float, default=25)
    p.add_argument("--rep", type=float, default=100)
    p.add_argument("--softcap", type=float, default=None, help="softcap every case's scores (Gemma 2: 50)")
    args = p.parse_args(argv)
    global SOFTCAP
    SOFTCAP = args.softcap
    H.require_cuda("bench/attention.py")
    import safeops  # noqa: F401

    out_dir = Path(args.out)
    deadline = time.time() + args.budget_s if args.budget_s else None
    dims, causals = _ints(args.d), _ints(args.causal)
    ceiling = matmul_tflops()
    print(f"{MATMUL_LABEL}: {ceiling:.0f} TFLOP/s")
    only = {s.strip() for s in args.impl.split(",") if s.strip()} or (QUICK_IMPLS if args.quick else None)
    directions = tuple(x.strip() for x in args.directions.split(",") if x.strip())
    bench = build_benchmark(make_cases(args.quick, dims, causals, directions), only)
    _skip_slow_peers(bench)
    results = H.run(bench, warmup_ms=args.warmup, rep_ms=args.rep, deadline=deadline)
    meta = H.device_meta()
    out_dir.mkdir(parents=True, exist_ok=True)
    md = tables(results, ceiling, meta)
    print(md)
    (out_dir / "attention.md").write_text(md + "\n")
    write_csv(out_dir / "attention.csv", results, ceiling, meta)
    write_png(out_dir / "attention.png", results, ceiling)
    print(f"wrote {out_dir / 'attention.md'}, attention.csv, attention.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
