"""DTensor inputs to the softmax family, attention and merge_attention, on two CPU processes over gloo.

One spawn of two processes (a 1-D ``DeviceMesh("cpu", [0, 1])``) runs every check; each check is then
reported as its own test. For every supported sharding a check compares, on each rank, the local shard of
the DTensor result and of the gradients (which must keep the inputs' placements) with the same piece of
``safeops`` run on the whole plain tensor: bit for bit on the Triton kernels (interpreted here), since each
supported sharding only splits independent rows and the kernels are batch-invariant (contract section 6);
within a few fp32 roundings on the plain-torch reference, whose CPU kernels are not batch-invariant. (The
whole-tensor results are checked against the float64 oracle in the other test files.) ``CommDebugMode``
proves that forward and backward issued no collective. Unsupported shardings must raise the ValueError
naming the argument; ``torch.compile(fullgraph=True)`` must give the eager results.

The checks build DTensors with ``DTensor.from_local`` from the whole tensor every rank generates from the
same seed, so nothing but the code under test communicates and a failing rank cannot leave the other one
waiting in a collective. The seed is 0 under the ci Hypothesis profile and fresh under the deep one (the
checks run in one spawn, so Hypothesis cannot draw it per check); ``SAFEOPS_TEST_SEED=<int>`` replays a
failure's inputs.
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import time
import traceback
import zlib
from datetime import timedelta

import pytest
import strategies
import torch
import torch.distributed as dist

import safeops
from safeops import _config

WORLD = 2
SEED_ENV = "SAFEOPS_TEST_SEED"
NEG_INF = float("-inf")

# name -> (check function, SAFEOPS_BACKEND to run it under)
CHECKS: dict[str, tuple] = {}


def _register(name: str, fn, backend: str = "reference") -> None:
    if name in CHECKS:
        raise AssertionError(f"duplicate check {name}")
    CHECKS[name] = (fn, backend)


# --------------------------------------------------------------------------------------------------
# Shared machinery (tests/test_dtensor_gpu.py uses it too)
# --------------------------------------------------------------------------------------------------


class Env:
    """What a check sees on its rank: the mesh, the device, a generator seeded identically on every rank."""

    def __init__(self, rank: int, mesh, device: str, seed: int):
        self.rank, self.mesh, self.device, self.seed = rank, mesh, device, seed
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, dtype=torch.float32, std: float = 1.0) -> torch.Tensor:
        t = torch.randn(shape, generator=self.gen, dtype=torch.float64) * std
        return t.to(dtype).to(self.device)

    def mask(self, *shape: int, keep: float = 0.7) -> torch.Tensor:
        return (torch.rand(shape, generator=self.gen, dtype=torch.float64) < keep).to(self.device)


def placements(code: str) -> list:
    """"S0" -> [Shard(0)], "R" -> [Replicate()], "P" -> [Partial()]; "R,S1" -> [Replicate(), Shard(1)] for a
    2-D mesh (one entry per mesh dimension)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    named = {"R": Replicate(), "P": Partial()}
    return [named[c] if c in named else Shard(int(c[1:])) for c in code.split(",")]


