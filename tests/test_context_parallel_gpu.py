"""Context-parallel attention on 2 GPUs with NCCL: the compiled Triton kernels behind the ring and the
all-gather, at real sizes, against single-GPU ``safeops.attention`` on the gathered sequence.

Skipped unless two CUDA devices are visible. Each of 2 spawned ranks owns one GPU, builds the same full
inputs from a shared seed, and checks its shard of out, lse, dq, dk, dv (the checks and tolerances of
tests/test_context_parallel.py) for both layouts, causal and not, both strategies, bf16 and fp32 ("ieee"),
GQA; then the huge-logit case and bit-for-bit determinism of two ring runs.

    python3 -m pytest -q tests/test_context_parallel_gpu.py      (on a machine with >= 2 GPUs)
"""

from __future__ import annotations

import itertools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st
from strategies import examples

from safeops import distributed as cp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA devices (NCCL context parallelism)"),
]

SMALL = os.environ.get("SAFEOPS_GPU_SMALL", "0").strip() not in ("", "0")
WORLD = 2
S_LOCAL = 512 if SMALL else 4096
HEAD_DIM = 128


def _cases() -> list[dict]:
    cases = []
    for dtype, layout, causal, strategy in itertools.product(
            (torch.bfloat16, torch.float32), ("contiguous", "zigzag"), (False, True), ("ring", "allgather")):
        cases.append(dict(layout=layout, causal=causal, hq=8, hkv=2, strategy=strategy, dtype=dtype,
                          softcap=None))
    cases.append(dict(layout="zigzag", causal=True, hq=4, hkv=4, strategy="ring", dtype=torch.bfloat16,
                      softcap=30.0))
    return cases


def _determinism(rank: int, device: str, seed: int) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn((1, 8, S_LOCAL, HEAD_DIM), generator=gen, device=device, dtype=torch.bfloat16)
               for _ in range(3))
    results = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = cp.context_parallel_attention(*leaves, is_causal=True, layout="zigzag", strategy="ring")
        out.backward(torch.ones_like(out))
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b), f"ring attention is not deterministic (rank {rank})"


def _worker(rank: int, init_file: str, seed: int) -> None:
    import test_context_parallel as cpu_tests  # the checks and tolerances of the CPU test

    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    os.environ["SAFEOPS_BACKEND"] = "auto"
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            device_id=torch.device(device))
    try:
        for i, case in enumerate(_cases()):
            cpu_tests._run_case(rank, WORLD, case, seed + i, s_local=S_LOCAL, d=HEAD_DIM, device=device)
        cpu_tests._huge_logits_case(rank, WORLD, device=device)
        _determinism(rank, device, seed)
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


@given(seed=st.integers(0, 2**31 - 1))
@examples(ci=1, deep=5)  # spawns the ranks and runs every case per example
def test_nccl_matches_single_gpu(seed):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "rendezvous"), seed), nprocs=WORLD, join=True)
