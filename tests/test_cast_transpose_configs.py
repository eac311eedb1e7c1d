"""The bf16 cast + transpose kernel compiles for sm_90, fits in shared memory, keeps its cheap element path.

``safeops.cast_transpose`` runs ``cast_transpose_bf16_kernel`` (element work in inline PTX) for bf16 inputs
with M % 4 == 0 on a GPU, with ``cast_transpose_launch.BF16_CONFIG``. The interpreter cannot run inline PTX,
so CPU CI cannot run it; here it is compiled offline for ``cuda:90`` (tensorwise and rowwise e4m3fn,
rowwise e5m2, whose NaN rule has more instructions) with the GPU machine's Triton (3.6): the Python named by
``SAFEOPS_COMPILE_PYTHON``, else ``/tmp/t36/bin/python``. Without either the test is skipped (CI's Triton
3.9 is not what the GPU runs).

Checks per kernel: it compiles (ptxas included); shared memory <= 232448 bytes (the H200's per-block limit);
no local memory (no LDL/STL: a spill would wreck a bandwidth-bound kernel); registers within the config's
cap; the cheap element path: at most 13 SASS instructions per converted element in the tile loop (the
Triton-level path of ``cast_transpose_kernel`` is ~17), one ``F2FP`` per pair of elements, and x never read
back from shared memory 2 bytes at a time (``LDS.U16``).

On a GPU, every bf16 bit pattern at special scales (tensorwise and rowwise), both fp8 formats, and a ragged
shape, bit for bit against the eager expression.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import sm90
import torch

from safeops.ops import cast_transpose_launch as launch

SMEM_LIMIT = 232448
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Runs in a fresh interpreter with the GPU machine's Triton (no torch needed): loads the kernel file by path,
# compiles every spec for sm_90 and reports registers, shared memory and SASS counts of the tile loop.
SCRIPT = r'''
import collections, importlib.util, json, re, subprocess, sys, tempfile
from concurrent.futures import ProcessPoolExecutor

def one(spec):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    path = spec["kernel_file"]
    mod = importlib.util.spec_from_file_location("ct_kernels", path)
    k = importlib.util.module_from_spec(mod)
    mod.loader.exec_module(k)
    fn = k.cast_transpose_bf16_kernel
    const = dict(spec["constexprs"], sxk=1)
    types = {"x_ptr": "*i16", "scale_ptr": "*fp32", "y_ptr": "*u8", "yt_ptr": "*i32", "ws_ptr": "*i32",
             "amax_ptr": "*i32"}
    sig = {a: "constexpr" if a in const else types.get(a, "i32") for a in fn.arg_names}
    aligned = ("x_ptr", "scale_ptr", "y_ptr", "yt_ptr", "ws_ptr", "amax_ptr", "M", "K", "sxm", "MW")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    try:
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": spec["num_warps"], "enable_fp_fusion": False,
                                    **({"maxnreg": spec["maxnreg"]} if spec.get("maxnreg") else {})})
    except Exception as e:
        return dict(spec, error=f"{type(e).__name__}: {str(e)[-1500:]}")
    binpath = triton.__path__[0] + "/backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    sass = subprocess.run([binpath, "-sass", f.name], capture_output=True, text=True).stdout
    res = subprocess.run([binpath, "-res-usage", f.name], capture_output=True, text=True).stdout
    ins = []
    for ln in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", ln)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    loop = None
    for addr, text in ins:  # the tile loop: the backward branch spanning the most code
        m = re.search(r"BRA\s+(?:`\(.*?\)\s*)?0x([0-9a-f]+)", text)
        start = int(m.group(1), 16) if m else addr
        if start < addr and (loop is None or addr - start > loop[1] - loop[0]):
            loop = (start, addr)
    body = [t for a, t in ins if loop and loop[0] <= a <= loop[1]]
    ops = collections.Counter((t.split()[1] if t.startswith("@") else t.split()[0]) for t in body)
    allops = collections.Counter((t.split()[1] if t.startswith("@") else t.split()[0]) for _, t in ins)
    regs = re.search(r"REG:(\d+)", res)
    return dict(spec, regs=int(regs.group(1)) if regs else -1, shared=c.metadata.shared, loop=len(body),
                ops=dict(ops), local=sum(v for o, v in allops.items() if o.startswith(("LDL", "STL"))))

if __name__ == "__main__":
    specs = json.loads(sys.stdin.read())
    with ProcessPoolExecutor(max_workers=min(8, max(2, __import__("os").cpu_count() or 2))) as ex:
        out = list(ex.map(one, specs))
    print(json.dumps(out))
'''


def specs() -> list[dict]:
    kernel_file = os.path.join(ROOT, "safeops", "kernels", "cast_transpose.py")
    x = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    scale = torch.empty(4096, 1, device="meta")
    cfg = launch.BF16_CONFIG
    out = []
    cases = ((torch.float8_e4m3fn, False), (torch.float8_e4m3fn, True), (torch.float8_e5m2, True))
    for fp8, rowwise in cases:
        opts, _ = launch._options_and_scalars(x, scale, fp8, rowwise, cfg, True, True, bf16=True)
        num_warps = opts.pop("num_warps")
        opts.pop("enable_fp_fusion")
        maxnreg = opts.pop("maxnreg", None)
        out.append(dict(rowwise=rowwise, fp8=str(fp8), kernel_file=kernel_file, constexprs=opts,
                        num_warps=num_warps, maxnreg=maxnreg,
                        codes=cfg.block_m * cfg.block_k // (32 * num_warps)))
    return out


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    python = sm90.triton36_python()
    if python is None:
        pytest.skip("no Triton 3.6 Python for offline sm_90 compiles (set SAFEOPS_COMPILE_PYTHON or create "
                    "/tmp/t36: python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 numpy)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([python, "-c", SCRIPT], input=json.dumps(specs()), capture_output=True, text=True,
                          env=env, timeout=600)
    if proc.returncode != 0:
        if "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
            pytest.skip("Triton's bundled ptxas is missing: cannot compile for sm_90 here")
        raise AssertionError(f"offline compile script failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _label(r: dict) -> str:
    return f"rowwise={r['rowwise']} {r['fp8']}"


def test_bf16_kernel_compiles_and_fits(compiled):
    assert len(compiled) == len(specs()) == 3
    errors = [f"{_label(r)}: {r['error']}" for r in compiled if "error" in r]
    assert not errors, "\n".join(errors)
    for r in compiled:
        assert r["shared"] <= SMEM_LIMIT, f"{_label(r)}: {r['shared']} bytes of shared memory"
        assert r["local"] == 0, f"{_label(r)}: {r['local']} local-memory instructions (spills)"
        assert 0 < r["regs"] <= (r.get("maxnreg") or 255), f"{_label(r)}: {r['regs']} registers"


def test_bf16_kernel_keeps_the_cheap_element_path(compiled):
    """The point of the inline PTX: few instructions per element, both conversions per pair, no 2-byte
    re-reads."""
    for r in compiled:
        assert "error" not in r, r["error"]
        ops = r["ops"]
        per_code = r["loop"] / r["codes"]
        assert per_code <= 13.0, f"{_label(r)}: {per_code:.2f} SASS instructions per element in the tile loop"
        f2fp = sum(v for o, v in ops.items() if o.startswith("F2FP"))
        assert f2fp == r["codes"] // 2, f"{_label(r)}: {f2fp} F2FP for {r['codes']} elements (one per pair)"
        assert not any(o.startswith("LDS.U16") for o in ops), f"{_label(r)}: x re-read from shared, 2 B/load"


INF, NAN = float("inf"), float("nan")
GPU_SCALES = [1.0, 0.1, 0.3333333, 2.0**-10, 3.0e4, -7.5, 1e-30, 0.0, INF, -INF, NAN]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_bf16_kernel_matches_eager_on_every_bf16_pattern(fp8):
    """GPU: every bf16 bit pattern x special scales (tensorwise and rowwise), bit for bit against the eager
    expression, through the launcher's default route (the bf16 kernel), then a ragged shape (partial tiles,
    rowwise) with random data."""
    assert launch.BF16_CONFIG is not None
    x = torch.arange(-2**15, 2**15, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.bfloat16)
    x = x.reshape(256, 256)
    assert launch._bf16_kernel_fits(x, fp8)
    rows = torch.tensor((GPU_SCALES * 24)[:256], dtype=torch.float32, device="cuda").reshape(256, 1)
    cases = [(torch.tensor(v, device="cuda"), False) for v in GPU_SCALES]
    cases += [(rows, True), (rows.flip(0), True)]
    fmax = torch.finfo(fp8).max
    for s, rowwise in cases:
        ref = (x.float() * s).clamp(-fmax, fmax).to(fp8)
        y, y_t, amax = launch.cast_transpose(x, s, fp8, rowwise)
        where = f"{fp8} rowwise={rowwise} scale={s.flatten()[0].item()}"
        diff = y.view(torch.uint8) != ref.view(torch.uint8)
        assert not diff.any(), f"{where}: {int(diff.sum())} differ, first at {diff.nonzero()[0].tolist()}"
        assert torch.equal(y_t.view(torch.uint8), ref.view(torch.uint8)), where
        assert y_t.stride() == (1, 256), where
        assert torch.isnan(amax), where  # the patterns include NaN
    xc = x.float().nan_to_num(0.0, 1e30, -1e30).to(torch.bfloat16)
    amax = launch.cast_transpose(xc, rows, fp8, True)[2]
    assert torch.equal(amax, xc.abs().max().float())
    # Ragged tiles (masks): 144 x 80 is no multiple of the tile.
    xr = (torch.randn(144, 80, device="cuda") * 300).to(torch.bfloat16)
    s = torch.exp2(torch.rand(144, 1, device="cuda") * 4 - 2)
    ref = (xr.float() * s).clamp(-fmax, fmax).to(fp8)
    y, y_t, amax = launch.cast_transpose(xr, s, fp8, True)
    assert torch.equal(y.view(torch.uint8), ref.view(torch.uint8)), "ragged"
    assert torch.equal(y_t.view(torch.uint8), ref.view(torch.uint8)), "ragged"
    assert torch.equal(amax, xr.abs().max().float()), "ragged"


# Under torch.compile the fp8 op is a triton_op (safeops.ops.cast_transpose.compiled_op): Inductor compiles
# the kernel itself, with the tensors' own dtypes and its own options, fp contraction on and no maxnreg.
# That gives eager's bits only because neither kernel has a multiply feeding an add: compiled the way
# Inductor compiles them, their PTX must hold no fma (the pattern test_kernels_ptx.py checks for with
# contraction on finds it in every other safeops kernel).
INDUCTOR_SCRIPT = r'''
import importlib.util, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

spec = json.loads(sys.stdin.read())
mod = importlib.util.spec_from_file_location("ct_kernels", spec["kernel_file"])
k = importlib.util.module_from_spec(mod)
mod.loader.exec_module(k)
out = {}
for case in spec["cases"]:
    fn = getattr(k, case["kernel"])
    const = dict(case["constexprs"], sxk=1)
    sig = {a: "constexpr" if a in const else case["types"].get(a, "i32") for a in fn.arg_names}
    aligned = ("x_ptr", "scale_ptr", "y_ptr", "yt_ptr", "ws_ptr", "amax_ptr")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": case["num_warps"], "enable_fp_fusion": True})
    ptx = c.asm["ptx"]
    out[case["name"]] = {"fma": len(re.findall(r"\b(?:fma|mad)\.[\w.]*f(?:16|32|64)", ptx)),
                         "mul": len(re.findall(r"\bmul\.[\w.]*f32", ptx))}
print(json.dumps(out))
'''

_PTX_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
              torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}


def inductor_cases() -> list[dict]:
    """The kernels and constexprs safeops.ops.cast_transpose_launch.traced_launch gives Inductor: the bf16
    kernel and the general one (fp32 and fp16 x, packed and byte y_t), both fp8 formats, both scalings."""
    cases = []
    for x_dtype, m in ((torch.bfloat16, 4096), (torch.float32, 4096), (torch.float16, 4098)):
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            for rowwise in (False, True):
                x = torch.empty(m, 4096, dtype=x_dtype, device="meta")
                scale = torch.empty(m, 1, device="meta") if rowwise else torch.empty(1, device="meta")
                bf16 = x_dtype == torch.bfloat16
                config, hw, pack = launch._choice(x, None, None, bf16) if bf16 else (
                    launch.tile_config(m, 4096, x.element_size()), True, m % 4 == 0)
                opts, _ = launch._options_and_scalars(x, scale, fp8, rowwise, config, hw, pack, bf16)
                opts.pop("enable_fp_fusion")
                opts.pop("maxnreg", None)
                opts["PARTIALS"] = True  # the triton_op's amax (safeops.ops.cast_transpose._compiled_body)
                num_warps = opts.pop("num_warps")
                types = {"x_ptr": _PTX_TYPES[x_dtype], "scale_ptr": "*fp32", "y_ptr": _PTX_TYPES[fp8],
                         "yt_ptr": _PTX_TYPES[fp8], "ws_ptr": "*i32", "amax_ptr": "*i32"}
                cases.append(dict(name=f"{x_dtype}->{fp8} rowwise={rowwise} pack={pack}",
                                  kernel="cast_transpose_bf16_kernel" if bf16 else "cast_transpose_kernel",
                                  constexprs=opts, num_warps=num_warps, types=types))
    return cases


def test_kernels_inductor_compiles_have_nothing_to_contract():
    python = sm90.triton36_python()
    if python is None:
        pytest.skip("no Triton 3.6 Python for offline sm_90 compiles (set SAFEOPS_COMPILE_PYTHON)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    cases = inductor_cases()
    spec = {"kernel_file": os.path.join(ROOT, "safeops", "kernels", "cast_transpose.py"), "cases": cases}
    proc = subprocess.run([python, "-c", INDUCTOR_SCRIPT], input=json.dumps(spec), capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out) == len(cases) == 12
    for name, counts in out.items():
        assert counts["fma"] == 0, f"{name}: {counts['fma']} fma in the PTX compiled with contraction on"
        assert counts["mul"] > 0, f"{name}: no f32 multiply found: the check looks at the wrong code"
