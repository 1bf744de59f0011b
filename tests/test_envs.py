"""Every ATOM_* environment variable is defined once (an envs.py of the runtime, the kernels or
the operator) and listed in docs/configuration.md; nothing reads one by a name those modules do
not define."""

from __future__ import annotations

import re
from pathlib import Path

from atom_kernels import envs as kernel_envs
from atom_operator import envs as operator_envs
from atom_runtime import envs as runtime_envs

ROOT = Path(__file__).resolve().parents[1]
ALL = runtime_envs.VARIABLES + kernel_envs.VARIABLES + operator_envs.VARIABLES
DEFINED = {v.name for v in ALL}
NAME = re.compile(r"\bATOM_[A-Z0-9_]*[A-Z0-9]\b")


def test_every_variable_named_in_the_code_is_defined_in_an_envs_module():
    named = {}
    for root in ("runtime", "kernels", "operator"):
        for path in (ROOT / root).rglob("*.py"):
            if path.name == "envs.py":
                continue
            for name in NAME.findall(path.read_text()):
                named.setdefault(name, path.relative_to(ROOT))
    undefined = {n: str(p) for n, p in named.items() if n not in DEFINED}
    assert undefined == {}


def _row(var) -> str:
    return f"| `{var.name}` | `{var.default or 'unset'}` | {var.doc} |"


def test_the_docs_list_every_variable_as_its_module_defines_it():
    """docs/configuration.md's table is the envs modules' (runtime, kernels, operator): each
    variable's row carries its default and its doc line, and no row names a variable that no
    module defines (the ATOM_KV_EVENTS_<FIELD> family aside, documented as one row)."""
    doc = (ROOT / "docs" / "configuration.md").read_text()
    stale = [var.name for var in ALL if _row(var) not in doc.splitlines()]
    assert stale == [], "rows differing from the envs modules (default or doc)"
    rows = re.findall(r"^\| `(ATOM_[A-Z0-9_]+)` \|", doc, flags=re.MULTILINE)
    assert sorted(set(rows) - DEFINED) == []
    assert len(rows) == len(set(rows)), "a variable listed twice"


def test_the_docs_list_no_variable_the_code_does_not_define():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    listed = set(re.findall(r"^\| `(ATOM_[A-Z0-9_]*[A-Z0-9])` \|", doc, re.MULTILINE))
    assert listed - DEFINED == set()


def test_a_variable_with_choices_refuses_others_naming_itself(monkeypatch):
    monkeypatch.setenv("ATOM_SMALL_M_KERNELS", "fastest")
    try:
        runtime_envs.SMALL_M_KERNELS.value()
    except ValueError as e:
        assert str(e).startswith("ATOM_SMALL_M_KERNELS='fastest': expected one of auto")
    else:
        raise AssertionError("no error for a value outside the choices")
    monkeypatch.delenv("ATOM_SMALL_M_KERNELS")
    assert runtime_envs.SMALL_M_KERNELS.value() == "auto"
