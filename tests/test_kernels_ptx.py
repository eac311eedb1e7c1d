"""Contract section 1 at the instruction level: nothing in the compiled kernels can become an fma.

PTX ``fma`` would contract by itself; a plain ``mul.f32`` / ``add.f32`` (no ``.rn``) lets ptxas fuse the
pair into an FFMA when it assembles. With fp fusion off every f32 multiply and add must carry ``.rn``.

The kernels are compiled for sm_90 (Hopper) with exactly the options the launcher uses. This needs no
GPU: Triton compiles to PTX on the CPU. It runs in a subprocess because this process has Triton's
interpreter switched on. With fp fusion on, one variant of each kernel must show fma instructions (or
non-.rn f32 arithmetic), so the check is known to be able to fail for every kernel.
"""

from __future__ import annotations

import textwrap

import pytest
import sm90

_SCRIPT = textwrap.dedent(
    r"""
    import dataclasses, json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from safeops.kernels import softmax as k
    from safeops.ops import softmax_launch as L

    fusion = sys.argv[1] == "on"
    target = GPUTarget("cuda", 90, 32)
    pointer_types = {"x_ptr": "*bf16", "out_ptr": "*bf16", "grad_ptr": "*bf16", "dx_ptr": "*bf16",
                     "mask_ptr": "*u8"}

    def signature(fn, constexprs):
        sig = {}
        for name in fn.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = pointer_types.get(name, "*fp32")
            elif name == "scale_value":
                sig[name] = "fp32"
            else:
                sig[name] = "i32"
        return sig

    def count(fn, constexprs, cfg):
        # Unit column strides and one batch dim are specialised as Triton does at launch.
        constexprs = dict(constexprs)
        constexprs.update({n: 1 for n in ("sxn", "son", "sgn", "sdn", "B1", "B2") if n in fn.arg_names})
        constexprs.update({n: 8 for n in ("XA", "OA", "MA", "GA", "DA") if n in fn.arg_names})
        options = L._launch_options(cfg)
        options["enable_fp_fusion"] = fusion if fusion else options["enable_fp_fusion"]
        src = ASTSource(fn=fn, signature=signature(fn, constexprs), constexprs=constexprs)
        ptx = triton.compile(src, target=target, options=options).asm["ptx"]
        # fma in the PTX, and f32 multiplies/adds without .rn, which ptxas itself may fuse into an fma.
        return (len(re.findall(r"\bfma\.rn(\.ftz)?\.f32\b", ptx))
                + len(re.findall(r"\b(mul|add|sub)(\.ftz)?\.f32\b", ptx)))

    rows = L.rows_config(4096, 2)
    split = L.split_config(1 << 20, 2)
    # The loop backward: the longest row it takes, at its own warp count.
    loop = dataclasses.replace(L.split_config(max(L.LOOP_MAX_COLS_BWD.values()), 2),
                               num_warps=L.LOOP_NUM_WARPS)
    results = {}
    # With fusion off every variant the launcher can compile; the fusion-on control compiles one variant of
    # each kernel (softmax with a scale tensor, one batch dim), enough to show the check sees contraction.
    kinds, scale_modes, all_row_dims = ((0,), (1,), (1,)) if fusion else ((0, 1, 2), (0, 1, 2), (1, 3))
    for kind in kinds:
        for scale_mode in scale_modes:
            base = {"KIND": kind, "SCALE_MODE": scale_mode, "HAS_MASK": True, "WIDE": False}
            # Rows kernels: both row decodings (one batch dim: `row * stride`; three: the division).
            for row_dims in all_row_dims:
                tile = {"BLOCK_M": rows.block_m, "BLOCK_N": rows.block_n, "ROW_DIMS": row_dims}
                results[f"fwd_rows/{kind}/{scale_mode}/{row_dims}"] = count(
                    k.softmax_fwd_rows_kernel, {**base, **tile}, rows)
                for stages in (0, 3):  # one tile per program; the persistent pipelined grid (16K rows)
                    results[f"bwd_rows/{kind}/{scale_mode}/{row_dims}/{stages}"] = count(
                        k.softmax_bwd_rows_kernel, {**base, **tile, "NEED_DSCALE": True, "STAGES": stages},
                        rows)
            splits = {"SPLITS": triton.next_power_of_2(split.n_splits), "BLOCK_N": split.block_n}
            results[f"fwd_finish/{kind}/{scale_mode}"] = count(
                k.softmax_fwd_finish_kernel, {**base, **splits}, split)
            results[f"bwd_partial/{kind}/{scale_mode}"] = count(
                k.softmax_bwd_partial_kernel, {**base, "BLOCK_N": split.block_n}, split)
            results[f"bwd_finish/{kind}/{scale_mode}"] = count(
                k.softmax_bwd_finish_kernel, {**base, **splits, "NEED_DSCALE": True}, split)
            if kind != 2:
                loop_splits = {"SPLITS": triton.next_power_of_2(loop.n_splits), "BLOCK_N": loop.block_n}
                results[f"bwd_loop/{kind}/{scale_mode}"] = count(
                    k.softmax_bwd_loop_kernel, {**base, **loop_splits, "NEED_DSCALE": True}, loop)
        results[f"fwd_partial/{kind}"] = count(
            k.softmax_fwd_partial_kernel,
            {"SCALE_MODE": 1, "HAS_MASK": True, "WIDE": False, "BLOCK_N": split.block_n, "LSE": kind == 2},
            split)
    print(json.dumps(results))
    """
)


