"""The one benchmark harness of safeops: each op's file declares shapes, implementations and a metric.

A benchmark is a :class:`Benchmark`: a list of :class:`Case` (direction, dtype, shape), a function that
makes one set of inputs for a case, a float32 reference of the result, a loose correctness check, and a
:class:`Metric` (for memory-bound ops: bytes moved per call, reported in GB/s). Implementations are
:class:`Impl`: ours, our variants, and every peer; each builds a zero-argument callable for a case, or says
why it cannot run (unavailable for every case, or :class:`Refused` for one shape).

For every case the harness checks each implementation's output once against the reference, then times it
with CUDA events through ``triton.testing.do_bench`` (median of many runs; warm-up and repetitions are in
milliseconds; do_bench also flushes the L2 before each run). When one input set fits in the L2 cache, it
rotates through several input sets so that repeated runs do not read from the cache. A device-to-device copy
measured in the same process gives the bandwidth ceiling every figure is compared with.

Outputs: a printed table per (direction, dtype), a CSV of every measurement, a PNG plot and a Markdown
snippet for ``bench/RESULTS.md`` whose header line names the date, GPU, torch, triton and CUDA versions.
"""

from __future__ import annotations

import csv
import datetime
import gc
import itertools
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}
DEFAULT_L2_BYTES = 60 * 2**20  # H200; read from the device when torch reports it


class Refused(Exception):
    """The implementation declines this case (e.g. a row longer than it supports)."""


class Unavailable(Exception):
    """The implementation cannot run at all here (e.g. its package is not installed)."""


def require_cuda(script: str) -> None:
    if not torch.cuda.is_available():
        sys.exit(f"{script}: needs a CUDA GPU (torch.cuda.is_available() is False on this machine); "
                 "run it on the GPU machine, e.g. through bench/gpu_run.sh")


def parse_sizes(text: str) -> list[int]:
    """'256,1K,4M' -> [256, 1024, 4194304]."""
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        if not part:
            continue
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(part[-1], 1)
        out.append(int(part[:-1] if mult > 1 else part) * mult)
    return out


def size_label(n: int) -> str:
    for suffix, unit in (("M", 2**20), ("K", 2**10)):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


# --------------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------------


def config_set(name: str, value):
    """``safeops._config.<name> = value`` for the block (fp_fusion, ...)."""
    from safeops import _config

    return mock.patch.object(_config, name, value)


