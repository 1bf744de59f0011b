"""Tool calling: the plan a request's tools and tool_choice make (and the 400s), the Hermes parser,
what streaming holds back, and end to end against `atom serve` with the official client."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from atom_runtime.server.tools import ToolPlan, parse_hermes, plan_tools
from atom_runtime.web.errors import APIError
from tests.server.conftest import TINY_FLAGS

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}  # fmt: skip
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


# -- the plan ----------------------------------------------------------------------------------


def test_plan_modes_and_defaults():
    assert plan_tools(None, None, None).mode == "none"
    assert plan_tools([WEATHER], None, None).mode == "none"  # no parser: tools reach the template
    assert plan_tools([WEATHER], None, "hermes").mode == "auto"
    named = plan_tools(
        [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None
    )
    assert (named.mode, named.name) == ("named", "get_time")
    assert json.loads(named.constraint.json) == TIME["function"]["parameters"]
    required = plan_tools([WEATHER, TIME], "required", None)
    schema = json.loads(required.constraint.json)
    jsonschema.validate([{"name": "get_time", "parameters": {"tz": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "x"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)


@pytest.mark.parametrize(
    ("tools", "choice", "parser", "param"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice"),
        ([WEATHER], {"type": "function"}, None, "tool_choice"),
        ([WEATHER], "sometimes", None, "tool_choice"),
        ([WEATHER], "auto", None, "tool_choice"),
        (None, "required", None, "tool_choice"),
        ([{"type": "retrieval"}], None, None, "tools[0]"),
        ([{"type": "function", "function": {"description": "x"}}], None, None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, None,
         "tools[0].function.parameters"),
    ],
)  # fmt: skip
def test_plan_refuses_naming_the_field(tools, choice, parser, param):
    with pytest.raises(APIError) as e:
        plan_tools(tools, choice, parser)
    assert e.value.status == 400 and e.value.param == param


def test_hermes_parser():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me check.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert parse_hermes("no calls here") == ("no calls here", [])
    # An unterminated last block still parses (the model stopped at EOS); broken JSON does not.
    assert (
        parse_hermes('<tool_call>{"name": "f", "arguments": {"a": 1}}')[1][0]["function"][
            "arguments"
        ]
        == '{"a": 1}'
    )
    assert parse_hermes("<tool_call>{not json</tool_call>") == (
        "<tool_call>{not json</tool_call>",
        [],
    )


def test_streaming_holds_back_what_may_become_a_call():
    auto = ToolPlan("auto", {"f": {}})
    assert auto.streamable("Hello") == 5
    assert auto.streamable("Hello <tool") == len("Hello ")
    assert auto.streamable("Hello <tool_call>{") == len("Hello ")
    assert auto.streamable("a < b") == 5  # "<" followed by a space cannot open a call
    assert ToolPlan("named", {"f": {}}, "f").streamable("{}") == 2  # as the arguments
    assert ToolPlan("required", {"f": {}}).streamable("[{") == 0
    assert ToolPlan("none", {}).streamable("<tool") == 5
    assert auto.finish_reason([{}], "stop") == "tool_calls"
    assert auto.finish_reason([], "stop") == "stop"
    assert ToolPlan("named", {"f": {}}, "f").finish_reason([{}], "stop") == "stop"
    assert auto.finish_reason([{}], "length") == "length"


# -- end to end --------------------------------------------------------------------------------


def test_named_function_is_called_with_valid_arguments(client, model_name):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model=model_name, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice,
        max_tokens=80, temperature=0, extra_body=COMPACT,
    )  # fmt: skip
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "stop" and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            max_tokens=80,
            temperature=0,
            extra_body=COMPACT,
            stream=True,
        )  # fmt: skip
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.content for d in deltas)
    pieces = [tc for d in deltas for tc in (d.tool_calls or [])]
    # The arguments stream as they are written: the first piece names the call, the rest extend
    # its arguments. (How many pieces depends on how many tokens each read of the engine's
    # output found waiting, so on the machine's speed; the pieces' shape does not.)
    assert pieces and all(p.index == 0 for p in pieces)
    assert pieces[0].id.startswith("chatcmpl-tool-") and pieces[0].function.name == "get_weather"
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_calls_one_or_more_tools(client, model_name):
    out = client.chat.completions.create(
        model=model_name, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=150, temperature=1.0, seed=3, n=3, extra_body=COMPACT,
    )  # fmt: skip
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_tool_conversation_round_trip_and_refusals(client, model_name, server):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    out = client.chat.completions.create(
        model=model_name, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=5
    )
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"
    body = {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 4}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    both = {**body, "tool_choice": "required", "response_format": {"type": "json_object"}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=both)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_auto_tool_choice_streams_the_same_content(tiny_models, launch_server):
    srv = launch_server("--model", str(tiny_models["llama"]), *TINY_FLAGS,
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes")  # fmt: skip
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=600)
    kw = dict(model=str(tiny_models["llama"]), messages=MESSAGES, tools=[WEATHER],
              max_tokens=24, temperature=0)  # fmt: skip
    out = client.chat.completions.create(**kw)
    streamed = client.chat.completions.create(**kw, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    # A random model writes no <tool_call>: its text comes back as content, whole.
    assert out.choices[0].message.tool_calls is None
    assert text == out.choices[0].message.content and text
    assert srv.stop() == 0


def test_auto_tool_choice_flags_are_checked(launch_server):
    srv = launch_server("--enable-auto-tool-choice", wait=False)
    assert srv.proc.wait(300) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in srv.log()
