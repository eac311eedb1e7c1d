"""One training step of a ~1B-parameter Llama-style model: attn_implementation "sdpa" against "safeops".

Issue 5, "Performance". A ``LlamaForCausalLM`` built from a config with random weights (no download):
hidden 2048, 22 layers, 32 query heads, 4 key/value heads (GQA), MLP 5632, vocabulary 32000 -- about
1.1B parameters, the TinyLlama shape -- in bf16, batch 1, sequence 4096. For each attention implementation
the same weights run one step, ``loss = model(ids, labels=ids).loss; loss.backward()``, and the script
reports:

- step time: median of CUDA-event timings (``triton.testing.do_bench`` through ``bench/_harness.py``),
  20th-80th percentile in brackets, and tokens per second from the median. ``--interleave R`` times the
  implementations in R alternating rounds instead (A B, B A, ...; ``--round-steps`` steps each, every
  implementation first run for ``--warmup-ms``), so a GPU clock still ramping up in the first one and
  drift of the clock or the host's load land on all of them alike; medians over all rounds;
- peak memory: ``torch.cuda.max_memory_allocated()`` over one step;
- the loss, and the largest difference of the logits from the first implementation's, relative to its
  largest logit (same weights, same input: the two differ only in attention rounding);
- whether two steps give bit-identical gradients for every parameter ("repeatable"). safeops' backward has
  no atomics (contract section 6); SDPA's cuDNN and flash backward gave different gradient bits from one
  call to the next on the H200 (scratch measurement, session 9), so its step is expected not to be.

``--cuda-graph`` captures each implementation's step in one CUDA graph (torch's whole-network capture) and
times its replays: the GPU time of a step with no host in the loop, so the result does not depend on how
fast the host enqueues (on the H200 machine the host's speed switches between two regimes ~1.5x apart,
session 10). The replayed step's loss must equal the eager step's bit for bit, or the row says so. Without
``--pad`` the model gets ``attention_mask=None`` there (transformers reads a mask's values on the host to
decide whether SDPA may drop it, which a capture forbids). Some transformers releases (5.17) also build an
explicit causal mask for SDPA while a graph is captured, so the captured step would run another attention
call than the eager one: the bench gives "sdpa" safeops' mask function too
(``safeops.transformers.capture_safe_sdpa_mask``: outside capture it is transformers' ``sdpa_mask``), so
both captured steps make the eager step's mask decision.

Optional ``--pad N`` left-pads the first N tokens of the sequence (attention_mask 0 there), the case where
torch's SDPA can produce NaN in padded rows and safeops gives 0.

    python bench/model.py [--seq 4096] [--batch 1] [--layers 22] [--impls sdpa,safeops] [--pad 0]
                          [--warmup-ms 200] [--rep-ms 1500] [--interleave R [--round-steps K]]
                          [--out bench/out/model.md]
    python bench/model.py --profile      # GPU kernel time by kernel and host enqueue time of one step
    python bench/model.py --deterministic  # under torch.use_deterministic_algorithms(True)
    python bench/model.py --cuda-graph     # time replays of the step captured in a CUDA graph

Needs a CUDA GPU and transformers (``pip install 'safeops[transformers]'``).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE.parent), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

import safeops  # noqa: E402, F401, I001  (first: on a CPU machine it sets TRITON_INTERPRET)
import _harness as H  # noqa: E402
import torch  # noqa: E402

IMPLS = ("sdpa", "safeops", "eager")


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.mlp, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=max(4096, args.seq), rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.train()
    return model


def set_impl(model, impl: str) -> None:
    if impl == "safeops":
        import safeops.transformers  # noqa: F401  (registers "safeops" with transformers)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl


def train_step(model, ids, mask):
    """One training step (gradients reset, forward with labels, backward); returns the model's output."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out


def _switcher(model, impl: str, ids, mask):
    """For ``interleaved_ms``: switches the model to ``impl`` and returns its training step."""
    def switch():
        set_impl(model, impl)
        return lambda: train_step(model, ids, mask)
    return switch


