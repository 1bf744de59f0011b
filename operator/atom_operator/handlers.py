"""kopf handlers for AtomDeployment: validate, render, apply, report.

Importing this module registers the handlers with kopf's default registry, so
`kopf run -m atom_operator.handlers` runs the operator (as does `atom operator run`, which
imports it). Importing the `atom_operator` package alone registers nothing: `atom render`
must not need kopf.

What runs when:

- create / resume / update (any change other than a replica count): validate and render
  every child first, then create-or-patch each one (`apply.apply_children`), delete the
  children the spec no longer renders (`apply.prune_children`), then write status with
  `observedGeneration`; when a child changed, post a warning event for each choice the spec
  allows but that is most likely not meant (`spec.spec_warnings`: the router on with KV events
  off). An invalid spec writes `SpecValid=False` naming the field and `observedGeneration`,
  emits a warning event, touches no child, and fails permanently for that generation (the
  next edit is handled afresh).
- a change of `spec.decode.replicas` or `spec.prefill.replicas` alone: patch only
  `spec.replicas` of that role's Deployment (`apply.scale_deployment`); nothing for a role
  whose autoscaler owns the replica count. Both paths share `converge`: plan -> apply ->
  report -> write status.
- every `ATOM_OPERATOR_AUTOSCALE_INTERVAL` seconds (default 10), for an AtomDeployment with a
  role on autoscaling provider builtin: scrape the role's Ready pods and the router's queued
  demand, decide (`autoscale.decide`), write the Deployment's replicas as the field's only
  writer, record the decision in status.autoscaling and as events.
- every `ATOM_OPERATOR_STATUS_INTERVAL` seconds (default 10): fold the owned Deployments'
  status (kept current by a kopf index over Deployments labelled
  `serving.atom.dev/deployment`) into the AtomDeployment's status, written only when it
  changed; or, when status.observedGeneration lags behind metadata.generation, reconcile.

Deletion needs no handler: every child carries an ownerReference to the AtomDeployment
(controller=true, blockOwnerDeletion=true), so Kubernetes' garbage collector removes the
children. kopf itself puts a finalizer (`serving.atom.dev/kopf-finalizer`) on each
AtomDeployment because of the status timer, and removes it when the object is deleted and the
timer stopped; an AtomDeployment deleted while no operator runs waits for one to start.

API errors: a 409 conflict retries soon with exponential backoff, other API errors and
unreachable API servers retry with a longer backoff (`kopf.TemporaryError`); a child whose
name is taken by an object this AtomDeployment does not control is reported as a warning
event and retried (the garbage collector may still be removing an older owner's object).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import aiohttp
import kopf

from atom_operator import apply, autoscale, status
from atom_operator.render import render_children
from atom_operator.render.names import endpoint_url, label_value
from atom_operator.schema import ENGINE_HTTP_PORT, GROUP, PLURAL, VERSION
from atom_operator.spec import (
    ROLES,
    SpecError,
    apply_defaults,
    has_router,
    spec_warnings,
    validate_spec,
)

STATUS_INTERVAL = float(os.environ.get("ATOM_OPERATOR_STATUS_INTERVAL", "10"))
AUTOSCALE_INTERVAL = float(os.environ.get("ATOM_OPERATOR_AUTOSCALE_INTERVAL", "10"))
SCRAPE_TIMEOUT = float(os.environ.get("ATOM_OPERATOR_SCRAPE_TIMEOUT", "3"))
REPLICA_FIELDS = {("spec", "decode", "replicas"), ("spec", "prefill", "replicas")}
ANNOTATION_PREFIX = GROUP  # kopf's bookkeeping annotations live under serving.atom.dev/


# --- operator-level setup ---------------------------------------------------------------------


class KubeConnection:
    """The credentials kopf logged in with, turned into one `apply.KubeAPI` on first use.

    Kept in the operator's memo (shared by every object's memo) because kopf logs in after
    the startup handlers run and again whenever its credentials stop working.
    """

    def __init__(self) -> None:
        self.info: kopf.ConnectionInfo | None = None
        self._api: apply.KubeAPI | None = None
        self._retired: list[apply.KubeAPI] = []  # built from older credentials; closed at exit

    def set_info(self, info: kopf.ConnectionInfo | None) -> None:
        if info is not self.info:
            self.info = info
            if self._api is not None:
                self._retired.append(self._api)
            self._api = None

    def api(self) -> apply.KubeAPI:
        if self._api is None:
            if self.info is None:
                raise kopf.TemporaryError("not logged in to the Kubernetes API yet", delay=1)
            self._api = apply.KubeAPI.from_connection_info(self.info)
        return self._api

    async def close(self) -> None:
        for api in [*self._retired, self._api]:
            if api is not None:
                await api.close()
        self._api, self._retired = None, []


def _connection(memo: kopf.Memo) -> KubeConnection:
    return memo.setdefault("kube", KubeConnection())


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Keep kopf's bookkeeping in serving.atom.dev/ annotations, out of our status."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/kopf-finalizer"
    # Only our own events and kopf's warnings become Kubernetes events, not every log line.
    settings.posting.level = logging.WARNING
    _connection(memo)


@kopf.on.login()
async def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account, else kubeconfig (as kopf's default), shared with apply."""
    info = await asyncio.to_thread(kopf.login_via_client, memo=memo, **kwargs)
    _connection(memo).set_info(info)
    return info


