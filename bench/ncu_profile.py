"""One call of each kernel worth a Nsight Compute look, between cudaProfilerStart / Stop.

Run under ``ncu --profile-from-start off`` (the warm-up calls that compile the kernels stay outside the
profiled range), e.g.::

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section LaunchStats \
        python3 bench/ncu_profile.py [--only attention,cast]

Kernels: the attention forward, dk/dv and dq kernels at bf16 B=4 H=16 S=4096 (D=64 and D=128, causal and
not, as in ``bench/attention.py --quick``), and the fp8 cast + transpose kernel at 4096 x 4096 and
8192 x 8192 (bf16 -> e4m3fn, tensorwise, as in ``bench/cast_transpose.py``). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def attention_calls(dims, causals):
    import safeops

    calls = []
    for d in dims:
        for causal in causals:
            q, k, v, g = (torch.randn(4, 16, 4096, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_(True)

            def call(q=q, k=k, v=v, g=g, causal=causal):
                out = safeops.attention(q, k, v, is_causal=causal)
                torch.autograd.grad(out, (q, k, v), g)
            calls.append((f"attention D{d}{' causal' if causal else ''}", call))
    return calls


def cast_calls(shapes):
    import safeops

    calls = []
    for m, k in shapes:
        x = (torch.randn(m, k, device="cuda") * 300).to(torch.bfloat16)
        s = torch.tensor(0.731, device="cuda")
        calls.append((f"cast_transpose {m}x{k}",
                      lambda x=x, s=s: safeops.cast_transpose(x, s, torch.float8_e4m3fn)))
    return calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="attention,cast")
    p.add_argument("--d", default="64,128")
    p.add_argument("--causal", default="0,1")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    only = set(args.only.split(","))
    calls = []
    if "attention" in only:
        dims = [int(d) for d in args.d.split(",")]
        calls += attention_calls(dims, [bool(int(c)) for c in args.causal.split(",")])
    if "cast" in only:
        calls += cast_calls([(4096, 4096), (8192, 8192)])
    for _, call in calls:  # compile and warm up outside the profiled range
        call()
        call()
    torch.cuda.synchronize()
    cudart = torch.cuda.cudart()
    for name, call in calls:
        print(f"profiling: {name}", flush=True)
        cudart.cudaProfilerStart()
        call()
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
