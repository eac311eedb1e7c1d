"""The graph rewrite that routes softmax in a Dynamo graph to safeops, before autograd.

It runs on the torch-level FX graph that Dynamo hands to Inductor (as ``pre_grad_custom_pass``), so every
rewritten softmax gets safeops' registered autograd: training graphs use the safeops backward, which
recomputes fp32 probabilities from the input (contract section 3), not a formula on rounded outputs.

Two kinds of rewrite:

- calls: ``torch.softmax``, ``F.softmax``, ``Tensor.softmax`` (and ``torch.special.softmax``), the same
  for ``log_softmax``, and ``torch.logsumexp`` / ``Tensor.logsumexp`` over one dim, and the aten ops
  ``_softmax``, ``softmax.int``, ``_log_softmax``, ``log_softmax.int``, ``logsumexp`` called directly;
- hand-written cores: ``m = amax(z, d, keepdim=True)`` (or ``max(z, d, keepdim=True)[0]``), then
  ``e = exp(z - m)``, ``out = e / sum(e, d, keepdim=True)`` for softmax, and
  ``out = (z - m) - log(sum(exp(z - m), d, keepdim=True))`` for log-softmax (``z - m`` once or twice).
  An fp16/bf16 -> fp32 upcast right before ``z`` and a cast right after ``out`` are folded into the op.

A core is rewritten only when its intermediates (the max, ``z - m``, ``exp``, the sum, the log) feed
nothing outside it: an ``exp`` that is also used elsewhere is not a softmax.

What computes the input is folded into the op when nothing else uses it, so one kernel reads the scores
once (otherwise a separate pass writes the scaled, masked scores and the backward reads them again):
``masked_fill(t, mask, -inf)`` / ``where(mask, t, -inf)`` becomes ``mask=`` (a select, as before: exact
``-inf`` is excluded, contract section 4, so fully masked rows come out 0, not NaN), ``t * c`` / ``t / c``
with a python number ``c`` becomes ``scale=`` (for fp32, only where one fp32 multiply gives the same bits
as the user's op; for fp16/bf16 the product is then not rounded to 16 bits first, which is the contract's
``z``), and an fp16/bf16 -> fp32 upcast is dropped. A fill value other than ``-inf`` (``finfo.min``) is a
real logit and stays in the graph.
"""

from __future__ import annotations

import collections
import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import functional

stats: collections.Counter = collections.Counter()

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_FUNCTIONS = {
    torch.softmax: "softmax", F.softmax: "softmax", torch.special.softmax: "softmax",
    torch.log_softmax: "log_softmax", F.log_softmax: "log_softmax", torch.special.log_softmax: "log_softmax",
    torch.logsumexp: "logsumexp", torch.special.logsumexp: "logsumexp",
    torch.amax: "amax", torch.max: "max", operator.getitem: "getitem",
    operator.sub: "sub", torch.sub: "sub", torch.exp: "exp", torch.sum: "sum",
    operator.truediv: "div", torch.div: "div", torch.true_divide: "div", torch.log: "log",
    torch._softmax: "aten_softmax", torch._log_softmax: "aten_log_softmax", F.softmin: "softmin",
    torch.detach: "detach", operator.mul: "mul", torch.mul: "mul", torch.multiply: "mul",
    torch.masked_fill: "masked_fill", torch.where: "where",
}
_METHODS = {"softmax", "log_softmax", "logsumexp", "amax", "max", "sub", "exp", "sum", "div", "log", "float",
            "to", "detach", "mul", "masked_fill"}


_aten = torch.ops.aten
# aten ops a user (or a library) calls directly: (kind, how their arguments map to safeops').
_ATEN_CALLS = {
    _aten._softmax.default: "softmax", _aten._log_softmax.default: "log_softmax",
    _aten.softmax.int: "softmax", _aten.log_softmax.int: "log_softmax", _aten.logsumexp.default: "logsumexp",
}


def _overload(target):
    """``torch.ops.aten.x`` (a packet) means its default overload."""
    return target.default if isinstance(target, torch._ops.OpOverloadPacket) else target


