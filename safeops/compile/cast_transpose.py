"""The graph rewrite that turns a hand-written fp8 cast + transposed copy into ``safeops::cast_transpose``.

It runs on the torch-level FX graph that Dynamo hands to Inductor (inside the safeops pre-grad pass, see
``safeops.compile.SafeopsGraphPass``). What it looks for, written the ways float8 training code writes it:

    xf = x.float()  |  x.to(torch.float32)  |  x.to(dtype=torch.float32)    (or x itself when it is fp32)
    z  = xf * scale  |  scale * xf  |  torch.mul(xf, scale)  |  xf.mul(scale)
    c  = z.clamp(-M, M)  |  torch.clamp(z, min=-M, max=M)  |  clip                with M = finfo(fp8).max
    y  = c.to(fp8)  |  c.to(dtype=fp8)
    y_t = y.t().contiguous().t()     or    y.t().contiguous()       (t / transpose(0, 1) / permute(1, 0))

and, when present after it, ``x.abs().max()`` / ``torch.max(torch.abs(x))`` / ``amax`` of the same ``x``
(or of ``xf``). One ``torch.ops.safeops.cast_transpose_compiled(x, scale, fp8, rowwise)`` replaces the cast
and every transposed clone (``y_t`` is its second output; a ``.t().contiguous()`` becomes ``y_t.t()``, a
view), and its ``amax`` replaces the reduction, so ``x`` is read once. That op is a ``triton_op``: on a GPU
Inductor launches the safeops kernel from its generated code; elsewhere it is ``safeops::cast_transpose``
(safeops.ops.cast_transpose). Either computes the same bits as the eager expression (contract section 6).

It is left alone, so the graph stays stock, when:

- ``M`` is not exactly the fp8 dtype's finite max (a different bound is a different function);
- ``x`` is not 2-D fp16/bf16/fp32, the scale is not an fp16/bf16/fp32 tensor with one element or one per
  row ``(M, 1)``, or the two are on different devices;
- ``xf``, ``z`` or the clamped value feed anything else (they would have to be computed anyway), or a
  transposed view feeds something other than a contiguous copy;
- nothing takes the transposed copy (a plain cast is Inductor's to fuse with its neighbours);
- ``x`` or the scale requires grad (the cast would be differentiated; the op is not);
- a size is known to be 0 or 1 (then ``y.t().contiguous()`` is ``y`` itself, with other strides);
- something writes in place between the first and the last node it would replace.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import reference
from ..ops.cast_transpose import compiled_op
from .rewrite import _no_mutation_between, _position, _value, stats

_CAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _method_or_function(node, methods: tuple[str, ...], functions: tuple) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target in methods
    if node.op == "call_function":
        try:
            return node.target in functions
        except TypeError:  # unhashable target
            return False
    return False


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _fp8_cast(node: fx.Node) -> torch.dtype | None:
    """The fp8 dtype of ``src.to(fp8)`` / ``src.to(dtype=fp8)``, or None."""
    if node.op != "call_method" or node.target != "to":
        return None
    if len(node.args) == 2 and not node.kwargs:
        dtype = node.args[1]
    elif len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        dtype = node.kwargs["dtype"]
    else:
        return None
    return dtype if dtype in reference.FP8_FORMATS else None


def _clamp_source(node, bound: float) -> fx.Node | None:
    """``src`` of ``src.clamp(-bound, bound)`` (or torch.clamp / clip, positional or keyword)."""
    if not _method_or_function(node, ("clamp", "clip"), (torch.clamp, torch.clip)):
        return None
    args = list(node.args)
    kwargs = dict(node.kwargs)
    src = args.pop(0) if args else kwargs.pop("input", kwargs.pop("self", None))
    lo = args.pop(0) if args else kwargs.pop("min", None)
    hi = args.pop(0) if args else kwargs.pop("max", None)
    if args or kwargs or not isinstance(src, fx.Node):
        return None
    if _number(lo) != -bound or _number(hi) != bound:
        return None
    return src


def _upcast_source(node) -> fx.Node | None:
    """``x`` of ``x.float()`` / ``x.to(torch.float32)`` / ``x.to(dtype=torch.float32)``."""
    if not isinstance(node, fx.Node) or node.op != "call_method":
        return None
    if node.target == "float" and len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    if node.target == "to":
        if len(node.args) == 2 and not node.kwargs and node.args[1] == torch.float32:
            return node.args[0]
        if len(node.args) == 1 and node.kwargs == {"dtype": torch.float32}:
            return node.args[0]
    return None


def _statically(predicate) -> bool:
    """``predicate`` (possibly a SymBool) is known to hold without adding a guard."""
    if isinstance(predicate, bool):
        return predicate
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true
    except ImportError:  # pragma: no cover - older torch
        return False
    return statically_known_true(predicate)


def _known_small(size) -> bool:
    return isinstance(size, int) and size <= 1


class _Match:
    def __init__(self):
        self.x = self.scale = None
        self.rowwise = False
        self.upcast: fx.Node | None = None
        self.mul = self.clamp = self.cast = None
        self.transposes: list[fx.Node] = []  # y.t() nodes whose contiguous copies are replaced
        self.copies: list[fx.Node] = []  # the contiguous copies
        self.amax: list[tuple[fx.Node, fx.Node]] = []  # (max node, abs node)


def _split_mul(mul: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(xf, scale) candidates of a plain two-operand multiply, in both orders."""
    if _method_or_function(mul, ("mul",), (operator.mul, torch.mul)):
        if len(mul.args) == 2 and not mul.kwargs:
            a, b = mul.args
            if isinstance(a, fx.Node) and isinstance(b, fx.Node):
                return [(a, b), (b, a)]
    return []


