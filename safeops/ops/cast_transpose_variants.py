"""Variants of ``cast_transpose_v2_kernel`` (issue 6 speed work) and their launcher.

``bench/cast_transpose_variants.py`` checks every :data:`VARIANTS` entry bit for bit against eager torch and
times it next to the shipped kernel; ``tests/test_cast_transpose_configs.py`` compiles each for sm_90
offline. ``cast_transpose_launch.SHIPPED_VARIANT`` is the one ``safeops.cast_transpose`` runs on a GPU (bf16,
M % 4 == 0): that launcher keeps its own routes, built from :func:`unsupported` and
:func:`launch_options_and_scalars` here (the kernel arguments and the amax workspace protocol are the
v1 kernel's, with ``PACK``).

The launcher below (:func:`cast_transpose`, for the bench and tests) keeps its own program count and
shares ``cast_transpose_launch``'s amax workspace and ``_launch``'s TMA allocator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from .. import _config, reference
from ._launch import KernelLaunch, ensure_tma_allocator


@dataclass(frozen=True)
class Variant:
    name: str
    block_m: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 1
    programs_per_sm: int | None = None  # None: persistent (one wave, from occupancy); 0: one per tile
    asm: bool = True  # inline PTX element path (bf16 input, GPU only)
    nan_mode: int | None = None  # None: 1 for e4m3 (exact by construction), 0 for e5m2
    tma_x: bool = False
    tma_y: int = 0  # 1: y through a descriptor, one box per 4-row block; 2: one box per tile
    tma_yt: bool = False
    prefetch: bool = False  # register double buffer of the next tile's x
    m_fast: bool = False  # tile order: row tiles fastest (consecutive programs write along y_t's rows)
    # Register cap for ptxas (Triton's maxnreg). Uncapped, ptxas holds the tile loop at 64 registers and
    # issues only 5 of a tile's 8 loads before converting; with 80-96 it issues all 8 (and the scales) first.
    maxnreg: int | None = None


V = Variant
VARIANTS = (
    V("v2-triton 128x64w4", asm=False),  # the v2 structure with Triton-level element code (int RNE off GPU)
    V("asm 128x64w4"),
    V("asm 128x64w4 nan0", nan_mode=0),
    V("asm 128x64w4 nan2", nan_mode=2),
    V("asm 128x64w4 tile-grid", programs_per_sm=0),
    V("asm 128x64w4 m-fast", m_fast=True),
    V("asm 128x64w4 r80", maxnreg=80),
    V("asm 128x64w4 r96", maxnreg=96),
    V("asm 64x64w2", 64, 64, 2),
    V("asm 64x64w2 tile-grid", 64, 64, 2, programs_per_sm=0),
    V("asm 256x64w8", 256, 64, 8),
    V("asm 128x128w8", 128, 128, 8),
    V("asm 128x64w4 prefetch", prefetch=True),
    V("asm 128x64w4 tma-yt", tma_yt=True),
    V("asm 128x64w4 tma-y2,yt", tma_y=2, tma_yt=True),
    V("asm 256x64w8 tma-y2,yt", 256, 64, 8, tma_y=2, tma_yt=True),
    V("asm 128x64w4 tma-y2,yt m-fast", tma_y=2, tma_yt=True, m_fast=True),
    V("asm 128x64w4 tma-y2,yt r96", tma_y=2, tma_yt=True, maxnreg=96),
    V("asm 256x64w8 r128", 256, 64, 8, maxnreg=128),
    V("asm 128x128w8 tma-yt", 128, 128, 8, tma_yt=True),
    V("asm 128x64w4 tma-all s3", num_stages=3, tma_x=True, tma_y=2, tma_yt=True),
    V("asm 128x128w4 tma-all s3", 128, 128, 4, num_stages=3, tma_x=True, tma_y=2, tma_yt=True),
)
del V


def kernels():
    """The kernel module, as the shipped launcher loads it (on first use: importing safeops must not compile
    anything); imported at call time, that module imports this one."""
    from .cast_transpose_launch import kernels as shipped

    return shipped()


def _interpreted() -> bool:
    return isinstance(kernels().cast_transpose_v2_kernel, InterpretedFunction)


def _on_gpu(x: torch.Tensor) -> bool:
    """Whether ``x`` is a CUDA tensor and kernels are compiled for the GPU (what inline PTX needs)."""
    return x.device.type == "cuda" and not _interpreted()


def unsupported(v: Variant, x: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why ``v`` cannot run on this input (None: it can)."""
    m, k = x.shape
    if x.numel() == 0 or m % 4:
        return "needs M % 4 == 0 and a non-empty x (packed y_t words)"
    if v.asm and not _on_gpu(x):
        return "inline PTX runs on the GPU only"
    if v.asm and x.dtype != torch.bfloat16:
        return "the inline PTX path reads bf16"
    if dtype not in reference.FP8_FORMATS:
        return f"no fp8 format {dtype}"
    if v.tma_x or v.tma_y or v.tma_yt:
        if x.stride(1) != 1 or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
            return "TMA needs x with unit column stride and 16-byte aligned rows"
        if k % 16 or m % 16:
            return "TMA needs K and M multiples of 16 (16-byte strides of y and y_t)"
    return None


