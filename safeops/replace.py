"""``replace_modules`` / ``restore_modules``: make an existing model use safeops, in place, and undo it.

What is replaced
    Submodules whose class is exactly ``torch.nn.Softmax``, ``torch.nn.LogSoftmax``,
    ``torch.nn.MultiheadAttention`` or ``torch.nn.CrossEntropyLoss`` become the :mod:`safeops.nn` class of
    the same name. Subclasses are
    left alone and reported (their ``forward`` may do something else), as are modules with a ``forward``
    assigned on the instance, the root module itself (it cannot be swapped in place) and modules already on
    safeops. A Hugging Face ``PreTrainedModel`` (found only if ``transformers`` is already imported) has its
    attention implementation switched to ``"safeops"`` with ``set_attn_implementation``, which reaches every
    attention layer that goes through transformers' ``AttentionInterface``.

How
    The replacement is a new object of the safeops class that shares the original's ``__dict__``: the same
    Parameter and buffer objects (nothing is copied), the same hook dictionaries (hooks registered before or
    after keep firing, and their handles still remove them), the same ``training`` flag, device and dtype.
    Where a ``torch.nn.TransformerEncoderLayer`` holds a replaced attention, its inference fast path (which
    calls a fused torch kernel instead of ``self_attn``) is turned off with a no-op forward pre-hook on the
    attention, and a ``torch.nn.TransformerEncoder`` around it gets ``use_nested_tensor = False``; both are
    undone by ``restore_modules`` and listed in the report.

Filters
    ``include`` and ``exclude`` each take a string, a type, or a list of them. A string is an
    ``fnmatch`` glob on the qualified module name (as in ``named_modules()``, e.g. ``"encoder.*"``; the root
    is ``""``); a type matches modules that are ``isinstance`` of it. A candidate is replaced when it matches
    ``include`` (or ``include`` is None) and does not match ``exclude``. Hugging Face models are candidates
    too, under their own name and type.

Report
    ``replace_modules`` returns the model and stores a :class:`ReplaceReport` as ``model.safeops_report``
    (``print(model.safeops_report)`` gives a table: what was replaced, what was not and why). The same text
    is logged at INFO level on the ``safeops.replace`` logger.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import sys

import torch

from . import nn as safe_nn

__all__ = ["replace_modules", "restore_modules", "ReplaceReport", "REPLACEMENTS"]

logger = logging.getLogger(__name__)

REPLACEMENTS: dict[type, type] = {
    torch.nn.Softmax: safe_nn.Softmax,
    torch.nn.LogSoftmax: safe_nn.LogSoftmax,
    torch.nn.MultiheadAttention: safe_nn.MultiheadAttention,
    torch.nn.CrossEntropyLoss: safe_nn.CrossEntropyLoss,
}
_SAFE_CLASSES = tuple(REPLACEMENTS.values())


@dataclasses.dataclass
class ReplaceReport:
    """What one ``replace_modules`` call did. ``str(report)`` is the readable form."""

    replaced: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (name, from, to)
    skipped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (name, class, why)
    notes: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"safeops.replace_modules: {len(self.replaced)} replaced, {len(self.skipped)} not replaced"]
        for name, old, new in self.replaced:
            lines.append(f"  replaced  {name or '<root>'}: {old} -> {new}")
        for name, cls, why in self.skipped:
            lines.append(f"  kept      {name or '<root>'} ({cls}): {why}")
        lines.extend(f"  note      {note}" for note in self.notes)
        return "\n".join(lines)


@dataclasses.dataclass
class _Record:
    """Everything restore_modules needs to undo the replacements on one model."""

    swaps: list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]] = dataclasses.field(
        default_factory=list)  # (parent, child name, original, replacement)
    hf: list[tuple[object, str, dict[int, tuple[object, str]]]] = dataclasses.field(
        default_factory=list)  # (model, previous implementation, {id(sub config): (submodel, impl)})
    hooks: list = dataclasses.field(default_factory=list)
    nested_flags: list[tuple[torch.nn.Module, bool]] = dataclasses.field(default_factory=list)


def _as_list(spec) -> list:
    if spec is None:
        return []
    if isinstance(spec, (list, tuple, set, frozenset)):
        items = list(spec)
    else:
        items = [spec]
    for item in items:
        if not isinstance(item, (str, type)):
            raise TypeError(
                f"include/exclude entries must be a glob string or a type, got {type(item).__name__}"
            )
    return items


def _matches(items: list, name: str, module: torch.nn.Module) -> bool:
    for item in items:
        if isinstance(item, str):
            if fnmatch.fnmatchcase(name, item):
                return True
        elif isinstance(module, item):
            return True
    return False


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _hf_pretrained_class():
    if "transformers" not in sys.modules:
        return None  # nothing can be a PreTrainedModel unless transformers was imported
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return PreTrainedModel


def _make_replacement(module: torch.nn.Module, cls: type) -> torch.nn.Module:
    new = cls.__new__(cls)
    # Same dict, not a copy: parameters, buffers, submodules, hooks and flags are the original's objects.
    object.__setattr__(new, "__dict__", module.__dict__)
    return new


def _state(model: torch.nn.Module) -> _Record:
    record = model.__dict__.get("_safeops_record")
    if record is None:
        record = _Record()
        model.__dict__["_safeops_record"] = record
    return record


def _block_encoder_fast_paths(model: torch.nn.Module, record: _Record, report: ReplaceReport) -> None:
    names = {id(m): n for n, m in model.named_modules()}
    blocked: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.TransformerEncoderLayer) and isinstance(module.self_attn,
                                                                                safe_nn.MultiheadAttention):
            attn = module.self_attn
            if id(attn) not in blocked and not any(h[1] is attn for h in record.hooks):
                handle = attn.register_forward_pre_hook(_no_op_pre_hook)
                record.hooks.append((handle, attn))
                blocked.add(id(attn))
                report.notes.append(
                    f"{names.get(id(module), '?')}: a no-op forward pre-hook on self_attn turns off "
                    "TransformerEncoderLayer's fused inference path (it would bypass self_attn)")
        if isinstance(module, torch.nn.TransformerEncoder) and getattr(module, "use_nested_tensor", False):
            if any(isinstance(getattr(layer, "self_attn", None), safe_nn.MultiheadAttention)
                   for layer in module.layers):
                record.nested_flags.append((module, True))
                module.use_nested_tensor = False
                report.notes.append(
                    f"{names.get(id(module), '?') or '<root>'}: use_nested_tensor set to False (the nested "
                    "path would hand self_attn nested tensors)")


def _no_op_pre_hook(module, args):
    return None


def _switch_hf(model, name: str, record: _Record, report: ReplaceReport) -> None:
    from . import transformers as safe_hf

    cls_name = type(model).__name__
    previous = model.config._attn_implementation
    if previous == safe_hf.NAME:
        report.skipped.append((name, cls_name, "Hugging Face attention already 'safeops'"))
        return
    subs = {}
    for sub in model.modules():
        if sub is not model and hasattr(sub, "set_attn_implementation") and hasattr(sub, "config"):
            subs[id(sub.config)] = (sub, sub.config._attn_implementation)
    ok, why = safe_hf.enable(model)
    if not ok:
        report.skipped.append((name, cls_name, why))
        return
    record.hf.append((model, previous, subs))
    report.replaced.append((name, f"{cls_name} attn_implementation={previous!r}",
                            f"attn_implementation={safe_hf.NAME!r}"))


def replace_modules(model: torch.nn.Module, *, include=None, exclude=None) -> torch.nn.Module:
    """Swap, in place, every replaceable submodule of ``model`` for its safeops version; returns ``model``.

    See the module documentation for what is replaced, the ``include``/``exclude`` semantics and the
    report (``model.safeops_report``). Undo with :func:`restore_modules`.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    include_items, exclude_items = _as_list(include), _as_list(exclude)
    report = ReplaceReport()
    record = _state(model)
    pretrained = _hf_pretrained_class()

    def selected(name, module) -> str | None:
        if include_items and not _matches(include_items, name, module):
            return "not matched by include"
        if exclude_items and _matches(exclude_items, name, module):
            return "matched by exclude"
        return None

    hf_roots: list[tuple[str, torch.nn.Module]] = []
    if pretrained is not None:
        for name, module in model.named_modules():
            if isinstance(module, pretrained) and not any(name.startswith(r + ".") or r == "" for r, _ in
                                                          hf_roots):
                hf_roots.append((name, module))
    for name, module in hf_roots:
        why = selected(name, module)
        if why:
            report.skipped.append((name, type(module).__name__, why))
        else:
            _switch_hf(module, name, record, report)

    done: dict[int, torch.nn.Module] = {}
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            target = REPLACEMENTS.get(type(child))
            if target is None:
                base = next((b for b in REPLACEMENTS if isinstance(child, b)), None)
                if isinstance(child, _SAFE_CLASSES):
                    report.skipped.append((name, _qualname(type(child)), "already a safeops module"))
                elif base is not None:
                    report.skipped.append((name, _qualname(type(child)),
                                           f"subclass of {_qualname(base)}; its forward may differ"))
                continue
            why = selected(name, child)
            if why:
                report.skipped.append((name, _qualname(type(child)), why))
                continue
            if "forward" in child.__dict__:
                report.skipped.append((name, _qualname(type(child)), "forward is overridden on the instance"))
                continue
            new = done.get(id(child))
            if new is None:
                new = done[id(child)] = _make_replacement(child, target)
            parent._modules[child_name] = new
            record.swaps.append((parent, child_name, child, new))
            report.replaced.append((name, _qualname(type(child)), _qualname(target)))

    if type(model) in REPLACEMENTS:
        report.skipped.append(("", _qualname(type(model)),
                               "the root module cannot be swapped in place; construct the safeops.nn class"))
    _block_encoder_fast_paths(model, record, report)
    model.__dict__["safeops_report"] = report
    logger.info("%s", report)
    return model


def restore_modules(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`replace_modules`: the original module objects go back, Hugging Face attention is reset."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    record = model.__dict__.pop("_safeops_record", None)
    if record is None:
        return model
    for handle, _ in record.hooks:
        handle.remove()
    for module, flag in record.nested_flags:
        module.use_nested_tensor = flag
    for parent, child_name, original, replacement in reversed(record.swaps):
        if parent._modules.get(child_name) is replacement:
            parent._modules[child_name] = original
        else:
            logger.warning("safeops.restore_modules: %s was changed after replace_modules; left as is",
                           child_name)
    for hf_model, previous, subs in reversed(record.hf):
        hf_model.set_attn_implementation(previous)
        for sub, impl in subs.values():
            if sub.config._attn_implementation != impl:
                sub.set_attn_implementation(impl)
    model.__dict__.pop("safeops_report", None)
    return model
