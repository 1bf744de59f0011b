"""`atom operator run` and the handler helpers that need no cluster."""

from __future__ import annotations

import argparse
import subprocess
import sys

import kopf
import pytest

from atom_operator import reconcile
from atom_operator.cli import run as operator_cli
from atom_operator.operator_config import OperatorConfig


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="atom operator")
    operator_cli.add_arguments(parser)
    return parser.parse_args(argv)


def options(*argv: str) -> dict:
    """kopf.run's keyword arguments, the memo apart (returned separately)."""
    found = operator_cli.operator_options(parse(*argv))
    return found, found.pop("memo")


def test_no_namespace_means_cluster_wide(monkeypatch):
    monkeypatch.delenv("ATOM_OPERATOR_ENV_SECRETS", raising=False)
    found, memo = options("run")
    assert found == {
        "standalone": False,
        "clusterwide": True,
        "namespaces": [],
        "liveness_endpoint": None,
    }
    assert memo.config == OperatorConfig() and memo.cluster_scan is True


def test_repeated_namespaces_standalone_and_liveness():
    found, _ = options("run", "-n", "a", "--namespace", "b", "--standalone", "--liveness",
                       "http://x/h")  # fmt: skip
    assert found == {
        "standalone": True,
        "clusterwide": False,
        "namespaces": ["a", "b"],
        "liveness_endpoint": "http://x/h",
    }


def test_env_reference_flags_add_to_the_environment(monkeypatch):
    monkeypatch.setenv("ATOM_OPERATOR_ENV_SECRETS", "from-env")
    _, memo = options("run", "--allow-env-secret", "hf", "--allow-env-secret", "db",
                      "--allow-env-configmap", "cfg")  # fmt: skip
    assert memo.config.env_secrets == {"from-env", "hf", "db"}
    assert memo.config.env_config_maps == {"cfg"}


def test_no_cluster_scan_needs_plain_namespaces():
    _, memo = options("run", "-n", "llm", "--no-cluster-scan")
    assert memo.cluster_scan is False
    for argv in (("run", "--no-cluster-scan"), ("run", "-n", "team-*", "--no-cluster-scan")):
        with pytest.raises(ValueError, match="--no-cluster-scan needs --namespace"):
            operator_cli.operator_options(parse(*argv))


def test_namespace_and_all_namespaces_exclude_each_other():
    with pytest.raises(SystemExit):
        parse("run", "-n", "a", "--all-namespaces")


def test_run_starts_kopf_with_the_registered_handlers(monkeypatch):
    calls = []
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(kopf, "configure", lambda **kwargs: None)
    monkeypatch.setattr("atom_runtime.system.process.set_process_title", lambda role: role)
    assert operator_cli.run(parse("run", "-n", "ns1", "--log-level", "warning")) == 0
    assert len(calls) == 1
    registry = calls[0].pop("registry")
    assert isinstance(calls[0].pop("memo")["config"], OperatorConfig)
    assert calls[0] == {
        "standalone": False,
        "clusterwide": False,
        "namespaces": ["ns1"],
        "liveness_endpoint": None,
    }
    handlers = registry._changing.get_all_handlers()
    # One function handles creation, resumption and updates (stacked kopf decorators).
    # (a resume handler is kopf's `initial` handler with no reason of its own)
    causes = {(h.reason, bool(h.initial)) for h in handlers if h.id == "on_change"}
    assert causes == {("create", False), (None, True), ("update", False)}
    fields = {h.id: h.param for h in handlers if h.id.startswith("on_replicas")}
    assert fields == {
        "on_replicas/spec.decode.replicas": "decode",
        "on_replicas/spec.prefill.replicas": "prefill",
    }


def test_python_dash_m_atom_operator_is_atom_operator():
    result = subprocess.run(
        [sys.executable, "-m", "atom_operator", "run", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.startswith("usage: atom operator run")


@pytest.mark.parametrize(
    ("retry", "conflict", "delay"),
    [(0, True, 1.0), (3, True, 8.0), (9, True, 30.0), (0, False, 5.0), (2, False, 20.0),
     (20, False, 300.0)],
)  # fmt: skip
def test_retry_delay_backs_off_exponentially_with_a_cap(retry, conflict, delay):
    assert reconcile.retry_delay(retry, conflict=conflict) == delay


@pytest.mark.parametrize(
    ("paths", "only"),
    [
        ([("spec", "decode", "replicas")], True),
        ([("spec", "decode", "replicas"), ("spec", "prefill", "replicas")], True),
        ([("spec", "decode", "replicas"), ("spec", "engine", "args")], False),
        ([("spec", "decode")], False),
        ([], False),
    ],
)
def test_only_replicas_changed(paths, only):
    diff = [("change", path, 1, 2) for path in paths]
    assert reconcile.only_replicas_changed(diff) is only
