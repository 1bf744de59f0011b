"""The AtomDeployment API: its OpenAPI v3 schema, CEL rules and CustomResourceDefinition.

This package is the one place the API's fields, bounds and static defaults are written down.
`crds/atomdeployments.serving.atom.dev.yaml` is generated from `crd.crd()` (run
`python -m atom_operator.schema > crds/atomdeployments.serving.atom.dev.yaml`; a test fails when the
committed file drifts), and `atom_operator.spec` walks the same `SPEC_SCHEMA` to default and
validate a spec in Python, so the API server and the operator apply the same rules.

Defaults that depend on another field (the engine image on the vendor, the tolerations on the
vendor, ...) cannot be expressed in a CRD; they live in `atom_operator.spec.DERIVED_DEFAULTS`.
"""

from __future__ import annotations

from atom_operator.schema.api import (
    API_VERSION,
    CRD_NAME,
    ENGINE_HTTP_PORT,
    GROUP,
    IMAGE_PATTERN,
    KIND,
    MODEL_URI_PATTERN,
    PLURAL,
    VERSION,
)
from atom_operator.schema.atomdeployment import SPEC_SCHEMA
from atom_operator.schema.crd import STATUS_SCHEMA, crd, crd_yaml

__all__ = [
    "API_VERSION",
    "CRD_NAME",
    "ENGINE_HTTP_PORT",
    "GROUP",
    "IMAGE_PATTERN",
    "KIND",
    "MODEL_URI_PATTERN",
    "PLURAL",
    "SPEC_SCHEMA",
    "STATUS_SCHEMA",
    "VERSION",
    "crd",
    "crd_yaml",
]
