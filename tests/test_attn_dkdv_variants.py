"""CPU checks of bench/attn_dkdv_variants.py: dk/dv kernel variants that lower register pressure at the GQA
split without changing a bit.

- under Triton's interpreter every variant gives the shipped kernel's dq / dk / dv bits (fresh random inputs:
  fp16 / fp32, causal, dense, window, softcap + bool mask, whole and partial blocks, (B, S, H, D) strides,
  packed varlen, 1 / 2 / 4 query heads per program);
- the swap really launches the variant (a counting stand-in), and the bit comparison sees a one-ulp change;
- the chosen variants compile for sm_90 offline (Triton 3.6 when /tmp/t36 exists; skipped otherwise) at the
  1.1B Llama layer's split 4 with no local-memory traffic inside their query-block loops, no wgmma
  serialization, and fewer spill bytes than the shipped kernel; ``remat_range_nolicm`` compiles without any
  spill or serialization for causal MHA at D=128.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import bench_module

from safeops.ops import attention_launch as L

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="runs the kernels under Triton's interpreter")

# Checked on every case; the others on the first two cases (the CPU time budget).
CHOSEN = ("remat_nolicm", "flat")
ALSO_EVERY_CASE = ("remat_range_nolicm", "remat")
ALL_ON = {"fp16 causal even g4 split1", "fp32 causal even g4 split2 bshd"}


def _module():
    return bench_module("attn_dkdv_variants")


def _case_ids():
    return [label for label, _ in _module().CPU_CASES]


@needs_interpreter
@pytest.mark.parametrize("label", _case_ids())
def test_variants_give_the_shipped_bits(label, seed):
    V = _module()
    case = dict(V.CPU_CASES)[label]
    t = V.cpu_inputs(case, seed.value)
    ref = V.backward_with("shipped", t, case["split"])
    assert all(torch.isfinite(x).all() for x in ref), seed
    names = list(V.VARIANTS) if label in ALL_ON else [*CHOSEN, *ALSO_EVERY_CASE]
    for name in names:
        got = V.backward_with(name, t, case["split"])
        for what, x, y in zip(("dq", "dk", "dv"), got, ref, strict=True):
            assert V.same_bits(x, y), f"{name} {what} differs from the shipped kernel ({label}, {seed})"


class _Counting:
    """Stands in for a kernel: counts launches and forwards them (a non-JIT stand-in launches as
    ``kernel[grid](...)`` in safeops.ops._launch and in the plans)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            return self.kernel[grid](*args, **kwargs)
        return launch


@needs_interpreter
def test_the_swap_launches_the_variant_and_restores_the_launcher(seed, monkeypatch):
    V = _module()
    label, case = V.CPU_CASES[0]
    t = V.cpu_inputs(case, seed.value)
    counting = _Counting(V.dkdv_remat_nolicm)
    monkeypatch.setitem(V.VARIANTS, "counting", "counting_kernel")
    monkeypatch.setattr(V, "counting_kernel", counting, raising=False)
    before = L._kernels
    V.backward_with("counting", t, case["split"])
    V.backward_with("counting", t, case["split"])  # the second call runs the plan made by the first
    assert counting.launches == 2
    assert L._kernels is before
    assert L.kernels().attn_bwd_dkdv_kernel is V.attn_bwd_dkdv_kernel


def test_the_bit_comparison_sees_one_ulp(seed):
    V = _module()
    for dtype, width in ((torch.float16, torch.int16), (torch.float32, torch.int32)):
        x = seed.randn(5, 7, dtype=dtype)
        y = x.clone()
        y.view(width)[2, 3] += 1
        assert V.same_bits(x, x.clone()) and not V.same_bits(x, y)
        assert not V.same_bits(x, x.to(torch.float64).to(dtype).reshape(7, 5))


