"""CPU checks of bench/attention.py's ``--sweep --shape llama`` (the backward at one layer of bench/model.py's
1.1B Llama: dk/dv configs, GQA split, causal head grouping, dq configs), so it cannot rot before the GPU run:

- the candidate lists start from the launcher's shipped D=64 entries and every split divides the group;
- each candidate's knobs reach the launches the launcher plans for CUDA (meta tensors, recorded) and are
  all restored afterwards;
- the sweep's per-candidate code (loose check against fp32 SDPA, bits against the default, timing rows)
  runs under the interpreter on a tiny GQA shape, and its check rejects a wrong result;
- two candidates compile for sm_90 offline (Triton 3.6 when /tmp/t36 exists) with registers / spills read
  back, and the spill-free tile has no spill.
"""

from __future__ import annotations

import pytest
import torch
from conftest import bench_module
from hypothesis import given
from strategies import seeds

from safeops.ops import attention_launch as L


def _module():
    return bench_module("attention")


def test_candidates_start_from_the_shipped_configs():
    A = _module()
    assert A.LLAMA_DKDV[0] == tuple(vars(L.DKDV_CONFIGS[(64, 2, True)]).values())[:4]
    assert A.LLAMA_DQ[0] == tuple(vars(L.DQ_CONFIGS[(64, 2, True)]).values())[:4]
    cands = A.llama_candidates()
    assert cands[0] == A.LlamaCand("base")
    assert len(set(cands)) == len(cands)
    group = A.LLAMA["hq"] // A.LLAMA["hkv"]
    assert all(group % c.split == 0 for c in cands if c.split)
    assert {c.kind for c in cands} == {"base", *A.LLAMA_KINDS}
    assert [c.kind for c in A.llama_candidates(("dq",))] == ["base"] + ["dq"] * (len(A.LLAMA_DQ) - 1)


def test_knobs_reach_the_planned_launches_and_are_restored():
    A = _module()
    C = A.LlamaCand
    cands = [C("base"), C("split", dkdv=(64, 128, 8, 3), split=2), C("dq", dq=(128, 32, 8, 3))]
    saved = (L.dkdv_split, L.BACKWARD_HEAD_GROUP, dict(L._override))
    recorded = A._record_llama(A.LLAMA, cands)
    assert (L.dkdv_split, L.BACKWARD_HEAD_GROUP, dict(L._override)) == saved
    got = {}
    for cand, launches in recorded:
        kw = {x["kernel"]: x["kwargs"] for x in launches}
        dkdv, dq = kw["attn_bwd_dkdv_kernel"], kw["attn_bwd_dq_kernel"]
        got[cand.kind] = ((dkdv["BLOCK_M"], dkdv["BLOCK_N"], dkdv["num_warps"], dkdv["NUM_STAGES"]),
                          dkdv["SPLIT"], (dq["BLOCK_M"], dq["BLOCK_N"], dq["num_warps"], dq["NUM_STAGES"]))
        assert dkdv["GROUP"] == 8 and dkdv["EVEN"] and dkdv["MASK_KIND"] == 0
    assert got["base"] == (A.LLAMA_DKDV[0], 4, A.LLAMA_DQ[0])  # default split: two heads per program
    assert got["split"] == ((64, 128, 8, 3), 2, A.LLAMA_DQ[0])
    assert got["dq"] == (A.LLAMA_DKDV[0], 4, (128, 32, 8, 3))
    with A.llama_knobs(C("group", head_group=32)):
        assert L._backward_grid(32, 32, True) == (32, 32, 1)
    assert L._backward_grid(32, 32, True) == (L.BACKWARD_HEAD_GROUP, 32, 4)


@given(seed=seeds())
def test_sweep_rows_on_cpu(monkeypatch, tmp_path, seed):
    """The GPU sweep's per-candidate code under the interpreter (fp32: the interpreter mishandles bf16, and
    fp32 results show any change of rounding), a one-call stand-in for the timer: rows pass the loose check,
    bits follow the expected dependence, a split that does not divide the group is an error row, and the CSV
    is written."""
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    A = _module()
    C = A.LlamaCand
    shape = dict(b=1, hq=4, hkv=2, s=40, d=16, causal=True, layout="bshd")
    cands = [C("base"), C("split", split=1), C("split", split=3), C("group", head_group=1),
             C("dq", dq=(16, 32, 1, 1)), C("dq", dq=(32, 16, 1, 1))]
    lines = []
    rows = A.sweep_llama(tmp_path, shape=shape, device="cpu", cands=cands, timer=lambda fn: (fn(), 1.0)[1],
                         dtype=torch.float32, log=lines.append, seed=seed.value)
    text = "\n".join(lines)
    assert [r["status"][:5] for r in rows] == ["ok", "ok", "error", "ok", "ok", "ok"], text
    assert "does not divide" in rows[2]["status"]
    assert "(unexpected)" not in text
    assert rows[0]["bits"] == rows[3]["bits"] == "dq=same dk=same dv=same", text
    assert rows[4]["bits"].startswith("dq=diff"), text  # another key step in dq: other rounding
    # Another dq query step: same bits on CUDA, but the interpreter's tl.dot (numpy's matmul) may round a
    # 32-row product differently from a 16-row one, so dq may differ here (never dk / dv: other kernel).
    assert rows[5]["bits"].endswith("dk=same dv=same"), text
    assert rows[1]["bits"].endswith("dk=diff dv=diff"), text  # split 1: no fp32 partials, other rounding
    assert (tmp_path / "attention_sweep_llama.csv").read_text().count("\n") == len(rows) + 1


