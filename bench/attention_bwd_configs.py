"""The attention backward's configurations side by side: the defaults, switched-off Gluon variants, cuDNN.

bench/attention.py measures what ships against its peers. This script answers the question before a switch
is turned: is a configuration that no launcher chooses yet (a field of ``GluonBwdConfig`` /
``GluonFusedConfig``, the fused kernel, the Gluon kernels at a head dim where they are not the default)
faster than the default, at which shapes, and does it keep the default's bits? Each variant patches the
configuration tables and switches of ``safeops.ops.attention_gluon`` for its own calls only, clears the
launch plans, and calls ``torch.ops.safeops.attention_backward`` on saved forward statistics; cuDNN runs
through autograd on the same inputs. Printed per (shape, variant): the median CUDA-event time in ms
(``_harness.bench_ms``, as bench/attention.py times), TFLOP/s (2.5x the forward's 4 B H S^2 D, halved
causal), the largest difference to the default's gradients (0: the same bits) and whether a rerun gave the
same bits.

    python3 bench/attention_bwd_configs.py                      # every variant, every shape
    python3 bench/attention_bwd_configs.py --variants default,fused_tma --shapes b4s4k-d128 --rep-ms 500
    python3 bench/attention_bwd_configs.py --warm               # compile each variant at a small size

``--compile-first`` starts one ``--warm`` process per variant (small shapes, the same compiled kernels) and
waits for them before the timed run: the variants compile in parallel into Triton's cache (the Gluon compiles
take tens of seconds each). ``bash bench/gpu_run.sh bwdconfigs`` runs the variants' GPU bit tests and this.
Needs a CUDA GPU (sm_90 for the Gluon kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
for path in (str(HERE.parent), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _harness import bench_ms  # noqa: E402

import safeops  # noqa: E402, F401  (registers torch.ops.safeops)
from safeops.ops import attention_gluon as G  # noqa: E402
from safeops.ops import attention_launch as L  # noqa: E402

# name -> (B, Hq, Hkv, S, D, causal[, window_left[, packed sequence lengths]]): a window of window_left keys
# before each query; packed: attention_varlen over sequences of these lengths (B = 1, S = their sum).
DOCS = (4096, 1024, 2048, 512, 3072, 1536, 2560, 1536)  # 16K tokens of documents, as packed training sees
SHAPES = {
    "b4s4k-d128": (4, 16, 16, 4096, 128, False),
    "b4s4k-d128-causal": (4, 16, 16, 4096, 128, True),
    "b4s4k-d64": (4, 16, 16, 4096, 64, False),
    "b4s4k-d64-causal": (4, 16, 16, 4096, 64, True),
    "llama8b-s8k": (1, 32, 8, 8192, 128, True),
    "llama8b-s16k": (1, 32, 8, 16384, 128, True),
    "llama8b-s8k-dense": (1, 32, 8, 8192, 128, False),
    "llama8b-s16k-dense": (1, 32, 8, 16384, 128, False),
    "b1h32s16k-d64-dense": (1, 32, 32, 16384, 64, False),
    "b2h16s8k-d64-dense": (2, 16, 16, 8192, 64, False),
    "b8h16s2k-d64-dense": (8, 16, 16, 2048, 64, False),
    "b16h16s1k-d128-dense": (16, 16, 16, 1024, 128, False),
    # GQA with few kv heads: TinyLlama's 32 / 4 heads (bench/model.py's layer), a 16 / 4 group at D=128.
    "tinyllama-s4k": (1, 32, 4, 4096, 64, True),
    "tinyllama-s4k-dense": (1, 32, 4, 4096, 64, False),
    "b4s4k-gqa4-d128-causal": (4, 16, 4, 4096, 128, True),
    "b1s4k-gqa8-d128-causal": (1, 32, 4, 4096, 128, True),  # 128 CTAs unsplit, as TinyLlama's at D=64
    "b2s4k-gqa8-d128-causal": (2, 32, 4, 4096, 128, True),  # 256 CTAs unsplit
    "b1s8k-gqa8-d128-causal": (1, 32, 4, 8192, 128, True),  # 256, longer
    "b1s16k-gqa8-d128-causal": (1, 32, 4, 16384, 128, True),  # 512
    "b4s4k-gqa8-d128-causal": (4, 32, 4, 4096, 128, True),  # 512, batched
    "b8s4k-gqa8-d128-causal": (8, 32, 4, 4096, 128, True),  # 1024
    "b1s4k-mqa-d128-causal": (1, 32, 1, 4096, 128, True),  # 32
    "b1s4k-gqa8-d128-dense": (1, 32, 4, 4096, 128, False),  # the fused kernel's GQA (no split) vs the pair's
    "b1s4k-mqa-d128-dense": (1, 32, 1, 4096, 128, False),
    "b4s4k-mqa-d128-dense": (4, 32, 1, 4096, 128, False),
    "b1s4k-gqa16-d128-dense": (1, 32, 2, 4096, 128, False),
    "b4s4k-gqa16-d128-dense": (4, 32, 2, 4096, 128, False),
    "b4s4k-gqa8-d128-dense": (4, 32, 4, 4096, 128, False),
    "b4s4k-d128-causal-w1k": (4, 16, 16, 4096, 128, True, 1024),
    "b4s4k-d64-w1k": (4, 16, 16, 4096, 64, False, 1024),
    "docs16k-d128-causal": (1, 16, 16, sum(DOCS), 128, True, -1, DOCS),
    "docs16k-d64-causal": (1, 16, 16, sum(DOCS), 64, True, -1, DOCS),
}
WARM_SHAPES = {d: [(1, 2, 2, 512, d, False), (1, 2, 2, 512, d, True)] for d in (64, 128)}


@dataclasses.dataclass(frozen=True)
class Variant:
    """``fused``: the fused kernel (GLUON_FUSED) with these changes to its configuration; ``bwd``: changes
    to the dK / dV kernel's configuration; ``env``: environment for the calls (e.g. SAFEOPS_GLUON_BWD)."""
    fused: dict | None = None
    bwd: dict | None = None
    env: dict = dataclasses.field(default_factory=dict)
    head_dims: tuple = (64, 128)
    seq: bool = False  # attention_gluon.GLUON_BWD_SEQ: packed sequences and windows on the Gluon kernels
    fused_noncausal: tuple | None = None  # attention_gluon.FUSED_NONCAUSAL, if not the shipped one
    fused_max_group: int | None = None  # attention_gluon.FUSED_MAX_GROUP, if not the shipped one
    split_head_dims: tuple | None = None  # attention_gluon.SPLIT_HEAD_DIMS (the dK / dV GQA split)
    split_min_group: dict | None = None  # attention_gluon.SPLIT_MIN_GROUP (the smallest group split per D)
    heads_per_program: int | None = None  # attention_launch.DKDV_HEADS_PER_PROGRAM (the split's slices)
    gluon_dq: bool = True  # attention_gluon.GLUON_DQ: off, dq comes from the Triton dq kernel
    dq: dict | None = None  # changes to the Gluon dQ kernel's configuration
    triton_dq: tuple | None = None  # a forced Triton dq configuration (AttnConfig fields); dK / dV stay Gluon


