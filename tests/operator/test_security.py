"""The operator's side of the trust boundaries (issue 33), written as the attacks they stop.

- A user string that reaches container args or env values cannot make the kubelet expand a
  variable: `$` is doubled, only the operator's own `$(POD_IP)`-style references survive.
- engine.env / <role>.env read only the Secrets and ConfigMaps the operator's configuration
  lists; anything else is SpecValid=False naming the field, and nothing is applied.
- Names that would become flags (a leading `-`) or carry `$`/`@` are refused.
- One keys Secret per AtomDeployment, made once and mounted read-only in every engine and
  router pod; KV events bind the pod's own address, optionally CurveZMQ.
- NetworkPolicies, evaluated below as a CNI would: with a router, clients reach only the
  router; KV-event ports admit only the router; KV-transfer ports only the engine pods.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
import zmq

from atom_operator.operator_config import OperatorConfig
from atom_operator.render import render_children
from atom_operator.render.keys import CURVE_FILES, DeploymentKeys
from atom_operator.render.kubelet_expansion import expand, literal, reference, references
from atom_operator.render.network import ports_except, render_network_policies
from atom_operator.spec import SpecError
from atom_operator.validation import validate_spec

UID = "0b5d2c36-1111-4a4a-8c8c-000000000009"
# The variables the operator itself refers to in args (defined in the same container's env).
OWN_REFERENCES = {"POD_IP", "ATOM_API_KEY", "ATOM_ROUTER_API_KEY"}
STOLEN = "$(STOLEN_TOKEN)"


def atomd(spec: dict[str, Any], name: str = "chat", namespace: str = "llm") -> dict[str, Any]:
    return {
        "apiVersion": "serving.atom.dev/v1alpha1",
        "kind": "AtomDeployment",
        "metadata": {"name": name, "namespace": namespace, "uid": UID},
        "spec": {"accelerator": {"vendor": "cpu"}, **spec},
    }


def containers(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Deployment name -> its one container."""
    out = {}
    for child in children:
        if child["kind"] == "Deployment":
            (only,) = child["spec"]["template"]["spec"]["containers"]
            out[child["metadata"]["name"]] = only
    return out


def as_the_kubelet_runs_it(container: dict[str, Any], secrets: dict[str, str]) -> list[str]:
    """The container's args after the kubelet's expansion, every env variable resolved (a
    Secret-backed one to `secrets[name]`)."""
    values = {}
    for var in container.get("env", []):
        values[var["name"]] = (
            expand(var["value"], values)
            if "value" in var
            else secrets.get(var["name"], f"<{var['name']}>")
        )
    return [expand(arg, values) for arg in container["args"]]


# --- kubelet expansion ------------------------------------------------------------------------


def test_literal_survives_the_kubelet_and_reference_does_not():
    assert literal("$(A) and $$ and $") == "$$(A) and $$$$ and $$"
    assert expand(literal("$(A) and $$ and $"), {"A": "x"}) == "$(A) and $$ and $"
    assert expand(reference("A"), {"A": "x"}) == "x"
    assert references(f"{literal('$(B)')}{reference('A')}$(C)") == ["A", "C"]
    assert expand("$(MISSING)", {}) == "$(MISSING)"  # as the kubelet leaves it
    with pytest.raises(ValueError):
        reference("A) $(B")


