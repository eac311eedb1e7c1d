"""Attention forward and backward TFLOP/s: safeops against SDPA (flash, cuDNN, efficient, math) and
FlexAttention (torch.compile'd), with the same masks, plus a "fusion on" variant of our kernels.

FLOPs: forward 4 * B * H * Sq * Sk * D (halved for causal), backward 2.5x the forward. Shapes: bf16 for D in
{64, 128}, S in {1K, 4K, 16K}, causal and not, B * H * S = 2**18 (H = 16; B = 16, 4, 1); fp16 and fp32
(per precision mode, against SDPA math/efficient) on fewer shapes. What each backward timing measures:

- safeops: ``torch.ops.safeops.attention_backward`` alone (dq with delta, dk/dv kernels) from saved tensors;
- safeops, fusion on: the same kernels compiled with ``enable_fp_fusion=True``
  (``safeops._config.fp_fusion``), to measure what the contraction-free build costs (target < 3%); it is
  our variant, not a peer;
- SDPA backends and FlexAttention: ``torch.autograd.grad`` of the output w.r.t. (q, k, v) on a retained
  graph, which runs their backward kernels only.

The dense bf16 matmul ceiling (8192^3 ``torch.mm``) is measured in the same run; "% ceil" is ours against it.

    python3 bench/attention.py --out DIR [--budget-s S] [--quick] [--impl safeops,flex] [--d 128]
                               [--causal 0,1] [--directions fwd,bwd]
    python3 bench/attention.py --sweep --out DIR [--kernels fwd,dkdv,dq] [--d 64,128] [--causal 0,1]

``--sweep`` times safeops alone with each candidate configuration of the chosen kernels
(``attention_launch.config_override``) on bf16 B=4 H=16 S=4K for the chosen head dims and causal settings,
and writes attention_sweep.csv plus the best per kernel, to paste into
``FWD_CONFIGS``/``DKDV_CONFIGS``/``DQ_CONFIGS``. Each candidate compiles one kernel (seconds): filter to
fit a time slot, e.g. ``--kernels dkdv,dq --d 128``.

``--sweep --shape llama`` sweeps the backward at one layer of bench/model.py's 1.1B Llama (B=1, 32 query /
4 kv heads, S=4K, D=64, causal, bf16, the model's (B, S, H, D)-transposed layout): dk/dv configs, the GQA
split (programs per kv head's query group, with a few dk/dv configs), the causal head grouping
(``BACKWARD_HEAD_GROUP``) and dq configs (``--kernels dkdv,split,group,dq``). Each candidate: loose check of
dq / dk / dv against fp32 SDPA, bits against the default, whole-backward time, device time per kernel
(torch.profiler; dk/dv, dq (delta included), other = the split's sum) and host time per call; writes
attention_sweep_llama.csv. ``--compile-only`` (no GPU) compiles the same candidates for sm_90 with Triton
3.6 (/tmp/t36) and prints registers / spills / shared memory:

    python3 bench/attention.py --sweep --shape llama --out DIR [--kernels dkdv,split] [--no-per-kernel]
    python3 bench/attention.py --sweep --shape llama --compile-only

Needs a CUDA GPU; without one it exits with a message.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
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

HEADS = 16
TOKENS_HEADS = 2**18  # B * H * S
MATMUL_LABEL = "dense bf16 matmul ceiling (8192^3 torch.mm, same run)"


# A case's shape is (B, H, S, D, causal, precision code); precision only matters for fp32.
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
    return {"q": q, "k": k, "v": v, "g": g, "causal": bool(causal)}


def reference(case: H.Case, t: dict) -> torch.Tensor:
    """fp32 SDPA (efficient backend) output, or the q gradient for bwd: a loose check only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t[n].float().requires_grad_(case.direction == "bwd") for n in ("q", "k", "v"))
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


@contextlib.contextmanager
def fp_fusion(on: bool):
    from safeops import _config

    saved = _config.fp_fusion
    _config.fp_fusion = on
    try:
        yield
    finally:
        _config.fp_fusion = saved


def build_safeops(case: H.Case, t: dict, fusion: bool = False):
    import safeops

    q, k, v, causal = t["q"], t["k"], t["v"], t["causal"]
    prec = PRECISION_NAMES[case.shape[5]] if case.dtype == torch.float32 else None
    scale = 1.0 / math.sqrt(q.shape[-1])
    if case.direction == "fwd":
        def call():
            with fp_fusion(fusion):
                return safeops.attention(q, k, v, is_causal=causal, precision=prec)
        return call
    code = case.shape[5] if case.dtype == torch.float32 else 0
    s = q.shape[2]
    with fp_fusion(fusion):
        out, m, l = torch.ops.safeops.attention(q, k, v, None, 0, None, None, s, s, causal, scale, None, -1,
                                                0 if causal else -1, code)

    def backward():
        with fp_fusion(fusion):
            return torch.ops.safeops.attention_backward(t["g"], q, k, v, out, m, l, None, 0, None, None, s, s,
                                                        causal, scale, None, -1, 0 if causal else -1, code)[0]
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

    def forward(q, k, v):
        return fn(q, k, v, block_mask=mask)
    return _autograd_call(case, t, forward)


