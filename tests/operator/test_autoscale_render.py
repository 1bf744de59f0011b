"""What each autoscaling provider renders: builtin nothing, keda a ScaledObject (validated against
KEDA's own CRD schema, vendored under tests/operator/data/), hpa an autoscaling/v2 HPA."""

from __future__ import annotations

import pathlib

import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_crd import to_json_schema

from atom_operator.render import render_children
from atom_operator.render.autoscalers import render_scaled_object
from atom_operator.render.roles import render_role_deployment

KEDA_CRD = pathlib.Path(__file__).parent / "data" / "keda.sh_scaledobjects.yaml"


def atomd(spec: dict) -> dict:
    return {
        "apiVersion": "serving.atom.dev/v1alpha1",
        "kind": "AtomDeployment",
        "metadata": {"name": "chat", "namespace": "llm", "uid": "u-1"},
        "spec": {"accelerator": {"vendor": "cpu"}, **spec},
    }


def keda_schema() -> dict:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = to_json_schema(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def assert_valid_scaled_object(obj: dict) -> None:
    errors = sorted(
        jsonschema.Draft202012Validator(keda_schema()).iter_errors(obj), key=lambda e: e.path
    )
    assert [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors] == []


KEDA = {"serverAddress": "http://prometheus.monitoring:9090"}


def test_builtin_renders_no_scaler_and_a_deployment_without_replicas():
    body = atomd({"decode": {"replicas": 3, "autoscaling": {
        "enabled": True, "maxReplicas": 4, "targetRequestsRunning": 16}}})  # fmt: skip
    kinds = [c["kind"] for c in render_children(body)]
    assert kinds == ["Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "Service"]
    # The autoscaler is the only writer of replicas: the operator's render never names it.
    assert "replicas" not in render_role_deployment(body, "decode")["spec"]


def test_keda_scaled_object_triggers_on_the_engine_metrics():
    autoscaling = {
        "enabled": True, "provider": "keda", "minReplicas": 0, "maxReplicas": 6,
        "targetRequestsWaiting": 2, "targetRequestsRunning": 24, "targetKVCacheUsage": 0.8,
        "targetTTFTSeconds": 0.5, "scaleDownStabilizationSeconds": 120,
        "scaleToZeroAfterSeconds": 600, "keda": KEDA,
    }  # fmt: skip
    body = atomd({"prefill": {"autoscaling": autoscaling}, "decode": {}})
    scaled = render_scaled_object(body, "prefill")
    pods = 'namespace="llm",pod=~"chat-prefill-[a-z0-9]+-[a-z0-9]+"'
    address = KEDA["serverAddress"]

    def trigger(name: str, query: str, threshold: str, kind: str = "AverageValue") -> dict:
        return {"type": "prometheus", "name": name, "metricType": kind,
                "metadata": {"serverAddress": address, "query": query, "threshold": threshold}}  # fmt: skip

    queued = trigger("router-queued",
                     'sum(atom:router_queued_requests{namespace="llm",role="prefill"})', "1")  # fmt: skip
    queued["metadata"]["activationThreshold"] = "0"
    assert scaled["metadata"]["name"] == "chat-prefill"
    assert scaled["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "chat-prefill"},
        "minReplicaCount": 0,
        "maxReplicaCount": 6,
        "pollingInterval": 15,
        "cooldownPeriod": 600,
        "advanced": {"horizontalPodAutoscalerConfig": {
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 120}}}},
        "triggers": [
            trigger("requests-waiting", f"sum(atom:requests_waiting{{{pods}}})", "2"),
            trigger("requests-running", f"sum(atom:requests_running{{{pods}}})", "24"),
            trigger("kv-cache-usage", f"sum(atom:kv_cache_usage_ratio{{{pods}}})", "0.8"),
            trigger("ttft-p90", "histogram_quantile(0.9, sum by (le) "
                    f"(rate(atom:time_to_first_token_seconds_bucket{{{pods}}}[2m])))", "0.5",
                    "Value"),
            queued,
        ],
    }  # fmt: skip
    assert_valid_scaled_object(scaled)
    assert "replicas" not in render_role_deployment(body, "prefill")["spec"]


def test_keda_schema_check_can_fail():
    body = atomd({"decode": {"autoscaling": {"enabled": True, "provider": "keda",
                  "maxReplicas": 2, "targetKVCacheUsage": 0.8, "keda": KEDA}}})  # fmt: skip
    scaled = render_scaled_object(body, "decode")
    assert_valid_scaled_object(scaled)
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 0.8  # KEDA wants strings
    with pytest.raises(AssertionError, match="triggers.0.metadata.threshold"):
        assert_valid_scaled_object(scaled)


def test_hpa_provider_keeps_the_autoscaling_v2_object():
    body = atomd({"decode": {"autoscaling": {"enabled": True, "provider": "hpa",
                  "maxReplicas": 5, "targetRequestsRunning": 16}}})  # fmt: skip
    children = render_children(body)
    (hpa,) = [c for c in children if c["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["metrics"] == [
        {"type": "Pods", "pods": {"metric": {"name": "atom_requests_running"},
                                  "target": {"type": "AverageValue", "averageValue": "16"}}},
    ]  # fmt: skip
    kubernetes_validate.validate(hpa, "1.30", strict=True)
    assert not [c for c in children if c["kind"] == "ScaledObject"]