@pytest.mark.parametrize(
    "spec",
    [
        {"engine": {"args": [f"--served-model-name={STOLEN}"]}},
        {"decode": {"args": ["--chat-template", STOLEN]}},
        {"prefill": {"args": [STOLEN]}},
        {"prefill": {}, "kvTransfer": {"config": {"note": STOLEN}}},
        {"model": {"uri": f"pvc://store/{STOLEN}", "name": "m"}},
        {"model": {"uri": f"file:///models/{STOLEN}", "name": "m"}},
    ],
    ids=["engine-args", "role-args", "prefill-args", "kv-transfer-config", "pvc-path", "file"],
)
def test_a_user_string_cannot_read_a_variable_through_the_kubelet(spec):
    """The attack: an AtomDeployment author writes $(VAR) where the operator puts user text,
    hoping the kubelet pastes a Secret-backed variable into the served model name or a flag."""
    spec = {"engine": {"env": [], "apiKeySecretRef": {"name": "keys"}}, **spec}
    engines = containers(render_children(atomd(spec)))
    for name, container in engines.items():
        rendered = " ".join(container["args"])
        if "STOLEN" in rendered:
            assert "$$(STOLEN_TOKEN)" in rendered, name
        assert set(references(rendered)) <= OWN_REFERENCES, name
        expanded = as_the_kubelet_runs_it(container, {"ATOM_API_KEY": "sk-secret"})
        assert STOLEN in " ".join(expanded) or "STOLEN" not in rendered, name
        # The operator's own references still work: the API key reaches only --api-key.
        if "--api-key" in expanded:
            assert expanded[expanded.index("--api-key") + 1] == "sk-secret"
            assert sum("sk-secret" in arg for arg in expanded) == 1


def test_user_env_values_are_literal():
    spec = {"engine": {"env": [{"name": "GREETING", "value": "$(ATOM_API_KEY)"}],
                       "apiKeySecretRef": {"name": "keys"}}}  # fmt: skip
    (engine,) = containers(render_children(atomd(spec))).values()
    (greeting,) = [var for var in engine["env"] if var["name"] == "GREETING"]
    assert greeting["value"] == "$$(ATOM_API_KEY)"


def test_every_reference_in_every_example_is_the_operators_own_and_defined():
    """Across the shipped examples, any $(X) the kubelet would expand is one the operator put
    there on purpose, and the container defines X (an undefined one is passed through
    unexpanded, which would hand the engine a literal `$(POD_IP)`)."""
    import pathlib

    import yaml

    examples = sorted((pathlib.Path(__file__).parents[2] / "examples").glob("*.yaml"))
    for path in examples:
        body = yaml.safe_load(path.read_text())
        body["metadata"]["uid"] = UID
        for name, container in containers(render_children(body)).items():
            defined = {var["name"] for var in container.get("env", [])}
            values = [*container["args"], *(v.get("value", "") for v in container.get("env", []))]
            for text in values:
                for variable in references(text):
                    assert variable in OWN_REFERENCES, (path.name, name, text)
                    assert variable in defined, (path.name, name, variable)


# --- names that would become flags ------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["-rf", "--api-key", "$(STOLEN_TOKEN)", "a@b", "has space", "x" * 254]
)
def test_model_names_that_would_be_flags_or_expansions_are_refused(name):
    with pytest.raises(SpecError) as caught:
        validate_spec({"model": {"name": name}})
    assert caught.value.field == "spec.model.name"


def test_a_derived_model_name_is_checked_too():
    """No model.name: it comes from the location; a location whose last segment is no valid
    name must be named explicitly."""
    with pytest.raises(SpecError) as caught:
        validate_spec({"model": {"uri": "file:///models/-evil"}})
    assert caught.value.field == "spec.model.name"
    validate_spec({"model": {"uri": "file:///models/-evil", "name": "ok"}})


# --- env references ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"engine": {"env": [{"name": "T", "valueFrom": {
            "secretKeyRef": {"name": "db-password", "key": "password"}}}]}},
         "spec.engine.env[0].valueFrom.secretKeyRef.name"),
        ({"decode": {"env": [{"name": "A", "value": "1"}, {"name": "T", "valueFrom": {
            "configMapKeyRef": {"name": "other-team", "key": "k"}}}]}},
         "spec.decode.env[1].valueFrom.configMapKeyRef.name"),
        ({"engine": {"env": [{"name": "T", "valueFrom": {"fileKeyRef": {"path": "/x"}}}]}},
         "spec.engine.env[0].valueFrom.fileKeyRef"),
    ],
    ids=["secret", "configmap", "unknown-source"],
)  # fmt: skip
def test_env_may_not_read_objects_the_operator_does_not_allow(spec, field):
    with pytest.raises(SpecError) as caught:
        render_children(atomd(spec))
    assert caught.value.field == field


