"""Launching a Triton kernel with little host work per call.

``JITFunction.run`` re-derives the kernel's specialization from every argument on every call (types,
16-byte alignment of pointers, integers equal to 1 or divisible by 16), hashes it and looks the compiled
kernel up: tens of microseconds for a kernel with twenty-odd arguments. A launcher that has already cached
everything that decides the specialization (shapes, strides, dtypes, pointer alignment, the launch
options) under its own key does not need that again: :class:`KernelLaunch` makes the first launch through
``JITFunction.run`` and keeps the ``CompiledKernel`` it returned, then launches that same compiled kernel
directly, with the same argument list ``JITFunction.run`` passes (constexprs included). Same kernel, same
compile options (``enable_fp_fusion=False``), same bits.

The direct launch uses ``CompiledKernel.run`` / ``.function`` / ``.packed_metadata`` /
``.launch_metadata`` and ``triton.knobs.runtime.launch_enter_hook`` / ``launch_exit_hook``, the calls
``JITFunction.run`` itself makes in Triton 3.4-3.6 and 3.9 (the metadata and the hooks only while a launch
hook is set: ``_no_hook``). Before it is used for a kernel, the argument
list is checked once against what Triton's own binder produces; when anything there is missing or differs
(another Triton version), every launch goes through ``JITFunction.run``. The interpreter
(``TRITON_INTERPRET=1``) always launches through ``kernel[grid](...)``.

Set ``safeops.ops._launch.DIRECT = False`` to launch every kernel through ``JITFunction.run``.

Kernels that take host-side TMA descriptors (the Gluon attention kernels) cost more per launch: Triton
3.6's launcher encodes every descriptor into a CUDA tensor map (``make_tensordesc_arg``: Python, then the
driver's encode) at every launch, and loops in Python over every argument to splice them in. A tensor map is
a pure function of the base address, shape, strides, padding and the kernel's descriptor metadata, so a
direct launch keeps the maps it encoded, per argument position, keyed by those values (a training loop
meets the same addresses step after step), and calls the generated C launcher itself with the list Triton's
wrapper would build (:func:`_tensor_map_launcher` recognizes that wrapper by its structure; anything else,
and any launch that needs global or profiling scratch, keeps Triton's path). ``TENSOR_MAPS = False`` turns
this off for launches kept from then on.

A cheap guard backs the callers' keys up: a direct launch first compares the dtypes of its tensor arguments
(the pointers' element types the kernel was compiled for; a TMA descriptor's base is covered by the
callers' keys only) with the first launch's; on any difference it
launches through ``JITFunction.run`` instead, which specializes for what it is given (same bits as a
correct key would give), and counts it in ``guard_fallbacks`` (a caller's key then misses a dtype: a bug to
fix there; the GPU tests check the count stays 0).
"""

from __future__ import annotations

import sys
from operator import attrgetter, itemgetter

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

try:
    from triton.knobs import HookChain as _HookChain
except ImportError:  # an older Triton: every hook slot that is not None counts as a hook
    _HookChain = None

# Launch compiled kernels directly once a KernelLaunch has made its first launch (see the module docstring).
DIRECT = True
# Keep the encoded TMA tensor maps of kernels with descriptor arguments (see the module docstring); read when
# a launch first keeps its compiled kernel.
TENSOR_MAPS = True
# Direct launches refused by the dtype guard (launched through JITFunction.run instead); should stay 0.
guard_fallbacks = 0
_dtype_of = attrgetter("dtype")

_runtime: dict = {}


def _triton_runtime():
    """(current device, current stream, knobs.runtime) as JITFunction.run gets them; None if unavailable."""
    if "value" not in _runtime:
        try:
            from triton import knobs
            from triton.runtime.driver import driver

            active = driver.active
            _runtime["value"] = (active.get_current_device, active.get_current_stream, knobs.runtime)
        except Exception:  # noqa: BLE001 - any missing piece means: launch through JITFunction.run
            _runtime["value"] = None
    return _runtime["value"]


