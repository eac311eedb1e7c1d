"""Launcher of the Gluon attention forward for Hopper (``safeops.kernels.attention_gluon``).

``forward(q, k, v, causal, scale)`` returns ``(o, m, l)`` with the meaning of the Triton forward's
(``safeops.ops.attention_launch.forward``): o in q's dtype, and per query row the base-2 row max ``m`` and
row sum ``l`` in fp32, kept apart (contract section 3), so the Triton backward consumes them unchanged.
``can_run(q, k, v, ...)`` says whether this path can take an input and, if not, why, in words.

Dense layout only: q ``(B, Hq, Sq, D)``, k / v ``(B, Hkv, Sk, D)`` (GQA / MQA: kv head = q head //
(Hq / Hkv)), any strides with a unit last stride that TMA accepts (16-byte aligned base and strides), so a
(B, S, H, D) tensor transposed to (B, H, S, D) runs without a copy. The configuration depends on the head
dim only (``FWD_CONFIGS``), never on batch, heads or sequence lengths: batch-invariant bits (contract
section 6).
"""

from __future__ import annotations

import functools

import torch
import triton

from .. import _config

_kernels = None

# Gluon's API changes between Triton releases; the kernel is written against this one.
TRITON_VERSION = (3, 6)
# Persistent grid (one program per SM walking the tiles) or one program per tile. Same bits either way.
PERSISTENT = False
# Causal tiles run in chunks of heads whose K and V take about this many bytes (the H100 / H200 L2 is 50 MB),
# so the programs running at once share K/V blocks in L2. Scheduling only: the bits do not depend on it.
L2_CHUNK_BYTES = 32 << 20


def kernels():
    """The Gluon kernel module, imported on first use (importing safeops must not compile anything)."""
    global _kernels
    if _kernels is None:
        from ..kernels import attention_gluon as module

        _kernels = module
    return _kernels


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tma_strides(t: torch.Tensor) -> list[int]:
    """t's strides for a TMA descriptor: a dimension of size 1 is never stepped along, so its stride (which
    torch leaves arbitrary) is replaced by a valid one (16 bytes)."""
    return [s if n > 1 else 16 // t.element_size() for n, s in zip(t.shape, t.stride(), strict=True)]


def _tma_ok(t: torch.Tensor) -> bool:
    per16 = 16 // t.element_size()
    strides = _tma_strides(t)
    return t.data_ptr() % 16 == 0 and strides[-1] == 1 and all(s > 0 and s % per16 == 0 for s in strides[:-1])


def can_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
            mask=None, softcap=None, window=None, varlen: bool = False) -> tuple[bool, str]:
    """(True, "") if :func:`forward` can compute this attention, else (False, the reason in words)."""
    named = [n for n, x in (("attn_mask", mask), ("softcap", softcap), ("window", window),
                            ("varlen", varlen or None)) if x is not None]
    if named:
        return False, f"the Gluon forward does not support {', '.join(named)} yet"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            return False, f"{name} has {t.dim()} dims, the Gluon forward takes (B, H, S, D)"
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False, (f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}: the Gluon forward takes bf16 or fp16, "
                       "all alike")
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        return False, f"head dims q {d}, k {k.shape[-1]}, v {v.shape[-1]}: the Gluon forward needs them equal"
    configs = kernels().FWD_CONFIGS
    if d not in configs:
        return False, f"head dim {d}: the Gluon forward has head dims {sorted(configs)}"
    if k.shape != v.shape or k.shape[0] != q.shape[0]:
        return False, f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return False, f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads"
    if q.shape[0] * q.shape[1] * triton.cdiv(q.shape[2], configs[d].block_m) >= 2**31:
        return False, "too many query tiles for the 1-D grid"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            return False, f"{name} is on {t.device}, the Gluon forward needs CUDA tensors"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(q.device)
        return False, f"the Gluon forward needs a Hopper GPU (sm_90), this is sm_{major}{minor}"
    if _triton_version() != TRITON_VERSION:
        return False, (f"the Gluon forward is written for Triton {'.'.join(map(str, TRITON_VERSION))}, "
                       f"this is Triton {triton.__version__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not _tma_ok(t):
            return False, (f"{name} strides {tuple(t.stride())} or alignment do not suit TMA (unit last "
                           "stride, 16-byte aligned base and strides)")
    return True, ""


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
            scale: float | None = None, *, persistent: bool | None = None,
            config=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, m, l)``: o ``(B, Hq, Sq, D)`` in q's dtype and layout, m and l ``(B, Hq, Sq)`` fp32 (base 2).

    ``scale`` defaults to 1 / sqrt(D); ``causal`` is top-left aligned (query i sees keys j <= i), as in the
    Triton path. ``persistent`` / ``config`` (a ``GluonFwdConfig``) are benchmark knobs. Raises ValueError
    with :func:`can_run`'s reason for an input this path cannot take."""
    ok, why = can_run(q, k, v, causal=causal)
    if not ok:
        raise ValueError(why)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .attention_launch import constants  # the Triton path's host constants: the same C1 bits

    K = kernels()
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    o = torch.empty_like(q)  # q's layout: a transposed (B, S, H, D) q gives a transposed o
    m = torch.empty(batch, hq, sq, dtype=torch.float32, device=q.device)
    l = torch.empty(batch, hq, sq, dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return o, m, l
    if sk == 0:  # no keys: every row is empty (contract section 4)
        return o.zero_(), m.fill_(float("-inf")), l.zero_()
    cfg = config or K.FWD_CONFIGS[d]
    dtype = "bfloat16" if q.dtype == torch.bfloat16 else "float16"
    descs = []
    for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
        shape = K.block_shapes(cfg, d)[name]
        layout = K.shared_layout(shape[2], d, dtype)
        descs.append(TensorDescriptor(t, list(t.shape), _tma_strides(t), shape, layout))
    n_m_blocks = triton.cdiv(sq, cfg.block_m)
    n_tiles = n_m_blocks * batch * hq
    persistent = PERSISTENT if persistent is None else persistent
    grid = (min(n_tiles, _num_sms(q.device.index)) if persistent else n_tiles,)
    kv_bytes = 2 * sk * d * k.element_size()  # one kv head's K and V, shared by hq // hkv query heads
    head_group = max(1, min(batch * hq, L2_CHUNK_BYTES * (hq // hkv) // kv_bytes))
    c1 = constants(scale, None)[0]
    with torch.cuda.device(q.device):
        K.attn_fwd_gluon_kernel[grid](
            *descs, m, l, c1, hq, hq // hkv, head_group, sq, sk, n_m_blocks, n_tiles,
            **K.constexprs(cfg, causal), **K.LAUNCH_OPTIONS, enable_fp_fusion=_config.fp_fusion)
    return o, m, l
