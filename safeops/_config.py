"""Process-wide settings: which backend runs an op, and knobs the benchmarks flip.

`SAFEOPS_BACKEND` is read on every call (not cached) so tests and users can switch it at run time:

- ``auto`` (default): CUDA tensors run the Triton kernels, everything else the reference.
- ``triton``: always the Triton kernels. CPU tensors then run under Triton's interpreter, which is how
  CI exercises the kernels without a GPU.
- ``reference``: always the pure-torch reference (``safeops.reference``).

`SAFEOPS_GLUON` (also read on every call): ``1`` (default) lets a CUDA attention forward that the Gluon
kernel takes run it (``safeops.attention_backend`` says which path a call takes and why); ``0`` keeps
every forward on the Triton kernels.

`SAFEOPS_GLUON_BWD` (read on every call): which CUDA attention backwards compute dk / dv with the Gluon
kernel (and dq with the Gluon dQ kernel): ``auto`` (default) those it takes at the head dims (and causal or
not) where it measured faster than the Triton kernels, ``1`` every one it takes, ``0`` none.
``SAFEOPS_GLUON=0`` turns it off too.

`SAFEOPS_GLUON_FUSED` (read on every call): ``auto`` (default) lets the backwards where the fused Gluon
kernel is the default (non-causal, head dim 128) run it; ``0`` keeps them on the dK / dV + dQ pair (e.g. on
a GPU shared under MPS with a cap on SMs: the fused kernel's shifted order needs a head's programs on the GPU
at once, and its plain order that programs start in the order of their numbers).
"""

from __future__ import annotations

import os
import sys

import torch

BACKENDS = ("auto", "triton", "reference")

# Launch kernels with fp contraction disabled (contract section 1). Only the benchmarks and the GPU test
# that proves the hazard is real turn this on; it is not part of the public API.
fp_fusion: bool = False


def _environ_entry(name: str):
    """``os.environ``'s raw entry for ``name`` (None if unset), read on every call.

    ``os.environ.get`` runs three Python-level calls per read (``Mapping.get``, ``__getitem__``, the key's
    encoding): ~0.6 us on a 2-core CPU, and every eager call reads SAFEOPS_BACKEND at least once. The dict
    behind it (CPython's ``os.environ._data``, keyed by the encoded name, updated by every change made
    through ``os.environ``) answers the same in one lookup. The entry is bytes on POSIX (``str`` elsewhere
    and where that dict is missing).
    """
    environ = os.environ
    data = getattr(environ, "_data", None)
    if data is None:
        return environ.get(name)
    key = _ENCODED_KEYS.get(name)
    if key is None:
        key = _ENCODED_KEYS[name] = environ.encodekey(name)
    return data.get(key)


_ENCODED_KEYS: dict = {}
# SAFEOPS_BACKEND's raw entries seen so far -> the backend they name (only valid ones are kept).
_backend_names: dict = {}


def backend_name() -> str:
    entry = _environ_entry("SAFEOPS_BACKEND")
    name = _backend_names.get(entry)
    if name is not None:
        return name
    value = os.environ.decodevalue(entry) if isinstance(entry, bytes) else entry or "auto"
    name = value.strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"SAFEOPS_BACKEND must be one of {BACKENDS}, got {name!r}")
    if len(_backend_names) < 64:
        _backend_names[entry] = name
    return name


_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def _switch(name: str, default: str, modes: tuple[str, ...], expected: str) -> str:
    """The setting ``name`` as ``"on"``, ``"off"`` or ``"auto"`` (one of ``modes``), else a ValueError that
    says which values it takes (``expected``)."""
    value = os.environ.get(name, default).strip().lower() or default
    mode = "on" if value in _ON else "off" if value in _OFF else value
    if mode not in modes:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return mode


def gluon_enabled() -> bool:
    """SAFEOPS_GLUON: whether attention forwards may run the Gluon kernel (see the module docstring)."""
    return _switch("SAFEOPS_GLUON", "1", ("on", "off"), "1 (on, the default) or 0 (off)") == "on"


def gluon_fused_enabled() -> bool:
    """SAFEOPS_GLUON_FUSED: whether the fused Gluon backward takes the cases it is the default for (see the
    module docstring)."""
    return _switch("SAFEOPS_GLUON_FUSED", "auto", ("auto", "off"), "auto (the default) or 0 (off)") == "auto"


def gluon_bwd_setting() -> tuple:
    """SAFEOPS_GLUON_BWD and SAFEOPS_GLUON_FUSED as set (raw, unchecked): what plans depend on, read on every
    call without raising."""
    return _environ_entry("SAFEOPS_GLUON_BWD"), _environ_entry("SAFEOPS_GLUON_FUSED")


def gluon_bwd_mode() -> str:
    """SAFEOPS_GLUON_BWD, with SAFEOPS_GLUON: ``"auto"``, ``"on"`` or ``"off"`` (see the module docstring)."""
    mode = _switch("SAFEOPS_GLUON_BWD", "auto", ("auto", "on", "off"),
                   "auto (the default), 1 (on) or 0 (off)")
    return mode if gluon_enabled() else "off"


def use_triton(x: torch.Tensor) -> bool:
    """True when the Triton kernels should run for tensors on ``x``'s device."""
    name = backend_name()
    if name == "reference":
        return False
    if name == "triton":
        return True
    return x.is_cuda


def _interpret_without_gpu() -> None:
    """On a machine with no GPU, Triton can only run kernels under its interpreter: turn it on.

    Triton reads TRITON_INTERPRET when ``triton.language`` is first imported, so this must happen before
    that; if Triton was already imported in compiled mode, CPU tensors need SAFEOPS_BACKEND=auto/reference.
    """
    if "triton" in sys.modules or "TRITON_INTERPRET" in os.environ:
        return
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_interpret_without_gpu()
