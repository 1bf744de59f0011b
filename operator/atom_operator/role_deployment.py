"""What status needs to know about each child Deployment (`RoleDeployment`, kept in the kopf
index by `summarize_deployment`) and one role's verdict from it (`role_state`).

A role is ready when its Deployment exists, is owned by this AtomDeployment, its controller
has observed the Deployment's generation, no pods of an older template remain, and
updatedReplicas, readyReplicas >= the desired replicas (spec.replicas of the Deployment, which
an HPA may own) >= 1. Its condition's reason says where it stands: DeploymentMissing,
RolloutFailed, ScaledToZero, RollingOut (old pods or an unobserved generation), PodsStarting
(updated pods still becoming ready), PodsNotReady (the controller finished the rollout, yet
pods are not ready: crashed or failing probes), AllPodsReady.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from atom_operator.render.names import ENGINE_CONTAINER, ROLE_LABEL, ROUTER


@dataclasses.dataclass(frozen=True)
class RoleDeployment:
    """What the status needs to know about one child Deployment (kept in the kopf index)."""

    name: str
    role: str
    owner_uid: str | None
    generation: int
    desired: int
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    observed_generation: int = 0
    selector: str = ""
    failure: str = ""  # a controller-reported failure, "" when there is none
    rollout_complete: bool = False  # the controller says the newest ReplicaSet is available
    args: tuple[str, ...] = ()  # the engine container's command and args
    env: tuple[str, ...] = ()  # names of the engine container's environment variables


def label_selector(match_labels: Mapping[str, str]) -> str:
    """`k1=v1,k2=v2` (sorted), the string form HPAs and the scale subresource read."""
    return ",".join(f"{key}={value}" for key, value in sorted(match_labels.items()))


def summarize_deployment(obj: Mapping[str, Any]) -> RoleDeployment | None:
    """The `RoleDeployment` of a live Deployment, or None when it carries no role label."""
    meta = obj.get("metadata") or {}
    role = (meta.get("labels") or {}).get(ROLE_LABEL)
    if not role:
        return None
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    owner = next(
        (ref.get("uid") for ref in meta.get("ownerReferences") or [] if ref.get("controller")),
        None,
    )
    failure, complete = "", False
    for condition in status.get("conditions") or []:
        kind, state, reason = (
            condition.get("type"),
            condition.get("status"),
            condition.get("reason"),
        )
        if kind == "Progressing" and state == "True" and reason == "NewReplicaSetAvailable":
            complete = True
        if (kind == "Progressing" and state == "False") or (
            kind == "ReplicaFailure" and state == "True"
        ):
            failure = f"{reason or kind}: {condition.get('message', '')}".rstrip(": ")
    containers = (spec.get("template") or {}).get("spec", {}).get("containers") or [{}]
    engine = next(
        (c for c in containers if c.get("name") in (ENGINE_CONTAINER, ROUTER)),
        containers[0],
    )
    args = [str(a) for a in (engine.get("command") or []) + (engine.get("args") or [])]
    return RoleDeployment(
        name=meta.get("name", ""),
        role=role,
        owner_uid=owner,
        generation=int(meta.get("generation") or 0),
        desired=int(spec.get("replicas", 1)),  # the API server defaults a missing value to 1
        replicas=int(status.get("replicas") or 0),
        ready=int(status.get("readyReplicas") or 0),
        updated=int(status.get("updatedReplicas") or 0),
        observed_generation=int(status.get("observedGeneration") or 0),
        selector=label_selector((spec.get("selector") or {}).get("matchLabels") or {}),
        failure=failure,
        rollout_complete=complete,
        args=tuple(args),
        env=tuple(str(var.get("name")) for var in engine.get("env") or []),
    )


@dataclasses.dataclass(frozen=True)
class RoleState:
    """One role's verdict: a condition (status/reason/message) plus how it weighs on phase."""

    ready: bool
    reason: str
    message: str
    degraded: bool = False
    pending: bool = False


def role_state(
    role: str, deployment: RoleDeployment | None, *, zero_by_design: bool = False
) -> RoleState:
    """One role's verdict. `zero_by_design`: the role autoscales with minReplicas 0 behind the
    router, so zero pods is a healthy resting state (requests wait at the router), not Pending."""
    if deployment is None:
        return RoleState(False, "DeploymentMissing", f"no {role} Deployment yet", pending=True)
    d = deployment
    counts = f"{d.ready}/{d.desired} ready, {d.updated}/{d.desired} updated"
    if d.failure:
        return RoleState(False, "RolloutFailed", f"{d.name}: {d.failure}", degraded=True)
    if d.desired == 0 and zero_by_design and d.replicas == 0:
        message = f"{d.name} scaled to zero while idle; the router holds requests until a pod is up"
        return RoleState(True, "ScaledToZero", message)
    if d.desired == 0:
        return RoleState(False, "ScaledToZero", f"{d.name} wants 0 pods", pending=True)
    if d.observed_generation < d.generation or d.updated < d.desired or d.replicas > d.updated:
        old = d.replicas - d.updated
        extra = f", {old} old pod(s) left" if old > 0 else ""
        return RoleState(False, "RollingOut", f"{d.name}: {counts}{extra}")
    if d.ready < d.desired and d.rollout_complete:
        return RoleState(False, "PodsNotReady", f"{d.name}: {counts}", degraded=True)
    if d.ready < d.desired:
        return RoleState(False, "PodsStarting", f"{d.name}: {counts}")
    return RoleState(True, "AllPodsReady", f"{d.name}: {d.ready}/{d.desired} pods ready")