@kopf.on.cleanup()
async def close_api(memo: kopf.Memo, **_: Any) -> None:
    await _connection(memo).close()


# --- the children's state, kept current by watching Deployments -------------------------------


@kopf.index(
    "apps",
    "v1",
    "deployments",
    labels={status.DEPLOYMENT_LABEL: kopf.PRESENT, status.ROLE_LABEL: kopf.PRESENT},
)
def role_deployments(
    body: kopf.Body, namespace: str, labels: Mapping[str, str], **_: Any
) -> dict[tuple[str, str], status.RoleDeployment] | None:
    """(namespace, AtomDeployment name) -> summary of each role Deployment."""
    summary = status.summarize_deployment(body)
    if summary is None:
        return None
    return {(namespace, labels[status.DEPLOYMENT_LABEL]): summary}


def _owned(index: kopf.Index, namespace: str, name: str) -> list[status.RoleDeployment]:
    return list(index.get((namespace, name), []))


# --- helpers the handlers share ---------------------------------------------------------------


def retry_delay(retry: int, *, conflict: bool) -> float:
    """Backoff for a failed apply: conflicts retry from 1 s, other errors from 5 s."""
    base, cap = (1.0, 30.0) if conflict else (5.0, 300.0)
    return min(cap, base * 2 ** min(retry, 10))


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def plan(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Validate the spec and render every child, all before the first write (or SpecError)."""
    return render_children(_plain(body))


def _plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """A plain-dict copy of a kopf Body (the renderer may not accept kopf's mapping views)."""
    meta = body.get("metadata") or {}
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
            "generation": meta.get("generation"),
            "labels": dict(meta.get("labels") or {}),
            "annotations": dict(meta.get("annotations") or {}),
        },
        "spec": _thaw(body.get("spec") or {}),
    }


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_thaw(v) for v in value]
    return value


def write_status(
    body: kopf.Body,
    patch: kopf.Patch,
    deployments: Iterable[status.RoleDeployment],
    *,
    applied_generation: int | None,
    with_generation: bool,
) -> dict[str, Any]:
    """Fold status and put the changed keys into kopf's patch; returns the folded status."""
    try:
        endpoint: str | None = endpoint_url(_plain(body))
    except (SpecError, ValueError, KeyError):
        endpoint = None
    folded = status.fold_status(
        body, deployments, applied_generation=applied_generation, endpoint=endpoint, now=_now()
    )
    current = dict(body.get("status") or {})
    changes = status.status_changes(current, folded)
    if with_generation and current.get("observedGeneration") != applied_generation:
        changes["observedGeneration"] = applied_generation
    if changes:
        patch.status.update(changes)
    return folded


def _refuse_invalid(
    body: kopf.Body, patch: kopf.Patch, index: kopf.Index, error: SpecError
) -> kopf.PermanentError:
    """Report an invalid spec and return the error that ends handling of this generation."""
    meta = body.get("metadata") or {}
    write_status(
        body,
        patch,
        _owned(index, meta.get("namespace"), meta.get("name")),
        applied_generation=meta.get("generation"),
        with_generation=True,
    )
    kopf.warn(body, reason="InvalidSpec", message=f"nothing applied: {error}")
    return kopf.PermanentError(f"invalid spec, nothing applied: {error}")


