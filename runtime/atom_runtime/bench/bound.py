"""The bandwidth bound of the decode workloads (W1, W2), computed from the engine that ran them.

A decode step must move, at the least: every weight it uses once (a MoE layer's routed experts
only as many as the batch's tokens pick), each sequence's K/V over its context in every
attention layer plus the new token's K/V, and each sequence's recurrent state (conv + delta
rule) read and written back in every stateful layer. Those bytes over the device's memory
bandwidth are the step's bound; prefill (compute, not bandwidth) and sampling are left out, so
the bound is a floor on time (a ceiling on tok/s) the engine cannot beat.

Two bandwidths: the device's peak (memory clock x bus width, from the driver: 4.9 TB/s on an
H200) and a measured device-to-device copy (read + write bytes over its time), which is what a
perfect streaming kernel reaches. `atom bench` reports the bound at both and the engine's ratio
to each.

Routed experts at batch B, with top-k of E under uniform routing, are expected to touch
E * (1 - (1 - k/E)^B) distinct experts a layer: exactly k at batch 1, nearly all E at W1's 256.
Random (dummy) weights route close to uniformly; a trained router's skew touches fewer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch


@dataclass(frozen=True)
class DecodeBytes:
    """What one decode step moves, by the batch's shape (bytes; this rank's shard under TP)."""

    weights: int  # read once a step whatever the batch: all but routed experts and the embedding
    expert: int  # one routed expert's weights, summed over the MoE layers
    num_experts: int
    top_k: int
    embedding_row: int  # one token's embedding row (0 when the table is the tied LM head)
    kv_per_token: int  # K + V of one token over every full-attention layer
    state_per_seq: int  # one sequence's recurrent + conv state over every stateful layer
    # Sliding-window layers read only their last `window` positions (GPT-OSS, Mistral).
    window_kv_per_token: int = 0  # K + V of one token over every windowed layer
    window: int = 0
    recurrent_per_seq: int = 0  # of which the recurrent (delta-rule) matrices
    recurrent_dtype: str = "float32"  # their dtype (--mamba-ssm-cache-dtype)

    def with_recurrent_dtype(self, dtype: torch.dtype) -> DecodeBytes:
        """The same step with the recurrent state kept in `dtype` (the conv state as it is)."""
        if not self.recurrent_per_seq:
            return self
        now = torch.empty((), dtype=getattr(torch, self.recurrent_dtype)).element_size()
        recurrent = self.recurrent_per_seq * torch.empty((), dtype=dtype).element_size() // now
        return replace(
            self,
            state_per_seq=self.state_per_seq - self.recurrent_per_seq + recurrent,
            recurrent_per_seq=recurrent,
            recurrent_dtype=str(dtype).removeprefix("torch."),
        )

    def experts_touched(self, batch: int) -> float:
        """Expected distinct routed experts a MoE layer reads at `batch` tokens."""
        if self.num_experts == 0:
            return 0.0
        e, k = self.num_experts, self.top_k
        return e * (1.0 - (1.0 - k / e) ** batch)

    def step(self, contexts: Sequence[int]) -> float:
        """Bytes of one decode step over sequences whose K/V span `contexts` tokens (each
        counting the token the step computes)."""
        batch = len(contexts)
        return (
            self.weights
            + self.experts_touched(batch) * self.expert
            + batch * self.embedding_row
            + (sum(contexts) + batch) * self.kv_per_token  # read the context, write the new K/V
            + (sum(min(c, self.window) for c in contexts) + batch) * self.window_kv_per_token
            + batch * 2 * self.state_per_seq  # read and write the state
        )


def decode_bytes(model: torch.nn.Module, runner) -> DecodeBytes:
    """The step's bytes from the loaded model's parameters and the runner's cache layout.

    Routed experts are the `w13` / `w2` parameters of a module with `num_experts` and `top_k`
    (layers of `layers.moe.SparseMoE`, their biases with them); the embedding is the
    `embed_tokens` module unless its weight is also the LM head's."""
    head = getattr(model, "lm_head", None)
    head_weight = getattr(head, "weight", None)
    weights = expert = embedding_row = 0
    num_experts = top_k = 0
    seen: set[int] = set()
    for name, module in model.named_modules():
        routed = hasattr(module, "num_experts") and hasattr(module, "top_k")
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            nbytes = p.numel() * p.element_size()
            if routed and pname in ("w13", "w2", "w13_bias", "w2_bias"):
                expert += nbytes // module.num_experts
                num_experts, top_k = module.num_experts, module.top_k
            elif name.endswith("embed_tokens") and p is not head_weight:
                embedding_row = nbytes // p.shape[0]
            else:
                weights += nbytes
    full = window = window_kv = 0
    for layer in model.attention_layers():  # K + V, or MLA's latent row, as its cache holds
        per_token = sum(t[0, 0].numel() * t.element_size() for t in layer.cache_tensors())
        if getattr(layer, "sliding_window", 0):
            window, window_kv = layer.sliding_window, window_kv + per_token
        else:
            full += per_token
    state = getattr(runner, "state", None)
    recurrent, recurrent_dtype = 0, "float32"
    if state is not None:  # StateTensors: per layer (conv, recurrent) shapes and dtypes
        recurrent_dtype = str(state.ssm_dtype).removeprefix("torch.")
        elem = torch.empty((), dtype=state.ssm_dtype).element_size()
        recurrent = sum(math.prod(layer.state_shapes()[1]) * elem for layer in state.layers)
    return DecodeBytes(
        weights=weights,
        expert=expert,
        num_experts=num_experts,
        top_k=top_k,
        embedding_row=embedding_row,
        kv_per_token=full,
        state_per_seq=runner.state_bytes_per_slot,
        window_kv_per_token=window_kv,
        window=window,
        recurrent_per_seq=recurrent,
        recurrent_dtype=recurrent_dtype,
    )