# The named fused variants below start from the plain order without the row statistics (the D=128 default
# before 2026-12-06 had neither), so that each measures what it names; fused_tma_shift_rs is the default now.
TMA = dict(tma_reduce=True, finalize=False, shift=False, early_turn=False, row_stats=False)
VARIANTS = {
    "default": Variant(),
    "gluon_bwd": Variant(env={"SAFEOPS_GLUON_BWD": "1"}),
    "pair": Variant(fused_noncausal=()),  # the Gluon dK / dV + dQ pair where the fused kernel is the default
    "triton_bwd": Variant(env={"SAFEOPS_GLUON_BWD": "0"}),
    "row_stats": Variant(bwd=dict(row_stats=True), env={"SAFEOPS_GLUON_BWD": "1"}),
    "gluon_seq": Variant(seq=True, env={"SAFEOPS_GLUON_BWD": "1"}),
    "fused_tma": Variant(fused=TMA, head_dims=(128,)),
    "fused_tma_shift": Variant(fused=dict(TMA, shift=True, early_turn=True), head_dims=(128,)),
    "fused_tma_lpt": Variant(fused=dict(TMA, causal_lpt=True, early_turn=True), head_dims=(128,)),
    "fused_tma_dq_early": Variant(fused=dict(TMA, dq_early=True), head_dims=(128,)),
    "fused_tma_row_stats": Variant(fused=dict(TMA, row_stats=True), head_dims=(128,)),
    "fused_tma_shift_rs": Variant(fused=dict(TMA, shift=True, early_turn=True, row_stats=True),
                                  head_dims=(128,)),
    # On the D=128 default (TMA writer, shifted order, row statistics): operand orders (same bits).
    "fused_dqe": Variant(fused=dict(dq_early=True), head_dims=(128,)),
    # The default without the shifted order (what a longer key length could take: the plain order needs no
    # head on the GPU at once).
    "fused_noshift": Variant(fused=dict(shift=False, early_turn=False), head_dims=(128,)),
    "fused_ds_rs": Variant(fused=dict(ds_rs=True), head_dims=(128,)),
    "fused_together": Variant(fused=dict(st_dpt_together=True), head_dims=(128,)),
    "fused_together_ds_rs": Variant(fused=dict(st_dpt_together=True, ds_rs=True), head_dims=(128,)),
    "fused_together_dqe": Variant(fused=dict(st_dpt_together=True, dq_early=True), head_dims=(128,)),
    # D=64: the TMA writer needs dQ split by head-dim columns (FUSED_CONFIGS[64] splits by keys).
    # The dK / dV kernel's GQA split (pair only): off, at every head dim, one query head per CTA.
    "fused_any_group": Variant(fused_max_group=1 << 20),  # the fused kernel whatever the query group
    "no_split": Variant(fused_noncausal=(), split_head_dims=()),
    "split_all": Variant(fused_noncausal=(), split_head_dims=(64, 128), split_min_group={}),
    "split_all_1": Variant(fused_noncausal=(), split_head_dims=(64, 128), split_min_group={},
                           heads_per_program=1),
    "triton_dq": Variant(gluon_dq=False),  # the pair's dq from the Triton dq kernel (dK / dV still Gluon)
    "dq_n64": Variant(dq=dict(block_n=64), head_dims=(64,)),  # the D=64 dQ kernel on 64-key blocks
    # The Triton dq kernel at D=128 in other shapes than its table's (128, 64, 8, 3): 64-query programs (as
    # at D=64, which measured faster than the Gluon dQ kernel there), with and without TMA loads of K / V.
    "triton_dq_m64": Variant(triton_dq=(64, 64, 4, 3), head_dims=(128,)),
    "triton_dq_m64_tma": Variant(triton_dq=(64, 64, 4, 3, False, True), head_dims=(128,)),
    "triton_dq_tma": Variant(triton_dq=(128, 64, 8, 3, False, True), head_dims=(128,)),
    "split_d64_only": Variant(split_head_dims=(64,)),  # the default before 2026-12-07's D=128 rule
    "fused64_tma": Variant(fused=dict(TMA, split_d=True), head_dims=(64,)),
    "fused64_tma_rs": Variant(fused=dict(TMA, split_d=True, row_stats=True), head_dims=(64,)),
    "fused64_tma_dqe_rs": Variant(fused=dict(TMA, split_d=True, dq_early=True, row_stats=True),
                                  head_dims=(64,)),
    "fused64_tma_shift_rs": Variant(fused=dict(TMA, split_d=True, shift=True, early_turn=True,
                                               row_stats=True), head_dims=(64,)),
}


