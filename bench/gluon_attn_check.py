"""GPU check and benchmark of the Gluon attention forward (safeops.ops.attention_gluon) on a Hopper GPU.

Standalone, for the H200 (torch 2.11, Triton 3.6), from the repository root:

    python3 bench/gluon_attn_check.py [--quick] [--skip-bench] [--budget-s 270]

Writes everything it prints to $OUT/gluon_attn_check.txt when OUT is set. Each part catches its own
exceptions, so one failing configuration does not hide the others. A kernel that does not finish within
WATCHDOG_S seconds (a barrier deadlock) ends the script at once with a HANG line: a hung kernel cannot be
recovered from inside the process.

1. Correctness, per configuration (bf16 / fp16 x head dim 64 / 128 / 256 x causal or not), at small shapes
   (GQA 4 query / 2 kv heads at S=384; MQA with partial blocks and Sq != Sk, 200 x 333): O and the lse
   from (m, l) against the float64 oracle of tests/oracle.py with its bounds (violation <= 1 passes), the
   row max m against the oracle's (base 2); O, m, l against the safeops Triton forward (max |diff|, bits
   equal); exact rows (causal row 0: O = v_0, l = 1; q = 0: m = 0, l = #visible keys); a NaN query row
   stays in its row; no keys: O = 0, m = -inf, l = 0; 10 reruns give the same bits; batch invariance
   (a batch element alone gives the bits it gets in the batch); the persistent grid, pingpong off and a
   (B, S, H, D)-transposed layout give the same bits; the Triton backward from the Gluon forward's
   (o, m, l) against the float64 oracle's gradients.
2. Timing (triton.testing.do_bench, median): B=4 H=16 S=4096 D=64 / 128, causal and not, and the
   Llama-3-8B layer (B=1, 32 query / 8 kv heads, D=128, causal, S=8192), bf16: Gluon (one program per tile
   and persistent), the safeops Triton forward, SDPA cuDNN and flash. TFLOP/s = 4 B H S^2 D / t, halved
   for causal. A short table at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE.parent), str(HERE.parent / "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402
import triton  # noqa: E402

WATCHDOG_S = 60.0
DEV = "cuda"
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
_lines: list[str] = []
SUMMARY: list[tuple[str, str]] = []


def say(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    _lines.append(line)


def dump() -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gluon_attn_check.txt").write_text("\n".join(_lines) + "\n")


def finish_or_die(what: str) -> None:
    """Wait for the GPU, or end the process if it does not finish (a deadlocked kernel)."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > WATCHDOG_S:
            say(f"HANG: {what} did not finish in {WATCHDOG_S:.0f} s (barrier deadlock?); stopping here")
            dump()
            os._exit(3)
        time.sleep(0.005)


def record(name: str, ok: bool | None, detail: str = "") -> None:
    status = "ok" if ok else ("FAIL" if ok is False else "info")
    SUMMARY.append((name, f"{status} {detail}".strip()))
    say(f"  [{status}] {name} {detail}")


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    both_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    d = torch.where(both_inf, torch.zeros_like(a), (a - b).abs())
    return float(d.nan_to_num(nan=float("inf")).max()) if d.numel() else 0.0


# ------------------------------------------------------------------------------------------------------
# The implementations.
# ------------------------------------------------------------------------------------------------------

def gluon(q, k, v, causal, **kw):
    from safeops.ops import attention_launch as L

    return L.gluon_forward(q, k, v, causal, **kw)


def triton_fwd(q, k, v, causal, scale=None):
    """The safeops Triton forward (SAFEOPS_GLUON=0 for the call: the launcher's CUDA default is Gluon)."""
    from safeops.ops import attention_launch as L

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    saved = os.environ.get("SAFEOPS_GLUON")
    os.environ["SAFEOPS_GLUON"] = "0"
    try:
        return L.forward(q, k, v, None, 0, None, None, q.shape[2], k.shape[2], causal, scale, None,
                         -1, 0 if causal else -1, 0)
    finally:
        if saved is None:
            del os.environ["SAFEOPS_GLUON"]
        else:
            os.environ["SAFEOPS_GLUON"] = saved


