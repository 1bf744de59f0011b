"""Shared test configuration: GPU-only tests skip with a reason when no GPU is present."""

from __future__ import annotations

import pytest


def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Folders of small random models by kind: llama, llama3, qwen2, qwen3 (built once)."""
    from tests.model_factory import CONFIGS, make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {kind: make_tiny_model(root / kind, kind) for kind in CONFIGS}


@pytest.fixture(scope="session")
def tiny_hybrid_models(tmp_path_factory):
    """Folders of small random hybrid models: qwen3_5, qwen3_5_moe, qwen3_next (built once)."""
    from tests.model_factory import HYBRID_CONFIGS, make_tiny_model

    root = tmp_path_factory.mktemp("hybrid_models")
    return {kind: make_tiny_model(root / kind, kind) for kind in HYBRID_CONFIGS}
