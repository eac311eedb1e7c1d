"""The Gluon attention forward for Hopper (``safeops.kernels.attention_gluon``): what it takes, and its
launcher.

:func:`reason` is ``""`` when the Gluon kernel computes a forward, else why not, in words.
``safeops.ops.attention_launch.gluon_reason`` (the path choice: this, after the launcher's own settings)
decides for every CUDA forward, once per plan, and ``safeops.ops.attention.path`` (behind
``safeops.attention_backend``) reports it after the reference choice. The check reads the dtype, the head
dims, the device, the options and the settings only: never the batch, the number of sequences, their
lengths or the memory layout, so a row's kernel, and with it its bits, does not depend on what else is in
the batch or where the tensor lies in memory (contract section 6). A layout TMA cannot read (an unaligned
base or stride, a stride of 0, a head dim that is not innermost) is copied first.

:class:`Plan` is one problem signature's launch: configuration, grid, scalars, descriptor layouts and the
compiled kernel, kept by ``attention_launch.forward``'s plan cache like the Triton path's plans; a call
allocates o, m, l, builds the four TMA descriptors (host-side, so a CUDA-graph capture records them by
value) and launches. It returns ``(o, m, l)`` with the Triton forward's meaning: o in q's dtype and layout,
per query row the base-2 row max ``m`` and row sum ``l`` in fp32, kept apart (contract section 3), so the
Triton backward consumes them unchanged.

Layouts: dense q ``(B, Hq, Sq, D)``, k / v ``(B, Hkv, Sk, D)``, stats ``(B, Hq, Sq)``; packed (varlen) q
``(Tq, Hq, D)``, k / v ``(Tk, Hkv, D)``, stats ``(Hq, Tq)``. GQA / MQA: kv head = q head // (Hq / Hkv).
The configuration depends on the head dim only (``FWD_CONFIGS``).
"""

from __future__ import annotations

import functools

import torch
import triton

from .. import _config, reference

_kernels = None

# Gluon's API changes between Triton releases; the kernel is written against this one.
TRITON_VERSION = (3, 6)
# Persistent grid (one program per SM walking the tiles) or one program per tile. Same bits either way.
# PERSISTENT: every forward; PERSISTENT_NONCAUSAL: the non-causal forwards of these head dims (D=128:
# +1.8-3.4% on an H100 with late_pv_wait, 2026-12-06; causal rows lose 2-7% with it, bench/RESULTS.md).
PERSISTENT = False
PERSISTENT_NONCAUSAL: tuple[int, ...] = (128,)
# Causal tiles run in chunks of heads whose K and V take about this many bytes (the H100 / H200 L2 is 50 MB),
# so the programs running at once share K/V blocks in L2. Scheduling only: the bits do not depend on it.
L2_CHUNK_BYTES = 32 << 20
# Attention sinks in the Gluon forward (the runtime flag has_sinks: each row's first score). Switched off, a
# call with sinks runs the Triton forward, and attention_backend says so.
GLUON_SINKS = True
# Softcapped scores in the Gluon forward (a SOFTCAP build of the kernel, the Triton kernels' formula), at the
# (head dim, causal) pairs of SOFTCAP_CASES, where it measured faster than the Triton forward: D=128 causal
# 1.10x, D=256 1.26-1.30x; D=128 without causal 0.81x (its step spills), D=64 not measured (bench/RESULTS.md).
# The backward of a softcapped forward stays on Triton.
GLUON_SOFTCAP = True
SOFTCAP_CASES = ((128, True), (256, False), (256, True))
# A left sliding-window bound in the Gluon forward (HAS_WL; causal or not, no right bound). Switched off, a
# window runs the Triton forward.
GLUON_WINDOW = True


def kernels():
    """The Gluon kernel module, imported on first use (importing safeops must not compile anything)."""
    global _kernels
    if _kernels is None:
        from ..kernels import attention_gluon as module

        _kernels = module
    return _kernels


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


# ------------------------------------------------------------------------------------------------------
# The path choice.
# ------------------------------------------------------------------------------------------------------

@functools.cache
def _arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def device_reason(device: torch.device) -> str:
    """'' if the Gluon kernel runs on ``device``, else why not."""
    if device.type != "cuda":
        return f"the Gluon kernel needs a CUDA device; q is on {device.type}"
    arch = _arch(device.index)
    if arch != "sm_90":
        return f"the Gluon kernel needs a Hopper GPU (sm_90); {device} is {arch}"
    if _triton_version() != TRITON_VERSION:
        wanted = ".".join(map(str, TRITON_VERSION))
        return f"the Gluon kernel is written for Triton {wanted}; this is Triton {triton.__version__}"
    return ""


def reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, cu_q, is_causal: bool, softcap,
           wl: int, wr: int, out_dtype: torch.dtype | None = None, sinks=None) -> str:
    """``""`` if the Gluon forward computes this attention, else why not, in words. The arguments are the
    attention op's (``wl`` / ``wr``: window sides, < 0 unbounded; ``wr`` is 0 with ``is_causal``); what
    they are read for: q's dtype, q's and v's head dims, q's device, whether a mask / softcap / window
    is given, and ``SAFEOPS_GLUON``. Packed sequences (``cu_q`` given) are taken like dense ones."""
    if not _config.gluon_enabled():
        return "SAFEOPS_GLUON=0 turns the Gluon forward off"
    if out_dtype is not None and out_dtype != q.dtype:
        return f"the Gluon kernel writes the output in q's dtype, not {out_dtype} (fp32 partials)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the Gluon kernel takes bf16 or fp16, not {str(q.dtype).removeprefix('torch.')}"
    if mask is not None:
        return "the Gluon kernel does not take an attention mask"
    if softcap is not None and not GLUON_SOFTCAP:
        return "the Gluon kernel does not take softcap"
    if sinks is not None and not GLUON_SINKS:
        return "the Gluon kernel does not take attention sinks"
    if wr >= 0 and not is_causal:
        bound = " with a right bound" if GLUON_WINDOW else ""
        return f"the Gluon kernel does not take a sliding window{bound}"
    if wl >= 0 and not GLUON_WINDOW:
        return "the Gluon kernel does not take a sliding window"
    d, dv = q.shape[-1], v.shape[-1]
    configs = kernels().FWD_CONFIGS
    if d not in configs:
        return f"head dim {d}: the Gluon kernel has head dims {', '.join(map(str, sorted(configs)))}"
    if dv != d:
        return f"v's head dim {dv} is not q's {d}: the Gluon kernel needs them equal"
    if wl >= 0 and d not in kernels().WINDOW_HEAD_DIMS:
        return f"head dim {d}: the Gluon kernel takes a sliding window at head dims 64 and 128"
    if softcap is not None and (d, is_causal) not in SOFTCAP_CASES:
        return (f"head dim {d}{' causal' if is_causal else ''} with softcap: the Triton forward (the Gluon "
                f"kernel takes softcap where it measured faster; bench/RESULTS.md)")
    return device_reason(q.device)


