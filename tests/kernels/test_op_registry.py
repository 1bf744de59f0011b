"""Every op is declared once in `ops` (`@op`): its torch reference and its Triton body take
exactly the declared parameters (the Triton body may add keyword-only launch knobs with
defaults), so a call that passes the op's check fits both backends."""

from __future__ import annotations

import inspect

import pytest

from atom_kernels import ops


def _params(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", sorted(ops.OPS))
def test_implementations_take_the_declared_parameters(kernels, name):
    declared = ops.OPS[name]
    assert getattr(ops, name).op is declared
    want = _params(declared.check)
    assert _params(declared.reference) == want, f"reference.{name}"
    if declared.triton_path is not None:
        got = _params(declared.triton_impl())
        # Launch-tuning knobs may follow, keyword-only with defaults (tests and sweeps set them).
        assert got[: len(want)] == want, declared.triton_path
        for _name, kind, default in got[len(want) :]:
            assert kind == inspect.Parameter.KEYWORD_ONLY and default is not inspect.Parameter.empty


def test_every_op_module_function_is_registered():
    """A public function of `ops` that takes tensors is an op (or the backend helpers)."""
    helpers = {"refresh_backend", "backend_for", "op"}
    public = {
        n for n, f in vars(ops).items()
        if callable(f) and not n.startswith("_") and not isinstance(f, type)
        and getattr(f, "__module__", ops.__name__) == ops.__name__
    }  # fmt: skip
    assert public - helpers == set(ops.OPS)


def test_dispatch_follows_the_declared_argument(monkeypatch):
    """`rotary_embedding_` dispatches on q (its second argument), passed by position or name."""
    import torch

    seen = []
    declared = ops.OPS["rotary_embedding_"]
    monkeypatch.setattr(declared, "reference", lambda *a, **k: seen.append((a, k)))
    q = torch.zeros(2, 1, 4)
    cache = torch.zeros(8, 4)
    positions = torch.zeros(2, dtype=torch.int64)
    ops.rotary_embedding_(positions, q, q.clone(), cache)
    ops.rotary_embedding_(positions, q=q, k=q.clone(), cos_sin_cache=cache, is_neox=False)
    assert len(seen) == 2 and seen[1][1]["is_neox"] is False
    with pytest.raises(ValueError, match="rotary_dim"):
        ops.rotary_embedding_(positions, q, q.clone(), torch.zeros(8, 6))
