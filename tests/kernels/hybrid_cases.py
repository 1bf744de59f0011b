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


def gdn_decode_case(
    *, slots, resume, hk, hv, dk, dv, width=4, seed, num_slots=6, dtype=torch.float32,
    state_dtype=torch.float32, device="cpu",
):  # fmt: skip
    """Arguments of `gated_delta_net_decode_` for one token per row: proj a strided column
    slice of a wider buffer (as the in_proj output is viewed), random conv and recurrent
    states in every slot, Qwen3-Next-like gate parameters."""
    g = torch.Generator().manual_seed(seed)
    b = len(slots)
    conv_dim = 2 * hk * dk + hv * dv
    width_proj = conv_dim + hv * dv + 2 * hv
    wide = torch.randn(b, width_proj + 5, generator=g)
    return dict(
        proj=wide.to(dtype).to(device)[:, 3 : 3 + width_proj],
        conv_weight=(torch.randn(conv_dim, width, generator=g) * 0.5).to(dtype).to(device),
        conv_state=torch.randn(num_slots, conv_dim, width - 1, generator=g).to(dtype).to(device),
        ssm_state=(torch.randn(num_slots, hv, dk, dv, generator=g) * 0.5)
        .to(state_dtype)
        .to(device),
        a_log=torch.randn(hv, generator=g).to(dtype).to(device),
        dt_bias=torch.randn(hv, generator=g).to(dtype).to(device),
        norm_weight=(torch.rand(dv, generator=g) + 0.5).to(dtype).to(device),
        eps=1e-6,
        slot_ids=torch.tensor(slots, dtype=torch.int32, device=device),
        has_initial_state=torch.tensor(resume, dtype=torch.bool, device=device),
        scale=dk**-0.5,
    )


def run_on_state_copies(fn, case: dict) -> tuple:
    """fn(**case) on copies of the case's conv and recurrent states: (its output, the conv
    state after, the recurrent state after), the case left as it was."""
    case = {
        **case,
        "conv_state": case["conv_state"].clone(),
        "ssm_state": case["ssm_state"].clone(),
    }
    out = fn(**case)
    return out, case["conv_state"], case["ssm_state"]


def unfused_gdn_decode(proj, conv_weight, conv_state, ssm_state, a_log, dt_bias, norm_weight,
                       eps, slot_ids, has_initial_state, scale, ops):  # fmt: skip
    """The chain the model ran before the fused decode op, on `ops` (the reference module or
    the ops dispatcher): conv1d + silu, the gates as the model wrote them in torch, the delta
    rule with the q/k L2 norm, the gated RMSNorm."""
    hv, dk, dv = ssm_state.shape[1:]
    conv_dim = conv_weight.shape[0]
    ks = (conv_dim - hv * dv) // 2
    t = proj.shape[0]
    qsl = torch.arange(t + 1, dtype=torch.int32, device=proj.device)
    mixed = ops.causal_conv1d_(
        proj[:, :conv_dim].contiguous(), conv_weight, None, conv_state, qsl, slot_ids,
        has_initial_state, activation="silu",
    )  # fmt: skip
    z = proj[:, conv_dim : conv_dim + hv * dv]
    b, a = proj[:, conv_dim + hv * dv : -hv], proj[:, -hv:]
    beta = torch.sigmoid(b.float())
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    o = ops.gated_delta_rule_(
        mixed[:, :ks].reshape(t, -1, dk), mixed[:, ks : 2 * ks].reshape(t, -1, dk),
        mixed[:, 2 * ks :].reshape(t, hv, dv), g, beta, ssm_state, qsl, slot_ids,
        has_initial_state, scale, use_qk_l2norm=True,
    )  # fmt: skip
    out = ops.gated_rms_norm(o.reshape(t * hv, dv), z.reshape(t * hv, dv), norm_weight, eps)
    return out.reshape(t, hv * dv)


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
