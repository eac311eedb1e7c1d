"""GPU tests of the Gluon attention forward (safeops.kernels.attention_gluon), the CUDA default where
``safeops.attention_backend`` says "gluon" (sm_90, Triton 3.6, bf16 / fp16, head dim 64 / 128 / 256, sinks, a
left window at head dims 64 / 128; no mask or softcap). Skipped without such a GPU (the device check's reason
is the skip reason).

- against the float64 oracle (tests/oracle.py): bf16 / fp16 x D 64 / 128 / 256 x causal or not, GQA and MQA,
  Sq != Sk with partial blocks: out, lse, and dq / dk / dv of the Triton backward run from the Gluon
  forward's saved statistics (contract sections 1-3);
- packed sequences (attention_varlen): each sequence's out / lse bits equal its dense call's (the oracle
  checks those), with a sequence without keys (out 0, lse -inf), one without queries, one shorter than a
  block; NaN keys of a neighbouring sequence stay out (they are selected away);
- bits (section 6): 10 reruns, batch invariance (a batch element alone and among others), layouts ((B, S, H,
  D) memory, a layout TMA cannot read and the launcher copies), the persistent grid;
- exact rows: causal row 0 gives v_0 and l = 1, q = 0 gives m = 0 and l = #visible keys exactly, no keys
  gives O = 0, m = -inf, l = 0 (section 4), a NaN query row stays in its row (section 5);
- the path: attention_backend's answer, the plan the forward keeps, ``SAFEOPS_GLUON=0`` gives the Triton
  forward (its bits differ; both pass the oracle).

The whole attention suite (tests/test_attention_gpu.py) runs with this path as the default as well, CUDA
graph capture included. A failure's random inputs are the ``Rng(n)`` in its falsifying example.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_attention_gpu import DEV, check_oracle, seeded_rng

import safeops
from safeops.ops import attention_gluon as G
from safeops.ops import attention_launch as L


def _why_not() -> str:
    if not torch.cuda.is_available():
        return "needs CUDA"
    return G.device_reason(torch.device("cuda", torch.cuda.current_device()))


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "-")]

BF16, FP16 = torch.bfloat16, torch.float16
NEG_INF = float("-inf")


@pytest.fixture
def rng(request):
    """Inputs from a fixed seed per test (the same every run; the oracle checks hold for any draw)."""
    return seeded_rng(request)


def _triton_launches() -> list[dict]:
    """The Triton kernels these tests launch (the backward of the oracle cases, the Triton forwards),
    recorded on meta tensors."""
    import json

    meta = torch.device("meta")
    with L.recording() as launches:
        for dtype in (BF16, FP16):
            for d in (64, 128, 256):
                for causal in (False, True):
                    q = torch.empty(2, 4, 300, d, dtype=dtype, device=meta)
                    k = torch.empty(2, 2, 300, d, dtype=dtype, device=meta)
                    opts = (None, 0, None, None, 300, 300, causal, d**-0.5, None, -1, 0 if causal else -1, 0)
                    o, m, l = L.forward(q, k, k, *opts)
                    L.backward(o, q, k, k, o, m, l, *opts)
    return list({json.dumps(x, sort_keys=True): x for x in launches}.values())


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    """Every Gluon configuration and the Triton kernels the tests use compiled in parallel first (the
    launches then load them from Triton's cache instead of compiling one at a time). Under pytest-xdist
    every worker runs this fixture; the first to take a file lock compiles with half the CPUs (8 at most,
    Gluon's compiles import torch in each process) and leaves a marker for the run, and the others wait for
    the lock and find the marker instead of compiling the same kernels again, all at once (14 workers
    starting 16 processes each ended in 45 setup errors on the GPU machine)."""
    import fcntl
    import json
    import os
    import sys
    import tempfile
    import threading

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"pid{os.getpid()}")
    base = os.path.join(tempfile.gettempdir(), f"safeops-gluon-warm-{os.getuid()}")
    with open(base + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            marker = f"{base}-{run}.json"
            if os.path.exists(marker):
                with open(marker) as f:
                    failed, triton = json.load(f)
            else:
                workers = max(1, min(8, (os.cpu_count() or 8) // 2))
                result = {}
                thread = threading.Thread(target=lambda: result.update(triton=L.compile_launches(
                    _triton_launches(), python=sys.executable, arch=90, workers=workers)))
                thread.start()
                failed = G.warm_cache(workers=workers)
                thread.join()
                triton = result["triton"]
                with open(marker, "w") as f:
                    json.dump([failed, triton], f)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    assert not failed, failed
    assert all(r["ok"] for r in triton["results"]), triton


@pytest.fixture(autouse=True)
def _shipped_settings(monkeypatch):
    monkeypatch.setenv("SAFEOPS_BACKEND", "auto")
    monkeypatch.delenv("SAFEOPS_GLUON", raising=False)
    L.clear_plans()
    yield
    L.clear_plans()


def _kept_plans():
    return [p.__class__ for p in L._fwd_plans.values()]


def _forward(q, k, v, causal):
    """(o, m, l) through the launcher (the op's forward, statistics included)."""
    return L.forward(q, k, v, None, 0, None, None, q.shape[2], k.shape[2], causal, q.shape[-1] ** -0.5, None,
                     -1, 0 if causal else -1, 0)


def test_path_and_reasons(rng):
    q, k, v = (rng.randn(2, 4, 300, 128, dtype=BF16) for _ in range(3))
    assert safeops.attention_backend(q, k, v, is_causal=True) == ("gluon", "bf16 causal D=128 on sm_90")
    assert safeops.attention_backend(q.half(), k.half(), v.half()) == (
        "gluon", "fp16 non-causal D=128 on sm_90")
    safeops.attention(q, k, v, is_causal=True)
    assert _kept_plans() == [G.Plan]
    mask = torch.ones(300, 300, dtype=torch.bool, device=DEV)
    assert safeops.attention_backend(q, k, v, attn_mask=mask) == (
        "triton", "the Gluon kernel does not take an attention mask")
    safeops.attention(q, k, v, attn_mask=mask)
    assert _kept_plans() == [G.Plan, L._FwdPlan]
    assert safeops.attention_backend(q[..., :96], k[..., :96], v[..., :96])[0] == "triton"


def test_gluon_off_runs_the_triton_forward(rng, monkeypatch):
    q, k, v = (rng.randn(2, 4, 300, 64, dtype=BF16) for _ in range(3))
    on = _forward(q, k, v, True)
    monkeypatch.setenv("SAFEOPS_GLUON", "0")
    assert safeops.attention_backend(q, k, v, is_causal=True) == (
        "triton", "SAFEOPS_GLUON=0 turns the Gluon forward off")
    off = _forward(q, k, v, True)
    assert _kept_plans() == [L._FwdPlan]
    check_oracle(q, k, v, rng, is_causal=True)  # the Triton path, against the oracle
    monkeypatch.setenv("SAFEOPS_GLUON", "1")
    again = _forward(q, k, v, True)
    assert _kept_plans() == [G.Plan]
    for a, b in zip(on, again, strict=True):
        assert torch.equal(a, b)
    assert all(a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
               for a, b in zip(on, off, strict=True))


@pytest.mark.parametrize("d", [64, 128])
def test_kept_tensor_maps_give_tritons_launcher_bits(d, rng, monkeypatch):
    """Direct launches of the Gluon kernels keep their encoded TMA tensor maps (safeops.ops._launch,
    Triton 3.6's launcher); forward and backward give the bits of launches through JITFunction.run (which
    encodes every descriptor afresh), for new tensors, and for new contents at addresses already seen."""
    from safeops.ops import _launch

    def step(q, k, v, g):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        o = safeops.attention(q, k, v, is_causal=True)
        return (o, *torch.autograd.grad(o, (q, k, v), g))

    def inputs():
        return (rng.randn(2, 8, 777, d, dtype=BF16), *(rng.randn(2, 2, 777, d, dtype=BF16) for _ in range(2)),
                rng.randn(2, 8, 777, d, dtype=BF16))

    draws = [inputs() for _ in range(3)]
    monkeypatch.setattr(_launch, "DIRECT", False)
    expected = [step(*x) for x in draws]
    L.clear_plans()
    monkeypatch.setattr(_launch, "DIRECT", True)
    for _ in range(2):
        for x, want in zip(draws, expected, strict=True):
            for a, b in zip(step(*x), want, strict=True):
                assert torch.equal(a, b)
    plan = next(p for p in L._fwd_plans.values() if isinstance(p, G.Plan))
    assert plan.launch._maps, "Triton 3.6's launcher not recognized: the tensor maps are encoded per launch"
    # The same addresses with other contents (the caching allocator hands them out again).
    for x in draws:
        for t in x:
            t.copy_(torch.roll(t, 1, dims=2))
    monkeypatch.setattr(_launch, "DIRECT", False)
    again = [step(*x) for x in draws]
    monkeypatch.setattr(_launch, "DIRECT", True)
    for x, want in zip(draws, again, strict=True):
        for a, b in zip(step(*x), want, strict=True):
            assert torch.equal(a, b)


# (B, Hq, Hkv, Sq, Sk): GQA with partial blocks, MQA with Sq != Sk (both ways), one short row block.
SHAPES = [(2, 4, 2, 300, 300), (1, 2, 1, 200, 333), (1, 4, 1, 333, 77), (3, 2, 2, 1, 129)]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_matches_oracle(dtype, d, causal, rng):
    for i, (b, hq, hkv, sq, sk) in enumerate(SHAPES):
        q = rng.randn(b, hq, sq, d, dtype=dtype)
        k, v = (rng.randn(b, hkv, sk, d, dtype=dtype) for _ in range(2))
        assert safeops.attention_backend(q, k, v, is_causal=causal)[0] == "gluon"
        check_oracle(q, k, v, rng, grads=i < 2, is_causal=causal)


def _packed(rng, lengths_q, lengths_k, hq, hkv, d, dtype):
    seqs = [(rng.randn(1, hq, nq, d, dtype=dtype), rng.randn(1, hkv, nk, d, dtype=dtype),
             rng.randn(1, hkv, nk, d, dtype=dtype)) for nq, nk in zip(lengths_q, lengths_k, strict=True)]
    packed = [torch.cat([s[i][0].transpose(0, 1) for s in seqs]) for i in range(3)]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
                  for n in (lengths_q, lengths_k))
    return seqs, packed, cu_q, cu_k


@pytest.mark.parametrize("dtype,d", [(BF16, 64), (BF16, 128), (BF16, 256), (FP16, 128)])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_varlen_equals_dense_bits(dtype, d, causal, rng):
    """Each packed sequence gets the bits of its dense call: one past a block boundary, one row, no keys
    (queries only), no queries (keys only), shorter than a key block, Sq != Sk."""
    lengths_q = [300, 1, 70, 0, 129, 200]
    lengths_k = [300, 1, 0, 50, 64, 333]
    seqs, packed, cu_q, cu_k = _packed(rng, lengths_q, lengths_k, 4, 2, d, dtype)
    assert safeops.attention_backend(*packed, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, is_causal=causal) == (
        "gluon", f"{'bf16' if dtype == BF16 else 'fp16'} {'causal' if causal else 'non-causal'} D={d} packed "
        "(varlen) on sm_90")
    out, lse = safeops.attention_varlen(*packed, cu_q, cu_k, is_causal=causal, return_lse=True)
    for b, nk in enumerate(lengths_k):
        o, ls = safeops.attention(*seqs[b], is_causal=causal, return_lse=True)
        sl = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert torch.equal(out[sl], o[0].transpose(0, 1)), f"out, sequence {b}; {rng}"
        assert torch.equal(lse[:, sl], ls[0]), f"lse, sequence {b}; {rng}"
        if nk == 0:
            assert (out[sl] == 0).all() and (lse[:, sl] == NEG_INF).all()
    check_oracle(*seqs[4], rng, grads=False, is_causal=causal)


def test_varlen_neighbours_nan_keys_stay_out(rng):
    """A sequence's last key block reaches into the next sequence's rows: NaN keys there are selected away
    (its output bits are those of the clean run), while the NaN sequence's own rows are NaN."""
    lengths = [100, 300, 64]
    seqs, packed, cu, _ = _packed(rng, lengths, lengths, 2, 2, 128, BF16)
    clean = safeops.attention_varlen(*packed, cu, cu)
    k = packed[1].clone()
    k[100:400] = float("nan")
    dirty = safeops.attention_varlen(packed[0], k, packed[2], cu, cu)
    assert torch.equal(dirty[:100], clean[:100]) and torch.equal(dirty[400:], clean[400:])
    assert torch.isnan(dirty[100:400]).all()


def test_deterministic_and_batch_invariant_bits(rng):
    q = rng.randn(5, 8, 700, 128, dtype=BF16)
    k, v = (rng.randn(5, 2, 700, 128, dtype=BF16) for _ in range(2))
    first = _forward(q, k, v, True)
    for _ in range(10):
        for a, b in zip(first, _forward(q, k, v, True), strict=True):
            assert torch.equal(a, b)
    alone = _forward(q[3:4].clone(), k[3:4].clone(), v[3:4].clone(), True)
    among = _forward(q[1:4], k[1:4], v[1:4], True)  # a slice: other neighbours, another offset
    for a, b, c in zip(first, alone, among, strict=True):
        assert torch.equal(a[3:4], b) and torch.equal(a[3:4], c[2:3])


@pytest.mark.parametrize("d", [64, 128])
def test_layout_and_schedule_same_bits(d, rng, monkeypatch):
    """(B, S, H, D) memory (read in place), a layout TMA cannot read (rows of D + 8 elements, 2 bytes off:
    copied first), the persistent grid and one program per tile give the bits of the contiguous call."""
    b, hq, hkv, s = 2, 8, 2, 777

    def make(h):
        return rng.randn(b, s, h, d, dtype=BF16).transpose(1, 2)
    q, k, v = make(hq), make(hkv), make(hkv)
    for causal in (False, True):
        ref = _forward(q.contiguous(), k.contiguous(), v.contiguous(), causal)
        bshd = _forward(q, k, v, causal)
        odd = [torch.empty(*t.shape[:-1], d + 9, dtype=BF16, device=DEV)[..., 1:d + 1].copy_(t)
               for t in (q, k, v)]
        copied = _forward(*odd, causal)
        monkeypatch.setattr(G, "PERSISTENT", True)
        persistent = _forward(q, k, v, causal)
        monkeypatch.setattr(G, "PERSISTENT", False)
        shipped = G.PERSISTENT_NONCAUSAL
        monkeypatch.setattr(G, "PERSISTENT_NONCAUSAL", ())
        per_tile = _forward(q, k, v, causal)
        monkeypatch.setattr(G, "PERSISTENT_NONCAUSAL", shipped)
        assert bshd[0].stride() == q.stride()  # o in q's layout
        for name, got in (("bshd", bshd), ("copied", copied), ("persistent", persistent),
                          ("per_tile", per_tile)):
            for a, r in zip(got, ref, strict=True):
                assert torch.equal(a, r), f"{name} causal={causal}; {rng}"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_exact_rows(d, causal, rng):
    b, hq, hkv, sq, sk = 2, 4, 2, 200, 333
    q = rng.randn(b, hq, sq, d, dtype=BF16)
    k, v = (rng.randn(b, hkv, sk, d, dtype=BF16) for _ in range(2))
    if causal:  # row 0 sees key 0 only: p = 1 exactly
        o, m, l = _forward(q, k, v, True)
        assert torch.equal(o[:, :, 0], v[:, :, 0].repeat_interleave(hq // hkv, 1)) and (l[:, :, 0] == 1).all()
    o, m, l = _forward(torch.zeros_like(q), k, v, causal)  # equal scores: z2 = 0 everywhere
    rows = torch.arange(sq, device=DEV)
    visible = torch.clamp(rows + 1, max=sk) if causal else torch.full_like(rows, sk)
    assert (m == 0).all() and (l == visible.float()).all()
    o, m, l = _forward(q, k[:, :, :0], v[:, :, :0], causal)  # no keys
    assert (o == 0).all() and (m == NEG_INF).all() and (l == 0).all()
    qn = q.clone()
    qn[0, 1, 7] = float("nan")
    on, mn, ln = _forward(qn, k, v, causal)
    oc, mc, lc = _forward(q, k, v, causal)
    keep = torch.ones_like(on[..., 0], dtype=torch.bool)
    keep[0, 1, 7] = False
    assert torch.isnan(on[0, 1, 7]).all()
    for a, c in ((on, oc), (mn, mc), (ln, lc)):
        assert torch.equal(a[keep], c[keep])


def test_long_sequence_llama_layer(rng):
    """The Llama-3-8B layer's shape (32 query / 8 kv heads, D=128, causal) at S=8K: a few rows against a
    float64 computation, and the lse."""
    b, hq, hkv, s, d = 1, 32, 8, 8192, 128
    q = rng.randn(b, hq, s, d, dtype=BF16)
    k, v = (rng.randn(b, hkv, s, d, dtype=BF16) for _ in range(2))
    out, lse = safeops.attention(q, k, v, is_causal=True, return_lse=True)
    rows = torch.tensor([0, 1, 127, 128, 4095, 8191], device=DEV)
    kk, vv = (t.double().repeat_interleave(4, 1) for t in (k, v))
    z = (q.double()[:, :, rows] @ kk.transpose(-1, -2)) / math.sqrt(d)
    z = torch.where(torch.arange(s, device=DEV)[None, :] <= rows[:, None], z, torch.full_like(z, NEG_INF))
    expected = torch.softmax(z, -1) @ vv
    assert (out[:, :, rows].double() - expected).abs().max().item() <= 2**-7 * vv.abs().max().item()
    assert torch.allclose(lse[:, :, rows].double(), torch.logsumexp(z, -1), atol=1e-3)


# Sinks in the Gluon forward (attention_gluon.GLUON_SINKS; the tests also pin it on).

@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_sinks_match_oracle(dtype, d, causal, rng, monkeypatch):
    from test_attention_sinks_gpu import check_oracle as check_sinks_oracle

    monkeypatch.setattr(G, "GLUON_SINKS", True)
    L.clear_plans()
    for b, hq, hkv, sq, sk in SHAPES[:3]:
        q = rng.randn(b, hq, sq, d, dtype=dtype)
        k, v = (rng.randn(b, hkv, sk, d, dtype=dtype) for _ in range(2))
        sinks = rng.randn(hq, std=3.0)
        assert safeops.attention_backend(q, k, v, is_causal=causal, sinks=sinks)[0] == "gluon"
        check_sinks_oracle(q, k, v, sinks, rng, is_causal=causal)


def test_sinks_varlen_and_rows_without_keys(rng, monkeypatch):
    """Packed sequences with sinks get their dense calls' bits; a sequence without keys gets out 0 and
    lse = the sink (m = zs2, l = 1 as the Triton path leaves it)."""
    monkeypatch.setattr(G, "GLUON_SINKS", True)
    L.clear_plans()
    lengths_q, lengths_k = [300, 70, 129], [300, 0, 64]
    seqs, packed, cu_q, cu_k = _packed(rng, lengths_q, lengths_k, 4, 2, 128, BF16)
    sinks = rng.randn(4, std=3.0)
    out, lse = safeops.attention_varlen(*packed, cu_q, cu_k, is_causal=True, sinks=sinks, return_lse=True)
    for b in range(3):
        o, ls = safeops.attention(*seqs[b], is_causal=True, sinks=sinks, return_lse=True)
        sl = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert torch.equal(out[sl], o[0].transpose(0, 1)) and torch.equal(lse[:, sl], ls[0]), (b, rng)
    sl = slice(int(cu_q[1]), int(cu_q[2]))
    assert (out[sl] == 0).all()
    # lse of the sink alone: zs2 * ln 2 with zs2 = fp32(sink * fp32(log2 e)), as the Triton path gives it
    log2e = torch.tensor(1.4426950408889634, dtype=torch.float32, device=DEV)
    expected = ((sinks * log2e).double() * 0.6931471805599453).float()
    assert torch.equal(lse[:, sl], expected[:, None].expand(4, 70))


# A left sliding window in the Gluon forward (attention_gluon.GLUON_WINDOW; the tests also pin it on): the
# oracle, packed == dense bits, rows that see no key, and with sinks (gpt-oss's layers).

@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_window_matches_oracle(dtype, d, causal, rng, monkeypatch):
    monkeypatch.setattr(G, "GLUON_WINDOW", True)
    L.clear_plans()
    for (b, hq, hkv, sq, sk), left in zip(SHAPES, (17, 128, 200, 0), strict=True):
        q = rng.randn(b, hq, sq, d, dtype=dtype)
        k, v = (rng.randn(b, hkv, sk, d, dtype=dtype) for _ in range(2))
        window = (left, None)
        assert safeops.attention_backend(q, k, v, is_causal=causal, window=window)[0] == "gluon"
        check_oracle(q, k, v, rng, grads=sq < 300, is_causal=causal, window=window)


def test_window_rows_without_keys_varlen_and_sinks(rng, monkeypatch):
    """Non-causal with a left window: rows past Sk + window see no key (out 0, lse -inf; with sinks the
    sink); packed sequences get their dense calls' bits; window + sinks against the oracle."""
    from test_attention_sinks_gpu import check_oracle as check_sinks_oracle

    monkeypatch.setattr(G, "GLUON_WINDOW", True)
    monkeypatch.setattr(G, "GLUON_SINKS", True)
    L.clear_plans()
    q = rng.randn(1, 2, 500, 64, dtype=BF16)
    k, v = (rng.randn(1, 2, 100, 64, dtype=BF16) for _ in range(2))
    out, lse = safeops.attention(q, k, v, window=(50, None), return_lse=True)
    assert (out[:, :, 150:] == 0).all() and (lse[:, :, 150:] == NEG_INF).all()
    check_oracle(q, k, v, rng, grads=False, window=(50, None))
    lengths_q, lengths_k = [300, 70, 129], [300, 0, 64]
    seqs, packed, cu_q, cu_k = _packed(rng, lengths_q, lengths_k, 4, 2, 128, BF16)
    out, lse = safeops.attention_varlen(*packed, cu_q, cu_k, is_causal=True, window=(100, None),
                                        return_lse=True)
    for b in range(3):
        o, ls = safeops.attention(*seqs[b], is_causal=True, window=(100, None), return_lse=True)
        sl = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert torch.equal(out[sl], o[0].transpose(0, 1)) and torch.equal(lse[:, sl], ls[0]), (b, rng)
    q = rng.randn(2, 4, 300, 64, dtype=BF16)
    k, v = (rng.randn(2, 2, 300, 64, dtype=BF16) for _ in range(2))
    sinks = rng.randn(4, std=3.0)
    assert safeops.attention_backend(q, k, v, is_causal=True, window=(128, None), sinks=sinks)[0] == "gluon"
    check_sinks_oracle(q, k, v, sinks, rng, is_causal=True, window=(128, None))


# Softcap (attention_gluon.GLUON_SOFTCAP): the Triton kernels' formula in the Gluon forward; the backward
# (Triton) reads its statistics. Not the Triton forward's bits: the Gluon forward's key blocks differ (128
# keys at D=64 / 128 against 64), which orders each row's sum differently, as without softcap.

SOFTCAP_CASES = [(BF16, 128, False), (BF16, 128, True), (FP16, 64, True), (BF16, 256, False)]


@pytest.mark.parametrize("dtype,d,causal", SOFTCAP_CASES)
def test_softcap_matches_oracle_and_reruns(dtype, d, causal, rng, monkeypatch):
    """Against the float64 oracle (forward, and the backward from the Gluon forward's statistics for the
    shorter shapes), large scores (std 3 queries) pressed against the cap; reruns give the same bits. Cases
    that route to Triton by default (slower on Gluon there) are forced onto the Gluon kernel to test it."""
    monkeypatch.setattr(G, "GLUON_SOFTCAP", True)
    monkeypatch.setattr(G, "SOFTCAP_CASES", tuple({*G.SOFTCAP_CASES, (d, causal)}))
    L.clear_plans()
    for (b, hq, hkv, sq, sk), cap in zip(SHAPES[:3], (30.0, 5.0, 50.0), strict=True):
        q = rng.randn(b, hq, sq, d, dtype=dtype, std=3.0)
        k, v = (rng.randn(b, hkv, sk, d, dtype=dtype) for _ in range(2))
        assert safeops.attention_backend(q, k, v, is_causal=causal, softcap=cap)[0] == "gluon"
        first = safeops.attention(q, k, v, is_causal=causal, softcap=cap, return_lse=True)
        again = safeops.attention(q, k, v, is_causal=causal, softcap=cap, return_lse=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), ((b, hq, sq, sk), cap)
        check_oracle(q, k, v, rng, grads=sq < 300, is_causal=causal, softcap=cap)


def test_softcap_window_varlen_gemma_layer(rng, monkeypatch):
    """Gemma 2's local layers: softcap 50 with a causal sliding window, packed sequences: each sequence's
    bits those of its dense call; the dense call against the oracle."""
    monkeypatch.setattr(G, "GLUON_SOFTCAP", True)
    L.clear_plans()
    lengths = [300, 70, 129]
    seqs, packed, cu_q, cu_k = _packed(rng, lengths, lengths, 4, 2, 128, BF16)
    options = dict(is_causal=True, window=(100, None), softcap=50.0)
    assert safeops.attention_backend(*packed, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **options)[0] == "gluon"
    out, lse = safeops.attention_varlen(*packed, cu_q, cu_k, return_lse=True, **options)
    for b in range(3):
        o, ls = safeops.attention(*seqs[b], return_lse=True, **options)
        sl = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert torch.equal(out[sl], o[0].transpose(0, 1)) and torch.equal(lse[:, sl], ls[0]), (b, rng)
    check_oracle(*seqs[0], rng, **options)


@pytest.mark.parametrize("d", [64, 128])
def test_late_pv_wait_same_bits(d, rng, monkeypatch):
    """GluonFwdConfig.late_pv_wait (a warpgroup barrier ordered after each block's row sums, so ptxas keeps
    the wait for the previous PV product after the exponentials) changes no arithmetic: the bits without it,
    causal or not, GQA with partial blocks, and with sinks, a window and packed sequences."""
    import dataclasses

    K = G.kernels()
    q = rng.randn(2, 8, 777, d, dtype=BF16)
    k, v = (rng.randn(2, 2, 901, d, dtype=BF16) for _ in range(2))
    sinks = rng.randn(8, std=2.0)
    cu = torch.tensor([0, 300, 301, 777], dtype=torch.int32, device=DEV)
    qp, kp, vp = (t[0].transpose(0, 1)[:777].contiguous() for t in (q, k, v))
    results = []
    for flag in (False, True):
        monkeypatch.setitem(K.FWD_CONFIGS, d, dataclasses.replace(K.FWD_CONFIGS[d], late_pv_wait=flag))
        L.clear_plans()
        got = [*_forward(q, k, v, False), *_forward(q, k, v, True),
               *safeops.attention(q, k, v, is_causal=True, window=(300, None), sinks=sinks, return_lse=True),
               safeops.attention_varlen(qp, kp, vp, cu, cu, is_causal=True)]
        plans = [p for p in L._fwd_plans.values() if p.__class__ is G.Plan and p.launch is not None]
        assert plans and all(p.launch.kwargs["LATE_PV_WAIT"] == flag for p in plans)
        results.append(got)
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        assert torch.equal(a, b), f"output {i} differs with late_pv_wait (D={d})"
