"""One Triton launch for the GQA split's partial sums: an experiment, not wired into the launcher.

When the dk/dv kernel splits a kv head's query group over SPLIT programs (``attention_launch.dkdv_split``),
each program writes an fp32 partial, and the backward then runs ``_sum_split`` on dk and on dv (two torch
sums) and ``dk.copy_`` / ``dv.copy_`` (two casts to the gradient dtype): four kernels, two fp32 temporaries
and four host dispatches per backward. ``split_sum`` here does the same in ONE launch: it reads the fp32
partials of dk and dv, sums each kv head's SPLIT partials and stores the result in dk's / dv's dtype
(round to nearest even, as ``copy_``) and layout.

Bits: the sum must be the one ``_sum_split`` computes, in its order:

- on the CPU, torch sums the SPLIT partials one after another from +0: ``((0 + x0) + x1) + ...``
  (``order="sequential"``);
- on CUDA, torch's reduction (ATen Reduce.cuh, ``thread_reduce_impl`` with vt0 = 4) gives each thread a
  whole output here (SPLIT < 64 inputs per output, reduced along a strided dimension) and keeps four
  accumulators: accumulator j sums x_j, x_{j+4}, x_{j+8}, ... in turn from +0, and the result is
  ``((acc0 + acc1) + acc2) + acc3`` (``order="cuda"``). For SPLIT <= 4 this equals the sequential order
  (adding +0 changes no nonzero value and turns -0 into +0 in both), for SPLIT = 8 (the 1.1B Llama: 32
  query / 4 kv heads) it does not.

``order=None`` is the cuda order (the kernel is for CUDA; torch's CPU sum is sequential for SPLIT <= 4 and
shape-dependent beyond). The CPU checks (tests/test_attn_split_sum.py, the interpreter) compare both orders
with an fp32 emulation and, for SPLIT <= 4, with the real CPU ``_sum_split`` + ``copy_``; only the GPU mode
compares the cuda order with the real CUDA ``_sum_split`` + ``copy_`` at SPLIT = 8 (unverified until then).

    python3 bench/attn_split_sum.py                 # GPU: bits vs the current path, device + host time
    python3 bench/attn_split_sum.py --self-check    # CPU (interpreter) or GPU: bits only, small shapes
    /tmp/t36/bin/python bench/attn_split_sum.py --compile-only   # sm_90 regs / spills / smem, no torch
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(HERE), HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

try:  # on a CPU-only machine this turns on Triton's interpreter before the kernel below is defined
    import safeops  # noqa: F401
except ImportError:  # --compile-only under a Triton-only venv (no torch)
    pass

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ORDERS = ("sequential", "cuda")
SPLIT_MAX = 63  # Reduce.cuh keeps one thread per output below 64 inputs per output (see the docstring)
# Rows (kv head x position) per program and warps: 32 x 8 keeps D=64 / split 8 at ~120 registers; 32 x 4
# needs 222 and 64 x 4 spills (offline sm_90, Triton 3.6: --compile-only). The GPU mode times a few.
BLOCK_R = 32
NUM_WARPS = 8


@triton.jit
def _sum_tile(part_ptr, out_ptr, r0, rows, n_heads, inner, dim, spo, sph, spi, soo, soh, soi,
              SPLIT: tl.constexpr, CUDA_ORDER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows r0 .. r0 + BLOCK_R of the flattened (outer, kv head, inner) output: outer / inner are (batch,
    position) dense and (token, 1) packed. Partial j of kv head h is head h * SPLIT + j of the partials."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_r < rows)[:, None] & (offs_d < dim)[None, :]
    i = offs_r % inner
    t = offs_r // inner
    h = t % n_heads
    o = t // n_heads
    p_rows = o.to(tl.int64) * spo + (h * SPLIT).to(tl.int64) * sph + i.to(tl.int64) * spi
    p_ptrs = part_ptr + p_rows[:, None] + offs_d[None, :]
    a0 = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    a1 = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    a2 = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    a3 = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for j in tl.static_range(SPLIT):
        x = tl.load(p_ptrs + j * sph, mask=ok, other=0.0)
        if CUDA_ORDER:
            if j % 4 == 0:
                a0 = a0 + x
            elif j % 4 == 1:
                a1 = a1 + x
            elif j % 4 == 2:
                a2 = a2 + x
            else:
                a3 = a3 + x
        else:
            a0 = a0 + x
    if CUDA_ORDER:
        acc = ((a0 + a1) + a2) + a3
    else:
        acc = a0
    o_rows = o.to(tl.int64) * soo + h.to(tl.int64) * soh + i.to(tl.int64) * soi
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def attn_split_sum_kernel(
    dkp_ptr, dvp_ptr, dk_ptr, dv_ptr, rows, n_heads, inner, n_blocks_k,
    skpo, skph, skpi, svpo, svph, svpi, sko, skh, ski, svo, svh, svi,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, SPLIT: tl.constexpr, CUDA_ORDER: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Programs 0 .. n_blocks_k - 1 sum dk's partials, the rest dv's (same rows, own head dim)."""
    pid = tl.program_id(0)
    if pid < n_blocks_k:
        _sum_tile(dkp_ptr, dk_ptr, pid * BLOCK_R, rows, n_heads, inner, HEAD_DIM, skpo, skph, skpi,
                  sko, skh, ski, SPLIT, CUDA_ORDER, BLOCK_R, BLOCK_D)
    else:
        _sum_tile(dvp_ptr, dv_ptr, (pid - n_blocks_k) * BLOCK_R, rows, n_heads, inner, HEAD_DIM_V, svpo,
                  svph, svpi, svo, svh, svi, SPLIT, CUDA_ORDER, BLOCK_R, BLOCK_DV)


