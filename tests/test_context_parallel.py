"""Context-parallel attention (``safeops.distributed``) on the gloo backend, in 2, 3 and 4 processes.

Every rank builds the same full q, k, v and output gradient from a shared seed, runs
``context_parallel_attention`` on its shard (forward and backward), and checks its shard of out, lse, dq,
dk and dv against single-process ``safeops.attention`` on the whole sequence (autograd backward), for
both layouts, causal and not, grouped-query heads, both strategies, fp32 and bf16, attention sinks (counted
once per row; their gradient against single-process attention's), plus shards whose contributions cancel
(partials must stay fp32 until the one rounding). A rank that finds a mismatch raises, which fails the
spawn. The worker loops over all cases in one spawn per world size,
because starting the processes costs more than the cases.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given
from strategies import seeds

import safeops
from safeops import distributed as cp

# Forked ranks inherit the imported torch and safeops (and Triton's interpreter setting); spawned ones
# would import them again, ~10 s per rank on a 2-core runner.
_START_METHOD = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def _cases(world: int) -> list[dict]:
    cases = []
    for layout, causal, (hq, hkv), strategy in itertools.product(
            ("contiguous", "zigzag"), (False, True), ((2, 2), (4, 2)), ("ring", "allgather")):
        cases.append(dict(layout=layout, causal=causal, hq=hq, hkv=hkv, strategy=strategy,
                          dtype=torch.float32, softcap=None))
    # bf16 and softcap, ring only.
    cases.append(dict(layout="zigzag", causal=True, hq=4, hkv=1, strategy="ring", dtype=torch.bfloat16,
                      softcap=None))
    cases.append(dict(layout="contiguous", causal=True, hq=2, hkv=2, strategy="ring", dtype=torch.float32,
                      softcap=5.0))
    # Attention sinks: every layout / strategy once, GQA, causal and not.
    for layout, causal, strategy in (("zigzag", True, "ring"), ("zigzag", True, "allgather"),
                                     ("contiguous", False, "ring"), ("contiguous", False, "allgather")):
        cases.append(dict(layout=layout, causal=causal, hq=4, hkv=2, strategy=strategy, dtype=torch.float32,
                          softcap=None, sinks=True))
    return cases


def _tolerance(dtype: torch.dtype, device: str = "cpu") -> tuple[float, float]:
    """(relative, fraction of the tensor's largest magnitude) allowed between ring and single process.

    fp32: both compute each score alike; they differ by the order of fp32 sums (the merge of W partials,
    W partial gradients), a few units of 2**-24 (on the GPU, the kernels' blocked fp32 sums over thousands of
    positions are reordered too: more). bf16: the attention op returns each partial output and gradient
    rounded to bf16 before the fp32 merge (one extra rounding per partial, ~2 ulps of bf16).
    """
    eps = torch.finfo(dtype).eps
    if dtype == torch.float32:
        return (64 * eps, 16 * eps) if device == "cpu" else (64 * eps, 256 * eps)
    return (4 * eps, 4 * eps)


def _check(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype, case, rank: int) -> None:
    rel, frac = _tolerance(dtype, actual.device.type)
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)} ({case}, rank {rank})"
    finite = torch.isfinite(e)
    same_inf = torch.equal(torch.isinf(a) & (a < 0), torch.isinf(e) & (e < 0))
    assert same_inf, f"{name}: -inf pattern differs ({case}, rank {rank})"
    assert not torch.isnan(a).any(), f"{name}: NaN ({case}, rank {rank})"
    scale = e[finite].abs().max().item() if finite.any() else 0.0
    err = torch.where(finite, (a - e).abs(), torch.zeros_like(a))
    bound = rel * e.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0) + frac * scale + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, (f"{name}: error {err.max().item():.3e} is {worst:.2f}x the bound "
                          f"(max |expected| {scale:.3e}) ({case}, rank {rank})")


def _inputs(seed: int, case: dict, world: int, s_local: int, d: int, device: str = "cpu"):
    """q, k, v, the output gradient and, for a case with sinks, (Hq,) sink logits (else None)."""
    gen = torch.Generator().manual_seed(seed)
    s = world * s_local
    shapes = [(1, case["hq"], s, d), (1, case["hkv"], s, d), (1, case["hkv"], s, d), (1, case["hq"], s, d)]
    tensors = [torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=case["dtype"])
               for shape in shapes]
    sinks = None
    if case.get("sinks"):  # a few logits of magnitude comparable to the scores, one well above them
        sinks = (2 * torch.randn(case["hq"], generator=gen, dtype=torch.float64)).float().to(device)
        sinks[0] = 4.0
    return [*tensors, sinks]


def _run_case(rank: int, world: int, case: dict, seed: int, s_local: int = 8, d: int = 16,
              device: str = "cpu") -> None:
    q, k, v, g, sinks = _inputs(seed, case, world, s_local, d, device)
    layout = case["layout"]
    options = dict(is_causal=case["causal"], softcap=case["softcap"])
    if case["dtype"] == torch.float32:
        options["precision"] = "ieee"
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    sinks_full = None if sinks is None else sinks.clone().requires_grad_(True)
    out, lse = safeops.attention(*full, return_lse=True, sinks=sinks_full, **options)
    out.backward(g)
    expected = [out, lse] + [t.grad for t in full]

    local = [cp.shard_sequence(t, rank, world, layout).requires_grad_(True) for t in (q, k, v)]
    sinks_local = None if sinks is None else sinks.clone().requires_grad_(True)
    out_l, lse_l = cp.context_parallel_attention(*local, layout=layout, strategy=case["strategy"],
                                                 return_lse=True, sinks=sinks_local, **options)
    out_l.backward(cp.shard_sequence(g, rank, world, layout))
    actual = [out_l, lse_l] + [t.grad for t in local]
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), actual, expected, strict=True):
        _check(name, a, cp.shard_sequence(e, rank, world, layout), case["dtype"], case, rank)
    if sinks is not None:  # the whole sequence's gradient, on every rank
        _check("dsinks", sinks_local.grad, sinks_full.grad, case["dtype"], case, rank)


def _huge_logits_case(rank: int, world: int, device: str = "cpu") -> None:
    """All scores of a row equal and ~4e8 (fp32 spacing 32 there): the merged output must be the mean of
    the visible values. A merge through the folded fp32 lse = m + log(l) would see every shard's lse as the
    same number and weight shards equally instead of by their key counts (contract section 3)."""
    s_local, d = 6, 16
    s = world * s_local
    q = torch.full((1, 1, s, d), 1e5, device=device)
    k = torch.full((1, 1, s, d), 1e3, device=device)
    v = torch.randn((1, 1, s, d), generator=torch.Generator().manual_seed(7), dtype=torch.float64).float()
    v = v.to(device)
    for layout, strategy in itertools.product(("contiguous", "zigzag"), ("ring", "allgather")):
        local = [cp.shard_sequence(t, rank, world, layout) for t in (q, k, v)]
        out = cp.context_parallel_attention(*local, is_causal=True, layout=layout, strategy=strategy,
                                            precision="ieee")
        counts = torch.arange(1, s + 1, dtype=torch.float64, device=device).reshape(1, 1, s, 1)
        mean = v.double().cumsum(2) / counts
        expected = cp.shard_sequence(mean, rank, world, layout)
        err = (out.double() - expected).abs().max().item()
        assert err <= 1e-5, f"huge logits, {layout}/{strategy}: error {err:.3e} (rank {rank})"


def _cancelling_case(rank: int, world: int, dtype: torch.dtype, device: str = "cpu") -> None:
    """Shards whose contributions cancel: q = 0 (every key weighs 1/S, so out = mean(v) and dv = mean(g))
    with v and g near +100 on the first half of the sequence and near -100 on the second. Each shard's
    partial is then about +-100 and the exact result is small: partials rounded to bf16 before the merge
    give 0 (error 100%); the contract's single rounding at the end gives the exact value to within one
    rounding plus fp32 accumulation error. Compared with the float64 result of the same rounded inputs."""
    s_local, d = 8, 8
    s = world * s_local
    gen = torch.Generator().manual_seed(11)
    sign = torch.where(torch.arange(s) < s // 2, 1.0, -1.0).double().view(1, 1, s, 1)
    q = torch.zeros(1, 1, s, d, dtype=torch.float64)
    k = torch.randn(1, 1, s, d, generator=gen, dtype=torch.float64)
    v = 100 * sign + 0.3 * torch.randn(1, 1, s, d, generator=gen, dtype=torch.float64)
    g = 100 * sign + 0.3 * torch.randn(1, 1, s, d, generator=gen, dtype=torch.float64)
    q, k, v, g = (t.to(device=device, dtype=dtype) for t in (q, k, v, g))
    exact_out = v.double().mean(2, keepdim=True).expand(1, 1, s, d)
    exact_dv = g.double().mean(2, keepdim=True).expand(1, 1, s, d)
    eps = torch.finfo(dtype).eps
    for layout, strategy in itertools.product(("contiguous", "zigzag"), ("ring", "allgather")):
        local = [cp.shard_sequence(t, rank, world, layout).requires_grad_(True) for t in (q, k, v)]
        out = cp.context_parallel_attention(*local, layout=layout, strategy=strategy)
        out.backward(cp.shard_sequence(g, rank, world, layout))
        for name, a, e in (("out", out, exact_out), ("dv", local[2].grad, exact_dv)):
            e = cp.shard_sequence(e, rank, world, layout)
            bound = eps * e.abs() + s * 2.0**-24 * 101 + 1e-12  # one rounding + fp32 sums of +-100 terms
            err = (a.detach().double() - e).abs()
            assert (err <= bound).all(), (f"cancelling shards, {layout}/{strategy} {dtype}: {name} error "
                                          f"{err.max().item():.3e} (exact max {e.abs().max().item():.3e}, "
                                          f"rank {rank})")


def _worker(rank: int, world: int, init_file: str, backend: str, seed: int, case_ids: list[int],
            huge: bool) -> None:
    os.environ["SAFEOPS_BACKEND"] = backend
    # One intra-op thread per rank: W ranks with a thread per core each oversubscribe a CI runner, and
    # spinning threads then make every gloo hop take tens of milliseconds.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cases = _cases(world)
        for i in case_ids:
            _run_case(rank, world, cases[i], seed + i)
        if huge:
            _huge_logits_case(rank, world)
        # bf16: partials rounded to it before the merge would lose the result entirely
        _cancelling_case(rank, world, torch.bfloat16)
    finally:
        dist.destroy_process_group()


def _spawn(world: int, backend: str, seed, case_ids: list[int], huge: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(_worker, args=(world, init_file, backend, seed.value, case_ids, huge),
                           nprocs=world, join=True, start_method=_START_METHOD)


def _mismatch_worker(rank: int, world: int, init_file: str) -> None:
    os.environ["SAFEOPS_BACKEND"] = "reference"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        s_local = 8 if rank == 0 else 6  # rank 1 holds a shorter shard: the ring's transfers would mismatch
        q = torch.randn(1, 2, s_local, 8)
        with pytest.raises(ValueError, match="every rank of the group must pass the same shard shapes"):
            cp.context_parallel_attention(q, q, q, strategy="ring")
        # Options must agree too.
        q = torch.randn(1, 2, 8, 8)
        with pytest.raises(ValueError, match="every rank of the group"):
            cp.context_parallel_attention(q, q, q, is_causal=rank == 0, strategy="ring")
    finally:
        dist.destroy_process_group()


def test_ranks_that_disagree_raise_everywhere():
    """Shards or options that differ between ranks raise the same ValueError on every rank (one small
    all-gather compares them) instead of mismatched transfers or a hang."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_mismatch_worker, args=(2, os.path.join(tmp, "rendezvous")), nprocs=2, join=True,
                           start_method=_START_METHOD)


