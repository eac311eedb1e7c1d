"""Public functions: argument checking (contract section 8), then one registered op call."""

from __future__ import annotations

import math
import numbers

import torch

from . import dtensor as _dtensor
from .ops import attention as _ops_attention
from .ops import cast_transpose as _ops_cast
from .ops import cross_entropy as _ops_ce
from .ops import merge as _ops_merge
from .ops import softmax as _ops

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_x(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATING:
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")


def _normalize_dim(dim, ndim: int) -> int:
    if type(dim) is not int:  # a plain int skips the abstract-class check (~0.3 us per call)
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
            raise TypeError(f"dim must be an int, got {type(dim).__name__}")
        dim = int(dim)
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise ValueError(f"dim {dim} is out of range for a tensor with {ndim} dimensions")
    return dim % rank


def _split_scale(scale, x: torch.Tensor) -> tuple[float | None, torch.Tensor | None]:
    if scale is None:
        return None, None
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dim() > 1:
            raise ValueError(f"scale must be a python float or a one-element tensor (0-d or shape (1,)), got "
                             f"shape {tuple(scale.shape)}")
        if not scale.dtype.is_floating_point:
            raise TypeError(f"scale tensor must be floating point, got {scale.dtype}")
        if scale.device != x.device:
            if scale.device.type != "cpu":
                raise ValueError(f"scale is on {scale.device} but x is on {x.device}")
            scale = scale.to(x.device)
        return None, scale.reshape(())
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a python float or a 0-d tensor, got {type(scale).__name__}")
    return float(scale), None


def _prepare_mask(mask, x: torch.Tensor) -> torch.Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a bool tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = keep), got {mask.dtype}")
    if mask.device != x.device:
        raise ValueError(f"mask is on {mask.device} but x is on {x.device}")
    try:
        shape = torch.broadcast_shapes(mask.shape, x.shape)
    except RuntimeError:
        shape = None
    if shape != x.shape:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to x's shape {tuple(x.shape)}"
        )
    return mask.expand(x.shape)


def _check_dtype(dtype) -> None:
    if dtype is not None and dtype not in _FLOATING:
        raise TypeError(
            f"dtype must be None or a floating dtype (float16, bfloat16, float32, float64), got {dtype}"
        )


def _prepare(x, dim, scale, mask, dtype):
    _check_x(x)
    dim = _normalize_dim(dim, x.dim())
    _check_dtype(dtype)
    scale_value, scale_tensor = _split_scale(scale, x)
    mask = _prepare_mask(mask, x)
    if _dtensor.any_dtensor(x, scale_tensor, mask):  # run locally on each shard, or a clear error
        scale_tensor, mask = _dtensor.prepare_rows(x, dim, scale_tensor, mask)
    return dim, scale_value, scale_tensor, mask


def softmax(x, dim=-1, *, scale=None, mask=None, dtype=None) -> torch.Tensor:
    """``softmax(z)`` along ``dim``, ``z = fp32(x) * fp32(scale)``, entries where ``mask`` is False excluded.

    Contract: one materialized fp32 ``z`` feeds the max and the subtraction (section 1), fp32 inside and
    one rounding to ``dtype`` (or ``x.dtype``) at the end (2), the backward recomputes fp32 probabilities
    from ``x`` and the saved row max and sum (3), a row with nothing included gives 0 (4).

    Args:
        x: float16, bfloat16, float32 or float64 tensor, any shape and strides.
        dim: the dimension to normalize over.
        scale: python float or 0-d tensor, applied as one fp32 multiply; a tensor scale gets a gradient.
        mask: bool tensor broadcastable to ``x``; True keeps an entry.
        dtype: output dtype. Unlike ``torch.softmax``, ``x`` is not rounded to it first.
    """
    dim, scale_value, scale_tensor, mask = _prepare(x, dim, scale, mask, dtype)
    if x.dim() == 0:
        return softmax(x.reshape(1), 0, scale=scale, mask=None if mask is None else mask.reshape(1),
                       dtype=dtype).reshape(())
    return _ops.forward(_ops.SOFTMAX, x, dim, scale_value, scale_tensor, mask, dtype)[0]