def build_benchmark(cases: list[H.Case], only: set[str] | None = None) -> H.Benchmark:
    bench = H.Benchmark(name="attention", metric=H.Metric("TFLOP/s", flops, scale=1e-12), cases=cases,
                        make_inputs=make_inputs, reference=reference, check=check)
    impls = [
        ("safeops", build_safeops, dict(role="ours")),
        ("safeops fusion on", lambda c, t: build_safeops(c, t, fusion=True), dict(role="variant")),
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


# --quick's default set: the peers the issue's targets name (cuDNN, FlexAttention), SDPA flash, and our
# fusion-on variant for the safety cost. SDPA efficient / math only in the full run.
QUICK_IMPLS = {"safeops", "safeops fusion on", "sdpa cudnn", "sdpa flash", "flex"}


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


# ------------------------------------------------------------------------------------------------------
# Config sweep
# ------------------------------------------------------------------------------------------------------

# (block_m, block_n, num_warps, num_stages[, warp_specialize, tma]). Run 4 (H200, Triton 3.6, B=4 H=16 S=4K)
# measured the first lists; the best of each went into the launcher. TMA and warp_specialize gave no gain on
# the forward (within 1%). ptxas crashes on TMA with D=128 128x128; warp_specialize with 4 warps fails to
# compile: both show up as "error" rows.
FWD_CANDIDATES = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 4), (64, 64, 4, 3),
                  (128, 64, 8, 3, True), (128, 64, 8, 3, False, True), (128, 128, 8, 3, False, True),
                  (64, 64, 4, 4, False, True)]
# dk/dv: block_m queries per step, block_n keys per program. Run 4: D=128 (32, 64, 4, 3) 270 TFLOP/s whole
# backward, (32, 128, 8, 2) 249, (64, 64, 4, 2) 247, 4 warps with 128 keys ~135; D=64 (32, 128, 4, 2) 213.
# Offline D=128 (Triton 3.6 ptxas -v): all below 0-8 B spill; (64, 64, 4, 3) spills 348 B (left out).
# Session 4 adds D=64 candidates around the shipped (32, 128, 4, 2), re-swept after the EVEN specialization
# changed the kernels' register use.
DKDV_CANDIDATES = [(32, 64, 4, 3), (32, 64, 4, 4), (16, 64, 4, 4), (16, 64, 4, 3), (16, 128, 8, 3),
                   (32, 128, 8, 3), (32, 64, 8, 3), (32, 64, 4, 3, False, True), (32, 128, 4, 2),
                   (32, 128, 4, 3), (64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2),
                   (16, 128, 4, 2), (32, 128, 4, 2, False, False),  # the shipped tile without TMA
                   # capped at 128 registers (7th field: maxnreg), see LLAMA_DKDV:
                   (32, 128, 8, 2, False, True, 128), (32, 128, 8, 2, False, False, 128),
                   (32, 128, 8, 3, False, False, 128)]
# dq: block_m queries per program, block_n keys per step. Run 4: D=64 (64, 64, 4, 2) 195 / causal 165 (TMA
# 168); D=128 not measured (default (128, 64, 8, 2): 1 CTA/SM at 131072 B smem; 4-warp tiles allow 2).
# Offline D=128: no spills below; (64, 128, 4, 2) spills 356 B (left out).
DQ_CANDIDATES = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3),
                 (64, 32, 4, 3), (64, 32, 4, 2), (128, 64, 8, 2, False, True)]
SWEEP_KERNELS = {"fwd": FWD_CANDIDATES, "dkdv": DKDV_CANDIDATES, "dq": DQ_CANDIDATES}


def precompile(case: H.Case, kind: str, candidates) -> None:
    """Compiles every candidate's kernels for this case at once on all CPU cores (a process pool, see
    ``attention_launch.compile_launches``) into Triton's on-disk cache, so the timing loop does not compile
    them one by one. The launches are planned by the launcher itself on meta tensors of the case's shapes."""
    import json

    from safeops.ops import attention_launch as L

    b, h, s, d, causal, code = case.shape
    q, k, v, g = (torch.empty(b, h, s, d, dtype=case.dtype, device="meta") for _ in range(4))
    options = (None, 0, None, None, s, s, bool(causal), 1.0 / math.sqrt(d), None, -1, 0 if causal else -1,
               code if case.dtype == torch.float32 else 0)
    with L.recording() as launches:
        for cand in candidates:
            with L.config_override(**{kind: L.AttnConfig(*cand)}):
                out, m, l = L.forward(q, k, v, *options)
                if case.direction == "bwd":
                    L.backward(g, q, k, v, out, m, l, *options)
    unique = list({json.dumps(x, sort_keys=True): x for x in launches}.values())
    start = time.time()
    try:
        results = L.compile_launches(unique, timeout=300)["results"]
        failed = sum(not r["ok"] for r in results)
        print(f"sweep: precompiled {len(unique)} kernels in {time.time() - start:.1f} s ({failed} failed)",
              flush=True)
    except Exception as e:  # only a warm-up: the timing loop compiles what is missing
        print(f"sweep: precompile failed ({str(e).splitlines()[0][:200]}); compiling one by one", flush=True)