def measure(model, impl: str, ids, mask, args, reference, timed: bool = True) -> dict:
    """One implementation's checks (loss, finiteness, logits against the reference, peak memory) and, if
    ``timed``, its step time (do_bench)."""
    row = {"impl": impl, "status": "ok", "note": ""}
    try:
        set_impl(model, impl)

        def step():
            train_step(model, ids, mask)

        out = train_step(model, ids, mask)
        row["loss"] = float(out.loss)
        logits = out.logits.detach()
        row["finite"] = bool(torch.isfinite(logits).all()) and all(
            p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        if reference is None:
            row["keep"] = logits.float().cpu()
            row["logit_diff"] = 0.0
        else:
            a = logits.float().cpu()
            ok = torch.isfinite(a) & torch.isfinite(reference)
            row["logit_diff"] = ((a[ok] - reference[ok]).abs().max() / reference[ok].abs().max()).item()
        del out, logits
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["repeatable"] = grads_repeatable(model, step)
        if timed:
            row["ms"], row["p20"], row["p80"] = H.bench_ms(step, args.warmup_ms, args.rep_ms)
            row["tok_s"] = ids.numel() / (row["ms"] * 1e-3)
    except Exception as e:  # one implementation failing must not lose the others' numbers
        row["status"], row["note"] = "error", H._short(e)
    return row


def time_graph(model, row: dict, ids, mask, args) -> None:
    """``--cuda-graph``: times replays of ``row``'s implementation's step captured in a CUDA graph, into
    ``row``; notes a replayed loss that differs from the eager one. Run after every implementation's checks,
    so no graph's memory is counted in another's peak."""
    try:
        set_impl(model, row["impl"])
        graph, loss = capture_step(model, ids, mask)
        try:
            graph.replay()
            torch.cuda.synchronize()
            if float(loss) != row["loss"]:
                row["note"] = f"replayed loss {float(loss)!r} != eager {row['loss']!r}"
            row["ms"], row["p20"], row["p80"] = H.bench_ms(graph.replay, args.warmup_ms, args.rep_ms)
        finally:
            del graph, loss
            model.zero_grad(set_to_none=True)  # the gradients live in the graph's memory pool
            gc.collect()
            torch.cuda.empty_cache()
        row["tok_s"] = ids.numel() / (row["ms"] * 1e-3)
    except Exception as e:
        row["status"], row["note"] = "error", H._short(e)


def capture_safe_masks() -> None:
    """SDPA-style implementations make the eager step's mask decision under capture (module docstring)."""
    from transformers.masking_utils import AttentionMaskInterface

    import safeops.transformers as sht

    AttentionMaskInterface.register("sdpa", sht.capture_safe_sdpa_mask)


def capture_step(model, ids, mask):
    """(graph, loss): one training step (forward with labels, backward) captured in a CUDA graph after a
    warm-up on a side stream, as torch's whole-network capture does; the gradients are allocated in the
    capture, so each replay writes them (and the loss) in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            train_step(model, ids, mask)
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)  # the capture allocates the gradients (in its memory pool)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = train_step(model, ids, mask).loss
    return graph, loss


def grads_repeatable(model, step) -> bool:
    """Whether two steps on the same weights and input give bit-identical gradients for every parameter
    (a run that needs reproducible training needs this; atomics in a backward kernel break it)."""
    step()
    first = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    step()
    same = all((a is None and p.grad is None) or (a is not None and p.grad is not None
                                                   and torch.equal(a, p.grad))
               for a, p in zip(first, model.parameters(), strict=True))
    del first
    return same


def cuda_block_ms(fn, n: int) -> list[float]:
    """CUDA-event time of each of ``n`` back-to-back calls of ``fn`` (no synchronization between them, so
    the host enqueues ahead as in training; one at the end)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def quantile(sorted_values: list[float], q: float) -> float:
    """The q-quantile of sorted values, linear between the two nearest ranks."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def interleaved_ms(steps: dict, rounds: int, per_round: int, warmup_ms: float, time_block=cuda_block_ms,
                   clock=None) -> dict[str, tuple[float, float, float]]:
    """(median, 20th, 80th percentile) step time in ms per implementation. ``steps`` maps a name to a
    function that switches the model to that implementation and returns its step function. First every
    implementation runs untimed for ``warmup_ms`` (``clock()``: seconds, default ``time.perf_counter``;
    the GPU's clock ramps up on a process's first work); then ``rounds`` rounds each time ``per_round``
    steps of every implementation, in the order of ``steps`` in even rounds and reversed in odd ones, after
    one untimed step per switch. ``time_block(fn, n)`` returns the n calls' times in ms."""
    import time

    clock = clock or time.perf_counter
    names = list(steps)
    for name in names:
        step = steps[name]()
        t0 = clock()
        step()
        while (clock() - t0) * 1e3 < warmup_ms:
            step()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            step = steps[name]()
            step()
            samples[name] += time_block(step, per_round)
    out = {}
    for name, values in samples.items():
        values = sorted(values)
        out[name] = (quantile(values, 0.5), quantile(values, 0.2), quantile(values, 0.8))
    return out


def profile(model, impl: str, ids, mask, top: int = 18) -> str:
    """One step's GPU kernel time by kernel (torch.profiler, summed over the step) and its host enqueue time
    (``time.perf_counter`` around a step with no synchronization inside; when the launch queue fills, the
    host waits on the GPU and this approaches the GPU time)."""
    import time

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    set_impl(model, impl)

    def step():
        train_step(model, ids, mask)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_kernel: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:90]
            by_kernel[name] = by_kernel.get(name, 0.0) + (e.time_range.end - e.time_range.start)
    lines = [f"{impl}: host enqueue {1e3 * (t1 - t0):.1f} ms, wall {1e3 * (t2 - t0):.1f} ms, "
             f"GPU kernel time {sum(by_kernel.values()) / 1e3:.1f} ms"]
    for name, us in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / 1e3:8.2f} ms  {name}")
    return "\n".join(lines)


