"""`atom bench serve`'s datasets: `random`, `sharegpt` (a file or the synthetic mix) and
`custom`, as vLLM samples them, and the tokenizer or vocabulary size they need.

`BenchError` lives here, the lowest of the bench_serve modules, since every one raises it.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The W4 ShareGPT-shaped synthetic mix: log-normal prompt and reply lengths (medians and spreads
# chosen to match the filtered ShareGPT_V3 set vLLM benchmarks with: prompts 4..1024 tokens, prompt
# plus reply at most 2048), drawn from --seed. A stand-in for the file, not a copy of it.
SHAREGPT_PROMPT_MEDIAN, SHAREGPT_PROMPT_SIGMA = 110.0, 1.1
SHAREGPT_OUTPUT_MEDIAN, SHAREGPT_OUTPUT_SIGMA = 150.0, 1.0
SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL, SHAREGPT_MIN_LEN = 1024, 2048, 4
# Random-token prompts avoid the lowest ids, where tokenizers keep their special tokens (W1).
RANDOM_TOKEN_LOW = 100


class BenchError(RuntimeError):
    """A problem with the benchmark's arguments or the endpoint: printed as one line, no trace."""


# -- datasets ----------------------------------------------------------------------------------


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


@dataclass
class TokenSource:
    """What the client knows of the model's vocabulary: a tokenizer, or only its size."""

    tokenizer: object | None  # atom_runtime.text.tokenizer.Tokenizer
    vocab_size: int | None
    name: str | None


def load_token_source(name: str | None) -> TokenSource:
    """A tokenizer from a local folder/file or hub repo id; failing that, the vocabulary size
    from a config.json (dummy-weight configs ship no tokenizer); failing that, nothing."""
    if not name:
        return TokenSource(None, None, None)
    from atom_runtime.models.loader import resolve_model_path
    from atom_runtime.text.tokenizer import Tokenizer

    try:
        path = resolve_model_path(name)
    except FileNotFoundError:
        return TokenSource(None, None, name)
    try:
        tok = Tokenizer.from_path(path)
        return TokenSource(tok, tok.vocab_size, name)
    except (FileNotFoundError, ValueError):
        pass
    cfg = (path if path.is_dir() else path.parent) / "config.json"
    if cfg.is_file():
        vocab = json.loads(cfg.read_text()).get("vocab_size")
        if isinstance(vocab, int):
            return TokenSource(None, vocab, name)
    return TokenSource(None, None, name)


def _random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    high = min(vocab, 150000)
    low = RANDOM_TOKEN_LOW if high > RANDOM_TOKEN_LOW + 1 else 0
    return rng.integers(low, high, size=n).tolist()


def _need_vocab(src: TokenSource, dataset: str) -> int:
    if src.vocab_size is None:
        raise BenchError(
            f"--dataset-name {dataset}: random token prompts need the model's vocabulary; "
            f"could not load a tokenizer or config.json from {src.name!r} "
            "(pass --tokenizer PATH, a model folder)"
        )
    return src.vocab_size


