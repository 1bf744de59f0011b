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
import socket
import sys

from atom_runtime.router.app import Router, build_app
from atom_runtime.router.config import POLICIES, RouterConfig

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RouterConfig(backends=["http://x"])
    g = parser.add_argument_group("router")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS)
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
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from atom_runtime.system.process import (
        LOG_FORMAT,
        apply_gc_policy,
        release_gc_policy,
        set_process_title,
    )

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if not 0 < args.port < 65536:
        print(f"atom router: error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
        # Parse every static backend now: a typo is a startup error, not a dead backend later.
        from atom_runtime.router.backends import BackendAddress
        from atom_runtime.router.discovery import ServiceTarget

        for url in config.backends + config.prefill_backends:
            BackendAddress.parse(url, config.kv_events_port, config.kv_replay_port)
        for url in config.decode_services + config.prefill_services:
            ServiceTarget.parse(url)
    except ValueError as e:
        print(f"atom router: error: {e}", file=sys.stderr)
        return 2
    set_process_title("Router")
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"atom router: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(Router(config)),
            log_level=args.log_level,
            log_config=None,
            access_log=False,
            lifespan="on",
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
