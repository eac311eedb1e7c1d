"""Context-parallel attention on several GPUs (NCCL): safeops.distributed against one GPU and against
PyTorch's own ``torch.distributed.tensor.experimental.context_parallel`` with SDPA.

For each total sequence length S (bf16, B=1, H heads, head dim D), causal and not, it times with CUDA events:

- ``1 GPU``: ``safeops.attention`` on the whole sequence on rank 0 (the scaling baseline);
- ``safeops <layout>/<strategy>``: ``context_parallel_attention`` on each rank's shard, for every layout
  (contiguous, zigzag) and strategy (ring, allgather); the time is the slowest rank's;
- ``torch CP (SDPA <backend>)``: SDPA inside ``context_parallel`` (its load-balanced layout and its default
  rotation), when importable;

forward alone and forward+backward, in ms and in TFLOP/s per GPU (forward 4 B H S^2 D, halved when causal,
backward 2.5x the forward). For the ring it also reports the overlap: the same ring with communication
replaced by nothing (compute only), the k/v (and dk/dv) transfers alone (communication only), and
``overlap = (compute + comm - ring) / min(compute, comm)``: 1 when the transfers hide completely behind the
attention, 0 when they run back to back.

    python3 bench/context_parallel.py --out DIR [--world 2] [--seqlens 32K,128K] [--heads 16]
        [--kv-heads 16] [--d 128] [--causal 1,0] [--layouts zigzag,contiguous] [--strategies ring,allgather]
        [--reps 5] [--no-peer]

Writes DIR/context_parallel.csv and DIR/context_parallel.md (a table for bench/RESULTS.md). Needs
``--world`` CUDA GPUs; ranks are spawned here (no torchrun), rendezvous through a file in DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _harness import device_meta, parse_sizes, require_cuda, size_label  # noqa: E402

FIELDS = ["S", "causal", "impl", "fwd_ms", "fwdbwd_ms", "fwd_tflops_per_gpu", "fwdbwd_tflops_per_gpu",
          "ring_fwd_ms", "compute_fwd_ms", "comm_fwd_ms", "overlap_fwd",
          "ring_bwd_ms", "compute_bwd_ms", "comm_bwd_ms", "overlap_bwd", "note"]


def _time_ms(fn, reps: int, warmup: int = 2, collective: bool = True) -> float:
    """Median CUDA-event time of ``fn`` over ``reps`` runs, the slowest rank's (all ranks run it); with
    ``collective=False`` this rank's alone (no barrier, no all-reduce)."""
    collective = collective and dist.is_initialized()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if collective:
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    median = sorted(times)[len(times) // 2]
    if not collective:
        return median
    ms = torch.tensor(median, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms)


def _flops(s: int, h: int, d: int, causal: bool) -> float:
    return 4.0 * h * s * s * d / (2 if causal else 1)


def _inputs(shape_q, shape_kv, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(shape_q, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(shape_kv, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape_kv, generator=gen, device="cuda", dtype=torch.bfloat16)
    return q, k, v


def _fwd_bwd(fn, q, k, v):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    grad = torch.ones_like(q)

    def run():
        for t in leaves:
            t.grad = None
        out = fn(*leaves)
        out.backward(grad)

    return run


def _row(s, causal, impl, fwd, fwdbwd, flops, world, **extra) -> dict:
    row = dict(S=s, causal=int(causal), impl=impl, fwd_ms=fwd, fwdbwd_ms=fwdbwd,
               fwd_tflops_per_gpu=flops / world / fwd / 1e9 if fwd else None,
               fwdbwd_tflops_per_gpu=3.5 * flops / world / fwdbwd / 1e9 if fwdbwd else None)
    row.update(extra)
    return row


def _overlap(ring, compute, comm):
    return (compute + comm - ring) / min(compute, comm) if min(compute, comm) > 0 else None


def _ring_overlap(q, k, v, causal, layout, reps):
    """(ring, compute-only, comm-only) for the forward and for the backward ring, in ms."""
    import safeops.distributed as module

    world, rank = dist.get_world_size(), dist.get_rank()
    from safeops import functional

    scale, softcap, _, _, code = functional._attention_options(q, None, None, None, causal, False, None)
    cfg = module._Config(group=dist.group.WORLD, world=world, rank=rank, is_causal=causal, scale=scale,
                         softcap=softcap, precision=code, layout=layout, strategy="ring")
    out, m, l = module._ring_forward(cfg, q, k, v)
    grad = torch.ones_like(out)
    ring_f = _time_ms(lambda: module._ring_forward(cfg, q, k, v), reps)
    ring_b = _time_ms(lambda: module._ring_backward(cfg, grad, q, k, v, out, m, l), reps)
    real_exchange = module._exchange
    module._exchange = lambda cfg, send, recv, tags: []  # compute only: no transfer (recv holds garbage)
    try:
        comp_f = _time_ms(lambda: module._ring_forward(cfg, q, k, v), reps)
        comp_b = _time_ms(lambda: module._ring_backward(cfg, grad, q, k, v, out, m, l), reps)
    finally:
        module._exchange = real_exchange
    kv = (k.contiguous(), v.contiguous())
    dkv = (torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device))

    def comm_fwd():
        for _ in range(world - 1):
            module._wait(real_exchange(cfg, kv, tuple(torch.empty_like(t) for t in kv), (0, 1)))

    def comm_bwd():
        for step in range(world):
            works = real_exchange(cfg, dkv, tuple(torch.empty_like(t) for t in dkv), (2, 3))
            if step + 1 < world:
                works += real_exchange(cfg, kv, tuple(torch.empty_like(t) for t in kv), (0, 1))
            module._wait(works)

    comm_f = _time_ms(comm_fwd, reps)
    comm_b = _time_ms(comm_bwd, reps)
    return dict(ring_fwd_ms=ring_f, compute_fwd_ms=comp_f, comm_fwd_ms=comm_f,
                overlap_fwd=_overlap(ring_f, comp_f, comm_f), ring_bwd_ms=ring_b, compute_bwd_ms=comp_b,
                comm_bwd_ms=comm_b, overlap_bwd=_overlap(ring_b, comp_b, comm_b))


def _torch_cp_one(args, s, causal, mesh, backend) -> tuple[float, float]:
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import sdpa_kernel

    def attn(q_, k_, v_):
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)

    q, k, v = _inputs((1, args.heads, s, args.d), (1, args.heads, s, args.d), seed=1)
    # The buffers are the full sequence; inside the context they are this rank's (load-balanced) shards.
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}), \
            sdpa_kernel([backend]):
        fwd = _time_ms(lambda: attn(q, k, v), args.reps)
        fwdbwd = _time_ms(_fwd_bwd(attn, q, k, v), args.reps)
    return fwd, fwdbwd