def _no_hook(hook) -> bool:
    """Whether a launch hook slot holds no hook. Triton 3.4-3.9 keep the launch hooks in a ``HookChain``
    (never None; its ``calls`` list is empty unless a profiler added a hook), so ``JITFunction.run`` builds
    the launch metadata (``CompiledKernel.launch_metadata``: a LazyDict per launch) and its launcher calls
    both empty chains, Python calls that change nothing. The launcher calls a hook slot only when it is not
    None and reads the metadata only in the hooks: with no hook in either slot, a direct launch passes None
    for all three. A hook of any other kind (a plain callable) counts as a hook."""
    return hook is None or (type(hook) is _HookChain and not hook.calls)


def _same_args(bound: list, full: list) -> bool:
    if len(bound) != len(full):
        return False
    for a, b in zip(bound, full, strict=True):
        if a is b:
            continue
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b) or a != b:
            return False
    return True


class KernelLaunch:
    """One kernel launch whose grid, constexprs and options are fixed; only the runtime arguments change.

    Build one per call signature (everything that decides the kernel's specialization must be in the
    caller's cache key: shapes, strides, dtypes, 16-byte alignment of every pointer, the options), then
    call it with the positional runtime arguments, exactly as ``kernel[grid](*args, **kwargs)``. A direct
    launch whose tensor arguments' dtypes differ from the first launch's goes through ``JITFunction.run``
    (the guard: one dtype comparison per tensor argument on the direct path).
    """

    __slots__ = ("kernel", "grid", "kwargs", "_tail", "_compiled", "_direct_ok", "_tensors", "_dtypes",
                 "_maps")

    def __init__(self, kernel, grid: tuple, kwargs: dict):
        self.kernel = kernel
        self.grid = tuple(grid)
        self.kwargs = kwargs
        self._tail: tuple | None = None  # the values of the parameters after the positional arguments
        self._compiled: dict = {}  # current device -> (compiled kernel, its launcher, grid x, y, z)
        self._direct_ok = not isinstance(kernel, InterpretedFunction)
        self._tensors = None  # args -> tuple of the tensor arguments (by the first launch's positions)
        self._dtypes: tuple = ()  # their dtypes at the first launch: what the kept kernel was compiled for
        self._maps: dict = {}  # current device -> _TensorMaps of a kernel with TMA descriptor arguments

    def __call__(self, *args) -> None:
        global guard_fallbacks
        if self._compiled and DIRECT:
            device_of, stream_of, runtime = _runtime["value"]
            device = device_of()
            entry = self._compiled.get(device)
            if entry is not None:
                # The guard: the tensor arguments' dtypes are those the kept kernel was compiled for.
                try:
                    same = tuple(map(_dtype_of, self._tensors(args))) == self._dtypes
                except (AttributeError, IndexError):  # a tensor position holds something else; args short
                    same = False
                if same:
                    compiled, run, g0, g1, g2 = entry
                    full = (*args, *self._tail)
                    stream = stream_of(device)
                    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
                    if _no_hook(enter) and _no_hook(leave):
                        # Nothing would read the launch metadata: no hooks, no metadata (see _no_hook).
                        metadata = enter = leave = None
                    else:
                        metadata = compiled.launch_metadata(self.grid, stream, *full)
                    maps = self._maps.get(device) if self._maps else None
                    if maps is not None:
                        maps.launch(g0, g1, g2, stream, compiled, metadata, enter, leave, full)
                    else:
                        run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, metadata, enter,
                            leave, *full)
                    return
                # Not what the kept kernel was compiled for: JITFunction.run specializes (nothing kept).
                guard_fallbacks += 1
                self.kernel[self.grid](*args, **self.kwargs)
                return
        compiled = self.kernel[self.grid](*args, **self.kwargs)
        if self._direct_ok and DIRECT:
            self._remember(compiled, args)

    def _remember(self, compiled, args: tuple) -> None:
        """After a launch through JITFunction.run: keep its compiled kernel if a direct launch is safe."""
        try:
            runtime = _triton_runtime()
            if runtime is None or compiled is None or hasattr(compiled, "result"):
                raise LookupError("no compiled kernel to keep")
            device = runtime[0]()
            if self._tail is None:
                params = self.kernel.params[len(args):]
                self._tail = tuple(self.kwargs.get(p.name, p.default) for p in params)
            full = [*args, *self._tail]
            # What JITFunction.run passed to the launcher: Triton's own binder, same options.
            binder = self.kernel.device_caches[device][-1]
            bound = binder(*args, **self.kwargs)[0]
            if not _same_args(list(bound.values()), full):
                raise LookupError("argument list differs from Triton's")
            run = compiled.run  # loads the module if needed
            for name in ("function", "packed_metadata", "launch_metadata"):
                getattr(compiled, name)
            g = (*self.grid, 1, 1)
            positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
            dtypes = tuple(args[i].dtype for i in positions)
            if self._compiled and dtypes != self._dtypes:
                return  # another device's kernel is kept, for other dtypes: keep that one only
            self._tensors = _picker(positions)
            self._dtypes = dtypes
            self._compiled[device] = (compiled, run, g[0], g[1], g[2])
            maps = _tensor_map_launcher(run, len(full)) if TENSOR_MAPS else None
            if maps is not None:
                self._maps[device] = maps
        except Exception:  # noqa: BLE001 - an unknown Triton: every launch goes through JITFunction.run
            self._direct_ok = False
            self._compiled.clear()