def triton_bwd(g, q, k, v, o, m, l, causal):
    from safeops.ops import attention_launch as L

    return L.backward(g, q, k, v, o, m, l, None, 0, None, None, q.shape[2], k.shape[2], causal,
                      q.shape[-1] ** -0.5, None, -1, -1, 0)


def inputs(b, hq, hkv, sq, sk, d, dtype, seed=0, layout="bhsd"):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def make(h, s):
        if layout == "bshd":  # (B, S, H, D) memory, viewed as (B, H, S, D)
            return torch.randn(b, s, h, d, device=DEV, dtype=dtype, generator=g).transpose(1, 2)
        return torch.randn(b, h, s, d, device=DEV, dtype=dtype, generator=g)
    return make(hq, sq), make(hkv, sk), make(hkv, sk)


# ------------------------------------------------------------------------------------------------------
# 0. Compile ahead, in parallel: every kernel this script launches lands in Triton's on-disk cache, so the
#    launches below load instead of compiling one at a time (same cache keys: the same JIT binder).
# ------------------------------------------------------------------------------------------------------

CHECK_CONFIGS = [(dt, d, c) for dt in ("bfloat16", "float16") for d in (64, 128, 256) for c in (False, True)]
SCHEDULE_CONFIGS = [(64, False), (64, True), (128, False), (128, True)]


def _triton_launches(quick):
    """The safeops Triton kernels this script launches, recorded on meta tensors (no GPU work)."""
    import json

    from safeops.ops import attention_launch as L

    meta = torch.device("meta")

    def plan(b, hq, hkv, s, d, dtype, causal, backward):
        q = torch.empty(b, hq, s, d, dtype=dtype, device=meta)
        k = torch.empty(b, hkv, s, d, dtype=dtype, device=meta)
        opts = (None, 0, None, None, s, s, causal, d**-0.5, None, -1, -1, 0)
        o, m, l = L.forward(q, k, k, *opts)
        if backward:
            L.backward(o, q, k, k, o, m, l, *opts)

    with L.recording() as launches:
        for dt, d, c in CHECK_CONFIGS:
            plan(2, 4, 2, 384, d, getattr(torch, dt), c, False)
        for d, c in SCHEDULE_CONFIGS[2:] if quick else SCHEDULE_CONFIGS:
            plan(2, 4, 2, 384, d, torch.bfloat16, c, True)
        for _, b, hq, hkv, s, d, c in BENCH_SHAPES:
            plan(b, hq, hkv, s, d, torch.bfloat16, c, False)
    return list({json.dumps(x, sort_keys=True): x for x in launches}.values())


def prewarm(quick, variants, triton_kernels=True):
    import threading

    from safeops.ops import attention_gluon as G
    from safeops.ops import attention_launch as L

    t0 = time.time()
    result = {} if triton_kernels else {"triton": "no Triton kernels (checks and timing skipped)"}

    def triton_side():
        try:
            launches = _triton_launches(quick)
            r = L.compile_launches(launches, python=sys.executable, arch=90, workers=8)
            result["triton"] = f"{sum(x['ok'] for x in r['results'])}/{len(launches)} Triton kernels"
        except Exception as e:  # noqa: BLE001 - the launches compile on first use instead
            result["triton"] = f"Triton prewarm failed ({type(e).__name__}: {str(e)[:200]})"

    thread = threading.Thread(target=triton_side if triton_kernels else lambda: None)
    thread.start()
    jobs = [(dt, d, c, False, {}) for dt, d, c in CHECK_CONFIGS]
    jobs += [("bfloat16", d, c, False, {"pingpong": False}) for d, c in (SCHEDULE_CONFIGS[2:] if quick else
                                                                        SCHEDULE_CONFIGS)]
    if variants:
        extra = [("bfloat16", d, c, False, _config_changes(changes)) for by_d in VARIANTS.values()
                 for d, changes in by_d.items() for c in (False, True)]
        jobs += [j for i, j in enumerate(extra) if j not in jobs and j not in extra[:i]]
    try:
        failed = G.warm_cache(jobs, workers=6)
    except Exception as e:  # noqa: BLE001 - the launches compile on first use instead
        failed = [f"pool: {type(e).__name__}: {str(e)[:300]}"]
    done = len(jobs) - len(failed)
    thread.join()
    say(f"prewarm ({time.time() - t0:.0f} s): {done}/{len(jobs)} Gluon configurations, "
        f"{result.get('triton')}")
    for f in failed:
        say(f"  Gluon prewarm failed: {f}")