def _kind(node: fx.Node) -> str | None:
    aten_op = isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
    if node.op == "call_function" and aten_op:
        kind = _ATEN_CALLS.get(_overload(node.target))
        return None if kind is None else f"aten_{kind}"
    if node.op == "call_function":
        try:
            return _FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            return None
    if node.op == "call_method" and node.target in _METHODS:
        return node.target
    return None


def _value(node) -> torch.Tensor | None:
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _single_dim(dim, ndim: int) -> int | None:
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return None
        dim = dim[0]
    if isinstance(dim, bool) or not isinstance(dim, int):
        return None
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        return None
    return dim % rank


def _supported(value: torch.Tensor | None) -> bool:
    return value is not None and value.dtype in _FLOATING and value.device.type in ("cpu", "cuda")


def _replace(graph: fx.Graph, old: fx.Node, fn, args, kwargs, dead: list[fx.Node]) -> None:
    with graph.inserting_before(old):
        new = graph.call_function(fn, tuple(args), dict(kwargs))
    new.meta.update(old.meta)
    old.replace_all_uses_with(new)
    for node in [old, *dead]:
        if not node.users:
            graph.erase_node(node)


# ---------------------------------------------------------------------------------------------------
# Calls of the library functions
# ---------------------------------------------------------------------------------------------------


_EXACT_CASTS = {
    torch.float16: (torch.float16, torch.float32, torch.float64),
    torch.bfloat16: (torch.bfloat16, torch.float32, torch.float64),
    torch.float32: (torch.float32, torch.float64),
    torch.float64: (torch.float64,),
}


def _dtype_ok(value: torch.Tensor, dtype) -> bool:
    """torch rounds x to ``dtype`` first; safeops does not. Same result only when that cast is exact."""
    return dtype is None or dtype in _EXACT_CASTS.get(value.dtype, ())


def _rewrite_call(graph: fx.Graph, node: fx.Node, kind: str) -> bool:
    if set(node.kwargs) - {"input", "self", "dim", "dtype", "keepdim", "_stacklevel"}:
        return False  # out= and the like: keep torch's own call
    x = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    value = _value(x)
    if not _supported(value) or value.dim() == 0:
        return False
    offset = 1 if node.args else 0
    if kind == "logsumexp":
        dim = _single_dim(_arg(node, offset, "dim"), value.dim())
        keepdim = _arg(node, offset + 1, "keepdim", False)
        if dim is None or not isinstance(keepdim, bool):
            return False
        inp, mask, negate, scale, _, folded = _prologue(graph, x, (node,), allow_upcast=False)
        if folded and not _no_mutation_between(folded[-1], node):
            inp, mask, scale, folded = x, None, None, []
        kwargs = {"keepdim": keepdim, **_prologue_kwargs(graph, node, mask, negate, scale)}
        _replace(graph, node, functional.logsumexp, (inp, dim), kwargs, folded)
        return True
    dim = _single_dim(_arg(node, offset, "dim"), value.dim())
    # F.softmax(x, dim, _stacklevel, dtype): dtype is the fourth positional argument there.
    dtype = node.kwargs.get("dtype")
    if node.op == "call_function" and node.target in (F.softmax, F.log_softmax) and len(node.args) > 3:
        dtype = node.args[3]
    elif len(node.args) > offset + 1 and node.target not in (F.softmax, F.log_softmax):
        dtype = node.args[offset + 1]
    if dim is None or not (dtype is None or dtype in _FLOATING) or not _dtype_ok(value, dtype):
        return False
    fn = functional.softmax if kind == "softmax" else functional.log_softmax
    inp, mask, negate, scale, upcast, folded = _prologue(graph, x, (node,))
    if folded and not _no_mutation_between(folded[-1], node):
        inp, mask, scale, upcast, folded = x, None, None, False, []
    if upcast and dtype is None:
        dtype = torch.float32  # softmax(x.float()) is fp32
    kwargs = {"dtype": dtype, **_prologue_kwargs(graph, node, mask, negate, scale)}
    _replace(graph, node, fn, (inp, dim), kwargs, folded)
    return True


