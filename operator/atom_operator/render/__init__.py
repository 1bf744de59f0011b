"""Render an AtomDeployment into the Kubernetes objects that serve it. Pure functions, no I/O.

`render_children(body)` is the entry point the kopf handlers and `atom render` call: it validates
the spec (raising `SpecError`), fills defaults and returns every child object, each owned by the
AtomDeployment when `metadata.uid` is known:

- per role (decode, and prefill in disaggregated mode): a Deployment running `atom serve`, a
  headless Service (per-pod DNS for the router and KV-event subscribers), a PodDisruptionBudget,
  and, when the role autoscales, an autoscaling/v2 HorizontalPodAutoscaler (provider hpa) or a
  KEDA ScaledObject (provider keda); provider builtin renders nothing (the operator scales);
- when the router is on (spec.router.enabled: always in disaggregated mode, opt-in when
  aggregated), a router Deployment running `atom router`, with its own ServiceAccount, Role and
  RoleBinding (list/watch on the namespace's EndpointSlices, for its discovery);
- a Gateway API Inference Extension InferencePool over the serving pods, when
  spec.inferencePool.enabled;
- NetworkPolicies over the engine pods and the router's (unless spec.networkPolicy.enabled is
  false): with a router, clients reach only the router;
- the per-deployment keys Secret (`render.keys`) when the caller passes the keys, and the
  model-cache claim of a Hugging Face source given a size (`render.model_volume`): both
  created once, never patched (`apply.CREATE_ONLY`);
- the user-facing Service, in front of the router when there is one, else of the decode pods.

Every container runs with a read-only root filesystem (writable, size-limited emptyDirs for the
cache, /tmp and /dev/shm) and CPU and memory requests and limits; engine pods get no service
account token (only the router's pod mounts one, for its EndpointSlice watch).
"""

from __future__ import annotations

from typing import Any

from atom_operator.operator_config import DEFAULT_CONFIG, OperatorConfig
from atom_operator.render.autoscalers import render_hpa, render_scaled_object
from atom_operator.render.keys import DeploymentKeys, render_keys_secret
from atom_operator.render.model_volume import render_model_cache_claim
from atom_operator.render.names import defaulted_spec
from atom_operator.render.network import render_inference_pool, render_network_policies
from atom_operator.render.roles import (
    render_pdb,
    render_role_deployment,
    render_role_service,
    render_service,
)
from atom_operator.render.router import render_router_deployment, render_router_rbac
from atom_operator.spec import ROLES, SpecError
from atom_operator.validation import validate_spec

# Kinds render_children may produce, as (apiVersion, kind, plural): what the operator lists by
# the `serving.atom.dev/deployment` label to prune children a new spec no longer renders.
CHILD_KINDS = [
    ("apps/v1", "Deployment", "deployments"),
    ("v1", "Service", "services"),
    ("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    ("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
    ("keda.sh/v1alpha1", "ScaledObject", "scaledobjects"),
    ("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    ("inference.networking.k8s.io/v1", "InferencePool", "inferencepools"),
    ("v1", "ServiceAccount", "serviceaccounts"),
    ("rbac.authorization.k8s.io/v1", "Role", "roles"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
]


def render_children(
    body: dict[str, Any],
    config: OperatorConfig = DEFAULT_CONFIG,
    keys: DeploymentKeys | None = None,
) -> list[dict[str, Any]]:
    """Validate the AtomDeployment `body` and return every child object (raises SpecError).

    `config` is the operator's installation (allowed env references, its own pods for the
    NetworkPolicy); `keys`, when given, renders the per-deployment keys Secret first (the
    operator creates it only when absent, see `render.keys`).
    """
    if not isinstance(body.get("metadata"), dict) or not body["metadata"].get("name"):
        raise SpecError("metadata.name", "is required")
    validate_spec(body.get("spec") or {}, config)
    spec = defaulted_spec(body)
    children: list[dict[str, Any]] = []
    if keys is not None:
        children.append(render_keys_secret(body, keys))
    claim = render_model_cache_claim(body, spec)
    if claim is not None:
        children.append(claim)
    for role in ROLES:
        if role not in spec:
            continue
        children += [
            render_role_deployment(body, role),
            render_role_service(body, role),
            render_pdb(body, role),
        ]
        for scaler in (render_hpa(body, role), render_scaled_object(body, role)):
            if scaler is not None:
                children.append(scaler)
    children += render_router_rbac(body)
    for extra in (render_router_deployment(body), render_inference_pool(body)):
        if extra is not None:
            children.append(extra)
    children += render_network_policies(body, config)
    children.append(render_service(body))
    return children