def sweep(out_dir: Path, deadline: float, kernels=("fwd", "dkdv", "dq"), dims=(64, 128),
          causals=(0, 1), warm: bool = True) -> None:
    """Times each candidate of each kernel (the others at their defaults) on bf16 B=4 H=16 S=4K. The dk/dv
    and dq rows time the whole backward (dq with delta + dk/dv kernels), so only differences between rows of
    one kernel mean something."""
    import safeops  # noqa: F401
    from safeops.ops import attention_launch as L

    rows = []
    best: dict[tuple, tuple] = {}
    shapes = [(4, HEADS, 2**12, d, causal) for d in dims for causal in causals]
    for b, h, s, d, causal in shapes:
        for kind in kernels:
            candidates = SWEEP_KERNELS[kind]
            direction = "fwd" if kind == "fwd" else "bwd"
            case = H.Case(direction, torch.bfloat16, (b, h, s, d, causal, 3))
            if warm:
                precompile(case, kind, candidates)
            t = make_inputs(case)
            ref = reference(case, t) if kind != "dkdv" else None
            for cand in candidates:
                if time.time() > deadline:
                    print("sweep: time budget used up")
                    break
                cfg = L.AttnConfig(*cand)
                status, ms = "ok", math.nan
                try:
                    with L.config_override(**{kind: cfg}):
                        fn = build_safeops(case, t)
                        out = fn()
                        torch.cuda.synchronize()
                        if ref is not None and check(case, out, ref):
                            status = "wrong"
                        ms = H.bench_ms(fn, 25, 100)[0]
                except Exception as e:  # out of resources (shared memory, registers): record and go on
                    status = f"error: {str(e).splitlines()[0][:100]}"
                tf = flops(case) / (ms * 1e-3) * 1e-12 if not math.isnan(ms) else math.nan
                rows.append([kind, d, causal, *cand[:4], len(cand) > 4 and cand[4], len(cand) > 5 and cand[5],
                             cand[6] if len(cand) > 6 else "", status, f"{ms:.4f}", f"{tf:.1f}"])
                print(f"sweep {kind:5s} D={d} causal={causal} {cand}: {status} {ms:.4f} ms  {tf:.1f} TFLOP/s "
                      f"({'whole backward' if kind != 'fwd' else 'forward'})", flush=True)
                key = (kind, d, causal)
                if status == "ok" and (key not in best or ms < best[key][1]):
                    best[key] = (cand, ms)
            del t
            torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "attention_sweep.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kernel", "D", "causal", "block_m", "block_n", "num_warps", "num_stages",
                    "warp_specialize", "tma", "maxnreg", "status", "ms", "tflops"])
        w.writerows(rows)
    print("\nbest (kernel, D, causal) -> (block_m, block_n, num_warps, num_stages):")
    for key, (cand, ms) in sorted(best.items()):
        print(f"  {key}: {cand}  {ms:.4f} ms")
    print(f"wrote {out_dir / 'attention_sweep.csv'}")


# ------------------------------------------------------------------------------------------------------
# Sweep at a model layer's shape (--shape llama): dk/dv configs, the GQA split, the head grouping, dq configs
# ------------------------------------------------------------------------------------------------------
# The 1.1B Llama of bench/model.py, one layer: B=1, 32 query / 4 kv heads (group 8), S=4096, D=64, causal,
# bf16, q / k / v / grad in the model's layout: a (B, S, H, D) tensor transposed to (B, H, S, D) ("bshd").
# There the dk/dv kernel (shipped (32, 128, 4, 2), split 8) takes ~477 us per layer against ~218 for dq.
LLAMA = dict(b=1, hq=32, hkv=4, s=4096, d=64, causal=True, layout="bshd")


def _say(*args) -> None:
    print(*args, flush=True)  # a run cut by `timeout` keeps every line printed so far


@dataclasses.dataclass(frozen=True)
class LlamaCand:
    """One point of the sweep: what it changes from the launcher's defaults (None: the default)."""
    kind: str  # "base", "dkdv", "split", "group" or "dq"
    dkdv: tuple | None = None  # (block_m, block_n, num_warps, num_stages[, warp_specialize, tma])
    dq: tuple | None = None
    fwd: tuple | None = None  # the forward's tile (sweep_llama_fwd)
    split: int | None = None  # programs per kv head's query group in dk/dv (attention_launch.dkdv_split)
    head_group: int | None = None  # attention_launch.BACKWARD_HEAD_GROUP (causal grid order, dk/dv and dq)

    @property
    def label(self) -> str:
        parts = [f"dkdv={self.dkdv}" if self.dkdv else "", f"dq={self.dq}" if self.dq else "",
                 f"fwd={self.fwd}" if self.fwd else "",
                 f"split={self.split}" if self.split else "",
                 f"hg={self.head_group}" if self.head_group else ""]
        return " ".join(p for p in parts if p) or "default"


# dk/dv at this shape, split 8 (offline sm_90, Triton 3.6, `--compile-only`; regs / spill bytes): shipped
# (32, 128, 4, 2) 255 / 0 (28-36 B spill in the MHA case of scratch/notes_attn_bwd.md); (32, 128, 8, 3)
# 146 / 0; (64, 64, 4, 2) 225 / 0; FlexAttention's tile (64, 128, 8, 3) 186 / 0; every entry compiles without
# spill. At split 1-4 the shipped tile spills 216-268 B (the 8-warp tiles do not); all numbers in
# scratch/notes_attn_llama_sweep.md.
LLAMA_DKDV = [(32, 128, 4, 2), (32, 128, 8, 3), (32, 128, 8, 2), (32, 128, 8, 4), (64, 64, 4, 2),
              (64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 4, 2), (32, 64, 4, 3),
              (16, 128, 4, 2), (32, 128, 4, 2, False, False),  # the shipped tile without TMA
              # 8-warp tiles capped at 128 registers (maxnreg): 2 programs per SM instead of 1; offline sm_90
              # spills 8 B (TMA) / 32 B (s2) / 56 B (s3) / 80 B (s4) against 170-192 registers uncapped.
              (32, 128, 8, 2, False, True, 128), (32, 128, 8, 2, False, False, 128),
              (32, 128, 8, 3, False, True, 128), (32, 128, 8, 3, False, False, 128),
              (32, 128, 8, 4, False, False, 128)]