def log_softmax(x, dim=-1, *, scale=None, mask=None, dtype=None) -> torch.Tensor:
    """``log(softmax(z))`` along ``dim``, computed as ``(z - m) - log(l)``, never ``z - lse``.

    Same arguments as :func:`softmax`. Values are ``<= 0``; a dominating logit gives exactly 0; excluded
    entries and empty rows give ``-inf`` with zero gradient (contract sections 1, 3, 4).
    """
    dim, scale_value, scale_tensor, mask = _prepare(x, dim, scale, mask, dtype)
    if x.dim() == 0:
        return log_softmax(x.reshape(1), 0, scale=scale, mask=None if mask is None else mask.reshape(1),
                           dtype=dtype).reshape(())
    return _ops.forward(_ops.LOG_SOFTMAX, x, dim, scale_value, scale_tensor, mask, dtype)[0]


def logsumexp(x, dim=-1, *, scale=None, mask=None, keepdim=False) -> torch.Tensor:
    """``m + log(l)`` along ``dim`` for ``z = fp32(x) * scale`` (excluded entries dropped), in ``x.dtype``.

    A row with nothing included gives ``-inf`` and a zero gradient (contract section 4). A row holding NaN
    gives NaN; one holding +inf and no NaN gives +inf, as ``torch.logsumexp`` does, with its gradient: NaN
    at the +inf entries, 0 at the others (section 5).
    """
    dim, scale_value, scale_tensor, mask = _prepare(x, dim, scale, mask, None)
    if not isinstance(keepdim, bool):
        raise TypeError(f"keepdim must be a bool, got {type(keepdim).__name__}")
    if x.dim() == 0:
        out = logsumexp(x.reshape(1), 0, scale=scale, mask=None if mask is None else mask.reshape(1))
        return out.reshape(())
    out = _ops.forward(_ops.LOGSUMEXP, x, dim, scale_value, scale_tensor, mask, None)[0]
    return out.unsqueeze(dim) if keepdim else out


# --------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------

_MAX_HEAD_DIM = 256


def _matmul_precision() -> str:
    # Read when torch.compile traces (Dynamo cannot put the string in a graph); eager reads it every call.
    return torch.get_float32_matmul_precision()


# What torch.compiler.assume_constant_result does, without importing torch._dynamo at `import safeops`
# (seconds of import time); tests/test_import.py checks that the decorator still sets exactly this.
_matmul_precision._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _check_qkv(q, k, v, rank: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATING:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.dim() != rank:
            raise ValueError(f"{name} must have {rank} dimensions {layout}, got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}: q, k and v must share a dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    h = -2 if rank == 3 else 1  # the head dimension
    hq, hk, hv = q.shape[h], k.shape[h], v.shape[h]
    if hk != hv:
        raise ValueError(f"k has {hk} heads but v has {hv}: k and v must have the same number of heads")
    if hk == 0 and hq != 0 or hk and hq % hk:
        raise ValueError(f"q has {hq} heads, not a multiple of k's {hk} (grouped-query attention needs "
                         "Hq % Hkv == 0)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q has head dim {q.shape[-1]} but k has {k.shape[-1]}: they must match")
    for name, t in (("q", q), ("v", v)):
        if not 1 <= t.shape[-1] <= _MAX_HEAD_DIM:
            raise ValueError(f"{name} has head dim {t.shape[-1]}; supported head dims are 1 to "
                             f"{_MAX_HEAD_DIM}")
    s = 0 if rank == 3 else 2  # the sequence dimension
    if k.shape[s] != v.shape[s]:
        raise ValueError(f"k has {k.shape[s]} keys but v has {v.shape[s]} values: they must match")


def _attention_options(q, scale, softcap, window, is_causal, return_lse, precision):
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be None or a python float, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"softcap must be None or a positive python float, got {type(softcap).__name__}")
        softcap = float(softcap)
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be a positive finite float, got {softcap}")
    left, right = -1, -1
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"window must be None or a pair (left, right), got {window!r}")
        sides = []
        for side, w in zip(("left", "right"), window, strict=True):
            if w is None:
                w = -1
            if isinstance(w, bool) or not isinstance(w, numbers.Integral):
                raise TypeError(f"window {side} must be an int >= 0 (or None / -1 for unbounded), got {w!r}")
            if int(w) < -1:
                raise ValueError(f"window {side} must be >= 0 (or None / -1 for unbounded), got {w}")
            sides.append(int(w))
        left, right = sides
    if is_causal:
        right = 0
    code = 0
    if q.dtype == torch.float32:
        if precision is None:
            precision = {"highest": "ieee"}.get(_matmul_precision(), "tf32")
        if precision not in _ops_attention.PRECISIONS:
            raise ValueError(f"precision must be None, 'ieee', 'tf32' or 'tf32x3', got {precision!r}")
        code = _ops_attention.PRECISIONS[precision]
    elif precision is not None and precision not in _ops_attention.PRECISIONS:
        raise ValueError(f"precision must be None, 'ieee', 'tf32' or 'tf32x3', got {precision!r}")
    return scale, softcap, left, right, code


