"""DTensor support: the public functions accept ``torch.distributed.tensor.DTensor`` inputs and run locally.

Each rank runs the op on its own shard, with no communication, when the sharding allows it:

- ``softmax`` / ``log_softmax`` / ``logsumexp``: ``x`` replicated or sharded (``Shard(d)``) on any dimension
  except the reduced one, on every mesh dimension. ``mask`` is placed like ``x`` or replicated; a tensor
  ``scale`` is a replicated scalar (a plain 0-d tensor counts as one) and its gradient comes back ``Partial``
  (each rank holds the sum over its rows) to a DTensor scale, reduced for a plain one.
- ``attention``: ``q``, ``k``, ``v`` placed alike, each mesh dimension ``Replicate``, ``Shard(0)`` (batch) or
  ``Shard(1)`` (heads). Sharding the heads of grouped-query attention keeps each group of q heads with its
  kv head, which needs ``Hkv`` divisible by the number of head shards (then ``Hq`` is too). ``attn_mask``
  (bool or additive) is placed like ``q`` after broadcasting to ``(B, Hq, Sq, Sk)``, or replicated.
  ``sinks`` (``(Hq,)``) is replicated (a plain tensor counts as replicated) or ``Shard(0)`` where ``q`` shards
  its heads; a replicated one is sliced to each rank's heads there (locally; its gradient is then gathered
  back). The sinks' gradient comes back ``Partial`` where ``q`` shards its batch (each rank holds the sum over
  its own rows), and for ``merge_attention``'s sinks where the partials shard a batch or row dim.
- ``merge_attention``: every partial output and lse placed alike, each mesh dimension ``Replicate`` or
  ``Shard(d)`` on a batch, head or query-row dim (any dim of ``(..., Sq)``; the merge is per row), so the
  DTensors ``attention(..., return_lse=True)`` returns merge as they are. Neither the head dim ``D`` of
  the outputs (the lse gradient is a dot product over it) nor the partials dim of a stacked input (merged
  over) can be sharded.

Anything else (a ``Partial`` input, sharding on the reduced dimension or on the sequence of attention,
mismatched placements (between partials too), a plain tensor mixed with DTensors, packed varlen attention)
raises a ``ValueError`` that names the argument and the redistribute that would make it work. safeops
never redistributes a forward input on its own: a hidden all-gather of an activation is a performance bug
the user should see. (The backward ops are different: there the incoming gradient's placement is not the
user's choice, so DTensor may redistribute it to match the saved input, e.g. a replicated gradient sliced
to a shard.)

The sharding strategies are registered with ``torch.distributed.tensor.experimental.register_sharding``
for ``torch.ops.safeops.{softmax, log_softmax, logsumexp, softmax_backward, attention,
attention_backward, attention_sinks_backward, merge_attention, merge_attention_backward,
merge_attention_sinks_backward}``: at the end of
``import safeops`` when ``torch.distributed.tensor`` is already imported, else right after its first import
(a post-import hook), and by the first DTensor a public function sees should that have failed.
``import safeops`` never imports ``torch.distributed.tensor`` itself and never fails over it. Code calling
the ``torch.ops.safeops`` ops directly on DTensors may call :func:`register` first to be sure; there an
unsupported placement raises DTensor's ``RuntimeError`` carrying the same message.

Results are the same bits as the op on the whole tensor: every supported sharding splits independent rows
(batch, heads, non-reduced dims) and the kernels are batch-invariant (contract section 6).
"""

from __future__ import annotations

import sys

import torch

from ._import_hooks import after_import

_registered = False


def is_dtensor(t) -> bool:
    """True for a DTensor. Never imports ``torch.distributed``: a DTensor exists only once it is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def any_dtensor(*tensors) -> bool:
    """Whether any argument is a DTensor (checked on every public call: kept to a few hundred ns)."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return False
    dtensor = module.DTensor
    for t in tensors:
        if t is not None and type(t) is not torch.Tensor and isinstance(t, dtensor):
            return True
    return False


# --------------------------------------------------------------------------------------------------
# Placement checks (shared by the public functions, which raise ValueError, and the strategies)
# --------------------------------------------------------------------------------------------------


def _kinds():
    from torch.distributed.tensor import Replicate, Shard

    return Replicate, Shard


