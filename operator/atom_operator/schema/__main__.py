"""`python -m atom_operator.schema > crds/atomdeployments.serving.atom.dev.yaml`."""

from __future__ import annotations

import sys

from atom_operator.schema.crd import crd_yaml

sys.stdout.write(crd_yaml())
