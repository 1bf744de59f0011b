"""One handler call for an AtomDeployment, as one object: what kopf hands over (the object, the
patch kopf writes back, the operator's memo, the retry count, the logger, the index of the
children's Deployments) and what every handler derives from it."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from atom_operator import apply, status
from atom_operator.kube_connection import connection
from atom_operator.model_readiness import ModelPod, summarize_pod
from atom_operator.operator_config import OperatorConfig
from atom_operator.render.names import DEPLOYMENT_LABEL, label_value


def thaw(value: Any) -> Any:
    """A plain-dict/list copy of kopf's read-only mapping views."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, list):
        return [thaw(v) for v in value]
    return value


@dataclasses.dataclass
class HandlerContext:
    """The arguments of one kopf handler call, bundled; build it with `from_kwargs`."""

    body: kopf.Body
    patch: kopf.Patch
    memo: kopf.Memo
    logger: logging.Logger | logging.LoggerAdapter
    deployments: Mapping[Any, Any]  # the `role_deployments` index
    retry: int = 0

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> HandlerContext:
        """From the keyword arguments kopf passes a handler (`**kwargs`)."""
        return cls(
            body=kwargs["body"],
            patch=kwargs["patch"],
            memo=kwargs["memo"],
            logger=kwargs["logger"],
            deployments=kwargs["role_deployments"],
            retry=int(kwargs.get("retry") or 0),
        )

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.body.get("metadata") or {}

    @property
    def namespace(self) -> str:
        return self.meta.get("namespace")

    @property
    def name(self) -> str:
        return self.meta.get("name")

    @property
    def uid(self) -> str:
        return self.meta.get("uid")

    @property
    def generation(self) -> int | None:
        return self.meta.get("generation")

    def plain(self) -> dict[str, Any]:
        """A plain-dict copy of the body (the renderer may not accept kopf's mapping views)."""
        meta = self.meta
        return {
            "apiVersion": self.body.get("apiVersion"),
            "kind": self.body.get("kind"),
            "metadata": {
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "generation": meta.get("generation"),
                "labels": dict(meta.get("labels") or {}),
                "annotations": dict(meta.get("annotations") or {}),
            },
            "spec": thaw(self.body.get("spec") or {}),
        }

    def api(self) -> apply.KubeAPI:
        return connection(self.memo).api()

    @property
    def config(self) -> OperatorConfig:
        """The operator's configuration (put in the memo at startup, or read from the env)."""
        return self.memo.setdefault("config", OperatorConfig.from_environ())

    async def pods(self) -> list[dict[str, Any]] | None:
        """This AtomDeployment's pods, listed by label (no cluster-wide pod watch); None when
        the API did not answer (logged; the caller skips this pass)."""
        selector = f"{DEPLOYMENT_LABEL}={label_value(self.name)}"
        try:
            return await self.api().list(f"/api/v1/namespaces/{self.namespace}/pods", selector)
        except apply.ApiError as error:
            self.logger.warning("cannot list the pods of %s: %s", self.name, error)
            return None

    async def model_pods(self) -> list[ModelPod] | None:
        """The engine pods' model state; None when unknown (ModelReady keeps its verdict)."""
        pods = await self.pods()
        return None if pods is None else [p for p in map(summarize_pod, pods) if p is not None]

    def owned_deployments(self) -> list[status.RoleDeployment]:
        """The index's summaries of the Deployments labelled with this AtomDeployment's name
        (the label value: long names are shortened with a hash)."""
        return list(self.deployments.get((self.namespace, label_value(self.name)), []))