def _rewrite_softmin(graph: fx.Graph, node: fx.Node) -> bool:
    """``F.softmin(x, dim, _stacklevel, dtype)`` is softmax of ``-x``: a scale of -1 (an exact multiply)."""
    x = node.args[0] if node.args else node.kwargs.get("input")
    value = _value(x)
    if not _supported(value) or value.dim() == 0:
        return False
    dim = _single_dim(_arg(node, 1, "dim"), value.dim())
    dtype = node.args[3] if len(node.args) > 3 else node.kwargs.get("dtype")
    if set(node.kwargs) - {"input", "dim", "dtype", "_stacklevel"}:
        return False
    if dim is None or not (dtype is None or dtype in _FLOATING) or not _dtype_ok(value, dtype):
        return False
    _replace(graph, node, functional.softmax, (x, dim), {"scale": -1.0, "dtype": dtype}, [])
    return True


def _rewrite_aten_call(graph: fx.Graph, node: fx.Node, kind: str) -> bool:
    """``aten._softmax(x, dim, half_to_float)``, ``aten.softmax.int(x, dim, dtype)``, the log_softmax
    twins, and ``aten.logsumexp(x, dims, keepdim)`` called directly in the graph."""
    if len(node.args) < 2 or node.kwargs.keys() - {"dtype", "keepdim", "half_to_float"}:
        return False
    x = node.args[0]
    value = _value(x)
    if not _supported(value) or value.dim() == 0:
        return False
    dim = _single_dim(node.args[1], value.dim())
    if dim is None:
        return False
    if kind == "logsumexp":
        keepdim = _arg(node, 2, "keepdim", False)
        if not isinstance(keepdim, bool):
            return False
        _replace(graph, node, functional.logsumexp, (x, dim), {"keepdim": keepdim}, [])
        return True
    if _overload(node.target) in (_aten._softmax.default, _aten._log_softmax.default, torch._softmax,
                                  torch._log_softmax):
        dtype = torch.float32 if _arg(node, 2, "half_to_float", False) else None
    else:
        dtype = _arg(node, 2, "dtype", None)
    if not (dtype is None or dtype in _FLOATING) or not _dtype_ok(value, dtype):
        return False
    fn = functional.softmax if kind == "softmax" else functional.log_softmax
    _replace(graph, node, fn, (x, dim), {"dtype": dtype}, [])
    return True


# ---------------------------------------------------------------------------------------------------
# Hand-written cores
# ---------------------------------------------------------------------------------------------------


def _reduction(node, kind: str, src: fx.Node) -> int | None:
    """The normalized dim of ``kind(src, dim, keepdim=True)``, or None."""
    if not isinstance(node, fx.Node) or _kind(node) != kind or not node.args or node.args[0] is not src:
        return None
    # A sum with dtype= (or anything else extra) is not the plain row reduction.
    if len(node.args) > 3 or set(node.kwargs) - {"dim", "keepdim"}:
        return None
    if _arg(node, 2, "keepdim", False) is not True:
        return None
    value = _value(src)
    return None if value is None else _single_dim(_arg(node, 1, "dim"), value.dim())


def _row_max(m) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """(z, dim, nodes) for ``amax(z, dim, keepdim=True)`` or ``max(z, dim, keepdim=True)[0]``, detached
    or not (the gradient through the max cancels out of a softmax either way)."""
    if not isinstance(m, fx.Node):
        return None
    if _kind(m) == "detach" and len(m.args) == 1 and not m.kwargs:
        inner = m.args[0]
        found = _row_max(inner) if isinstance(inner, fx.Node) and len(inner.users) == 1 else None
        return None if found is None else (found[0], found[1], [m, *found[2]])
    if _kind(m) == "amax" and m.args:
        z = m.args[0]
        dim = _reduction(m, "amax", z)
        return None if dim is None else (z, dim, [m])
    if _kind(m) == "getitem" and m.args[1] == 0 and isinstance(m.args[0], fx.Node):
        pair = m.args[0]
        if _kind(pair) != "max" or not pair.args or len(pair.users) != 1:
            return None
        z = pair.args[0]
        dim = _reduction(pair, "max", z)
        return None if dim is None else (z, dim, [m, pair])
    return None


def _difference(t) -> tuple[fx.Node, fx.Node] | None:
    """(z, m) for ``z - m`` written as a plain subtraction."""
    if not isinstance(t, fx.Node) or _kind(t) != "sub" or len(t.args) != 2 or t.kwargs:
        return None
    z, m = t.args
    if not isinstance(z, fx.Node) or not isinstance(m, fx.Node):
        return None
    return z, m