def kernel_options(v: Variant, x: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> dict:
    """The constexprs and launch options of one launch (also what the offline compile test uses)."""
    m, k = x.shape
    fmt = reference.FP8_FORMATS[dtype]
    nan_mode = v.nan_mode if v.nan_mode is not None else (1 if fmt.code == 0 else 0)
    sxm, sxk = x.stride()
    span = max(v.block_m * (abs(sxm) + 1) + v.block_k * (abs(sxk) + 1), v.block_m * k + v.block_k,
               v.block_k * m + v.block_m)
    return dict(
        FP8=fmt.code, MAX_BITS=fmt.max_bits, MAN=fmt.mantissa_bits, BIAS=fmt.exponent_bias,
        ROWWISE=bool(rowwise), HW_CVT=x.device.type == "cuda", X_BF16_BITS=x.dtype == torch.bfloat16,
        WIDE=span >= 2**31, EVEN=(m % v.block_m == 0 and k % v.block_k == 0), NUM_STAGES=v.num_stages,
        BLOCK_M=v.block_m, BLOCK_K=v.block_k, ASM=v.asm, NAN_MODE=nan_mode, TMA_X=v.tma_x, TMA_Y=v.tma_y,
        TMA_YT=v.tma_yt, PREFETCH=v.prefetch, M_FAST=v.m_fast, num_warps=v.num_warps,
        enable_fp_fusion=_config.fp_fusion, **({"maxnreg": v.maxnreg} if v.maxnreg else {}),
    )


_capacity: dict = {}


def _programs(kernel, args: list, options: dict, v: Variant, device: torch.device, n_tiles: int) -> int:
    if v.programs_per_sm == 0:
        return n_tiles
    if device.type != "cuda":
        return min(n_tiles, 2)  # the interpreter: a small persistent grid (programs with several tiles)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if v.programs_per_sm is not None:
        return min(n_tiles, v.programs_per_sm * sms)
    key = (device.index, v, tuple(sorted(options.items())))
    if key not in _capacity:
        from .softmax_launch import _resident_programs

        _capacity[key] = max(sms, _resident_programs(kernel, args, options, device))
    return min(n_tiles, _capacity[key])


def launch_options_and_scalars(v: Variant, x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                               rowwise: bool) -> tuple[dict, tuple]:
    """The constexprs + launch options and the scalar arguments of ``v``'s launch for this input (the
    launcher's routes keep them; no tensor is kept)."""
    m, k = x.shape
    n_tiles_k = triton.cdiv(k, v.block_k)
    n_tiles = triton.cdiv(m, v.block_m) * n_tiles_k
    scalars = (m, k, x.stride(0), x.stride(1), scale.stride(0) if rowwise else 0, n_tiles_k, n_tiles, m // 4)
    return kernel_options(v, x, dtype, rowwise), scalars


_plans: dict = {}


def _shipped_workspace(device: torch.device) -> torch.Tensor:
    """The shipped launcher's amax workspace (same protocol: two int32 words, zero between launches, the
    last program re-zeroes them); imported at call time, that module imports this one."""
    from .cast_transpose_launch import _workspace

    return _workspace(device)


def warmup(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool, v: Variant) -> None:
    """Compiles the kernel ``cast_transpose`` would launch for these arguments, without launching it (the
    bench compiles its variants from several threads: ptxas runs in parallel)."""
    cast_transpose(x, scale, dtype, rowwise, v, _warmup=True)


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool, v: Variant,
                   _warmup: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, y_t, amax) as ``safeops.cast_transpose`` returns them, computed by variant ``v``."""
    m, k = x.shape
    # Everything but the tensors depends only on this key: computed once (host time per call matters at
    # 4096 x 4096, where the kernel takes ~16 us at the target).
    key = (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0, scale.dtype,
           scale.data_ptr() % 16 == 0, scale.stride(0) if rowwise else 0, dtype, rowwise, v,
           _config.fp_fusion)
    plan = _plans.get(key)
    if plan is None:
        why = unsupported(v, x, dtype)
        if why:
            raise ValueError(f"variant {v.name!r}: {why}")
        options, scalars = launch_options_and_scalars(v, x, scale, dtype, rowwise)
        plan = [scalars, options, None, None]  # programs and the launch: on the first (non-warm-up) call
        _plans[key] = plan
    scalars, options, programs, launch = plan
    device = x.device
    y = torch.empty(m, k, dtype=dtype, device=device)
    y_t = torch.empty_strided((m, k), (1, m), dtype=dtype, device=device)
    amax = torch.empty(size=(), dtype=torch.float32, device=device)
    tma = v.tma_x or v.tma_y or v.tma_yt
    if tma:
        ensure_tma_allocator()
    ws = _shipped_workspace(device)
    tensors = (x.view(torch.int16) if x.dtype == torch.bfloat16 else x, scale, y.view(torch.uint8),
               y_t.t().view(torch.int32), ws, amax.view(torch.int32))
    kernel = kernels().cast_transpose_v2_kernel
    if _warmup:
        kernel.warmup(*tensors, *scalars, grid=(1,), **options)
        return y, y_t, amax
    if programs is None:
        programs = plan[2] = _programs(kernel, [*tensors, *scalars], options, v, device, scalars[6])
    # The launch keeps the compiled kernel (safeops.ops._launch), which is specialized on the pointers'
    # 16-byte alignment: x's and scale's are in the key, fresh outputs and the workspace are aligned; if
    # one is not, and for TMA (descriptors' scratch is set up per launch), launch through JITFunction.run.
    if tma or (y.data_ptr() | y_t.data_ptr() | amax.data_ptr() | ws.data_ptr()) & 15:
        kernel[(programs,)](*tensors, *scalars, **options)
        return y, y_t, amax
    if launch is None:
        launch = plan[3] = KernelLaunch(kernel, (programs,), options)
    launch(*tensors, *scalars)
    return y, y_t, amax