class _TensorMaps:
    """The direct launch of a kernel with TMA descriptor arguments: Triton 3.6's generated launcher, called
    with the argument list its Python wrapper (``wrap_handle_tensordesc``) builds, each descriptor replaced
    by its encoded tensor map, shape and strides (``make_tensordesc_arg``'s list), kept per argument position
    and (base address, shape, strides, padding) in ``caches``."""

    __slots__ = ("raw", "cooperative", "pdl", "positions", "metas", "encode", "caches")
    CACHE_MAX = 256  # encoded maps kept per position (a 32-layer model's activations, with room)

    def __init__(self, raw, cooperative, pdl, positions: tuple, metas: tuple, encode):
        self.raw, self.cooperative, self.pdl = raw, cooperative, pdl
        self.positions, self.metas, self.encode = positions, metas, encode
        self.caches = tuple({} for _ in positions)

    def launch(self, g0, g1, g2, stream, compiled, metadata, enter, leave, full: tuple) -> None:
        out = [g0, g1, g2, stream, compiled.function, self.cooperative, self.pdl, None, None,
               compiled.packed_metadata, metadata, enter, leave]
        start = 0
        for pos, meta, cache in zip(self.positions, self.metas, self.caches, strict=True):
            out += full[start:pos]
            desc = full[pos]
            key = (desc.base.data_ptr(), *desc.shape, *desc.strides, desc.padding)
            encoded = cache.get(key)
            if encoded is None:
                encoded = self.encode(desc, meta)
                if len(cache) >= self.CACHE_MAX:
                    cache.clear()
                cache[key] = encoded
            out += encoded
            start = pos + 1
        out += full[start:]
        self.raw(*out)


