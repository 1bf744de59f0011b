"""Fold what the cluster reports about an AtomDeployment's children into its `status`.

Pure: the input is the AtomDeployment object, a `RoleDeployment` summary of each child
Deployment (made by `summarize_deployment` from the live object) and the time; the output is
the status to write. The handlers and the status timer both call `fold_status`, so there is one
definition of every phase and condition.

Conditions (each with status, reason, message, lastTransitionTime, observedGeneration;
lastTransitionTime changes only when status changes):

- `SpecValid`      the spec passes `validate_spec`; False names the field.
- `DecodeReady`    the decode Deployment has rolled out and all its desired pods are ready.
- `PrefillReady`   the same for prefill (only in disaggregated mode, i.e. spec.prefill set).
- `RouterReady`    the same for the router (only when there is one: spec.router.enabled, always
                   so in disaggregated mode).
- `KVEventsWired`  spec.kvEvents.enabled and every engine role's container args carry
                   `--kv-events-config` with the publisher endpoint on spec.kvEvents.port and a
                   `kv@...` topic, and (when there is a router) the router Deployment's args
                   subscribe on spec.kvEvents.port and replayPort (`--kv-events-port`,
                   `--kv-events-replay-port`, or the router's defaults when absent). False
                   with reason `Disabled` when KV events are off, `ArgsMissing` otherwise.
- `ScalingLimited` (only while a role autoscales with provider builtin) True when the built-in
                   autoscaler's last decision for some role wanted more than maxReplicas
                   (read from status.autoscaling, which the autoscaler writes).
- `Ready`          True only when the spec is valid, the operator has applied the current
                   generation (status.observedGeneration == metadata.generation) and every
                   condition above that applies is True. Never earlier.

A role is ready when its Deployment exists, is owned by this AtomDeployment, its controller
has observed the Deployment's generation, no pods of an older template remain, and
updatedReplicas, readyReplicas >= the desired replicas (spec.replicas of the Deployment, which
an HPA may own) >= 1. Its condition's reason says where it stands: DeploymentMissing,
RolloutFailed, ScaledToZero, RollingOut (old pods or an unobserved generation), PodsStarting
(updated pods still becoming ready), PodsNotReady (the controller finished the rollout, yet
pods are not ready: crashed or failing probes), AllPodsReady.

Phase, first match wins:

- `Failed`       SpecValid is False (nothing of the new spec was applied; old children keep
                 running and are still reported).
- `Degraded`     a role's Deployment reports a failure (ProgressDeadlineExceeded,
                 ReplicaFailure), or a role finished rolling out yet has fewer ready pods than
                 desired (PodsNotReady), or KV events are enabled but every role exists and
                 some engine Deployment's args do not wire them.
- `Pending`      a role's Deployment does not exist (yet), or a role wants zero pods.
- `Progressing`  everything exists and is rolling out, or the operator has not yet applied
                 the current generation.
- `Ready`        the Ready condition is True.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from collections.abc import Iterable, Mapping
from typing import Any

from atom_operator.render.names import role_selector_string
from atom_operator.spec import SpecError, apply_defaults, has_router, validate_spec

DEPLOYMENT_LABEL = "serving.atom.dev/deployment"
ROLE_LABEL = "serving.atom.dev/role"
ROLE_CONDITIONS = {"decode": "DecodeReady", "prefill": "PrefillReady", "router": "RouterReady"}
ENGINE_ROLES = ("decode", "prefill")
ENGINE_CONTAINER = "engine"
ROUTER_CONTAINER = "router"
KV_EVENTS_FLAG = "--kv-events-config"
# `atom router`'s KV-event flags and their defaults (RouterConfig in
# runtime/atom_runtime/router/app.py; tests/test_render_to_serve.py checks they agree).
ROUTER_KV_PORT_FLAGS = {"--kv-events-port": 5557, "--kv-events-replay-port": 5558}
CONDITION_ORDER = (
    "SpecValid",
    "DecodeReady",
    "PrefillReady",
    "RouterReady",
    "KVEventsWired",
    "ScalingLimited",
    "Ready",
)


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
        (c for c in containers if c.get("name") in (ENGINE_CONTAINER, ROUTER_CONTAINER)),
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


def kv_events_problem(args: Iterable[str], env: Iterable[str], *, port: int, model: str) -> str:
    """Why an engine container with these args and env variables does not publish KV events on
    `port` under a `kv@<pod-ip>:<port>@<model>` topic ("" when it does)."""
    args = list(args)
    value = None
    for index, arg in enumerate(args):
        if arg == KV_EVENTS_FLAG and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(KV_EVENTS_FLAG + "="):
            value = arg.split("=", 1)[1]
        elif KV_EVENTS_FLAG in arg and " " in arg:  # a shell script line: `sh -c "... --flag x"`
            words = shlex.split(arg)
            if KV_EVENTS_FLAG in words[:-1]:
                value = words[words.index(KV_EVENTS_FLAG) + 1]
    if value is None:
        return f"no {KV_EVENTS_FLAG} argument"
    try:
        config = json.loads(value)
    except ValueError:
        return f"{KV_EVENTS_FLAG} is not JSON: {value!r}"
    if not isinstance(config, dict):
        return f"{KV_EVENTS_FLAG} is not a JSON object"
    endpoint, topic = str(config.get("endpoint") or ""), str(config.get("topic") or "")
    if not endpoint.endswith(f":{port}"):
        return f"publisher endpoint {endpoint!r} is not on spec.kvEvents.port {port}"
    if not re.fullmatch(rf"kv@[^@:]+:{port}@{re.escape(model)}", topic):
        return f"topic {topic!r} is not kv@<pod-ip>:{port}@{model}"
    for variable in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", topic):
        if variable not in env:
            return f"topic {topic!r} refers to $({variable}), which the container does not set"
    return ""


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of the last `flag V` or `flag=V` in `args` (argparse keeps the last), or None."""
    value = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def router_kv_events_problem(args: Iterable[str], *, port: int, replay_port: int) -> str:
    """Why a router container with these args does not subscribe to the decode pods' KV events
    on `port` and replay on `replay_port` ("" when it does)."""
    args = list(args)
    problems = []
    for (flag, default), want in zip(
        ROUTER_KV_PORT_FLAGS.items(), (port, replay_port), strict=True
    ):
        value = _flag_value(args, flag)
        got = default if value is None else value
        if str(got) != str(want):
            shown = f"{flag} {value}" if value is not None else f"no {flag} (default {default})"
            problems.append(f"{shown}, spec.kvEvents wants {want}")
    return "; ".join(problems)


