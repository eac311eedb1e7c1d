"""Context-parallel attention over a ``torch.distributed`` process group (ring or all-gather).

Each rank holds one shard of the sequence for q, k and v, ``(B, H, S_local, D)``; the result on each rank is
its shard of ``safeops.attention`` over the whole (gathered) sequence, forward and backward, within fp32
reduction-order error. Import this module explicitly (``import safeops.distributed``); ``import safeops``
does not import ``torch.distributed``.

Layouts (how the global sequence of length ``W * S_local`` is split over the ``W`` ranks of the group):

- ``"contiguous"``: rank r holds positions ``[r * S_local, (r + 1) * S_local)``.
- ``"zigzag"``: the sequence is cut into ``2W`` chunks of ``S_local / 2``; rank r holds chunks r and
  ``2W - 1 - r`` (in that order). With ``is_causal`` every rank then has the same amount of work.
  :func:`shard_sequence` / :func:`unshard_sequence` convert between the full sequence and the shards.

Strategies:

- ``"ring"``: the k/v shards travel around the ring with ``batch_isend_irecv``; the transfer of the next
  shard is issued before the attention on the current one, so communication overlaps compute. Partials
  are merged in fp32 through their base-2 row stats ``(m, l)`` kept apart (contract section 3): merging
  the folded ``lse = m + log(l)`` instead would lose ``log(l)`` once ``|m|`` is ~1e11. The backward runs
  the ring again with the GLOBAL stats and output, so each step's gradients are exact pieces of the
  single-GPU gradient; dq accumulates locally in fp32, the fp32 dk/dv accumulators travel with their k/v
  shard and arrive back at the owner after ``W`` hops.
- ``"allgather"``: all-gather k and v once, attend to the visible prefix (causal handled through
  ``window_right``, exact), and reduce-scatter the fp32 dk/dv in the backward. One collective instead of
  ``W - 1`` dependent hops, but nothing overlaps it and every rank holds the whole k/v.
- ``"auto"`` (default): ``"allgather"`` when the gathered k and v take at most
  ``ALLGATHER_MAX_BYTES`` per rank (short sequences: each ring hop would cost more in latency than the
  attention it hides behind), else ``"ring"``. The threshold is provisional until measured
  (``bench/context_parallel.py`` times both).

Attention sinks (``sinks=``, contract section 9) are counted once per query row: the ring computes its
partials without them and merges each head's sink into the running stats once, at the end, as one more
partial with output 0 (``m = zs2``, ``l = 1``); the all-gather strategy sees each row's keys in one call and
passes the sinks to it. The backward needs nothing new for dq, dk, dv (the global stats include the sink);
each rank sums ``-p_sink * rowsum(dO * O)`` over its own rows in float64, and the ranks' sums are
all-gathered and added in rank order, so every rank holds the same bits of the sinks' gradient.

Every rank must call with the same shapes, options and layout; all ranks of the group must run the backward.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import functional as _functional
from . import reference
from .ops import attention as _ops_attention

__all__ = ["context_parallel_attention", "shard_sequence", "unshard_sequence", "choose_strategy",
           "LAYOUTS", "STRATEGIES", "ALLGATHER_MAX_BYTES"]

LAYOUTS = ("contiguous", "zigzag")
STRATEGIES = ("auto", "ring", "allgather")
# "auto" all-gathers when W * (k + v shard bytes) is at most this (provisional, see the module docstring).
ALLGATHER_MAX_BYTES = 32 << 20
NEG_INF = float("-inf")
# Distinct tags keep the k, v, dk and dv transfers between one pair of ranks apart (gloo matches by tag;
# NCCL ignores tags and matches in posting order, which is the same on every rank).
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 0, 1, 2, 3


@dataclass(frozen=True)
class _Config:
    group: object
    world: int
    rank: int
    is_causal: bool
    scale: float
    softcap: float | None
    precision: int
    layout: str
    strategy: str


# --------------------------------------------------------------------------------------------------
# Layout helpers
# --------------------------------------------------------------------------------------------------


def _chunks_of(layout: str, rank: int, world: int) -> tuple[int, ...]:
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "contiguous",
                   dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` (sequence along ``dim``) in ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    n_chunks = world_size if layout == "contiguous" else 2 * world_size
    if x.shape[dim] % n_chunks:
        raise ValueError(f"x has {x.shape[dim]} positions along dim {dim}, not a multiple of {n_chunks} "
                         f"({layout} layout over {world_size} ranks)")
    chunks = x.chunk(n_chunks, dim)
    return torch.cat([chunks[c] for c in _chunks_of(layout, rank, world_size)], dim)


def unshard_sequence(shards, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """The full sequence from the list of every rank's shard (inverse of :func:`shard_sequence`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    world = len(shards)
    if layout == "contiguous":
        return torch.cat(list(shards), dim)
    halves = [s.chunk(2, dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [halves[r][1] for r in reversed(range(world))], dim)


def _pieces(cfg: _Config, src: int, s_local: int) -> list[tuple[slice, slice, bool]]:
    """(query rows, key rows, causal) of the local queries against the k/v shard of rank ``src``.

    Chunk a of the queries and chunk b of the keys (global chunk indices): b < a all visible, b == a
    causal (equal chunk lengths, so top-left alignment is the diagonal), b > a nothing visible.
    """
    every = slice(None)
    if not cfg.is_causal:
        return [(every, every, False)]
    if src == cfg.rank:
        # One top-left causal call over the shard covers both zigzag chunks: the earlier chunk comes first.
        return [(every, every, True)]
    if cfg.layout == "contiguous":
        return [(every, every, False)] if src < cfg.rank else []
    half = s_local // 2
    if src < cfg.rank:
        # Key chunks src < rank < 2W-1-rank, and 2W-1-src > 2W-1-rank: only the first key chunk is visible.
        return [(every, slice(0, half), False)]
    # src > rank: both key chunks lie after query chunk `rank` and before query chunk 2W-1-rank.
    return [(slice(half, None), every, False)]


# --------------------------------------------------------------------------------------------------
# Local attention calls and the fp32 merge of partials through their (m, l) stats
# --------------------------------------------------------------------------------------------------


def _window(cfg: _Config, causal: bool, offset: int = -1) -> tuple[bool, int, int]:
    if offset >= 0:
        return False, -1, offset  # key j visible iff j <= i + offset: causal with the queries shifted
    return causal, -1, (0 if causal else -1)


# Partial outputs and gradients come back in fp32 (``partial_forward`` / ``partial_backward``): they are
# summed across shards, and rounding each to bf16 first loses everything where shards cancel (contract
# section 2: one rounding, at the end).


def _attn(cfg: _Config, q, k, v, causal: bool, offset: int = -1, sinks=None):
    is_causal, wl, wr = _window(cfg, causal, offset)
    return _ops_attention.partial_forward(q, k, v, is_causal, cfg.scale, cfg.softcap, wl, wr, cfg.precision,
                                          sinks)


def _attn_backward(cfg: _Config, grad, q, k, v, out, m, l, causal: bool, offset: int = -1):
    is_causal, wl, wr = _window(cfg, causal, offset)
    # Row slices as they are: the launcher takes any strides with a unit last dim (and makes the stats
    # contiguous itself); copying each slice here was a second pass over grad per ring step.
    return _ops_attention.partial_backward(grad, q, k, v, out, m, l, is_causal, cfg.scale, cfg.softcap, wl,
                                           wr, cfg.precision)


class _Merged:
    """Running merge of partials: the unnormalized fp32 output ``sum_j exp2(z_j - m) v_j`` and the base-2
    stats ``m`` (max), ``l`` (sum of exp2(z - m)), the same pair a single attention call returns."""

    def __init__(self, q: torch.Tensor, dv: int):
        acc = reference.compute_dtype(q.dtype)
        b, h, s, _ = q.shape
        self.acc = torch.zeros((b, h, s, dv), dtype=acc, device=q.device)
        self.m = torch.full((b, h, s), NEG_INF, dtype=acc, device=q.device)
        self.l = torch.zeros((b, h, s), dtype=acc, device=q.device)

    def add(self, rows: slice, out: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> None:
        acc, m_old, l_old = self.acc[:, :, rows], self.m[:, :, rows], self.l[:, :, rows]
        m_new = torch.maximum(m_old, m)
        # exp2(-inf - (-inf)) would be NaN: a row nobody has seen yet uses 0 as its reference.
        ref = torch.where(m_new == NEG_INF, torch.zeros_like(m_new), m_new)
        keep = torch.exp2(m_old - ref)
        w = l * torch.exp2(m - ref)
        acc.mul_(keep.unsqueeze(-1)).addcmul_(out, w.unsqueeze(-1))
        l_old.mul_(keep).add_(w)
        m_old.copy_(m_new)

    def add_sinks(self, sinks: torch.Tensor) -> None:
        """Each head's sink, once per row: one more partial with output 0, ``m = zs2``, ``l = 1``."""
        zs = reference.sink_scores(sinks, self.m.dtype).view(1, -1, 1).expand_as(self.m)
        m_new = torch.maximum(self.m, zs)
        ref = torch.where(m_new == NEG_INF, torch.zeros_like(m_new), m_new)
        keep = torch.exp2(self.m - ref)
        self.acc.mul_(keep.unsqueeze(-1))
        self.l.mul_(keep).add_(torch.exp2(zs - ref))
        self.m.copy_(m_new)

    def finish(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        empty = (self.l == 0).unsqueeze(-1)
        out = self.acc / torch.where(empty, torch.ones_like(self.acc), self.l.unsqueeze(-1))
        out = torch.where(empty, torch.zeros_like(out), out)
        return out.to(dtype), self.m, self.l


# --------------------------------------------------------------------------------------------------
# Ring
# --------------------------------------------------------------------------------------------------


def _peers(cfg: _Config) -> tuple[int, int]:
    nxt = dist.get_global_rank(cfg.group, (cfg.rank + 1) % cfg.world)
    prv = dist.get_global_rank(cfg.group, (cfg.rank - 1) % cfg.world)
    return nxt, prv


def _exchange(cfg: _Config, send: tuple[torch.Tensor, ...], recv: tuple[torch.Tensor, ...], tags) -> list:
    """Sends ``send`` to the next rank and receives ``recv`` from the previous one; returns the works."""
    nxt, prv = _peers(cfg)
    ops = [dist.P2POp(dist.isend, t, nxt, cfg.group, tag) for t, tag in zip(send, tags, strict=True)]
    ops += [dist.P2POp(dist.irecv, t, prv, cfg.group, tag) for t, tag in zip(recv, tags, strict=True)]
    return dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _ring_forward(cfg: _Config, q, k, v, sinks):
    merged = _Merged(q, v.shape[-1])
    kv = (k.contiguous(), v.contiguous())
    for step in range(cfg.world):
        src = (cfg.rank - step) % cfg.world
        works, incoming = [], None
        if step + 1 < cfg.world:
            incoming = (torch.empty_like(kv[0]), torch.empty_like(kv[1]))
            works = _exchange(cfg, kv, incoming, (_TAG_K, _TAG_V))
        for rows, keys, causal in _pieces(cfg, src, q.shape[2]):
            out, m, l = _attn(cfg, q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], causal)
            merged.add(rows, out, m, l)
        _wait(works)
        if incoming is not None:
            kv = incoming
    if sinks is not None:
        merged.add_sinks(sinks)
    return merged.finish(q.dtype)


def _ring_backward(cfg: _Config, grad, q, k, v, out, m, l):
    acc = reference.compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = (k.contiguous(), v.contiguous())
    # fp32 gradient accumulators of the k/v shard currently held; they travel with it.
    dkv = (torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device))
    dkv_works: list = []
    dkv_sent = None  # what dkv_works are still sending: kept alive until they are waited for
    for step in range(cfg.world):
        src = (cfg.rank - step) % cfg.world
        kv_works, incoming = [], None
        if step + 1 < cfg.world:
            incoming = (torch.empty_like(kv[0]), torch.empty_like(kv[1]))
            kv_works = _exchange(cfg, kv, incoming, (_TAG_K, _TAG_V))
        partial = []
        for rows, keys, causal in _pieces(cfg, src, q.shape[2]):
            a, b, c = _attn_backward(cfg, grad[:, :, rows], q[:, :, rows], kv[0][:, :, keys],
                                     kv[1][:, :, keys], out[:, :, rows], m[:, :, rows], l[:, :, rows], causal)
            dq[:, :, rows] += a
            partial.append((keys, b, c))
        _wait(dkv_works)  # the accumulators for `src` have arrived (sent by the previous rank last step)
        dkv_sent = None
        for keys, b, c in partial:
            dkv[0][:, :, keys] += b
            dkv[1][:, :, keys] += c
        # Pass them on; after the last step they reach their owner (src + W = the next rank's own shard).
        arriving = (torch.empty_like(dkv[0]), torch.empty_like(dkv[1]))
        dkv_works, dkv_sent = _exchange(cfg, dkv, arriving, (_TAG_DK, _TAG_DV)), dkv
        _wait(kv_works)
        dkv = arriving
        if incoming is not None:
            kv = incoming
    _wait(dkv_works)
    del dkv_sent
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


# --------------------------------------------------------------------------------------------------
# All-gather
# --------------------------------------------------------------------------------------------------


def _all_gather_sequence(cfg: _Config, x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(cfg.world)]
    dist.all_gather(parts, x, group=cfg.group)
    return unshard_sequence(parts, cfg.layout)


def _reduce_scatter_sequence(cfg: _Config, full: torch.Tensor) -> torch.Tensor:
    """Sum over ranks of ``full`` (the whole sequence), each rank keeping its shard."""
    shards = [shard_sequence(full, r, cfg.world, cfg.layout).contiguous() for r in range(cfg.world)]
    if full.device.type == "cpu":
        # gloo (the CPU backend) has no reduce_scatter: all-reduce the stacked shards and keep ours.
        stacked = torch.stack(shards)
        dist.all_reduce(stacked, group=cfg.group)
        return stacked[cfg.rank]
    result = torch.empty_like(shards[0])
    dist.reduce_scatter(result, shards, group=cfg.group)
    return result


def _query_chunks(cfg: _Config, s_local: int) -> list[tuple[slice, int]]:
    """(local rows, global offset of their first position) of each query chunk."""
    chunks = _chunks_of(cfg.layout, cfg.rank, cfg.world)
    length = s_local // len(chunks)
    return [(slice(i * length, (i + 1) * length), c * length) for i, c in enumerate(chunks)]


def _gather_pieces(cfg: _Config, s_local: int, s_total: int) -> list[tuple[slice, int, int]]:
    """(local rows, visible key prefix length, window offset or -1) for each query chunk."""
    if not cfg.is_causal:
        return [(slice(None), s_total, -1)]
    return [(rows, offset + (rows.stop - rows.start), offset) for rows, offset in _query_chunks(cfg, s_local)]


def _gather_forward(cfg: _Config, q, k, v, sinks):
    kg, vg = _all_gather_sequence(cfg, k), _all_gather_sequence(cfg, v)
    # Each row's visible keys are all in its one call: the sinks go there, once.
    pieces = [_attn(cfg, q[:, :, rows], kg[:, :, :n], vg[:, :, :n], False, offset, sinks)
              for rows, n, offset in _gather_pieces(cfg, q.shape[2], kg.shape[2])]
    out, m, l = (torch.cat(parts, 2) for parts in zip(*pieces, strict=True))
    return out.to(q.dtype), m, l


def _gather_backward(cfg: _Config, grad, q, k, v, out, m, l):
    kg, vg = _all_gather_sequence(cfg, k), _all_gather_sequence(cfg, v)
    acc = reference.compute_dtype(q.dtype)
    dkg = torch.zeros(kg.shape, dtype=acc, device=k.device)
    dvg = torch.zeros(vg.shape, dtype=acc, device=v.device)
    dq = []
    for rows, n, offset in _gather_pieces(cfg, q.shape[2], kg.shape[2]):
        a, b, c = _attn_backward(cfg, grad[:, :, rows], q[:, :, rows], kg[:, :, :n], vg[:, :, :n],
                                 out[:, :, rows], m[:, :, rows], l[:, :, rows], False, offset)
        dq.append(a)
        dkg[:, :, :n] += b
        dvg[:, :, :n] += c
    dk = _reduce_scatter_sequence(cfg, dkg)
    dv = _reduce_scatter_sequence(cfg, dvg)
    return torch.cat(dq, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _sinks_backward(cfg: _Config, grad, out, m, l, sinks) -> torch.Tensor:
    """d loss / d sinks over the whole sequence: each rank's float64 sum of ``-p_sink * rowsum(dO * O)`` over
    its rows (from the global stats), all-gathered and added in rank order, rounded once."""
    f64 = torch.float64
    zs = reference.sink_scores(sinks, m.dtype).to(f64).view(1, -1, 1)
    m64, l64 = m.to(f64), l.to(f64)
    p = torch.exp2(zs - torch.where(m64 == NEG_INF, torch.zeros_like(m64), m64))
    p = torch.where(l64 == 0, torch.zeros_like(p), p / torch.where(l64 == 0, torch.ones_like(l64), l64))
    delta = (grad.to(f64) * out.to(f64)).sum(-1)
    mine = -(torch.where(l64 == 0, torch.zeros_like(p), p * delta)).sum((0, 2))
    table = [torch.empty_like(mine) for _ in range(cfg.world)]
    dist.all_gather(table, mine.contiguous(), group=cfg.group)
    total = table[0]
    for part in table[1:]:
        total = total + part
    return total.to(sinks.dtype)


# --------------------------------------------------------------------------------------------------
# Autograd and the public function
# --------------------------------------------------------------------------------------------------


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cfg: _Config):
        if cfg.strategy == "ring":
            out, m, l = _ring_forward(cfg, q, k, v, sinks)
        else:
            out, m, l = _gather_forward(cfg, q, k, v, sinks)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, out, m, l, sinks)
        lse = reference.attention_lse(m, l)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, m, l, sinks = ctx.saved_tensors
        cfg = ctx.cfg
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks,
                                                                                        grad_out)):
            raise RuntimeError("context_parallel_attention is differentiable once: double backward "
                               "(create_graph=True) is not supported")
        if cfg.strategy == "ring":
            dq, dk, dv = _ring_backward(cfg, grad_out, q, k, v, out, m, l)
        else:
            dq, dk, dv = _gather_backward(cfg, grad_out, q, k, v, out, m, l)
        # Every rank computes it (a collective), whether or not its own sinks want a gradient.
        dsinks = None if sinks is None else _sinks_backward(cfg, grad_out, out, m, l, sinks)
        return dq, dk, dv, dsinks, None


