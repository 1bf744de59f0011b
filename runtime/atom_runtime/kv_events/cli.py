"""`atom kv-events listen ENDPOINT`: print a pod's KV events as they arrive (a debugging tool).
`atom kv-events keygen DIR`: make the CurveZMQ keys of kv_events/curve.py."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import msgspec

from atom_runtime.kv_events.curve import CurveKeys, write_keys
from atom_runtime.kv_events.events import BlockStored, EventBatch, KVCacheEvent
from atom_runtime.kv_events.subscriber import KVEventSubscriber


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="kv_events_command", metavar="COMMAND", required=True)
    listen = commands.add_parser(
        "listen",
        help="subscribe to a publisher and print its event batches",
        description="Subscribe to an engine's KV event publisher and print each batch.",
    )
    listen.add_argument("endpoint", help="the publisher's PUB endpoint, e.g. tcp://10.0.0.7:5557")
    listen.add_argument(
        "--replay", metavar="ENDPOINT", help="its replay endpoint: fetch history first, fill gaps"
    )
    listen.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    listen.add_argument(
        "--count", type=int, default=0, help="exit after N batches (default: run until Ctrl-C)"
    )
    listen.add_argument(
        "--timeout", type=float, default=0.0, help="exit with status 1 after S seconds of silence"
    )
    listen.add_argument("--json", action="store_true", help="one JSON object per batch")
    listen.add_argument(
        "--bind", action="store_true", help="bind the endpoint (publishers connect to us)"
    )
    listen.add_argument(
        "--curve-dir",
        metavar="DIR",
        help="CurveZMQ key directory of engines run with curve_keys_dir (the client keypair and "
        "the server public key)",
    )
    keygen = commands.add_parser(
        "keygen",
        help="make CurveZMQ keys for the KV-event sockets",
        description="Write a server and a client keypair (Z85 text) into DIR: engines take "
        "the directory as --kv-events-config '{\"curve_keys_dir\": DIR}', the router as "
        "--kv-events-curve-dir DIR.",
    )
    keygen.add_argument("directory", metavar="DIR")


def event_to_dict(event: KVCacheEvent) -> dict[str, Any]:
    """An event as a map with a `type` key, the shape newer vLLM releases publish."""
    return {"type": type(event).__name__, **msgspec.structs.asdict(event)}


def format_batch(seq: int, batch: EventBatch) -> str:
    lines = [
        f"seq={seq} ts={batch.ts:.6f} dp_rank={batch.data_parallel_rank} events={len(batch.events)}"
    ]
    for event in batch.events:
        if isinstance(event, BlockStored):
            lines.append(
                f"  BlockStored hashes={event.block_hashes} parent={event.parent_block_hash} "
                f"block_size={event.block_size} tokens={event.token_ids} medium={event.medium}"
                + (
                    f" lora={event.lora_name or event.lora_id}"
                    if event.lora_id or event.lora_name
                    else ""
                )
            )
        else:
            fields = msgspec.structs.asdict(event)
            lines.append(
                "  " + " ".join([type(event).__name__] + [f"{k}={v}" for k, v in fields.items()])
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.kv_events_command == "keygen":
        write_keys(args.directory)
        print(f"CurveZMQ keys for KV events written to {args.directory}")
        return 0
    if args.kv_events_command != "listen":
        raise ValueError(f"unknown kv-events command {args.kv_events_command!r}")
    if args.count < 0:
        print("atom kv-events listen: --count must be >= 0", file=sys.stderr)
        return 2
    try:
        curve = None
        if args.curve_dir is not None:
            curve = CurveKeys.for_subscriber(args.curve_dir, "--curve-dir")
        subscriber = KVEventSubscriber(
            args.endpoint,
            args.replay,
            topic=args.topic,
            bind=True if args.bind else None,
            curve=curve,
        )
    except ValueError as exc:
        print(f"atom kv-events listen: {exc}", file=sys.stderr)
        return 2
    printed = 0
    last_news = time.monotonic()
    status = 0
    try:
        while not args.count or printed < args.count:
            batches = subscriber.poll(200)
            for seq, batch in batches:
                if args.json:
                    record = {
                        "seq": seq,
                        "ts": batch.ts,
                        "data_parallel_rank": batch.data_parallel_rank,
                        "events": [event_to_dict(e) for e in batch.events],
                    }
                    print(json.dumps(record), flush=True)
                else:
                    print(format_batch(seq, batch), flush=True)
                printed += 1
                if args.count and printed >= args.count:
                    break
            if batches:
                last_news = time.monotonic()
            elif args.timeout and time.monotonic() - last_news > args.timeout:
                print(f"atom kv-events listen: nothing for {args.timeout}s", file=sys.stderr)
                status = 1
                break
    except KeyboardInterrupt:
        pass
    finally:
        subscriber.close()
        print(
            f"batches={subscriber.batches_applied} last_seq={subscriber.last_seq} "
            f"gaps_filled={subscriber.gaps_filled} gaps_unfillable={subscriber.gaps_unfillable} "
            f"missed={subscriber.batches_missed} malformed={subscriber.malformed_total}",
            file=sys.stderr,
        )
    return status
