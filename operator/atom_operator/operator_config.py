"""What the operator's installation decides, not the AtomDeployment: which Secrets and ConfigMaps
an AtomDeployment's env may read, and who the operator is on the network.

Built from the environment (`from_environ`, names in `envs`) and `atom operator run`'s flags;
kopf handlers find it in the operator's memo; `atom render` takes the same flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

from atom_operator import envs


def _names(text: str) -> frozenset[str]:
    return frozenset(name.strip() for name in text.split(",") if name.strip())


def _labels(text: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{envs.POD_LABELS.name}: {item!r} is not key=value")
        pairs.append((key.strip(), value.strip()))
    return tuple(sorted(pairs))


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    """The operator-wide settings the renderer and the validation take as input."""

    # Secrets / ConfigMaps that engine.env and <role>.env may reference (valueFrom). Anything
    # else is refused (SpecValid=False): an AtomDeployment author must not be able to read every
    # Secret of the namespace into a pod they control the arguments of.
    env_secrets: frozenset[str] = frozenset()
    env_config_maps: frozenset[str] = frozenset()
    # Where the operator's pods are, for the NetworkPolicy peer that lets them scrape /metrics.
    namespace: str = ""
    pod_labels: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> OperatorConfig:
        def read(var: envs.EnvVar) -> str:
            return (environ.get(var.name, "") or var.default).strip()

        return cls(
            env_secrets=_names(read(envs.ENV_SECRETS)),
            env_config_maps=_names(read(envs.ENV_CONFIG_MAPS)),
            namespace=read(envs.NAMESPACE),
            pod_labels=_labels(read(envs.POD_LABELS)),
        )

    def allowing(
        self, secrets: Iterable[str] = (), config_maps: Iterable[str] = ()
    ) -> OperatorConfig:
        """This configuration with more allowed Secret and ConfigMap names (command-line flags)."""
        return dataclasses.replace(
            self,
            env_secrets=self.env_secrets | frozenset(secrets),
            env_config_maps=self.env_config_maps | frozenset(config_maps),
        )

    def operator_peer(self) -> dict[str, Any] | None:
        """A NetworkPolicyPeer selecting the operator's pods; None when they are not known."""
        if not self.namespace or not self.pod_labels:
            return None
        return {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": self.namespace}},
            "podSelector": {"matchLabels": dict(self.pod_labels)},
        }


DEFAULT_CONFIG = OperatorConfig()


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `atom operator run` and `atom render` that extend `OperatorConfig`."""
    parser.add_argument(
        "--allow-env-secret",
        action="append",
        default=[],
        metavar="NAME",
        help="a Secret that engine.env / <role>.env may read with valueFrom.secretKeyRef "
        f"(repeatable; added to ${envs.ENV_SECRETS.name}); none by default",
    )
    parser.add_argument(
        "--allow-env-configmap",
        action="append",
        default=[],
        metavar="NAME",
        help="a ConfigMap that engine.env / <role>.env may read with valueFrom.configMapKeyRef "
        f"(repeatable; added to ${envs.ENV_CONFIG_MAPS.name}); none by default",
    )


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> OperatorConfig:
    return OperatorConfig.from_environ(environ).allowing(
        args.allow_env_secret, args.allow_env_configmap
    )
