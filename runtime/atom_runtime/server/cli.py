"""`atom serve`: the OpenAI-compatible server over a separate EngineCore process.

atom serve                                   # the default model on http://127.0.0.1:8000/v1
atom serve --model ./my-model --port 9000 --api-key secret
"""

from __future__ import annotations

import argparse
import logging
import sys

from atom_runtime import envs
from atom_runtime.config import EngineConfig, add_engine_arguments
from atom_runtime.server.reasoning import REASONING_PARSERS
from atom_runtime.server.tools import TOOL_CALL_PARSERS

API_KEY_ENV = envs.API_KEY.name
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key",
        default=envs.API_KEY.value() or None,
        help="require `Authorization: Bearer <key>` on /v1/*, /tokenize, /detokenize and the debug "
        f"routes; /health, /metrics and /version stay open (default: ${API_KEY_ENV})",
    )
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="do not log one line per finished request",
    )
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
        "exits 1 for its supervisor to restart it; 0 turns the check off (default 300)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="largest request body accepted; a bigger one is answered 413 before it is parsed "
        "(default 8 MiB: a prompt of about two million tokens)",
    )
    g.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=256,
        help="most sequences one request may start (n x the prompts of a batched completion); "
        "more is answered 400 (default 256)",
    )
    g.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="serve GET /debug/kv_cache (the cached block hashes) and POST /reset_prefix_cache "
        "(drops every cached prefix); off by default, and under --api-key like /v1",
    )
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
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from atom_runtime.engine.core_proc import HEARTBEAT_S
    from atom_runtime.server.api_server import run_event_loop, serve
    from atom_runtime.server.state import ServerConfig
    from atom_runtime.system.process import LOG_FORMAT

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if not 0 < args.port < 65536:
        print(f"atom serve: error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    if args.shutdown_grace_period < 0:
        print("atom serve: error: --shutdown-grace-period must be >= 0", file=sys.stderr)
        return 2
    for flag in ("max_request_body_bytes", "max_sequences_per_request"):
        if getattr(args, flag) < 1:
            name = "--" + flag.replace("_", "-")
            print(f"atom serve: error: {name} must be >= 1", file=sys.stderr)
            return 2
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print(
            "atom serve: error: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr
        )
        return 2
    if args.tool_call_parser == "openai" and args.reasoning_parser not in (
        "gpt_oss",
        "openai_gptoss",
    ):
        print(
            "atom serve: error: --tool-call-parser openai reads harmony messages: it needs "
            "--reasoning-parser gpt_oss",
            file=sys.stderr,
        )
        return 2
    if args.engine_stall_timeout != 0 and not args.engine_stall_timeout > HEARTBEAT_S:
        print(
            f"atom serve: error: --engine-stall-timeout must be 0 (off) or more than "
            f"{HEARTBEAT_S:g} s, got {args.engine_stall_timeout:g}",
            file=sys.stderr,
        )
        return 2
    try:
        engine_config = EngineConfig.from_args(args).for_serving()
    except ValueError as e:
        print(f"atom serve: error: {e}", file=sys.stderr)
        return 2
    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        log_requests=not args.disable_log_requests,
        shutdown_grace_period=args.shutdown_grace_period,
        engine_stall_timeout=args.engine_stall_timeout,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        reasoning_parser=args.reasoning_parser,
        max_request_body_bytes=args.max_request_body_bytes,
        max_sequences_per_request=args.max_sequences_per_request,
        enable_debug_endpoints=args.enable_debug_endpoints,
    )
    return run_event_loop(serve(config, engine_config))