def markdown(rows, meta, args, n_params) -> str:
    lines = [
        f"### Llama-style model, one training step, sdpa vs safeops: measured {meta.get('date')} on "
        f"{meta.get('gpu')} (torch {meta.get('torch')}, triton {meta.get('triton')}, "
        f"CUDA {meta.get('cuda')})",
        "",
        f"{n_params / 1e9:.2f}B parameters (hidden {args.hidden}, {args.layers} layers, {args.heads} "
        f"query / {args.kv_heads} key-value heads, MLP {args.mlp}, vocabulary {args.vocab}), bf16, "
        f"batch {args.batch}, sequence {args.seq}"
        + (f", first {args.pad} tokens left-padded" if args.pad else "")
        + ". One step = forward with labels + backward. Time: median of CUDA-event timings, 20th-80th "
        "percentile in brackets"
        + (f" ({args.interleave} alternating rounds of {args.round_steps} steps per implementation)"
           if args.interleave else "")
        + (", timed over replays of the step captured in a CUDA graph (no host in the loop; "
           "attention_mask=None)"
           if getattr(args, "cuda_graph", False) else "")
        + ". Logit diff: max |logits - first| / max |first|. Repeatable: two steps give bit-identical "
        "gradients for every parameter"
        + (" (under `torch.use_deterministic_algorithms(True)`)" if args.deterministic else "") + ".",
        "",
        "| attn_implementation | step ms | tokens/s | vs first | peak GiB | loss | finite | logit diff "
        "| repeatable |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    first = next((r for r in rows if r["status"] == "ok"), None)
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['impl']} | {r['status']}: {r['note']} | | | | | | | |")
            continue
        lines.append(
            f"| {r['impl']} | {r['ms']:.1f} [{r['p20']:.1f}-{r['p80']:.1f}] | {r['tok_s']:.0f} | "
            f"{first['ms'] / r['ms']:.2f}x | {r['peak_gib']:.2f} | {r['loss']:.4f} | "
            f"{'yes' if r['finite'] else 'NO'} | {r['logit_diff']:.2e} | "
            f"{'yes' if r['repeatable'] else 'no'} |")
    lines += ["", "'vs first' > 1 means faster than the first row."]
    lines += [f"- {r['impl']}: {r['note']}" for r in rows if r["status"] == "ok" and r.get("note")]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="One training step of a ~1B Llama-style model, sdpa vs safeops.")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--mlp", type=int, default=5632)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--pad", type=int, default=0, help="left-padded tokens at the start of the sequence")
    p.add_argument("--impls", default="sdpa,safeops", help=f"comma list from {', '.join(IMPLS)}")
    p.add_argument("--warmup-ms", type=float, default=200)
    p.add_argument("--rep-ms", type=float, default=1500)
    p.add_argument("--interleave", type=int, default=0,
                   help="time the implementations in this many alternating rounds (0: one after another)")
    p.add_argument("--round-steps", type=int, default=5, help="--interleave: timed steps per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True) for every implementation (what a run that "
                        "needs repeatable gradients sets); an implementation without a deterministic path "
                        "reports the error")
    p.add_argument("--out", default=str(HERE / "out" / "model.md"))
    p.add_argument("--cuda-graph", action="store_true",
                   help="time replays of each implementation's step captured in a CUDA graph (no host in the "
                        "loop); without --pad the model then gets attention_mask=None")
    p.add_argument("--profile", action="store_true",
                   help="instead of timing: each implementation's GPU kernel time by kernel and host enqueue "
                        "time of one step")
    args = p.parse_args(argv)
    if args.interleave and args.cuda_graph:
        p.error("--cuda-graph times each implementation's replays one after another; drop --interleave")
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        p.error(f"unknown implementation(s) {bad}; choose from {IMPLS}")
    if args.deterministic:  # cuBLAS needs a fixed workspace for repeatable results, set before its first use
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    H.require_cuda("bench/model.py")
    try:
        import transformers
    except ImportError:
        sys.exit("bench/model.py: needs transformers (pip install 'safeops[transformers]')")

    meta = H.device_meta()
    print(f"{meta['gpu']}: torch {meta['torch']}, triton {meta['triton']}, transformers "
          f"{transformers.__version__}", flush=True)
    model = build(args)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    if args.pad:
        mask[:, : args.pad] = 0
    elif args.cuda_graph:
        mask = None  # see the module docstring: a mask's values would be read on the host in the capture
    if args.profile:
        for impl in impls:
            print(profile(model, impl, ids, mask), flush=True)
        return 0
    rows, reference = [], None
    for impl in impls:
        row = measure(model, impl, ids, mask, args, reference, timed=not (args.interleave or args.cuda_graph))
        if reference is None and row["status"] == "ok":
            reference = row.pop("keep")
        row.pop("keep", None)
        rows.append(row)
    if args.cuda_graph:  # after every implementation's checks: no graph's memory in another's peak
        capture_safe_masks()
        for row in rows:
            if row["status"] == "ok":
                time_graph(model, row, ids, mask, args)
    if args.interleave:
        ok = [row for row in rows if row["status"] == "ok"]
        try:
            times = interleaved_ms({row["impl"]: _switcher(model, row["impl"], ids, mask) for row in ok},
                                   args.interleave, args.round_steps, args.warmup_ms)
        except Exception as e:  # e.g. out of memory: report it in every timed row
            times = None
            for row in ok:
                row["status"], row["note"] = "error", H._short(e)
        for row in ok if times else []:
            row["ms"], row["p20"], row["p80"] = times[row["impl"]]
            row["tok_s"] = ids.numel() / (row["ms"] * 1e-3)
    for row in rows:
        shown = (f"{row['ms']:.1f} ms, {row['tok_s']:.0f} tok/s, peak {row['peak_gib']:.2f} GiB, loss "
                 f"{row['loss']:.4f}, finite {row['finite']}" if row["status"] == "ok"
                 else f"{row['status']}: {row['note']}")
        print(f"{row['impl']}: {shown}", flush=True)
    text = markdown(rows, meta, args, n_params)
    print("\n" + text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(f"\nwrote {out}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
