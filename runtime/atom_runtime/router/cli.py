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
from atom_runtime.system.process import LOG_LEVELS, log_level


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RouterConfig(backends=["http://x"])
    g = parser.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--log-level", default="info", type=log_level, choices=LOG_LEVELS, help="any case"
    )
    _add_backend_arguments(parser, d)
    _add_routing_arguments(parser, d)
    _add_security_arguments(parser, d)


def _add_backend_arguments(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    b = parser.add_argument_group("backends")
    b.add_argument(
        "--decode-service",
        action="append",
        default=[],
        metavar="URL",
        help="decode pods behind a (headless) Service, http://<svc>.<ns>.svc.cluster.local:PORT: "
        "its EndpointSlices are watched in a cluster, else its DNS name is resolved",
    )
    b.add_argument(
        "--prefill-service",
        action="append",
        default=[],
        metavar="URL",
        help="prefill pods behind a Service (disaggregated mode), found as for --decode-service",
    )
    b.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL[,kv-events=PORT][,kv-replay=PORT]",
        help="a decode (or aggregated) engine by URL; repeat for more",
    )
    b.add_argument(
        "--prefill-backend",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill engine by URL (disaggregated mode); repeat for more",
    )
    b.add_argument(
        "--kv-events-port",
        type=int,
        default=d.kv_events_port,
        help="port of every decode pod's KV-event PUB socket (0: subscribe to none)",
    )
    b.add_argument(
        "--kv-events-replay-port",
        type=int,
        default=d.kv_replay_port,
        help="port of every decode pod's KV-event replay socket (0: no replay)",
    )
    b.add_argument(
        "--discovery",
        choices=("auto", "kubernetes", "dns"),
        default=d.discovery,
        help="how services are resolved: the EndpointSlice watch (needs list/watch on "
        "endpointslices), DNS, or auto (the watch in a cluster, DNS otherwise or when refused)",
    )
    b.add_argument("--discovery-interval", type=float, default=d.discovery_interval)


def _add_routing_arguments(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    r = parser.add_argument_group("routing")
    r.add_argument("--policy", choices=POLICIES, default=d.policy)
    r.add_argument(
        "--remote-prefill-threshold",
        type=int,
        default=d.remote_prefill_threshold,
        help="prefill on a prefill pod only when the chosen decode pod would compute more than "
        "this many prompt tokens itself (prompt minus its cached prefix)",
    )
    r.add_argument(
        "--load-weight",
        type=float,
        default=d.load_weight,
        help="prompt tokens one running or waiting request on a pod is worth when ranking pods",
    )
    r.add_argument("--max-attempts", type=int, default=d.max_attempts)
    r.add_argument("--probe-interval", type=float, default=d.probe_interval)
    r.add_argument("--probe-timeout", type=float, default=d.probe_timeout)
    r.add_argument("--connect-timeout", type=float, default=d.connect_timeout)
    q = parser.add_argument_group("queue (scale from zero)")
    q.add_argument(
        "--queue-size",
        type=int,
        default=d.queue_size,
        help="requests held while a role has no ready pod; beyond it: 429",
    )
    q.add_argument(
        "--queue-timeout",
        type=float,
        default=d.queue_timeout,
        help="seconds a held request waits for a ready pod before a 503",
    )


def _add_security_arguments(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    s = parser.add_argument_group("access and limits (docs/security.md)")
    s.add_argument(
        "--api-key",
        default=envs.ROUTER_API_KEY.value() or None,
        help="require `Authorization: Bearer <key>` on every route but /health (admin routes "
        f"and /metrics included); enables the {CACHE_SALT_HEADER} header "
        f"(default: ${envs.ROUTER_API_KEY.name})",
    )
    s.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=d.max_request_body_bytes,
        help="largest request body accepted; a bigger one is answered 413 before it is read "
        "(default 8 MiB)",
    )
    s.add_argument(
        "--request-header-timeout",
        type=float,
        default=d.request_header_timeout,
        help="seconds a client has to send a request's headers before the connection is closed",
    )
    s.add_argument(
        "--request-body-timeout",
        type=float,
        default=d.request_body_timeout,
        help="seconds a client has to send a request's body after its headers (then 408)",
    )
    s.add_argument(
        "--kv-events-curve-dir",
        metavar="DIR",
        help="CurveZMQ keys for the engines' KV-event sockets (engines run with "
        "curve_keys_dir; `atom kv-events keygen DIR` makes them)",
    )
    s.add_argument(
        "--kv-transfer-insecure",
        action="store_true",
        help="disaggregated without a transfer key: send kv_transfer_params unsigned (the "
        'engines must run with "insecure": true); local experiments only',
    )


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        decode_services=args.decode_service,
        prefill_services=args.prefill_service,
        backends=args.backend,
        prefill_backends=args.prefill_backend,
        kv_events_port=args.kv_events_port or None,
        kv_replay_port=args.kv_events_replay_port or None,
        discovery=args.discovery,
        discovery_interval=args.discovery_interval,
        policy=args.policy,
        remote_prefill_threshold=args.remote_prefill_threshold,
        load_weight=args.load_weight,
        queue_size=args.queue_size,
        queue_timeout=args.queue_timeout,
        probe_interval=args.probe_interval,
        probe_timeout=args.probe_timeout,
        connect_timeout=args.connect_timeout,
        max_attempts=args.max_attempts,
        api_key=args.api_key or None,
        max_request_body_bytes=args.max_request_body_bytes,
        request_header_timeout=args.request_header_timeout,
        request_body_timeout=args.request_body_timeout,
        kv_events_curve_dir=args.kv_events_curve_dir,
        kv_transfer_insecure=args.kv_transfer_insecure,
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
