"""safeops.attention_backend and the path choice behind it (safeops.ops.attention_gluon), on CPU and meta
tensors, plus the Gluon launch's arguments with the kernel replaced by a recorder (the kernel itself runs in
tests/test_attention_gluon_gpu.py and compiles offline in tests/test_attention_gluon_offline.py).

- The reasons a person reads: each thing the Gluon kernel does not take names itself; fp64 and CPU tensors
  name the reference; ``SAFEOPS_GLUON=0`` and a forced Triton configuration name themselves.
- The answer depends on no size and no layout (batch invariance, contract section 6): with the device check
  accepting CPU tensors, every batch size, head count, sequence length, GQA group and memory layout of a
  problem gets the same answer.
- Bad arguments raise what ``safeops.attention`` / ``attention_varlen`` raise.
- ``attention_launch.forward`` runs a Gluon plan exactly when the check says so, keeps it, and reuses it.
- The launch arguments match the kernel's signature (what the offline test compiles), in order; layouts TMA
  can read go in place, others are copied; o keeps q's layout.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import safeops
from safeops.kernels import attention_gluon as K
from safeops.ops import attention_gluon as G
from safeops.ops import attention_launch as L

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _settings(monkeypatch):
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")  # CPU tensors run the Triton kernels (interpreted)
    monkeypatch.delenv("SAFEOPS_GLUON", raising=False)
    yield
    L.clear_plans()


def _qkv(d=64, dtype=BF16, b=1, hq=2, hkv=2, sq=64, sk=64, dv=None, device="cpu"):
    q = torch.zeros(b, hq, sq, d, dtype=dtype, device=device)
    k = torch.zeros(b, hkv, sk, d, dtype=dtype, device=device)
    v = torch.zeros(b, hkv, sk, dv or d, dtype=dtype, device=device)
    return q, k, v


def _on_hopper(monkeypatch):
    """The device check accepts CPU tensors (as an sm_90 GPU): the rest of the check is what answers."""
    monkeypatch.setattr(G, "device_reason", lambda device: "")
    monkeypatch.setattr(G, "_arch", lambda index: "sm_90")
    monkeypatch.setattr(G, "_num_sms", lambda index: 132)  # an H100 / H200 (persistent grids size by it)


@pytest.mark.parametrize(
    ("make", "options", "path", "reason"),
    [
        (dict(dtype=torch.float32), {}, "triton", "the Gluon kernel takes bf16 or fp16, not float32"),
        (dict(dtype=torch.float64), {}, "reference", "float64 inputs run the float64 reference"),
        (dict(d=96), {}, "triton", "head dim 96: the Gluon kernel has head dims 64, 128, 256"),
        (dict(d=64, dv=128), {}, "triton", "v's head dim 128 is not q's 64"),
        (dict(), {"softcap": 30.0}, "triton", "head dim 64 with softcap: the Triton forward"),
        (dict(d=128), {"softcap": 30.0}, "triton", "head dim 128 with softcap: the Triton forward"),
        (dict(d=128), {"softcap": 30.0, "is_causal": True}, "triton", "needs a CUDA device; q is on cpu"),
        (dict(d=256), {"softcap": 30.0}, "triton", "needs a CUDA device; q is on cpu"),
        (dict(), {"attn_mask": torch.ones(64, 64, dtype=torch.bool)}, "triton",
         "the Gluon kernel does not take an attention mask"),
        (dict(), {"attn_mask": torch.zeros(64, 64)}, "triton",
         "the Gluon kernel does not take an attention mask"),
        (dict(), {"window": (16, 16)}, "triton", "the Gluon kernel does not take a sliding window"),
        (dict(), {"window": (None, 0)}, "triton", "the Gluon kernel does not take a sliding window"),
        # A left window (causal or not) and sinks are the kernel's: the device answers.
        (dict(), {"is_causal": True, "window": (16, None)}, "triton", "needs a CUDA device; q is on cpu"),
        (dict(), {"sinks": torch.zeros(2)}, "triton", "needs a CUDA device; q is on cpu"),
        # Unbounded sides are no window; causal alone is what the kernel takes: the device answers.
        (dict(), {"is_causal": True, "window": (None, None)}, "triton", "needs a CUDA device; q is on cpu"),
        (dict(), {"window": (-1, -1), "return_lse": True}, "triton", "needs a CUDA device; q is on cpu"),
        (dict(device="meta"), {}, "triton", "needs a CUDA device; q is on meta"),
    ],
)
def test_reasons(make, options, path, reason):
    q, k, v = _qkv(**make)
    got = safeops.attention_backend(q, k, v, **options)
    assert got[0] == path and reason in got[1], got


def test_reference_and_settings_reasons(monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setenv("SAFEOPS_BACKEND", "auto")
    assert safeops.attention_backend(q, k, v) == (
        "reference", "cpu tensors run the pure-torch reference (SAFEOPS_BACKEND=auto)")
    monkeypatch.setenv("SAFEOPS_BACKEND", "reference")
    assert safeops.attention_backend(q, k, v) == ("reference", "SAFEOPS_BACKEND=reference")
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    _on_hopper(monkeypatch)
    assert safeops.attention_backend(q, k, v, is_causal=True) == ("gluon", "bf16 causal D=64 on sm_90")
    for off in ("0", "off", "false"):
        monkeypatch.setenv("SAFEOPS_GLUON", off)
        assert safeops.attention_backend(q, k, v) == ("triton", "SAFEOPS_GLUON=0 turns the Gluon forward off")
    monkeypatch.setenv("SAFEOPS_GLUON", "1")
    assert safeops.attention_backend(q, k, v)[0] == "gluon"
    with L.config_override(fwd=L.AttnConfig(64, 64, 4, 2)):
        assert safeops.attention_backend(q, k, v) == (
            "triton", "a Triton forward configuration is forced (attention_launch.config_override)")
    monkeypatch.setenv("SAFEOPS_GLUON", "maybe")
    with pytest.raises(ValueError, match="SAFEOPS_GLUON must be 1"):
        safeops.attention_backend(q, k, v)


def test_answer_depends_on_no_size_or_layout(monkeypatch):
    """Per (dtype, head dim, options): the same answer for every batch size, head count, GQA group,
    sequence length (partial blocks, Sq != Sk, no keys), packed batch and memory layout."""
    _on_hopper(monkeypatch)
    shapes = [(1, 2, 2, 64, 64), (7, 2, 2, 64, 64), (3, 8, 2, 1, 5000), (2, 4, 1, 333, 200), (1, 1, 1, 77, 0)]
    for dtype in (BF16, torch.float16, torch.float32):
        for d in (32, 64, 128, 256):
            for options in ({}, {"is_causal": True}, {"softcap": 5.0}, {"window": (8, 0)}):
                answers = set()
                for b, hq, hkv, sq, sk in shapes:
                    q, k, v = _qkv(d, dtype, b, hq, hkv, sq, sk)
                    answers.add(safeops.attention_backend(q, k, v, **options))
                    # (B, S, H, D) memory; a slice of a wider buffer (rows of D + 8 elements, base offset)
                    bshd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
                    answers.add(safeops.attention_backend(*bshd, **options))
                    wide = [torch.zeros(*t.shape[:-1], t.shape[-1] + 8, dtype=dtype)[..., 1:1 + t.shape[-1]]
                            for t in (q, k, v)]
                    answers.add(safeops.attention_backend(*wide, **options))
                    packed = [torch.zeros(t.shape[0] * t.shape[2], t.shape[1], d, dtype=dtype)
                              for t in (q, k, v)]
                    cu_q = torch.tensor([0, b * sq], dtype=torch.int32)
                    cu_k = torch.tensor([0, b * sk], dtype=torch.int32)
                    path, why = safeops.attention_backend(*packed, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                          **options)
                    answers.add((path, why.replace(" packed (varlen)", "")))
                assert len(answers) == 1, (dtype, d, options, answers)
                (answer,) = answers
                takes = (dtype != torch.float32 and d != 32 and "window" not in options
                         and ("softcap" not in options or d == 256))  # softcap: G.SOFTCAP_CASES
                assert (answer[0] == "gluon") == takes, (dtype, d, options, answer)


def test_varlen_answer(monkeypatch):
    _on_hopper(monkeypatch)
    q = torch.zeros(100, 4, 128, dtype=torch.float16)
    k = torch.zeros(90, 2, 128, dtype=torch.float16)
    cu_q = torch.tensor([0, 30, 30, 100], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 40, 90], dtype=torch.int32)
    assert safeops.attention_backend(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, is_causal=True) == (
        "gluon", "fp16 causal D=128 packed (varlen) on sm_90")


@pytest.mark.parametrize(
    "case",
    [
        dict(shapes=((1, 2, 64, 64), (1, 2, 64, 128), (1, 2, 64, 128))),  # head dims differ
        dict(shapes=((1, 3, 64, 64), (1, 2, 64, 64), (1, 2, 64, 64))),  # 3 heads over 2 kv heads
        dict(shapes=((2, 64, 64),) * 3),  # not (B, H, S, D)
        dict(shapes=((1, 2, 64, 64), (2, 2, 64, 64), (2, 2, 64, 64))),  # batch sizes differ
        dict(shapes=((1, 2, 64, 64),) * 3, attn_mask=torch.ones(3, 3, dtype=torch.bool)),
        dict(shapes=((1, 2, 64, 64),) * 3, scale="big"),
        dict(shapes=((1, 2, 64, 64),) * 3, window=(1, 2, 3)),
        dict(shapes=((1, 2, 64, 64),) * 3, is_causal=1),
        dict(shapes=((1, 2, 64, 64),) * 3, dtype=torch.int32),
    ],
)
def test_bad_arguments_raise_as_attention_does(case):
    case = dict(case)
    dtype = case.pop("dtype", BF16)
    q, k, v = (torch.zeros(s, dtype=dtype) for s in case.pop("shapes"))
    with pytest.raises((TypeError, ValueError)) as expected:
        safeops.attention(q, k, v, **case)
    with pytest.raises(expected.type, match=str(expected.value).replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        safeops.attention_backend(q, k, v, **case)


def test_bad_varlen_arguments():
    q = torch.zeros(10, 2, 64, dtype=BF16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="pass both cu_seqlens_q and cu_seqlens_k"):
        safeops.attention_backend(q, q, q, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="takes no attn_mask"):
        safeops.attention_backend(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, attn_mask=torch.ones(10, 10))
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32"):
        safeops.attention_backend(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu.long())
    with pytest.raises(ValueError, match="one batch size"):
        safeops.attention_backend(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=torch.tensor([0, 5, 10],
                                                                                       dtype=torch.int32))


# ------------------------------------------------------------------------------------------------------
# The dispatch, and the Gluon launch's arguments (kernel replaced by a recorder).
# ------------------------------------------------------------------------------------------------------

class _Recorder:
    launches: list = []

    def __init__(self, kernel, grid, kwargs):
        self.kernel, self.grid, self.kwargs = kernel, grid, kwargs

    def __call__(self, *args):
        _Recorder.launches.append((self.grid, self.kwargs, args))


@pytest.fixture
def recorded(monkeypatch):
    from safeops.ops import _launch

    _Recorder.launches = []
    monkeypatch.setattr(_launch, "KernelLaunch", _Recorder)
    return _Recorder.launches


def test_forward_runs_a_gluon_plan_exactly_when_the_check_says_so(monkeypatch, recorded):
    q, k, v = _qkv(sq=100, sk=70)
    options = (None, 0, None, None, 100, 70, True, 0.125, None, -1, 0, 0)
    _on_hopper(monkeypatch)
    o, m, l = L.forward(q, k, v, *options)
    assert len(recorded) == 1 and o.shape == q.shape and m.shape == l.shape == (1, 2, 100)
    (plan,) = L._fwd_plans.values()
    assert plan.__class__ is G.Plan
    L.forward(q, k, v, *options)  # the kept plan launches again
    assert len(recorded) == 2 and list(L._fwd_plans.values()) == [plan]
    monkeypatch.setenv("SAFEOPS_GLUON", "0")  # the Triton kernels (interpreted here), and a Triton plan
    o, m, l = L.forward(q, k, v, *options)
    assert len(recorded) == 2 and not any(p.__class__ is G.Plan for p in L._fwd_plans.values())
    masked = (torch.ones(1, 2, 100, 70, dtype=torch.bool), 1, *options[2:])
    monkeypatch.setenv("SAFEOPS_GLUON", "1")
    L.forward(q, k, v, *masked)  # a mask: Triton
    assert len(recorded) == 2


def _arg_kinds(args) -> list[str]:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32"}
    kinds = []
    for a in args:
        if isinstance(a, TensorDescriptor):
            block = ", ".join(map(str, a.block_shape))
            kinds.append(f"tensordesc<{short[a.base.dtype]}[{block}],{a.layout!r}>")
        elif isinstance(a, torch.Tensor):
            kinds.append("*" + short[a.dtype])
        else:
            kinds.append({int: "i32", float: "fp32"}[type(a)])
    return kinds


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("d", K.HEAD_DIMS)
@pytest.mark.parametrize("varlen", [False, True])
def test_launch_matches_the_compiled_signature(dtype, d, varlen, monkeypatch, recorded):
    """The launch's arguments are, in order, of the types the offline test compiles (K.signature), with its
    constexprs; descriptors address what the kernel expects (dense (B, H, S, D) views, or (1, H, T, D)
    over packed tensors); inputs TMA can read are not copied."""
    _on_hopper(monkeypatch)
    monkeypatch.setattr(G, "_num_sms", lambda index: 5)  # fewer SMs than tiles: the persistent grid shows
    if varlen:
        q = torch.randn(150, 4, d).to(dtype)
        k, v = (torch.randn(120, 2, d).to(dtype) for _ in range(2))
        cu_q = torch.tensor([0, 100, 150], dtype=torch.int32)
        cu_k = torch.tensor([0, 20, 120], dtype=torch.int32)
        options = (None, 0, cu_q, cu_k, 100, 100, True, 0.1, None, -1, 0, 0)
    else:
        q = torch.randn(2, 150, 4, d).to(dtype).transpose(1, 2)  # (B, S, H, D) memory
        k, v = (torch.randn(2, 2, 120, d).to(dtype) for _ in range(2))
        options = (None, 0, None, None, 150, 120, False, 0.1, None, -1, -1, 0)
    o, m, l = L.forward(q, k, v, *options)
    ((grid, kwargs, args),) = recorded
    cfg = K.FWD_CONFIGS[d]
    dname = "bfloat16" if dtype == BF16 else "float16"
    assert _arg_kinds(args) == list(K.signature(cfg, d, dname, varlen).values())
    assert {n: kwargs[n] for n in K.constexprs(cfg, True, varlen)} == K.constexprs(cfg, options[6], varlen)
    assert kwargs["num_warps"] == 4 and kwargs["enable_fp_fusion"] is False
    q_desc, k_desc, v_desc, o_desc = args[:4]
    assert q_desc.base is q and k_desc.base is k and v_desc.base is v and o_desc.base is o  # read in place
    assert o.stride() == q.stride()  # o keeps q's layout (the op's fake gives empty_like(q))
    if varlen:
        assert q_desc.shape == [1, 4, 150, d] and q_desc.strides[1:] == [d, 4 * d, 1]
        assert k_desc.shape == [1, 2, 120, d] and m.shape == (4, 150)
        assert args[7] is cu_q and args[8] is cu_k and args[-5:] == (o.stride(0), o.stride(1), 0, 0, 1.0)
        n_m_blocks = -(-100 // cfg.block_m)
        sizes = (150, 100, n_m_blocks, n_m_blocks * 2 * 4)  # seqlen_q = Tq (the stats' head stride)
    else:
        assert q_desc.shape == [2, 4, 150, d] and q_desc.strides == list(q.stride())
        assert m.shape == (2, 4, 150)
        n_m_blocks = -(-150 // cfg.block_m)
        sizes = (150, 120, n_m_blocks, n_m_blocks * 2 * 4)
    assert args[9] is m  # no sinks: the m pointer stands in for sinks_ptr (not read)
    assert args[10:18] == (L.constants(0.1, None)[0], 4, 2, args[13], *sizes)  # C1, heads, group, chunk, ...
    # One program per tile, or one per SM walking them (attention_gluon.PERSISTENT_NONCAUSAL: 5 fake SMs).
    persistent = not options[6] and d in G.PERSISTENT_NONCAUSAL
    assert grid == ((min(args[17], 5),) if persistent else (args[17],))
    # The kept plan: new tensors of the same layout get the same launch, descriptors rebased onto them.
    q2, k2, v2 = (t.clone(memory_format=torch.preserve_format) for t in (q, k, v))
    o2, m2, l2 = L.forward(q2, k2, v2, *options)
    (_, kwargs2, args2) = recorded[1]
    assert kwargs2 == kwargs and args2[4:] == (m2, l2, o2, *args2[7:9], m2, *args[10:])
    for new, old, base in zip(args2[:4], args[:4], (q2, k2, v2, o2), strict=True):
        assert new.base is base and {**vars(new), "base": None} == {**vars(old), "base": None}


def test_layouts_tma_cannot_read_are_copied(monkeypatch, recorded):
    _on_hopper(monkeypatch)
    d = 64
    wide = torch.randn(1, 2, 100, d + 1).to(BF16)[..., :d]  # rows of 65 elements: not 16-byte multiples
    offset = torch.randn(2 * 100 * d + 1).to(BF16)[1:].view(1, 2, 100, d)  # base 2 bytes off
    expanded = torch.randn(1, 1, 100, d).to(BF16).expand(1, 2, 100, d)  # head stride 0
    head_dim_outer = torch.randn(1, 2, d, 100).to(BF16).transpose(2, 3)  # head dim not innermost
    for q in (wide, offset, head_dim_outer):
        recorded.clear()
        L.clear_plans()
        o, m, l = L.forward(q, expanded, expanded, None, 0, None, None, 100, 100, False, 0.125, None, -1, -1,
                            0)
        ((_, _, args),) = recorded
        for desc, t in zip(args[:3], (q, expanded, expanded), strict=True):
            assert desc.base is not t and desc.base.is_contiguous() and torch.equal(desc.base, t)
        assert o.stride() == torch.empty_like(q).stride()
        assert (args[3].base is o) == (o.stride(-1) == 1)  # else a scratch, copied into o after the launch


def test_empty_problems_launch_nothing(monkeypatch, recorded):
    _on_hopper(monkeypatch)
    q, k, v = _qkv(sq=10, sk=0)
    o, m, l = L.forward(q, k, v, None, 0, None, None, 10, 0, True, 0.125, None, -1, 0, 0)
    assert not recorded and (o == 0).all() and (m == float("-inf")).all() and (l == 0).all()
    q, k, v = _qkv(b=0)
    o, m, l = L.forward(q, k, v, None, 0, None, None, 64, 64, False, 0.125, None, -1, -1, 0)
    assert not recorded and o.shape == q.shape and m.shape == (0, 2, 64)


# ------------------------------------------------------------------------------------------------------
# The backward's dk / dv path (safeops.kernels.attention_gluon_bwd) and its launch.
# ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("make", "options", "env", "reason"),
    [
        (dict(d=256), {}, "1", "head dim 256: the Gluon backward has head dims 64, 128"),
        (dict(d=128, dtype=torch.float32), {}, "auto", "the Gluon backward takes bf16 or fp16, not float32"),
        (dict(d=128, dv=64), {}, "auto", "v's head dim 64 is not q's 128"),
        (dict(d=128), {"softcap": 30.0}, "auto", "the Gluon backward does not take softcap"),
        (dict(d=128), {"attn_mask": torch.zeros(64, 64)}, "auto",
         "the Gluon backward does not take an attention mask"),
        (dict(d=128), {"window": (None, 16)}, "auto",
         "the Gluon backward does not take a sliding window with a right bound"),
        (dict(d=128), {}, "0", "SAFEOPS_GLUON_BWD=0 keeps dk / dv on the Triton kernel"),
    ],
)
def test_backward_reasons(make, options, env, reason, monkeypatch):
    _on_hopper(monkeypatch)
    monkeypatch.setattr(G, "GLUON_BWD_SEQ", True)
    monkeypatch.setenv("SAFEOPS_GLUON_BWD", env)
    q, k, v = _qkv(**make)
    path, why = safeops.attention_backend(q, k, v, backward=True, **options)
    assert path == "triton" and reason in why, (path, why)


def test_backward_answers(monkeypatch):
    monkeypatch.setattr(G, "GLUON_BWD_SEQ", True)
    q, k, v = _qkv(d=128)
    assert safeops.attention_backend(q, k, v, backward=True) == (
        "triton", "the Gluon kernel needs a CUDA device; q is on cpu")
    _on_hopper(monkeypatch)
    assert safeops.attention_backend(q, k, v, is_causal=True, backward=True) == (
        "gluon", "bf16 causal D=128 on sm_90: Gluon dq, dk / dv")
    assert safeops.attention_backend(q, k, v, is_causal=True)[0] == "gluon"  # the forward's answer
    sinks = torch.zeros(2)
    assert safeops.attention_backend(q, k, v, sinks=sinks, backward=True)[0] == "gluon"
    p = torch.zeros(64, 2, 128, dtype=BF16)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    answer = safeops.attention_backend(p, p, p, cu_seqlens_q=cu, cu_seqlens_k=cu, backward=True)
    assert answer == ("gluon", "bf16 non-causal D=128 on sm_90: Gluon dq, dk / dv")
    p64 = p[..., :64]
    # D=64 packed takes the kernels a dense D=64 call takes (a packed sequence gets the bits of it alone).
    answer = safeops.attention_backend(p64, p64, p64, cu_seqlens_q=cu, cu_seqlens_k=cu, backward=True)
    assert answer == ("gluon", "bf16 non-causal D=64 on sm_90: Gluon dk / dv, Triton dq")
    with monkeypatch.context() as mp:
        mp.setattr(G, "SEQ_HEAD_DIMS", (128,))
        answer = safeops.attention_backend(p64, p64, p64, cu_seqlens_q=cu, cu_seqlens_k=cu, backward=True)
        assert answer[0] == "triton" and answer[1].startswith("head dim 64 with packed (varlen) sequences")
    q64, k64, v64 = _qkv(d=64, dtype=torch.float16)
    # D=64: the Gluon dK / dV kernel causal or not by default, dq from the Triton dq kernel (as measured)
    assert safeops.attention_backend(q64, k64, v64, backward=True) == (
        "gluon", "fp16 non-causal D=64 on sm_90: Gluon dk / dv, Triton dq")
    assert safeops.attention_backend(q64, k64, v64, is_causal=True, backward=True) == (
        "gluon", "fp16 causal D=64 on sm_90: Gluon dk / dv, Triton dq")
    assert "DQ_HEAD_DIMS" in G.dq_reason(q64, k64, v64, None, None, True, None, -1, 0)
    mask64 = torch.ones(q64.shape[2], k64.shape[2], dtype=torch.bool)  # the first reason wins
    assert G.dq_reason(q64, k64, v64, mask64, None, True, None, -1, 0) == (
        "the Gluon backward does not take an attention mask")
    monkeypatch.setattr(G, "DQ_HEAD_DIMS", (64, 128))  # the Gluon dQ kernel at D=64 too
    assert safeops.attention_backend(q64, k64, v64, is_causal=True, backward=True) == (
        "gluon", "fp16 causal D=64 on sm_90: Gluon dq, dk / dv")
    monkeypatch.setattr(G.bwd_kernels(), "AUTO_HEAD_DIMS", (128,))  # a head dim left to the Triton kernels
    answer = safeops.attention_backend(q64, k64, v64, is_causal=True, backward=True)
    assert answer[0] == "triton" and "SAFEOPS_GLUON_BWD=1 runs the Gluon one" in answer[1]
    monkeypatch.setenv("SAFEOPS_GLUON_BWD", "1")
    assert safeops.attention_backend(q64, k64, v64, is_causal=True, backward=True) == (
        "gluon", "fp16 causal D=64 on sm_90: Gluon dq, dk / dv")
    assert safeops.attention_backend(q64, k64, v64, backward=True) == (
        "gluon", "fp16 non-causal D=64 on sm_90: Gluon dq, dk / dv")
    monkeypatch.setattr(G, "GLUON_DQ", False)  # the switch: dq back on the Triton kernel
    assert safeops.attention_backend(q64, k64, v64, backward=True) == (
        "gluon", "fp16 non-causal D=64 on sm_90: Gluon dk / dv, Triton dq")
    monkeypatch.setattr(G, "GLUON_DQ", True)
    monkeypatch.setenv("SAFEOPS_GLUON", "0")
    assert safeops.attention_backend(q, k, v, backward=True) == (
        "triton", "SAFEOPS_GLUON=0 keeps dk / dv on the Triton kernel")
    monkeypatch.setenv("SAFEOPS_GLUON", "1")
    with L.config_override(dkdv=L.AttnConfig(64, 64, 4, 2)):
        assert safeops.attention_backend(q, k, v, backward=True) == (
            "triton", "a Triton dk/dv configuration is forced (attention_launch.config_override)")
    monkeypatch.setenv("SAFEOPS_GLUON_BWD", "perhaps")
    with pytest.raises(ValueError, match="SAFEOPS_GLUON_BWD must be auto"):
        safeops.attention_backend(q, k, v, backward=True)


def test_backward_answer_depends_on_no_size_or_layout(monkeypatch):
    _on_hopper(monkeypatch)
    shapes = [(1, 2, 2, 64, 64), (7, 2, 2, 64, 64), (3, 8, 2, 1, 5000), (2, 4, 1, 333, 200)]
    for dtype in (BF16, torch.float16):
        for d in (64, 128):
            for options in ({}, {"is_causal": True}):
                answers = set()
                for b, hq, hkv, sq, sk in shapes:
                    q, k, v = _qkv(d, dtype, b, hq, hkv, sq, sk)
                    answers.add(safeops.attention_backend(q, k, v, backward=True, **options))
                    bshd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
                    answers.add(safeops.attention_backend(*bshd, backward=True, **options))
                assert len(answers) == 1, (dtype, d, options, answers)
                assert next(iter(answers))[0] == "gluon"


def test_gluon_split_rule_reads_heads_and_head_dim_only():
    """The Gluon dK / dV kernel's GQA split (``G.split_of``): at D=64 every group (the Triton kernel's
    ``dkdv_split``), at D=128 groups of 8 or more (smaller ones measured slower split), none at D=256 (not in
    ``SPLIT_HEAD_DIMS``); the memory cap as dkdv_split's. Its arguments are the group, the elements of k and v
    (the cap) and the head dim: nothing about the batch or the sequence lengths."""
    import inspect

    assert [G.split_of(g, 1, 64) for g in (1, 2, 4, 8)] == [1, 2, 2, 4]
    assert [G.split_of(g, 1, 128) for g in (1, 2, 4, 6, 8, 16, 32)] == [1, 1, 1, 1, 4, 8, 16]
    assert [G.split_of(g, 1, 256) for g in (2, 8, 32)] == [1, 1, 1]
    cap = L.DKDV_SPLIT_MAX_BYTES
    assert G.split_of(8, cap // 4 // 4 + 1, 128) == L.dkdv_split(8, cap // 4 // 4 + 1) == 2
    assert list(inspect.signature(G.split_of).parameters) == ["group", "kv_elements", "d"]


@pytest.mark.parametrize(("hkv", "d"), [(4, 128), (2, 128), (2, 64)], ids=["mha", "gqa", "gqa-d64"])
@pytest.mark.parametrize("sq", [150, 151, 1])
def test_backward_launch_matches_the_compiled_signature(sq, hkv, d, monkeypatch, recorded):
    """dk / dv through a Gluon launch whose arguments are, in order, of the types the offline test compiles
    (KB.signature) with its constexprs; dq from the (interpreted) Triton kernel (``GLUON_DQ`` off; on, the
    test below). Row statistics of a length that is not a multiple of 4 are padded copies (their row stride
    must be 16-byte aligned for TMA). GQA (group 2) at D=64 (``G.split_of``): the split form, one query head
    per CTA (``dkdv_split``), fp32 partials (B, Hkv x split, Sk, D) in place of dk / dv, summed afterwards; at
    D=128 (below ``G.SPLIT_MIN_GROUP``) the whole group per CTA."""
    from safeops.kernels import attention_gluon_bwd as KB

    _on_hopper(monkeypatch)
    monkeypatch.setattr(G, "GLUON_DQ", False)
    split = G.split_of(4 // hkv, 1, d)
    assert split == (2 if (hkv, d) == (2, 64) else 1)
    q = torch.randn(2, sq, 4, d).to(BF16).transpose(1, 2)  # (B, S, H, D) memory
    k, v = (torch.randn(2, hkv, 120, d).to(BF16) for _ in range(2))
    o = torch.randn(2, 4, sq, d).to(BF16)
    m = torch.randn(2, 4, sq)
    l = torch.rand(2, 4, sq) + 1
    options = (None, 0, None, None, sq, 120, True, 0.1, None, -1, 0, 0)
    dq, dk, dv = L.backward(o, q, k, v, o, m, l, *options)
    ((grid, kwargs, args),) = recorded
    cfg = KB.BWD_CONFIGS[d]
    partial = split > 1
    assert split == (2 if (hkv, d) == (2, 64) else 1)
    assert _arg_kinds(args) == list(KB.signature(cfg, d, "bfloat16", partial).values())
    assert {n: kwargs[n] for n in KB.constexprs(cfg, True, partial)} == KB.constexprs(cfg, True, partial)
    assert kwargs["num_warps"] == 4 and kwargs["enable_fp_fusion"] is False
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, m_desc, l_desc, delta_desc = args[:9]
    assert q_desc.base is q and k_desc.base is k and v_desc.base is v and do_desc.base is o  # in place
    if partial:  # never stored through: k's and v's stand in
        assert dk_desc.base is k and dv_desc.base is v
    else:
        assert dk_desc.base is dk and dv_desc.base is dv
    assert q_desc.shape == [2, 4, sq, d]
    assert all(a == b for a, b, n in zip(q_desc.strides, q.stride(), q.shape, strict=True) if n > 1)
    assert m_desc.shape == [2, 4, sq]
    if cfg.row_stats:  # each row's base and 1 / l (tests/test_attention_row_stats.py checks them)
        assert m_desc.base is not m and l_desc.base is not l
        m, l = L.row_stats(m, l)
    else:
        assert (m_desc.base is m) == (sq % 4 == 0)
    assert torch.equal(m_desc.base[..., :sq], m) and torch.equal(l_desc.base[..., :sq], l)
    assert m_desc.strides[-1] == 1 and all(s % 4 == 0 for s in m_desc.strides[:-1])
    n_blocks = -(-120 // cfg.block_n)
    c1, _, scale_ds = L.constants(0.1, None)
    n_tiles = n_blocks * 2 * hkv * split
    assert args[9:18] == (c1, scale_ds, 4, 4 // (hkv * split), args[13], sq, 120, n_blocks, n_tiles)
    assert grid == (n_tiles,)
    # Dense, no window: an int32 stand-in for cu_seqlens, varlen 0, NO_WINDOW; without the split dk and dv
    # (not read; stored by TMA), with it the partials and their row and head strides (head index
    # batch x heads + head), then the split.
    assert args[18].dtype == args[19].dtype == torch.int32
    if partial:
        for part in args[20:22]:
            assert part.dtype == torch.float32 and part.is_contiguous()
            assert part.shape == (2, hkv * split, 120, d)
        assert args[22:] == (0, KB.NO_WINDOW, d, 120 * d, d, 120 * d, split)
    else:
        assert args[20] is dk and args[21] is dv
        assert args[22:] == (0, KB.NO_WINDOW, 0, 0, 0, 0, 1)


def test_gluon_dq_launch_matches_the_compiled_signature(monkeypatch, recorded):
    """With ``attention_gluon.GLUON_DQ`` on, the Triton dq kernel computes delta alone (interpreted here),
    then the Gluon dQ launch has the arguments the offline test compiles (KB.dq_signature), then dK / dV."""
    from safeops.kernels import attention_gluon_bwd as KB

    _on_hopper(monkeypatch)
    monkeypatch.setattr(G, "GLUON_DQ", True)
    monkeypatch.setattr(G, "FUSED_NONCAUSAL", ())  # the dK / dV + dQ pair, not the fused kernel
    d, sq = 128, 130
    q = torch.randn(1, 4, sq, d).to(BF16)
    k, v = (torch.randn(1, 2, 90, d).to(BF16) for _ in range(2))
    o, g = (torch.randn(1, 4, sq, d).to(BF16) for _ in range(2))
    m, l = torch.randn(1, 4, sq), torch.rand(1, 4, sq) + 1
    assert safeops.attention_backend(q, k, v, backward=True) == (
        "gluon", "bf16 non-causal D=128 on sm_90: Gluon dq, dk / dv")
    options = (None, 0, None, None, sq, 90, False, 0.1, None, -1, -1, 0)
    dq, dk, dv = L.backward(g, q, k, v, o, m, l, *options)
    (grid, kwargs, args), (_, _, dkdv_args) = recorded
    cfg = KB.DQ_CONFIGS[d]
    assert _arg_kinds(args) == list(KB.dq_signature(cfg, d, "bfloat16").values())
    assert {n: kwargs[n] for n in KB.dq_constexprs(cfg, False)} == KB.dq_constexprs(cfg, False)
    assert kwargs["enable_fp_fusion"] is False and kwargs["num_warps"] == 4
    q_desc, k_desc, v_desc, do_desc, dq_desc = args[:5]
    assert (q_desc.base, k_desc.base, v_desc.base, do_desc.base, dq_desc.base) == (q, k, v, g, dq)
    assert k_desc.block_shape == [1, 1, cfg.block_n, d] and q_desc.block_shape == [1, 1, 64, d]
    assert args[5] is m and args[6] is l
    delta = args[7]  # from the delta-only Triton launch; dK / dV read the same tensor
    assert torch.equal(dkdv_args[8].base, delta)
    expected = (o.double() * g.double()).sum(-1)
    torch.testing.assert_close(delta.double(), expected, rtol=1e-5, atol=1e-4)
    n_m = -(-sq // cfg.block_m)
    c1, _, scale_ds = L.constants(0.1, None)
    assert args[8:16] == (c1, scale_ds, 4, 2, sq, 90, n_m, n_m * 4) and grid == (n_m * 4,)
    assert args[16].dtype == torch.int32 and args[18] is dq and args[20:] == (0, KB.NO_WINDOW, 0, 0, 0, 0)


@pytest.mark.parametrize("fused", [False, True], ids=["pair", "fused"])
def test_gluon_backward_plan_replays_the_general_launches(fused, monkeypatch, recorded):
    """A backward whose dq comes from a Gluon kernel keeps a plan (``_GluonBwdPlan``): the second call of the
    same signature skips the general path and makes the same launches with its own tensors -- the
    delta-only Triton dq launch (interpreted here: delta is checked), then the kept Gluon plans (the dQ and
    dK / dV pair, D=64 GQA with the split; or the fused kernel, non-causal D=128)."""
    _on_hopper(monkeypatch)
    L.kernels(), G.bwd_kernels()  # loaded: a plan made before a module's first use is dropped once
    monkeypatch.setattr(G, "GLUON_DQ", True)
    monkeypatch.setattr(G, "DQ_HEAD_DIMS", (64, 128))  # the Gluon dQ kernel at D=64 too
    d, hkv, causal = (128, 4, False) if fused else (64, 1, True)
    if not fused:
        monkeypatch.setattr(G, "FUSED_NONCAUSAL", ())
    sq = 130

    def inputs():
        q = torch.randn(1, 4, sq, d).to(BF16)
        k, v = (torch.randn(1, hkv, 90, d).to(BF16) for _ in range(2))
        o, g = (torch.randn(1, 4, sq, d).to(BF16) for _ in range(2))
        return q, k, v, o, g, torch.randn(1, 4, sq), torch.rand(1, 4, sq) + 1

    options = (None, 0, None, None, sq, 90, causal, 0.1, None, -1, 0 if causal else -1, 0)
    general_calls = []
    general = L._backward_general
    monkeypatch.setattr(L, "_backward_general", lambda *a, **kw: general_calls.append(1) or general(*a, **kw))
    calls = []
    for _ in range(2):
        q, k, v, o, g, m, l = inputs()
        n = len(recorded)
        dq, dk, dv = L.backward(g, q, k, v, o, m, l, *options)
        calls.append(((q, k, v, o, g), recorded[n:]))
    assert len(general_calls) == 1  # the second call replayed the plan
    (plan,) = L._bwd_plans.values()
    assert type(plan) is L._GluonBwdPlan and (plan.fused is not None) == fused
    (_, first), ((q, k, v, o, g), second) = calls
    assert len(first) == len(second) == (1 if fused else 2)
    for (grid_a, kw_a, args_a), (grid_b, kw_b, args_b) in zip(first, second, strict=True):
        assert grid_a == grid_b and kw_a is kw_b  # the same kept launch
        assert _arg_kinds(args_a) == _arg_kinds(args_b)
        scalars = [[a for a in args if not isinstance(a, torch.Tensor) and not hasattr(a, "base")]
                   for args in (args_a, args_b)]
        assert scalars[0] == scalars[1]
        assert all(x.base is t for x, t in zip(args_b[:4], (q, k, v, g), strict=True))
        # The second call's descriptors: the first's kept fields with the new bases (attention_gluon._desc).
        descs = [(a, b) for a, b in zip(args_a, args_b, strict=True) if hasattr(b, "base")]
        assert descs and all(a is not b and {**a.__dict__, "base": None} == {**b.__dict__, "base": None}
                             for a, b in descs)
    if not fused:
        assert type(plan.dkdv) is G.BwdPlan and plan.dkdv.split == 2  # group 4 at D=64
    # delta from the replayed delta-only launch (the Gluon kernels read it: dQ's argument 7, the fused
    # kernel's descriptor 8, a padded copy when Sq is not a multiple of 4)
    delta = second[0][2][8].base[..., :sq] if fused else second[0][2][7]
    expected = (o.double() * g.double()).sum(-1)
    torch.testing.assert_close(delta.double(), expected, rtol=1e-5, atol=1e-4)


def test_gluon_backward_plan_replays_packed_with_sinks(monkeypatch, recorded):
    """The kept Gluon backward plan of a packed (varlen) D=64 GQA call with a left window and sinks: the
    second call replays it, passing cu_seqlens and the window to the Gluon launches as the general path did,
    and the sinks' gradient (from the replayed delta-only Triton launch, interpreted here) has the general
    path's bits."""
    _on_hopper(monkeypatch)
    L.kernels(), G.bwd_kernels()
    monkeypatch.setattr(G, "GLUON_DQ", True)
    monkeypatch.setattr(G, "DQ_HEAD_DIMS", (64, 128))  # the Gluon dQ kernel at D=64 too
    d, wl = 64, 40
    cu = torch.tensor([0, 70, 71, 202], dtype=torch.int32)
    q, o, g = (torch.randn(202, 8, d).to(BF16) for _ in range(3))
    k, v = (torch.randn(202, 2, d).to(BF16) for _ in range(2))
    m, l = torch.randn(8, 202), torch.rand(8, 202) + 1
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 0.25, 3.0])
    options = (None, 0, cu, cu, 131, 131, True, 0.1, None, wl, 0, 0)
    general_calls = []
    general = L._backward_general
    monkeypatch.setattr(L, "_backward_general", lambda *a, **kw: general_calls.append(1) or general(*a, **kw))
    results, launches = [], []
    for _ in range(2):
        n = len(recorded)
        results.append(L.backward(g, q, k, v, o, m, l, *options, sinks=sinks))
        launches.append(recorded[n:])
    assert len(general_calls) == 1
    (plan,) = L._bwd_plans.values()
    assert type(plan) is L._GluonBwdPlan and plan.varlen and plan.dkdv.split == 2  # group 4: 2 heads / CTA
    for (grid_a, kw_a, args_a), (grid_b, kw_b, args_b) in zip(*launches, strict=True):
        assert grid_a == grid_b and kw_a is kw_b and _arg_kinds(args_a) == _arg_kinds(args_b)
        # The packed arguments: cu_seqlens (twice), the outputs, varlen, the window, the outputs' strides.
        i = next(j for j, x in enumerate(args_b) if x is cu)
        seq_a, seq_b = args_a[i:i + 10], args_b[i:i + 10]
        assert seq_a[0] is cu and seq_b[1] is cu and seq_b[4:6] == (1, wl)
        assert [x for x in seq_a if not isinstance(x, torch.Tensor)] == [
            x for x in seq_b if not isinstance(x, torch.Tensor)]
    assert len(results[0]) == len(results[1]) == 4
    assert torch.equal(results[0][3], results[1][3])  # the sinks' gradient, general path vs plan