def chunk(full: torch.Tensor, mesh, places) -> torch.Tensor:
    """This rank's piece of ``full`` under ``places``: torch.chunk's split (ceil(n / k) per rank, the last
    ones shorter or empty), which is how DTensor shards."""
    from torch.distributed.tensor import Shard

    coordinate = mesh.get_coordinate()
    for i, p in enumerate(places):
        if isinstance(p, Shard):
            n, k, c = full.shape[p.dim], mesh.size(i), coordinate[i]
            size = -(-n // k)
            start = min(c * size, n)
            full = full.narrow(p.dim, start, max(0, min(size, n - start)))
    return full


def shard(env: Env, full: torch.Tensor, places, *, requires_grad: bool = False):
    """A DTensor whose global value is ``full`` (held whole by every rank), built without communication."""
    from torch.distributed.tensor import DTensor

    local = chunk(full, env.mesh, places).detach().clone()
    if places[0].is_partial():
        local = full.detach().clone() if env.rank == 0 else torch.zeros_like(full)
    d = DTensor.from_local(local, env.mesh, places, run_check=False, shape=full.shape, stride=full.stride())
    return d.requires_grad_() if requires_grad else d


def assert_shard(actual, expected: torch.Tensor, env: Env, places, what: str) -> None:
    """``actual`` (a DTensor) has ``places`` and its local shard equals ``expected``'s piece: bit for bit on
    the Triton kernels (batch-invariant, contract section 6); within a few fp32 roundings on the
    reference, which is plain torch, whose CPU reductions and vectorized exp / log are not batch-invariant
    (a reduction over a non-innermost dim is tiled by the row count)."""
    assert tuple(actual.placements) == tuple(places), (
        f"{what}: placements {actual.placements}, expected {tuple(places)} (check seed {env.seed})")
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: global shape {tuple(actual.shape)}"
    local, piece = actual.to_local(), chunk(expected, env.mesh, places)
    assert local.dtype == piece.dtype, f"{what}: dtype {local.dtype}, expected {piece.dtype}"
    if not torch.equal(local, piece):
        if not _config.use_triton(local):
            eps = torch.finfo(local.dtype).eps
            finite = piece[piece.isfinite()].abs()
            size = max(1.0, finite.max().item()) if finite.numel() else 1.0
            torch.testing.assert_close(local, piece, rtol=4 * eps, atol=8 * eps * size, equal_nan=True,
                                       msg=lambda m: f"{what}, rank {env.rank} (check seed {env.seed}): {m}")
            return
        same = (local == piece) | (local.isnan() & piece.isnan())  # NaN at the same places is the same
        if bool(same.all()):
            return
        diff = (local.double() - piece.double()).abs().masked_fill(same, 0).max().item()
        raise AssertionError(f"{what}: local shard differs from the whole-tensor result on rank {env.rank}, "
                             f"max |diff| = {diff} (check seed {env.seed})")


def comm_counter():
    from torch.distributed.tensor.debug import CommDebugMode

    return CommDebugMode()


def assert_raises(exc_type, match: str, fn) -> str:
    try:
        fn()
    except exc_type as e:
        assert match in str(e), f"error message {str(e)!r} lacks {match!r}"
        return str(e)
    raise AssertionError(f"expected {exc_type.__name__} containing {match!r}, nothing was raised")


def run_checks(rank: int, world: int, store: str, seed: int, out_dir: str, device_type: str, pg_backend: str,
               module: str, names: list[str]) -> None:
    """The body of each spawned process: run the named checks of ``module``, write ``rank<N>.json``."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(pg_backend, rank=rank, world_size=world, init_method=f"file://{store}",
                            timeout=timedelta(seconds=60))
    results: dict[str, str | None] = {}
    try:
        device = device_type
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        mesh = init_device_mesh(device_type, (world,))
        checks = importlib.import_module(module).CHECKS
        for name in names:
            fn, backend = checks[name]
            os.environ["SAFEOPS_BACKEND"] = backend
            start = time.perf_counter()
            try:
                fn(Env(rank, mesh, device, seed + zlib.crc32(name.encode())))
                results[name] = None
            except Exception:
                results[name] = traceback.format_exc()
            results[name + ":seconds"] = f"{time.perf_counter() - start:.2f}"
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def deep_seed() -> int:
    """The checks' seed: one for the whole spawn (Hypothesis cannot draw it per check across processes),
    fixed under the ci profile (every run the same inputs), fresh under the deep one (tests/conftest.py)."""
    return 0 if strategies.profile() == "ci" else secrets.randbits(31)


def spawn_checks(tmp_dir, device_type: str, pg_backend: str, module: str, names: list[str],
                 timeout: float = 300.0) -> tuple[int, dict[str, list[str]]]:
    """Runs ``names`` in ``WORLD`` spawned processes; returns the seed and, per check, each rank's failure."""
    import torch.multiprocessing as mp

    seed = int(os.environ[SEED_ENV]) if SEED_ENV in os.environ else deep_seed()
    out_dir = str(tmp_dir)
    store = os.path.join(out_dir, "store")
    # The children decide TRITON_INTERPRET themselves when they import safeops, as a user's process does
    # (the "import_state" check looks at the result).
    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        ctx = mp.start_processes(run_checks, args=(WORLD, store, seed, out_dir, device_type, pg_backend,
                                                   module, names), nprocs=WORLD, join=False,
                                 start_method="spawn")
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise AssertionError(f"the {WORLD} processes did not finish in {timeout} s (seed={seed})")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    failures: dict[str, list[str]] = {name: [] for name in names}
    for rank in range(WORLD):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            results = json.load(f)
        for name in names:
            if name not in results:
                failures[name].append(f"rank {rank}: did not run")
            elif results[name] is not None:
                failures[name].append(f"rank {rank}:\n{results[name]}")
    return seed, failures


# --------------------------------------------------------------------------------------------------
# softmax, log_softmax, logsumexp
# --------------------------------------------------------------------------------------------------


def _import_state(env: Env) -> None:
    """Runs first in a fresh process: ``import safeops`` did not import triton before safeops._config chose
    the interpreter (safeops.dtensor is imported early and must not pull in torch._dynamo)."""
    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", (
        "TRITON_INTERPRET is not 1 in a process without a GPU: something imported triton before safeops")


_register("import_state", _import_state)


def _compiled(env: Env) -> None:
    """``torch.compile(fullgraph=True)`` of code calling safeops on DTensors, as the process's first DTensor
    call: one graph (so the sharding rules were registered before tracing), the eager results, forward and
    backward."""
    from torch.distributed.tensor import Replicate, Shard

    # Even shards: with uneven ones the two ranks' compiled graphs differ only in local sizes, and Inductor's
    # on-disk cache (shared by both processes) was seen handing rank 1 the graph compiled for rank 0.
    x, q, mask = env.randn(6, 12, std=3.0), env.randn(2, 4, 6, 8), env.mask(1, 1, 6, 6)
    places = [Shard(0)]
    whole_x, whole_q = x.clone().requires_grad_(), q.clone().requires_grad_()
    (safeops.log_softmax(whole_x, -1).exp() * 2).sum().backward()
    safeops.attention(whole_q, whole_q, whole_q, attn_mask=mask).sum().backward()
    xd, qd = shard(env, x, places, requires_grad=True), shard(env, q, [Shard(1)], requires_grad=True)
    md = shard(env, mask, [Replicate()])
    try:
        y = torch.compile(lambda t: safeops.log_softmax(t, -1).exp() * 2, fullgraph=True)(xd)
        o = torch.compile(lambda t, m: safeops.attention(t, t, t, attn_mask=m), fullgraph=True)(qd, md)
        y.sum().backward()
        o.sum().backward()
    finally:
        torch._dynamo.reset()
    assert_shard(y, (safeops.log_softmax(x, -1).exp() * 2), env, places, "compiled log_softmax")
    assert_shard(xd.grad, whole_x.grad, env, places, "compiled log_softmax grad")
    assert_shard(o, safeops.attention(q, q, q, attn_mask=mask), env, [Shard(1)], "compiled attention")
    assert_shard(qd.grad, whole_q.grad, env, [Shard(1)], "compiled attention grad")


