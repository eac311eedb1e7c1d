"""GPU tests of the Gluon backward's dK / dV and dQ kernels (safeops.kernels.attention_gluon_bwd), the CUDA
default for head dims 64 and 128 where ``safeops.attention_backend(..., backward=True)`` says "gluon" (sm_90,
Triton 3.6, bf16 / fp16, dense, no mask, softcap or window), and of the fused kernel, the default for
non-causal D=128 (``attention_gluon.FUSED_NONCAUSAL``; this file's other tests switch that off, so they test
the pair). dq comes from
the Gluon dQ kernel (``attention_gluon.GLUON_DQ``), delta and the sinks' gradient from a delta-only launch of
the Triton dq kernel. Skipped without such a GPU (the device check's reason is the skip reason).

- against the float64 oracle (tests/oracle.py): bf16 / fp16 x D 64 / 128 x causal or not, GQA and MQA with
  partial blocks, Sq != Sk both ways, a sequence length that is not a multiple of 4 (the row statistics are
  then padded for TMA);
- bits (contract section 6): for MHA the same bits as the Triton dk/dv kernel (same blocks, same order);
  100 reruns of the backward; batch invariance; a (B, S, H, D) memory layout and one TMA cannot read;
- exact cases: keys that no query sees (causal, Sk > Sq) get dk = dv = 0 exactly; sinks (their gradient
  comes from the Triton dq kernel; dk / dv from this one);
- the path: attention_backend's answers, ``SAFEOPS_GLUON_BWD=0`` and ``SAFEOPS_GLUON=0``;
- packed sequences and a left window (``attention_gluon.GLUON_BWD_SEQ``; the ``seq_`` tests also take D=64):
  each packed sequence's gradients equal those of the sequence alone (lengths around the block sizes, an
  empty and a one-row sequence, GQA), windows against the oracle and the Triton kernels' values (MHA),
  reruns, sinks with a window.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_gpu import DEV, check_oracle, seeded_rng
from test_attention_sinks_gpu import check_oracle as check_sinks_oracle

import safeops
from safeops.ops import attention_gluon as G
from safeops.ops import attention_launch as L


def _why_not() -> str:
    if not torch.cuda.is_available():
        return "needs CUDA"
    return G.device_reason(torch.device("cuda", torch.cuda.current_device()))


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "-")]

BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture
def rng(request):
    """Inputs from a fixed seed per test (the same every run; the oracle checks hold for any draw)."""
    return seeded_rng(request)


@pytest.fixture(autouse=True)
def _shipped_settings(monkeypatch):
    monkeypatch.setattr(G, "FUSED_NONCAUSAL", ())  # the pair (the fused kernel's tests: GLUON_FUSED)
    monkeypatch.setenv("SAFEOPS_BACKEND", "auto")
    monkeypatch.delenv("SAFEOPS_GLUON", raising=False)
    monkeypatch.delenv("SAFEOPS_GLUON_BWD", raising=False)
    monkeypatch.delenv("SAFEOPS_GLUON_FUSED", raising=False)
    L.clear_plans()
    yield
    L.clear_plans()


def _grads(q, k, v, g, **options):
    q_, k_, v_ = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = safeops.attention(q_, k_, v_, **options)
    return torch.autograd.grad(out, (q_, k_, v_), g)


def _gluon_ran(monkeypatch, q, k, v, **options):
    """Asserts the backward of these inputs takes the Gluon dK / dV kernel (switched on for D=64, whose
    causal backward takes it only so)."""
    if q.shape[-1] == 64:
        monkeypatch.setenv("SAFEOPS_GLUON_BWD", "1")
    path = safeops.attention_backend(q, k, v, backward=True, **options)
    assert path[0] == "gluon", path


def test_path_and_reasons(rng, monkeypatch):
    q, k, v = (rng.randn(2, 4, 300, 128, dtype=BF16) for _ in range(3))
    assert safeops.attention_backend(q, k, v, is_causal=True, backward=True) == (
        "gluon", "bf16 causal D=128 on sm_90: Gluon dq, dk / dv")
    q64 = q[..., :64].contiguous()
    assert safeops.attention_backend(q64, q64, q64, backward=True)[0] == "gluon"  # D=64 non-causal
    assert safeops.attention_backend(q64, q64, q64, is_causal=True, backward=True) == (
        "gluon", "bf16 causal D=64 on sm_90: Gluon dk / dv, Triton dq")
    mask = torch.ones(300, 300, dtype=torch.bool, device=DEV)
    assert safeops.attention_backend(q, k, v, attn_mask=mask, backward=True) == (
        "triton", "the Gluon backward does not take an attention mask")
    assert safeops.attention_backend(q, k, v, window=(16, 0), backward=True) == (
        "triton", "the Gluon backward does not take a sliding window with a right bound")
    monkeypatch.setenv("SAFEOPS_GLUON_BWD", "1")
    assert safeops.attention_backend(q64, q64, q64, is_causal=True, backward=True)[0] == "gluon"
    monkeypatch.setenv("SAFEOPS_GLUON_BWD", "0")
    assert safeops.attention_backend(q, k, v, backward=True) == (
        "triton", "SAFEOPS_GLUON_BWD=0 keeps dk / dv on the Triton kernel")
    monkeypatch.setenv("SAFEOPS_GLUON_BWD", "1")
    monkeypatch.setenv("SAFEOPS_GLUON", "0")
    assert safeops.attention_backend(q, k, v, backward=True) == (
        "triton", "SAFEOPS_GLUON=0 keeps dk / dv on the Triton kernel")
    monkeypatch.setenv("SAFEOPS_GLUON_BWD", "sometimes")
    monkeypatch.delenv("SAFEOPS_GLUON")
    with pytest.raises(ValueError, match="SAFEOPS_GLUON_BWD must be"):
        safeops.attention_backend(q, k, v, backward=True)


# (B, Hq, Hkv, Sq, Sk): MHA with partial blocks; GQA; MQA with Sq != Sk both ways (333: not a multiple of
# 4, so the statistics are padded); one query row.
SHAPES = [(2, 2, 2, 300, 300), (1, 4, 2, 200, 333), (1, 4, 1, 333, 77), (3, 2, 2, 1, 129)]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_matches_oracle(dtype, d, causal, rng, monkeypatch):
    for b, hq, hkv, sq, sk in SHAPES:
        q = rng.randn(b, hq, sq, d, dtype=dtype)
        k, v = (rng.randn(b, hkv, sk, d, dtype=dtype) for _ in range(2))
        _gluon_ran(monkeypatch, q, k, v, is_causal=causal)
        check_oracle(q, k, v, rng, is_causal=causal)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_mha_same_bits_as_the_triton_kernel(d, causal, rng, monkeypatch):
    """For MHA (no GQA split) the Gluon kernel sums the same blocks in the same order as the Triton dk/dv
    kernel: the path choice changes no bit."""
    for sq, sk in ((300, 300), (1000, 777), (64, 1000)):
        q, g = (rng.randn(2, 3, sq, d, dtype=BF16) for _ in range(2))
        k, v = (rng.randn(2, 3, sk, d, dtype=BF16) for _ in range(2))
        monkeypatch.setenv("SAFEOPS_GLUON_BWD", "1")
        _gluon_ran(monkeypatch, q, k, v, is_causal=causal)
        gluon = _grads(q, k, v, g, is_causal=causal)
        monkeypatch.setenv("SAFEOPS_GLUON_BWD", "0")
        triton = _grads(q, k, v, g, is_causal=causal)
        for name, a, b in zip("q k v".split(), gluon, triton, strict=True):
            assert torch.equal(a, b), f"d{name} differs between the Gluon and the Triton dk/dv ({sq}, {sk})"


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_gqa_split_same_bits_as_the_triton_kernel(causal, rng, monkeypatch):
    """GQA at D=64 (``attention_gluon.SPLIT_HEAD_DIMS``): both dK / dV kernels split a kv head's query group
    the same way (``dkdv_split``: one query head per CTA below a group of 4, two from 4 on), store fp32
    partials and sum them in one fixed-order launch, so the path choice changes no bit here either (groups
    2, 4, 8: splits 2, 2, 4)."""
    d = 64
    assert d in G.SPLIT_HEAD_DIMS
    for hkv, group, sq, sk in ((2, 2, 300, 300), (1, 4, 1000, 777), (2, 8, 200, 333)):
        assert L.dkdv_split(group, 1) == (group if group < 4 else group // 2)
        q, g = (rng.randn(2, hkv * group, sq, d, dtype=BF16) for _ in range(2))
        k, v = (rng.randn(2, hkv, sk, d, dtype=BF16) for _ in range(2))
        monkeypatch.setenv("SAFEOPS_GLUON_BWD", "1")
        _gluon_ran(monkeypatch, q, k, v, is_causal=causal)
        gluon = _grads(q, k, v, g, is_causal=causal)
        monkeypatch.setenv("SAFEOPS_GLUON_BWD", "0")
        triton = _grads(q, k, v, g, is_causal=causal)
        for name, a, b in zip("q k v".split(), gluon, triton, strict=True):
            assert torch.equal(a, b), f"d{name}: the Gluon and the Triton dk/dv differ (group {group})"


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_d128_split_of_large_groups(causal, rng, monkeypatch):
    """D=128 splits groups of 8 or more (``G.split_of``: GQA 16 / 2 heads in 4 slices, MQA 16 / 1 in 8): the
    float64 oracle, the same bits over reruns and for a batch element alone or among others; a group of 4 is
    left whole."""
    for hq, hkv, split in ((16, 2, 4), (16, 1, 8), (8, 2, 1)):
        L.clear_plans()
        q = rng.randn(3, hq, 333, 128, dtype=BF16)
        k, v = (rng.randn(3, hkv, 300, 128, dtype=BF16) for _ in range(2))
        _gluon_ran(monkeypatch, q, k, v, is_causal=causal)
        check_oracle(q, k, v, rng, is_causal=causal)
        plans = [p for p in L._gluon_bwd_plans.values() if p.__class__ is G.BwdPlan]
        assert plans and {p.split for p in plans} == {split}, (hq, hkv)
        g = rng.randn(3, hq, 333, 128, dtype=BF16)
        first = _grads(q, k, v, g, is_causal=causal)
        for _ in range(3):
            for a, b in zip(first, _grads(q, k, v, g, is_causal=causal), strict=True):
                assert torch.equal(a, b)
        alone = _grads(q[1:2], k[1:2], v[1:2], g[1:2], is_causal=causal)
        for name, a, b in zip("qkv", first, alone, strict=True):
            assert torch.equal(a[1:2], b), f"d{name}: batch element 1 alone differs ({hq} / {hkv} heads)"


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_pipelined_d64_same_bits_as_unpipelined(causal, rng, monkeypatch):
    """The D=64 kernel's software pipelining (GluonBwdConfig.pipeline) issues the same products in the same
    order as the unpipelined loop: the same dq / dk / dv bits, GQA, partial blocks and Sq != Sk included."""
    import dataclasses

    KB = G.bwd_kernels()
    q, g = (rng.randn(2, 8, 700, 64, dtype=BF16) for _ in range(2))
    k, v = (rng.randn(2, 2, 555, 64, dtype=BF16) for _ in range(2))
    _gluon_ran(monkeypatch, q, k, v, is_causal=causal)
    # (skip_masked is for unpipelined steps: off in both, so the pair differs in the pipelining alone.)
    two = dataclasses.replace(KB.BWD_CONFIGS[64], num_wg=2, consumer_regs=240, turns=0, skip_masked=False)
    grads = []
    for pipeline in (True, False):
        monkeypatch.setitem(KB.BWD_CONFIGS, 64, dataclasses.replace(two, pipeline=pipeline))
        L.clear_plans()
        grads.append(_grads(q, k, v, g, is_causal=causal))
    for name, a, b in zip("q k v".split(), *grads, strict=True):
        assert torch.equal(a, b), f"d{name} differs between the pipelined and the unpipelined D=64 kernel"


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_three_warpgroups_same_bits_as_two(causal, rng, monkeypatch):
    """The D=64 default, three consumer warpgroups (192 keys per CTA), gives the bits of two (128 keys per
    CTA, pipelined as before): each key's dK / dV row sums the same query blocks in the same order, and a
    causal CTA's extra leading query blocks add exact zeros (two warpgroups, pipelined) or are skipped (three,
    skip_masked); GQA, partial blocks and Sq != Sk included."""
    import dataclasses

    KB = G.bwd_kernels()
    q, g = (rng.randn(2, 8, 700, 64, dtype=BF16) for _ in range(2))
    k, v = (rng.randn(2, 2, 555, 64, dtype=BF16) for _ in range(2))
    _gluon_ran(monkeypatch, q, k, v, is_causal=causal)
    assert KB.BWD_CONFIGS[64].num_wg == 3
    three = _grads(q, k, v, g, is_causal=causal)
    plans = [p for p in L._gluon_bwd_plans.values() if p.__class__ is G.BwdPlan]
    assert plans and all(p.launch.kwargs["NUM_WG"] == 3 for p in plans)
    two = dataclasses.replace(KB.BWD_CONFIGS[64], num_wg=2, consumer_regs=240, pipeline=True, turns=0,
                              skip_masked=False)
    monkeypatch.setitem(KB.BWD_CONFIGS, 64, two)
    L.clear_plans()
    two = _grads(q, k, v, g, is_causal=causal)
    for name, a, b in zip("q k v".split(), three, two, strict=True):
        assert torch.equal(a, b), f"d{name} differs between three and two consumer warpgroups at D=64"


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_row_stats_same_bits(d, causal, rng, monkeypatch):
    """GluonBwdConfig.row_stats (each row's base and 1 / l computed once by attn_bwd_row_stats_kernel, with
    the kernel's own operations) gives the bits of the kernel that derives them at every step."""
    import dataclasses

    KB = G.bwd_kernels()
    q, g = (rng.randn(2, 8, 700, d, dtype=BF16) for _ in range(2))
    k, v = (rng.randn(2, 2, 555, d, dtype=BF16) for _ in range(2))
    _gluon_ran(monkeypatch, q, k, v, is_causal=causal)
    grads = []
    for over in ({"row_stats": False}, {"row_stats": True}):
        monkeypatch.setitem(KB.BWD_CONFIGS, d, dataclasses.replace(KB.BWD_CONFIGS[d], **over))
        L.clear_plans()
        grads.append(_grads(q, k, v, g, is_causal=causal))
    plans = [p for p in L._gluon_bwd_plans.values() if p.__class__ is G.BwdPlan]
    assert plans and all(p.launch.kwargs["PRE_STATS"] for p in plans)
    for name, a, b in zip("q k v".split(), *grads, strict=True):
        assert torch.equal(a, b), f"d{name} differs with the precomputed row statistics"


def test_deterministic_over_100_reruns(rng):
    q, g = (rng.randn(1, 8, 1000, 128, dtype=BF16) for _ in range(2))
    k, v = (rng.randn(1, 2, 1000, 128, dtype=BF16) for _ in range(2))
    first = _grads(q, k, v, g, is_causal=True)
    for _ in range(100):
        again = _grads(q, k, v, g, is_causal=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_batch_invariant_and_layout_independent(causal, rng):
    q, g = (rng.randn(3, 4, 500, 128, dtype=FP16) for _ in range(2))
    k, v = (rng.randn(3, 2, 500, 128, dtype=FP16) for _ in range(2))
    whole = _grads(q, k, v, g, is_causal=causal)
    alone = _grads(q[1:2], k[1:2], v[1:2], g[1:2], is_causal=causal)
    for a, b in zip(whole, alone, strict=True):
        assert torch.equal(a[1:2], b)
    # (B, S, H, D) memory (TMA reads it in place), and a head-dim slice of a wider tensor (16-byte rows
    # that TMA cannot stride over evenly: copied first)
    bshd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, g)]
    wide = [torch.cat([t, t[..., :4]], dim=-1)[..., :128] for t in (q, k, v, g)]
    for tensors in (bshd, wide):
        other = _grads(*tensors, is_causal=causal)
        for a, b in zip(whole, other, strict=True):
            assert torch.equal(a, b)


