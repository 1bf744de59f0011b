"""Fold what the cluster reports about an AtomDeployment's children into its `status`.

Pure: the input is the AtomDeployment object, a `RoleDeployment` summary of each child
Deployment (made by `summarize_deployment` from the live object) and the time; the output is
the status to write. The handlers and the status timer both call `fold_status`, so there is one
definition of every phase and condition.

Conditions (each with status, reason, message, lastTransitionTime, observedGeneration;
lastTransitionTime changes only when status changes):

- `SpecValid`      the spec passes `validate_spec`; False names the field.
- `ModelReady`     (valid specs) the engine pods of the current model source have their model:
                   mounted, downloaded or loaded (`model_readiness`); not part of Ready.
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
                   role condition and KVEventsWired (when enabled) is True. Never earlier.

A role's verdict is `role_deployment.role_state`; KV-event wiring is read back from the
containers' args by `kv_events_wiring`. Each condition has its own function below.

Phase, first match wins:

- `Failed`       SpecValid is False (nothing of the new spec was applied; old children keep
                 running and are still reported).
- `Degraded`     a role's Deployment reports a failure (ProgressDeadlineExceeded,
                 ReplicaFailure), or a role finished rolling out yet has fewer ready pods than
                 desired (PodsNotReady), or KV events are enabled but every role exists and
                 some engine Deployment's args do not wire them, or the model's download step
                 failed (ModelReady DownloadFailed).
- `Pending`      a role's Deployment does not exist (yet), or a role wants zero pods.
- `Progressing`  everything exists and is rolling out, or the operator has not yet applied
                 the current generation.
- `Ready`        the Ready condition is True.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from atom_operator.kv_events_wiring import kv_events_problem, router_kv_events_problem
from atom_operator.model_readiness import ModelPod, model_ready
from atom_operator.model_source import model_source
from atom_operator.operator_config import DEFAULT_CONFIG, OperatorConfig
from atom_operator.render.model_volume import source_digest
from atom_operator.render.names import DEPLOYMENT_LABEL, ROLE_LABEL, role_selector_string
from atom_operator.role_deployment import (
    RoleDeployment,
    RoleState,
    role_state,
    summarize_deployment,
)
from atom_operator.spec import SpecError, apply_defaults, has_router
from atom_operator.validation import validate_spec

__all__ = [
    "DEPLOYMENT_LABEL",
    "ROLE_LABEL",
    "RoleDeployment",
    "fold_status",
    "status_changes",
    "summarize_deployment",
]

ROLE_CONDITIONS = {"decode": "DecodeReady", "prefill": "PrefillReady", "router": "RouterReady"}
ENGINE_ROLES = ("decode", "prefill")
CONDITION_ORDER = (
    "SpecValid",
    "ModelReady",
    "DecodeReady",
    "PrefillReady",
    "RouterReady",
    "KVEventsWired",
    "ScalingLimited",
    "Ready",
)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One condition before it is dated: True/False, reason, message, the generation it is
    about."""

    kind: str
    ready: bool
    reason: str
    message: str
    generation: int | None


@dataclasses.dataclass(frozen=True)
class Observed:
    """What every condition is computed from: the spec (defaulted when valid), its error, the
    roles that apply, the owned Deployments and each role's verdict."""

    spec: Mapping[str, Any]
    spec_error: SpecError | None
    pods: list[ModelPod] | None  # the engine pods' model state; None: not known this time
    generation: int | None
    applied_generation: int | None
    roles: list[str]
    owned: dict[str, RoleDeployment]
    states: dict[str, RoleState]
    old_status: Mapping[str, Any]


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


