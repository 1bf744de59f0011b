"""The Helm chart, rendered and linted offline with helm-python-sdk (Helm's Go SDK via ctypes;
no helm binary, no cluster), and its objects checked with kubernetes-validate."""

from __future__ import annotations

import pathlib

import kubernetes_validate
import pytest
import yaml

from atom_operator.render import CHILD_KINDS
from atom_operator.render.router import ROUTER_RULES

helm = pytest.importorskip("helm_python", reason="helm-python-sdk renders and lints the chart")

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "atom-operator"
VERSIONS = sorted({"1.30", kubernetes_validate.latest_version()})
FULL_VERBS = ["get", "list", "watch", "create", "patch", "update", "delete"]


def render_chart(values: dict | None = None) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values=values, name="atom-operator", namespace="atom-system")
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def notes(values: dict | None = None) -> str:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values=values, name="atom-operator", namespace="atom-system")
    return manifests["atom-operator/templates/NOTES.txt"]


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def operator_args(objects: list[dict]) -> list[str]:
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["atom"]
    return container["args"]


@pytest.mark.parametrize("kube_version", [f"v{v}.0" for v in VERSIONS])
def test_chart_lints_strict(kube_version):
    report = helm.lint(CHART, strict=True, kube_version=kube_version)
    assert report["errors"] == []
    assert report["messages"] == []


def test_lint_reports_bad_values():
    """The lint above can fail: a log level outside values.schema.json is an error."""
    report = helm.lint(CHART, {"logLevel": "verbose"}, strict=True)
    assert any("/logLevel" in error and "must be one of" in error for error in report["errors"])


def test_values_schema_rejects_unknown_keys():
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema({"logLevel": "info"})
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"watchNamespace": ["typo"]})


def test_chart_crd_is_the_repository_crd():
    with helm.Chart.load(CHART) as chart:
        (crd,) = chart.crds
    assert crd["filename"] == "atom-operator/crds/atomdeployments.serving.atom.dev.yaml"
    assert crd["data"] == (REPO / "crds" / "atomdeployments.serving.atom.dev.yaml").read_text()


@pytest.mark.parametrize("values", [None, {"watchNamespaces": ["llm", "team-b"]},
                                    {"namespaced": True, "envReferences": {"secrets": ["s"]}}],
                         ids=["cluster-wide", "watched", "namespaced"])  # fmt: skip
def test_rendered_objects_are_valid_kubernetes(values):
    objects = render_chart(values)
    assert objects
    for obj in objects:
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_cluster_wide_install():
    objects = render_chart()
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == [
        ("ClusterRole", "atom-operator"),
        ("ClusterRole", "atom-operator-discovery"),
        ("ClusterRoleBinding", "atom-operator"),
        ("ClusterRoleBinding", "atom-operator-discovery"),
        ("Deployment", "atom-operator"),
        ("ServiceAccount", "atom-operator"),
    ]
    assert operator_args(objects) == [
        "operator", "run", "--standalone", "--all-namespaces",
        "--liveness", "http://0.0.0.0:8080/healthz", "--log-level", "info",
    ]  # fmt: skip
    discovery = next(o for o in objects if o["metadata"]["name"] == "atom-operator-discovery"
                     and o["kind"] == "ClusterRole")  # fmt: skip
    assert discovery["rules"] == [
        {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    ]  # fmt: skip
    (binding,) = [o for o in by_kind(objects, "ClusterRoleBinding")
                  if o["metadata"]["name"] == "atom-operator"]  # fmt: skip
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "atom-operator", "namespace": "atom-system"}
    ]
    assert "every namespace" in notes()


def test_namespaced_install_has_one_role_per_namespace_and_no_cluster_write_access():
    objects = render_chart({"watchNamespaces": ["llm", "team-b"], "logLevel": "debug"})
    roles = by_kind(objects, "Role")
    assert [r["metadata"]["namespace"] for r in roles] == ["llm", "team-b"]
    assert [b["metadata"]["namespace"] for b in by_kind(objects, "RoleBinding")] == [
        "llm",
        "team-b",
    ]
    (cluster_role,) = by_kind(objects, "ClusterRole")
    assert cluster_role["metadata"]["name"] == "atom-operator-discovery"
    assert cluster_role["rules"] == [
        {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
         "verbs": ["get", "list", "watch"]},
    ]  # fmt: skip
    assert operator_args(objects) == [
        "operator", "run", "--standalone", "--namespace", "llm", "--namespace", "team-b",
        "--liveness", "http://0.0.0.0:8080/healthz", "--log-level", "debug",
    ]  # fmt: skip
    assert "these namespaces: llm, team-b" in notes({"watchNamespaces": ["llm", "team-b"]})


