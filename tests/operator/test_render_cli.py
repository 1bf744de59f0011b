"""`atom render` through the real console script, as a user runs it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
ATOM = pathlib.Path(sys.executable).parent / "atom"
CPU_EXAMPLE = REPO / "examples" / "cpu-smollm2.yaml"


def atom_render(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ATOM), "render", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_renders_a_file_as_multi_document_yaml():
    result = atom_render("-f", str(CPU_EXAMPLE))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("---\n")
    docs = list(yaml.safe_load_all(result.stdout))
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("Secret", "smollm2-atom-keys"),
        ("Deployment", "smollm2-decode"),
        ("Service", "smollm2-decode"),
        ("PodDisruptionBudget", "smollm2-decode"),
        ("NetworkPolicy", "smollm2"),
        ("Service", "smollm2"),
    ]
    assert {d["metadata"]["namespace"] for d in docs} == {"default"}
    assert "ownerReferences" not in docs[0]["metadata"]  # no uid outside a cluster
    # Fresh keys on every render; --no-keys-secret leaves the Secret out for re-renders.
    again = yaml.safe_load_all(atom_render("-f", str(CPU_EXAMPLE)).stdout)
    assert next(again)["data"]["transfer-key"] != docs[0]["data"]["transfer-key"]
    without = atom_render("-f", str(CPU_EXAMPLE), "--no-keys-secret")
    assert [d["kind"] for d in yaml.safe_load_all(without.stdout)] == [d["kind"] for d in docs[1:]]


def test_env_references_need_the_operators_allowance():
    doc = yaml.safe_load(CPU_EXAMPLE.read_text())
    doc["spec"]["engine"]["env"] = [
        {"name": "T", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    ]
    text = yaml.safe_dump(doc)
    refused = atom_render("-f", "-", stdin=text)
    assert refused.returncode == 2
    assert refused.stderr.startswith(
        "atom render: error: <stdin>: spec.engine.env[0].valueFrom.secretKeyRef.name: "
        "Secret 'hf' is not one"
    )
    allowed = atom_render("-f", "-", "--allow-env-secret", "hf", stdin=text)
    assert allowed.returncode == 0, allowed.stderr


def test_reads_several_documents_from_stdin_with_a_default_namespace():
    two = """
apiVersion: serving.atom.dev/v1alpha1
kind: AtomDeployment
metadata: {name: one}
spec: {accelerator: {vendor: cpu}}
---
apiVersion: serving.atom.dev/v1alpha1
kind: AtomDeployment
metadata: {name: two, namespace: team-b}
spec: {accelerator: {vendor: nvidia}, prefill: {}}
"""
    result = atom_render("-f", "-", "--namespace", "team-a", stdin=two)
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert [(d["kind"], d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs] == [
        ("Secret", "team-a", "one-atom-keys"),
        ("Deployment", "team-a", "one-decode"),
        ("Service", "team-a", "one-decode"),
        ("PodDisruptionBudget", "team-a", "one-decode"),
        ("NetworkPolicy", "team-a", "one"),
        ("Service", "team-a", "one"),
        ("Secret", "team-b", "two-atom-keys"),
        ("Deployment", "team-b", "two-decode"),
        ("Service", "team-b", "two-decode"),
        ("PodDisruptionBudget", "team-b", "two-decode"),
        ("Deployment", "team-b", "two-prefill"),
        ("Service", "team-b", "two-prefill"),
        ("PodDisruptionBudget", "team-b", "two-prefill"),
        ("ServiceAccount", "team-b", "two-router"),
        ("Role", "team-b", "two-router"),
        ("RoleBinding", "team-b", "two-router"),
        ("Deployment", "team-b", "two-router"),
        ("NetworkPolicy", "team-b", "two"),
        ("NetworkPolicy", "team-b", "two-router"),
        ("Service", "team-b", "two"),
    ]


def test_invalid_spec_exits_2_naming_the_file_and_the_field():
    path = REPO / "examples" / "invalid" / "state-checkpoint-interval.yaml"
    result = atom_render("-f", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        f"atom render: error: {path}: spec.stateCheckpoint.intervalTokens: must be a multiple "
        "of spec.engine.blockSize (16), got 100\n"
    )


def test_one_invalid_document_prints_nothing():
    text = (
        CPU_EXAMPLE.read_text()
        + "\n---\n"
        + (REPO / "examples" / "invalid" / "vendor-unknown.yaml").read_text()
    )
    result = atom_render("-f", "-", stdin=text)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(  # which of the two documents, by place and name
        "atom render: error: <stdin>: document 2 (bad-vendor): spec.accelerator.vendor: "
        "must be one of amd, nvidia, cpu"
    )


def test_other_kinds_and_missing_files_are_errors():
    result = atom_render("-f", "-", stdin="apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    assert (result.returncode, result.stderr) == (
        2,
        "atom render: error: <stdin>: document 1 is a ConfigMap, not an AtomDeployment\n",
    )
    missing = atom_render("-f", "/nonexistent/atomd.yaml")
    assert (missing.returncode, missing.stdout, missing.stderr) == (
        2,
        "",
        "atom render: error: /nonexistent/atomd.yaml: cannot read it: No such file or directory\n",
    )


def test_bad_yaml_is_one_line_naming_the_file_and_the_problem(tmp_path):
    """A YAML mistake prints the file, the line and column, and what PyYAML found, in one line
    (no traceback, no "<unicode string>"), and exits 2."""
    path = tmp_path / "atomd.yaml"
    path.write_text("apiVersion: serving.atom.dev/v1alpha1\n  kind: AtomDeployment\n")
    result = atom_render("-f", str(path))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"atom render: error: {path}: line 2, column 7: invalid YAML: "
        "mapping values are not allowed here\n"
    )
    unclosed = atom_render("-f", "-", stdin="spec: {accelerator: [cpu\n")
    assert unclosed.returncode == 2
    assert unclosed.stderr.startswith("atom render: error: <stdin>: line 2, column 1: invalid YAML")
    assert len(unclosed.stderr.splitlines()) == 1 and "Traceback" not in unclosed.stderr
