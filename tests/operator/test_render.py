"""Renderer unit tests: each spec field lands in the exact place and form the runtime expects."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from atom_operator.render import render_children
from atom_operator.render.autoscalers import quantity, render_hpa
from atom_operator.render.names import (
    child_name,
    endpoint_url,
    label_value,
    role_selector_string,
    short_hash,
)
from atom_operator.render.roles import (
    render_pdb,
    render_role_deployment,
    render_role_service,
    render_service,
)
from atom_operator.render.router import render_router_deployment
from atom_operator.spec import SpecError

UID = "7f0c1e52-3d3c-4b8e-9a55-2f1f2b6a0c11"
# The per-deployment keys Secret, read-only in every engine and router pod.
KEYS_VOLUME = {
    "name": "atom-keys",
    "secret": {"secretName": "qwen3-8b-atom-keys", "defaultMode": 0o440},
}
KEYS_MOUNT = {"name": "atom-keys", "mountPath": "/etc/atom/keys", "readOnly": True}


def atomd(spec: dict[str, Any] | None = None, name: str = "qwen3-8b", **metadata: Any):
    meta = {"name": name, "namespace": "llm", "uid": UID, "generation": 3}
    meta.update(metadata)
    return {
        "apiVersion": "serving.atom.dev/v1alpha1",
        "kind": "AtomDeployment",
        "metadata": meta,
        "spec": spec if spec is not None else {"model": {"uri": "hf://Qwen/Qwen3-8B"}},
    }


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def pod(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def flag(args: list[str], name: str) -> str:
    """The value after `name`; fails if the flag is absent or repeated."""
    assert args.count(name) == 1, (name, args)
    return args[args.index(name) + 1]


def env_of(deployment: dict[str, Any]) -> dict[str, Any]:
    return {
        var["name"]: var.get("value", var.get("valueFrom")) for var in container(deployment)["env"]
    }


# --- names ------------------------------------------------------------------------------------


def test_child_name_keeps_a_clean_name():
    assert child_name(atomd(), "decode") == "qwen3-8b-decode"
    assert child_name(atomd()) == "qwen3-8b"


@pytest.mark.parametrize(
    "name,expected",
    [
        ("Qwen3.8B", "qwen3-8b-{h}-decode"),
        ("qwen3-0.6b", "qwen3-0-6b-{h}-decode"),
        ("Qwen/Qwen3_8B", "qwen-qwen3-8b-{h}-decode"),
        ("7b-model", "atom-7b-model-{h}-decode"),
    ],
)
def test_child_name_sanitizes_and_adds_a_hash_of_the_original(name, expected):
    got = child_name(atomd(name=name), "decode")
    assert got == expected.format(h=short_hash(name))


def test_child_name_truncates_to_63_with_hash_and_keeps_the_suffix():
    long = "a" * 70
    got = child_name(atomd(name=long), "prefill")
    assert len(got) == 63
    assert got == "a" * 46 + "-" + short_hash(long) + "-prefill"


def test_names_that_sanitize_alike_do_not_collide():
    assert child_name(atomd(name="a.b"), "decode") != child_name(atomd(name="a-b"), "decode")


def test_label_value_truncates_long_names_with_a_hash():
    assert label_value("qwen3-8b") == "qwen3-8b"
    long = "m" * 100
    assert label_value(long) == "m" * 54 + "-" + short_hash(long)
    assert len(label_value(long)) == 63


def test_endpoint_url():
    assert endpoint_url(atomd()) == "http://qwen3-8b.llm.svc.cluster.local:8000/v1"
    body = atomd({"service": {"port": 80}}, namespace="prod")
    assert endpoint_url(body) == "http://qwen3-8b.prod.svc.cluster.local:80/v1"


# --- children of aggregated and disaggregated specs -------------------------------------------


def kinds_and_names(children):
    return [(c["kind"], c["metadata"]["name"]) for c in children]


def test_aggregated_children():
    assert kinds_and_names(render_children(atomd())) == [
        ("Deployment", "qwen3-8b-decode"),
        ("Service", "qwen3-8b-decode"),
        ("PodDisruptionBudget", "qwen3-8b-decode"),
        ("NetworkPolicy", "qwen3-8b"),
        ("Service", "qwen3-8b"),
    ]


@pytest.mark.parametrize(
    "provider,scaler",
    [("builtin", []), ("hpa", [("HorizontalPodAutoscaler", "qwen3-8b-prefill")])],
)
def test_disaggregated_children_with_autoscaling(provider, scaler):
    autoscaling = {"enabled": True, "provider": provider, "maxReplicas": 3,
                   "targetRequestsWaiting": 2}  # fmt: skip
    spec = {"prefill": {"autoscaling": autoscaling}, "decode": {"replicas": 2}}
    assert kinds_and_names(render_children(atomd(spec))) == [
        ("Deployment", "qwen3-8b-decode"),
        ("Service", "qwen3-8b-decode"),
        ("PodDisruptionBudget", "qwen3-8b-decode"),
        ("Deployment", "qwen3-8b-prefill"),
        ("Service", "qwen3-8b-prefill"),
        ("PodDisruptionBudget", "qwen3-8b-prefill"),
        *scaler,
        ("ServiceAccount", "qwen3-8b-router"),
        ("Role", "qwen3-8b-router"),
        ("RoleBinding", "qwen3-8b-router"),
        ("Deployment", "qwen3-8b-router"),
        ("NetworkPolicy", "qwen3-8b"),
        ("NetworkPolicy", "qwen3-8b-router"),
        ("Service", "qwen3-8b"),
    ]


def test_aggregated_children_with_the_router():
    """router.enabled without a prefill role: the router and its RBAC join the decode role's
    children, and nothing of a prefill role appears."""
    spec = {"decode": {"replicas": 4}, "router": {"enabled": True}}
    assert kinds_and_names(render_children(atomd(spec))) == [
        ("Deployment", "qwen3-8b-decode"),
        ("Service", "qwen3-8b-decode"),
        ("PodDisruptionBudget", "qwen3-8b-decode"),
        ("ServiceAccount", "qwen3-8b-router"),
        ("Role", "qwen3-8b-router"),
        ("RoleBinding", "qwen3-8b-router"),
        ("Deployment", "qwen3-8b-router"),
        ("NetworkPolicy", "qwen3-8b"),
        ("NetworkPolicy", "qwen3-8b-router"),
        ("Service", "qwen3-8b"),
    ]
    # Explicitly off is the aggregated default: the same children as without the field.
    off = render_children(atomd({"decode": {"replicas": 4}, "router": {"enabled": False}}))
    assert off == render_children(atomd({"decode": {"replicas": 4}}))


def test_every_child_is_owned_by_the_atomdeployment_in_its_namespace():
    for child in render_children(atomd({"prefill": {}})):
        assert child["metadata"]["namespace"] == "llm"
        assert child["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "serving.atom.dev/v1alpha1",
                "kind": "AtomDeployment",
                "name": "qwen3-8b",
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert child["metadata"]["labels"]["serving.atom.dev/deployment"] == "qwen3-8b"


def test_no_owner_reference_without_a_uid():
    body = atomd()
    del body["metadata"]["uid"]
    assert all("ownerReferences" not in c["metadata"] for c in render_children(body))


def test_render_children_refuses_an_invalid_spec():
    with pytest.raises(SpecError) as caught:
        render_children(atomd({"stateCheckpoint": {"intervalTokens": 100}}))
    assert str(caught.value) == (
        "spec.stateCheckpoint.intervalTokens: must be a multiple of spec.engine.blockSize (16), "
        "got 100"
    )
    assert isinstance(caught.value, ValueError)


def test_render_does_not_modify_the_body():
    body = atomd({"prefill": {}, "accelerator": {"vendor": "nvidia"}})
    before = copy.deepcopy(body)
    render_children(body)
    assert body == before


# --- the engine Deployment --------------------------------------------------------------------


def test_role_labels_and_selector():
    deployment = render_role_deployment(atomd({"prefill": {}}), "prefill")
    labels = {
        "app.kubernetes.io/name": "atom",
        "app.kubernetes.io/instance": "qwen3-8b",
        "app.kubernetes.io/managed-by": "atom-operator",
        "serving.atom.dev/deployment": "qwen3-8b",
        "app.kubernetes.io/component": "prefill",
        "serving.atom.dev/role": "prefill",
        "llm-d.ai/inferenceServing": "true",
        "llm-d.ai/role": "prefill",
        "llm-d.ai/engine-type": "atom",
    }
    assert deployment["metadata"]["labels"] == labels
    assert deployment["spec"]["template"]["metadata"]["labels"] == labels
    assert deployment["spec"]["selector"] == {
        "matchLabels": {
            "serving.atom.dev/deployment": "qwen3-8b",
            "serving.atom.dev/role": "prefill",
        }
    }
    assert role_selector_string(atomd(), "decode") == (
        "serving.atom.dev/deployment=qwen3-8b,serving.atom.dev/role=decode"
    )


def test_serve_args_for_an_aggregated_hf_model_in_order():
    spec = {
        "model": {"uri": "hf://Qwen/Qwen3-8B", "name": "qwen3"},
        "engine": {"blockSize": 32, "maxModelLen": 32768, "args": ["--max-num-seqs", "128"]},
        "decode": {"tensorParallelSize": 8, "args": ["--enforce-eager"]},
        "stateCheckpoint": {"intervalTokens": 8192, "demand": False, "memoryFraction": 0.25},
    }
    engine = container(render_role_deployment(atomd(spec), "decode"))
    assert engine["command"] == ["atom"]
    assert engine["args"] == [
        "serve",
        "--host", "0.0.0.0",
        "--port", "8000",
        "--model", "Qwen/Qwen3-8B",
        "--served-model-name", "qwen3",
        "--block-size", "32",
        "--max-model-len", "32768",
        "--tensor-parallel-size", "8",
        "--compile-cache-dir", "/var/cache/atom/compile",
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://$(POD_IP):5557",'
        '"replay_endpoint":"tcp://$(POD_IP):5558","topic":"kv@$(POD_IP):5557@qwen3"}',
        "--state-checkpoint-interval-tokens", "8192",
        "--no-state-checkpoint-demand",
        "--state-checkpoint-memory-fraction", "0.25",
        "--max-num-seqs", "128",
        "--enforce-eager",
    ]  # fmt: skip


def test_served_model_name_defaults_to_the_hf_repo_id():
    args = container(render_role_deployment(atomd(), "decode"))["args"]
    assert flag(args, "--served-model-name") == "Qwen/Qwen3-8B"
    assert "--max-model-len" not in args


def test_kv_events_config_uses_spec_ports_and_the_pod_ip_variable():
    spec = {
        "model": {"uri": "hf://org/m", "name": "m"},
        "kvEvents": {"port": 6000, "replayPort": 6001},
    }
    deployment = render_role_deployment(atomd(spec), "decode")
    config = json.loads(flag(container(deployment)["args"], "--kv-events-config"))
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://$(POD_IP):6000",
        "replay_endpoint": "tcp://$(POD_IP):6001",
        "topic": "kv@$(POD_IP):6000@m",
    }
    # the variable $(POD_IP) refers to must be defined, and before any user variable
    assert container(deployment)["env"][0] == {
        "name": "POD_IP",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    }
    assert container(deployment)["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "kv-events", "containerPort": 6000, "protocol": "TCP"},
        {"name": "kv-replay", "containerPort": 6001, "protocol": "TCP"},
    ]


def test_kv_events_disabled_drops_the_flag_and_ports():
    deployment = render_role_deployment(atomd({"kvEvents": {"enabled": False}}), "decode")
    assert "--kv-events-config" not in container(deployment)["args"]
    assert [p["name"] for p in container(deployment)["ports"]] == ["http"]
    service = render_role_service(atomd({"kvEvents": {"enabled": False}}), "decode")
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]


def test_state_checkpoint_defaults_to_anchors_and_demand():
    args = container(render_role_deployment(atomd(), "decode"))["args"]
    assert flag(args, "--state-checkpoint-interval-tokens") == "-1"
    assert "--state-checkpoint-demand" in args
    assert "--no-state-checkpoint-demand" not in args


def test_kv_transfer_roles_in_disaggregated_mode():
    spec = {"prefill": {}, "kvTransfer": {"connector": "NixlConnector", "config": {"a": 1}}}
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        args = container(render_role_deployment(atomd(spec), role))["args"]
        assert json.loads(flag(args, "--kv-transfer-config")) == {
            "kv_connector": "NixlConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"a": 1},
        }


def test_kv_transfer_defaults_to_the_portable_connector_and_is_absent_when_aggregated():
    args = container(render_role_deployment(atomd({"prefill": {}}), "decode"))["args"]
    assert json.loads(flag(args, "--kv-transfer-config"))["kv_connector"] == "AtomPortableConnector"
    assert (
        "--kv-transfer-config" not in container(render_role_deployment(atomd(), "decode"))["args"]
    )


def test_prefill_and_decode_run_at_their_own_tensor_parallel_sizes():
    """Prefill TP 2 -> decode TP 8: each role's pods get their own --tensor-parallel-size and
    GPU count (the runtime's KV connector pulls each decode rank's heads from the producer
    ranks that hold them)."""
    spec = {"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 8}}
    for role, size in (("prefill", 2), ("decode", 8)):
        engine = container(render_role_deployment(atomd(spec), role))
        assert flag(engine["args"], "--tensor-parallel-size") == str(size)
        assert engine["resources"]["limits"]["amd.com/gpu"] == size
        assert json.loads(flag(engine["args"], "--kv-transfer-config"))["kv_role"] == (
            "kv_producer" if role == "prefill" else "kv_consumer"
        )


def test_user_args_come_after_the_operator_flags():
    spec = {"engine": {"args": ["--block-size", "64"]}, "prefill": {"args": ["--x"]}}
    args = container(render_role_deployment(atomd(spec), "prefill"))["args"]
    assert args[-3:] == ["--block-size", "64", "--x"]
    assert args.index("--kv-transfer-config") < len(args) - 3


def test_hf_token_from_the_auth_secret():
    spec = {"model": {"uri": "hf://meta-llama/Llama-3.1-8B", "authSecretRef": {"name": "hf"}}}
    env = env_of(render_role_deployment(atomd(spec), "decode"))
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
    assert env["HF_HOME"] == "/var/cache/atom/huggingface"
    assert "HF_TOKEN" not in env_of(render_role_deployment(atomd(), "decode"))


def test_user_env_overrides_by_name_and_role_env_wins_over_engine_env():
    spec = {
        "engine": {"env": [{"name": "HF_HOME", "value": "/data/hf"}, {"name": "A", "value": "1"}]},
        "decode": {"env": [{"name": "A", "value": "2"}]},
    }
    deployment = render_role_deployment(atomd(spec), "decode")
    names = [var["name"] for var in container(deployment)["env"]]
    assert names == ["POD_IP", "ATOM_TRANSFER_KEY_FILE", "HF_HOME", "TRITON_CACHE_DIR",
                     "XDG_CACHE_HOME", "A"]  # fmt: skip
    assert env_of(deployment)["HF_HOME"] == "/data/hf"
    assert env_of(deployment)["A"] == "2"


def test_pod_ip_is_reserved():
    with pytest.raises(SpecError) as caught:
        render_children(atomd({"engine": {"env": [{"name": "POD_IP", "value": "x"}]}}))
    assert caught.value.field == "spec.engine.env[0].name"


def test_pvc_model_is_mounted_read_only():
    spec = {"model": {"uri": "pvc://model-store/qwen/Qwen3-8B"}}
    deployment = render_role_deployment(atomd(spec), "decode")
    args = container(deployment)["args"]
    assert flag(args, "--model") == "/mnt/models/qwen/Qwen3-8B"
    assert flag(args, "--served-model-name") == "Qwen3-8B"
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "model-store", "readOnly": True},
    } in (pod(deployment)["volumes"])
    assert {"name": "model", "mountPath": "/mnt/models", "readOnly": True} in (
        container(deployment)["volumeMounts"]
    )


def test_pvc_root_and_file_models():
    args = container(render_role_deployment(atomd({"model": {"uri": "pvc://store"}}), "decode"))[
        "args"
    ]
    assert (flag(args, "--model"), flag(args, "--served-model-name")) == ("/mnt/models", "store")
    deployment = render_role_deployment(atomd({"model": {"uri": "file:///models/smol"}}), "decode")
    args = container(deployment)["args"]
    assert (flag(args, "--model"), flag(args, "--served-model-name")) == ("/models/smol", "smol")
    assert [v["name"] for v in pod(deployment)["volumes"]] == [
        "dshm", "cache", "compile-cache", "tmp", "atom-keys"
    ]  # fmt: skip


def test_default_model_has_no_model_flag():
    args = container(render_role_deployment(atomd({"accelerator": {"vendor": "cpu"}}), "decode"))[
        "args"
    ]
    assert "--model" not in args
    assert flag(args, "--served-model-name") == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize(
    "accelerator,resource,toleration",
    [
        ({}, "amd.com/gpu", "amd.com/gpu"),
        ({"vendor": "amd"}, "amd.com/gpu", "amd.com/gpu"),
        ({"vendor": "nvidia"}, "nvidia.com/gpu", "nvidia.com/gpu"),
        ({"vendor": "amd", "resourceName": "amd.com/xcp"}, "amd.com/xcp", "amd.com/gpu"),
    ],
)
def test_gpu_resources_equal_tensor_parallel_size(accelerator, resource, toleration):
    spec = {"accelerator": accelerator, "decode": {"tensorParallelSize": 4,
            "resources": {"requests": {"cpu": "8"}, "limits": {"memory": "64Gi"}}}}  # fmt: skip
    deployment = render_role_deployment(atomd(spec), "decode")
    # Each of cpu and memory gets a request and a limit: the one given serves as both.
    assert container(deployment)["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi", resource: 4},
        "limits": {"memory": "64Gi", "cpu": "8", resource: 4},
    }
    assert pod(deployment)["tolerations"] == [
        {"key": toleration, "operator": "Exists", "effect": "NoSchedule"}
    ]


def test_cpu_vendor_requests_no_device_and_tolerates_nothing():
    spec = {"accelerator": {"vendor": "cpu"}, "decode": {"resources": {"requests": {"cpu": "2"}}}}
    deployment = render_role_deployment(atomd(spec), "decode")
    assert container(deployment)["resources"] == {
        "requests": {"cpu": "2", "memory": "4Gi"},  # memory: the cpu vendor's default
        "limits": {"cpu": "2", "memory": "4Gi"},
    }
    assert "tolerations" not in pod(deployment)
    assert "supplementalGroups" not in pod(deployment)["securityContext"]
    assert container(deployment)["image"] == "ghcr.io/atom-serving/atom-runtime:0.1.0-cpu"


def test_explicit_tolerations_replace_the_vendor_default_and_empty_means_none():
    mine = [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}]
    deployment = render_role_deployment(atomd({"accelerator": {"tolerations": mine}}), "decode")
    assert pod(deployment)["tolerations"] == mine
    none = render_role_deployment(atomd({"accelerator": {"tolerations": []}}), "decode")
    assert "tolerations" not in pod(none)


def test_gpu_resource_in_user_resources_is_refused():
    spec = {"accelerator": {"vendor": "nvidia"},
            "decode": {"resources": {"requests": {"nvidia.com/gpu": 1}}}}  # fmt: skip
    with pytest.raises(SpecError) as caught:
        render_children(atomd(spec))
    assert caught.value.field == "spec.decode.resources.requests[nvidia.com/gpu]"


def test_product_labels_become_required_node_affinity_and_node_selector_is_kept():
    spec = {
        "accelerator": {
            "productLabels": {"key": "amd.com/gpu.product-name", "values": ["AMD_Instinct_MI300X"]},
            "nodeSelector": {"pool": "gpu"},
        }
    }
    deployment = render_role_deployment(atomd(spec), "decode")
    assert pod(deployment)["affinity"] == {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": "amd.com/gpu.product-name",
                                "operator": "In",
                                "values": ["AMD_Instinct_MI300X"],
                            }
                        ]
                    }  # fmt: skip
                ]
            }
        }
    }
    assert pod(deployment)["nodeSelector"] == {"pool": "gpu"}
    plain = render_role_deployment(atomd(), "decode")
    assert "affinity" not in pod(plain) and "nodeSelector" not in pod(plain)


def test_security_context_is_non_root_and_amd_gets_the_video_group():
    deployment = render_role_deployment(atomd(), "decode")
    assert pod(deployment)["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
        "supplementalGroups": [44],
    }
    assert container(deployment)["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    custom = render_role_deployment(
        atomd({"accelerator": {"supplementalGroups": [44, 110]}}), "decode"
    )
    assert pod(custom)["securityContext"]["supplementalGroups"] == [44, 110]
    nvidia = render_role_deployment(atomd({"accelerator": {"vendor": "nvidia"}}), "decode")
    assert "supplementalGroups" not in pod(nvidia)["securityContext"]


def test_shm_cache_volumes_and_probes():
    spec = {"engine": {"shmSize": "32Gi", "startupTimeoutSeconds": 1800}}
    deployment = render_role_deployment(atomd(spec), "decode")
    # The root filesystem is read-only: every writable place is a size-limited emptyDir.
    assert pod(deployment)["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}},
        {"name": "cache", "emptyDir": {"sizeLimit": "100Gi"}},
        {"name": "compile-cache", "emptyDir": {"sizeLimit": "10Gi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        KEYS_VOLUME,
    ]
    assert container(deployment)["volumeMounts"] == [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": "/var/cache/atom"},
        {"name": "compile-cache", "mountPath": "/var/cache/atom/compile"},
        {"name": "tmp", "mountPath": "/tmp"},
        KEYS_MOUNT,
    ]
    assert container(deployment)["securityContext"]["readOnlyRootFilesystem"] is True
    sized = render_role_deployment(atomd({"engine": {"cacheSize": "300Gi"}}), "decode")
    assert pod(sized)["volumes"][1] == {"name": "cache", "emptyDir": {"sizeLimit": "300Gi"}}
    engine = container(deployment)
    health = {"path": "/health", "port": "http"}
    assert engine["startupProbe"] == {
        "httpGet": health, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 180
    }  # fmt: skip
    assert engine["readinessProbe"] == {
        "httpGet": health, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3
    }  # fmt: skip
    assert engine["livenessProbe"]["httpGet"] == health
    assert deployment["spec"]["progressDeadlineSeconds"] == 2400


def test_startup_probe_covers_a_custom_timeout():
    spec = {"engine": {"startupTimeoutSeconds": 605}}
    probe = container(render_role_deployment(atomd(spec), "decode"))["startupProbe"]
    assert probe["failureThreshold"] == 61  # 61 * 10 s >= 605 s


def test_image_pull_settings_and_default_images():
    spec = {"engine": {"image": "registry.local/atom:dev", "imagePullPolicy": "Always",
                       "imagePullSecrets": [{"name": "regcred"}]}}  # fmt: skip
    deployment = render_role_deployment(atomd(spec), "decode")
    assert container(deployment)["image"] == "registry.local/atom:dev"
    assert container(deployment)["imagePullPolicy"] == "Always"
    assert pod(deployment)["imagePullSecrets"] == [{"name": "regcred"}]
    amd = render_role_deployment(atomd(), "decode")
    assert container(amd)["image"] == "ghcr.io/atom-serving/atom-runtime:0.1.0-rocm"
    assert "imagePullSecrets" not in pod(amd)
    nvidia = render_role_deployment(atomd({"accelerator": {"vendor": "nvidia"}}), "decode")
    assert container(nvidia)["image"] == "ghcr.io/atom-serving/atom-runtime:0.1.0-cuda"


def test_replicas_and_rollout_strategy():
    deployment = render_role_deployment(atomd({"decode": {"replicas": 3}}), "decode")
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }


# --- autoscaling ------------------------------------------------------------------------------


def test_autoscaled_role_has_no_replicas_and_an_hpa():
    autoscaling = {
        "enabled": True,
        "provider": "hpa",
        "minReplicas": 2,
        "maxReplicas": 8,
        "targetRequestsWaiting": 4,
        "targetKVCacheUsage": 0.8,
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
    }
    body = atomd({"decode": {"replicas": 5, "autoscaling": autoscaling}})
    assert "replicas" not in render_role_deployment(body, "decode")["spec"]
    hpa = render_hpa(body, "decode")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "qwen3-8b-decode"},
        "minReplicas": 2,
        "maxReplicas": 8,
        "metrics": [
            {"type": "Pods", "pods": {"metric": {"name": "atom_requests_waiting"},
                                      "target": {"type": "AverageValue", "averageValue": "4"}}},
            {"type": "Pods", "pods": {"metric": {"name": "atom_kv_cache_usage_ratio"},
                                      "target": {"type": "AverageValue", "averageValue": "800m"}}},
        ],
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
    }  # fmt: skip


def test_no_hpa_without_autoscaling():
    assert render_hpa(atomd(), "decode") is None


@pytest.mark.parametrize("value,expected", [(4, "4"), (2.0, "2"), (0.8, "800m"), (2.5, "2500m"),
                                            (0.0001, "1m")])  # fmt: skip
def test_quantity(value, expected):
    assert quantity(value) == expected


# --- services, PDB, router --------------------------------------------------------------------


def test_role_service_is_headless_with_engine_ports():
    service = render_role_service(atomd(), "decode")
    assert service["spec"] == {
        "clusterIP": "None",
        "selector": {"serving.atom.dev/deployment": "qwen3-8b", "serving.atom.dev/role": "decode"},
        "ports": [
            {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"},
            {"name": "kv-events", "port": 5557, "targetPort": "kv-events", "protocol": "TCP"},
            {"name": "kv-replay", "port": 5558, "targetPort": "kv-replay", "protocol": "TCP"},
        ],
    }


def test_user_service_targets_decode_when_aggregated():
    spec = {"service": {"type": "LoadBalancer", "port": 80, "annotations": {"a": "b"}}}
    service = render_service(atomd(spec))
    assert service["metadata"]["name"] == "qwen3-8b"
    assert service["metadata"]["annotations"] == {"a": "b"}
    assert service["spec"] == {
        "type": "LoadBalancer",
        "selector": {"serving.atom.dev/deployment": "qwen3-8b", "serving.atom.dev/role": "decode"},
        "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
    }


def test_user_service_targets_the_router_when_disaggregated():
    service = render_service(atomd({"prefill": {}}))
    assert service["spec"]["selector"] == {
        "serving.atom.dev/deployment": "qwen3-8b",
        "serving.atom.dev/role": "router",
    }
    assert service["spec"]["type"] == "ClusterIP"


@pytest.mark.parametrize(
    ("spec", "target"),
    [({"router": {"enabled": True}}, "router"), ({"router": {"enabled": False}}, "decode"),
     ({"prefill": {}, "router": {"enabled": True}}, "router")],
)  # fmt: skip
def test_user_service_follows_the_router(spec, target):
    """The user-facing Service selects the router pods whenever there is a router, in either
    mode, and the decode pods otherwise; the decode pods keep their headless Service, which the
    router discovers."""
    children = render_children(atomd(spec))
    services = {c["metadata"]["name"]: c for c in children if c["kind"] == "Service"}
    assert services["qwen3-8b"]["spec"]["selector"] == {
        "serving.atom.dev/deployment": "qwen3-8b",
        "serving.atom.dev/role": target,
    }
    assert services["qwen3-8b-decode"]["spec"]["clusterIP"] == "None"


def test_pdb_per_role():
    pdb = render_pdb(atomd(), "decode")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"] == {
        "maxUnavailable": 1,
        "selector": {
            "matchLabels": {
                "serving.atom.dev/deployment": "qwen3-8b",
                "serving.atom.dev/role": "decode",
            }
        },  # fmt: skip
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }


def test_router_deployment():
    spec = {"prefill": {}, "router": {"replicas": 2, "resources": {"requests": {"cpu": "1"}}}}
    router = render_router_deployment(atomd(spec))
    assert router["metadata"]["name"] == "qwen3-8b-router"
    assert router["spec"]["replicas"] == 2
    assert router["spec"]["selector"]["matchLabels"]["serving.atom.dev/role"] == "router"
    labels = router["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "router"
    assert "llm-d.ai/role" not in labels
    engine = container(router)
    assert engine["image"] == "ghcr.io/atom-serving/atom-runtime:0.1.0-rocm"
    assert engine["command"] == ["atom"]
    assert engine["args"] == [
        "router",
        "--host", "0.0.0.0",
        "--port", "8000",
        "--decode-service", "http://qwen3-8b-decode.llm.svc.cluster.local:8000",
        "--prefill-service", "http://qwen3-8b-prefill.llm.svc.cluster.local:8000",
        "--kv-events-port", "5557",
        "--kv-events-replay-port", "5558",
    ]  # fmt: skip
    assert engine["resources"] == {
        "requests": {"cpu": "1", "memory": "1Gi"},
        "limits": {"cpu": "1", "memory": "1Gi"},
    }
    assert engine["securityContext"]["readOnlyRootFilesystem"] is True
    assert engine["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}, KEYS_MOUNT]
    assert router["spec"]["template"]["spec"]["volumes"] == [
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        KEYS_VOLUME,
    ]
    assert "tolerations" not in pod(router)  # the router needs no GPU node
    assert render_router_deployment(atomd()) is None


def test_aggregated_router_is_told_only_the_decode_service():
    """Without a prefill role the router gets --decode-service alone (`atom router` then never
    prefills remotely), with the same KV-event ports as in disaggregated mode."""
    router = render_router_deployment(atomd({"router": {"enabled": True, "replicas": 2}}))
    assert router["metadata"]["name"] == "qwen3-8b-router"
    assert router["spec"]["replicas"] == 2
    assert container(router)["args"] == [
        "router",
        "--host", "0.0.0.0",
        "--port", "8000",
        "--decode-service", "http://qwen3-8b-decode.llm.svc.cluster.local:8000",
        "--kv-events-port", "5557",
        "--kv-events-replay-port", "5558",
    ]  # fmt: skip
    assert pod(router)["serviceAccountName"] == "qwen3-8b-router"
    assert render_router_deployment(atomd({"router": {"enabled": False}})) is None


@pytest.mark.parametrize("mode", [{"prefill": {}}, {"router": {"enabled": True}}],
                         ids=["disaggregated", "aggregated"])  # fmt: skip
@pytest.mark.parametrize(
    ("events", "port", "replay"),
    [({"port": 6000, "replayPort": 6001}, "6000", "6001"),
     ({"enabled": False, "port": 6000, "replayPort": 6001}, "0", "0")],
    ids=["custom-ports", "disabled"],
)  # fmt: skip
def test_router_subscribes_on_the_spec_kv_event_ports(events, port, replay, mode):
    router = render_router_deployment(atomd({**mode, "kvEvents": events}))
    args = container(router)["args"]
    assert (flag(args, "--kv-events-port"), flag(args, "--kv-events-replay-port")) == (
        port, replay
    )  # fmt: skip


def test_router_has_its_own_service_account_allowed_to_watch_endpointslices():
    children = render_children(atomd({"prefill": {}}))
    by_kind = {(c["kind"], c["metadata"]["name"]): c for c in children}
    account = by_kind[("ServiceAccount", "qwen3-8b-router")]
    role = by_kind[("Role", "qwen3-8b-router")]
    binding = by_kind[("RoleBinding", "qwen3-8b-router")]
    for obj in (account, role, binding):
        assert obj["metadata"]["namespace"] == "llm"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == UID
        assert obj["metadata"]["labels"]["serving.atom.dev/deployment"] == "qwen3-8b"
    assert account["automountServiceAccountToken"] is False  # only the router pod opts in
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
         "verbs": ["get", "list", "watch"]},
    ]  # fmt: skip
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "qwen3-8b-router"
    }  # fmt: skip
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "qwen3-8b-router", "namespace": "llm"}
    ]
    router = by_kind[("Deployment", "qwen3-8b-router")]
    assert pod(router)["serviceAccountName"] == "qwen3-8b-router"
    assert pod(router)["automountServiceAccountToken"] is True
    for role_name in ("decode", "prefill"):
        engine = by_kind[("Deployment", f"qwen3-8b-{role_name}")]
        assert pod(engine)["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in pod(engine)
    # Aggregated: no router, no RBAC objects.
    aggregated = {c["kind"] for c in render_children(atomd())}
    assert aggregated.isdisjoint({"ServiceAccount", "Role", "RoleBinding"})


def test_router_image_override():
    router = render_router_deployment(atomd({"prefill": {}, "router": {"image": "r:1"}}))
    assert container(router)["image"] == "r:1"


# --- a locked-down cluster --------------------------------------------------------------------


def test_engine_pods_mount_no_service_account_token():
    for role in ("decode", "prefill"):
        deployment = render_role_deployment(atomd({"prefill": {}}), role)
        assert pod(deployment)["automountServiceAccountToken"] is False


def test_api_key_comes_from_a_secret_through_an_env_var_never_the_pod_spec():
    spec = {"engine": {"apiKeySecretRef": {"name": "keys"}}}
    deployment = render_role_deployment(atomd(spec), "decode")
    args = container(deployment)["args"]
    assert flag(args, "--api-key") == "$(ATOM_API_KEY)"  # expanded by the kubelet
    (var,) = [v for v in container(deployment)["env"] if v["name"] == "ATOM_API_KEY"]
    assert var == {
        "name": "ATOM_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api-key"}},
    }
    assert "--api-key" not in container(render_role_deployment(atomd(), "decode"))["args"]
    mine = {"engine": {"apiKeySecretRef": {"name": "keys"},
                       "env": [{"name": "ATOM_API_KEY", "value": "plain"}]}}  # fmt: skip
    with pytest.raises(SpecError) as caught:
        render_children(atomd(mine))
    assert caught.value.field == "spec.engine.env[0].name"
    assert "set from spec.engine.apiKeySecretRef" in caught.value.message


def test_image_digests_are_accepted_verbatim():
    digest = "registry.local:5000/atom/runtime@sha256:" + "ab" * 32
    tagged = "registry.local/atom/runtime:0.2@sha256:" + "0f" * 32
    spec = {"engine": {"image": digest}, "prefill": {}, "router": {"image": tagged}}
    children = render_children(atomd(spec))
    images = {
        c["metadata"]["name"]: c["spec"]["template"]["spec"]["containers"][0]["image"]
        for c in children
        if c["kind"] == "Deployment"
    }
    assert images == {"qwen3-8b-decode": digest, "qwen3-8b-prefill": digest,
                      "qwen3-8b-router": tagged}  # fmt: skip
    with pytest.raises(SpecError) as caught:
        render_children(atomd({"engine": {"image": "atom@sha256:1234"}}))
    assert caught.value.field == "spec.engine.image"
