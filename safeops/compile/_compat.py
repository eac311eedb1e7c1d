"""Everything that touches torch.compile internals, in one place (torch 2.11 to 2.13 are tested).

Each helper names the private API it uses; when a torch release moves one, this is the only file to change.
"""

from __future__ import annotations

from typing import Any

from .._import_hooks import after_import


def custom_graph_pass_base() -> type:
    """Inductor's ``CustomGraphPass`` (torch >= 2.6: passes with a uuid() take part in its cache keys)."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # pragma: no cover - older torch
        class CustomGraphPass:  # type: ignore[no-redef]
            def uuid(self) -> Any:
                return None
    return CustomGraphPass


def inductor_config():
    import torch._inductor.config as config

    return config


def functorch_config():
    import torch._functorch.config as config

    return config


def decomposition_table() -> dict:
    """Inductor's global decomposition table (``torch._inductor.decomposition.decompositions``)."""
    from torch._inductor import decomposition

    return decomposition.decompositions


def clear_decomposition_cache() -> None:
    """``select_decomp_table()`` serves a cached merged copy; drop it after editing the table."""
    from torch._inductor import decomposition

    for name in ("fast_random_decomps", "select_decomp_table"):
        fn = getattr(decomposition, name, None)
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()


def select_decomp_table() -> dict:
    from torch._inductor.decomposition import select_decomp_table as select

    return select()


def compile_fx(gm, example_inputs, **kwargs):
    from torch._inductor.compile_fx import compile_fx as inductor_compile_fx

    return inductor_compile_fx(gm, example_inputs, **kwargs)


_REGISTRY = "torch._dynamo.backends.registry"


def register_backend(name: str, fn) -> None:
    from torch._dynamo.backends.registry import _COMPILER_FNS
    from torch._dynamo.backends.registry import register_backend as register

    if name not in _COMPILER_FNS:
        register(compiler_fn=fn, name=name)


def register_backend_on_import(name: str, fn) -> None:
    """``register_backend`` now if Dynamo's backend registry is loaded, else right after it first loads.

    Importing the registry imports all of ``torch._dynamo`` (seconds), which ``import safeops`` should not
    cost; ``torch.compile(..., backend=name)`` imports it before it looks the name up, and that import runs
    the registration. (A ``torch_dynamo_backends`` entry point would work only for installed copies, and
    torch refuses a name registered both ways.)
    """
    after_import(_REGISTRY, lambda: register_backend(name, fn))


def pre_grad_pass_in_cache_key() -> bool:
    """Whether Inductor's FX-graph / AOT-autograd caches will hash ``config.pre_grad_custom_pass`` now.

    torch >= 2.12 runs a pass with a ``uuid()`` "late" (after the cache lookup) and hashes it; a pass
    without one (a user's pass chained with safeops') or ``pre_grad_pass_timing="early"`` runs before the
    lookup and is not hashed, and older torch never hashes it. Then a graph that only the decomposition
    table changes could be served across a safeops / stock boundary, so the callers turn the caches off.
    """
    try:
        import torch._inductor.codecache as codecache
    except ImportError:
        return False
    resolve = getattr(codecache, "resolve_pre_grad_pass_timing", None)
    if resolve is None:
        return False
    try:
        return resolve() == "late"
    except RuntimeError:
        return False


def mode_options(mode: str | None) -> dict:
    """Inductor config patches for a ``torch.compile`` mode (what the stock Inductor backend applies)."""
    if mode is None or mode == "default":
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))