def _mutates(node: fx.Node) -> bool:
    """Whether ``node`` may write to a tensor in place (an in-place method or function, or an op that
    declares a mutation). Conservative: when in doubt, it mutates."""
    if node.kwargs.get("inplace") is True or "out" in node.kwargs:
        return True
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__") or node.target == "__setitem__"
    if node.op == "call_function":
        target = node.target
        if target in (operator.setitem, operator.delitem):
            return True
        if isinstance(target, torch._ops.OpOverload):
            return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)
        name = getattr(target, "__name__", "")
        return (name.endswith("_") and not name.endswith("__")) or name.startswith("i") and target in (
            operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow)
    return node.op == "call_module"


def _no_mutation_between(first: fx.Node, last: fx.Node) -> bool:
    """No node from ``first`` to ``last`` (graph order) writes in place: the rewritten op reads its input
    at ``last``, so the values there must be those the original code read."""
    node = first
    while node is not last:
        if _mutates(node):
            return False
        node = node.next
        if node.op == "root":
            return False
    return not _mutates(last)


def _only_users(node: fx.Node, allowed) -> bool:
    return set(node.users) <= set(allowed)


def _is_upcast(node: fx.Node) -> bool:
    """``t.float()`` or ``t.to(torch.float32)`` of an fp16/bf16 tensor: exact, and safeops works in fp32."""
    if _kind(node) not in ("float", "to") or node.kwargs:
        return False
    if not ((_kind(node) == "float" and len(node.args) == 1)
            or (_kind(node) == "to" and len(node.args) == 2 and node.args[1] == torch.float32)):
        return False
    src, out = _value(node.args[0]), _value(node)
    return (_supported(src) and out is not None and src.dtype in (torch.float16, torch.bfloat16)
            and out.dtype == torch.float32)


def _neg_inf_fill(node: fx.Node):
    """(source, mask, keep_when_true) for ``masked_fill(source, mask, -inf)`` and
    ``where(mask, source, -inf)`` / ``where(mask, -inf, source)`` with a bool mask the shape of the result."""
    kind = _kind(node)
    if kind == "masked_fill" and len(node.args) == 3 and not node.kwargs:
        source, mask, fill = node.args
        keep_when_true = False
    elif kind == "where" and len(node.args) == 3 and not node.kwargs:
        mask, a, b = node.args
        if isinstance(b, float) and isinstance(a, fx.Node):
            source, fill, keep_when_true = a, b, True
        elif isinstance(a, float) and isinstance(b, fx.Node):
            source, fill, keep_when_true = b, a, False
        else:
            return None
    else:
        return None
    if not (isinstance(fill, float) and fill == float("-inf") and isinstance(source, fx.Node)
            and isinstance(mask, fx.Node)):
        return None
    src, msk, out = _value(source), _value(mask), _value(node)
    if src is None or msk is None or out is None or msk.dtype != torch.bool or out.shape != src.shape:
        return None
    if out.dtype != src.dtype:
        return None
    return source, mask, keep_when_true


_FP32_NORMAL_MIN = torch.finfo(torch.float32).tiny
_FP32_MAX = torch.finfo(torch.float32).max


def _constant_scale(node: fx.Node):
    """(source, scale) for ``source * c``, ``c * source`` and ``source / c`` with a python number
    ``c``, when one fp32 multiply by ``scale`` reproduces it: always for a multiply (torch multiplies by
    fp32(c) too); for a division when 1/c is exact (a power of two), or when the source is fp16/bf16 (there
    eager rounds the quotient to 16 bits, and one fp32 multiply by 1/c is the more accurate of the two)."""
    kind = _kind(node)
    if kind not in ("mul", "div") or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if kind == "mul" and isinstance(a, (int, float)) and isinstance(b, fx.Node):
        a, b = b, a
    if not isinstance(a, fx.Node) or isinstance(b, bool) or not isinstance(b, (int, float)):
        return None
    c = float(b)
    if not math.isfinite(c) or c == 0.0:
        return None
    src, out = _value(a), _value(node)
    if not _supported(src) or out is None or out.shape != src.shape or out.dtype != src.dtype:
        return None
    if src.dtype == torch.float64:
        return None  # fp64 runs the reference in fp64; keep the user's own op
    if kind == "div":
        if abs(math.frexp(c)[0]) != 0.5 and src.dtype not in (torch.float16, torch.bfloat16):
            return None
        c = 1.0 / c
    if not _FP32_NORMAL_MIN <= abs(c) <= _FP32_MAX or not _FP32_NORMAL_MIN <= abs(float(b)) <= _FP32_MAX:
        return None  # the fp32 scale (or 1/c) would overflow, or lose bits as a subnormal
    return a, c