# The split's candidates (split 4 = the default, two heads per program, is in LLAMA_DKDV): each divides the
# group (8). The first tile is the shipped one (TMA loads of q / dO).
LLAMA_SPLITS = (1, 2, 8)
LLAMA_SPLIT_CONFIGS = [(32, 128, 4, 2, False, True), (32, 128, 8, 3), (64, 64, 4, 2), (64, 128, 8, 3)]
LLAMA_HEAD_GROUPS = (1, 4, 16, 32)  # default 8; n_bh = 32 for dk/dv (split 8) and for dq
LLAMA_DQ = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3),
            (128, 128, 8, 2), (64, 64, 4, 2, False, False),  # the shipped tile without TMA
            (64, 64, 4, 3, False, True), (128, 64, 8, 2, False, True), (64, 32, 4, 3, False, True),
            (128, 32, 8, 3, False, True)]
LLAMA_KINDS = ("dkdv", "split", "group", "dq")


def llama_candidates(kinds=LLAMA_KINDS) -> list[LlamaCand]:
    """The default first, then each kind's candidates (the default's own point left out)."""
    out = [LlamaCand("base")]
    if "dkdv" in kinds:
        out += [LlamaCand("dkdv", dkdv=c) for c in LLAMA_DKDV if c != LLAMA_DKDV[0]]
    if "split" in kinds:
        out += [LlamaCand("split", dkdv=c, split=s) for c in LLAMA_SPLIT_CONFIGS for s in LLAMA_SPLITS]
    if "group" in kinds:
        out += [LlamaCand("group", head_group=g) for g in LLAMA_HEAD_GROUPS]
    if "dq" in kinds:
        out += [LlamaCand("dq", dq=c) for c in LLAMA_DQ if c != LLAMA_DQ[0]]
    return out


@contextlib.contextmanager
def llama_knobs(cand: LlamaCand):
    """The candidate's configs (``config_override``), split (``dkdv_split`` replaced) and head grouping
    (``BACKWARD_HEAD_GROUP``) inside the block; the launcher's plans see the change (both are part of
    ``attention_launch._settings``) and everything is restored on exit."""
    from safeops.ops import attention_launch as L

    overrides = {}
    if cand.dkdv:
        overrides["dkdv"] = L.AttnConfig(*cand.dkdv)
    if cand.dq:
        overrides["dq"] = L.AttnConfig(*cand.dq)
    if cand.fwd:
        overrides["fwd"] = L.AttnConfig(*cand.fwd)
    saved = L.dkdv_split, L.BACKWARD_HEAD_GROUP
    try:
        if cand.split is not None:
            def forced_split(group: int, kv_elements: int, split=cand.split) -> int:
                if group % split:
                    raise ValueError(f"split: {split} does not divide the query group {group}")
                return split
            L.dkdv_split = forced_split
        if cand.head_group is not None:
            L.BACKWARD_HEAD_GROUP = cand.head_group
        with L.config_override(**overrides):
            yield
    finally:
        L.dkdv_split, L.BACKWARD_HEAD_GROUP = saved


def llama_tensors(shape: dict, device, dtype=torch.bfloat16, seed: int = 0) -> dict:
    """q, k, v, grad (random, or meta) in the shape's layout, the forward's (out, m, l) left to the caller."""
    b, hq, hkv, s, d = (shape[n] for n in ("b", "hq", "hkv", "s", "d"))
    meta = torch.device(device).type == "meta"
    gen = None if meta else torch.Generator(device=device).manual_seed(seed)

    def make(h):
        if shape.get("layout", "bhsd") == "bshd":
            size, back = (b, s, h, d), (lambda t: t.transpose(1, 2))
        else:
            size, back = (b, h, s, d), (lambda t: t)
        t = (torch.empty(size, dtype=dtype, device=device) if meta else
             torch.randn(size, dtype=dtype, device=device, generator=gen))
        return back(t)
    return {"q": make(hq), "k": make(hkv), "v": make(hkv), "g": make(hq)}


def _llama_options(shape: dict) -> tuple:
    s, d, causal = shape["s"], shape["d"], bool(shape["causal"])
    return (None, 0, None, None, s, s, causal, 1.0 / math.sqrt(d), None, -1, 0 if causal else -1, 0)


def llama_reference(shape: dict, t: dict) -> tuple:
    """fp32 (dq, dk, dv) from SDPA with k / v repeated over each query group (efficient or math backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = shape["hq"] // shape["hkv"]
    q, k, v = (t[n].float().requires_grad_(True) for n in ("q", "k", "v"))
    ke, ve = (x.repeat_interleave(group, dim=1) for x in (k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(q, ke, ve, is_causal=bool(shape["causal"]))
    return tuple(x.detach() for x in torch.autograd.grad(out, (q, k, v), t["g"].float()))


def llama_check(outs: tuple, ref: tuple) -> str | None:
    """The sweep's loose check (2% of the largest reference value + 1e-3) on dq, dk and dv."""
    bad = []
    for name, o, r in zip(("dq", "dk", "dv"), outs, ref, strict=True):
        err, scale = (o.float() - r).abs().max().item(), r.abs().max().item()
        if not err <= 0.02 * scale + 1e-3:
            bad.append(f"{name} max error {err:.3g} > {0.02 * scale + 1e-3:.3g}")
    return "; ".join(bad) or None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16),
                                              b.contiguous().view(torch.int16))


