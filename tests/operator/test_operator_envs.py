"""Every ATOM_OPERATOR_* variable the operator reads is defined once in atom_operator/envs.py and
listed in docs/operator.md with its default."""

from __future__ import annotations

import re
from pathlib import Path

from atom_operator import envs

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bATOM_OPERATOR_[A-Z0-9_]*[A-Z0-9]\b")


def test_every_operator_variable_is_defined_in_envs():
    defined = {var.name for var in envs.VARIABLES}
    named = {
        name: str(path.relative_to(ROOT))
        for path in (ROOT / "operator").rglob("*.py")
        if path.name != "envs.py"
        for name in NAME.findall(path.read_text())
    }
    assert {n: p for n, p in named.items() if n not in defined} == {}


def test_docs_list_every_operator_variable_with_its_default():
    doc = (ROOT / "docs" / "operator.md").read_text()
    for var in envs.VARIABLES:
        assert f"| `{var.name}` | `{var.default or 'unset'}` |" in doc, var.name
