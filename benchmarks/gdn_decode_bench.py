"""Fused decode ops of the hybrid models against the chains they replace, on one GPU.

    python benchmarks/gdn_decode_bench.py --out gdn_decode.json          # batch 1 and 16
    python benchmarks/gdn_decode_bench.py --batch 1 --sweep              # + Dv splits and num_warps of the fused GDN
    python benchmarks/gdn_decode_bench.py --batch 256 --sweep --parts gdn --state-dtype float32,bfloat16

Qwen3.5-4B shapes, bf16 (benchmarks/configs/qwen3.5-4b): a GDN layer with 16 k heads and 32 v
heads of 128, conv width 4, fp32 state; a gated attention layer with 16 q heads (each with its
output gate), 4 KV heads of 256, rotary on the first 64 channels, 1024 cached tokens per
sequence in blocks of 16. Only the work between the projections is timed (in_proj/qkv_proj and
out_proj/o_proj are the same GEMMs either way):

- gdn/chain: what `GatedDeltaNet.forward` ran for a decode batch before the fused op (the copy of
  the conv input, causal_conv1d_, eight elementwise ops for beta and g, gated_delta_rule_, the
  copy of z and gated_rms_norm); gdn/prefill_path: today's non-decode path at decode shapes
  (strided conv input, gdn_gating); gdn/fused: gated_delta_net_decode_ as the engine calls it
  (gdn_decode.py's kernel, or the wide one where the batch fills the GPU); with --sweep,
  gdn/fused_vsplitN: gdn_decode.py's kernel with N splits, gdn/wide_*: the wide kernel's
  launch candidates (`gdn_decode_wide.launch_candidates`). Each GDN row also gives the state
  stream's GB/s (the conv and recurrent state read and written once, over the time) and its
  share of the copy ceiling (`--copy-gbps`, 4,233 measured on an H200).
- attn/chain: the old GatedAttention (the query and gate copies, two rms_norms, rotary,
  store_kvcache, decode attention, sigmoid, multiply); attn/fused: qk_norm_rope_store_ with
  q_gate, decode attention on the strided queries, sigmoid_gate_mul; attn/attention_only: the
  decode attention kernel alone, what neither path can save.

Each variant runs as a CUDA graph of many layers, each with its own states and caches (enough of
them that the states do not stay in L2 from one replay to the next, as in a real step where the
weights stream through in between), and the figure is microseconds per layer: graph time /
layers, the median of several replays. A check that fused and chain agree is printed too. About
20-40 s of GPU time, most of it Triton compiling.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from collections.abc import Callable

import torch

# Qwen3.5-4B
HK, HV, DK, DV, WIDTH = 16, 32, 128, 128, 4
HEADS, KV_HEADS, HEAD_DIM, ROTARY_DIM = 16, 4, 256, 64
GDN_LAYERS, ATTN_LAYERS = 24, 8
CONTEXT, BLOCK = 1024, 16
L2_BYTES = 60 * 2**20  # H200: 60 MiB; states are spread over at least 4x this
EPS = 1e-6
DEVICE = "cuda"


def _graph_us_per_layer(step: Callable[[int], object], layers: int, replays: int = 20) -> float:
    """Capture step(0..layers-1) in one CUDA graph; median microseconds per layer over replays."""
    for i in range(layers):  # compile and warm up outside the capture
        step(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            step(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / layers)
    times.sort()
    return times[len(times) // 2]


class GdnLayers:
    """`layers` GDN layers' parameters and states for a batch of b decode rows in slots 0..b-1."""

    def __init__(
        self, b: int, layers: int, gen: torch.Generator, state_dtype=torch.float32
    ) -> None:
        dev, bf16 = DEVICE, torch.bfloat16
        self.b, self.conv_dim = b, 2 * HK * DK + HV * DV
        width = self.conv_dim + HV * DV + 2 * HV
        self.proj = (torch.randn(b, width, generator=gen) * 0.5).to(bf16).to(dev)
        self.conv_weight = [
            (torch.randn(self.conv_dim, WIDTH, generator=gen) * 0.5).to(bf16).to(dev)
            for _ in range(layers)
        ]
        self.conv_state = [
            torch.randn(b, self.conv_dim, WIDTH - 1, generator=gen).to(bf16).to(dev)
            for _ in range(layers)
        ]
        self.ssm_state = [
            (torch.randn(b, HV, DK, DV, generator=gen) * 0.1).to(state_dtype).to(dev)
            for _ in range(layers)
        ]
        self.a_log = torch.randn(HV, generator=gen).to(bf16).to(dev)
        self.dt_bias = torch.randn(HV, generator=gen).to(bf16).to(dev)
        self.norm_weight = (torch.rand(DV, generator=gen) + 0.5).to(bf16).to(dev)
        self.qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.slots = torch.arange(b, dtype=torch.int32, device=dev)
        self.resume = torch.ones(b, dtype=torch.bool, device=dev)

    def chain(self, i: int, gating: str = "torch") -> torch.Tensor:
        from atom_kernels import ops

        b, cd, vs = self.b, self.conv_dim, HV * DV
        proj = self.proj
        z, bb, a = proj[:, cd : cd + vs], proj[:, cd + vs : cd + vs + HV], proj[:, cd + vs + HV :]
        conv_in = proj[:, :cd].contiguous() if gating == "torch" else proj[:, :cd]
        mixed = ops.causal_conv1d_(
            conv_in, self.conv_weight[i], None, self.conv_state[i], self.qsl, self.slots,
            self.resume, activation="silu",
        )  # fmt: skip
        q = mixed[:, : HK * DK].reshape(b, HK, DK)
        k = mixed[:, HK * DK : 2 * HK * DK].reshape(b, HK, DK)
        v = mixed[:, 2 * HK * DK :].reshape(b, HV, DV)
        if gating == "torch":
            beta = torch.sigmoid(bb.float())
            g = -self.a_log.float().exp() * torch.nn.functional.softplus(
                a.float() + self.dt_bias.float()
            )
        else:
            g, beta = ops.gdn_gating(a, bb, self.a_log, self.dt_bias)
        o = ops.gated_delta_rule_(
            q, k, v, g, beta, self.ssm_state[i], self.qsl, self.slots, self.resume, DK**-0.5,
            use_qk_l2norm=True,
        )  # fmt: skip
        o = ops.gated_rms_norm(o.reshape(b * HV, DV), z.reshape(b * HV, DV), self.norm_weight, EPS)
        return o.reshape(b, vs)

    def fused(
        self, i: int, num_warps: int | None = None, v_split: int | None = None
    ) -> torch.Tensor:
        from atom_kernels import gdn_decode

        return gdn_decode.gated_delta_net_decode_(
            self.proj, self.conv_weight[i], self.conv_state[i], self.ssm_state[i], self.a_log,
            self.dt_bias, self.norm_weight, EPS, self.slots, self.resume, DK**-0.5,
            num_warps=num_warps, v_split=v_split,
        )  # fmt: skip

    def wide(self, i: int, **launch) -> torch.Tensor:
        from atom_kernels import gdn_decode_wide

        return gdn_decode_wide.gated_delta_net_decode_wide_(
            self.proj, self.conv_weight[i], self.conv_state[i], self.ssm_state[i], self.a_log,
            self.dt_bias, self.norm_weight, EPS, self.slots, self.resume, DK**-0.5, **launch,
        )  # fmt: skip


