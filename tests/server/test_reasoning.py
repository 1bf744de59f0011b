"""Reasoning output (`--reasoning-parser`): each parser's split of a model's text into reasoning
and content, that streaming that text piece by piece sends exactly the split (reasoning and
content only grow, markers never leak), tool calls read from the answer and never from the
thinking, GPT-OSS's harmony channels and calls; and end to end against `atom serve`, the
non-streamed message equal to the streamed deltas put together, with a Hermes tool call after a
reasoning block."""

from __future__ import annotations

import json

import openai
import pytest

from atom_runtime.sampling_params import SamplingParams
from atom_runtime.server.reasoning import (
    ChoiceReasoning,
    HarmonyParser,
    ThinkParser,
    make_parser,
    plan_reasoning,
)
from atom_runtime.server.tools import ToolPlan
from tests.server.conftest import TINY_FLAGS

R1, QWEN3, HARMONY = make_parser("deepseek_r1"), make_parser("qwen3"), make_parser("gpt_oss")
NONE = ToolPlan("none", {})
AUTO_HERMES = ToolPlan("auto", {"get_weather": {}})


def _streamed(choice: ChoiceReasoning, text: str, step: int = 1):
    """Feed `text` `step` characters at a time, then finish: (reasoning, content, calls)."""
    reasoning, content, calls = "", "", []
    for end in range(step, len(text) + step, step):
        final = end >= len(text)
        delta, got = choice.delta(text[:end], final=final)
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        calls += got
        if final:
            break
    return reasoning, content, calls


@pytest.mark.parametrize(
    ("parser", "text", "opened", "want"),
    [
        (R1, "step one</think>The answer.", False, ("step one", "The answer.")),
        (R1, "<think>step one</think>The answer.", False, ("step one", "The answer.")),
        (R1, "cut short by max_tokens", False, ("cut short by max_tokens", None)),
        (QWEN3, "<think>\nhmm\n</think>\n\nHi!", False, ("\nhmm\n", "\n\nHi!")),
        (QWEN3, "Hi, no thinking here.", False, (None, "Hi, no thinking here.")),
        (QWEN3, "opened by the prompt</think>Hi", True, ("opened by the prompt", "Hi")),
        (QWEN3, "a < b, so <thin is not a tag", False, (None, "a < b, so <thin is not a tag")),
    ],
)
def test_think_parsers_split_and_stream_the_same(parser, text, opened, want):
    message = ChoiceReasoning(parser, NONE, opened).message(text)
    assert message[:2] == want
    for step in (1, 3, 100):
        reasoning, content, _ = _streamed(ChoiceReasoning(parser, NONE, opened), text, step)
        assert (reasoning or None, content or None) == want


def test_streaming_holds_back_a_marker_being_written():
    choice = ChoiceReasoning(R1, NONE)
    assert choice.delta("thinking </th", final=False)[0] == {"reasoning_content": "thinking "}
    assert choice.delta("thinking </think>ok", final=False)[0] == {"content": "ok"}
    qwen = ChoiceReasoning(QWEN3, NONE)
    assert qwen.delta("<thi", final=False)[0] == {}  # perhaps "<think>": nothing shown yet
    assert qwen.delta("<think>x", final=False)[0] == {"reasoning_content": "x"}


