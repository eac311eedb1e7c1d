"""CPU checks of bench/softmax_bwd_variants.py (the softmax / log-softmax backward schedule experiment), so
the experiment cannot rot before its GPU run: every variant kernel runs under Triton's interpreter against
the float64 oracle of tests/test_softmax_gpu.py and bit for bit against safeops' own (interpreted) backward,
persistent ones with more row blocks than programs and for batch invariance, plus a masked case; the GPU
run's per-shape code and table run on the CPU; the checks are shown able to fail; two variants compile for
sm_90 with the loads of the pipelined one really in flight during the reduction (cp.async, two buffers)."""

from __future__ import annotations

import os
import types

import sm90
import torch
from conftest import StubHarness, bench_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    return bench_module("softmax_bwd_variants")


def test_every_variant_matches_oracle_and_shipped_bits(monkeypatch):
    """fp32 and fp16, N = 64 and 200 (a ragged tile), softmax and log-softmax: each variant (extras
    included) within the oracle budget, bit-identical to the shipped backward, batch-invariant when
    persistent, and on a masked input (fully masked rows, NaN under the mask) exact zeros where excluded."""
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    M = _module()
    assert M.interpret_check(M.VARIANTS) == []


def test_checks_can_fail(monkeypatch):
    """The bit comparison sees a one-ulp change, and the oracle check rejects the other kind's gradient and
    a gradient missing its row-sum term."""
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    M = _module()
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    x = (torch.randn(5, 48, generator=gen) * 4.0).to(torch.float16)
    g = torch.randn(5, 48, generator=gen).to(torch.float16)
    _, row_max, row_sum = M.shipped_forward(x)
    dx = M.run_variant(M.shipped_cfg(48), 0, g, x, row_max, row_sum)
    assert M.bits_equal(dx, M.shipped_backward(0, g, x, row_max, row_sum))
    bumped = dx.clone()
    bumped[2, 7] = torch.nextafter(bumped[2, 7].float(), torch.tensor(float("inf"))).to(dx.dtype)
    if bumped[2, 7] == dx[2, 7]:  # the fp32 step was under one fp16 ulp: step in fp16 bits
        bumped.view(torch.int16)[2, 7] += 1
    assert not M.bits_equal(bumped, dx)
    assert M.oracle_ratio(0, x, g, dx) <= 1.0
    assert M.oracle_ratio(0, x, g, M.run_variant(M.shipped_cfg(48), 1, g, x, row_max, row_sum)) > 1.0
    p = torch.softmax(x.double(), 1)
    no_sum = (p * g.double()).to(torch.float16)  # dz without the "- sum(g * p)" term
    assert M.oracle_ratio(0, x, g, no_sum) > 1.0


def test_gpu_shape_code_and_table_run_on_cpu(monkeypatch):
    """gpu_shape (the GPU run's check-and-time step) at N = 200 on fp16 under the interpreter, with a
    wall-clock stand-in timer and no torch.compile peer: every variant row passes its checks."""
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    M = _module()

    args = types.SimpleNamespace(no_compile=True, warmup_ms=1, rep_ms=1)
    rows: list = []
    variants = [v for v in M.VARIANTS if v.default]
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    M.gpu_shape(200, (0, 1), variants, args, StubHarness, gen, rows, lambda: None, device="cpu",
                dtype=torch.float16, m=13)
    runs = [v for v in variants if v.cfg(200) is not None]
    assert len(rows) == 2 * (1 + len(runs))
    for _n, _kind, name, _ms, _tb, bit, ratio, inv, _mcell, _info, note in rows:
        assert note == "", (name, note)
        assert ratio <= 1.0, (name, ratio)
        if name != "safeops (shipped)":
            assert bit.startswith("same"), (name, bit)  # the interpreter reduces every tile alike
            assert inv in ("-", "yes"), (name, inv)
    masked = [r[8] for r in rows if r[1] == 0 and r[2] != "safeops (shipped)"]
    assert masked and all(c.startswith("same") for c in masked), masked
    lines = M.table(rows, "test", 3.0)
    assert len(lines) == 4 + len(rows) and all(line.count("|") == 13 for line in lines[2:])


def test_bit_expectations():
    M = _module()
    by = M.VARIANTS_BY_NAME
    for n in M.DEFAULT_N:
        assert M.same_bits_expected(by["copy"].cfg(n), n)
        assert M.same_bits_expected(by["persist-s3"].cfg(n), n)
        assert M.same_bits_expected(by["prefetch"].cfg(n), n)
    assert not M.same_bits_expected(by["half-warps"].cfg(16384), 16384)
    assert M.same_bits_expected(by["half-warps"].cfg(256), 256)  # 1 warp on 4 x 256: the rows split
    assert M.same_bits_expected(by["m2x"].cfg(256), 256)
    assert not M.same_bits_expected(by["m2x"].cfg(4096), 4096)  # 2 x 4096 on 16 warps: 16 warps a row
    assert M.shipped_cfg(16384).label() == "(1x16384,32w)"
    assert M.shipped_cfg(256).label() == "(4x256,2w)"


def test_copied_config_is_the_launchers():
    """The shipped config copied into the bench (ROWS_BWD for 2-byte elements) is the launcher's today."""
    M = _module()
    from safeops.ops import softmax_launch as L

    for n in (200, *M.DEFAULT_N):
        c = L.rows_config(n, 2, True, backward=True)
        s = M.shipped_cfg(n)
        assert (c.block_m, c.block_n, c.num_warps, c.maxnreg) == (s.block_m, s.block_n, s.warps, None), \
            f"N={n}: the launcher now picks {c}; update SHIPPED_TILE / SHIPPED_PER_THREAD in the bench"


SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import softmax_bwd_variants as M
out = {}
for name in ("copy", "persist-s3"):
    out[name] = M.compile_stats((M.VARIANTS_BY_NAME[name].cfg(1024), 1024, 0))
print(json.dumps(out))
"""


def test_two_variants_compile_for_sm90():
    """Offline sm_90 compile (ptxas included) at N = 1024: the copy without spills or fp contraction, with
    128-bit loads; persist-s3 with its loads turned into cp.async (LDGSTS) copies into two buffers, whose
    waits leave the next block's copies in flight during the reduction."""
    stats = sm90.run_script(SCRIPT, os.path.join(ROOT, "bench"), what="two softmax backward variants",
                            python=sm90.compiler_python())
    for name, r in stats.items():
        assert r["ok"], (name, r)
        assert r["spill"] == 0 and r["fma_ptx"] == 0, (name, r)
    assert stats["copy"]["ldg128"] > 0 and stats["copy"]["ldgsts"] == 0, stats["copy"]
    s3 = stats["persist-s3"]
    assert s3["ldgsts"] > 0 and s3["buffers"] >= 2 and s3["wait_num"] > 0, s3