_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def _check_ranks_agree(group, world: int, q, k, v, is_causal, scale, softcap, code, layout, strategy,
                       has_sinks: bool = False) -> None:
    """Every rank must pass the same shapes and options, or the ring's transfers mismatch (a gloo error, an
    NCCL hang). One small all-gather compares them; every rank sees the same table and raises the same
    ValueError."""
    fields = [*q.shape, *k.shape, *v.shape, _DTYPE_CODES.get(q.dtype, 0), int(bool(is_causal)),
              LAYOUTS.index(layout), STRATEGIES.index(strategy), int(code), int(softcap is not None),
              int(has_sinks),
              struct.unpack("<q", struct.pack("<d", float(scale)))[0],
              struct.unpack("<q", struct.pack("<d", float(softcap or 0.0)))[0]]
    mine = torch.tensor(fields, dtype=torch.int64, device=q.device)
    table = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(table, mine, group=group)  # (gloo has no all_gather_into_tensor)
    rows = torch.stack(table).tolist()
    if any(row != rows[0] for row in rows):
        shapes = "; ".join(f"rank {r}: q {tuple(row[0:4])}, k {tuple(row[4:8])}, v {tuple(row[8:12])}"
                           for r, row in enumerate(rows))
        raise ValueError("q, k, v: every rank of the group must pass the same shard shapes, dtype and "
                         f"options (is_causal, scale, softcap, precision, layout, strategy, sinks or none); "
                         f"got {shapes}")


