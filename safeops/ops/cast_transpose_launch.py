"""Launcher for the fused fp8 cast + transpose kernels: kernel choice, tile table, grid, amax workspace.

The choice of kernel and tile depends on the shape, the input dtype and the device only; it cannot change a
result (every output byte is computed from its own input element, and amax is a maximum, which no order
changes).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from .. import _config, reference
from ._launch import KernelLaunch, alignment_bits, check_triton_device, resident_programs

_kernels = None


def kernels():
    """The kernel module, imported on first use (importing safeops must not compile anything)."""
    global _kernels
    if _kernels is None:
        from ..kernels import cast_transpose as module

        _kernels = module
    return _kernels


# The hardware fp32 -> fp8 conversion on a GPU (cvt.rn.satfinite, round to nearest even); False runs the
# integer rounding instead (same bits, more instructions). The interpreter always runs the integer one:
# its own fp8 casts round wrongly (no carry into the exponent, ties not to even, subnormals lost).
HARDWARE_CONVERT = True


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_k: int
    num_warps: int
    num_stages: int = 1  # > 1: the tile loop prefetches x with cp.async (useful with a persistent grid)
    # Programs per SM: None = as many as fit on the GPU at once (a persistent grid, one wave, from the
    # compiled kernel's registers and shared memory); 0 = one program per tile; k > 0 = at most k per SM.
    programs_per_sm: int | None = 0
    # y_t written as int32 words of 4 codes (the kernel's PACK; used when M % 4 == 0, else bytes).
    pack: bool = True
    maxnreg: int | None = None  # register cap for ptxas (Triton's ``maxnreg``); None: ptxas chooses


# Chosen for the H200 from the compiled sm_90 code (SASS per thread) and tile sweeps on the H200
# (bench/RESULTS.md).
# - PACK (y_t as 4-code words): the byte kernel moved y_t's bytes through shared memory one byte at a time
#   (128x64 w8: 12 STS + 4 LDS + 32 LDS.U8 per 32 codes; 64x64 w4: 32 STS.U8 + 16 LDS.U16). With PACK and
#   64 codes per thread (128x64 w4, 256x64 w8, 64x64 w2) Triton uses stmatrix: per thread 8 LDG.128,
#   4 STSM.16.M88.4 + 4 LDS.128, 8 STG.128 (both outputs 16-byte stores), 64 registers.
# - 128 x 64 tiles, 4 warps: 64 registers -> 8 programs (32 warps) per SM; 16 KB of x in flight per
#   program. One wave of programs (persistent), each looping over tiles, so the amax hand-off (one atomic
#   max and one release/acquire count per program, each with a MEMBAR) happens ~1000 times, not per tile.
# - Small inputs (under 4M elements): 64 x 64 tiles, 2 warps (64 codes per thread), one per program.
LARGE_NUMEL = 1 << 22
CONFIGS = {
    "large": TileConfig(128, 64, 4, num_stages=1, programs_per_sm=None),
    "small": TileConfig(64, 64, 2, num_stages=1, programs_per_sm=0),
}
# Candidates for CONFIGS, which the tests run bit for bit through ``cast_transpose(config=...,
# hardware_convert=...)`` (interpreted, and on the GPU): (config, hardware_convert) pairs, None = the module
# default. Configs with 64 codes per thread and PACK (clean SASS, see above), a few others, the previous
# byte-transpose default, and the integer rounding on two tiles (same bits, more ALU).
_T = TileConfig
SWEEP_CANDIDATES = tuple(dict.fromkeys([
    *((cfg, None) for cfg in CONFIGS.values()),
    (_T(128, 64, 4, programs_per_sm=None), None), (_T(128, 64, 4, programs_per_sm=0), None),
    (_T(256, 64, 8, programs_per_sm=None), None), (_T(256, 64, 8, programs_per_sm=0), None),
    (_T(64, 64, 2, programs_per_sm=0), None), (_T(64, 64, 2, programs_per_sm=None), None),
    (_T(128, 128, 4, programs_per_sm=None), None), (_T(128, 128, 4, programs_per_sm=0), None),
    (_T(128, 64, 4, num_stages=2, programs_per_sm=None), None),
    (_T(256, 64, 8, num_stages=2, programs_per_sm=None), None),
    (_T(128, 64, 8, programs_per_sm=None), None), (_T(128, 64, 4, programs_per_sm=4), None),
    (_T(128, 64, 8, num_stages=2, programs_per_sm=None, pack=False), None),  # the previous default
    (_T(128, 64, 4, programs_per_sm=0, pack=False), None),
    (_T(128, 64, 4, programs_per_sm=None), False), (_T(256, 64, 8, programs_per_sm=0), False),
]))
del _T
# The interpreter runs programs one after another in numpy: one 64 x 64 tile per program.
INTERPRETER_CONFIG = TileConfig(64, 64, 4)
# bf16 inputs with M % 4 == 0 on a GPU run ``cast_transpose_bf16_kernel`` (element work in inline PTX, y_t
# as packed words) on this tile, persistent; None: the kernel above for every input. The 80-register cap:
# uncapped, ptxas holds the tile loop at 64 registers and issues only 5 of a tile's 8 loads before
# converting; with 80 it issues all 8 (and the scales) first (H200 measurements in bench/RESULTS.md).
BF16_CONFIG: TileConfig | None = TileConfig(128, 64, 4, num_stages=1, programs_per_sm=None, maxnreg=80)


def tile_config(m: int, k: int, elem_size: int) -> TileConfig:
    """The table above; the element size is part of the key so that fp32 can be tuned apart."""
    del elem_size  # the same tiles serve 2- and 4-byte inputs until measurements say otherwise
    return CONFIGS["large" if m * k >= LARGE_NUMEL else "small"]


def _interpreted() -> bool:
    return isinstance(kernels().cast_transpose_kernel, InterpretedFunction)


def _bf16_kernel_fits(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``cast_transpose_bf16_kernel`` computes this call: BF16_CONFIG set, a non-empty bf16 x with
    M % 4 == 0 (packed y_t words) on a GPU with compiled kernels (inline PTX), an fp8 format."""
    return (BF16_CONFIG is not None and x.dtype == torch.bfloat16 and x.device.type == "cuda"
            and x.numel() > 0 and x.shape[0] % 4 == 0 and dtype in reference.FP8_FORMATS
            and not _interpreted())


