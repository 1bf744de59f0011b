"""The compile cache (worker/compile_cache.py): keyed by device and versions, kept on disk, and a
second start with the same key skips the batch-1 kernel timing (worker/kernel_choice.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from atom_runtime.worker import kernel_choice
from atom_runtime.worker.compile_cache import CompileCache, cache_key, default_cache_dir


def test_the_key_names_the_device_and_every_version():
    key = cache_key(torch.device("cpu"))
    assert key["gpu"] == "cpu" and key["torch"] == torch.__version__
    assert {"atom", "triton"} <= key.keys()
    a = CompileCache("/tmp/x", {**key, "driver": "1"})
    b = CompileCache("/tmp/x", {**key, "driver": "2"})
    assert a.dir != b.dir and a.dir.parent == b.dir.parent


def test_default_dir_is_under_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "atom" / "compile"
    assert CompileCache(None, {"gpu": "x"}).dir.parent == tmp_path / "atom" / "compile"


def test_prepare_points_triton_there_and_timings_survive_a_restart(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    key = {"gpu": "NVIDIA H200", "driver": "570", "torch": "2.13", "triton": "3.9", "atom": "0.1"}
    first = CompileCache(tmp_path, key).prepare()
    assert os.environ["TRITON_CACHE_DIR"] == str(first.dir / "triton")
    assert json.loads((first.dir / "key.json").read_text()) == key
    first.put_path("auto", "rmsnorm+1024x2048", "gemv+norm")
    first.put_launch_shape("auto", 1024, 2048, {"block_n": 8, "num_warps": 4})
    first.save()
    again = CompileCache(tmp_path, key)
    assert again.path("auto", "rmsnorm+1024x2048") == "gemv+norm"
    assert again.launch_shape("auto", 1024, 2048) == {
        "block_n": 8, "num_warps": 4,
    }  # fmt: skip
    assert again.path("checked", "rmsnorm+1024x2048") is None  # other mode


def _half_precision_llama(tiny_models):
    from atom_runtime.models.loader import build_model
    from atom_runtime.models.source import load_model_config

    folder = tiny_models["llama"]
    return build_model(
        folder, load_model_config(folder), "auto", torch.float16, torch.device("cpu")
    )


def test_a_second_start_with_the_same_key_skips_the_timing(tiny_models, tmp_path, monkeypatch):
    """The first start times every group and keeps the results; the second finds them all and
    times nothing (the timing functions would fail here: there is no GPU)."""
    model = _half_precision_llama(tiny_models)
    groups = kernel_choice.small_m_groups(model)
    assert groups
    timed: list[str] = []

    def fake_time(key, layers, paths):
        timed.append(key)
        return paths[-1]

    monkeypatch.setattr(kernel_choice, "_time_group", fake_time)
    monkeypatch.setattr(kernel_choice, "tune_gemv_launch", lambda layers: {"block_n": 8})
    monkeypatch.setattr("atom_kernels.gemv.set_launch_shape", lambda n, k, cfg, **kind: None)
    cuda = torch.device("cuda")  # a device name only: nothing runs on it
    key = {"gpu": "test"}
    first = kernel_choice.choose_small_m_kernels(model, cuda, CompileCache(tmp_path, key))
    assert sorted(timed) == sorted(groups)

    def no_timing(*args, **kwargs):
        raise AssertionError("timed although the compile cache had the result")

    monkeypatch.setattr(kernel_choice, "_time_group", no_timing)
    monkeypatch.setattr(kernel_choice, "tune_gemv_launch", no_timing)
    second = kernel_choice.choose_small_m_kernels(model, cuda, CompileCache(tmp_path, key))
    assert second == first
    with pytest.raises(AssertionError, match="timed although"):
        kernel_choice.choose_small_m_kernels(model, cuda, CompileCache(tmp_path, {"gpu": "other"}))
