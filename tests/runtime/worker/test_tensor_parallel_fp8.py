"""FP8 checkpoints under tensor parallelism (2 ranks over gloo, CPU): each rank places its part
of every scale (block rows or columns, per-channel rows, per-tensor values of fused parts) where
its part of the weight goes, so the dequantized shards give the tokens one rank gives on the
dequantized twin."""

from __future__ import annotations

import pytest

from tests.fp8_checkpoints import write_fp8_checkpoint
from tests.runtime.worker.test_tensor_parallel import _run

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leftover_tp_workers")]


@pytest.mark.parametrize(
    "kind, layout", [("llama", "block"), ("qwen3", "channel"), ("llama", "tensor")]
)
def test_tp2_fp8_checkpoint_equals_one_rank_on_its_twin(tiny_models, tmp_path, kind, layout):
    # Blocks of 16 rows: every rank's q, k and v parts start on a block (k and v are 16 rows a
    # rank in the tiny llama).
    fp8_dir, twin = write_fp8_checkpoint(tiny_models[kind], tmp_path, layout, block=16)
    assert _run(fp8_dir, 2) == _run(twin, 1)


def test_tp2_fp8_checkpoint_through_the_safetensors_library_equals_its_twin(tiny_models, tmp_path):
    """`--load-format safetensors`: each rank narrows the lazy tensors (weights and scales)."""
    fp8_dir, twin = write_fp8_checkpoint(tiny_models["llama"], tmp_path, "block", block=16)
    assert _run(fp8_dir, 2, load_format="safetensors") == _run(twin, 1)


def test_tp2_fp8_hybrid_moe_equals_one_rank_on_its_twin(tiny_hybrid_models, tmp_path):
    """Qwen3-Next: FP8 attention and shared-expert layers split by rank, and what is dequantized
    at load (the GDN in_proj, whose loader reorders rows; the routed experts) read whole and then
    split, as in bf16."""
    fp8_dir, twin = write_fp8_checkpoint(tiny_hybrid_models["qwen3_next"], tmp_path, "block", 16)
    assert _run(fp8_dir, 2) == _run(twin, 1)