def _torch_cp_rows(args, s, causal, world, flops) -> list[dict]:
    """SDPA inside torch's context_parallel (flash, then cuDNN), each as its own row."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
        from torch.nn.attention import SDPBackend
    except Exception as e:  # noqa: BLE001
        return [_row(s, causal, "torch CP (SDPA)", None, None, flops, world, note=f"unavailable: {e}")]
    mesh = init_device_mesh("cuda", (world,))
    rows = []
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        impl = f"torch CP (SDPA {name})"
        try:
            fwd, fwdbwd = _torch_cp_one(args, s, causal, mesh, backend)
            rows.append(_row(s, causal, impl, fwd, fwdbwd, flops, world, note="heads = kv heads (no GQA)"))
        except Exception as e:  # noqa: BLE001
            first = str(e).splitlines()[0][:120] if str(e) else ""
            note = f"failed: {type(e).__name__}: {first}"
            rows.append(_row(s, causal, impl, None, None, flops, world, note=note))
        torch.cuda.empty_cache()
    return rows


def _single_gpu_row(args, s: int, causal: bool, rank: int, flops: float) -> dict:
    """One GPU, whole sequence: rank 0 times it, then shares the numbers."""
    import safeops

    def single(q_, k_, v_):
        return safeops.attention(q_, k_, v_, is_causal=causal)

    fwd = fwdbwd = 0.0
    if rank == 0:
        q, k, v = _inputs((1, args.heads, s, args.d), (1, args.kv_heads, s, args.d), seed=0)
        fwd = _time_ms(lambda: single(q, k, v), args.reps, collective=False)
        fwdbwd = _time_ms(_fwd_bwd(single, q, k, v), args.reps, collective=False)
    pair = torch.tensor([fwd, fwdbwd], device="cuda")
    dist.broadcast(pair, 0)
    torch.cuda.empty_cache()
    return _row(s, causal, "1 GPU safeops.attention", float(pair[0]), float(pair[1]), flops, 1)


def _ours_row(args, s: int, causal: bool, layout: str, strategy: str, rank: int, flops: float) -> dict:
    import safeops.distributed as cp

    s_local = s // args.world
    q, k, v = _inputs((1, args.heads, s_local, args.d), (1, args.kv_heads, s_local, args.d), seed=rank + 1)

    def ours(q_, k_, v_):
        return cp.context_parallel_attention(q_, k_, v_, is_causal=causal, layout=layout, strategy=strategy)

    fwd = _time_ms(lambda: ours(q, k, v), args.reps)
    fwdbwd = _time_ms(_fwd_bwd(ours, q, k, v), args.reps)
    extra = _ring_overlap(q, k, v, causal, layout, args.reps) if strategy == "ring" else {}
    torch.cuda.empty_cache()
    return _row(s, causal, f"safeops {layout}/{strategy}", fwd, fwdbwd, flops, args.world, **extra)


def _worker(rank: int, args, init_file: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=args.world,
                            device_id=torch.device("cuda", rank))
    rows: list[dict] = []
    deadline = time.time() + args.budget_s
    try:
        for s in args.seqlens:
            for causal in args.causal:
                go = torch.tensor([time.time() < deadline], device="cuda")
                dist.broadcast(go, 0)  # every rank stops at the same shape
                if not bool(go):
                    break
                flops = _flops(s, args.heads, args.d, causal)
                rows.append(_single_gpu_row(args, s, causal, rank, flops))
                for layout in args.layouts:
                    for strategy in args.strategies:
                        rows.append(_ours_row(args, s, causal, layout, strategy, rank, flops))
                        if rank == 0:
                            print(rows[-1], flush=True)
                if args.peer:
                    rows += _torch_cp_rows(args, s, causal, args.world, flops)
        if rank == 0:
            _report(rows, args)
    finally:
        dist.destroy_process_group()


def _fmt(x, spec="{:.2f}") -> str:
    return "-" if x is None else spec.format(x)


def _report(rows: list[dict], args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "context_parallel.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in FIELDS})
    meta = device_meta()
    lines = [f"### Context-parallel attention, {args.world} GPUs ({meta['gpu']}, torch {meta['torch']}, "
             f"triton {meta['triton']}, {meta['date']})", "",
             f"bf16, B=1, H={args.heads}, Hkv={args.kv_heads}, D={args.d}. Times are the slowest rank's "
             "median; TFLOP/s per GPU (backward counted as 2.5x the forward).", "",
             "| S | causal | implementation | fwd ms | fwd+bwd ms | fwd TF/GPU | fwd+bwd TF/GPU | "
             "overlap fwd | overlap bwd | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {size_label(r['S'])} | {r['causal']} | {r['impl']} | {_fmt(r['fwd_ms'])} | "
                     f"{_fmt(r['fwdbwd_ms'])} | {_fmt(r['fwd_tflops_per_gpu'], '{:.0f}')} | "
                     f"{_fmt(r['fwdbwd_tflops_per_gpu'], '{:.0f}')} | {_fmt(r.get('overlap_fwd'))} | "
                     f"{_fmt(r.get('overlap_bwd'))} | {r.get('note') or ''} |")
    ring = [r for r in rows if r.get("ring_fwd_ms")]
    if ring:
        lines += ["", "Ring overlap (ms): ring = compute + comm - hidden.", "",
                  "| S | causal | layout | ring fwd | compute fwd | comm fwd | ring bwd | compute bwd "
                  "| comm bwd |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in ring:
            lines.append(f"| {size_label(r['S'])} | {r['causal']} | {r['impl'].split()[1]} | "
                         f"{_fmt(r['ring_fwd_ms'])} | {_fmt(r['compute_fwd_ms'])} | "
                         f"{_fmt(r['comm_fwd_ms'])} | {_fmt(r['ring_bwd_ms'])} | "
                         f"{_fmt(r['compute_bwd_ms'])} | {_fmt(r['comm_bwd_ms'])} |")
    text = "\n".join(lines) + "\n"
    (out / "context_parallel.md").write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(HERE / "out"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seqlens", type=parse_sizes, default=parse_sizes("32K,128K"))
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--causal", type=lambda t: [bool(int(x)) for x in t.split(",")],
                        default=[True, False])
    parser.add_argument("--layouts", type=lambda t: t.split(","), default=["zigzag", "contiguous"])
    parser.add_argument("--strategies", type=lambda t: t.split(","), default=["ring", "allgather"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting new shapes after this")
    parser.add_argument("--no-peer", dest="peer", action="store_false")
    args = parser.parse_args()
    require_cuda("bench/context_parallel.py")
    if torch.cuda.device_count() < args.world:
        sys.exit(f"bench/context_parallel.py: needs {args.world} GPUs, found {torch.cuda.device_count()}")
    for s in args.seqlens:
        chunks = 2 * args.world
        if s % chunks:
            sys.exit(f"sequence length {s} is not a multiple of {chunks} (zigzag over {args.world} ranks)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    init_file = os.path.join(os.path.abspath(args.out), f".rendezvous_{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.remove(init_file)
    try:
        mp.spawn(_worker, args=(args, init_file), nprocs=args.world, join=True)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(init_file)


if __name__ == "__main__":
    main()