def test_keys_no_query_sees_get_zero(rng):
    """Causal with Sk > Sq: keys past the last query (top-left alignment) get dk = dv = 0 exactly."""
    q, g = (rng.randn(2, 4, 100, 128, dtype=BF16) for _ in range(2))
    k, v = (rng.randn(2, 4, 300, 128, dtype=BF16) for _ in range(2))
    _, dk, dv = _grads(q, k, v, g, is_causal=True)
    assert torch.equal(dk[:, :, 100:], torch.zeros_like(dk[:, :, 100:]))
    assert torch.equal(dv[:, :, 100:], torch.zeros_like(dv[:, :, 100:]))
    check_oracle(q, k, v, rng, is_causal=True)


def test_sinks(rng):
    q = rng.randn(2, 4, 300, 128, dtype=BF16)
    k, v = (rng.randn(2, 2, 300, 128, dtype=BF16) for _ in range(2))
    sinks = rng.randn(4, std=2.0)
    assert safeops.attention_backend(q, k, v, is_causal=True, sinks=sinks, backward=True)[0] == "gluon"
    check_sinks_oracle(q, k, v, sinks, rng, is_causal=True)


# The Gluon dQ kernel (attention_gluon.GLUON_DQ, on by default since 2026-12-05): dq from it, delta from a
# delta-only launch of the Triton dq kernel, dk / dv from the Gluon dK / dV kernel.