def gdn_state_bytes(b: int, state_dtype=torch.float32) -> int:
    """One GDN layer's recurrent and conv (bf16) state for b rows."""
    recurrent = HV * DK * DV * torch.empty((), dtype=state_dtype).element_size()
    return b * (recurrent + (2 * HK * DK + HV * DV) * (WIDTH - 1) * 2)


class AttnLayers:
    """`layers` gated attention layers' caches (each sequence's blocks apart) and one qkv row."""

    def __init__(
        self, b: int, layers: int, gen: torch.Generator, state_dtype=torch.float32
    ) -> None:
        dev, bf16 = DEVICE, torch.bfloat16
        self.b = b
        width = (2 * HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.qkv = torch.randn(b, width, generator=gen).to(bf16).to(dev)
        blocks = CONTEXT // BLOCK
        shape = (b * blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.k_cache = [torch.randn(shape, generator=gen).to(bf16).to(dev) for _ in range(layers)]
        self.v_cache = [torch.randn(shape, generator=gen).to(bf16).to(dev) for _ in range(layers)]
        self.tables = torch.arange(b * blocks, dtype=torch.int32, device=dev).view(b, blocks)
        self.lens = torch.full((b,), CONTEXT, dtype=torch.int32, device=dev)
        self.slot_mapping = (self.tables[:, -1].long() * BLOCK + BLOCK - 1).contiguous()
        self.positions = torch.full((b,), CONTEXT - 1, dtype=torch.int64, device=dev)
        inv = 1.0 / (1e7 ** (torch.arange(0, ROTARY_DIM, 2, dtype=torch.float32) / ROTARY_DIM))
        freqs = torch.outer(torch.arange(CONTEXT, dtype=torch.float32), inv)
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dev)
        self.q_w = (torch.rand(HEAD_DIM, generator=gen) + 0.5).to(bf16).to(dev)
        self.k_w = (torch.rand(HEAD_DIM, generator=gen) + 0.5).to(bf16).to(dev)

    def _attend(self, i: int, q: torch.Tensor) -> torch.Tensor:
        from atom_kernels import ops

        return ops.paged_attention_decode(
            q, self.k_cache[i], self.v_cache[i], self.tables, self.lens, HEAD_DIM**-0.5
        )

    def chain(self, i: int) -> torch.Tensor:
        from atom_kernels import ops

        t, hd, nh, nkv = self.b, HEAD_DIM, HEADS, KV_HEADS
        qkv = self.qkv  # left as it is: the norms and rotary work on copies
        q_size, kv_size = nh * 2 * hd, nkv * hd
        q_gate = qkv[:, :q_size].view(t, nh, 2 * hd)
        gate = q_gate[..., hd:].reshape(t, nh * hd)
        q = ops.rms_norm(q_gate[..., :hd].reshape(t * nh, hd), self.q_w, EPS)
        k = ops.rms_norm(qkv[:, q_size : q_size + kv_size].reshape(t * nkv, hd), self.k_w, EPS)
        q, k = q.view(t, nh, hd), k.view(t, nkv, hd)
        v = qkv[:, q_size + kv_size :].reshape(t, nkv, hd)
        ops.rotary_embedding_(self.positions, q, k, self.cos_sin, is_neox=True)
        ops.store_kvcache(k, v, self.k_cache[i], self.v_cache[i], self.slot_mapping)
        return self._attend(i, q).reshape(t, nh * hd) * torch.sigmoid(gate)

    def fused(self, i: int) -> torch.Tensor:
        from atom_kernels import ops

        t, hd, nh = self.b, HEAD_DIM, HEADS
        qkv = self.qkv  # normed and rotated in place (again at every replay: fine for timing)
        ops.qk_norm_rope_store_(
            qkv, self.positions, self.cos_sin, self.q_w, self.k_w, EPS, self.k_cache[i],
            self.v_cache[i], self.slot_mapping, nh, KV_HEADS, hd, True,
        )  # fmt: skip
        q_gate = qkv[:, : nh * 2 * hd].view(t, nh, 2 * hd)
        out = ops.sigmoid_gate_mul(self._attend(i, q_gate[..., :hd]), q_gate[..., hd:])
        return out.view(t, nh * hd)

    def attention_only(self, i: int) -> torch.Tensor:
        q = self.qkv[:, : HEADS * 2 * HEAD_DIM].view(self.b, HEADS, 2 * HEAD_DIM)[..., :HEAD_DIM]
        return self._attend(i, q)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _timed(
    part: str, variant: str, batch: int, step, layers: int, diff: float, moved: int = 0
) -> dict:
    us = _graph_us_per_layer(step, layers)
    row = dict(
        part=part, variant=variant, batch=batch, us_per_layer=round(us, 2),
        layers_in_graph=layers, max_abs_diff_vs_chain=diff,
    )  # fmt: skip
    if moved:  # bytes the layer must move: its state read and written
        row["state_GBps"] = round(moved / (us * 1e-6) / 1e9, 1)
    return row


def kernel_registers(jit_fn) -> list[dict]:
    """Registers and spills of each compiled variant of a Triton kernel (by num_warps); empty
    where this Triton version keeps its compiled kernels elsewhere."""
    stats = []
    try:
        for entry in jit_fn.device_caches.values():
            for kernel in entry[0].values():
                kernel._init_handles()
                stats.append(
                    dict(num_warps=kernel.metadata.num_warps, n_regs=kernel.n_regs,
                         n_spills=kernel.n_spills)
                )  # fmt: skip
    except (AttributeError, IndexError, TypeError, KeyError):
        pass
    return stats


def bench_gdn(batch: int, sweep: bool, gen: torch.Generator, state_dtype) -> list[dict]:
    from atom_kernels import gdn_decode_wide

    layers = max(GDN_LAYERS, math.ceil(4 * L2_BYTES / gdn_state_bytes(batch, state_dtype)))
    gdn = GdnLayers(batch, layers, gen, state_dtype)
    # Agreement from the same states of layer 0 (each call advances them).
    conv0, ssm0 = gdn.conv_state[0].clone(), gdn.ssm_state[0].clone()
    want = gdn.chain(0)
    gdn.conv_state[0].copy_(conv0)
    gdn.ssm_state[0].copy_(ssm0)
    diff = _max_diff(gdn.fused(0), want)
    variants = {
        "chain": gdn.chain,
        "prefill_path": lambda i: gdn.chain(i, gating="triton"),
        "fused": gdn.fused,
    }
    if sweep:
        # Dv split across programs (the default picks one from the batch), then warps.
        for v in (1, 2, 4, 8):
            variants[f"fused_vsplit{v}"] = lambda i, v=v: gdn.fused(i, v_split=v)
        for w in (2, 8):
            variants[f"fused_vsplit8_warps{w}"] = lambda i, w=w: gdn.fused(i, w, v_split=8)
        for w in (4, 16):
            variants[f"fused_vsplit1_warps{w}"] = lambda i, w=w: gdn.fused(i, w, v_split=1)
        for c in gdn_decode_wide.launch_candidates(DK, DV):
            knobs = {k: v for k, v in c.items() if k != "kernel"}
            name = f"wide_{c['block_v']}x{c['num_warps']}w" + ("" if c["prefetch"] else "_nopf")
            variants[name] = lambda i, knobs=knobs: gdn.wide(i, **knobs)
    moved = 2 * gdn_state_bytes(batch, state_dtype)
    dtype = str(state_dtype).removeprefix("torch.")
    return [
        {**_timed("gdn", name, batch, step, layers, diff, moved), "state_dtype": dtype}
        for name, step in variants.items()
    ]


def bench_attn(batch: int, gen: torch.Generator) -> list[dict]:
    attn = AttnLayers(batch, ATTN_LAYERS, gen)
    want = attn.chain(0)  # the chain first: it leaves the qkv row as it is
    diff = _max_diff(attn.fused(0), want)
    variants = {"chain": attn.chain, "fused": attn.fused, "attention_only": attn.attention_only}
    return [_timed("attn", name, batch, step, ATTN_LAYERS, diff) for name, step in variants.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,16", help="comma-separated decode batch sizes")
    parser.add_argument(
        "--sweep", action="store_true", help="also time the fused GDN's Dv splits and num_warps"
    )
    parser.add_argument("--out", help="write the rows (and the device) to this JSON file")
    parser.add_argument(
        "--state-dtype", default="float32", help="recurrent state dtypes: float32,bfloat16"
    )
    parser.add_argument("--parts", default="gdn,attn", help="gdn, attn or both")
    parser.add_argument(
        "--copy-gbps", type=float, default=4233.0, help="the device copy's GB/s (read + write)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA/ROCm GPU", file=sys.stderr)
        return 2
    parts = args.parts.split(",")
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        gen = torch.Generator().manual_seed(b)
        if "gdn" in parts:
            for name in args.state_dtype.split(","):
                rows += bench_gdn(b, args.sweep, gen, getattr(torch, name))
                torch.cuda.empty_cache()
        if "attn" in parts:
            rows += bench_attn(b, gen)
            torch.cuda.empty_cache()
    print(f"{'part':6} {'variant':22} {'state':9} {'batch':>5} {'us/layer':>9} {'GB/s':>7} "
          f"{'of copy':>7}  max|fused-chain|")  # fmt: skip
    for r in rows:
        gbps = r.get("state_GBps")
        rate = f"{gbps:7.0f} {gbps / args.copy_gbps:7.1%}" if gbps else f"{'':7} {'':7}"
        print(f"{r['part']:6} {r['variant']:22} {r.get('state_dtype', ''):9} {r['batch']:5d} "
              f"{r['us_per_layer']:9.2f} {rate}  {r['max_abs_diff_vs_chain']:.3g}")  # fmt: skip
    from atom_kernels import gdn_decode, gdn_decode_wide

    registers = kernel_registers(gdn_decode._gdn_decode_kernel)
    for k in registers:
        print(f"fused GDN kernel, {k['num_warps']} warps: {k['n_regs']} registers a thread, "
              f"{k['n_spills']} spilled")  # fmt: skip
    wide_registers = kernel_registers(gdn_decode_wide._gdn_decode_wide_kernel)
    for k in wide_registers:
        print(f"wide GDN kernel, {k['num_warps']} warps: {k['n_regs']} registers a thread, "
              f"{k['n_spills']} spilled")  # fmt: skip
    by = {
        (r["part"], r["variant"], r["batch"]): r["us_per_layer"]
        for r in rows
        if r.get("state_dtype", "float32") == "float32"
    }
    for b in sorted({r["batch"] for r in rows}):
        if ("gdn", "chain", b) not in by or ("attn", "chain", b) not in by:
            continue
        saved = GDN_LAYERS * (by["gdn", "chain", b] - by["gdn", "fused", b])
        saved += ATTN_LAYERS * (by["attn", "chain", b] - by["attn", "fused", b])
        print(f"batch {b}: a Qwen3.5-4B step ({GDN_LAYERS} GDN + {ATTN_LAYERS} attention layers) "
              f"saves about {saved:.0f} us between the projections")  # fmt: skip
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    python=platform.python_version(), fused_gdn_registers=registers,
                    wide_gdn_registers=wide_registers)  # fmt: skip
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            pass
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