@dataclass(frozen=True)
class Case:
    direction: str  # "fwd" or "bwd"
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def n(self) -> int:
        return self.shape[-1]

    @property
    def m(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        return f"{self.direction} {DTYPE_NAMES.get(self.dtype, self.dtype)} {'x'.join(map(str, self.shape))}"


@dataclass(frozen=True)
class Metric:
    name: str  # e.g. "GB/s"
    amount: Callable[[Case], float]  # units of work per call (bytes for GB/s)
    scale: float = 1e-9  # amount per second -> reported unit


@dataclass
class Impl:
    name: str
    build: Callable[[Case, dict], Callable[[], object]]  # inputs -> the zero-argument call that is timed
    role: str = "peer"  # "ours" | "variant" (of ours, not a peer) | "peer"
    tag: str = ""  # one letter naming the best peer in the Markdown table
    unavailable: str | None = None  # why it cannot run at all, if so
    directions: tuple[str, ...] = ("fwd", "bwd")


@dataclass
class Benchmark:
    name: str
    metric: Metric
    cases: list[Case]
    make_inputs: Callable[[Case], dict]
    reference: Callable[[Case, dict], torch.Tensor]
    check: Callable[[Case, torch.Tensor, torch.Tensor], str | None]  # None when close enough
    impls: list[Impl] = field(default_factory=list)

    def add(self, name: str, build=None, **kwargs):
        """Register an implementation; usable as ``bench.add(name, build)`` or as a decorator."""
        if build is not None:
            self.impls.append(Impl(name=name, build=build, **kwargs))
            return build

        def decorate(fn):
            self.impls.append(Impl(name=name, build=fn, **kwargs))
            return fn

        return decorate


@dataclass
class Result:
    bench: str
    case: Case
    impl: str
    role: str
    tag: str
    status: str  # ok | wrong | refused | error | unavailable | skipped
    ms: float = math.nan
    ms_p20: float = math.nan
    ms_p80: float = math.nan
    value: float = math.nan
    unit: str = ""
    note: str = ""


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def bench_ms(fn: Callable[[], object], warmup_ms: float = 25,
             rep_ms: float = 100) -> tuple[float, float, float]:
    """(median, 20th, 80th percentile) of fn's CUDA-event time in ms."""
    from triton.testing import do_bench

    q = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    if isinstance(q, (int, float)):
        return float(q), float(q), float(q)
    return float(q[0]), float(q[1]), float(q[2])


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def rotation_count(bytes_per_call: float) -> int:
    """Input sets to rotate through so the timed data is at least 4x the L2 (1 when it already is)."""
    need = 4 * l2_bytes()
    return 1 if bytes_per_call >= need else min(16, math.ceil(need / max(bytes_per_call, 1)))


def copy_bandwidth_gbps(nbytes: int = 2**31, warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Device-to-device copy through torch: bytes read + bytes written per second, in GB/s."""
    def measure() -> float:
        src = torch.empty(nbytes // 2, dtype=torch.int16, device="cuda").random_()
        dst = torch.empty_like(src)
        return bench_ms(lambda: dst.copy_(src), warmup_ms, rep_ms)[0]

    ms = measure()
    torch.cuda.empty_cache()
    return 2 * nbytes / ms / 1e6


def device_meta() -> dict:
    import triton

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "sms": props.multi_processor_count,
        "l2_mb": round(l2_bytes() / 2**20),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }


class _Stop(Exception):
    pass


def _on_term(signum, frame):  # `timeout` sends SIGTERM: stop timing, still write what was measured
    raise _Stop()


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text[:240]


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def run(bench: Benchmark, *, warmup_ms: float = 25, rep_ms: float = 100, deadline: float | None = None,
        log: Callable[[str], None] = print) -> list[Result]:
    """Check, then time, every implementation on every case; never raises for one implementation."""
    results: list[Result] = []
    unit = bench.metric.name
    old_handler = signal.signal(signal.SIGTERM, _on_term)
    stopped = ""
    try:
        for case in bench.cases:
            impls = [i for i in bench.impls if case.direction in i.directions]
            if stopped or (deadline is not None and time.time() > deadline):
                stopped = stopped or "time budget used up"
                results += [Result(bench.name, case, i.name, i.role, i.tag, "skipped", note=stopped)
                            for i in impls]
                continue
            t_case = time.time()
            amount = bench.metric.amount(case)
            try:
                sets = [bench.make_inputs(case)]
                sets += [bench.make_inputs(case) for _ in range(rotation_count(amount) - 1)]
                ref = bench.reference(case, sets[0])
                torch.cuda.synchronize()
            except Exception as e:  # out of memory, say: every implementation is skipped for this case
                note = _short(e)
                log(f"[{bench.name}] {case}: inputs failed: {note}")
                results += [Result(bench.name, case, i.name, i.role, i.tag, "error", note=note)
                            for i in impls]
                sets, ref = [], None
                _free()
                continue
            for impl in impls:
                res = Result(bench.name, case, impl.name, impl.role, impl.tag, "ok", unit=unit)
                if impl.unavailable:
                    res.status, res.note = "unavailable", impl.unavailable
                    results.append(res)
                    continue
                fns = out = None
                try:
                    fns = [impl.build(case, s) for s in sets]
                    out = fns[0]()
                    torch.cuda.synchronize()
                    problem = bench.check(case, out, ref)
                    if problem:
                        res.status, res.note = "wrong", problem
                    del out
                    out = None
                    if len(fns) == 1:
                        timed = fns[0]
                    else:
                        cycle = itertools.cycle(fns)

                        def timed(cycle=cycle):
                            return next(cycle)()

                    res.ms, res.ms_p20, res.ms_p80 = bench_ms(timed, warmup_ms, rep_ms)
                    res.value = amount / (res.ms * 1e-3) * bench.metric.scale
                except Refused as e:
                    res.status, res.note = "refused", _short(e)
                except Unavailable as e:
                    res.status, res.note = "unavailable", _short(e)
                except _Stop:
                    stopped = "stopped by SIGTERM"
                    res.status, res.note = "skipped", stopped
                    results.append(res)
                    raise
                except Exception as e:
                    res.status, res.note = "error", _short(e)
                    try:
                        torch.cuda.synchronize()
                    except Exception as e2:
                        res.note += f" (then: {_short(e2)})"
                finally:
                    del fns, out
                    _free()
                if res.status != "skipped":
                    results.append(res)
                shown = f"{res.value:8.1f} {unit}  {res.ms:.4f} ms" if not math.isnan(res.value) else ""
                log(f"[{bench.name}] {case}: {impl.name:<28} {res.status:<8} {shown}"
                    + (f"  ({res.note})" if res.note else ""))
            del sets, ref
            _free()
            log(f"[{bench.name}] {case}: {time.time() - t_case:.1f} s")
    except _Stop:
        log(f"[{bench.name}] SIGTERM: stopping, writing what was measured")
        done = {(r.case, r.impl) for r in results}
        for case in bench.cases:
            for impl in bench.impls:
                if case.direction in impl.directions and (case, impl.name) not in done:
                    results.append(Result(bench.name, case, impl.name, impl.role, impl.tag, "skipped",
                                          note="stopped by SIGTERM"))
    finally:
        signal.signal(signal.SIGTERM, old_handler)
    return results


# --------------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------------


def _groups(results: list[Result]) -> dict[tuple[str, str], list[Result]]:
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.case.direction, DTYPE_NAMES.get(r.case.dtype, str(r.case.dtype))), []).append(r)
    return groups


def _ordered(values):
    return list(dict.fromkeys(values))


def best_peer(rs: list[Result]) -> Result | None:
    ok = [r for r in rs if r.role == "peer" and r.status == "ok" and not math.isnan(r.value)]
    return max(ok, key=lambda r: r.value) if ok else None


def ours(rs: list[Result]) -> Result | None:
    for r in rs:
        if r.role == "ours":
            return r
    return None


def _cell(r: Result | None, fmt="{:.0f}") -> str:
    if r is None:
        return "-"
    if r.status in ("ok",):
        return fmt.format(r.value)
    if r.status == "wrong":
        return (fmt.format(r.value) + "!") if not math.isnan(r.value) else "WRONG"
    return r.status


def print_tables(results: list[Result], copy_gbps: float, log=print) -> None:
    for (direction, dtype), rs in _groups(results).items():
        impls = _ordered(r.impl for r in rs)
        cases = _ordered(r.case for r in rs)
        unit = next((r.unit for r in rs if r.unit), "")
        log(f"\n{rs[0].bench} {direction} {dtype} ({unit}; copy {copy_gbps:.0f} GB/s; "
            "'!' = failed the check)")
        head = f"{'N':>6} {'M':>7} " + " ".join(f"{i[:14]:>14}" for i in impls) + \
            f" {'ours %copy':>10} {'best peer':>14} {'speedup':>8}"
        log(head)
        for case in cases:
            row = {r.impl: r for r in rs if r.case == case}
            mine, peer = ours(list(row.values())), best_peer(list(row.values()))
            pct = f"{100 * mine.value / copy_gbps:.0f}%" if mine and mine.status == "ok" else "-"
            speed = f"{mine.value / peer.value:.2f}x" if mine and peer and mine.status == "ok" else "-"
            log(f"{size_label(case.n):>6} {case.m:>7} " + " ".join(f"{_cell(row.get(i)):>14}" for i in impls)
                + f" {pct:>10} {peer.impl[:14] if peer else '-':>14} {speed:>8}")
    notes = {(r.impl, r.status, r.note) for r in results if r.note and r.status != "ok"}
    if notes:
        log("\nnotes:")
        for impl, status, note in sorted(notes):
            log(f"  {impl} [{status}]: {note}")


def write_csv(path: Path, results: list[Result], meta: dict, copy_gbps: float) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["bench", "direction", "dtype", "shape", "m", "n", "impl", "role", "status", "ms_median",
                    "ms_p20", "ms_p80", "value", "unit", "pct_of_copy", "copy_gbps", "note", "gpu", "torch",
                    "triton", "cuda", "date"])
        for r in results:
            pct = 100 * r.value / copy_gbps if not math.isnan(r.value) else math.nan
            w.writerow([r.bench, r.case.direction, DTYPE_NAMES.get(r.case.dtype, str(r.case.dtype)),
                        "x".join(map(str, r.case.shape)), r.case.m, r.case.n, r.impl, r.role, r.status,
                        f"{r.ms:.6f}", f"{r.ms_p20:.6f}", f"{r.ms_p80:.6f}", f"{r.value:.2f}", r.unit,
                        f"{pct:.1f}", f"{copy_gbps:.1f}", r.note, meta.get("gpu"), meta.get("torch"),
                        meta.get("triton"), meta.get("cuda"), meta.get("date")])


def write_png(path: Path, results: list[Result], meta: dict, copy_gbps: float, log=print) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        log(f"no plot: matplotlib is not importable ({_short(e)})")
        return
    groups = _groups(results)
    directions = _ordered(d for d, _ in groups)
    dtypes = _ordered(t for _, t in groups)
    fig, axes = plt.subplots(len(directions), len(dtypes), figsize=(6.5 * len(dtypes), 4.2 * len(directions)),
                             squeeze=False)
    for (direction, dtype), rs in groups.items():
        ax = axes[directions.index(direction)][dtypes.index(dtype)]
        for impl in _ordered(r.impl for r in rs):
            pts = sorted((r.case.n, r.value) for r in rs if r.impl == impl and r.status == "ok"
                         and not math.isnan(r.value))
            if pts:
                style = "-o" if any(r.role == "ours" for r in rs if r.impl == impl) else "--."
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=impl)
        ax.axhline(copy_gbps, color="gray", linestyle=":", label=f"copy {copy_gbps:.0f}")
        ax.set_xscale("log", base=2)
        ns = sorted({r.case.n for r in rs})
        ax.set_xticks(ns, [size_label(n) for n in ns])
        ax.set_title(f"{rs[0].bench} {direction} {dtype}")
        ax.set_xlabel("N (columns)")
        ax.set_ylabel(rs[0].unit or "value")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{meta.get('gpu')}  torch {meta.get('torch')}  triton {meta.get('triton')}  "
                 f"{meta.get('date')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(results: list[Result], meta: dict, copy_gbps: float, title: str = "") -> str:
    """Tables in TB/s (GB/s / 1000) per (direction, dtype), ready for bench/RESULTS.md."""
    lines = [f"### {title or results[0].bench}: measured {meta.get('date')} on {meta.get('gpu')} "
             f"(torch {meta.get('torch')}, triton {meta.get('triton')}, CUDA {meta.get('cuda')}); "
             f"device-to-device copy {copy_gbps / 1000:.2f} TB/s", ""]
    tags = {r.tag: r.impl for r in results if r.tag}
    if tags:
        lines += ["Best peer named after its figure: " + ", ".join(f"{t} = {i}" for t, i in tags.items())
                  + ". '!' marks a figure whose output failed the correctness check.", ""]
    for (direction, dtype), rs in _groups(results).items():
        cases = _ordered(r.case for r in rs)
        impls = _ordered(r.impl for r in rs)
        m_note = ", ".join(f"{size_label(c.n)}: M={c.m}" for c in cases)
        lines.append(f"**{direction} {dtype}**, TB/s ({m_note})")
        lines.append("")
        lines.append("| | " + " | ".join(size_label(c.n) for c in cases) + " |")
        lines.append("|---|" + "---|" * len(cases))

        def row(label, cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")

        by = {(r.case, r.impl): r for r in rs}
        for impl in impls:
            row(impl, [_fmt_tb(by.get((c, impl))) for c in cases])
        peers = [best_peer([r for r in rs if r.case == c]) for c in cases]
        mine = [ours([r for r in rs if r.case == c]) for c in cases]
        row("best peer", [f"{p.value / 1000:.2f} {p.tag or p.impl}" if p else "-" for p in peers])
        row("ours, % of copy", [f"{100 * m.value / copy_gbps:.0f}%" if m and m.status == "ok" else "-"
                                for m in mine])
        row("ours / best peer", [f"{m.value / p.value:.2f}x" if m and p and m.status == "ok" else "-"
                                 for m, p in zip(mine, peers, strict=True)])
        lines.append("")
    return "\n".join(lines)


def _fmt_tb(r: Result | None) -> str:
    if r is None:
        return "-"
    if r.status == "ok":
        return f"{r.value / 1000:.2f}"
    if r.status == "wrong" and not math.isnan(r.value):
        return f"{r.value / 1000:.2f}!"
    return r.status


def report(results: list[Result], meta: dict, copy_gbps: float, out_dir: Path, stem: str, *,
           plot: bool = True, log=print) -> list[Path]:
    """Print the tables and write <stem>.csv, <stem>.png and <stem>.md under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if not results:
        log("no results to report")
        return []
    print_tables(results, copy_gbps, log)
    paths = [out_dir / f"{stem}.csv", out_dir / f"{stem}.md"]
    write_csv(paths[0], results, meta, copy_gbps)
    paths[1].write_text(markdown(results, meta, copy_gbps) + "\n")
    if plot:
        png = out_dir / f"{stem}.png"
        write_png(png, results, meta, copy_gbps, log)
        if png.exists():
            paths.append(png)
    log("\nwrote " + ", ".join(str(p) for p in paths))
    return paths
