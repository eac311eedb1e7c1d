"""The graph rewrite that routes cross-entropy in a Dynamo graph to safeops.cross_entropy, before autograd.

It runs first in the safeops pre-grad pass (before the softmax rewrite, which would otherwise take the
log-softmax of the pattern below on its own), so training graphs get the fused safeops backward. Two forms:

- calls of ``F.cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction,
  label_smoothing)``; ``nn.CrossEntropyLoss`` is this call in the graph;
- ``F.nll_loss(log_softmax(x, class_dim), target, weight, size_average, ignore_index, reduce, reduction)``
  with ``torch.log_softmax`` / ``F.log_softmax`` / ``Tensor.log_softmax`` over the class dim, when the
  log-softmax feeds nothing else.

A call is rewritten only when safeops computes what torch computes: class-index targets of a dtype torch
takes (int64, uint8) shaped like the input without its class dim; no legacy ``size_average`` / ``reduce``;
``weight`` None or a ``(C,)`` tensor of the input's dtype (torch requires it) that does not require grad;
``ignore_index``, ``reduction`` and ``label_smoothing`` python constants in range; logits fp16, bf16, fp32 or
fp64, at least 1-D, on CPU or CUDA. An fp16/bf16 -> fp32 upcast of the logits (``x.float()``,
``x.to(torch.float32)``, or the log-softmax's ``dtype=torch.float32``) that feeds only the loss is folded
in as ``dtype=torch.float32``: the kernel reads the 16-bit logits and no fp32 copy of them is made, and the
gradient is rounded once to 16 bits, as the upcast's backward does.

What changes, by design (contract section 10): an ignored row is selected away (NaN logits there no longer
reach the gradient), a mean over no counted target is 0 with zero gradients where torch gives NaN, and a
counted row of all ``-inf`` logits has loss ``+inf`` with a zero gradient where torch gives NaN.
"""

from __future__ import annotations

import numbers

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import functional
from .rewrite import _is_upcast, _kind, _no_mutation_between, _single_dim, _supported, _value, stats

_CE_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
            "label_smoothing")
_NLL_ARGS = _CE_ARGS[:-1]
_DEFAULTS = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean",
             "label_smoothing": 0.0}
_TARGET_DTYPES = (torch.int64, torch.uint8)  # what torch's nll_loss takes


def _bind(node: fx.Node, names: tuple[str, ...]) -> dict | None:
    if len(node.args) > len(names) or set(node.kwargs) - set(names):
        return None
    bound = {k: v for k, v in _DEFAULTS.items() if k in names}
    bound.update(zip(names, node.args, strict=False))
    for name, value in node.kwargs.items():
        if name in names[: len(node.args)]:
            return None  # given twice: let torch raise its own error
        bound[name] = value
    return bound if "input" in bound and "target" in bound else None


def _options_ok(args: dict, x: torch.Tensor) -> bool:
    """Whether the call's options and target are ones safeops computes exactly as torch does."""
    if args["size_average"] is not None or args["reduce"] is not None:
        return False
    ignore_index, reduction = args["ignore_index"], args["reduction"]
    smoothing = args.get("label_smoothing", 0.0)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        return False
    if reduction not in ("mean", "sum", "none"):
        return False
    if isinstance(smoothing, bool) or not isinstance(smoothing, numbers.Real) or not 0 <= smoothing <= 1:
        return False
    if not _supported(x) or x.dim() == 0:
        return False
    target = _value(args["target"])
    expected = () if x.dim() == 1 else (x.shape[0], *x.shape[2:])
    if target is None or target.dtype not in _TARGET_DTYPES or tuple(target.shape) != expected:
        return False
    if target.device != x.device:
        return False
    weight = args["weight"]
    if weight is not None:
        w = _value(weight)
        n_classes = x.shape[0] if x.dim() == 1 else x.shape[1]
        if w is None or w.dtype != x.dtype or tuple(w.shape) != (n_classes,) or w.device != x.device:
            return False
        if w.requires_grad:
            return False
    return True


