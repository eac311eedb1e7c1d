"""Contract section 6 for the softmax family: a row's reduction order must not depend on memory layout.

Triton picks a kernel's register layout, and with it the order of every ``tl.sum`` / ``tl.max`` (each
thread's elements in turn, then shuffles across lanes and warps), from the loads and stores the kernel was
specialized for: unit strides, 16-byte alignment. The launcher therefore reads every input (x, the
incoming gradient, the mask) in one canonical form per row length (``softmax_launch.canonical_input``:
reduced dim unit-stride, row starts 16-byte aligned where the row length allows the claim), copying the
inputs that are not, and leaves outputs where they are.

Two kinds of checks:

- offline, sm_90, Triton 3.6 (the GPU machine's): for each kernel and configuration the launcher can choose,
  every specialization it can still produce after that copy (outputs strided or misaligned, 64-bit
  offsets, one to three batch dims, row lengths without the alignment claim, the scale gradient wanted or
  not) compiles to the same layout at every reduction as the canonical one; a strided input, which the
  launcher copies, does not (so the comparison can fail);
- on the CPU: which inputs the launcher copies, and that canonical ones are read in place (no copy, no
  cost on the common path).

The bits themselves are compared on the GPU (tests/test_softmax_gpu.py, test_bits_independent_of_*).
"""

from __future__ import annotations

import json
import textwrap

import pytest
import sm90
import torch

from safeops.ops import softmax_launch as L

_SCRIPT = textwrap.dedent(
    r"""
    import importlib.util, json, multiprocessing, os, re, sys, types
    from concurrent.futures import ProcessPoolExecutor

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    root, jobs = sys.argv[1], json.loads(sys.argv[2])
    # The kernel files import each other as safeops.kernels.*; load them by path (no torch here).
    for name in ("safeops", "safeops.kernels"):
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package
    for mod in ("convert", "reduce", "softmax"):
        spec = importlib.util.spec_from_file_location("safeops.kernels." + mod,
                                                      os.path.join(root, "safeops", "kernels", mod + ".py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["safeops.kernels." + mod] = module
        spec.loader.exec_module(module)
    K = sys.modules["safeops.kernels.softmax"]
    DATA = ("x_ptr", "out_ptr", "grad_ptr", "dx_ptr")

    def reduce_layouts(job):
        kernel, dtype, constexprs, warps, unaligned = job
        fn = getattr(K, kernel)
        sig = {}
        for a in fn.arg_names:
            if a in constexprs:
                sig[a] = "constexpr"
            elif a in DATA:
                sig[a] = "*" + dtype
            elif a == "mask_ptr":
                sig[a] = "*u8"
            elif a.endswith("_ptr"):
                sig[a] = "*fp32"
            elif a == "scale_value":
                sig[a] = "fp32"
            else:
                sig[a] = "i32"
        # Triton specializes a pointer argument on 16-byte alignment at launch: torch allocations are.
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
                 for a in fn.arg_names if a.endswith("_ptr") and a not in unaligned and a not in constexprs}
        try:
            c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": warps, "enable_fp_fusion": False})
        except Exception as e:
            return {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}
        ttgir = c.asm["ttgir"]
        aliases = dict(re.findall(r"^(#\w+) = (#ttg\.[^\n]*)$", ttgir, re.M))
        reductions = []
        for m in re.finditer(r'"tt\.reduce"\([^)]*\) <\{axis = (\d+) : i32\}>.*?\}\) : \(([^)]*)\)', ttgir,
                             re.S):
            operands = [aliases.get(a, a) for a in re.findall(r"tensor<[^,>]*, (#\w+)>", m.group(2))]
            reductions.append([int(m.group(1)), re.findall(r"tensor<([^,>]*)", m.group(2)), operands])
        return {"reductions": reductions}

    if __name__ == "__main__":
        workers = max(1, min(len(jobs), os.cpu_count() or 1))
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            print(json.dumps(list(pool.map(reduce_layouts, jobs, chunksize=1))))
    """
)

_TRITON = {torch.bfloat16: "bf16", torch.float32: "fp32"}
_ALIGN = {"x_ptr": "XA", "out_ptr": "OA", "grad_ptr": "GA", "dx_ptr": "DA", "mask_ptr": "MA"}
_COL = {"x_ptr": "sxn", "out_ptr": "son", "grad_ptr": "sgn", "dx_ptr": "sdn", "mask_ptr": "smn"}


