"""First launches of risky experimental kernels in subprocesses, so a crash or a hang cannot take a whole
benchmark run down (the variant benches' ``--probe`` mode: one launch, synchronised, ``PROBE OK`` printed
when it finished with finite outputs)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def run_probes(script: str | Path, jobs: list[tuple[tuple, list[str]]], timeout: float,
               cwd: str | Path) -> dict:
    """Runs ``python script *args`` for every ``(key, args)`` in ``jobs`` concurrently; returns
    ``{key: reason}`` for those that failed, gave no ``PROBE OK`` or did not finish within ``timeout``
    seconds in all. Prints one line per probe."""
    procs = [(key, subprocess.Popen([sys.executable, str(Path(script).resolve()), *args],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    cwd=str(cwd)))
             for key, args in jobs]
    failed = {}
    t0 = time.time()
    for key, proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, timeout - (time.time() - t0)))
            if proc.returncode != 0 or "PROBE OK" not in out:
                tail = " | ".join(out.strip().splitlines()[-3:])
                failed[key] = f"probe failed (rc {proc.returncode}): {tail}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failed[key] = f"probe timed out after {timeout:.0f} s (hang?)"
        print(f"probe {key}: {failed.get(key, 'ok')}", flush=True)
    return failed
