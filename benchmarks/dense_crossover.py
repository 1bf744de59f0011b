"""Where the dense prefill path beats the paged kernel, by prompt length: for each head config,
one fresh prompt of each length through `ops.varlen_causal_attention` (padded to its bucket,
cuDNN) and through the paged Triton kernel, after the start-up's plan warm-up. The paged kernel
reads pages scattered at random (a cache after hours of serving) and, for a second figure, the
same K/V in consecutive pages (a fresh engine's first prompts).

    python benchmarks/dense_crossover.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from kernels_bench import _time_ms
from prefill_dense_bench import BUDGET, HEADS, FreshPrefill

LENGTHS = (1024, 1536, 2048, 3072, 4096, 5003, 6144, 8192)


def contiguous_paged(p: FreshPrefill):
    """The paged kernel on `p`'s K/V copied into consecutive pages (one prompt)."""
    from atom_kernels import prefill_attention

    pages = p.tables[0, : -(-p.lens[0] // p.k_cache.shape[1])].long()
    k_cache, v_cache = p.k_cache[pages], p.v_cache[pages]
    tables = torch.arange(len(pages), dtype=torch.int32, device="cuda")[None]
    return lambda: prefill_attention.paged_attention_prefill(
        p.q, k_cache, v_cache, p.cu, p.seq_lens, tables, p.scale, p.lens[0]
    )


@torch.inference_mode()
def main() -> None:
    from atom_kernels import varlen_attention

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for model, heads in HEADS.items():
        varlen_attention.warm_up(torch.device("cuda"), torch.bfloat16, *heads, BUDGET)
        for n in LENGTHS:
            p = FreshPrefill(heads, [n])
            dense, paged = _time_ms(p.dense), _time_ms(p.paged)
            consecutive = _time_ms(contiguous_paged(p))
            rows.append(dict(model=model, tokens=n, dense_ms=round(dense, 4),
                             paged_ms=round(paged, 4),
                             paged_consecutive_ms=round(consecutive, 4)))  # fmt: skip
            print(f"{model:13s} {n:5d} tokens: dense {dense:.3f} ms, paged {paged:.3f} ms "
                  f"(consecutive pages {consecutive:.3f}), paged/dense {paged / dense:.2f} "
                  f"({consecutive / dense:.2f})", flush=True)  # fmt: skip
            del p
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