def _describe(placements) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def _plain_placement(p) -> bool:
    replicate, shard = _kinds()
    return type(p) is replicate or type(p) is shard


def _redistribute_hint(name: str, placements, ok: str) -> str:
    return (f"redistribute {name} first (e.g. {name}.redistribute(mesh, placements) with {ok}), or call "
            f"{name}.full_tensor() to gather it")


def _shards(mesh, placements, dim: int) -> int:
    """How many pieces ``dim`` is cut into (a product when several mesh dimensions shard it)."""
    _, shard = _kinds()
    n = 1
    for i, p in enumerate(placements):  # a plain loop: torch.compile traces this (no generator arguments)
        if type(p) is shard and p.dim == dim:
            n *= mesh.size(i)
    return n


def _too_few_error(name: str, shape, mesh, placements) -> str | None:
    # DTensor offers no sharded strategy for a dim shorter than its number of pieces; it would gather instead.
    for d, size in enumerate(shape):
        n = _shards(mesh, placements, d)
        if size < n:
            return (f"{name} has size {size} on dim {d}, sharded into {n} pieces {_describe(placements)}: "
                    f"some ranks would hold nothing, and DTensor would gather {name} instead of running "
                    f"locally; shard a longer dimension or replicate {name}")
    return None


def rows_error(name: str, placements, mesh, shape, dim: int, op: str) -> str | None:
    """Why ``x``'s placements cannot run the row op ``op`` (reducing ``dim``) locally, or None."""
    replicate, shard = _kinds()
    ndim = len(shape)
    ok = f"Replicate() or Shard(d) for any d != {dim}"
    for p in placements:
        if p.is_partial():
            return (f"{name} has a Partial placement {_describe(placements)}: safeops.{op} is not linear, so "
                    f"it needs the reduced values; " + _redistribute_hint(name, placements, ok))
        if not _plain_placement(p):
            return (f"{name} has placement {p} in {_describe(placements)}; safeops.{op} supports {ok} on "
                    f"each mesh dimension; " + _redistribute_hint(name, placements, ok))
        if type(p) is shard and p.dim % max(ndim, 1) == dim:
            return (f"{name} is sharded on dim {dim} {_describe(placements)}, the dimension safeops.{op} "
                    f"reduces over: each rank would hold part of every row, and combining them needs "
                    f"communication; " + _redistribute_hint(name, placements, ok))
    return _too_few_error(name, shape, mesh, placements)


def attention_error(names, placements_list, mesh_list, shapes) -> str | None:
    """Why q, k, v's placements cannot run attention locally, or None. ``names`` etc. are for q, k, v."""
    replicate, shard = _kinds()
    ok = "Replicate(), Shard(0) (batch) or Shard(1) (heads)"
    qp, qm = placements_list[0], mesh_list[0]
    for name, placements, mesh in zip(names, placements_list, mesh_list, strict=True):
        if mesh != qm:
            return f"{name} is on device mesh {mesh} but q is on {qm}: q, k and v must share one mesh"
        for p in placements:
            if p.is_partial():
                return (f"{name} has a Partial placement {_describe(placements)}: attention needs its "
                        f"values reduced; " + _redistribute_hint(name, placements, ok))
            if not _plain_placement(p) or type(p) is shard and p.dim % 4 not in (0, 1):
                seq = (" Sharding the sequence needs communication between ranks (ring / context-parallel "
                       "attention)." if type(p) is shard and p.dim % 4 == 2 else "")
                return (f"{name} has placement {p} in {_describe(placements)}; safeops.attention runs "
                        f"locally only with {ok} on each mesh dimension.{seq} " +
                        _redistribute_hint(name, placements, ok))
        if tuple(placements) != tuple(qp):
            return (f"{name} is placed {_describe(placements)} but q is placed {_describe(qp)}: q, k and v "
                    f"must be sharded alike (the same batch entries and head groups on each rank); "
                    + _redistribute_hint(name, placements, f"q's placements {_describe(qp)}"))
    hq, hkv = shapes[0][1], shapes[1][1]
    n = _shards(qm, qp, 1)
    if n > 1 and hq != hkv and hkv % n:
        return (f"q has {hq} heads and k/v {hkv}: sharding the heads over {n} ranks must keep each group of "
                f"{hq // max(hkv, 1)} q heads with its kv head, which needs Hkv divisible by {n}; shard the "
                f"batch (Shard(0)) instead, or use a mesh whose size divides {hkv}")
    for name, shape in zip(names, shapes, strict=True):
        message = _too_few_error(name, shape, qm, qp)
        if message:
            return message
    return None


