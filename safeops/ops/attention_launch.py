"""Launchers for the attention Triton kernels: configurations, grids, constants.

Configurations are keyed by the head-dim block, the dtype and whether a causal/window mask is present,
never by the batch, head count or sequence length: a sequence then gets the same bits whatever else is in
the batch, packed (varlen) or padded (contract section 6). The bf16 / fp16 tables hold the fastest
configurations of ``python3 bench/attention.py --sweep`` on the H200 (numbers in bench/RESULTS.md); a block
size changes the reduction order, so a table entry also fixes the bits of its configuration.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .. import _config, reference
from . import attention_gluon as _gluon
from ._launch import KernelLaunch, check_triton_device, ensure_tma_allocator, launch

_kernels = None


def kernels():
    """The kernel module, imported on first use (importing safeops must not compile anything)."""
    global _kernels
    if _kernels is None:
        from ..kernels import attention as module

        _kernels = module
    return _kernels


@dataclass(frozen=True)
class AttnConfig:
    block_m: int  # query rows per block
    block_n: int  # keys per block
    num_warps: int
    num_stages: int
    warp_specialize: bool = False  # forward K/V loop only (tl.range warp_specialize); a tuning knob
    tma: bool = False  # loads of the looped-over tiles through TMA descriptors (if the layout allows); a knob
    maxnreg: int | None = None  # ptxas register cap per thread (Triton's ``maxnreg``): more programs per SM


# (head-dim block, element size, masked by causal/window) -> config, bf16 / fp16. D=64 and D=128 are the
# H200 sweep's best; D=32 and D=256 were chosen offline (no register spills, shared memory fits). Causal
# entries equal the dense ones except where noted. Every entry (and its mask variants below) is compiled for
# sm_90 by tests/test_attention_configs.py.
def _both(cfg: AttnConfig) -> dict[bool, AttnConfig]:
    return {False: cfg, True: cfg}


def _table(by_d: dict[int, AttnConfig]) -> dict[tuple[int, int, bool], AttnConfig]:
    return {(d, 2, masked): cfg for d, c in by_d.items() for masked, cfg in _both(c).items()}


FWD_CONFIGS = _table({32: AttnConfig(128, 64, 4, 3), 64: AttnConfig(128, 64, 8, 3),
                      128: AttnConfig(128, 64, 8, 3), 256: AttnConfig(128, 64, 8, 2)})
# Causal / windowed forward at D=64: 64-query programs of 4 warps (the same key block, so the same bits),
# faster on the causal Llama layer; dense attention stays faster with 128-query programs.
FWD_CONFIGS[(64, 2, True)] = AttnConfig(64, 64, 4, 3)
# dk/dv kernel: block_n keys per program, block_m queries per step.
DKDV_CONFIGS = _table({32: AttnConfig(32, 128, 4, 2), 64: AttnConfig(32, 128, 4, 2),
                       128: AttnConfig(32, 64, 4, 3), 256: AttnConfig(32, 64, 8, 1)})
# Dense dk/dv at D=64: three pipeline stages (same tile, same bits); causal is faster with two.
DKDV_CONFIGS[(64, 2, False)] = AttnConfig(32, 128, 4, 3)
# Causal / windowed dk/dv at D=64: q / dO loaded through TMA descriptors (same tile, same bits), faster.
DKDV_CONFIGS[(64, 2, True)] = AttnConfig(32, 128, 4, 2, tma=True)
# dq kernel: block_m queries per program, block_n keys per step. (128, 32, 4, 2) at D=16 is avoided: Triton
# 3.6's ptxas (12.8) crashes on it. D=64 loads K / V through TMA descriptors (same bits), faster with
# Hugging Face's (B, S, H, D) layout.
DQ_CONFIGS = _table({32: AttnConfig(64, 64, 4, 2), 64: AttnConfig(64, 64, 4, 2, tma=True),
                     128: AttnConfig(128, 64, 8, 3), 256: AttnConfig(64, 32, 8, 1)})
# A dense attn_mask is loaded tile by tile beside K/V, and the pipeliner stages its tiles through shared
# memory too, which must fit sm_90's 232448 bytes: (kind, head-dim block, smallest mask element size) -> the
# config to use instead; kind is "fwd" / "dkdv" / "dq" for bf16 / fp16 and "fp32-fwd" / "fp32-dkdv" /
# "fp32-dq" for fp32 inputs. With causal + window + softcap + GQA (sm_90 compile) the fwd D=128 table entry
# takes 196608 B with an fp32 mask, 262144 with fp64; D=256 takes 229376 with fp32, 262144 with fp64.
MASK_CONFIGS: dict[tuple[str, int, int], AttnConfig] = {
    ("fwd", 128, 8): AttnConfig(128, 64, 8, 2),
    ("fwd", 256, 4): AttnConfig(128, 32, 8, 2),
    # dq D=128: three K/V stages fit with a 2-byte mask tile per stage, not with a 4-byte one.
    ("dq", 128, 4): AttnConfig(128, 64, 8, 2),
}
# fp32 inputs, by (head-dim block, ieee): smaller tiles. "ieee" dots are FMA loops (no tensor cores) and
# spill registers with larger tiles; tf32 / tf32x3 use the tensor cores.
FP32_FWD = {(32, False): AttnConfig(64, 32, 8, 2), (64, False): AttnConfig(64, 32, 8, 2),
            (128, False): AttnConfig(64, 32, 4, 2), (256, False): AttnConfig(32, 32, 4, 1),
            (32, True): AttnConfig(64, 32, 8, 2), (64, True): AttnConfig(64, 32, 8, 2),
            (128, True): AttnConfig(32, 32, 4, 2), (256, True): AttnConfig(16, 32, 4, 1)}
FP32_BWD = {(32, False): AttnConfig(32, 32, 4, 1), (64, False): AttnConfig(32, 32, 4, 1),
            (128, False): AttnConfig(16, 32, 4, 1), (256, False): AttnConfig(16, 16, 4, 1),
            (32, True): AttnConfig(16, 32, 4, 1), (64, True): AttnConfig(16, 32, 4, 1),
            (128, True): AttnConfig(16, 32, 4, 1), (256, True): AttnConfig(16, 16, 4, 1)}
# Under Triton's interpreter (CPU tensors): small blocks, so short test sequences span several blocks.
INTERPRETER_CONFIG = AttnConfig(16, 16, 1, 1)

_override: dict[str, AttnConfig] = {}


@contextlib.contextmanager
def config_override(**configs: AttnConfig):
    """Force configs (keys ``fwd``, ``dkdv``, ``dq``) for every launch inside the block (benchmark sweeps)."""
    saved = dict(_override)
    _override.update(configs)
    try:
        yield
    finally:
        _override.clear()
        _override.update(saved)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv without its per-call wrapper (a constexpr_function in newer Triton)


def block_dim(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())  # triton.next_power_of_2, without its per-call wrapper cost


def _gpu(device: torch.device) -> bool:
    """CUDA, or "meta": a meta tensor plans the GPU launch without running it (the launch arguments are
    recorded by tests/test_attention_configs.py, which compiles every configuration offline for sm_90)."""
    return device.type in ("cuda", "meta")


def config(kind: str, block_d: int, dtype: torch.dtype, masked: bool, device: torch.device,
           precision: int = 0, mask_bytes: int = 0) -> AttnConfig:
    """The configuration of kernel ``kind`` ("fwd", "dkdv", "dq"): a function of the head-dim block, the
    dtype / precision, causal-or-window and the dense mask's element size (0: no mask) only, never of the
    batch, head count or sequence lengths (batch invariance, varlen == dense bits)."""
    if kind in _override:
        return _override[kind]
    if not _gpu(device):
        return INTERPRETER_CONFIG
    key_d = max(32, block_d)
    if dtype == torch.float32:
        kind = "fp32-" + kind
        cfg = (FP32_FWD if kind == "fp32-fwd" else FP32_BWD)[(key_d, precision == 0)]
    else:
        cfg = {"fwd": FWD_CONFIGS, "dkdv": DKDV_CONFIGS, "dq": DQ_CONFIGS}[kind][(key_d, 2, masked)]
    if mask_bytes:  # the entry for the largest listed mask element size <= this mask's
        for size in sorted((k[2] for k in MASK_CONFIGS if k[:2] == (kind, key_d)), reverse=True):
            if mask_bytes >= size:
                return MASK_CONFIGS[(kind, key_d, size)]
    return cfg


def _launch_options(cfg: AttnConfig) -> dict:
    # Fusion off: z2 = s * C1 must be rounded before it feeds both the max and z2 - m (contract section 1).
    options = {"num_warps": cfg.num_warps, "enable_fp_fusion": _config.fp_fusion}
    if cfg.maxnreg is not None:
        options["maxnreg"] = cfg.maxnreg
    return options


def _check_device(q: torch.Tensor) -> None:
    if not _gpu(q.device):
        check_triton_device(q, "q", kernels().attn_fwd_kernel)


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (nearest even), as a Python float."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # beyond fp32's range: inf, as the conversion gives
        return float(torch.tensor(x, dtype=torch.float32))


def constants(scale: float, softcap: float | None) -> tuple[float, float, float]:
    """(C1, C2, scale) for the kernels' z2 formula (see safeops.kernels.attention), each fp32-rounded once."""
    if softcap is None:
        return _f32(scale * reference.LOG2E), 1.0, _f32(scale)
    return _f32(2.0 * reference.LOG2E * scale / softcap), _f32(softcap * reference.LOG2E), _f32(scale)


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and 16-byte multiples for every stride but the last."""
    for t in tensors:
        per16 = 16 // t.element_size()
        if t.data_ptr() % 16 or any(st % per16 for st in t.stride()[:-1]):
            return False
    return True


def _launch(kernel, grid: tuple, *args, record: list | None = None, **kwargs) -> None:
    if record is not None:  # building a plan (see "Plans" below): the launch as the general path makes it
        record.append((kernel, grid, args, kwargs))
    # Cached, direct launches (safeops.ops._launch). A TMA launch's descriptor scratch is allocated by
    # Triton's launcher at each launch, from the allocator ``_use_tma`` set for this thread.
    launch(kernel, grid, *args, **kwargs)


def _use_tma(cfg: AttnConfig, varlen: bool, *tensors: torch.Tensor) -> bool:
    # Packed (varlen) launches never take device-side descriptors: on an H100 (Triton 3.6) the dq kernel's
    # varlen launch with them hung for good at GQA group >= 8 (D=64 causal, lengths 700 / 1 / 333; group 4 and
    # pointer loads finished), whether run first in the process or after other launches, and with scratch
    # never reused (bench/RESULTS.md, 2026-12-05). Pointer loads give the same bits (each element is loaded
    # either way), so only speed can differ.
    if varlen or not cfg.tma or not _tma_ok(*tensors):
        return False
    if tensors[0].device.type == "cuda":
        ensure_tma_allocator()  # device-side descriptors live in a small global scratch buffer per launch
    return True


def empty_outputs(q: torch.Tensor, v: torch.Tensor, varlen: bool):
    """``(out, row_max, row_sum)`` as the attention op returns them, uninitialised: ``out`` keeps q's memory
    layout (e.g. (B, S, H, D) transposed) when the head dims match; the statistics are fp32 (fp64 for fp64
    inputs), (B, Hq, Sq) dense or (Hq, Tq) packed. The op's fake and reference paths allocate the same."""
    acc = reference.compute_dtype(q.dtype)
    shape = (q.shape[1], q.shape[0]) if varlen else tuple(q.shape[:3])
    dv = v.shape[-1]
    out = torch.empty_like(q) if q.shape[-1] == dv else q.new_empty(q.shape[:-1] + (dv,))
    return out, q.new_empty(shape, dtype=acc), q.new_empty(shape, dtype=acc)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """The kernels address the head dim with stride 1."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _scratch(result: torch.Tensor) -> torch.Tensor:
    return result if result.stride(-1) == 1 or result.shape[-1] <= 1 else torch.empty(
        result.shape, dtype=result.dtype, device=result.device)


def _bhs(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, sequence) strides: dense (B, H, S, D), packed (T, H, D) with no batch stride."""
    if varlen:
        return 0, t.stride(1), t.stride(0)
    return t.stride(0), t.stride(1), t.stride(2)


