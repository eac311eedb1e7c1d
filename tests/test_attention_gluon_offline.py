"""The Gluon attention kernels (safeops.kernels.attention_gluon: the forward;
safeops.kernels.attention_gluon_bwd: the backward's dK / dV and dQ), checked without a GPU.

Every configuration the launchers can choose (the forward: bf16 / fp16 x each head dim of ``FWD_CONFIGS``
x causal or not x dense or packed (varlen) x a left window or not; sinks are a runtime flag of the same
kernels; the backward's dK / dV
and dQ: bf16 / fp16 x each head dim of ``BWD_CONFIGS`` / ``DQ_CONFIGS`` x causal or not; a variant whose
switch is off in bf16 at head dim 128 only; the GQA group, the sizes and the persistent grid are runtime
values, not compile-time ones) is compiled for sm_90 exactly as ``safeops.ops.attention_gluon``'s plans
launch it (their constexprs, 4 warps, ``enable_fp_fusion=False``), in one subprocess pool with Triton 3.6
(the Gluon API the kernels are written for; the test skips without one), together with a fusion-on control
per kernel. Then:

- contract section 1 at the instruction level: no f32 ``fma`` and every f32 mul / add / sub ``.rn`` in the
  PTX, so ``z2 = s * C1`` is rounded once and the same bits feed the row max and ``z2 - m``; with fp fusion
  on the same kernel shows fma (the check can fail);
- the fused backward (dK / dV and dQ with a writer warp; by default for non-causal D=128 with its TMA
  reduce-add writer, the shifted order and the row statistics precomputed), and its atomic writer,
  compiles the same way;
- the FA3 structure is what was compiled: Hopper wgmma, and setmaxnreg giving the consumer warpgroups their
  registers and the TMA warp 24; with ``late_pv_wait`` (D=128) the SASS (cuobjdump) keeps each key-block
  loop's wait for the previous PV product after the softmax's exponentials (a control without it shows
  ptxas hoisting the wait);
- it fits: shared memory at most 227 KB (232448 bytes, the H100 / H200 per-block limit), and ptxas (Triton's
  own ``-v`` run, ``--fmad=false``, whose log Triton prints on request) warns of nothing (no serialized
  wgmma) and spills nothing in the forward (at most ``SPILL_CAP_FWD_D64`` bytes at head dim 64), at most
  ``SPILL_CAP`` bytes in the backward (``SPILL_CAP_BWD_D64`` in the D=64 dK / dV kernel).

``python -m pytest tests/test_attention_gluon_offline.py -s`` prints registers, spills and shared memory per
configuration. The path choice's reasons are tested on CPU tensors in tests/test_attention_backend.py.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import sm90

from safeops.kernels import attention_gluon as K
from safeops.kernels import attention_gluon_bwd as KB
from safeops.ops import attention_gluon as G

SMEM_LIMIT = 232448  # bytes: H100/H200 (sm_90) maximum dynamic shared memory per block
# ptxas spill bytes allowed per kernel: none in the forward; the D=128 dK / dV kernel sits at its 240 / 248
# register budgets (two 64 x 128 fp32 accumulators per thread) and spills 8-84 bytes (stores + loads);
# with the packed-sequence and window arguments (2026-12-06) 52-232 bytes, all of them around the step
# loops (the loops holding the wgmmas have no local-memory access in the SASS), which this cap lets
# through and a regression past it does not.
# The D=64 forward runs three consumer warpgroups at 160 registers: 0-256 bytes of spills, and measured faster
# than two warpgroups without spills (bench/RESULTS.md); capped there at what it spills today. The softcapped
# forward (off) spills 0-368 bytes at D=128 (non-causal: 4 stores and 4 loads in one consumer's step loop of
# 1,680 instructions, offline 2026-12-06).
SPILL_CAP = {"fwd": 0, "fwd+window": 0, "fwd+softcap": 400, "bwd": 256, "dq": 0, "fused": 300,
             "fused+atomic": 1100, "fused+tma+lpt": 300, "fused+tma+dqe": 300}
SPILL_CAP_FWD_D64 = 256
# The D=64 dK / dV kernel's three warpgroups at 160 registers: 32 bytes without causal, 288 with (its
# selects); measured 1.05x the two-warpgroup kernel causal and 1.23x without (bench/RESULTS.md, 2026-12-06).
SPILL_CAP_BWD_D64 = 300


def _spill_cap(c: tuple) -> int:
    if c[2] == 64 and c[0].startswith("fwd"):
        return SPILL_CAP_FWD_D64
    if c[0].startswith("bwd"):  # "bwd", "bwd+split" (the GQA split's fp32 partials)
        return SPILL_CAP_BWD_D64 if c[2] == 64 else SPILL_CAP["bwd"]
    return SPILL_CAP[c[0]]
KERNEL_FILE = os.path.join(sm90.ROOT, "safeops", "kernels", "attention_gluon.py")
BWD_KERNEL_FILE = os.path.join(sm90.ROOT, "safeops", "kernels", "attention_gluon_bwd.py")

_SCRIPT = textwrap.dedent(
    r"""
    import contextlib, importlib.util, io, json, multiprocessing, os, re, subprocess, sys, tempfile
    from concurrent.futures import ProcessPoolExecutor

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    path, bwd_path, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

    def load(name, file):
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    K = load("attention_gluon", path)
    KB = load("attention_gluon_bwd", bwd_path)
    knobs.nvidia.dump_ptxas_log = True  # Triton prints the log of its own ptxas -v run: no second run

    def ptxas_log(ptx, fusion):
        # A compile served from Triton's cache ran no ptxas: run it as Triton does (same flags).
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            fmad = [] if fusion else ["--fmad=false"]
            return subprocess.run([get_ptxas(90).path, *fmad, "-v", "--gpu-name=sm_90a", src, "-o",
                                   os.path.join(tmp, "k.o")], capture_output=True, text=True).stderr

    def pv_overlap(cubin):
        # Per innermost loop that holds wgmma and exponentials (the consumers' key-block loops): whether every
        # MUFU.EX2 comes before the loop's last wait for all wgmma groups (the previous block's PV product).
        from triton.backends import nvidia
        tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
        ins = [(int(m.group(1), 16), m.group(2))
               for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
        # (first, last) address of each loop. Left out: mbarrier retry loops (a few instructions), and the
        # retry paths ptxas places after the code, whose branches back span the partition's EXIT.
        exits = [a for a, text in ins if re.search(r"\bEXIT\b", text)]
        back = []
        for a, text in ins:
            m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
            lo = int(m.group(1), 16) if m else a
            if 0x400 < a - lo and not any(lo <= e <= a for e in exits):
                back.append((lo, a))
        loops = []
        for lo, hi in back:
            if any(lo <= x < y <= hi and (x, y) != (lo, hi) for x, y in back):
                continue  # not innermost
            body = [(a, t) for a, t in ins if lo <= a <= hi]
            mufu = [a for a, t in body if "MUFU.EX2" in t]
            waits = [a for a, t in body if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in t]
            if mufu and waits and any("HGMMA" in t for a, t in body):
                loops.append(max(mufu) < max(waits))
        return loops

    def compile_one(job):
        kind, dtype, d, causal, varlen, fusion = job
        if kind.startswith("fwd"):  # "fwd", "fwd+window"
            cfg = K.FWD_CONFIGS[d]
            if "+early" in kind:  # the overlap check's control: the PV wait where ptxas puts it
                import dataclasses
                cfg = dataclasses.replace(cfg, late_pv_wait=False)
            fn = K.attn_fwd_gluon_kernel
            constexprs = K.constexprs(cfg, causal, varlen, "+window" in kind, "+softcap" in kind)
            sig = K.signature(cfg, d, dtype, varlen)
            # A torch allocation is 16-byte aligned: Triton's launch specializes the stats pointers so (the
            # pointers of K.UNALIGNED_ARGS are not specialized).
            aligned = ("m_ptr", "l_ptr")
            loader_regs = K.LOADER_REGS
        elif kind.startswith("bwd"):  # the backward's dK / dV: every tensor argument is a TMA descriptor
            cfg = KB.BWD_CONFIGS[d]
            fn = KB.attn_bwd_dkdv_gluon_kernel
            constexprs = KB.constexprs(cfg, causal, "+split" in kind)
            sig = KB.signature(cfg, d, dtype, "+split" in kind)
            aligned = ()
            loader_regs = KB.LOADER_REGS
        elif kind.startswith("fused"):  # dK / dV and dQ in one kernel; dq_ptr / sem_ptr: fresh allocations
            cfg = KB.FUSED_CONFIGS[d]
            import dataclasses
            if "+atomic" in kind:  # the atomic writer, the plain order, the row statistics in the kernel
                cfg = dataclasses.replace(cfg, tma_reduce=False, finalize=True, shift=False, early_turn=False,
                                          row_stats=False)
            if "+tma" in kind:  # its writer's TMA reduce-add (finalize off)
                cfg = dataclasses.replace(cfg, tma_reduce=True, finalize=False)
            if "+shift" in kind:  # (not causal) the shifted order, the writer waiting for turns early
                cfg = dataclasses.replace(cfg, shift=True, early_turn=True)
            # As the launch takes it where a head's key blocks fit on half the SMs (KB.fused_shift).
            shift = cfg.shift and not causal
            if "+lpt" in kind:  # (causal) longest first, turns ascending
                cfg = dataclasses.replace(cfg, causal_lpt=True)
            if "+dqe" in kind:  # dQ between dV and dK, its partial stored while dK runs
                cfg = dataclasses.replace(cfg, dq_early=True)
            if "+rs" in kind:  # the row statistics' base and 1 / l precomputed
                cfg = dataclasses.replace(cfg, row_stats=True)
            fn = KB.attn_bwd_fused_gluon_kernel
            constexprs = KB.fused_constexprs(cfg, causal, shift)
            sig = KB.fused_signature(cfg, d, dtype)
            aligned = ("dq_ptr", "out_ptr", "sem_ptr")
            loader_regs = KB.writer_regs(cfg.consumer_regs)  # the TMA warp shares the writer's warpgroup
        else:  # the backward's dQ
            cfg = KB.DQ_CONFIGS[d]
            fn = KB.attn_bwd_dq_gluon_kernel
            constexprs = KB.dq_constexprs(cfg, causal)
            sig = KB.dq_signature(cfg, d, dtype)
            aligned = ("m_ptr", "l_ptr", "delta_ptr")
            loader_regs = KB.LOADER_REGS
        sig.update({name: "constexpr" for name in constexprs})
        constants = {(fn.arg_names.index(name),): v for name, v in constexprs.items()}
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
        options = dict(K.LAUNCH_OPTIONS, enable_fp_fusion=fusion)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                c = triton.compile(GluonASTSource(fn, sig, constants, attrs),
                                   target=GPUTarget("cuda", 90, 32), options=options)
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {str(e)[-3000:]}"}
        ptx = c.asm["ptx"]
        log = printed.getvalue()
        if "Used" not in log:
            log = ptxas_log(ptx, fusion)
        regs = re.search(r"Used (\d+) registers", log)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        return {"ok": True, "shared": c.metadata.shared,
                "fma": len(re.findall(r"\bfma\.rn(\.ftz)?\.f32\b", ptx)),
                "loose": len(re.findall(r"(?<![\w.])(mul|add|sub)(\.ftz)?\.f32\b", ptx)),  # not atom.*.add
                "wgmma": len(re.findall(r"\bwgmma\.mma_async", ptx)),
                "setmaxnreg": sorted({(m.group(1), int(m.group(2))) for m in re.finditer(
                    r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                "regs_at_launch": int(regs.group(1)) if regs else None,
                "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else None,
                "ptxas_warnings": [x for x in log.splitlines() if "warning" in x.lower()
                                   or "performance" in x.lower()],
                "consumer_regs": cfg.consumer_regs, "loader_regs": int(loader_regs),
                "pv_overlap": pv_overlap(c.asm["cubin"]) if kind.startswith("fwd") and d == 128 else None}

    if __name__ == "__main__":
        workers = max(1, min(len(jobs), os.cpu_count() or 1))
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(compile_one, jobs, chunksize=1))
        print(json.dumps(results))
    """
)

# (kernel, dtype, head dim, causal, varlen): every kernel the launchers can launch. The GQA group, the sizes
# and the persistent grid are runtime values.
FWD_KINDS = ("fwd", "fwd+window", "fwd+softcap")


def _gated(kind: str) -> bool:
    """A kernel variant its switch keeps off (attention_gluon.GLUON_WINDOW / GLUON_DQ): the
    launchers cannot choose it yet, so it compiles in bf16 at head dim 128 only (the other dtype and head
    dims are the same code) until the switch is turned on."""
    off = {"window": not G.GLUON_WINDOW, "dq": not G.GLUON_DQ, "fused": not G.GLUON_FUSED,
           "softcap": not G.GLUON_SOFTCAP}
    return any(off.get(flag, False) for flag in kind.split("+"))


def _dtypes(kind: str) -> tuple[str, ...]:
    return ("bfloat16",) if _gated(kind) else K.DTYPES


def _dims(kind: str) -> tuple[int, ...]:
    if _gated(kind):
        return (128,)
    return K.WINDOW_HEAD_DIMS if "window" in kind else K.HEAD_DIMS if kind.startswith("fwd") else KB.HEAD_DIMS


def _launchable(kind: str, d: int, causal: bool) -> bool:
    """The softcap build at the (head dim, causal) pairs the path choice sends to it (G.SOFTCAP_CASES)."""
    return "softcap" not in kind or _gated(kind) or (d, causal) in G.SOFTCAP_CASES


CONFIGS = [(kind, dtype, d, causal, varlen) for kind in FWD_KINDS for dtype in _dtypes(kind)
           for d in _dims(kind) for causal in (False, True) for varlen in (False, True)
           if _launchable(kind, d, causal)] + [
    (kind, dtype, d, causal, False) for kind in ("bwd", "bwd+split", "dq") for dtype in _dtypes(kind)
    for d in _dims(kind) for causal in (False, True)
    if kind != "bwd+split" or d in G.SPLIT_HEAD_DIMS] + [
    # The fused backward: the launchers take its D=128 configuration without causal in both dtypes
    # (attention_gluon.FUSED_NONCAUSAL); causal only with GLUON_FUSED.
    ("fused", dtype, 128, causal, False) for dtype in K.DTYPES for causal in (False, True)
    if not causal or dtype == "bfloat16" or G.GLUON_FUSED] + [
    # Configurations no launcher chooses (switched off, measured slower): bf16 at D=128.
    ("fused+tma+lpt", "bfloat16", 128, True, False)] + [
    (kind, "bfloat16", 128, causal, False) for kind in ("fused+atomic", "fused+tma+dqe")
    for causal in (False, True)]
# The contraction check's controls: one configuration of each kernel compiled with fp fusion on must show
# f32 fma. The backward's at D=64: at D=128 a uniform branch (the window's selects) sits between the score's
# multiply and its subtraction in every step, so even fusion on has nothing to contract there.
FUSION_ON = [("fwd", "bfloat16", 128, True, False), ("bwd", "bfloat16", 64, False, False),
             ("dq", "bfloat16", 64, True, False), ("fused", "bfloat16", 128, True, False)]
# The overlap check's control: the D=128 forward without late_pv_wait, where ptxas places the wait for the
# previous PV product before the exponentials (the check can fail).
EARLY_WAIT = ("fwd+early", "bfloat16", 128, False, False)


def _compile(jobs: list[tuple]) -> list[dict]:
    python = sm90.triton36_python()
    if python is None:
        pytest.skip("the Gluon kernel is written for Triton 3.6: no Triton 3.6 Python here "
                    "(SAFEOPS_COMPILE_PYTHON or /tmp/t36, see tests/sm90.py)")
    return sm90.run_script(_SCRIPT, KERNEL_FILE, BWD_KERNEL_FILE, json.dumps(jobs),
                           what="the Gluon attention kernels", timeout=1800, python=python)


@pytest.fixture(scope="module")
def compiled() -> dict[tuple, dict]:
    """Every configuration (fp fusion off, as launched) and the fusion-on control, in one process pool."""
    # The control first: the longest compiles start first, so the pool's tail is short.
    jobs = [[*c, True] for c in FUSION_ON] + [[*EARLY_WAIT, False]] + [[*c, False] for c in CONFIGS]
    results = _compile(jobs)
    table = dict(zip(CONFIGS, results[len(FUSION_ON) + 1:], strict=True))
    for c, r in zip(FUSION_ON, results, strict=False):
        table[("fusion on", *c)] = r
    table[("control", *EARLY_WAIT)] = results[len(FUSION_ON)]
    print("\nGluon attention kernels, sm_90, Triton 3.6 (kernel, dtype, head dim, causal, varlen):")
    for c, r in table.items():
        if r["ok"]:
            print(f"  {c}: shared {r['shared']} B, {r['regs_at_launch']} registers at launch, consumer "
                  f"budget {r['consumer_regs']}, spills {r['spill_bytes']} B, wgmma {r['wgmma']}, f32 fma "
                  f"{r['fma']}, non-.rn f32 mul/add/sub {r['loose']}, setmaxnreg {r['setmaxnreg']}"
                  + (f", loops with the PV wait after the exponentials {r['pv_overlap']}"
                     if r["pv_overlap"] is not None else ""))
        else:
            print(f"  {c}: FAILED {r['error'][:500]}")
    return table


def _launched(compiled) -> dict[tuple, dict]:
    return {c: r for c, r in compiled.items() if c[0] not in ("fusion on", "control")}


def test_every_configuration_compiles_and_fits(compiled):
    compiled = _launched(compiled)
    failed = {c: r["error"] for c, r in compiled.items() if not r["ok"]}
    assert not failed, f"Gluon configurations that do not compile for sm_90: {failed}"
    too_big = {c: r["shared"] for c, r in compiled.items() if r["shared"] > SMEM_LIMIT}
    assert not too_big, f"shared memory past {SMEM_LIMIT} bytes: {too_big}"
    spills = {c: r["spill_bytes"] for c, r in compiled.items()
              if r["spill_bytes"] is None or r["spill_bytes"] > _spill_cap(c)}
    assert not spills, (f"ptxas spills past {SPILL_CAP} bytes ({SPILL_CAP_FWD_D64} in the D=64 forward, "
                        f"{SPILL_CAP_BWD_D64} in the D=64 dK / dV; None: no ptxas report): {spills}")
    # e.g. "Potential Performance Loss: wgmma.mma_async instructions are serialized" (C7515)
    warned = {c: r["ptxas_warnings"] for c, r in compiled.items() if r["ptxas_warnings"]}
    assert not warned, f"ptxas warnings: {warned}"


def test_no_contraction_in_the_softmax(compiled):
    compiled = _launched(compiled)
    offenders = {c: (r["fma"], r["loose"]) for c, r in compiled.items() if r["fma"] or r["loose"]}
    assert not offenders, f"f32 fma / non-.rn f32 mul-add in the Gluon kernels (contract 1): {offenders}"


def test_warp_specialized_wgmma(compiled):
    for c, r in _launched(compiled).items():
        assert r["wgmma"] > 0, f"{c}: no wgmma.mma_async in the PTX"
        budgets = set(map(tuple, r["setmaxnreg"]))
        assert ("inc", r["consumer_regs"]) in budgets, f"{c}: consumer warpgroups not raised: {budgets}"
        assert ("dec", r["loader_regs"]) in budgets, f"{c}: TMA warp not lowered to its registers: {budgets}"


def test_kernel_sizes_unpacked_by_name():
    """Every partition unpacks the kernels' tuple of runtime sizes by name: an index into it (``sizes[7]``)
    reads another value once the tuple grows, and a loop bound read that way in one partition alone hangs
    the GPU (on a branch the forward's TMA warp looped to n_m_blocks instead of n_tiles after a new value
    joined the tuple; no CPU test runs the kernels)."""
    import re

    for path in (KERNEL_FILE, BWD_KERNEL_FILE):
        with open(path) as f:
            source = f.read()
        assert not re.search(r"\bsizes\[", source), f"{path}: index into sizes; unpack it by name"


def test_bwd_config_options_that_need_unpipelined_steps():
    """``turns`` and ``skip_masked`` are written for the unpipelined step loop only: with ``pipeline=True``
    the configuration is refused by name instead of compiling a kernel that ignores them; the skip reaches
    the kernel as its constexpr."""
    with pytest.raises(ValueError, match="skip_masked"):
        KB.GluonBwdConfig(block_m=64, num_stages=3, pipeline=True, skip_masked=True)
    with pytest.raises(ValueError, match="turns"):
        KB.GluonBwdConfig(block_m=64, num_stages=3, pipeline=True, turns=1)
    cfg = KB.GluonBwdConfig(block_m=64, num_stages=3, skip_masked=True)
    assert KB.constexprs(cfg, True)["SKIP_MASKED"] is True
    assert KB.constexprs(KB.GluonBwdConfig(block_m=64, num_stages=3), True)["SKIP_MASKED"] is False


@pytest.mark.parametrize("control", FUSION_ON, ids=lambda c: c[0])
def test_contraction_check_can_fail(compiled, control):
    r = compiled[("fusion on", *control)]
    assert r["ok"], r.get("error")
    # With fusion on, LLVM fuses some products into fma and leaves others as mul / add without .rn, which
    # ptxas may fuse (the D=64 dK / dV kernel, unpipelined: all of them); the check counts both.
    assert r["fma"] + r["loose"] > 0, f"fp fusion on left nothing contractible: the check is blind ({r})"


def test_softmax_overlaps_the_pv_product(compiled):
    """With ``GluonFwdConfig.late_pv_wait`` (D=128) the SASS keeps, in every consumer's key-block loop, the
    wait for the previous block's PV product after the last exponential of the block's softmax (ptxas
    otherwise hoists it above them, bench/RESULTS.md 2026-12-06); the control without it shows the hoist."""
    checked = 0
    for c, r in _launched(compiled).items():
        if r["pv_overlap"] is None or not K.FWD_CONFIGS[c[2]].late_pv_wait:
            continue
        assert r["pv_overlap"] and all(r["pv_overlap"]), (
            f"{c}: a PV wait before an exponential: {r['pv_overlap']}")
        checked += 1
    assert checked, "no configuration with late_pv_wait was checked"
    control = compiled[("control", *EARLY_WAIT)]
    assert control["ok"] and control["pv_overlap"] and not any(control["pv_overlap"]), (
        f"the control's loops show no hoisted wait: the check is blind ({control.get('pv_overlap')})")