# ------------------------------------------------------------------------------------------------------
# 1. Correctness.
# ------------------------------------------------------------------------------------------------------

def check_oracle(name, q, k, v, causal, o, m, l):
    import oracle

    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    r = oracle.attention(qc, kc, vc, is_causal=causal)
    out_b, lse_b = oracle.attention_bounds(r, qc)
    o_viol, o_where = oracle.max_violation(o.cpu(), r.out, out_b)
    lse = (m.cpu().double() + torch.log2(l.cpu().double())) * LN2
    lse_viol, lse_where = oracle.max_violation(lse, r.lse, lse_b)
    # Row max, base 2: z2 = fp32(s) * C1 against the float64 max of s * scale * log2(e).
    s64 = qc.double() @ kc.double().repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)
    z64 = s64 * (q.shape[-1] ** -0.5) * LOG2E
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        z64 = z64.masked_fill(~keep, float("-inf"))
    m64 = z64.amax(-1)
    m_viol, m_where = oracle.max_violation(m.cpu(), m64, lse_b * LOG2E)
    ok = o_viol <= 1 and lse_viol <= 1 and m_viol <= 1
    record(f"{name} vs float64 oracle", ok,
           f"(violation / bound: O {o_viol:.3g}, lse {lse_viol:.3g}, m {m_viol:.3g})"
           + ("" if ok else f" O {o_where}; lse {lse_where}; m {m_where}"))