_register("compiled_fullgraph", _compiled)


def _rows_check(op: str, shape, dim: int, code: str, mask_kind: str | None, scale_kind: str | None,
                keepdim: bool = False, dtype=torch.float32):
    """``op`` on ``x`` placed by ``code`` against the whole tensor; ``mask_kind``: None, "like" (a full mask
    placed like x, one row entirely False) or "bcast" (a broadcast mask, replicated); ``scale_kind``:
    None, "float", "plain" (a plain 0-d tensor: its gradient arrives all-reduced) or "dtensor" (a replicated
    DTensor: its gradient arrives Partial)."""

    def check(env: Env) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        fn = getattr(safeops, op)
        places = placements(code)
        x = env.randn(*shape, dtype=dtype, std=3.0)
        mask, mask_places = None, None
        if mask_kind == "like":
            mask, mask_places = env.mask(*shape), places
            index = [0] * len(shape)
            index[dim] = slice(None)
            mask[tuple(index)] = False  # an empty row: output 0 / -inf, zero gradient (contract section 4)
        elif mask_kind == "bcast":
            mask_shape = [1] * len(shape)
            mask_shape[dim] = shape[dim]
            mask, mask_places = env.mask(*mask_shape), [Replicate()] * env.mesh.ndim
        s = 0.75 + 0.5 * float(torch.rand((), generator=env.gen))
        kw = {"keepdim": keepdim} if op == "logsumexp" else {}

        x_whole = x.clone().requires_grad_()
        scale_whole = torch.tensor(s, device=env.device, requires_grad=True) if scale_kind in (
            "plain", "dtensor") else (s if scale_kind == "float" else None)
        out_whole = fn(x_whole, dim, scale=scale_whole, mask=mask, **kw)
        grad = env.randn(*out_whole.shape, dtype=out_whole.dtype)
        out_whole.backward(grad)

        xd = shard(env, x, places, requires_grad=True)
        md = None if mask is None else shard(env, mask, mask_places)
        if scale_kind == "plain":
            sd = torch.tensor(s, device=env.device, requires_grad=True)
        elif scale_kind == "dtensor":
            sd = DTensor.from_local(torch.tensor(s, device=env.device), env.mesh,
                                    [Replicate()] * env.mesh.ndim, run_check=False).requires_grad_()
        else:
            sd = scale_whole
        with comm_counter() as comm:
            out = fn(xd, dim, scale=sd, mask=md, **kw)
            out.backward(shard(env, grad, out.placements))
        # Only a plain scale tensor's gradient is all-reduced (from_local's backward); nothing else talks.
        counts = {str(k): v for k, v in comm.get_comm_counts().items()}
        assert comm.get_total_counts() == (1 if scale_kind == "plain" else 0), f"collectives: {counts}"

        assert_shard(out, out_whole.detach(), env, out.placements, f"{op} output")
        expected = places
        if op == "logsumexp" and not keepdim:
            expected = [type(p)(p.dim if p.dim < dim % len(shape) else p.dim - 1) if p.is_shard() else p
                        for p in places]
        assert tuple(out.placements) == tuple(expected), f"output placements {out.placements}"
        assert_shard(xd.grad, x_whole.grad, env, places, f"{op} grad x")
        if scale_kind in ("plain", "dtensor"):
            # The scale gradient sums terms c_i = x_i * d(g . out)/dz_i over every element, in another order
            # when each rank sums its own rows: allow fp32 summation error on a bound of sum |c_i| (softmax:
            # c_i = x_i p_i (g_i - <g, p>); log_softmax: x_i (g_i - p_i sum g); logsumexp: x_i p_i g_row).
            x_max, g_abs = x.abs().max().item(), grad.double().abs()
            rows = grad.numel() // (1 if op == "logsumexp" else shape[dim])
            row_sums = grad.double().sum(dim).abs().sum().item() if op == "log_softmax" else 0.0
            terms = {"softmax": 2 * g_abs.max().item() * rows, "log_softmax": g_abs.sum().item() + row_sums,
                     "logsumexp": g_abs.sum().item()}[op] * x_max
            atol = 4 * torch.finfo(torch.float32).eps * terms
            if scale_kind == "dtensor":
                assert all(p.is_partial() for p in sd.grad.placements) or code == "R", sd.grad.placements
            got = sd.grad if scale_kind == "plain" else sd.grad.full_tensor()
            torch.testing.assert_close(got, scale_whole.grad, rtol=0, atol=atol)

    return check