def _canonical(dtype, n: int, tensors: tuple[str, ...]) -> dict:
    """Constexprs of the canonical launch: every tensor unit-stride along the row, the 16-byte claim made
    where the row length allows it (``_aligns``), one batch dim, 32-bit offsets."""
    per16 = {name: (16 if name == "mask_ptr" else 16 // torch.empty((), dtype=dtype).element_size())
             for name in tensors}
    cx = {_COL[t]: 1 for t in tensors}
    cx.update({_ALIGN[t]: (per16[t] if n % per16[t] == 0 else 1) for t in tensors})
    return cx


def _rows_cases():
    """(name, kernel, dtype, constexprs, warps, inputs, outputs): the rows kernels at configurations the
    launcher chooses (rows_config), forward and backward, every kind, with and without a mask."""
    cases = []
    for dtype, n, kind, mask in ((torch.bfloat16, 256, 0, False), (torch.bfloat16, 1001, 1, False),
                                 (torch.bfloat16, 4096, 0, True), (torch.bfloat16, 32768, 0, False),
                                 (torch.bfloat16, 4096, 2, False), (torch.float32, 1024, 0, False),
                                 (torch.float32, 16384, 2, True)):
        cfg = L.rows_config(n, dtype.itemsize, True)
        tensors = ("x_ptr", "mask_ptr") + (("out_ptr",) if kind != 2 else ())
        cx = dict(KIND=kind, SCALE_MODE=1, HAS_MASK=mask, WIDE=False, ROW_DIMS=1, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, **_canonical(dtype, n, tensors))
        cases.append((f"fwd rows {_TRITON[dtype]} N={n} kind={kind} mask={mask}", "softmax_fwd_rows_kernel",
                      dtype, n, cx, cfg.num_warps, ("x_ptr", "mask_ptr"), tensors[2:]))
    for dtype, n, kind, mask in ((torch.bfloat16, 256, 0, False), (torch.bfloat16, 1001, 1, False),
                                 (torch.bfloat16, 16384, 0, True), (torch.float32, 4096, 1, False),
                                 (torch.float32, 1024, 0, True)):
        cfg = L.rows_config(n, dtype.itemsize, True, backward=True)
        tensors = ("x_ptr", "mask_ptr", "grad_ptr", "dx_ptr")
        cx = dict(KIND=kind, SCALE_MODE=2, HAS_MASK=mask, NEED_DSCALE=False, WIDE=False, ROW_DIMS=1,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
                  **_canonical(dtype, n, tensors))
        cases.append((f"bwd rows {_TRITON[dtype]} N={n} kind={kind} mask={mask} stages={cfg.stages}",
                      "softmax_bwd_rows_kernel", dtype, n, cx, cfg.num_warps,
                      ("x_ptr", "mask_ptr", "grad_ptr"), ("dx_ptr",)))
    return cases


def _split_cases():
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        n = 65536 + 8
        sc = L.split_config(n, dtype.itemsize)
        splits = {"SPLITS": 1 << (sc.n_splits - 1).bit_length(), "BLOCK_N": sc.block_n}
        fwd = ("x_ptr", "mask_ptr")
        bwd = ("x_ptr", "mask_ptr", "grad_ptr")
        base = dict(KIND=0, SCALE_MODE=1, HAS_MASK=True, WIDE=False)
        cases += [
            (f"fwd partial {_TRITON[dtype]}", "softmax_fwd_partial_kernel", dtype, n,
             dict(SCALE_MODE=1, HAS_MASK=True, WIDE=False, BLOCK_N=sc.block_n, LSE=False,
                  **_canonical(dtype, n, fwd)), sc.num_warps, fwd, ()),
            (f"fwd finish {_TRITON[dtype]}", "softmax_fwd_finish_kernel", dtype, n,
             dict(base, **splits, **_canonical(dtype, n, fwd + ("out_ptr",))), sc.num_warps, fwd,
             ("out_ptr",)),
            (f"bwd partial {_TRITON[dtype]}", "softmax_bwd_partial_kernel", dtype, n,
             dict(base, BLOCK_N=sc.block_n, **_canonical(dtype, n, bwd)), sc.num_warps, bwd, ()),
            (f"bwd finish {_TRITON[dtype]}", "softmax_bwd_finish_kernel", dtype, n,
             dict(base, NEED_DSCALE=True, **splits, **_canonical(dtype, n, bwd + ("dx_ptr",))), sc.num_warps,
             bwd, ("dx_ptr",)),
        ]
    return cases


def _without(cx: dict, *names: str) -> dict:
    return {k: v for k, v in cx.items() if k not in names}


def _variants(kernel: str, dtype, n: int, cx: dict, inputs, outputs):
    """(name, constexprs, unaligned pointers): what the launcher can still launch for this row length,
    dtype and op after reading its inputs in canonical form."""
    out = [("canonical", cx, ())]
    for o in outputs:  # an output in any layout: strided along the row, misaligned
        out.append((f"{o} strided, misaligned", dict(_without(cx, _COL[o]), **{_ALIGN[o]: 1}), (o,)))
    if "WIDE" in cx:
        out.append(("64-bit offsets", dict(cx, WIDE=True), ()))
    if "ROW_DIMS" in cx:  # batch sizes and strides are runtime arguments (not specialised)
        for dims in (2, 3):
            out.append((f"{dims} batch dims", dict(cx, ROW_DIMS=dims, WIDE=dims == 3), ()))
    if "NEED_DSCALE" in cx:
        out.append(("scale gradient wanted", dict(cx, NEED_DSCALE=True), ()))
    if all(cx.get(_ALIGN[t], 1) == 1 for t in inputs):  # no claim at this row length: bases may be anything
        out.append(("inputs' bases misaligned", cx, tuple(inputs)))
    return out


def _control(cx: dict, anchor: str):
    """The anchoring input strided along the row: the launcher copies it, because the layout changes."""
    return (f"{anchor} strided (copied by the launcher)", _without(cx, _COL[anchor]), ())


@pytest.fixture(scope="module")
def layouts():
    python = sm90.triton36_python()
    if python is None:
        pytest.skip("no Triton 3.6 to compile with (SAFEOPS_COMPILE_PYTHON or /tmp/t36)")
    jobs, index = [], []
    for name, kernel, dtype, n, cx, warps, inputs, outputs in _rows_cases() + _split_cases():
        variants = _variants(kernel, dtype, n, cx, inputs, outputs)
        if kernel in ("softmax_fwd_rows_kernel", "softmax_bwd_rows_kernel") and "N=256" in name:
            variants.append(_control(cx, "x_ptr" if kernel.startswith("softmax_fwd") else "grad_ptr"))
        for variant, vcx, unaligned in variants:
            jobs.append([kernel, _TRITON[dtype], vcx, warps, list(unaligned)])
            index.append((name, variant))
    results = sm90.run_script(_SCRIPT, sm90.ROOT, json.dumps(jobs), what="the softmax kernels' variants",
                              python=python)
    table: dict[str, dict[str, dict]] = {}
    for (name, variant), result in zip(index, results, strict=True):
        table.setdefault(name, {})[variant] = result
    return table


def test_compiles(layouts):
    errors = {f"{c} / {v}": r["error"] for c, vs in layouts.items() for v, r in vs.items() if "error" in r}
    assert not errors, errors


def test_every_reachable_variant_reduces_in_the_canonical_layout(layouts):
    differ = []
    for case, variants in layouts.items():
        ref = variants["canonical"]["reductions"]
        assert ref or "kind=2" in case, f"{case}: no reduction found in the canonical kernel (parser broken?)"
        for variant, result in variants.items():
            if "copied by the launcher" in variant or "error" in result:
                continue
            got = result["reductions"]
            if variant == "scale gradient wanted":
                got = got[:len(ref)]  # plus the scale gradient's own sum, after the op's
            if got != ref:
                differ.append(f"{case} / {variant}: {result['reductions']} != {ref}")
    assert not differ, "reductions whose layout depends on memory layout:\n" + "\n".join(differ)


def test_the_comparison_sees_a_strided_input(layouts):
    """The control: a strided x (forward) or incoming gradient (backward) changes the reductions' layout,
    which is why the launcher copies such inputs; if Triton stopped doing that, the copy could go."""
    controls = {(c, v): r for c, vs in layouts.items() for v, r in vs.items()
                if "copied by the launcher" in v}
    assert len(controls) == 2
    for (case, variant), result in controls.items():
        assert result["reductions"] != layouts[case]["canonical"]["reductions"], (case, variant)


# ---------------------------------------------------------------------------------------------------
# The launcher's side, on the CPU
# ---------------------------------------------------------------------------------------------------


def _offset(n_rows: int, n_cols: int, dtype, elements: int) -> torch.Tensor:
    """(n_rows, n_cols) contiguous at ``elements`` past a 16-byte-aligned allocation."""
    flat = torch.randn(n_rows * n_cols + elements, dtype=torch.float32).to(dtype)
    return flat[elements:].view(n_rows, n_cols)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_which_inputs_are_read_in_place(dtype):
    x = torch.randn(8, 64, dtype=torch.float32).to(dtype)
    assert L.canonical_input(x, 1)
    assert L.canonical_input(x[2:6], 1)  # whole rows sliced off: row starts stay 16-byte aligned
    assert L.canonical_input(x[:, :1], 1)  # one column: nothing to order
    assert L.canonical_input(x.expand(3, 8, 64), 2)  # a broadcast batch dim (stride 0)
    assert not L.canonical_input(x.t(), 1)  # the reduced dim strided
    assert L.canonical_input(x.t(), 0)  # reduced over its unit-stride dim
    assert not L.canonical_input(x[:, ::2], 1)
    assert not L.canonical_input(x[:, :1].expand(8, 64), 1)  # stride 0 along the row
    assert not L.canonical_input(_offset(8, 64, dtype, 1), 1)  # misaligned start
    per16 = 16 // x.element_size()
    rows_off_grid = torch.randn(8, 64 + per16 // 2).to(dtype)[:, :64]
    assert not L.canonical_input(rows_off_grid, 1)  # row starts off the 16-byte grid
    # A row length that allows no alignment claim: nothing depends on where rows start.
    n = 64 + 1
    assert L.canonical_input(_offset(8, n, dtype, 1), 1)


def test_canonical_inputs_are_not_copied():
    x = torch.randn(4, 3, 256)
    mask = (torch.rand(1, 1, 256) > 0.2).expand(4, 3, 256).view(torch.uint8)
    out = torch.empty_like(x)
    rows, t = L._layout(x.shape, 2, {"x": x, "out": out, "mask": mask})
    assert t["x"] is x and t["mask"] is mask and t["out"] is out
    assert rows.n_rows == 12 and rows.args("x")[3] == 1


@pytest.mark.parametrize("case", ["transposed", "misaligned", "channels", "mask along the row",
                                  "5 batch dims"])
def test_other_inputs_are_read_from_rows_major_copies(case):
    torch.manual_seed(0)
    mask = None
    if case == "transposed":
        x, dim = torch.randn(256, 16).t(), 1
    elif case == "misaligned":
        x, dim = _offset(16, 256, torch.float32, 2), 1
    elif case == "channels":  # softmax over the channels of an NCHW tensor
        x, dim = torch.randn(2, 32, 4, 4), 1
    elif case == "mask along the row":
        x, dim = torch.randn(16, 256), 1
        mask = (torch.rand(16, 1) > 0.5).expand(16, 256).view(torch.uint8)
    else:  # interleaved slices: more batch dims than the kernels decode
        x, dim = torch.randn(3, 4, 5, 6, 7, 64).permute(0, 2, 4, 1, 3, 5)[:, :, :, :, ::2], 5
    out = torch.empty_like(x)
    rows, t = L._layout(x.shape, dim, {"x": x, "out": out, "mask": mask})
    for name in ("x", "mask"):
        if t[name] is not None:
            assert L.canonical_input(t[name], dim), name
            assert torch.equal(t[name], x if name == "x" else mask), name  # same values
            assert rows.args(name)[3] == 1
    if case == "5 batch dims":  # outputs then go through scratch written rows-major
        assert t["out"] is not out and rows.sizes[:2] == (1, 1)
    else:
        assert t["out"] is out  # outputs stay where they are: a store does not change the reductions


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "logsumexp"])
def test_values_do_not_move(op, triton_backend):
    """End to end through the launcher (Triton's interpreter): a transposed and a misaligned input, read
    through their copies, give the values of the contiguous input, forward and backward."""
    import safeops

    torch.manual_seed(1)
    base = torch.randn(16, 64) * 3
    fn = getattr(safeops, op)
    ref_x = base.clone().requires_grad_(True)
    ref = fn(ref_x, -1)
    g = torch.randn_like(ref)
    (ref_g,) = torch.autograd.grad(ref, ref_x, g)
    for view in (base.t().contiguous().t(), _offset(16, 64, torch.float32, 1).copy_(base)):
        x = view.detach().requires_grad_(True)
        y = fn(x, -1)
        (gx,) = torch.autograd.grad(y, x, g)
        assert torch.equal(y, ref) and torch.equal(gx, ref_g)

