"""torch.library definitions of the safeops ops (importing this registers them)."""

from . import softmax  # noqa: F401