ROW_CASES = [
    # op, shape, dim, placement, mask, scale, keepdim
    ("softmax", (5, 6, 8), -1, "S0", None, None, False),  # 5 rows over 2 ranks: uneven shards
    ("softmax", (5, 6, 8), 2, "S1", "like", "float", False),
    ("softmax", (4, 6, 8), 0, "S2", "bcast", "plain", False),
    ("softmax", (3, 7), -1, "R", "like", None, False),
    ("log_softmax", (5, 6, 8), -1, "S1", "like", "dtensor", False),
    ("log_softmax", (5, 6, 8), 1, "S0", "bcast", None, False),
    ("log_softmax", (6, 9), 0, "S1", None, "float", False),
    ("logsumexp", (5, 6, 8), -1, "S0", "like", None, False),
    ("logsumexp", (5, 6, 8), 0, "S2", None, "plain", True),
    ("logsumexp", (5, 6, 8), 1, "S2", "bcast", None, False),
]
for _op, _shape, _dim, _code, _mask, _scale, _keep in ROW_CASES:
    _register(f"{_op}_{_code}_dim{_dim}_mask-{_mask}_scale-{_scale}" + ("_keepdim" if _keep else ""),
              _rows_check(_op, _shape, _dim, _code, _mask, _scale, _keep))
_register("softmax_S0_triton", _rows_check("softmax", (3, 4, 40), -1, "S0", "like", "float"), "triton")
_register("log_softmax_S1_bf16_triton",
          _rows_check("log_softmax", (3, 4, 40), -1, "S1", None, None, dtype=torch.bfloat16), "triton")


def _rows_errors(env: Env) -> None:
    from torch.distributed.tensor import Replicate, Shard

    x = env.randn(4, 6, 8)
    for op in ("softmax", "log_softmax", "logsumexp"):
        fn = getattr(safeops, op)
        for dim in (-1, 0):
            bad = shard(env, x, [Shard(dim % 3)])
            with comm_counter() as comm:
                msg = assert_raises(ValueError, f"x is sharded on dim {dim % 3}",
                                    lambda fn=fn, bad=bad, dim=dim: fn(bad, dim))
            assert "redistribute" in msg and comm.get_total_counts() == 0, msg
        partial = shard(env, x, placements("P"))
        assert_raises(ValueError, "x has a Partial placement", lambda fn=fn, partial=partial: fn(partial, -1))
    good = shard(env, x, [Shard(0)])
    mask = env.mask(4, 6, 8)
    assert_raises(ValueError, "mask is placed",
                  lambda: safeops.softmax(good, mask=shard(env, mask, [Shard(1)])))
    assert_raises(ValueError, "mask is a plain torch.Tensor", lambda: safeops.softmax(good, mask=mask))
    assert_raises(ValueError, "x is a plain torch.Tensor",
                  lambda: safeops.log_softmax(x, mask=shard(env, mask, [Replicate()])))
    assert_raises(ValueError, "x has size 1 on dim 0, sharded into 2 pieces",
                  lambda: safeops.logsumexp(shard(env, env.randn(1, 8), [Shard(0)])))
    partial_scale = shard(env, torch.tensor(0.5, device=env.device), placements("P"))
    assert_raises(ValueError, "scale must be a replicated DTensor",
                  lambda: safeops.softmax(good, scale=partial_scale))


_register("softmax_family_errors", _rows_errors)


def _direct_op_error(env: Env) -> None:
    """The registered op on its own (no public function in front) refuses too, rather than gathering."""
    from torch.distributed.tensor import Shard

    safeops.dtensor.register()
    bad = shard(env, env.randn(4, 6), [Shard(1)])
    with comm_counter() as comm:
        assert_raises(RuntimeError, "the dimension safeops.softmax reduces over",
                      lambda: torch.ops.safeops.softmax(bad, 1, None, None, None, None))
    assert comm.get_total_counts() == 0
    good = shard(env, env.randn(4, 6), [Shard(0)])
    out, row_max, row_sum = torch.ops.safeops.log_softmax(good, 1, 0.5, None, None, None)
    assert [tuple(t.placements) for t in (out, row_max, row_sum)] == [(Shard(0),)] * 3


_register("direct_op_call", _direct_op_error)


# --------------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------------