def merge_error(names, placements_list, mesh_list, shape, stacked: bool) -> str | None:
    """Why merge_attention's outputs / lses (``names`` etc. are for the two, ``shape`` the outputs') cannot
    be merged locally, or None. ``stacked``: the stacks ``(P, ..., Sq, D)`` / ``(P, ..., Sq)``; else one
    partial ``(..., Sq, D)`` / ``(..., Sq)``, with the dims the caller sees (a list is checked unstacked)."""
    _, shard = _kinds()
    (o_name, l_name), (op, lp), (om, lm) = names, placements_list, mesh_list
    op, lp = tuple(op), tuple(lp)
    head = len(shape) - 1
    ok = f"Replicate() or Shard(d), {int(stacked)} <= d < {head} (batch, head or query-row dims)"
    if lm != om:
        return f"{l_name} is on device mesh {lm} but {o_name} is on {om}: they must share one mesh"
    for p in op:
        if p.is_partial():
            return (f"{o_name} has a Partial placement {_describe(op)}: merge_attention is not linear in "
                    f"its inputs, it needs their reduced values; " + _redistribute_hint(o_name, op, ok))
        if not _plain_placement(p):
            return (f"{o_name} has placement {p} in {_describe(op)}; safeops.merge_attention runs locally "
                    f"only with {ok} on each mesh dimension; " + _redistribute_hint(o_name, op, ok))
        dim = p.dim % len(shape) if type(p) is shard else None
        if dim == head:
            return (f"{o_name} is sharded on its head dim D (dim {head}) {_describe(op)}: each rank would "
                    f"hold part of every row, and merging (its lse gradient is a dot product over D) would "
                    f"need communication; " + _redistribute_hint(o_name, op, ok))
        if stacked and dim == 0:
            return (f"{o_name} is sharded on dim 0 {_describe(op)}, the partials dim of the stack: merging "
                    f"sums over the partials, which would need communication; "
                    + _redistribute_hint(o_name, op, ok))
    if lp != op:
        return (f"{l_name} is placed {_describe(lp)} but {o_name} {_describe(op)}: each rank needs the lses "
                f"of its own rows, so they must be placed alike; "
                + _redistribute_hint(l_name, lp, f"{o_name}'s placements {_describe(op)}"))
    return _too_few_error(o_name, shape, om, op)


def _replicated(placements) -> bool:
    replicate, _ = _kinds()
    for p in placements:  # a plain loop: torch.compile traces this
        if type(p) is not replicate:
            return False
    return True


def _follower_error(name: str, t, lead: str, lead_placements, lead_mesh) -> str | None:
    """A mask-like argument must be placed like the lead argument or replicated."""
    replicate, _ = _kinds()
    if t.device_mesh != lead_mesh:
        return (f"{name} is on device mesh {t.device_mesh} but {lead} is on {lead_mesh}: they must share one "
                "mesh")
    placements = tuple(t.placements)
    if placements == tuple(lead_placements) or _replicated(placements):
        return None
    return (f"{name} is placed {_describe(placements)} but {lead} {_describe(lead_placements)}: {name} must "
            f"be placed like {lead} (after broadcasting to its shape) or replicated; "
            + _redistribute_hint(name, placements, f"{lead}'s placements {_describe(lead_placements)}"))


# --------------------------------------------------------------------------------------------------
# Preparing the public functions' arguments
# --------------------------------------------------------------------------------------------------