def tflops(b: int, hq: int, s: int, d: int, causal: bool, ms: float, wl: int = -1, docs=None) -> float:
    """Of the pairs computed: per sequence, each query's visible keys (causal, window) x 4 D x 2.5."""
    pairs = 0
    for n in docs or (s,) * b:
        for i in range(n) if wl >= 0 else ():
            pairs += min(i if causal else n - 1, n - 1) - max(i - wl, 0) + 1
        if wl < 0:
            pairs += n * (n + 1) // 2 if causal else n * n
    return 2.5 * 4 * hq * pairs * d / ms / 1e9


@contextlib.contextmanager
def applied(variant: Variant, d: int):
    """The variant's switches and configuration changes, for the block; plans cleared on entry and exit."""
    KB = G.bwd_kernels()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, variant.env))
        stack.enter_context(mock.patch.object(G, "GLUON_FUSED", variant.fused is not None))
        stack.enter_context(mock.patch.object(G, "GLUON_BWD_SEQ", variant.seq))
        stack.enter_context(mock.patch.object(G, "GLUON_DQ", variant.gluon_dq))
        if variant.fused_noncausal is not None:
            stack.enter_context(mock.patch.object(G, "FUSED_NONCAUSAL", variant.fused_noncausal))
        if variant.fused_max_group is not None:
            stack.enter_context(mock.patch.object(G, "FUSED_MAX_GROUP", variant.fused_max_group))
        if variant.split_head_dims is not None:
            stack.enter_context(mock.patch.object(G, "SPLIT_HEAD_DIMS", variant.split_head_dims))
        if variant.split_min_group is not None:
            stack.enter_context(mock.patch.object(G, "SPLIT_MIN_GROUP", variant.split_min_group))
        if variant.heads_per_program is not None:
            stack.enter_context(mock.patch.object(L, "DKDV_HEADS_PER_PROGRAM", variant.heads_per_program))
        if variant.fused is not None:
            cfg = dataclasses.replace(KB.FUSED_CONFIGS[d], **variant.fused)
            stack.enter_context(mock.patch.dict(KB.FUSED_CONFIGS, {d: cfg}))
        if variant.triton_dq is not None:
            stack.enter_context(L.config_override(dq=L.AttnConfig(*variant.triton_dq)))
        if variant.dq is not None:
            cfg = dataclasses.replace(KB.DQ_CONFIGS[d], **variant.dq)
            stack.enter_context(mock.patch.dict(KB.DQ_CONFIGS, {d: cfg}))
        if variant.bwd is not None:
            cfg = dataclasses.replace(KB.BWD_CONFIGS[d], **variant.bwd)
            stack.enter_context(mock.patch.dict(KB.BWD_CONFIGS, {d: cfg}))
        L.clear_plans()
        try:
            yield
        finally:
            L.clear_plans()