def test_env_reads_the_objects_the_operator_allows():
    ref = {"secretKeyRef": {"name": "shared-hf", "key": "token"}}
    spec = {"engine": {"env": [{"name": "HF_TOKEN", "valueFrom": ref},
                               {"name": "POD_NAME", "valueFrom": {"fieldRef": {
                                   "fieldPath": "metadata.name"}}}]}}  # fmt: skip
    with pytest.raises(SpecError):
        render_children(atomd(spec))
    config = OperatorConfig(env_secrets=frozenset({"shared-hf"}))
    (engine,) = containers(render_children(atomd(spec), config)).values()
    assert {"name": "HF_TOKEN", "valueFrom": ref} in engine["env"]


def test_operator_config_from_environ_and_flags():
    config = OperatorConfig.from_environ(
        {"ATOM_OPERATOR_ENV_SECRETS": "a, b,", "ATOM_OPERATOR_ENV_CONFIGMAPS": "c",
         "ATOM_OPERATOR_NAMESPACE": "atom-system",
         "ATOM_OPERATOR_POD_LABELS": "app.kubernetes.io/name=atom-operator,tier=ctl"}
    )  # fmt: skip
    assert config.env_secrets == {"a", "b"} and config.env_config_maps == {"c"}
    assert config.allowing(["d"]).env_secrets == {"a", "b", "d"}
    assert config.operator_peer() == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "atom-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "atom-operator",
                                        "tier": "ctl"}},
    }  # fmt: skip
    assert OperatorConfig().operator_peer() is None
    with pytest.raises(ValueError):
        OperatorConfig.from_environ({"ATOM_OPERATOR_POD_LABELS": "novalue"})


# --- the per-deployment keys ------------------------------------------------------------------


def test_keys_are_random_and_the_curve_pairs_match():
    first, second = DeploymentKeys.generate(), DeploymentKeys.generate()
    assert set(first.files) == {"transfer-key", *CURVE_FILES}
    assert re.fullmatch(r"[0-9a-f]{64}", first.files["transfer-key"])
    assert first.files["transfer-key"] != second.files["transfer-key"]
    for side in ("server", "client"):
        secret = first.files[f"kv-events-{side}.key"].encode()
        assert len(secret) == 40
        assert zmq.curve_public(secret) == first.files[f"kv-events-{side}.pub"].encode()
    assert first.files["kv-events-server.key"] != second.files["kv-events-server.key"]


def test_keys_secret_is_mounted_read_only_in_every_engine_and_router_pod():
    keys = DeploymentKeys.generate()
    children = render_children(atomd({"prefill": {}}), keys=keys)
    secret = children[0]
    assert (secret["kind"], secret["metadata"]["name"], secret["type"]) == (
        "Secret", "chat-atom-keys", "Opaque"
    )  # fmt: skip
    assert secret["metadata"]["ownerReferences"][0]["uid"] == UID
    decoded = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert decoded == keys.files
    pods = {c["metadata"]["name"]: c["spec"]["template"]["spec"] for c in children
            if c["kind"] == "Deployment"}  # fmt: skip
    assert set(pods) == {"chat-decode", "chat-prefill", "chat-router"}
    for name, pod in pods.items():
        assert {
            "name": "atom-keys",
            "secret": {"secretName": "chat-atom-keys", "defaultMode": 0o440},
        } in pod["volumes"], name
        (container,) = pod["containers"]
        assert {"name": "atom-keys", "mountPath": "/etc/atom/keys", "readOnly": True} in (
            container["volumeMounts"]
        ), name
        assert {"name": "ATOM_TRANSFER_KEY_FILE", "value": "/etc/atom/keys/transfer-key"} in (
            container["env"]
        ), name
    # Without keys the renderer stays pure and emits no Secret (the operator passes them in).
    assert "Secret" not in {c["kind"] for c in render_children(atomd({"prefill": {}}))}