def test_tool_calls_come_from_the_answer_not_the_thinking():
    text = (
        '<think>I could write <tool_call>{"name": "nope"}</tool_call> here.</think>\n'
        'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    reasoning, content, calls = ChoiceReasoning(QWEN3, AUTO_HERMES).message(text)
    assert reasoning.startswith("I could write <tool_call>")
    assert content == "\nChecking.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    s_reasoning, s_content, s_calls = _streamed(ChoiceReasoning(QWEN3, AUTO_HERMES), text, 2)
    assert (s_reasoning, s_content) == (reasoning, content)
    assert [c["function"] for c in s_calls] == [c["function"] for c in calls]


HARMONY_TEXT = (
    "<|channel|>analysis<|message|>User wants weather. Call the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}<|call|>'
)


def test_harmony_channels_and_calls():
    tools = ToolPlan("auto", {"get_weather": {}})
    reasoning, content, calls = ChoiceReasoning(HARMONY, tools).message(HARMONY_TEXT)
    assert reasoning == "User wants weather. Call the tool."
    assert content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}')
    ]
    answer = (
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Hello there.<|return|>"
    )
    assert ChoiceReasoning(HARMONY, NONE).message(answer) == ("Think.", "Hello there.", [])
    for text in (answer, HARMONY_TEXT):
        for step in (1, 4):
            want = ChoiceReasoning(HARMONY, tools).message(text)
            got = _streamed(ChoiceReasoning(HARMONY, tools), text, step)
            assert (got[0] or None, got[1] or None) == want[:2]
            assert [c["function"] for c in got[2]] == [c["function"] for c in want[2]]
    # Text with no harmony at all (a model off its format) is the answer.
    assert ChoiceReasoning(HARMONY, NONE).message("plain") == (None, "plain", [])


def test_plan_reasoning_detokenizes_harmony_with_special_tokens_and_skips_schemas():
    params = SamplingParams(n=2)
    plan = plan_reasoning(HARMONY, NONE, params, True, lambda: "")
    assert sorted(plan) == [0, 1] and params.skip_special_tokens is False
    params = SamplingParams()
    named = ToolPlan("named", {"f": {}}, "f")
    assert plan_reasoning(QWEN3, named, params, True, lambda: "") is None
    assert plan_reasoning(None, NONE, params, True, lambda: "") is None
    opened = plan_reasoning(QWEN3, NONE, params, True, lambda: "<|im_start|>assistant\n<think>\n")
    assert opened[0].opened and params.skip_special_tokens is True
    assert isinstance(R1, ThinkParser) and isinstance(HARMONY, HarmonyParser)
    with pytest.raises(ValueError, match="reasoning parser 'nope'"):
        make_parser("nope")


# -- end to end --------------------------------------------------------------------------------

# The random model writes what the regex allows: a thinking block, then a Hermes tool call.
THINK_THEN_CALL = (
    r'<think>[a-z]{2,6}( [a-z]{2,6}){1,3}</think>\n<tool_call>\n\{"name": "get_weather", '
    r'"arguments": \{"city": "[A-Z][a-z]{2,5}"\}\}\n</tool_call>'
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


def test_server_reasoning_then_tool_call_streamed_and_not(tiny_models, launch_server):
    srv = launch_server(
        "--model", str(tiny_models["llama"]), *TINY_FLAGS, "--reasoning-parser", "deepseek_r1",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=600)
    kw = dict(
        model=str(tiny_models["llama"]), messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER], max_tokens=120, temperature=0,
        extra_body={"structured_outputs": {"regex": THINK_THEN_CALL}},
    )  # fmt: skip
    out = client.chat.completions.create(**kw)
    msg = out.choices[0].message
    thought = msg.model_extra["reasoning_content"]
    assert thought and "<think>" not in thought and "</think>" not in thought
    assert out.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
    assert not (msg.content or "").strip()
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == thought
    assert not "".join(d.content or "" for d in deltas).strip()
    (s_call,) = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert s_call.function.arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # include_reasoning false: the thinking is dropped, the call stays.
    no_thinking = {**kw["extra_body"], "include_reasoning": False}
    bare = client.chat.completions.create(**{**kw, "extra_body": no_thinking})
    assert bare.choices[0].message.model_extra["reasoning_content"] is None
    assert bare.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    assert srv.stop() == 0


def test_openai_tool_parser_needs_the_gpt_oss_reasoning_parser(launch_server):
    srv = launch_server("--enable-auto-tool-choice", "--tool-call-parser", "openai", wait=False)
    assert srv.proc.wait(300) == 2
    assert "--tool-call-parser openai reads harmony messages" in srv.log()
