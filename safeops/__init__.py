"""safeops: numerically safe softmax, log-softmax, logsumexp and attention for PyTorch, as Triton kernels
that the compiler cannot break, plus a fused fp8 cast + transpose.

Public API: :func:`softmax`, :func:`log_softmax`, :func:`logsumexp`, :func:`attention`,
:func:`attention_varlen`, :func:`attention_backend` (which kernel an attention call runs, and why),
:func:`merge_attention`, :func:`cast_transpose`, :func:`cross_entropy`; :func:`register`,
:func:`unregister`, :func:`registered`, :func:`is_registered` for ``torch.compile`` (and
``backend="safeops"``). For existing models: :mod:`safeops.nn` (drop-in modules), :func:`replace_modules` /
:func:`restore_modules`, :func:`patched` (eager patching) and ``import safeops.transformers``
(``attn_implementation="safeops"``). ``docs/contract.md`` says what "safe" means, clause by clause.
"""

__version__ = "0.1.0"

from . import nn  # noqa: E402  (drop-in modules; safeops.transformers is imported only on request)
from . import ops as _ops  # noqa: E402,F401  (registers the torch.library ops)
from .compile import is_registered, register, registered, unregister  # noqa: E402
from .functional import (  # noqa: E402
    attention,
    attention_backend,
    attention_varlen,
    cast_transpose,
    cross_entropy,
    log_softmax,
    logsumexp,
    merge_attention,
    softmax,
)
from .patching import patched  # noqa: E402
from .replace import replace_modules, restore_modules  # noqa: E402

__all__ = [
    "softmax", "log_softmax", "logsumexp", "attention", "attention_varlen", "attention_backend",
    "cast_transpose", "merge_attention", "cross_entropy",
    "register", "unregister", "registered", "is_registered",
    "nn", "replace_modules", "restore_modules", "patched",
    "__version__",
]

from . import dtensor as _dtensor  # noqa: E402

_dtensor.register_if_loaded()  # DTensor sharding rules, now if DTensor is already imported (safeops.dtensor)