def describe(q: torch.Tensor, is_causal: bool, varlen: bool) -> str:
    """What the Gluon kernel runs, in words (for a problem :func:`reason` accepts)."""
    dtype = "bf16" if q.dtype == torch.bfloat16 else "fp16"
    what = f"{dtype} {'causal' if is_causal else 'non-causal'} D={q.shape[-1]}"
    return f"{what}{' packed (varlen)' if varlen else ''} on {_arch(q.device.index)}"


def settings() -> tuple:
    """What the path choice and the Gluon plans depend on beyond ``attention_launch.forward``'s plan keys
    (its plans are dropped when any of it changes)."""
    return (_config.gluon_enabled(), _config.gluon_bwd_setting(), PERSISTENT, PERSISTENT_NONCAUSAL,
            L2_CHUNK_BYTES, reason, Plan, device_reason, bwd_reason, GLUON_DQ, DQ_HEAD_DIMS, dq_reason,
            GLUON_SINKS, GLUON_WINDOW, GLUON_FUSED, FUSED_NONCAUSAL, FUSED_PLAIN_NONCAUSAL, FUSED_MAX_GROUP,
            fused_reason, GLUON_BWD_SEQ, SEQ_HEAD_DIMS, GLUON_SOFTCAP, SPLIT_HEAD_DIMS,
            tuple(sorted(SPLIT_MIN_GROUP.items())), _bwd_tables())


def _bwd_tables() -> tuple:
    """The Gluon backward module's configuration tables (by identity) and head-dim switches: replacing one
    drops the kept plans, as for this module's switches (editing a table in place is not seen, as for the
    Triton tables). Empty until the module is loaded (the first time a backward asks for the Gluon path)."""
    K = _bwd_kernels
    if K is None:
        return ()
    return (id(K.BWD_CONFIGS), id(K.DQ_CONFIGS), id(K.FUSED_CONFIGS), K.AUTO_HEAD_DIMS,
            K.AUTO_HEAD_DIMS_NONCAUSAL)


# ------------------------------------------------------------------------------------------------------
# The launch.
# ------------------------------------------------------------------------------------------------------

