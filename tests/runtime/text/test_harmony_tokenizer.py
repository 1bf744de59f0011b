"""A GPT-OSS-style tokenizer as the checkpoint folder ships it: tokenizer.json (byte-level BPE
behind o200k's split pattern, harmony's markers as special tokens) and chat_template.jinja (a
harmony template that writes today's date with strftime_now and uses `{% break %}`). Pinned:
the folder loads, the template renders with transformers' template globals, the markers are
single special tokens both ways, and the detokenizer the server uses under the gpt_oss
reasoning parser keeps them, so harmony's channels split into reasoning and content."""

from __future__ import annotations

import datetime
import json

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from atom_runtime.engine.output_processor import SequenceText
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.server.reasoning import make_parser
from atom_runtime.text.tokenizer import Tokenizer

# o200k's pre-tokenizer split, as GPT-OSS's tokenizer.json has it.
O200K_SPLIT = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
           "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]  # fmt: skip
TEMPLATE = (
    "<|start|>system<|message|>Current date: {{ strftime_now('%Y-%m-%d') }}<|end|>"
    "{%- for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
    "<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)
ANSWER = (
    "<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hi there!<|return|>"
)


def _folder(tmp_path):
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=HARMONY, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["The user greets; answer briefly. Hi there! Hello"] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    config = {"eos_token": "<|return|>", "bos_token": "<|startoftext|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_harmony_folder_loads_renders_and_splits_its_channels(tmp_path):
    tokenizer = Tokenizer.from_path(_folder(tmp_path))
    messages = [{"role": "user", "content": "Hello"}, {"role": "stop"}, {"role": "user"}]
    prompt = tokenizer.apply_chat_template(messages)
    today = datetime.datetime.now().strftime("%Y-%m-%d")
    assert prompt == (
        f"<|start|>system<|message|>Current date: {today}<|end|>"
        "<|start|>user<|message|>Hello<|end|><|start|>assistant"
    )
    ids = tokenizer.encode_chat(messages)
    start = tokenizer.hf.token_to_id("<|start|>")
    assert ids.count(start) == 3  # a marker is one token
    last = len(ids) - 1 - ids[::-1].index(start)
    assert tokenizer.decode(ids[last + 1 :]) == "assistant"
    assert tokenizer.eos_token_ids == [tokenizer.hf.token_to_id("<|return|>")]

    answer = tokenizer.encode(ANSWER, add_special_tokens=False)
    shown = SequenceText(0, SamplingParams(skip_special_tokens=False), tokenizer)
    plain = SequenceText(0, SamplingParams(), tokenizer)
    for token in answer:  # as the detokenizer sees the stream, one token at a time
        shown.append_token(token)
        plain.append_token(token)
    assert shown.text == ANSWER
    assert "<|channel|>" not in plain.text  # skipped, so the parser asks for them
    split = make_parser("gpt_oss").split(shown.text, final=True)
    assert (split.reasoning, split.content) == ("The user greets; answer briefly.", "Hi there!")
