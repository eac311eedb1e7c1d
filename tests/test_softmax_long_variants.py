"""CPU checks of bench/softmax_long_variants.py (the looped long-row softmax / log-softmax experiment), so
the experiment cannot rot before its GPU run: every default variant, forward and backward, runs under
Triton's interpreter (64-column blocks, more rows than programs) against the float64 oracle of
tests/test_softmax_gpu.py and bit for bit against safeops' own split path run with the same blocks, for
batch invariance and on a masked input; the GPU run's per-shape code and table run on the CPU; the checks
are shown able to fail; the copied launcher constants are the launcher's; two variants compile for sm_90
(no spills, no fp contraction, 128-bit loads; cp.async copies in flight during the reduction)."""

from __future__ import annotations

import os
import types

import sm90
import torch
from conftest import StubHarness, bench_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    return bench_module("softmax_long_variants")


def test_every_variant_matches_oracle_and_shipped_bits(monkeypatch):
    """Softmax and log-softmax, forward and backward, fp32 at N = 200 (4 blocks, the last ragged) and fp16 at
    N = 256: within the oracle budget, the shipped split path's bits (out, row max, row sum; dx),
    batch-invariant, exact 0 / -inf / 0-gradient at excluded entries. Under the interpreter the variants
    differ only in the grid (one program per row or 2 fake SMs x per_sm), the partials' home (registers or
    workspace) and pass 2's block order; one variant of each such combination runs here (warps, stages and
    eviction hints mean nothing to the interpreter; `--interpret-check` runs them all)."""
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    M = _module()
    by = M.VARIANTS_BY_NAME
    kinds = {(bool(v.cfg(65536).per_sm), v.cfg(65536).ws, v.cfg(65536).reverse): v for v in M.VARIANTS}
    assert len(kinds) >= 4
    assert M.interpret_check(list(kinds.values()), ns=(200,), dtypes=("float32",)) == []
    assert M.interpret_check([by["exact-p4-s3"]], ns=(256,), dtypes=("float16",)) == []


def test_checks_can_fail(monkeypatch):
    """The bit comparison sees a one-ulp change in any of the forward's three outputs; the oracle rejects
    the other kind's output and gradient, and a gradient missing its row-sum term."""
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    M = _module()
    from safeops.ops import softmax_launch as L

    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    x = (torch.randn(4, 130, generator=gen) * 4.0).to(torch.float16)
    g = torch.randn(4, 130, generator=gen).to(torch.float16)
    cfg = M.small_cfg(M.VARIANTS_BY_NAME["exact"].cfg(65536))
    with M.interpreter_split(L):
        ref = M.shipped_forward(0, x)
        out = M.run_variant("fwd", cfg, 0, x)
        assert M._same(out, ref)
        for i in range(3):
            bumped = [t.clone() for t in out]
            bits = bumped[i].view(-1).view(torch.int16 if i == 0 else torch.int32)
            bits[1] += 1
            assert not M._same(tuple(bumped), ref)
        assert M.oracle_ratio("fwd", 0, x, out[0]) <= 1.0
        assert M.oracle_ratio("fwd", 1, x, out[0]) > 1.0
        dx = M.run_variant("bwd", cfg, 0, x, g, ref[1], ref[2])
        assert M.oracle_ratio("bwd", 0, x, dx, g) <= 1.0
        assert M.oracle_ratio("bwd", 0, x, M.run_variant("bwd", cfg, 1, x, g, ref[1], ref[2]), g) > 1.0
    no_sum = (torch.softmax(x.double(), 1) * g.double()).to(torch.float16)  # dz without "- sum(g * p)"
    assert M.oracle_ratio("bwd", 0, x, no_sum, g) > 1.0


