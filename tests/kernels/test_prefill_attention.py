"""The prefill kernel's launch variants against the torch reference: split-KV with its merge,
query heads of a GQA group packed into one program, the three block-table lookups, loop
pipelining, head_dim 128 and 256; and the host-side choices (splits, heads per program,
lookup), which must depend on shapes alone.

Without a GPU these run under TRITON_INTERPRET=1 on CPU tensors in fp32 and fp16 (see
conftest.py). Unused cache slots hold NaN, so a read past a mask shows up as a mismatch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_cases import make_paged_case

from atom_kernels import reference

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}

# (cached prefix, chunk) per sequence: a long prefix ending mid-page under a chunk that is no
# multiple of the tile; a whole prompt; a decode row over one cached token; an empty chunk;
# a chunk of exactly one 16-row tile over a prefix ending mid-page.
SHAPES = [(290, 37), (0, 45), (1, 1), (130, 0), (75, 16)]


def _inputs(shapes, *, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed,
            table_width=None):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + c for p, c in shapes]
    q_lens = [c for _, c in shapes]
    case = make_paged_case(
        seq_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        generator=g,
    )
    tables = case.block_tables
    if table_width is not None:  # a wider table: a longer possible context, same contents
        pad = torch.full((tables.shape[0], table_width - tables.shape[1]), -1, dtype=torch.int32)
        tables = torch.cat([tables, pad], dim=1)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (
        q.to(device),
        case.k_cache.to(device),
        case.v_cache.to(device),
        cu.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        tables.to(device),
        head_dim**-0.5,
        max(q_lens),
    )


VARIANTS = [
    # (num_heads, num_kv_heads, head_dim, block_size, launch overrides)
    pytest.param(4, 2, 128, 16, dict(block_m=32, block_n=16, heads_per_program=2,
                                     kv_lookup="page", num_splits=3), id="gqa2-d128-page-split3"),
    pytest.param(8, 2, 64, 8, dict(block_m=32, block_n=32, heads_per_program=4,
                                   kv_lookup="page", num_splits=5), id="gqa4-d64-page8-split5"),
    pytest.param(4, 2, 128, 16, dict(block_m=32, block_n=16, heads_per_program=1,
                                     kv_lookup="row", num_splits=4), id="gqa2-d128-row-split4"),
    pytest.param(6, 2, 96, 24, dict(block_m=16, block_n=16, heads_per_program=1,
                                    kv_lookup="row", num_splits=4), id="gqa3-d96-page24-split4"),
    pytest.param(2, 2, 32, 32, dict(block_m=16, block_n=16, kv_lookup="tile", num_splits=7),
                 id="mha-d32-tile-split7"),
    pytest.param(4, 2, 256, 16, dict(block_m=16, block_n=16, heads_per_program=2,
                                     num_splits=2), id="gqa2-d256-split2"),
    pytest.param(4, 1, 128, 16, dict(block_m=32, block_n=16, heads_per_program=4,
                                     kv_lookup="page", num_splits=1), id="gqa4-d128-page-nosplit"),
    pytest.param(4, 2, 128, 16, dict(block_m=32, block_n=16, heads_per_program=2,
                                     num_splits=3, loop_stages=2), id="gqa2-d128-range-split3"),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "launch"), VARIANTS
)
def test_prefill_variants_match_reference(
    kernels, device, dtype, num_heads, num_kv_heads, head_dim, block_size, launch
):
    args = _inputs(
        SHAPES,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
        seed=40,
    )
    want = reference.paged_attention_prefill(*args)
    got = kernels["prefill_attention"].paged_attention_prefill(*args, **launch)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_split_where_some_rows_see_no_key_of_a_split(kernels, device):
    """A whole 45-token prompt in 32-query tiles cut into 4 splits: in the first tile the
    second split covers keys 16..31, which queries 0..15 cannot see (their partial max is
    -inf), and the last splits of each tile start past its keys. The merge must weigh each
    row by what it saw."""
    args = _inputs(
        [(0, 45)],
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        block_size=8,
        dtype=torch.float32,
        device=device,
        seed=41,
    )
    want = reference.paged_attention_prefill(*args)
    prefill = kernels["prefill_attention"].paged_attention_prefill
    for splits in (2, 4):
        got = prefill(*args, block_m=32, block_n=16, heads_per_program=1, num_splits=splits)
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_automatic_split_engages_on_a_short_chunk_over_a_long_context(kernels, device, monkeypatch):
    """W3's shape in miniature: one short chunk over a long cached prefix gives few
    programs, so on a device with many multiprocessors the launch splits the keys; the
    result matches the reference and the unsplit launch."""
    mod = kernels["prefill_attention"]
    args = _inputs(
        [(700, 20), (3, 5)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=device,
        seed=42,
        table_width=64,  # 1024 possible tokens per sequence: room for 4 splits of 256
    )
    monkeypatch.setattr(mod, "_multiprocessor_count", lambda _device: 132)
    launched = []
    real_merge = mod._prefill_merge_kernel
    monkeypatch.setattr(
        mod, "_prefill_merge_kernel", _Spy(real_merge, lambda grid: launched.append(grid))
    )
    got = mod.paged_attention_prefill(*args, block_m=64, block_n=16)
    assert launched, "expected the split path (and its merge) on this shape"
    want = reference.paged_attention_prefill(*args)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    unsplit = mod.paged_attention_prefill(*args, block_m=64, block_n=16, num_splits=1)
    torch.testing.assert_close(got, unsplit, **TOL[torch.float32])


class _Spy:
    """Stands in for a Triton kernel: records each launch's grid, then launches it."""

    def __init__(self, kernel, record) -> None:
        self.kernel, self.record = kernel, record

    def __getitem__(self, grid):
        self.record(grid)
        return self.kernel[grid]


