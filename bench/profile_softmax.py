"""Launches each softmax kernel of a few shapes once, for a profiler (``bash bench/gpu_run.sh ncu``).

    ncu -k "regex:softmax_(fwd|bwd)_rows" --section SpeedOfLight ... python3 bench/profile_softmax.py

Shapes: ``--n`` row lengths (default 256 and 16K, bf16), M x N = 2**28 as in bench/softmax.py; one forward
and one backward launch each, after one untimed warm-up call that compiles the kernels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import safeops  # noqa: E402, I001
import torch  # noqa: E402
from _harness import DTYPES_BY_NAME, parse_sizes  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", default="256,16K")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    args = p.parse_args()
    dtype = DTYPES_BY_NAME[args.dtype]
    for n in parse_sizes(args.n):
        x = torch.randn(max(1, 2**28 // n), n, device="cuda", dtype=dtype, requires_grad=True)
        g = torch.randn_like(x)
        safeops.softmax(x).backward(g)  # compiles (profiled too: the second launch is the clean one)
        torch.cuda.synchronize()
        with torch.cuda.nvtx.range(f"softmax {args.dtype} N={n}"):
            safeops.softmax(x).backward(g)
        torch.cuda.synchronize()
        print(f"launched forward and backward at N={n}", flush=True)


if __name__ == "__main__":
    main()
