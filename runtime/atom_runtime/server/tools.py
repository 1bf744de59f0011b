"""Tool calling for /v1/chat/completions, as OpenAI's API and vLLM's server offer it.

`tool_choice` decides how a request's tools are used:
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is held to the
  function's `parameters` schema (structured outputs) and returned as that function's call;
- `"required"`: the output is held to a JSON list of `{"name", "parameters"}` objects, one of the
  tools each, and returned as those calls;
- `"auto"` (the default when tools are given and the server runs with
  `--enable-auto-tool-choice --tool-call-parser hermes`): the model writes what it likes and the
  parser takes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the Hermes
  format of Qwen2.5/Qwen3's templates) out of its text;
- `"none"`: plain text; the tools still reach the chat template.
Streaming sends the text as it comes, holding back from the first `<tool_call>`, and the calls
in one delta when the choice finishes.

`--tool-call-parser openai` (GPT-OSS) reads calls from harmony's messages addressed to
`functions.NAME`; harmony is parsed by the gpt_oss reasoning parser (server/reasoning.py), which
it needs.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from atom_runtime.sampling_params import StructuredOutputs
from atom_runtime.web.errors import bad_request

TOOL_CALL_PARSERS = ("hermes", "openai")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolPlan:
    mode: str  # "none" | "named" | "required" | "auto"
    functions: dict[str, dict]  # name -> the function's definition
    name: str | None = None  # the named function

    @property
    def constraint(self) -> StructuredOutputs | None:
        """What the output is held to (named and required)."""
        if self.mode == "named":
            schema = self.functions[self.name].get("parameters") or {"type": "object"}
            return StructuredOutputs(json=json.dumps(schema))
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": name},
                        "parameters": fn.get("parameters") or {"type": "object"},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, fn in self.functions.items()
            ]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            return StructuredOutputs(json=json.dumps(schema))
        return None

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a finished choice's text."""
        if self.mode == "named":
            return None, [call_object(self.name, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
                return None, [call_object(c["name"], json.dumps(c["parameters"])) for c in calls]
            except (ValueError, TypeError, KeyError):  # cut short by max_tokens
                return text, []
        if self.mode == "auto":
            return parse_hermes(text)
        return text, []

    def streamable(self, text: str) -> int:
        """How much of a choice's text so far can be streamed (as content; for a named function,
        as its call's arguments)."""
        if self.mode == "required":
            return 0
        if self.mode in ("none", "named"):
            return len(text)
        start = text.find(HERMES_OPEN)
        if start >= 0:
            return start
        # Hold back a tail that could be the start of "<tool_call>".
        for keep in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
            if HERMES_OPEN.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def finish_reason(self, calls: list[dict], reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required); a named
        function's call ends with "stop"."""
        if calls and reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """Hermes-format calls out of a model's text: content before the first block, the calls.
    A block whose JSON does not parse leaves the whole text as content (as vLLM does)."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES_BLOCK.findall(text[start:]):
        try:
            obj = json.loads(body)
            arguments = obj.get("arguments", obj.get("parameters", {}))
            calls.append(call_object(obj["name"], json.dumps(arguments)))
        except (ValueError, TypeError, KeyError, AttributeError):
            return text, []
    content = text[:start]  # as streamed: whitespace kept
    return (content if content.strip() else None), calls


def call_object(name: str, arguments: str) -> dict:
    """One tool call of a response, as OpenAI's API shapes it (a fresh id)."""
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def named_call_delta(name: str, arguments: str, first: bool) -> dict:
    """A streamed piece of a named function's call: the first carries its id and name."""
    if first:
        return {"index": 0, **call_object(name, arguments)}
    return {"index": 0, "function": {"arguments": arguments}}


def plan_tools(
    tools: list[dict] | None, tool_choice: str | dict | None, parser: str | None
) -> ToolPlan:
    """The request's ToolPlan; a 400 naming the field for anything malformed or unavailable."""
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(
                f'tools[{i}]: expected {{"type": "function", "function": {{...}}}}', f"tools[{i}]"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name: required", f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(
                f"tools[{i}].function.parameters: must be a JSON schema object",
                f"tools[{i}].function.parameters",
            )
        functions[name] = fn
    if tool_choice is None:
        tool_choice = "auto" if functions and parser else "none"
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                'tool_choice: expected {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in functions:
            raise bad_request(f"tool_choice: no tool named {name!r} in tools", "tool_choice")
        return ToolPlan("named", functions, name)
    if tool_choice not in ("none", "auto", "required"):
        raise bad_request(
            f"tool_choice: expected none, auto, required or a function, got {tool_choice!r}",
            "tool_choice",
        )
    if tool_choice != "none" and not functions:
        raise bad_request(f"tool_choice: {tool_choice!r} needs tools", "tool_choice")
    if tool_choice == "auto" and parser is None:
        raise bad_request(
            'tool_choice: "auto" needs the server started with --enable-auto-tool-choice '
            "and --tool-call-parser",
            "tool_choice",
        )
    return ToolPlan(tool_choice, functions)
