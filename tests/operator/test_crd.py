"""The AtomDeployment CRD: generated file in sync, valid, and enforcing the same rules as spec.py.

The examples are checked against the CRD's openAPIV3Schema with jsonschema (after translating
the Kubernetes-only keywords) and against its CEL rules, evaluated for real by cel-python (celpy)
on the spec after the CRD's own defaulting, as the API server does. A table of broken specs then
pins that the CRD and `validate_spec` reject the same things and name the same field.
"""

from __future__ import annotations

import copy
import pathlib
import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from atom_operator import schema
from atom_operator.spec import DERIVED_DEFAULTS, SpecError, apply_defaults, has_router
from atom_operator.validation import spec_warnings, validate_spec

try:
    import celpy  # cel-python: evaluates the CRD's CEL rules for real
except ImportError:  # pragma: no cover - the test extra installs it
    celpy = None
needs_cel = pytest.mark.skipif(celpy is None, reason="cel-python (celpy) is not installed")

REPO = pathlib.Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "atomdeployments.serving.atom.dev.yaml"
CHART_CRD_FILE = REPO / "charts" / "atom-operator" / "crds" / CRD_FILE.name
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
INVALID_EXAMPLES = sorted((REPO / "examples" / "invalid").glob("*.yaml"))


def _crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())


def _version(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return version


def _spec_schema() -> dict[str, Any]:
    return _version(_crd())["schema"]["openAPIV3Schema"]["properties"]["spec"]


# --- translating the structural schema for jsonschema, and running its CEL rules ------------


def to_json_schema(node: Any) -> Any:
    """OpenAPI v3 structural schema -> JSON Schema 2020-12.

    x-kubernetes-* keys are dropped (int-or-string already carries an anyOf); OpenAPI's boolean
    exclusiveMinimum becomes JSON Schema's numeric one; objects that neither preserve unknown
    fields nor declare additionalProperties reject unknown keys (the API server would prune
    them silently, which for an example means a typo).
    """
    if isinstance(node, list):
        return [to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if out.get("exclusiveMinimum") is True:
        out["exclusiveMinimum"] = out.pop("minimum")
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_default(value: Any, node: dict[str, Any]) -> Any:
    """The API server's structural defaulting, written independently of spec.py."""
    value = copy.deepcopy(value)
    if isinstance(value, dict):
        for name, sub in node.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = crd_default(value[name], sub)
    elif isinstance(value, list) and "items" in node:
        value = [crd_default(item, node["items"]) for item in value]
    return value


def cel_violations(value: Any, node: dict[str, Any], path: str = "spec") -> list[tuple[str, str]]:
    """Evaluate every x-kubernetes-validations rule that applies to `value`, with celpy.

    Returns (field path, message) for each failing rule; the path joins the rule's location
    and its fieldPath, as the API server reports it.
    """
    failures = []
    env = celpy.Environment()
    for rule in node.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(result, Exception):
            raise AssertionError(f"CEL rule {rule['rule']!r} failed to evaluate: {result}")
        if not bool(result):
            failures.append((path + rule.get("fieldPath", ""), rule["message"]))
    if isinstance(value, dict):
        for name, sub in node.get("properties", {}).items():
            if name in value:
                failures += cel_violations(value[name], sub, f"{path}.{name}")
    return failures


def _error_field(error: jsonschema.ValidationError) -> str:
    """The field an error is about; for a missing or unknown key, that key (not its parent)."""
    parts = ["spec", *map(str, error.absolute_path)]
    if error.validator == "required":
        parts.append(next(k for k in error.validator_value if k not in error.instance))
    elif error.validator == "additionalProperties":
        parts.append(next(k for k in error.instance if k not in error.schema["properties"]))
    return ".".join(parts)


def crd_errors(spec: dict[str, Any]) -> tuple[list[str], list[tuple[str, str]]]:
    """(schema error paths, CEL failures) the CRD would produce for `spec`."""
    node = _spec_schema()
    validator = jsonschema.Draft202012Validator(to_json_schema(node))
    schema_errors = [_error_field(error) for error in validator.iter_errors(spec)]
    if schema_errors:
        return schema_errors, []
    return [], cel_violations(crd_default(spec, node), node)


# --- the file itself --------------------------------------------------------------------------


def test_committed_crd_is_generated_from_the_schema_package():
    assert CRD_FILE.read_text() == schema.crd_yaml(), (
        "crds/ is stale: python -m atom_operator.schema > " + str(CRD_FILE.relative_to(REPO))
    )


def test_chart_ships_a_byte_identical_crd():
    assert CHART_CRD_FILE.read_bytes() == CRD_FILE.read_bytes()


@pytest.mark.parametrize("version", ["1.30", kubernetes_validate.latest_version()])
def test_crd_is_a_valid_customresourcedefinition(version):
    assert kubernetes_validate.validate(_crd(), version, strict=True) == version[:4]


def test_crd_names_scope_and_short_name():
    crd = _crd()
    assert crd["metadata"]["name"] == "atomdeployments.serving.atom.dev"
    assert crd["spec"]["group"] == "serving.atom.dev"
    assert crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["kind"] == "AtomDeployment"
    assert crd["spec"]["names"]["shortNames"] == ["atomd"]
    version = _version(crd)
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)


def test_scale_subresource_drives_decode_replicas():
    assert _version(_crd())["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.decode.replicas",
            "statusReplicasPath": ".status.roles.decode.replicas",
            "labelSelectorPath": ".status.roles.decode.selector",
        },
    }