def check_config(dtype, d, causal, quick):
    dn = "bf16" if dtype == torch.bfloat16 else "fp16"
    tag = f"{dn} D={d} {'causal' if causal else 'dense'}"
    say(f"\n== {tag}")
    shapes = [("GQA 4/2 S=384", (2, 4, 2, 384, 384)), ("MQA 2/1 Sq=200 Sk=333", (1, 2, 1, 200, 333))]
    for label, (b, hq, hkv, sq, sk) in shapes:
        name = f"{tag} {label}"
        try:
            q, k, v = inputs(b, hq, hkv, sq, sk, d, dtype)
            o, m, l = gluon(q, k, v, causal)
            finish_or_die(name)
            check_oracle(name, q, k, v, causal, o, m, l)
            if label.startswith("GQA"):
                ot, mt, lt = triton_fwd(q, k, v, causal)
                torch.cuda.synchronize()
                record(f"{name} vs Triton forward", None,
                       f"max|dO| {maxdiff(o, ot):.3g} bits {bits_equal(o, ot)}; max|dm| {maxdiff(m, mt):.3g} "
                       f"bits {bits_equal(m, mt)}; max|dl| {maxdiff(l, lt):.3g} bits {bits_equal(l, lt)}")
                runs = [gluon(q, k, v, causal) for _ in range(10)]
                finish_or_die(name + " reruns")
                same = all(bits_equal(x, y) for r in runs for x, y in zip(r, (o, m, l), strict=True))
                record(f"{name} 10 reruns same bits", same)
                o1, m1, l1 = gluon(q[1:2].clone(), k[1:2].clone(), v[1:2].clone(), causal)
                finish_or_die(name + " batch element alone")
                record(f"{name} batch invariance", bits_equal(o1, o[1:2]) and bits_equal(m1, m[1:2])
                       and bits_equal(l1, l[1:2]))
                op, mp, lp = gluon(q, k, v, causal, persistent=True)
                finish_or_die(name + " persistent")
                record(f"{name} persistent grid same bits", bits_equal(op, o) and bits_equal(mp, m)
                       and bits_equal(lp, l))
                qt, kt, vt = inputs(b, hq, hkv, sq, sk, d, dtype, layout="bshd")
                ob, mb, lb = gluon(qt, kt, vt, causal)
                oc, mc, lc = gluon(qt.contiguous(), kt.contiguous(), vt.contiguous(), causal)
                finish_or_die(name + " bshd")
                record(f"{name} (B,S,H,D) layout same bits", bits_equal(ob.contiguous(), oc)
                       and bits_equal(mb, mc) and bits_equal(lb, lc))
            if not quick or label.startswith("GQA"):
                check_exact_rows(name, b, hq, hkv, sq, sk, d, dtype, causal)
        except Exception as e:  # noqa: BLE001 - report and go on with the other configurations
            record(name, False, f"EXCEPTION {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc(limit=4)


def check_exact_rows(name, b, hq, hkv, sq, sk, d, dtype, causal):
    q, k, v = inputs(b, hq, hkv, sq, sk, d, dtype, seed=1)
    group = hq // hkv
    if causal:  # row 0 sees key 0 only: p = 1 exactly, so O = v_0 exactly and l = 1
        o, m, l = gluon(q, k, v, True)
        finish_or_die(name + " causal row 0")
        v0 = v[:, :, 0, :].repeat_interleave(group, 1)
        record(f"{name} causal row 0: O = v_0, l = 1 exactly", bool(torch.equal(o[:, :, 0, :], v0))
               and bool((l[:, :, 0] == 1).all()))
    zq = torch.zeros_like(q)  # equal logits: z2 = 0, m = 0, l = number of visible keys
    o, m, l = gluon(zq, k, v, causal)
    finish_or_die(name + " q = 0")
    rows = torch.arange(sq, device=DEV)
    count = torch.clamp(rows + 1, max=sk) if causal else torch.full_like(rows, sk)
    record(f"{name} q = 0: m = 0, l = #visible keys exactly", bool((m == 0).all())
           and bool((l == count.float()).all()))
    qn = q.clone()
    qn[0, 0, 5, :] = float("nan")
    on, mn, ln_ = gluon(qn, k, v, causal)
    oc, mc, lc = gluon(q, k, v, causal)
    finish_or_die(name + " NaN row")
    other = torch.ones(sq, dtype=torch.bool, device=DEV)
    other[5] = False
    stays = (bool(torch.isnan(on[0, 0, 5]).all()) and bits_equal(on[0, 0, other], oc[0, 0, other])
             and bits_equal(on[:, 1:], oc[:, 1:]) and bits_equal(mn[0, 0, other], mc[0, 0, other]))
    record(f"{name} NaN query row: NaN there, other rows' bits unchanged", stays)
    ke, ve = k[:, :, :0], v[:, :, :0]
    oe, me, le = gluon(q, ke, ve, causal)
    torch.cuda.synchronize()
    record(f"{name} no keys: O = 0, m = -inf, l = 0", bool((oe == 0).all()) and bool((me == -math.inf).all())
           and bool((le == 0).all()))


def check_schedule_and_backward(quick):
    import oracle

    from safeops.kernels import attention_gluon as K

    for d, causal in SCHEDULE_CONFIGS[2:] if quick else SCHEDULE_CONFIGS:
        name = f"bf16 D={d} {'causal' if causal else 'dense'}"
        try:
            q, k, v = inputs(2, 4, 2, 384, 384, d, torch.bfloat16, seed=2)
            o, m, l = gluon(q, k, v, causal)
            cfg = dataclasses.replace(K.FWD_CONFIGS[d], pingpong=False)
            o2, m2, l2 = gluon(q, k, v, causal, config=cfg)
            finish_or_die(name + " pingpong off")
            record(f"{name} pingpong off same bits", bits_equal(o, o2) and bits_equal(m, m2)
                   and bits_equal(l, l2))
            g = torch.randn_like(o)
            dq, dk, dv = triton_bwd(g, q, k, v, o, m, l, causal)
            torch.cuda.synchronize()
            r, dq64, dk64, dv64 = oracle.attention_gradients(q.cpu(), k.cpu(), v.cpu(), g.cpu(),
                                                             is_causal=causal)
            _, _, dq_b, dk_full, dv_full = oracle.attention_bounds(r, q.cpu(), g.cpu())
            hkv = k.shape[1]
            bounds = (oracle.add_rounding(dq_b, dq64, dq.dtype),
                      oracle.add_rounding(oracle.reduce_kv_bound(dk_full, hkv), dk64, dk.dtype),
                      oracle.add_rounding(oracle.reduce_kv_bound(dv_full, hkv), dv64, dv.dtype))
            viol = [oracle.max_violation(x.cpu(), e, bnd)[0]
                    for x, e, bnd in zip((dq, dk, dv), (dq64, dk64, dv64), bounds, strict=True)]
            record(f"{name} Triton backward from the Gluon (o, m, l) vs float64 oracle", max(viol) <= 1,
                   f"(violation / bound: dq {viol[0]:.3g}, dk {viol[1]:.3g}, dv {viol[2]:.3g})")
        except Exception as e:  # noqa: BLE001
            record(name + " schedule / backward", False, f"EXCEPTION {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc(limit=4)


# ------------------------------------------------------------------------------------------------------
# 2. Timing.
# ------------------------------------------------------------------------------------------------------

def sdpa(backend_name):
    def run(q, k, v, causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, backend_name)]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    enable_gqa=q.shape[1] != k.shape[1])
    run.sdpa = True
    return run


