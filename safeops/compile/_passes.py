"""The Inductor pre-grad pass that rewrites a Dynamo graph to safeops ops, and the chain that runs it after a
user's own pass.

A module of its own because subclassing Inductor's ``CustomGraphPass`` imports ``torch._inductor`` and with it
``torch._dynamo`` (seconds): ``safeops.compile`` imports this only when a compile or ``register()`` needs it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from .. import __version__ as _version
from . import _compat
from .attention import rewrite as rewrite_attention
from .cast_transpose import rewrite as rewrite_cast_transpose
from .cross_entropy import rewrite as rewrite_cross_entropy
from .rewrite import rewrite_graph


def _code_hash() -> str:
    """Changes whenever the code that decides what a compiled graph computes changes."""
    h = hashlib.sha256(_version.encode())
    package = Path(__file__).parent.parent
    for path in sorted([*package.joinpath("compile").glob("*.py"), package / "functional.py",
                        *package.joinpath("ops").glob("*.py")]):
        h.update(path.read_bytes())
    return h.hexdigest()


class SafeopsGraphPass(_compat.custom_graph_pass_base()):
    """Inductor pre-grad pass: rewrites cross-entropy, softmax (and SDPA, and the fp8 cast + transpose) in the
    Dynamo graph to safeops ops."""

    _uuid = _code_hash()

    def __call__(self, graph: torch.fx.Graph) -> None:
        rewrite_cross_entropy(graph)  # first: its nll_loss(log_softmax) pattern holds a log_softmax
        rewrite_graph(graph)
        rewrite_attention(graph)  # F.scaled_dot_product_attention -> safeops.attention
        rewrite_cast_transpose(graph)  # fp8 cast + transposed copy -> safeops::cast_transpose

    def uuid(self) -> str:
        return self._uuid


_PASS = SafeopsGraphPass()


class _Chain(_compat.custom_graph_pass_base()):
    """A user's own pre-grad pass followed by the safeops pass, as one pass.

    One callable rather than a list, since older torch calls ``config.pre_grad_custom_pass(graph)``.
    """

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.first(graph)
        self.second(graph)

    def uuid(self):
        first = self.first.uuid() if hasattr(self.first, "uuid") else None
        # A user pass without a uuid keeps Inductor from caching with it, as it would without safeops.
        return None if first is None else (first, self.second.uuid())


def with_safeops_pass(current):
    """``current`` (None, a pass, or a chain already holding safeops) with the safeops pass added."""
    if current is None or current is _PASS:
        return _PASS
    if isinstance(current, _Chain) and current.second is _PASS:
        return current
    return _Chain(current, _PASS)