@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _view4(t: torch.Tensor, varlen: bool) -> tuple[list[int], list[int]]:
    """Shape and strides of the (B, H, S, D) view the descriptors address: the tensor's own (dense), or
    (1, H, T, D) over a packed (T, H, D) tensor. A dimension of size 1 is never stepped along, so its
    stride (which torch leaves arbitrary) is replaced by a valid one (16 bytes)."""
    if varlen:
        shape = [1, t.shape[1], t.shape[0], t.shape[2]]
        strides = [0, t.stride(1), t.stride(0), t.stride(2)]
    else:
        shape, strides = list(t.shape), list(t.stride())
    return shape, [s if n > 1 else 16 // t.element_size() for n, s in zip(shape, strides, strict=True)]


def _tma_ok(t: torch.Tensor, varlen: bool) -> bool:
    """TMA can read ``t`` in place: 16-byte aligned base, unit head-dim stride, the other strides positive
    multiples of 16 bytes."""
    per16 = 16 // t.element_size()
    strides = _view4(t, varlen)[1]
    return t.data_ptr() % 16 == 0 and strides[-1] == 1 and all(s > 0 and s % per16 == 0 for s in strides[:-1])


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous, freshly allocated (so aligned) copy: what TMA reads when it cannot read ``t``."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


class Plan:
    """One forward's launch for every call with the shapes, strides, dtypes, 16-byte alignment, options and
    settings of the call it was made for (``attention_launch.forward``'s plan key): what that call decided
    once (copies, configuration, grid, scalars, kernel handle), so a repeated call only allocates o, m, l,
    builds the descriptors and launches."""

    __slots__ = ("varlen", "copy", "o_scratch", "stat_shape", "empty", "block_shapes", "layouts", "args",
                 "launch", "descs", "window", "has_sinks", "c2")

    def __init__(self, q, k, v, cu_q, max_q: int, max_k: int, causal: bool, c1: float, *,
                 persistent: bool | None = None, config=None, sinks: bool = False, window_left: int = -1,
                 softcap_c2: float | None = None):
        """``c1``: fp32(scale * log2(e)), the Triton path's constant (``attention_launch.constants``), so
        both paths multiply the scores by the same bits; with softcap (``softcap_c2`` its C2) the two
        softcap constants of ``constants(scale, softcap)``."""
        from ._launch import KernelLaunch

        K = kernels()
        varlen = self.varlen = cu_q is not None
        d = q.shape[-1]
        if varlen:
            batch, hq, hkv = cu_q.numel() - 1, q.shape[1], k.shape[1]
            self.stat_shape = (hq, q.shape[0])
            rows_q, rows_k = q.shape[0], max_k  # seqlen_q: the stats' head stride (Tq); seqlen_k: unused
        else:
            batch, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
            self.stat_shape = tuple(q.shape[:3])
            rows_q, rows_k = q.shape[2], k.shape[2]
            max_q, max_k = rows_q, rows_k
        # No rows: nothing to compute. No keys: every row is empty (contract section 4).
        self.empty = "rows" if q.numel() == 0 else "keys" if k.numel() == 0 or max_k == 0 else None
        self.copy = tuple(not _tma_ok(t, varlen) for t in (q, k, v))
        o_like = torch.empty_like(q, device="meta")  # the output's layout (q's, as the op's fake gives it)
        self.o_scratch = not (o_like.stride(-1) == 1 and all(
            s > 0 and s % (16 // q.element_size()) == 0 for s in _view4(o_like, varlen)[1][:-1]))
        self.launch = None
        self.descs: dict = {}  # kept TMA descriptors (_desc)
        if self.empty:
            return
        cfg = config or K.FWD_CONFIGS[d]
        dtype = "bfloat16" if q.dtype == torch.bfloat16 else "float16"
        shapes = K.block_shapes(cfg, d)
        self.block_shapes = [shapes[n] for n in ("q", "k", "v", "o")]
        self.layouts = [K.shared_layout(s[2], d, dtype) for s in self.block_shapes]
        n_m_blocks = triton.cdiv(max_q, cfg.block_m)
        n_tiles = n_m_blocks * batch * hq
        if n_tiles >= 2**31:
            raise ValueError(f"q: {n_tiles} query tiles of {cfg.block_m} rows, more than the 2**31 - 1 the "
                             "launch grid allows")
        if persistent is None:
            persistent = PERSISTENT or (not causal and d in PERSISTENT_NONCAUSAL)
        grid = (min(n_tiles, _num_sms(q.device.index)) if persistent else n_tiles,)
        kv_bytes = 2 * max(max_k, 1) * d * k.element_size()  # one kv head's K and V, shared by a query group
        head_group = max(1, min(batch * hq, L2_CHUNK_BYTES * (hq // hkv) // kv_bytes))
        self.args = (c1, hq, hq // hkv, head_group, rows_q, rows_k, n_m_blocks, n_tiles)
        self.window = max(window_left, 0)  # not read without HAS_WL
        self.has_sinks = int(sinks)
        self.c2 = 1.0 if softcap_c2 is None else softcap_c2  # (not read without softcap)
        kwargs = dict(K.constexprs(cfg, causal, varlen, window_left >= 0, softcap_c2 is not None),
                      **K.LAUNCH_OPTIONS, enable_fp_fusion=_config.fp_fusion)
        self.launch = KernelLaunch(K.attn_fwd_gluon_kernel, grid, kwargs)

    def _descriptors(self, tensors) -> list:
        """The four TMA descriptors over ``tensors`` (q, k, v, o as launched), through :func:`_desc`."""
        return [_desc(self.descs, i, t, block, layout, self.varlen) for i, (t, block, layout)
                in enumerate(zip(tensors, self.block_shapes, self.layouts, strict=True))]

    def __call__(self, q, k, v, cu_q=None, cu_k=None, sinks=None):
        """``sinks``: the (Hq,) fp32 sink logits of a plan made with ``sinks=True``, else None."""
        o = torch.empty_like(q)
        m = torch.empty(self.stat_shape, dtype=torch.float32, device=q.device)
        l = torch.empty(self.stat_shape, dtype=torch.float32, device=q.device)
        if self.empty == "rows":
            return o, m, l
        if self.empty == "keys":  # every row sees only the sink, if any (contract sections 4 and 9)
            if sinks is None:
                return o.zero_(), m.fill_(float("-inf")), l.zero_()
            zs = reference.sink_scores(sinks, torch.float32)
            zs = zs.view(-1, 1) if self.varlen else zs.view(1, -1, 1)
            m.copy_(zs.expand(m.shape))
            l.copy_(torch.exp2(zs - torch.where(zs == float("-inf"), 0.0, zs)).expand(l.shape))
            return o.zero_(), m, l
        cq, ck, cv = self.copy
        q_ = _copy(q) if cq else q
        k_ = _copy(k) if ck else k
        v_ = _copy(v) if cv else v
        o_ = torch.empty(q.shape, dtype=q.dtype, device=q.device) if self.o_scratch else o
        q_desc, k_desc, v_desc, o_desc = self._descriptors((q_, k_, v_, o_))
        sinks_arg = m if sinks is None else sinks
        if self.varlen:
            self.launch(q_desc, k_desc, v_desc, o_desc, m, l, o_, cu_q, cu_k, sinks_arg, *self.args,
                        o_.stride(0), o_.stride(1), self.window, self.has_sinks, self.c2)
        else:
            self.launch(q_desc, k_desc, v_desc, o_desc, m, l, o_, m, m, sinks_arg, *self.args, 0, 0,
                        self.window, self.has_sinks, self.c2)
        if o_ is not o:
            o.copy_(o_)
        return o, m, l


# ------------------------------------------------------------------------------------------------------
# Compiling ahead, in parallel (GPU tests, benchmarks): first launches then load from Triton's cache.
# ------------------------------------------------------------------------------------------------------

def configurations() -> list[tuple[str, int, bool, bool, dict, bool, bool]]:
    """Every (dtype name, head dim, causal, varlen, config changes, left window, softcap) the path choice can
    launch (one compiled kernel each; sinks and the softcap value are runtime arguments)."""
    K = kernels()
    windows = (False, True) if GLUON_WINDOW else (False,)
    softcaps = (False, True) if GLUON_SOFTCAP else (False,)
    return [(dtype, d, causal, varlen, {}, window, softcap) for dtype in K.DTYPES for d in K.HEAD_DIMS
            for causal in (False, True) for varlen in (False, True) for window in windows
            for softcap in softcaps
            if (not window or d in K.WINDOW_HEAD_DIMS) and (not softcap or (d, causal) in SOFTCAP_CASES)]


def _warm(job) -> tuple:
    """(In a spawned worker.) Compile one configuration through the JIT's own warmup, so it lands in Triton's
    on-disk cache under the key the launch computes: CPU tensors stand in for the CUDA ones (the key reads
    dtypes, block shapes, layouts, alignment and the options, as :class:`Plan` passes them)."""
    import dataclasses

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dtype_name, d, causal, varlen, changes, window, softcap = job
    K = kernels()
    dtype = getattr(torch, dtype_name)
    cfg = dataclasses.replace(K.FWD_CONFIGS[d], **changes)
    t = torch.empty(1, 1, 256, d, dtype=dtype)
    descs = []
    for block in K.block_shapes(cfg, d).values():
        layout = K.shared_layout(block[2], d, dtype_name)
        descs.append(TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout))
    stat = torch.empty(1, 256)
    cu = torch.zeros(2, dtype=torch.int32) if varlen else stat
    sizes = (1, 1, 1, 256, 256, 2, 2, 0, 0, 0, 0, 0.5)  # n_heads .. window_left, has_sinks (not
    # specialized), C2 (a float: never specialized)
    K.attn_fwd_gluon_kernel.warmup(*descs, stat, stat, t, cu, cu, stat, 0.5, *sizes, grid=(1,),
                                   **K.constexprs(cfg, causal, varlen, window, softcap), **K.LAUNCH_OPTIONS,
                                   enable_fp_fusion=_config.fp_fusion)
    return job


def warm_cache(jobs: list[tuple] | None = None, workers: int = 8) -> list[str]:
    """Compiles Gluon configurations (default: :func:`configurations`; a job is (dtype name, head dim,
    causal, varlen), optionally followed by a dict of ``GluonFwdConfig`` changes, the left-window flag and
    the softcap flag) in ``workers`` spawned processes into Triton's on-disk cache. Returns the failures, in
    words (those compile again on first launch)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(*j, *({}, False, False)[len(j) - 4:]) for j in (configurations() if jobs is None else jobs)]
    failed = []
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for job, future in [(j, pool.submit(_warm, j)) for j in jobs]:
            try:
                future.result()
            except Exception as e:  # noqa: BLE001 - reported; the launch compiles it again
                failed.append(f"{job}: {type(e).__name__}: {str(e)[:300]}")
    return failed


# ------------------------------------------------------------------------------------------------------
# The backward's dK / dV and dQ (``safeops.kernels.attention_gluon_bwd``); delta (and dq with GLUON_DQ off)
# come from the Triton dq kernel, launched first by ``attention_launch``.
# ------------------------------------------------------------------------------------------------------

_bwd_kernels = None


def bwd_kernels():
    """The Gluon backward kernel module, imported on first use."""
    global _bwd_kernels
    if _bwd_kernels is None:
        from ..kernels import attention_gluon_bwd as module

        _bwd_kernels = module
    return _bwd_kernels


# The Gluon dQ kernel (``attn_bwd_dq_gluon_kernel``; delta then comes from a delta-only launch of the Triton
# dq kernel). On: the whole backward +8% at D=128, +4% causal, against the Triton dq kernel on the H200
# (bench/RESULTS.md, 2026-12-05); False puts dq back on the Triton kernel.
GLUON_DQ = True
# Head dims whose dq the Gluon dQ kernel computes (with GLUON_DQ on). At head dim 64 the Triton dq kernel
# (64-query programs, 64-key steps) measured as fast or up to 9% faster for the whole backward with the same
# bits (H100, 2026-12-07: B4 H16 S4K causal 1.143 -> 1.087 ms, TinyLlama's 32 / 4 heads causal 0.631 ->
# 0.577), so dq is computed there; at 128 it is 2.5-3% slower (causal).
DQ_HEAD_DIMS = (128,)


def bwd_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, cu_q, is_causal: bool, softcap,
               wl: int, wr: int, grad_dtype: torch.dtype | None = None) -> str:
    """``""`` if the Gluon dK / dV kernel computes this backward's dk and dv, else why not, in words. Like
    :func:`reason` it reads dtypes, head dims, the device, the options and the settings only. Sinks need
    nothing here (the saved statistics include them; the Triton dq kernel computes their gradient)."""
    mode = _config.gluon_bwd_mode()
    if mode == "off":
        off = "SAFEOPS_GLUON=0" if not _config.gluon_enabled() else "SAFEOPS_GLUON_BWD=0"
        return f"{off} keeps dk / dv on the Triton kernel"
    return _bwd_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, grad_dtype, mode, True,
                       bwd_kernels().BWD_CONFIGS)


def dq_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, cu_q, is_causal: bool, softcap,
              wl: int, wr: int, grad_dtype: torch.dtype | None = None) -> str:
    """``""`` if the Gluon dQ kernel computes this backward's dq (``GLUON_DQ`` on, and what
    :func:`bwd_reason` asks of the inputs, at the head dims of ``DQ_CONFIGS``), else why not."""
    mode = _config.gluon_bwd_mode()
    if not GLUON_DQ or mode == "off":
        return "the Gluon dq kernel is off (attention_gluon.GLUON_DQ)"
    why = _bwd_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, grad_dtype, mode, True,
                      bwd_kernels().DQ_CONFIGS)
    if not why and q.shape[-1] not in DQ_HEAD_DIMS:
        return (f"head dim {q.shape[-1]}: dq from the Triton dq kernel, faster there "
                f"(attention_gluon.DQ_HEAD_DIMS = {DQ_HEAD_DIMS})")
    return why


# Packed sequences (``attention_varlen``) and a left window (causal or not) on the Gluon dK / dV and dQ
# kernels: runtime arguments of the same kernels (one compile serves dense and packed calls, with and
# without a window), at the head dims of SEQ_HEAD_DIMS. D=128: 1.25-1.28x the Triton backward on packed
# documents and a 1K window, the same bits. D=64 measured 2-3% slower than the Triton kernels there, but a
# packed sequence must get the bits of the same sequence alone (contract section 6), which a dense D=64
# call computes on the Gluon kernels; with GQA the Triton kernels' split sums gave other last bits then
# (GPU test test_gqa_split_backward_bits), so packed and windowed D=64 calls take the Gluon kernels too
# (bench/RESULTS.md). Since the Gluon dK / dV kernel splits GQA groups as the Triton one does (D=64,
# SPLIT_HEAD_DIMS, 2026-12-07) that reason is gone; the choice stands until packed D=64 is measured again.
# Packed statistics are re-laid for TMA (_aligned_stats).
GLUON_BWD_SEQ = True
SEQ_HEAD_DIMS = (64, 128)


# The fused Gluon backward (``attn_bwd_fused_gluon_kernel``: dk, dv and dq in one kernel, dq added into an
# fp32 buffer in a fixed order of key blocks; delta from a delta-only launch of the Triton dq kernel).
# ``GLUON_FUSED`` makes it take every case it can (tests and benchmarks); by default it takes the non-causal
# backward at the head dims of ``FUSED_NONCAUSAL``: in the shifted order where it applies (a head's key
# blocks at most half the SMs: Sk <= 8448 on 132 SMs), 11-13% faster than the dK / dV + dQ pair on the H200
# (B4 H16 S4K, Llama-3-8B's 32 / 8 heads at S = 8K), and for longer keys at the head dims of
# ``FUSED_PLAIN_NONCAUSAL`` in the plain order (Llama-3-8B's heads at S = 16K: +10% on an H100;
# bench/RESULTS.md). D=64 (within +-3% of the pair on an H100 at S = 2K-8K) and causal (8-26% slower) keep
# the pair.
GLUON_FUSED = False
FUSED_NONCAUSAL = (128,)
# Head dims of FUSED_NONCAUSAL where the fused kernel also takes longer keys, in the plain order (a CTA waits
# only for CTAs numbered before it, which a GPU starts first: no head needs to fit on the GPU at once).
FUSED_PLAIN_NONCAUSAL = (128,)
# The largest query group the fused kernel takes by default: it walks a kv head's whole group in one CTA,
# so its grid is batch x kv heads x key blocks, and with few kv heads it leaves SMs idle (H100, MQA 32 / 1
# heads S=4K: 4.805 ms against 1.610 for the dK / dV + dQ pair with the group split). Larger groups take
# the pair. The rule reads the head counts only (batch invariance).
FUSED_MAX_GROUP = 8


def fused_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, cu_q, is_causal: bool, softcap,
                 wl: int, wr: int, grad_dtype: torch.dtype | None = None) -> str:
    """``""`` if the fused Gluon backward computes this backward's dq, dk and dv (``GLUON_FUSED`` on, or a
    non-causal problem at a head dim of ``FUSED_NONCAUSAL`` whose key blocks fit the shifted order, or at one
    of ``FUSED_PLAIN_NONCAUSAL``; and what :func:`bwd_reason` asks of the inputs, at the head dims of
    ``FUSED_CONFIGS``), else why not."""
    mode = _config.gluon_bwd_mode()
    if mode == "off":
        return "the Gluon backward is off (SAFEOPS_GLUON_BWD=0 or SAFEOPS_GLUON=0)"
    d = q.shape[-1]
    if not GLUON_FUSED and not _config.gluon_fused_enabled():
        return "SAFEOPS_GLUON_FUSED=0 keeps the backward off the fused Gluon kernel"
    if not GLUON_FUSED and (is_causal or d not in FUSED_NONCAUSAL):
        return (f"the fused Gluon backward is the default for non-causal head dims "
                f"{', '.join(map(str, FUSED_NONCAUSAL))} only (bench/RESULTS.md)")
    K = bwd_kernels()
    why = _bwd_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, grad_dtype, "on", False,
                      K.FUSED_CONFIGS)
    if why or GLUON_FUSED:
        return why
    group = q.shape[1] // k.shape[1]
    if group > FUSED_MAX_GROUP:
        return (f"a query group of {group} heads: the fused Gluon backward takes groups of at most "
                f"{FUSED_MAX_GROUP} (attention_gluon.FUSED_MAX_GROUP)")
    if d in FUSED_PLAIN_NONCAUSAL:
        return why
    cfg = K.FUSED_CONFIGS[d]
    n_n, sms = triton.cdiv(k.shape[2], cfg.block_n), _num_sms(q.device.index)
    if not K.fused_shift(cfg, False, n_n, sms):
        return (f"{n_n} key blocks of {cfg.block_n} are more than half the {sms} SMs: the fused Gluon "
                "backward's shifted order does not apply")
    return ""


def _bwd_reason(q, k, v, mask, cu_q, is_causal, softcap, wl, wr, grad_dtype, mode, seq: bool, configs) -> str:
    """``seq``: the kernels take packed sequences and a left window (the dK / dV and dQ kernels with
    ``GLUON_BWD_SEQ``; not the fused one)."""
    seq = seq and GLUON_BWD_SEQ
    if grad_dtype is not None and grad_dtype != q.dtype:
        return f"the Gluon backward writes dk / dv in the inputs' dtype, not {grad_dtype}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the Gluon backward takes bf16 or fp16, not {str(q.dtype).removeprefix('torch.')}"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "the Gluon backward needs q, k and v in one dtype"
    if cu_q is not None and not seq:
        return "the Gluon backward does not take packed (varlen) sequences"
    if mask is not None:
        return "the Gluon backward does not take an attention mask"
    if softcap is not None:
        return "the Gluon backward does not take softcap"
    if wr >= 0 and not is_causal:
        return "the Gluon backward does not take a sliding window with a right bound"
    if wl >= 0 and not seq:
        return "the Gluon backward does not take a sliding window"
    d, dv = q.shape[-1], v.shape[-1]
    if d not in configs:
        return f"head dim {d}: the Gluon backward has head dims {', '.join(map(str, sorted(configs)))}"
    if (cu_q is not None or wl >= 0) and d not in SEQ_HEAD_DIMS:
        what = "packed (varlen) sequences" if cu_q is not None else "a sliding window"
        return (f"head dim {d} with {what}: the Triton backward (the Gluon one at head dims "
                f"{', '.join(map(str, SEQ_HEAD_DIMS))}; bench/RESULTS.md)")
    if dv != d:
        return f"v's head dim {dv} is not q's {d}: the Gluon backward needs them equal"
    auto = bwd_kernels().AUTO_HEAD_DIMS if is_causal else bwd_kernels().AUTO_HEAD_DIMS_NONCAUSAL
    if mode == "auto" and d not in auto:
        return (f"head dim {d}{' causal' if is_causal else ''}: the Triton dk/dv kernel measured as fast "
                "(bench/RESULTS.md); SAFEOPS_GLUON_BWD=1 runs the Gluon one")
    return device_reason(q.device)


def describe_bwd(q: torch.Tensor, is_causal: bool, gluon_dq: bool = False, fused: bool = False) -> str:
    """What the Gluon backward runs, in words (for a problem :func:`bwd_reason` accepts)."""
    dtype = "bf16" if q.dtype == torch.bfloat16 else "fp16"
    causal = "causal" if is_causal else "non-causal"
    kernels = ("fused Gluon dq, dk / dv (dq added in a fixed order)" if fused
               else "Gluon dq, dk / dv" if gluon_dq else "Gluon dk / dv, Triton dq")
    return f"{dtype} {causal} D={q.shape[-1]} on {_arch(q.device.index)}: {kernels}"


def _desc(cache: dict, key, t: torch.Tensor, block: list[int], layout, varlen: bool, stat: bool = False):
    """The TMA descriptor of tensor ``t`` in a plan's launch: ``_view4``'s view (``stat``: a row statistic's,
    :func:`_stat_desc`). The first descriptor of each ``key`` is built with TensorDescriptor's checks and
    kept in ``cache`` without its tensor (a plan must not keep a call's tensors alive); later ones copy its
    fields with the new base (~1 us instead of several), if that base is 16-byte aligned (else
    TensorDescriptor's checks run and raise). ``key``: the argument's position where the plan's own key
    fixes the tensor's shape and strides; with the shape and strides too where it does not (packed
    statistics, re-laid to a length that depends on the sequences)."""
    kept = cache.get(key)
    if kept is None or t.data_ptr() % 16:
        if stat:
            desc = _stat_desc(t, block, layout, varlen)
        else:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

            desc = TensorDescriptor(t, *_view4(t, varlen), block, layout)
        if len(cache) < 64:  # a plan's slots take a few shapes (packed statistics: one per total length)
            cache[key] = (type(desc), {**desc.__dict__, "base": None})
        return desc
    cls, fields = kept
    desc = object.__new__(cls)
    desc.__dict__.update(fields)
    desc.base = t
    return desc


def _stat_desc(t: torch.Tensor, block: list[int], layout, varlen: bool):
    """The TMA descriptor of a row statistic: (B, H, S) dense, (H, T) packed (as (1, H, T)); ``t`` as
    :func:`_stat_view` gives it."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    shape = list(t.shape)
    strides = list(t.stride())
    if varlen:
        shape, strides = [1] + shape, [4] + strides
    # A dimension of size 1 other than the last is never stepped along: a valid stride (16 bytes).
    strides = [s if n > 1 else 4 for n, s in zip(shape[:-1], strides[:-1], strict=True)] + [1]
    return TensorDescriptor(t, shape, strides, block, layout)


def _aligned_stats(stats, cu: torch.Tensor) -> list[torch.Tensor]:
    """Packed (H, T) row statistics re-laid for the dK / dV kernel's TMA loads, which must start on a 16-byte
    boundary along the innermost (row) dimension: sequence b's rows from column 4 ceil(cu[b] / 4) + 4 b on
    (the kernel computes the same columns), the gaps 0. Device ops only: nothing syncs."""
    h, t = stats[0].shape
    n_seq = cu.numel() - 1
    cu64 = cu.to(torch.int64)
    rows = torch.arange(t, device=cu.device)
    seq = torch.searchsorted(cu64[1:], rows, right=True)  # each packed row's sequence (empty ones skipped)
    start = (cu64[:-1] + 3) // 4 * 4 + 4 * torch.arange(n_seq, device=cu.device)
    cols = start[seq] + (rows - cu64[seq])
    width = (t + 3) // 4 * 4 + 4 * n_seq
    return [torch.zeros(h, width, dtype=s.dtype, device=s.device).index_copy_(1, cols, s) for s in stats]


def _seq_args(varlen: bool, cu_q, cu_k, out0: torch.Tensor, out1: torch.Tensor, window_left: int,
              dummy: torch.Tensor) -> tuple:
    """The Gluon backward kernels' ``SEQ_ARGS``: cu_seqlens (a dense call passes an int32 stand-in, never
    read), the packed outputs with their row and head strides, whether packed, the left window."""
    # (``window_left`` comes clamped to 2**30 = NO_WINDOW keys from attention_launch's problem: the kernels'
    # key + window sums stay inside int32.)
    wl = window_left if window_left >= 0 else bwd_kernels().NO_WINDOW
    if varlen:
        return (cu_q, cu_k, out0, out1, 1, wl, out0.stride(0), out0.stride(1), out1.stride(0), out1.stride(1))
    return (dummy, dummy, out0, out1, 0, wl, 0, 0, 0, 0)


def _stat_view(t: torch.Tensor) -> torch.Tensor:
    """A (B, H, S) fp32 statistic as TMA reads it: its row stride a multiple of 16 bytes. Otherwise a copy
    padded to S rounded up to 4, the padding l = 0 (p = 0) and m = delta = 0; the rows past S are read as
    zeros by TMA either way."""
    s = t.shape[-1]
    if t.is_contiguous() and s % 4 == 0 and t.data_ptr() % 16 == 0:
        return t
    padded = torch.zeros(*t.shape[:-1], -(-s // 4) * 4, dtype=t.dtype, device=t.device)
    padded[..., :s] = t
    return padded[..., :s]


# GQA on the Gluon dK / dV kernel: one CTA per (key block, kv head) walks the whole query group, so with few
# kv heads the grid is short and, causal, the first key blocks' CTAs (every query sees them) set the time:
# TinyLlama's 32 / 4 heads at S=4K, D=64, are 128 CTAs for 132 SMs, each up to 8 heads x 32 query blocks.
# At the head dims of SPLIT_HEAD_DIMS, from a query group of SPLIT_MIN_GROUP[d] heads on (2 where d is not
# listed), the group is split as the Triton kernel splits it (dkdv_split: two query heads per CTA from a
# group of 4 on, one below), fp32 partials summed afterwards in a fixed order (at D=64 the same bits as the
# Triton kernels). The rule reads only the head counts and the head dim, never the batch or the sequence
# lengths, so a sequence's gradients do not depend on its neighbours (contract section 6). H100 (bench/
# RESULTS.md, 2026-12-07): D=64, B1 32 / 4 heads S=4K: backward 1.134 -> 0.637 ms causal, 1.276 -> 1.089 ms
# without. D=128 with groups of 8 or more: +8% to +29% where the unsplit grid is 128-256 CTAs (B1-B2 32 / 4
# heads, S = 4K-8K, causal), -0.3% to -2% at 512-1024 (B4 / B8 S=4K, B1 S=16K), 3.8x with MQA (32 / 1 heads);
# with groups of 4 it lost 3-8% (Llama-3-8B's 32 / 8 heads, B4 16 / 4 heads), so those stay whole.
SPLIT_HEAD_DIMS = (64, 128)
SPLIT_MIN_GROUP = {128: 8}


def split_of(group: int, kv_elements: int, d: int) -> int:
    """CTAs per (key block, kv head) of the Gluon dK / dV kernel for a query group of ``group`` heads at head
    dim ``d`` (``kv_elements``: the elements of k and v, for the partials' memory cap): the Triton dk/dv
    kernel's split (``attention_launch.dkdv_split``) where ``SPLIT_HEAD_DIMS`` and ``SPLIT_MIN_GROUP`` say
    so, else 1."""
    from .attention_launch import dkdv_split

    if d not in SPLIT_HEAD_DIMS or group < SPLIT_MIN_GROUP.get(d, 2):
        return 1
    return dkdv_split(group, kv_elements)


class BwdPlan:
    """The Gluon dK / dV launch of one backward signature (shapes, strides, dtypes, alignment, options)."""

    __slots__ = ("cfg", "block_shapes", "layouts", "stat_layout", "args", "launch", "copy", "scratch",
                 "varlen", "window_left", "dummy", "split", "descs")

    @staticmethod
    def _split(group: int, kv_elements: int, d: int) -> int:
        """CTAs per (key block, kv head): :func:`split_of`."""
        return split_of(group, kv_elements, d)

    @staticmethod
    def _kernel(K, d: int, causal: bool, sk: int, device: torch.device, partial: bool = False):
        """(configuration, kernel, constexprs) of head dim ``d`` (``sk`` keys on ``device``; ``partial``: the
        GQA split's form)."""
        cfg = K.BWD_CONFIGS[d]
        return cfg, K.attn_bwd_dkdv_gluon_kernel, K.constexprs(cfg, causal, partial)

    def __init__(self, q, k, v, grad, causal: bool, c1: float, scale_ds: float, cu_q=None, max_q: int = 0,
                 max_k: int = 0, window_left: int = -1):
        """Dense (B, H, S, D) tensors, or with ``cu_q`` packed (T, H, D) ones (sequences of up to ``max_q``
        / ``max_k`` rows); ``window_left`` >= 0: query i sees key j only if i - j <= window_left."""
        from ._launch import KernelLaunch

        K = bwd_kernels()
        varlen = self.varlen = cu_q is not None
        self.window_left = window_left
        self.dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
        self.descs: dict = {}
        if varlen:
            batch, hq, d = cu_q.numel() - 1, q.shape[1], q.shape[2]
            hkv, sq, sk = k.shape[1], q.shape[0], k.shape[0]
        else:
            batch, hq, sq, d = q.shape
            hkv, sk = k.shape[1], k.shape[2]
            max_q, max_k = sq, sk
        split = self.split = self._split(hq // hkv, k.numel() + v.numel(), d)
        cfg, kernel, constexprs = self._kernel(K, d, causal, max_k, q.device, split > 1)
        self.cfg = cfg
        dtype = "bfloat16" if q.dtype == torch.bfloat16 else "float16"
        shapes = K.block_shapes(cfg, d)
        self.block_shapes = [shapes[n] for n in ("q", "k", "v", "do", "dk", "dv")]
        self.layouts = [K.shared_layout(s[2], d, dtype) for s in self.block_shapes]
        self.stat_layout = K.stat_layout(cfg)
        self.copy = tuple(not _tma_ok(t, varlen) for t in (q, k, v, grad))
        dk_like = torch.empty_like(k, device="meta")
        # (With the split the partials are written by plain stores and summed into dk / dv by a Triton
        # launch that takes any strides: no scratch.)
        self.scratch = split == 1 and not (dk_like.stride(-1) == 1 and all(
            s > 0 and s % (16 // k.element_size()) == 0 for s in _view4(dk_like, varlen)[1][:-1]))
        n_n_blocks = triton.cdiv(max_k, cfg.block_n)
        n_tiles = n_n_blocks * batch * hkv * split
        if n_tiles >= 2**31:
            raise ValueError(f"k: {n_tiles} key tiles, more than the 2**31 - 1 the launch grid allows")
        per = hq // (hkv * split)  # query heads per CTA
        qdo_bytes = 2 * per * max(max_q, 1) * d * q.element_size()  # one CTA's Q and dO
        head_group = max(1, min(batch * hkv * split, L2_CHUNK_BYTES // qdo_bytes))
        self.args = (c1, scale_ds, hq, per, head_group, sq, sk, n_n_blocks, n_tiles)
        kwargs = dict(constexprs, **K.LAUNCH_OPTIONS, enable_fp_fusion=_config.fp_fusion)
        self.launch = KernelLaunch(kernel, (n_tiles,), kwargs)

    def _descriptors(self, q, k, v, grad, m, l, delta, dk, dv, cu_q=None
                     ) -> tuple[list, torch.Tensor, torch.Tensor]:
        """(the TMA descriptors of q, k, v, dO, dk, dv, m, l, delta; where dk and dv are written). With the
        configuration's ``row_stats`` the m and l descriptors cover each row's base and 1 / l instead;
        packed statistics are re-laid by :func:`_aligned_stats`."""
        if self.cfg.row_stats:  # computed once here, not at every step of the kernel
            from .attention_launch import row_stats

            m, l = row_stats(m, l)
        if self.varlen:
            m, l, delta = _aligned_stats((m, l, delta), cu_q)

        tensors = [_copy(t) if c else t for t, c in zip((q, k, v, grad), self.copy, strict=True)]
        if self.split > 1:  # the dk / dv descriptors are never stored through: k's and v's stand in
            dk_, dv_ = tensors[1], tensors[2]
        else:
            dk_ = torch.empty(k.shape, dtype=k.dtype, device=k.device) if self.scratch else dk
            dv_ = torch.empty(v.shape, dtype=v.dtype, device=v.device) if self.scratch else dv
        tensors += [dk_, dv_]
        cache, varlen = self.descs, self.varlen
        descs = [_desc(cache, i, t, block, layout, varlen) for i, (t, block, layout)
                 in enumerate(zip(tensors, self.block_shapes, self.layouts, strict=True))]
        stat_block = [1, 1, self.cfg.block_m]
        stats = [_stat_view(t) for t in (m, l, delta)]
        descs += [_desc(cache, (6 + i, t.shape, t.stride()), t, stat_block, self.stat_layout, varlen, True)
                  for i, t in enumerate(stats)]
        return descs, dk_, dv_

    def __call__(self, q, k, v, grad, m, l, delta, dk, dv, cu_q=None, cu_k=None) -> None:
        """Writes dk and dv (k's and v's shapes and dtype; any layout, with the split one of unit stride
        along the head dim, as the launcher's ``_scratch`` gives)."""
        descs, dk_, dv_ = self._descriptors(q, k, v, grad, m, l, delta, dk, dv, cu_q)
        if self.split > 1:
            self._split_call(descs, k, v, dk, dv, cu_q, cu_k)
            return
        self.launch(*descs, *self.args,
                    *_seq_args(self.varlen, cu_q, cu_k, dk_, dv_, self.window_left, self.dummy), 1)
        if dk_ is not dk:
            dk.copy_(dk_)
            dv.copy_(dv_)

    def _split_call(self, descs, k, v, dk, dv, cu_q, cu_k) -> None:
        """The GQA split: fp32 partials, slice j of kv head h at head h x split + j of (B, Hkv x split, Sk,
        D) dense / (T, Hkv x split, D) packed, then one Triton launch adding each head's slices in order j =
        0, 1, ... and rounding once into dk / dv (the Triton dk/dv kernel's split sum)."""
        from .attention_launch import split_partials, split_sum

        parts = [split_partials(t, self.split) for t in (k, v)]
        seq = _seq_args(self.varlen, cu_q, cu_k, *parts, self.window_left, self.dummy)
        if not self.varlen:  # head index batch x heads + head: the head stride spans a batch's heads
            seq = seq[:6] + tuple(s for p in parts for s in (p.stride(2), p.stride(1)))
        self.launch(*descs, *self.args, *seq, self.split)
        split_sum(parts[0], parts[1], dk, dv, self.split, self.varlen, None)


class DqPlan:
    """The Gluon dQ launch of one backward signature (shapes, strides, dtypes, alignment, options)."""

    __slots__ = ("block_shapes", "layouts", "args", "launch", "copy", "scratch", "varlen", "window_left",
                 "dummy", "descs")

    def __init__(self, q, k, v, grad, causal: bool, c1: float, scale_ds: float, cu_q=None, max_q: int = 0,
                 max_k: int = 0, window_left: int = -1):
        """As :class:`BwdPlan`'s."""
        from ._launch import KernelLaunch

        K = bwd_kernels()
        varlen = self.varlen = cu_q is not None
        self.window_left = window_left
        self.dummy = torch.zeros(1, dtype=torch.int32, device=q.device)
        self.descs: dict = {}
        if varlen:  # seqlen_q: the statistics' head stride (Tq)
            batch, hq, d = cu_q.numel() - 1, q.shape[1], q.shape[2]
            hkv, sq, sk = k.shape[1], q.shape[0], k.shape[0]
        else:
            batch, hq, sq, d = q.shape
            hkv, sk = k.shape[1], k.shape[2]
            max_q = sq
        cfg = K.DQ_CONFIGS[d]
        dtype = "bfloat16" if q.dtype == torch.bfloat16 else "float16"
        shapes = K.dq_block_shapes(cfg, d)
        self.block_shapes = [shapes[n] for n in ("q", "k", "v", "do", "dq")]
        self.layouts = [K.shared_layout(s[2], d, dtype) for s in self.block_shapes]
        self.copy = tuple(not _tma_ok(t, varlen) for t in (q, k, v, grad))
        dq_like = torch.empty_like(q, device="meta")
        self.scratch = not (dq_like.stride(-1) == 1 and all(
            s > 0 and s % (16 // q.element_size()) == 0 for s in _view4(dq_like, varlen)[1][:-1]))
        n_m_blocks = triton.cdiv(max_q, cfg.block_m)
        n_tiles = n_m_blocks * batch * hq
        if n_tiles >= 2**31:
            raise ValueError(f"q: {n_tiles} query tiles, more than the 2**31 - 1 the launch grid allows")
        self.args = (c1, scale_ds, hq, hq // hkv, sq, sk, n_m_blocks, n_tiles)
        kwargs = dict(K.dq_constexprs(cfg, causal), **K.LAUNCH_OPTIONS, enable_fp_fusion=_config.fp_fusion)
        self.launch = KernelLaunch(K.attn_bwd_dq_gluon_kernel, (n_tiles,), kwargs)

    def __call__(self, q, k, v, grad, m, l, delta, dq, cu_q=None, cu_k=None) -> None:
        """Writes dq (q's shape and dtype; any layout) from contiguous fp32 m, l and delta ((B, H, S) dense,
        (H, T) packed)."""
        tensors = [_copy(t) if c else t for t, c in zip((q, k, v, grad), self.copy, strict=True)]
        dq_ = torch.empty(q.shape, dtype=q.dtype, device=q.device) if self.scratch else dq
        tensors.append(dq_)
        descs = [_desc(self.descs, i, t, block, layout, self.varlen) for i, (t, block, layout)
                 in enumerate(zip(tensors, self.block_shapes, self.layouts, strict=True))]
        self.launch(*descs, m, l, delta, *self.args,
                    *_seq_args(self.varlen, cu_q, cu_k, dq_, dq_, self.window_left, self.dummy))
        if dq_ is not dq:
            dq.copy_(dq_)


class FusedPlan(BwdPlan):
    """The fused Gluon backward launch of one backward signature (shapes, strides, dtypes, alignment,
    options): dk, dv and dq in one kernel (:class:`BwdPlan`'s launch, plus an fp32 dq buffer, dq and the
    turn counters)."""

    __slots__ = ("n_m_blocks", "scale_ds", "acc_block", "acc_layout")

    @staticmethod
    def _kernel(K, d: int, causal: bool, sk: int, device: torch.device, partial: bool = False):
        cfg = K.FUSED_CONFIGS[d]
        # (The SM count is read only when the shifted order is asked for.)
        shift = cfg.shift and not causal and K.fused_shift(cfg, causal, triton.cdiv(sk, cfg.block_n),
                                                            _num_sms(device.index))
        return cfg, K.attn_bwd_fused_gluon_kernel, K.fused_constexprs(cfg, causal, shift)

    @staticmethod
    def _split(group: int, kv_elements: int, d: int) -> int:
        return 1  # one CTA per (key block, kv head): its dq additions run in a fixed order of key blocks

    def __init__(self, q, k, v, grad, causal: bool, c1: float, scale_ds: float):
        super().__init__(q, k, v, grad, causal, c1, scale_ds)
        batch, hq, sq, d = q.shape
        self.n_m_blocks = triton.cdiv(sq, self.cfg.block_m)
        if batch * hq * self.n_m_blocks >= 2**31 or batch * hq * sq * d >= 2**62:
            raise ValueError("q: too many query blocks for the fused backward's turn counters")
        self.scale_ds = scale_ds
        K = bwd_kernels()
        self.acc_block, self.acc_layout = K.dqacc_block_shape(self.cfg, d), K.dqacc_layout(self.cfg, d)

    def __call__(self, q, k, v, grad, m, l, delta, dq, dk, dv) -> None:
        """Writes dq, dk and dv (q's, k's and v's shapes and dtype; any layout)."""
        descs, dk_, dv_ = self._descriptors(q, k, v, grad, m, l, delta, dk, dv)
        batch, hq, sq, d = q.shape
        turns = torch.zeros(batch * hq * self.n_m_blocks, dtype=torch.int32, device=q.device)
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        if self.cfg.finalize:  # the kernel writes dq (contiguous) and needs no zeroed buffer
            acc = torch.empty((batch, hq, sq, d), dtype=torch.float32, device=q.device)
            out = dq if dq.is_contiguous() else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        else:  # dq = scale_ds * (the buffer's fixed-order sum), one fp32 multiply, rounded once
            # The TMA writer's first turn of each query block stores (every block has one: key block 0 sees
            # every query); the atomic writer adds from zero.
            zeroed = not self.cfg.tma_reduce or k.shape[2] == 0
            acc = (torch.zeros if zeroed else torch.empty)((batch, hq, sq, d), dtype=torch.float32,
                                                            device=q.device)
            out = q
        acc_desc = TensorDescriptor(acc, *_view4(acc, False), self.acc_block, self.acc_layout)
        self.launch(*descs, acc_desc, acc, out, turns, *self.args)
        if self.cfg.finalize:
            if out is not dq:
                dq.copy_(out)
        else:
            from .attention_launch import dq_scale

            dq_scale(acc, dq, self.scale_ds)
        if dk_ is not dk:
            dk.copy_(dk_)
            dv.copy_(dv_)
