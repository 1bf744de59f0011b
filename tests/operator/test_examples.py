"""Every example renders, and every rendered object is valid Kubernetes for the versions we
support (kubernetes-validate, strict: unknown fields are errors)."""

from __future__ import annotations

import pathlib

import kubernetes_validate
import pytest
import yaml

from atom_operator.render import render_children
from atom_operator.render.keys import DeploymentKeys
from atom_operator.render.names import endpoint_url

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
# The oldest Kubernetes we support, one in the middle, and the newest kubernetes-validate knows.
VERSIONS = sorted({"1.30", "1.33", kubernetes_validate.latest_version()})


def _body(path: pathlib.Path) -> dict:
    body = yaml.safe_load(path.read_text())
    body["metadata"]["uid"] = "0b5d2c36-1111-4a4a-8c8c-000000000001"
    return body


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_children_are_valid_kubernetes(path):
    children = render_children(_body(path), keys=DeploymentKeys.generate())
    assert children[0]["kind"] == "Secret"
    for child in children:
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(child, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                where = ".".join(map(str, error.path))
                pytest.fail(f"{child['kind']}/{child['metadata']['name']} on {version}: "
                            f"{where}: {error.message}")  # fmt: skip


def _kinds(path: str) -> list[str]:
    return [c["kind"] for c in render_children(_body(REPO / "examples" / path))]


def test_example_shapes():
    # provider hpa renders an HPA; the disaggregated example autoscales with builtin: no object.
    assert _kinds("amd-mi300x-aggregated.yaml") == [
        "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
        "NetworkPolicy", "Service",
    ]  # fmt: skip
    # router.enabled on an aggregated deployment: the router and its RBAC, no prefill role.
    assert _kinds("amd-mi300x-aggregated-router.yaml") == [
        "Deployment", "Service", "PodDisruptionBudget",
        "ServiceAccount", "Role", "RoleBinding",
        "Deployment", "NetworkPolicy", "NetworkPolicy", "Service",
    ]  # fmt: skip
    assert _kinds("amd-mi300x-disaggregated.yaml") == [
        "Deployment", "Service", "PodDisruptionBudget",
        "Deployment", "Service", "PodDisruptionBudget",
        "ServiceAccount", "Role", "RoleBinding",
        "Deployment", "NetworkPolicy", "NetworkPolicy", "Service",
    ]  # fmt: skip
    assert _kinds("nvidia-h100-aggregated.yaml") == [
        "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "Service",
    ]  # fmt: skip
    # A Hugging Face source given a size: the model-cache claim first (created once).
    assert _kinds("amd-mi300x-deepseek-r1.yaml") == [
        "PersistentVolumeClaim",
        "Deployment", "Service", "PodDisruptionBudget",
        "ServiceAccount", "Role", "RoleBinding",
        "Deployment", "NetworkPolicy", "NetworkPolicy", "Service",
    ]  # fmt: skip
    assert _kinds("cpu-smollm2.yaml") == [
        "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "Service",
    ]  # fmt: skip


def test_example_endpoints():
    bodies = {p.name: _body(p) for p in EXAMPLES}
    assert endpoint_url(bodies["cpu-smollm2.yaml"]) == (
        "http://smollm2.default.svc.cluster.local:8000/v1"
    )
    assert endpoint_url(bodies["nvidia-h100-aggregated.yaml"]) == (
        "http://llama-3-1-8b.llm.svc.cluster.local:80/v1"
    )


def test_validator_catches_a_broken_object():
    """The check above can fail: a misspelt field is an error in strict mode."""
    (deployment, *_) = render_children(_body(EXAMPLES[0]))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.30", strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_container_is_locked_down(path):
    """Read-only root, CPU and memory requests and limits on every container (engine, router);
    no service account token in engine pods."""
    for child in render_children(_body(path)):
        if child["kind"] != "Deployment":
            continue
        pod = child["spec"]["template"]["spec"]
        for container in pod["containers"]:
            where = f"{child['metadata']['name']}/{container['name']}"
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, where
            for section in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][section]), where
            for mount in container.get("volumeMounts", []):
                (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
                if "emptyDir" in volume:
                    assert volume["emptyDir"]["sizeLimit"], where
        if child["metadata"]["labels"]["serving.atom.dev/role"] != "router":
            assert pod["automountServiceAccountToken"] is False
