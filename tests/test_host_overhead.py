"""The eager paths' host-cost shortcuts (bench/RESULTS.md, host overhead) change no result and drop no check.

- SAFEOPS_BACKEND is still read on every call: only the parsing of an entry already seen is cached, and an
  invalid value raises on every call, also after valid ones.
"""

from __future__ import annotations

import os

import pytest
import torch

import safeops
from safeops import _config


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), what
    assert torch.equal(_bits(a), _bits(b)), what


# --------------------------------------------------------------------------------------------------
# SAFEOPS_BACKEND
# --------------------------------------------------------------------------------------------------


def test_backend_follows_every_change_of_the_environment(monkeypatch):
    monkeypatch.delenv("SAFEOPS_BACKEND", raising=False)
    assert _config.backend_name() == "auto"
    for value, name in [("triton", "triton"), (" Reference ", "reference"), ("", "auto"), ("AUTO", "auto"),
                        ("reference", "reference"), ("triton", "triton")]:
        monkeypatch.setenv("SAFEOPS_BACKEND", value)
        assert _config.backend_name() == name, value
    os.environ["SAFEOPS_BACKEND"] = "reference"  # set directly, as users do
    assert _config.backend_name() == "reference"
    del os.environ["SAFEOPS_BACKEND"]
    assert _config.backend_name() == "auto"
    cpu = torch.zeros(1)
    assert not _config.use_triton(cpu)
    monkeypatch.setenv("SAFEOPS_BACKEND", "triton")
    assert _config.use_triton(cpu)


def test_invalid_backend_raises_on_every_call(monkeypatch):
    for value in ("bogus", "triton", "bogus", "tritonx", "reference", "bogus"):
        monkeypatch.setenv("SAFEOPS_BACKEND", value)
        if value in ("triton", "reference"):
            assert _config.backend_name() == value
            continue
        with pytest.raises(ValueError, match="SAFEOPS_BACKEND must be one of"):
            _config.backend_name()
        with pytest.raises(ValueError, match="SAFEOPS_BACKEND"):
            safeops.softmax(torch.zeros(2, 3))