@pytest.fixture
def gluon_dq(monkeypatch):
    monkeypatch.setattr(G, "GLUON_DQ", True)
    monkeypatch.setattr(G, "DQ_HEAD_DIMS", (64, 128))  # the Gluon dQ kernel at D=64 too
    L.clear_plans()


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_gluon_dq_matches_oracle(dtype, d, causal, rng, monkeypatch, gluon_dq):
    for b, hq, hkv, sq, sk in SHAPES:
        q = rng.randn(b, hq, sq, d, dtype=dtype)
        k, v = (rng.randn(b, hkv, sk, d, dtype=dtype) for _ in range(2))
        _gluon_ran(monkeypatch, q, k, v, is_causal=causal)
        assert "Gluon dq" in safeops.attention_backend(q, k, v, is_causal=causal, backward=True)[1]
        check_oracle(q, k, v, rng, is_causal=causal)


def test_gluon_dq_deterministic_batch_invariant_and_sinks(rng, gluon_dq):
    q, g = (rng.randn(3, 8, 700, 128, dtype=BF16) for _ in range(2))
    k, v = (rng.randn(3, 2, 700, 128, dtype=BF16) for _ in range(2))
    first = _grads(q, k, v, g, is_causal=True)
    for _ in range(20):
        assert all(torch.equal(a, b) for a, b in zip(first, _grads(q, k, v, g, is_causal=True), strict=True))
    alone = _grads(q[2:], k[2:], v[2:], g[2:], is_causal=True)
    assert all(torch.equal(a[2:], b) for a, b in zip(first, alone, strict=True))
    check_sinks_oracle(q[:1, :4], k[:1, :1], v[:1, :1], rng.randn(4, std=2.0), rng, is_causal=True)


