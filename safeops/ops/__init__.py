"""torch.library definitions of the safeops ops (importing this registers them)."""

from . import attention, cast_transpose, cross_entropy, merge, softmax  # noqa: F401
