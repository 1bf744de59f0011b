"""spec.model.source (pvc, huggingface, image): the volume, the read-only mount, --model, the
download step and the model-cache claim, each exact and valid Kubernetes; the download step's
shell passes its arguments to the real `hf download` untouched. (The CRD and validate_spec
refusing the same broken sources is in test_crd.py's tables.)"""

from __future__ import annotations

import base64
import pathlib
import subprocess
import sys
from typing import Any

import kubernetes_validate
import pytest

from atom_operator.render import render_children
from atom_operator.render.keys import DeploymentKeys
from atom_operator.render.model_volume import DOWNLOAD_SCRIPT
from atom_operator.spec import DERIVED_DEFAULTS, apply_defaults

HF = {"repo": "deepseek-ai/DeepSeek-R1", "revision": "main", "size": "1Ti",
      "tokenSecret": {"name": "hf"}}  # fmt: skip


def atomd(model: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "serving.atom.dev/v1alpha1",
        "kind": "AtomDeployment",
        "metadata": {"name": "r1", "namespace": "llm", "uid": "u-1"},
        "spec": {"model": model, **spec},
    }


def by_name(children: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def engine_pod(children: list[dict[str, Any]], role: str = "decode") -> dict[str, Any]:
    return by_name(children)[("Deployment", f"r1-{role}")]["spec"]["template"]["spec"]


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, (name, args)
    return args[args.index(name) + 1]


def validate(children: list[dict[str, Any]], versions: tuple[str, ...]) -> None:
    for child in children:
        for version in versions:
            kubernetes_validate.validate(child, version, strict=True)


def test_pvc_source_mounts_the_claim_read_only():
    children = render_children(atomd({"source": {"pvc": {"claimName": "models",
                                                          "path": "qwen/Qwen3-8B"}}}))  # fmt: skip
    pod = engine_pod(children)
    (engine,) = pod["containers"]
    assert flag(engine["args"], "--model") == "/mnt/models/qwen/Qwen3-8B"
    assert flag(engine["args"], "--served-model-name") == "Qwen3-8B"
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in (pod["volumes"])
    assert {"name": "model", "mountPath": "/mnt/models", "readOnly": True} in engine["volumeMounts"]
    assert "initContainers" not in pod
    validate(children, ("1.30",))


def test_huggingface_source_downloads_once_into_a_claim_the_replicas_share():
    keys = DeploymentKeys.generate()
    body = atomd({"name": "deepseek-r1", "source": {"huggingface": HF}}, decode={"replicas": 3})
    children = render_children(body, keys=keys)
    claim = by_name(children)[("PersistentVolumeClaim", "r1-model-cache")]
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Ti"}}
    }  # fmt: skip
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert [c["kind"] for c in children[:2]] == ["Secret", "PersistentVolumeClaim"]  # first
    pod = engine_pod(children)
    (download,) = pod["initContainers"]
    (engine,) = pod["containers"]
    directory = "/mnt/models/huggingface/deepseek-ai/DeepSeek-R1/main"
    assert download["name"] == "model-download"
    assert download["command"] == ["sh", "-c", DOWNLOAD_SCRIPT]
    assert download["args"] == ["model-download", "deepseek-ai/DeepSeek-R1", "--revision", "main",
                                "--local-dir", directory]  # fmt: skip
    assert {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}},
    } in (download["env"])
    # The token is the download step's alone; the engine reads local files.
    assert "HF_TOKEN" not in {var["name"] for var in engine["env"]}
    assert download["volumeMounts"][0] == {"name": "model", "mountPath": "/mnt/models"}
    assert {"name": "model", "mountPath": "/mnt/models", "readOnly": True} in engine["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "r1-model-cache"}} in (
        pod["volumes"]
    )
    assert flag(engine["args"], "--model") == directory
    assert flag(engine["args"], "--served-model-name") == "deepseek-r1"
    assert download["securityContext"]["readOnlyRootFilesystem"] is True
    validate(children, ("1.30", kubernetes_validate.latest_version()))


def test_huggingface_source_into_an_existing_claim_and_default_name():
    hub = {"repo": "Qwen/Qwen3-8B", "cachePVC": {"claimName": "hub-cache"}}
    children = render_children(atomd({"source": {"huggingface": hub}}))
    assert "PersistentVolumeClaim" not in {c["kind"] for c in children}
    pod = engine_pod(children)
    (engine,) = pod["containers"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "hub-cache"}} in pod["volumes"]
    assert flag(engine["args"], "--model") == "/mnt/models/huggingface/Qwen/Qwen3-8B/main"
    assert flag(engine["args"], "--served-model-name") == "Qwen/Qwen3-8B"
    assert "--revision" not in pod["initContainers"][0]["args"]