def _stat_strides(stat: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    if varlen:  # (H, T)
        return 0, stat.stride(0), stat.stride(1)
    return stat.stride(0), stat.stride(1), stat.stride(2)


@dataclass
class _Problem:
    varlen: bool
    batch: int
    hq: int
    hkv: int
    max_q: int
    max_k: int
    d: int
    dv: int
    precision: int
    masked: bool
    has_wl: bool
    has_wr: bool
    window_left: int
    window_right: int
    mask_arg: torch.Tensor
    mask_strides: tuple[int, int, int, int]
    mask_bytes: int  # the dense mask's element size, 0 without one
    cu_q: torch.Tensor
    cu_k: torch.Tensor


def check_sequence_offsets(named: dict, max_q: int, max_k: int, varlen: bool) -> None:
    """The kernels step along a sequence with 32-bit offsets (position x sequence stride, from a 64-bit
    base per batch and head): refuse, naming the argument, a layout where they would wrap, instead of
    reading the wrong rows. A (B, H, S, D)-contiguous tensor has sequence stride D and never comes close."""
    for name, t in named.items():
        length = max_k if name in ("k", "v", "dk", "dv") else max_q
        stride = abs(t.stride(0 if varlen else 2))
        if (length + 256) * stride >= 2**31:
            raise ValueError(
                f"{name}: sequence offsets up to {length} x stride {stride} pass 2**31, beyond the kernels' "
                "32-bit offsets; pass it contiguous as (B, H, S, D) (stride D along the sequence) or split "
                "the sequence")


def _problem(q, k, v, mask, mask_kind, cu_q, cu_k, max_q, max_k, is_causal, wl, wr, precision) -> _Problem:
    varlen = cu_q is not None
    if varlen:
        batch, hq, hkv = cu_q.numel() - 1, q.shape[1], k.shape[1]
    else:
        batch, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
    if batch * hq > 65535:
        raise ValueError(f"q: batch x heads = {batch * hq} is more than the 65535 the launch grid allows")
    wr = 0 if is_causal else wr
    if mask is not None:
        mask_arg = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        mask_strides = tuple(mask_arg.stride())
    else:
        mask_arg, mask_strides = q, (0, 0, 0, 0)
    return _Problem(
        varlen=varlen, batch=batch, hq=hq, hkv=hkv, max_q=max_q, max_k=max_k, d=q.shape[-1], dv=v.shape[-1],
        precision=precision if q.dtype == torch.float32 else 3, masked=wl >= 0 or wr >= 0,
        # Windows clamped to 2**30 keys (longer than any sequence the kernels take): their position + window
        # sums stay inside int32.
        has_wl=wl >= 0, has_wr=wr >= 0, window_left=min(max(wl, 0), 1 << 30),
        window_right=min(max(wr, 0), 1 << 30),
        mask_arg=mask_arg, mask_strides=mask_strides,
        mask_bytes=mask_arg.element_size() if mask is not None else 0,
        cu_q=cu_q if varlen else q, cu_k=cu_k if varlen else q,
    )


def _common_constexprs(p: _Problem, mask_kind: int, softcap) -> dict:
    return dict(GROUP=p.hq // p.hkv, HEAD_DIM=p.d, HEAD_DIM_V=p.dv, MASK_KIND=mask_kind, HAS_WL=p.has_wl,
                HAS_WR=p.has_wr, SOFTCAP=softcap is not None, VARLEN=p.varlen, PRECISION=p.precision,
                BLOCK_D=block_dim(p.d), BLOCK_DV=block_dim(p.dv))


# GQA: the dk/dv kernel runs one program per (key block, kv head), looping over the head's query group. With
# few kv heads that is too few programs to fill the GPU (a 4-kv-head model at S=4K: 128 programs for 132 SMs),
# so each group is split over SPLIT programs writing fp32 partials, summed afterwards in a fixed order. Two
# query heads per program beat both one head per program and the unsplit kernel wherever the group has 4 or
# more (H200 sweep, bench/RESULTS.md). The split depends on the group size only (plus a memory cap for the
# partials), never on the sequence lengths or the batch.
DKDV_SPLIT_MAX_BYTES = 4 << 30
DKDV_HEADS_PER_PROGRAM = 2


def dkdv_split(group: int, kv_elements: int) -> int:
    """How many programs share one kv head's query group in the dk/dv kernel (a divisor of ``group``):
    ``group / DKDV_HEADS_PER_PROGRAM`` for a group of 4 or more, the whole group (one head per program) below,
    fewer if the fp32 partials (``2 x split x`` the elements of k and v) would pass the memory cap."""
    per = DKDV_HEADS_PER_PROGRAM
    split = group // per if group >= 4 and group % per == 0 else group
    while split > 1 and kv_elements * split * 4 > DKDV_SPLIT_MAX_BYTES:
        split = max(d for d in range(1, split) if group % d == 0)
    return split


# Causal / windowed backward programs differ in length; ordering them block-major over groups of this many
# heads starts the longest ones first, so the short ones fill the tail.
BACKWARD_HEAD_GROUP = 8


def _backward_grid(n_blocks: int, n_bh: int, masked: bool) -> tuple[int, int, int]:
    """Grid (G, n_blocks, cdiv(n_bh, G)) of the dk/dv and dq kernels (kernels.attention._backward_program).
    Program order changes no result: each program writes its own block."""
    g = min(BACKWARD_HEAD_GROUP, n_bh) if masked else 1
    return g, n_blocks, _cdiv(n_bh, g)


def _even(p: _Problem, cfg: AttnConfig) -> bool:
    """The ``EVEN`` of the forward, dk/dv and dq kernels (each with its own config): every query block
    (block_m) and key block (block_n) of the launch is whole (not varlen; both sequence lengths multiples of
    the blocks). The kernels then compile without the bounds masks and the empty masked tail loop; the
    arithmetic per block and its order are unchanged, so the bits are the same either way (a compile-time
    specialization, like Triton's own on integer arguments)."""
    return not p.varlen and p.max_q % cfg.block_m == 0 and p.max_k % cfg.block_n == 0


# The GQA split's sum: rows (kv head x position) per program and warps. 32 x 8 keeps D=64 at split 8 near 100
# registers; one launch for dk and dv replaces two torch sums and two casting copies.
SPLIT_SUM_BLOCK_R = 32
SPLIT_SUM_WARPS = 8


def split_partials(t: torch.Tensor, split: int) -> torch.Tensor:
    """The GQA split's fp32 partials of dk or dv (``t``: k / v or dk / dv): ``split`` heads per kv head along
    dimension 1, of (B, Hkv, S, D) dense or (T, Hkv, D) packed."""
    shape = list(t.shape)
    shape[1] *= split
    return torch.empty(shape, dtype=torch.float32, device=t.device)


def split_sum(dk_part, dv_part, dk, dv, split: int, varlen: bool, record: list | None) -> None:
    """dk / dv = the fp32 partials of each kv head's SPLIT programs (heads h * split .. h * split + split - 1
    of dk_part / dv_part), added in a fixed order and rounded once to dk's / dv's dtype: one launch. Rows are
    (batch, kv head, position); a packed tensor is one batch of T positions (``_bhs``: batch stride 0)."""
    batch, heads, inner = (1, dk.shape[1], dk.shape[0]) if varlen else dk.shape[:3]
    rows = batch * heads * inner
    on_gpu = _gpu(dk.device)
    block_r = SPLIT_SUM_BLOCK_R if on_gpu else 16
    n_blocks = _cdiv(rows, block_r)
    _launch(kernels().attn_bwd_split_sum_kernel, (2 * n_blocks,),
        dk_part, dv_part, dk, dv, rows, heads, inner, n_blocks,
        *_bhs(dk_part, varlen), *_bhs(dv_part, varlen), *_bhs(dk, varlen), *_bhs(dv, varlen),
        HEAD_DIM=dk.shape[-1], HEAD_DIM_V=dv.shape[-1], SPLIT=split, BLOCK_R=block_r,
        BLOCK_D=block_dim(dk.shape[-1]), BLOCK_DV=block_dim(dv.shape[-1]),
        num_warps=SPLIT_SUM_WARPS if on_gpu else 1, enable_fp_fusion=_config.fp_fusion, record=record,
    )


DQ_SCALE_BLOCK_R = 32


def row_stats(m: torch.Tensor, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, rinv) of the saved statistics ``m``, ``l`` (contiguous fp32): base = (m == -inf ? 0 : m) and
    rinv = (l == 0 ? 0 : 1 / l) per row, by ``attn_bwd_row_stats_kernel`` with the operations the Gluon
    dK / dV kernel otherwise repeats at every step (its ``row_stats`` configuration reads these instead)."""
    base, rinv = torch.empty_like(m), torch.empty_like(l)
    n = m.numel()
    if n:
        block = 1024 if _gpu(m.device) else 64
        _launch(kernels().attn_bwd_row_stats_kernel, (_cdiv(n, block),), m, l, base, rinv, n, BLOCK=block,
                num_warps=4 if _gpu(m.device) else 1, enable_fp_fusion=_config.fp_fusion)
    return base, rinv


def dq_scale(acc: torch.Tensor, dq: torch.Tensor, scale: float) -> None:
    """dq = scale * acc, one fp32 multiply rounded once to dq's dtype (``attn_bwd_dq_scale_kernel``): the
    fused Gluon backward's fp32 buffer ((B, H, S, D), contiguous) into dq (its shape, any layout), one pass
    with the bits of ``dq.copy_(acc.mul_(scale))``."""
    if dq.stride(-1) != 1 or acc.numel() == 0:
        dq.copy_(acc.mul_(scale))
        return
    batch, heads, seqlen, d = acc.shape
    rows = batch * heads * seqlen
    on_gpu = _gpu(dq.device)
    block_r = DQ_SCALE_BLOCK_R if on_gpu else 16
    _launch(kernels().attn_bwd_dq_scale_kernel, (_cdiv(rows, block_r),), acc, dq, _f32(scale), rows, seqlen,
            heads, dq.stride(0), dq.stride(1), dq.stride(2), HEAD_DIM=d, BLOCK_R=block_r,
            num_warps=4 if on_gpu else 1, enable_fp_fusion=_config.fp_fusion)


def _no_key_stats(row_max, row_sum, sinks, varlen: bool) -> None:
    """Fills the stats of rows that see no key: -inf and 0, or with sinks the sink alone, as the forward
    kernel leaves such a row (m = zs2 = fp32(sink) * fp32(log2 e), l = exp2(zs2 - guarded zs2))."""
    if sinks is None:
        row_max.fill_(float("-inf"))
        row_sum.zero_()
        return
    zs = reference.sink_scores(sinks, torch.float32)
    zs = zs.view(-1, 1) if varlen else zs.view(1, -1, 1)
    row_max.copy_(zs.expand(row_max.shape))
    row_sum.copy_(torch.exp2(zs - torch.where(zs == float("-inf"), 0.0, zs)).expand(row_sum.shape))


def _forward_general(q, k, v, mask, mask_kind, cu_q, cu_k, max_q, max_k, is_causal, scale, softcap, wl, wr,
                     precision, *, out_dtype: torch.dtype | None = None, sinks: torch.Tensor | None = None,
                     record: list | None = None):
    """The forward with every decision made again (``forward`` keeps them in plans); ``record`` (a list)
    receives the launch as ``(kernel, grid, args, kwargs)``."""
    _check_device(q)
    out, row_max, row_sum = empty_outputs(q, v, cu_q is not None)
    if out_dtype is not None and out_dtype != out.dtype:
        out = torch.empty(out.shape, dtype=out_dtype, device=out.device)
    if out.numel() == 0 and row_max.numel() == 0:
        return out, row_max, row_sum
    if k.numel() == 0 or max_k == 0:
        out.zero_()
        _no_key_stats(row_max, row_sum, sinks, cu_q is not None)
        return out, row_max, row_sum
    p = _problem(q, k, v, mask, mask_kind, cu_q, cu_k, max_q, max_k, is_causal, wl, wr, precision)
    q_, k_, v_ = _unit_last(q), _unit_last(k), _unit_last(v)
    out_ = _scratch(out)
    check_sequence_offsets({"q": q_, "k": k_, "v": v_, "out": out_}, p.max_q, p.max_k, p.varlen)
    cfg = config("fwd", max(block_dim(p.d), block_dim(p.dv)), q.dtype, p.masked, q.device, p.precision,
                 p.mask_bytes)
    c1, c2, _ = constants(scale, softcap)
    n_m_blocks = _cdiv(p.max_q, cfg.block_m)
    grid = (n_m_blocks, p.batch * p.hq)
    _launch(kernels().attn_fwd_kernel, grid,
        q_, k_, v_, out_, row_max, row_sum, p.mask_arg, p.cu_q, p.cu_k, sinks,
        *_bhs(q_, p.varlen), *_bhs(k_, p.varlen), *_bhs(v_, p.varlen), *_bhs(out_, p.varlen),
        *_stat_strides(row_max, p.varlen), *p.mask_strides,
        p.hq, p.max_q, p.max_k, n_m_blocks, p.window_left, p.window_right, c1, c2,
        **_common_constexprs(p, mask_kind, softcap), REVERSE=p.has_wr,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
        WARP_SPECIALIZE=cfg.warp_specialize and _gpu(q.device), USE_TMA=_use_tma(cfg, p.varlen, k_, v_),
        EVEN=_even(p, cfg), **_sinks_constexpr(sinks), **_launch_options(cfg), record=record,
    )
    if out_ is not out:
        out.copy_(out_)
    return out, row_max, row_sum


def _sinks_constexpr(sinks) -> dict:
    """``HAS_SINKS`` only when there are sinks: a launch without them passes the kernels' defaults, as
    before sinks existed (the same compiled kernels)."""
    return {} if sinks is None else {"HAS_SINKS": True}


def sinks_gradient(dsink_rows: torch.Tensor, varlen: bool) -> torch.Tensor:
    """d loss / d sinks (Hq,) from the dq kernel's per-row ``p_sink * delta`` ((B, Hq, Sq) or (Hq, Tq)): minus
    their sum per head, in float64 by torch's reduction (a fixed order for a fixed shape: the same bits on
    every run, no atomics), rounded once to fp32."""
    total = dsink_rows.sum(dim=1 if varlen else (0, 2), dtype=torch.float64)
    return (-total).to(torch.float32)


def _dkdv_triton(p: _Problem, q_, k_, v_, g_, dk, dv, dk_, dv_, row_max, row_sum, delta, st, common,
                 block_d: int, c1: float, c2: float, scale_ds: float, record: list | None) -> None:
    """dk and dv through the Triton kernel (``dk_`` / ``dv_``: what it writes; with the GQA split, fp32
    partials summed into them)."""
    kv = config("dkdv", block_d, q_.dtype, p.masked, q_.device, p.precision, p.mask_bytes)
    split = dkdv_split(p.hq // p.hkv, k_.numel() + v_.numel())
    dkp, dvp = dk_, dv_
    if split > 1:  # fp32 partials per slice of each kv head's query group, summed below
        dkp, dvp = split_partials(dk, split), split_partials(dv, split)
    n_bh = p.batch * p.hkv * split
    _launch(kernels().attn_bwd_dkdv_kernel, _backward_grid(_cdiv(p.max_k, kv.block_n), n_bh, p.masked),
        q_, k_, v_, g_, dkp, dvp, row_max, row_sum, delta, p.mask_arg, p.cu_q, p.cu_k,
        *_bhs(q_, p.varlen), *_bhs(k_, p.varlen), *_bhs(v_, p.varlen), *_bhs(g_, p.varlen),
        *_bhs(dkp, p.varlen), *_bhs(dvp, p.varlen), *st, *p.mask_strides,
        p.hq, n_bh, p.max_q, p.max_k, p.window_left, p.window_right, c1, c2, scale_ds,
        **common, BLOCK_M=kv.block_m, BLOCK_N=kv.block_n, NUM_STAGES=kv.num_stages,
        USE_TMA=_use_tma(kv, p.varlen, q_, g_), SPLIT=split, EVEN=_even(p, kv), **_launch_options(kv),
        record=record,
    )
    if split > 1:
        split_sum(dkp, dvp, dk_, dv_, split, p.varlen, record)


def _backward_general(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_q, cu_k, max_q, max_k,
                      is_causal, scale, softcap, wl, wr, precision, *, grad_dtype: torch.dtype | None = None,
                      sinks: torch.Tensor | None = None, record: list | None = None):
    """The backward with every decision made again (``backward`` keeps them in plans); ``record``: see
    ``_forward_general``. With ``sinks`` it returns ``(dq, dk, dv, dsinks)``."""
    _check_device(q)
    if grad_dtype is None:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    else:
        dq, dk, dv = (torch.empty(t.shape, dtype=grad_dtype, device=t.device) for t in (q, k, v))
    if q.numel() == 0 or k.numel() == 0 or max_q == 0 or max_k == 0:
        # No rows, or no keys: the output is 0, so delta = 0 and the sinks get no gradient either.
        result = dq.zero_(), dk.zero_(), dv.zero_()
        return result if sinks is None else (*result, torch.zeros_like(sinks))
    p = _problem(q, k, v, mask, mask_kind, cu_q, cu_k, max_q, max_k, is_causal, wl, wr, precision)
    q_, k_, v_, o_, g_ = (_unit_last(t) for t in (q, k, v, out, grad))
    dq_, dk_, dv_ = _scratch(dq), _scratch(dk), _scratch(dv)
    check_sequence_offsets({"q": q_, "k": k_, "v": v_, "out": o_, "grad": g_, "dq": dq_, "dk": dk_,
                            "dv": dv_}, p.max_q, p.max_k, p.varlen)
    row_max, row_sum = row_max.contiguous(), row_sum.contiguous()
    delta = torch.empty_like(row_max)
    dsink_rows = None if sinks is None else torch.empty_like(row_max)
    st = _stat_strides(row_max, p.varlen)
    k_mod = kernels()
    common = _common_constexprs(p, mask_kind, softcap)
    c1, c2, scale_ds = constants(scale, softcap)
    block_d = max(block_dim(p.d), block_dim(p.dv))

    # dq first: its programs also compute delta = rowsum(dO * O) of their rows, which dk/dv reads (only delta
    # where the Gluon dq kernel computes dq, after it).
    fused = not gluon_fused_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, grad_dtype)
    # The Gluon dK / dV and dQ plans' packed sequences and window (clamped, as the Triton kernels get it).
    seq = (cu_q, p.max_q, p.max_k, p.window_left if p.has_wl else -1)
    gluon_dq = fused or not gluon_dq_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, grad_dtype)
    qc = config("dq", block_d, q.dtype, p.masked, q.device, p.precision, p.mask_bytes)
    n_m_blocks = _cdiv(p.max_q, qc.block_m)
    _launch(k_mod.attn_bwd_dq_kernel, _backward_grid(n_m_blocks, p.batch * p.hq, p.masked),
        q_, k_, v_, g_, o_, dq_, row_max, row_sum, delta, p.mask_arg, p.cu_q, p.cu_k, sinks, dsink_rows,
        *_bhs(q_, p.varlen), *_bhs(k_, p.varlen), *_bhs(v_, p.varlen), *_bhs(g_, p.varlen),
        *_bhs(o_, p.varlen), *_bhs(dq_, p.varlen), *st, *p.mask_strides,
        p.hq, p.batch * p.hq, p.max_q, p.max_k, n_m_blocks, p.window_left, p.window_right, c1, c2, scale_ds,
        **common, REVERSE=p.has_wr,
        BLOCK_M=qc.block_m, BLOCK_N=qc.block_n, NUM_STAGES=qc.num_stages,
        USE_TMA=_use_tma(qc, p.varlen, k_, v_),
        EVEN=_even(p, qc), **_sinks_constexpr(sinks), **({"DELTA_ONLY": True} if gluon_dq else {}),
        **_launch_options(qc), record=record,
    )
    if fused:
        plan = _gluon_launch(_gluon.FusedPlan, (q_, k_, v_, g_), (dq_, dk_, dv_), is_causal, c1, scale_ds)
        plan(q_, k_, v_, g_, row_max, row_sum, delta, dq_, dk_, dv_)
        if record is not None:
            record.append((_GLUON, plan, (q_, k_, v_, g_, dq_, dk_, dv_)))
    elif gluon_dq:
        plan = _gluon_launch(_gluon.DqPlan, (q_, k_, v_, g_), (dq_,), is_causal, c1, scale_ds, seq)
        plan(q_, k_, v_, g_, row_max, row_sum, delta, dq_, cu_q, cu_k)
        if record is not None:
            record.append((_GLUON, plan, (q_, k_, v_, g_, dq_)))
    if fused:
        pass  # dk / dv came with dq
    elif not gluon_bwd_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, grad_dtype):
        plan = _gluon_launch(_gluon.BwdPlan, (q_, k_, v_, g_), (dk_, dv_), is_causal, c1, scale_ds, seq)
        plan(q_, k_, v_, g_, row_max, row_sum, delta, dk_, dv_, cu_q, cu_k)
        if record is not None:
            record.append((_GLUON, plan, (q_, k_, v_, g_, dk_, dv_)))
    else:
        _dkdv_triton(p, q_, k_, v_, g_, dk, dv, dk_, dv_, row_max, row_sum, delta, st, common, block_d,
                     c1, c2, scale_ds, record)
    for result, written in ((dq, dq_), (dk, dk_), (dv, dv_)):
        if written is not result:
            result.copy_(written)
    if sinks is not None:
        return dq, dk, dv, sinks_gradient(dsink_rows, p.varlen)
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------------
# Plans: a call's decisions kept per signature, so a repeated call only allocates its outputs and launches.
# ------------------------------------------------------------------------------------------------------
# Everything ``_forward_general`` / ``_backward_general`` decide -- configs, grids, constexprs, scalars,
# strides, the GQA split, EVEN, TMA, the checks -- is a function of the key below: the shapes, strides,
# dtypes and 16-byte alignment of every tensor argument, the device, the options, and the module's settings
# (kernels, overrides, caps; ``_settings``). The first call of a key runs the general path, recording its
# launches, and keeps them as a plan: the scalar arguments, constexprs and options exactly as the general
# path passed them, and a launch object (on CUDA a ``KernelLaunch``: the compiled kernel launched directly).
# A later call allocates the outputs as the general path does (same shapes, strides, dtypes) and launches
# with the same arguments, so the kernels and their bits are the same (a plan with TMA loads sets Triton's
# per-thread scratch allocator first, as the general path does). Layouts the plan does not cover (inputs
# that need a copy to unit head-dim stride, empty tensors) run the general path on every call. A forward
# the Gluon kernel takes (``gluon_reason``) is kept as an ``attention_gluon.Plan`` instead, and a backward
# whose dq a Gluon kernel computes as a ``_GluonBwdPlan`` (the delta-only Triton launch, then the kept
# Gluon plans; the general path's checks, path choices and plan lookups cost ~110 us of host time per call
# on the H100 machine's host). Editing a config table in place is not seen: call ``clear_plans()`` after
# that.

_GENERAL = "general"
_PLANS_MAX = 1024
_fwd_plans: dict = {}
_bwd_plans: dict = {}
_plans_settings: list = [None]


def clear_plans() -> None:
    _fwd_plans.clear()
    _bwd_plans.clear()
    _gluon_plans.clear()
    _gluon_bwd_plans.clear()
    _plans_settings[0] = None


def _settings() -> tuple:
    """What plans depend on beyond their keys; plans are dropped when any of it is replaced."""
    return (kernels, _kernels, _config.fp_fusion, tuple(_override.items()), DKDV_SPLIT_MAX_BYTES,
            SPLIT_SUM_BLOCK_R, SPLIT_SUM_WARPS, BACKWARD_HEAD_GROUP, INTERPRETER_CONFIG,
            config, dkdv_split, DKDV_HEADS_PER_PROGRAM, _gpu, _check_device, _use_tma, launch, FWD_CONFIGS,
            DKDV_CONFIGS, DQ_CONFIGS, MASK_CONFIGS, FP32_FWD, FP32_BWD, _gluon.settings(), gluon_reason)


def _tables() -> tuple[dict, dict]:
    settings = _settings()
    if _plans_settings[0] != settings:
        clear_plans()
        _plans_settings[0] = settings
    return _fwd_plans, _bwd_plans


class _GridLaunch:
    """``kernel[grid](*args, **kwargs)`` (the interpreter, CPU / meta tensors, recorders)."""

    __slots__ = ("kernel", "grid", "kwargs")

    def __init__(self, kernel, grid: tuple, kwargs: dict):
        self.kernel, self.grid, self.kwargs = kernel, grid, kwargs

    def __call__(self, *args) -> None:
        self.kernel[self.grid](*args, **self.kwargs)


def _launcher(kernel, grid: tuple, kwargs: dict, device: torch.device):
    """What ``_launch`` does for a non-TMA launch, once per plan: on CUDA one KernelLaunch (as
    ``safeops.ops._launch.launch`` keeps one per argument signature), else ``kernel[grid]``."""
    if (device.type == "cuda" and isinstance(kernel, JITFunction)
            and not isinstance(kernel, InterpretedFunction)):
        return KernelLaunch(kernel, grid, kwargs)
    return _GridLaunch(kernel, grid, kwargs)


def _split_args(args: tuple, n: int) -> tuple | None:
    """The scalars after the ``n`` leading tensor arguments, or None if the launch is not of that form."""
    head, tail = args[:n], args[n:]
    if len(head) != n or not all(isinstance(a, torch.Tensor) for a in head):
        return None
    if any(isinstance(a, torch.Tensor) for a in tail):
        return None
    return tail


def _sig(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.data_ptr() % 16


class _FwdPlan:
    __slots__ = ("run", "scalars", "out_like_q", "out_shape", "out_dtype", "stat_shape", "acc", "mask_bool",
                 "varlen", "tma")


class _BwdPlan:
    __slots__ = ("dkdv", "dkdv_scalars", "dq", "dq_scalars", "split", "part_shape",
                 "sum", "sum_scalars", "mask_bool", "varlen", "grad_dtype", "tma")


# A record entry of a Gluon backward plan the general path ran: (_GLUON, plan, the tensors it was given).
_GLUON = "gluon"


class _GluonBwdPlan:
    """The backward's launches where the Gluon kernels compute dq (the dK / dV + dQ pair, or the fused
    kernel): the delta-only launch of the Triton dq kernel, then the kept Gluon plans, called as the general
    path calls them."""

    __slots__ = ("delta", "delta_scalars", "fused", "dq", "dkdv", "varlen", "tma")


def _forward_plan(q, k, v, mask, cu_q, out_dtype, sinks, result, record) -> _FwdPlan | str:
    out, row_max, row_sum = result
    if len(record) != 1:
        return _GENERAL
    kernel, grid, args, kwargs = record[0]
    # The 9 leading tensors, the sinks (a tensor or None: the plan passes the call's own), the scalars.
    scalars = _split_args(args[:9] + args[10:], 9)
    if (scalars is None or args[0] is not q or args[1] is not k or args[2] is not v or args[3] is not out
            or args[4] is not row_max or args[5] is not row_sum or args[9] is not sinks):
        return _GENERAL
    plan = _FwdPlan()
    plan.tma = bool(kwargs.get("USE_TMA"))
    plan.run = _launcher(kernel, grid, kwargs, q.device)
    plan.scalars = scalars
    plan.out_like_q = (out_dtype is None or out_dtype == q.dtype) and q.shape[-1] == v.shape[-1]
    plan.out_shape, plan.out_dtype = tuple(out.shape), out.dtype
    plan.stat_shape, plan.acc = tuple(row_max.shape), row_max.dtype
    plan.mask_bool = mask is not None and mask.dtype == torch.bool
    plan.varlen = cu_q is not None
    return plan


def gluon_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, out_dtype=None, sinks=None) -> str:
    """The path choice of ``forward``: ``""`` when the Gluon kernel runs it (``attention_gluon.reason``),
    unless a Triton forward configuration is forced (``config_override``, for sweeps and tests)."""
    if "fwd" in _override:
        return "a Triton forward configuration is forced (attention_launch.config_override)"
    return _gluon.reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, out_dtype, sinks)


_gluon_plans: dict = {}


def gluon_forward(q, k, v, causal: bool = False, scale: float | None = None, *,
                  persistent: bool | None = None, config=None):
    """``(o, m, l)`` of dense attention through the Gluon kernel, for benchmarks and tests (``forward``
    takes this path where ``gluon_reason`` says so). ``persistent`` / ``config`` (a ``GluonFwdConfig``)
    are benchmark knobs. Raises ValueError with ``gluon_reason``'s answer for an input it does not take."""
    why = gluon_reason(q, k, v, None, None, causal, None, -1, 0 if causal else -1)
    if why:
        raise ValueError(why)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    key = tuple((t.shape, t.stride(), t.dtype, t.data_ptr() % 16, t.device) for t in (q, k, v)) + (
        causal, scale, persistent, config, _gluon.settings(), _config.fp_fusion)
    plan = _gluon_plans.get(key)
    if plan is None:
        if len(_gluon_plans) >= 256:
            _gluon_plans.clear()
        c1 = constants(scale, None)[0]
        plan = _gluon_plans[key] = _gluon.Plan(q, k, v, None, q.shape[2], k.shape[2], causal, c1,
                                               persistent=persistent, config=config)
    return plan(q, k, v)