def _api_failure(body: kopf.Body, error: Exception, retry: int) -> kopf.TemporaryError:
    if isinstance(error, apply.OwnershipError):
        kopf.warn(body, reason="ChildConflict", message=str(error))
        return kopf.TemporaryError(str(error), delay=retry_delay(retry, conflict=False))
    conflict = isinstance(error, apply.ApiError) and error.is_conflict
    return kopf.TemporaryError(str(error), delay=retry_delay(retry, conflict=conflict))


def _report(body: kopf.Body, results: Iterable[apply.Applied]) -> None:
    changed = [r for r in results if r.action != "unchanged"]
    if changed:
        # kopf.event, not kopf.info: posting.level keeps kopf's own INFO logs out of events,
        # and kopf.info obeys that level too.
        message = ", ".join(str(r) for r in changed)
        kopf.event(body, type="Normal", reason="Applied", message=message)


# --- change handlers --------------------------------------------------------------------------


Step = Callable[[apply.KubeAPI, list[dict[str, Any]], str], Awaitable[list[apply.Applied] | None]]


async def converge(
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    retry: int,
    role_deployments: kopf.Index,
    step: Step,
) -> list[apply.Applied] | None:
    """The one path every change takes: plan (validate and render every child), apply `step`
    to the plan, report what changed as an event, write status with observedGeneration.

    `step(api, children, uid)` does the writes and returns what happened, or None when it had
    nothing to do for this change (then nothing is reported and status is left alone).
    """
    meta = body.get("metadata") or {}
    try:
        children = plan(body)
    except SpecError as error:
        raise _refuse_invalid(body, patch, role_deployments, error) from error
    api = _connection(memo).api()
    try:
        results = await step(api, children, meta["uid"])
    except (apply.ApiError, apply.OwnershipError) as error:
        raise _api_failure(body, error, retry) from error
    if results is None:
        return None
    _report(body, results)
    write_status(
        body,
        patch,
        _owned(role_deployments, meta["namespace"], meta["name"]),
        applied_generation=meta.get("generation"),
        with_generation=True,
    )
    return results


def apply_everything(namespace: str) -> Step:
    """The reconcile step: create-or-patch every child, then delete the ones not rendered."""

    async def step(
        api: apply.KubeAPI, children: list[dict[str, Any]], uid: str
    ) -> list[apply.Applied]:
        instance = children[0]["metadata"]["labels"][status.DEPLOYMENT_LABEL]
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


async def reconcile(
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    retry: int,
    role_deployments: kopf.Index,
    logger: logging.Logger | logging.LoggerAdapter,
) -> None:
    """Render everything, then create-or-patch each child, prune, then write status."""
    namespace = (body.get("metadata") or {})["namespace"]
    results = await converge(
        body, patch, memo, retry, role_deployments, apply_everything(namespace)
    )
    logger.info("applied: %s", ", ".join(str(r) for r in results or []))
    if any(r.action != "unchanged" for r in results or []):
        # Once per change that reached the cluster, not on every resume or safety-net pass.
        for reason, message in spec_warnings(apply_defaults(_plain(body)["spec"])):
            kopf.warn(body, reason=reason, message=message)


