"""The few-row product (`gemv_rows.linear_few_rows`, a verify step's projections) against
`F.linear` on awkward shapes (N and K not multiples of the blocks), with and without bias and
SwiGLU, K split or not; under TRITON_INTERPRET=1 on CPU in fp32 and fp16."""

from __future__ import annotations

import pytest
import torch

from atom_kernels import ops, reference

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(scope="module")
def rows_module(kernels):
    return kernels["gemv_rows"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("m", "act", "with_bias", "split"),
    [(2, None, False, 1), (5, None, True, 3), (8, "silu_mul", False, 1), (16, "silu_mul", True, 2)],
)
def test_matches_the_reference(rows_module, device, dtype, m, act, with_bias, split):
    g = torch.Generator().manual_seed(m)
    n, k = (2 * 90, 300) if act else (200, 300)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if with_bias else None
    config = {"block_n": 32, "block_k": 64, "split": split, "num_warps": 4}
    got = rows_module.linear_few_rows(x, w, b, act=act, config=config)
    want = reference.linear_few_rows(x.float(), w.float(), b.float() if b is not None else None,
                                     act=act).to(dtype)  # fmt: skip
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_a_strided_row_view_and_the_rules_shape(rows_module, device):
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(4, 150, generator=g).to(device)
    x = wide[:, 10:138]  # rows 150 apart, 128 wide
    w = torch.randn(70, 128, generator=g).to(device)
    torch.testing.assert_close(
        rows_module.linear_few_rows(x, w), torch.nn.functional.linear(x, w), **TOL[torch.float32]
    )


def test_the_op_refuses_what_it_cannot_take():
    w = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="2 <= M <= 16"):
        ops.linear_few_rows(torch.zeros(1, 4), w)
    with pytest.raises(ValueError, match="2 <= M <= 16"):
        ops.linear_few_rows(torch.zeros(17, 4), w)
    with pytest.raises(ValueError, match="odd N"):
        ops.linear_few_rows(torch.zeros(3, 4), torch.zeros(7, 4), act="silu_mul")