def gluon_bwd_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, grad_dtype=None) -> str:
    """The backward's path choice for dk / dv: ``""`` when the Gluon dK / dV kernel computes them
    (``attention_gluon.bwd_reason``), unless a Triton dk/dv configuration is forced (``config_override``)."""
    if "dkdv" in _override:
        return "a Triton dk/dv configuration is forced (attention_launch.config_override)"
    return _gluon.bwd_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, grad_dtype)


def gluon_fused_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, grad_dtype=None) -> str:
    """The backward's path choice for the fused kernel: ``""`` when it computes dq, dk and dv
    (``attention_gluon.fused_reason``), unless a Triton dq or dk/dv configuration is forced."""
    if "dq" in _override or "dkdv" in _override:
        return "a Triton dq or dk/dv configuration is forced (attention_launch.config_override)"
    return _gluon.fused_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, grad_dtype)


def gluon_dq_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, grad_dtype=None) -> str:
    """The backward's path choice for dq: ``""`` when the Gluon dQ kernel computes it
    (``attention_gluon.dq_reason``), unless a Triton dq or dk/dv configuration is forced."""
    if "dq" in _override or "dkdv" in _override:
        return "a Triton backward configuration is forced (attention_launch.config_override)"
    return _gluon.dq_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, grad_dtype)