def _tensor_map_launcher(run, n_args: int) -> _TensorMaps | None:
    """A :class:`_TensorMaps` for ``run`` (a compiled kernel's launcher) when it is Triton 3.6's
    ``CudaLauncher`` of a kernel with TMA descriptor arguments lowered to tensor maps, needing no global or
    profiling scratch; else None (the launch goes through ``run`` as before)."""
    try:
        wrapper = run.launch
        code, cells = wrapper.__code__, wrapper.__closure__
        if code.co_name != "inner" or cells is None:
            return None
        free = dict(zip(code.co_freevars, (c.cell_contents for c in cells), strict=True))
        if set(free) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
            return None
        module = sys.modules.get(wrapper.__module__)
        encode = getattr(module, "make_tensordesc_arg", None)
        if (encode is None or getattr(module, "_BASE_ARGS_FORMAT_LEN", None) != 13
                or encode.__code__.co_argcount != 2):
            return None
        positions = tuple(sorted(free["tensordesc_indices"]))
        metas = tuple(free["tensordesc_meta"])
        if (not positions or len(metas) != len(positions) or any(m is None for m in metas)
                or positions[-1] >= n_args or run.global_scratch_size or run.profile_scratch_size):
            return None
        return _TensorMaps(free["launcher"], run.launch_cooperative_grid, run.launch_pdl, positions, metas,
                           encode)
    except Exception:  # noqa: BLE001 - another Triton: launch through its own launcher
        return None


def _picker(positions: tuple):
    """``args -> tuple(args[i] for i in positions)``, in C (itemgetter): a slice when the tensors lead the
    argument list (every launcher here passes them first), else the positions."""
    if positions == tuple(range(len(positions))):
        return itemgetter(slice(0, len(positions)))
    if len(positions) > 1:
        return itemgetter(*positions)
    return itemgetter(slice(positions[0], positions[0] + 1))


# Launches keyed by their exact argument signature, for launchers that do not keep plans of their own: the
# key holds every non-tensor argument's value and every tensor's dtype and 16-byte alignment (with the
# device), which is all that decides Triton's specialisation, plus the grid and the keyword arguments.
_PLANS: dict = {}
_PLANS_MAX = 4096