@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_gluon_backward_packed_and_window_launches(causal, d, monkeypatch, recorded):
    """With ``attention_gluon.GLUON_BWD_SEQ`` on, a packed (varlen) backward with a left window takes the
    Gluon dQ and dK / dV kernels (the compiled signatures): descriptors over (1, H, T, D) views and the
    statistics over (1, H, T), cu_seqlens, the packed outputs with their row and head strides, varlen 1
    and the window; the grid counts the longest sequence's blocks per sequence. Off, the path says why.
    At D=64 (group 2) dK / dV take the GQA split: fp32 partials (T, Hkv x split, D), one query head per
    CTA."""
    from safeops.kernels import attention_gluon_bwd as KB

    _on_hopper(monkeypatch)
    monkeypatch.setattr(G, "GLUON_DQ", True)
    monkeypatch.setattr(G, "DQ_HEAD_DIMS", (64, 128))  # the Gluon dQ kernel at D=64 too
    lengths, wl = [70, 0, 131], 40
    tq = sum(lengths)
    cu = torch.tensor([0, 70, 70, 201], dtype=torch.int32)
    q, o, g = (torch.randn(tq, 4, d).to(BF16) for _ in range(3))
    k, v = (torch.randn(tq, 2, d).to(BF16) for _ in range(2))
    m, l = torch.randn(4, tq), torch.rand(4, tq) + 1
    options = (None, 0, cu, cu, 131, 131, causal, 0.1, None, wl, 0 if causal else -1, 0)
    monkeypatch.setattr(G, "GLUON_BWD_SEQ", False)
    why = G.bwd_reason(q, k, v, None, cu, causal, None, wl, options[10])
    assert why == "the Gluon backward does not take packed (varlen) sequences"
    monkeypatch.setattr(G, "GLUON_BWD_SEQ", True)
    assert G.bwd_reason(q, k, v, None, cu, causal, None, wl, options[10]) == ""
    q64, k64, v64 = (t[..., :64] for t in (q, k, v)) if d == 128 else (q, k, v)
    assert G.bwd_reason(q64, k64, v64, None, cu, causal, None, wl, options[10]) == ""
    with monkeypatch.context() as mp:
        mp.setattr(G, "SEQ_HEAD_DIMS", (128,))
        assert G.bwd_reason(q64, k64, v64, None, cu, causal, None, wl, options[10]) == (
            "head dim 64 with packed (varlen) sequences: the Triton backward (the Gluon one at head dims "
            "128; bench/RESULTS.md)")
        assert G.bwd_reason(q64, k64, v64, None, None, causal, None, wl, options[10]) == (
            "head dim 64 with a sliding window: the Triton backward (the Gluon one at head dims 128; "
            "bench/RESULTS.md)")
    assert G.bwd_reason(q, k, v, None, None, False, None, wl, 5) == (
        "the Gluon backward does not take a sliding window with a right bound")
    assert G.fused_reason(q, k, v, None, cu, causal, None, wl, options[10]) != ""
    dq, dk, dv = L.backward(g, q, k, v, o, m, l, *options)
    (grid_q, _, args_q), (grid_k, kwargs_k, args_k) = recorded
    dcfg, cfg = KB.DQ_CONFIGS[d], KB.BWD_CONFIGS[d]
    assert _arg_kinds(args_q) == list(KB.dq_signature(dcfg, d, "bfloat16").values())
    split = 2 if d == 64 else 1  # group 2 at D=64: the split form, one query head per CTA
    assert _arg_kinds(args_k) == list(KB.signature(cfg, d, "bfloat16", split > 1).values())
    constexprs = KB.constexprs(cfg, causal, split > 1)
    assert {n: kwargs_k[n] for n in constexprs} == constexprs
    q_desc, k_desc = args_k[0], args_k[1]
    assert q_desc.shape == [1, 4, tq, d] and k_desc.shape == [1, 2, tq, d]
    assert list(q_desc.strides[1:]) == [d, 4 * d, 1]
    # The statistics re-laid with each sequence's first row on a 16-byte boundary (TMA): sequence b from
    # column 4 ceil(cu[b] / 4) + 4 b (0, 76 (empty), 80), the gaps 0.
    m_desc, l_desc = args_k[6], args_k[7]
    assert m_desc.shape == [1, 4, 204 + 12] and l_desc.shape == [1, 4, 216]
    base, rinv = (m, l) if not cfg.row_stats else L.row_stats(m, l)
    for desc, want in ((m_desc, base), (l_desc, rinv)):
        got = desc.base.reshape(4, 216)
        assert torch.equal(got[:, :70], want[:, :70]) and torch.equal(got[:, 80:211], want[:, 70:])
        assert (got[:, 70:80] == 0).all() and (got[:, 211:] == 0).all()
    n_blocks = -(-131 // cfg.block_n)
    assert args_k[12] == 2 // split  # query heads per CTA
    n_tiles = n_blocks * 3 * 2 * split
    assert args_k[14:18] == (tq, tq, n_blocks, n_tiles) and grid_k == (n_tiles,)
    assert args_k[18] is cu and args_k[19] is cu
    if split > 1:
        assert all(p.shape == (tq, 2 * split, d) and p.dtype == torch.float32 for p in args_k[20:22])
        assert args_k[22:] == (1, wl, 4 * d, d, 4 * d, d, 2)
    else:
        assert args_k[20] is dk and args_k[21] is dv
        assert args_k[22:] == (1, wl, 2 * d, d, 2 * d, d, 1)
    n_m = -(-131 // dcfg.block_m)
    assert args_q[12:16] == (tq, tq, n_m, n_m * 3 * 4) and grid_q == (n_m * 3 * 4,)
    assert args_q[16] is cu and args_q[18] is dq and args_q[20:] == (1, wl, 4 * d, d, 4 * d, d)


def test_gluon_sinks_launch_and_rows_without_keys(monkeypatch, recorded):
    """With ``attention_gluon.GLUON_SINKS`` on, a forward with sinks takes the Gluon kernel with has_sinks 1
    and the sink logits as sinks_ptr (the kernel compiled for calls without sinks); rows that see no key get
    the sink alone (m = zs2, l = 1, or 0 for a -inf sink), the same statistics as the Triton path gives
    them."""
    _on_hopper(monkeypatch)
    sinks = torch.tensor([0.5, -1.0, float("-inf"), 3.0])
    q, k, v = _qkv(hq=4, hkv=2, sq=100, sk=70)
    monkeypatch.setattr(G, "GLUON_SINKS", False)
    assert safeops.attention_backend(q, k, v, sinks=sinks) == (
        "triton", "the Gluon kernel does not take attention sinks")
    monkeypatch.setattr(G, "GLUON_SINKS", True)
    assert safeops.attention_backend(q, k, v, sinks=sinks, is_causal=True)[0] == "gluon"
    options = (None, 0, None, None, 100, 70, True, 0.125, None, -1, 0, 0)
    L.forward(q, k, v, *options, sinks=sinks)
    ((grid, kwargs, args),) = recorded
    cfg = K.FWD_CONFIGS[64]
    assert "HAS_SINKS" not in kwargs and args[-2] == 1 and args[9] is sinks
    assert _arg_kinds(args) == list(K.signature(cfg, 64, "bfloat16").values())
    no_keys = (None, 0, None, None, 100, 0, True, 0.125, None, -1, 0, 0)
    o, m, l = L.forward(q, k[:, :, :0], v[:, :, :0], *no_keys, sinks=sinks)
    assert len(recorded) == 1  # nothing to launch
    monkeypatch.setenv("SAFEOPS_GLUON", "0")
    o_t, m_t, l_t = L.forward(q, k[:, :, :0], v[:, :, :0], *no_keys, sinks=sinks)
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(o, o_t)
    assert torch.equal(m, m_t) and torch.equal(l, l_t)
    assert l[0, :, 0].tolist() == [1.0, 1.0, 0.0, 1.0] and m[0, 2, 0] == float("-inf")


def test_gluon_window_reasons_and_launch(monkeypatch, recorded):
    """With ``attention_gluon.GLUON_WINDOW`` on, a left window (causal or not) takes the Gluon kernel with
    HAS_WL and the window as its last argument but one (has_sinks last); a right bound without causal, or
    head dim 256, does not."""
    _on_hopper(monkeypatch)
    q, k, v = _qkv(sq=100, sk=70)
    monkeypatch.setattr(G, "GLUON_WINDOW", False)
    assert safeops.attention_backend(q, k, v, is_causal=True, window=(16, None)) == (
        "triton", "the Gluon kernel does not take a sliding window")
    monkeypatch.setattr(G, "GLUON_WINDOW", True)
    assert safeops.attention_backend(q, k, v, is_causal=True, window=(16, None))[0] == "gluon"
    assert safeops.attention_backend(q, k, v, window=(16, None))[0] == "gluon"
    assert safeops.attention_backend(q, k, v, window=(16, 16)) == (
        "triton", "the Gluon kernel does not take a sliding window with a right bound")
    q2, k2, v2 = _qkv(d=256, sq=100, sk=70)
    assert safeops.attention_backend(q2, k2, v2, window=(16, None)) == (
        "triton", "head dim 256: the Gluon kernel takes a sliding window at head dims 64 and 128")
    options = (None, 0, None, None, 100, 70, True, 0.125, None, 16, 0, 0)
    L.forward(q, k, v, *options)
    ((grid, kwargs, args),) = recorded
    assert kwargs["HAS_WL"] is True and args[-3:] == (16, 0, 1.0)  # window_left, has_sinks, C2
    assert _arg_kinds(args) == list(K.signature(K.FWD_CONFIGS[64], 64, "bfloat16").values())
    L.forward(q, k, v, None, 0, None, None, 100, 70, True, 0.125, None, -1, 0, 0)
    assert recorded[1][1]["HAS_WL"] is False and recorded[1][2][-3:] == (0, 0, 1.0)


def test_gluon_softcap_reason_and_launch(monkeypatch, recorded):
    """With ``attention_gluon.GLUON_SOFTCAP`` on, a softcapped forward takes the Gluon kernel's SOFTCAP
    build with the Triton path's two constants (C1 and C2 of ``constants(scale, softcap)``); off, the path
    says why. The backward of a softcapped forward stays on the Triton kernels."""
    _on_hopper(monkeypatch)
    q, k, v = _qkv(d=128, sq=100, sk=70)
    monkeypatch.setattr(G, "GLUON_SOFTCAP", False)
    assert safeops.attention_backend(q, k, v, softcap=30.0, is_causal=True) == (
        "triton", "the Gluon kernel does not take softcap")
    monkeypatch.setattr(G, "GLUON_SOFTCAP", True)
    assert safeops.attention_backend(q, k, v, softcap=30.0, is_causal=True)[0] == "gluon"
    assert safeops.attention_backend(q, k, v, softcap=30.0, is_causal=True, backward=True) == (
        "triton", "the Gluon backward does not take softcap")
    L.forward(q, k, v, None, 0, None, None, 100, 70, True, 0.125, 30.0, -1, 0, 0)
    ((grid, kwargs, args),) = recorded
    c1, c2, _ = L.constants(0.125, 30.0)
    assert kwargs["SOFTCAP"] is True and args[10] == c1 and args[-1] == c2 and c2 != 1.0
    assert _arg_kinds(args) == list(K.signature(K.FWD_CONFIGS[128], 128, "bfloat16").values())
    L.forward(q, k, v, None, 0, None, None, 100, 70, True, 0.125, None, -1, 0, 0)
    assert recorded[1][1]["SOFTCAP"] is False and recorded[1][2][-1] == 1.0


def test_gluon_fused_launch_matches_the_compiled_signature(monkeypatch, recorded):
    """With ``attention_gluon.GLUON_FUSED`` on, the Triton dq kernel computes delta alone (interpreted here),
    then one fused Gluon launch has the arguments the offline test compiles (KB.fused_signature): an fp32
    dq buffer, dq itself (the last turn writes it) and zeroed int32 turn counters (B, Hq, query blocks)."""
    import dataclasses

    from safeops.kernels import attention_gluon_bwd as KB

    _on_hopper(monkeypatch)
    monkeypatch.setattr(G, "GLUON_FUSED", True)
    # The atomic writer (the TMA writer's launch: test_gluon_fused_shift_only_where_a_head_fits)
    monkeypatch.setitem(KB.FUSED_CONFIGS, 128, dataclasses.replace(
        KB.FUSED_CONFIGS[128], tma_reduce=False, finalize=True, shift=False, early_turn=False,
        row_stats=False))
    d, sq, sk = 128, 130, 90
    q = torch.randn(1, 4, sq, d).to(BF16)
    k, v = (torch.randn(1, 2, sk, d).to(BF16) for _ in range(2))
    o, g = (torch.randn(1, 4, sq, d).to(BF16) for _ in range(2))
    m, l = torch.randn(1, 4, sq), torch.rand(1, 4, sq) + 1
    assert safeops.attention_backend(q, k, v, is_causal=True, backward=True) == (
        "gluon", "bf16 causal D=128 on sm_90: fused Gluon dq, dk / dv (dq added in a fixed order)")
    options = (None, 0, None, None, sq, sk, True, 0.1, None, -1, 0, 0)
    dq, dk, dv = L.backward(g, q, k, v, o, m, l, *options)
    ((grid, kwargs, args),) = recorded
    cfg = KB.FUSED_CONFIGS[d]
    assert _arg_kinds(args) == list(KB.fused_signature(cfg, d, "bfloat16").values())
    assert {n: kwargs[n] for n in KB.fused_constexprs(cfg, True)} == KB.fused_constexprs(cfg, True)
    assert kwargs["enable_fp_fusion"] is False and kwargs["num_warps"] == 4
    assert tuple(a.base for a in args[:6]) == (q, k, v, g, dk, dv)
    assert torch.equal(args[6].base, m) and torch.equal(args[7].base, l)  # copies padded for TMA (Sq = 130)
    expected = (o.double() * g.double()).sum(-1)
    torch.testing.assert_close(args[8].base.double(), expected, rtol=1e-5, atol=1e-4)  # delta
    acc_desc, acc, out, turns = args[9], args[10], args[11], args[12]
    n_m, n_n = -(-sq // cfg.block_m), -(-sk // cfg.block_n)
    assert acc.shape == q.shape and acc.dtype == torch.float32 and acc.is_contiguous()
    assert acc_desc.base is acc and acc_desc.block_shape == KB.dqacc_block_shape(cfg, d)  # TMA_REDUCE's view
    assert out is dq and cfg.finalize  # the kernel's last turn writes dq itself
    assert turns.shape == (4 * n_m,) and turns.dtype == torch.int32 and not turns.any()
    c1, _, scale_ds = L.constants(0.1, None)
    assert args[13:] == (c1, scale_ds, 4, 2, 2, sq, sk, n_n, n_n * 2) and grid == (n_n * 2,)  # one head chunk
    monkeypatch.setattr(G, "GLUON_FUSED", False)
    assert safeops.attention_backend(q, k, v, is_causal=True, backward=True)[1].endswith("Gluon dq, dk / dv")


def _noncausal_d128_backward_inputs(sq: int = 130, sk: int = 200) -> tuple:
    """attention_launch.backward's arguments: (g, q, k, v, out, m, l, options...) for a non-causal GQA
    backward at D=128 (4 query heads, 2 kv heads), bf16 CPU tensors."""
    q = torch.randn(1, 4, sq, 128).to(BF16)
    k, v = (torch.randn(1, 2, sk, 128).to(BF16) for _ in range(2))
    o, g = (torch.randn(1, 4, sq, 128).to(BF16) for _ in range(2))
    m, l = torch.randn(1, 4, sq), torch.rand(1, 4, sq) + 1
    return (g, q, k, v, o, m, l, None, 0, None, None, sq, sk, False, 0.1, None, -1, -1, 0)


@pytest.mark.parametrize("sms,shift", [(4, True), (3, False)])
def test_gluon_fused_shift_only_where_a_head_fits(monkeypatch, recorded, sms, shift):
    """GluonFusedConfig.shift (not causal) reaches the kernel only where a head's key blocks fit on half the
    GPU's SMs (here 2 key blocks: 4 SMs yes, 3 no); the TMA writer's launch (finalize off) passes q as out_ptr
    and a buffer of q's shape, and dq comes from the scale pass."""
    import dataclasses

    from safeops.kernels import attention_gluon_bwd as KB

    _on_hopper(monkeypatch)
    monkeypatch.setattr(G, "_num_sms", lambda index: sms)
    monkeypatch.setattr(G, "GLUON_FUSED", True)
    cfg = dataclasses.replace(KB.FUSED_CONFIGS[128], tma_reduce=True, finalize=False, shift=True,
                              early_turn=True)
    monkeypatch.setitem(KB.FUSED_CONFIGS, 128, cfg)
    L.clear_plans()
    inputs = _noncausal_d128_backward_inputs()
    q = inputs[1]
    dq, dk, dv = L.backward(*inputs)
    ((grid, kwargs, args),) = recorded
    assert kwargs["SHIFT"] is shift and kwargs["EARLY_TURN"] is True and kwargs["TMA_REDUCE"] is True
    assert args[11] is q and args[10].shape == q.shape
    # dq = scale * buffer: the (unwritten, here) buffer through the scale pass, in dq's dtype and shape
    assert dq.shape == q.shape and dq.dtype == q.dtype
    L.clear_plans()


def test_backward_settings_edge_cases(monkeypatch, recorded):
    """A bad SAFEOPS_GLUON_BWD fails the backward's path choice only (forwards run); a forced Triton backward
    configuration keeps dq off the Gluon kernel too; a backward whose dq the Gluon kernel computes keeps a
    Gluon backward plan (the delta launch and the Gluon launches, never the delta launch alone);
    clear_plans() drops the Gluon plans."""
    _on_hopper(monkeypatch)
    monkeypatch.setattr(G, "GLUON_DQ", True)
    monkeypatch.setattr(G, "FUSED_NONCAUSAL", ())  # the dK / dV + dQ pair, not the fused kernel
    q, k, v = _qkv(d=128, hq=2, hkv=2, sq=64, sk=64)
    o, g = torch.randn(1, 2, 64, 128).to(BF16), torch.randn(1, 2, 64, 128).to(BF16)
    m, l = torch.randn(1, 2, 64), torch.rand(1, 2, 64) + 1
    options = (None, 0, None, None, 64, 64, False, 0.1, None, -1, -1, 0)
    monkeypatch.setenv("SAFEOPS_GLUON_BWD", "maybe")
    L.forward(q, k, v, *options)  # the forward does not read it
    with pytest.raises(ValueError, match="SAFEOPS_GLUON_BWD must be auto"):
        L.backward(g, q, k, v, o, m, l, *options)
    monkeypatch.setenv("SAFEOPS_GLUON_BWD", "auto")
    with L.config_override(dkdv=L.AttnConfig(64, 64, 4, 2)):
        assert L.gluon_dq_reason(q, k, v, None, None, False, None, -1, -1) == (
            "a Triton backward configuration is forced (attention_launch.config_override)")
    recorded.clear()
    for _ in range(2):  # the second call launches the Gluon dQ and dK / dV kernels again
        L.backward(g, q, k, v, o, m, l, *options)
    kernels = [kw.get("CONSUMER_REGS") is not None and "NUM_WG" in kw for _, kw, _ in recorded]
    assert len(recorded) == 4 and all(kernels)
    assert [type(p) for p in L._bwd_plans.values()] == [L._GluonBwdPlan]
    assert L._gluon_bwd_plans
    L.clear_plans()
    assert not L._gluon_bwd_plans and not L._gluon_plans


@pytest.mark.parametrize("varlen", [False, True])
def test_warm_up_passes_the_launch_signature(varlen, monkeypatch):
    """The ahead-of-time warm-up (``G._warm``, run by the GPU tests' fixture) passes the forward kernel the
    arguments of a launch, in the types the offline test compiles (a missing one would fail every warm-up
    on the GPU and with it the Gluon GPU tests' setup)."""
    calls = []
    monkeypatch.setattr(K.attn_fwd_gluon_kernel, "warmup", lambda *a, **kw: calls.append((a, kw)))
    for softcap in (False, True):
        calls.clear()
        G._warm(("bfloat16", 128, True, varlen, {}, False, softcap))
        ((args, kwargs),) = calls
        assert _arg_kinds(args) == list(K.signature(K.FWD_CONFIGS[128], 128, "bfloat16", varlen).values())
        constexprs = K.constexprs(K.FWD_CONFIGS[128], True, varlen, False, softcap)
        assert {n: kwargs[n] for n in constexprs} == constexprs


def test_warm_up_lists_every_kernel_the_path_can_launch(monkeypatch):
    """G.configurations() (what the GPU tests and benchmarks compile ahead) holds every (dtype, head dim,
    causal, packed, left window) the path choice sends to the Gluon forward, and nothing it cannot send."""
    _on_hopper(monkeypatch)
    listed = set(((dt, d, causal, varlen, window, softcap)
                  for dt, d, causal, varlen, _, window, softcap in G.configurations()))
    launchable = set()
    for dtype in (BF16, torch.float16):
        for d in (32, 64, 96, 128, 256):
            for causal, varlen, window, softcap in itertools.product((False, True), repeat=4):
                q, k, v = _qkv(d=d, dtype=dtype)
                cu = torch.tensor([0, 64], dtype=torch.int32) if varlen else None
                why = G.reason(q, k, v, None, cu, causal, 30.0 if softcap else None, 16 if window else -1,
                               0 if causal else -1)
                if not why:
                    name = "bfloat16" if dtype == BF16 else "float16"
                    launchable.add((name, d, causal, varlen, window, softcap))
    assert launchable == listed
    assert any(c[-1] for c in listed)  # softcap builds among them


def test_fused_backward_by_default_where_measured(monkeypatch):
    """Without GLUON_FUSED the fused kernel takes the non-causal backward at the head dims of
    FUSED_NONCAUSAL (128), whatever the key length (the shifted order where a head's key blocks are at most
    half the SMs, the plain order past that: FUSED_PLAIN_NONCAUSAL), and nothing else: causal, D=64 and
    SAFEOPS_GLUON_BWD=0 keep the pair or Triton; a head dim of FUSED_NONCAUSAL not in FUSED_PLAIN_NONCAUSAL
    keeps the pair past the half-SM bound."""
    from safeops.kernels import attention_gluon_bwd as KB

    _on_hopper(monkeypatch)
    assert not G.GLUON_FUSED and G.FUSED_NONCAUSAL == (128,) and G.FUSED_PLAIN_NONCAUSAL == (128,)
    fused = "bf16 non-causal D=128 on sm_90: fused Gluon dq, dk / dv (dq added in a fixed order)"
    block_n = KB.FUSED_CONFIGS[128].block_n
    q = torch.zeros(1, 4, 256, 128, dtype=BF16)
    # (SMs, key length, whether a head's key blocks fit on half the SMs: the shifted order)
    cases = [(132, 256, True), (4, 2 * block_n, True), (4, 2 * block_n + 1, False),
             (5, 2 * block_n + 1, False)]
    for plain in [(128,), ()]:
        monkeypatch.setattr(G, "FUSED_PLAIN_NONCAUSAL", plain)
        for sms, sk, shifted in cases:
            monkeypatch.setattr(G, "_num_sms", lambda index, sms=sms: sms)
            k = torch.zeros(1, 2, sk, 128, dtype=BF16)  # GQA
            answer = safeops.attention_backend(q, k, k, backward=True)
            if plain or shifted:
                assert answer == ("gluon", fused), (sms, sk, plain)
            else:
                assert answer == ("gluon", "bf16 non-causal D=128 on sm_90: Gluon dq, dk / dv"), (sms, sk)
                why = G.fused_reason(q, k, k, None, None, False, None, -1, -1)
                assert why.startswith(f"3 key blocks of 128 are more than half the {sms} SMs"), why
    monkeypatch.setattr(G, "FUSED_PLAIN_NONCAUSAL", (128,))
    monkeypatch.setattr(G, "_num_sms", lambda index: 132)
    k = torch.zeros(1, 2, 256, 128, dtype=BF16)
    assert safeops.attention_backend(q, k, k, is_causal=True, backward=True) == (
        "gluon", "bf16 causal D=128 on sm_90: Gluon dq, dk / dv")
    assert "non-causal head dims 128 only" in G.fused_reason(q, k, k, None, None, True, None, -1, 0)
    q64, k64 = torch.zeros(1, 4, 256, 64, dtype=BF16), torch.zeros(1, 2, 256, 64, dtype=BF16)
    assert safeops.attention_backend(q64, k64, k64, backward=True)[1].endswith(": Gluon dk / dv, Triton dq")
    mask = torch.zeros(256, 256, dtype=torch.bool)
    assert not safeops.attention_backend(q, k, k, attn_mask=mask, backward=True)[1].startswith("bf16")
    # Query groups past FUSED_MAX_GROUP (8) take the pair: 8 query heads on 1 kv head fused, 9 to 32 not,
    # whatever the batch.
    assert G.FUSED_MAX_GROUP == 8
    for b, hq, hkv in [(1, 8, 1), (3, 16, 2), (1, 9, 1), (2, 32, 1), (1, 32, 2)]:
        qg, kg = torch.zeros(b, hq, 256, 128, dtype=BF16), torch.zeros(b, hkv, 256, 128, dtype=BF16)
        answer = safeops.attention_backend(qg, kg, kg, backward=True)
        if hq // hkv <= 8:
            assert answer == ("gluon", fused), (b, hq, hkv)
        else:
            assert answer == ("gluon", "bf16 non-causal D=128 on sm_90: Gluon dq, dk / dv"), (b, hq, hkv)
            assert G.fused_reason(qg, kg, kg, None, None, False, None, -1, -1) == (
                f"a query group of {hq // hkv} heads: the fused Gluon backward takes groups of at most 8 "
                "(attention_gluon.FUSED_MAX_GROUP)")
    monkeypatch.setenv("SAFEOPS_GLUON_FUSED", "0")  # the pair instead, read on every call
    assert safeops.attention_backend(q, k, k, backward=True) == (
        "gluon", "bf16 non-causal D=128 on sm_90: Gluon dq, dk / dv")
    assert G.fused_reason(q, k, k, None, None, False, None, -1, -1) == (
        "SAFEOPS_GLUON_FUSED=0 keeps the backward off the fused Gluon kernel")
    monkeypatch.setenv("SAFEOPS_GLUON_FUSED", "sometimes")
    with pytest.raises(ValueError, match="SAFEOPS_GLUON_FUSED must be auto"):
        safeops.attention_backend(q, k, k, backward=True)
    monkeypatch.setenv("SAFEOPS_GLUON_FUSED", "auto")
    assert safeops.attention_backend(q, k, k, backward=True) == ("gluon", fused)
    monkeypatch.setenv("SAFEOPS_GLUON_BWD", "0")
    assert safeops.attention_backend(q, k, k, backward=True)[0] == "triton"
    assert G.fused_reason(q, k, k, None, None, False, None, -1, -1) == (
        "the Gluon backward is off (SAFEOPS_GLUON_BWD=0 or SAFEOPS_GLUON=0)")


def test_default_fused_launch_matches_the_compiled_signature(monkeypatch, recorded):
    """Without GLUON_FUSED, a non-causal D=128 backward whose key blocks fit on half the SMs is one fused
    launch with the default configuration's constexprs (the TMA writer, the shifted order, the row
    statistics precomputed) and the argument types the offline test compiles; one SM fewer, the same launch in
    the plain order (FUSED_PLAIN_NONCAUSAL), or the pair without it."""
    from safeops.kernels import attention_gluon_bwd as KB

    _on_hopper(monkeypatch)
    monkeypatch.setattr(G, "_num_sms", lambda index: 4)
    assert not G.GLUON_FUSED
    d = 128
    inputs = _noncausal_d128_backward_inputs()  # 2 key blocks of 128
    _, q, k, v = inputs[:4]
    dq, dk, dv = L.backward(*inputs)
    ((grid, kwargs, args),) = recorded
    cfg = KB.FUSED_CONFIGS[d]
    assert _arg_kinds(args) == list(KB.fused_signature(cfg, d, "bfloat16").values())
    assert kwargs["SHIFT"] is True and kwargs["PRE_STATS"] is True and kwargs["TMA_REDUCE"] is True
    constexprs = KB.fused_constexprs(cfg, False, True)
    assert {n: kwargs[n] for n in constexprs} == constexprs
    assert kwargs["enable_fp_fusion"] is False
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    recorded.clear()
    L.clear_plans()
    monkeypatch.setattr(G, "_num_sms", lambda index: 3)
    L.backward(*inputs)
    ((grid, kwargs, args),) = recorded  # the fused kernel in the plain order
    assert _arg_kinds(args) == list(KB.fused_signature(cfg, d, "bfloat16").values())
    assert kwargs["SHIFT"] is False and kwargs["PRE_STATS"] is True and kwargs["TMA_REDUCE"] is True
    recorded.clear()
    L.clear_plans()
    monkeypatch.setattr(G, "FUSED_PLAIN_NONCAUSAL", ())
    L.backward(*inputs)
    assert len(recorded) == 2 and all("SHIFT" not in kw for _, kw, _ in recorded)  # dQ, then dK / dV
    L.clear_plans()
