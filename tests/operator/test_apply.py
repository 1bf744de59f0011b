"""Create-or-patch: the pure diff, and KubeAPI against the emulated API server."""

from __future__ import annotations

import json

import pytest
from conftest import DEPLOYMENTS, Cluster

from atom_operator import apply

UID = "uid-1"


def child(replicas=1, image="img:1", owner=UID):
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "chat-decode",
            "namespace": "ns1",
            "labels": {"serving.atom.dev/deployment": "chat"},
            "ownerReferences": [{"uid": owner, "controller": True, "name": "chat"}],
        },
        "spec": {
            "replicas": replicas,
            "template": {"spec": {"containers": [{"name": "engine", "image": image}]}},
        },
    }


def test_merge_patch_is_empty_when_live_contains_the_render():
    live = child()
    live["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresent"
    live["status"] = {"replicas": 1}
    assert apply.merge_patch(live, child()) == {}


def test_merge_patch_names_only_changed_fields_and_replaces_lists_whole():
    assert apply.merge_patch(child(), child(replicas=3)) == {"spec": {"replicas": 3}}
    assert apply.merge_patch(child(), child(image="img:2")) == {
        "spec": {"template": {"spec": {"containers": [{"name": "engine", "image": "img:2"}]}}}
    }


def test_resource_path():
    assert apply.resource_path(child()) == "/apis/apps/v1/namespaces/ns1/deployments/chat-decode"
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "n"}}
    assert apply.resource_path(service, named=False) == "/api/v1/namespaces/n/services"
    with pytest.raises(ValueError, match="no API path known for v1 ConfigMap"):
        apply.resource_path({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {}})


@pytest.mark.asyncio
async def test_apply_creates_then_patches_then_leaves_alone(cluster: Cluster):
    api = apply.KubeAPI(cluster.url, {})
    try:
        assert [a.action for a in await apply.apply_children(api, [child()], UID)] == ["created"]
        assert [a.action for a in await apply.apply_children(api, [child()], UID)] == ["unchanged"]
        patched = await apply.apply_child(api, child(replicas=2), UID)
        assert (patched.action, patched.patch) == ("patched", {"spec": {"replicas": 2}})
        assert cluster.versions(DEPLOYMENTS, "chat-decode") == 2
        last = [w for w in cluster.writes() if w.method.value == "PATCH"][-1]
        assert json.loads(last.body) == {"spec": {"replicas": 2}}
        assert last.params == {"fieldManager": "atom-operator"}
        assert last.headers["Content-Type"] == "application/merge-patch+json"

        scaled = await apply.scale_deployment(api, child(replicas=5, image="ignored"), UID)
        assert (scaled.action, scaled.patch) == ("patched", {"spec": {"replicas": 5}})
        assert (
            cluster.get(DEPLOYMENTS, "chat-decode")["spec"]["template"]["spec"]["containers"][0][
                "image"
            ]
            == "img:1"
        )
        gone = dict(child(), metadata={**child()["metadata"], "name": "nope"})
        assert await apply.scale_deployment(api, gone, UID) is None
    finally:
        await api.close()


@pytest.mark.asyncio
async def test_apply_refuses_an_object_controlled_by_someone_else(cluster: Cluster):
    api = apply.KubeAPI(cluster.url, {})
    try:
        await apply.apply_child(api, child(owner="other"), "other")
        with pytest.raises(apply.OwnershipError, match="not controlled by this AtomDeployment"):
            await apply.apply_child(api, child(), UID)
    finally:
        await api.close()


@pytest.mark.asyncio
async def test_duplicate_create_is_a_conflict_error(cluster: Cluster):
    api = apply.KubeAPI(cluster.url, {})
    try:
        await api.create(child())
        with pytest.raises(apply.ApiError) as caught:
            await api.create(child())
        assert caught.value.status == 409 and caught.value.is_conflict
        assert await api.get("/apis/apps/v1/namespaces/ns1/deployments/absent") is None
    finally:
        await api.close()


@pytest.mark.asyncio
async def test_prune_deletes_only_owned_children_that_are_no_longer_rendered(cluster: Cluster):
    api = apply.KubeAPI(cluster.url, {})
    stale = dict(child(), metadata={**child()["metadata"], "name": "chat-prefill"})
    foreign = dict(child(owner="other"), metadata={**child(owner="other")["metadata"], "name": "x"})
    try:
        for obj in (child(), stale, foreign):
            await api.create(obj)
        deleted = await apply.prune_children(
            api, [child()], namespace="ns1", selector="serving.atom.dev/deployment=chat", uid=UID
        )
        assert [(d.kind, d.name, d.action) for d in deleted] == [
            ("Deployment", "chat-prefill", "deleted")
        ]
        assert cluster.names(DEPLOYMENTS) == ["chat-decode", "x"]
    finally:
        await api.close()