def test_printer_columns():
    columns = {c["name"]: c["jsonPath"] for c in _version(_crd())["additionalPrinterColumns"]}
    assert columns == {
        "Model": ".status.model",
        "Vendor": ".spec.accelerator.vendor",
        "Decode": ".status.roles.decode.ready",
        "Prefill": ".status.roles.prefill.ready",
        "Phase": ".status.phase",
        "Endpoint": ".status.endpoint",
        "Age": ".metadata.creationTimestamp",
    }


def test_status_schema_has_the_fields_the_scale_subresource_and_columns_read():
    status = _version(_crd())["schema"]["openAPIV3Schema"]["properties"]["status"]
    decode = status["properties"]["roles"]["properties"]["decode"]["properties"]
    assert decode["replicas"]["type"] == "integer"
    assert decode["selector"]["type"] == "string"
    assert decode["ready"]["type"] == "string"
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert conditions["items"]["required"] == ["type", "status"]


def _walk_schema(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk_schema(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk_schema(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk_schema(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    """Every node has a type (or is int-or-string), as a structural schema requires."""
    untyped = [
        path
        for path, node in _walk_schema(_version(_crd())["schema"]["openAPIV3Schema"])
        if "type" not in node and not node.get("x-kubernetes-int-or-string")
    ]
    assert untyped == []


def test_cel_rules_reference_only_known_fields():
    """A typo in a rule (self.engine.blocksize) would make it vacuous or an API-server error."""
    for path, node in _walk_schema(_spec_schema()):
        for rule in node.get("x-kubernetes-validations", []):
            for chain in re.findall(r"self((?:\.[A-Za-z]+)+)", rule["rule"]):
                cursor = node
                for name in chain.strip(".").split("."):
                    assert name in cursor.get("properties", {}), (path, rule["rule"], name)
                    cursor = cursor["properties"][name]


def test_defaults_match_apply_defaults_except_the_derived_ones():
    """The CRD's defaulting and apply_defaults agree on everything but DERIVED_DEFAULTS."""
    spec = {"model": {"uri": "hf://Qwen/Qwen3-8B", "authSecretRef": {"name": "hf"}}, "prefill": {}}
    by_crd = crd_default(spec, _spec_schema())
    by_python = apply_defaults(spec)
    for dotted in DERIVED_DEFAULTS:
        section, _, field = dotted.partition(".")
        if field:
            by_python[section].pop(field)
        else:
            by_python.pop(section)
    assert by_python == by_crd
    assert by_crd["engine"]["blockSize"] == 16
    assert by_crd["accelerator"]["vendor"] == "amd"
    assert by_crd["kvEvents"] == {"enabled": True, "port": 5557, "replayPort": 5558,
                                  "encryption": "none", "includeTokenIds": True}  # fmt: skip
    assert by_crd["model"]["authSecretRef"] == {"name": "hf", "key": "HF_TOKEN"}


@pytest.mark.parametrize(
    ("spec", "enabled"),
    [({}, False), ({"prefill": {}}, True), ({"router": {"enabled": True}}, True),
     ({"router": {"replicas": 2}}, False), ({"prefill": {}, "router": {"replicas": 2}}, True)],
)  # fmt: skip
def test_router_enabled_defaults_to_whether_a_prefill_role_exists(spec, enabled):
    """The CRD leaves router.enabled unset (its default depends on spec.prefill); the operator
    fills it: on in disaggregated mode, off when aggregated unless asked for."""
    by_crd = crd_default(spec, _spec_schema())["router"]
    assert by_crd.get("enabled") == (spec.get("router") or {}).get("enabled")  # kept, not filled
    assert apply_defaults(spec)["router"]["enabled"] is enabled
    assert has_router(spec) is enabled
    assert has_router(apply_defaults(spec)) is enabled


@pytest.mark.parametrize(
    ("spec", "warned"),
    [({"router": {"enabled": True}, "kvEvents": {"enabled": False}}, True),
     ({"prefill": {}, "kvEvents": {"enabled": False}}, True),
     ({"kvEvents": {"enabled": False}}, False), ({"router": {"enabled": True}}, False)],
)  # fmt: skip
def test_a_router_without_kv_events_is_warned_about_not_refused(spec, warned):
    """The router still balances on load and holds requests for a decode role at zero without
    KV events, so the spec is valid; it only loses the cache-aware choice, which is a warning."""
    validate_spec(spec)
    warnings = spec_warnings(apply_defaults(spec))
    assert [reason for reason, _ in warnings] == (["RouterWithoutKVEvents"] if warned else [])


# --- examples ---------------------------------------------------------------------------------


def _load(path: pathlib.Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} == {
        "amd-mi300x-aggregated.yaml",
        "amd-mi300x-aggregated-router.yaml",
        "amd-mi300x-disaggregated.yaml",
        "nvidia-h100-aggregated.yaml",
        "cpu-smollm2.yaml",
        "amd-mi300x-fp8.yaml",
        "amd-mi300x-deepseek-r1.yaml",
        "nvidia-h200-gpt-oss-120b.yaml",
    }
    assert len(INVALID_EXAMPLES) >= 8


@needs_cel
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_passes_the_crd_schema_and_cel_rules(path):
    doc = _load(path)
    whole = to_json_schema(_version(_crd())["schema"]["openAPIV3Schema"])
    jsonschema.Draft202012Validator(whole).validate(doc)
    assert crd_errors(doc["spec"]) == ([], [])
    validate_spec(doc["spec"])


def _expectation(path: pathlib.Path) -> tuple[str, str]:
    text = path.read_text()
    field = re.search(r"^# Invalid: breaks (\S+)", text, re.M)
    rejected_by = re.search(r"^# rejected-by: (\w+)", text, re.M)
    assert field and rejected_by, f"{path.name} must say which field it breaks and who rejects it"
    return field.group(1), rejected_by.group(1)


@needs_cel
@pytest.mark.parametrize("path", INVALID_EXAMPLES, ids=lambda p: p.name)
def test_invalid_example_is_rejected_naming_its_field(path):
    field, rejected_by = _expectation(path)
    spec = _load(path)["spec"]
    with pytest.raises(SpecError) as caught:
        validate_spec(spec)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")

    schema_errors, cel_failures = crd_errors(spec)
    if rejected_by == "schema":
        assert schema_errors == [field]
    elif rejected_by == "cel":
        assert schema_errors == []
        assert [path for path, _ in cel_failures] == [field]
    else:
        assert rejected_by == "operator"
        assert (schema_errors, cel_failures) == ([], [])


# --- the same rules in the CRD and in validate_spec -------------------------------------------

# (spec, field both must name). Each one breaks exactly one rule.
BROKEN_SPECS = [
    ({"engine": {"blockSize": 32}, "stateCheckpoint": {"intervalTokens": 48}},
     "spec.stateCheckpoint.intervalTokens"),
    ({"stateCheckpoint": {"intervalTokens": -2}}, "spec.stateCheckpoint.intervalTokens"),
    ({"stateCheckpoint": {"memoryFraction": 0}}, "spec.stateCheckpoint.memoryFraction"),
    ({"stateCheckpoint": {"memoryFraction": 1.5}}, "spec.stateCheckpoint.memoryFraction"),
    ({"accelerator": {"vendor": "cpu"}, "decode": {"tensorParallelSize": 4}},
     "spec.decode.tensorParallelSize"),
    ({"accelerator": {"vendor": "cpu", "resourceName": "example.com/npu"}},
     "spec.accelerator.resourceName"),
    ({"accelerator": {"resourceName": "gpu"}}, "spec.accelerator.resourceName"),
    ({"decode": {"autoscaling": {"enabled": True, "maxReplicas": 3}}},
     "spec.decode.autoscaling.enabled"),
    ({"decode": {"autoscaling": {"minReplicas": 5, "maxReplicas": 3}}},
     "spec.decode.autoscaling.minReplicas"),
    ({"decode": {"autoscaling": {"enabled": True, "maxReplicas": 3, "targetKVCacheUsage": 1.5}}},
     "spec.decode.autoscaling.targetKVCacheUsage"),
    ({"decode": {"autoscaling": {"enabled": True, "maxReplicas": 3,
                                 "targetRequestsWaiting": 0}}},
     "spec.decode.autoscaling.targetRequestsWaiting"),
    ({"kvEvents": {"port": 8000}}, "spec.kvEvents.port"),
    ({"kvEvents": {"replayPort": 5557}}, "spec.kvEvents.replayPort"),
    ({"kvEvents": {"port": 80}}, "spec.kvEvents.port"),
    ({"kvTransfer": {}}, "spec.kvTransfer"),
    ({"model": {"uri": "hf://Qwen"}}, "spec.model.uri"),
    ({"model": {"uri": "file://relative/path"}}, "spec.model.uri"),
    ({"model": {"uri": "pvc://Models/qwen"}}, "spec.model.uri"),
    ({"model": {"authSecretRef": {"key": "token"}}}, "spec.model.authSecretRef.name"),
    ({"engine": {"blockSize": 0}}, "spec.engine.blockSize"),
    ({"engine": {"imagePullPolicy": "Sometimes"}}, "spec.engine.imagePullPolicy"),
    ({"decode": {"replicas": -1}}, "spec.decode.replicas"),
    ({"decode": {"tensorParallelSize": 32}}, "spec.decode.tensorParallelSize"),
    ({"service": {"type": "ExternalName"}}, "spec.service.type"),
    ({"service": {"port": 70000}}, "spec.service.port"),
    ({"accelerator": {"productLabels": {"key": "amd.com/gpu.product-name", "values": []}}},
     "spec.accelerator.productLabels.values"),
    ({"accelerator": {"tolerations": [{"key": "x", "operator": "Maybe"}]}},
     "spec.accelerator.tolerations[0].operator"),
    ({"decode": {"replicaz": 2}}, "spec.decode.replicaz"),
    ({"decode": {"autoscaling": {"provider": "cron"}}}, "spec.decode.autoscaling.provider"),
    ({"decode": {"autoscaling": {"enabled": True, "provider": "keda", "maxReplicas": 3,
                                 "targetRequestsRunning": 8}}},
     "spec.decode.autoscaling.keda"),
    ({"decode": {"autoscaling": {"provider": "keda", "keda": {"serverAddress": "prom:9090"}}}},
     "spec.decode.autoscaling.keda.serverAddress"),
    ({"prefill": {"autoscaling": {"provider": "hpa", "minReplicas": 0}}},
     "spec.prefill.autoscaling.minReplicas"),
    ({"decode": {"autoscaling": {"provider": "hpa", "targetTTFTSeconds": 0.5}}},
     "spec.decode.autoscaling.targetTTFTSeconds"),
    ({"decode": {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                                 "targetRequestsWaiting": 1}}},
     "spec.decode.autoscaling.minReplicas"),
    ({"decode": {"autoscaling": {"maxStep": 0}}}, "spec.decode.autoscaling.maxStep"),
    ({"engine": {"image": "atom@sha256:1234"}}, "spec.engine.image"),
    ({"inferencePool": {"enabled": True}}, "spec.inferencePool.endpointPicker"),
    ({"router": {"image": "atom runtime"}}, "spec.router.image"),
    ({"engine": {"apiKeySecretRef": {"key": "k"}}}, "spec.engine.apiKeySecretRef.name"),
    ({"decode": {"autoscaling": {"scaleDownStabilizationSeconds": 4000}}},
     "spec.decode.autoscaling.scaleDownStabilizationSeconds"),
    # Disaggregated mode cannot run without the router; decode rests at zero only behind it.
    ({"prefill": {}, "router": {"enabled": False}}, "spec.router.enabled"),
    ({"router": {"enabled": False},
      "decode": {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                                 "targetRequestsRunning": 4}}},
     "spec.decode.autoscaling.minReplicas"),
    ({"router": {"enabled": "yes"}}, "spec.router.enabled"),
    # Strings passed as flag values or into the KV-event topic (issue 33).
    ({"model": {"name": "--api-key"}}, "spec.model.name"),
    ({"model": {"name": "$(HF_TOKEN)"}}, "spec.model.name"),
    ({"model": {"name": "a@b"}}, "spec.model.name"),
    ({"model": {"name": "m" * 254}}, "spec.model.name"),
    ({"model": {"authSecretRef": {"name": "Not_A_Secret"}}}, "spec.model.authSecretRef.name"),
    ({"router": {"apiKeySecret": {"key": "k"}}}, "spec.router.apiKeySecret.name"),
    ({"kvEvents": {"encryption": "tls"}}, "spec.kvEvents.encryption"),
    ({"kvEvents": {"includeTokenIds": "no"}}, "spec.kvEvents.includeTokenIds"),
    # spec.engine's compute choices (tests/operator/test_engine_features.py renders them).
    ({"engine": {"quantization": "int4"}}, "spec.engine.quantization"),
    ({"engine": {"kvCacheDtype": "fp16"}}, "spec.engine.kvCacheDtype"),
    ({"engine": {"reasoningParser": "r1"}}, "spec.engine.reasoningParser"),
    ({"engine": {"speculative": {"method": "eagle", "numSpeculativeTokens": 2}}},
     "spec.engine.speculative.method"),
    ({"engine": {"speculative": {"method": "ngram"}}},
     "spec.engine.speculative.numSpeculativeTokens"),
    ({"engine": {"speculative": {"method": "ngram", "numSpeculativeTokens": 17}}},
     "spec.engine.speculative.numSpeculativeTokens"),
    ({"engine": {"speculative": {"method": "draft_model", "numSpeculativeTokens": 2}}},
     "spec.engine.speculative.model"),
    ({"engine": {"speculative": {"method": "ngram", "numSpeculativeTokens": 2, "model": "x/y"}}},
     "spec.engine.speculative.model"),
    ({"engine": {"speculative": {"method": "draft_model", "numSpeculativeTokens": 2,
                                 "model": "-x"}}},
     "spec.engine.speculative.model"),
    ({"engine": {"speculative": {"method": "mtp", "numSpeculativeTokens": 2,
                                 "promptLookupMin": 2}}},
     "spec.engine.speculative.promptLookupMin"),
    ({"engine": {"speculative": {"method": "ngram", "numSpeculativeTokens": 2,
                                 "promptLookupMin": 5, "promptLookupMax": 3}}},
     "spec.engine.speculative.promptLookupMax"),
    ({"engine": {"speculative": {"method": "ngram", "numSpeculativeTokens": 2,
                                 "draftTensorParallelSize": 1}}},
     "spec.engine.speculative.draftTensorParallelSize"),
    ({"decode": {"tensorParallelSize": 8},
      "engine": {"speculative": {"method": "draft_model", "numSpeculativeTokens": 2,
                                 "model": "x/y", "draftTensorParallelSize": 4}}},
     "spec.engine.speculative.draftTensorParallelSize"),
    ({"engine": {"compileCache": {"pvc": {}}}}, "spec.engine.compileCache.pvc.claimName"),
    # spec.model.source (tests/operator/test_model_source.py renders it).
    ({"model": {"uri": "hf://a/b", "source": {"pvc": {"claimName": "m"}}}}, "spec.model.source"),
    ({"model": {"source": {}}}, "spec.model.source.pvc"),
    ({"model": {"source": {"pvc": {"claimName": "m"}, "image": {"reference": "r/i:1"}}}},
     "spec.model.source.pvc"),
    ({"model": {"source": {"pvc": {}}}}, "spec.model.source.pvc.claimName"),
    ({"model": {"source": {"pvc": {"claimName": "m", "path": "../etc"}}}},
     "spec.model.source.pvc.path"),
    ({"model": {"source": {"huggingface": {"repo": "-rf/x", "size": "1Gi"}}}},
     "spec.model.source.huggingface.repo"),
    ({"model": {"source": {"huggingface": {"repo": "a/b", "revision": "$(X)", "size": "1Gi"}}}},
     "spec.model.source.huggingface.revision"),
    ({"model": {"source": {"huggingface": {"repo": "a/b"}}}},
     "spec.model.source.huggingface.size"),
    ({"model": {"source": {"huggingface": {"repo": "a/b", "size": "1Gi",
                                           "cachePVC": {"claimName": "c"}}}}},
     "spec.model.source.huggingface.size"),
    ({"model": {"source": {"huggingface": {"repo": "a/b", "cachePVC": {"claimName": "c"},
                                           "storageClassName": "fast"}}}},
     "spec.model.source.huggingface.storageClassName"),
    ({"model": {"source": {"huggingface": {"repo": "a/b", "size": "1Gi",
                                           "accessMode": "ReadMany"}}}},
     "spec.model.source.huggingface.accessMode"),
    ({"model": {"source": {"image": {"reference": "r/i:1", "pullPolicy": "Sometimes"}}}},
     "spec.model.source.image.pullPolicy"),
    ({"model": {"source": {"image": {}}}}, "spec.model.source.image.reference"),
]  # fmt: skip


@needs_cel
@pytest.mark.parametrize("spec,field", BROKEN_SPECS, ids=[f for _, f in BROKEN_SPECS])
def test_crd_and_validate_spec_reject_the_same_field(spec, field):
    assert_refused_alike(spec, field)


def assert_refused_alike(spec: dict[str, Any], field: str) -> None:
    """validate_spec and the CRD (schema, then CEL) both refuse `spec`, naming `field` alone."""
    with pytest.raises(SpecError) as caught:
        validate_spec(spec)
    assert caught.value.field == field

    schema_errors, cel_failures = crd_errors(spec)
    crd_fields = schema_errors or [path for path, _ in cel_failures]
    # jsonschema names list items as .0, the operator as [0]
    assert [re.sub(r"\.(\d+)", r"[\1]", f) for f in crd_fields] == [field]


def assert_accepted_alike(spec: dict[str, Any]) -> None:
    validate_spec(spec)
    assert crd_errors(spec) == ([], [])


GOOD_SPECS = [
    {},
    {"stateCheckpoint": {"intervalTokens": 0}},
    {"stateCheckpoint": {"intervalTokens": -1}},
    {"stateCheckpoint": {"memoryFraction": 1}},
    {"engine": {"blockSize": 32}, "stateCheckpoint": {"intervalTokens": 96}},
    {"accelerator": {"vendor": "cpu"}, "decode": {"tensorParallelSize": 1}},
    {"accelerator": {"vendor": "nvidia", "resourceName": "nvidia.com/mig-3g.40gb"}},
    {"decode": {"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 3,
                                "targetKVCacheUsage": 1}}},
    {"decode": {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 4,
                                "targetRequestsRunning": 32, "scaleToZeroAfterSeconds": 60}},
     "prefill": {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                                 "targetRequestsWaiting": 2, "targetTTFTSeconds": 0.5}}},
    {"decode": {"autoscaling": {"enabled": True, "provider": "keda", "maxReplicas": 4,
                                "targetKVCacheUsage": 0.8,
                                "keda": {"serverAddress": "http://prometheus.monitoring:9090"}}}},
    {"decode": {"autoscaling": {"enabled": True, "provider": "hpa", "maxReplicas": 4,
                                "targetRequestsRunning": 16}}},
    {"engine": {"image": "reg.local:5000/atom/runtime:0.2@sha256:" + "ab" * 32,
                "apiKeySecretRef": {"name": "keys"}, "cacheSize": "300Gi"},
     "networkPolicy": {"kvEventsFrom": [{"podSelector": {"matchLabels": {"app": "epp"}}}]}},
    {"prefill": {}, "kvTransfer": {"connector": "NixlConnector", "config": {"backends": ["UCX"]}}},
    {"model": {"uri": "pvc://model-store"}},
    {"model": {"uri": "pvc://model-store/qwen/Qwen3-8B"}},
    {"model": {"uri": "file:///models/smollm2"}},
    {"decode": {"resources": {"limits": {"cpu": 4, "memory": "8Gi"}}}},
    # Tensor parallelism anywhere, and prefill and decode at their own sizes (issue 37: the
    # runtime's connectors move each decode rank's heads; KV-head divisibility is its check).
    {"decode": {"tensorParallelSize": 8}},
    {"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 8}},
    {"prefill": {"tensorParallelSize": 4}, "decode": {"tensorParallelSize": 1}},
    {"prefill": {"tensorParallelSize": 1}, "decode": {"tensorParallelSize": 1}},
    # The router opt-in: aggregated with the router (TP allowed: no KV transfer), decode at zero
    # behind it, the router spelled out in disaggregated mode, and explicitly off when aggregated.
    {"router": {"enabled": True, "replicas": 2}, "decode": {"replicas": 4, "tensorParallelSize": 2}},
    {"router": {"enabled": True},
     "decode": {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 4,
                                "targetRequestsRunning": 16}}},
    {"prefill": {}, "router": {"enabled": True}},
    {"router": {"enabled": False}, "kvEvents": {"enabled": False}},
    {"model": {"name": "deepseek-ai/DeepSeek-R1"}}, {"model": {"name": "llama3:8b_v1.2+x"}},
    {"router": {"enabled": True, "apiKeySecret": {"name": "router-key"}},
     "kvEvents": {"encryption": "curve", "includeTokenIds": False},
     "networkPolicy": {"httpFrom": [{"namespaceSelector": {}}]}},
    {"engine": {"quantization": "fp8", "kvCacheDtype": "fp8"}},
    {"engine": {"kvCacheDtype": "auto", "reasoningParser": "gpt_oss"}},
    {"decode": {"tensorParallelSize": 8},
     "engine": {"speculative": {"method": "draft_model", "numSpeculativeTokens": 4,
                                "model": "/mnt/models/draft", "draftTensorParallelSize": 1}}},
    {"engine": {"speculative": {"method": "ngram", "numSpeculativeTokens": 4,
                                "promptLookupMin": 3, "promptLookupMax": 3}}},
    {"decode": {"tensorParallelSize": 2},
     "engine": {"speculative": {"method": "mtp", "numSpeculativeTokens": 3,
                                "draftTensorParallelSize": 1}}},
    {"engine": {"compileCache": {"pvc": {"claimName": "kernels"}}}},
    {"model": {"source": {"pvc": {"claimName": "m", "path": "org/model-1.5/"}}}},
    {"model": {"source": {"huggingface": {"repo": "gpt2", "size": 10737418240}}}},
    {"model": {"source": {"huggingface": {"repo": "a/b", "revision": "refs/pr/1",
                                          "size": "1Gi", "storageClassName": "nfs",
                                          "accessMode": "ReadWriteOnce"}}}},
    {"model": {"source": {"image": {"reference": "r.io/m@sha256:" + "a" * 64, "pullPolicy": "Always"}}}},
]  # fmt: skip


@needs_cel
@pytest.mark.parametrize("spec", GOOD_SPECS, ids=range(len(GOOD_SPECS)))
def test_crd_and_validate_spec_accept_the_same_good_specs(spec):
    assert_accepted_alike(spec)


@pytest.mark.parametrize(
    "spec,field",
    [
        ({"accelerator": "amd"}, "spec.accelerator"),
        ({"accelerator": {"vendor": 7}}, "spec.accelerator.vendor"),
        ({"engine": None}, "spec.engine"),
        ({"decode": {"autoscaling": []}}, "spec.decode.autoscaling"),
        ({"model": {"uri": 5}}, "spec.model.uri"),
    ],
)
def test_wrong_types_are_a_spec_error_not_a_crash(spec, field):
    before = copy.deepcopy(spec)
    apply_defaults(spec)  # tolerates them, for status code that defaults before validating
    assert spec == before
    with pytest.raises(SpecError) as caught:
        validate_spec(spec)
    assert caught.value.field == field
