"""The ``python -m safeops`` report: the seed cases under eager PyTorch, torch.compile and safeops.

For each public bug report that started safeops (``_seed``), the report runs the reported code eagerly and
under ``torch.compile`` (default Inductor backend) on this machine, and the same computation through
safeops. On a GPU it adds one timing line per op. Every cell is computed on its own: an exception becomes
``error: ...`` in that cell, never a crash. ``--json`` prints the same data as JSON, with non-finite floats
written as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` so the output is strict JSON (``float()`` reads
them back).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable

import torch

from . import __version__, _config, _seed, log_softmax, logsumexp, softmax
from . import compile as safeops_compile

# Case 1 and 1b: safeops runs a softmax over a row of this many copies of x; the exact answer is 1/N.
N_COPIES = 4
# Speed section: one bf16 tensor, reduced over its last dim.
SPEED_SHAPE = (4096, 32768)
SPEED_DTYPE = torch.bfloat16
ERROR_CHARS = 160  # an error message is cut to this length in the JSON, and shorter in the table


# ---------------------------------------------------------------------------------------------- helpers

def _error(exc: BaseException) -> dict:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return {"error": f"{type(exc).__name__}: {first_line}"[:ERROR_CHARS]}


def _cell(fn: Callable[[], dict]) -> dict:
    try:
        return fn()
    except Exception as exc:  # one failing cell must not hide the others
        return _error(exc)


def _compiled(fn: Callable, registered: bool = False) -> Callable:
    """``torch.compile(fn)`` after a fresh ``torch._dynamo.reset()``, so no earlier graph is reused.

    With ``registered``, the function is compiled and run under ``safeops.registered()``.
    """
    torch._dynamo.reset()
    compiled = torch.compile(fn)
    if not registered:
        return compiled

    def run(*args):
        with safeops_compile.registered():
            return compiled(*args)

    return run


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _safeops_path(device: torch.device) -> str:
    """Which implementation safeops runs for fp32/bf16 tensors on ``device``."""
    try:
        _config.backend_name()
    except ValueError:
        return "nothing: SAFEOPS_BACKEND is invalid"
    if not _config.use_triton(torch.empty(0, device=device)):
        return "the pure-torch reference"
    if device.type == "cuda":
        return "the Triton kernels"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "the Triton kernels, interpreted"
    return "the Triton kernels, but TRITON_INTERPRET is not 1 (fails on CPU tensors)"


def _machine(device: torch.device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception as exc:
        triton_version = _error(exc)["error"]
    return {
        "safeops": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton_version,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU only",
        "safeops_backend": os.environ.get("SAFEOPS_BACKEND", "auto"),
        "safeops_path": _safeops_path(device),
    }


# ------------------------------------------------------------------------------------ case 1 and 1b

def _scalar(t: torch.Tensor) -> dict:
    return {"value": float(t.item())}


def _row(out: torch.Tensor) -> dict:
    """A softmax of N equal logits: its first value and whether every value is exactly 1/N."""
    n = out.numel()
    return {"value": float(out[0].item()), "n": n, "exact": bool((out.double() == 1.0 / n).all().item())}


def _fma_case(dtype: torch.dtype, expression: Callable, device: torch.device) -> dict:
    x, scale = _seed.fma_inputs(dtype, device)
    row = x.reshape(1).repeat(N_COPIES)

    def safeops_row(r: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return softmax(r, -1, scale=s)

    cells = {
        "eager": _cell(lambda: _scalar(expression(x, scale))),
        "compiled": _cell(lambda: _scalar(_compiled(expression)(x, scale))),
        "compiled_registered": _cell(lambda: _scalar(_compiled(expression, registered=True)(x, scale))),
        "safeops": _cell(lambda: _row(safeops_row(row, scale))),
        "safeops_compiled": _cell(lambda: _row(_compiled(safeops_row)(row, scale))),
    }
    eager, compiled = cells["eager"], cells["compiled"]
    if "error" in eager or "error" in compiled:
        reproduced, note = None, "torch.compile or eager failed: see the cell"
    elif _same(eager["value"], compiled["value"]):
        reproduced = False
        where = "on CPU" if device.type == "cpu" else "on this stack"
        note = f"compile matches eager: not reproducible {where}"
    else:
        reproduced, note = True, f"compile gives {_num(compiled['value'])}: bug reproduced"
    return {"dtype": str(dtype).removeprefix("torch."), "expected": 1.0, "cells": cells,
            "bug_reproduced": reproduced, "note": note}


# ------------------------------------------------------------------------------------------- case 1c

def _torch_softmax(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.softmax(t, dim)


def _safeops_softmax(t: torch.Tensor, dim: int) -> torch.Tensor:
    return softmax(t, dim)


def _y_grad(softmax_fn: Callable, device: torch.device, compile: bool,
            registered: bool = False) -> list[float]:
    x, y = _seed.userland_inputs(torch.bfloat16, device)

    def loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _seed.userland_loss(softmax_fn, a, b)

    if not compile:
        loss(x, y).backward()
    elif registered:
        with safeops_compile.registered():
            _compiled(loss)(x, y).backward()
    else:
        _compiled(loss)(x, y).backward()
    return y.grad.double().flatten().tolist()


def _reference_grad(device: torch.device) -> list[float]:
    """float64 gradient from the same bf16-rounded inputs (the exact answer is 0)."""
    x, y = _seed.userland_inputs(torch.bfloat16, device)
    y64 = y.detach().double().requires_grad_(True)
    _seed.userland_loss(_seed.userland_softmax, x.double(), y64).backward()
    return y64.grad.flatten().tolist()


def _userland_case(device: torch.device) -> dict:
    variants = {  # name: (softmax function, compiled, under safeops.register())
        "eager_userland": (_seed.userland_softmax, False, False),
        "eager_torch_softmax": (_torch_softmax, False, False),
        "compiled_userland": (_seed.userland_softmax, True, False),
        "compiled_userland_registered": (_seed.userland_softmax, True, True),
        "safeops": (_safeops_softmax, False, False),
        "safeops_compiled": (_safeops_softmax, True, False),
    }
    reference = _cell(lambda: {"grad": _reference_grad(device)})
    cells = {}
    for name, (fn, compile, registered) in variants.items():
        cell = _cell(lambda fn=fn, compile=compile, registered=registered:
                     {"grad": _y_grad(fn, device, compile, registered)})
        if "grad" in cell:
            grad = cell["grad"]
            cell["nan"] = any(math.isnan(g) for g in grad)
            cell["finite"] = all(math.isfinite(g) for g in grad)
            if "grad" in reference:
                errors = [abs(g - r) for g, r in zip(grad, reference["grad"], strict=True)]
                cell["max_abs_err"] = math.nan if cell["nan"] else max(errors)
        cells[name] = cell
    compiled = cells["compiled_userland"]
    if "error" in compiled:
        reproduced, note = None, "torch.compile failed: see the cell"
    elif compiled["nan"]:
        reproduced, note = True, "compiled user-land gradient is NaN: bug reproduced"
    else:
        reproduced, note = False, "compiled user-land gradient is not NaN: bug not reproduced on this torch"
    return {"dtype": "bfloat16", "expected": 0.0, "reference": reference, "cells": cells,
            "bug_reproduced": reproduced, "note": note}


# --------------------------------------------------------------------------------------------- speed

def _speed_ops() -> dict:
    """name: (safeops function, torch function, times the backward)."""
    return {
        "softmax fwd": (lambda t: softmax(t, -1), lambda t: torch.softmax(t, -1), False),
        "softmax bwd": (lambda t: softmax(t, -1), lambda t: torch.softmax(t, -1), True),
        "log_softmax fwd": (lambda t: log_softmax(t, -1), lambda t: torch.log_softmax(t, -1), False),
        "logsumexp fwd": (lambda t: logsumexp(t, -1), lambda t: torch.logsumexp(t, -1), False),
    }


def _time_one(fn: Callable, x: torch.Tensor, backward: bool, timer: Callable) -> float:
    if not backward:
        return timer(lambda: fn(x))
    xg = x.detach().requires_grad_(True)
    out = fn(xg)
    dout = torch.randn_like(out)
    return timer(lambda: torch.autograd.grad(out, xg, dout, retain_graph=True))


def speed_rows(
    device: torch.device, shape=SPEED_SHAPE, dtype=SPEED_DTYPE, timer: Callable | None = None
) -> dict:
    """Median ms per op for safeops, torch eager and torch.compile; ``timer(fn) -> ms``."""
    if timer is None:
        from triton.testing import do_bench

        def timer(fn):
            return do_bench(fn, return_mode="median")

    x = torch.randn(shape, dtype=dtype, device=device)
    rows = {}
    for name, (ours, theirs, backward) in _speed_ops().items():
        impls = {"safeops": lambda f=ours: f, "eager": lambda f=theirs: f,
                 "compile": lambda f=theirs: _compiled(f)}
        row = {}
        for impl, make in impls.items():
            row[impl] = _cell(lambda make=make, bw=backward: {"ms": _time_one(make(), x, bw, timer)})
        peers = [row[p]["ms"] for p in ("eager", "compile") if "ms" in row[p]]
        if "ms" in row["safeops"] and peers:
            row["speedup_vs_best_peer"] = min(peers) / row["safeops"]["ms"]
        rows[name] = row
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "timer": "median ms",
            "rows": rows}


def _speed(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"skipped": "CPU only: the speed comparison needs a CUDA device"}
    return _cell(lambda: speed_rows(device))


# ----------------------------------------------------------------------------------------- collect

def collect(device: torch.device | None = None) -> dict:
    """Everything the report shows, as plain Python data (floats may be nan/inf)."""
    start = time.perf_counter()
    device = device or _default_device()
    data = {
        "machine": _machine(device),
        "cases": {
            "1": _fma_case(torch.float32, _seed.fma_expression, device),
            "1b": _fma_case(torch.bfloat16, _seed.fma_expression_bf16, device),
            "1c": _userland_case(device),
        },
        "speed": _speed(device),
    }
    data["elapsed_s"] = round(time.perf_counter() - start, 1)
    return data


def to_json(data) -> str:
    """Strict JSON: non-finite floats become the strings "nan", "inf", "-inf"."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {k: clean(w) for k, w in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(w) for w in v]
        return v

    return json.dumps(clean(data), indent=2, allow_nan=False)


