"""Contract section 6 for the softmax family: a row's reduction order must not depend on memory layout.

Triton picks a kernel's register layout, and with it the order of every ``tl.sum`` / ``tl.max`` (each
thread's elements in turn, then shuffles across lanes and warps), from the loads and stores the kernel was
specialized for: unit strides, 16-byte alignment. The launcher therefore reads every input (x, the
incoming gradient, the mask) in one canonical form per row length (``softmax_launch.canonical_layout``:
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
        # What Triton's launch specializes, from the values the launcher passes: an int equal to 1 becomes a
        # constant, one divisible by 16 gets that divisibility, a 16-byte-aligned pointer too; the
        # do_not_specialize arguments (row strides, row and batch counts) get nothing.
        kernel, dtype, constexprs, warps, ints, unaligned, pointer_types = job
        fn = getattr(K, kernel)
        constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
        sig, attrs = {}, {}
        for i, a in enumerate(fn.arg_names):
            if a not in constexprs and fn.params[i].is_constexpr:  # a constexpr left at its default
                constexprs[a] = fn.params[i].default
            if a in constexprs:
                continue
            if a.endswith("_ptr"):
                default = "*" + dtype if a in DATA else "*u8" if a == "mask_ptr" else "*fp32"
                sig[a] = pointer_types.get(a, default)
                if a not in unaligned:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            elif a == "scale_value":
                sig[a] = "fp32"
            elif a in K.ROW_STRIDES:
                sig[a] = "i32"
            else:
                value = ints[a]  # KeyError: the test did not say what the launcher passes
                if value == 1:
                    constexprs[a] = 1
                    continue
                sig[a] = "i32"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        sig = {a: ("constexpr" if a in constexprs else sig[a]) for a in fn.arg_names}  # in argument order
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

_TRITON = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_ALIGN = {"x_ptr": "XA", "out_ptr": "OA", "grad_ptr": "GA", "dx_ptr": "DA", "mask_ptr": "MA"}
_COL = {"x_ptr": "sxn", "out_ptr": "son", "grad_ptr": "sgn", "dx_ptr": "sdn", "mask_ptr": "smn"}


def _per16(dtype, tensor: str) -> int:
    return 16 if tensor == "mask_ptr" else 16 // dtype.itemsize


def _claims(dtype, n: int, tensors) -> dict:
    """The alignment constexprs of canonical tensors (``_aligns``): the 16-byte claim wherever the row
    length allows it."""
    return {_ALIGN[t]: (_per16(dtype, t) if n % _per16(dtype, t) == 0 else 1) for t in tensors}


def _case(name, kernel, dtype, n, cx, warps, tensors, ints=()):
    """One configuration the launcher chooses, launched on canonical tensors: every one unit-stride along
    the row (the column strides are 1, so Triton makes them constants), the claims of ``_claims``. A tile
    tensor the call does not have (no mask; logsumexp's per-row output or gradient) gets what the launcher
    passes for it: column stride 0, no claim."""
    absent = [t for t in _COL if t not in tensors]
    ints = {"n_cols": n, **{_COL[t]: 1 for t in tensors}, **{_COL[t]: 0 for t in absent}, **dict(ints)}
    cx = {**cx, **_claims(dtype, n, tensors), **{_ALIGN[t]: 1 for t in absent}}
    return dict(name=name, kernel=kernel, dtype=dtype, n=n, cx=cx, warps=warps, tensors=tensors, ints=ints)


def _cases():
    cases = []
    for dtype, n, kind, mask in ((torch.bfloat16, 256, 0, False), (torch.bfloat16, 1000, 1, True),
                                 (torch.bfloat16, 1001, 0, False), (torch.float16, 4096, 0, True),
                                 (torch.bfloat16, 32768, 0, False), (torch.bfloat16, 4096, 2, False),
                                 (torch.float32, 1024, 0, False), (torch.float32, 16384, 2, True)):
        cfg = L.rows_config(n, dtype.itemsize)
        tensors = ("x_ptr",) + (("mask_ptr",) if mask else ()) + (("out_ptr",) if kind != 2 else ())
        cx = dict(KIND=kind, SCALE_MODE=1, HAS_MASK=mask, WIDE=False, ROW_DIMS=1, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n)
        cases.append(_case(f"fwd rows {_TRITON[dtype]} N={n} kind={kind} mask={mask}",
                           "softmax_fwd_rows_kernel", dtype, n, cx, cfg.num_warps, tensors))
    for dtype, n, kind, mask in ((torch.bfloat16, 256, 0, False), (torch.bfloat16, 1000, 1, True),
                                 (torch.bfloat16, 16384, 0, True), (torch.float16, 16384, 1, False),
                                 (torch.float32, 4096, 1, False), (torch.float32, 1024, 2, True)):
        cfg = L.rows_config(n, dtype.itemsize, backward=True)
        tensors = ("x_ptr", "dx_ptr") + (("mask_ptr",) if mask else ()) + (("grad_ptr",) if kind != 2 else ())
        # With a scale tensor (SCALE_MODE 2) the launcher always has the scale gradient's terms computed
        # (NEED_DSCALE), wanted or not; logsumexp's backward has no other row sum.
        scale_mode = 1 if kind == 1 else 2
        cx = dict(KIND=kind, SCALE_MODE=scale_mode, HAS_MASK=mask, NEED_DSCALE=scale_mode == 2, WIDE=False,
                  ROW_DIMS=1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages)
        cases.append(_case(f"bwd rows {_TRITON[dtype]} N={n} kind={kind} mask={mask} stages={cfg.stages}",
                           "softmax_bwd_rows_kernel", dtype, n, cx, cfg.num_warps, tensors))
    for dtype in (torch.bfloat16, torch.float32):
        n = 65536 + 8 * 16
        sc = L.split_config(n, dtype.itemsize)
        ints = {"n_splits": sc.n_splits, "cols_per_split": sc.cols_per_split}
        splits = {"SPLITS": 1 << (sc.n_splits - 1).bit_length(), "BLOCK_N": sc.block_n}
        base = dict(KIND=0, SCALE_MODE=1, HAS_MASK=True, WIDE=False)
        fwd, bwd = ("x_ptr", "mask_ptr"), ("x_ptr", "mask_ptr", "grad_ptr")
        t = _TRITON[dtype]
        cases += [
            _case(f"fwd partial {t}", "softmax_fwd_partial_kernel", dtype, n,
                  dict(SCALE_MODE=1, HAS_MASK=True, WIDE=False, BLOCK_N=sc.block_n, LSE=False), sc.num_warps,
                  fwd, ints),
            _case(f"fwd finish {t}", "softmax_fwd_finish_kernel", dtype, n, dict(base, **splits),
                  sc.num_warps, fwd + ("out_ptr",), ints),
            _case(f"bwd partial {t}", "softmax_bwd_partial_kernel", dtype, n, dict(base, BLOCK_N=sc.block_n),
                  sc.num_warps, bwd, ints),
            _case(f"bwd finish {t}", "softmax_bwd_finish_kernel", dtype, n,
                  dict(base, SCALE_MODE=2, NEED_DSCALE=True, **splits), sc.num_warps, bwd + ("dx_ptr",),
                  ints),
        ]
    return cases


def _variants(case: dict):
    """(name, constexprs, ints, unaligned pointers): every launch of this row length, dtype and op the
    launcher can still make once its tensors are canonical, with or without the row statistics. Then the
    controls: a tensor strided along the row, which the launcher copies (an input) or replaces by scratch
    (an output) because it does move the reductions."""
    cx, ints = case["cx"], case["ints"]
    out = [("canonical", cx, ints, ())]
    if "WIDE" in cx:
        out.append(("64-bit offsets", dict(cx, WIDE=True), ints, ()))
    if "ROW_DIMS" in cx:  # batch sizes and strides are do_not_specialize arguments
        for dims in (2, 3):
            out.append((f"{dims} batch dims", dict(cx, ROW_DIMS=dims, WIDE=dims == 3), ints, ()))
    if case["kernel"] == "softmax_fwd_rows_kernel":  # an eager call that records no backward
        out.append(("no row statistics", dict(cx, STATS=False), ints, ()))
        out.append(("no row statistics, 3 batch dims, 64-bit offsets",
                    dict(cx, STATS=False, ROW_DIMS=3, WIDE=True), ints, ()))
    if cx.get("SCALE_MODE") == 2:
        out.append(("scale tensor misaligned", cx, ints, ("scale_ptr",)))
    for t in case["tensors"]:
        if cx[_ALIGN[t]] == 1:  # no claim for this tensor at this row length: its base may be anywhere
            out.append((f"{t} base misaligned", cx, ints, (t,)))
    for name, t in _CONTROLS:
        if name == case["name"]:
            out.append((f"{t} strided (made canonical by the launcher)", dict(cx, **{_ALIGN[t]: 1}),
                        dict(ints, **{_COL[t]: 8}), (t,)))
    return out


# (case, tensor) pairs where a strided tensor moves the reductions' layout (compiled as controls).
_CONTROLS = (("fwd rows bf16 N=256 kind=0 mask=False", "x_ptr"),
             ("fwd rows fp32 N=1024 kind=0 mask=False", "x_ptr"),
             ("fwd rows bf16 N=1000 kind=1 mask=True", "mask_ptr"),
             ("bwd rows bf16 N=256 kind=0 mask=False stages=0", "grad_ptr"),
             ("bwd rows fp16 N=16384 kind=1 mask=False stages=3", "x_ptr"),
             ("bwd rows fp16 N=16384 kind=1 mask=False stages=3", "dx_ptr"),
             ("fwd partial bf16", "mask_ptr"))


@pytest.fixture(scope="module")
def layouts():
    python = sm90.triton36_python()
    if python is None:
        pytest.skip("no Triton 3.6 to compile with (SAFEOPS_COMPILE_PYTHON or /tmp/t36)")
    jobs, index = [], []
    for case in _cases():
        for variant, cx, ints, unaligned in _variants(case):
            # Without statistics the launcher passes the output in the statistics' place.
            out_type = f"*{_TRITON[case['dtype']]}"
            types = {"row_max_ptr": out_type, "row_sum_ptr": out_type} if cx.get("STATS") is False else {}
            jobs.append([case["kernel"], _TRITON[case["dtype"]], cx, case["warps"], ints, list(unaligned),
                         types])
            index.append((case["name"], variant))
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
        assert ref, f"{case}: no reduction found in the canonical kernel (parser broken?)"
        for variant, result in variants.items():
            if "made canonical" in variant or "error" in result:
                continue
            if result["reductions"] != ref:
                differ.append(f"{case} / {variant}: {result['reductions']} != {ref}")
    assert not differ, "reductions whose layout depends on memory layout:\n" + "\n".join(differ)


def test_the_comparison_sees_strided_tensors(layouts):
    """The controls: a strided tensor moves the reductions' layout in these cases (which is why the launcher
    makes every tile tensor canonical), so the comparison above can fail. Elsewhere another tensor may
    anchor the layout (e.g. a mask), but nothing says it always will."""
    moved = {(c, v) for c, vs in layouts.items() for v, r in vs.items()
             if "made canonical" in v and r.get("reductions") != vs["canonical"]["reductions"]}
    for case, tensor in _CONTROLS:
        assert (case, f"{tensor} strided (made canonical by the launcher)") in moved, (case, tensor)


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
    assert L.canonical_layout(x, 1)
    assert L.canonical_layout(x[2:6], 1)  # whole rows sliced off: row starts stay 16-byte aligned
    assert L.canonical_layout(x[:, :1], 1)  # one column: nothing to order
    assert L.canonical_layout(x.expand(3, 8, 64), 2)  # a broadcast batch dim (stride 0)
    assert not L.canonical_layout(x.t(), 1)  # the reduced dim strided
    assert L.canonical_layout(x.t(), 0)  # reduced over its unit-stride dim
    assert not L.canonical_layout(x[:, ::2], 1)
    assert not L.canonical_layout(x[:, :1].expand(8, 64), 1)  # stride 0 along the row
    assert not L.canonical_layout(_offset(8, 64, dtype, 1), 1)  # misaligned start
    per16 = 16 // x.element_size()
    rows_off_grid = torch.randn(8, 64 + per16 // 2).to(dtype)[:, :64]
    assert not L.canonical_layout(rows_off_grid, 1)  # row starts off the 16-byte grid
    # A row length that allows no alignment claim: nothing depends on where rows start.
    n = 64 + 1
    assert L.canonical_layout(_offset(8, n, dtype, 1), 1)


def test_canonical_tensors_are_used_in_place():
    x = torch.randn(4, 3, 256)
    mask = (torch.rand(1, 1, 256) > 0.2).expand(4, 3, 256).view(torch.uint8)
    out = torch.empty_like(x)
    rows, t = L._layout(x.shape, 2, {"x": x, "out": out, "mask": mask})
    assert t["x"] is x and t["mask"] is mask and t["out"] is out
    assert rows.n_rows == 12 and rows.args("x")[3] == 1


@pytest.mark.parametrize("case", ["transposed", "misaligned", "channels", "mask along the row",
                                  "5 batch dims"])
def test_other_tensors_are_used_through_rows_major_copies(case):
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
    for name in ("x", "mask", "out"):
        if t[name] is not None:
            assert L.canonical_layout(t[name], dim), name
            assert rows.args(name)[3] == 1
    for name, given in (("x", x), ("mask", mask)):
        if given is not None:
            assert torch.equal(t[name], given), name  # same values
    if case == "5 batch dims":
        assert rows.sizes[:2] == (1, 1)  # everything rows-major: one batch dim
    else:
        # An output like a non-canonical x is not canonical either: it is written to scratch, copied back.
        assert (t["out"] is out) == L.canonical_layout(out, dim)


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

