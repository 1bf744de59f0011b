"""`atom serve`: the OpenAI-compatible server over a separate EngineCore process.

atom serve                                   # the default model on http://127.0.0.1:8000/v1
atom serve ./my-model --port 9000 --api-key secret
atom serve Qwen/Qwen3-0.6B --revision main   # a hub model, fetched into the Hugging Face cache

Before any process starts or any weight is read, the flags and the model's config are checked
(models/preflight.py): a mistake ends the command with one line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from atom_runtime import envs
from atom_runtime.config import EngineConfig
from atom_runtime.engine_args import add_engine_arguments
from atom_runtime.server.reasoning import REASONING_PARSERS
from atom_runtime.server.tools import TOOL_CALL_PARSERS
from atom_runtime.system.flag_table import same_named
from atom_runtime.system.process import LOG_LEVELS, log_level

API_KEY_ENV = envs.API_KEY.name
UVICORN_LOG_LEVELS = (*LOG_LEVELS, "trace")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it (the same as --model)",
    )
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument(
        "--api-key",
        default=envs.API_KEY.value() or None,
        help="require `Authorization: Bearer <key>` on /v1/*, /tokenize, /detokenize and the debug "
        f"routes; /health, /metrics and /version stay open (default: ${API_KEY_ENV})",
    )
    g.add_argument(
        "--log-level",
        type=log_level,
        default="info",
        choices=LOG_LEVELS,
        help="ATOM's log level, any case; debug also shows tracebacks of start-up errors",
    )
    g.add_argument(
        "--uvicorn-log-level",
        type=log_level,
        default="info",
        choices=UVICORN_LOG_LEVELS,
        help="uvicorn's own log level",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="do not log one line per finished request",
    )
    g.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="do not log the engine's throughput, queue and cache usage every 10 s while busy",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file, or the template itself, in place of the model's",
    )
    _add_cors_arguments(parser)
    _add_limit_arguments(parser)
    _add_tool_arguments(parser)
    add_engine_arguments(parser)


def _add_cors_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("CORS (browsers calling the API from other origins)")
    g.add_argument(
        "--allowed-origins",
        type=_string_list,
        default=[],
        help="origins allowed, a JSON list as vLLM takes it ('[\"https://app.example\"]') or "
        'comma-separated; "*" any. Default: none (vLLM allows any): a page a user visits cannot '
        "call a server on their machine unless it is allowed here",
    )
    g.add_argument(
        "--allowed-methods", type=_string_list, default=["*"], help="methods allowed (CORS)"
    )
    g.add_argument(
        "--allowed-headers", type=_string_list, default=["*"], help="headers allowed (CORS)"
    )
    g.add_argument(
        "--allow-credentials", action="store_true", help="allow credentials (cookies) in CORS"
    )


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("limits and lifecycle")
    g.add_argument(
        "--shutdown-grace-period",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    g.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=300.0,
        help="seconds the engine core may go without a sign of life (it sends one at least "
        "every second, busy or idle) before it is taken for hung, killed, and the server "
        "exits 1 for its supervisor to restart it; 0 turns the check off",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="largest request body accepted; a bigger one is answered 413 before it is parsed "
        "(8 MiB: a prompt of about two million tokens)",
    )
    g.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=256,
        help="most sequences one request may start (n x the prompts of a batched completion); "
        "more is answered 400",
    )
    g.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="serve GET /debug/kv_cache (the cached block hashes) and POST /reset_prefix_cache "
        "(drops every cached prefix), under --api-key like /v1",
    )


def _add_tool_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tool calling")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how tool calls are read out of the model's text: hermes (<tool_call>{...}</tool_call>, "
        "Qwen2.5/Qwen3 and Hermes models), openai (GPT-OSS's harmony calls; needs "
        "--reasoning-parser gpt_oss)",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="put the model's thinking in chat responses' reasoning_content: deepseek_r1 "
        "(DeepSeek-R1), qwen3 (Qwen3 <think> blocks), gpt_oss or openai_gptoss (GPT-OSS's "
        "harmony analysis channel)",
    )


def _string_list(text: str) -> list[str]:
    """A JSON list of strings, or comma-separated strings."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


class UsageError(ValueError):
    """A flag or the model refused before anything started: one line, exit code 2."""


def run(args: argparse.Namespace) -> int:
    from atom_runtime.system.process import LOG_FORMAT
    from atom_runtime.system.startup import process_started_at

    started = process_started_at()

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:
        config, engine_config = _configs(args, started)
    except (UsageError, ValueError, FileNotFoundError) as e:
        if args.log_level == "debug":
            logging.getLogger("atom_runtime.server").debug("refused", exc_info=True)
        print(f"atom serve: error: {e}", file=sys.stderr)
        return 2
    from atom_runtime.server.api_server import run_event_loop, serve

    return run_event_loop(serve(config, engine_config))


def _configs(args: argparse.Namespace, started: float):
    """ServerConfig and EngineConfig from the flags, after every check that needs no process:
    the flags' values, then the model (preflight.check_model)."""
    from atom_runtime.engine.core_proc import HEARTBEAT_S
    from atom_runtime.models.preflight import preflight
    from atom_runtime.server.state import ServerConfig

    _check_server_flags(args, HEARTBEAT_S)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise UsageError(
                f"the model is given twice, as {args.model_tag!r} and --model {args.model!r}"
            )
        args.model = args.model_tag
    engine_config = EngineConfig.from_args(args).for_serving()
    from atom_runtime.kv_events import KVEventsConfig

    # As the engine core will read it (the flag and ATOM_KV_EVENTS_*), checked here so a bad
    # field or an unreadable curve_keys_dir is one line before any process starts.
    KVEventsConfig.from_cli(engine_config.kv_events_config)
    preflight(engine_config)
    config = ServerConfig(
        api_key=args.api_key or None,
        log_requests=not args.disable_log_requests,
        log_stats=not args.disable_log_stats,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        chat_template=_chat_template(args.chat_template),
        started=started,
        **same_named(
            args,
            "host port served_model_name log_level uvicorn_log_level shutdown_grace_period "
            "engine_stall_timeout reasoning_parser max_request_body_bytes "
            "max_sequences_per_request enable_debug_endpoints allowed_origins allowed_methods "
            "allowed_headers allow_credentials",
        ),
    )
    return config, engine_config


def _check_server_flags(args: argparse.Namespace, heartbeat_s: float) -> None:
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    if args.shutdown_grace_period < 0:
        raise UsageError("--shutdown-grace-period must be >= 0")
    for flag in ("max_request_body_bytes", "max_sequences_per_request"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UsageError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.tool_call_parser == "openai" and args.reasoning_parser not in (
        "gpt_oss",
        "openai_gptoss",
    ):
        raise UsageError(
            "--tool-call-parser openai reads harmony messages: it needs --reasoning-parser gpt_oss"
        )
    if args.engine_stall_timeout != 0 and not args.engine_stall_timeout > heartbeat_s:
        raise UsageError(
            f"--engine-stall-timeout must be 0 (off) or more than {heartbeat_s:g} s, got "
            f"{args.engine_stall_timeout:g}"
        )


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents when it names a file (as vLLM reads it), else the
    template itself; a value that looks like a path but is none is refused."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in value and ("/" in value or value.endswith((".jinja", ".j2"))):
        raise UsageError(f"--chat-template {value!r}: no such file")
    return value