def _block(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _strides3(t, varlen: bool) -> tuple[int, int, int]:
    """(outer, head, inner) strides: dense (B, H, S, D) -> (b, h, s); packed (T, H, D) -> (t, h, 0)."""
    if varlen:
        return t.stride(0), t.stride(1), 0
    return t.stride(0), t.stride(1), t.stride(2)


def launch_args(dk_part, dv_part, dk, dv, split: int, varlen: bool, order: str | None = None,
                block_r: int = BLOCK_R, num_warps: int = NUM_WARPS) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, keyword arguments) of the one launch; checks the shapes."""
    if order is None:
        order = "cuda"
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
    if not 1 <= split <= SPLIT_MAX:
        raise ValueError(f"split: expected 1 .. {SPLIT_MAX}, got {split}")
    for name, part, out in (("dk_part", dk_part, dk), ("dv_part", dv_part, dv)):
        want = ((out.shape[0], out.shape[1] * split, out.shape[2]) if varlen else
                (out.shape[0], out.shape[1] * split, *out.shape[2:]))
        if tuple(part.shape) != tuple(want):
            raise ValueError(f"{name}: expected shape {want} for split {split}, got {tuple(part.shape)}")
        if part.stride(-1) != 1 or out.stride(-1) != 1:
            raise ValueError(f"{name}: the head dim must have stride 1 in the partials and the result")
    if varlen:
        rows_o, n_heads, inner = dk.shape[0], dk.shape[1], 1
    else:
        rows_o, n_heads, inner = dk.shape[0], dk.shape[1], dk.shape[2]
    if dv.shape[:-1] != dk.shape[:-1]:
        raise ValueError(f"dv: expected the leading dims of dk {tuple(dk.shape[:-1])}, got {tuple(dv.shape)}")
    rows = rows_o * n_heads * inner
    n_blocks = -(-rows // block_r)
    args = (dk_part, dv_part, dk, dv, rows, n_heads, inner, n_blocks,
            *_strides3(dk_part, varlen), *_strides3(dv_part, varlen), *_strides3(dk, varlen),
            *_strides3(dv, varlen))
    kwargs = dict(HEAD_DIM=dk.shape[-1], HEAD_DIM_V=dv.shape[-1], SPLIT=split, CUDA_ORDER=order == "cuda",
                  BLOCK_R=block_r, BLOCK_D=_block(dk.shape[-1]), BLOCK_DV=_block(dv.shape[-1]),
                  num_warps=num_warps, enable_fp_fusion=False)  # adds only; off as on every safeops launch
    return (2 * n_blocks,), args, kwargs


def split_sum(dk_part, dv_part, dk, dv, split: int, varlen: bool, order: str | None = None,
              block_r: int = BLOCK_R, num_warps: int = NUM_WARPS) -> None:
    """Writes ``dk = _sum_split(dk_part)`` and ``dv = _sum_split(dv_part)`` cast to their dtypes, in place,
    in one launch. Partials: (B, Hkv * split, S, D) dense or (T, Hkv * split, D) packed, fp32."""
    from safeops.ops._launch import launch

    grid, args, kwargs = launch_args(dk_part, dv_part, dk, dv, split, varlen, order, block_r, num_warps)
    if args[4] == 0:
        return
    launch(attn_split_sum_kernel, grid, *args, **kwargs)


# ------------------------------------------------------------------------------------------------------
# References: the current code path and the two orders written out in fp32 torch
# ------------------------------------------------------------------------------------------------------


def current_path(dk_part, dv_part, dk, dv, split: int, varlen: bool) -> None:
    """What ``attention_launch.backward`` does today: two ``_sum_split`` and two ``copy_``."""
    from safeops.ops.attention_launch import _sum_split

    dk_, dv_ = _sum_split(dk_part, split, varlen), _sum_split(dv_part, split, varlen)
    dk.copy_(dk_)
    dv.copy_(dv_)


def emulate(part, split: int, varlen: bool, order: str):
    """fp32 sum of the partials in ``order``, one elementwise add at a time (any device)."""
    import torch

    if varlen:
        t, h, d = part.shape
        x = part.view(t, h // split, split, d)
        xs = [x[:, :, j] for j in range(split)]
    else:
        b, h, s, d = part.shape
        x = part.view(b, h // split, split, s, d)
        xs = [x[:, :, j] for j in range(split)]
    zero = torch.zeros_like(xs[0])
    if order == "sequential":
        acc = zero
        for x_j in xs:
            acc = acc + x_j
        return acc
    accs = [zero] * 4
    for j, x_j in enumerate(xs):
        accs[j % 4] = accs[j % 4] + x_j
    return ((accs[0] + accs[1]) + accs[2]) + accs[3]


def make_case(b: int, hkv: int, s: int, d: int, dv: int, split: int, dtype, device, varlen: bool,
              layout: str = "bhsd", seed: int = 0, signed_zeros: bool = False):
    """(dk_part, dv_part, dk, dv): random fp32 partials (contiguous, as the launcher allocates them) and
    empty results of ``dtype`` in ``layout`` ("bhsd" contiguous, "bshd" = a (B, S, H, D) tensor transposed,
    the layout of a transformers model's k / v, kept by ``empty_like(k)``). ``signed_zeros``: a few columns
    are +-0 in every partial, a few others cancel (the second half of the partials negates the first)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)

    def part(dim):
        shape = (b * s, hkv * split, dim) if varlen else (b, hkv * split, s, dim)
        x = torch.randn(shape, generator=gen, dtype=torch.float32) * 3.0
        # a wide spread of exponents makes the order of the adds visible in the low bits
        x = x * torch.exp2(torch.randint(-12, 13, shape, generator=gen).float())
        if signed_zeros:  # columns [0, c): +-0 in every partial; [c, 2c): second half = -first half
            grp = x.view(b * s, hkv, split, dim) if varlen else x.view(b, hkv, split, s, dim)
            c = max(1, dim // 8)
            grp[..., :c] = torch.where(torch.rand(grp[..., :c].shape, generator=gen) < 0.5, 0.0, -0.0)
            half = split // 2
            if half:
                grp[:, :, split - half:][..., c:2 * c] = -grp[:, :, :half][..., c:2 * c]
        return x.to(device)

    def result(dim):
        if varlen:
            return torch.empty(b * s, hkv, dim, dtype=dtype, device=device)
        if layout == "bshd":
            return torch.empty(b, s, hkv, dim, dtype=dtype, device=device).transpose(1, 2)
        return torch.empty(b, hkv, s, dim, dtype=dtype, device=device)

    return part(d), part(dv), result(d), result(dv)


def same_bits(a, b) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


# (B, Hkv, S, D, DV, split, varlen, layout): GQA shapes, splits 2 .. 8, a padded and an unequal head dim
CHECK_CASES = [(2, 2, 24, 16, 16, 2, False, "bhsd"), (1, 2, 40, 32, 32, 4, False, "bshd"),
               (1, 1, 33, 24, 40, 8, False, "bhsd"), (2, 2, 20, 16, 16, 3, True, "bhsd"),
               (1, 2, 17, 16, 32, 8, True, "bhsd"), (1, 1, 8, 16, 16, 6, False, "bhsd")]


def self_check(device: str = "cpu", cases=CHECK_CASES, dtypes=None, log=print, seed: int = 0,
               orders=ORDERS) -> int:
    """Bits of ``split_sum`` against the emulation of each order (every case), and of the default (cuda)
    order against the current path: on CUDA always; on the CPU only for split <= 4, where torch's CPU sum
    is sequential, which equals the cuda order there (for larger splits the CPU sum's order depends on the
    shape). bf16 is left out on the CPU: Triton's interpreter truncates fp32 -> bf16 instead of rounding
    to nearest even (the GPU's cvt.rn). Returns the number of failures."""
    import torch

    on_cpu = torch.device(device).type == "cpu"
    dtypes = dtypes or ((torch.float32, torch.float16) if on_cpu else
                        (torch.float32, torch.float16, torch.bfloat16))
    bad, n = 0, 0
    for case in cases:
        b, hkv, s, d, d_v, split, varlen, layout = case
        for dtype in dtypes:
            for zeros in (False, True):
                n += 1
                dkp, dvp, dk, dv = make_case(b, hkv, s, d, d_v, split, dtype, device, varlen, layout,
                                             seed=seed + n, signed_zeros=zeros)
                notes = []
                if not on_cpu or split <= 4:
                    ref_k, ref_v = torch.empty_like(dk), torch.empty_like(dv)
                    current_path(dkp, dvp, ref_k, ref_v, split, varlen)
                    split_sum(dkp, dvp, dk, dv, split, varlen)
                    if not (same_bits(dk, ref_k) and same_bits(dv, ref_v)):
                        notes.append("vs current path")
                for order in orders:
                    ek, ev = (emulate(p, split, varlen, order).to(dtype) for p in (dkp, dvp))
                    out_k, out_v = torch.empty_like(dk), torch.empty_like(dv)
                    split_sum(dkp, dvp, out_k, out_v, split, varlen, order=order)
                    if not (same_bits(out_k, ek) and same_bits(out_v, ev)):
                        notes.append(f"vs {order} emulation")
                bad += bool(notes)
                log(f"split_sum {case} {str(dtype)[6:]} zeros={zeros} seed={seed + n}: "
                    f"{'DIFFERENT ' + ', '.join(notes) if notes else 'same bits'}")
    return bad


# ------------------------------------------------------------------------------------------------------
# GPU timing: device time and host time per call, the current path against the one launch
# ------------------------------------------------------------------------------------------------------


def _host_us(fn, n: int = 200) -> float:
    """Host time to enqueue one call (no synchronization inside the loop), in microseconds."""
    import torch

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


# (label, (B, Hkv, S, D, DV, split, varlen, layout), result dtype); the first gets every tile of ``tiles``
GPU_SHAPES = [("llama-1.1B", (1, 4, 4096, 64, 64, 8, False, "bshd"), "bfloat16"),
              ("llama-1.1B bhsd", (1, 4, 4096, 64, 64, 8, False, "bhsd"), "bfloat16"),
              ("B4 Hkv8 S4K D128 split4", (4, 8, 4096, 128, 128, 4, False, "bhsd"), "bfloat16"),
              ("varlen T=16K Hkv4 D64 split8", (4, 4, 4096, 64, 64, 8, True, "bhsd"), "bfloat16"),
              ("llama-1.1B fp32 grads", (1, 4, 4096, 64, 64, 8, False, "bshd"), "float32")]


def gpu_bench(tiles=((16, 4), (32, 4), (32, 8), (64, 8)), log=None, device: str = "cuda", shapes=None,
              check_dtype: str = "bfloat16", timer=None, host=None) -> int:
    """The 1.1B Llama's split (B=1, Hkv=4, S=4096, D=64, split=8, bf16, bshd-strided dk / dv) and a few
    others: bits against the current path and device / host time of both. Returns the number of failures.
    ``device`` / ``shapes`` / ``check_dtype`` / ``timer(fn) -> ms`` / ``host(fn) -> us``: for a CPU dry
    run of this code (tests)."""
    import torch

    log = log or functools.partial(print, flush=True)
    if timer is None:
        from _harness import bench_ms

        def timer(fn):
            return bench_ms(fn, 25, 100)[0]
    host = host or _host_us
    # every check case in one dtype (each compiles a kernel: ~1 s), the cuda order only; more dtypes below
    bad = self_check(device, dtypes=(getattr(torch, check_dtype),), orders=("cuda",), log=log)
    log(f"self-check on {device}: {bad} failures")
    shapes = shapes or GPU_SHAPES
    for label, (b, hkv, s, d, d_v, split, varlen, layout), dtype_name in shapes:
        dtype = getattr(torch, dtype_name)
        dkp, dvp, dk, dv = make_case(b, hkv, s, d, d_v, split, dtype, device, varlen, layout)
        ref_k, ref_v = torch.empty_like(dk), torch.empty_like(dv)
        current_path(dkp, dvp, ref_k, ref_v, split, varlen)
        seq_k, seq_v = torch.empty_like(dk), torch.empty_like(dv)
        split_sum(dkp, dvp, seq_k, seq_v, split, varlen, order="sequential")
        seq_same = same_bits(seq_k, ref_k) and same_bits(seq_v, ref_v)
        emu_same = all(same_bits(emulate(p, split, varlen, "cuda").to(dtype), r)
                       for p, r in ((dkp, ref_k), (dvp, ref_v)))
        moved = (dkp.numel() + dvp.numel()) * 4 + (dk.numel() + dv.numel()) * dk.element_size()
        cur = functools.partial(current_path, dkp, dvp, dk, dv, split, varlen)
        ms = timer(cur)
        log(f"{label}: current (2 sums + 2 copies) {ms * 1e3:.1f} us device, {host(cur):.1f} us host; "
            f"{moved / ms / 1e6:.0f} GB/s of the one-pass traffic; sequential order gives the current bits: "
            f"{seq_same} (expected {split <= 4}); torch adds in the cuda order give them: {emu_same} "
            "(expected True)")
        bad += not emu_same
        tiles_here = tiles if label == shapes[0][0] else ((BLOCK_R, NUM_WARPS),)
        for block_r, nw in tiles_here:
            out_k, out_v = torch.empty_like(dk), torch.empty_like(dv)
            new = functools.partial(split_sum, dkp, dvp, out_k, out_v, split, varlen, block_r=block_r,
                                    num_warps=nw)
            try:
                new()
                if device == "cuda":
                    torch.cuda.synchronize()
                same = same_bits(out_k, ref_k) and same_bits(out_v, ref_v)
                bad += not same
                ms_new = timer(new)
                log(f"    split_sum block_r={block_r:3d} warps={nw}: {'same bits' if same else 'DIFFERENT'} "
                    f"{ms_new * 1e3:.1f} us device ({ms / ms_new:.2f}x), {host(new):.1f} us host, "
                    f"{moved / ms_new / 1e6:.0f} GB/s")
            except Exception as e:  # report and go on
                bad += 1
                log(f"    split_sum block_r={block_r} warps={nw}: error {str(e).splitlines()[0][:150]}")
    log(f"split_sum GPU: {bad} failures")
    return bad


# ------------------------------------------------------------------------------------------------------
# Offline sm_90 compile (Triton only: run with /tmp/t36/bin/python)
# ------------------------------------------------------------------------------------------------------


COMPILE_CONFIGS = ((64, 64, 8, 32, 8), (64, 64, 8, 16, 4), (64, 64, 8, 32, 4), (64, 64, 8, 64, 8),
                   (64, 64, 8, 64, 4), (128, 128, 4, 32, 8), (64, 64, 2, 32, 8), (128, 128, 8, 32, 8))


def compile_stats(configs=COMPILE_CONFIGS, out_dtype: str = "bf16", log=print) -> list[dict]:
    """(D, DV, split, block_r, warps) -> sm_90 registers, spill bytes, shared memory of the kernel compiled
    as a contiguous-partials launch would specialize it."""
    import _sm90
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    results = []
    for d, dv, split, block_r, nw in configs:
        names = attn_split_sum_kernel.arg_names
        ptrs = {"dkp_ptr": "*fp32", "dvp_ptr": "*fp32", "dk_ptr": f"*{out_dtype}", "dv_ptr": f"*{out_dtype}"}
        consts = dict(HEAD_DIM=d, HEAD_DIM_V=dv, SPLIT=split, CUDA_ORDER=True, BLOCK_R=block_r,
                      BLOCK_D=_block(d), BLOCK_DV=_block(dv))
        sig, attrs = {}, {}
        for i, name in enumerate(names):
            if name in consts:
                sig[name] = "constexpr"
            elif name in ptrs:
                sig[name] = ptrs[name]
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[name] = "i32"
        c = triton.compile(ASTSource(attn_split_sum_kernel, sig, consts, attrs), target=target,
                           options={"num_warps": nw, "enable_fp_fusion": False})
        regs, spill, _ = _sm90.binary_stats(c)
        row = dict(d=d, dv=dv, split=split, block_r=block_r, warps=nw, regs=regs, spill=spill,
                   shared=c.metadata.shared)
        results.append(row)
        log(f"attn_split_sum_kernel D={d} DV={dv} split={split} block_r={block_r} warps={nw}: regs={regs} "
            f"spill={spill} smem={c.metadata.shared}")
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--self-check", action="store_true", help="bits only, small shapes (CPU: interpreter)")
    p.add_argument("--compile-only", action="store_true", help="offline sm_90 build stats (Triton only)")
    args = p.parse_args(argv)
    if args.compile_only:
        compile_stats()
        return 0
    import torch

    if args.self_check:
        return 1 if self_check("cuda" if torch.cuda.is_available() else "cpu") else 0
    if not torch.cuda.is_available():
        print("bench/attn_split_sum.py: no CUDA GPU; use --self-check (interpreter) or --compile-only")
        return 2
    return 1 if gpu_bench() else 0


if __name__ == "__main__":
    sys.exit(main())