def _prologue(graph: fx.Graph, inp: fx.Node, consumers, allow_upcast: bool = True):
    """Folds what computes a softmax's input into the safeops call: ``masked_fill(t, mask, -inf)`` /
    ``where(mask, t, -inf)`` becomes ``mask=``, ``t * c`` / ``t / c`` becomes ``scale=``, and an
    fp16/bf16 -> fp32 upcast is dropped (safeops reads 16-bit inputs and works in fp32 anyway).

    Every folded node must feed only the next one (its intermediate is used nowhere else). A scale applied
    after the mask folds only when positive (``-inf * c`` stays ``-inf``). Returns
    ``(input, mask_node, negate_mask, scale, upcast, folded_nodes_outermost_first)``.
    """
    mask = negate = scale = None
    upcast = no_mask = False
    folded: list[fx.Node] = []
    node = inp
    while isinstance(node, fx.Node) and (
            _only_users(node, consumers) if not folded else list(node.users) == [folded[-1]]):
        if allow_upcast and not upcast and _is_upcast(node):
            upcast, inner = True, node.args[0]
        elif mask is None and not no_mask and (fill := _neg_inf_fill(node)) is not None:
            inner, mask, keep_when_true = fill
            negate = not keep_when_true
        elif scale is None and (found := _constant_scale(node)) is not None:
            inner, scale = found
            # A negative scale applied after a mask would turn its -inf into +inf: no mask below it.
            no_mask = mask is None and scale < 0
        else:
            break
        folded.append(node)
        node = inner
    return node, mask, negate, scale, upcast, folded


def _prologue_kwargs(graph: fx.Graph, before: fx.Node, mask: fx.Node | None, negate: bool,
                     scale: float | None) -> dict:
    kwargs = {}
    if scale is not None:
        kwargs["scale"] = scale
    if mask is not None:
        if negate:
            with graph.inserting_before(before):
                keep = graph.call_function(torch.logical_not, (mask,))
            value = _value(mask)
            if value is not None:
                keep.meta["example_value"] = torch.empty_like(value)
            mask = keep
        kwargs["mask"] = mask
    return kwargs


def _fold_cast_after(out: fx.Node):
    """Returns (out_dtype, node_to_replace, dead_after): folds a cast right after the core's output.
    ``dead_after`` must be erased before the core's nodes. (An upcast before the input is folded by
    ``_prologue``.)"""
    after = []
    out_value = _value(out)
    target, dtype = out, (out_value.dtype if out_value is not None else None)
    if len(out.users) == 1:
        (cast,) = out.users
        cast_value = _value(cast)
        # A cast to a narrower or equal float only: a cast to fp64 would move the op to the fp64 path.
        if (_kind(cast) == "to" and len(cast.args) == 2 and not cast.kwargs
                and cast.args[1] in (torch.float16, torch.bfloat16, torch.float32)
                and cast_value is not None and cast_value.dtype == cast.args[1]):
            target, dtype = cast, cast.args[1]
            after = [out]
    return dtype, target, after


def _position(graph: fx.Graph):
    order = {node: i for i, node in enumerate(graph.nodes)}
    return order.__getitem__


def _replace_core(graph: fx.Graph, fn, z: fx.Node, dim: int, out: fx.Node, core: list[fx.Node],
                  max_nodes: list[fx.Node], z_users) -> bool:
    """Replaces a matched core (``core`` and ``max_nodes`` listed users first) by ``fn(input, dim)``.

    Leaves the graph unchanged, returning False, when something writes in place inside the core.
    """
    dtype, target, after = _fold_cast_after(out)
    inp, mask, negate, scale, _, folded = _prologue(graph, z, z_users)
    first = min([*max_nodes, *core, *folded], key=_position(graph))
    if not _no_mutation_between(first, target):
        return False
    dead = [*after, *core, *max_nodes, *folded]
    kwargs = {"dtype": dtype, **_prologue_kwargs(graph, target, mask, negate, scale)}
    _replace(graph, target, fn, (inp, dim), kwargs, [n for n in dead if n is not target])
    return True