# The fused Gluon backward (by default for non-causal D=128, attention_gluon.FUSED_NONCAUSAL; everywhere it
# applies with GLUON_FUSED): dq, dk and dv in one kernel, each query block's dq partials added into an
# fp32 buffer in a fixed order of key blocks (turn counters), delta from a delta-only launch of the Triton dq
# kernel.


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_fused_is_the_noncausal_d128_default(dtype, rng, monkeypatch):
    """Without GLUON_FUSED: non-causal D=128 takes the fused kernel (TMA writer, shifted order, precomputed
    row statistics): float64 oracle (GQA / MQA, partial blocks, Sq != Sk), 20 reruns with the same bits,
    batch invariance, the (B, S, H, D) layout's bits; causal keeps the pair."""
    monkeypatch.setattr(G, "FUSED_NONCAUSAL", (128,))
    L.clear_plans()
    cfg = G.bwd_kernels().FUSED_CONFIGS[128]
    assert cfg.tma_reduce and cfg.shift and cfg.row_stats and not G.GLUON_FUSED
    fused = "non-causal D=128 on sm_90: fused Gluon dq, dk / dv (dq added in a fixed order)"
    for b, hq, hkv, sq, sk in SHAPES + [(1, 2, 1, 1000, 1000), (1, 2, 2, 130, 700)]:
        q = rng.randn(b, hq, sq, 128, dtype=dtype)
        k, v = (rng.randn(b, hkv, sk, 128, dtype=dtype) for _ in range(2))
        assert safeops.attention_backend(q, k, v, backward=True)[1].endswith(fused)
        causal = safeops.attention_backend(q, k, v, is_causal=True, backward=True)
        assert causal[1].endswith(": Gluon dq, dk / dv"), causal
        check_oracle(q, k, v, rng)
    q, g = (rng.randn(3, 8, 1000, 128, dtype=dtype) for _ in range(2))
    k, v = (rng.randn(3, 2, 1000, 128, dtype=dtype) for _ in range(2))
    first = _grads(q, k, v, g)
    for _ in range(20):
        assert all(torch.equal(a, b) for a, b in zip(first, _grads(q, k, v, g), strict=True))
    alone = _grads(q[2:], k[2:], v[2:], g[2:])
    assert all(torch.equal(a[2:], b) for a, b in zip(first, alone, strict=True))
    bshd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, g)]  # (B, S, H, D) storage
    assert all(torch.equal(a, b) for a, b in zip(first, _grads(*bshd), strict=True))


def test_fused_leaves_groups_past_its_limit_to_the_split_pair(rng, monkeypatch):
    """The shipped non-causal D=128 default: query groups of 8 take the fused kernel, groups of 16 and 32
    (past ``FUSED_MAX_GROUP``) the dK / dV + dQ pair with the group split (slices of 2 heads), whatever the
    batch: float64 oracle, the same bits over reruns and for a batch element alone."""
    monkeypatch.setattr(G, "FUSED_NONCAUSAL", (128,))
    for hq, hkv, split in ((8, 1, None), (16, 2, None), (32, 2, 8), (16, 1, 8), (32, 1, 16)):
        L.clear_plans()
        q, g = (rng.randn(3, hq, 260, 128, dtype=BF16) for _ in range(2))
        k, v = (rng.randn(3, hkv, 390, 128, dtype=BF16) for _ in range(2))
        check_oracle(q, k, v, rng)
        kinds = {p.__class__ for p in L._gluon_bwd_plans.values()}
        if split is None:
            assert kinds == {G.FusedPlan}, (hq, hkv, kinds)
        else:
            plans = [p for p in L._gluon_bwd_plans.values() if p.__class__ is G.BwdPlan]
            assert plans and {p.split for p in plans} == {split} and G.FusedPlan not in kinds, (hq, hkv)
        first = _grads(q, k, v, g)
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(first, _grads(q, k, v, g), strict=True))
        alone = _grads(q[1:2], k[1:2], v[1:2], g[1:2])
        assert all(torch.equal(a[1:2], b) for a, b in zip(first, alone, strict=True)), (hq, hkv)


