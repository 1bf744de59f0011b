"""PagedStateCheckpointSpec: derived once from the pool plan, frozen, validated (contract 6)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from atom_runtime.state.checkpoint_spec import (
    PagedStateCheckpointSpec,
    StatePoolPlan,
    StateTensorShape,
    gated_deltanet_state_tensors,
)


def _plan(**overrides) -> StatePoolPlan:
    kw = dict(
        block_size=16,
        num_attention_layers=2,
        num_kv_heads=2,
        head_dim=64,
        kv_dtype=torch.bfloat16,
        state_tensors=gated_deltanet_state_tensors(
            num_layers=6,
            conv_dim=384,
            conv_kernel=4,
            num_v_heads=4,
            head_k_dim=32,
            head_v_dim=32,
            conv_dtype=torch.bfloat16,
            state_dtype=torch.float32,
        ),
    )
    kw.update(overrides)
    return StatePoolPlan(**kw)


def test_spec_from_plan_counts_bytes_and_units():
    spec = PagedStateCheckpointSpec.from_plan(_plan())
    # KV block: 2 (K,V) x 2 layers x 16 tokens x 2 heads x 64 dims x 2 bytes.
    assert spec.page_unit_bytes == 2 * 2 * 16 * 2 * 64 * 2 == 16384
    # Per GDN layer: conv 384 x 3 x 2 bytes + recurrent 4 x 32 x 32 x 4 bytes.
    per_layer = 384 * 3 * 2 + 4 * 32 * 32 * 4
    assert spec.image_bytes == spec.slot_bytes == 6 * per_layer == 112128
    assert spec.units_per_image == 7  # ceil(112128 / 16384)
    assert spec.padded_image_bytes == 7 * 16384


def test_units_per_image_is_exact_when_the_image_fills_whole_units():
    spec = PagedStateCheckpointSpec(
        page_unit_bytes=100, slot_bytes=300, image_bytes=300, layout_id="x"
    )
    assert spec.units_per_image == 3
    assert PagedStateCheckpointSpec(100, 301, 301, "x").units_per_image == 4
    assert PagedStateCheckpointSpec(100, 1, 1, "x").units_per_image == 1


def test_spec_is_frozen():
    spec = PagedStateCheckpointSpec(100, 300, 300, "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.page_unit_bytes = 7


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(page_unit_bytes=0), "page_unit_bytes"),
        (dict(page_unit_bytes=-4), "page_unit_bytes"),
        (dict(page_unit_bytes=4.0), "page_unit_bytes"),
        (dict(page_unit_bytes=True), "page_unit_bytes"),
        (dict(slot_bytes=0), "slot_bytes"),
        (dict(image_bytes=0), "image_bytes"),
        (dict(image_bytes=400), "image_bytes"),  # larger than the slot
        (dict(layout_id=""), "layout_id"),
        (dict(layout_id=7), "layout_id"),
    ],
)
def test_spec_refuses_bad_fields_naming_them(kwargs, field):
    base = dict(page_unit_bytes=100, slot_bytes=300, image_bytes=300, layout_id="x")
    base.update(kwargs)
    with pytest.raises(ValueError, match=f"^{field}"):
        PagedStateCheckpointSpec(**base)


def test_layout_id_changes_with_any_layout_fact_and_only_then():
    a = _plan().layout_id
    assert _plan().layout_id == a
    assert _plan(block_size=32).layout_id != a
    assert _plan(kv_dtype=torch.float16).layout_id != a
    other_state = gated_deltanet_state_tensors(6, 384, 4, 4, 32, 32, "bfloat16", "bfloat16")
    assert _plan(state_tensors=other_state).layout_id != a


def test_plan_accepts_dtype_names_and_refuses_unknown_ones():
    assert _plan(kv_dtype="float16").kv_dtype is torch.float16
    with pytest.raises(ValueError, match="^kv_dtype"):
        _plan(kv_dtype="float99")
    with pytest.raises(ValueError, match=r"^x\.dtype"):
        StateTensorShape("x", (2,), "nope")


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(block_size=0), "block_size"),
        (dict(num_attention_layers=0), "num_attention_layers"),
        (dict(num_kv_heads=-1), "num_kv_heads"),
        (dict(head_dim=0), "head_dim"),
        (dict(state_tensors=()), "state_tensors"),
    ],
)
def test_plan_refuses_bad_dims_naming_them(overrides, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        _plan(**overrides)


def test_plan_refuses_duplicate_state_tensor_names_and_bad_shapes():
    t = StateTensorShape("a", (2, 3), torch.float32)
    with pytest.raises(ValueError, match="duplicate"):
        _plan(state_tensors=(t, t))
    with pytest.raises(ValueError, match=r"^a\.shape\[1\]"):
        StateTensorShape("a", (2, 0), torch.float32)
    with pytest.raises(ValueError, match="^conv_kernel"):
        gated_deltanet_state_tensors(1, 8, 1, 1, 4, 4, "float32", "float32")