def test_split_result_written_into_out_and_padding_rows_untouched(kernels, device):
    """With splits, the merge writes every real row into `out` and leaves rows past the last
    chunk (padding tokens) as they were."""
    args = list(
        _inputs(
            [(40, 7)],
            num_heads=2,
            num_kv_heads=2,
            head_dim=32,
            block_size=8,
            dtype=torch.float32,
            device=device,
            seed=43,
        )
    )
    q = args[0]
    padded = torch.cat([q, torch.randn(3, *q.shape[1:], device=device)])
    args[0] = padded
    out = torch.full_like(padded, 7.0)
    got = kernels["prefill_attention"].paged_attention_prefill(
        *args, out, block_m=16, block_n=16, num_splits=3
    )
    assert got is out
    want = reference.paged_attention_prefill(q, *args[1:])
    torch.testing.assert_close(out[:7], want, **TOL[torch.float32])
    assert torch.equal(out[7:], torch.full_like(out[7:], 7.0))


def test_choose_prefill_splits_depends_on_shapes_only(kernels):
    choose = kernels["prefill_attention"].choose_prefill_splits
    h200 = 132
    # W3 on Qwen3-0.6B: 8 programs (8 KV groups of 2 heads, one 64-query tile), 8,064 keys.
    assert choose(8, 8064, 64, h200) == 16
    assert choose(16, 8064, 64, h200) == 8  # one head a program: half the splits
    assert choose(1, 100_000, 64, h200) == 32  # capped
    assert choose(8, 1000, 64, h200) == 3  # at least 256 keys a split
    assert choose(8, 200, 64, h200) == 1  # too short to be worth a merge
    assert choose(512, 8192, 64, h200) == 1  # a long prompt fills the device alone
    assert choose(70, 8192, 64, h200) == 1  # more than half the device: no split