def only_replicas_changed(diff: Iterable[Any], **_: Any) -> bool:
    """Whether every change is to spec.decode.replicas or spec.prefill.replicas."""
    paths = [tuple(change[1]) for change in diff]
    return bool(paths) and all(path in REPLICA_FIELDS for path in paths)


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, when=lambda diff, **_: not only_replicas_changed(diff))
async def on_change(
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    retry: int,
    role_deployments: kopf.Index,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """Creation, resumption after an operator restart, and any edit other than a replica
    count: the whole reconcile."""
    await reconcile(body, patch, memo, retry, role_deployments, logger)


async def scale(
    role: str,
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    retry: int,
    role_deployments: kopf.Index,
    logger: logging.Logger | logging.LoggerAdapter,
) -> None:
    """Patch only spec.replicas of the role's Deployment (whole reconcile if it is missing)."""
    spec = apply_defaults(_plain(body)["spec"])
    results = await converge(body, patch, memo, retry, role_deployments, apply_replicas(role, spec))
    if results is None and role in spec:
        logger.info("spec.%s.replicas ignored: the role's autoscaler owns it", role)


@kopf.on.field(GROUP, VERSION, PLURAL, field="spec.prefill.replicas", param="prefill")
@kopf.on.field(GROUP, VERSION, PLURAL, field="spec.decode.replicas", param="decode")
async def on_replicas(
    param: str,
    reason: str,
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    retry: int,
    role_deployments: kopf.Index,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """A change of one role's replica count; `param` names the role."""
    if reason == "update":  # creation and resumption are whole reconciles already
        await scale(param, body, patch, memo, retry, role_deployments, logger)


# --- status -----------------------------------------------------------------------------------


@kopf.timer(GROUP, VERSION, PLURAL, interval=STATUS_INTERVAL)
async def fold_children_status(
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    retry: int,
    role_deployments: kopf.Index,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """Fold the children's status into the AtomDeployment's; write only what changed.

    Also the safety net for reconciling: when status.observedGeneration lags behind
    metadata.generation (kopf folds a spec edit that lands while the creation cycle is still
    running into that cycle, and an apply can keep failing), reconcile here.
    """
    meta = body.get("metadata") or {}
    current = body.get("status") or {}
    if current.get("observedGeneration") != meta.get("generation"):
        logger.info(
            "generation %s is not applied (status.observedGeneration=%s): reconciling",
            meta.get("generation"),
            current.get("observedGeneration"),
        )
        try:
            await reconcile(body, patch, memo, retry, role_deployments, logger)
        except kopf.PermanentError:
            pass  # SpecValid=False and observedGeneration are written; nothing to retry
        return
    write_status(
        body,
        patch,
        _owned(role_deployments, meta.get("namespace"), meta.get("name")),
        applied_generation=current.get("observedGeneration"),
        with_generation=False,
    )


# --- the built-in autoscaler --------------------------------------------------------------------


def builtin_roles(spec: Mapping[str, Any]) -> list[str]:
    """Roles that autoscale with provider builtin (on a defaulted spec)."""
    return [
        role
        for role in ROLES
        if role in spec
        and spec[role]["autoscaling"]["enabled"]
        and spec[role]["autoscaling"]["provider"] == "builtin"
    ]


def _autoscaled(spec: Mapping[str, Any], **_: Any) -> bool:
    try:
        return bool(builtin_roles(apply_defaults(_thaw(spec))))
    except TypeError:
        return False


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """Running, Ready, with an IP, and not being deleted."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    state = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in state.get("conditions") or []
    )
    return ready and bool(state.get("podIP"))


def metrics_url(pod: Mapping[str, Any]) -> str:
    """http://<pod IP>:<port>/metrics, the port being the container port named `http` (the
    engine's and the router's), so a pod says itself where its metrics are."""
    ip = pod["status"]["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    port = ENGINE_HTTP_PORT
    for container in (pod.get("spec") or {}).get("containers") or []:
        for entry in container.get("ports") or []:
            if entry.get("name") == "http" and entry.get("containerPort"):
                port = int(entry["containerPort"])
                break
        else:
            continue
        break
    return f"http://{host}:{port}/metrics"


async def _scrape(session: aiohttp.ClientSession, pod: Mapping[str, Any]) -> str:
    async with session.get(metrics_url(pod)) as response:
        if response.status != 200:
            raise autoscale.MetricsError(f"/metrics answered {response.status}")
        return await response.text()


async def scrape_engine(
    session: aiohttp.ClientSession, pod: Mapping[str, Any]
) -> autoscale.PodMetrics:
    """One engine pod's metrics; a failed or unusable scrape is a PodMetrics with `error`."""
    name = pod["metadata"]["name"]
    try:
        return autoscale.parse_engine_metrics(name, await _scrape(session, pod))
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError, autoscale.MetricsError) as exc:
        return autoscale.PodMetrics(pod=name, error=f"{type(exc).__name__}: {exc}"[:200])


async def scrape_router_demand(
    session: aiohttp.ClientSession, pods: Iterable[Mapping[str, Any]]
) -> dict[str, float] | None:
    """role -> requests queued at the router pods; None when no router pod answered."""
    total: dict[str, float] | None = None
    for pod in pods:
        try:
            queued = autoscale.parse_router_queue(await _scrape(session, pod))
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError, autoscale.MetricsError):
            continue
        total = total or {}
        for role, value in queued.items():
            total[role] = total.get(role, 0.0) + value
    return total