@pytest.mark.parametrize("world", [2, 3, 4])
@given(seed=seeds())
def test_matches_single_process_reference(world, seed):
    """Reference backend: every case of ``_cases``, forward and backward, plus the huge-logit case."""
    _spawn(world, "reference", seed, list(range(len(_cases(world)))), huge=True)


@pytest.mark.interpret
@given(seed=seeds())
def test_matches_single_process_triton_interpreted(seed, triton_backend):
    """The Triton attention kernels (interpreted) behind the ring and the all-gather, 2 ranks: causal GQA
    zigzag (sliced shards), both strategies; fp32 here, bf16 in the cancelling case every worker runs."""
    cases = _cases(2)
    picks = [i for i, c in enumerate(cases) if c["causal"] and c["layout"] == "zigzag" and c["hq"] == 4
             and c["dtype"] == torch.float32 and not c.get("sinks")]
    assert len(picks) == 2
    # Sinks: the ring (partials without them, the sink merged once) and the all-gather (one call per row).
    picks += [i for i, c in enumerate(cases) if c.get("sinks") and c["causal"]]
    assert len(picks) == 4
    _spawn(2, "triton", seed, picks, huge=False)


# --------------------------------------------------------------------------------------------------
# No processes needed
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@given(seed=seeds())
def test_shard_roundtrip(layout, world, seed):
    x = seed.randn(2, 3, 4 * world, 5)
    shards = [cp.shard_sequence(x, r, world, layout) for r in range(world)]
    assert torch.equal(cp.unshard_sequence(shards, layout), x)
    if layout == "zigzag":
        chunk = 2
        first = shards[0]
        assert torch.equal(first[:, :, :chunk], x[:, :, :chunk])
        assert torch.equal(first[:, :, chunk:], x[:, :, -chunk:])


