"""spec.inferencePool renders a Gateway API Inference Extension InferencePool, validated against
the extension's own CRD schema (vendored under tests/operator/data/)."""

from __future__ import annotations

import pathlib

import jsonschema
import pytest
import yaml
from test_crd import to_json_schema

from atom_operator.render import render_children
from atom_operator.render.network import render_inference_pool
from atom_operator.spec import SpecError

POOL_CRD = (
    pathlib.Path(__file__).parent / "data" / "inference.networking.k8s.io_inferencepools.yaml"
)


def atomd(spec: dict) -> dict:
    return {
        "apiVersion": "serving.atom.dev/v1alpha1",
        "kind": "AtomDeployment",
        "metadata": {"name": "chat", "namespace": "llm", "uid": "u-1"},
        "spec": {"accelerator": {"vendor": "cpu"}, **spec},
    }


def schema_errors(obj: dict) -> list[str]:
    crd = yaml.safe_load(POOL_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = to_json_schema(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]


ENABLED = {"enabled": True, "endpointPicker": {"name": "chat-epp"}}


def test_pool_selects_the_serving_pods_and_names_the_endpoint_picker():
    pool = render_inference_pool(atomd({"prefill": {}, "inferencePool": ENABLED}))
    assert pool["metadata"]["name"] == "chat"
    assert pool["spec"] == {
        "selector": {"matchLabels": {"serving.atom.dev/deployment": "chat",
                                     "llm-d.ai/inferenceServing": "true"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"kind": "Service", "name": "chat-epp", "port": {"number": 9002},
                              "failureMode": "FailClose"},
    }  # fmt: skip
    assert schema_errors(pool) == []
    # The selector picks both engine roles (they carry the llm-d label), never the router.
    roles = {
        c["metadata"]["labels"]["serving.atom.dev/role"]: c["spec"]["template"]["metadata"]
        for c in render_children(atomd({"prefill": {}, "inferencePool": ENABLED}))
        if c["kind"] == "Deployment"
    }
    matching = {
        role for role, meta in roles.items()
        if all(meta["labels"].get(k) == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
    }  # fmt: skip
    assert matching == {"decode", "prefill"}


def test_pool_schema_check_can_fail():
    pool = render_inference_pool(atomd({"inferencePool": ENABLED}))
    pool["spec"]["endpointPickerRef"]["failureMode"] = "Sometimes"
    assert [e.split(":")[0] for e in schema_errors(pool)] == ["spec.endpointPickerRef.failureMode"]


def test_no_pool_unless_enabled_and_an_enabled_pool_needs_a_picker():
    assert render_inference_pool(atomd({})) is None
    with pytest.raises(SpecError) as caught:
        render_children(atomd({"inferencePool": {"enabled": True}}))
    assert caught.value.field == "spec.inferencePool.endpointPicker"
