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


# -- first run: vLLM's habits, one-line start-up errors, --help with defaults ----------------------


def _one_line_error(proc: subprocess.CompletedProcess, command: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"atom {command}: error: ")
    return line


def test_version():
    proc = _atom("--version")
    import atom_runtime

    assert (proc.returncode, proc.stdout) == (0, f"atom {atom_runtime.__version__}\n")


def test_serve_refuses_a_tensor_parallel_size_the_default_model_cannot_take():
    """The head count is checked from the model's header before any process starts or weight is
    read: one line, exit 2, no traceback (as the issue's 105-line failure was not)."""
    line = _one_line_error(_atom("serve", "--tensor-parallel-size", "2"), "serve")
    assert "tensor_parallel_size: 2 does not fit the model" in line
    assert "attention heads (num_attention_heads) 9 is not divisible by 2" in line


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (("serve", "--dtype", "fp7"), "atom serve: error: argument --dtype: invalid choice"),
        (("serve", "--device", "tpu"), "atom serve: error: argument --device: expected auto, cpu"),
        (("serve", "--no-such-flag"), "atom serve: error: unrecognized arguments: --no-such-flag"),
        (("render",), "atom render: error: the following arguments are required: -f/--filename"),
        (("operator", "run", "--log-level", "x"), "atom operator run: error: argument --log-level"),
    ],
)
def test_a_refused_flag_is_one_line_pointing_at_help(command, expected):
    """argparse's refusal without the whole usage before it (50 lines for serve)."""
    proc = _atom(*command)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(expected), line
    assert line.endswith(f"(`atom {' '.join(command[:2 if command[0] == 'operator' else 1])} "
                         "--help` lists the options)")  # fmt: skip


def test_a_gpu_device_on_a_machine_without_one_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: --device cuda is valid here")
    proc = _atom("generate", "--prompt", "x", "--device", "cuda")
    # After the config phase's progress lines (the check needs torch, which generate loads).
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("atom generate: error: --device cuda: no CUDA or ROCm GPU is visible here")
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("/no/such/model",), "model '/no/such/model': no such file or folder"),
        (("--max-model-len", "100000"), "max_model_len: 100000 exceeds the model's context length"),
        (("--data-parallel-size", "2"), "data_parallel_size: must be 1, got 2"),
        (("--no-enable-chunked-prefill",), "enable_chunked_prefill: cannot be turned off"),
        (("--port", "0"), "--port must be in 1..65535"),
        (("./a", "--model", "./b"), "the model is given twice"),
        (("--chat-template", "/no/such/template.jinja"), "--chat-template '/no/such/template"),
        # KV-events keys the engine would fail to read only after its process started.
        (("--kv-events-config", '{"enable_kv_cache_events": true, "curve_keys_dir": "/no/k"}'),
         "kv-events config field 'curve_keys_dir': cannot read /no/k/kv-events-server.pub"),
        # A hub id that cannot be fetched (no network, or no such repo): the hub's multi-line
        # message kept on one line.
        (("no-such-org-atom/no-such-model",), "model 'no-such-org-atom/no-such-model': not a "
         "local path, and fetching it from the Hugging Face hub failed"),
    ],
)  # fmt: skip
def test_serve_start_up_errors_are_one_line(args, expected):
    assert expected in _one_line_error(_atom("serve", *args), "serve")


def test_generate_checks_before_loading():
    line = _one_line_error(_atom("generate", "--prompt", "x", "-tp", "2"), "generate")
    assert "attention heads (num_attention_heads) 9 is not divisible by 2" in line


def test_log_level_is_case_insensitive_and_debug_shows_the_traceback():
    proc = _atom("serve", "--log-level", "DEBUG", "--tensor-parallel-size", "2")
    assert proc.returncode == 2 and "Traceback" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("atom serve: error: tensor_parallel")
    proc = _atom("serve", "--log-level", "Loud")
    assert proc.returncode == 2 and "choose from debug, info, warning, error, critical" in (
        proc.stderr.replace("'", "")
    )


def test_help_shows_defaults_and_choices():
    out = _atom("serve", "--help").stdout
    flat = " ".join(out.split())
    for needle in (
        "--port PORT port to listen on (default: 8000)",
        "--dtype {auto,float32,float16,bfloat16,fp32,fp16,bf16}",
        "(default: 256)",  # --max-num-seqs
        "tokens per KV-cache block (8-256) (default: 16)",
        "random seed (sampling, dummy weights) (default: 0)",  # 0 is shown, not taken for "off"
        "reuse the KV cache of prompts' common prefixes (default: on)",
        "--load-format {auto,safetensors,runai_streamer,fastsafetensors,gguf,dummy}",
        "--uvicorn-log-level {debug,info,warning,error,critical,trace}",
        "--enable-chunked-prefill, --no-enable-chunked-prefill",
        "--data-parallel-size DATA_PARALLEL_SIZE, -dp DATA_PARALLEL_SIZE",
        "--trust-remote-code",
        "--allowed-origins",
        "--disable-log-stats",
        "--cpu-threads",
        "--compile-cache-dir",
        "MODEL the model, as `vllm serve MODEL` takes it",
    ):
        assert needle in flat, needle
    bench = " ".join(_atom("bench", "serve", "--help").stdout.split())
    assert "(default: 600)" in bench  # --ready-check-timeout-sec


def test_vllm_flags_that_apply_are_accepted():
    """Parsed and carried into the config (the serve run itself is tested in tests/server)."""
    import argparse

    from atom_runtime.config import EngineConfig
    from atom_runtime.server import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(
        ["some/model", "--tokenizer", "t", "--revision", "r", "--download-dir", "/d",
         "--trust-remote-code", "--enable-chunked-prefill", "--data-parallel-size", "1",
         "--allowed-origins", '["http://a.example"]', "--uvicorn-log-level", "WARNING",
         "--disable-log-stats", "--chat-template", "{{ messages }}", "--cpu-threads", "3"]
    )  # fmt: skip
    config = EngineConfig.from_args(args)
    assert (config.tokenizer, config.revision, config.download_dir) == ("t", "r", "/d")
    assert config.trust_remote_code and config.cpu_threads == 3
    assert args.model_tag == "some/model" and args.allowed_origins == ["http://a.example"]
    assert args.uvicorn_log_level == "warning" and args.disable_log_stats


def test_every_command_takes_the_same_log_levels_in_any_case():
    """One convention: serve, generate, router, bench and `operator run` show the same five
    lower-case names and read any case (the operator's chart passes `info`, a user `DEBUG`)."""
    import argparse
    import importlib

    from atom_runtime.system.process import LOG_LEVELS

    def parse(command: str, *args: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser(exit_on_error=False)
        importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
        return parser.parse_args(list(args))

    for command, prefix in (("serve", ()), ("generate", ("--prompt", "x")), ("router", ()),
                            ("operator", ("run",)), ("bench", ("startup", "--dir", "d"))):  # fmt: skip
        for typed in ("WARNING", "Warning", "warning"):
            assert parse(command, *prefix, "--log-level", typed).log_level == "warning", command
        # argparse exits on a bad choice even with exit_on_error=False (a 3.11 quirk).
        with pytest.raises((argparse.ArgumentError, SystemExit)):
            parse(command, *prefix, "--log-level", "loud")
    assert LOG_LEVELS == ("debug", "info", "warning", "error", "critical")
