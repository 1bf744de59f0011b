"""Apply rendered child objects to the cluster: create what is missing, patch what drifted.

Create-or-patch, not server-side apply: for each child we GET the live object; a missing one is
created (POST), a live one is compared with the rendered one and receives a JSON merge patch
holding only the fields whose rendered value differs (nothing at all when it already matches).
Re-running the same render is therefore a no-op, which is what makes an operator restart
write nothing. Every write names the field manager `atom-operator`.

The rendered object is compared as a pattern: the live object must contain every rendered
field with the same value; fields the API server or other controllers added (defaults,
`status`, an HPA's `replicas`) are left alone. Lists are compared element by element
(same length, each live element containing the rendered one) and are replaced whole when they
differ, as a merge patch replaces lists. Keys dropped from a later render are not removed from
the live object (a merge patch only removes what it names as null); the children's shapes are
fixed by the renderer, so this only matters for user-set labels and annotations.

Secrets and PersistentVolumeClaims are created once and never patched (`CREATE_ONLY`): a
Secret's keys must not change under the pods that hold them, a claim's storage is not
re-specified. They are created with a plain POST, an existing one (409) left as it is, so the
operator needs `create` on Secrets and never `get`: it cannot read any Secret.

The pure part (`merge_patch`, `resource_path`) is separate from the HTTP part (`KubeAPI`,
`apply_children`, `scale_deployment`) so it can be tested without a server.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp

FIELD_MANAGER = "atom-operator"
AUTOSCALER_MANAGER = "atom-operator-autoscaler"
MERGE_PATCH = "application/merge-patch+json"

# (apiVersion, kind) -> plural, for every kind the renderer produces.
PLURALS: dict[tuple[str, str], str] = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("v1", "Secret"): "secrets",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
}
# Created when absent, never patched, never pruned (the owner reference garbage-collects them).
CREATE_ONLY = {("v1", "Secret"), ("v1", "PersistentVolumeClaim")}
# Kinds a cluster may not serve (KEDA, the Inference Extension not installed): nothing of
# theirs to prune there.
OPTIONAL_KINDS = {
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
}


class ApiError(Exception):
    """A Kubernetes API call that did not succeed; `status` is the HTTP status (0: no answer)."""

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path} -> {status}: {message}")
        self.status = status
        self.method = method
        self.path = path
        self.message = message

    @property
    def is_conflict(self) -> bool:
        return self.status == 409


class OwnershipError(Exception):
    """A child's name is taken by an object this AtomDeployment does not own."""


def resource_path(obj: Mapping[str, Any], *, named: bool = True) -> str:
    """The API path of a namespaced object (`named=False`: of its collection, for POST)."""
    api_version, kind = obj.get("apiVersion", ""), obj.get("kind", "")
    plural = PLURALS.get((api_version, kind))
    if plural is None:
        raise ValueError(f"apply: no API path known for {api_version} {kind}")
    meta = obj.get("metadata", {})
    namespace, name = meta.get("namespace"), meta.get("name")
    if not namespace or not name:
        raise ValueError(f"apply: {kind} needs metadata.namespace and metadata.name, got {meta}")
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    collection = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{collection}/{name}" if named else collection


def contains(live: Any, rendered: Any) -> bool:
    """Whether `live` holds every field of `rendered` with an equal value (see module doc)."""
    if isinstance(rendered, Mapping):
        return isinstance(live, Mapping) and all(
            key in live and contains(live[key], value) for key, value in rendered.items()
        )
    if isinstance(rendered, list):
        return (
            isinstance(live, list)
            and len(live) == len(rendered)
            and all(contains(a, b) for a, b in zip(live, rendered, strict=True))
        )
    return live == rendered


def merge_patch(live: Mapping[str, Any], rendered: Mapping[str, Any]) -> dict[str, Any]:
    """The smallest JSON merge patch that makes `live` contain `rendered`; {} when it does."""
    patch: dict[str, Any] = {}
    for key, value in rendered.items():
        current = live.get(key)
        if key not in live:
            patch[key] = value
        elif isinstance(value, Mapping) and isinstance(current, Mapping):
            nested = merge_patch(current, value)
            if nested:
                patch[key] = nested
        elif not contains(current, value):
            patch[key] = value
    return patch


def owner_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of the object's controlling owner, if any."""
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


@dataclasses.dataclass(frozen=True)
class Applied:
    """What happened to one child: created, patched (with the patch sent), unchanged, deleted."""

    kind: str
    name: str
    action: str
    patch: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.kind}/{self.name} {self.action}"