def from_json(text: str) -> dict:
    """Inverse of :func:`to_json`: the strings "nan", "inf", "-inf" become floats again."""
    def restore(v):
        if isinstance(v, str) and v in ("nan", "inf", "-inf"):
            return float(v)
        if isinstance(v, dict):
            return {k: restore(w) for k, w in v.items()}
        if isinstance(v, list):
            return [restore(w) for w in v]
        return v

    return restore(json.loads(text))


# ------------------------------------------------------------------------------------------ render

def _num(v: float) -> str:
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return str(v)
    return repr(v) if 1e-3 <= abs(v) < 1e6 and len(repr(v)) <= 8 else f"{v:.1e}"


def _err_text(cell: dict, width: int = 36) -> str:
    text = "error: " + cell["error"]
    return text if len(text) <= width else text[: width - 3] + "..."


def _row_text(cell: dict) -> str:
    if "error" in cell:
        return _err_text(cell)
    exact = "exact" if cell["exact"] else "NOT exact"
    return f"{_num(cell['value'])} (1/{cell['n']} {exact})"


def _scalar_text(cell: dict) -> str:
    return _err_text(cell) if "error" in cell else _num(cell["value"])


def _grad_text(cell: dict) -> str:
    return "[" + ", ".join(_num(g) for g in cell["grad"]) + "]"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for r in rows:
        padded = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)]
        lines.append((indent + "  ".join([*padded, r[-1]])).rstrip())
    return lines


