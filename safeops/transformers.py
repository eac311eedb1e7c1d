"""Hugging Face transformers integration: ``attn_implementation="safeops"``.

Importing this module (``import safeops.transformers``) registers, under the name ``"safeops"``:

- :func:`attention_forward` in transformers' ``AttentionInterface``, and
- :func:`capture_safe_sdpa_mask` (transformers' own ``sdpa_mask``, see below) in ``AttentionMaskInterface``.
  transformers builds masks only for implementations that have a mask function; without one, a custom
  implementation gets ``attention_mask=None`` and loses causal, padding and sliding-window masking without a
  word.

After that ``from_pretrained(..., attn_implementation="safeops")``, ``from_config(config,
attn_implementation="safeops")`` and ``model.set_attn_implementation("safeops")`` all work, and
:func:`safeops.replace_modules` switches Hugging Face models it finds. ``import safeops`` does not import
transformers; this module is the only place that does.

How transformers' arguments map onto :func:`safeops.attention`:

- ``attention_mask``: the bool mask from ``sdpa_mask`` (True = attend) or a user's additive float mask is
  passed as ``attn_mask``; ``None`` means "use is_causal", decided as transformers' sdpa integration does
  (``q_len > 1`` and the module is causal; keys beyond ``q_len`` are cropped, since SDPA's causal mask is
  top-left aligned).
- GQA: key/value with fewer heads go straight to safeops, which groups heads natively.
- ``sliding_window=w`` (Mistral, Gemma-2): transformers attends key ``j`` from query ``i`` when
  ``i - w < j <= i``; that is ``window=(w - 1, 0)``. It is passed when query and key lengths are equal (the
  mask, when there is one, already holds the same window; with a KV cache the mask alone carries it).
- ``softcap`` (Gemma-2 ``attn_logit_softcapping``) and ``scaling`` map directly.
- ``s_aux`` (gpt-oss: the attention layer's ``sinks`` parameter, ``(num_attention_heads,)`` in the model's
  dtype, logits in the units of ``scaling * q.k`` that the eager implementation appends to every row of
  scores and drops after the softmax) is passed as ``sinks`` (``sinks=`` too, for other models); its
  gradient reaches the parameter.
- ``dropout > 0`` (training with ``attention_dropout``) runs :func:`safeops.nn.materialized_attention`:
  fp32 probabilities from :func:`safeops.softmax`, dropout on them as the eager implementation does, then
  the product with ``v``. Correct, but its memory grows with ``q_len * kv_len``.
- Returned attention weights are always ``None`` (as with ``sdpa``); ``position_bias`` is not supported and
  raises a ValueError naming it.

Padded query rows: with left padding, a padded query position attends to nothing. safeops gives it 0
(contract section 4); transformers' eager implementation averages the masked keys there, and torch's SDPA
may give NaN. Those rows are ignored by the loss, so compare models on the non-padded positions.
"""

from __future__ import annotations

import logging

import torch

import safeops

from . import nn as safe_nn

__all__ = ["NAME", "attention_forward", "capture_safe_sdpa_mask", "register", "enable", "is_registered"]