def _check_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda":
        check_triton_device(x, "x", kernels().cast_transpose_kernel)


# ---------------------------------------------------------------------------------------------------
# The amax workspace: two int32 words, zero between launches (the kernel's last program re-zeroes them).
# One per (device, stream), so launches on different streams never share one. While a CUDA graph is
# being captured a fresh zeroed one is used (its zeroing is captured with it), never the cached one.
# ---------------------------------------------------------------------------------------------------

_workspaces: dict = {}
_lock = threading.Lock()
_cuda_stream_fns: list = []


def _cuda_streams():
    """(is the current stream capturing, raw handle of a device's current stream): the torch._C functions
    Triton's own launcher and Inductor use (no Stream object per call), else the public ones."""
    if not _cuda_stream_fns:
        try:
            from torch._C import _cuda_getCurrentRawStream as raw
            from torch._C import _cuda_isCurrentStreamCapturing as capturing
        except ImportError:
            capturing = torch.cuda.is_current_stream_capturing

            def raw(index):
                return torch.cuda.current_stream(index).cuda_stream
        _cuda_stream_fns[:] = [capturing, raw]
    return _cuda_stream_fns


def _workspace(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        capturing, raw = _cuda_stream_fns or _cuda_streams()
        if capturing():
            return torch.zeros(2, dtype=torch.int32, device=device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = ("cuda", index, raw(index))
    else:
        key = (device.type, None, threading.get_ident())
    ws = _workspaces.get(key)
    if ws is None:
        with _lock:
            ws = _workspaces.setdefault(key, torch.zeros(2, dtype=torch.int32, device=device))
    return ws


_sm_counts: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: a persistent grid of programs_per_sm programs (tests use it)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def empty_outputs(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, y_t, amax) with the layouts the op promises (the fake implementation uses this too)."""
    m, k = x.shape
    y = torch.empty((m, k), dtype=dtype, device=x.device)
    # The strides of ``torch.empty((K, M)).t()``: (1, M) (1 for a size that is 0 or 1).
    y_t = torch.empty_strided((m, k), (1, torch.sym_max(m, 1)), dtype=dtype, device=x.device)
    amax = torch.empty((), dtype=torch.float32, device=x.device)
    return y, y_t, amax


def _wide(m: int, k: int, sxm: int, sxk: int, cfg: TileConfig) -> bool:
    """Whether offsets inside one tile can pass 2**31 (then the kernel computes them in 64 bits)."""
    span = max(cfg.block_m * (abs(sxm) + 1) + cfg.block_k * (abs(sxk) + 1), cfg.block_m * k + cfg.block_k,
               cfg.block_k * m + cfg.block_m)
    return span >= 2**31


# Launch plans: everything about a launch that depends only on shapes, strides, dtypes, the device and
# the config, computed once per key (host time per call matters: at 4096 x 4096 the kernel takes ~16 us
# at the target bandwidth).
_plans: dict = {}


def _options_and_scalars(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool,
                         config: TileConfig, hardware_convert: bool, pack: bool, bf16: bool
                         ) -> tuple[dict, tuple]:
    """The constexprs + launch options and the scalar arguments of a launch (no tensor is kept): of
    ``cast_transpose_bf16_kernel`` with ``bf16``, else of ``cast_transpose_kernel``."""
    m, k = x.shape
    fmt = reference.FP8_FORMATS[dtype]
    n_tiles_k = triton.cdiv(k, config.block_k)
    n_tiles = triton.cdiv(m, config.block_m) * n_tiles_k
    if n_tiles >= 2**31:
        raise ValueError(f"x: too many tiles for shape {tuple(x.shape)}")
    sxm, sxk = x.stride()
    scalars = (m, k, sxm, sxk, scale.stride(0) if rowwise else 0, n_tiles_k, n_tiles, m // 4)
    options = dict(
        FP8=fmt.code, ROWWISE=bool(rowwise), WIDE=_wide(m, k, sxm, sxk, config),
        EVEN=(m % config.block_m == 0 and k % config.block_k == 0), NUM_STAGES=config.num_stages,
        BLOCK_M=config.block_m, BLOCK_K=config.block_k, num_warps=config.num_warps,
        enable_fp_fusion=_config.fp_fusion,
    )
    if not bf16:
        options.update(MAX_BITS=fmt.max_bits, MAN=fmt.mantissa_bits, BIAS=fmt.exponent_bias,
                       HW_CVT=bool(hardware_convert), X_BF16_BITS=x.dtype == torch.bfloat16, PACK=pack)
    if config.maxnreg:
        options["maxnreg"] = config.maxnreg
    return options, scalars


def _kernel(bf16: bool):
    return kernels().cast_transpose_bf16_kernel if bf16 else kernels().cast_transpose_kernel


def _plan(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool, config: TileConfig,
          hardware_convert: bool, pack: bool, bf16: bool, tensors: list) -> tuple:
    """(scalar arguments, the launch) of one launch; the launch is made with ``(*tensors, *scalars)``."""
    options, scalars = _options_and_scalars(x, scale, dtype, rowwise, config, hardware_convert, pack, bf16)
    kernel = _kernel(bf16)
    programs = min(scalars[6], _programs(kernel, [*tensors, *scalars], options, config, x.device))
    return scalars, KernelLaunch(kernel, (programs,), options)


def _yt_arg(y_t: torch.Tensor, pack: bool) -> torch.Tensor:
    """y_t's storage, ``(K, M)`` bytes, or with ``pack`` ``(K, M // 4)`` int32 words (little-endian: the
    word's low byte is the smallest row)."""
    storage = y_t.t().view(torch.uint8)
    return storage.view(torch.int32) if pack else storage


def _choice(x: torch.Tensor, config: TileConfig | None, hardware_convert: bool | None,
            bf16: bool) -> tuple[TileConfig, bool, bool]:
    """(tile config, hardware conversion, packed y_t words) of a launch: BF16_CONFIG for the bf16 kernel
    (always the hardware conversion and packed words), else the given config and conversion, the table's
    and the module default where None."""
    if bf16:
        return BF16_CONFIG, True, True
    interpreted = _interpreted()
    if config is None:
        config = INTERPRETER_CONFIG if interpreted else tile_config(*x.shape, x.element_size())
    if hardware_convert is None:
        hardware_convert = HARDWARE_CONVERT and not interpreted
    return config, hardware_convert, config.pack and x.shape[0] % 4 == 0


# ---------------------------------------------------------------------------------------------------
# Routes: the default call (no config / hardware_convert given), what safeops.cast_transpose runs
# ---------------------------------------------------------------------------------------------------
# Per key -- x's shape, strides, dtype, device and 16-byte alignment, scale's dtype, alignment and row
# stride, the fp8 dtype, rowwise -- the decision the general path below makes on every call (which kernel:
# the bf16 kernel for bf16 with M % 4 == 0 on a GPU, else the other kernel with its tile table; the empty
# and oversized cases: the general path itself), with that kernel's constexprs, scalar arguments and
# launch (grid and compiled kernel kept: safeops.ops._launch). A repeated call then costs:
# the key and one lookup, three output allocations, the workspace lookup, (under the interpreter) the dtype
# views and the launch. Fresh outputs and the workspace are 16-byte aligned (caching allocators); if one
# ever is not, that call takes the general path (the compiled kernel is specialized on alignment).
# The module settings a route depends on (BF16_CONFIG, HARDWARE_CONVERT, CONFIGS, LARGE_NUMEL, ...)
# are compared by identity on every call, and the routes dropped when one was replaced; changing a
# TileConfig inside CONFIGS in place is not seen: call clear_routes() after that.

_GENERAL = "general"
_routes: dict = {}
_route_state: list = [None]


class _Route:
    """One kernel's launch for one key. ``launch`` is made on the first call (the persistent grid's size
    comes from the compiled kernel's occupancy, which needs the arguments)."""

    __slots__ = ("kernel", "options", "scalars", "views", "x_bits", "pack", "programs", "launch")

    def __init__(self, kernel, options: dict, scalars: tuple, views: bool, x_bits: bool, pack: bool,
                 programs):
        self.kernel, self.options, self.scalars = kernel, options, scalars
        # The tensors as they are (compiled kernels cast their pointers), or under the interpreter, which
        # cannot read fp8 tensors, as integer views: x as int16 bits (bf16), y_t as int32 words (pack).
        self.views, self.x_bits, self.pack = views, x_bits, pack
        self.programs = programs  # (tensors, device) -> number of programs
        self.launch = None

    def first_launch(self, tensors: tuple, device: torch.device) -> KernelLaunch:
        programs = min(self.scalars[6], self.programs(tensors, device))
        self.launch = KernelLaunch(self.kernel, (programs,), self.options)
        return self.launch


def clear_routes() -> None:
    """Forgets every route (after a change the per-call identity check cannot see, e.g. CONFIGS edited in
    place)."""
    _routes.clear()


def _settings() -> tuple:
    return (BF16_CONFIG, HARDWARE_CONVERT, LARGE_NUMEL, CONFIGS.get("large"), CONFIGS.get("small"),
            INTERPRETER_CONFIG, tile_config, _wide, _interpreted, _check_device, _config.fp_fusion,
            _bf16_kernel_fits, _kernels)  # _kernels: the routes keep its kernels


def _default_launch(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool):
    """``(kernel, tile config, packed y_t, constexprs + options, scalars)`` of the default call (no config or
    conversion given), from shapes, strides and dtypes alone; None where the general path decides itself
    (empty or oversized x). Raises as the general path does."""
    _check_device(x)
    m, k = x.shape
    if x.numel() == 0 or m >= 2**31 or k >= 2**31:
        return None
    bf16 = _bf16_kernel_fits(x, dtype)
    config, hardware_convert, pack = _choice(x, config=None, hardware_convert=None, bf16=bf16)
    options, scalars = _options_and_scalars(x, scale, dtype, rowwise, config, hardware_convert, pack, bf16)
    return _kernel(bf16), config, pack, options, scalars


def _new_route(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool):
    """The route of this call's key: what the general path would do, decided once (raises as it does)."""
    default = _default_launch(x, scale, dtype, rowwise)
    if default is None:
        return _GENERAL
    kernel, config, pack, options, scalars = default

    def programs(tensors, device):
        return _programs(kernel, [*tensors, *scalars], options, config, device)

    return _Route(kernel, options, scalars, _interpreted(), x.dtype == torch.bfloat16, pack, programs)


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool,
                   config: TileConfig | None = None, hardware_convert: bool | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs the kernel. ``config`` / ``hardware_convert`` override the table and the module default."""
    if config is None and hardware_convert is None:
        settings = _settings()
        if settings != _route_state[0]:
            _routes.clear()
            _route_state[0] = settings
        shape, device = x.shape, x.device
        key = (shape, x.stride(), x.dtype, device, not x.data_ptr() & 15, scale.dtype,
               not scale.data_ptr() & 15, scale.stride(0) if rowwise else 0, dtype, rowwise)
        route = _routes.get(key)
        if route is None:
            route = _new_route(x, scale, dtype, rowwise)
            if len(_routes) >= 4096:
                _routes.clear()
            _routes[key] = route
        if route is not _GENERAL:
            m, k = shape
            y = torch.empty(m, k, dtype=dtype, device=device)
            y_t = torch.empty_strided((m, k), (1, m), dtype=dtype, device=device)
            amax = torch.empty(size=(), dtype=torch.float32, device=device)
            ws = _workspace(device)
            if not (y.data_ptr() | y_t.data_ptr() | amax.data_ptr() | ws.data_ptr()) & 15:
                if route.views:
                    tensors = (x.view(torch.int16) if route.x_bits else x, scale, y.view(torch.uint8),
                               y_t.t().view(torch.int32 if route.pack else torch.uint8), ws,
                               amax.view(torch.int32))
                else:
                    tensors = (x, scale, y, y_t, ws, amax)
                launch = route.launch or route.first_launch(tensors, device)
                launch(*tensors, *route.scalars)
                return y, y_t, amax
    return _general(x, scale, dtype, rowwise, config, hardware_convert)


def _general(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool,
             config: TileConfig | None, hardware_convert: bool | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every decision made on this call (explicit configs, empty or oversized inputs, and what routes do
    not cover)."""
    _check_device(x)
    m, k = x.shape
    if x.numel() == 0:
        y, y_t, amax = empty_outputs(x, dtype)
        amax.zero_()  # the maximum of no magnitudes (documented in safeops.cast_transpose)
        return y, y_t, amax
    if m >= 2**31 or k >= 2**31:
        raise ValueError(f"x: dimensions of 2**31 or more are not supported, got {tuple(x.shape)}")
    bf16 = config is None and hardware_convert is None and _bf16_kernel_fits(x, dtype)
    config, hardware_convert, pack = _choice(x, config, hardware_convert, bf16)
    y, y_t, amax = empty_outputs(x, dtype)
    tensors = [x.view(torch.int16) if x.dtype == torch.bfloat16 else x, scale, y.view(torch.uint8),
               _yt_arg(y_t, pack), _workspace(x.device), amax.view(torch.int32)]
    # Everything else depends only on what this key holds: computed once per key, not per call. The
    # pointers' 16-byte alignment is in it because Triton specializes the compiled kernel on it (the plan
    # keeps the compiled kernel: safeops.ops._launch).
    align = alignment_bits(*tensors)
    key = (x.shape, x.stride(), x.dtype, x.device, scale.dtype, scale.stride(0) if rowwise else 0, dtype,
           rowwise, config, hardware_convert, bf16, _config.fp_fusion, _wide, align,  # _wide: tests patch it
           _kernels)  # the plan keeps its kernel
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(x, scale, dtype, rowwise, config, hardware_convert, pack, bf16, tensors)
        if len(_plans) >= 4096:
            _plans.clear()
        _plans[key] = plan
    scalars, launch = plan
    launch(*tensors, *scalars)
    return y, y_t, amax


# ---------------------------------------------------------------------------------------------------
# The launch Inductor makes (safeops::cast_transpose_compiled, a triton_op): decided from shapes, strides and
# dtypes alone (the arguments may be FakeTensors), without the launcher's caches, the workspace cache or a
# compiled kernel. Inductor compiles the kernel itself with its own options (no ``maxnreg``, no
# ``enable_fp_fusion``; the kernels have nothing to contract, tests/test_cast_transpose_configs.py), and the
# persistent grid is sized without an occupancy query: the kernels run 64 registers a thread at 4 warps
# when ptxas chooses, 8 programs per SM. A different count changes no result (programs take tiles
# pid, pid + n_programs, ...; the amax hand-off counts whatever programs ran).
# ---------------------------------------------------------------------------------------------------
TRACED_PROGRAMS_PER_SM = 8


def traced_launch(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool):
    """``(kernel, grid, scalars, constexprs)`` of the default call on ``x``, or None where the launcher's
    general path decides (not a CUDA tensor for the compiled kernels, empty or oversized x)."""
    if x.device.type != "cuda" or not _config.use_triton(x) or _interpreted():
        return None
    default = _default_launch(x, scale, dtype, rowwise)
    if default is None:
        return None
    kernel, config, _, options, scalars = default
    del options["enable_fp_fusion"]  # Inductor compiles with its own options (see above)
    options.pop("maxnreg", None)
    per_sm = TRACED_PROGRAMS_PER_SM if config.programs_per_sm is None else config.programs_per_sm
    n_tiles = scalars[6]
    programs = n_tiles if per_sm == 0 else min(n_tiles, per_sm * _sm_count(x.device))
    return kernel, (programs,), scalars, options


_capacity: dict = {}


def _programs(kernel, args: list, options: dict, config: TileConfig, device: torch.device) -> int:
    """How many programs to launch (before capping at the number of tiles)."""
    if config.programs_per_sm == 0:
        return 2**31 - 1
    if config.programs_per_sm is not None:
        return config.programs_per_sm * _sm_count(device)
    if device.type != "cuda":
        return 2  # the interpreter: a small persistent grid, so tests cover programs with several tiles
    key = (device.index, tuple(sorted(options.items())), tuple(
        (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else (a % 16 == 0, a == 1)
        for a in args))
    if key not in _capacity:
        _capacity[key] = max(_sm_count(device), resident_programs(kernel, args, options, device))
    return _capacity[key]
