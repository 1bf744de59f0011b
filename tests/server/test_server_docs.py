"""The snippets of docs/serving.md's "Serve" section, run as written against `atom serve` on the
default model (the one smoke test that loads it; only the port is changed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def serve_snippets() -> dict[str, str]:
    section = DOC.read_text().split("## Serve\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    curl = next(code for lang, code in blocks if lang == "bash" and "curl" in code)
    python = next(code for lang, code in blocks if lang == "python")
    command = next(code for lang, code in blocks if lang == "bash" and "atom serve" in code)
    return {"curl": curl, "python": python, "command": command}


@pytest.fixture(scope="module")
def default_server(launch_module_server):
    srv = launch_module_server()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_serve_section_starts_with_atom_serve():
    assert serve_snippets()["command"].split("#")[0].strip() == ".venv/bin/atom serve"


def test_doc_curl_snippet_answers(default_server):
    curl = serve_snippets()["curl"].replace("127.0.0.1:8000", f"127.0.0.1:{default_server.port}")
    r = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["object"] == "chat.completion"
    assert body["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert body["choices"][0]["message"]["content"].strip()
    assert "Paris" in body["choices"][0]["message"]["content"]
    # The line the Serve section tells a user to wait for.
    assert re.search(r"ready in [\d.]+ s: OpenAI-compatible API at http://127\.0\.0\.1:\d+/v1",
                     default_server.log())  # fmt: skip


def test_doc_openai_snippet_answers(default_server):
    code = serve_snippets()["python"].replace("127.0.0.1:8000", f"127.0.0.1:{default_server.port}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert re.search(r"\n\[\d+ tokens\]\n$", r.stdout), r.stdout
    assert len(r.stdout.strip()) > 20