def _attention_check(code: str, b: int, hq: int, hkv: int, sq: int, sk: int, d: int, dv: int, options: dict,
                     mask_kind: str | None, dtype=torch.float32):
    """Attention on q, k, v placed by ``code``, with ``mask_kind``: None, "bool_like" (a full bool mask
    placed like q, one query row with no key), "bool_bcast" ((B, 1, Sq, Sk), replicated), "bool_bcast_sharded"
    ((B, 1, Sq, Sk) placed like q's batch) or "float_bcast" (an additive (Sq, Sk) mask with -inf,
    replicated)."""

    def check(env: Env) -> None:
        from torch.distributed.tensor import Replicate

        places = placements(code)
        q, k, v = env.randn(b, hq, sq, d, dtype=dtype), env.randn(b, hkv, sk, d, dtype=dtype), \
            env.randn(b, hkv, sk, dv, dtype=dtype)
        mask, mask_places = None, None
        if mask_kind == "bool_like":
            mask, mask_places = env.mask(b, hq, sq, sk), places
            mask[0, 0, 1] = False
        elif mask_kind in ("bool_bcast", "bool_bcast_sharded"):
            mask = env.mask(b, 1, sq, sk)
            mask[-1, 0, 0] = False
            mask_places = places if mask_kind == "bool_bcast_sharded" else [Replicate()] * env.mesh.ndim
        elif mask_kind == "float_bcast":
            mask = env.randn(sq, sk, std=2.0).masked_fill(env.mask(sq, sk, keep=0.6).logical_not(), NEG_INF)
            mask[1] = NEG_INF
            mask_places = [Replicate()] * env.mesh.ndim
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        out_whole, lse_whole = safeops.attention(*whole, attn_mask=mask, return_lse=True, **options)
        grad = env.randn(*out_whole.shape, dtype=dtype)
        out_whole.backward(grad)

        qd, kd, vd = (shard(env, t, places, requires_grad=True) for t in (q, k, v))
        md = None if mask is None else shard(env, mask, mask_places)
        with comm_counter() as comm:
            out, lse = safeops.attention(qd, kd, vd, attn_mask=md, return_lse=True, **options)
            out.backward(shard(env, grad, places))
        assert comm.get_total_counts() == 0, f"collectives: {comm.get_comm_counts()}"
        assert_shard(out, out_whole.detach(), env, places, "attention output")
        assert_shard(lse, lse_whole, env, places, "attention lse")
        for name, t, w in zip(("q", "k", "v"), (qd, kd, vd), whole, strict=True):
            assert_shard(t.grad, w.grad, env, places, f"attention grad {name}")

    return check


ATTENTION_CASES = [
    # name, placement, B, Hq, Hkv, Sq, Sk, D, Dv, options, mask
    ("batch_gqa_causal", "S0", 3, 4, 2, 5, 6, 8, 8, {"is_causal": True}, None),
    ("batch_bool_mask_sharded", "S0", 3, 2, 2, 4, 5, 8, 8, {}, "bool_bcast_sharded"),
    ("batch_additive_mask", "S0", 3, 2, 1, 4, 5, 8, 8, {"softcap": 4.0}, "float_bcast"),
    ("heads_gqa_bool_mask", "S1", 2, 4, 2, 5, 6, 8, 8, {}, "bool_bcast"),
    ("heads_gqa_full_mask_window", "S1", 2, 8, 2, 6, 6, 8, 8, {"window": (2, 1)}, "bool_like"),
    ("heads_mha_uneven", "S1", 2, 3, 3, 4, 4, 8, 16, {"is_causal": True, "scale": 0.3}, None),
    ("replicated", "R", 2, 2, 1, 3, 4, 8, 8, {"is_causal": True}, "bool_like"),
]
for _name, _code, *_args in ATTENTION_CASES:
    _register(f"attention_{_name}", _attention_check(_code, *_args))
_register("attention_heads_gqa_triton",
          _attention_check("S1", 2, 4, 2, 16, 16, 16, 16, {"is_causal": True}, "bool_bcast"), "triton")


def _attention_sinks_check(code: str, sinks_code: str):
    """Attention with sinks, q / k / v placed by ``code`` (GQA, causal), the sinks a DTensor placed by
    ``sinks_code`` requiring grad: out, lse, dq, dk, dv as the whole tensor's. The sinks' gradient: with the
    heads sharded, each rank's heads (``Shard(0)``); with the batch sharded, ``Partial`` (each rank's rows),
    whose sum is the whole tensor's gradient. Nothing communicates in forward and backward."""

    def check(env: Env) -> None:
        places, sink_places = placements(code), placements(sinks_code)
        q, k, v = env.randn(4, 4, 5, 8), env.randn(4, 2, 6, 8), env.randn(4, 2, 6, 8)
        sinks = env.randn(4, std=2.0)
        whole = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out_whole, lse_whole = safeops.attention(*whole[:3], sinks=whole[3], is_causal=True, return_lse=True)
        grad = env.randn(*out_whole.shape)
        out_whole.backward(grad)
        qd, kd, vd = (shard(env, t, places, requires_grad=True) for t in (q, k, v))
        sd = shard(env, sinks, sink_places, requires_grad=True)
        with comm_counter() as comm:
            out, lse = safeops.attention(qd, kd, vd, sinks=sd, is_causal=True, return_lse=True)
            out.backward(shard(env, grad, places))
        assert comm.get_total_counts() == 0, f"collectives: {comm.get_comm_counts()}"
        assert_shard(out, out_whole.detach(), env, places, "attention output")
        assert_shard(lse, lse_whole, env, places, "attention lse")
        for name, t, w in zip(("q", "k", "v"), (qd, kd, vd), whole[:3], strict=True):
            assert_shard(t.grad, w.grad, env, places, f"attention grad {name}")
        if code == "S0":
            assert tuple(sd.grad.placements) == tuple(placements("P")), sd.grad.placements
            torch.testing.assert_close(sd.grad.full_tensor(), whole[3].grad, rtol=1e-5, atol=1e-6)
        else:
            assert_shard(sd.grad, whole[3].grad, env, sink_places, "attention grad sinks")

    return check


