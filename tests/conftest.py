"""Shared fixtures: backend switching, fresh random seeds, the gpu marker.

``import safeops`` comes first: on a machine without a GPU it turns on Triton's interpreter
(TRITON_INTERPRET=1), which only works if it happens before anything imports triton or torch._dynamo.
"""

import safeops  # noqa: F401, I001  (must be first, see the module docstring)

import os
import secrets

import pytest
import torch

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
SEED_ENV = "SAFEOPS_TEST_SEED"


def pytest_configure(config):
    # numpy warns (overflow, 0/0, inf - inf) while Triton's interpreter evaluates a kernel on masked-off
    # lanes and on -inf sentinels; the kernels select those values away. The tests check the results.
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")
    # Raised from inside torch by opcheck / torch.compile, not by safeops.
    config.addinivalue_line("filterwarnings",
                            "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def pytest_collection_modifyitems(config, items):
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
# Fresh random inputs, reproducible from the seed printed in every failure
# --------------------------------------------------------------------------------------------------


class Seed:
    """A fresh seed per test (or SAFEOPS_TEST_SEED to replay one) and a torch.Generator on it."""

    def __init__(self, value: int):
        self.value = value
        self.gen = torch.Generator().manual_seed(value)

    def __str__(self) -> str:
        return f"seed={self.value} (replay with {SEED_ENV}={self.value})"

    __repr__ = __str__

    def randn(self, *shape: int, dtype=torch.float32, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=self.gen, dtype=torch.float64) * std).to(dtype)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen, dtype=torch.float64)

    def mask(self, *shape, keep: float = 0.7) -> torch.Tensor:
        return self.rand(*shape) < keep

    def randint(self, low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.gen)

    def uniform(self, low: float, high: float) -> float:
        return low + (high - low) * float(self.rand())


@pytest.fixture
def seed(request) -> Seed:
    value = int(os.environ[SEED_ENV]) if SEED_ENV in os.environ else secrets.randbits(31)
    request.node.user_properties.append(("seed", value))
    request.node._safeops_seed = value
    print(f"{request.node.nodeid}: seed={value}")
    return Seed(value)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    value = getattr(item, "_safeops_seed", None)
    if value is not None and report.failed:
        report.sections.append(("safeops seed", f"{SEED_ENV}={value} pytest '{item.nodeid}'"))
    return report


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
