"""The trust-boundary rules with the real kopf operator against the emulated API: a refused env
reference applies nothing, the operator's configuration comes from its environment, and the
keys Secret is made once and never rewritten."""

from __future__ import annotations

import base64

import pytest
from conftest import DEPLOYMENTS, SECRETS, eventually
from test_handlers import AGGREGATED, condition

pytestmark = pytest.mark.asyncio

STOLEN_REF = {"secretKeyRef": {"name": "db-password", "key": "password"}}
WITH_REF = {**AGGREGATED, "engine": {"env": [{"name": "T", "valueFrom": STOLEN_REF}]}}


async def test_a_secret_the_operator_does_not_allow_applies_nothing(cluster, operator_running):
    async with operator_running():
        await cluster.create_atomd("chat", WITH_REF)
        await eventually(lambda: condition(cluster.atomd("chat"), "SpecValid")["status"] == "False")
    message = condition(cluster.atomd("chat"), "SpecValid")["message"]
    assert message.startswith(
        "spec.engine.env[0].valueFrom.secretKeyRef.name: Secret 'db-password' is not one the "
        "operator lets an AtomDeployment read (allowed: none)"
    )
    assert cluster.writes() == []
    assert cluster.names(DEPLOYMENTS) == [] and cluster.names(SECRETS) == []


async def test_the_operator_allows_the_secrets_its_environment_lists(
    cluster, operator_running, monkeypatch
):
    monkeypatch.setenv("ATOM_OPERATOR_ENV_SECRETS", "db-password")
    async with operator_running():
        await cluster.create_atomd("chat", WITH_REF)
        await eventually(lambda: cluster.get(DEPLOYMENTS, "chat-decode"))
        await eventually(lambda: condition(cluster.atomd("chat"), "SpecValid")["status"] == "True")
    (engine,) = cluster.get(DEPLOYMENTS, "chat-decode")["spec"]["template"]["spec"]["containers"]
    assert {"name": "T", "valueFrom": STOLEN_REF} in engine["env"]


async def test_the_keys_secret_is_created_once_and_never_rewritten(cluster, operator_running):
    async with operator_running():
        created = await cluster.create_atomd("chat", AGGREGATED)
        await eventually(lambda: cluster.get(SECRETS, "chat-atom-keys"))
        first = cluster.get(SECRETS, "chat-atom-keys")
        # An edit reconciles everything again, with freshly generated keys in the plan.
        await cluster.patch_atomd("chat", {"spec": {"engine": {"blockSize": 32}}})
        await eventually(lambda: cluster.atomd("chat")["status"]["observedGeneration"] == 2)
    # ... and a restart resumes (one more reconcile).
    async with operator_running():
        await eventually(lambda: cluster.atomd("chat")["status"]["observedGeneration"] == 2)
    secret = cluster.get(SECRETS, "chat-atom-keys")
    assert secret["data"] == first["data"]
    assert cluster.versions(SECRETS, "chat-atom-keys") == 1
    assert secret["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    assert len(base64.b64decode(secret["data"]["transfer-key"])) == 64
    # The operator never read a Secret: it has no `get` on them (chart RBAC: create only).
    reads = [r for r in cluster.api if r.method.value == "GET" and r.url.path.endswith("/secrets")
             or (r.method.value == "GET" and "/secrets/" in r.url.path)]  # fmt: skip
    assert reads == []
