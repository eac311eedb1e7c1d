"""DTensor inputs on two GPUs over NCCL: the Triton kernels at real sizes (skipped without 2 CUDA devices).

The machinery of tests/test_dtensor.py (one spawn of two processes running every check, each check then
reported as its own test), on ``DeviceMesh("cuda", [0, 1])``. Each rank compares its local shard of the
output and of every gradient with the same piece of ``safeops`` run on the whole tensor on its own GPU,
bit for bit: the supported shardings only split independent rows and the kernels are batch-invariant
(contract section 6). ``CommDebugMode`` proves that no collective ran. Sizes cover the single-block and the
split (long-row) softmax paths, attention at bf16 / fp16 / fp32 with GQA, causal, windows and masks, and
merge_attention sharded on heads, batch or query rows (lists and stacks, with and without an lse gradient).

The spawned processes inherit the environment (keep NCCL_NVLS_ENABLE=0 etc. set where the machine wants
it). The seed follows tests/test_dtensor.py (0 under the ci Hypothesis profile, fresh under deep);
``SAFEOPS_TEST_SEED=<int>`` replays a failure's inputs.
"""

from __future__ import annotations

import pytest
import test_dtensor as common  # tests/ is on sys.path, as for tests/oracle.py
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
    pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available()), reason="needs NCCL"),
]

CHECKS: dict[str, tuple] = {}

ROW_CASES = [
    # op, shape, dim, placement, mask, scale, dtype
    ("softmax", (8, 16, 4096), -1, "S0", None, None, torch.bfloat16),
    ("softmax", (6, 5, 70000), -1, "S1", "like", "plain", torch.float32),  # long rows: the split path
    ("log_softmax", (4, 32, 8192), -1, "S1", "like", "float", torch.float16),
    ("log_softmax", (3000, 64), 1, "S0", "bcast", "dtensor", torch.bfloat16),
    ("logsumexp", (4096, 7, 3), 0, "S1", None, None, torch.float32),  # reduce a strided dim
    ("logsumexp", (5, 3, 300000), -1, "S0", None, "float", torch.bfloat16),
]
for op, shape, dim, code, mask, scale, dtype in ROW_CASES:
    name = f"{op}_{code}_{'x'.join(map(str, shape))}_{str(dtype)[6:]}"
    CHECKS[name] = (common._rows_check(op, shape, dim, code, mask, scale, dtype=dtype), "auto")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CAUSAL = {"is_causal": True}
ATTENTION_CASES = [
    # name, placement, B, Hq, Hkv, Sq, Sk, D, Dv, options, mask, dtype
    ("batch_gqa_causal_bf16", "S0", 4, 32, 8, 2048, 2048, 128, 128, CAUSAL, None, BF16),
    ("heads_gqa_causal_bf16", "S1", 2, 32, 8, 2048, 2048, 128, 128, CAUSAL, None, BF16),
    ("heads_gqa_mask_fp16", "S1", 2, 16, 4, 1000, 1500, 64, 64, {}, "bool_bcast", FP16),
    ("batch_window_softcap_bf16", "S0", 3, 8, 8, 777, 1024, 128, 64,
     {"window": (256, 64), "softcap": 30.0}, "bool_bcast_sharded", BF16),
    ("batch_additive_fp32", "S0", 2, 4, 2, 512, 640, 64, 64, {"precision": "ieee"}, "float_bcast", FP32),
    ("heads_mha_full_mask_bf16", "S1", 2, 8, 8, 256, 384, 96, 96, CAUSAL, "bool_like", BF16),
]
for name, code, *args, dtype in ATTENTION_CASES:
    CHECKS[f"attention_{name}"] = (common._attention_check(code, *args, dtype=dtype), "auto")
MERGE_CASES = [
    # name, placement, partial shape (..., Sq, D), P, form, gradients used, dtype
    ("heads_list_bf16", "S1", (2, 16, 2048, 128), 4, "list", "both", BF16),
    ("rows_uneven_stacked_fp16", "S2", (2, 8, 3001, 64), 3, "stacked", "out", FP16),
    ("batch_list_fp32_d96", "S0", (3, 8, 1024, 96), 2, "list", "lse", FP32),
]
for name, code, *args, dtype in MERGE_CASES:
    CHECKS[f"merge_{name}"] = (common._merge_check(code, *args, dtype=dtype), "auto")
CHECKS["two_dim_meshes"] = (common._two_dim_meshes, "auto")
CHECKS["softmax_family_errors"] = (common._rows_errors, "auto")
CHECKS["attention_errors"] = (common._attention_errors, "auto")
CHECKS["merge_errors"] = (common._merge_errors, "auto")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return common.spawn_checks(tmp_path_factory.mktemp("dtensor_gpu"), "cuda", "nccl", __name__, list(CHECKS),
                               timeout=540.0)


@pytest.mark.parametrize("name", list(CHECKS))
def test_dtensor_gpu(spawned, name):
    seed, failures = spawned
    assert not failures[name], (f"seed={seed} (replay with {common.SEED_ENV}={seed})\n"
                                + "\n".join(failures[name]))