def _fma_counts(fusion: str) -> dict[str, int]:
    return sm90.run_script(_SCRIPT, fusion, what="the kernels")


@pytest.fixture(scope="module")
def fma_counts_off():
    return _fma_counts("off")


def test_no_fma_in_any_kernel(fma_counts_off):
    offenders = {name: n for name, n in fma_counts_off.items() if n}
    assert not offenders, f"fused multiply-adds in compiled kernels (contract section 1): {offenders}"
    assert len(fma_counts_off) >= 40  # every kernel, kind and scale mode was compiled


def test_check_can_fail_with_fp_fusion_on(fma_counts_off):
    counts = _fma_counts("on")  # one variant of each kernel
    assert {n.split("/")[0] for n in counts} == {n.split("/")[0] for n in fma_counts_off}
    blind = [name for name, n in counts.items() if not n]
    assert not blind, f"with enable_fp_fusion=True nothing was contracted in {blind}: the check is blind"


# The loop backward compiled with the GPU machine's Triton (3.6): its speed comes from its cache hints (the
# first walk's loads evict-last, the second's loads and stores evict-first; without them it measured no
# faster than the two-launch path, bench/RESULTS.md). The Python named by sm90.triton36_python() has no
# torch, so the kernel file is loaded with stand-in packages for its `safeops.kernels` imports; the launch's
# specializations (unit column strides, 16-byte aligned pointers and row length) are stated by hand.
_HINTS_SCRIPT = textwrap.dedent(
    r"""
    import json, os, re, sys, types
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    root = sys.argv[1]
    for name, path in (("safeops", ["safeops"]), ("safeops.kernels", ["safeops", "kernels"])):
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, *path)]
        sys.modules[name] = package
    import safeops.kernels.softmax as k

    fn = k.softmax_bwd_loop_kernel
    const = {"KIND": 0, "SCALE_MODE": 2, "HAS_MASK": True, "NEED_DSCALE": True, "WIDE": False, "SPLITS": 8,
             "BLOCK_N": 4096, "XA": 8, "MA": 16, "GA": 8, "DA": 8, "sgn": 1, "sxn": 1, "sdn": 1, "smn": 1}
    sig = {}
    for arg in fn.arg_names:
        if arg in const:
            sig[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            rows = arg in ("x_ptr", "grad_ptr", "dx_ptr")
            sig[arg] = {"mask_ptr": "*u8"}.get(arg, "*bf16" if rows else "*fp32")
        else:
            sig[arg] = "fp32" if arg == "scale_value" else "i32"
    aligned = ("x_ptr", "grad_ptr", "dx_ptr", "mask_ptr", "n_cols")
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 16, "enable_fp_fusion": False}).asm["ptx"]
    found = sorted(set(re.findall(r"\b(?:ld|st)\.global[^ \t]*", ptx)))
    print(json.dumps({"triton": triton.__version__, "accesses": found}))
    """
)


def test_loop_backward_keeps_its_cache_hints():
    """Every row-sized access of the loop backward carries its hint: the first walk's loads (x, the gradient,
    the mask) evict-last, the second walk's loads and dx's stores evict-first, all vectorized."""
    python = sm90.triton36_python()
    if python is None:
        pytest.skip("no Python with Triton 3.6 (SAFEOPS_COMPILE_PYTHON or /tmp/t36): see tests/sm90.py")
    out = sm90.run_script(_HINTS_SCRIPT, sm90.ROOT, what="the loop backward", python=python)
    assert out["triton"].startswith("3.6"), out
    accesses = set(out["accesses"])
    row_sized = {a for a in accesses if a not in ("ld.global.b32", "st.global.b32")}  # the per-row scalars
    assert row_sized == {
        "ld.global.L1::evict_last.L2::cache_hint.v4.b32", "ld.global.L1::evict_last.L2::cache_hint.v2.b32",
        "ld.global.L1::evict_first.L2::cache_hint.v4.b32", "ld.global.L1::evict_first.L2::cache_hint.v2.b32",
        "st.global.L1::evict_first.L2::cache_hint.v4.b32"}, sorted(accesses)
