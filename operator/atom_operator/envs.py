"""Every `ATOM_OPERATOR_*` environment variable the operator reads, defined once with its
default and what it does (the project's `EnvVar`, as atom_runtime/envs.py; docs/operator.md
lists them). Each is read when asked (`VAR.value()`), except where its doc says "read at import".
"""

from __future__ import annotations

from atom_runtime.envs import EnvVar  # the project's one definition of an environment variable

STATUS_INTERVAL = EnvVar(
    "ATOM_OPERATOR_STATUS_INTERVAL",
    "10",
    "Seconds between status passes over each AtomDeployment (fold the children's status, list "
    "its pods for ModelReady, reconcile a lagging generation). Read at import.",
)
AUTOSCALE_INTERVAL = EnvVar(
    "ATOM_OPERATOR_AUTOSCALE_INTERVAL",
    "10",
    "Seconds between passes of the built-in autoscaler (provider builtin). Read at import.",
)
SCRAPE_TIMEOUT = EnvVar(
    "ATOM_OPERATOR_SCRAPE_TIMEOUT",
    "3",
    "Seconds one /metrics scrape of one pod may take.",
)
ENV_SECRETS = EnvVar(
    "ATOM_OPERATOR_ENV_SECRETS",
    "",
    "Comma-separated Secret names an AtomDeployment's engine.env / <role>.env may read with "
    "valueFrom.secretKeyRef (`atom operator run --allow-env-secret NAME` adds to it). Unset: "
    "none.",
)
ENV_CONFIG_MAPS = EnvVar(
    "ATOM_OPERATOR_ENV_CONFIGMAPS",
    "",
    "The same for ConfigMaps (valueFrom.configMapKeyRef; `--allow-env-configmap NAME`).",
)
NAMESPACE = EnvVar(
    "ATOM_OPERATOR_NAMESPACE",
    "",
    "The operator's own namespace (the chart sets it from the downward API): with "
    "ATOM_OPERATOR_POD_LABELS, the NetworkPolicy of a routed deployment admits these pods to "
    "the engines' /metrics. Unset: no such peer (the built-in autoscaler cannot scrape them).",
)
POD_LABELS = EnvVar(
    "ATOM_OPERATOR_POD_LABELS",
    "",
    "The operator pods' labels, `key=value,key2=value2` (set by the chart).",
)

VARIABLES = (STATUS_INTERVAL, AUTOSCALE_INTERVAL, SCRAPE_TIMEOUT, ENV_SECRETS, ENV_CONFIG_MAPS,
             NAMESPACE, POD_LABELS)  # fmt: skip
