"""Speculative decoding on hybrid models (tiny Qwen3.5 and Qwen3-Next, fp32, CPU) against the same
engine without it: a rejected draft never leaves the recurrent state advanced (greedy output
identical with drafts wrong at chosen positions, with n-gram and with the model's MTP head),
state slots (1 + k a sequence) all come back, state checkpoints still resume a conversation's
next turn, and the MTP head's drafts are the ones transformers' layers compute."""

from __future__ import annotations

import pytest
import torch

from atom_runtime import LLM, SamplingParams
from tests.runtime.spec_decode.oracle import OracleDrafter, install

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K}
PROMPTS = [[11, 22, 33, 44, 55, 11, 22, 33, 44, 55, 11, 22], list(range(100, 137)), [9, 8, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
COMMON = dict(dtype="float32", num_gpu_blocks_override=96)


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    from tests.model_factory import make_tiny_model

    root = tmp_path_factory.mktemp("mtp_models")
    return {
        kind: make_tiny_model(root / kind, kind, mtp_layers=1) for kind in ("qwen3_5", "qwen3_next")
    }


def _ids(llm, params, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _plain(model, params, prompts=PROMPTS, **kw):
    llm = LLM(str(model), **COMMON, **kw)
    try:
        return _ids(llm, params, prompts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_rejected_drafts_leave_no_state_behind(mtp_models, kind):
    want = _plain(mtp_models[kind], GREEDY)
    truth = {tuple(p): ids for p, ids in zip(PROMPTS, want, strict=True)}
    llm = LLM(str(mtp_models[kind]), speculative_config=NGRAM, **COMMON)
    try:
        pool = llm.engine.state_pool
        assert pool.slots_per_request == 1 + K
        for wrong in (lambda s, p: p == s % (K + 1), lambda s, p: p == 0, lambda s, p: False):
            install(llm, OracleDrafter(truth, K, wrong))
            assert _ids(llm, GREEDY) == want
            assert pool.num_in_use == 0
        stats = llm.engine.scheduler.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_mtp_drafts_keep_greedy_output(mtp_models, kind):
    want = _plain(mtp_models[kind], GREEDY)
    llm = LLM(str(mtp_models[kind]), speculative_config={"method": "mtp",
              "num_speculative_tokens": 2}, **COMMON)  # fmt: skip
    try:
        assert _ids(llm, GREEDY) == want
        assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
    finally:
        llm.shutdown()


def test_mtp_drafts_are_what_transformers_layers_compute(mtp_models):
    """The head's first two drafts after a prompt, against the same formula run through
    transformers' own Qwen3.5 layers with the checkpoint's mtp.* tensors."""
    import transformers
    from safetensors.torch import load_file

    from atom_runtime.protocol.engine_core import EngineRequest

    folder = mtp_models["qwen3_5"]
    prompt = PROMPTS[1]
    llm = LLM(str(folder), speculative_config={"method": "mtp", "num_speculative_tokens": 2},
              **COMMON)  # fmt: skip
    try:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        engine.add_request(EngineRequest("r", prompt, params))
        seq = engine.scheduler.requests["r"]
        while not seq.num_output_tokens:  # the prompt (a chunk may stop at a checkpoint)
            engine.step()  # then its first token, and the drafts after it
        first, drafts = seq.token_ids[-1], list(seq.spec_token_ids)
        engine.abort_requests(["r"])
    finally:
        llm.shutdown()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = model.config
    mtp = {k[4:]: v for k, v in load_file(str(folder / "mtp.safetensors")).items()}
    layer_cls = type(model.model.layers[0])
    norm_cls = type(model.model.norm)
    layer = layer_cls(cfg, cfg.layer_types.index("full_attention")).eval()
    layer.load_state_dict(
        {k[len("layers.0.") :]: v for k, v in mtp.items() if k.startswith("layers.0.")}
    )
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[name].load_state_dict({"weight": mtp[f"{name}.weight"]})
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]  # the target's, normed

        def head(h, tokens):
            emb = norms["pre_fc_norm_embedding"](model.model.embed_tokens(tokens))
            x = torch.cat([emb, norms["pre_fc_norm_hidden"](h)], -1) @ mtp["fc.weight"].t()
            n = x.shape[0]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = layer(x[None], model.model.rotary_emb(x[None], pos), attention_mask=mask,
                        position_ids=pos)[0]  # fmt: skip
            out = norms["norm"](out)
            return out, model.lm_head(out).argmax(-1)

        tokens = torch.tensor([*prompt[1:], first])
        out, ids = head(hidden, tokens)
        d1 = int(ids[-1])
        _, ids2 = head(torch.cat([hidden, out[-1:]]), torch.cat([tokens, torch.tensor([d1])]))
    assert drafts[:2] == [d1, int(ids2[-1])]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_checkpoints_resume_the_next_turn_under_speculation(mtp_models, async_scheduling):
    """A conversation's second turn resumes from a state checkpoint (decode anchors placed only
    where a verify step's accepted state landed on a block boundary) and its output is the plain
    engine's. Under async scheduling a verify step's boundary is staged after the next step was
    launched; its copy runs before the sequence's next forward (it sat out the one between)."""
    folder = mtp_models["qwen3_5"]
    first = [list(range(200, 243))]
    turn1 = _plain(folder, GREEDY, first)[0]
    second = [first[0] + turn1 + [301, 302, 303]]
    want = _plain(folder, GREEDY, second)
    llm = LLM(str(folder), speculative_config=NGRAM, state_checkpoint_interval_tokens=16,
              async_scheduling=async_scheduling, **COMMON)  # fmt: skip
    try:
        truth = {tuple(first[0]): turn1, tuple(second[0]): want[0]}
        install(llm, OracleDrafter(truth, K, lambda s, p: p == 2))
        assert _ids(llm, GREEDY, first)[0] == turn1
        assert _ids(llm, GREEDY, second) == want
        counters = llm.engine.checkpoints.counters
        assert counters.stored > 0 and counters.restored > 0
        assert llm.engine.state_pool.num_in_use == 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_frees_every_slot(mtp_models, async_scheduling):
    folder = mtp_models["qwen3_next"]
    prompts = [PROMPTS[0] * 2, PROMPTS[1], [5, 6] * 10, PROMPTS[2] * 5]
    small = dict(dtype="float32", num_gpu_blocks_override=7, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(folder), **small)
    try:
        want = _ids(plain, params, prompts)
    finally:
        plain.shutdown()
    llm = LLM(str(folder), speculative_config=NGRAM, async_scheduling=async_scheduling, **small)
    try:
        truth = {tuple(p): ids for p, ids in zip(prompts, want, strict=True)}
        install(llm, OracleDrafter(truth, K, lambda s, p: (s + p) % 4 == 0))
        assert _ids(llm, params, prompts) == want
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.state_pool.num_in_use == 0
        assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
    finally:
        llm.shutdown()


def test_mtp_head_with_state_checkpoints_resumes_the_next_turn(mtp_models):
    """An MTP head's attention layer shares the target's block ids, so a block holds its K/V
    too; a checkpoint's PAGE unit is the target's rows of a borrowed block only (the image
    layout is the same with and without a drafter), and a second turn resumed from a
    checkpoint is the plain engine's."""
    folder = mtp_models["qwen3_5"]
    first = [list(range(200, 243))]
    turn1 = _plain(folder, GREEDY, first)[0]
    second = [first[0] + turn1 + [301, 302, 303]]
    want = _plain(folder, GREEDY, second)
    llm = LLM(str(folder), speculative_config={"method": "mtp", "num_speculative_tokens": 2},
              state_checkpoint_interval_tokens=16, **COMMON)  # fmt: skip
    try:
        runner = llm.engine.executor
        head = runner.drafter.attention_layers()
        assert head
        own = runner.block_size * sum(
            layer.cache_spec().bytes_per_token(runner.dtype)
            for layer in runner.model.attention_layers()
        )
        assert runner.checkpoint_spec.page_unit_bytes == own < runner.bytes_per_block
        assert _ids(llm, GREEDY, first)[0] == turn1
        assert _ids(llm, GREEDY, second) == want
        counters = llm.engine.checkpoints.counters
        assert counters.stored > 0 and counters.restored > 0
        assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
        assert llm.engine.state_pool.num_in_use == 0
    finally:
        llm.shutdown()


NARROW = dict(kv_cache_dtype="fp8", mamba_ssm_cache_dtype="bfloat16")


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_fp8_kv_and_bf16_state_under_speculation_keep_greedy_output(mtp_models, kind):
    """--kv-cache-dtype fp8 --mamba-ssm-cache-dtype bfloat16 with drafts accepted and rejected:
    the output is the same engine's without speculation (each verified token starts from the
    state as a plain decode step stores it), with n-gram drafts and with the MTP head (its
    attention layer's cache in FP8 too)."""
    want = _plain(mtp_models[kind], GREEDY, **NARROW)
    truth = {tuple(p): ids for p, ids in zip(PROMPTS, want, strict=True)}
    llm = LLM(str(mtp_models[kind]), speculative_config=NGRAM, **COMMON, **NARROW)
    try:
        assert llm.engine.executor.state.ssm_dtype == torch.bfloat16
        install(llm, OracleDrafter(truth, K, lambda s, p: p == s % (K + 1)))
        assert _ids(llm, GREEDY) == want
        stats = llm.engine.scheduler.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    finally:
        llm.shutdown()
    llm = LLM(str(mtp_models[kind]), speculative_config={"method": "mtp",
              "num_speculative_tokens": 2}, **COMMON, **NARROW)  # fmt: skip
    try:
        runner = llm.engine.executor
        assert {layer.kv_cache_dtype for layer in runner.kv_layers()} == {runner.kv_cache_dtype}
        assert runner.kv_cache_dtype.itemsize == 1
        assert _ids(llm, GREEDY) == want
    finally:
        llm.shutdown()
