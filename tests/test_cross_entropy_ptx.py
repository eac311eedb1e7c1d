"""The cross-entropy kernels for sm_90, compiled offline (no GPU needed), as the launcher compiles them.

Contract section 1 at the instruction level (as tests/test_kernels_ptx.py for the softmax family): with fp
fusion off no f32 multiply and add may become an fma, so every f32 mul/add/sub carries ``.rn`` and no
``fma.rn.f32`` appears; with fusion on the same compile must show some, so the check can fail. It also
shows that every configuration the launcher uses on the GPU compiles for sm_90 (the row-sum tree over
4096 lanes included), and that the forward's fixed-order lane sums stay spread over the threads (the f32
adds a thread executes are counted in the PTX).
"""

from __future__ import annotations

import textwrap

import pytest
import sm90
import torch

from safeops.ops import cross_entropy_launch

_SCRIPT = textwrap.dedent(
    r"""
    import json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from safeops.kernels import cross_entropy as k

    target = GPUTarget("cuda", 90, 32)
    pointers = {"x_ptr": "*bf16", "dx_ptr": "*bf16", "grad_ptr": "*bf16", "loss_ptr": "*fp32",
                "target_ptr": "*i64", "out_ptr": "*bf16"}
    floats = ("n_classes", "nll_scale", "smooth_scale", "z_loss")
    FUSION = [False]

    def compile_ptx(fn, constexprs, num_warps):
        sig = {}
        for name in fn.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = pointers.get(name, "*fp32")
            elif name in floats:
                sig[name] = "fp32"
            else:
                sig[name] = "i32"
        # Unit class strides are specialised as Triton does at launch.
        constexprs = dict(constexprs, **{n: 1 for n in ("sc", "dc") if n in fn.arg_names})
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        options = {"num_warps": num_warps, "enable_fp_fusion": FUSION[0]}
        return triton.compile(src, target=target, options=options).asm["ptx"]

    def fmas(ptx):
        return (len(re.findall(r"\bfma\.rn(\.ftz)?\.f32\b", ptx))
                + len(re.findall(r"\b(mul|add|sub)(\.ftz)?\.f32\b", ptx)))

    # Every arithmetic branch on (weights, smoothing, z-loss; "none" in the forward, the mean's divisions in
    # the backward) with the launcher's long-row block (lanes and warps: argv), and the reduction; with
    # fusion on, one compile of the short-row tile is enough to see contraction appear.
    LANES, WARPS, BWD_LANES, BWD_WARPS = map(int, sys.argv[1:5])
    every = dict(HAS_WEIGHT=True, HAS_NLL=True, HAS_SMOOTHING=True, HAS_Z=True, ROW_DIMS=2, WIDE=False, XA=8)
    long_rows = dict(every, BLOCK_M=1, BLOCK_N=LANES)
    configs = {
        "off": [("fwd/long/none", k.cross_entropy_fwd_kernel, dict(long_rows, REDUCE=0), WARPS),
                ("bwd/long/mean", k.cross_entropy_bwd_kernel,
                 dict(long_rows, REDUCE=1, DA=8, BLOCK_N=BWD_LANES), BWD_WARPS),
                ("reduce/mean", k.cross_entropy_reduce_kernel,
                 dict(MEAN=True, HAS_WEIGHT=True, HAS_Z=True, BLOCK=1024), 4)],
        "on": [("bwd/short/mean", k.cross_entropy_bwd_kernel,
                dict(every, REDUCE=1, DA=8, BLOCK_M=64, BLOCK_N=64), 8)],
    }
    results = {"adds": {}}
    for mode, entries in configs.items():
        FUSION[0] = mode == "on"
        results[mode] = {}
        for name, fn, c, warps in entries:
            ptx = compile_ptx(fn, c, warps)
            results[mode][name] = fmas(ptx)
            if mode == "off":
                results["adds"][name] = len(re.findall(r"\badd\.rn\.f32\b", ptx))
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def counts():
    """{"off": {kernel: count}, "on": {...}}, from one subprocess (its start-up is most of the cost), at the
    blocks the launcher takes for long rows on a GPU (the backward has its own)."""
    cuda = torch.device("cuda")
    _, lanes, warps = cross_entropy_launch.config(1 << 17, cuda)
    _, bwd_lanes, bwd_warps = cross_entropy_launch.config(1 << 17, cuda, backward=True)
    return sm90.run_script(_SCRIPT, *map(str, (lanes, warps, bwd_lanes, bwd_warps)),
                           what="the cross-entropy kernels")


def test_no_fma_in_the_cross_entropy_kernels(counts):
    offenders = {k: n for k, n in counts["off"].items() if n}
    assert not offenders, f"fused multiply-adds in compiled cross-entropy kernels (section 1): {offenders}"
    assert len(counts["off"]) == 3  # every configuration compiled


def test_check_can_fail_with_fp_fusion_on(counts):
    assert any(counts["on"].values()), "with enable_fp_fusion=True nothing was contracted: the check is blind"


def test_forward_lane_sums_stay_parallel(counts):
    """The forward's two fixed-order lane sums (row sum, smoothing sum) over the long-row block (2048 lanes,
    2 warps: 32 lanes per thread). Spread over all threads, as ``row_sum_tree`` folds them now, a thread's
    f32 adds stay within a small multiple of that (4096 lanes on 8 warps: 88 on Triton 3.6, loop adds
    included); the earlier spelling of the folds (permute + split) left them to one thread's serial adds
    (582 in the PTX at 4096 lanes, 2,091 FADD in the SASS), the cross-entropy forward's main cost until
    2026-12-05 (bench/RESULTS.md)."""
    _, lanes, warps = cross_entropy_launch.config(1 << 17, torch.device("cuda"))
    per_thread = lanes // (32 * warps)
    adds = counts["adds"]["fwd/long/none"]
    assert adds <= 6 * per_thread, f"{adds} f32 adds per thread, {per_thread} lanes each: serial lane sums?"
