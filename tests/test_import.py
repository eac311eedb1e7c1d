"""What ``import safeops`` costs: it must not load torch._dynamo / torch._inductor (seconds of import
time), and the "safeops" torch.compile backend must still be there whenever Dynamo's backend registry is.

Each case runs in a fresh interpreter (this process has long since loaded Dynamo).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_import_loads_no_dynamo_and_registers_the_backend_when_dynamo_loads():
    out = _run("""
        import inspect, sys
        import safeops
        print("dynamo", "torch._dynamo" in sys.modules, "inductor", "torch._inductor" in sys.modules)
        import torch._dynamo.backends.registry as registry
        # Registered by the import itself, before any torch.compile looks the name up.
        print("registered", "safeops" in registry._COMPILER_FNS)
        print("source", "def lookup_backend" in inspect.getsource(registry))  # the wrapped loader delegates
    """)
    assert out.split() == ["dynamo", "False", "inductor", "False", "registered", "True", "source", "True"]


def test_dtensor_rules_registered_when_dtensor_loads():
    # Not at `import safeops` (DTensor is optional and not loaded), but as soon as it is: before any trace
    # could meet an unregistered op (registering inside torch.compile(fullgraph=True) is a graph break).
    out = _run("""
        import sys
        import torch
        import safeops
        from safeops import dtensor
        loaded = "torch.distributed.tensor" in sys.modules
        print(torch.distributed.is_available(), loaded, dtensor._registered)
        import torch.distributed.tensor
        print(dtensor._registered)
    """)
    if out.split()[0] == "False":
        return  # no torch.distributed in this build: nothing to register
    assert out.split() == ["True", "False", "False", "True"]


def test_backend_registered_when_dynamo_was_loaded_first():
    out = _run("""
        import torch, torch._dynamo
        import safeops
        from torch._dynamo.backends.registry import _COMPILER_FNS, lookup_backend
        print("safeops" in _COMPILER_FNS, lookup_backend("safeops") is safeops.compile.backend)
    """)
    assert out.split() == ["True", "True"]


def test_assume_constant_result_sets_only_the_marker_safeops_sets():
    # safeops.functional marks _matmul_precision by hand (the decorator imports torch._dynamo): the decorator
    # must still do exactly that, else Dynamo would stop folding the precision string.
    from safeops import functional

    def probe():
        return "x"

    before = set(vars(probe))
    assert torch.compiler.assume_constant_result(probe) is probe
    assert set(vars(probe)) - before == {"_dynamo_marked_constant"}
    assert probe._dynamo_marked_constant is True
    assert functional._matmul_precision._dynamo_marked_constant is True
