"""CPU checks of bench/attn_split_sum.py: one Triton launch for the GQA split's two partial sums and two
casts (an experiment for the GPU, not used by the launcher), so it cannot rot before the GPU run.

- Under Triton's interpreter, its dk / dv equal, bit for bit, an fp32 emulation of each summation order
  (torch's CUDA reduction order and the sequential one) on GQA shapes with splits 2 to 8, dense (two
  layouts) and packed (varlen), unequal head dims, fp32 / fp16 results, signed zeros and cancelling
  partials; for splits <= 4 also the current path (``_sum_split`` twice + ``copy_`` twice) itself.
- The two orders differ at split 8 (so matching CUDA's order is not vacuous) and agree up to split 4.
- Bad shapes / orders / splits raise ValueError naming the argument.
- The default configuration compiles for sm_90 (Triton 3.6 when /tmp/t36 exists) without spills.
"""

from __future__ import annotations

import os

import pytest
import sm90
import torch
from conftest import bench_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    return bench_module("attn_split_sum")


def test_bits_equal_the_emulated_orders_and_the_current_path(seed):
    M = _module()
    lines = []
    assert M.self_check("cpu", log=lines.append, seed=seed.value) == 0, "\n".join(lines)
    assert len(lines) == 2 * 2 * len(M.CHECK_CASES)  # two dtypes x (random, signed zeros) per case


def test_cuda_order_differs_from_sequential_beyond_four(seed):
    """At split 8 the four-accumulator order gives other bits than the sequential one on random partials
    (so the kernel must follow CUDA's); up to split 4 they are the same sum."""
    M = _module()
    for split, differs in ((2, False), (3, False), (4, False), (8, True)):
        dkp, dvp, dk, dv = M.make_case(1, 2, 64, 32, 32, split, torch.float32, "cpu", False, seed=seed.value)
        cuda, seq = (M.emulate(dkp, split, False, order) for order in M.ORDERS)
        assert (not M.same_bits(cuda, seq)) == differs, split
        out = {}
        for order in M.ORDERS:
            k, v = torch.empty_like(dk), torch.empty_like(dv)
            M.split_sum(dkp, dvp, k, v, split, False, order=order)
            out[order] = k
        assert (not M.same_bits(out["cuda"], out["sequential"])) == differs, split
        # and each is a sum of the partials: within the recursive-summation bound (split - 1) u sum |x|
        # (u = 2**-24) of the float64 sum
        parts = dkp.double().view(1, 2, split, 64, 32)
        bound = (split - 1) * 2.0**-24 * parts.abs().sum(2)
        for k in out.values():
            assert ((k.double() - parts.sum(2)).abs() <= bound).all(), split


def test_bad_arguments_name_the_argument():
    M = _module()
    dkp, dvp, dk, dv = M.make_case(1, 2, 8, 16, 16, 2, torch.float32, "cpu", False)
    with pytest.raises(ValueError, match="dk_part"):
        M.split_sum(dkp, dvp, dk, dv, 4, False)
    with pytest.raises(ValueError, match="dv_part"):
        M.split_sum(dkp, dvp[:, :, :4], dk, dv, 2, False)
    with pytest.raises(ValueError, match="order"):
        M.split_sum(dkp, dvp, dk, dv, 2, False, order="tree")
    with pytest.raises(ValueError, match="split"):
        M.split_sum(dkp, dvp, dk, dv, 0, False)


SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import attn_split_sum as M
print(json.dumps(M.compile_stats([(64, 64, 8, M.BLOCK_R, M.NUM_WARPS)], log=lambda *a: None)))
"""


def test_default_config_compiles_for_sm90_without_spills():
    (r,) = sm90.run_script(SCRIPT, os.path.join(ROOT, "bench"), what="the split sum",
                           python=sm90.compiler_python())
    assert 0 < r["regs"] <= 255 and r["spill"] == 0, r


def test_gpu_mode_code_runs_on_cpu():
    """The GPU mode's per-shape code (bits vs the current path, timing lines) on the CPU with small shapes
    (splits <= 4, where the CPU sum has the cuda order too) and stand-ins for the timers."""
    M = _module()
    lines = []
    shapes = [("small bshd", (1, 2, 16, 16, 16, 2, False, "bshd"), "float16"),
              ("small varlen", (2, 2, 8, 16, 32, 4, True, "bhsd"), "float32")]
    bad = M.gpu_bench(tiles=((16, 1), (32, 2)), log=lines.append, device="cpu", shapes=shapes,
                      check_dtype="float16", timer=lambda fn: (fn(), 1.0)[1], host=lambda fn: 1.0)
    text = "\n".join(lines)
    assert bad == 0, text
    assert sum("split_sum block_r=" in line and "same bits" in line for line in lines) == 3, text