def _rewrite_softmax_core(graph: fx.Graph, out: fx.Node) -> bool:
    """``out = e / sum(e, d, keepdim=True)`` with ``e = exp(z - m)`` and ``m`` the row max of z."""
    if len(out.args) != 2 or out.kwargs:
        return False
    e, s = out.args
    if not isinstance(e, fx.Node) or _kind(e) != "exp" or len(e.args) != 1:
        return False
    dim = _reduction(s, "sum", e)
    if dim is None:
        return False
    diff = _difference(e.args[0])
    if diff is None:
        return False
    t = e.args[0]
    z, m = diff
    row_max = _row_max(m)
    if row_max is None or row_max[0] is not z or row_max[1] != dim:
        return False
    max_nodes = row_max[2]
    if not (_only_users(e, (s, out)) and _only_users(s, (out,)) and _only_users(t, (e,))
            and _only_users(m, (t,))):
        return False
    if not _supported(_value(z)):
        return False
    return _replace_core(graph, functional.softmax, z, dim, out, [s, e, t], max_nodes, (max_nodes[-1], t))


def _rewrite_log_softmax_core(graph: fx.Graph, out: fx.Node) -> bool:
    """``out = (z - m) - log(sum(exp(z - m), d, keepdim=True))``."""
    if len(out.args) != 2 or out.kwargs:
        return False
    a, lg = out.args
    if not isinstance(lg, fx.Node) or _kind(lg) != "log" or len(lg.args) != 1:
        return False
    s = lg.args[0]
    if not isinstance(s, fx.Node) or _kind(s) != "sum" or not s.args:
        return False
    e = s.args[0]
    if not isinstance(e, fx.Node) or _kind(e) != "exp" or len(e.args) != 1:
        return False
    dim = _reduction(s, "sum", e)
    t = e.args[0]
    diff_t, diff_a = _difference(t), _difference(a)
    if dim is None or diff_t is None or diff_a is None:
        return False
    if diff_t[0] is not diff_a[0] or diff_t[1] is not diff_a[1]:
        return False
    z, m = diff_t
    row_max = _row_max(m)
    if row_max is None or row_max[0] is not z or row_max[1] != dim:
        return False
    max_nodes = row_max[2]
    same = a is t
    diffs = (t,) if same else (t, a)
    if not (_only_users(lg, (out,)) and _only_users(s, (lg,)) and _only_users(e, (s,))
            and _only_users(m, diffs)):
        return False
    if same and not _only_users(t, (e, out)):
        return False
    if not same and not (_only_users(t, (e,)) and _only_users(a, (out,))):
        return False
    if not _supported(_value(z)):
        return False
    core = [lg, s, e, *([] if same else [a]), t]
    return _replace_core(graph, functional.log_softmax, z, dim, out, core, max_nodes, (max_nodes[-1], *diffs))


def rewrite_graph(graph: fx.Graph) -> int:
    """Rewrites every softmax in ``graph`` it recognizes; returns how many it rewrote."""
    count = 0
    alive = set(graph.nodes)
    for node in list(graph.nodes):
        if node not in alive:
            continue
        kind = _kind(node)
        done = False
        if kind in ("softmax", "log_softmax", "logsumexp"):
            done = _rewrite_call(graph, node, kind)
            label = f"{kind}_call"
        elif kind is not None and kind.startswith("aten_"):
            done = _rewrite_aten_call(graph, node, kind[5:])
            label = f"{kind[5:]}_call"
        elif kind == "softmin":
            done = _rewrite_softmin(graph, node)
            label = "softmax_call"
        elif kind == "div":
            done = _rewrite_softmax_core(graph, node)
            label = "softmax_pattern"
        elif kind == "sub":
            done = _rewrite_log_softmax_core(graph, node)
            label = "log_softmax_pattern"
        if done:
            stats[label] += 1
            count += 1
            alive = set(graph.nodes)
    if count:
        graph.lint()
    return count
