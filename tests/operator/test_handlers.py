"""The kopf operator, run in-process against an emulated Kubernetes API (see conftest.py)."""

from __future__ import annotations

import json

import pytest
from conftest import (
    ATOMD,
    DEPLOYMENTS,
    HPAS,
    PDBS,
    ROLEBINDINGS,
    ROLES,
    SERVICEACCOUNTS,
    SERVICES,
    eventually,
)

pytestmark = pytest.mark.asyncio

AGGREGATED = {
    "model": {"name": "SmolLM2-135M-Instruct"},
    "accelerator": {"vendor": "cpu"},
    "decode": {"replicas": 2},
}
HANDLED = "serving.atom.dev/last-handled-configuration"
AGGREGATED_CHILDREN = {
    DEPLOYMENTS: ["chat-decode"],
    SERVICES: ["chat", "chat-decode"],
    PDBS: ["chat-decode"],
    HPAS: [],
}


def children(cluster) -> dict[str, list[str]]:
    return {r: cluster.names(r) for r in (DEPLOYMENTS, SERVICES, PDBS, HPAS)}


def condition(obj: dict, kind: str) -> dict:
    found = [c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind]
    if not found:
        raise LookupError(f"no {kind} condition in {obj.get('status')}")
    return found[0]


async def test_create_makes_every_child_owned_by_the_atomdeployment(cluster, operator_running):
    async with operator_running():
        created = await cluster.create_atomd("chat", AGGREGATED)
        await eventually(lambda: children(cluster) == AGGREGATED_CHILDREN)
        await eventually(lambda: cluster.atomd("chat")["status"]["observedGeneration"] == 1)

    uid = created["metadata"]["uid"]
    for resource, names in AGGREGATED_CHILDREN.items():
        for name in names:
            owners = cluster.get(resource, name)["metadata"]["ownerReferences"]
            assert owners == [
                {
                    "apiVersion": "serving.atom.dev/v1alpha1",
                    "kind": "AtomDeployment",
                    "name": "chat",
                    "uid": uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
    assert cluster.get(DEPLOYMENTS, "chat-decode")["spec"]["replicas"] == 2
    assert cluster.get(ATOMD, "chat")["status"]["endpoint"] == (
        "http://chat.ns1.svc.cluster.local:8000/v1"
    )


async def _created(cluster, name: str = "chat", spec: dict | None = None) -> dict:
    """Create an AtomDeployment and wait until the operator has applied generation 1 and kopf
    has finished the creation cycle (it records the handled spec in an annotation)."""
    created = await cluster.create_atomd(name, spec or AGGREGATED)
    await eventually(lambda: cluster.atomd(name)["status"]["observedGeneration"] == 1)
    await eventually(lambda: HANDLED in cluster.atomd(name)["metadata"]["annotations"])
    return created


def versions(cluster) -> dict[tuple[str, str], int]:
    return {
        (resource, name): cluster.versions(resource, name)
        for resource, names in children(cluster).items()
        for name in names
    }


async def test_create_posts_an_applied_event(cluster, operator_running):
    async with operator_running():
        await _created(cluster)
        await eventually(lambda: any(e[1] == "Applied" for e in cluster.events()))
    applied = [e for e in cluster.events() if e[1] == "Applied"]
    assert applied == [
        (
            "Normal",
            "Applied",
            "Secret/chat-atom-keys created, "
            "Deployment/chat-decode created, Service/chat-decode created, "
            "PodDisruptionBudget/chat-decode created, NetworkPolicy/chat created, "
            "Service/chat created",
        )
    ]


async def test_replica_change_patches_only_that_deployments_replicas(cluster, operator_running):
    async with operator_running():
        await _created(cluster)
        before = versions(cluster)
        writes_before = len(cluster.writes())
        await cluster.patch_atomd("chat", {"spec": {"decode": {"replicas": 3}}})
        await eventually(lambda: cluster.atomd("chat")["status"]["observedGeneration"] == 2)

    new_writes = cluster.writes()[writes_before:]
    assert [(w.method.value, w.url.path, json.loads(w.body)) for w in new_writes] == [
        ("PATCH", "/apis/apps/v1/namespaces/ns1/deployments/chat-decode", {"spec": {"replicas": 3}})
    ]
    assert cluster.get(DEPLOYMENTS, "chat-decode")["spec"]["replicas"] == 3
    after = versions(cluster)
    assert after[(DEPLOYMENTS, "chat-decode")] == before[(DEPLOYMENTS, "chat-decode")] + 1
    del after[(DEPLOYMENTS, "chat-decode")], before[(DEPLOYMENTS, "chat-decode")]
    assert after == before


async def test_engine_args_change_patches_the_pod_template_and_nothing_else(
    cluster, operator_running
):
    async with operator_running():
        await _created(cluster)
        before = versions(cluster)
        await cluster.patch_atomd("chat", {"spec": {"engine": {"args": ["--max-num-seqs", "8"]}}})
        await eventually(lambda: cluster.atomd("chat")["status"]["observedGeneration"] == 2)

    container = cluster.get(DEPLOYMENTS, "chat-decode")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-2:] == ["--max-num-seqs", "8"]
    after = versions(cluster)
    assert after[(DEPLOYMENTS, "chat-decode")] == before[(DEPLOYMENTS, "chat-decode")] + 1
    del after[(DEPLOYMENTS, "chat-decode")], before[(DEPLOYMENTS, "chat-decode")]
    assert after == before
    patches = [json.loads(w.body) for w in cluster.writes() if w.method.value == "PATCH"]
    assert len(patches) == 1
    assert list(patches[0]) == ["spec"]
    assert list(patches[0]["spec"]) == ["template"]


async def test_child_status_folds_into_phase_conditions_and_counts(cluster, operator_running):
    rolling = {"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"}
    complete = {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}
    async with operator_running():
        await _created(cluster)
        await eventually(lambda: cluster.atomd("chat")["status"]["phase"] == "Progressing")

        await cluster.set_deployment_status(
            "chat-decode",
            {"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 1,
             "conditions": [rolling]},
        )  # fmt: skip
        await eventually(
            lambda: condition(cluster.atomd("chat"), "DecodeReady")["reason"] == "PodsStarting"
        )
        status = cluster.atomd("chat")["status"]
        assert status["phase"] == "Progressing"
        assert condition(status_obj := cluster.atomd("chat"), "Ready")["status"] == "False"
        spec_valid_since = condition(status_obj, "SpecValid")["lastTransitionTime"]
        decode_false_since = condition(status_obj, "DecodeReady")["lastTransitionTime"]

        await cluster.set_deployment_status(
            "chat-decode", {"readyReplicas": 2, "availableReplicas": 2, "conditions": [complete]}
        )
        await eventually(lambda: cluster.atomd("chat")["status"]["phase"] == "Ready")
        ready = cluster.atomd("chat")
        assert ready["status"]["roles"] == {
            "decode": {
                "replicas": 2,
                "readyReplicas": 2,
                "updatedReplicas": 2,
                "desiredReplicas": 2,
                "selector": "serving.atom.dev/deployment=chat,serving.atom.dev/role=decode",
                "ready": "2/2",
            }
        }
        assert condition(ready, "Ready")["status"] == "True"
        assert condition(ready, "DecodeReady")["reason"] == "AllPodsReady"
        assert condition(ready, "KVEventsWired")["status"] == "True"
        assert condition(ready, "SpecValid")["lastTransitionTime"] == spec_valid_since

        await cluster.set_deployment_status("chat-decode", {"readyReplicas": 1})
        await eventually(lambda: cluster.atomd("chat")["status"]["phase"] == "Degraded")
        degraded = cluster.atomd("chat")
        assert condition(degraded, "DecodeReady")["reason"] == "PodsNotReady"
        assert condition(degraded, "Ready")["status"] == "False"
        assert decode_false_since <= condition(degraded, "DecodeReady")["lastTransitionTime"]


async def test_restart_writes_no_child_twice(cluster, operator_running):
    async with operator_running():
        await _created(cluster)
        writes = len(cluster.writes())
        names = children(cluster)

    def reads_of_user_service() -> int:
        path = "/api/v1/namespaces/ns1/services/chat"
        return sum(1 for r in cluster.api if r.method.value == "GET" and r.url.path == path)

    reads = reads_of_user_service()
    async with operator_running():
        # The resume handler re-renders and GETs every child; the user-facing Service is last.
        await eventually(lambda: reads_of_user_service() > reads)
    assert children(cluster) == names
    assert len(cluster.writes()) == writes


async def test_invalid_spec_sets_spec_valid_false_and_creates_nothing(cluster, operator_running):
    spec = {**AGGREGATED, "decode": {"replicas": -1}}
    async with operator_running():
        await cluster.create_atomd("chat", spec)
        await eventually(lambda: condition(cluster.atomd("chat"), "SpecValid")["status"] == "False")
        await eventually(lambda: any(e[1] == "InvalidSpec" for e in cluster.events()))
    obj = cluster.atomd("chat")
    spec_valid = condition(obj, "SpecValid")
    assert spec_valid["reason"] == "InvalidSpec"
    assert spec_valid["message"] == "spec.decode.replicas: must be >= 0, got -1"
    assert spec_valid["observedGeneration"] == 1
    assert obj["status"]["observedGeneration"] == 1
    assert obj["status"]["phase"] == "Failed"
    assert condition(obj, "Ready")["reason"] == "SpecInvalid"
    assert cluster.writes() == []
    assert children(cluster) == {DEPLOYMENTS: [], SERVICES: [], PDBS: [], HPAS: []}
    warning = [e for e in cluster.events() if e[1] == "InvalidSpec"]
    assert warning[0] == (
        "Warning",
        "InvalidSpec",
        "nothing applied: spec.decode.replicas: must be >= 0, got -1",
    )


async def test_invalid_update_leaves_children_alone_until_fixed(cluster, operator_running):
    async with operator_running():
        await _created(cluster)
        before = versions(cluster)
        await cluster.patch_atomd(
            "chat", {"spec": {"engine": {"args": ["--x"]}, "kvEvents": {"port": 8000}}}
        )
        await eventually(lambda: condition(cluster.atomd("chat"), "SpecValid")["status"] == "False")
        assert versions(cluster) == before
        assert cluster.atomd("chat")["status"]["observedGeneration"] == 2
        assert cluster.atomd("chat")["status"]["phase"] == "Failed"

        await cluster.patch_atomd("chat", {"spec": {"kvEvents": {"port": 5557}}})
        await eventually(lambda: condition(cluster.atomd("chat"), "SpecValid")["status"] == "True")
        await eventually(lambda: cluster.atomd("chat")["status"]["observedGeneration"] == 3)
    args = cluster.get(DEPLOYMENTS, "chat-decode")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert args[-1] == "--x"


# ModelReady joins on the pass that has read the engine pods: wait for the list, never read once.
AGGREGATED_CONDITIONS = ["SpecValid", "ModelReady", "DecodeReady", "KVEventsWired", "Ready"]


def _condition_types(cluster) -> list[str]:
    return [c["type"] for c in cluster.atomd("chat")["status"].get("conditions", [])]


async def test_removing_prefill_deletes_the_disaggregated_children(cluster, operator_running):
    spec = {**AGGREGATED, "prefill": {"replicas": 1}}
    async with operator_running():
        await _created(cluster, spec=spec)
        assert children(cluster) == {
            DEPLOYMENTS: ["chat-decode", "chat-prefill", "chat-router"],
            SERVICES: ["chat", "chat-decode", "chat-prefill"],
            PDBS: ["chat-decode", "chat-prefill"],
            HPAS: [],
        }
        # The router's own ServiceAccount, Role and RoleBinding, owned like every child.
        rbac = (SERVICEACCOUNTS, ROLES, ROLEBINDINGS)
        assert [cluster.names(r) for r in rbac] == [["chat-router"]] * 3
        uid = cluster.atomd("chat")["metadata"]["uid"]
        for resource in rbac:
            obj = cluster.get(resource, "chat-router")
            assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        router = cluster.get(DEPLOYMENTS, "chat-router")
        assert router["spec"]["template"]["spec"]["serviceAccountName"] == "chat-router"
        await cluster.patch_atomd("chat", {"spec": {"prefill": None}})
        await eventually(lambda: children(cluster) == AGGREGATED_CHILDREN)
        await eventually(lambda: [cluster.names(r) for r in rbac] == [[], [], []])
        await eventually(lambda: cluster.atomd("chat")["status"]["observedGeneration"] == 2)
        await eventually(lambda: _condition_types(cluster) == AGGREGATED_CONDITIONS)
        status = cluster.atomd("chat")["status"]
    assert set(status["roles"]) == {"decode"}


ROUTED = {**AGGREGATED, "router": {"enabled": True}}


async def test_router_opt_in_renders_the_router_and_opt_out_prunes_it(cluster, operator_running):
    """An aggregated AtomDeployment with router.enabled gets the router, its RBAC and a Service
    pointing at it; turning the router off deletes them and points the Service at decode."""
    rbac = (SERVICEACCOUNTS, ROLES, ROLEBINDINGS)
    async with operator_running():
        await _created(cluster, spec=ROUTED)
        assert children(cluster) == {
            DEPLOYMENTS: ["chat-decode", "chat-router"],
            SERVICES: ["chat", "chat-decode"],
            PDBS: ["chat-decode"],
            HPAS: [],
        }
        assert [cluster.names(r) for r in rbac] == [["chat-router"]] * 3
        router = cluster.get(DEPLOYMENTS, "chat-router")["spec"]["template"]["spec"]
        assert router["serviceAccountName"] == "chat-router"
        assert router["containers"][0]["args"] == [
            "router", "--host", "0.0.0.0", "--port", "8000",
            "--decode-service", "http://chat-decode.ns1.svc.cluster.local:8000",
            "--kv-events-port", "5557", "--kv-events-replay-port", "5558",
        ]  # fmt: skip
        assert cluster.get(SERVICES, "chat")["spec"]["selector"] == {
            "serving.atom.dev/deployment": "chat", "serving.atom.dev/role": "router"
        }  # fmt: skip
        assert cluster.get(SERVICES, "chat-decode")["spec"]["clusterIP"] == "None"
        # ModelReady joins once the operator has read the engine pods, a pass after creation.
        await eventually(
            lambda: (
                [c["type"] for c in cluster.atomd("chat")["status"]["conditions"]]
                == [
                    "SpecValid",
                    "ModelReady",
                    "DecodeReady",
                    "RouterReady",
                    "KVEventsWired",
                    "Ready",
                ]
            )
        )
        assert condition(cluster.atomd("chat"), "RouterReady")["reason"] == "RollingOut"

        await cluster.patch_atomd("chat", {"spec": {"router": {"enabled": False}}})
        await eventually(lambda: children(cluster) == AGGREGATED_CHILDREN)
        await eventually(lambda: [cluster.names(r) for r in rbac] == [[], [], []])
        await eventually(lambda: cluster.atomd("chat")["status"]["observedGeneration"] == 2)
        await eventually(lambda: _condition_types(cluster) == AGGREGATED_CONDITIONS)
        status = cluster.atomd("chat")["status"]
    assert cluster.get(SERVICES, "chat")["spec"]["selector"]["serving.atom.dev/role"] == "decode"
    assert set(status["roles"]) == {"decode"}
    assert not any(e[1] == "RouterWithoutKVEvents" for e in cluster.events())


async def test_router_off_with_a_prefill_role_is_refused(cluster, operator_running):
    spec = {**AGGREGATED, "prefill": {"replicas": 1}, "router": {"enabled": False}}
    async with operator_running():
        await cluster.create_atomd("chat", spec)
        await eventually(lambda: condition(cluster.atomd("chat"), "SpecValid")["status"] == "False")
    assert condition(cluster.atomd("chat"), "SpecValid")["message"] == (
        "spec.router.enabled: cannot be false with a prefill role: the router is what sends "
        "prompts to the prefill pods and their KV to the decode pods"
    )
    assert cluster.writes() == []


async def test_router_without_kv_events_is_applied_with_a_warning(cluster, operator_running):
    """The router on and KV events off is valid (load-aware routing, a queue for decode at
    zero) but not cache-aware: applied, KVEventsWired=False/Disabled, and a Warning event."""
    spec = {**ROUTED, "kvEvents": {"enabled": False}}
    async with operator_running():
        await _created(cluster, spec=spec)
        await eventually(lambda: any(e[1] == "RouterWithoutKVEvents" for e in cluster.events()))
        obj = cluster.atomd("chat")
    (warning,) = [e for e in cluster.events() if e[1] == "RouterWithoutKVEvents"]
    assert warning[0] == "Warning"
    assert warning[2].startswith("spec.kvEvents.enabled is false: the router subscribes to no KV")
    assert condition(obj, "KVEventsWired")["reason"] == "Disabled"
    args = cluster.get(DEPLOYMENTS, "chat-router")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert args[-4:] == ["--kv-events-port", "0", "--kv-events-replay-port", "0"]