def _effective(shape: dict, t: dict) -> tuple[tuple, tuple]:
    """What the bits of dk / dv and of dq depend on, with the configs the launcher uses now (inside
    ``llama_knobs``): on CUDA the dk/dv query step and split, and the dq key step. Under Triton's interpreter
    (CPU tensors) also the other block size of each kernel: its ``tl.dot`` is numpy's matmul, whose rounding
    of an element can depend on the product's row count (OpenBLAS picks its kernel by shape and CPU)."""
    from safeops.ops import attention_launch as L

    q, k, v = t["q"], t["k"], t["v"]
    block_d = L.block_dim(shape["d"])
    kv = L.config("dkdv", block_d, q.dtype, bool(shape["causal"]), q.device)
    dq = L.config("dq", block_d, q.dtype, bool(shape["causal"]), q.device)
    split = L.dkdv_split(shape["hq"] // shape["hkv"], k.numel() + v.numel())
    if q.device.type == "cuda":
        return (kv.block_m, split), (dq.block_n,)
    return (kv.block_m, kv.block_n, split), (dq.block_m, dq.block_n)


KERNEL_GROUPS = (("dkdv", "attn_bwd_dkdv_kernel"), ("dq", "attn_bwd_dq_kernel"))


def kernel_times_us(fn, iters: int = 20) -> dict[str, float]:
    """Device time per call of each backward kernel (torch.profiler): dkdv, dq (delta included), and "other"
    (the split's sum), in microseconds."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # as bench/compile.py
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    attr = "device_time_total" if events and hasattr(events[0], "device_time_total") else "cuda_time_total"
    out = {name: 0.0 for name, _ in KERNEL_GROUPS} | {"other": 0.0}
    for e in events:
        us = getattr(e, attr, 0) or 0
        if us <= 0 or e.device_type.name not in ("CUDA", "PrivateUse1"):
            continue
        name = next((n for n, kernel in KERNEL_GROUPS if kernel in e.key), "other")
        out[name] += us / iters
    return out


def host_us(fn, n: int = 50) -> float:
    """Host time to enqueue one call, no synchronization inside the loop (microseconds)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def _record_llama(shape: dict, cands: list[LlamaCand]) -> list[tuple[LlamaCand, list[dict]]]:
    """Each candidate's launches (forward + backward) as the launcher plans them for CUDA, on meta tensors."""
    from safeops.ops import attention_launch as L

    t = llama_tensors(shape, "meta")
    options = _llama_options(shape)
    out = []
    for cand in cands:
        with L.recording() as launches, llama_knobs(cand):
            o, m, l = L.forward(t["q"], t["k"], t["v"], *options)
            L.backward(t["g"], t["q"], t["k"], t["v"], o, m, l, *options)
        out.append((cand, list(launches)))
    return out


def precompile_llama(shape: dict, cands: list[LlamaCand], log=_say) -> None:
    """``precompile`` for the Llama candidates: their distinct kernels compiled in parallel into Triton's
    cache before the timing loop."""
    import json

    from safeops.ops import attention_launch as L

    unique = {json.dumps(x, sort_keys=True): x for _, ls in _record_llama(shape, cands) for x in ls}
    start = time.time()
    try:
        results = L.compile_launches(list(unique.values()), timeout=300)["results"]
        log(f"sweep llama: precompiled {len(unique)} kernels in {time.time() - start:.1f} s "
            f"({sum(not r['ok'] for r in results)} failed)")
    except Exception as e:  # only a warm-up
        log(f"sweep llama: precompile failed ({str(e).splitlines()[0][:200]}); compiling one by one")


def sweep_llama(out_dir: Path | None, deadline: float = math.inf, kinds=LLAMA_KINDS,
                shape: dict | None = None, device: str = "cuda", cands: list[LlamaCand] | None = None,
                timer=None, per_kernel: bool = True, warm: bool = True, log=_say,
                dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> list[dict]:
    """Times the backward (dq with delta + dk/dv + the split's sum) with each candidate at one model layer's
    shape (default ``LLAMA``), the forward's outputs computed once with the default configs. Per candidate:
    the loose check of dq / dk / dv against fp32 SDPA, their bits against the default's (expected equal where
    the dk/dv query step and split, resp. the dq key step, are the default's (``_effective``; on the CPU also
    the other block size): "diff(unexpected)" otherwise; "same" where a difference was possible is no
    error), the backward's CUDA-event
    time, and on CUDA the device time per kernel (profiler) and the host time per call. ``timer(fn) -> ms``
    replaces the CUDA-event timer (CPU tests, which also pass fp16: Triton 3.9's interpreter mishandles
    bf16); rows go to ``out_dir/attention_sweep_llama.csv``."""
    import safeops  # noqa: F401

    shape = shape or LLAMA
    cands = cands if cands is not None else llama_candidates(kinds)
    on_cuda = torch.device(device).type == "cuda"
    timer = timer or (lambda fn: H.bench_ms(fn, 25, 100)[0])
    if warm and on_cuda:
        precompile_llama(shape, cands, log)
    t = llama_tensors(shape, device, dtype, seed)
    options = _llama_options(shape)
    q, k, v, g = t["q"], t["k"], t["v"], t["g"]
    out, m, l = torch.ops.safeops.attention(q, k, v, *options)
    ref = llama_reference(shape, t)
    b, hq, s, d = shape["b"], shape["hq"], shape["s"], shape["d"]
    flop = 2.5 * 4.0 * b * hq * s * s * d / (2 if shape["causal"] else 1)

    def backward():
        return torch.ops.safeops.attention_backward(g, q, k, v, out, m, l, *options)

    rows: list[dict] = []
    base_bits = base_eff = None
    for cand in cands:
        if time.time() > deadline:
            log("sweep llama: time budget used up")
            break
        row = dict(kind=cand.kind, candidate=cand.label, status="ok", ms=math.nan, tflops=math.nan, bits="",
                   host_us=math.nan, **{f"{n}_us": math.nan for n in ("dkdv", "dq", "other")})
        try:
            with llama_knobs(cand):
                eff = _effective(shape, t)
                grads = backward()
                if on_cuda:
                    torch.cuda.synchronize()
                problem = llama_check(grads, ref)
                if problem:
                    row["status"] = f"wrong: {problem}"
                if base_bits is None:
                    base_bits, base_eff = [x.clone() for x in grads], eff
                same = [_same_bits(x, y) for x, y in zip(grads, base_bits, strict=True)]
                expect = [eff[1] == base_eff[1], eff[0] == base_eff[0], eff[0] == base_eff[0]]
                row["bits"] = " ".join(
                    f"{n}={'same' if sm else 'diff'}{'(unexpected)' if ex and not sm else ''}"
                    for n, sm, ex in zip(("dq", "dk", "dv"), same, expect, strict=True))
                row["ms"] = timer(backward)
                row["tflops"] = flop / (row["ms"] * 1e-3) * 1e-12
                if on_cuda and per_kernel:
                    try:
                        row.update({f"{n}_us": us for n, us in kernel_times_us(backward).items()})
                    except Exception as e:  # the profiler is a bonus: keep the row
                        log(f"sweep llama: per-kernel times failed ({str(e).splitlines()[0][:120]})")
                if on_cuda:
                    row["host_us"] = host_us(backward)
        except Exception as e:  # out of resources, a split that does not divide: record and go on
            row["status"] = f"error: {str(e).splitlines()[0][:120]}"
        rows.append(row)
        log(f"sweep llama {cand.kind:5s} {cand.label:42s} {row['status'][:60]:8s} {row['ms']:.4f} ms "
            f"{row['tflops']:.1f} TFLOP/s | dkdv {row['dkdv_us']:.1f} dq {row['dq_us']:.1f} other "
            f"{row['other_us']:.1f} us | host {row['host_us']:.1f} us | "
            f"{row['bits']}")
    best: dict[str, dict] = {}
    for row in rows:
        if row["status"] == "ok" and (row["kind"] not in best or row["ms"] < best[row["kind"]]["ms"]):
            best[row["kind"]] = row
    log("\nbest per kind (whole backward, CUDA events):")
    for kind, row in best.items():
        log(f"  {kind}: {row['candidate']}  {row['ms']:.4f} ms  dkdv {row['dkdv_us']:.1f} us")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "attention_sweep_llama.csv"
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["shape"] if rows else ["shape"])
            w.writeheader()
            for row in rows:
                w.writerow(row | {"shape": json_shape(shape)})
        log(f"wrote {path}")
    return rows


# The forward at the layer's shape (--kernels fwd): the shipped tile first, then tiles with and without TMA
# loads of K / V ((block_m, block_n, num_warps, num_stages[, warp_specialize, tma])).
LLAMA_FWD = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 3, False, True), (128, 64, 8, 2, False, True),
             (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2, False, True), (64, 64, 4, 3, False, True),
             (128, 32, 8, 3), (128, 32, 4, 3, False, True)]


