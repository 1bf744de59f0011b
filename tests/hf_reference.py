"""The transformers peer every model test compares with: random prompts, greedy tokens (and the
first step's log-softmax) from `generate`, teacher-forced log-softmax over given sequences, and
ATOM's own greedy tokens for the same prompts. fp32 on CPU; each call loads the folder afresh."""

from __future__ import annotations

import random

import torch
import transformers

from atom_runtime import LLM, SamplingParams


def random_prompts(seed: int, lengths: list[int], vocab: int = 49152) -> list[list[int]]:
    """Prompts of these lengths, token ids uniform in [3, vocab) from `random.Random(seed)`."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def load_reference(folder, dtype=torch.float32, attn_implementation: str | None = None):
    """The checkpoint in `folder` as transformers loads it (its default attention, or
    `attn_implementation`, e.g. "eager"), in eval mode."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=attn_implementation
    ).eval()


def hf_greedy(
    folder,
    prompts: list[list[int]],
    max_tokens: int,
    first_logprobs: bool = False,
    attn_implementation: str | None = None,
):
    """transformers' greedy tokens for each prompt (EOS ignored); with `first_logprobs`, also the
    first step's log-softmax of each: (tokens, first)."""
    model = load_reference(folder, attn_implementation=attn_implementation)
    tokens, first = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=first_logprobs,
            )
            tokens.append(gen.sequences[0, len(p) :].tolist())
            if first_logprobs:
                first.append(gen.logits[0][0].log_softmax(-1))
    return (tokens, first) if first_logprobs else tokens


def hf_logprobs(folder, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced log-softmax of every position of each sequence ([len, vocab] each): what
    the model predicts after each prefix, for agreement and logit-error checks."""
    model = load_reference(folder)
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].log_softmax(-1) for s in sequences]


def atom_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """ATOM's greedy tokens for each prompt (EOS ignored), in prompt order."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]