def test_choose_heads_per_program(kernels):
    choose = kernels["prefill_attention"].choose_heads_per_program
    assert choose(2, 128, 64) == 2  # W3 on Qwen3-0.6B: 64 queries x 2 heads fill 128 rows
    assert choose(4, 128, 64) == 2
    assert choose(4, 128, 1) == 4  # decode rows: the whole group
    assert choose(8, 64, 3) == 8  # 4 rows a head would do 16; the group caps it at 8
    assert choose(4, 128, 8192) == 1  # long chunks fill the tile with queries
    assert choose(6, 128, 1) == 2  # largest power of two dividing 6
    assert choose(3, 128, 1) == 1
    assert choose(1, 128, 1) == 1


def test_choose_kv_lookup(kernels):
    choose = kernels["prefill_attention"].choose_kv_lookup
    assert choose(128, 64) == "tile"
    assert choose(64, 64) == "tile"
    assert choose(16, 64) == "row"
    assert choose(24, 16) == "row"
    assert choose(48, 16) == "tile"


@pytest.mark.parametrize(
    ("launch", "message"),
    [
        (dict(block_m=48), "block_m=48"),
        (dict(heads_per_program=3), "heads_per_program=3"),
        (dict(heads_per_program=4), "heads_per_program=4"),  # the group is 2
        (dict(block_n=16, kv_lookup="tile"), "kv_lookup='tile'"),  # page 8
        (dict(block_n=16, kv_lookup="pages"), "kv_lookup='pages'"),
        (dict(num_splits=0), "num_splits=0"),
    ],
)
def test_bad_launch_settings_raise(kernels, device, launch, message):
    args = _inputs(
        [(3, 5)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=8,
        dtype=torch.float32,
        device=device,
        seed=44,
    )
    with pytest.raises(ValueError, match=message):
        kernels["prefill_attention"].paged_attention_prefill(*args, **launch)


def _long(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "short_chunks"}


def test_defaults_per_vendor_and_head_dim(kernels, monkeypatch):
    mod = kernels["prefill_attention"]
    defaults = mod.PREFILL_DEFAULTS
    monkeypatch.setattr(torch.version, "hip", None)
    assert mod.prefill_config(128) == _long(defaults[("cuda", 128)])
    assert mod.prefill_config(96) == _long(defaults[("cuda", 128)])
    assert mod.prefill_config(256) == _long(defaults[("cuda", 256)])
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert mod.prefill_config(64) == _long(defaults[("hip", 128)])
    assert mod.prefill_config(256) == _long(defaults[("hip", 256)])
    for table in (mod.PREFILL_CANDIDATES, mod.SHORT_CHUNK_CANDIDATES):
        for bucket, candidates in table.items():
            assert bucket in (128, 256)
            assert len({name for name, _ in candidates}) == len(candidates)


def test_short_chunk_overrides_apply_only_to_short_chunks(kernels, monkeypatch):
    """An entry's "short_chunks" settings replace its own for launches whose chunks are all
    at most SHORT_CHUNK_TOKENS long, and only for them."""
    mod = kernels["prefill_attention"]
    monkeypatch.setattr(torch.version, "hip", None)
    entry = dict(block_m=128, block_n=64, num_warps=4, num_stages=3,
                 short_chunks=dict(num_warps=8, block_n=128))  # fmt: skip
    monkeypatch.setitem(mod.PREFILL_DEFAULTS, ("cuda", 128), entry)
    mod._defaults.cache_clear()
    mod._plan.cache_clear()
    try:
        short = mod.SHORT_CHUNK_TOKENS
        assert mod.prefill_config(128, short) == dict(block_m=128, block_n=128, num_warps=8,
                                                      num_stages=3)  # fmt: skip
        assert mod.prefill_config(128, short + 1) == _long(entry)
        assert mod.prefill_config(128) == _long(entry)
    finally:
        mod._defaults.cache_clear()
        mod._plan.cache_clear()


def test_plans_for_w3_and_a_long_prompt_on_an_h200(kernels, monkeypatch):
    """W3 on Qwen3-0.6B (16 q / 8 KV heads, 64 new tokens over 8,000 cached, block 16): both
    heads of a KV group in one 128-row program, one query tile, 16 splits, per-row lookups.
    One 8k prompt: one head a program, 64 tiles, no split."""
    mod = kernels["prefill_attention"]
    monkeypatch.setattr(torch.version, "hip", None)
    shapes = dict(num_heads=16, num_kv_heads=8, head_dim=128, page_size=16, batch=1,
                  num_multiprocessors=132, block_m=128, block_n=64)  # fmt: skip
    w3 = mod.plan_prefill_launch(**shapes, max_seqlen_q=64, max_context=504 * 16)
    assert (w3.heads_per_program, w3.num_tiles, w3.num_splits, w3.kv_lookup) == (2, 1, 16, "row")
    long = mod.plan_prefill_launch(**shapes, max_seqlen_q=8192, max_context=8192)
    assert (long.heads_per_program, long.num_tiles, long.num_splits) == (1, 64, 1)
    forced = mod.plan_prefill_launch(**{**shapes, "block_m": 64}, max_seqlen_q=64,
                                     max_context=8064, num_splits=3, heads_per_program=1)  # fmt: skip
    assert (forced.heads_per_program, forced.num_tiles, forced.num_splits) == (1, 1, 3)


def test_reachable_launches_cover_every_step_the_engine_can_run(kernels, monkeypatch):
    """The start-up warm-up compiles `reachable_launches`: every (chunk length, batch, context)
    a Qwen3-0.6B-shaped engine can run on an H200 must plan a launch of one of those variants
    (W3's single request and its 61 at once among them), and there are few of them."""
    mod = kernels["prefill_attention"]
    monkeypatch.setattr(torch.version, "hip", None)
    dims = dict(num_heads=16, num_kv_heads=8, head_dim=128, page_size=16)
    launches = mod.reachable_launches(
        **dims, max_num_seqs=256, max_tokens=8192, max_context=40960, num_multiprocessors=132
    )
    variants = {mod._variant(launch) for launch in launches}
    assert len(variants) == len(launches) <= 24
    gen = torch.Generator().manual_seed(3)
    shapes = [(1, 64, 8064), (61, 64, 8064), (1, 8192, 8192), (2, 8000, 8192), (256, 1, 40960)]
    for _ in range(400):
        batch = int(torch.randint(1, 257, (1,), generator=gen))
        q = int(torch.randint(1, 8192 - batch + 2, (1,), generator=gen))
        context = int(torch.randint(q, 40961, (1,), generator=gen))
        shapes.append((batch, q, context))
    for batch, q, context in shapes:
        width = -(-context // 16)
        plan = mod.plan_prefill_launch(**dims, batch=batch, max_seqlen_q=q,
                                       max_context=width * 16, num_multiprocessors=132)  # fmt: skip
        assert mod._variant(plan) in variants, (batch, q, context, plan)


def test_warm_up_runs_each_variant_once_without_touching_the_cache(kernels, device):
    """The warm-up launches each variant on one token over one page; the caches are only read."""
    mod = kernels["prefill_attention"]
    args = _inputs([(20, 1)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                   dtype=torch.float32, device=device, seed=5)  # fmt: skip
    _, k_cache, v_cache, *_ = args
    k_before, v_before = k_cache.clone(), v_cache.clone()
    shape = dict(num_heads=4, num_kv_heads=2, head_dim=32, page_size=16, batch=1,
                 max_seqlen_q=1, max_context=32, num_multiprocessors=4, block_m=16, block_n=16)  # fmt: skip
    launches = [mod.plan_prefill_launch(**shape, num_splits=splits) for splits in (1, 3)]
    # A variant that cannot be built is reported and the others are compiled all the same.
    bad = dataclasses.replace(launches[0], heads_per_program=3)
    failed = mod.warm_up(k_cache, v_cache, 4, (4 + 2 * 2) * 32, 32**-0.5, [bad, *launches])
    assert [launch for launch, _ in failed] == [bad]
    assert "heads_per_program=3" in str(failed[0][1])
    assert torch.equal(k_cache.nan_to_num(7.0), k_before.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_before.nan_to_num(7.0))