def run_shape(name: str, shape: tuple, variants: dict[str, Variant], rep_ms: float) -> None:
    b, hq, hkv, s, d, causal = shape[:6]
    wl = shape[6] if len(shape) > 6 else -1
    docs = shape[7] if len(shape) > 7 else None
    # Packed: (T, H, D) tensors and cu_seqlens; otherwise (B, H, S, D).
    dims_q, dims_k = ((s, hq, d), (s, hkv, d)) if docs else ((b, hq, s, d), (b, hkv, s, d))
    q, g = (torch.randn(*dims_q, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(*dims_k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = None
    longest = s
    if docs:
        cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        longest = max(docs)
    scale = 1 / math.sqrt(d)
    wr = 0 if causal else -1
    out, m, l = torch.ops.safeops.attention(q, k, v, None, 0, cu, cu, longest, longest, causal, scale, None,
                                            wl, wr, 0)

    def backward():
        return torch.ops.safeops.attention_backward(g, q, k, v, out, m, l, None, 0, cu, cu, longest, longest,
                                                    causal, scale, None, wl, wr, 0)

    reference = None
    for vname, variant in variants.items():
        if d not in variant.head_dims:
            continue
        try:
            with applied(variant, d):
                t0 = time.time()
                grads = backward()
                torch.cuda.synchronize()
                first = time.time() - t0
                ms = bench_ms(backward, rep_ms=rep_ms)[0]
                again = backward()
        except Exception as e:  # noqa: BLE001 - reported, the other variants still run
            print(f"{name:20s} {vname:20s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        grads = [t.float() for t in grads]
        if reference is None and vname == "default":
            reference = grads
        diff = (max((a - r).abs().max().item() for a, r in zip(grads, reference, strict=True))
                if reference is not None else float("nan"))
        same = all(torch.equal(a.float(), x) for a, x in zip(again, grads, strict=True))
        rate = tflops(b, hq, s, d, causal, ms, wl, docs)
        print(f"{name:20s} {vname:20s} {ms:8.3f} ms {rate:6.0f} TFLOP/s  "
              f"max|diff to default| {diff:.3g}  rerun same bits {same}  first call {first:.1f} s",
              flush=True)
    if docs or wl >= 0:  # cuDNN through SDPA takes neither packed sequences nor a window
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=hq != hkv)
        ms = bench_ms(lambda: torch.autograd.grad(o, (qq, kk, vv), g, retain_graph=True), rep_ms=rep_ms)[0]
    print(f"{name:20s} {'cudnn':20s} {ms:8.3f} ms {tflops(b, hq, s, d, causal, ms):6.0f} TFLOP/s", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--rep-ms", type=float, default=200, help="timing time per case (do_bench)")
    parser.add_argument("--warm", action="store_true", help="compile only (small shapes, briefly timed)")
    parser.add_argument("--compile-first", action="store_true",
                        help="compile each variant in its own process, in parallel, before timing")
    args = parser.parse_args(argv)
    # The default first: the bits every other variant is compared with.
    variants = {"default": VARIANTS["default"],
                **{n: VARIANTS[n] for n in args.variants.split(",") if n != "default"}}
    if not torch.cuda.is_available():
        sys.exit("bench/attention_bwd_configs.py needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    if args.compile_first:
        t0 = time.time()
        procs = [subprocess.Popen([sys.executable, __file__, "--warm", "--variants", name, "--shapes",
                                   args.shapes], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for name in variants]
        codes = [p.wait() for p in procs]
        print(f"compiled {len(procs)} variants in parallel in {time.time() - t0:.0f} s (exit codes {codes})",
              flush=True)
    torch.manual_seed(0)
    if args.warm:
        dims = {SHAPES[n][4] for n in args.shapes.split(",")}
        for d in sorted(dims):
            for i, shape in enumerate(WARM_SHAPES[d]):
                run_shape(f"warm {i}", shape, variants, 5)
        return
    for name in args.shapes.split(","):
        run_shape(name, SHAPES[name], variants, args.rep_ms)


if __name__ == "__main__":
    main()
