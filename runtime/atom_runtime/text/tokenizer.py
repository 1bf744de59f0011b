"""Tokenizer, chat template and incremental detokenizer.

A Hugging Face folder brings tokenizer.json (loaded with `tokenizers`) and tokenizer_config.json
(special tokens, chat template). A GGUF file brings its vocabulary, merges and chat template in its
metadata; we rebuild the byte-level BPE tokenizer from them with `tokenizers`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

# GGUF `tokenizer.ggml.pre` -> the split rules that model's tokenizer.json uses before byte-level BPE.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gguf_pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default"):
        return byte_level
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is None:
        raise ValueError(f"GGUF tokenizer pre-tokenizer {pre!r} is not supported")
    from tokenizers import Regex

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


class Tokenizer:
    """Encodes prompts, applies chat templates, decodes ids; wraps a `tokenizers.Tokenizer`."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        bos_token: str | None,
        eos_token: str | None,
        add_bos_token: bool,
        chat_template: str | None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.hf = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.eos_token_ids = sorted({*eos_token_ids, *([eos_id] if eos_id is not None else [])})
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self._template = None

    def set_chat_template(self, template: str) -> None:
        """Use `template` (Jinja) in place of the model's chat template (--chat-template)."""
        self.chat_template = template
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        if path.is_file() and path.suffix == ".gguf":
            return cls.from_gguf(path)
        folder = path if path.is_dir() else path.parent
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{folder}: no tokenizer.json (a fast tokenizer is required)")
        cfg_file = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        jinja = folder / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        return cls(
            HFTokenizer.from_file(str(tok_file)),
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            chat_template=template if isinstance(template, str) else None,
            eos_token_ids=eos_token_ids,
        )

    @classmethod
    def from_gguf(cls, path: Path) -> Tokenizer:
        from atom_runtime.models.gguf import gguf_field, open_gguf

        reader = open_gguf(path)
        kind = gguf_field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE only)"
            )
        tokens = gguf_field(reader, "tokenizer.ggml.tokens")
        types = gguf_field(reader, "tokenizer.ggml.token_type")
        merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges")]
        tok = HFTokenizer(
            models.BPE(
                vocab={t: i for i, t in enumerate(tokens)},
                merges=merges,
                fuse_unk=False,
                byte_fallback=False,
            )
        )
        tok.pre_tokenizer = _gguf_pre_tokenizer(gguf_field(reader, "tokenizer.ggml.pre", "gpt2"))
        tok.decoder = decoders.ByteLevel()
        from tokenizers import AddedToken

        control = [t for t, kind in zip(tokens, types, strict=True) if kind in (3, 4)]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
        eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
        return cls(
            tok,
            bos_token=tokens[bos] if bos is not None else None,
            eos_token=tokens[eos] if eos is not None else None,
            add_bos_token=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
            chat_template=gguf_field(reader, "tokenizer.chat_template"),
        )

    # -- encoding ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it), so a long prompt
        # tokenized in a worker thread leaves the API server's event loop free.
        ids = self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        if not self.chat_template:
            raise ValueError("messages: this model has no chat template; use a plain prompt")
        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            # What transformers gives templates too: `{% break %}` / `{% continue %}` and
            # strftime_now (GPT-OSS's harmony template writes today's date with it).
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        text = self.apply_chat_template(messages, **kwargs)
        # The template writes any BOS itself; encode its special tokens literally. (encode_batch:
        # the GIL is released while it works, see encode.)
        return self.hf.encode_batch([text], add_special_tokens=False)[0].ids


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _raise_template_error(message: str):
    raise ValueError(f"messages: {message}")
