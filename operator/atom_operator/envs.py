"""Every `ATOM_OPERATOR_*` environment variable the operator reads, with its default.

The intervals are read when `atom_operator.handlers` is imported (kopf fixes a timer's interval
when it registers it); the others when the operator starts (`OperatorConfig.from_environ`).
"""

from __future__ import annotations

import os


def _seconds(name: str, default: float) -> float:
    return float(os.environ.get(name, str(default)))


# How often each AtomDeployment's status is folded from its children (and a lagging generation
# reconciled).
STATUS_INTERVAL = _seconds("ATOM_OPERATOR_STATUS_INTERVAL", 10.0)
# How often the built-in autoscaler scrapes and decides, for roles on provider builtin.
AUTOSCALE_INTERVAL = _seconds("ATOM_OPERATOR_AUTOSCALE_INTERVAL", 10.0)
# The time limit of one /metrics scrape of one pod.
SCRAPE_TIMEOUT = _seconds("ATOM_OPERATOR_SCRAPE_TIMEOUT", 3.0)

# Comma-separated Secret names an AtomDeployment's engine.env / <role>.env may read with
# valueFrom.secretKeyRef (default: none). `atom operator run --allow-env-secret NAME` adds to it.
ENV_SECRETS = "ATOM_OPERATOR_ENV_SECRETS"
# The same for ConfigMaps (valueFrom.configMapKeyRef); `--allow-env-configmap NAME`.
ENV_CONFIG_MAPS = "ATOM_OPERATOR_ENV_CONFIGMAPS"
# The operator's own namespace and pod labels (`k=v,k2=v2`), set by the chart from the downward
# API: the NetworkPolicy of a routed deployment lets these pods scrape the engines' /metrics.
# Unset: no such peer is rendered (the built-in autoscaler then cannot scrape routed engines).
NAMESPACE = "ATOM_OPERATOR_NAMESPACE"
POD_LABELS = "ATOM_OPERATOR_POD_LABELS"
