"""Inputs for the hybrid-model ops and their plainest possible specifications: token-by-token,
head-by-head Python loops written without the reference's vectorisation or chunking."""

from __future__ import annotations

import torch


def _rows(lens, slots, resume, device):
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return dict(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        slot_ids=torch.tensor(slots, dtype=torch.int32, device=device),
        has_initial_state=torch.tensor(resume, dtype=torch.bool, device=device),
    )


def conv_case(
    *, lens, slots, resume, d, width, seed, num_slots=6, dtype=torch.float32, device="cpu"
):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return dict(
        x=torch.randn(t, d, generator=g).to(dtype).to(device),
        weight=torch.randn(d, width, generator=g).to(dtype).to(device),
        bias=torch.randn(d, generator=g).to(dtype).to(device),
        conv_state=torch.randn(num_slots, d, width - 1, generator=g).to(dtype).to(device),
        **_rows(lens, slots, resume, device),
    )


def gdn_case(
    *, lens, slots, resume, hk, hv, dk, dv, seed, num_slots=6, dtype=torch.float32,
    state_dtype=torch.float32, device="cpu",
):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return dict(
        q=torch.randn(t, hk, dk, generator=g).to(dtype).to(device),
        k=torch.randn(t, hk, dk, generator=g).to(dtype).to(device),
        v=torch.randn(t, hv, dv, generator=g).to(dtype).to(device),
        # Qwen3-Next's g = -exp(A) * softplus(.): negative, mostly small, sometimes large.
        g=(-torch.rand(t, hv, generator=g) * 2).to(device),
        beta=torch.rand(t, hv, generator=g).to(dtype).to(device),
        state=(torch.randn(num_slots, hv, dk, dv, generator=g) * 0.5).to(state_dtype).to(device),
        **_rows(lens, slots, resume, device),
        scale=dk**-0.5,
    )


def naive_conv1d(x, weight, bias, conv_state, query_start_loc, slot_ids, has_initial_state,
                 activation="silu"):  # fmt: skip
    """y[t, c] = act(bias[c] + sum_w weight[c, w] * input[t - (W-1) + w, c]) token by token,
    the inputs before the sequence coming from the slot (or zeros)."""
    width = weight.shape[1]
    y = torch.zeros_like(x)
    starts = query_start_loc.tolist()
    for b, slot in enumerate(slot_ids.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if slot < 0 or hi == lo:
            continue
        past = [
            conv_state[slot][:, i].double() if has_initial_state[b] else torch.zeros(x.shape[1])
            for i in range(width - 1)
        ]
        inputs = [p.double() for p in past] + [x[t].double() for t in range(lo, hi)]
        for i, t in enumerate(range(lo, hi)):
            acc = torch.zeros(x.shape[1], dtype=torch.float64)
            for w in range(width):
                acc += weight[:, w].double() * inputs[i + w]
            if bias is not None:
                acc += bias.double()
            if activation == "silu":
                acc = acc * torch.sigmoid(acc)
            y[t] = acc.to(x.dtype)
        for i in range(width - 1):
            conv_state[slot][:, i] = inputs[len(inputs) - (width - 1) + i].to(conv_state.dtype)
    return y


def naive_gdn(q, k, v, g, beta, state, query_start_loc, slot_ids, has_initial_state, scale,
              use_qk_l2norm=True):  # fmt: skip
    """The gated delta rule token by token and head by head, in float64."""
    group = v.shape[1] // k.shape[1]
    o = torch.zeros(v.shape, dtype=v.dtype)
    starts = query_start_loc.tolist()
    for b, slot in enumerate(slot_ids.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if slot < 0 or hi == lo:
            continue
        for h in range(v.shape[1]):
            s = state[slot, h].double() if has_initial_state[b] else torch.zeros(state.shape[2:])
            s = s.double()
            for t in range(lo, hi):
                qt, kt = q[t, h // group].double(), k[t, h // group].double()
                if use_qk_l2norm:
                    qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                    kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
                qt = qt * scale
                s = s * torch.exp(g[t, h].double())
                s = s + torch.outer(kt, beta[t, h].double() * (v[t, h].double() - kt @ s))
                o[t, h] = (qt @ s).to(o.dtype)
            state[slot, h] = s.to(state.dtype)
    return o


def naive_topk(logits, top_k, renormalize):
    weights, ids = [], []
    for row in logits.double():
        probs = torch.exp(row - row.max())
        probs = probs / probs.sum()
        order = sorted(range(len(row)), key=lambda e: -probs[e].item())[:top_k]
        w = probs[order]
        if renormalize:
            w = w / w.sum()
        weights.append(w.float())
        ids.append(torch.tensor(order, dtype=torch.int32))
    return torch.stack(weights), torch.stack(ids)


def naive_moe(x, w13, w2, topk_weights, topk_ids):
    inter = w2.shape[2]
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w13[e].double() @ x[t].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            y[t] += topk_weights[t, j].double() * (w2[e].double() @ act)
    return y.to(x.dtype)