def _attention_mask(attn_mask, q: torch.Tensor, sk: int):
    if attn_mask is None:
        return None, 0
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be None or a tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype == torch.bool:
        kind = 1
    elif attn_mask.dtype in _FLOATING:
        kind = 2
    else:
        raise TypeError(f"attn_mask must be bool (True = attend) or floating (added to the scores), "
                        f"got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {q.device}")
    if kind == 2 and attn_mask.requires_grad and torch.is_grad_enabled():
        # The kernels treat an additive mask as a constant; silently dropping its gradient would stop a
        # learned bias (relative positions, ALiBi slopes) from training.
        raise ValueError("attn_mask requires grad, but safeops.attention gives an additive mask no gradient; "
                         "pass attn_mask.detach() if it is a constant, or add the bias to the scores outside")
    target = (q.shape[0], q.shape[1], q.shape[2], sk)
    try:
        ok = torch.broadcast_shapes(attn_mask.shape, target) == torch.Size(target)
    except RuntimeError:
        ok = False
    if not ok or attn_mask.dim() > 4:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                         f"(B, Hq, Sq, Sk) = {target}")
    return attn_mask.expand(target), kind  # a view: broadcast dims get stride 0, nothing is materialized


def _attention_sinks(sinks, q: torch.Tensor, heads: int):
    """``sinks`` checked and converted once to the compute dtype of ``q`` (fp32; fp64 for fp64), contiguous:
    a differentiable cast, so the gradient comes back in the sinks' own dtype (rounded once). ``q``: any
    tensor whose dtype and device the sinks follow."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be None or a tensor of shape (Hq,) = ({heads},) (one logit per query "
                        f"head), got {type(sinks).__name__}")
    if sinks.dtype not in _FLOATING:
        raise TypeError(f"sinks must be float16, bfloat16, float32 or float64 (logits, converted once to "
                        f"fp32), got {sinks.dtype}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape (Hq,) = ({heads},), one logit per query head, got shape "
                         f"{tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but the inputs are on {q.device}")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return sinks.to(acc).contiguous()


def _finish(out, row_max, row_sum, return_lse):
    if not return_lse:
        return out
    from . import reference

    return out, reference.attention_lse(row_max.detach(), row_sum.detach())


def attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None, softcap=None, window=None,
              return_lse=False, precision=None, sinks=None):
    """Scaled dot-product attention in the ``(B, H, S, D)`` layout, a drop-in for SDPA.

    Each score is one materialized fp32 value ``z = fp32(q.k) * scale`` (then ``softcap * tanh(z / softcap)``,
    then ``+ attn_mask``) feeding both the row max and the subtraction (contract section 1); the row max and
    sum are kept apart for the backward (3); a query that sees no key gets output 0, lse -inf and zero
    gradient (4); masked keys are selected away, so NaN there does not leak (5); results are deterministic
    and batch-invariant (6); fp32 inputs follow ``precision`` (7); ``sinks`` as section 9 says.

    Args:
        q: ``(B, Hq, Sq, D)``; k: ``(B, Hkv, Sk, D)``; v: ``(B, Hkv, Sk, Dv)``, with ``Hq % Hkv == 0``
            (grouped-query / multi-query attention), head dims 1..256 (multiples of 16 are fastest).
        attn_mask: bool (True = attend) or floating (added to the scores), broadcastable to
            ``(B, Hq, Sq, Sk)``; never materialized. A float mask gets no gradient.
        is_causal: query i sees keys ``j <= i`` (top-left aligned, like SDPA). May be combined with a mask.
        scale: multiplies ``q.k``; default ``1 / sqrt(D)``.
        softcap: ``z = softcap * tanh(z / softcap)`` (Gemma 2 style), applied before the mask.
        window: ``(left, right)``: key j visible iff ``i - left <= j <= i + right``; ``None``/-1 for an
            unbounded side. With ``is_causal`` only ``left`` matters.
        return_lse: also return the natural-log logsumexp per query, fp32, ``(B, Hq, Sq)``.
        precision: fp32 inputs only: ``"ieee"``, ``"tf32"`` (inputs rounded to nearest TF32) or ``"tf32x3"``;
            default from ``torch.get_float32_matmul_precision()``.
        sinks: attention sinks (gpt-oss): a ``(Hq,)`` tensor of logits in the units of the scaled scores
            ``scale * q.k`` (after softcap and mask, which do not touch it), any floating dtype, converted
            once to fp32 (fp64 for fp64 inputs; exact from bf16 / fp16). Each row of head h gets one extra
            logit ``sinks[h]`` that carries no value: it enters the row max and the row sum like a key's
            score (base 2: ``fp32(sinks[h]) * fp32(log2 e)``, one multiply), and the lse includes it. A row
            that sees no key (no keys, fully masked, outside its window) gives output 0 and lse
            ``sinks[h]`` up to one ulp (``fp32(ln 2 * fp32(sinks[h] * log2 e))``: two roundings), with zero
            gradient for q. ``sinks`` gets a gradient, ``-sum over rows of p_sink * rowsum(dO * O)``,
            summed in a fixed order (the same bits on every run).
    """
    _check_qkv(q, k, v, 4, "(B, H, S, D)")
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k and v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, "
                         f"{v.shape[0]}")
    scale, softcap, left, right, code = _attention_options(q, scale, softcap, window, is_causal,
                                                           return_lse, precision)
    mask, mask_kind = _attention_mask(attn_mask, q, k.shape[2])
    if _dtensor.any_dtensor(q, k, v, mask, sinks):  # run locally on each shard, or a clear error
        mask, sinks = _dtensor.prepare_attention(q, k, v, mask, sinks)
    sinks = _attention_sinks(sinks, q, q.shape[1])
    out, row_max, row_sum = _ops_attention.forward(
        q, k, v, mask, mask_kind, None, None, q.shape[2], k.shape[2], is_causal, scale, softcap, left, right,
        code, sinks)
    return _finish(out, row_max, row_sum, return_lse)


def _check_cu_tensor(name: str, cu, device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (as in FlashAttention), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D with batch + 1 entries, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")


def _check_cu_seqlens(name: str, cu, total: int, device, max_seqlen, max_name: str) -> tuple[int, int]:
    _check_cu_tensor(name, cu, device)
    values = cu.tolist()  # one device sync: bad offsets would read out of bounds in the kernel
    if values[0] != 0 or values[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the packed length {total}, got "
                         f"{values[0]} .. {values[-1]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:], strict=True)]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    longest = max(lengths, default=0)
    if max_seqlen is None:
        return longest, len(values) - 1
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral):
        raise TypeError(f"{max_name} must be None or an int, got {type(max_seqlen).__name__}")
    if int(max_seqlen) < longest:
        raise ValueError(f"{max_name} is {max_seqlen} but {name} has a sequence of length {longest}")
    return int(max_seqlen), len(values) - 1


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                     is_causal=False, scale=None, softcap=None, window=None, return_lse=False,
                     precision=None, sinks=None):
    """Attention over packed variable-length sequences, like FlashAttention's ``flash_attn_varlen_func``.

    q ``(Tq, Hq, D)``, k ``(Tk, Hkv, D)``, v ``(Tk, Hkv, Dv)`` hold the sequences back to back; sequence b's
    queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and it attends only to its own keys
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (int32, ``(B + 1,)``, starting at 0). ``max_seqlen_*`` (the longest
    sequence) are computed when None. ``is_causal`` and ``window`` are top-left aligned within each
    sequence, as in :func:`attention` (FlashAttention aligns causal bottom-right when a sequence has more
    keys than queries). FlexAttention's document masking (``doc[q_idx] == doc[kv_idx]``, optionally
    ``and q_idx >= kv_idx``) over one packed batch is this call with ``cu_seqlens_q = cu_seqlens_k`` = the
    document boundaries (and ``is_causal=True``). The lse is ``(Hq, Tq)``. Other arguments and the contract
    are those of :func:`attention`.
    """
    _dtensor.reject_varlen((("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("sinks", sinks)))
    _check_qkv(q, k, v, 3, "(total, H, D)")
    sq, nb = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, max_seqlen_q,
                               "max_seqlen_q")
    sk, nbk = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device, max_seqlen_k,
                                "max_seqlen_k")
    if nb != nbk:
        raise ValueError(f"cu_seqlens_q has {nb + 1} entries but cu_seqlens_k has {nbk + 1}: one batch size")
    scale, softcap, left, right, code = _attention_options(q, scale, softcap, window, is_causal,
                                                           return_lse, precision)
    sinks = _attention_sinks(sinks, q, q.shape[1])
    out, row_max, row_sum = _ops_attention.forward(
        q, k, v, None, 0, cu_seqlens_q, cu_seqlens_k, sq, sk, is_causal, scale, softcap, left, right, code,
        sinks)
    return _finish(out, row_max, row_sum, return_lse)


def attention_backend(q, k, v, *, attn_mask=None, is_causal=False, scale=None, softcap=None, window=None,
                      return_lse=False, precision=None, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None,
                      backward=False) -> tuple[str, str]:
    """Which kernel runs the forward of ``safeops.attention(q, k, v, **options)`` (with ``cu_seqlens_q`` and
    ``cu_seqlens_k``: of ``safeops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)``), and
    why: ``(path, reason)``, the path one of

    - ``"gluon"``: the warp-specialized Hopper kernel (CUDA, sm_90, bf16 / fp16, head dim 64, 128 or 256,
      causal or not, GQA / MQA, dense or packed; no mask, softcap, window or sinks), e.g.
      ``("gluon", "bf16 causal D=128 on sm_90")``;
    - ``"triton"``: the Triton kernels, e.g.
      ``("triton", "the Gluon kernel does not take an attention mask")``;
    - ``"reference"``: the pure-torch reference (fp64 inputs, CPU tensors, ``SAFEOPS_BACKEND=reference``).

    The forward asks the same check. Its answer depends on the dtype, the head dims, the device, the
    options and the settings (``SAFEOPS_BACKEND``, ``SAFEOPS_GLUON=0`` turns the Gluon path off), never on
    the batch size, the number of sequences or the memory layout (the backward's fused kernel, below, also
    on the key length and the SM count): a row's kernel, and so its bits, does not change with what else is
    in the batch.

    ``backward=True`` answers for the backward instead, whatever the forward ran: ``"gluon"`` where dk / dv
    come from the warp-specialized Gluon kernel (CUDA, sm_90, bf16 / fp16, no mask or softcap, no window
    with a right bound; head dims 64 and 128, dense or packed, with or without a left window); dq from
    the Gluon dQ kernel, delta and the sinks' gradient from the Triton dq kernel), e.g. ``("gluon", "bf16
    causal D=128 on sm_90: Gluon dq, dk / dv")``, or, dense non-causal at head dim 128, all three from the
    fused Gluon kernel (``"... fused Gluon dq, dk / dv (dq added in a fixed order)"``); else ``"triton"``
    with the reason, or ``"reference"``. For MHA the Gluon dK / dV + dQ pair and the Triton kernels give the
    same bits.
    The arguments are checked as ``attention`` /
    ``attention_varlen`` check them (the same errors); nothing is computed and the device is not
    synchronized.
    """
    if cu_seqlens_q is None and cu_seqlens_k is None:
        _check_qkv(q, k, v, 4, "(B, H, S, D)")
        if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
            raise ValueError(f"q, k and v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, "
                             f"{v.shape[0]}")
        mask = _attention_mask(attn_mask, q, k.shape[2])[0]
    else:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("pass both cu_seqlens_q and cu_seqlens_k (a packed batch, attention_varlen's "
                             "layout) or neither")
        if attn_mask is not None:
            raise ValueError("attention_varlen takes no attn_mask")
        _check_qkv(q, k, v, 3, "(total, H, D)")
        _check_cu_tensor("cu_seqlens_q", cu_seqlens_q, q.device)
        _check_cu_tensor("cu_seqlens_k", cu_seqlens_k, q.device)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel()} entries but cu_seqlens_k has "
                             f"{cu_seqlens_k.numel()}: one batch size")
        mask = None
    _, softcap, left, right, _ = _attention_options(q, scale, softcap, window, is_causal, return_lse,
                                                    precision)
    sinks = _attention_sinks(sinks, q, q.shape[1])
    return _ops_attention.path(q, k, v, mask, cu_seqlens_q, is_causal, softcap, left, right, sinks,
                               backward=bool(backward))


# --------------------------------------------------------------------------------------------------
# Merging partial attention results
# --------------------------------------------------------------------------------------------------


def _stack_partials(name: str, parts, min_dim: int) -> torch.Tensor:
    if isinstance(parts, torch.Tensor):
        if parts.dim() < min_dim + 1:
            raise ValueError(f"{name} as one stacked tensor must have a leading partials dim and at least "
                             f"{min_dim} more, got shape {tuple(parts.shape)}")
        if parts.shape[0] == 0:
            raise ValueError(f"{name} must hold at least one partial, got an empty stack")
        return parts
    if not isinstance(parts, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors (or one stacked tensor), "
                        f"got {type(parts).__name__}")
    if not parts:
        raise ValueError(f"{name} must hold at least one partial, got an empty {type(parts).__name__}")
    for i, t in enumerate(parts):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < min_dim:
            raise ValueError(f"{name}[{i}] must have at least {min_dim} dims, got shape {tuple(t.shape)}")
        for what, a, b in (("shape", t.shape, parts[0].shape), ("dtype", t.dtype, parts[0].dtype),
                           ("device", t.device, parts[0].device)):
            if a != b:
                error = TypeError if what == "dtype" else ValueError
                raise error(f"{name}[{i}] has {what} {a} but {name}[0] has {b}: all partials must match")
    return torch.stack(list(parts)) if len(parts) > 1 else parts[0].unsqueeze(0)


def merge_attention(outs, lses, *, sinks=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges attention results computed over disjoint key sets into attention over their union.

    For each query row, with ``lse = logsumexp_i(lse_i)``: ``out = sum_i exp(lse_i - lse) * out_i``, computed
    in fp32 (fp64 for fp64 outputs) after subtracting the largest ``lse_i``, rounded once to the outputs'
    dtype (contract section 2). A partial with ``lse_i = -inf`` (it saw no key) contributes exactly nothing,
    whatever its output holds; a row where every partial is empty gives out 0 and lse -inf, with zero
    gradients (section 4); no NaN comes out of finite or -inf inputs, however large the lses.
    Differentiable with respect to every partial's output and lse (and ``sinks``).

    Attention sinks (contract section 9) are counted once, here: compute the partials without ``sinks`` and
    pass them to the merge, which adds each head's sink as one more partial with output 0 and lse
    ``sinks[h]`` (partials computed with the sinks would count them once per partial).

    Args:
        outs: a list/tuple of P tensors ``(..., Sq, D)`` of one shape, dtype (float16, bfloat16, float32 or
            float64) and device, or one stacked tensor ``(P, ..., Sq, D)`` (read without a copy).
        lses: the matching natural-log logsumexps ``(..., Sq)``, float32 (float64 with float64 outputs),
            as ``safeops.attention(..., return_lse=True)`` returns them; a list or a stacked tensor.
        sinks: None or ``(H,)`` sink logits for partials ``(..., H, Sq, D)`` (the head dim just before the
            query rows, as attention's ``(B, H, Sq, D)``), any floating dtype, converted once to the lses'
            dtype; their gradient comes back in their own dtype.

    Returns:
        ``(out, lse)``: ``(..., Sq, D)`` in the outputs' dtype and ``(..., Sq)`` in the lses' dtype.
    """
    stacked = isinstance(outs, torch.Tensor)
    if stacked != isinstance(lses, torch.Tensor):
        raise TypeError("outs and lses must both be lists/tuples of tensors or both stacked tensors, got "
                        f"{type(outs).__name__} and {type(lses).__name__}")
    if not stacked and isinstance(outs, (list, tuple)) and isinstance(lses, (list, tuple)) \
            and len(outs) != len(lses):
        raise ValueError(f"outs has {len(outs)} partials but lses has {len(lses)}: one lse per output")
    if stacked or isinstance(outs, (list, tuple)) and isinstance(lses, (list, tuple)):
        parts_o, parts_l = ([outs], [lses]) if stacked else (outs, lses)
        if _dtensor.any_dtensor(*parts_o, *parts_l, sinks):  # run locally on each shard, or a clear error
            # partials checked before stacking
            sinks = _dtensor.prepare_merge(list(parts_o), list(parts_l), stacked, sinks)
    o = _stack_partials("outs", outs, 1)
    lse = _stack_partials("lses", lses, 0)
    if o.dtype not in _FLOATING:
        raise TypeError(f"outs must be float16, bfloat16, float32 or float64, got {o.dtype}")
    allowed = (torch.float32, torch.float64) if o.dtype == torch.float64 else (torch.float32,)
    if lse.dtype not in allowed:
        raise TypeError(f"lses must be float32 (natural-log logsumexps, as attention(return_lse=True) "
                        f"gives), got {lse.dtype}")
    if lse.shape != o.shape[:-1]:
        raise ValueError(f"lses must have the outputs' shape without the head dim, {tuple(o.shape[:-1])} "
                         f"(partials first), got {tuple(lse.shape)}")
    if lse.device != o.device:
        raise ValueError(f"lses are on {lse.device} but outs are on {o.device}")
    if sinks is not None:
        if lse.dim() < 3:
            raise ValueError(f"sinks need partials with a head dim, (..., H, Sq, D), got outputs of shape "
                             f"{tuple(o.shape[1:])}")
        sinks = _attention_sinks(sinks, lse, lse.shape[-2]).to(lse.dtype)
    return _ops_merge.forward(o, lse, sinks)


