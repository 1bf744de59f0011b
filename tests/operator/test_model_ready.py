"""ModelReady: read from the engine pods of the current model source (pure, then with the real
operator against the emulated API, which also creates the model-cache claim exactly once)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import DEPLOYMENTS, NAMESPACE, PVCS, eventually
from test_handlers import AGGREGATED, condition

from atom_operator.model_readiness import ModelPod, model_ready, summarize_pod
from atom_operator.model_source import ModelSource, model_source
from atom_operator.render.model_volume import source_digest
from atom_operator.status import fold_status

DIGEST = "abc123"
HUB = ModelSource("huggingface", repo_id="deepseek-ai/DeepSeek-R1")


def pod(
    name: str = "r1-decode-1",
    role: str = "decode",
    source: str = DIGEST,
    init: dict | None = None,
    engine: dict | None = None,
    ready: bool = False,
) -> dict:
    status: dict[str, Any] = {"phase": "Pending",
                              "conditions": [{"type": "Ready", "status": str(ready)}]}  # fmt: skip
    if init is not None:
        status["initContainerStatuses"] = [{"name": "model-download", **init}]
    if engine is not None:
        status["containerStatuses"] = [{"name": "engine", **engine}]
    return {
        "metadata": {
            "name": name,
            "labels": {"serving.atom.dev/deployment": "r1", "serving.atom.dev/role": role},
            "annotations": {"serving.atom.dev/model-source": source},
        },
        "status": status,
    }


RUNNING = {"state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}
DONE = {"state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
CRASHED = {"state": {"waiting": {"reason": "CrashLoopBackOff"}},
           "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}  # fmt: skip
CREATING = {"state": {"waiting": {"reason": "ContainerCreating"}}}


def verdict(source: ModelSource, *pods: dict) -> tuple[bool, str, str]:
    return model_ready(source, DIGEST, [p for p in map(summarize_pod, pods) if p])


def test_router_and_deleted_pods_do_not_count():
    assert summarize_pod(pod(role="router")) is None
    gone = pod()
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert summarize_pod(gone) is None


@pytest.mark.parametrize(
    ("pods", "ready", "reason"),
    [
        ((), False, "NoPods"),
        ((pod(init={"state": {"waiting": {"reason": "PodInitializing"}}}),), False, "Pending"),
        ((pod(init=RUNNING, engine=CREATING),), False, "Downloading"),
        ((pod(init=CRASHED, engine=CREATING),), False, "DownloadFailed"),
        ((pod(init=DONE, engine=RUNNING),), True, "Downloaded"),
        # Another pod of the same source has its model: the verdict is True.
        ((pod(init=RUNNING), pod("r1-decode-2", init=DONE, engine=RUNNING)), True, "Downloaded"),
        # A pod of the previous source does not speak for this one.
        ((pod(source="old", init=DONE, engine=RUNNING),), False, "NoPods"),
    ],
    ids=["none", "init-waiting", "downloading", "failed", "downloaded", "one-of-two", "old"],
)
def test_huggingface_verdicts(pods, ready, reason):
    assert verdict(HUB, *pods)[:2] == (ready, reason)


def test_messages_point_at_the_download_log():
    _, _, message = verdict(HUB, pod(init=CRASHED))
    assert message == ("r1-decode-1: exit code 1, CrashLoopBackOff; "
                       "kubectl logs r1-decode-1 -c model-download")  # fmt: skip
    _, _, message = verdict(HUB, pod(init=RUNNING))
    assert "downloading deepseek-ai/DeepSeek-R1" in message


def test_mounted_and_engine_downloaded_sources():
    pvc, hf = ModelSource("pvc", claim="m"), ModelSource("hf", repo_id="Qwen/Qwen3-8B")
    assert verdict(pvc, pod(engine=CREATING))[:2] == (False, "Pending")
    assert verdict(pvc, pod(engine=RUNNING))[:2] == (True, "Mounted")
    assert verdict(ModelSource("default"), pod(engine=RUNNING))[:2] == (True, "InImage")
    # uri hf://: the engine downloads at start, so only a Ready pod has the model.
    assert verdict(hf, pod(engine=RUNNING))[:2] == (False, "Loading")
    assert verdict(hf, pod(engine=RUNNING, ready=True))[:2] == (True, "Loaded")
    restarted = {"state": {"waiting": {"reason": "CrashLoopBackOff"}},
                 "lastState": {"terminated": {"exitCode": 137}}}  # fmt: skip
    assert verdict(pvc, pod(engine=restarted))[:2] == (True, "Mounted")  # it did start


def _body(status: dict | None = None) -> dict:
    return {
        "metadata": {"name": "r1", "namespace": "llm", "uid": "u", "generation": 1},
        "spec": {"accelerator": {"vendor": "cpu"},
                 "model": {"source": {"huggingface": {"repo": "a/b", "size": "1Gi"}}}},
        "status": status or {},
    }  # fmt: skip


def _fold(body: dict, pods: list[ModelPod] | None) -> dict:
    return fold_status(body, [], applied_generation=1, endpoint=None, now="t", pods=pods)


def test_fold_status_reports_model_ready_and_a_failed_download_degrades():
    body = _body()
    digest = source_digest(model_source(body["spec"]["model"]))
    failed = summarize_pod(pod(source=digest, init=CRASHED))
    status = _fold(body, [failed])
    types = [c["type"] for c in status["conditions"]]
    assert types[:2] == ["SpecValid", "ModelReady"]
    model = status["conditions"][1]
    assert (model["status"], model["reason"]) == ("False", "DownloadFailed")
    assert status["phase"] == "Degraded"
    # Pods not known this time (the API did not answer, or a change handler's write): the last
    # verdict stands, unchanged.
    kept = _fold(_body(status), None)
    assert kept["conditions"][1] == model
    # No earlier verdict and no pods known: no ModelReady yet.
    assert "ModelReady" not in [c["type"] for c in _fold(_body(), None)["conditions"]]


async def _add_engine_pod(cluster, name: str, annotations: dict, status: dict) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations,
                     "labels": {"serving.atom.dev/deployment": "chat",
                                "serving.atom.dev/role": "decode"}},
        "spec": {"containers": [{"name": "engine"}]},
    }  # fmt: skip
    await cluster.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", body)
    await set_pod_status(cluster, name, status)


async def set_pod_status(cluster, name: str, status: dict) -> None:
    path = f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/status"
    await cluster.request("PATCH", path, {"status": status})


@pytest.mark.asyncio
async def test_operator_creates_the_claim_once_and_follows_the_download(cluster, operator_running):
    hub = {"repo": "Qwen/Qwen3-0.6B", "size": "20Gi"}
    spec = {**AGGREGATED, "model": {"source": {"huggingface": hub}}}
    async with operator_running():
        await cluster.create_atomd("chat", spec)
        await eventually(lambda: cluster.get(DEPLOYMENTS, "chat-decode"))
        claim = cluster.get(PVCS, "chat-model-cache")
        assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
        template = cluster.get(DEPLOYMENTS, "chat-decode")["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        assert template["spec"]["initContainers"][0]["name"] == "model-download"
        await eventually(lambda: condition(cluster.atomd("chat"), "ModelReady")["reason"]
                         == "NoPods")  # fmt: skip

        await _add_engine_pod(cluster, "chat-decode-1", annotations, {
            "phase": "Pending",
            "initContainerStatuses": [{"name": "model-download", **RUNNING}]})  # fmt: skip
        await eventually(lambda: condition(cluster.atomd("chat"), "ModelReady")["reason"]
                         == "Downloading")  # fmt: skip
        await set_pod_status(cluster, "chat-decode-1", {
            "phase": "Running",
            "initContainerStatuses": [{"name": "model-download", **DONE}],
            "containerStatuses": [{"name": "engine", **RUNNING}]})  # fmt: skip
        await eventually(lambda: condition(cluster.atomd("chat"), "ModelReady")["status"]
                         == "True")  # fmt: skip
        assert condition(cluster.atomd("chat"), "ModelReady")["reason"] == "Downloaded"

        # A later edit reconciles again: the claim is not re-specified or re-created.
        await cluster.patch_atomd("chat", {"spec": {"engine": {"blockSize": 32}}})
        await eventually(lambda: cluster.atomd("chat")["status"]["observedGeneration"] == 2)
    assert cluster.versions(PVCS, "chat-model-cache") == 1
