"""Request bodies of the OpenAI API, with OpenAI's field names (and vLLM's sampling extras).

pydantic checks types and structure only, in strict mode (`"10"` is not an int); value ranges are
SamplingParams' job, so each rule lives in one place. `to_sampling_params` turns a request into
SamplingParams and the error param back into the name the client used.
"""

from __future__ import annotations

import json
from typing import Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from atom_runtime.sampling_params import STRUCTURED_FIELD as STRUCTURED
from atom_runtime.sampling_params import SamplingParams, StructuredOutputs
from atom_runtime.server.tools import ToolPlan
from atom_runtime.web.errors import bad_request, from_value_error


class _Body(BaseModel):
    # Unknown fields are ignored (clients send `user`, SDK metadata, ...); known ones are strict.
    # Floats must be finite: `Infinity`, `NaN` and 1e999 are refused with the field's name.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(
        strict=True, extra="ignore", populate_by_name=True, allow_inf_nan=False
    )
    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# structured_outputs keys that tune a constraint rather than being one.
OPTIONS = ("disable_any_whitespace",)
# vLLM's guided-decoding fields (the request's name -> StructuredOutputs' field).
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}  # fmt: skip


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras (the openai client sends them through `extra_body`).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Only `atom router` sets these usefully: an engine acts on kv_transfer_params it signed
    # (kv_transfer/auth.py) and refuses any other. cache_salt (vLLM's) keeps a tenant's
    # prefix-cache entries its own.
    kv_transfer_params: dict | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    # Structured outputs: OpenAI's response_format, or vLLM's guided_* / structured_outputs.
    response_format: ResponseFormat | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None

    def _structured_asked(self) -> dict[str, dict]:
        """{the field the request used: StructuredOutputs fields} for each way it asked."""
        asked = {}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked["response_format"] = {"json_object": True}
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise bad_request(
                    "response_format.json_schema: required when type is json_schema",
                    "response_format.json_schema",
                )
            asked["response_format"] = {"json": json.dumps(rf.json_schema.schema_)}
        for name, key in GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                asked[name] = {key: value if isinstance(value, (str, list)) else json.dumps(value)}
        fields = {k: v for k, v in (self.structured_outputs or {}).items() if k not in OPTIONS}
        if isinstance(fields.get("json"), dict):
            fields["json"] = json.dumps(fields["json"])
        if fields:
            asked[STRUCTURED] = fields
        return asked

    def _structured_options(self) -> dict:
        """structured_outputs' options (disable_any_whitespace), which also apply to a
        constraint asked for another way (response_format, guided_json)."""
        return {k: v for k, v in (self.structured_outputs or {}).items() if k in OPTIONS}

    def _structured(self, tool: StructuredOutputs | None = None) -> StructuredOutputs | None:
        """The request's structured-output constraint: the one it asked for, or `tool` (what
        its tool_choice holds the output to), with structured_outputs' options."""
        asked = self._structured_asked()
        if tool is not None:
            if asked:
                raise bad_request(
                    f"tool_choice: cannot be combined with {next(iter(asked))}", "tool_choice"
                )
            return msgspec.structs.replace(tool, **self._structured_options())
        if not asked:
            if self._structured_options():
                raise bad_request(
                    f"{STRUCTURED}: options given without a constraint (json, regex, choice, "
                    "grammar, json_object, or response_format / guided_*)",
                    STRUCTURED,
                )
            return None
        names = list(asked)
        if len(names) > 1:
            raise bad_request(f"{names[1]}: cannot be combined with {names[0]}", names[1])
        try:
            return msgspec.convert(asked[names[0]] | self._structured_options(), StructuredOutputs)
        except (ValueError, msgspec.ValidationError) as e:
            text = str(e).removeprefix(f"{STRUCTURED}: ")
            raise bad_request(f"{names[0]}: {text}", names[0]) from None

    def _structured_source(self) -> str:
        """The name this request gave its structured-output constraint (for engine errors)."""
        return next(iter(self._structured_asked()), STRUCTURED)

    def _common_sampling(self, tool: StructuredOutputs | None = None) -> dict:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        fields = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": _token_keys(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids,
            "prompt_logprobs": self.prompt_logprobs,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "structured_outputs": self._structured(tool),
        }
        return {k: v for k, v in fields.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    # Token ids first: pydantic's smart union tries the members in order, and a 562-token id
    # prompt validated in 84 us with list[str] ahead of list[int], 17 us this way.
    prompt: list[int] | str | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def sampling_params(self) -> SamplingParams:
        if self.suffix is not None:
            raise bad_request("suffix: not supported", "suffix", "unsupported")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of: only best_of == n is supported", "best_of", "unsupported")
        fields = self._common_sampling()
        fields["max_tokens"] = self.max_tokens
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs
            if self.echo:  # the prompt's tokens come back with their logprobs too
                fields["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return _build(fields, self.renames())

    def renames(self) -> dict[str, str]:
        """Engine/SamplingParams field name -> the name this request used."""
        return {STRUCTURED: self._structured_source()}

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: each item a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt: must not be an empty list", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        for i, item in enumerate(p):
            if isinstance(item, list) and not item:
                raise bad_request(f"prompt[{i}]: must not be an empty list", f"prompt[{i}]")
        return list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict] | None = None
    reasoning_content: str | None = None  # an earlier answer's thinking, sent back

    def template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # Templates (Qwen, Hermes) write the arguments with `tojson`: give them the object.
            out["tool_calls"] = [_template_call(call) for call in self.tool_calls]
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    include_reasoning: bool = True  # under --reasoning-parser: False drops reasoning_content

    def sampling_params(self, tools: ToolPlan | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request(
                "top_logprobs: requires logprobs to be true", "top_logprobs", "invalid_value"
            )
        fields = self._common_sampling(tools.constraint if tools is not None else None)
        # max_completion_tokens is the current name; max_tokens the deprecated one. Neither:
        # up to the context length.
        if self.max_completion_tokens is not None:
            fields["max_tokens"] = self.max_completion_tokens
        else:
            fields["max_tokens"] = self.max_tokens
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        return _build(fields, self.renames())

    def renames(self) -> dict[str, str]:
        """Engine/SamplingParams field name -> the name this request used."""
        renames = {"logprobs": "top_logprobs", "prompt": "messages"}
        renames[STRUCTURED] = self._structured_source()
        if self.tools and not self._structured_asked():
            renames[STRUCTURED] = "tools"  # a function's parameters schema held the output
        if self.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        return renames

    def conversation(self) -> list[dict]:
        return [m.template_dict() for m in self.messages]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def _build(fields: dict, renames: dict[str, str]) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        raise from_value_error(e, renames) from None


def _token_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as JSON strings."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad_request(
                f"logit_bias: keys must be token ids, got {key!r}", "logit_bias"
            ) from None
    return out


def _template_call(call: dict) -> dict:
    """An assistant message's tool call as chat templates read it: arguments as an object."""
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass  # leave it as the string it is
    return {**call, "function": fn, **fn}
