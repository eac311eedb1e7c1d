"""Offline compilation for sm_90 in a fresh interpreter, shared by the PTX tests.

The tests' own process runs Triton's interpreter (``import safeops`` turned it on); compiling for a GPU needs
a process without it, and without a visible GPU, so the compile targets sm_90 whatever this machine is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def triton36_python() -> str | None:
    """A Python with the GPU machine's Triton (3.6) for offline compiles, if one is around:
    ``SAFEOPS_COMPILE_PYTHON``, else /tmp/t36 (``python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install
    triton==3.6.0 numpy``). It has no torch: scripts run there load kernel files by path."""
    for candidate in (os.environ.get("SAFEOPS_COMPILE_PYTHON"), "/tmp/t36/bin/python"):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def compiler_python() -> str:
    """:func:`triton36_python`, else this process's Python (the Triton installed here)."""
    return triton36_python() or sys.executable


def run_script(script: str, *args: str, what: str, timeout: int = 600, python: str | None = None):
    """Runs ``script`` (which compiles kernels and prints JSON as its last line) with ``python`` (default:
    this process's) and returns that JSON.

    Skips when Triton's bundled ptxas is missing; fails with the script's stderr otherwise."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([python or sys.executable, "-c", script, *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    if proc.returncode != 0:
        if "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
            pytest.skip("Triton's bundled ptxas is missing: cannot compile for sm_90 here")
        raise AssertionError(f"compiling {what} for sm_90 failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