NAME = "safeops"
logger = logging.getLogger(__name__)
_warned_attentions = False


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: (B, H, S, D) inputs, returns ``(out (B, S, H, D), None)``."""
    global _warned_attentions
    if kwargs.get("position_bias") is not None:
        raise ValueError("safeops attention does not support position_bias (T5-style relative bias)")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    elif kwargs.get("sinks") is not None:
        raise ValueError("safeops attention got both s_aux and sinks: pass the attention sinks once")
    if kwargs.get("output_attentions", False) and not _warned_attentions:
        _warned_attentions = True
        logger.warning("safeops attention does not return attention weights (output_attentions); "
                       "use attn_implementation='eager' to get them")
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            "attention_mask must be a tensor or None for safeops attention, got "
            f"{type(attention_mask).__name__} (a BlockMask needs attn_implementation='flex_attention')"
        )
    if query.shape[1] % key.shape[1] != 0:
        raise ValueError(
            f"query has {query.shape[1]} heads, not a multiple of key's {key.shape[1]} heads"
        )

    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = q_len > 1 and attention_mask is None and bool(causal)
    if causal and key.shape[2] > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    kv_len = key.shape[2]
    if attention_mask is not None and attention_mask.shape[-1] != kv_len:
        attention_mask = attention_mask[..., :kv_len]

    window = None
    if sliding_window is not None and q_len == kv_len and getattr(module, "is_causal", True):
        window = (int(sliding_window) - 1, 0)

    if dropout > 0.0:
        out = safe_nn.materialized_attention(query, key, value, attn_mask=attention_mask, is_causal=causal,
                                             scale=scaling, softcap=softcap, dropout_p=float(dropout),
                                             sinks=sinks)[0]
    else:  # safeops.attention looked up per call (patchable); None softcap / window / sinks are its defaults
        options = {} if sinks is None else {"sinks": sinks}
        out = safeops.attention(query, key, value, attn_mask=attention_mask, is_causal=causal, scale=scaling,
                                softcap=softcap, window=window, **options)
    return out.transpose(1, 2).contiguous(), None


def capture_safe_sdpa_mask(*args, **kwargs):
    """transformers' ``sdpa_mask``, except that it returns ``None`` (causal by ``is_causal``) while a CUDA
    graph is being captured in the cases where an eager call returns ``None`` too: no padding mask, and a
    causal pattern that ``is_causal`` expresses.

    Some transformers 5.x releases (5.17 among them) treat CUDA-graph capture as tracing and then always
    build an explicit (batch, 1, q, kv) bool mask, so a captured training step runs a different attention
    call than the same step run eagerly (a causal mask instead of ``is_causal``) and replays other bits; later
    releases build the mask during capture only when there is a padding mask to read. This applies the later
    rule on every version. Outside capture, or with a padding mask, it is ``sdpa_mask`` unchanged.
    """
    from transformers.masking_utils import sdpa_mask

    if _stream_capturing() and not torch.compiler.is_compiling():
        skip = _causal_skip_without_padding(sdpa_mask, args, kwargs)
        if skip:
            return None
    return sdpa_mask(*args, **kwargs)


def _stream_capturing() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a CPU-only build of torch
        return False


def _causal_skip_without_padding(sdpa_mask, args, kwargs) -> bool:
    """Whether newer transformers' ``_ignore_causal_mask_sdpa`` skips the mask for these ``sdpa_mask``
    arguments when there is no padding mask (it reads no tensor values then)."""
    import inspect

    try:
        bound = inspect.signature(sdpa_mask).bind(*args, **kwargs)
    except TypeError:
        return False
    bound.apply_defaults()
    a = bound.arguments
    needed = ("q_length", "kv_length", "q_offset", "attention_mask", "allow_is_causal_skip", "local_size")
    if any(name not in a for name in needed):  # an older signature (4.x): leave it to transformers
        return False
    if not a["allow_is_causal_skip"] or a["attention_mask"] is not None:
        return False
    if isinstance(a["q_offset"], torch.Tensor):
        return False
    q_len, kv_len, local = a["q_length"], a["kv_length"], a["local_size"]
    if local is not None and kv_len >= local:
        return False
    return q_len == 1 or kv_len == q_len or a["q_offset"] == 0


def register() -> None:
    """Register ``"safeops"`` with transformers' attention and mask registries (idempotent)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "safeops.transformers needs transformers with AttentionInterface and masking_utils."
            "AttentionMaskInterface (install the extra: pip install 'safeops[transformers]')"
        ) from exc
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, capture_safe_sdpa_mask)


def is_registered() -> bool:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    return (AttentionInterface._global_mapping.get(NAME) is attention_forward
            and NAME in AttentionMaskInterface._global_mapping)


def enable(model) -> tuple[bool, str]:
    """Switch a ``PreTrainedModel`` (and its sub-models) to safeops attention. Returns ``(done, why_not)``."""
    register()
    if not hasattr(model, "set_attn_implementation"):
        return False, "this transformers version has no set_attn_implementation"
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        return False, "its attention layers do not go through transformers' AttentionInterface"
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, ImportError) as exc:
        return False, f"set_attn_implementation refused: {exc}"
    if model.config._attn_implementation != NAME:
        return False, f"set_attn_implementation left {model.config._attn_implementation!r}"
    return True, ""


register()
