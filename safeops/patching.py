"""``safeops.patched()``: route eager softmax / log-softmax / SDPA calls to safeops inside a ``with`` block.

Inside ``with safeops.patched():`` these attributes are replaced by safeops wrappers:

    torch.nn.functional.softmax, torch.nn.functional.log_softmax, torch.softmax, torch.log_softmax,
    torch.Tensor.softmax, torch.Tensor.log_softmax, torch.nn.functional.scaled_dot_product_attention

and restored on exit, also when the block raises.

Scope, nesting and threads:

- Patching swaps module and class attributes, so it is process-global: while any thread is inside a
  ``patched()`` block, calls from every thread are routed. A lock makes enter/exit atomic, and a counter
  makes the blocks re-entrant: the first enter (from any thread) patches, the last exit restores.
  ``patched()`` never makes a call in another thread less safe, only safer, but code that needs the stock
  behaviour must not run concurrently with a ``patched()`` block.
- Only calls that look the attribute up at call time are routed (``F.softmax(x)``, ``x.softmax(-1)``,
  ``torch.nn.Softmax``, ``F.multi_head_attention_forward``, transformers' ``sdpa`` attention). A name bound
  earlier with ``from torch.nn.functional import softmax`` keeps the original.
- It is for eager code: under ``torch.compile`` tracing the wrappers call the originals; compiled code uses
  :func:`safeops.register` instead.

Argument mapping:

- ``dtype=`` becomes safeops' output dtype. Widening (bf16 -> fp32) gives what torch gives; narrowing
  (fp32 -> bf16) differs on purpose: torch rounds the input to ``dtype`` first, safeops computes in fp32
  and rounds the result once (contract section 2). ``_stacklevel`` is ignored.
- SDPA: ``attn_mask`` (bool True = attend, or additive float), ``is_causal`` (top-left aligned, as torch),
  ``scale`` and ``enable_gqa`` map directly. ``dropout_p > 0`` runs :func:`safeops.nn.materialized_attention`:
  fp32 probabilities from :func:`safeops.softmax`, dropout on them (as torch's math path does), then the
  product with ``v``; memory grows with ``L * S``.

A call safeops cannot serve falls back to the original function: a non-float or named-dim input,
``dim=None``, a tensor subclass (FakeTensor, DTensor, ...), a non-strided or nested tensor, SDPA inputs that
are not 4-D, a backend that cannot run on the input's device (``SAFEOPS_BACKEND=triton`` on CPU without
Triton's interpreter), or any argument safeops' validation rejects (TypeError/ValueError), in which case the
original gives torch's own answer or error. ``fallback_counts`` counts these by reason.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from . import _config, functional

__all__ = ["patched", "is_patched", "fallback_counts"]

logger = logging.getLogger(__name__)

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_lock = threading.RLock()
_depth = 0
_saved: list[tuple[object, str, bool, object, object]] = []  # (owner, name, owned, original, wrapper)
_busy = threading.local()  # set while a wrapper runs safeops, so safeops' own torch calls are not rerouted
fallback_counts: collections.Counter = collections.Counter()


def is_patched() -> bool:
    """True while at least one ``patched()`` block is active (in any thread)."""
    return _depth > 0


def _fallback(reason: str) -> None:
    fallback_counts[reason] += 1
    logger.debug("safeops.patched: calling the original function (%s)", reason)


def _plain_tensor(t) -> bool:
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_nested)


def _device_supported(t: torch.Tensor) -> bool:
    if t.device.type == "cuda":
        return True
    if _config.backend_name() != "triton":
        return True  # the reference path runs on any device
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def _unservable_tensor(t) -> str | None:
    if not isinstance(t, torch.Tensor):
        return "not a tensor"
    if not _plain_tensor(t):
        return "tensor subclass, nested or non-strided tensor"
    if t.dtype not in _FLOATING:
        return f"dtype {t.dtype}"
    if not _device_supported(t):
        return f"no safeops backend for device {t.device}"
    return None


def _must_call_original() -> bool:
    return getattr(_busy, "active", False) or torch.compiler.is_compiling() or torch.jit.is_tracing()


def _run(original, args, kwargs, safe_call):
    _busy.active = True
    try:
        return safe_call()
    except (TypeError, ValueError) as exc:
        _fallback(f"rejected by safeops: {type(exc).__name__}")
    finally:
        _busy.active = False
    return original(*args, **kwargs)


def _softmax_wrapper(original, log: bool, functional_signature: bool):
    safe = functional.log_softmax if log else functional.softmax

    def wrapper(*args, **kwargs):
        if _must_call_original():
            return original(*args, **kwargs)
        try:
            if functional_signature:  # F.softmax(input, dim=None, _stacklevel=3, dtype=None)
                bound = _bind_functional(*args, **kwargs)
            else:  # torch.softmax(input, dim, dtype=None) and Tensor.softmax(self, dim, dtype=None)
                bound = _bind_method(*args, **kwargs)
        except TypeError:
            _fallback("arguments not understood")
            return original(*args, **kwargs)
        x, dim, dtype = bound
        reason = _unservable_tensor(x)
        if reason is None and (isinstance(dim, bool) or not isinstance(dim, int)):
            reason = f"dim {dim!r} is not an int"
        if reason is None and dtype is not None and dtype not in _FLOATING:
            reason = f"dtype={dtype}"
        if reason is not None:
            _fallback(reason)
            return original(*args, **kwargs)
        return _run(original, args, kwargs, lambda: safe(x, dim, dtype=dtype))

    wrapper.__name__ = getattr(original, "__name__", "softmax")
    wrapper.__doc__ = f"safeops.patched() wrapper of {wrapper.__name__} (see safeops.patching)."
    wrapper._safeops_original = original
    return wrapper


def _bind_functional(input, dim=None, _stacklevel=3, dtype=None):
    return input, dim, dtype


def _bind_method(input, dim, dtype=None):
    return input, dim, dtype


def _sdpa_wrapper(original):
    def wrapper(*args, **kwargs):
        if _must_call_original():
            return original(*args, **kwargs)
        try:
            q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = _bind_sdpa(*args, **kwargs)
        except TypeError:
            _fallback("arguments not understood")
            return original(*args, **kwargs)
        reason = next((r for r in map(_unservable_tensor, (q, k, v)) if r is not None), None)
        if reason is None and not (q.dim() == k.dim() == v.dim() == 4):
            reason = "inputs are not 4-D (B, H, S, D)"
        if reason is None and not (q.dtype == k.dtype == v.dtype):
            reason = "query, key and value dtypes differ"
        if reason is None and q.shape[1] != k.shape[1] and not enable_gqa:
            reason = "different head counts without enable_gqa"
        if reason is None and is_causal and attn_mask is not None:
            reason = "attn_mask and is_causal both given"
        if reason is None and attn_mask is not None and not _plain_tensor(attn_mask):
            reason = "attn_mask is a tensor subclass"
        if reason is not None:
            _fallback(reason)
            return original(*args, **kwargs)
        return _run(original, args, kwargs,
                    lambda: _safe_sdpa(q, k, v, attn_mask, float(dropout_p), bool(is_causal), scale))

    wrapper.__name__ = "scaled_dot_product_attention"
    wrapper.__doc__ = "safeops.patched() wrapper of scaled_dot_product_attention (see safeops.patching)."
    wrapper._safeops_original = original
    return wrapper


def _bind_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _safe_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale):
    from . import nn as safe_nn

    if dropout_p > 0.0:
        return safe_nn.materialized_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              dropout_p=dropout_p)[0]
    return safe_nn._attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def _targets():
    return [
        (F, "softmax", lambda o: _softmax_wrapper(o, log=False, functional_signature=True)),
        (F, "log_softmax", lambda o: _softmax_wrapper(o, log=True, functional_signature=True)),
        (torch, "softmax", lambda o: _softmax_wrapper(o, log=False, functional_signature=False)),
        (torch, "log_softmax", lambda o: _softmax_wrapper(o, log=True, functional_signature=False)),
        (torch.Tensor, "softmax", lambda o: _softmax_wrapper(o, log=False, functional_signature=False)),
        (torch.Tensor, "log_softmax", lambda o: _softmax_wrapper(o, log=True, functional_signature=False)),
        (F, "scaled_dot_product_attention", _sdpa_wrapper),
    ]


def _install() -> None:
    for owner, name, make in _targets():
        owned = name in vars(owner)
        original = vars(owner)[name] if owned else getattr(owner, name)
        wrapper = make(getattr(owner, name))
        setattr(owner, name, wrapper)
        _saved.append((owner, name, owned, original, wrapper))


def _uninstall() -> None:
    while _saved:
        owner, name, owned, original, wrapper = _saved.pop()
        current = vars(owner).get(name)
        if current is not wrapper:
            warnings.warn(
                f"safeops.patched(): {getattr(owner, '__name__', owner)}.{name} was replaced by someone else "
                "inside the block; leaving that replacement in place", RuntimeWarning, stacklevel=3,
            )
            continue
        if owned:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """Route eager softmax, log-softmax and SDPA calls to safeops inside the block (see the module docs).

    Re-entrant and thread-safe: the first enter patches, the last exit restores, also on exceptions. Usable
    as a decorator too.
    """
    global _depth
    with _lock:
        if _depth == 0:
            try:
                _install()
            except BaseException:
                _uninstall()
                raise
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _uninstall()
