"""Host-side cost of one call: how long the CPU takes to launch each softmax path, on a tiny input.

A training step whose kernels are short is bound by how fast the host enqueues them (bench/compile.py
shows it for the transformer block). This measures, per call, the wall time of many back-to-back calls on a
64 x 1024 bf16 input (GPU work per call is a few microseconds, so the host is the bottleneck):

- ``torch.softmax`` (one ATen kernel) as the yardstick;
- ``safeops.softmax`` (argument checks, the registered op, the launcher, Triton's launch);
- ``torch.ops.safeops.softmax`` (the op without the public function's checks);
- ``softmax_launch.forward`` (the launcher and Triton's launch, no torch.library dispatch);
- the same forward + backward through autograd, for safeops and torch;
- an empty Triton kernel with 4 and with 40 scalar arguments (Triton's own launch cost).

    python bench/overhead.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import safeops  # noqa: E402, I001
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from safeops.ops import softmax_launch  # noqa: E402


@triton.jit
def _empty4(a, b, c, d):
    pass


@triton.jit
def _empty40(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9,
             c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, d0, d1, d2, d3, d4, d5, d6, d7, d8,
             N: tl.constexpr):
    pass


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/overhead.py: needs a CUDA GPU")
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    g = torch.randn_like(x)
    t = torch.empty(1, device="cuda")

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(xg), xg, g)

    cases = [
        ("torch.softmax", lambda: torch.softmax(x, -1)),
        ("safeops.softmax", lambda: safeops.softmax(x)),
        ("torch.ops.safeops.softmax", lambda: torch.ops.safeops.softmax.default(x, -1, None, None, None,
                                                                                None)),
        ("softmax_launch.forward", lambda: softmax_launch.forward(0, x, 1, None, None, None, x.dtype)),
        ("fwd+bwd torch.softmax", fwd_bwd(lambda t_: torch.softmax(t_, -1))),
        ("fwd+bwd safeops.softmax", fwd_bwd(safeops.softmax)),
        ("empty Triton kernel, 4 args", lambda: _empty4[(1,)](t, 1, 2, 3)),
        ("empty Triton kernel, 40 args", lambda: _empty40[(1,)](t, *range(1, 39), N=4)),
    ]
    print(f"{torch.cuda.get_device_name()}: torch {torch.__version__}, triton {triton.__version__}; "
          f"wall time per call, {args.calls} back-to-back calls, best of 3")
    for name, fn in cases:
        print(f"  {name:32s} {per_call_us(fn, args.calls):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