_gluon_bwd_plans: dict = {}


def _gluon_launch(plan_class, inputs: tuple, outputs: tuple, causal: bool, c1: float, scale_ds: float,
                  seq: tuple = (None, 0, 0, -1)):
    """The kept ``attention_gluon.BwdPlan`` / ``DqPlan`` / ``FusedPlan`` for these inputs (q, k, v, grad)
    and outputs (their layouts and alignment make the key) and ``seq`` = (cu_q, max_q, max_k,
    window_left) (packed sequences: cu_q not None), made on first use."""
    cu_q, max_q, max_k, wl = seq
    key = (plan_class,) + tuple((t.shape, t.stride(), t.dtype, t.data_ptr() % 16, t.device)
                                for t in inputs + outputs) + (causal, c1, scale_ds, _gluon.settings(),
                                                              _config.fp_fusion, _sig(cu_q), max_q, max_k, wl)
    plan = _gluon_bwd_plans.get(key)
    if plan is None:
        if len(_gluon_bwd_plans) >= 256:
            _gluon_bwd_plans.clear()
        extra = () if cu_q is None and wl < 0 else (cu_q, max_q, max_k, wl)
        plan = _gluon_bwd_plans[key] = plan_class(*inputs, causal, c1, scale_ds, *extra)
    return plan