def _condition(
    kind: str,
    ready: bool,
    reason: str,
    message: str,
    generation: int | None,
    previous: Mapping[str, Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    status = "True" if ready else "False"
    before = previous.get(kind) or {}
    changed = before.get("status") != status or not before.get("lastTransitionTime")
    condition: dict[str, Any] = {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now if changed else before["lastTransitionTime"],
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    return condition


def _role_status(state: RoleDeployment | None, desired: int, selector: str) -> dict[str, Any]:
    if state is None:
        counts = {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0}
        return {**counts, "desiredReplicas": desired, "selector": selector, "ready": f"0/{desired}"}
    return {
        "replicas": state.replicas,
        "readyReplicas": state.ready,
        "updatedReplicas": state.updated,
        "desiredReplicas": state.desired,
        "selector": state.selector,
        "ready": f"{state.ready}/{state.desired}",
    }


def _spec_desired(spec: Mapping[str, Any], role: str) -> int:
    section = spec.get(role) or {}
    autoscaling = section.get("autoscaling") or {}
    if autoscaling.get("enabled"):
        return int(autoscaling.get("minReplicas", 1))
    return int(section.get("replicas", 1))


def fold_status(
    body: Mapping[str, Any],
    deployments: Iterable[RoleDeployment],
    *,
    applied_generation: int | None,
    endpoint: str | None,
    now: str,
) -> dict[str, Any]:
    """The whole status for `body`, except observedGeneration (which only the appliers write).

    `applied_generation` is the generation the operator last applied (status.observedGeneration,
    or the current one when the caller has just applied it); `endpoint` the Service URL, None
    to keep the current one (the spec may be too broken to compute it).
    """
    meta = body.get("metadata") or {}
    generation = meta.get("generation")
    uid = meta.get("uid")
    old_status = body.get("status") or {}
    previous = {c.get("type"): c for c in old_status.get("conditions") or [] if c.get("type")}
    raw_spec = body.get("spec") or {}

    spec_error: SpecError | None = None
    try:
        validate_spec(dict(raw_spec))
        spec = apply_defaults(dict(raw_spec))
    except SpecError as exc:
        spec_error = exc
        spec = dict(raw_spec)

    owned: dict[str, RoleDeployment] = {}
    for deployment in deployments:
        if deployment.owner_uid == uid and deployment.role not in owned:
            owned[deployment.role] = deployment

    routed = has_router(spec)
    roles = ["decode"] + (["prefill"] if "prefill" in spec else []) + (["router"] if routed else [])

    def zero_by_design(role: str) -> bool:
        autoscaling = (spec.get(role) or {}).get("autoscaling") or {}
        return bool(
            spec_error is None
            and routed
            and autoscaling.get("enabled")
            and autoscaling.get("minReplicas") == 0
        )

    states = {
        role: role_state(role, owned.get(role), zero_by_design=zero_by_design(role))
        for role in roles
    }

    conditions: list[dict[str, Any]] = []

    def add(kind: str, ready: bool, reason: str, message: str, gen: int | None) -> None:
        conditions.append(_condition(kind, ready, reason, message, gen, previous, now))

    if spec_error is None:
        add("SpecValid", True, "Valid", "the spec is valid", generation)
    else:
        add("SpecValid", False, "InvalidSpec", str(spec_error), generation)
    for role in roles:
        state = states[role]
        add(ROLE_CONDITIONS[role], state.ready, state.reason, state.message, applied_generation)

    kv_events = spec.get("kvEvents") or {}
    kv_enabled = bool(kv_events.get("enabled", True))
    kv_problems: list[str] = []
    if not kv_enabled:
        add(
            "KVEventsWired", False, "Disabled", "spec.kvEvents.enabled is false", applied_generation
        )
    else:
        for role in (r for r in ENGINE_ROLES if r in roles):
            deployment = owned.get(role)
            if deployment is None:
                kv_problems.append(f"{role}: no Deployment yet")
                continue
            problem = kv_events_problem(
                deployment.args,
                deployment.env,
                port=int(kv_events.get("port", 5557)),
                model=str((spec.get("model") or {}).get("name", "")),
            )
            if problem:
                kv_problems.append(f"{role} ({deployment.name}): {problem}")
        if "router" in roles:
            router = owned.get("router")
            if router is None:
                kv_problems.append("router: no Deployment yet")
            else:
                problem = router_kv_events_problem(
                    router.args,
                    port=int(kv_events.get("port", 5557)),
                    replay_port=int(kv_events.get("replayPort", 5558)),
                )
                if problem:
                    kv_problems.append(f"router ({router.name}): {problem}")
        if kv_problems:
            add("KVEventsWired", False, "ArgsMissing", "; ".join(kv_problems), applied_generation)
        else:
            message = f"engine pods publish on port {kv_events.get('port', 5557)}"
            if "router" in roles:
                message += (
                    f"; the router subscribes on {kv_events.get('port', 5557)} "
                    f"(replay {kv_events.get('replayPort', 5558)})"
                )
            add("KVEventsWired", True, "ArgsWired", message, applied_generation)

    builtin = [
        role
        for role in ENGINE_ROLES
        if role in roles
        and ((spec.get(role) or {}).get("autoscaling") or {}).get("enabled")
        and ((spec.get(role) or {}).get("autoscaling") or {}).get("provider") == "builtin"
    ]
    if builtin and spec_error is None:
        decisions = old_status.get("autoscaling") or {}
        limited = [
            f"{role}: {(decisions.get(role) or {}).get('reason', '')}"
            for role in builtin
            if (decisions.get(role) or {}).get("limited") == "max"
        ]
        if limited:
            add("ScalingLimited", True, "AtMaxReplicas", "; ".join(limited), applied_generation)
        else:
            message = f"{', '.join(builtin)} within [minReplicas, maxReplicas]"
            add("ScalingLimited", False, "WithinLimits", message, applied_generation)

    not_ready = [ROLE_CONDITIONS[r] for r in roles if not states[r].ready]
    if spec_error is not None:
        ready, reason, message = False, "SpecInvalid", str(spec_error)
    elif applied_generation != generation:
        ready, reason = False, "Reconciling"
        message = f"generation {generation} is not applied yet (applied: {applied_generation})"
    elif not_ready:
        ready, reason, message = False, "ComponentsNotReady", f"not ready: {', '.join(not_ready)}"
    elif kv_enabled and kv_problems:
        ready, reason, message = False, "KVEventsNotWired", "; ".join(kv_problems)
    else:
        ready, reason, message = True, "AllComponentsReady", f"ready: {', '.join(roles)}"
    add("Ready", ready, reason, message, applied_generation)

    if spec_error is not None:
        phase = "Failed"
    elif any(s.degraded for s in states.values()) or (
        kv_enabled and kv_problems and not any(s.pending for s in states.values())
    ):
        phase = "Degraded"
    elif any(s.pending for s in states.values()):
        phase = "Pending"
    elif not ready:
        phase = "Progressing"
    else:
        phase = "Ready"

    status: dict[str, Any] = {
        "phase": phase,
        "endpoint": old_status.get("endpoint") if endpoint is None else endpoint,
        "model": (spec.get("model") or {}).get("name") or old_status.get("model"),
        "roles": {
            role: _role_status(
                owned.get(role), _spec_desired(spec, role), role_selector_string(body, role)
            )
            if role in roles
            else None
            for role in ("decode", "prefill", "router")
        },
        "conditions": conditions,
    }
    return status


def status_changes(current: Mapping[str, Any], folded: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level status keys whose folded value differs from the current one (a merge
    patch: a role that is gone stays None so the patch removes it)."""
    changes: dict[str, Any] = {}
    for key, value in folded.items():
        if key == "roles":
            roles = {
                role: state
                for role, state in value.items()
                if (current.get("roles") or {}).get(role) != state
            }
            if roles:
                changes["roles"] = roles
        elif current.get(key) != value:
            changes[key] = value
    return changes