def render(data: dict) -> str:
    m, cases = data["machine"], data["cases"]
    lines = [
        f"safeops {m['safeops']}: the seed bug reports on this machine",
        f"machine: torch {m['torch']} | triton {m['triton']} | {m['device']} | "
        f"SAFEOPS_BACKEND={m['safeops_backend']} (safeops runs: {m['safeops_path']})",
        "",
        f"case 1   fp32 exp(x*s - x*s), x = {_seed.FMA_X!r}, s = {_seed.FMA_SCALE:.18f}; exact: 1",
        "case 1b  the same in bf16, the max stored through aten._lazy_clone; exact: 1",
        f"         safeops: softmax(row of {N_COPIES} copies of x, scale=s); exact: 1/{N_COPIES}",
        "",
    ]
    rows = [["", "eager", "torch.compile", "+ register()", "safeops", "safeops compiled", "note"]]
    for key in ("1", "1b"):
        c = cases[key]["cells"]
        registered = _scalar_text(c["compiled_registered"]) if "compiled_registered" in c else "-"
        rows.append([f"case {key}", _scalar_text(c["eager"]), _scalar_text(c["compiled"]), registered,
                     _row_text(c["safeops"]), _row_text(c["safeops_compiled"]), cases[key]["note"]])
    lines += _table(rows, indent="")
    lines += ["         (cases 1 and 1b are not softmax code, so register() leaves them alone; a softmax",
              "         written the same way is what it rewrites: case 1c)", ""]

    case = cases["1c"]
    lines.append("case 1c  user-land bf16 softmax backward: y.grad of sum(softmax(x @ x / y)); exact: 0")
    ref = case["reference"]
    rows = [["y.grad from", "y.grad", "max |grad - fp64|"],
            ["float64 reference", _err_text(ref) if "error" in ref else _grad_text(ref), "-"]]
    labels = {
        "eager_userland": "eager, user-land softmax",
        "eager_torch_softmax": "eager, torch.softmax",
        "compiled_userland": "torch.compile, user-land",
        "compiled_userland_registered": "torch.compile + register()",
        "safeops": "safeops.softmax",
        "safeops_compiled": "safeops.softmax, compiled",
    }
    for key, label in labels.items():
        cell = case["cells"][key]
        if "error" in cell:
            rows.append([label, _err_text(cell, 60), ""])
            continue
        if cell["nan"]:
            err = "NaN in the gradient"
        else:
            err = _num(cell["max_abs_err"]) if "max_abs_err" in cell else "-"
        rows.append([label, _grad_text(cell), err])
    lines += _table(rows)
    lines.append(f"  {case['note']}")
    lines.append("")

    speed = data["speed"]
    if "skipped" in speed:
        lines.append(f"speed: skipped ({speed['skipped']})")
    elif "error" in speed:
        lines.append(f"speed: {_err_text(speed, 100)}")
    else:
        shape = "x".join(str(s) for s in speed["shape"])
        lines.append(f"speed: {speed['dtype']} ({shape}), reduced over the last dim, "
                     f"{speed['timer']} by triton.testing.do_bench")
        rows = [["op", "safeops", "torch eager", "torch.compile", "speedup over the best torch"]]
        for name, row in speed["rows"].items():
            cells = [_err_text(row[i], 28) if "error" in row[i] else f"{row[i]['ms']:.3f}"
                     for i in ("safeops", "eager", "compile")]
            ratio = row.get("speedup_vs_best_peer")
            rows.append([name, *cells, f"{ratio:.2f}x" if ratio else "-"])
        lines += _table(rows)
    lines.append(f"ran in {data['elapsed_s']} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m safeops",
        description="Run the seed bug reports under eager PyTorch, torch.compile and safeops here.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    data = collect()
    print(to_json(data) if args.json else render(data))
    return 0
