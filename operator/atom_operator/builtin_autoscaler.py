"""The built-in autoscaler's pass over one AtomDeployment (provider builtin): scrape each Ready
pod of every builtin-autoscaled role and the router's queued demand, decide each role's
replicas (`autoscale.decide`, pure), write them to the role's Deployment as that field's only
writer, and record the decision in status.autoscaling and, when it matters, as events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from atom_operator import apply, autoscale, envs, status
from atom_operator.context import HandlerContext, thaw
from atom_operator.scrape import pod_is_ready, scrape_engine, scrape_router_demand
from atom_operator.spec import ROLES, SpecError, apply_defaults, has_router
from atom_operator.validation import validate_spec


def builtin_roles(spec: Mapping[str, Any]) -> list[str]:
    """Roles that autoscale with provider builtin (on a defaulted spec)."""
    return [
        role
        for role in ROLES
        if role in spec
        and spec[role]["autoscaling"]["enabled"]
        and spec[role]["autoscaling"]["provider"] == "builtin"
    ]


def is_autoscaled(spec: Mapping[str, Any], **_: Any) -> bool:
    """The timer's filter: whether some role autoscales with provider builtin."""
    try:
        return bool(builtin_roles(apply_defaults(thaw(spec))))
    except TypeError:
        return False


def decision_status(
    decision: autoscale.Decision, now: str, before: Mapping[str, Any]
) -> dict[str, Any]:
    """status.autoscaling.<role>: the decision, and when the replicas last changed."""
    record = {
        "currentReplicas": decision.current,
        "desiredReplicas": decision.desired,
        "recommendedReplicas": decision.recommended,
        "reason": decision.reason,
        "limited": decision.limited,
        "metrics": {k: str(v) for k, v in decision.metrics.items()},
        "lastScaleTime": before.get("lastScaleTime"),
    }
    if decision.changed:
        record["lastScaleTime"] = now
    return {k: v for k, v in record.items() if v is not None}


async def _write_replicas(
    ctx: HandlerContext, role: str, deployment: status.RoleDeployment, decision: autoscale.Decision
) -> bool:
    """Set the role's Deployment to the decided replicas and post the Autoscaled event;
    False when the write failed (logged; the next pass tries again)."""
    target = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": deployment.name, "namespace": ctx.namespace},
        "spec": {"replicas": decision.desired},
    }
    try:
        await apply.scale_deployment(
            ctx.api(), target, ctx.uid, field_manager=apply.AUTOSCALER_MANAGER
        )
    except (apply.ApiError, apply.OwnershipError) as error:
        ctx.logger.warning("autoscaler: cannot scale %s: %s", deployment.name, error)
        return False
    metrics = ", ".join(f"{k}={v:g}" for k, v in decision.metrics.items())
    kopf.event(
        ctx.body,
        type="Normal",
        reason="Autoscaled",
        message=f"{role}: {decision.current} -> {decision.desired} replicas: "
        f"{decision.reason} [{metrics}]",
    )
    return True


def _of_role(pods: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    return [p for p in pods if (p["metadata"].get("labels") or {}).get(status.ROLE_LABEL) == role]


async def _ready_pods(ctx: HandlerContext) -> list[dict[str, Any]] | None:
    pods = await ctx.pods()
    return None if pods is None else [p for p in pods if pod_is_ready(p)]


async def _decide_role(
    ctx: HandlerContext,
    session: aiohttp.ClientSession,
    role: str,
    spec: Mapping[str, Any],
    pods: list[dict[str, Any]],
    demand: dict[str, float] | None,
) -> autoscale.Decision:
    scraped = await asyncio.gather(*(scrape_engine(session, p) for p in _of_role(pods, role)))
    histories: dict[str, autoscale.History] = ctx.memo.setdefault("autoscale_history", {})
    owned = {d.role: d for d in ctx.owned_deployments() if d.owner_uid == ctx.uid}
    decision, histories[role] = autoscale.decide(
        autoscale.Policy.from_spec(spec[role]["autoscaling"]),
        now=time.monotonic(),
        current=owned[role].desired,
        pods=scraped,
        router_queued=None if demand is None else demand.get(role, 0.0),
        history=histories.get(role, autoscale.History()),
    )
    return decision


async def autoscale_pass(ctx: HandlerContext, now: str) -> None:
    """One pass of the built-in autoscaler over the AtomDeployment of `ctx`."""
    plain = ctx.plain()
    try:
        validate_spec(plain["spec"], ctx.config)
    except SpecError:
        return  # SpecValid=False is reported by the change handlers; nothing to scale on
    spec = apply_defaults(plain["spec"])
    owned = {d.role: d for d in ctx.owned_deployments() if d.owner_uid == ctx.uid}
    pods = await _ready_pods(ctx)
    if pods is None:
        return
    before = dict((ctx.body.get("status") or {}).get("autoscaling") or {})
    records: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=envs.SCRAPE_TIMEOUT.number())
    async with aiohttp.ClientSession(timeout=timeout) as session:
        routed = has_router(spec)
        demand = await scrape_router_demand(session, _of_role(pods, "router")) if routed else None
        for role in builtin_roles(spec):
            if role not in owned:
                continue  # the change handlers create it; nothing to scale yet
            decision = await _decide_role(ctx, session, role, spec, pods, demand)
            previous = before.get(role) or {}
            if decision.changed and not await _write_replicas(ctx, role, owned[role], decision):
                continue
            if decision.limited and previous.get("limited") != decision.limited:
                message = f"{role} is at maxReplicas: {decision.reason}"
                kopf.event(ctx.body, type="Warning", reason="ScalingLimited", message=message)
            records[role] = decision_status(decision, now, previous)
    for role in before:
        records.setdefault(role, None)  # the role stopped autoscaling: drop its record
    changed = {role: rec for role, rec in records.items() if thaw(before.get(role)) != rec}
    if changed:
        ctx.patch.status["autoscaling"] = changed