def test_gpu_shape_code_and_table_run_on_cpu(monkeypatch):
    """gpu_shape (the GPU run's check-and-time step), forward and backward, at N = 200 on fp16 under the
    interpreter with a stand-in timer and no peers: every variant row passes its checks."""
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    M = _module()
    from safeops.ops import softmax_launch as L

    args = types.SimpleNamespace(no_compile=True, no_liger=True, warmup_ms=1, rep_ms=1)
    variants = [M.VARIANTS_BY_NAME["exact-p2-ev-s3"]]
    rows: list = []
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    with M.interpreter_split(L):
        for d in M.DIRS:
            M.gpu_shape(200, d, (0, 1), variants, args, StubHarness, gen, rows, lambda: None, device="cpu",
                        dtype=torch.float16, m=8)
    assert len(rows) == 2 * 2 * (1 + len(variants))
    for _n, _dt, _d, _kind, name, _ms, _tb, bit, ratio, inv, _mcell, _info, note in rows:
        assert note == "", (name, note)
        assert ratio <= 1.0, (name, ratio)
        if name != "safeops (shipped)":
            assert bit == "same" and inv == "yes", (name, bit, inv)
    masked = [r[10] for r in rows if r[3] == 0 and r[4] != "safeops (shipped)"]
    assert len(masked) == 2 * len(variants) and all(c.startswith("same") for c in masked), masked
    lines = M.table(rows, "test", 3.0)
    assert len(lines) == 4 + len(rows) and all(line.count("|") == 15 for line in lines[2:])
    summary = M.summary(rows, 3.0)
    assert len(summary) == 2 + 2 * 2  # a line per (direction, kind)
    assert all(line.count("|") == 9 and "exact-p2-ev-s3" in line for line in summary[2:]), summary


def test_copied_launcher_constants_and_bit_expectations():
    """The split block and warps copied into the bench are the launcher's at every benchmarked length (so
    "same bits expected" means what it says), and only the shipped block on 4 warps expects them."""
    M = _module()
    from safeops.ops import softmax_launch as L

    # since session 7 the forward keeps rows of up to 32K columns in one program (not a split)
    assert M.launcher_note(L, M.DEFAULT_N, (32768,)) == "".join(
        f" N=32768 ({e} B): the launcher keeps the row resident (fwd);" for e in (2, 4))
    assert M.launcher_note(L, M.DEFAULT_N[1:], ()) == ""
    by = M.VARIANTS_BY_NAME
    for n in M.DEFAULT_N:
        for name in ("exact", "exact-ws", "exact-s3", "exact-p2-ev-s3"):
            assert M.same_bits_expected(by[name].cfg(n, 2), 2)
            assert M.same_bits_expected(by[name].cfg(n, 4), 4)
        for name in ("b4k-w8-p2-s3", "b8k-w16-p1-s3", "b8k-w8-row", "b16k-w16-p1"):
            assert not M.same_bits_expected(by[name].cfg(n, 2), 2)
    assert by["exact"].cfg(32768, 4).block_n == 2048


SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import softmax_long_variants as M
out = {}
for name in ("exact", "exact-s3", "exact-p2-ev"):
    out[name] = M.compile_stats(("bwd", M.VARIANTS_BY_NAME[name].cfg(32768), 32768, 0, "bf16"))
print(json.dumps(out))
"""


def test_variants_compile_for_sm90():
    """Offline sm_90 compile (ptxas included) of the 32K bf16 softmax backward: no spills or fp contraction;
    exact with 128-bit loads; exact-s3 with its loads turned into cp.async copies into two buffers whose
    waits leave the next block's copies in flight; exact-p2-ev with both eviction hints in the PTX."""
    stats = sm90.run_script(SCRIPT, os.path.join(ROOT, "bench"), what="long-row softmax variants",
                            python=sm90.compiler_python())
    for name, r in stats.items():
        assert r["ok"], (name, r)
        assert r["spill"] == 0 and r["fma_ptx"] == 0, (name, r)
    assert stats["exact"]["ldg128"] >= 8 and stats["exact"]["ldgsts"] == 0, stats["exact"]
    s3 = stats["exact-s3"]
    assert s3["ldgsts"] > 0 and s3["buffers"] >= 2 and s3["wait_num"] > 0, s3
    assert stats["exact-p2-ev"]["evict_ptx"] == ["evict_first", "evict_last"], stats["exact-p2-ev"]
