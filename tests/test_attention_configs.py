"""Every kernel configuration the attention launcher can choose compiles for sm_90 and fits in shared memory.

The first H200 run found a forward configuration that needed 245760 bytes of shared memory (the additive
mask's tiles are pipelined through shared memory too) and one that crashed ptxas. Neither shows on a CPU
machine unless the kernels are compiled for the GPU, so this test does that, offline:

1. The launcher itself runs on **meta** tensors (``attention_launch`` treats meta as "plan a GPU launch")
   with the kernels replaced by recorders, so the recorded launches are exactly what a CUDA call would
   launch: configuration, constexprs, options, argument dtypes, and the integer values Triton specializes on
   (strides equal to 1, multiples of 16).
2. A subprocess without Triton's interpreter rebuilds each launch with Triton's own argument binder
   (``MockTensor`` stands in for tensors) and compiles it for ``cuda:90``, ptxas included. It uses the
   Python named by ``SAFEOPS_COMPILE_PYTHON``, else ``/tmp/t36/bin/python`` (Triton 3.6, the GPU machine's)
   when it exists, else this Python's Triton (3.9 in CI).
3. Every launch must compile and its ``shared`` metadata must be at most 232448 bytes (227 KB, the H200's
   per-block opt-in limit).

Which launches (``SAFEOPS_ATTN_CONFIGS``; one sm_90 compile takes 2-5 s of CPU): ``core`` (default, about
30 kernels, ~1-1.5 min cold on 2 cores): every bf16 head-dim bucket's plain kernel and its heaviest variant
(fp64 additive mask + causal + window + softcap + GQA, the most shared memory), tf32 at D=128;
``representative`` (~700 kernels: every head dim x dtype / precision x mask kind x span, options mixed in;
run it after changing a configuration table: ~15 min on 2 cores, ~2 min on 16); ``full`` (the product of
every option, thousands). Compiles run in parallel and land in Triton's on-disk cache, so a rerun is fast.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest
import sm90
import torch

from safeops.ops import attention_launch as L

SMEM_LIMIT = 232448  # bytes: H100/H200 (sm_90) maximum dynamic shared memory per block
KERNEL_NAMES = L.KERNEL_NAMES


def record(variants) -> list[dict]:
    """The distinct kernel launches the launcher makes for the variants (forward + backward each)."""
    with L.recording() as launches:
        for v in variants:
            _plan(**v)
    unique = {json.dumps(x, sort_keys=True): x for x in launches}
    return list(unique.values())


def _plan(d, dtype, precision=0, mask=None, causal=False, window=(-1, -1), softcap=None, group=1,
          varlen=False, sinks=False):
    meta = torch.device("meta")
    b, hkv, s = 2, 2, 384
    hq = hkv * group
    if varlen:
        q, g = (torch.empty(b * s, hq, d, dtype=dtype, device=meta) for _ in range(2))
        k, v = (torch.empty(b * s, hkv, d, dtype=dtype, device=meta) for _ in range(2))
        cu = torch.empty(b + 1, dtype=torch.int32, device=meta)
    else:
        q, g = (torch.empty(b, hq, s, d, dtype=dtype, device=meta) for _ in range(2))
        k, v = (torch.empty(b, hkv, s, d, dtype=dtype, device=meta) for _ in range(2))
        cu = None
    mask_kind, mask_t = 0, None
    if mask is not None:  # a (1, 1, Sq, Sk) mask broadcast to (B, Hq, Sq, Sk), as safeops.attention passes it
        mask_kind = 1 if mask == torch.bool else 2
        mask_t = torch.empty(1, 1, s, s, dtype=mask, device=meta).expand(b, hq, s, s)
    wl, wr = window
    options = (mask_t, mask_kind, cu, cu, s, s, causal, d**-0.5, softcap, wl, wr, precision)
    kw = {"sinks": torch.empty(hq, dtype=torch.float32, device=meta)} if sinks else {}
    out, m, l = L.forward(q, k, v, *options, **kw)
    L.backward(g, q, k, v, out, m, l, *options, **kw)


MASKS = [None, torch.bool, torch.float16, torch.float32, torch.float64]
# (causal, window): unmasked; causal; a two-sided window; causal with a left window.
SPANS = [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 17)), (True, (129, -1))]
DTYPES = [(torch.bfloat16, 0), (torch.float32, 0), (torch.float32, 1), (torch.float32, 2)]
HEAD_DIMS = [16, 32, 64, 128, 256]


def variants(level: str) -> list[dict]:
    """"core" (default, CI): every bf16 table entry's plain kernel (each head-dim bucket: what crashed ptxas
    at D=16) and its heaviest (fp64 additive mask + causal + window + softcap + GQA: the most shared memory),
    tf32 at D=128; "representative": every head dim x dtype/precision x mask kind x span with the
    options mixed in (about 700 kernels); "full": the whole product (thousands)."""
    heavy = dict(mask=torch.float64, causal=True, window=(129, -1), softcap=30.0, group=2)
    if level == "core":  # D=32 shares D=16's table entries (bucket 32); ieee fp32 compiles slowly
        dims = [d for d in HEAD_DIMS if d != 32]
        out = [dict(d=d, dtype=torch.bfloat16) for d in dims]
        out += [dict(d=d, dtype=torch.bfloat16, **heavy) for d in dims]
        out += [dict(d=256, dtype=torch.bfloat16, mask=torch.float32, causal=True, softcap=30.0)]
        out += [dict(d=128, dtype=torch.float32, precision=1, **heavy)]
        out += [dict(d=128, dtype=torch.bfloat16, sinks=True, **heavy)]  # the sinks' forward and dq kernels
        return out
    if level == "full":
        out = []
        for d, (dtype, prec), mask, (causal, window), softcap, group in itertools.product(
                HEAD_DIMS + [40, 96], DTYPES + [(torch.float16, 0)], MASKS, SPANS, (None, 30.0), (1, 2)):
            out.append(dict(d=d, dtype=dtype, precision=prec, mask=mask, causal=causal, window=window,
                            softcap=softcap, group=group))
        return out
    out = []
    for d, (dtype, prec) in itertools.product(HEAD_DIMS, DTYPES):
        base = dict(d=d, dtype=dtype, precision=prec)
        out.append(base)
        for mask in MASKS[1:]:
            out.append(dict(base, mask=mask))
            out.append(dict(base, mask=mask, causal=True, window=(129, -1), softcap=30.0, group=2))
        out.append(dict(base, causal=True))
        out.append(dict(base, window=(100, 17), softcap=30.0, group=2))
        if dtype != torch.float32:
            out.append(dict(base, causal=True, varlen=True))
    for d in (40, 96):  # a padded head dim
        out.append(dict(d=d, dtype=torch.bfloat16))
        out.append(dict(d=d, dtype=torch.bfloat16, mask=torch.float32, causal=True, softcap=30.0))
    out.append(dict(d=128, dtype=torch.float16, causal=True))
    return out


def compile_offline(launches: list[dict], python: str | None = None) -> dict:
    try:
        return L.compile_launches(launches, python or sm90.compiler_python())
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e).lower():
            pytest.skip("Triton's bundled ptxas is missing: cannot compile for sm_90 here")
        raise


def _label(launch: dict) -> str:
    kw = launch["kwargs"]
    keys = ("HEAD_DIM", "MASK_KIND", "HAS_WL", "HAS_WR", "SOFTCAP", "VARLEN", "GROUP", "PRECISION", "BLOCK_M",
            "BLOCK_N", "NUM_STAGES", "num_warps", "USE_TMA")
    dtypes = sorted({a["tensor"] for a in launch["args"] if isinstance(a, dict)})
    return f"{launch['kernel']} {dtypes} " + " ".join(f"{k}={kw[k]}" for k in keys if k in kw)


def test_recorder_sees_the_launchers_choice():
    """The meta-tensor plan records the configuration table's entry (the recorder is not blind); a GQA group
    of 2 splits dk/dv (two programs per group), so the split's sum is launched too."""
    launches = record([dict(d=128, dtype=torch.bfloat16, group=2)])
    fwd = [x for x in launches if x["kernel"] == "attn_fwd_kernel"]
    assert len(fwd) == 1
    cfg = L.config("fwd", 128, torch.bfloat16, False, torch.device("cuda"))
    assert (fwd[0]["kwargs"]["BLOCK_M"], fwd[0]["kwargs"]["BLOCK_N"], fwd[0]["kwargs"]["num_warps"]) == (
        cfg.block_m, cfg.block_n, cfg.num_warps)
    assert {x["kernel"] for x in launches} == set(KERNEL_NAMES)