def resident_weights(model: torch.nn.Module) -> dict:
    """Bytes of the model's parameters as they sit in memory (a tied tensor once): in all, the
    FP8 tensors (weights stored in one byte a value), and the fp32 scales beside them."""
    total = fp8 = scales = 0
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        nbytes = p.numel() * p.element_size()
        total += nbytes
        if p.element_size() == 1 and p.is_floating_point():
            fp8 += nbytes
        elif name.endswith(("weight_scale", "input_scale")):
            scales += nbytes
    return {"bytes": total, "fp8_bytes": fp8, "scale_bytes": scales}


def describe_weights(weights: dict) -> str:
    """One line for the bench's output."""
    gib = 2**30
    line = f"resident weights: {weights['bytes'] / gib:.2f} GiB"
    if weights["fp8_bytes"]:
        line += (
            f" ({weights['fp8_bytes'] / gib:.2f} GiB FP8, {weights['scale_bytes'] / 2**20:.1f} MiB"
            " of scales)"
        )
    return line


def peak_bandwidth(device: torch.device) -> float | None:
    """The device's peak memory bandwidth in bytes/s from the driver's memory clock (kHz,
    double data rate) and bus width (bits); None where they are not reported (CPU)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2.0 * clock_khz * 1e3 * bus_bits / 8


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float | None:
    """Bytes/s of a device-to-device copy (read + write), best of `repeats`. On a GPU the size
    shrinks to a quarter of the free memory if 1 GiB does not fit twice; on CPU to 256 MiB.
    None when not even two buffers of 1 MiB fit (the engine holds the memory): no copy figure,
    rather than a benchmark that fails after its run."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = max(1 << 20, min(nbytes, free // 4))
    else:
        nbytes = min(nbytes, 1 << 28)
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
    except torch.OutOfMemoryError:
        return None
    dst.copy_(src)  # warm-up: first touch, lazy allocation
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    del src, dst
    return 2 * nbytes / best


def w2_bound_ms(db: DecodeBytes, input_len: int, output_len: int, bandwidth: float) -> float:
    """Milliseconds a token for W2's single sequence: the mean of the decode steps W2 times (its
    second output token to its last; the first comes from the prefill)."""
    contexts = range(input_len + 1, input_len + output_len)
    if not contexts:
        return 0.0
    return sum(db.step([c]) for c in contexts) / len(contexts) / bandwidth * 1e3


