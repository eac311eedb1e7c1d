"""Public functions: argument checking (contract section 8), then one registered op call."""

from __future__ import annotations

import numbers

import torch

from .ops import softmax as _ops

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_x(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATING:
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")


def _normalize_dim(dim, ndim: int) -> int:
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
            raise ValueError(f"scale must be a python float or a 0-d tensor, got shape {tuple(scale.shape)}")
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
    return _ops.softmax_op(x, dim, scale_value, scale_tensor, mask, dtype)[0]


def log_softmax(x, dim=-1, *, scale=None, mask=None, dtype=None) -> torch.Tensor:
    """``log(softmax(z))`` along ``dim``, computed as ``(z - m) - log(l)``, never ``z - lse``.

    Same arguments as :func:`softmax`. Values are ``<= 0``; a dominating logit gives exactly 0; excluded
    entries and empty rows give ``-inf`` with zero gradient (contract sections 1, 3, 4).
    """
    dim, scale_value, scale_tensor, mask = _prepare(x, dim, scale, mask, dtype)
    if x.dim() == 0:
        return log_softmax(x.reshape(1), 0, scale=scale, mask=None if mask is None else mask.reshape(1),
                           dtype=dtype).reshape(())
    return _ops.log_softmax_op(x, dim, scale_value, scale_tensor, mask, dtype)[0]


def logsumexp(x, dim=-1, *, scale=None, mask=None, keepdim=False) -> torch.Tensor:
    """``m + log(l)`` along ``dim`` for ``z = fp32(x) * scale`` (excluded entries dropped), in ``x.dtype``.

    A row with nothing included gives ``-inf`` and a zero gradient (contract section 4).
    """
    dim, scale_value, scale_tensor, mask = _prepare(x, dim, scale, mask, None)
    if not isinstance(keepdim, bool):
        raise TypeError(f"keepdim must be a bool, got {type(keepdim).__name__}")
    if x.dim() == 0:
        out = logsumexp(x.reshape(1), 0, scale=scale, mask=None if mask is None else mask.reshape(1))
        return out.reshape(())
    out = _ops.logsumexp_op(x, dim, scale_value, scale_tensor, mask, None)[0]
    return out.unsqueeze(dim) if keepdim else out
