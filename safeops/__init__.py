"""safeops: numerically safe softmax, log-softmax and logsumexp for PyTorch that the compiler cannot break.

Public API: :func:`softmax`, :func:`log_softmax`, :func:`logsumexp`; :func:`register`,
:func:`unregister`, :func:`registered` for ``torch.compile`` (and ``backend="safeops"``). The README's
contract says what "safe" means, clause by clause.
"""

__version__ = "0.1.0"

from . import ops as _ops  # noqa: E402,F401  (registers the torch.library ops)
from .compile import is_registered, register, registered, unregister  # noqa: E402
from .functional import log_softmax, logsumexp, softmax  # noqa: E402

__all__ = [
    "softmax", "log_softmax", "logsumexp",
    "register", "unregister", "registered", "is_registered",
    "__version__",
]