def w1_bound_tok_s(
    db: DecodeBytes,
    prompt_lens: Sequence[int],
    output_len: int,
    max_num_seqs: int,
    bandwidth: float,
) -> float:
    """Output tokens/s for W1 if every decode step ran at `bandwidth`: the prompts in waves of
    `max_num_seqs` (all at once at W1's 256), each generating `output_len` tokens, the first
    from its prefill (not counted in the time)."""
    seconds = 0.0
    for start in range(0, len(prompt_lens), max_num_seqs):
        wave = prompt_lens[start : start + max_num_seqs]
        for j in range(1, output_len):
            seconds += db.step([p + j for p in wave]) / bandwidth
    tokens = len(prompt_lens) * output_len
    return tokens / seconds if seconds > 0 else float("inf")


def report(
    engine, workload: str, measured: float, *, prompt_lens=None, input_len=0, output_len=0
) -> dict:
    """The bound of a W1 (tok/s) or W2 (ms/token) run of `engine` at the device's peak and copy
    bandwidth, with the engine's `measured` figure as a fraction of each (1.0 = at the bound)."""
    runner = getattr(engine.executor, "runner", engine.executor)
    db = decode_bytes(runner.model, runner)
    device = runner.device
    bandwidths = {"peak": peak_bandwidth(device), "copy": copy_bandwidth(device)}
    out: dict = {"bytes": asdict(db)}

    def bound_of(db: DecodeBytes, bw: float) -> tuple[float, float]:
        if workload == "throughput":
            bound = w1_bound_tok_s(db, prompt_lens, output_len, engine.config.max_num_seqs, bw)
            return bound, measured / bound
        bound = w2_bound_ms(db, input_len, output_len, bw)
        return bound, bound / measured

    for kind, bw in bandwidths.items():
        if bw is None:
            continue
        bound, share = bound_of(db, bw)
        out[kind] = {"bandwidth_GBps": bw / 1e9, "bound": bound, "atom_share_of_bound": share}
    if db.recurrent_per_seq and bandwidths["copy"] is not None:
        # A hybrid's bound with its recurrent state in each dtype --mamba-ssm-cache-dtype offers
        # (at the copy bandwidth); the run's own is the one above.
        out["by_recurrent_dtype"] = {"engine": db.recurrent_dtype}
        for dtype in (torch.float32, torch.bfloat16):
            bound, share = bound_of(db.with_recurrent_dtype(dtype), bandwidths["copy"])
            name = str(dtype).removeprefix("torch.")
            out["by_recurrent_dtype"][name] = {"bound": bound, "atom_share_of_bound": share}
    return out


def describe(workload: str, bound: dict) -> str:
    """One line for the bench's output."""
    unit = "tok/s" if workload == "throughput" else "ms/token"
    parts = []
    for kind in ("peak", "copy"):
        if kind in bound:
            b = bound[kind]
            figure = f"{b['bound']:,.0f}" if unit == "tok/s" else f"{b['bound']:.3f}"
            share = b["atom_share_of_bound"]
            times = "" if unit == "tok/s" else f"{1 / share:.2f}x the bound, "
            parts.append(
                f"{figure} {unit} at {b['bandwidth_GBps'] / 1e3:.2f} TB/s ({kind}); atom at "
                f"{times}{share:.0%} of it"
            )
    by_dtype = bound.get("by_recurrent_dtype")
    if by_dtype:
        figures = " / ".join(
            f"{by_dtype[d]['bound']:,.0f}" if unit == "tok/s" else f"{by_dtype[d]['bound']:.3f}"
            for d in ("float32", "bfloat16")
        )
        shares = " / ".join(
            f"{by_dtype[d]['atom_share_of_bound']:.0%}" for d in ("float32", "bfloat16")
        )
        parts.append(
            f"recurrent state float32 / bfloat16: {figures} {unit} (copy), atom at {shares} "
            f"(this run: {by_dtype['engine']})"
        )
    name = "W1" if workload == "throughput" else "W2"
    return f"bound {name}: " + "; ".join(parts)
