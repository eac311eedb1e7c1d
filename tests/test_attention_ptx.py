"""Contract section 1 for the attention kernels, at the instruction level, and the Hopper MMA path.

The forward, dk/dv and dq kernels are compiled for sm_90 exactly as the launcher compiles them for bf16
(its configuration, ``enable_fp_fusion=False``), causal and with softcap (the forward and dq kernels also
with attention sinks), in a subprocess without Triton's interpreter. Every f32 multiply, add and subtract
in the PTX must carry ``.rn`` and there must be no f32 ``fma``: so ``z2 = s * C1`` is rounded before it
feeds the row max and ``z2 - m`` (and ptxas cannot fuse it later either). With fp fusion on, each kernel
(compiled once, with bounds masks) must show fma instructions: the check can fail. The bf16 dots must lower
to Hopper's warpgroup MMA (``wgmma.mma_async``), the path the performance needs.
"""

from __future__ import annotations

import textwrap

import pytest
import sm90

_SCRIPT = textwrap.dedent(
    r"""
    import json, re, sys
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from safeops.kernels import attention as k
    from safeops.ops import attention_launch as L

    fusion = sys.argv[1] == "on"
    target = GPUTarget("cuda", 90, 32)
    stats = {"m_ptr", "l_ptr", "delta_ptr", "sinks_ptr", "dsink_ptr"}

    def signature(fn, constexprs):
        sig, attrs = {}, {}
        if "HAS_SINKS" in fn.arg_names:  # else a runtime i32 below: both of its branches compiled
            constexprs.setdefault("HAS_SINKS", False)
        for i, name in enumerate(fn.arg_names):
            if name in ("sinks_ptr", "dsink_ptr") and not constexprs["HAS_SINKS"]:
                constexprs[name] = None  # as the launcher passes them without sinks
            if name in constexprs:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = ("*fp32" if name in stats else "*i32" if name.startswith("cu_")
                             else "*u8" if name == "mask_ptr" else "*bf16")
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif name in ("C1", "C2", "scale_ds"):
                sig[name] = "fp32"
            else:
                sig[name] = "i32"
        return sig, attrs

    def compile_ptx(fn, constexprs, cfg):
        sig, attrs = signature(fn, constexprs)
        options = L._launch_options(cfg)
        if fusion:
            options["enable_fp_fusion"] = True
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        return triton.compile(src, target=target, options=options).asm["ptx"]

    def counts(ptx):
        return {"fma": len(re.findall(r"\bfma\.rn(\.ftz)?\.f32\b", ptx)),
                "loose": len(re.findall(r"\b(mul|add|sub)(\.ftz)?\.f32\b", ptx)),
                "wgmma": len(re.findall(r"\bwgmma\.mma_async", ptx))}

    d = 64
    common = dict(GROUP=2, HEAD_DIM=d, HEAD_DIM_V=d, MASK_KIND=0, HAS_WL=False, HAS_WR=True, SOFTCAP=True,
                  VARLEN=False, PRECISION=3, BLOCK_D=L.block_dim(d), BLOCK_DV=L.block_dim(d))
    cuda = torch.device("cuda")
    results = {}
    # The fusion-on control: each kernel once (with bounds masks), enough to show the check sees contraction.
    FUSION_ON = ("fwd", "dkdv", "dq")
    # Every kernel twice: with bounds masks, and EVEN (whole blocks, what most GPU launches compile).
    for kind, fn, extra in (("fwd", k.attn_fwd_kernel, {"REVERSE": True, "WARP_SPECIALIZE": False,
                                                        "USE_TMA": False, "EVEN": False}),
                            ("fwd-even", k.attn_fwd_kernel, {"REVERSE": True, "WARP_SPECIALIZE": False,
                                                             "USE_TMA": False, "EVEN": True}),
                            ("dkdv", k.attn_bwd_dkdv_kernel, {"USE_TMA": False}),
                            ("dkdv-even", k.attn_bwd_dkdv_kernel, {"USE_TMA": False, "EVEN": True}),
                            ("dq", k.attn_bwd_dq_kernel, {"REVERSE": True, "USE_TMA": False}),
                            ("dq-even", k.attn_bwd_dq_kernel,
                             {"REVERSE": True, "USE_TMA": False, "EVEN": True}),
                            ("fwd-sinks", k.attn_fwd_kernel,
                             {"REVERSE": True, "WARP_SPECIALIZE": False, "USE_TMA": False, "EVEN": True,
                              "HAS_SINKS": True}),
                            ("dq-sinks", k.attn_bwd_dq_kernel,
                             {"REVERSE": True, "USE_TMA": False, "EVEN": True, "HAS_SINKS": True})):
        if fusion and kind not in FUSION_ON:
            continue
        cfg = L.config(kind.split("-")[0], L.block_dim(d), torch.bfloat16, True, cuda)
        constexprs = {**common, **extra, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                      "NUM_STAGES": cfg.num_stages}
        results[kind] = counts(compile_ptx(fn, constexprs, cfg))
    print(json.dumps(results))
    """
)


def _compile(fusion: str) -> dict[str, dict[str, int]]:
    return sm90.run_script(_SCRIPT, fusion, what="the attention kernels", timeout=900)


@pytest.fixture(scope="module")
def counts_off():
    return _compile("off")


def test_no_contraction_in_attention_kernels(counts_off):
    offenders = {kind: c for kind, c in counts_off.items() if c["fma"] or c["loose"]}
    assert not offenders, f"f32 fma or non-.rn mul/add in attention kernels (contract section 1): {offenders}"
    assert set(counts_off) == {"fwd", "fwd-even", "dkdv", "dkdv-even", "dq", "dq-even", "fwd-sinks",
                               "dq-sinks"}


def test_bf16_dots_use_wgmma(counts_off):
    missing = [kind for kind, c in counts_off.items() if not c["wgmma"]]
    assert not missing, f"no wgmma.mma_async (Hopper warpgroup MMA) in {missing}: {counts_off}"


def test_contraction_check_can_fail():
    counts = _compile("on")  # each kernel once
    assert set(counts) == {"fwd", "dkdv", "dq"}
    assert all(c["fma"] for c in counts.values()), f"fp fusion on made no fma, the check is blind: {counts}"
