"""Drop-in modules: :class:`Softmax`, :class:`LogSoftmax`, :class:`MultiheadAttention` and
:class:`CrossEntropyLoss` on safeops ops.

Each class subclasses its ``torch.nn`` namesake, so the constructor, the parameters, the ``state_dict`` keys,
``isinstance`` checks and ``load_state_dict`` are torch's own; only ``forward`` changes. A state_dict saved
from one loads into the other.

Where the result differs from torch, on purpose:

- a row with nothing to attend to (every key padded or masked) gives 0 for its attention output (the output
  projection's bias after ``out_proj``), zero weights and finite gradients, where torch gives NaN (contract
  section 4);
- scores are formed in fp32 (fp64 for fp64 inputs), never rounded to bf16/fp16 before the softmax
  (contract section 1).

``MultiheadAttention`` with ``need_weights=False`` and no dropout runs :func:`safeops.attention`. With
``need_weights=True``, or with dropout in training, it runs the materialized form
(:func:`attention_probabilities`): fp32 scores, one fp32 multiply by the scale, :func:`safeops.softmax`
with the mask, dropout on the probabilities (as torch does), then the product with ``v``. The weights it
returns are the probabilities the output was computed from. Dropout cannot be applied to the output of a
fused attention after the fact, so it always takes this path (memory grows with ``L * S``, as torch's own
``need_weights=True`` path does).
"""

from __future__ import annotations

import warnings

import einops
import torch
import torch.nn.functional as F

from . import functional, reference

__all__ = ["Softmax", "LogSoftmax", "MultiheadAttention", "CrossEntropyLoss", "attention_probabilities",
           "materialized_attention"]


def _legacy_softmax_dim(ndim: int) -> int:
    # torch.nn.Softmax(dim=None) keeps the old implicit rule (with a warning): dim 0 for 0-, 1- and 3-d
    # inputs, else 1.
    warnings.warn(
        "Implicit dimension choice for softmax has been deprecated. Change the call to include dim=X "
        "as an argument.", stacklevel=3,
    )
    return 0 if ndim in (0, 1, 3) else 1