def sweep_llama_fwd(out_dir: Path | None, deadline: float = math.inf, shape: dict | None = None,
                    device: str = "cuda", tiles: list[tuple] | None = None, timer=None, warm: bool = True,
                    log=_say, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> list[dict]:
    """Times the forward with each tile (``LLAMA_FWD``) at one model layer's shape: the loose check of the
    output against fp32 SDPA (k / v repeated over each query group), its bits and the lse's against the
    shipped tile's (the same block_m and block_n give the same bits; TMA only changes how K / V are loaded),
    CUDA-event time, TFLOP/s. Rows go to ``out_dir/attention_sweep_llama_fwd.csv``."""
    import safeops  # noqa: F401
    from safeops.ops import attention_launch as L

    shape = shape or LLAMA
    tiles = tiles or LLAMA_FWD
    on_cuda = torch.device(device).type == "cuda"
    timer = timer or (lambda fn: H.bench_ms(fn, 25, 100)[0])
    cands = [LlamaCand("base")] + [LlamaCand("fwd", fwd=tile) for tile in tiles[1:]]
    if warm and on_cuda:
        precompile_llama(shape, cands, log)
    t = llama_tensors(shape, device, dtype, seed)
    options = _llama_options(shape)
    q, k, v = t["q"], t["k"], t["v"]
    group = shape["hq"] // shape["hkv"]
    ke, ve = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), ke, ve, is_causal=bool(shape["causal"]))
    b, hq, s, d = shape["b"], shape["hq"], shape["s"], shape["d"]
    flop = 4.0 * b * hq * s * s * d / (2 if shape["causal"] else 1)

    def forward():
        return torch.ops.safeops.attention(q, k, v, *options)

    rows, base = [], None
    for cand in cands:
        if time.time() > deadline:
            log("sweep llama fwd: time budget used up")
            break
        tile = cand.fwd or tiles[0]
        row = dict(candidate=str(tile), status="ok", ms=math.nan, tflops=math.nan, bits="")
        try:
            with L.config_override(fwd=L.AttnConfig(*tile)):
                out, lse, _ = forward()
                err, scale = (out.float() - ref).abs().max().item(), ref.abs().max().item()
                if not err <= 0.02 * scale + 1e-3:
                    row["status"] = f"wrong: max error {err:.3g}"
                if base is None:
                    base = (tile, out.clone(), lse.clone())
                same = _same_bits(out, base[1]) and torch.equal(lse, base[2])
                expect = tuple(tile[:2]) == tuple(base[0][:2])
                row["bits"] = ("same" if same else "diff") + ("(unexpected)" if expect and not same else "")
                row["ms"] = timer(forward)
                row["tflops"] = flop / (row["ms"] * 1e-3) * 1e-12
        except Exception as e:  # out of resources: record and go on
            row["status"] = f"error: {str(e).splitlines()[0][:120]}"
        rows.append(row)
        log(f"sweep llama fwd {row['candidate']:32s} {row['status'][:60]:8s} {row['ms']:.4f} ms "
            f"{row['tflops']:.1f} TFLOP/s | out/lse bits {row['bits']}")
    if out_dir is not None and rows:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "attention_sweep_llama_fwd.csv"
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["shape"])
            w.writeheader()
            for row in rows:
                w.writerow(row | {"shape": json_shape(shape)})
        log(f"wrote {path}")
    return rows


