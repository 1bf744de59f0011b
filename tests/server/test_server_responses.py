"""Pure parts of the server: the JSON edge converts arrays to lists, error mapping names fields,
and the wire messages of the engine-core sockets round-trip through msgpack."""

from __future__ import annotations

from array import array

import pytest
from pydantic import ValidationError

from atom_runtime.protocol.codec import decoder, encoder
from atom_runtime.protocol.engine_core import (
    AddRequests,
    ClientMessage,
    EngineMessage,
    EngineReady,
    EngineRequest,
    EngineStats,
    Outputs,
    RequestUpdate,
    StepOutputs,
)
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.server import responses as R
from atom_runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from atom_runtime.web.errors import field_path, from_validation_error, from_value_error


def _walk(obj):
    yield obj
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk(v)


def test_builders_turn_arrays_into_lists():
    ids = array("i", [5, 6, 7])
    top = [{5: -0.1, 9: -2.0}, {6: -0.2, 9: -3.0}, {7: -0.3, 1: -1.0}]
    text = {5: "a", 6: "b", 7: "c", 9: "z", 1: "y"}.__getitem__
    bodies = [
        R.completion_logprobs(ids, top, 1, text, 0),
        R.chat_logprobs(ids, top, 2, text),
        R.completion_body(
            "id", 0, "m", [R.completion_choice(0, "abc", "length", None, None)], R.usage(3, 3, 0)
        ),
    ]
    for body in bodies:
        assert not any(isinstance(x, array) for x in _walk(body))
        R.encode(body)  # would raise TypeError on an array
    assert bodies[0] == {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [-0.1, -0.2, -0.3],
        "top_logprobs": [{"a": -0.1}, {"b": -0.2}, {"c": -0.3}],
        "text_offset": [0, 1, 2],
    }
    assert [c["top_logprobs"][1]["token"] for c in bodies[1]["content"]] == ["z", "z", "y"]


def test_encoding_an_array_fails_loudly():
    with pytest.raises(TypeError, match="array"):
        R.encode({"token_ids": array("i", [1, 2])})


def test_usage_shape():
    assert R.usage(10, 4, 8) == {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


@pytest.mark.parametrize(
    "loc, path",
    [((), None), (("messages",), "messages"), (("messages", 0, "role"), "messages[0].role")],
)
def test_field_path(loc, path):
    assert field_path(loc) == path


def test_validation_error_names_the_field_without_union_tags():
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate_json(
            b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'
        )
    err = from_validation_error(e.value)
    assert (err.status, err.param) == (400, "messages[0].content")


def test_value_errors_map_to_params_with_renames():
    err = from_value_error(ValueError("max_tokens: 5000 + 3 prompt tokens exceed"), {})
    assert (err.param, err.message) == ("max_tokens", "max_tokens: 5000 + 3 prompt tokens exceed")
    renamed = from_value_error(
        ValueError("prompt: 2000 tokens leave no room"), {"prompt": "messages"}
    )
    assert (renamed.param, renamed.message) == ("messages", "messages: 2000 tokens leave no room")
    plain = from_value_error(ValueError("something went wrong here"))
    assert plain.param is None


def test_requests_to_sampling_params():
    c = CompletionRequest.model_validate({"prompt": "x", "stop": "END", "seed": 3})
    assert c.sampling_params() == SamplingParams(max_tokens=16, stop=["END"], seed=3)
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}
    )
    assert chat.sampling_params() == SamplingParams(max_tokens=None, logprobs=2)
    with pytest.raises(Exception) as e:
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}
        ).sampling_params()
    assert e.value.param == "max_completion_tokens"


def test_socket_messages_round_trip_as_msgpack():
    stats = EngineStats(1, 2, 0.5, 64, 16, 10, 4, 0, 10, 3)
    update = RequestUpdate("r", finish_reason="length", num_prompt_tokens=3)
    out = StepOutputs(["r", "r"], [1, 2], [0.5, -1.0], [[7], [8]], [[-0.1], [-2.0]], [update])
    for msg in (
        AddRequests(7, [EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=2))]),
        Outputs(out, stats),
        EngineReady("/m", [2], 1024, "cpu", 64, 16, 49152, 4096, stats),
    ):
        data = encoder().encode(msg)
        union = ClientMessage if isinstance(msg, AddRequests) else EngineMessage
        assert decoder(union).decode(data) == msg