def observe(
    body: Mapping[str, Any],
    deployments: Iterable[RoleDeployment],
    applied_generation: int | None,
    config: OperatorConfig = DEFAULT_CONFIG,
    pods: Iterable[ModelPod] | None = None,
) -> Observed:
    """Validate the spec, pick the Deployments this AtomDeployment owns and judge each role."""
    meta = body.get("metadata") or {}
    raw_spec = body.get("spec") or {}
    spec_error: SpecError | None = None
    try:
        validate_spec(dict(raw_spec), config)
        spec = apply_defaults(dict(raw_spec))
    except SpecError as exc:
        spec_error, spec = exc, dict(raw_spec)
    owned: dict[str, RoleDeployment] = {}
    for deployment in deployments:
        if deployment.owner_uid == meta.get("uid") and deployment.role not in owned:
            owned[deployment.role] = deployment
    routed = has_router(spec)
    roles = ["decode"] + (["prefill"] if "prefill" in spec else []) + (["router"] if routed else [])

    def zero_by_design(role: str) -> bool:
        autoscaling = (spec.get(role) or {}).get("autoscaling") or {}
        return bool(spec_error is None and routed and autoscaling.get("enabled")
                    and autoscaling.get("minReplicas") == 0)  # fmt: skip

    states = {role: role_state(role, owned.get(role), zero_by_design=zero_by_design(role))
              for role in roles}  # fmt: skip
    return Observed(spec, spec_error, None if pods is None else list(pods), meta.get("generation"),
                    applied_generation, roles, owned, states, body.get("status") or {})  # fmt: skip


def spec_valid(seen: Observed) -> Verdict:
    if seen.spec_error is None:
        return Verdict("SpecValid", True, "Valid", "the spec is valid", seen.generation)
    return Verdict("SpecValid", False, "InvalidSpec", str(seen.spec_error), seen.generation)


def model_ready_verdict(seen: Observed) -> Verdict | None:
    """ModelReady (model_readiness.py); None for an invalid spec, or when the pods are not
    known this time and there is no earlier verdict to keep."""
    if seen.spec_error is not None:
        return None
    if seen.pods is None:
        before = next((c for c in seen.old_status.get("conditions") or []
                       if c.get("type") == "ModelReady"), None)  # fmt: skip
        if before is None:
            return None
        return Verdict("ModelReady", before.get("status") == "True", before.get("reason", ""),
                       before.get("message", ""), before.get("observedGeneration"))  # fmt: skip
    source = model_source(seen.spec["model"])
    ready, reason, message = model_ready(source, source_digest(source), seen.pods)
    return Verdict("ModelReady", ready, reason, message, seen.applied_generation)


def role_ready(seen: Observed, role: str) -> Verdict:
    state = seen.states[role]
    kind = ROLE_CONDITIONS[role]
    return Verdict(kind, state.ready, state.reason, state.message, seen.applied_generation)


def kv_events_wiring_problems(seen: Observed) -> list[str]:
    """What keeps the engines' and the router's args from wiring KV events as the spec says."""
    events = seen.spec.get("kvEvents") or {}
    port, replay = int(events.get("port", 5557)), int(events.get("replayPort", 5558))
    model = str((seen.spec.get("model") or {}).get("name", ""))
    problems = []
    for role in (r for r in ENGINE_ROLES if r in seen.roles):
        deployment = seen.owned.get(role)
        if deployment is None:
            problems.append(f"{role}: no Deployment yet")
            continue
        problem = kv_events_problem(deployment.args, deployment.env, port=port, model=model)
        if problem:
            problems.append(f"{role} ({deployment.name}): {problem}")
    if "router" in seen.roles:
        router = seen.owned.get("router")
        if router is None:
            problems.append("router: no Deployment yet")
        else:
            problem = router_kv_events_problem(router.args, port=port, replay_port=replay)
            if problem:
                problems.append(f"router ({router.name}): {problem}")
    return problems


def kv_events_enabled(seen: Observed) -> bool:
    return bool((seen.spec.get("kvEvents") or {}).get("enabled", True))


def kv_events_wired(seen: Observed, problems: list[str]) -> Verdict:
    gen = seen.applied_generation
    if not kv_events_enabled(seen):
        return Verdict("KVEventsWired", False, "Disabled", "spec.kvEvents.enabled is false", gen)
    if problems:
        return Verdict("KVEventsWired", False, "ArgsMissing", "; ".join(problems), gen)
    events = seen.spec.get("kvEvents") or {}
    message = f"engine pods publish on port {events.get('port', 5557)}"
    if "router" in seen.roles:
        message += (
            f"; the router subscribes on {events.get('port', 5557)} "
            f"(replay {events.get('replayPort', 5558)})"
        )
    return Verdict("KVEventsWired", True, "ArgsWired", message, gen)