def forward(q, k, v, mask, mask_kind, cu_q, cu_k, max_q, max_k, is_causal, scale, softcap, wl, wr, precision,
            *, out_dtype: torch.dtype | None = None, sinks: torch.Tensor | None = None):
    """``(out, row_max, row_sum)``. ``out_dtype`` (internal): the output's dtype when it is not q's, e.g.
    fp32 partials that are merged before the one rounding (safeops.distributed); the kernel stores in its
    output pointer's type. ``sinks``: None or the (Hq,) fp32 sink logits (the stats then include them)."""
    plans = _tables()[0]
    key = (q.device, q.shape, q.stride(), q.dtype, q.data_ptr() % 16, k.shape, k.stride(), k.dtype,
           k.data_ptr() % 16, v.shape, v.stride(), v.dtype, v.data_ptr() % 16, _sig(mask), mask_kind,
           _sig(cu_q), _sig(cu_k), max_q, max_k, is_causal, scale, softcap, wl, wr, precision, out_dtype,
           _sig(sinks))
    plan = plans.get(key)
    if plan is None:
        # The path choice (safeops.attention_backend reports it): the Gluon kernel where it takes the forward.
        if not gluon_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, out_dtype, sinks):
            if len(plans) >= _PLANS_MAX:
                plans.clear()
            c1, c2, _ = constants(scale, softcap)
            plan = plans[key] = _gluon.Plan(q, k, v, cu_q, max_q, max_k, is_causal, c1,
                                            sinks=sinks is not None, window_left=wl,
                                            softcap_c2=None if softcap is None else c2)
            return plan(q, k, v, cu_q, cu_k, sinks)
        record: list = []
        result = _forward_general(q, k, v, mask, mask_kind, cu_q, cu_k, max_q, max_k, is_causal, scale,
                                  softcap, wl, wr, precision, out_dtype=out_dtype, sinks=sinks, record=record)
        if len(plans) >= _PLANS_MAX:
            plans.clear()
        plans[key] = _forward_plan(q, k, v, mask, cu_q, out_dtype, sinks, result, record)
        return result
    if plan is _GENERAL:
        return _forward_general(q, k, v, mask, mask_kind, cu_q, cu_k, max_q, max_k, is_causal, scale, softcap,
                                wl, wr, precision, out_dtype=out_dtype, sinks=sinks)
    if plan.__class__ is _gluon.Plan:
        return plan(q, k, v, cu_q, cu_k, sinks)
    device = q.device
    if plan.out_like_q:
        out = torch.empty_like(q)
    else:
        out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=device)
    row_max = torch.empty(plan.stat_shape, dtype=plan.acc, device=device)
    row_sum = torch.empty(plan.stat_shape, dtype=plan.acc, device=device)
    mask_arg = q if mask is None else mask.view(torch.uint8) if plan.mask_bool else mask
    if plan.tma:  # Triton's scratch allocator is per thread (autograd's backward thread too)
        ensure_tma_allocator()
    if plan.varlen:
        plan.run(q, k, v, out, row_max, row_sum, mask_arg, cu_q, cu_k, sinks, *plan.scalars)
    else:
        plan.run(q, k, v, out, row_max, row_sum, mask_arg, q, q, sinks, *plan.scalars)
    return out, row_max, row_sum