class KubeAPI:
    """JSON calls to the Kubernetes API over one aiohttp session.

    Built from the `kopf.ConnectionInfo` the operator logged in with (server, token, TLS), so
    the handlers use exactly the credentials kopf uses for its own watches.
    """

    def __init__(self, server: str, headers: Mapping[str, str], ssl: Any = None) -> None:
        self.server = server.rstrip("/")
        self._headers = dict(headers)
        self._ssl = ssl
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_connection_info(cls, info: Any) -> KubeAPI:
        """From a `kopf.ConnectionInfo` (kept untyped here so this module does not import kopf)."""
        ssl = info.as_ssl_context() if info.server.startswith("https") else None
        return cls(info.server, info.as_http_headers(), ssl)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers={**self._headers, "Accept": "application/json"},
                connector=aiohttp.TCPConnector(ssl=self._ssl if self._ssl is not None else True),
                timeout=aiohttp.ClientTimeout(total=30),
            )
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        try:
            async with self._session.request(
                method, self.server + path, data=data, headers=headers, params=params
            ) as response:
                text = await response.text()
                if response.status >= 400:
                    raise ApiError(response.status, method, path, _status_message(text))
                return json.loads(text) if text else {}
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ApiError(0, method, path, f"{type(exc).__name__}: {exc}") from exc

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object at `path`, or None when it does not exist."""
        try:
            return await self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        path = resource_path(obj, named=False)
        return await self.request("POST", path, obj, params={"fieldManager": FIELD_MANAGER})

    async def patch(
        self, path: str, patch: Mapping[str, Any], *, field_manager: str = FIELD_MANAGER
    ) -> dict[str, Any]:
        return await self.request(
            "PATCH", path, patch, content_type=MERGE_PATCH, params={"fieldManager": field_manager}
        )

    async def list(self, path: str, label_selector: str) -> list[dict[str, Any]]:
        found = await self.request("GET", path, params={"labelSelector": label_selector})
        return list(found.get("items") or [])

    async def delete(self, path: str) -> None:
        try:
            await self.request("DELETE", path, {"propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status != 404:  # already gone is what we wanted
                raise


def _status_message(text: str) -> str:
    try:
        status = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(status, dict):
        return str(status.get("message") or status.get("reason") or text[:500])
    return text[:500]


async def create_once(api: KubeAPI, rendered: Mapping[str, Any]) -> Applied:
    """Create a CREATE_ONLY child unless an object of that name exists (then: unchanged)."""
    kind, name = rendered["kind"], rendered["metadata"]["name"]
    try:
        await api.create(rendered)
    except ApiError as exc:
        if exc.status != 409:
            raise
        return Applied(kind, name, "unchanged")
    return Applied(kind, name, "created")


async def apply_child(api: KubeAPI, rendered: Mapping[str, Any], uid: str) -> Applied:
    """Create the child or patch the fields that differ; refuse objects owned by someone else."""
    kind, name = rendered["kind"], rendered["metadata"]["name"]
    if (rendered.get("apiVersion"), kind) in CREATE_ONLY:
        return await create_once(api, rendered)
    path = resource_path(rendered)
    live = await api.get(path)
    if live is None:
        await api.create(rendered)
        return Applied(kind, name, "created")
    if owner_uid(live) != uid:
        raise OwnershipError(
            f"{kind}/{name} exists and is not controlled by this AtomDeployment "
            f"(controller uid {owner_uid(live)!r}); delete or rename it"
        )
    patch = merge_patch(live, rendered)
    if not patch:
        return Applied(kind, name, "unchanged")
    await api.patch(path, patch)
    return Applied(kind, name, "patched", patch)


async def apply_children(
    api: KubeAPI, children: Iterable[Mapping[str, Any]], uid: str
) -> list[Applied]:
    """Apply every child in order (the renderer's order); stops at the first failure."""
    return [await apply_child(api, child, uid) for child in children]


async def prune_children(
    api: KubeAPI,
    rendered: Iterable[Mapping[str, Any]],
    *,
    namespace: str,
    selector: str,
    uid: str,
) -> list[Applied]:
    """Delete the children this AtomDeployment controls that `rendered` no longer contains
    (a removed prefill role, a role that stopped autoscaling). Found by `selector`, a label
    selector every child carries; objects controlled by anyone else are never touched."""
    keep = {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in rendered}
    deleted: list[Applied] = []
    for (api_version, kind), plural in PLURALS.items():
        if (api_version, kind) in CREATE_ONLY:
            continue
        prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        collection = f"{prefix}/namespaces/{namespace}/{plural}"
        try:
            found = await api.list(collection, selector)
        except ApiError as exc:
            if exc.status == 404 and (api_version, kind) in OPTIONAL_KINDS:
                continue
            raise
        for live in found:
            name = live.get("metadata", {}).get("name", "")
            if owner_uid(live) != uid or (api_version, kind, name) in keep:
                continue
            await api.delete(f"{collection}/{name}")
            deleted.append(Applied(kind, name, "deleted"))
    return deleted


async def scale_deployment(
    api: KubeAPI, rendered: Mapping[str, Any], uid: str, *, field_manager: str = FIELD_MANAGER
) -> Applied | None:
    """Set only `spec.replicas` of a rendered Deployment, if the live value differs.

    None when the Deployment does not exist: there is nothing to scale, the caller applies
    everything instead. The built-in autoscaler writes under its own `field_manager`
    (`AUTOSCALER_MANAGER`): the rendered Deployment of an autoscaled role has no `replicas`, so
    the field has exactly one writer.
    """
    replicas = rendered.get("spec", {}).get("replicas")
    if replicas is None:
        raise ValueError(f"scale: {rendered['metadata']['name']} has no spec.replicas to set")
    kind, name = rendered["kind"], rendered["metadata"]["name"]
    path = resource_path(rendered)
    live = await api.get(path)
    if live is None:
        return None
    if owner_uid(live) != uid:
        raise OwnershipError(f"{kind}/{name} exists and is not controlled by this AtomDeployment")
    if live.get("spec", {}).get("replicas") == replicas:
        return Applied(kind, name, "unchanged")
    patch = {"spec": {"replicas": replicas}}
    await api.patch(path, patch, field_manager=field_manager)
    return Applied(kind, name, "patched", patch)
