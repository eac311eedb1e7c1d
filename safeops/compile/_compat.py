"""Everything that touches torch.compile internals, in one place (torch 2.11 to 2.13 are tested).

Each helper names the private API it uses; when a torch release moves one, this is the only file to change.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import warnings
from typing import Any


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
    if _REGISTRY in sys.modules:
        register_backend(name, fn)
        return
    sys.meta_path.insert(0, _AfterImport(_REGISTRY, lambda: register_backend(name, fn)))


class _AfterImport(importlib.abc.MetaPathFinder):
    """A post-import hook: finds nothing itself, but wraps the loader of module ``name`` (found by the finders
    after it) so that ``then()`` runs once the module has executed. Removes itself at the first lookup."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """Delegates to ``loader`` (get_source etc. included), then calls ``then()`` after ``exec_module``."""

    def __init__(self, loader, then):
        self._loader, self._then = loader, then

    def __getattr__(self, attr):
        return getattr(self._loader, attr)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            self._then()
        except Exception as e:  # a failed registration must not break `import torch._dynamo`
            warnings.warn(f"safeops: registering the torch.compile backend failed: {e!r}", stacklevel=2)


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