def choose_strategy(k: torch.Tensor, v: torch.Tensor, world_size: int) -> str:
    """The ``"auto"`` rule: ``"allgather"`` when the gathered k and v fit ``ALLGATHER_MAX_BYTES``."""
    gathered = world_size * (k.numel() * k.element_size() + v.numel() * v.element_size())
    return "allgather" if gathered <= ALLGATHER_MAX_BYTES else "ring"


def context_parallel_attention(q, k, v, *, group=None, is_causal: bool = False, scale=None, softcap=None,
                               layout: str = "contiguous", strategy: str = "auto", return_lse: bool = False,
                               precision=None, sinks=None):
    """Attention over a sequence sharded across the ranks of ``group``: this rank's rows of
    ``safeops.attention`` on the gathered sequence (same numerics contract, within fp32 reduction order).

    Args:
        q, k, v: this rank's shards, ``(B, Hq, S_local, D)``, ``(B, Hkv, S_local, D)``,
            ``(B, Hkv, S_local, Dv)`` (``Hq % Hkv == 0``); every rank has the same shapes.
        group: the process group (default: the default group). CPU tensors need gloo, CUDA ones NCCL.
        is_causal: causal over the global positions of ``layout``.
        scale, softcap, precision: as in :func:`safeops.attention`.
        layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring; zigzag needs an even
            ``S_local``). :func:`shard_sequence` makes the shards.
        strategy: ``"auto"``, ``"ring"`` or ``"allgather"`` (see the module docstring).
        return_lse: also return the natural-log lse ``(B, Hq, S_local)`` (fp32, no gradient).
        sinks: attention sinks ``(Hq,)``, as in :func:`safeops.attention` (the same on every rank), counted
            once per row (see the module docstring); their gradient is the whole sequence's, on every rank.
    """
    _functional._check_qkv(q, k, v, 4, "(B, H, S_local, D)")
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k and v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, "
                         f"{v.shape[0]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q has {q.shape[2]} positions but k has {k.shape[2]}: context parallelism shards "
                         "one sequence, so every rank holds as many queries as keys")
    scale, softcap, _, _, code = _functional._attention_options(q, scale, softcap, None, is_causal,
                                                                return_lse, precision)
    sinks = _functional._attention_sinks(sinks, q, q.shape[1])
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"layout 'zigzag' needs an even local sequence length (two chunks), "
                         f"got {q.shape[2]}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context_parallel_attention needs torch.distributed initialized "
                           "(torch.distributed.init_process_group)")
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    if strategy == "auto":
        strategy = choose_strategy(k, v, world)
    if world == 1:
        out = _functional.attention(q, k, v, is_causal=is_causal, scale=scale, softcap=softcap,
                                    return_lse=return_lse, precision=precision, sinks=sinks)
        return out
    _check_ranks_agree(group, world, q, k, v, is_causal, scale, softcap, code, layout, strategy,
                       sinks is not None)
    cfg = _Config(group=group, world=world, rank=rank, is_causal=is_causal, scale=scale, softcap=softcap,
                  precision=code, layout=layout, strategy=strategy)
    out, lse = _ContextParallelAttention.apply(q, k, v, sinks, cfg)
    return (out, lse) if return_lse else out