# --------------------------------------------------------------------------------------------------
# fp8 cast + transpose
# --------------------------------------------------------------------------------------------------

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_CAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def cast_transpose(x, scale, dtype=torch.float8_e4m3fn, *, rowwise=False):
    """Casts ``x`` to fp8 in both layouts at once: returns ``(y, y_t, amax)``.

    - ``y = (x.float() * scale).clamp(-max, max).to(dtype)``, bit for bit (``max = finfo(dtype).max``);
      NaN stays NaN, +-inf saturate to +-max, -0 stays -0, rounding is to nearest even;
    - ``y_t``: the same values column-major, shape ``(M, K)``, strides ``(1, M)``, what
      ``y.t().contiguous().t()`` holds (the second operand layout of ``torch._scaled_mm``);
    - ``amax = x.abs().max()`` as a 0-d fp32 tensor (NaN if ``x`` holds a NaN), from the same pass.
      An empty ``x`` gives empty ``y``/``y_t`` and ``amax = 0`` (the largest of no magnitudes; eager
      ``x.abs().max()`` would raise).

    Not differentiable: the outputs never require grad (inputs that do are detached).

    Args:
        x: 2-D float16, bfloat16 or float32 tensor ``(M, K)``, any strides (read in place).
        scale: float16/bfloat16/float32 tensor on x's device: one element (tensorwise), or ``(M, 1)``
            with ``rowwise=True`` (one scale per row). Applied as one fp32 multiply.
        dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
        rowwise: whether ``scale`` holds one value per row.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _CAST_DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if not isinstance(dtype, torch.dtype) or dtype not in _FP8_DTYPES:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype!r}")
    if not isinstance(rowwise, bool):
        raise TypeError(f"rowwise must be a bool, got {type(rowwise).__name__}")
    if not isinstance(scale, torch.Tensor):
        raise TypeError("scale must be a tensor (e.g. torch.tensor(s, dtype=torch.float32, device=x.device)),"
                        f" got {type(scale).__name__}")
    if scale.dtype not in _CAST_DTYPES:
        raise TypeError(f"scale must be float32, float16 or bfloat16, got {scale.dtype}")
    if scale.device != x.device:
        raise ValueError(f"scale is on {scale.device} but x is on {x.device}")
    if rowwise:
        if tuple(scale.shape) != (x.shape[0], 1):
            raise ValueError(f"scale must have shape (M, 1) = ({x.shape[0]}, 1) with rowwise=True, "
                             f"got {tuple(scale.shape)}")
    elif scale.numel() != 1 or scale.dim() > 2:
        raise ValueError(f"scale must have one element (or pass rowwise=True with an (M, 1) scale), "
                         f"got shape {tuple(scale.shape)}")
    return _ops_cast.cast_transpose(x, scale, dtype, rowwise)  # the registered op, or its eager fast path


# --------------------------------------------------------------------------------------------------
# Cross-entropy
# --------------------------------------------------------------------------------------------------

_TARGET_DTYPES = (torch.int64, torch.int32, torch.uint8)


def _check_ce_args(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, dtype,
                   inplace_backward):
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.dtype not in _FLOATING:
        raise TypeError(f"input must be float16, bfloat16, float32 or float64 logits, got {input.dtype}")
    if input.dim() == 0:
        raise ValueError("input must have a class dimension: (C,), (N, C) or (N, C, d1, ...), got a 0-d "
                         "tensor")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor of class indices, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex:
        raise TypeError(f"target must hold class indices (int64, int32 or uint8); probability targets "
                        f"({target.dtype}) are not supported by safeops.cross_entropy")
    if target.dtype not in _TARGET_DTYPES:
        raise TypeError(f"target must be int64, int32 or uint8 class indices, got {target.dtype}")
    expected = () if input.dim() == 1 else (input.shape[0], *input.shape[2:])
    if tuple(target.shape) != expected:
        layout = "(C,) input takes a 0-d target" if input.dim() == 1 else "(N, C, d...) input takes (N, d...)"
        raise ValueError(f"target must have shape {expected} for input of shape {tuple(input.shape)} "
                         f"({layout}), got {tuple(target.shape)}")
    if target.device != input.device:
        raise ValueError(f"target is on {target.device} but input is on {input.device}")
    n_classes = input.shape[0] if input.dim() == 1 else input.shape[1]
    if weight is not None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be None or a tensor of class weights, got {type(weight).__name__}")
        if weight.dtype not in _FLOATING:
            raise TypeError(f"weight must be a floating tensor (float16, bfloat16, float32 or float64), "
                            f"got {weight.dtype}")
        if tuple(weight.shape) != (n_classes,):
            raise ValueError(f"weight must have shape ({n_classes},), one weight per class, got "
                             f"{tuple(weight.shape)}")
        if weight.device != input.device:
            raise ValueError(f"weight is on {weight.device} but input is on {input.device}")
        if weight.requires_grad and torch.is_grad_enabled():
            raise ValueError("weight requires grad, but class weights get no gradient (as in torch's "
                             "nll_loss); pass weight.detach()")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not isinstance(reduction, str) or reduction not in _ops_ce.REDUCTIONS:
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    for name, value in (("label_smoothing", label_smoothing), ("z_loss", z_loss)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a python float, got {type(value).__name__}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (math.isfinite(float(z_loss)) and float(z_loss) >= 0.0):
        raise ValueError(f"z_loss must be a finite float >= 0, got {z_loss}")
    _check_dtype(dtype)
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be a bool, got {type(inplace_backward).__name__}")
    if inplace_backward and input.requires_grad and input.is_leaf:
        raise ValueError("inplace_backward=True writes the gradient into the logits' buffer, which for a "
                         "leaf tensor would make its .grad its own storage; it is meant for logits computed "
                         "in the graph (e.g. a linear head's output)")


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, *,
                  z_loss=0.0, dtype=None, inplace_backward=False) -> torch.Tensor:
    """``F.cross_entropy`` for class-index targets, fused and safe (contract section 10).

    The meaning of ``F.cross_entropy(input, target, weight, ignore_index=..., reduction=...,
    label_smoothing=...)``: log-softmax over the class dim, the negative log-likelihood of the target class
    (times its weight), label smoothing as torch defines it (weights included), and the reductions "none",
    "sum" and "mean" (the weighted mean ``sum(w_t * loss) / sum(w_t)`` over counted targets). Plus
    ``z_loss``: ``z_loss * lse**2`` for every counted row (PaLM's auxiliary loss), added per row for "none"
    and "sum" and averaged over the count of counted rows (not weighted) for "mean".

    Contract: one fp32 value per logit, fp32 inside and one rounding of the loss to the input's dtype (as
    torch returns it); the row max and sum stay apart, so ``lse`` and the backward's probabilities come from
    them (sections 1-3); a row whose target is ``ignore_index`` contributes exactly 0 and gets a zero gradient
    whatever its logits hold, NaN included (selected away); a mean over no counted target is 0 with zero
    gradients (eager PyTorch gives NaN); a counted row whose logits are all ``-inf`` has loss ``+inf`` and a
    zero gradient (section 4); the same bits in every memory layout, batch and run (section 6).

    Args:
        input: logits ``(N, C)``, ``(C,)`` or ``(N, C, d1, ...)``, float16, bfloat16, float32 or float64, any
            strides (read in place).
        target: class indices, ``(N,)`` (``()`` for ``(C,)`` input, ``(N, d1, ...)`` for the last form),
            int64, int32 or uint8. A counted index outside ``[0, C)`` raises a ValueError for CPU tensors;
            for CUDA tensors, where checking would sync the device, its row's loss and gradient are NaN.
        weight: ``(C,)`` floating class weights, or None. Not differentiable.
        ignore_index: targets equal to it are not counted.
        reduction: "mean" (default), "sum" or "none".
        label_smoothing: in [0, 1].
        z_loss: >= 0.
        dtype: the loss's dtype (default ``input``'s). Unlike ``F.cross_entropy(input.to(dtype), ...)``,
            the logits are not converted first (no logits-sized copy); the fp32 loss is rounded once. fp64
            computes in fp64. The gradient keeps ``input``'s dtype.
        inplace_backward: the backward writes the gradient into ``input``'s own buffer, so training needs
            no second logits-sized buffer; ``input`` then holds its gradient, not its logits. Only for logits
            that nothing else needs after the backward (other users that saved them raise, "modified by an
            inplace operation"); eager mode only (under torch.compile the gradient gets its own buffer),
            and not for leaf tensors.

    Returns:
        The loss in ``dtype`` (default ``input``'s): 0-d, or target-shaped for ``reduction="none"``.
    """
    _check_ce_args(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, dtype,
                   inplace_backward)
    x, t = (input.unsqueeze(0), target.unsqueeze(0)) if input.dim() == 1 else (input, target)
    code = _ops_ce.REDUCTIONS[reduction]
    loss = _ops_ce.forward(x, t, weight, int(ignore_index), code, float(label_smoothing), float(z_loss),
                           dtype, inplace_backward)[0]
    return loss.squeeze(0) if input.dim() == 1 and code == _ops_ce.reference.CE_NONE else loss