_register("attention_sinks_batch", _attention_sinks_check("S0", "R"))
_register("attention_sinks_heads", _attention_sinks_check("S1", "S0"))
_register("attention_sinks_heads_triton", _attention_sinks_check("S1", "S0"), "triton")


def _merge_sinks(env: Env) -> None:
    """merge_attention with sinks, the partials' heads sharded and the sinks Shard(0): the local merge of
    each rank's heads, forward and backward, no communication."""
    from torch.distributed.tensor import Shard

    outs, lses, sinks = env.randn(2, 2, 4, 5, 8), env.randn(2, 2, 4, 5), env.randn(4, std=2.0)
    whole = [t.clone().requires_grad_() for t in (outs, lses, sinks)]
    out_whole, lse_whole = safeops.merge_attention(whole[0], whole[1], sinks=whole[2])
    g, g_lse = env.randn(*out_whole.shape), env.randn(*lse_whole.shape)
    torch.autograd.backward((out_whole, lse_whole), (g, g_lse))
    od = shard(env, outs, [Shard(2)], requires_grad=True)
    ld = shard(env, lses, [Shard(2)], requires_grad=True)
    sd = shard(env, sinks, [Shard(0)], requires_grad=True)
    with comm_counter() as comm:
        out, lse = safeops.merge_attention(od, ld, sinks=sd)
        torch.autograd.backward((out, lse), (shard(env, g, [Shard(1)]), shard(env, g_lse, [Shard(1)])))
    assert comm.get_total_counts() == 0, f"collectives: {comm.get_comm_counts()}"
    assert_shard(out, out_whole.detach(), env, [Shard(1)], "merge out")
    assert_shard(lse, lse_whole.detach(), env, [Shard(1)], "merge lse")
    for name, t, w, p in (("outs", od, whole[0], [Shard(2)]), ("lses", ld, whole[1], [Shard(2)]),
                          ("sinks", sd, whole[2], [Shard(0)])):
        assert_shard(t.grad, w.grad, env, p, f"merge grad {name}")


_register("merge_sinks_heads", _merge_sinks)


def _two_dim_meshes(env: Env) -> None:
    """The same checks on 2-D meshes of the two ranks, (1, 2) and (2, 1): placements per mesh dimension."""
    from torch.distributed.device_mesh import init_device_mesh

    for shape, rows, dims, heads in (((1, 2), "S0,S1", (-1, 2), "S0,S1"), ((2, 1), "S2,R", (0, 1), "S1,S0")):
        mesh = init_device_mesh(env.device.split(":")[0], shape)
        sub = Env(env.rank, mesh, env.device, env.seed + shape[0])
        _rows_check("log_softmax", (4, 6, 8), dims[0], rows, "like", "float")(sub)
        _rows_check("logsumexp", (4, 6, 8), dims[1], rows, "bcast", None)(sub)
        _attention_check(heads, 2, 4, 2, 5, 6, 8, 8, {"is_causal": True}, "bool_bcast")(sub)
        _merge_check(heads.replace("S1", "S2"), (3, 2, 5, 8), 2, "list")(sub)


_register("two_dim_meshes", _two_dim_meshes)


def _attention_errors(env: Env) -> None:
    from torch.distributed.tensor import Replicate, Shard

    q, k, v = env.randn(2, 6, 4, 8), env.randn(2, 3, 4, 8), env.randn(2, 3, 4, 8)

    def run(qp, kp=None, vp=None, mask=None, **kw):
        return safeops.attention(shard(env, q, qp), shard(env, k, kp or qp), shard(env, v, vp or qp),
                                 attn_mask=mask, **kw)

    with comm_counter() as comm:
        msg = assert_raises(ValueError, "q has placement", lambda: run([Shard(2)]))
        assert "sequence" in msg, msg
        assert_raises(ValueError, "k is placed", lambda: run([Shard(0)], kp=[Replicate()]))
        assert_raises(ValueError, "v is placed", lambda: run([Shard(0)], vp=[Shard(1)]))
        # 6 q heads in groups of 2 over 3 kv heads: 2 ranks cannot split the kv heads evenly
        assert_raises(ValueError, "Hkv divisible by 2", lambda: run([Shard(1)]))
        partial = placements("P")
        assert_raises(ValueError, "q has a Partial placement", lambda: run(partial, kp=partial, vp=partial))
        mask = env.mask(2, 1, 4, 4)
        assert_raises(ValueError, "attn_mask is a plain torch.Tensor", lambda: run([Shard(0)], mask=mask))
        assert_raises(ValueError, "attn_mask is placed",
                      lambda: run([Shard(0)], mask=shard(env, env.mask(1, 1, 4, 4), [Shard(2)])))
        one_head = env.randn(2, 1, 4, 8)
        assert_raises(ValueError, "q has size 1 on dim 1", lambda: safeops.attention(
            *(shard(env, one_head, [Shard(1)]) for _ in range(3))))
        assert_raises(ValueError, "k is a plain torch.Tensor",
                      lambda: safeops.attention(shard(env, q, [Shard(0)]), k, v))
        sinks = shard(env, env.randn(6), [Shard(0)])  # sharded though q's heads are not
        assert_raises(ValueError, "sinks is placed (S(0))", lambda: run([Shard(0)], sinks=sinks))
    assert comm.get_total_counts() == 0
    cu = torch.tensor([0, 4], dtype=torch.int32, device=env.device)
    packed = shard(env, env.randn(4, 2, 8), [Shard(1)])
    assert_raises(ValueError, "attention_varlen does not take DTensors",
                  lambda: safeops.attention_varlen(packed, packed, packed, cu, cu))