def _operands(match: _Match, xf: fx.Node, scale: fx.Node) -> bool:
    """Fills x, scale, rowwise and upcast when ``xf * scale`` is the pattern's product."""
    source = _upcast_source(xf)
    x = source if source is not None else xf
    xv, sv, xfv = _value(x), _value(scale), _value(xf)
    if xv is None or sv is None or xfv is None:
        return False
    if xv.dtype not in _CAST_DTYPES or xv.dim() != 2 or xfv.dtype != torch.float32:
        return False
    if source is None and xv.dtype != torch.float32:
        return False  # a product of something else, not of x.float()
    if sv.dtype not in _CAST_DTYPES or sv.device != xv.device or xv.device.type not in ("cpu", "cuda"):
        return False
    if xv.requires_grad or sv.requires_grad:
        return False
    m, k = xv.shape
    if _known_small(m) or _known_small(k):
        return False
    if sv.dim() <= 2 and _statically(sv.numel() == 1):
        rowwise = False
    elif sv.dim() == 2 and _statically(sv.shape[0] == m) and _statically(sv.shape[1] == 1):
        rowwise = True
    else:
        return False
    match.x, match.scale, match.rowwise = x, scale, rowwise
    match.upcast = xf if source is not None else None
    return True


def _transposed_copies(match: _Match, y: fx.Node) -> None:
    for t in list(y.users):
        is_t = (_method_or_function(t, ("t",), (torch.t,)) and len(t.args) == 1 and not t.kwargs)
        if not is_t and _method_or_function(t, ("transpose",), (torch.transpose,)) and not t.kwargs:
            is_t = len(t.args) == 3 and {d % 2 if isinstance(d, int) else None for d in t.args[1:]} == {0, 1}
        if not is_t and _method_or_function(t, ("permute",), (torch.permute,)) and not t.kwargs:
            dims = t.args[1:] if len(t.args) == 3 else (t.args[1] if len(t.args) == 2 else None)
            is_t = (isinstance(dims, (list, tuple))
                    and tuple(d % 2 for d in dims if isinstance(d, int)) == (1, 0))
        if not is_t or t.args[0] is not y:
            continue
        copies = [c for c in t.users if _is_contiguous_copy(c, t)]
        if copies:
            match.transposes.append(t)
            match.copies += copies


def _is_contiguous_copy(node: fx.Node, src: fx.Node) -> bool:
    if node.op != "call_method" or node.target != "contiguous" or node.args != (src,):
        return False
    return not node.kwargs or node.kwargs == {"memory_format": torch.contiguous_format}


def _amax_reductions(match: _Match, after: int, position) -> None:
    """``abs(x).max()`` (or of ``xf``) computed after ``after``: the op's amax replaces it."""
    sources = [match.x] + ([match.upcast] if match.upcast is not None else [])
    for source in sources:
        for a in list(source.users):
            if not (_method_or_function(a, ("abs",), (torch.abs,)) and a.args == (source,) and not a.kwargs):
                continue
            if len(a.users) != 1:
                continue
            (mx,) = a.users
            if _is_full_max(mx, a) and position(a) > after and _value(mx) is not None:
                match.amax.append((mx, a))


