"""The examples in examples/ run from a clean clone and show what they claim."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_train_tiny_transformer_example():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("SAFEOPS_BACKEND", None)
    script = ROOT / "examples" / "train_tiny_transformer.py"
    run = subprocess.run([sys.executable, str(script), "--steps", "6"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = {line.split(":")[0].strip(): line for line in run.stdout.splitlines() if ":" in line}
    assert "NaN losses: 6 of 6" in lines["stock PyTorch"], run.stdout  # the failure the example is about
    assert "NaN losses: 0 of 6" in lines["with safeops"], run.stdout
    assert "4 replaced" in run.stdout and "come from: torch" in run.stdout, run.stdout