_register("attention_errors", _attention_errors)


# --------------------------------------------------------------------------------------------------
# merge_attention
# --------------------------------------------------------------------------------------------------


def _backward(out, lse, g_out, g_lse, grads: str) -> None:
    used = {"both": ((out, g_out), (lse, g_lse)), "out": ((out, g_out),), "lse": ((lse, g_lse),)}[grads]
    torch.autograd.backward([t for t, _ in used], [g for _, g in used])


def _merge_check(code: str, shape, p: int, form: str, grads: str = "both", dtype=torch.float32):
    """merge_attention of ``p`` partials ``shape`` = (..., Sq, D) (lses (..., Sq)) placed by ``code`` (in the
    partials' dims), passed as lists (``form`` "list") or as stacks (``form`` "stacked", placed one dim
    further), against the whole tensors, forward and backward. Partial 0 is empty for query 1 and every
    partial for query 2 (an all-empty row). ``grads``: "both" (out and lse used downstream), "out" (the
    backward gets no lse gradient) or "lse" (no output gradient)."""

    def check(env: Env) -> None:
        from torch.distributed.tensor import Shard

        places = placements(code)
        outs = [env.randn(*shape, dtype=dtype) for _ in range(p)]
        lses = [env.randn(*shape[:-1], std=3.0) for _ in range(p)]
        lses[0][..., 1] = NEG_INF
        for lse in lses:
            lse[..., 2] = NEG_INF
        whole = [t.clone().requires_grad_() for t in outs + lses]
        out_whole, lse_whole = safeops.merge_attention(whole[:p], whole[p:])
        g_out, g_lse = env.randn(*out_whole.shape, dtype=dtype), env.randn(*lse_whole.shape)
        _backward(out_whole, lse_whole, g_out, g_lse, grads)

        if form == "stacked":
            stack_places = [Shard(q.dim + 1) if q.is_shard() else q for q in places]
            args = [shard(env, torch.stack(t), stack_places, requires_grad=True) for t in (outs, lses)]
            leaves = args
        else:
            args = [[shard(env, t, places, requires_grad=True) for t in ts] for ts in (outs, lses)]
            leaves = args[0] + args[1]
        with comm_counter() as comm:
            out, lse = safeops.merge_attention(*args)
            _backward(out, lse, shard(env, g_out, places), shard(env, g_lse, places), grads)
        assert comm.get_total_counts() == 0, f"collectives: {comm.get_comm_counts()}"
        assert_shard(out, out_whole.detach(), env, places, "merged out")
        assert_shard(lse, lse_whole.detach(), env, places, "merged lse")
        if form == "stacked":
            expected = [torch.stack([w.grad for w in whole[:p]]), torch.stack([w.grad for w in whole[p:]])]
            for leaf, e, what in zip(leaves, expected, ("outs", "lses"), strict=True):
                assert_shard(leaf.grad, e, env, stack_places, f"merge grad {what}")
        else:
            for i, (leaf, w) in enumerate(zip(leaves, whole, strict=True)):
                what = f"outs[{i}]" if i < p else f"lses[{i - p}]"
                assert_shard(leaf.grad, w.grad, env, places, f"merge grad {what}")

    return check


MERGE_CASES = [
    # name, placement, partial shape (..., Sq, D), P, form, gradients used
    ("batch_list", "S0", (3, 2, 5, 8), 3, "list", "both"),
    ("heads_stacked", "S1", (2, 4, 5, 8), 2, "stacked", "both"),
    ("rows_uneven_list_out_only", "S2", (2, 2, 7, 8), 3, "list", "out"),
    ("rows_stacked_lse_only", "S0", (5, 8), 2, "stacked", "lse"),
    ("replicated_list", "R", (2, 3, 8), 2, "list", "both"),
]
for _name, _code, *_args in MERGE_CASES:
    _register(f"merge_{_name}", _merge_check(_code, *_args))
_register("merge_rows_stacked_triton", _merge_check("S2", (2, 2, 6, 24), 3, "stacked"), "triton")
_register("merge_heads_list_bf16_triton",
          _merge_check("S1", (2, 4, 3, 24), 2, "list", "out", dtype=torch.bfloat16), "triton")


