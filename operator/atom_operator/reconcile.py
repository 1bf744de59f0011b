"""The one path every change of an AtomDeployment takes: plan (validate and render every child),
apply, report, write status.

`reconcile` applies everything and prunes what the spec no longer renders; `scale` patches only
one role's replica count. Both go through `converge`.
"""

from __future__ import annotations

import datetime
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import kopf

from atom_operator import apply, status
from atom_operator.context import HandlerContext
from atom_operator.model_readiness import ModelPod
from atom_operator.render import render_children
from atom_operator.render.keys import DeploymentKeys
from atom_operator.render.names import endpoint_url
from atom_operator.spec import SpecError, apply_defaults
from atom_operator.validation import spec_warnings

REPLICA_FIELDS = {("spec", "decode", "replicas"), ("spec", "prefill", "replicas")}

Step = Callable[[apply.KubeAPI, list[dict[str, Any]], str], Awaitable[list[apply.Applied] | None]]


def retry_delay(retry: int, *, conflict: bool) -> float:
    """Backoff for a failed apply: conflicts retry from 1 s, other errors from 5 s."""
    base, cap = (1.0, 30.0) if conflict else (5.0, 300.0)
    return min(cap, base * 2 ** min(retry, 10))


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def only_replicas_changed(diff: Iterable[Any], **_: Any) -> bool:
    """Whether every change is to spec.decode.replicas or spec.prefill.replicas."""
    paths = [tuple(change[1]) for change in diff]
    return bool(paths) and all(path in REPLICA_FIELDS for path in paths)


def write_status(
    ctx: HandlerContext,
    *,
    applied_generation: int | None,
    with_generation: bool,
    pods: list[ModelPod] | None = None,
) -> dict[str, Any]:
    """Fold status and put the changed keys into kopf's patch; returns the folded status.
    `pods`: the engine pods' model state, read by the status timer only (an apply changes no
    pod at once; None keeps ModelReady as it was)."""
    try:
        endpoint: str | None = endpoint_url(ctx.plain())
    except (SpecError, ValueError, KeyError):
        endpoint = None
    folded = status.fold_status(
        ctx.body,
        ctx.owned_deployments(),
        applied_generation=applied_generation,
        endpoint=endpoint,
        now=now(),
        config=ctx.config,
        pods=pods,
    )
    current = dict(ctx.body.get("status") or {})
    changes = status.status_changes(current, folded)
    if with_generation and current.get("observedGeneration") != applied_generation:
        changes["observedGeneration"] = applied_generation
    if changes:
        ctx.patch.status.update(changes)
    return folded


def _refuse_invalid(ctx: HandlerContext, error: SpecError) -> kopf.PermanentError:
    """Report an invalid spec and return the error that ends handling of this generation."""
    write_status(ctx, applied_generation=ctx.generation, with_generation=True)
    kopf.warn(ctx.body, reason="InvalidSpec", message=f"nothing applied: {error}")
    return kopf.PermanentError(f"invalid spec, nothing applied: {error}")


def _api_failure(ctx: HandlerContext, error: Exception) -> kopf.TemporaryError:
    if isinstance(error, apply.OwnershipError):
        kopf.warn(ctx.body, reason="ChildConflict", message=str(error))
        return kopf.TemporaryError(str(error), delay=retry_delay(ctx.retry, conflict=False))
    conflict = isinstance(error, apply.ApiError) and error.is_conflict
    return kopf.TemporaryError(str(error), delay=retry_delay(ctx.retry, conflict=conflict))


def _report(body: kopf.Body, results: Iterable[apply.Applied]) -> None:
    changed = [r for r in results if r.action != "unchanged"]
    if changed:
        # kopf.event, not kopf.info: posting.level keeps kopf's own INFO logs out of events,
        # and kopf.info obeys that level too.
        message = ", ".join(str(r) for r in changed)
        kopf.event(body, type="Normal", reason="Applied", message=message)


