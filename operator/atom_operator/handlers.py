"""kopf handlers for AtomDeployment: validate, render, apply, report.

Importing this module registers the handlers with kopf's default registry, so
`kopf run -m atom_operator.handlers` runs the operator (as does `atom operator run`, which
imports it). Importing the `atom_operator` package alone registers nothing: `atom render`
must not need kopf. This module only registers: each handler bundles its kopf arguments into
one `context.HandlerContext` and hands it to the module that does the work (`reconcile`,
`builtin_autoscaler`; `scrape` reads the pods' metrics).

What runs when:

- create / resume / update (any change other than a replica count): validate and render
  every child first, then create-or-patch each one (`apply.apply_children`), delete the
  children the spec no longer renders (`apply.prune_children`), then write status with
  `observedGeneration`; when a child changed, post a warning event for each choice the spec
  allows but that is most likely not meant (`validation.spec_warnings`: the router on with KV events
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
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from atom_operator import envs, status
from atom_operator.builtin_autoscaler import autoscale_pass, is_autoscaled
from atom_operator.context import HandlerContext
from atom_operator.kube_connection import connection
from atom_operator.operator_config import OperatorConfig
from atom_operator.reconcile import fold_or_reconcile, now, only_replicas_changed, reconcile, scale
from atom_operator.schema import GROUP, PLURAL, VERSION

ANNOTATION_PREFIX = GROUP  # kopf's bookkeeping annotations live under serving.atom.dev/


# --- operator-level setup ---------------------------------------------------------------------


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
    connection(memo)
    # `atom operator run` puts its configuration in the memo; `kopf run` gets the env's.
    memo.setdefault("config", OperatorConfig.from_environ())
    # --no-cluster-scan: a namespaced install holds no permission on CRDs or namespaces.
    if memo.get("cluster_scan") is False:
        settings.scanning.disabled = True


@kopf.on.login()
async def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account, else kubeconfig (as kopf's default), shared with apply."""
    info = await asyncio.to_thread(kopf.login_via_client, memo=memo, **kwargs)
    connection(memo).set_info(info)
    return info


@kopf.on.cleanup()
async def close_api(memo: kopf.Memo, **_: Any) -> None:
    await connection(memo).close()


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
    """(namespace, AtomDeployment label value) -> summary of each role Deployment."""
    summary = status.summarize_deployment(body)
    if summary is None:
        return None
    return {(namespace, labels[status.DEPLOYMENT_LABEL]): summary}


# --- changes ----------------------------------------------------------------------------------


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, when=lambda diff, **_: not only_replicas_changed(diff))
async def on_change(**kwargs: Any) -> None:
    """Creation, resumption after an operator restart, and any edit other than a replica
    count: the whole reconcile."""
    await reconcile(HandlerContext.from_kwargs(kwargs))


@kopf.on.field(GROUP, VERSION, PLURAL, field="spec.prefill.replicas", param="prefill")
@kopf.on.field(GROUP, VERSION, PLURAL, field="spec.decode.replicas", param="decode")
async def on_replicas(param: str, reason: str, **kwargs: Any) -> None:
    """A change of one role's replica count; `param` names the role."""
    if reason == "update":  # creation and resumption are whole reconciles already
        await scale(HandlerContext.from_kwargs(kwargs), param)


# --- timers -----------------------------------------------------------------------------------


@kopf.timer(GROUP, VERSION, PLURAL, interval=envs.STATUS_INTERVAL.number())
async def fold_children_status(**kwargs: Any) -> None:
    """Fold the children's status into the AtomDeployment's (or reconcile a lagging
    generation: `reconcile.fold_or_reconcile`)."""
    await fold_or_reconcile(HandlerContext.from_kwargs(kwargs))


@kopf.timer(GROUP, VERSION, PLURAL, interval=envs.AUTOSCALE_INTERVAL.number(), when=is_autoscaled)
async def autoscale_roles(**kwargs: Any) -> None:
    """provider builtin: one pass of the built-in autoscaler (`builtin_autoscaler`)."""
    await autoscale_pass(HandlerContext.from_kwargs(kwargs), now())
