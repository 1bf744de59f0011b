"""The ModelReady condition: whether the engine pods have their model, from the pods themselves.

The operator lists the AtomDeployment's engine pods (label selector, on each status pass) and
keeps, per pod, what `summarize_pod` reads from its status: the download step's state (a
Hugging Face source), whether the engine container has started (it starts only once every
volume, the model's included, is mounted and every init container has succeeded) and whether
the pod is Ready. Only pods whose template carries the current source's digest count, so pods
of a previous source never speak for the new one.

- a mounted source (pvc, image, huggingface) and a model inside the image (file, the bundled
  default): True as soon as one engine pod's engine container has started (reasons Mounted,
  Downloaded, InImage);
- uri hf:// (the engine downloads the model itself): True once one engine pod is Ready (reason
  Loaded); before that Loading;
- False otherwise: Downloading (the download step runs), DownloadFailed (it exited non-zero;
  the phase is then Degraded), Pending (the pod waits for its volumes, image or node),
  NoPods (no engine pod of this source exists, e.g. scaled to zero).

ModelReady does not enter Ready: DecodeReady and PrefillReady already require a loaded model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from atom_operator.model_source import ModelSource
from atom_operator.render.model_volume import DOWNLOAD_CONTAINER, SOURCE_ANNOTATION
from atom_operator.render.names import ENGINE_CONTAINER, ROLE_LABEL
from atom_operator.spec import ROLES

MOUNTED_REASONS = {"pvc": "Mounted", "image": "Mounted", "huggingface": "Downloaded",
                   "file": "InImage", "default": "InImage"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelPod:
    """What ModelReady needs to know about one engine pod."""

    name: str
    source: str  # the template's SOURCE_ANNOTATION
    download: str = ""  # "", "waiting", "running", "done", "failed"
    download_detail: str = ""  # why it failed, or what it waits for
    engine_started: bool = False
    ready: bool = False
    waiting: str = ""  # the engine container's waiting reason (ContainerCreating, ...)


def _named(statuses: Iterable[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    return next((s for s in statuses or [] if s.get("name") == name), {})


def _download_state(status: Mapping[str, Any]) -> tuple[str, str]:
    if not status:
        return "", ""
    state, last = status.get("state") or {}, status.get("lastState") or {}
    if "running" in state:
        return "running", ""
    done = state.get("terminated")
    if done is not None:
        code = done.get("exitCode", 0)
        return ("done", "") if code == 0 else ("failed", f"exit code {code} ({done.get('reason')})")
    failed = last.get("terminated")
    if failed is not None and failed.get("exitCode", 0) != 0:  # waiting to be retried
        waiting = (state.get("waiting") or {}).get("reason", "waiting to retry")
        return "failed", f"exit code {failed['exitCode']}, {waiting}"
    return "waiting", (state.get("waiting") or {}).get("reason", "")


def summarize_pod(pod: Mapping[str, Any]) -> ModelPod | None:
    """The ModelPod of a live engine pod; None for other pods (the router's) or a deleted one."""
    meta = pod.get("metadata") or {}
    if (meta.get("labels") or {}).get(ROLE_LABEL) not in ROLES or meta.get("deletionTimestamp"):
        return None
    status = pod.get("status") or {}
    download, detail = _download_state(
        _named(status.get("initContainerStatuses"), DOWNLOAD_CONTAINER)
    )
    engine = _named(status.get("containerStatuses"), ENGINE_CONTAINER)
    state, last = engine.get("state") or {}, engine.get("lastState") or {}
    return ModelPod(
        name=meta.get("name", ""),
        source=(meta.get("annotations") or {}).get(SOURCE_ANNOTATION, ""),
        download=download,
        download_detail=detail,
        engine_started="running" in state or "terminated" in state or "terminated" in last,
        ready=any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        ),  # fmt: skip
        waiting=(state.get("waiting") or {}).get("reason", "") or status.get("phase", ""),
    )


def model_ready(
    source: ModelSource, digest: str, pods: Iterable[ModelPod]
) -> tuple[bool, str, str]:
    """(status, reason, message) of ModelReady for the source whose digest is `digest`."""
    current = [pod for pod in pods if pod.source == digest]
    if not current:
        return False, "NoPods", "no engine pod of the current model source exists"
    if source.scheme == "hf":
        loaded = [pod for pod in current if pod.ready]
        if loaded:
            return True, "Loaded", f"{loaded[0].name} loaded {source.repo_id}"
        started = [pod for pod in current if pod.engine_started]
        if started:
            return False, "Loading", f"{started[0].name} is downloading and loading the model"
    else:
        started = [pod for pod in current if pod.engine_started]
        if started:
            return True, MOUNTED_REASONS[source.scheme], f"{started[0].name} has the model"
    logs = "kubectl logs {} -c " + DOWNLOAD_CONTAINER
    failed = [pod for pod in current if pod.download == "failed"]
    if failed:
        pod = failed[0]
        return (
            False,
            "DownloadFailed",
            f"{pod.name}: {pod.download_detail}; {logs.format(pod.name)}",
        )
    running = [pod for pod in current if pod.download == "running"]
    if running:
        pod = running[0]
        message = f"{pod.name} is downloading {source.repo_id} (progress: {logs.format(pod.name)})"
        return False, "Downloading", message
    pod = current[0]
    return False, "Pending", f"{pod.name}: {pod.download_detail or pod.waiting or 'pending'}"
