"""CPU checks of bench/attn_bwd_ordered.py (issue 5: the fused backward with dq accumulated in a fixed order,
an experiment for the GPU), so it cannot rot before the GPU run:

- under Triton's interpreter (programs run one after another in id order), the fused kernel's dq, dk, dv
  are within the float64 oracle's bounds (fp16 and fp32, two block sizes, both dq numerics), two runs give
  identical bits (outputs and dq buffer NaN-filled first: nothing left unwritten or read before written),
  dk/dv equal the shipped backward's bits where the query step is the same (16), every wait was already
  satisfied when reached and the counters are back at zero; the same kernel with the key blocks ascending
  (each program then waits on a LATER id) must report timed-out waits and leave NaN: the checks can fail;
- the GPU run's per-case code (oracle, determinism, bits, timing, table row) runs on the CPU;
- one configuration compiles for sm_90 offline and its final loop keeps the protocol's order (five
  products, spin, counting barrier, one read of the dq tile, store, barrier, release), with gpu-scope
  acquire / release in the PTX, .v2 tile accesses whose pairs are adjacent, and no fp contraction;
- the PTX pair check and the deadlock guard's bookkeeping (a hung or crashed child) can fail.
"""

from __future__ import annotations

import os
import re
import subprocess

import sm90
import torch
from conftest import StubHarness, bench_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    return bench_module("attn_bwd_ordered")


def test_interpreted_oracle_determinism_and_wait_order(monkeypatch):
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    M = _module()
    lines = []
    assert M.interpret_check(log=lines.append) == [], "\n".join(lines)
    # the negative control ran and was detected (interpret_check fails otherwise, this keeps it visible)
    assert sum("timed-out waits" in line for line in lines) == 2, lines


def test_gpu_case_code_runs_on_cpu(monkeypatch):
    """run_case (the GPU run's check-and-time step) on a small causal fp16 case with interpreter configs, a
    wall-clock stand-in for the timer and no peers: every config row passes the oracle, is deterministic,
    and (query step 16) has the shipped dk/dv bits."""
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    M = _module()
    import oracle

    class Args:
        no_cudnn = True

    rows = []
    cfgs = [M.Cfg(16, 1, 1, spin=0), M.Cfg(32, 1, 1, spin=0, dq_norm=1)]
    M.run_case(1, 2, 64, 32, cfgs, Args, StubHarness, None, oracle, rows, {}, device="cpu",
               dtype=torch.float16)
    assert len(rows) == 1 + len(cfgs)
    for row in rows[1:]:
        _label, _name, _ms, _tf, _speed, _kms, ratio, det, _kv, _dq, _info, note = row
        assert ratio <= 1.0 and det == "yes" and note.startswith("ok"), row
    assert rows[1][8] == "same", rows[1]  # the 16-query step: the shipped interpreter's dk/dv bits


SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import attn_bwd_ordered as M
print(json.dumps(M.compile_stats((64, M.Cfg(64, 4, 2), True))))
"""


def test_default_config_compiles_for_sm90_in_protocol_order():
    r = sm90.run_script(SCRIPT, os.path.join(ROOT, "bench"), what="the ordered backward",
                            python=sm90.compiler_python())
    assert r["ok"] and r["order_ok"], r.get("order", r)
    assert "5/5 products before the spin" in r["order"], r["order"]
    assert "v2 pairs adjacent" in r["order"] and not r["order"].startswith("0 "), r["order"]
    assert 0 < r["shared"] <= 232448 and r["fma"] == 0, {k: v for k, v in r.items() if k != "ptx"}
    ptx = r["ptx"]
    assert re.search(r"ld\.acquire\.gpu\.global\.b32", ptx)
    # the dq tile in .v2 pairs through L2, added with a plain round-to-nearest add (no fma)
    assert re.search(r"ld\.global\.cg\.v2\.f32", ptx) and re.search(r"st\.global\.cg\.v2\.b32", ptx)
    assert "add.rn.f32 %u0, %t0, %u0" in ptx
    # the wait's barrier counts the threads whose spin ran out (every thread's give-up is reported)
    assert re.search(r"bar\.red\.popc\.u32", ptx)
    assert r["LDG.STRONG"].split("/")[0] == "1", r["LDG.STRONG"]  # 32-bit strong loads: the spin only
    release = [m.start() for m in re.finditer(r"atom\.global\.gpu\.release\.exch\.b32", ptx)]
    assert len(release) == 2, len(release)  # the diagonal step and the loop
    for pos in release:  # a bar.sync shortly before each release (the barrier of _release)
        assert "bar.sync" in ptx[max(0, pos - 600):pos], ptx[max(0, pos - 600):pos + 80]


def test_loop_order_check_rejects_a_reordered_loop():
    """The IR check the GPU run relies on (it refuses a config that fails it): the right order passes; the
    spin after the tile's read (what Triton 3.6's pipeliner produced before the data chain), a second read,
    a missing barrier before the release each fail."""
    M = _module()

    def ir(*ops):
        body = "\n".join(f"      %{i} = {op}" for i, op in enumerate(ops))
        return f"  tt.func @k() {{\n    %l = scf.for %i = %a to %b step %c {{\n{body}\n    }}\n  }}\n"

    dot = "ttng.warp_group_dot %x, %y"
    spin = 'tt.elementwise_inline_asm "SPIN: ld.acquire.gpu.global.b32 $0, [$1];"'
    bar = 'tt.elementwise_inline_asm "bar.sync 0;"'
    read = 'tt.elementwise_inline_asm "ld.global.cg.f32 %t, [$1]; add.rn.f32"'
    store = 'tt.elementwise_inline_asm "@%p st.global.cg.b32 [$1], $2;"'
    release = "tt.atomic_rmw exch, release, gpu, %p, %v"
    good = [dot] * 5 + [spin, bar, read, store, bar, release]
    ok, summary = M.loop_order(ir(*good))
    assert ok and "5/5 products before the spin" in summary, summary
    assert not M.loop_order(ir(*([dot] * 5 + [read, store, spin, bar, bar, release])))[0]
    assert not M.loop_order(ir(*([dot] * 5 + [spin, bar, read, read, store, bar, release])))[0]
    assert not M.loop_order(ir(*([dot] * 5 + [spin, bar, read, store, release])))[0]
    assert not M.loop_order(ir(*([dot] * 5 + [spin, read, store, bar, release])))[0]


def test_ptx_pair_check_rejects_non_adjacent_pointers():
    """The .v2 tile accesses assume each asm's two pointers are p and p + 4 (checked in the PTX of every
    compiled config before the GPU launches it): adjacent pairs pass, a gap, a swapped pair, an odd start
    and a pointer defined twice (a loop phi) each fail."""
    M = _module()

    def ptx(second_off: int, first_off: int = 0, extra: str = "") -> str:
        return (f"\tadd.s64 \t%rd10, %rd9, {first_off};\n\tadd.s64 \t%rd11, %rd9, {second_off};\n{extra}"
                "\t{\n// v2pair %rd10 %rd11\nld.global.cg.v2.f32 {%t0, %t1}, [%rd10];\n}\n")

    assert M.ptx_pairs_ok(ptx(4))[0]
    assert M.ptx_pairs_ok(ptx(36, 32))[0]
    assert not M.ptx_pairs_ok(ptx(8))[0]
    assert not M.ptx_pairs_ok(ptx(-4))[0]
    assert not M.ptx_pairs_ok(ptx(8, 4))[0]
    assert not M.ptx_pairs_ok(ptx(4, extra="\tmov.b64 \t%rd10, %rd3;\n"))[0]
    assert M.ptx_pairs_ok("no pairs")[0]


def test_guard_marks_the_hung_config_and_runs_the_rest(monkeypatch):
    """run_guard with a stand-in for the child process: the first child finishes config a, hangs in b (killed
    at the time limit); a second child runs c, which reports timed-out waits, then fails in d with a CUDA
    error (the child stops: the error is sticky); a third child runs e. a and e pass, b is marked as hung,
    c and d with their failures (the main run skips all three); no config is silently dropped."""
    M = _module()
    items = [(64, M.Cfg(64, 4, 2)), (64, M.Cfg(64, 4, 2, dq_norm=1)), (64, M.Cfg(64, 4, 3)),
             (64, M.Cfg(64, 4, 2, group_heads=8)), (64, M.Cfg(64, 4, 2, vec=1))]
    a, b, c, d, e = (cfg.label() for _, cfg in items)
    calls = []

    def fake_run(cmd, capture_output, text, timeout):
        calls.append(cmd[cmd.index("--guard-only") + 1])
        if len(calls) == 1:
            out = f"START 64 {a}\nGUARD 64 {a} 0.10s ok\nSTART 64 {b}\n"
            raise subprocess.TimeoutExpired(cmd, timeout, output=out.encode())
        if len(calls) == 2:
            out = (f"START 64 {c}\nGUARD 64 {c} 0.20s 3 timed-out waits, 0 counters not reset -\n"
                   f"START 64 {d}\nGUARD 64 {d} 0.01s error AcceleratorError: misaligned address -\n")
            return subprocess.CompletedProcess(cmd, 3, out, "")
        return subprocess.CompletedProcess(cmd, 0, f"START 64 {e}\nGUARD 64 {e} 0.10s ok\n", "")

    monkeypatch.setattr(M.subprocess, "run", fake_run)

    class Args:
        d, block, configs = "64", "64", ""

    result = M.run_guard(Args, items, timeout=100.0)
    assert result[(64, a)] == "" and result[(64, e)] == "", result
    assert "TIMED OUT" in result[(64, b)]
    assert "timed-out waits" in result[(64, c)]
    assert "misaligned" in result[(64, d)]
    assert len(calls) == 3 and a not in calls[1] and b not in calls[1] and c in calls[1], calls
    assert calls[2] == repr([(64, e)]), calls