def test_image_source_is_an_image_volume():
    source = {"image": {"reference": "registry.local/models/qwen3-8b:v1", "path": "weights"}}
    children = render_children(atomd({"source": source}))
    pod = engine_pod(children)
    (engine,) = pod["containers"]
    assert {"name": "model", "image": {"reference": "registry.local/models/qwen3-8b:v1",
                                       "pullPolicy": "IfNotPresent"}} in pod["volumes"]  # fmt: skip
    assert flag(engine["args"], "--model") == "/mnt/models/weights"
    assert flag(engine["args"], "--served-model-name") == "weights"
    no_path = apply_defaults({"model": {"source": {"image": {"reference": "r.io/a/qwen3:v1"}}}})
    assert no_path["model"]["name"] == "qwen3"
    # Image volumes exist from Kubernetes 1.31 (beta, on by default since 1.33).
    validate(children, ("1.33", kubernetes_validate.latest_version()))


def test_the_pod_template_names_its_model_source():
    """A source change changes the template's annotation: ModelReady counts only pods of the
    current source."""
    one = engine_pod(render_children(atomd({"source": {"pvc": {"claimName": "a"}}})))
    annotations = [
        by_name(render_children(atomd(model)))[("Deployment", "r1-decode")]["spec"]["template"][
            "metadata"]["annotations"]["serving.atom.dev/model-source"]
        for model in ({"source": {"pvc": {"claimName": "a"}}}, {"source": {"pvc": {"claimName": "b"}}},
                      {"uri": "hf://Qwen/Qwen3-8B"})
    ]  # fmt: skip
    assert len(set(annotations)) == 3
    assert "initContainers" not in one
    assert "model.name" in DERIVED_DEFAULTS


def _run_download_step(
    tmp_path: pathlib.Path, args: list[str], tools: dict[str, str], **extra_env: str
):
    """The rendered init container's command, run by a real shell with `tools` on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, target in tools.items():
        (bin_dir / name).symlink_to(target)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf-home"), **extra_env}  # fmt: skip
    return subprocess.run(["sh", "-c", DOWNLOAD_SCRIPT, *args], env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip


def test_download_step_hands_its_arguments_to_hf_download_untouched(tmp_path):
    recorder = tmp_path / "record.sh"
    recorder.write_text('#!/bin/sh\nprintf "%s\\n" "$0" "$@" > "$RECORD"\n')
    recorder.chmod(0o755)
    pod = engine_pod(render_children(atomd({"source": {"huggingface": HF}})))
    args = pod["initContainers"][0]["args"]
    for tool in ("hf", "huggingface-cli"):  # the older CLI when `hf` is not installed
        record = tmp_path / f"{tool}.args"
        result = _run_download_step(tmp_path / tool, args, {tool: str(recorder)},
                                    RECORD=str(record))  # fmt: skip
        assert result.returncode == 0, result.stderr
        lines = record.read_text().splitlines()
        assert pathlib.Path(lines[0]).name == tool
        assert lines[1:] == ["download", *args[1:]]


def test_real_hf_cli_accepts_the_download_arguments(tmp_path):
    """The installed huggingface-hub CLI parses exactly what the operator renders: offline it
    fails for want of the files (exit 1), never with a usage error (exit 2)."""
    hf = pathlib.Path(sys.executable).parent / "hf"
    if not hf.exists():
        pytest.skip("huggingface-hub's `hf` CLI is not installed")
    pod = engine_pod(render_children(atomd({"source": {"huggingface": HF}})))
    args = pod["initContainers"][0]["args"]
    args = [a.replace("/mnt/models", str(tmp_path / "models")) for a in args]
    result = _run_download_step(tmp_path, args, {"hf": str(hf)})
    assert result.returncode == 1, result.stderr
    assert "offline" in result.stderr.lower()


def test_keys_secret_is_valid_kubernetes():
    keys = DeploymentKeys.generate()
    (secret,) = [c for c in render_children(atomd({}), keys=keys) if c["kind"] == "Secret"]
    validate([secret], ("1.30",))
    assert base64.b64decode(secret["data"]["transfer-key"]).decode() == keys.files["transfer-key"]