def _is_full_max(mx: fx.Node, src: fx.Node) -> bool:
    """``src.max()``, ``torch.max(src)``, or ``amax`` over every dim (no dim, or ``dim=()``)."""
    if _method_or_function(mx, ("max",), (torch.max,)):
        return mx.args == (src,) and not mx.kwargs
    if not _method_or_function(mx, ("amax",), (torch.amax,)) or mx.args[:1] != (src,):
        return False
    dims = list(mx.args[1:]) + ([mx.kwargs["dim"]] if "dim" in mx.kwargs else [])
    if set(mx.kwargs) - {"dim"} or len(dims) > 1:
        return False
    return not dims or (isinstance(dims[0], (list, tuple)) and len(dims[0]) == 0)


def _find(y: fx.Node, position) -> _Match | None:
    dtype = _fp8_cast(y)
    if dtype is None:
        return None
    clamp = y.args[0]
    mul = _clamp_source(clamp, reference.FP8_FORMATS[dtype].max)
    if mul is None or set(clamp.users) != {y} or set(mul.users) != {clamp}:
        return None
    match = _Match()
    if not any(_operands(match, xf, scale) for xf, scale in _split_mul(mul)):
        return None
    match.mul, match.clamp, match.cast = mul, clamp, y
    _amax_reductions(match, position(mul), position)
    if match.upcast is not None:
        amax_abs = {a for _, a in match.amax}
        if not set(match.upcast.users) <= {mul} | amax_abs:
            return None
    _transposed_copies(match, y)
    if not match.copies:
        return None
    first = match.upcast if match.upcast is not None else mul
    last = max([y, *match.copies, *(mx for mx, _ in match.amax)], key=position)
    if not _no_mutation_between(first, last):
        return None
    return match


def _fake_outputs(match: _Match, dtype: torch.dtype):
    """Example outputs for the new nodes' meta (what later pre-grad passes read), from the fake op."""
    xv, sv = _value(match.x), _value(match.scale)
    mode = getattr(xv, "fake_mode", None)
    if mode is None or getattr(sv, "fake_mode", None) is not mode:
        return None
    try:
        with mode:
            return compiled_op()(xv, sv, dtype, match.rowwise)
    except Exception:  # meta is a convenience; AOT autograd retraces the graph either way
        return None


def _apply(graph: fx.Graph, match: _Match) -> None:
    dtype = _fp8_cast(match.cast)
    example = _fake_outputs(match, dtype)
    with graph.inserting_before(match.mul):
        op = graph.call_function(compiled_op(),
                                 (match.x, match.scale, dtype, match.rowwise))
        outs = [graph.call_function(operator.getitem, (op, i)) for i in range(3)]
    if example is not None:
        op.meta["example_value"] = example
        for node, value in zip(outs, example, strict=True):
            node.meta["example_value"] = value
    y, y_t, amax = outs
    match.cast.replace_all_uses_with(y)
    for copy in match.copies:
        back = [u for u in copy.users if u.op == "call_method" and u.target == "t" and u.args == (copy,)
                and not u.kwargs]
        for u in back:  # y.t().contiguous().t() is y_t itself
            u.replace_all_uses_with(y_t)
            graph.erase_node(u)
        if copy.users:  # y.t().contiguous() is the (contiguous) view y_t.t()
            with graph.inserting_after(y_t):
                view = graph.call_method("t", (y_t,))
            if example is not None:
                view.meta["example_value"] = example[1].t()
            copy.replace_all_uses_with(view)
        graph.erase_node(copy)
    for mx, a in match.amax:
        with graph.inserting_before(mx):
            value = amax
            if _value(mx).dtype != torch.float32:
                # amax is x.abs().max() rounded to fp32, exactly: back in x's dtype it is exact again.
                value = graph.call_method("to", (amax, _value(mx).dtype))
                value.meta.update(mx.meta)
        mx.replace_all_uses_with(value)
        graph.erase_node(mx)
        graph.erase_node(a)
    for node in [*match.transposes, match.cast, match.clamp, match.mul, match.upcast]:
        if node is not None and not node.users:
            graph.erase_node(node)


def rewrite(gm) -> int:
    """Rewrites every fp8 cast + transposed copy in ``gm`` (a GraphModule or a Graph); returns how many."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    count = 0
    alive = set(graph.nodes)
    for node in list(graph.nodes):
        if node not in alive or _fp8_cast(node) is None:
            continue
        match = _find(node, _position(graph))
        if match is None:
            continue
        _apply(graph, match)
        stats["cast_transpose_pattern"] += 1
        count += 1
        alive = set(graph.nodes)
    if count:
        graph.lint()
        if isinstance(gm, fx.GraphModule):
            gm.recompile()
    return count
