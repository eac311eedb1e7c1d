"""Static instruction counts of the softmax kernels (no GPU needed).

Compiles kernels for sm_90 with the Triton installed here, disassembles them with the ``cuobjdump`` that
ships in Triton's wheel, and prints per-thread instruction counts, load/store widths and the commonest
opcodes. Triton's divisibility hints are set as at a real launch with aligned tensors and N a multiple of
16. bench/RESULTS.md uses it to explain instruction-bound kernels.

    TRITON_INTERPRET=0 python bench/sass_count.py
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from safeops.kernels import softmax as k  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
POINTERS = {"x_ptr": "*bf16", "out_ptr": "*bf16", "grad_ptr": "*bf16", "dx_ptr": "*bf16", "mask_ptr": "*u8"}
UNIT = {"sxn": 1, "son": 1, "sgn": 1, "sdn": 1, "smn": 0}

CASES = [
    ("fwd rows 16x256", k.softmax_fwd_rows_kernel, dict(KIND=0, BLOCK_M=16, BLOCK_N=256), 4, 32),
    ("fwd rows 4x1024", k.softmax_fwd_rows_kernel, dict(KIND=0, BLOCK_M=4, BLOCK_N=1024), 4, 32),
    ("bwd rows 1x1024", k.softmax_bwd_rows_kernel,
     dict(KIND=0, NEED_DSCALE=False, BLOCK_M=1, BLOCK_N=1024, STAGES=0), 2, 16),
]


def main() -> None:
    for label, fn, extra, num_warps, per_thread in CASES:
        constexprs = {"SCALE_MODE": 0, "HAS_MASK": False, "WIDE": False, **extra}
        constexprs.update({a: 8 for a in ("XA", "OA", "GA", "DA") if a in fn.arg_names})
        constexprs.update({"MA": 1, "ROW_DIMS": 1})  # contiguous rows: one batch dim, as benchmarked
        constexprs.update({n: v for n, v in UNIT.items() if n in fn.arg_names})
        signature = {n: "constexpr" if n in constexprs else POINTERS.get(n, "*fp32" if n.endswith("_ptr")
                     else "fp32" if n == "scale_value" else "i32") for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n.endswith("_ptr") or n == "n_cols"}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps, "enable_fp_fusion": False})
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        body = [re.sub(r"^\s+/\*[0-9a-f]{4}\*/\s+", "", line) for line in sass.splitlines()
                if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
        ops = [(b.split()[1] if b.startswith("@") else b.split()[0]) for b in body if b.split()]
        hist = collections.Counter(op.split(".")[0] for op in ops)
        widths = sorted({op for op in ops if op.startswith(("LDG", "STG"))})
        print(f"{label}: {len(ops)} instructions per thread, {len(ops) / per_thread:.1f} per element; "
              f"{widths}")
        print("   ", ", ".join(f"{op} {n}" for op, n in hist.most_common(12)))


if __name__ == "__main__":
    main()