def _local_view(t: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's shard of the whole tensor ``t`` under ``placements``, as a view (torch.chunk's split,
    which is DTensor's). A broadcast mask stays a zero-stride view instead of being materialized."""
    _, shard = _kinds()
    coordinate = mesh.get_coordinate()
    for i, p in enumerate(placements):
        if type(p) is shard:
            pieces = torch.chunk(t, mesh.size(i), dim=p.dim)
            c = coordinate[i]
            t = pieces[c] if c < len(pieces) else t.narrow(p.dim, t.size(p.dim), 0)
    return t


def _like(t, lead):
    """A replicated DTensor ``t`` re-wrapped with ``lead``'s placements, each rank keeping a view of its part
    (DTensor's own Replicate -> Shard would copy the part, materializing a broadcast mask)."""
    from torch.distributed.tensor import DTensor

    if tuple(t.placements) == tuple(lead.placements):
        return t
    local = _local_view(t.to_local(), lead.device_mesh, lead.placements)
    return DTensor.from_local(local, lead.device_mesh, lead.placements, run_check=False, shape=t.shape,
                              stride=t.stride())


def _replicated_scalar(t, lead):
    """A plain 0-d tensor as a replicated DTensor on ``lead``'s mesh (gradient flows back to ``t``)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = lead.device_mesh
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _ensure_registered() -> None:
    if not _registered:
        # Outside any torch.compile trace. Wrapped here rather than decorated: torch.compiler.disable imports
        # torch._dynamo, which imports triton, and `import safeops` must not (safeops._config first decides
        # whether Triton runs under its interpreter).
        torch.compiler.disable(register)()


def _plain_error(name: str, lead: str) -> ValueError:
    return ValueError(
        f"{name} is a plain torch.Tensor but {lead} is a DTensor: pass {name} as a DTensor too (e.g. "
        f"DTensor.from_local({name}, mesh, [Replicate()]) when every rank holds all of it)")


def prepare_rows(x, dim: int, scale_tensor, mask):
    """Checks a softmax-family call with DTensor arguments; returns ``(scale_tensor, mask)`` for the op."""
    if not is_dtensor(x):
        other = "scale" if is_dtensor(scale_tensor) else "mask"
        raise ValueError(f"{other} is a DTensor but x is a plain torch.Tensor: pass x as a DTensor too")
    _ensure_registered()
    message = rows_error("x", x.placements, x.device_mesh, x.shape, dim, "softmax / log_softmax / logsumexp")
    if message:
        raise ValueError(message)
    if scale_tensor is not None:
        if not is_dtensor(scale_tensor):
            scale_tensor = _replicated_scalar(scale_tensor, x)
        elif scale_tensor.device_mesh != x.device_mesh or not _replicated(scale_tensor.placements):
            raise ValueError(f"scale must be a replicated DTensor on x's mesh, got placements "
                             f"{_describe(scale_tensor.placements)}; redistribute it to Replicate() first")
    if mask is not None:
        if not is_dtensor(mask):
            raise _plain_error("mask", "x")
        message = _follower_error("mask", mask, "x", x.placements, x.device_mesh)
        if message:
            raise ValueError(message)
        mask = _like(mask, x)
    return scale_tensor, mask


def prepare_attention(q, k, v, mask, sinks=None):
    """Checks an attention call with DTensor arguments; returns ``(mask, sinks)`` ready for the op."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not is_dtensor(t):
            raise _plain_error(name, "q" if name != "q" else "attn_mask" if is_dtensor(mask) else "sinks")
    _ensure_registered()
    message = attention_error(("q", "k", "v"), (q.placements, k.placements, v.placements),
                              (q.device_mesh, k.device_mesh, v.device_mesh), (q.shape, k.shape, v.shape))
    if message:
        raise ValueError(message)
    if mask is not None:
        if not is_dtensor(mask):
            raise _plain_error("attn_mask", "q")
        message = _follower_error("attn_mask", mask, "q", q.placements, q.device_mesh)
        if message:
            raise ValueError(message)
        mask = _like(mask, q)
    return mask, _prepare_sinks(sinks, q, "q", 1)


def _prepare_sinks(sinks, lead, lead_name: str, head_dim: int):
    """``sinks`` as a DTensor on ``lead``'s mesh: a plain tensor counts as replicated; a DTensor is
    replicated, or ``Shard(0)`` on the mesh dimensions where ``lead`` shards its heads (``head_dim``)."""
    replicate, shard = _kinds()
    if sinks is None or not isinstance(sinks, torch.Tensor):
        return sinks  # not a tensor: the public function's own TypeError
    if not is_dtensor(sinks):
        return _replicated_scalar(sinks, lead)
    ok = sinks.device_mesh == lead.device_mesh
    for p, lp in zip(sinks.placements, lead.placements, strict=True) if ok else ():
        if not (type(p) is replicate or (type(p) is shard and p.dim == 0 and type(lp) is shard
                                          and lp.dim == head_dim)):
            ok = False
    if not ok:
        raise ValueError(f"sinks is placed {_describe(sinks.placements)} on {sinks.device_mesh}, but it must "
                         f"be on {lead_name}'s mesh, replicated or Shard(0) where {lead_name} shards its "
                         f"heads (dim {head_dim}; {lead_name} is placed {_describe(lead.placements)})")
    return sinks


def prepare_merge(outs: list, lses: list, stacked: bool, sinks=None):
    """Checks a merge_attention call with DTensor arguments: ``outs`` / ``lses`` are the lists of partials
    (``stacked``: the one stacked tensor each). The partials are checked before they are stacked: stacking
    differently placed DTensors would redistribute them. Returns ``sinks`` ready for the op."""
    named = []
    for what, parts in (("outs", outs), ("lses", lses)):
        named += [(what if stacked else f"{what}[{i}]", t) for i, t in enumerate(parts)]
    lead = next((n for n, t in named if is_dtensor(t)), None)
    if lead is None:
        raise ValueError("sinks is a DTensor but the partials are plain tensors: pass them as DTensors too, "
                         "or sinks as a plain tensor")
    for n, t in named:
        if isinstance(t, torch.Tensor) and not is_dtensor(t):
            raise _plain_error(n, lead)
    if not outs or not lses or not all(is_dtensor(t) for _, t in named):
        return sinks  # some argument is no tensor: merge_attention's own checks raise the TypeError
    _ensure_registered()
    for what, parts in (("outs", outs), ("lses", lses)):
        first = parts[0]
        for i, t in enumerate(parts[1:], 1):
            if t.device_mesh != first.device_mesh:
                raise ValueError(f"{what}[{i}] is on device mesh {t.device_mesh} but {what}[0] is on "
                                 f"{first.device_mesh}: all partials must share one mesh")
            if tuple(t.placements) != tuple(first.placements):
                raise ValueError(
                    f"{what}[{i}] is placed {_describe(t.placements)} but {what}[0] "
                    f"{_describe(first.placements)}: all partials must be placed alike (stacking them would "
                    f"redistribute them); "
                    + _redistribute_hint(f"{what}[{i}]", t.placements, f"{what}[0]'s placements"))
    o, lse = outs[0], lses[0]
    if o.dim() < 1 + stacked:
        return sinks  # merge_attention's shape checks raise
    names = ("outs", "lses") if stacked else ("outs[0]", "lses[0]")
    message = merge_error(names, (o.placements, lse.placements), (o.device_mesh, lse.device_mesh), o.shape,
                          stacked)
    if message:
        raise ValueError(message)
    return _prepare_sinks(sinks, o, names[0], o.dim() - 3)


def reject_varlen(names_and_tensors) -> None:
    for name, t in names_and_tensors:
        if is_dtensor(t):
            raise ValueError(
                f"{name} is a DTensor, but safeops.attention_varlen does not take DTensors (a packed batch "
                "has no fixed dimension to shard); call it on each rank's local tensors (to_local()), or use "
                "safeops.attention with q, k, v sharded on batch or heads")


# --------------------------------------------------------------------------------------------------
# Sharding strategies
# --------------------------------------------------------------------------------------------------
# Each strategy function receives the op's arguments with DTensorSpecs in place of tensors and returns the
# acceptable (output placements, input placements) pairs for ONE mesh dimension; DTensor expands them over
# the mesh and picks the cheapest. We offer only Replicate and the shardings the inputs actually use, so the
# cheapest is always the no-communication one (an offered Shard(1) of attention was checked for GQA).


def _used_shard_dims(placements) -> list[int]:
    _, shard = _kinds()
    return sorted({p.dim for p in placements if type(p) is shard})


def _rows_forward(kind: int):
    from .ops.softmax import KIND_NAMES, LOGSUMEXP

    def strategy(x, dim, scale, scale_tensor, mask, out_dtype):
        replicate, shard = _kinds()
        message = rows_error("x", x.placements, x.mesh, x.shape, dim, KIND_NAMES[kind])
        if message:
            raise ValueError(message)
        pairs = []
        for d in [None] + _used_shard_dims(x.placements):
            here = replicate() if d is None else shard(d)
            reduced = replicate() if d is None else shard(d if d < dim else d - 1)
            out = reduced if kind == LOGSUMEXP else here
            inputs = [here, None, None, None if scale_tensor is None else replicate(),
                      None if mask is None else here, None]
            pairs.append(([out, reduced, reduced], inputs))
        return pairs

    return strategy


def _rows_backward(grad, x, row_max, row_sum, dim, kind, scale, scale_tensor, mask, need_dscale):
    from torch.distributed.tensor import Partial

    from .ops.softmax import LOGSUMEXP

    replicate, shard = _kinds()
    pairs = []
    for d in [None] + _used_shard_dims(x.placements):
        here = replicate() if d is None else shard(d)
        reduced = replicate() if d is None else shard(d if d < dim else d - 1)
        # Each rank's scale gradient sums over its own rows only: the partial sums add up to the whole.
        dscale = replicate() if d is None else Partial()
        inputs = [reduced if kind == LOGSUMEXP else here, here, reduced, reduced, None, None, None,
                  None if scale_tensor is None else replicate(), None if mask is None else here, None]
        pairs.append(([here, dscale], inputs))
    return pairs


def _check_dense(q, k, v, cu_seqlens_q):
    if cu_seqlens_q is not None:
        raise ValueError("packed (varlen) attention does not take DTensors; run it on local tensors")
    message = attention_error(("q", "k", "v"), (q.placements, k.placements, v.placements),
                              (q.mesh, k.mesh, v.mesh), (q.shape, k.shape, v.shape))
    if message:
        raise ValueError(message)


def _sinks_placement(d):
    """The (Hq,) sinks' placement for a mesh dimension on which q is replicated (None) or sharded on d."""
    replicate, shard = _kinds()
    return shard(0) if d == 1 else replicate()


def _attention_forward(q, k, v, mask, mask_kind, cu_seqlens_q, cu_seqlens_k, *options):
    _check_dense(q, k, v, cu_seqlens_q)
    replicate, shard = _kinds()
    has_sinks = len(options) > 8 and options[8] is not None  # max_seqlen_q .. precision, then sinks
    pairs = []
    for d in [None] + _used_shard_dims(q.placements):
        p = replicate() if d is None else shard(d)  # batch or heads: the same dim of every operand
        inputs = [p, p, p, None if mask is None else p] + [None] * (3 + len(options))
        if has_sinks:
            inputs[-1] = _sinks_placement(d)
        pairs.append(([p, p, p], inputs))
    return pairs


def _attention_backward(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q, cu_seqlens_k,
                        *options):
    _check_dense(q, k, v, cu_seqlens_q)
    replicate, shard = _kinds()
    pairs = []
    for d in [None] + _used_shard_dims(q.placements):
        p = replicate() if d is None else shard(d)
        pairs.append(([p, p, p], [p] * 7 + [None if mask is None else p] + [None] * (3 + len(options))))
    return pairs


def _attention_sinks_backward(grad, q, k, v, out, row_max, row_sum, mask, mask_kind, cu_seqlens_q,
                              cu_seqlens_k, *options):
    _check_dense(q, k, v, cu_seqlens_q)
    replicate, shard = _kinds()
    from torch.distributed.tensor import Partial

    pairs = []
    for d in [None] + _used_shard_dims(q.placements):
        p = replicate() if d is None else shard(d)
        # Each batch shard's dsinks sums over its own rows only: the partial sums add up to the whole.
        dsinks = Partial() if d == 0 else _sinks_placement(d)
        pairs.append(([p, p, p, dsinks], [p] * 7 + [None if mask is None else p] + [None] * (len(options) + 2)
                      + [_sinks_placement(d)]))
    return pairs


def _check_merge(outs, lses) -> None:
    message = merge_error(("outs", "lses"), (outs.placements, lses.placements), (outs.mesh, lses.mesh),
                          outs.shape, True)
    if message:
        raise ValueError(message)


def _merge_sinks_placement(outs, d):
    """The (H,) sinks' placement where the stacked outs (P, ..., H, Sq, D) are replicated (None) or sharded
    on d: Shard(0) on the head dim, else replicated."""
    replicate, shard = _kinds()
    return shard(0) if d == len(outs.shape) - 3 else replicate()


def _merge_forward(outs, lses, sinks=None):
    _check_merge(outs, lses)
    replicate, shard = _kinds()
    pairs = []
    for d in [None] + _used_shard_dims(outs.placements):
        stack = replicate() if d is None else shard(d)  # a batch / head / row dim of every partial
        merged = replicate() if d is None else shard(d - 1)  # the same dim, the partials dim gone
        sink = None if sinks is None else _merge_sinks_placement(outs, d)
        pairs.append(([merged, merged], [stack, stack, sink]))
    return pairs


def _merge_backward(grad_out, grad_lse, outs, lses):
    _check_merge(outs, lses)
    replicate, shard = _kinds()
    pairs = []
    for d in [None] + _used_shard_dims(outs.placements):
        stack = replicate() if d is None else shard(d)
        merged = replicate() if d is None else shard(d - 1)
        pairs.append(([stack, stack], [merged, None if grad_lse is None else merged, stack, stack]))
    return pairs


def _merge_sinks_backward(grad_out, grad_lse, outs, lses, sinks):
    _check_merge(outs, lses)
    replicate, shard = _kinds()
    from torch.distributed.tensor import Partial

    pairs = []
    for d in [None] + _used_shard_dims(outs.placements):
        stack = replicate() if d is None else shard(d)
        merged = replicate() if d is None else shard(d - 1)
        sink = _merge_sinks_placement(outs, d)
        # Sharded on a batch or row dim, each rank's dsinks sums its own rows: partial sums of the whole.
        dsinks = sink if d is None or d == len(outs.shape) - 3 else Partial()
        inputs = [merged, None if grad_lse is None else merged, stack, stack, sink]
        pairs.append(([stack, stack, dsinks], inputs))
    return pairs


def register_if_loaded() -> None:
    """Called at the end of ``import safeops``: registers right away when DTensor is already imported, else
    right after ``torch.distributed.tensor`` is first imported (safeops._import_hooks), so code compiled with
    ``torch.compile(fullgraph=True)`` never meets an unregistered op: registering inside a trace would be a
    graph break. The first DTensor a public function sees registers too, should that have failed. Never
    raises: ``import safeops`` must not fail over an optional feature, and a failure here comes back, with
    its cause, on the first DTensor call."""
    if not torch.distributed.is_available():
        return
    after_import("torch.distributed.tensor", _register_quietly)


def _register_quietly() -> None:
    try:
        register()
    except Exception:  # noqa: BLE001, S110  (retried, and raised, by the first DTensor call)
        pass


def register() -> None:
    """Registers the DTensor sharding strategies of the safeops ops (idempotent).

    The public functions call this on the first DTensor they see; call it yourself before using
    ``torch.ops.safeops.*`` directly on DTensors. Raises ``RuntimeError`` where ``torch.distributed`` (or
    DTensor) is unavailable.
    """
    global _registered
    if _registered:
        return
    if not torch.distributed.is_available():
        raise RuntimeError("safeops.dtensor needs torch.distributed, which this PyTorch build lacks")
    from torch.distributed.tensor.experimental import register_sharding

    from .ops import attention as _attention_ops  # noqa: F401  (defines torch.ops.safeops.*)
    from .ops import merge as _merge_ops  # noqa: F401
    from .ops import softmax as _softmax_ops

    ops = torch.ops.safeops
    for kind, op in ((_softmax_ops.SOFTMAX, ops.softmax), (_softmax_ops.LOG_SOFTMAX, ops.log_softmax),
                     (_softmax_ops.LOGSUMEXP, ops.logsumexp)):
        register_sharding(op.default)(_rows_forward(kind))
    register_sharding(ops.softmax_backward.default)(_rows_backward)
    register_sharding(ops.attention.default)(_attention_forward)
    register_sharding(ops.attention_backward.default)(_attention_backward)
    register_sharding(ops.attention_sinks_backward.default)(_attention_sinks_backward)
    register_sharding(ops.merge_attention.default)(_merge_forward)
    register_sharding(ops.merge_attention_backward.default)(_merge_backward)
    register_sharding(ops.merge_attention_sinks_backward.default)(_merge_sinks_backward)
    _registered = True
