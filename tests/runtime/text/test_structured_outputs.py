"""Structured outputs in the engine: text held to a JSON schema, a regex, a choice or a Lark
grammar (llguidance masks, checked here against the real matcher on a small random model, whose
free text would match none of them), batched beside unguided requests, with async scheduling,
and bad grammars refused naming the field without harming the engine."""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import pytest

from atom_runtime import LLM, SamplingParams
from atom_runtime.protocol.engine_core import EngineRequest
from atom_runtime.sampling_params import StructuredOutputs

PROMPT = {"prompt_token_ids": [11, 22, 33, 44, 55]}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_models, request):
    engine = LLM(
        str(tiny_models["llama"]),
        dtype="float32",
        num_gpu_blocks_override=128,
        async_scheduling=request.param,
    )
    yield engine
    engine.shutdown()


def _run(llm, spec: StructuredOutputs, n: int = 1, **kw):
    params = dict(temperature=0, max_tokens=120, ignore_eos=True) | kw
    out = llm.generate(
        PROMPT, SamplingParams(n=n, structured_outputs=spec, **params), use_tqdm=False
    )
    return out[0].outputs


def test_json_schema_output_parses_and_validates(llm):
    spec = StructuredOutputs(json=json.dumps(SCHEMA), disable_any_whitespace=True)
    outs = _run(llm, spec, n=4, temperature=1.0, seed=5)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert " " not in out.text.replace(json.loads(out.text)["name"], "")
    assert len({o.text for o in outs}) > 1  # it really samples


def test_regex_and_choice_and_grammar(llm):
    for out in _run(llm, StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"), n=3, temperature=1.0):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out.text) and out.finish_reason == "stop"
    choices = ["yes", "no", 'it "depends"']
    texts = {o.text for o in _run(llm, StructuredOutputs(choice=choices), n=8, temperature=1.0)}
    assert texts <= set(choices)
    lark = 'start: "(" NUM ("," NUM)* ")"\nNUM: /[1-9][0-9]?/'
    (out,) = _run(llm, StructuredOutputs(grammar=lark))
    assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", out.text), out.text


def test_json_object_is_an_object(llm):
    (out,) = _run(llm, StructuredOutputs(json_object=True), max_tokens=200)
    assert out.text.lstrip().startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


def test_guided_and_free_requests_share_a_batch(llm):
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPT, free, use_tqdm=False)[0].outputs[0].token_ids
    guided = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(regex="[a-z]{5}")
    )
    outs = llm.generate([PROMPT, PROMPT, PROMPT], [guided, free, guided], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    assert all(re.fullmatch("[a-z]{5}", o.outputs[0].text) for o in (outs[0], outs[2]))


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputs(regex="[0-9"),
        StructuredOutputs(grammar="start: undefined_rule"),
        StructuredOutputs(json='{"type": "no-such-type"}'),
    ],
)
def test_bad_grammars_are_refused_and_the_engine_carries_on(llm, spec):
    engine = llm.engine
    with pytest.raises(ValueError, match="^structured_outputs: "):
        engine.add_request(EngineRequest("bad", [1, 2, 3], SamplingParams(structured_outputs=spec)))
    assert "bad" not in engine.scheduler.requests and not engine.has_unfinished_requests()
    (out,) = _run(llm, StructuredOutputs(choice=["ok"]))
    assert out.text == "ok"


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["b"]}, "exactly one of"),
        ({"choice": ["a", ""]}, "choice must be"),
        ({"json": "{not json"}, "not a valid JSON"),
    ],
)
def test_spec_validation_names_the_field(fields, match):
    with pytest.raises(ValueError, match=f"^structured_outputs: .*{match}"):
        StructuredOutputs(**fields)


def test_spec_travels_in_sampling_params_and_refuses_unknown_keys():
    params = SamplingParams(structured_outputs=StructuredOutputs(choice=["a", "b"]))
    wire = msgspec.msgpack.encode(params)
    assert msgspec.msgpack.decode(wire, type=SamplingParams) == params
    with pytest.raises(msgspec.ValidationError, match="whitespace_pattern"):
        msgspec.convert({"regex": "a", "whitespace_pattern": " "}, StructuredOutputs)
