"""Reasoning output for /v1/chat/completions (`--reasoning-parser`), as vLLM's API gives it: the
model's thinking in the message's `reasoning_content` (and in streamed deltas'), the answer in
`content`, tool calls read from the answer only.

Parsers, by vLLM's names:
- `deepseek_r1`: the output starts inside the thinking (R1's template opens `<think>` in the
  prompt; a generated `<think>` is dropped), which `</think>` ends. No `</think>`: all of it is
  reasoning (cut short by max_tokens, say).
- `qwen3`: thinking is `<think>...</think>` at the start of the output, or opened by the prompt
  (the Thinking-2507 templates end the prompt with `<think>`). Otherwise all is content
  (`enable_thinking: false` templates close the block in the prompt).
- `gpt_oss` (vLLM also calls it `openai_gptoss`): GPT-OSS's harmony format. The output is a
  run of messages, `<|channel|>NAME<|message|>BODY<|end|>`, the next ones after
  `<|start|>assistant`; the `analysis` channel is reasoning, `final` (and `commentary` addressed
  to no one, a preamble) is content, and a message addressed `to=functions.NAME` is a call of
  that tool with BODY as its arguments (`--tool-call-parser openai`). Its markers are special
  tokens, so a request under this parser is detokenized with them.

Every parser is a pure function of the text so far (`split`), whose reasoning and content only
grow as the text does: streaming sends what is new in each (a tail that could begin a marker is
held back until it is known not to be one).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from atom_runtime.sampling_params import SamplingParams
from atom_runtime.server.tools import ToolPlan, call_object

REASONING_PARSERS = ("deepseek_r1", "qwen3", "gpt_oss", "openai_gptoss")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Split:
    """A choice's text as reasoning and content (and harmony's tool calls)."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)  # gpt_oss: (name, arguments) dicts
    thinking: bool = False  # the text ends inside the reasoning


def _held_tail(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could begin one of `markers`."""
    for keep in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        tail = text[-keep:]
        if any(m.startswith(tail) for m in markers):
            return keep
    return 0


class ThinkParser:
    """`<think>...</think>` reasoning (deepseek_r1, qwen3)."""

    needs_special_tokens = False

    def __init__(self, opens_by_default: bool) -> None:
        self.opens_by_default = opens_by_default

    def split(self, text: str, final: bool, opened: bool = False) -> Split:
        """`opened`: the prompt ended inside a thinking block."""
        body = text.lstrip()
        if body.startswith(THINK_OPEN):
            body = body[len(THINK_OPEN) :]
        elif not final and body and THINK_OPEN.startswith(body):
            return Split()  # perhaps "<think>" still arriving: hold it
        elif not (opened or self.opens_by_default):
            return Split(content=text)
        end = body.find(THINK_CLOSE)
        if end >= 0:
            return Split(reasoning=body[:end], content=body[end + len(THINK_CLOSE) :])
        hold = 0 if final else _held_tail(body, (THINK_CLOSE,))
        return Split(reasoning=body[: len(body) - hold], thinking=True)


_HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
_HARMONY_MESSAGE = re.compile(
    r"(?P<header>(?:(?!<\|message\|>).)*?)<\|message\|>(?P<body>.*?)"
    r"(?P<stop><\|end\|>|<\|return\|>|<\|call\|>|<\|start\|>|$)",
    re.DOTALL,
)
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser:
    """GPT-OSS's harmony channels (gpt_oss)."""

    needs_special_tokens = True

    def split(self, text: str, final: bool, opened: bool = False) -> Split:
        out = Split()
        if not final:
            text = text[: len(text) - _held_tail(text, _HARMONY_MARKERS)]
        found = False
        for m in _HARMONY_MESSAGE.finditer(text):
            found = True
            header, body = m.group("header"), m.group("body")
            channel = _CHANNEL.search(header)
            recipient = _RECIPIENT.search(header)
            ended = m.group("stop") != ""
            if recipient is not None:
                if recipient.group(1).startswith("functions.") and (ended or final):
                    name = recipient.group(1)[len("functions.") :]
                    out.calls.append(call_object(name, body.strip()))
                continue
            if channel is not None and channel.group(1) == "analysis":
                out.reasoning += body
                out.thinking = not ended
            else:  # final, or commentary addressed to no one (a preamble)
                out.content += body
        if not found and final:  # no harmony at all: the text is the answer
            out.content = text
        return out


def make_parser(name: str | None) -> ThinkParser | HarmonyParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser {name!r}: not one of {', '.join(REASONING_PARSERS)}")
    if name in ("gpt_oss", "openai_gptoss"):
        return HarmonyParser()
    return ThinkParser(opens_by_default=name == "deepseek_r1")


def plan_reasoning(
    parser: ThinkParser | HarmonyParser | None,
    tools: ToolPlan,
    params: SamplingParams,
    include_reasoning: bool,
    prompt_tail: Callable[[], str],
) -> dict[int, ChoiceReasoning] | None:
    """Each choice's reasoning split for a chat request, by choice index; None without a parser
    or when the output is held to a tool's schema from its first token (a named function,
    "required"). Harmony's markers are special tokens: such a request is detokenized with them
    (`params` changes). `prompt_tail`: the prompt's last tokens as text, to see whether the
    template opened a thinking block."""
    if parser is None or tools.mode not in ("none", "auto"):
        return None
    if parser.needs_special_tokens:
        params.skip_special_tokens = False
    opened = isinstance(parser, ThinkParser) and prompt_tail().rstrip().endswith(THINK_OPEN)
    return {i: ChoiceReasoning(parser, tools, opened, include_reasoning) for i in range(params.n)}


@dataclass
class ChoiceReasoning:
    """One choice under a reasoning parser: its split, what of it was streamed, and its message
    (or last delta) fields."""

    parser: ThinkParser | HarmonyParser
    tools: ToolPlan
    opened: bool = False
    include_reasoning: bool = True
    sent_reasoning: int = 0
    sent_content: int = 0

    def message(self, text: str) -> tuple[str | None, str | None, list[dict]]:
        """(reasoning_content, content, tool calls) of a finished choice's text."""
        split = self.parser.split(text, final=True, opened=self.opened)
        content, calls = self._answer(split)
        reasoning = split.reasoning if self.include_reasoning and split.reasoning else None
        return reasoning, content, calls

    def _answer(self, split: Split) -> tuple[str | None, list[dict]]:
        if self.tools.mode == "auto" and isinstance(self.parser, HarmonyParser):
            return (split.content or None), split.calls
        content, calls = self.tools.parse(split.content)
        return (content or None), calls

    def delta(self, text: str, final: bool) -> tuple[dict, list[dict]]:
        """What is new since the last delta: {reasoning_content, content} pieces, and at the
        end the tool calls (whose text was held back)."""
        split = self.parser.split(text, final=final, opened=self.opened)
        delta: dict = {}
        if len(split.reasoning) > self.sent_reasoning:
            if self.include_reasoning:
                delta["reasoning_content"] = split.reasoning[self.sent_reasoning :]
            self.sent_reasoning = len(split.reasoning)
        calls: list[dict] = []
        if final:
            content, calls = self._answer(split)
            upto = len(content or "") if calls else len(split.content)
            shown = (content or "") if calls else split.content
        else:
            harmony_tools = self.tools.mode == "auto" and isinstance(self.parser, HarmonyParser)
            shown = split.content
            upto = len(shown) if harmony_tools else self.tools.streamable(shown)
        if upto > self.sent_content:
            delta["content"] = shown[self.sent_content : upto]
            self.sent_content = upto
        return delta, calls
