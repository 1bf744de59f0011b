"""DeepSeek-V3's MTP head as the `mtp` drafter (tiny random DeepSeek-V3, one nextn layer, fp32,
CPU): greedy output is the plain engine's (k above the layer count reuses the layer; prefix
caching, chunked prefill with preemption, n > 1), the head's drafts are what transformers' own
DeepSeek-V3 decoder layer computes inside transformers' `MtpLayer`, and `mtp` is refused before
any weight is read on a config without nextn layers or a checkpoint without the head's tensors."""

from __future__ import annotations

import pytest
import torch

from atom_runtime import LLM, SamplingParams

PROMPTS = [[11, 22, 33, 44, 55, 11, 22, 33, 44, 55, 11, 22], list(range(100, 137)), [9, 8, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
COMMON = dict(dtype="float32", num_gpu_blocks_override=96)
MTP = {"method": "deepseek_mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory):
    from tests.model_factory import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("ds_mtp"), "deepseek_v3", mtp_layers=1)


def _ids(llm, params, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def _run(model, params, prompts=PROMPTS, spec=None, **kw):
    llm = LLM(str(model), speculative_config=spec, **(COMMON | kw))
    try:
        got = _ids(llm, params, prompts)
        if spec is not None:
            runner = llm.engine.executor
            stats = llm.engine.scheduler.spec_stats
            assert stats.num_draft_tokens > 0
            assert len(runner.drafter.attention_layers()) == 1  # the one MTP layer, reused
            assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
        return got
    finally:
        llm.shutdown()


def test_mtp_drafts_keep_greedy_output(deepseek_mtp):
    assert _run(deepseek_mtp, GREEDY, spec=MTP) == _run(deepseek_mtp, GREEDY)


def test_mtp_under_chunked_prefill_preemption_and_prefix_caching(deepseek_mtp):
    """A 16-token step budget (prompts in chunks), a cache too small for every sequence at once
    (preemption: the head's catch-up starts over), the prompts run twice (the second time over
    cached prefixes, whose head KV the blocks hold too)."""
    prompts = [PROMPTS[0] * 3, PROMPTS[1], PROMPTS[2] * 4, [5, 6] * 9]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    small = dict(num_gpu_blocks_override=8, max_num_batched_tokens=16, enable_prefix_caching=True)
    want = _run(deepseek_mtp, params, prompts, **small)
    llm = LLM(str(deepseek_mtp), speculative_config=MTP, **(COMMON | small))
    try:
        assert _ids(llm, params, prompts) == want
        assert llm.engine.scheduler.num_preemptions > 0
        assert _ids(llm, params, prompts) == want
        assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
    finally:
        llm.shutdown()


def test_mtp_with_n_children(deepseek_mtp):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3)
    want = _run(deepseek_mtp, params, PROMPTS[:2])
    assert all(len({tuple(c) for c in children}) == 1 for children in want)
    assert _run(deepseek_mtp, params, PROMPTS[:2], spec=MTP) == want


def _engine_drafts(folder, prompt, k):
    """The first token after `prompt` and the k drafts the head proposes from it."""
    from atom_runtime.protocol.engine_core import EngineRequest

    llm = LLM(str(folder), speculative_config={"method": "mtp", "num_speculative_tokens": k},
              **COMMON)  # fmt: skip
    try:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        engine.add_request(EngineRequest("r", prompt, params))
        seq = engine.scheduler.requests["r"]
        while not seq.num_output_tokens:
            engine.step()
        first, drafts = seq.token_ids[-1], list(seq.spec_token_ids)
        engine.abort_requests(["r"])
        return first, drafts
    finally:
        llm.shutdown()


def test_mtp_drafts_are_what_transformers_mtp_layer_computes(deepseek_mtp):
    """Drafts 1 and 2 after a prompt against transformers' `MtpLayer` (enorm, hnorm, eh_proj,
    its DeepSeek-V3 decoder layer, the post norm) loaded with the checkpoint's layer-3 tensors,
    over the target's final hidden states, the model's LM head giving the tokens."""
    import transformers
    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    prompt = PROMPTS[1]
    first, drafts = _engine_drafts(deepseek_mtp, prompt, 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(deepseek_mtp, dtype=torch.float32)
    model.eval()
    cfg = model.config
    index = cfg.num_hidden_layers  # 3: a MoE layer, as DeepSeek-V3's layer 61
    layer = MtpLayer(cfg, hf.DeepseekV3DecoderLayer, hf.DeepseekV3RMSNorm, index).eval()
    prefix = f"model.layers.{index}."
    own = {k[len(prefix) :]: v for k, v in load_file(str(deepseek_mtp / "mtp.safetensors")).items()
           if k.startswith(prefix)}  # fmt: skip
    state = {"post_norm.weight": own.pop("shared_head.norm.weight")}
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
        state[name] = own.pop(name)
    assert torch.equal(own.pop("shared_head.head.weight"), model.lm_head.weight)
    assert torch.equal(own.pop("embed_tokens.weight"), model.model.embed_tokens.weight)
    state |= {f"mtp_block.{k}": v for k, v in own.items()}
    layer.load_state_dict(state)
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state  # normed, as served

        def head(h, tokens):
            n = tokens.shape[1]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = layer(model.model.embed_tokens(tokens), h, model.model.rotary_emb(h, pos),
                        mask, pos, None)  # fmt: skip
            return out, model.lm_head(out[0]).argmax(-1)

        tokens = torch.tensor([[*prompt[1:], first]])
        out, ids = head(hidden, tokens)
        d1 = int(ids[-1])
        _, ids2 = head(
            torch.cat([hidden, out[:, -1:]], 1), torch.cat([tokens, torch.tensor([[d1]])], 1)
        )
    assert drafts == [d1, int(ids2[-1])]


def test_mtp_refused_without_nextn_layers_or_their_tensors(tmp_path, deepseek_mtp):
    """Refused by name from the config and the files' headers, before any weight is read (the
    engine is never built: the safetensors data here would not even load)."""
    import json

    from tests.model_factory import make_tiny_model

    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 1}
    none = make_tiny_model(tmp_path / "none", "deepseek_v3", num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="speculative_config.method: mtp needs a model whose"):
        LLM(str(none), speculative_config=spec, **COMMON)
    # transformers' DeepSeek-V3 config declares one MTP layer by default; save_pretrained
    # writes no tensors for it (as many re-uploads of DeepSeek-V3 / R1 do).
    bare = make_tiny_model(tmp_path / "bare", "deepseek_v3")
    assert json.loads((bare / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with pytest.raises(ValueError, match=r"mtp: deepseek_v3 declares 1 MTP layer\(s\) but .*"
                       r"model\.layers\.3\.eh_proj\.weight missing"):  # fmt: skip
        LLM(str(bare), speculative_config=spec, **COMMON)
    assert _run(bare, SamplingParams(temperature=0, max_tokens=4), PROMPTS[:1])  # plain: served


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_deepseek_mtp_on_the_gpu_keeps_greedy_output(deepseek_mtp, enforce_eager):
    """The head's MLA layer on the GPU kernels (its latent cache beside the target's), verify
    steps through CUDA graphs or eager: greedy output is the plain engine's."""
    kw = dict(device="cuda", enforce_eager=enforce_eager)
    assert _run(deepseek_mtp, GREEDY, spec=MTP, **kw) == _run(deepseek_mtp, GREEDY, **kw)


def test_mtp_drafts_accepted_and_rejected_keep_greedy_output(deepseek_mtp, tmp_path):
    """A head that drafts the token it reads, again and again (eh_proj passes the hidden state
    through, the decoder layer adds nothing, unit norms: the target's own prediction at j, which
    is token j + 1): accepted wherever the target repeats a token, so the head's catch-up runs
    over several accepted positions; output stays the plain engine's."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "echo"
    shutil.copytree(deepseek_mtp, folder)
    tensors = load_file(str(folder / "mtp.safetensors"))
    h = tensors["model.layers.3.hnorm.weight"].numel()
    for name, t in tensors.items():
        if name.endswith("norm.weight") and t.numel() == h:
            tensors[name] = torch.ones_like(t)
        elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            tensors[name] = torch.zeros_like(t)
    tensors["model.layers.3.eh_proj.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], 1)
    save_file(tensors, str(folder / "mtp.safetensors"))
    prompts = [[7] * 12, [5, 6] * 9, PROMPTS[1]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _run(folder, params, prompts)
    llm = LLM(str(folder), speculative_config=MTP, **COMMON)
    try:
        assert _ids(llm, params, prompts) == want
        stats = llm.engine.scheduler.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    finally:
        llm.shutdown()