def _gluon_backward_plan(grad, q, k, v, out, row_max, row_sum, mask, cu_q, grad_dtype, sinks, result, record
                         ) -> _GluonBwdPlan | str:
    """The plan of a backward whose dq came from a Gluon kernel (``record``: the delta-only Triton launch,
    then the Gluon plans with their tensors), if every tensor the general path passed is the call's own (no
    copy, no scratch output); else ``_GENERAL``."""
    dq, dk, dv = result[:3]
    (kernel, grid, args_q, kw_q), *gluon = record
    if mask is not None or grad_dtype is not None or not gluon or any(r[0] != _GLUON for r in gluon):
        return _GENERAL
    scalars = _split_args(args_q[:12] + args_q[14:], 12)
    inputs = (q, k, v, grad)
    if (scalars is None or not all(a is t for a, t in zip(args_q[:4], inputs, strict=True))
            or args_q[4] is not out or args_q[5] is not dq or args_q[6] is not row_max
            or args_q[7] is not row_sum or args_q[12] is not sinks
            or (args_q[13] is None) != (sinks is None)):
        return _GENERAL
    plans = [r[1] for r in gluon]
    expected = ([(_gluon.FusedPlan, (dq, dk, dv))] if len(gluon) == 1 else
                [(_gluon.DqPlan, (dq,)), (_gluon.BwdPlan, (dk, dv))])
    if len(expected) != len(gluon):
        return _GENERAL
    for (_, plan, tensors), (cls, outputs) in zip(gluon, expected, strict=True):
        if type(plan) is not cls or len(tensors) != 4 + len(outputs) or not all(
                a is t for a, t in zip(tensors, inputs + outputs, strict=True)):
            return _GENERAL
    plan = _GluonBwdPlan()
    plan.tma = bool(kw_q.get("USE_TMA"))
    plan.delta = _launcher(kernel, grid, kw_q, q.device)
    plan.delta_scalars = scalars
    plan.fused = plans[0] if len(plans) == 1 else None
    plan.dq, plan.dkdv = (None, None) if len(plans) == 1 else plans
    plan.varlen = cu_q is not None
    return plan


