"""Every `ATOM_OPERATOR_*` environment variable the operator reads, with its default.

Read when `atom_operator.handlers` is imported (kopf's timer intervals are fixed at registration).
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
