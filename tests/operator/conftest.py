"""A Kubernetes API for the operator tests: kmock's emulator with the server-side bookkeeping
the operator relies on, plus a helper that runs the real kopf operator in-process against it.

kmock's `KubernetesEmulator` stores objects and streams watch events over a real local HTTP
server, but it leaves `uid`, `resourceVersion`, `generation` and the namespace of a created
object to the client, merges status writes into the main object and ignores label selectors.
`ClusterEmulator` fills those in the way a real API server does, so kopf and the handlers see
the same shapes they see on a cluster. Everything here is test-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import os
import pathlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import kmock
import pytest
import pytest_asyncio
import yaml

# The status timer's interval is read when atom_operator.handlers is imported: keep it short so
# status follows child changes within a test's patience.
os.environ.setdefault("ATOM_OPERATOR_STATUS_INTERVAL", "0.3")
os.environ.setdefault("ATOM_OPERATOR_AUTOSCALE_INTERVAL", "0.3")

import kopf  # noqa: E402
from kubernetes.config import kube_config  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "atomdeployments.serving.atom.dev.yaml"
NAMESPACE = "ns1"

ATOMD = "serving.atom.dev/v1alpha1/atomdeployments"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
PDBS = "policy/v1/poddisruptionbudgets"
HPAS = "autoscaling/v2/horizontalpodautoscalers"
SCALEDOBJECTS = "keda.sh/v1alpha1/scaledobjects"
NETWORKPOLICIES = "networking.k8s.io/v1/networkpolicies"
INFERENCEPOOLS = "inference.networking.k8s.io/v1/inferencepools"
SERVICEACCOUNTS = "v1/serviceaccounts"
ROLES = "rbac.authorization.k8s.io/v1/roles"
ROLEBINDINGS = "rbac.authorization.k8s.io/v1/rolebindings"
PODS = "v1/pods"
SECRETS = "v1/secrets"
PVCS = "v1/persistentvolumeclaims"
EVENTS = "v1/events"
NAMESPACES = "v1/namespaces"
CRDS = "apiextensions.k8s.io/v1/customresourcedefinitions"
CHILD_RESOURCES = (
    DEPLOYMENTS, SERVICES, PDBS, HPAS, SCALEDOBJECTS, NETWORKPOLICIES, INFERENCEPOOLS,
    SERVICEACCOUNTS, ROLES, ROLEBINDINGS,
)  # fmt: skip

# Built-in kinds the operator touches; all of them have a status subresource on a real cluster
# except Services' status being irrelevant here, PDBs and events.
BUILTINS: dict[str, dict[str, Any]] = {
    DEPLOYMENTS: {"kind": "Deployment", "namespaced": True, "subresources": {"status", "scale"}},
    SERVICES: {"kind": "Service", "namespaced": True, "subresources": {"status"}},
    PDBS: {"kind": "PodDisruptionBudget", "namespaced": True, "subresources": {"status"}},
    HPAS: {"kind": "HorizontalPodAutoscaler", "namespaced": True, "subresources": {"status"}},
    SCALEDOBJECTS: {"kind": "ScaledObject", "namespaced": True, "subresources": {"status"}},
    NETWORKPOLICIES: {"kind": "NetworkPolicy", "namespaced": True},
    INFERENCEPOOLS: {"kind": "InferencePool", "namespaced": True, "subresources": {"status"}},
    SERVICEACCOUNTS: {"kind": "ServiceAccount", "namespaced": True},
    ROLES: {"kind": "Role", "namespaced": True},
    ROLEBINDINGS: {"kind": "RoleBinding", "namespaced": True},
    PODS: {"kind": "Pod", "namespaced": True, "subresources": {"status"}},
    SECRETS: {"kind": "Secret", "namespaced": True},
    PVCS: {"kind": "PersistentVolumeClaim", "namespaced": True, "subresources": {"status"}},
    EVENTS: {"kind": "Event", "namespaced": True},
    # kopf waits for namespaces to be discoverable before it watches anything.
    NAMESPACES: {"kind": "Namespace", "namespaced": False},
    CRDS: {"kind": "CustomResourceDefinition", "namespaced": False},
}
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


def crd_resource_info() -> tuple[str, dict[str, Any]]:
    """The AtomDeployment resource as the CRD file declares it (the single source of truth)."""
    crd = yaml.safe_load(CRD_PATH.read_text())
    spec = crd["spec"]
    version = next(v for v in spec["versions"] if v.get("served", True))
    names = spec["names"]
    key = f"{spec['group']}/{version['name']}/{names['plural']}"
    info = {
        "kind": names["kind"],
        "singular": names.get("singular", names["kind"].lower()),
        "namespaced": spec["scope"] == "Namespaced",
        "shortnames": set(names.get("shortNames", [])),
        "categories": set(names.get("categories", [])),
        "subresources": set(version.get("subresources", {})),
    }
    return key, info


def _label_selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality (`k=v`, `k==v`, `k!=v`) and existence (`k`, `!k`) terms, comma-joined (AND)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@attrs.define(kw_only=True)
class ClusterEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus uid/resourceVersion/generation/namespace, status-subresource
    semantics and label selectors on list and watch."""

    _versions: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)

    def _has_status_subresource(self, resource: kmock.resource) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and isinstance(request.data, (dict, list)):
            self._fill_server_fields(request)
        return await super()._handle(request)

    def _fill_server_fields(self, request: kmock.Request) -> None:
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            if request.namespace is not None:
                meta["namespace"] = request.namespace
            meta["uid"] = str(uuid.uuid4())
            meta["resourceVersion"] = str(next(self._versions))
            meta["generation"] = 1
            meta["creationTimestamp"] = _now()
        elif request.action == kmock.action.UPDATE and request.name is not None:
            key = (request.resource, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                return  # the emulator answers 404 itself
            current = self.objects[key].raw
            if isinstance(request.data, list):
                self._fill_json_patch(request.data, current)
            else:
                self._fill_merge_patch(request, current)

    def _fill_json_patch(self, ops: list[dict[str, Any]], current: dict[str, Any]) -> None:
        """kopf guards its JSON patches with a `test` of resourceVersion; a stale one is a 422."""
        version = current.get("metadata", {}).get("resourceVersion")
        for op in ops:
            if op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion":
                if op.get("value") != version:
                    raise kmock.KubernetesError(422, "Invalid", "resourceVersion test failed")
        ops.append(
            {
                "op": "replace",
                "path": "/metadata/resourceVersion",
                "value": str(next(self._versions)),
            }
        )

    def _fill_merge_patch(self, request: kmock.Request, current: dict[str, Any]) -> None:
        data: dict[str, Any] = request.data
        if self._has_status_subresource(request.resource):
            # A real API server takes only status from /status and everything but status
            # from the main endpoint.
            if request.subresource == "status":
                for field in list(data):
                    if field not in ("status", "metadata"):
                        del data[field]
            else:
                data.pop("status", None)
        meta = data.setdefault("metadata", {})
        expected = meta.pop("resourceVersion", None)
        if expected is not None and expected != current.get("metadata", {}).get("resourceVersion"):
            raise kmock.KubernetesError(409, "Conflict", "the object has been modified")
        for field in ("uid", "generation", "creationTimestamp", "namespace", "name"):
            meta.pop(field, None)
        if request.subresource == "status":
            meta.clear()
        meta["resourceVersion"] = str(next(self._versions))
        if "spec" in data and request.subresource is None:
            patched = kmock.Object(copy.deepcopy(current))
            patched.patch({"spec": data["spec"]})
            if patched.raw.get("spec") != current.get("spec"):
                meta["generation"] = current.get("metadata", {}).get("generation", 1) + 1

    async def _serve_list(self, request: kmock.Request) -> Any:
        payload = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            payload["items"] = [
                item
                for item in payload["items"]
                if _label_selector_matches(selector, item.get("metadata", {}).get("labels") or {})
            ]
        payload["metadata"]["resourceVersion"] = str(next(self._versions))
        return payload

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        selector = request.params.get("labelSelector")
        async for event in super()._serve_watch(request):
            if selector and isinstance(event, dict):
                labels = event.get("object", {}).get("metadata", {}).get("labels") or {}
                if not _label_selector_matches(selector, labels):
                    continue
            yield event


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define
class Cluster:
    """What a test needs of the emulated cluster: its objects and a client to change them."""

    api: ClusterEmulator
    url: str

    def get(self, resource: str, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
        key = (kmock.resource(resource), namespace, name)
        if key not in self.api.objects or self.api.objects[key].deleted:
            return None
        return copy.deepcopy(self.api.objects[key].raw)

    def names(self, resource: str, namespace: str = NAMESPACE) -> list[str]:
        return sorted(
            name
            for (res, ns, name), obj in self.api.objects.items()
            if res == kmock.resource(resource) and ns == namespace and not obj.deleted
        )

    def versions(self, resource: str, name: str, namespace: str = NAMESPACE) -> int:
        """How many times the object was written (create + patches)."""
        history = self.api.objects[kmock.resource(resource), namespace, name].history
        return sum(1 for version in history if version is not None)

    def writes(self) -> list[kmock.Request]:
        """Every create/patch/delete of a child object, in order (status writes excluded: in
        these tests only the test itself, playing the Deployment controller, makes those). The
        create-once Secret and claim are not children here: their POST is sent on every
        reconcile and answered 409 once they exist; `versions` counts what was stored."""
        children = [kmock.resource(r) for r in CHILD_RESOURCES]
        actions = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)
        return [
            r
            for r in self.api
            if r.resource in children and r.action in actions and r.subresource is None
        ]

    def events(self) -> list[tuple[str, str, str]]:
        """(type, reason, message) of every Kubernetes event posted, in order."""
        return [
            (r.data.get("type"), r.data.get("reason"), r.data.get("message"))
            for r in self.api
            if r.resource == kmock.resource(EVENTS) and r.action == kmock.action.CREATE
        ]

    async def request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self.api.request(method, path, json=body, headers=headers) as resp:
            payload = await resp.json()
            if resp.status >= 400:
                raise RuntimeError(f"{method} {path} -> {resp.status}: {payload}")
            return payload

    async def create_atomd(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {
            "apiVersion": "serving.atom.dev/v1alpha1",
            "kind": "AtomDeployment",
            "metadata": {"name": name},
            "spec": spec,
        }
        return await self.request(
            "POST", f"/apis/serving.atom.dev/v1alpha1/namespaces/{NAMESPACE}/atomdeployments", body
        )

    async def patch_atomd(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        path = f"/apis/serving.atom.dev/v1alpha1/namespaces/{NAMESPACE}/atomdeployments/{name}"
        return await self.request("PATCH", path, patch)

    async def set_deployment_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Play the Deployment controller: write the status subresource of a Deployment."""
        path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}/status"
        return await self.request("PATCH", path, {"status": status})

    def atomd(self, name: str) -> dict[str, Any]:
        obj = self.get(ATOMD, name)
        if obj is None:
            raise LookupError(f"AtomDeployment {name} does not exist")
        return obj


async def eventually(
    check: Callable[[], Any], *, timeout: float = 10.0, interval: float = 0.05
) -> Any:
    """Poll `check` until it returns a truthy value without raising; re-raise the last failure."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
            failure: BaseException = AssertionError(f"still falsy: {result!r}")
        except (AssertionError, KeyError, LookupError, TypeError) as exc:
            failure = exc
        if time.monotonic() > deadline:
            raise failure
        await asyncio.sleep(interval)


@pytest_asyncio.fixture()
async def cluster(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Cluster]:
    """A fresh emulated cluster; KUBECONFIG points at it, as it would for a local operator."""
    async with ClusterEmulator() as api, kmock.Server(api):
        key, info = crd_resource_info()
        api.resources[key] = kmock.ResourceInfo(verbs=VERBS, **info)
        for resource, builtin in BUILTINS.items():
            api.resources[resource] = kmock.ResourceInfo(verbs=VERBS, **builtin)
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        api.objects[NAMESPACES, None, NAMESPACE] = namespace
        crd = yaml.safe_load(CRD_PATH.read_text())
        api.objects[CRDS, None, crd["metadata"]["name"]] = crd
        url = str(api.url).rstrip("/")
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock-token"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
            "current-context": "kmock",
        }
        path = tmp_path / "kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig))
        monkeypatch.setenv("KUBECONFIG", str(path))
        # The kubernetes client reads $KUBECONFIG once, when it is imported.
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield Cluster(api=api, url=url)


@contextlib.asynccontextmanager
async def running_operator(*, timeout: float = 15.0) -> AsyncIterator[None]:
    """Run the real kopf operator (the handlers of atom_operator) until the block exits.

    The operator gets its own thread and event loop, as in production: at exit kopf waits for
    every task started in its loop after it started, which would include the emulator's
    never-ending watch-stream responses if both shared one loop.
    """
    import atom_operator.handlers  # noqa: F401  (registers the handlers on import)

    settings = kopf.OperatorSettings()
    # kmock cannot route GET /api/v1/namespaces (it reads "namespaces" as a namespace name), so
    # kopf must not scan namespaces/CRDs; it still discovers the resources through /api, /apis.
    settings.scanning.disabled = True
    # How long kopf waits for its own patch to come back through the watch before it goes on
    # anyway (5 s by default): a missed wait then costs a test 1 s, not 5.
    settings.persistence.consistency_timeout = 1.0
    stop, ready = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def operate() -> None:
        try:
            asyncio.run(
                kopf.operator(
                    registry=kopf.get_default_registry(),
                    settings=settings,
                    standalone=True,
                    namespaces=[NAMESPACE],
                    stop_flag=stop,
                    ready_flag=ready,
                )
            )
        except BaseException as exc:  # reported by the test thread below
            failure.append(exc)

    thread = threading.Thread(target=operate, name="kopf-operator", daemon=True)
    thread.start()
    try:
        if not await asyncio.to_thread(ready.wait, timeout):
            raise TimeoutError(f"the operator was not ready within {timeout}s: {failure}")
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, timeout)
        if thread.is_alive():
            raise TimeoutError(f"the operator did not stop within {timeout}s")
    if failure:
        raise failure[0]


@pytest.fixture()
def operator_running() -> Callable[..., contextlib.AbstractAsyncContextManager[Any]]:
    return running_operator