IMPLS = {
    "gluon": lambda q, k, v, c: gluon(q, k, v, c)[0],
    "gluon persistent": lambda q, k, v, c: gluon(q, k, v, c, persistent=True)[0],
    "safeops triton": lambda q, k, v, c: triton_fwd(q, k, v, c)[0],
    "sdpa cudnn": sdpa("CUDNN_ATTENTION"),
    "sdpa flash": sdpa("FLASH_ATTENTION"),
}
BENCH_SHAPES = [  # (label, B, Hq, Hkv, S, D, causal)
    ("B4 H16 S4K D64", 4, 16, 16, 4096, 64, False),
    ("B4 H16 S4K D64 causal", 4, 16, 16, 4096, 64, True),
    ("B4 H16 S4K D128", 4, 16, 16, 4096, 128, False),
    ("B4 H16 S4K D128 causal", 4, 16, 16, 4096, 128, True),
    ("Llama-3-8B S8K (32/8 heads, D128) causal", 1, 32, 8, 8192, 128, True),
]


# --variants: configurations to time against the default at the B4 H16 S4K shapes (name -> head dim ->
# changes to FWD_CONFIGS[d], plus "persistent" for the persistent grid); "same bits" is expected wherever the
# key block (block_n) is unchanged. Each compiles offline for sm_90 without spills (Triton 3.6).
VARIANTS = {
    "pingpong off": {64: {"pingpong": False}, 128: {"pingpong": False}},
    "one more stage": {64: {"num_stages": 4}, 128: {"num_stages": 3}},
    "64-key blocks, 4 stages": {128: {"block_n": 64, "num_stages": 4}},
    "3 consumer warpgroups (192 rows), 64-key blocks, 4 stages": {
        64: {"num_wg": 3, "consumer_regs": 160, "block_n": 64, "num_stages": 4}},
    "persistent": {64: {"persistent": True}, 128: {"persistent": True}},
    "persistent, separate O buffer": {64: {"persistent": True, "separate_o": True},
                                      128: {"persistent": True, "separate_o": True}},
    "3 warpgroups, 64-key blocks, persistent, separate O": {
        64: {"num_wg": 3, "consumer_regs": 160, "block_n": 64, "num_stages": 4, "persistent": True,
             "separate_o": True}},
}