def _backward_plan(grad, q, k, v, out, row_max, row_sum, mask, cu_q, grad_dtype, sinks, result, record
                   ) -> _BwdPlan | _GluonBwdPlan | str:
    dq, dk, dv = result[:3]
    if record and record[0][3].get("DELTA_ONLY"):  # dq from a Gluon kernel
        return _gluon_backward_plan(grad, q, k, v, out, row_max, row_sum, mask, cu_q, grad_dtype, sinks,
                                    result, record)
    if any(r[0] == _GLUON for r in record):  # Gluon dK / dV beside the Triton dq kernel
        return _GENERAL
    if len(record) == 3:  # dq (and delta), dk/dv, the split's sum
        record, sum_launch = record[:2], record[2]
    elif len(record) == 2:
        sum_launch = None
    else:
        return _GENERAL
    (dk_q, grid_q, args_q, kw_q), (dk_k, grid_k, args_k, kw_k) = record
    if kw_q.get("DELTA_ONLY"):  # dq comes from the Gluon kernel, which a plan does not replay
        return _GENERAL
    # dq's 12 leading tensors, then the sinks and their per-row buffer (tensors or None), then the scalars.
    dq_scalars, dkdv_scalars = _split_args(args_q[:12] + args_q[14:], 12), _split_args(args_k, 12)
    if dq_scalars is None or dkdv_scalars is None:
        return _GENERAL
    delta = args_q[8]
    inputs = (q, k, v, grad)
    same = (all(a is t for a, t in zip(args_q[:4], inputs, strict=True)) and args_q[4] is out
            and args_q[5] is dq and args_q[6] is row_max and args_q[7] is row_sum
            and all(a is t for a, t in zip(args_k[:4], inputs, strict=True))
            and args_k[6] is row_max and args_k[7] is row_sum and args_k[8] is delta
            and args_q[12] is sinks and (args_q[13] is None) == (sinks is None))
    if not same:
        return _GENERAL
    split = kw_k["SPLIT"]
    sum_scalars = None
    if split == 1:
        if sum_launch is not None or args_k[4] is not dk or args_k[5] is not dv:
            return _GENERAL
    else:
        if sum_launch is None or not (args_k[4].shape == args_k[5].shape
                                      and args_k[4].dtype == args_k[5].dtype == torch.float32
                                      and args_k[4].is_contiguous() and args_k[5].is_contiguous()):
            return _GENERAL
        args_s = sum_launch[2]
        sum_scalars = _split_args(args_s, 4)
        if (sum_scalars is None or args_s[0] is not args_k[4] or args_s[1] is not args_k[5]
                or args_s[2] is not dk or args_s[3] is not dv):
            return _GENERAL
    plan = _BwdPlan()
    plan.tma = bool(kw_k.get("USE_TMA") or kw_q.get("USE_TMA"))
    plan.sum, plan.sum_scalars = None, sum_scalars
    if sum_launch is not None:
        plan.sum = _launcher(sum_launch[0], sum_launch[1], sum_launch[3], q.device)
    plan.dkdv = _launcher(dk_k, grid_k, kw_k, q.device)
    plan.dq = _launcher(dk_q, grid_q, kw_q, q.device)
    plan.dkdv_scalars, plan.dq_scalars = dkdv_scalars, dq_scalars
    plan.split, plan.part_shape = split, tuple(args_k[4].shape)
    plan.mask_bool = mask is not None and mask.dtype == torch.bool
    plan.varlen = cu_q is not None
    plan.grad_dtype = grad_dtype
    return plan