def test_every_launcher_config_compiles_and_fits_shared_memory():
    level = os.environ.get("SAFEOPS_ATTN_CONFIGS", "core")
    launches = record(variants(level))
    answer = compile_offline(launches)
    failed, too_big = [], []
    for launch, result in zip(launches, answer["results"], strict=True):
        if not result["ok"]:
            failed.append(f"{_label(launch)}: {result['error'][-300:]}")
        elif result["shared"] > SMEM_LIMIT:
            too_big.append(f"{_label(launch)}: {result['shared']} bytes")
    msg = f"Triton {answer['triton']}, {len(launches)} kernels"
    assert not failed, f"{msg}; do not compile for sm_90:\n" + "\n".join(failed)
    assert not too_big, f"{msg}; shared memory over {SMEM_LIMIT}:\n" + "\n".join(too_big)


def test_mask_configs_replace_the_table_entry():
    """A dense mask of 8-byte elements at D=128 gets the smaller-footprint entry; 2-byte masks and no mask
    keep the tuned table entry; nothing depends on more than (kind, head-dim block, dtype, masked, mask
    element size)."""
    cuda = torch.device("cuda")
    bf16 = torch.bfloat16
    table = L.FWD_CONFIGS[(128, 2, True)]
    assert L.config("fwd", 128, bf16, True, cuda, 3, 0) == table
    assert L.config("fwd", 128, bf16, True, cuda, 3, 2) == table
    assert L.config("fwd", 128, bf16, True, cuda, 3, 8) == L.MASK_CONFIGS[("fwd", 128, 8)] != table
    assert L.config("fwd", 256, bf16, False, cuda, 3, 8) == L.MASK_CONFIGS[("fwd", 256, 4)]
    assert L.config("fwd", 256, bf16, False, cuda, 3, 1) == L.FWD_CONFIGS[(256, 2, False)]
    launches = record([dict(d=128, dtype=bf16, mask=torch.float64, causal=True)])
    fwd = next(x for x in launches if x["kernel"] == "attn_fwd_kernel")["kwargs"]
    assert fwd["NUM_STAGES"] == L.MASK_CONFIGS[("fwd", 128, 8)].num_stages


def test_packed_sequences_load_through_pointers():
    """Varlen launches never take device-side TMA descriptors (a varlen dq launch with them hung on an H100 at
    GQA group >= 8; see ``attention_launch._use_tma``), while the same problem dense does (the check can
    fail)."""
    launches = record([dict(d=64, dtype=torch.bfloat16, causal=True, group=8, varlen=True),
                       dict(d=64, dtype=torch.bfloat16, causal=True, group=8)])
    with_tma = [x for x in launches if "USE_TMA" in x["kwargs"]]
    packed = [x["kernel"] for x in with_tma if x["kwargs"]["VARLEN"]]
    assert sorted(packed) == sorted(["attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"])
    assert not [x["kernel"] for x in with_tma if x["kwargs"]["VARLEN"] and x["kwargs"]["USE_TMA"]]
    assert [x["kernel"] for x in with_tma if not x["kwargs"]["VARLEN"] and x["kwargs"]["USE_TMA"]]