def test_fused_takes_longer_keys_in_the_plain_order(rng, monkeypatch):
    """Past half the SMs' worth of key blocks, the head dims of FUSED_PLAIN_NONCAUSAL keep the fused kernel in
    the plain order (SHIFT off): float64 oracle, reruns with the same bits; the others take the pair."""
    monkeypatch.setattr(G, "FUSED_NONCAUSAL", (64, 128))
    monkeypatch.setattr(G, "FUSED_PLAIN_NONCAUSAL", (128,))
    L.clear_plans()
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for d in (64, 128):
        block_n = G.bwd_kernels().FUSED_CONFIGS[d].block_n
        q, g = (rng.randn(1, 4, 200, d, dtype=BF16) for _ in range(2))
        k, v = (rng.randn(1, 2, sms // 2 * block_n + 1, d, dtype=BF16) for _ in range(2))
        path = safeops.attention_backend(q, k, v, backward=True)[1]
        assert ("fused Gluon" in path) is (d == 128), path
        check_oracle(q, k, v, rng)
        first = _grads(q, k, v, g)
        for _ in range(10):
            assert all(torch.equal(a, b) for a, b in zip(first, _grads(q, k, v, g), strict=True))
    assert _shift_plans() == [False]


@pytest.fixture
def gluon_fused(monkeypatch):
    monkeypatch.setattr(G, "GLUON_FUSED", True)
    L.clear_plans()


@pytest.fixture
def gluon_fused_tma(monkeypatch, gluon_fused):
    """The fused backward with its TMA reduce-add writer (GluonFusedConfig.tma_reduce, finalize off: each
    query block's first turn stores its partial into the fp32 buffer, the later turns add, dq = scale *
    buffer after the kernel); at D=64 with dQ split by head-dim columns, which the TMA writer needs."""
    import dataclasses

    KB = G.bwd_kernels()
    for d in (64, 128):
        monkeypatch.setitem(KB.FUSED_CONFIGS, d, dataclasses.replace(
            KB.FUSED_CONFIGS[d], tma_reduce=True, finalize=False, split_d=True))
    L.clear_plans()


def _fused_oracle(dtype, d, causal, rng):
    for b, hq, hkv, sq, sk in SHAPES + [(1, 2, 1, 1000, 1000), (1, 2, 2, 130, 700)]:
        q = rng.randn(b, hq, sq, d, dtype=dtype)
        k, v = (rng.randn(b, hkv, sk, d, dtype=dtype) for _ in range(2))
        assert "fused Gluon" in safeops.attention_backend(q, k, v, is_causal=causal, backward=True)[1]
        check_oracle(q, k, v, rng, is_causal=causal)


def _fused_deterministic(causal, rng, d=128):
    q, g = (rng.randn(3, 8, 1000, d, dtype=BF16) for _ in range(2))
    k, v = (rng.randn(3, 2, 1000, d, dtype=BF16) for _ in range(2))
    first = _grads(q, k, v, g, is_causal=causal)
    for _ in range(100):
        again = _grads(q, k, v, g, is_causal=causal)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    alone = _grads(q[1:2], k[1:2], v[1:2], g[1:2], is_causal=causal)
    assert all(torch.equal(a[1:2], b) for a, b in zip(first, alone, strict=True))


def _fused_keys_no_query_sees_and_sinks(rng):
    q, g = (rng.randn(2, 4, 100, 128, dtype=BF16) for _ in range(2))
    k, v = (rng.randn(2, 4, 300, 128, dtype=BF16) for _ in range(2))
    dq, dk, dv = _grads(q, k, v, g, is_causal=True)
    assert torch.all(dk[:, :, 100:] == 0) and torch.all(dv[:, :, 100:] == 0)
    assert torch.isfinite(dq).all()
    q = rng.randn(2, 4, 300, 128, dtype=BF16)
    k, v = (rng.randn(2, 2, 300, 128, dtype=BF16) for _ in range(2))
    sinks = rng.randn(4, std=2.0)
    assert "fused Gluon" in safeops.attention_backend(q, k, v, is_causal=True, sinks=sinks, backward=True)[1]
    check_sinks_oracle(q, k, v, sinks, rng, is_causal=True)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_fused_matches_oracle(dtype, d, causal, rng, gluon_fused):
    _fused_oracle(dtype, d, causal, rng)


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_fused_deterministic_over_100_reruns_and_batch_invariant(causal, rng, gluon_fused):
    _fused_deterministic(causal, rng)


def test_fused_keys_no_query_sees_and_sinks(rng, gluon_fused):
    _fused_keys_no_query_sees_and_sinks(rng)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_fused_tma_matches_oracle(dtype, d, causal, rng, gluon_fused_tma):
    assert G.bwd_kernels().FUSED_CONFIGS[d].tma_reduce
    _fused_oracle(dtype, d, causal, rng)


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_fused_tma_deterministic_over_100_reruns_and_batch_invariant(causal, d, rng, gluon_fused_tma):
    _fused_deterministic(causal, rng, d)


def test_fused_tma_keys_no_query_sees_and_sinks(rng, gluon_fused_tma):
    _fused_keys_no_query_sees_and_sinks(rng)


@pytest.fixture
def gluon_fused_shift(monkeypatch, gluon_fused):
    """The fused backward at D=128 with the TMA writer, the shifted order (GluonFusedConfig.shift: CTAs head
    by head, each from its own first query block, turns from each block's home key block) and the writer
    waiting for turns early."""
    import dataclasses

    KB = G.bwd_kernels()
    monkeypatch.setitem(KB.FUSED_CONFIGS, 128, dataclasses.replace(
        KB.FUSED_CONFIGS[128], tma_reduce=True, finalize=False, shift=True, early_turn=True))
    L.clear_plans()


def _shift_plans() -> list[bool]:
    """SHIFT of every fused plan made so far."""
    return [p.launch.kwargs["SHIFT"] for p in L._gluon_bwd_plans.values() if p.__class__ is G.FusedPlan]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_fused_shift_matches_oracle(dtype, rng, gluon_fused_shift):
    _fused_oracle(dtype, 128, False, rng)
    assert _shift_plans() and all(_shift_plans())


def test_fused_shift_deterministic_over_100_reruns_and_batch_invariant(rng, gluon_fused_shift):
    _fused_deterministic(False, rng)


def test_fused_shift_with_half_the_sms_holding_a_key_block(rng, gluon_fused_shift):
    """As many key blocks per head as half the SMs (the most the shifted order takes), four heads; one more
    key block falls back to the plain order."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    q = rng.randn(1, 4, 256, 128, dtype=BF16)
    k, v = (rng.randn(1, 4, sms // 2 * 128, 128, dtype=BF16) for _ in range(2))
    check_oracle(q, k, v, rng)
    assert _shift_plans() == [True]
    L.clear_plans()
    k, v = (rng.randn(1, 4, sms // 2 * 128 + 1, 128, dtype=BF16) for _ in range(2))
    check_oracle(q, k, v, rng)
    assert _shift_plans() == [False]


@pytest.fixture
def gluon_fused_lpt(monkeypatch, gluon_fused):
    """The fused backward at D=128 with the TMA writer and, causal, the CTAs longest first with each query
    block's turns ascending (GluonFusedConfig.causal_lpt)."""
    import dataclasses

    KB = G.bwd_kernels()
    monkeypatch.setitem(KB.FUSED_CONFIGS, 128, dataclasses.replace(
        KB.FUSED_CONFIGS[128], tma_reduce=True, finalize=False, causal_lpt=True, early_turn=True))
    L.clear_plans()


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_fused_lpt_matches_oracle(dtype, rng, gluon_fused_lpt):
    _fused_oracle(dtype, 128, True, rng)
    plans = [p for p in L._gluon_bwd_plans.values() if p.__class__ is G.FusedPlan]
    assert plans and all(p.launch.kwargs["LPT"] for p in plans)


def test_fused_lpt_deterministic_over_100_reruns_and_batch_invariant(rng, gluon_fused_lpt):
    _fused_deterministic(True, rng)


def test_fused_lpt_keys_no_query_sees_and_sinks(rng, gluon_fused_lpt):
    _fused_keys_no_query_sees_and_sinks(rng)


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_fused_operand_orders_same_bits(causal, rng, monkeypatch, gluon_fused):
    """GluonFusedConfig.st_dpt_together (S^T and dP^T in flight at once), ds_rs (dK's dS^T from registers) and
    dq_early (dQ between dV and dK, its partial stored while dK runs) change when and from where the same
    products run, not what they add, and row_stats (each row's base and 1 / l computed once, with the
    kernel's operations) not what P is: dq, dk and dv keep the TMA writer's bits."""
    import dataclasses

    KB = G.bwd_kernels()
    base = dataclasses.replace(KB.FUSED_CONFIGS[128], tma_reduce=True, finalize=False, row_stats=False)
    q, g = (rng.randn(2, 4, 700, 128, dtype=BF16) for _ in range(2))
    k, v = (rng.randn(2, 2, 700, 128, dtype=BF16) for _ in range(2))
    results = []
    for over in ({}, {"st_dpt_together": True}, {"ds_rs": True}, {"st_dpt_together": True, "ds_rs": True},
                 {"dq_early": True}, {"dq_early": True, "st_dpt_together": True}, {"row_stats": True}):
        monkeypatch.setitem(KB.FUSED_CONFIGS, 128, dataclasses.replace(base, **over))
        L.clear_plans()
        assert "fused Gluon" in safeops.attention_backend(q, k, v, is_causal=causal, backward=True)[1]
        results.append(_grads(q, k, v, g, is_causal=causal))
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], got, strict=True))


