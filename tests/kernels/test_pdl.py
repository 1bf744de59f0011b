"""Programmatic dependent launch is only asked for where it can run (atom_kernels.pdl); the
kernels themselves run with it on in tests/runtime/worker/test_gpu_engine.py (Hopper)."""

from __future__ import annotations

import torch

from atom_kernels import pdl


def test_no_pdl_off_an_nvidia_gpu_or_when_not_asked_for(monkeypatch):
    monkeypatch.setenv("ATOM_PDL", "1")
    pdl._enabled.cache_clear()
    try:
        assert pdl.options(torch.device("cpu")) == {"PDL": False}
        assert not pdl.enabled(torch.device("cpu"))
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        pdl._enabled.cache_clear()
        assert not pdl._enabled(0)  # the interpreter has no grid dependency control
        monkeypatch.delenv("TRITON_INTERPRET")
        monkeypatch.setenv("ATOM_PDL", "0")
        pdl._enabled.cache_clear()
        assert not pdl._enabled(0)
    finally:
        pdl._enabled.cache_clear()