class Softmax(torch.nn.Softmax):
    """``torch.nn.Softmax`` computed by :func:`safeops.softmax` (fp32 inside, empty rows give 0)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dim = self.dim if self.dim is not None else _legacy_softmax_dim(input.dim())
        return functional.softmax(input, dim)


class LogSoftmax(torch.nn.LogSoftmax):
    """``torch.nn.LogSoftmax`` computed by :func:`safeops.log_softmax` (``(z - m) - log(l)``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dim = self.dim if self.dim is not None else _legacy_softmax_dim(input.dim())
        return functional.log_softmax(input, dim)


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` computed by :func:`safeops.cross_entropy` (class-index targets): fused,
    fp32 inside, ignored rows selected away, a mean over no counted target 0 instead of NaN.

    Takes torch's constructor arguments, plus ``z_loss`` (``z_loss * lse**2`` per counted row) and
    ``inplace_backward`` (the gradient overwrites the logits; see :func:`safeops.cross_entropy`).
    """

    def __init__(self, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0, *, z_loss: float = 0.0,
                 inplace_backward: bool = False):
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.z_loss = z_loss
        self.inplace_backward = inplace_backward

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # A module converted by replace_modules shares torch's __dict__, which has no z_loss.
        return functional.cross_entropy(input, target, self.weight, self.ignore_index, self.reduction,
                                        self.label_smoothing, z_loss=getattr(self, "z_loss", 0.0),
                                        inplace_backward=getattr(self, "inplace_backward", False))

    def extra_repr(self) -> str:
        parts = [f"reduction={self.reduction!r}"]
        if self.ignore_index != -100:
            parts.append(f"ignore_index={self.ignore_index}")
        if self.label_smoothing:
            parts.append(f"label_smoothing={self.label_smoothing}")
        if getattr(self, "z_loss", 0.0):
            parts.append(f"z_loss={self.z_loss}")
        if getattr(self, "inplace_backward", False):
            parts.append("inplace_backward=True")
        return ", ".join(parts)


# ------------------------------------------------------------------------------------------------------
# Materialized attention (weights, dropout)
# ------------------------------------------------------------------------------------------------------

def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return einops.repeat(x, "b h s d -> b (h g) s d", g=groups)


def attention_probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities ``softmax(z)`` for SDPA-layout ``q`` (B, H, Sq, D) and ``k`` (B, Hkv, Sk, D).

    ``z`` is built as the contract's section 1 says: fp32 (fp64 for fp64) scores, one multiply by ``scale``
    (default ``D ** -0.5``), ``softcap * tanh(z / softcap)``, then an additive float mask; a bool mask (True =
    attend) and ``is_causal`` (top-left aligned, as in ``F.scaled_dot_product_attention``) exclude entries.
    The softmax is :func:`safeops.softmax`, so a row with nothing included is 0. Returned in fp32 (fp64).
    ``sinks`` (``(H,)`` logits, contract section 9) join each row's softmax as one more column, dropped
    from the result (the rows then sum to less than 1; the sinks get a gradient).
    """
    acc = reference.compute_dtype(q.dtype)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    groups = q.shape[1] // k.shape[1]
    scores = torch.matmul(q.to(acc), _repeat_kv(k, groups).to(acc).transpose(-2, -1))
    z = scores * torch.tensor(scale, dtype=acc, device=q.device)
    if softcap is not None:
        cap = torch.tensor(softcap, dtype=acc, device=q.device)
        z = cap * torch.tanh(z / cap)
    keep = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask
        else:
            z = z + attn_mask.to(acc)
    if is_causal:
        sq, sk = z.shape[-2], z.shape[-1]
        causal = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        keep = causal if keep is None else keep & causal
    if keep is not None:
        keep = keep.expand(z.shape)
    if sinks is None:
        return functional.softmax(z, -1, mask=keep)
    column = functional._attention_sinks(sinks, q, q.shape[1]).view(1, -1, 1, 1).expand(*z.shape[:-1], 1)
    if keep is not None:
        keep = torch.cat([keep, keep.new_ones(column.shape)], -1)
    return functional.softmax(torch.cat([z, column], -1), -1, mask=keep)[..., :-1]


def materialized_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dropout(P) @ v, dropout(P))`` with ``P`` from :func:`attention_probabilities`; output in q's dtype.

    This is the path for attention weights and for attention dropout: dropout acts on the probabilities,
    which a fused kernel never materializes, so it cannot be applied afterwards to a fused output.
    """
    p = attention_probabilities(q, k, attn_mask=attn_mask, is_causal=is_causal, scale=scale, softcap=softcap,
                                sinks=sinks)
    if dropout_p > 0.0:
        p = F.dropout(p, p=dropout_p, training=True)
    groups = q.shape[1] // v.shape[1]
    out = torch.matmul(p, _repeat_kv(v, groups).to(p.dtype))
    return out.to(q.dtype), p


def _attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None, softcap=None, window=None):
    """``safeops.attention``, imported at call time (the attention ops load separately from this module)."""
    import safeops

    kwargs = {}
    if softcap is not None:
        kwargs["softcap"] = softcap
    if window is not None:
        kwargs["window"] = window
    return safeops.attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **kwargs)


# ------------------------------------------------------------------------------------------------------
# MultiheadAttention
# ------------------------------------------------------------------------------------------------------

def _check_mask(mask, name: str) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a bool or floating tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"{name} must be a bool or floating tensor, got {mask.dtype}")


def _additive(mask: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    # torch.nn.MultiheadAttention's bool masks mark positions NOT to attend (the opposite of SDPA's).
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=acc, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(acc)


def _pad_key_column(mask: torch.Tensor | None) -> torch.Tensor | None:
    # A key appended by add_bias_kv / add_zero_attn is never masked: False (bool) or 0 (float).
    return None if mask is None else F.pad(mask, (0, 1))


class MultiheadAttention(torch.nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` on safeops: same constructor, parameters, state_dict and forward.

    Supported: packed and separate (``kdim``/``vdim``) projections, ``bias``, ``add_bias_kv``,
    ``add_zero_attn``, ``batch_first``, unbatched inputs, ``key_padding_mask`` and ``attn_mask`` as bool
    (True = do not attend, torch's convention) or additive float, 2-D ``(L, S)`` or 3-D ``(N * num_heads, L,
    S)`` ``attn_mask``, the ``is_causal`` hint (as torch reads it), ``need_weights`` with
    ``average_attn_weights``, and ``dropout``. A query with no key left to attend gives 0 attention (so the
    output is ``out_proj``'s bias) and finite gradients; torch gives NaN there.
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.is_nested:
                raise ValueError(f"{name} is a nested tensor; safeops.nn.MultiheadAttention takes dense ones")
        _check_mask(key_padding_mask, "key_padding_mask")
        _check_mask(attn_mask, "attn_mask")
        if is_causal and attn_mask is None:
            raise ValueError(
                "is_causal=True is a hint that attn_mask is the causal mask, so attn_mask is required (as in "
                "torch.nn.MultiheadAttention); use torch.nn.Transformer.generate_square_subsequent_mask"
            )
        if query.dim() not in (2, 3):
            raise ValueError(f"query must be 2-D (unbatched) or 3-D, got {query.dim()}-D")
        self_attention = query is key and key is value  # one packed projection, as torch does
        batched = query.dim() == 3
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                f"query, key and value must have the same number of dimensions, got {query.dim()}, "
                f"{key.dim()} and {value.dim()}"
            )
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        # From here on: (N, L, E) query, (N, S, kdim/vdim) key and value.
        out, weights = self._attend(query, key, value, key_padding_mask, need_weights, attn_mask,
                                    average_attn_weights, is_causal, self_attention)
        if not batched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _project(self, query, key, value, self_attention):
        e = self.embed_dim
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
            if self_attention:
                return F.linear(query, self.in_proj_weight, self.in_proj_bias).split(e, dim=-1)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def _attend(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                is_causal, self_attention):
        n, tgt_len, e = query.shape
        src_len = key.shape[1]
        heads, head_dim = self.num_heads, self.head_dim
        if e != self.embed_dim:
            raise ValueError(f"query's embedding size is {e}, expected embed_dim={self.embed_dim}")
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(
                f"key and value must have the same batch and sequence sizes, got {tuple(key.shape)} and "
                f"{tuple(value.shape)}"
            )
        if key.shape[0] != n:
            raise ValueError(f"key has batch size {key.shape[0]} but query has {n}")
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (n, src_len):
            raise ValueError(
                f"key_padding_mask must have shape {(n, src_len)} (batch, source length), got "
                f"{tuple(key_padding_mask.shape)}"
            )
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                expected = (tgt_len, src_len)
            elif attn_mask.dim() == 3:
                expected = (n * heads, tgt_len, src_len)
            else:
                raise ValueError(f"attn_mask must be 2-D or 3-D, got {attn_mask.dim()}-D")
            if tuple(attn_mask.shape) != expected:
                raise ValueError(f"attn_mask must have shape {expected}, got {tuple(attn_mask.shape)}")

        q, k, v = self._project(query, key, value, self_attention)
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.expand(n, 1, e)], dim=1)
            v = torch.cat([v, self.bias_v.expand(n, 1, e)], dim=1)
            attn_mask = _pad_key_column(attn_mask)
            key_padding_mask = _pad_key_column(key_padding_mask)
        q = q.reshape(n, tgt_len, heads, head_dim).transpose(1, 2)
        k = k.reshape(n, k.shape[1], heads, head_dim).transpose(1, 2)
        v = v.reshape(n, v.shape[1], heads, head_dim).transpose(1, 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(n, heads, 1, head_dim)], dim=2)
            v = torch.cat([v, v.new_zeros(n, heads, 1, head_dim)], dim=2)
            attn_mask = _pad_key_column(attn_mask)
            key_padding_mask = _pad_key_column(key_padding_mask)
        src_len = k.shape[2]

        dropout_p = self.dropout if self.training else 0.0
        # torch reads is_causal as "attn_mask is causal" and, when nothing else needs the mask, uses SDPA's
        # (top-left) causal flag in its place.
        causal_flag = is_causal and key_padding_mask is None and not need_weights
        if causal_flag:
            attn_mask = None
        mask = self._merge_masks(attn_mask, key_padding_mask, n, tgt_len, src_len, q.dtype)

        mask_needs_grad = mask is not None and mask.requires_grad and torch.is_grad_enabled()
        if need_weights or dropout_p > 0.0 or mask_needs_grad:
            out, p = materialized_attention(q, k, v, attn_mask=mask, is_causal=causal_flag,
                                            dropout_p=dropout_p)
        else:
            p = None
            out = _attention(q, k, v, attn_mask=mask, is_causal=causal_flag)
        out = out.transpose(1, 2).reshape(n, tgt_len, e)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        if not need_weights:
            return out, None
        weights = p.mean(dim=1) if average_attn_weights else p
        return out, weights.to(query.dtype)

    @staticmethod
    def _merge_masks(attn_mask, key_padding_mask, n, tgt_len, src_len, dtype):
        """One mask for safeops.attention, broadcastable to (N, H, L, S): bool True = attend, or additive."""
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0) if attn_mask.dim() == 2 else attn_mask.view(n, -1, tgt_len,
                                                                                          src_len)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.view(n, 1, 1, src_len)
        masks = [m for m in (attn_mask, key_padding_mask) if m is not None]
        if not masks:
            return None
        if all(m.dtype == torch.bool for m in masks):
            keep = ~masks[0]
            for m in masks[1:]:
                keep = keep & ~m
            return keep
        acc = reference.compute_dtype(dtype)
        total = _additive(masks[0], acc)
        for m in masks[1:]:
            total = total + _additive(m, acc)
        return total