def test_auto_strategy_rule():
    k = torch.empty(1, 2, 1024, 64, dtype=torch.bfloat16)
    small = 2 * 2 * k.numel() * k.element_size()
    assert small <= cp.ALLGATHER_MAX_BYTES
    assert cp.choose_strategy(k, k, 2) == "allgather"
    big = torch.empty(1, 8, 1 << 16, 128, dtype=torch.bfloat16)
    assert cp.choose_strategy(big, big, 2) == "ring"


def test_bad_input():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(TypeError, match="q must be"):
        cp.context_parallel_attention(q.numpy(), q, q)
    with pytest.raises(ValueError, match="positions"):
        cp.context_parallel_attention(q, q[:, :, :4], q[:, :, :4])
    with pytest.raises(ValueError, match="layout"):
        cp.context_parallel_attention(q, q, q, layout="striped")
    with pytest.raises(ValueError, match="even"):
        cp.context_parallel_attention(q[:, :, :7], q[:, :, :7], q[:, :, :7], layout="zigzag")
    with pytest.raises(ValueError, match="strategy"):
        cp.context_parallel_attention(q, q, q, strategy="tree")
    with pytest.raises(TypeError, match="is_causal"):
        cp.context_parallel_attention(q, q, q, is_causal=1)
    with pytest.raises(ValueError, match="multiple"):
        cp.shard_sequence(q, 0, 3, "zigzag")
    with pytest.raises(ValueError, match="sinks must have shape"):
        cp.context_parallel_attention(q, q, q, sinks=torch.zeros(3))
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            cp.context_parallel_attention(q, q, q)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@given(seed=seeds())
def test_single_rank_group_is_plain_attention(seed, tmp_path):
    """A group of one: the call is safeops.attention itself (bit for bit)."""
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        q, k, v = seed.randn(1, 2, 8, 16), seed.randn(1, 1, 8, 16), seed.randn(1, 1, 8, 16)
        out = cp.context_parallel_attention(q, k, v, is_causal=True, layout="zigzag")
        assert torch.equal(out, safeops.attention(q, k, v, is_causal=True))
    finally:
        dist.destroy_process_group()
    assert math.isfinite(float(out.abs().max()))