def _decision_status(decision: autoscale.Decision, now: str, before: Mapping[str, Any]) -> dict:
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


@kopf.timer(GROUP, VERSION, PLURAL, interval=AUTOSCALE_INTERVAL, when=_autoscaled)
async def autoscale_roles(
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    role_deployments: kopf.Index,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """provider builtin: scrape each ready pod of every builtin-autoscaled role (and the router's
    queued demand), decide the role's replicas (`autoscale.decide`) and write them to its
    Deployment, the only writer of that field; record the decision in status.autoscaling and,
    when the replicas change or the role hits maxReplicas, as an event."""
    plain = _plain(body)
    try:
        validate_spec(plain["spec"])
    except SpecError:
        return  # SpecValid=False is reported by the change handlers; nothing to scale on
    spec = apply_defaults(plain["spec"])
    meta = plain["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    owned = {d.role: d for d in _owned(role_deployments, namespace, name) if d.owner_uid == uid}
    api = _connection(memo).api()
    selector = f"{status.DEPLOYMENT_LABEL}={label_value(name)}"
    try:
        pods = await api.list(f"/api/v1/namespaces/{namespace}/pods", selector)
    except apply.ApiError as error:
        logger.warning("autoscaler: cannot list pods: %s", error)
        return
    ready = [p for p in pods if pod_is_ready(p)]

    def of_role(role: str) -> list[dict[str, Any]]:
        return [
            p for p in ready if (p["metadata"].get("labels") or {}).get(status.ROLE_LABEL) == role
        ]

    histories: dict[str, autoscale.History] = memo.setdefault("autoscale_history", {})
    before = dict((body.get("status") or {}).get("autoscaling") or {})
    records: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        demand = (
            await scrape_router_demand(session, of_role("router")) if has_router(spec) else None
        )
        for role in builtin_roles(spec):
            deployment = owned.get(role)
            if deployment is None:
                continue  # the change handlers create it; nothing to scale yet
            scraped = await asyncio.gather(*(scrape_engine(session, p) for p in of_role(role)))
            policy = autoscale.Policy.from_spec(spec[role]["autoscaling"])
            decision, histories[role] = autoscale.decide(
                policy,
                now=time.monotonic(),
                current=deployment.desired,
                pods=scraped,
                router_queued=None if demand is None else demand.get(role, 0.0),
                history=histories.get(role, autoscale.History()),
            )
            previous = before.get(role) or {}
            if decision.changed:
                target = {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "metadata": {"name": deployment.name, "namespace": namespace},
                    "spec": {"replicas": decision.desired},
                }
                try:
                    await apply.scale_deployment(
                        api, target, uid, field_manager=apply.AUTOSCALER_MANAGER
                    )
                except (apply.ApiError, apply.OwnershipError) as error:
                    logger.warning("autoscaler: cannot scale %s: %s", deployment.name, error)
                    continue
                metrics = ", ".join(f"{k}={v:g}" for k, v in decision.metrics.items())
                kopf.event(
                    body,
                    type="Normal",
                    reason="Autoscaled",
                    message=f"{role}: {decision.current} -> {decision.desired} replicas: "
                    f"{decision.reason} [{metrics}]",
                )
            if decision.limited and previous.get("limited") != decision.limited:
                kopf.event(
                    body,
                    type="Warning",
                    reason="ScalingLimited",
                    message=f"{role} is at maxReplicas: {decision.reason}",
                )
            records[role] = _decision_status(decision, _now(), previous)
    for role in before:
        if role not in records:
            records[role] = None  # the role stopped autoscaling: drop its record
    changed = {
        role: record for role, record in records.items() if _thaw(before.get(role)) != record
    }
    if changed:
        patch.status["autoscaling"] = changed