def json_shape(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


# Offline build statistics: Triton's compile worker (attention_launch._COMPILE_WORKER) with triton.compile
# wrapped to keep the compiled kernel, whose binary bench/_sm90.py rebuilds with ptxas -v for registers and
# spill bytes. Runs in a Triton-only venv (no torch, no GPU).
_STATS_WORKER = r"""
import json, multiprocessing, os, sys
from concurrent.futures import ProcessPoolExecutor

import triton

request = json.load(sys.stdin)
sys.path.insert(0, request["bench_dir"])
import _sm90

worker = {"__name__": "safeops_compile_worker"}
exec(request["worker_source"], worker)
_last = _sm90.keep_compiled()


def stats(job):
    _last.clear()
    result = worker["compile_one"](job)
    if result.get("ok") and _last:
        try:
            result["regs"], result["spill"], _ = _sm90.binary_stats(_last[-1])
        except Exception as e:
            result["regs"] = result["spill"] = -1
            result["stats_error"] = str(e)[-300:]
    return result


if __name__ == "__main__":
    jobs = [(request["kernel_file"], request["arch"], launch) for launch in request["launches"]]
    workers = max(1, min(len(jobs), request.get("workers") or os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(stats, jobs, chunksize=1))
    print(json.dumps({"triton": triton.__version__, "results": results}))
"""


def compile_stats(launches: list[dict], python: str | None = None, workers: int | None = None,
                  timeout: float = 1800) -> dict:
    """``attention_launch.compile_launches`` plus registers / spill bytes per launch (ptxas -v, sm_90a)."""
    import json
    import os
    import subprocess

    from safeops.ops import attention_launch as L

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if "TRITON_INTERPRET" in env:
        env["TRITON_INTERPRET"] = "0"
    request = json.dumps({"kernel_file": L.KERNEL_FILE, "arch": 90, "launches": launches, "workers": workers,
                          "bench_dir": str(HERE), "worker_source": L._COMPILE_WORKER})
    proc = subprocess.run([python or sys.executable, "-c", _STATS_WORKER], input=request, capture_output=True,
                          text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"offline compile worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def default_compile_python() -> str:
    """/tmp/t36's Python (Triton 3.6, the GPU machine's) when it exists, else this one."""
    import os

    for candidate in (os.environ.get("SAFEOPS_COMPILE_PYTHON"), "/tmp/t36/bin/python"):
        if candidate and os.path.exists(candidate):
            return candidate
    return sys.executable


def compile_only_llama(shape: dict | None = None, cands: list[LlamaCand] | None = None,
                       python: str | None = None, log=_say) -> list[dict]:
    """Compiles every candidate's dk/dv and dq kernels for sm_90 offline and prints registers, spill bytes
    and shared memory. Returns one row per (candidate, kernel)."""
    import json

    shape = shape or LLAMA
    cands = cands if cands is not None else llama_candidates()
    recorded = _record_llama(shape, cands)
    wanted = ("attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")
    unique: dict[str, dict] = {}
    for _, launches in recorded:
        for x in launches:
            if x["kernel"] in wanted:
                unique.setdefault(json.dumps(x, sort_keys=True), x)
    keys = list(unique)
    start = time.time()
    answer = compile_stats([unique[key] for key in keys], python or default_compile_python())
    by_key = dict(zip(keys, answer["results"], strict=True))
    log(f"compile-only: Triton {answer['triton']}, {len(keys)} kernels for sm_90 in "
        f"{time.time() - start:.0f} s ({json_shape(shape)})")
    rows = []
    shows = {"base": wanted, "dkdv": wanted[:1], "split": wanted[:1], "dq": wanted[1:], "group": ()}
    for cand, launches in recorded:
        for x in launches:
            if x["kernel"] not in shows.get(cand.kind, wanted):  # the kernels the candidate changes
                continue
            r = by_key[json.dumps(x, sort_keys=True)]
            kw = x["kwargs"]
            cfg = (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["NUM_STAGES"])
            row = dict(kind=cand.kind, candidate=cand.label, kernel=x["kernel"], config=cfg,
                       split=kw.get("SPLIT", ""), tma=kw.get("USE_TMA"), maxnreg=kw.get("maxnreg"),
                       ok=r["ok"], regs=r.get("regs"),
                       spill=r.get("spill"), shared=r.get("shared"), error=r.get("error", "")[-200:])
            rows.append(row)
            short = x["kernel"].removeprefix("attn_bwd_").removesuffix("_kernel")
            status = (f"regs={row['regs']} spill={row['spill']} smem={row['shared']}" if r["ok"] else
                      f"FAILED {row['error']}")
            log(f"  {cand.kind:5s} {cand.label:42s} {short:4s} {cfg} split={row['split']} "
                f"tma={row['tma']} maxnreg={row['maxnreg']}: {status}")
    return rows


def layer_shape(text: str) -> dict:
    """``LLAMA`` with the ``key=value`` pairs of ``text`` (comma separated) replaced."""
    shape = dict(LLAMA)
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, value = item.partition("=")
        if key not in LLAMA or not value:
            raise ValueError(f"--layer: expected key=value with a key of {sorted(LLAMA)}, got {item!r}")
        shape[key] = value if key == "layout" else int(value)
    if shape["hq"] % shape["hkv"]:
        raise ValueError(f"--layer: hq={shape['hq']} is not a multiple of hkv={shape['hkv']}")
    return shape


def _tiles(text: str) -> list[tuple | None]:
    return [tuple(int(v) for v in t.split(":")) for t in text.split(";") if t.strip()] or [None]


def split_candidates(shape: dict, splits: tuple[int, ...], tiles: list[tuple | None]) -> list[LlamaCand]:
    """The default, then each dk/dv tile (None: the shipped one) at each split that divides the group."""
    group = shape["hq"] // shape["hkv"]
    out = [LlamaCand("base")]
    for tile in tiles:
        out += [LlamaCand("split", dkdv=tile, split=s) for s in splits if group % s == 0]
    return out


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(HERE / "out"))
    p.add_argument("--budget-s", type=float, default=0, help="stop timing new cases after this many seconds")
    p.add_argument("--quick", action="store_true",
                   help="bf16 S=4K only; unless --impl: safeops (+ fusion on), cuDNN, SDPA flash, flex")
    p.add_argument("--sweep", action="store_true", help="tune safeops' kernel configurations instead")
    p.add_argument("--kernels", default="",
                   help="--sweep: which kernels' candidates to time (default fwd,dkdv,dq; with "
                        "--shape llama: dkdv,split,group,dq, or fwd alone for the forward's tiles)")
    p.add_argument("--shape", default="mha", choices=("mha", "llama"),
                   help="--sweep: mha = bf16 B=4 H=16 S=4K (--d, --causal); llama = one layer of "
                        "bench/model.py's 1.1B Llama (B=1, 32 q / 4 kv heads, S=4K, D=64, causal, "
                        "(B, S, H, D) layout)")
    p.add_argument("--compile-only", action="store_true",
                   help="--sweep --shape llama: compile the candidates for sm_90 offline and print "
                        "registers / spills / shared memory (no GPU; Triton from --compile-python)")
    p.add_argument("--compile-python", default="",
                   help="--compile-only: the Python whose Triton compiles (default: /tmp/t36/bin/python "
                        "if it exists)")
    p.add_argument("--layer", action="append", default=[],
                   help="--shape llama: another layer shape instead of the 1.1B Llama's, e.g. "
                        "'hq=32,hkv=8,d=128' (keys of LLAMA; the rest as LLAMA); repeatable, one sweep each "
                        "into OUT/<layer>")
    p.add_argument("--splits", default="",
                   help="--shape llama: instead of the kinds' candidates, the default and every listed "
                        "GQA split that divides the layer's group (with --split-configs' dk/dv tiles)")
    p.add_argument("--split-configs", default="",
                   help="--splits: dk/dv tiles 'BM:BN:W:S;...' (default: the shipped tile)")
    p.add_argument("--no-per-kernel", action="store_true",
                   help="--shape llama: skip the per-kernel device times (torch.profiler)")
    p.add_argument("--no-precompile", action="store_true",
                   help="--sweep: do not compile the candidates in parallel first")
    p.add_argument("--d", default="64,128", help="head dims (sweep and benchmark)")
    p.add_argument("--causal", default="0,1", help="0 and/or 1 (sweep and benchmark)")
    p.add_argument("--directions", default="fwd,bwd", help="benchmark: fwd and/or bwd")
    p.add_argument("--impl", default="", help="comma list of implementation names (default: all)")
    p.add_argument("--warmup", type=float, default=25)
    p.add_argument("--rep", type=float, default=100)
    args = p.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kernels.split(",") if k.strip())
    if args.shape == "llama":
        if not args.sweep:
            p.error("--shape llama: only with --sweep")
        unknown = set(kinds) - set(LLAMA_KINDS) - {"fwd"}
        if unknown:
            p.error(f"--kernels: unknown {sorted(unknown)} for --shape llama; choose from "
                    f"{list(LLAMA_KINDS) + ['fwd']}")
        if kinds == ("fwd",):
            if args.compile_only:
                p.error("--compile-only: not for --kernels fwd")
        elif "fwd" in kinds:
            p.error("--kernels fwd: on its own (the forward sweep times the forward only)")
        kinds = kinds or LLAMA_KINDS
        if args.compile_only:
            import safeops  # noqa: F401

            rows = compile_only_llama(cands=llama_candidates(kinds), python=args.compile_python or None)
            return 1 if any(not r["ok"] for r in rows) else 0
    elif args.compile_only:
        p.error("--compile-only: only with --sweep --shape llama")
    H.require_cuda("bench/attention.py")
    import safeops  # noqa: F401

    out_dir = Path(args.out)
    deadline = time.time() + args.budget_s if args.budget_s else None
    dims, causals = _ints(args.d), _ints(args.causal)
    if args.sweep and args.shape == "llama" and kinds == ("fwd",):
        for text in args.layer or [""]:
            sweep_llama_fwd(out_dir / text.replace(",", "_").replace("=", "") if text else out_dir,
                            deadline or math.inf, shape=layer_shape(text), warm=not args.no_precompile)
        return 0
    if args.sweep and args.shape == "llama":
        for text in args.layer or [""]:
            shape = layer_shape(text)
            cands = (split_candidates(shape, _ints(args.splits), _tiles(args.split_configs))
                     if args.splits else None)
            sweep_llama(out_dir / text.replace(",", "_").replace("=", "") if text else out_dir,
                        deadline or math.inf, kinds, shape=shape, cands=cands,
                        per_kernel=not args.no_per_kernel, warm=not args.no_precompile)
        return 0
    if args.sweep:
        kernels = kinds or ("fwd", "dkdv", "dq")
        unknown = set(kernels) - set(SWEEP_KERNELS)
        if unknown:
            p.error(f"--kernels: unknown {sorted(unknown)}; choose from {sorted(SWEEP_KERNELS)}")
        sweep(out_dir, deadline or math.inf, kernels, dims, causals, warm=not args.no_precompile)
        return 0
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
