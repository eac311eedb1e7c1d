"""Shared fixtures: backend switching, Hypothesis profiles, the gpu marker.

``import safeops`` comes first: on a machine without a GPU it turns on Triton's interpreter
(TRITON_INTERPRET=1), which only works if it happens before anything imports triton or torch._dynamo.

Random inputs come from Hypothesis (``@given``; strategies and a drawn seed for tensor contents in
``tests/strategies.py``). Two settings profiles, chosen by ``SAFEOPS_HYPOTHESIS``:

- ``ci`` (the default): derandomized, so every run tries the same examples; one example per test unless
  the test asks for more (``@strategies.examples(n)``: the property tests); no deadline; no example
  database and no shrinking (a failure is reported at once, with the ``@reproduce_failure`` blob).
- ``deep``: fresh random examples, 200 per test (``SAFEOPS_HYPOTHESIS_EXAMPLES`` changes the count; a slow
  test may ask for fewer), shrunk to a minimal failing example and kept in ``.hypothesis/`` to replay; for
  local and GPU runs, e.g. ``SAFEOPS_HYPOTHESIS=deep pytest tests/test_softmax_numerics.py -k triton``.

A failing example prints its arguments; a tensor's values are ``Seed(n)`` in it, so
``@hypothesis.example(..., seed=Seed(n))`` on the test replays it.
"""

import safeops  # noqa: F401, I001  (must be first, see the module docstring)

import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

import strategies

# torch's test helpers (tests/test_opinfo.py imports them) register their own hypothesis profiles and load
# one when first imported: 10 random examples with the function-scoped-fixture health check on, for every
# test collected after them. Importing them here first lets the profile below be the one that stays. They
# need expecttest (a test extra); without it test_opinfo.py skips and nothing else loads them.
try:
    import torch.testing._internal.common_utils  # noqa: E402,F401  isort: skip
except ImportError:
    pass

# Function-scoped fixtures (backend, monkeypatch, tmp_path) are shared by a test's examples: the fixtures
# used with @given set state that every example wants (a backend) or that an example resets itself.
_SUPPRESSED = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=1, derandomize=True, deadline=None, print_blob=True,
                          database=None, phases=[Phase.explicit, Phase.generate],
                          suppress_health_check=_SUPPRESSED)
settings.register_profile("deep", max_examples=strategies.deep_examples(), deadline=None, print_blob=True,
                          suppress_health_check=_SUPPRESSED)
settings.load_profile(strategies.profile())

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


# CPython 3.11 keeps Python frames in 16 KiB chunks and unmaps a chunk as soon as the frame at its base
# returns, so a hot loop whose calls cross a chunk boundary maps and unmaps memory on every call. Which
# tests hit a boundary depends on the stack depth: under @given's extra frames, Triton's interpreter spent
# more system time than compute in some files (tests/test_attention.py: 123 s of system time against 2 s).
# Each test therefore runs inside one frame of 32768 locals, whose 512 KiB chunk leaves room for all the
# test's own frames. CPython 3.12 does not unmap the chunk this way.
if sys.version_info[:2] == (3, 11):
    from _pytest.python import pytest_pyfunc_call as _call_test_function

    # `call` is never None: the assigned names are there only to size the frame.
    _roomy_source = ("def _roomy(call):\n    if call is None:\n        "
                     + " = ".join(f"_{i}" for i in range(32768)) + " = None\n    return call()\n")
    _namespace: dict = {}
    exec(_roomy_source, _namespace)
    _roomy = _namespace["_roomy"]

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(pyfuncitem):
        return _roomy(lambda: _call_test_function(pyfuncitem))