# --- KV events --------------------------------------------------------------------------------


def kv_events_config(spec: dict[str, Any]) -> dict[str, Any]:
    engines = containers(render_children(atomd(spec)))
    args = engines["chat-decode"]["args"]
    return json.loads(args[args.index("--kv-events-config") + 1])


def test_kv_events_bind_the_pod_address_never_every_interface():
    config = kv_events_config({})
    assert config["endpoint"] == "tcp://$(POD_IP):5557"
    assert config["replay_endpoint"] == "tcp://$(POD_IP):5558"
    assert "include_token_ids" not in config and "curve_keys_dir" not in config


def test_kv_events_curve_and_hashes_only():
    spec = {"router": {"enabled": True},
            "kvEvents": {"encryption": "curve", "includeTokenIds": False}}  # fmt: skip
    config = kv_events_config(spec)
    assert config["curve_keys_dir"] == "/etc/atom/keys"
    assert config["include_token_ids"] is False
    router = containers(render_children(atomd(spec)))["chat-router"]["args"]
    assert router[router.index("--kv-events-curve-dir") + 1] == "/etc/atom/keys"
    plain = containers(render_children(atomd({"router": {"enabled": True}})))["chat-router"]
    assert "--kv-events-curve-dir" not in plain["args"]


def test_router_api_key_comes_from_its_secret_through_the_environment():
    spec = {"router": {"enabled": True, "apiKeySecret": {"name": "router-key"}}}
    router = containers(render_children(atomd(spec)))["chat-router"]
    assert router["args"][router["args"].index("--api-key") + 1] == "$(ATOM_ROUTER_API_KEY)"
    assert {"name": "ATOM_ROUTER_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "router-key", "key": "api-key"}}} in router["env"]  # fmt: skip
    assert as_the_kubelet_runs_it(router, {"ATOM_ROUTER_API_KEY": "rk"})[-1] == "rk"


# --- NetworkPolicies, evaluated as a CNI does -------------------------------------------------


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        if expression["operator"] != "In":
            raise AssertionError(f"the evaluator knows In only: {expression}")
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def _peer_admits(peer: dict[str, Any], policy_ns: str, src: tuple[str, dict]) -> bool:
    src_ns, src_labels = src
    if "namespaceSelector" in peer:
        ns_labels = {"kubernetes.io/metadata.name": src_ns}
        if not _selects(peer["namespaceSelector"], ns_labels):
            return False
    elif src_ns != policy_ns:
        return False
    return _selects(peer.get("podSelector", {}), src_labels)


def _port_admits(ports: list[dict[str, Any]] | None, port: int) -> bool:
    if not ports:
        return True
    return any(p["port"] <= port <= p.get("endPort", p["port"]) for p in ports)


def admitted(policies, src: tuple[str, dict], dst_labels: dict[str, str], port: int) -> bool:
    """Whether a CNI lets a pod (namespace, labels) open `port` on a pod of these labels."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], dst_labels)]
    if not selecting:
        return True  # not isolated
    for policy in selecting:
        ns = policy["metadata"]["namespace"]
        for rule in policy["spec"]["ingress"]:
            peers = rule.get("from")
            if _port_admits(rule.get("ports"), port) and (
                peers is None or any(_peer_admits(peer, ns, src) for peer in peers)
            ):
                return True
    return False


def pod_labels(children, role: str) -> dict[str, str]:
    (deployment,) = [c for c in children if c["kind"] == "Deployment"
                     and c["metadata"]["name"].endswith(f"-{role}")]  # fmt: skip
    return deployment["spec"]["template"]["metadata"]["labels"]


OPERATOR = OperatorConfig(namespace="atom-system",
                          pod_labels=(("app.kubernetes.io/name", "atom-operator"),))  # fmt: skip


def test_with_a_router_clients_reach_only_the_router():
    body = atomd({"prefill": {}})
    children = render_children(body, OPERATOR)
    policies = render_network_policies(body, OPERATOR)
    assert [p for p in children if p["kind"] == "NetworkPolicy"] == policies
    decode, prefill = pod_labels(children, "decode"), pod_labels(children, "prefill")
    router = pod_labels(children, "router")
    client = ("llm", {"app": "curl"})
    elsewhere = ("attackers", {"app": "curl"})
    operator = ("atom-system", {"app.kubernetes.io/name": "atom-operator"})
    for engine in (decode, prefill):
        assert not admitted(policies, client, engine, 8000)  # no bypassing the router
        assert not admitted(policies, elsewhere, engine, 8000)
        assert admitted(policies, ("llm", router), engine, 8000)
        assert admitted(policies, operator, engine, 8000)  # the autoscaler's /metrics scrape
        assert admitted(policies, ("llm", router), engine, 5557)
        assert admitted(policies, ("llm", router), engine, 5558)
        assert not admitted(policies, client, engine, 5557)
        assert not admitted(policies, client, engine, 14579)
    # KV events only from the router: not even from the other engine role.
    assert not admitted(policies, ("llm", decode), prefill, 5557)
    # KV transfer: decode pulls from prefill on the connector's ports (any but HTTP and events).
    assert admitted(policies, ("llm", decode), prefill, 14579)
    assert admitted(policies, ("llm", decode), prefill, 40123)
    assert not admitted(policies, ("llm", router), prefill, 14579)
    for who in (client, elsewhere):
        assert admitted(policies, who, router, 8000)
        assert not admitted(policies, who, router, 9000)


def test_without_a_router_clients_reach_the_engines_and_nothing_else():
    body = atomd({})
    policies = render_network_policies(body)
    (policy,) = policies
    decode = pod_labels(render_children(body), "decode")
    client = ("other", {"app": "curl"})
    assert admitted(policies, client, decode, 8000)
    assert not admitted(policies, client, decode, 5557)
    assert not admitted(policies, ("llm", decode), decode, 5557)
    epp = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "llm-d"}}}
    with_epp = render_network_policies(atomd({"networkPolicy": {"kvEventsFrom": [epp]}}))
    assert admitted(with_epp, ("llm-d", {"app": "epp"}), decode, 5558)
    assert not admitted(with_epp, ("llm-d", {"app": "epp"}), decode, 14579)
    assert render_network_policies(atomd({"networkPolicy": {"enabled": False}})) == []


def test_http_from_lets_a_gateway_reach_routed_engines():
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}}
    body = atomd({"router": {"enabled": True}, "networkPolicy": {"httpFrom": [gateway]}})
    policies = render_network_policies(body)
    decode = pod_labels(render_children(body), "decode")
    assert admitted(policies, ("gw", {"app": "envoy"}), decode, 8000)
    assert not admitted(policies, ("gw", {"app": "envoy"}), decode, 5557)
    # Without the operator's identity (atom render, or a chart without it) no scrape peer.
    assert not admitted(policies, ("atom-system", {"app.kubernetes.io/name": "atom-operator"}),
                        decode, 8000)  # fmt: skip


def test_ports_except_covers_every_other_port_exactly():
    excluded = {8000, 5557, 5558}
    ranges = ports_except(excluded)
    covered = {p for r in ranges for p in range(r["port"], r.get("endPort", r["port"]) + 1)}
    assert covered == set(range(1, 65536)) - excluded
    assert ports_except({1, 65535})[0] == {"protocol": "TCP", "port": 2, "endPort": 65534}
