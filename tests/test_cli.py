import subprocess

import pytest

from atom_runtime.bench.processes import ATOM
from atom_runtime.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_command_exits_nonzero(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_no_command_prints_usage_and_fails(capsys):
    assert main([]) == 2
    assert "usage: atom" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_flags(flag):
    assert main([flag]) == 0


PP_REFUSED = "pipeline_parallel_size: must be 1, got 2: pipeline parallelism is not supported"


def _atom(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ATOM), *args], capture_output=True, text=True, timeout=300)


def test_pipeline_parallelism_is_refused_at_start_up_in_one_line(tiny_hybrid_models):
    """vLLM's --pipeline-parallel-size/-pp parses, and anything but 1 ends the command before
    it loads a model: exit 2, one line on stderr, no traceback. For a hybrid model the line also
    says its state slots and checkpoints need every layer in one stage."""
    hybrid = _atom(
        "serve", "--model", str(tiny_hybrid_models["qwen3_5"]), "--pipeline-parallel-size", "2"
    )
    plain = _atom("generate", "--prompt", "x", "-pp", "2")
    for proc, command in ((hybrid, "serve"), (plain, "generate")):
        assert proc.returncode == 2, proc.stderr
        assert proc.stdout == ""
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"atom {command}: error: {PP_REFUSED} (split a model across GPUs")
    assert "is a hybrid model, and its state slots and checkpoints need every layer in one " in (
        hybrid.stderr
    )
    assert "hybrid" not in plain.stderr
