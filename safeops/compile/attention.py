"""The graph rewrite that routes ``F.scaled_dot_product_attention`` in a Dynamo graph to safeops.attention.

Runs in the same pre-grad pass as the softmax rewrite (``safeops.compile.rewrite``), so training graphs
get safeops' registered attention backward. A call is rewritten only when safeops.attention computes the
same function SDPA would, argument for argument:

- ``query``, ``key``, ``value`` 4-D ``(B, H, S, D)``, one floating dtype, on CPU or CUDA; ``key`` and
  ``value`` with as many heads as ``query``, or fewer with ``enable_gqa=True`` (``Hq % Hkv == 0``);
  ``D`` of query and key equal, ``D`` and ``Dv`` at most safeops' largest head dim;
- ``dropout_p`` the constant 0 (safeops has no dropout; a call with dropout keeps torch's own kernel);
- ``attn_mask`` None, bool (True = attend) or floating (added to the scores) that does not require grad
  (safeops gives the mask no gradient), not together with ``is_causal`` (SDPA refuses that pair itself);
  ``is_causal`` top-left aligned in both;
- ``scale`` None (``1/sqrt(D)`` in both) or a python number.

What safeops changes, by design: a query row with no visible key gives 0 (contract section 4), and an
fp32 call follows ``torch.get_float32_matmul_precision()`` with TF32 inputs rounded, not truncated
(contract section 7).
"""

from __future__ import annotations

import numbers

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import functional
from .rewrite import _value, stats

_SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _bind(node: fx.Node) -> dict | None:
    if len(node.args) > len(_SDPA_ARGS) or set(node.kwargs) - set(_SDPA_ARGS):
        return None
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_ARGS, node.args, strict=False))
    for name, value in node.kwargs.items():
        if name in _SDPA_ARGS[: len(node.args)]:
            return None  # given twice: let torch raise its own error
        bound[name] = value
    return bound if all(name in bound for name in _SDPA_ARGS[:3]) else None


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _supported(args: dict) -> bool:
    q, k, v = (_value(args[name]) for name in ("query", "key", "value"))
    if q is None or k is None or v is None:
        return False
    if not (q.dim() == k.dim() == v.dim() == 4) or q.dtype not in _FLOATING:
        return False
    if not (q.dtype == k.dtype == v.dtype) or q.device.type not in ("cpu", "cuda"):
        return False
    if not (q.device == k.device == v.device):
        return False
    if q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        return False
    if k.shape[2] != v.shape[2] or q.shape[3] != k.shape[3]:
        return False
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv and not (args["enable_gqa"] is True and hkv > 0 and hq % hkv == 0):
        return False
    if not (1 <= q.shape[3] <= functional._MAX_HEAD_DIM and 1 <= v.shape[3] <= functional._MAX_HEAD_DIM):
        return False
    if not (_is_number(args["dropout_p"]) and args["dropout_p"] == 0):
        return False
    if not isinstance(args["is_causal"], bool) or not isinstance(args["enable_gqa"], bool):
        return False
    scale = args["scale"]
    if scale is not None and not _is_number(scale):
        return False
    mask = args["attn_mask"]
    if mask is not None:
        if args["is_causal"]:
            return False
        m = _value(mask)
        if m is None or m.device != q.device or m.dim() > 4:
            return False
        if m.requires_grad:
            return False  # safeops gives an additive mask no gradient; torch's SDPA does
        if not (m.dtype == torch.bool or m.dtype in _FLOATING):
            return False
        target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        try:
            if torch.broadcast_shapes(m.shape, target) != torch.Size(target):
                return False
        except RuntimeError:
            return False
    return True


def rewrite(graph: fx.Graph) -> int:
    """Rewrites each SDPA call in ``graph`` that safeops.attention computes the same way; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA_TARGETS:
            continue
        args = _bind(node)
        if args is None or not _supported(args):
            continue
        kwargs = {"attn_mask": args["attn_mask"], "is_causal": args["is_causal"]}
        if args["scale"] is not None:
            kwargs["scale"] = float(args["scale"])
        with graph.inserting_before(node):
            qkv = (args["query"], args["key"], args["value"])
            new = graph.call_function(functional.attention, qkv, kwargs)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        stats["attention_call"] += 1
        count += 1
    if count:
        graph.lint()
    return count
