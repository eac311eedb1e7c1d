"""safeops: numerically safe softmax, log-softmax and logsumexp for PyTorch that the compiler cannot break.

Public API: :func:`softmax`, :func:`log_softmax`, :func:`logsumexp`. See CONTRACT in the README for what
"safe" means, clause by clause.
"""

from . import ops as _ops  # noqa: F401  (registers the torch.library ops)
from .functional import log_softmax, logsumexp, softmax

__version__ = "0.1.0"

__all__ = ["softmax", "log_softmax", "logsumexp", "__version__"]
