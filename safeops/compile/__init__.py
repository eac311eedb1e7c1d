"""torch.compile integration: make Inductor route softmax through safeops.

Two ways in:

- ``torch.compile(fn, backend="safeops")``: Inductor with the safeops rewrite, for that call only;
- ``safeops.register()`` / ``safeops.unregister()`` / ``with safeops.registered():``: every
  ``torch.compile`` with the default Inductor backend gets the rewrite while registered.

What is rewritten (see ``safeops.compile.rewrite``): calls of softmax / log_softmax / logsumexp and
hand-written softmax and log-softmax cores, in the Dynamo graph, before autograd, so training graphs use
the safeops backward; and ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` calls and the
``nll_loss(log_softmax(x))`` pattern, to the fused ``safeops.cross_entropy``
(``safeops.compile.cross_entropy``). While registered, the aten forward ops ``_softmax``, ``_log_softmax``
and ``logsumexp`` that other decompositions produce are also mapped to safeops through Inductor's
decomposition table. Their backward ops receive the output, not the input, so they cannot recompute:
``_softmax_backward_data`` stays Inductor's fp32 formula on the (safe) output, and
``_log_softmax_backward_data`` gets a version that gives excluded entries (output -inf) a zero gradient.

Cache safety: the rewrite is an Inductor ``CustomGraphPass`` whose ``uuid()`` hashes this package's
rewrite code, so Inductor's FX-graph and AOT-autograd caches key on whether it ran. On torch versions
whose caches do not hash custom passes, registration turns those caches off while in force.

Attention: ``F.scaled_dot_product_attention`` calls go to ``safeops.attention`` where it computes the
same function (``safeops.compile.attention`` says when: no dropout, 4-D inputs, ...).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ..ops import softmax as _ops
from . import _compat
from .rewrite import stats

__all__ = ["register", "unregister", "registered", "is_registered", "backend", "stats", "BACKEND_NAME"]

BACKEND_NAME = "safeops"

aten = torch.ops.aten
_lock = threading.RLock()
_state: dict = {"registered": False}


def _with_safeops_pass(current):
    """``current`` (None, a pass, or a chain already holding safeops) with the safeops pass added."""
    from . import _passes  # Inductor's CustomGraphPass: imported when a compile first needs it, not at import

    return _passes.with_safeops_pass(current)


def __getattr__(name: str):
    if name == "SafeopsGraphPass":  # kept where it was documented; defined in _passes (imports Inductor)
        from ._passes import SafeopsGraphPass

        return SafeopsGraphPass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------------
# aten forward ops produced by other decompositions
# ---------------------------------------------------------------------------------------------------


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _decompositions(original: dict) -> dict:
    """Decompositions of the aten forward ops into safeops ops; anything else goes to ``original``."""

    def fallback(op, *args):
        fn = original.get(op)
        return NotImplemented if fn is None else fn(*args)

    def softmax(x, dim, half_to_float):
        if x.dtype not in _FLOATS or x.dim() == 0:
            return fallback(aten._softmax.default, x, dim, half_to_float)
        out_dtype = torch.float32 if half_to_float else None
        return _ops.softmax_op(x, dim % x.dim(), None, None, None, out_dtype)[0]

    def log_softmax(x, dim, half_to_float):
        if x.dtype not in _FLOATS or x.dim() == 0:
            return fallback(aten._log_softmax.default, x, dim, half_to_float)
        out_dtype = torch.float32 if half_to_float else None
        return _ops.log_softmax_op(x, dim % x.dim(), None, None, None, out_dtype)[0]

    def logsumexp(x, dim, keepdim=False):
        dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
        if len(dims) != 1 or x.dim() == 0 or x.dtype not in _FLOATS:
            return fallback(aten.logsumexp.default, x, dim, keepdim)
        d = dims[0] % x.dim()
        out = _ops.logsumexp_op(x, d, None, None, None, None)[0]
        return out.unsqueeze(d) if keepdim else out

    def log_softmax_backward(grad, output, dim, input_dtype):
        # The aten backward sees only the output. An excluded entry (output exactly -inf) influences
        # nothing, so its gradient is 0 and its incoming gradient is not summed (contract section 4);
        # Inductor's own formula would give it g, and g to the others through the sum.
        acc = torch.float64 if torch.float64 in (output.dtype, grad.dtype) else torch.float32
        keep = output != float("-inf")
        g = torch.where(keep, grad.to(acc), 0.0)
        dx = g - torch.exp(output.to(acc)) * g.sum(dim, keepdim=True)
        return torch.where(keep, dx, 0.0).to(input_dtype)

    return {
        aten._softmax.default: softmax,
        aten._log_softmax.default: log_softmax,
        aten.logsumexp.default: logsumexp,
        aten._log_softmax_backward_data.default: log_softmax_backward,
    }


_OPS = (aten._softmax.default, aten._log_softmax.default, aten.logsumexp.default,
        aten._log_softmax_backward_data.default)


def _table_with_safeops() -> dict:
    table = dict(_compat.select_decomp_table())
    table.update(_decompositions({op: table.get(op) for op in _OPS}))
    return table


# ---------------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------------


def backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None,
            **kwargs):
    """``torch.compile(fn, backend="safeops")``: Inductor plus the safeops rewrite, for this compile only.

    ``mode`` and ``options`` mean what they mean for Inductor (``torch.compile`` passes them through).
    """
    config = _compat.inductor_config()
    patches = dict(_compat.mode_options(mode))
    patches.update(options or {})
    patches["pre_grad_custom_pass"] = _with_safeops_pass(config.pre_grad_custom_pass)
    with config.patch(patches), _caches_safe():
        return _compat.compile_fx(gm, example_inputs, decompositions=_table_with_safeops(), **kwargs)


_compat.register_backend_on_import(BACKEND_NAME, backend)


@contextlib.contextmanager
def _caches_safe():
    if _compat.pre_grad_pass_in_cache_key():
        yield
        return
    # The caches would not see that this compile differs from a stock one: compile without them.
    with _compat.inductor_config().patch({"fx_graph_cache": False}), \
            _compat.functorch_config().patch({"enable_autograd_cache": False}):
        yield


# ---------------------------------------------------------------------------------------------------
# Global registration
# ---------------------------------------------------------------------------------------------------


def is_registered() -> bool:
    return _state["registered"]


def register() -> None:
    """From now on, ``torch.compile`` (Inductor) routes softmax through safeops. Idempotent."""
    with _lock:
        if _state["registered"]:
            return
        config = _compat.inductor_config()
        saved = {"pre_grad_custom_pass": config.pre_grad_custom_pass}
        config.pre_grad_custom_pass = _with_safeops_pass(config.pre_grad_custom_pass)

        table = _compat.decomposition_table()
        saved["decompositions"] = {op: table.get(op) for op in _OPS}
        table.update(_decompositions(dict(saved["decompositions"])))
        _compat.clear_decomposition_cache()

        if not _compat.pre_grad_pass_in_cache_key():
            # The caches would not see whether safeops was in force: off while it is.
            fconfig = _compat.functorch_config()
            saved["fx_graph_cache"] = config.fx_graph_cache
            saved["enable_autograd_cache"] = fconfig.enable_autograd_cache
            config.fx_graph_cache = False
            fconfig.enable_autograd_cache = False
        _state.update(registered=True, saved=saved)


def unregister() -> None:
    """Back to stock ``torch.compile``: undoes everything :func:`register` changed. Idempotent.

    Functions compiled while registered keep their compiled (safe) code; call ``torch._dynamo.reset()``
    to recompile them stock.
    """
    with _lock:
        if not _state["registered"]:
            return
        saved = _state.pop("saved")
        config = _compat.inductor_config()
        config.pre_grad_custom_pass = saved["pre_grad_custom_pass"]
        table = _compat.decomposition_table()
        for op, fn in saved["decompositions"].items():
            if fn is None:
                table.pop(op, None)
            else:
                table[op] = fn
        _compat.clear_decomposition_cache()
        if "fx_graph_cache" in saved:
            config.fx_graph_cache = saved["fx_graph_cache"]
            _compat.functorch_config().enable_autograd_cache = saved["enable_autograd_cache"]
        _state["registered"] = False


@contextlib.contextmanager
def registered():
    """``with safeops.registered(): ...``: registration for the block, restored after (nesting is fine)."""
    with _lock:
        was = _state["registered"]
        register()
    try:
        yield
    finally:
        if not was:
            unregister()
