"""CPU checks of bench/attn_fwd_variants.py (the forward-attention schedule experiment of issue 4), so the
experiment cannot rot before the GPU run: every variant kernel runs under Triton's interpreter against the
float64 oracle and bit for bit against safeops' own (interpreted) forward; the GPU run's per-case code and
table run on the CPU; two variants compile for sm_90 with fp contraction absent from their PTX."""

from __future__ import annotations

import os

import sm90
import torch
from conftest import StubHarness, bench_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    return bench_module("attn_fwd_variants")


def test_every_variant_matches_oracle_and_shipped_bits(monkeypatch):
    """Dense, causal and a skewed input (every row max in the first key block, so exact-skip skips): each
    variant within the oracle bound and bit-identical to the shipped forward; the control (BLOCK_N 32)
    must differ in bits, so the comparison can fail."""
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    M = _module()
    assert M.interpret_check(M.VARIANTS, dims=(64,), causals=(False, True), control=True) == []


def test_gpu_case_code_and_table_run_on_cpu(monkeypatch):
    """run_case (the GPU run's check-and-time step) on a small causal case under the interpreter, with a
    wall-clock timer and no peers: every variant row is within the bound and has the shipped bits."""
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    M = _module()
    import oracle

    class A:
        @staticmethod
        def flops(case):
            b, h, s, d, causal, _ = case.shape
            return 4.0 * b * h * s * s * d / (2 if causal else 1)

    class Args:
        no_cudnn = True
        no_flex = True

    rows = []
    variants = [v for v in M.VARIANTS if v.default]
    M.run_case(1, 2, 64, 64, True, variants, Args, StubHarness, A, oracle, rows, device="cpu",
               dtype=torch.float16, shrink=True)
    assert len(rows) == 1 + len(variants)
    for _label, name, _ms, _tf, ratio, bit, _info, note in rows[1:]:
        assert ratio <= 1.0, (name, ratio, note)
        want = M.same_bits_expected(M.VARIANTS_BY_NAME[name.split()[0]].cfg[64], 64)
        # Interpreted, every variant has the shipped key steps (BLOCK_N 16), so the same bits.
        assert bit.startswith("same"), (name, bit, note)
        assert bit == "same" if want else bit == "same (unexpected)"
    lines = M.table(rows, "test")
    assert len(lines) == 4 + len(rows) and all(line.count("|") == 9 for line in lines[2:])


def test_bit_expectations():
    M = _module()
    assert M.same_bits_expected(M.VARIANTS_BY_NAME["copy"].cfg[128], 128)
    assert M.same_bits_expected(M.VARIANTS_BY_NAME["subtile2"].cfg[128], 128)
    assert M.same_bits_expected(M.VARIANTS_BY_NAME["next-qk"].cfg[128], 128)
    assert not M.same_bits_expected(M.VARIANTS_BY_NAME["m128n128s2"].cfg[128], 128)
    assert M.SHIPPED[128].label() == "(128,64,8w,3s)"


SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import attn_fwd_variants as M
out = {}
for name in ("copy", "next-qk"):
    out[name] = M.compile_stats((M.VARIANTS_BY_NAME[name].cfg[64], 64, True))
print(json.dumps(out))
"""


def test_two_variants_compile_for_sm90_without_contraction():
    """Offline sm_90 compile (ptxas included) of the copy and next-qk at D=64 causal: no spill, shared
    memory within the H200's limit, and no fma.rn.f32 in the PTX (z2 = s * C1 stays one rounded value)."""
    stats = sm90.run_script(SCRIPT, os.path.join(ROOT, "bench"), what="two forward variants",
                            python=sm90.compiler_python())
    for name, r in stats.items():
        assert r["ok"], (name, r)
        assert r["spill"] == 0 and 0 < r["shared"] <= 232448, (name, r)
        assert r["fma_ptx"] == 0, (name, r)
        assert r["hgmma"] > 0 and r["ex2"] > 0, (name, r)  # the main loop was found: wgmma + exp2