@given(seed=seeds())
def test_loose_check_rejects_a_wrong_gradient(seed):
    A = _module()
    ref = tuple(seed.randn(2, 3, 8, 4) for _ in range(3))
    assert A.llama_check(ref, ref) is None
    bad = (ref[0], ref[1] * 1.1, ref[2])
    assert "dk" in A.llama_check(bad, ref)


def test_cli_refuses_misplaced_options():
    A = _module()
    for argv in (["--shape", "llama"], ["--compile-only"],
                 ["--sweep", "--shape", "llama", "--kernels", "fwd,dq"],
                 ["--sweep", "--shape", "llama", "--kernels", "fwd", "--compile-only"]):
        with pytest.raises(SystemExit):
            A.main(argv)


def test_two_candidates_compile_for_sm90_with_register_counts():
    A = _module()
    C = A.LlamaCand
    lines = []
    capped = (32, 128, 8, 2, False, True, 128)
    rows = A.compile_only_llama(cands=[C("base"), C("dkdv", dkdv=(32, 128, 8, 3)), C("dkdv", dkdv=capped)],
                                log=lines.append)
    text = "\n".join(lines)
    assert [(r["kind"], r["kernel"]) for r in rows] == [("base", "attn_bwd_dq_kernel"),  # launch order
                                                         ("base", "attn_bwd_dkdv_kernel"),
                                                         ("dkdv", "attn_bwd_dkdv_kernel"),
                                                         ("dkdv", "attn_bwd_dkdv_kernel")], text
    assert all(r["ok"] and 0 < r["regs"] <= 255 and 0 < r["shared"] <= 232448 for r in rows), text
    assert rows[2]["spill"] == 0 and rows[2]["config"] == (32, 128, 8, 3), text
    # The register cap reaches ptxas: uncapped this tile takes 170 registers (one 8-warp program per SM).
    assert rows[2]["maxnreg"] is None and rows[3]["maxnreg"] == 128, text
    assert rows[3]["regs"] <= 128 and rows[2]["regs"] > 128, text


def test_layer_shapes_and_split_candidates():
    A = _module()
    shape = A.layer_shape("hq=32,hkv=8,d=128")
    assert shape == dict(A.LLAMA, hkv=8, d=128)
    assert A.layer_shape("") == A.LLAMA
    for bad in ("hq=32,heads=4", "hkv=", "hq=30,hkv=4"):
        with pytest.raises(ValueError, match="--layer"):
            A.layer_shape(bad)
    cands = A.split_candidates(shape, (1, 2, 3, 4, 8), A._tiles("64:64:4:3;32:128:4:2"))
    assert cands[0] == A.LlamaCand("base")
    assert [(c.dkdv, c.split) for c in cands[1:]] == [
        ((64, 64, 4, 3), 1), ((64, 64, 4, 3), 2), ((64, 64, 4, 3), 4),
        ((32, 128, 4, 2), 1), ((32, 128, 4, 2), 2), ((32, 128, 4, 2), 4)]  # 3 and 8 do not divide 4
    assert [c.dkdv for c in A.split_candidates(shape, (2,), A._tiles(""))] == [None, None]


@given(seed=seeds())
def test_forward_sweep_on_cpu(monkeypatch, tmp_path, seed):
    """The forward sweep under the interpreter (fp32): every tile passes the loose check against fp32 SDPA,
    TMA loads give the pointer loads' bits, and the CSV is written; the tile list starts from the shipped
    forward config."""
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    A = _module()
    assert A.LLAMA_FWD[0] == tuple(vars(L.FWD_CONFIGS[(64, 2, True)]).values())[:4]
    shape = dict(b=1, hq=4, hkv=2, s=40, d=16, causal=True, layout="bshd")
    tiles = [(16, 16, 1, 1), (16, 16, 1, 1, False, True), (32, 16, 1, 1), (16, 32, 1, 1)]
    lines = []
    rows = A.sweep_llama_fwd(tmp_path, shape=shape, device="cpu", tiles=tiles, log=lines.append,
                             timer=lambda fn: (fn(), 1.0)[1], dtype=torch.float32, seed=seed.value)
    text = "\n".join(lines)
    assert [r["status"] for r in rows] == ["ok"] * 4, text
    assert "(unexpected)" not in text and rows[1]["bits"] == "same", text
    assert (tmp_path / "attention_sweep_llama_fwd.csv").read_text().count("\n") == len(rows) + 1