def _verbs(rules: list[dict], group: str, resource: str) -> set[str]:
    return {
        verb
        for rule in rules
        if group in rule["apiGroups"] and resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.mark.parametrize("values", [None, {"watchNamespaces": ["llm"]}, {"namespaced": True}],
                         ids=["cluster", "ns", "release-ns"])  # fmt: skip
def test_rbac_covers_exactly_what_the_operator_does(values):
    objects = render_chart(values)
    (role,) = by_kind(objects, "Role" if values else "ClusterRole")[-1:]
    rules = role["rules"]
    for api_version, _kind, plural in CHILD_KINDS:
        group = api_version.rpartition("/")[0]
        assert _verbs(rules, group, plural) == set(FULL_VERBS), plural
    group = "serving.atom.dev"
    assert _verbs(rules, group, "atomdeployments") == {"get", "list", "watch", "patch", "update"}
    assert _verbs(rules, group, "atomdeployments/status") == {"get", "patch", "update"}
    assert _verbs(rules, group, "atomdeployments/finalizers") == {"update"}
    assert _verbs(rules, "", "pods") == {"get", "list", "watch"}
    assert _verbs(rules, "", "events") == {"create", "patch"}
    # The router's Role grants ROUTER_RULES; Kubernetes lets the operator create it only if the
    # operator holds each of those permissions itself.
    for rule in ROUTER_RULES:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert _verbs(rules, group, resource) >= set(rule["verbs"]), resource
    # The keys Secret and a model-cache claim are created once, never read: the operator cannot
    # read any Secret (apply.CREATE_ONLY POSTs them and takes a 409 as "exists").
    assert _verbs(rules, "", "secrets") == {"create"}
    assert _verbs(rules, "", "persistentvolumeclaims") == {"create"}
    # nothing else: no wildcards, no peering objects (the operator runs --standalone)
    granted = {res for rule in rules for res in rule["resources"]}
    assert granted == {
        "atomdeployments", "atomdeployments/status", "atomdeployments/finalizers", "deployments",
        "services", "poddisruptionbudgets", "horizontalpodautoscalers", "scaledobjects",
        "networkpolicies", "inferencepools", "pods", "events",
        "serviceaccounts", "roles", "rolebindings", "endpointslices",
        "secrets", "persistentvolumeclaims",
    }  # fmt: skip


def test_namespaced_install_has_no_cluster_scoped_object():
    objects = render_chart({"namespaced": True})
    assert sorted((o["kind"], o["metadata"].get("namespace")) for o in objects) == [
        ("Deployment", "atom-system"), ("Role", "atom-system"), ("RoleBinding", "atom-system"),
        ("ServiceAccount", "atom-system"),
    ]  # fmt: skip
    assert operator_args(objects)[:6] == [
        "operator", "run", "--standalone", "--namespace", "atom-system", "--no-cluster-scan",
    ]  # fmt: skip
    assert "its own namespace only (atom-system)" in notes({"namespaced": True})
    with pytest.raises(Exception, match="either namespaced"):
        render_chart({"namespaced": True, "watchNamespaces": ["llm"]})


def test_env_references_become_operator_flags_and_the_operator_knows_its_pods():
    objects = render_chart({"envReferences": {"secrets": ["hf-shared"], "configMaps": ["c"]}})
    args = operator_args(objects)
    assert args[args.index("--allow-env-secret") + 1] == "hf-shared"
    assert args[args.index("--allow-env-configmap") + 1] == "c"
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {var["name"]: var for var in container["env"]}
    assert env["ATOM_OPERATOR_NAMESPACE"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.namespace"}
    }
    labels = dict(p.split("=") for p in env["ATOM_OPERATOR_POD_LABELS"]["value"].split(","))
    assert labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert labels == deployment["spec"]["selector"]["matchLabels"]


def test_operator_deployment_is_single_non_root_and_probed():
    (deployment,) = by_kind(render_chart({"image": {"repository": "reg/atom-operator",
                                                    "tag": "dev", "pullPolicy": "Always"}}),
                            "Deployment")  # fmt: skip
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["image"] == "reg/atom-operator:dev"
    assert container["imagePullPolicy"] == "Always"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert container["ports"] == [{"name": "healthz", "containerPort": 8080, "protocol": "TCP"}]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["resources"] == {
        "requests": {"cpu": "100m", "memory": "128Mi"},
        "limits": {"memory": "512Mi"},
    }
