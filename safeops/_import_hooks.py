"""Post-import hooks: run a function right after a module is first imported, without importing it.

``import safeops`` registers things with parts of torch that are expensive or optional to import (Dynamo's
backend registry pulls in all of ``torch._dynamo``; DTensor). Importing them here would cost every user
seconds; registering lazily on first use would happen inside a ``torch.compile`` trace, where it is a graph
break. A hook registers as soon as the module exists, whoever imports it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import warnings


def after_import(name: str, then) -> None:
    """``then()`` now if module ``name`` is imported, else right after its first import finishes executing
    (an exception from ``then`` is turned into a warning: it must not break that import)."""
    if name in sys.modules:
        then()
        return
    sys.meta_path.insert(0, _AfterImport(name, then))


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
            warnings.warn(f"safeops: {self._then!r} after importing {module.__name__} failed: {e!r}",
                          stacklevel=2)
