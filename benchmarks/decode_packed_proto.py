"""Experiment: decode attention with several KV heads in one program (W1's batch-256 step).

The engine's kernel now does this itself (two heads a program at large batch,
`decode_attention.decode_heads_per_program`); this standalone version is the experiment that
chose it, kept to compare head counts and launch settings against the engine's choice.

The engine's decode kernel gave each program one KV head of one sequence, so it read each
token's K and V as a 256-byte piece of a `num_kv_heads x head_dim` row. Here a program takes
HEADS KV heads at once and reads HEADS x 256 contiguous bytes a token: its query tile is
block-diagonal (row r holds query head r's vector in its KV head's columns and zeros
elsewhere), so one `tl.dot` over all HEADS x head_dim columns gives every row its own head's
scores, and P @ V gives each row its head's output in that head's columns (the rest is
discarded). Fewer, longer programs; contiguous reads; the tensor cores do HEADS times the
(small) work. Compared with the engine's kernel (one head a program, and its own choice) on
W1's spread of contexts.

Usage: python benchmarks/decode_packed_proto.py [--check] [--out F]
(`--check` compares with the engine's kernel on small shapes, under TRITON_INTERPRET=1 too.)
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _packed_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    scale_log2,
    q_stride_b,
    q_stride_h,
    cache_stride_block,
    cache_stride_off,
    cache_stride_h,
    bt_stride_b,
    out_stride_b,
    out_stride_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_base = tl.program_id(1) * HEADS
    ctx = tl.load(context_lens_ptr + seq)

    offs_r = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, HEADS * HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    row_head = offs_r // GROUP  # the KV head (of this program's HEADS) a query row belongs to
    col_head = offs_c // HEAD_DIM
    col_dim = offs_c % HEAD_DIM
    diag = (offs_r[:, None] < HEADS * GROUP) & (row_head[:, None] == col_head[None, :])
    q_heads = kv_base * GROUP + offs_r
    q = tl.load(
        q_ptr + seq.to(tl.int64) * q_stride_b + q_heads[:, None] * q_stride_h + col_dim[None, :],
        mask=diag,
        other=0.0,
    )

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEADS * HEAD_DIM], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * bt_stride_b
    col_off = (kv_base + col_head).to(tl.int64) * cache_stride_h + col_dim
    for tile in range(0, ctx, BLOCK_N):
        pos = tile + offs_n
        valid = pos < ctx
        block = tl.load(bt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        rows = block * cache_stride_block + (pos % PAGE_SIZE) * cache_stride_off
        ptrs = rows[:, None] + col_off[None, :]
        k = tl.load(k_cache_ptr + ptrs, mask=valid[:, None], other=0.0)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + ptrs, mask=valid[:, None], other=0.0)
        if IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = (
        out_ptr
        + seq.to(tl.int64) * out_stride_b
        + q_heads[:, None] * out_stride_h
        + col_dim[None, :]
    )
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=diag)


def packed_decode(
    q, k_cache, v_cache, block_tables, context_lens, scale, *, heads, block_n, warps, stages
):
    """Decode attention, `heads` KV heads a program (unsplit). q: [B, num_heads, head_dim]."""
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert num_kv_heads % heads == 0 and triton.next_power_of_2(head_dim) == head_dim
    out = torch.empty_like(q)
    _packed_decode_kernel[(batch, num_kv_heads // heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, HEADS=heads, PAGE_SIZE=page_size,
        BLOCK_G=max(16, triton.next_power_of_2(heads * group)), BLOCK_N=block_n,
        IEEE_DOT=q.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _cache(seq_lens, num_kv_heads, head_dim, page, dtype, device):
    blocks = [(n + page - 1) // page for n in seq_lens]
    total = sum(blocks)
    k = torch.randn(total, page, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(total, page, num_kv_heads, head_dim, dtype=dtype, device=device)
    order = torch.randperm(total, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    at = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = order[at : at + nb]
        at += nb
    return k, v, tables


def check(device: str) -> None:
    """The packed kernel against the engine's, every head count, small shapes."""
    from atom_kernels import decode_attention

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    seq_lens = [1, 17, 40, 100]
    for num_heads, num_kv_heads in ((16, 8), (32, 8)):
        k, v, tables = _cache(seq_lens, num_kv_heads, 64, 16, dtype, device)
        q = torch.randn(len(seq_lens), num_heads, 64, dtype=dtype, device=device)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        ref = decode_attention.paged_attention_decode(q, k, v, tables, lens, 0.125, num_splits=1)
        for heads in (1, 2, 4, 8):
            got = packed_decode(
                q, k, v, tables, lens, 0.125, heads=heads, block_n=16, warps=4, stages=2
            )
            err = (got.float() - ref.float()).abs().max().item()
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            print(f"check heads={num_heads}/{num_kv_heads} packed {heads}: max err {err:.2e}")
            assert err < tol, err


def _time_ms(fn, warmup=10, iters=50):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def bench() -> list[dict]:
    """W1's decode attention (Qwen3-0.6B heads, batch 256, W1's prompts plus 0/256/511
    generated): the engine's kernel against the packed one by heads a program and settings."""
    from atom_kernels import decode_attention

    rng = random.Random(0)
    prompts = [rng.randint(100, 1024) for _ in range(256)]
    rows = []
    for generated in (0, 256, 511):
        seq_lens = [p + generated for p in prompts]
        k, v, tables = _cache(seq_lens, 8, 128, 16, torch.bfloat16, "cuda")
        q = torch.randn(256, 16, 128, dtype=torch.bfloat16, device="cuda")
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        kv_bytes = 2 * sum(seq_lens) * 8 * 128 * 2
        engine = functools.partial(
            decode_attention.paged_attention_decode, q, k, v, tables, lens, 0.1, num_splits=1
        )
        runs = [("engine, 1 head a program", functools.partial(engine, heads_per_program=1)),
                ("engine, its own choice", engine)]  # fmt: skip
        for heads, block_n, warps, stages in ((2, 32, 4, 3), (2, 64, 4, 2), (2, 32, 8, 3),
                                              (4, 16, 4, 3), (4, 32, 8, 2), (4, 16, 8, 4),
                                              (8, 16, 8, 2), (8, 16, 8, 3)):  # fmt: skip
            runs.append((f"packed {heads} n{block_n} w{warps} s{stages}", functools.partial(
                packed_decode, q, k, v, tables, lens, 0.1, heads=heads, block_n=block_n,
                warps=warps, stages=stages)))  # fmt: skip
        ref = runs[0][1]().float()
        for name, fn in runs:
            try:
                err = (fn().float() - ref).abs().max().item()
                ms = _time_ms(fn)
            except Exception as exc:  # a launch setting that does not fit: say so, go on
                print(f"{generated:4d} {name:28s} failed: {type(exc).__name__}: {exc}"[:200])
                continue
            row = {"generated": generated, "kernel": name, "ms": round(ms, 4),
                   "GB_per_s": round(kv_bytes / (ms * 1e-3) / 1e9, 1), "max_err": round(err, 4)}  # fmt: skip
            rows.append(row)
            print(
                f"{generated:4d} {name:28s} {ms:8.4f} ms {row['GB_per_s']:8.1f} GB/s err {err:.3f}"
            )
        del k, v, tables
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="correctness only")
    parser.add_argument("--out", default="decode_packed.json")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check(device)
    if args.check or device == "cpu":
        return 0
    rows = bench()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
