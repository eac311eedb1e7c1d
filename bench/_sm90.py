"""Build statistics of a Triton kernel compiled offline for sm_90: registers, spill bytes and SASS.

Triton only (no torch), so the variant benches' ``--compile-only`` runs in a Triton venv without a GPU. The
binary is rebuilt with the ptxas Triton ships, ``--fmad=false`` as Triton itself builds a kernel launched
with ``enable_fp_fusion=False`` (otherwise the counts would be of a binary with contracted FFMAs), and
disassembled with its ``cuobjdump``.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton


def nvidia_bin(name: str) -> str:
    """A tool from the NVIDIA toolchain bundled with Triton (ptxas, cuobjdump, ...)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def opcode(text: str) -> str:
    """The opcode of one SASS instruction's text, a ``@P0``-style predicate skipped."""
    t = text.split(None, 1)[1] if text.startswith("@") and " " in text else text
    return t.split()[0] if t.split() else ""


def keep_compiled() -> list:
    """Wraps ``triton.compile`` so that every kernel it builds is appended to the returned list: the offline
    stats workers let a compile worker build a kernel, then read its binary from there."""
    kept = []
    compile_ = triton.compile

    def keep(*args, **kwargs):
        compiled = compile_(*args, **kwargs)
        kept.append(compiled)
        return compiled

    triton.compile = keep
    return kept


def binary_stats(compiled) -> tuple[int, int, str]:
    """(registers, spill-store bytes, SASS) of a CompiledKernel for sm_90a; -1 where ptxas said nothing.
    Triton 3.9's PTX needs the newer of its two ptxas binaries (ptxas-blackwell): the first that accepts the
    PTX is used. A ``.maxnreg`` in the PTX is passed on as ``--maxrregcount``."""
    ptx_text = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(ptx_text)
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        report = ""
        maxnreg = re.search(r"\.maxnreg\s+(\d+)", ptx_text)
        for ptxas in ("ptxas", "ptxas-blackwell"):
            if not os.path.exists(nvidia_bin(ptxas)):
                continue
            cmd = [nvidia_bin(ptxas), "-v", "--fmad=false", "--gpu-name", "sm_90a", ptx, "-o", "/dev/null"]
            if maxnreg:
                cmd[2:2] = ["--maxrregcount", maxnreg.group(1)]
            report = subprocess.run(cmd, capture_output=True, text=True).stderr
            if "Used" in report:
                break
        sass = subprocess.run([nvidia_bin("cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True).stdout
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores", report)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else -1, sass