# Packed sequences and a left window on the Gluon dK / dV and dQ kernels (attention_gluon.GLUON_BWD_SEQ; the
# launcher takes them at the head dims of SEQ_HEAD_DIMS, these tests at D=64 too).

@pytest.fixture
def gluon_bwd_seq(monkeypatch):
    monkeypatch.setattr(G, "GLUON_BWD_SEQ", True)
    monkeypatch.setattr(G, "SEQ_HEAD_DIMS", (64, 128))
    monkeypatch.setenv("SAFEOPS_GLUON_BWD", "1")  # D=64 causal too
    L.clear_plans()


SEQ_OPTIONS = {"dense": dict(), "causal": dict(is_causal=True), "causal_window": dict(is_causal=True,
               window=(100, None)), "left_window": dict(window=(77, None))}


def _packed_grads(seqs, gs, **options):
    """dq, dk, dv of attention_varlen over the sequences (each (1, H, S, D)) packed back to back."""
    packed = [torch.cat([s[i][0].transpose(0, 1) for s in seqs]).requires_grad_() for i in range(3)]
    g = torch.cat([x[0].transpose(0, 1) for x in gs])
    lengths = [s[0].shape[2] for s in seqs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    assert safeops.attention_backend(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu, backward=True,
                                     **options)[0] == "gluon"
    out = safeops.attention_varlen(*packed, cu, cu, **options)
    return torch.autograd.grad(out, packed, g), cu


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("options", SEQ_OPTIONS.values(), ids=SEQ_OPTIONS.keys())
@pytest.mark.parametrize("heads", [(4, 2), (16, 2)], ids=["group2", "group8"])
def test_seq_packed_equals_dense_values(d, options, heads, rng, gluon_bwd_seq):
    """Each packed sequence's gradients are those of the same sequence alone in a dense call (its rows past
    the sequence's end, which a packed tile also loads, selected away; its last blocks stored by masked
    stores): lengths around the 64- / 128-row blocks, an empty sequence, one row, GQA (groups of 2 and 8:
    the dK / dV split at both head dims for the latter)."""
    hq, hkv = heads
    lengths = [300, 1, 0, 1029, 64, 129, 65]
    seqs = [[rng.randn(1, h, n, d, dtype=BF16) for h in (hq, hkv, hkv)] for n in lengths]
    gs = [rng.randn(1, hq, n, d, dtype=BF16) for n in lengths]
    (dq, dk, dv), cu = _packed_grads(seqs, gs, **options)
    for b, (s, g) in enumerate(zip(seqs, gs, strict=True)):
        if lengths[b] == 0:
            continue
        assert safeops.attention_backend(*s, backward=True, **options)[0] == "gluon"
        alone = _grads(*s, g, **options)
        sl = slice(int(cu[b]), int(cu[b + 1]))
        for name, packed, a in zip("qkv", (dq, dk, dv), alone, strict=True):
            assert torch.equal(packed[sl], a[0].transpose(0, 1)), f"d{name}, sequence {b} ({lengths[b]} rows)"


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_seq_window_matches_oracle(dtype, d, causal, rng, gluon_bwd_seq):
    for (b, hq, hkv, sq, sk), wl in zip(SHAPES, (100, 0, 63, 5), strict=True):
        q = rng.randn(b, hq, sq, d, dtype=dtype)
        k, v = (rng.randn(b, hkv, sk, d, dtype=dtype) for _ in range(2))
        options = dict(is_causal=causal, window=(wl, None))
        assert safeops.attention_backend(q, k, v, backward=True, **options)[0] == "gluon"
        check_oracle(q, k, v, rng, **options)


@pytest.mark.parametrize("d", [64, 128])
def test_seq_window_same_values_as_the_triton_kernels(d, rng, monkeypatch, gluon_bwd_seq):
    """MHA with a window: the Gluon kernels visit the Triton kernels' blocks in their order (plus blocks the
    window excludes entirely, which add zeros): the same values."""
    for causal, wl in ((True, 200), (False, 130)):
        q, g = (rng.randn(2, 3, 700, d, dtype=BF16) for _ in range(2))
        k, v = (rng.randn(2, 3, 700, d, dtype=BF16) for _ in range(2))
        options = dict(is_causal=causal, window=(wl, None))
        gluon = _grads(q, k, v, g, **options)
        monkeypatch.setenv("SAFEOPS_GLUON_BWD", "0")
        triton = _grads(q, k, v, g, **options)
        monkeypatch.setenv("SAFEOPS_GLUON_BWD", "1")
        for name, a, b in zip("qkv", gluon, triton, strict=True):
            assert torch.equal(a, b), f"d{name} differs from the Triton kernels' (causal {causal}, wl {wl})"


def test_seq_deterministic_and_sinks(rng, gluon_bwd_seq):
    lengths = [1000, 37, 513]
    seqs = [[rng.randn(1, h, n, 128, dtype=BF16) for h in (8, 2, 2)] for n in lengths]
    gs = [rng.randn(1, 8, n, 128, dtype=BF16) for n in lengths]
    options = dict(is_causal=True, window=(300, None))
    first, _ = _packed_grads(seqs, gs, **options)
    for _ in range(20):
        again, _ = _packed_grads(seqs, gs, **options)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    q = rng.randn(1, 4, 300, 128, dtype=BF16)
    k, v = (rng.randn(1, 2, 300, 128, dtype=BF16) for _ in range(2))
    check_sinks_oracle(q, k, v, rng.randn(4, std=2.0), rng, is_causal=True, window=(90, None))


@pytest.mark.parametrize(("d", "pipeline"), [(64, True), (64, False), (128, False)])
@pytest.mark.parametrize("options", SEQ_OPTIONS.values(), ids=SEQ_OPTIONS.keys())
def test_thread_arrive_same_bits(d, pipeline, options, rng, monkeypatch, gluon_bwd_seq):
    """GluonBwdConfig.thread_arrive (Q / dO slots released by per-thread arrives; on at D=64) gives the
    bits of one elected arrive, in the pipelined loop (D=64's) and the plain one: dense GQA with partial
    blocks and Sq != Sk, and packed sequences (an empty one, one row, GQA) with and without a window."""
    import dataclasses

    KB = G.bwd_kernels()
    q, g = (rng.randn(2, 8, 700, d, dtype=BF16) for _ in range(2))
    k, v = (rng.randn(2, 2, 555, d, dtype=BF16) for _ in range(2))
    lengths = [300, 1, 0, 1029, 64, 129]
    seqs = [[rng.randn(1, h, n, d, dtype=BF16) for h in (4, 2, 2)] for n in lengths]
    gs = [rng.randn(1, 4, n, d, dtype=BF16) for n in lengths]
    _gluon_ran(monkeypatch, q, k, v, **options)
    results = []
    for flag in (False, True):
        # Pipelined: the two-warpgroup kernel (three at 160 registers would serialize the wgmma).
        shape = dict(num_wg=2, consumer_regs=240, turns=0, skip_masked=False) if pipeline else {}
        monkeypatch.setitem(KB.BWD_CONFIGS, d, dataclasses.replace(KB.BWD_CONFIGS[d], pipeline=pipeline,
                                                                    thread_arrive=flag, **shape))
        L.clear_plans()
        dense = _grads(q, k, v, g, **options)
        packed, _ = _packed_grads(seqs, gs, **options)
        results.append((*dense, *packed))
    plans = [p for p in L._gluon_bwd_plans.values() if p.__class__ is G.BwdPlan]
    flags = [(p.launch.kwargs["PIPELINE"], p.launch.kwargs["THREAD_ARRIVE"]) for p in plans]
    assert flags and set(flags) == {(pipeline, True)}, flags
    for name, a, b in zip(("dq", "dk", "dv", "packed dq", "packed dk", "packed dv"), *results, strict=True):
        assert torch.equal(a, b), f"{name} differs with thread_arrive (D={d}, pipeline {pipeline}, {options})"


@pytest.mark.parametrize("turns", [1, 2])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("options", SEQ_OPTIONS.values(), ids=SEQ_OPTIONS.keys())
def test_turns_same_bits(d, turns, options, rng, monkeypatch, gluon_bwd_seq):
    """GluonBwdConfig.turns (the consumer warpgroups take turns issuing their products) gives the bits
    without turns, and every warpgroup of a CTA takes the same number of turns (no hang): dense GQA with
    partial blocks and Sq != Sk, causal or not, and packed sequences (an empty one, one row, GQA) with and
    without a window."""
    import dataclasses

    KB = G.bwd_kernels()
    q, g = (rng.randn(2, 8, 700, d, dtype=BF16) for _ in range(2))
    k, v = (rng.randn(2, 2, 555, d, dtype=BF16) for _ in range(2))
    lengths = [300, 1, 0, 1029, 64, 129]
    seqs = [[rng.randn(1, h, n, d, dtype=BF16) for h in (4, 2, 2)] for n in lengths]
    gs = [rng.randn(1, 4, n, d, dtype=BF16) for n in lengths]
    _gluon_ran(monkeypatch, q, k, v, **options)
    results = []
    for t in (0, turns):
        monkeypatch.setitem(KB.BWD_CONFIGS, d, dataclasses.replace(KB.BWD_CONFIGS[d], turns=t))
        L.clear_plans()
        dense = _grads(q, k, v, g, **options)
        packed, _ = _packed_grads(seqs, gs, **options)
        results.append((*dense, *packed))
    plans = [p for p in L._gluon_bwd_plans.values() if p.__class__ is G.BwdPlan]
    assert plans and {p.launch.kwargs["TURNS"] for p in plans} == {turns}
    for name, a, b in zip(("dq", "dk", "dv", "packed dq", "packed dk", "packed dv"), *results, strict=True):
        assert torch.equal(a, b), f"{name} differs with turns={turns} (D={d}, {options})"


@pytest.mark.parametrize(("d", "turns"), [(64, 1), (64, 0), (128, 0), (128, 2)])
@pytest.mark.parametrize("options", [SEQ_OPTIONS["causal"], SEQ_OPTIONS["causal_window"]],
                         ids=["causal", "causal_window"])
def test_skip_masked_same_bits(d, turns, options, rng, monkeypatch, gluon_bwd_seq):
    """GluonBwdConfig.skip_masked (causal: a warpgroup skips the products of the query blocks before all of
    its keys, taking only their turns and releasing their slots) gives the bits of the kernel that runs
    them on zeros, without a hang: Sq > Sk and Sq < Sk with GQA and partial blocks, a group of 8 (the dK /
    dV split's fp32 partials), packed sequences (an empty one, one row, GQA), with and without a window,
    with and without turns."""
    import dataclasses

    KB = G.bwd_kernels()
    shapes = [(2, 8, 2, 700, 555), (1, 4, 1, 333, 1000), (1, 16, 2, 1100, 1100)]
    dense_in = []
    for b, hq, hkv, sq, sk in shapes:
        q, g = (rng.randn(b, hq, sq, d, dtype=BF16) for _ in range(2))
        k, v = (rng.randn(b, hkv, sk, d, dtype=BF16) for _ in range(2))
        dense_in.append((q, k, v, g))
    lengths = [300, 1, 0, 1029, 64, 129]
    seqs = [[rng.randn(1, h, n, d, dtype=BF16) for h in (4, 2, 2)] for n in lengths]
    gs = [rng.randn(1, 4, n, d, dtype=BF16) for n in lengths]
    _gluon_ran(monkeypatch, *dense_in[0][:3], **options)
    results = []
    for flag in (False, True):
        monkeypatch.setitem(KB.BWD_CONFIGS, d, dataclasses.replace(KB.BWD_CONFIGS[d], turns=turns,
                                                                    skip_masked=flag))
        L.clear_plans()
        grads = [t for q, k, v, g in dense_in for t in _grads(q, k, v, g, **options)]
        packed, _ = _packed_grads(seqs, gs, **options)
        results.append((*grads, *packed))
    plans = [p for p in L._gluon_bwd_plans.values() if p.__class__ is G.BwdPlan]
    assert plans and {p.launch.kwargs["SKIP_MASKED"] for p in plans} == {True}
    names = [f"d{x} of {shape}" for shape in shapes for x in "qkv"] + ["packed dq", "packed dk", "packed dv"]
    for name, a, b in zip(names, *results, strict=True):
        assert torch.equal(a, b), f"{name} differs with skip_masked (D={d}, turns={turns}, {options})"