def sample_random(
    src: TokenSource,
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    seed: int,
) -> list[SampleRequest]:
    """vLLM's `random` dataset: lengths uniform in [floor(len*(1-r)), ceil(len*(1+r))]."""
    if not 0.0 <= range_ratio < 1.0:
        raise BenchError(f"--random-range-ratio: must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise BenchError("--random-input-len and --random-output-len: must be >= 1")
    vocab = _need_vocab(src, "random")
    rng = np.random.default_rng(seed)
    in_lo, in_hi = (
        math.floor(input_len * (1 - range_ratio)),
        math.ceil(input_len * (1 + range_ratio)),
    )
    out_lo = math.floor(output_len * (1 - range_ratio))
    out_hi = math.ceil(output_len * (1 + range_ratio))
    in_lens = rng.integers(max(in_lo, 1), in_hi + 1, size=num)
    out_lens = rng.integers(max(out_lo, 1), out_hi + 1, size=num)
    prefix = _random_ids(rng, prefix_len, vocab)
    return [
        SampleRequest(prefix + _random_ids(rng, int(n), vocab), prefix_len + int(n), int(o))
        for n, o in zip(in_lens, out_lens, strict=True)
    ]


def sample_sharegpt_synthetic(
    src: TokenSource, num: int, output_len: int | None, seed: int
) -> list[SampleRequest]:
    """The ShareGPT-shaped synthetic mix: log-normal lengths, filtered as vLLM filters ShareGPT."""
    vocab = _need_vocab(src, "sharegpt")
    rng = np.random.default_rng(seed)
    out: list[SampleRequest] = []
    while len(out) < num:
        p = int(rng.lognormal(math.log(SHAREGPT_PROMPT_MEDIAN), SHAREGPT_PROMPT_SIGMA))
        o = int(rng.lognormal(math.log(SHAREGPT_OUTPUT_MEDIAN), SHAREGPT_OUTPUT_SIGMA))
        if output_len is not None:
            o = output_len
        if p < SHAREGPT_MIN_LEN or o < SHAREGPT_MIN_LEN:
            continue
        if p > SHAREGPT_MAX_PROMPT or p + o > SHAREGPT_MAX_TOTAL:
            continue
        out.append(SampleRequest(_random_ids(rng, p, vocab), p, o))
    return out


def sample_sharegpt_file(
    src: TokenSource, path: str, num: int, output_len: int | None, seed: int
) -> list[SampleRequest]:
    """Real ShareGPT conversations: the first human turn is the prompt, the reply sets the
    output length; filtered like vLLM (lengths >= 4, prompt <= 1024, total <= 2048)."""
    if src.tokenizer is None:
        raise BenchError("--dataset-path with sharegpt: counting prompt tokens needs --tokenizer")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise BenchError(f"--dataset-path {path}: cannot read ShareGPT JSON: {e}") from e
    convs = [
        d["conversations"]
        for d in data
        if isinstance(d, dict) and len(d.get("conversations") or []) >= 2
    ]
    np.random.default_rng(seed).shuffle(convs)
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) == num:
            break
        prompt, reply = conv[0].get("value", ""), conv[1].get("value", "")
        p = len(src.tokenizer.encode(prompt))
        o = output_len if output_len is not None else len(src.tokenizer.encode(reply))
        if p < SHAREGPT_MIN_LEN or o < SHAREGPT_MIN_LEN:
            continue
        if p > SHAREGPT_MAX_PROMPT or p + o > SHAREGPT_MAX_TOTAL:
            continue
        out.append(SampleRequest(prompt, p, o))
    if len(out) < num:
        raise BenchError(f"--dataset-path {path}: only {len(out)} usable conversations, need {num}")
    return out


def sample_custom(
    src: TokenSource, path: str | None, num: int, output_len: int, skip_template: bool, chat: bool
) -> list[SampleRequest]:
    """A JSONL file, one {"prompt": "..."} per line (vLLM's `custom` dataset); a line may also
    give its own "output_tokens". Completions prompts go through the chat template unless
    --custom-skip-chat-template (as vLLM does); chat requests carry the text as the user turn."""
    if not path:
        raise BenchError("--dataset-name custom: needs --dataset-path FILE.jsonl")
    rows = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    rows.append((n, json.loads(line)))
    except OSError as e:
        raise BenchError(f"--dataset-path {path}: {e}") from e
    except ValueError as e:
        raise BenchError(f"--dataset-path {path}: line {n} is not JSON: {e}") from e
    out = []
    tok = src.tokenizer
    for n, row in rows[:num]:
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise BenchError(f'--dataset-path {path}: line {n} needs a string "prompt"')
        prompt = row["prompt"]
        if not chat and not skip_template and tok is not None and tok.chat_template:
            prompt = tok.apply_chat_template([{"role": "user", "content": prompt}])
        plen = len(tok.encode(prompt)) if tok is not None else 0
        out.append(SampleRequest(prompt, plen, int(row.get("output_tokens", output_len))))
    if len(out) < num:
        raise BenchError(f"--dataset-path {path}: {len(out)} prompts, --num-prompts is {num}")
    return out


def get_samples(args: argparse.Namespace, src: TokenSource) -> list[SampleRequest]:
    if args.num_prompts < 1:
        raise BenchError(f"--num-prompts: must be >= 1, got {args.num_prompts}")
    if args.dataset_name == "random":
        samples = sample_random(
            src,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            args.seed,
        )
    elif args.dataset_name == "sharegpt":
        if args.dataset_path:
            samples = sample_sharegpt_file(
                src, args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed
            )
        else:
            samples = sample_sharegpt_synthetic(
                src, args.num_prompts, args.sharegpt_output_len, args.seed
            )
    else:
        samples = sample_custom(
            src,
            args.dataset_path,
            args.num_prompts,
            args.custom_output_len,
            args.custom_skip_chat_template,
            args.backend == "openai-chat",
        )
    if args.backend == "openai-chat":
        for s in samples:
            if not isinstance(s.prompt, str):
                if src.tokenizer is None:
                    raise BenchError(
                        "--backend openai-chat: chat messages are text; token prompts of the "
                        f"{args.dataset_name} dataset need --tokenizer to decode them"
                    )
                s.prompt = src.tokenizer.decode(s.prompt)
    return samples
