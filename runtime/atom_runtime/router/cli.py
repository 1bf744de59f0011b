"""`atom router`: a KV-cache-aware OpenAI-compatible proxy in front of `atom serve` pods.

atom router --backend http://10.0.0.5:8000 --backend http://10.0.0.6:8000       # aggregated
atom router --decode-service http://m-decode.ns.svc.cluster.local:8000 \\
            --prefill-service http://m-prefill.ns.svc.cluster.local:8000          # disaggregated
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from atom_runtime import envs
from atom_runtime.router.app import CACHE_SALT_HEADER, Router
from atom_runtime.router.config import POLICIES, RouterConfig
from atom_runtime.router.routes import build_app
from atom_runtime.system.flag_table import add_flags, same_named
from atom_runtime.system.process import LOG_LEVELS, log_level


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RouterConfig(backends=["http://x"])
    add_flags(parser, "router", d, (
        ("--host", None, "address to listen on (default 127.0.0.1)", {"default": "127.0.0.1"}),
        ("--port", None, None, {"type": int, "default": 8000}),
        ("--log-level", None, "any case",
         {"default": "info", "type": log_level, "choices": LOG_LEVELS}),
    ))  # fmt: skip
    _add_backend_arguments(parser, d)
    _add_routing_arguments(parser, d)
    _add_security_arguments(parser, d)


def _add_backend_arguments(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    add_flags(parser, "backends", d, (
        ("--decode-service", None, "decode pods behind a (headless) Service, "
         "http://<svc>.<ns>.svc.cluster.local:PORT: its EndpointSlices are watched in a "
         "cluster, else its DNS name is resolved", _urls("URL")),
        ("--prefill-service", None, "prefill pods behind a Service (disaggregated mode), found "
         "as for --decode-service", _urls("URL")),
        ("--backend", None, "a decode (or aggregated) engine by URL; repeat for more",
         _urls("URL[,kv-events=PORT][,kv-replay=PORT]")),
        ("--prefill-backend", None, "a prefill engine by URL (disaggregated mode); repeat for "
         "more", _urls("URL")),
        ("--kv-events-port", "kv_events_port", "port of every decode pod's KV-event PUB socket "
         "(0: subscribe to none)"),
        ("--kv-events-replay-port", "kv_replay_port", "port of every decode pod's KV-event "
         "replay socket (0: no replay)"),
        ("--discovery", "discovery", "how services are resolved: the EndpointSlice watch (needs "
         "list/watch on endpointslices), DNS, or auto (the watch in a cluster, DNS otherwise or "
         "when refused)", {"choices": ("auto", "kubernetes", "dns")}),
        ("--discovery-interval", "discovery_interval", None),
    ))  # fmt: skip


def _urls(metavar: str) -> dict:
    """A repeatable URL flag: each use appends one."""
    return {"action": "append", "default": [], "metavar": metavar}


def _add_routing_arguments(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    add_flags(parser, "routing", d, (
        ("--policy", "policy", None, {"choices": POLICIES}),
        ("--remote-prefill-threshold", "remote_prefill_threshold", "prefill on a prefill pod "
         "only when the chosen decode pod would compute more than this many prompt tokens "
         "itself (prompt minus its cached prefix)"),
        ("--load-weight", "load_weight", "prompt tokens one running or waiting request on a pod "
         "is worth when ranking pods"),
        ("--max-attempts", "max_attempts", None),
        ("--probe-interval", "probe_interval", None),
        ("--probe-timeout", "probe_timeout", None),
        ("--connect-timeout", "connect_timeout", None),
    ))  # fmt: skip
    add_flags(parser, "queue (scale from zero)", d, (
        ("--queue-size", "queue_size", "requests held while a role has no ready pod; beyond "
         "it: 429"),
        ("--queue-timeout", "queue_timeout", "seconds a held request waits for a ready pod "
         "before a 503"),
    ))  # fmt: skip


def _add_security_arguments(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    add_flags(parser, "access and limits (docs/security.md)", d, (
        ("--api-key", None, "require `Authorization: Bearer <key>` on every route but /health "
         f"(admin routes and /metrics included); enables the {CACHE_SALT_HEADER} header "
         f"(default: ${envs.ROUTER_API_KEY.name})",
         {"default": envs.ROUTER_API_KEY.value() or None}),
        ("--max-request-body-bytes", "max_request_body_bytes", "largest request body accepted; "
         "a bigger one is answered 413 before it is read (default 8 MiB)"),
        ("--request-header-timeout", "request_header_timeout", "seconds a client has to send a "
         "request's headers before the connection is closed"),
        ("--request-body-timeout", "request_body_timeout", "seconds a client has to send a "
         "request's body after its headers (then 408)"),
        ("--kv-events-curve-dir", None, "CurveZMQ keys for the engines' KV-event sockets "
         "(engines run with curve_keys_dir; `atom kv-events keygen DIR` makes them)",
         {"metavar": "DIR"}),
        ("--kv-transfer-insecure", None, "disaggregated without a transfer key: send "
         "kv_transfer_params unsigned (the engines must run with \"insecure\": true); local "
         "experiments only", {"action": "store_true"}),
    ))  # fmt: skip


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        decode_services=args.decode_service,
        prefill_services=args.prefill_service,
        backends=args.backend,
        prefill_backends=args.prefill_backend,
        kv_events_port=args.kv_events_port or None,
        kv_replay_port=args.kv_events_replay_port or None,
        api_key=args.api_key or None,
        **same_named(
            args,
            "discovery discovery_interval policy remote_prefill_threshold load_weight queue_size "
            "queue_timeout probe_interval probe_timeout connect_timeout max_attempts "
            "max_request_body_bytes request_header_timeout request_body_timeout "
            "kv_events_curve_dir kv_transfer_insecure",
        ),
    )


def _check_backends(config: RouterConfig) -> None:
    """Parse every static backend now: a typo is a startup error, not a dead backend later."""
    from atom_runtime.router.backends import BackendAddress
    from atom_runtime.router.discovery import ServiceTarget

    for url in config.backends + config.prefill_backends:
        BackendAddress.parse(url, config.kv_events_port, config.kv_replay_port)
    for url in config.decode_services + config.prefill_services:
        ServiceTarget.parse(url)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from atom_runtime.system.process import (
        LOG_FORMAT,
        apply_gc_policy,
        release_gc_policy,
        set_process_title,
    )
    from atom_runtime.web.header_timeout import header_timeout_protocol
    from atom_runtime.web.listen import listening_socket, uvicorn_config

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    # httpx logs every request at INFO: with probes every two seconds per pod, noise.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    if not 0 < args.port < 65536:
        print(f"atom router: error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
        _check_backends(config)
        router = Router(config)  # loads the transfer key and the CurveZMQ keys
    except ValueError as e:
        print(f"atom router: error: {e}", file=sys.stderr)
        return 2
    set_process_title("Router")
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as e:
        print(f"atom router: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    server = uvicorn.Server(
        uvicorn_config(
            build_app(router),
            args.log_level,
            http=header_timeout_protocol(config.request_header_timeout),
        )
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    # Contract 7 (docs/architecture.md): a long-lived process freezes what start-up built.
    apply_gc_policy()
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        release_gc_policy()
    return 0