def scaling_limited(seen: Observed) -> Verdict | None:
    """Only while a role autoscales with provider builtin: whether its last decision wanted more
    than maxReplicas (read from status.autoscaling, which the autoscaler writes)."""
    builtin = [
        role
        for role in ENGINE_ROLES
        if role in seen.roles
        and ((seen.spec.get(role) or {}).get("autoscaling") or {}).get("enabled")
        and ((seen.spec.get(role) or {}).get("autoscaling") or {}).get("provider") == "builtin"
    ]
    if not builtin or seen.spec_error is not None:
        return None
    decisions = seen.old_status.get("autoscaling") or {}
    limited = [
        f"{role}: {(decisions.get(role) or {}).get('reason', '')}"
        for role in builtin
        if (decisions.get(role) or {}).get("limited") == "max"
    ]
    gen = seen.applied_generation
    if limited:
        return Verdict("ScalingLimited", True, "AtMaxReplicas", "; ".join(limited), gen)
    message = f"{', '.join(builtin)} within [minReplicas, maxReplicas]"
    return Verdict("ScalingLimited", False, "WithinLimits", message, gen)


def ready(seen: Observed, kv_problems: list[str]) -> Verdict:
    gen = seen.applied_generation
    not_ready = [ROLE_CONDITIONS[r] for r in seen.roles if not seen.states[r].ready]
    if seen.spec_error is not None:
        return Verdict("Ready", False, "SpecInvalid", str(seen.spec_error), gen)
    if seen.applied_generation != seen.generation:
        message = f"generation {seen.generation} is not applied yet (applied: {gen})"
        return Verdict("Ready", False, "Reconciling", message, gen)
    if not_ready:
        return Verdict("Ready", False, "ComponentsNotReady", f"not ready: {', '.join(not_ready)}",
                       gen)  # fmt: skip
    if kv_events_enabled(seen) and kv_problems:
        return Verdict("Ready", False, "KVEventsNotWired", "; ".join(kv_problems), gen)
    return Verdict("Ready", True, "AllComponentsReady", f"ready: {', '.join(seen.roles)}", gen)


def phase(
    seen: Observed, is_ready: bool, kv_problems: list[str], model: Verdict | None = None
) -> str:
    states = seen.states.values()
    if seen.spec_error is not None:
        return "Failed"
    if (
        (model is not None and model.reason == "DownloadFailed")
        or any(s.degraded for s in states)
        or (kv_events_enabled(seen) and kv_problems and not any(s.pending for s in states))
    ):
        return "Degraded"
    if any(s.pending for s in states):
        return "Pending"
    return "Ready" if is_ready else "Progressing"


def fold_status(
    body: Mapping[str, Any],
    deployments: Iterable[RoleDeployment],
    *,
    applied_generation: int | None,
    endpoint: str | None,
    now: str,
    config: OperatorConfig = DEFAULT_CONFIG,
    pods: Iterable[ModelPod] | None = None,
) -> dict[str, Any]:
    """The whole status for `body`, except observedGeneration (which only the appliers write).

    `applied_generation` is the generation the operator last applied (status.observedGeneration,
    or the current one when the caller has just applied it); `endpoint` the Service URL, None
    to keep the current one (the spec may be too broken to compute it); `config` the operator's
    configuration the spec is validated against; `pods` the engine pods' model state
    (`model_readiness.summarize_pod`), None when it could not be read this time.
    """
    seen = observe(body, deployments, applied_generation, config, pods)
    kv_problems = kv_events_wiring_problems(seen) if kv_events_enabled(seen) else []
    model = model_ready_verdict(seen)
    verdicts = [spec_valid(seen), model, *(role_ready(seen, role) for role in seen.roles)]
    verdicts.append(kv_events_wired(seen, kv_problems))
    verdicts.append(scaling_limited(seen))
    overall = ready(seen, kv_problems)
    verdicts.append(overall)
    previous = {c.get("type"): c for c in seen.old_status.get("conditions") or [] if c.get("type")}
    conditions = [
        _condition(v.kind, v.ready, v.reason, v.message, v.generation, previous, now)
        for v in verdicts
        if v is not None
    ]
    spec = seen.spec
    return {
        "phase": phase(seen, overall.ready, kv_problems, model),
        "endpoint": seen.old_status.get("endpoint") if endpoint is None else endpoint,
        "model": (spec.get("model") or {}).get("name") or seen.old_status.get("model"),
        "roles": {
            role: _role_status(
                seen.owned.get(role), _spec_desired(spec, role), role_selector_string(body, role)
            )
            if role in seen.roles
            else None
            for role in ("decode", "prefill", "router")
        },
        "conditions": conditions,
    }


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