def pytest_configure(config):
    # numpy warns (overflow, 0/0, inf - inf) while Triton's interpreter evaluates a kernel on masked-off
    # lanes and on -inf sentinels; the kernels select those values away. The tests check the results.
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")
    # Raised from inside torch by opcheck / torch.compile, not by safeops.
    config.addinivalue_line("filterwarnings",
                            "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


# Tests whose cost under Triton's interpreter is out of proportion to what they add in CI beside their
# sibling cases (each keeps a cheaper case of the same property in CI: another split, dtype or length).
# `.ci/run` sets SAFEOPS_CI_QUICK=1 to skip these (the 12-minute CI budget on 2 cores); every other run,
# and any run without that variable, runs them. (test id prefix, a substring of the parameter part or None)
CI_QUICK_SKIPS = [
    ("tests/test_attention.py::test_tma_loads_same_bits", None),  # a tuning knob, off by default
    ("tests/test_attention.py::test_gqa_dkdv_split", "[split2]"),  # split4 and nosplit stay
    ("tests/test_attention_plans.py::test_plan_bits_on_the_interpreter", "[True]"),  # sinks: [False] stays
    ("tests/test_attention_sinks.py::test_merge_counts_the_sink_once", "[triton-True]"),
    ("tests/test_softmax_numerics.py::test_batch_invariant", "split_fp16]"),  # split_fp32 stays
    ("tests/test_softmax_numerics.py::test_deterministic", "split_fp16]"),
    ("tests/test_softmax_numerics.py::test_long_rows_split_path_match_oracle", "fp32_40000]"),
    ("tests/test_compile_register.py::test_hand_written_core_is_rewritten_and_matches_oracle", "-fp16]"),
]


def _ci_quick_skip(nodeid: str) -> bool:
    for prefix, part in CI_QUICK_SKIPS:
        if nodeid.startswith(prefix) and (part is None or part in nodeid[len(prefix):]):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    # Every test module is imported by now; one that loaded another hypothesis profile would have changed
    # the example counts and health checks of the modules imported after it.
    if settings.get_current_profile_name() != strategies.profile():
        raise pytest.UsageError(f"a test module loaded the hypothesis profile "
                                f"{settings.get_current_profile_name()!r}; safeops' tests run under "
                                f"{strategies.profile()!r} (tests/conftest.py)")
    if os.environ.get("SAFEOPS_CI_QUICK") == "1":
        quick = pytest.mark.skip(reason="SAFEOPS_CI_QUICK=1: a sibling case covers this in CI "
                                        "(tests/conftest.py CI_QUICK_SKIPS)")
        for item in items:
            if _ci_quick_skip(item.nodeid):
                item.add_marker(quick)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# --------------------------------------------------------------------------------------------------
# Backends for CPU tensors
# --------------------------------------------------------------------------------------------------

_NO_INTERPRETER = (
    "SAFEOPS_BACKEND=triton on CPU tensors needs Triton's interpreter, and TRITON_INTERPRET=1 was not set "
    "before triton was imported (a CUDA machine runs these kernels in the GPU tests instead)"
)

CPU_BACKENDS = [
    pytest.param("reference", id="reference"),
    pytest.param("triton", id="triton", marks=[
        pytest.mark.interpret, pytest.mark.skipif(not INTERPRETER, reason=_NO_INTERPRETER)]),
]


@pytest.fixture(params=CPU_BACKENDS)
def backend(request, monkeypatch) -> str:
    """Each test runs once on the pure-torch reference and once on the Triton kernels (interpreted)."""
    monkeypatch.setenv("SAFEOPS_BACKEND", request.param)
    return request.param


@pytest.fixture
def triton_backend(monkeypatch) -> str:
    if not INTERPRETER:
        pytest.skip(_NO_INTERPRETER)
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    return "triton"


@pytest.fixture
def reference_backend(monkeypatch) -> str:
    monkeypatch.setenv("SAFEOPS_BACKEND", "reference")
    return "reference"


# --------------------------------------------------------------------------------------------------
# bench/ files that tests exercise on the CPU
# --------------------------------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_module(name: str):
    """``bench/<name>.py`` imported once by path (bench/ is not a package), registered as ``name``."""
    import importlib.util
    import sys

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