def alignment_bits(*tensors) -> int:
    """Bit i: whether tensor i's data pointer is 16-byte aligned (Triton specializes pointers on it), for the
    launchers' plan keys; None counts as unaligned."""
    bits = 0
    for i, t in enumerate(tensors):
        if t is not None and t.data_ptr() % 16 == 0:
            bits |= 1 << i
    return bits


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``; on CUDA through one cached :class:`KernelLaunch` per argument
    signature, so a repeated call launches the compiled kernel directly. Interpreted kernels, CPU tensors
    and non-JIT stand-ins (tests' recorders) launch as ``kernel[grid]``."""
    first = args[0]
    if (not isinstance(kernel, JITFunction) or isinstance(kernel, InterpretedFunction)
            or first.device.type != "cuda"):
        kernel[grid](*args, **kwargs)
        return
    key = (kernel, grid, first.device.index, tuple(
        (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args),
        tuple(kwargs.items()))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        plan = _PLANS[key] = KernelLaunch(kernel, grid, kwargs)
    plan(*args)


def resident_programs(kernel, args, kwargs, device: torch.device) -> int:
    """How many programs of this compiled kernel fit on the GPU at once (all SMs, full occupancy)."""
    compiled = kernel.warmup(*args, grid=(1,), **kwargs)
    compiled._init_handles()
    props = torch.cuda.get_device_properties(device)
    threads = 32 * compiled.metadata.num_warps
    regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    by_regs = (regs_per_sm // regs_per_warp) // compiled.metadata.num_warps
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = smem // (compiled.metadata.shared + 1024) if compiled.metadata.shared else 32
    per_sm = max(0, min(by_regs, by_threads, by_smem, 32))
    return per_sm * props.multi_processor_count


def check_triton_device(t: torch.Tensor, arg: str, kernel) -> None:
    """The launchers' device check for a non-CUDA tensor ``t`` (argument ``arg``): a CPU tensor needs
    Triton's interpreter (``kernel``, any of the launcher's kernels, is interpreted); anything else raises."""
    if t.device.type != "cpu":
        raise ValueError(f"{arg}: Triton kernels need a CUDA tensor (or, interpreted, a CPU one), "
                         f"not {t.device}")
    if not isinstance(kernel, InterpretedFunction):
        raise ValueError(
            f"{arg}: SAFEOPS_BACKEND=triton with a CPU tensor needs Triton's interpreter; set "
            "TRITON_INTERPRET=1 before importing triton, or use SAFEOPS_BACKEND=auto to run CPU tensors on "
            "the reference")


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for device-side TMA descriptors (Triton asks for it at each launch that needs it)."""
    return torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))


def ensure_tma_allocator() -> None:
    """Device-side tensor descriptors need Triton's global scratch allocator. Triton keeps it in a
    ContextVar, so it is per thread: setting it once is not enough (the autograd engine runs the backward on
    its own thread). Set ours wherever none is set; a user's wins."""
    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # private API moved: set ours every time
        pass
    triton.set_allocator(_tma_scratch)


# ---------------------------------------------------------------------------------------------------
# Registering an op with few layers between the dispatcher and its implementation
# ---------------------------------------------------------------------------------------------------
# torch.library.custom_op wraps an op in several Python layers that run on every call, compiled graphs'
# calls included: an Autograd kernel that builds a metadata object, re-fills default arguments and
# re-dispatches; a backend kernel that checks the outputs for aliasing; a Dynamo-disable wrapper. Together
# they cost tens of microseconds per call (bench/RESULTS.md, host overhead). ``define_op`` registers the
# same things through torch.library.Library directly: the schema (with the tag custom_op adds), the
# implementation for every backend (Dynamo-disabled whenever Dynamo intercepts frames, so a graph break
# never traces into a launcher), the fake, and an Autograd kernel that records an autograd.Function only
# when a gradient is being recorded, and otherwise calls the implementation directly when nothing but a
# CPU/CUDA backend is left to dispatch to (fake tensors, functionalization, Python modes and subclasses go
# on down the dispatcher as usual).

_lib = torch.library.Library("safeops", "FRAGMENT")
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_BACKEND_KEYS = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
_below_autograd = torch._C._AutoDispatchBelowAutograd
_any_requires_grad = getattr(torch._C, "_any_requires_grad", None) or (
    lambda *args: any(isinstance(a, torch.Tensor) and a.requires_grad for a in args))
# Dynamo's frame callback for this thread (None when nothing would intercept a Python frame); without it,
# the Dynamo-disable wrapper always runs.
_dynamo_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)


def define_op(name: str, schema: str, impl, fake, function=None):
    """Defines ``safeops::<name><schema>`` and returns its default overload.

    ``impl`` runs on every backend, ``fake`` under tracing. ``function(below)`` returns the autograd.Function
    used when a gradient is recorded; its ``forward(ctx, *args, keyset)`` computes the op with
    ``below(keyset, args)``. Without ``function`` the op has no derivative: its outputs then raise in
    backward, as a custom_op without ``register_autograd`` does.
    """
    _lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    kernel = torch._disable_dynamo(impl)
    _lib.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"safeops::{name}", fake, lib=_lib)
    op = getattr(torch.ops.safeops, name).default

    def below(keyset, args):
        rest = keyset & _AFTER_AUTOGRAD
        with _below_autograd():
            if rest.highestPriorityTypeId() in _BACKEND_KEYS:
                # The Dynamo-disable wrapper only matters while Dynamo intercepts frames (a graph break's
                # eager code); a compiled graph runs with no callback, and so does plain eager code.
                if _dynamo_callback is not None and _dynamo_callback() is None:
                    return impl(*args)
                return kernel(*args)
            return op.redispatch(rest, *args)

    recorded = function(below) if function is not None else _no_derivative(name, below)

    def autograd_kernel(keyset, *args):
        if torch.is_grad_enabled() and _any_requires_grad(*args):
            return recorded.apply(*args, keyset)
        return below(keyset, args)

    _lib.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return op


def _no_derivative(name: str, below):
    class NoDerivative(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            return below(args[-1], args[:-1])

        @staticmethod
        def backward(ctx, *grads):
            raise RuntimeError(f"safeops::{name} has no derivative: backward (or double backward, "
                               "create_graph=True) through it is not supported")

    NoDerivative.__name__ = f"NoDerivative_{name}"
    return NoDerivative