async def converge(ctx: HandlerContext, step: Step) -> list[apply.Applied] | None:
    """Plan (validate and render every child), apply `step` to the plan, report what changed
    as an event, write status with observedGeneration.

    `step(api, children, uid)` does the writes and returns what happened, or None when it had
    nothing to do for this change (then nothing is reported and status is left alone).
    """
    try:
        # Fresh keys each time: they reach the cluster only if the Secret does not exist yet.
        children = render_children(ctx.plain(), ctx.config, DeploymentKeys.generate())
    except SpecError as error:
        raise _refuse_invalid(ctx, error) from error
    try:
        results = await step(ctx.api(), children, ctx.uid)
    except (apply.ApiError, apply.OwnershipError) as error:
        raise _api_failure(ctx, error) from error
    if results is None:
        return None
    _report(ctx.body, results)
    write_status(ctx, applied_generation=ctx.generation, with_generation=True)
    return results


def apply_everything(namespace: str) -> Step:
    """The reconcile step: create-or-patch every child, then delete the ones not rendered."""

    async def step(
        api: apply.KubeAPI, children: list[dict[str, Any]], uid: str
    ) -> list[apply.Applied]:
        instance = children[-1]["metadata"]["labels"][status.DEPLOYMENT_LABEL]
        results = await apply.apply_children(api, children, uid)
        return results + await apply.prune_children(
            api,
            children,
            namespace=namespace,
            selector=f"{status.DEPLOYMENT_LABEL}={instance}",
            uid=uid,
        )

    return step


def apply_replicas(role: str, spec: Mapping[str, Any]) -> Step:
    """The scale step: only spec.replicas of the role's Deployment (everything when it is
    missing); nothing when the role is gone or an autoscaler owns its replica count."""

    async def step(
        api: apply.KubeAPI, children: list[dict[str, Any]], uid: str
    ) -> list[apply.Applied] | None:
        if role not in spec:
            return None  # the role was removed in the same edit; the change handler does that
        if spec[role]["autoscaling"]["enabled"]:
            return None
        deployment = next(
            c
            for c in children
            if c["kind"] == "Deployment"
            and c["metadata"].get("labels", {}).get(status.ROLE_LABEL) == role
        )
        result = await apply.scale_deployment(api, deployment, uid)
        if result is None:
            return await apply.apply_children(api, children, uid)
        return [result]

    return step


async def reconcile(ctx: HandlerContext) -> None:
    """Render everything, then create-or-patch each child, prune, then write status."""
    results = await converge(ctx, apply_everything(ctx.namespace))
    ctx.logger.info("applied: %s", ", ".join(str(r) for r in results or []))
    if any(r.action != "unchanged" for r in results or []):
        # Once per change that reached the cluster, not on every resume or safety-net pass.
        for reason, message in spec_warnings(apply_defaults(ctx.plain()["spec"])):
            kopf.warn(ctx.body, reason=reason, message=message)


async def scale(ctx: HandlerContext, role: str) -> None:
    """Patch only spec.replicas of the role's Deployment (whole reconcile if it is missing)."""
    spec = apply_defaults(ctx.plain()["spec"])
    results = await converge(ctx, apply_replicas(role, spec))
    if results is None and role in spec:
        ctx.logger.info("spec.%s.replicas ignored: the role's autoscaler owns it", role)


async def fold_or_reconcile(ctx: HandlerContext) -> None:
    """The status timer's pass: fold the children's status into the AtomDeployment's, writing
    only what changed; or, when status.observedGeneration lags behind metadata.generation (kopf
    folds a spec edit that lands while the creation cycle is still running into that cycle, and
    an apply can keep failing), reconcile."""
    current = ctx.body.get("status") or {}
    if current.get("observedGeneration") != ctx.generation:
        ctx.logger.info(
            "generation %s is not applied (status.observedGeneration=%s): reconciling",
            ctx.generation,
            current.get("observedGeneration"),
        )
        try:
            await reconcile(ctx)
        except kopf.PermanentError:
            pass  # SpecValid=False and observedGeneration are written; nothing to retry
        return
    generation = current.get("observedGeneration")
    pods = await ctx.model_pods()
    write_status(ctx, applied_generation=generation, with_generation=False, pods=pods)