def test_recorded_launch_is_the_shipped_llama_launch():
    V = _module()
    launch = V.recorded_dkdv(V.LLAMA, 4)
    kw = launch["kwargs"]
    assert launch["kernel"] == V.SHIPPED
    assert (kw["SPLIT"], kw["GROUP"], kw["EVEN"], kw["MASK_KIND"], kw["HAS_WR"], kw["USE_TMA"]) == (
        4, 8, True, 0, True, False)
    assert V.tile(launch) == tuple(vars(L.DKDV_CONFIGS[(64, 2, True)]).values())[:4]
    assert V.recorded_dkdv(V.LLAMA, None)["kwargs"]["SPLIT"] == L.dkdv_split(8, 1)


def test_chosen_variants_compile_for_sm90_without_loop_spills():
    V = _module()
    python = V.compile_python()
    if python is None:
        pytest.skip("no Triton 3.6 Python for offline sm_90 compiles (/tmp/t36 or SAFEOPS_COMPILE_PYTHON)")
    rows = V.compile_only(["shipped", *CHOSEN], (4,), V.LLAMA, python, log=lambda *a: None)
    by_name = {r["variant"]: r for r in rows}
    assert all(r["ok"] for r in rows), [r["error"] for r in rows]
    shipped = by_name["shipped"]
    for name in CHOSEN:
        r = by_name[name]
        assert r["loops"], f"{name}: no query-block loop found in the SASS"
        assert all(ldst == 0 for _, _, _, ldst in r["loops"]), f"{name}: local memory inside a loop {r}"
        assert r["serialized"] is False, f"{name}: wgmma serialized (ptxas C7515)"
        assert r["spill"] < max(shipped["spill"], 1), f"{name}: {r['spill']} B spilled, shipped {shipped}"


class _Corrupting(_Counting):
    """Launches the kernel, then changes one value of its dk output (a wrong variant)."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kernel[grid](*args, **kwargs)
            args[4].view(-1)[0] += 1
        return launch


@needs_interpreter
def test_gpu_mode_rows_run_on_cpu_and_flag_wrong_bits(monkeypatch):
    V = _module()
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")  # the op on CPU tensors runs the (interpreted) kernels
    monkeypatch.setitem(V.VARIANTS, "wrong", "wrong_kernel")
    monkeypatch.setattr(V, "wrong_kernel", _Corrupting(V.dkdv_flat), raising=False)
    shape = dict(b=1, hq=4, hkv=1, s=32, d=16, causal=True, layout="bshd")
    lines: list[str] = []
    rows = V.gpu_rows(shape, ["remat_nolicm", "wrong"], ["d", "g"], device="cpu", dtype=torch.float16,
                      timer=lambda fn: (fn(), 1.0)[1], log=lines.append)
    got = [(r["variant"], r["split"], r["status"]) for r in rows]
    assert got == [("shipped", "default", "ok"), ("remat_nolicm", "default", "ok"),
                   ("wrong", "default", "BITS DIFFER"), ("shipped", 4, "ok"), ("remat_nolicm", 4, "ok")], (
        lines)
    assert rows[2]["bits"] == "dq=same dk=DIFF dv=same"
    V.summary(rows, log=lines.append)
    assert "1 row(s) not ok: wrong/default: BITS DIFFER" in lines[-1]


def test_remat_range_compiles_spill_free_and_async_for_causal_mha_d128():
    """One head per program, causal MHA at D=128 ((B, H, S, D), B=4 H=16 S=4K): no spill and no wgmma
    serialization (the shipped kernel's are serialized there, offline)."""
    V = _module()
    python = V.compile_python()
    if python is None:
        pytest.skip("no Triton 3.6 Python for offline sm_90 compiles (/tmp/t36 or SAFEOPS_COMPILE_PYTHON)")
    shape = V.layer_shape("b=4,hq=16,hkv=16,layout=bhsd,d=128")
    (r,) = V.compile_only(["remat_range_nolicm"], (1,), shape, python, log=lambda *a: None)
    assert r["ok"], r["error"]
    assert r["spill"] == 0 and r["serialized"] is False, r
    assert r["loops"] and all(ldst == 0 for _, _, _, ldst in r["loops"]), r