def _attention_then_merge(env: Env) -> None:
    """The DTensors attention(..., return_lse=True) returns on two key blocks merge as they are, locally, into
    attention over all keys (heads sharded), forward and backward."""
    from torch.distributed.tensor import Shard

    places = [Shard(1)]
    q, k, v = env.randn(2, 4, 5, 8), env.randn(2, 4, 6, 8), env.randn(2, 4, 6, 8)

    def split_merge(q, k, v):
        o1, l1 = safeops.attention(q, k[:, :, :2], v[:, :, :2], return_lse=True)
        o2, l2 = safeops.attention(q, k[:, :, 2:], v[:, :, 2:], return_lse=True)
        return safeops.merge_attention([o1, o2], [l1, l2])

    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out_whole, lse_whole = split_merge(*whole)
    grad = env.randn(*out_whole.shape)
    out_whole.backward(grad)
    full = safeops.attention(q, k, v)
    torch.testing.assert_close(out_whole.detach(), full, rtol=1e-5, atol=1e-6)  # the split is exact
    qd, kd, vd = (shard(env, t, places, requires_grad=True) for t in (q, k, v))
    with comm_counter() as comm:
        out, lse = split_merge(qd, kd, vd)
        out.backward(shard(env, grad, places))
    assert comm.get_total_counts() == 0, f"collectives: {comm.get_comm_counts()}"
    assert_shard(out, out_whole.detach(), env, places, "merged attention out")
    assert_shard(lse, lse_whole.detach(), env, places, "merged attention lse")
    for name, t, w in zip(("q", "k", "v"), (qd, kd, vd), whole, strict=True):
        assert_shard(t.grad, w.grad, env, places, f"merged attention grad {name}")


_register("merge_attention_blocks", _attention_then_merge)


def _merge_errors(env: Env) -> None:
    """Placements that would need communication raise a ValueError naming the argument, before anything
    runs; the registered op called directly refuses too."""
    from torch.distributed.tensor import Replicate, Shard

    outs, lses = env.randn(2, 2, 4, 6, 8), env.randn(2, 2, 4, 6)

    def listed(o_places, l_places, o1_places=None, l1_places=None):
        o = [shard(env, outs[0], o_places), shard(env, outs[1], o1_places or o_places)]
        lse = [shard(env, lses[0], l_places), shard(env, lses[1], l1_places or l_places)]
        return safeops.merge_attention(o, lse)

    def stacked(o_places, l_places, fn=safeops.merge_attention):
        return fn(shard(env, outs, o_places), shard(env, lses, l_places))

    with comm_counter() as comm:
        msg = assert_raises(ValueError, "outs[0] is sharded on its head dim D (dim 3)",
                            lambda: listed([Shard(3)], [Replicate()]))
        assert "redistribute" in msg, msg
        assert_raises(ValueError, "outs is sharded on its head dim D (dim 4)",
                      lambda: stacked([Shard(4)], [Replicate()]))
        assert_raises(ValueError, "outs is sharded on dim 0", lambda: stacked([Shard(0)], [Shard(0)]))
        assert_raises(ValueError, "outs[1] is placed (S(1)) but outs[0] (S(0))",
                      lambda: listed([Shard(0)], [Shard(0)], o1_places=[Shard(1)]))
        assert_raises(ValueError, "lses[1] is placed",
                      lambda: listed([Shard(2)], [Shard(2)], l1_places=[Replicate()]))
        assert_raises(ValueError, "lses[0] is placed (R) but outs[0] (S(0))",
                      lambda: listed([Shard(0)], [Replicate()]))
        partial = placements("P")
        assert_raises(ValueError, "outs has a Partial placement", lambda: stacked(partial, partial))
        o0, l0 = shard(env, outs[0], [Shard(0)]), shard(env, lses[0], [Shard(0)])
        assert_raises(ValueError, "lses[1] is a plain torch.Tensor but outs[0] is a DTensor",
                      lambda: safeops.merge_attention([o0, o0], [l0, lses[1]]))
        assert_raises(ValueError, "outs is a plain torch.Tensor but lses is a DTensor",
                      lambda: safeops.merge_attention(outs, shard(env, lses, [Shard(1)])))
        o1, l1 = shard(env, outs[0, :1], [Shard(0)]), shard(env, lses[0, :1], [Shard(0)])
        assert_raises(ValueError, "outs[0] has size 1 on dim 0, sharded into 2 pieces",
                      lambda: safeops.merge_attention([o1], [l1]))
    assert comm.get_total_counts() == 0
    safeops.dtensor.register()
    with comm_counter() as comm:
        assert_raises(RuntimeError, "outs is sharded on its head dim D",
                      lambda: stacked([Shard(4)], [Replicate()], torch.ops.safeops.merge_attention))
    assert comm.get_total_counts() == 0
    out, lse = torch.ops.safeops.merge_attention(shard(env, outs, [Shard(3)]), shard(env, lses, [Shard(3)]))
    assert [tuple(t.placements) for t in (out, lse)] == [(Shard(2),)] * 2


_register("merge_errors", _merge_errors)


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------

_NEEDS_GLOO = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                 reason="needs torch.distributed with the gloo backend")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    names = list(CHECKS)
    if os.environ.get("TRITON_INTERPRET") != "1":
        names = [n for n in names if CHECKS[n][1] != "triton"]
    return spawn_checks(tmp_path_factory.mktemp("dtensor"), "cpu", "gloo", __name__, names)


@_NEEDS_GLOO
@pytest.mark.parametrize("name", list(CHECKS))
def test_dtensor(spawned, name):
    seed, failures = spawned
    if name not in failures:
        pytest.skip("the Triton checks need TRITON_INTERPRET=1 on a machine without a GPU")
    assert not failures[name], f"seed={seed} (replay with {SEED_ENV}={seed})\n" + "\n".join(failures[name])


