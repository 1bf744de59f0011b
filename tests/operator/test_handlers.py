"""The kopf operator, run in-process against an emulated Kubernetes API (see conftest.py)."""

from __future__ import annotations

import pytest
from conftest import ATOMD, DEPLOYMENTS, HPAS, PDBS, SERVICES, eventually

pytestmark = pytest.mark.asyncio

AGGREGATED = {
    "model": {"name": "SmolLM2-135M-Instruct"},
    "accelerator": {"vendor": "cpu"},
    "decode": {"replicas": 2},
}
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