def backward(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_q, cu_k, max_q, max_k, is_causal,
             scale, softcap, wl, wr, precision, *, grad_dtype: torch.dtype | None = None,
             sinks: torch.Tensor | None = None):
    """``(dq, dk, dv)``, with ``sinks`` (the forward's fp32 sink logits) ``(dq, dk, dv, dsinks)``: dq, dk and
    dv need no sinks (the saved stats include them), only dsinks does. ``grad_dtype`` (internal): dq, dk, dv
    in this dtype instead of the inputs' (see ``forward``)."""
    plans = _tables()[1]
    key = (q.device, grad.shape, grad.stride(), grad.dtype, grad.data_ptr() % 16, q.shape, q.stride(),
           q.dtype, q.data_ptr() % 16, k.shape, k.stride(), k.dtype, k.data_ptr() % 16, v.shape, v.stride(),
           v.dtype, v.data_ptr() % 16, out.shape, out.stride(), out.dtype, out.data_ptr() % 16, _sig(row_max),
           _sig(row_sum), _sig(mask), mask_kind, _sig(cu_q), _sig(cu_k), max_q, max_k, is_causal, scale,
           softcap, wl, wr, precision, grad_dtype, _sig(sinks))
    plan = plans.get(key)
    if plan is None:
        record: list = []
        result = _backward_general(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_q, cu_k, max_q,
                                   max_k, is_causal, scale, softcap, wl, wr, precision, grad_dtype=grad_dtype,
                                   sinks=sinks, record=record)
        if len(plans) >= _PLANS_MAX:
            plans.clear()
        plans[key] = _backward_plan(grad, q, k, v, out, row_max, row_sum, mask, cu_q, grad_dtype, sinks,
                                    result, record)
        return result
    if plan is _GENERAL:
        return _backward_general(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_q, cu_k, max_q,
                                 max_k, is_causal, scale, softcap, wl, wr, precision, grad_dtype=grad_dtype,
                                 sinks=sinks)
    if plan.__class__ is _GluonBwdPlan:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty_like(row_max)
        dsink_rows = None if sinks is None else torch.empty_like(row_max)
        if plan.tma:
            ensure_tma_allocator()
        cq, ck = (cu_q, cu_k) if plan.varlen else (q, q)
        plan.delta(q, k, v, grad, out, dq, row_max, row_sum, delta, q, cq, ck, sinks, dsink_rows,
                   *plan.delta_scalars)
        if plan.fused is not None:
            plan.fused(q, k, v, grad, row_max, row_sum, delta, dq, dk, dv)
        else:
            plan.dq(q, k, v, grad, row_max, row_sum, delta, dq, cu_q, cu_k)
            plan.dkdv(q, k, v, grad, row_max, row_sum, delta, dk, dv, cu_q, cu_k)
        if sinks is not None:
            return dq, dk, dv, sinks_gradient(dsink_rows, plan.varlen)
        return dq, dk, dv
    device = q.device
    if grad_dtype is None:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    else:
        dq, dk, dv = (torch.empty(t.shape, dtype=grad_dtype, device=device) for t in (q, k, v))
    delta = torch.empty_like(row_max)
    mask_arg = q if mask is None else mask.view(torch.uint8) if plan.mask_bool else mask
    if not plan.varlen:
        cu_q = cu_k = q
    if plan.tma:
        ensure_tma_allocator()
    dsink_rows = None if sinks is None else torch.empty_like(row_max)
    plan.dq(q, k, v, grad, out, dq, row_max, row_sum, delta, mask_arg, cu_q, cu_k, sinks, dsink_rows,
            *plan.dq_scalars)
    split = plan.split
    if split > 1:  # fp32 partials per slice of each kv head's query group, summed below
        dk_ = torch.empty(plan.part_shape, dtype=torch.float32, device=device)
        dv_ = torch.empty(plan.part_shape, dtype=torch.float32, device=device)
    else:
        dk_, dv_ = dk, dv
    plan.dkdv(q, k, v, grad, dk_, dv_, row_max, row_sum, delta, mask_arg, cu_q, cu_k, *plan.dkdv_scalars)
    if split > 1:
        plan.sum(dk_, dv_, dk, dv, *plan.sum_scalars)
    if sinks is not None:
        return dq, dk, dv, sinks_gradient(dsink_rows, plan.varlen)
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------------
# Ahead-of-time compilation without a GPU (or in parallel on one): tests/test_attention_configs.py compiles
# every configuration for sm_90 offline; bench/attention.py --sweep warms Triton's cache in parallel.
# ------------------------------------------------------------------------------------------------------

KERNEL_NAMES = ("attn_fwd_kernel", "attn_bwd_dkdv_kernel",
                "attn_bwd_split_sum_kernel", "attn_bwd_dq_kernel")
KERNEL_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels",
                           "attention.py")


def _describe(x):
    if isinstance(x, torch.Tensor):
        return {"tensor": str(x.dtype).removeprefix("torch.")}
    if isinstance(x, (bool, int, float)) or x is None:
        return x
    raise TypeError(f"unexpected launch argument {type(x).__name__}")


class _Recorder:
    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({"kernel": self.name, "args": [_describe(a) for a in args],
                                  "kwargs": {k: _describe(v) for k, v in kwargs.items()}})
        return launch


@contextlib.contextmanager
def recording():
    """Inside the block the kernels are recorded, not launched: yields the list of launches (kernel name,
    argument dtypes / values, constexprs and options). Call ``forward`` / ``backward`` with META tensors of
    the real shapes and strides: meta plans exactly the launch CUDA would make."""
    global _kernels
    launches: list[dict] = []
    saved = _kernels
    _kernels = SimpleNamespace(**{name: _Recorder(name, launches) for name in KERNEL_NAMES})
    try:
        yield launches
    finally:
        _kernels = saved


_COMPILE_WORKER = textwrap.dedent(
    r"""
    import importlib.util, json, multiprocessing, os, sys, types
    from concurrent.futures import ProcessPoolExecutor

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import MockTensor, create_function_from_signature

    DTYPES = {"bfloat16": tl.bfloat16, "float16": tl.float16, "float32": tl.float32, "float64": tl.float64,
              "uint8": tl.uint8, "int32": tl.int32, "int64": tl.int64}
    _module = None

    def kernels(path):
        global _module
        if _module is None:  # the package's module name: it is part of Triton's cache key
            # The kernel module imports its siblings (safeops.kernels.reduce): bare package modules make those
            # importable without running safeops/__init__ (torch, and Triton's interpreter on a CPU machine).
            kernels_dir = os.path.dirname(path)
            for name, where in (("safeops", os.path.dirname(kernels_dir)), ("safeops.kernels", kernels_dir)):
                package = types.ModuleType(name)
                package.__path__ = [where]
                sys.modules[name] = package
            spec = importlib.util.spec_from_file_location("safeops.kernels.attention", path)
            _module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(_module)
        return _module

    def value(x):
        return MockTensor(DTYPES[x["tensor"]]) if isinstance(x, dict) else x

    def compile_one(job):
        path, arch, launch = job
        try:
            target = GPUTarget("cuda", arch, 32)
            fn = getattr(kernels(path), launch["kernel"])
            backend = make_backend(target)
            args = [value(a) for a in launch["args"]]
            kwargs = {k: value(v) for k, v in launch["kwargs"].items()}
            kwargs.setdefault("debug", False)  # as JITFunction.run sets them
            kwargs.setdefault("instrumentation_mode", "")
            # Triton's own binder: the same specialization (ints equal to 1, multiples of 16) as a launch.
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            bound, specialization, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization,
                                                                  options)
            c = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                               options=options.__dict__)
            return {"ok": True, "shared": c.metadata.shared}
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {str(e)[-1500:]}"}

    if __name__ == "__main__":
        request = json.load(sys.stdin)
        jobs = [(request["kernel_file"], request["arch"], launch) for launch in request["launches"]]
        workers = max(1, min(len(jobs), request.get("workers") or os.cpu_count() or 1))
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(compile_one, jobs, chunksize=1))
        print(json.dumps({"triton": triton.__version__, "results": results}))
    """
)


def compile_launches(launches: list[dict], python: str | None = None, arch: int = 90,
                     workers: int | None = None, timeout: float = 1800) -> dict:
    """Compiles recorded launches for ``cuda:arch`` (ptxas included) in a subprocess pool, without a GPU and
    without Triton's interpreter; results land in Triton's on-disk cache, so the real launches later find
    them. Returns ``{"triton": version, "results": [{"ok", "shared" | "error"}, ...]}`` in launch order."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if "TRITON_INTERPRET" in env:  # off in the worker; left unset when unset (env is part of cache keys)
        env["TRITON_INTERPRET"] = "0"
    request = json.dumps({"kernel_file": KERNEL_FILE, "arch": arch, "launches": launches, "workers": workers})
    proc = subprocess.run([python or sys.executable, "-c", _COMPILE_WORKER], input=request,
                          capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"offline compile worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