def _config_changes(changes: dict) -> dict:
    return {k: v for k, v in changes.items() if k != "persistent"}


def variant_configs():
    from safeops.kernels import attention_gluon as K

    return [(name, d, dataclasses.replace(K.FWD_CONFIGS[d], **_config_changes(changes)),
             changes.get("persistent", False))
            for name, by_d in VARIANTS.items() for d, changes in by_d.items()]


def bench_variants(deadline):
    rows = []
    for label, b, hq, hkv, s, d, causal in BENCH_SHAPES[:4]:
        flops = 4 * b * hq * s * s * d / (2 if causal else 1)
        q, k, v = inputs(b, hq, hkv, s, s, d, torch.bfloat16, seed=3)
        base = gluon(q, k, v, causal)
        finish_or_die(f"gluon {label}")
        ms = triton.testing.do_bench(lambda q=q, k=k, v=v, c=causal: gluon(q, k, v, c), warmup=25, rep=100,
                                     return_mode="median")
        rows.append((label, "default", flops / ms / 1e9, ""))
        try:  # the reference point, in the same run
            ms = triton.testing.do_bench(lambda q=q, k=k, v=v, c=causal: IMPLS["sdpa cudnn"](q, k, v, c),
                                         warmup=25, rep=100, return_mode="median")
            rows.append((label, "sdpa cudnn", flops / ms / 1e9, ""))
        except Exception as e:  # noqa: BLE001
            rows.append((label, "sdpa cudnn", None, f"FAILED {type(e).__name__}"))
        for name, vd, cfg, persistent in variant_configs():
            if vd != d or time.time() > deadline:
                continue
            try:
                out = gluon(q, k, v, causal, config=cfg, persistent=persistent)
                finish_or_die(f"{name} {label}")
                same = all(bits_equal(x, y) for x, y in zip(out, base, strict=True))
                ms = triton.testing.do_bench(
                    lambda q=q, k=k, v=v, c=causal, cfg=cfg, p=persistent: gluon(q, k, v, c, config=cfg,
                                                                                 persistent=p),
                    warmup=25, rep=100, return_mode="median")
                note = f"same bits {same}, max|dO| {maxdiff(out[0], base[0]):.3g}"
                rows.append((label, name, flops / ms / 1e9, note))
            except Exception as e:  # noqa: BLE001
                rows.append((label, name, None, f"FAILED {type(e).__name__}: {str(e)[:150]}"))
        del q, k, v, base
        torch.cuda.empty_cache()
    say("\n== Gluon variants, TFLOP/s (bf16)")
    for label, name, tf, note in rows:
        say(f"  {label:24s} {name:44s} {'-' if tf is None else f'{tf:6.0f}'}  {note}")