def _fold_upcast(node: fx.Node, consumer: fx.Node) -> fx.Node | None:
    """The 16-bit source of an fp16/bf16 -> fp32 upcast that feeds only ``consumer``, else None."""
    if isinstance(node, fx.Node) and _is_upcast(node) and list(node.users) == [consumer]:
        return node.args[0]
    return None


def _log_softmax_dtype(node: fx.Node):
    """The ``dtype=`` of a log_softmax call (positional or keyword, as each form takes it)."""
    dtype = node.kwargs.get("dtype")
    offset = 1 if node.args else 0
    if node.op == "call_function" and node.target is F.log_softmax:
        if len(node.args) > 3:
            dtype = node.args[3]
    elif len(node.args) > offset + 1:
        dtype = node.args[offset + 1]
    return dtype


def _log_softmax_input(node, consumer: fx.Node):
    """(logits, out_dtype) when ``node`` is a log-softmax over the class dim that feeds only ``consumer``."""
    if not isinstance(node, fx.Node) or _kind(node) != "log_softmax" or list(node.users) != [consumer]:
        return None
    if set(node.kwargs) - {"input", "self", "dim", "dtype", "_stacklevel"}:
        return None
    x = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    value = _value(x)
    if not _supported(value) or value.dim() == 0:
        return None
    offset = 1 if node.args else 0
    dim = node.args[offset] if len(node.args) > offset else node.kwargs.get("dim")
    if _single_dim(dim, value.dim()) != (0 if value.dim() == 1 else 1):
        return None
    dtype = _log_softmax_dtype(node)
    if dtype is None or dtype == value.dtype:
        return x, None
    if dtype == torch.float32 and value.dtype in (torch.float16, torch.bfloat16):
        return x, torch.float32  # log_softmax(x, dtype=float32): the upcast, inside the call
    return None


def _replace(graph: fx.Graph, node: fx.Node, x, args: dict, out_dtype, dead: list[fx.Node], label: str):
    kwargs = {"weight": args["weight"], "ignore_index": args["ignore_index"], "reduction": args["reduction"],
              "label_smoothing": float(args.get("label_smoothing", 0.0))}
    if out_dtype is not None:
        kwargs["dtype"] = out_dtype
    with graph.inserting_before(node):
        new = graph.call_function(functional.cross_entropy, (x, args["target"]), kwargs)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    for n in [node, *dead]:
        if not n.users:
            graph.erase_node(n)
    stats[label] += 1


def _rewrite_call(graph: fx.Graph, node: fx.Node) -> bool:
    args = _bind(node, _CE_ARGS)
    if args is None or not isinstance(args["input"], fx.Node) or not _options_ok(args, _value(args["input"])):
        return False
    x, out_dtype, dead = args["input"], None, []
    source = _fold_upcast(x, node)
    if source is not None and _no_mutation_between(x, node):
        x, out_dtype, dead = source, torch.float32, [x]
    _replace(graph, node, x, args, out_dtype, dead, "cross_entropy_call")
    return True


def _rewrite_pattern(graph: fx.Graph, node: fx.Node) -> bool:
    args = _bind(node, _NLL_ARGS)
    if args is None:
        return False
    found = _log_softmax_input(args["input"], node)
    if found is None:
        return False
    x, out_dtype = found
    log_softmax = args["input"]
    if not _options_ok(args, _value(log_softmax)) or not _no_mutation_between(log_softmax, node):
        return False
    dead = [log_softmax]
    source = _fold_upcast(x, log_softmax) if out_dtype is None else None
    if source is not None and _no_mutation_between(x, node):
        x, out_dtype, dead = source, torch.float32, [log_softmax, x]
    _replace(graph, node, x, args, out_dtype, dead, "cross_entropy_pattern")
    return True


def rewrite(graph: fx.Graph) -> int:
    """Rewrites every cross-entropy call and nll_loss(log_softmax) pattern it can; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is F.cross_entropy:
            count += _rewrite_call(graph, node)
        elif node.target is F.nll_loss:
            count += _rewrite_pattern(graph, node)
    if count:
        graph.lint()
    return count