def bench(deadline):
    table = {}
    for label, b, hq, hkv, s, d, causal in BENCH_SHAPES:
        say(f"\n== timing {label}")
        flops = 4 * b * hq * s * s * d / (2 if causal else 1)
        q, k, v = inputs(b, hq, hkv, s, s, d, torch.bfloat16, seed=3)
        ref = None
        for impl, fn in IMPLS.items():
            if time.time() > deadline:
                say(f"  {impl}: skipped (time budget)")
                continue
            try:
                kq, vq, note = k, v, ""
                if getattr(fn, "sdpa", False) and hq != hkv:
                    try:
                        fn(q, k, v, causal)
                    except RuntimeError:  # no GQA in this backend: time it on kv expanded beforehand
                        kq, vq = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))
                        note = " (kv expanded)"
                out = fn(q, kq, vq, causal)
                finish_or_die(f"{impl} {label}")
                if ref is None:
                    ref = triton_fwd(q, k, v, causal)[0]
                diff = maxdiff(out, ref)
                ms = triton.testing.do_bench(lambda fn=fn, q=q, kq=kq, vq=vq, c=causal: fn(q, kq, vq, c),
                                             warmup=25, rep=100, return_mode="median")
                tf = flops / ms / 1e9
                table[(label, impl)] = tf
                say(f"  {impl:18s} {ms * 1e3:9.1f} us  {tf:6.0f} TFLOP/s  max|O - safeops triton| "
                    f"{diff:.3g}{note}")
            except Exception as e:  # noqa: BLE001
                table[(label, impl)] = None
                first = str(e).splitlines()[0][:200] if str(e) else ""
                say(f"  {impl:18s} FAILED {type(e).__name__}: {first}")
        del q, k, v, ref
        torch.cuda.empty_cache()
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer correctness cases (bf16 all, fp16 D=128)")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--no-prewarm", action="store_true", help="compile on first launch, one at a time")
    ap.add_argument("--variants", action="store_true",
                    help="also time the configurations of VARIANTS (1-2 more minutes)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="stop starting new parts after this")
    args = ap.parse_args()
    start = time.time()
    deadline = start + args.budget_s
    say(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name(0)}")
    from safeops.ops import attention_launch as L

    q, k, v = inputs(1, 2, 2, 128, 128, 128, torch.bfloat16)
    why = L.gluon_reason(q, k, v, None, None, False, None, -1, -1)
    say(f"Gluon path can run: {not why} {why}")
    if why:
        dump()
        return 1
    if not args.no_prewarm:
        prewarm(args.quick, args.variants, triton_kernels=not (args.skip_checks and args.skip_bench))
    if not args.skip_checks:
        configs = [(getattr(torch, dt), d, c) for dt, d, c in CHECK_CONFIGS]
        if args.quick:
            configs = [x for x in configs if x[0] == torch.bfloat16 or x[1] == 128]
        for dt, d, c in configs:
            if time.time() > deadline - (120 if not args.skip_bench else 0):
                say(f"\n== {dt} D={d} causal={c}: skipped (time budget; timing needs ~2 min)")
                continue
            check_config(dt, d, c, args.quick)
        check_schedule_and_backward(args.quick)
    table = {} if args.skip_bench else bench(deadline + 60)
    if args.variants:  # alone (--skip-checks --skip-bench), within --budget-s; else up to 3 minutes more
        bench_variants(deadline if args.skip_checks and args.skip_bench else deadline + 180)
    say(f"\n== summary ({time.time() - start:.0f} s)")
    fails = [n for n, s in SUMMARY if s.startswith("FAIL")]
    say(f"checks: {sum(s.startswith('ok') for _, s in SUMMARY)} ok, {len(fails)} failed")
    for n in fails:
        say(f"  FAIL {n}")
    if table:
        impls = list(IMPLS)
        say("TFLOP/s (bf16)".ljust(44) + "".join(f"{i:>18s}" for i in impls) + "   gluon / cudnn")
        for label, *_ in BENCH_SHAPES:
            vals = [table.get((label, i)) for i in impls]
            cells = "".join(f"{'-' if x is None else f'{x:.0f}':>18s}" for x in vals)
            best = max((x for x in vals[:2] if x is not None), default=None)
            cudnn = table.get((label, "sdpa cudnn"))
            ratio = f"{best / cudnn:.2f}x" if best and cudnn else "-"
            say(label.ljust(44) + cells + f"   {ratio:>8s}")
    dump()
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
