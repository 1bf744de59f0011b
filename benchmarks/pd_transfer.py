"""KV pull throughput of one connector, two of them in this process over 127.0.0.1 with real KV
tensors (pd_bench.py's `transfer`; the `pd` suite runs it for both connectors):

  --connector tcp   the portable connector: GPU cache -> pinned host -> TCP stripes -> pinned
                    host -> GPU cache (a CPU cache: sockets straight on the blocks)
  --connector nixl  NixlConnector: one NIXL READ of the producer's registered blocks straight
                    into the consumer's (VRAM to VRAM over CUDA IPC on one GPU or node; DRAM to
                    DRAM on a CPU), as UCX picks the path

Each row: n blocks of Qwen3-0.6B's geometry (by default) pulled `--repeat` times after a warm-up
round, into other block ids than they are read from and in reverse order (`--consecutive`: in
order, so runs of blocks merge into one NIXL descriptor per cache tensor); GB/s best and median,
and the process's CPU seconds per GB moved. `--check` compares the pulled bytes.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import statistics
import threading
import time

# One KV-transfer key for the whole run (docs/security.md): engines and routers read it from the
# environment; the transfer benchmark's connectors too.
KEY_ENV = {"ATOM_TRANSFER_KEY": secrets.token_hex(32)}
CONNECTOR_NAMES = {"tcp": "AtomPortableConnector", "nixl": "NixlConnector"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_transfer_args(t) -> None:
    t.add_argument("--connector", choices=sorted(CONNECTOR_NAMES), default="tcp")
    t.add_argument("--layers", type=int, default=28)  # Qwen3-0.6B's geometry by default
    t.add_argument("--kv-heads", type=int, default=8)
    t.add_argument("--head-dim", type=int, default=128)
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--dtype", default="bfloat16")
    t.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")],
                   default=[16, 64, 256, 1024])  # fmt: skip
    t.add_argument("--repeat", type=int, default=5)
    t.add_argument("--streams", type=int, default=4, help="(tcp) payload connections per pull")
    t.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    t.add_argument("--staged", action="store_true",
                   help="(tcp) a CPU cache through staging buffers too (default: sockets on the "
                        "blocks)")  # fmt: skip
    t.add_argument("--socket-buffer-bytes", type=int, default=0, help="0: kernel autotuning")
    t.add_argument("--check", action="store_true", help="compare the pulled bytes")
    t.add_argument("--consecutive", action="store_true",
                   help="pull into consecutive block ids (default: reversed, as scattered as it "
                        "gets: NIXL then needs a descriptor per block and cache tensor)")  # fmt: skip
    t.add_argument("--gil-load", action="store_true",
                   help="a thread spinning Python meanwhile, as a busy engine loop")  # fmt: skip


def _connectors(args, device: str):
    """(producer, consumer, producer's port) over caches of max(args.blocks) blocks."""
    import torch

    from atom_runtime.kv_transfer import rank_connector
    from atom_runtime.kv_transfer.base import KVCacheAccess
    from atom_runtime.kv_transfer.config import KVTransferConfig
    from atom_runtime.layers.attention import PagedAttention

    dtype = getattr(torch, args.dtype)
    max_blocks = max(args.blocks)
    direct = False if args.staged else None  # None: direct on a CPU cache, staged on a GPU

    def layer():
        """A real attention layer with its paged cache bound (random contents)."""
        shape = (max_blocks, args.block_size, args.kv_heads, args.head_dim)
        x = PagedAttention(args.kv_heads, args.kv_heads, args.head_dim, 1.0)
        x.bind_cache([torch.randn(shape, device=device).to(dtype) for _ in range(2)])
        return x

    def connector(role: str, port: int):
        extra = {"streams": args.streams, "socket_buffer_bytes": args.socket_buffer_bytes}
        cfg = KVTransferConfig.from_cli(json.dumps({
            "kv_connector": CONNECTOR_NAMES[args.connector], "kv_role": role,
            "kv_ip": "127.0.0.1", "kv_port": port, "kv_connector_extra_config": extra,
        }))  # fmt: skip
        kv = KVCacheAccess([layer() for _ in range(args.layers)], direct=direct)
        return rank_connector(cfg, kv, None)

    port = free_port()
    producer = connector("kv_producer", port)
    try:
        return producer, connector("kv_consumer", free_port()), port
    except BaseException:
        producer.close()
        raise


def _pull_rounds(producer, consumer, port: int, n: int, max_blocks: int, args):
    """Wall and CPU seconds of `args.repeat` pulls of n blocks (after one warm-up round)."""
    from atom_runtime.kv_transfer.base import RemoteBlocks

    ids = list(range(n))
    into = list(range(max_blocks - 1, max_blocks - 1 - n, -1))
    if args.consecutive:
        into = into[::-1]
    times, cpu = [], []
    for r in range(args.repeat + 1):
        tid = f"bench-{n}-{r}"
        producer.offer(tid, ids)
        start, cpu0 = time.perf_counter(), time.process_time()
        consumer.start_pull(RemoteBlocks(tid, "127.0.0.1", port, ids), into, 120)
        results = []
        while not results:
            consumer.wait(0.01)
            results = consumer.completed()
        if results[0].error:
            raise RuntimeError(results[0].error)
        if r:  # the first round warms the sockets, staging buffers and NIXL's connections
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu0)
        consumer.release_remote("127.0.0.1", port, tid)
        while not producer.withdraw(tid):
            time.sleep(0.001)  # the last read's ticket settles just after its bytes
    return ids, into, times, cpu


def bench_transfer(args) -> dict:
    os.environ.update(KEY_ENV)
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    max_blocks = max(args.blocks)
    producer, consumer, port = _connectors(args, device)
    rows = []
    stop = threading.Event()

    def engine_loop() -> None:  # pure Python, as an engine loop between steps: holds the GIL
        x = 0
        while not stop.is_set():
            x += 1

    busy = threading.Thread(target=engine_loop, daemon=True)
    if args.gil_load:
        busy.start()
    try:
        for n in args.blocks:
            ids, into, times, cpu = _pull_rounds(producer, consumer, port, n, max_blocks, args)
            if args.check:
                for a, b in zip(producer.kv.caches, consumer.kv.caches, strict=True):
                    if not torch.equal(a[ids], b[into]):
                        raise RuntimeError(f"{n} blocks: the pulled bytes differ")
            rows.append(_row(n, n * consumer.kv.block_bytes, times, cpu))
    finally:
        stop.set()
        if args.gil_load:
            busy.join()
        producer.close()
        consumer.close()
    return {
        "connector": CONNECTOR_NAMES[args.connector],
        "device": device,
        "gil_load": args.gil_load,
        "layout": consumer.kv.layout,
        "streams": args.streams,
        "direct": consumer.kv.direct,
        "consecutive": args.consecutive,
        "socket_buffer_bytes": args.socket_buffer_bytes,
        "rows": rows,
    }


def _row(n: int, nbytes: int, times: list[float], cpu: list[float]) -> dict:
    best, median = min(times), statistics.median(times)
    row = {
        "blocks": n,
        "bytes": nbytes,
        "seconds_best": best,
        "seconds_median": median,
        "gb_per_s_best": nbytes / best / 1e9,
        "gb_per_s_median": nbytes / median / 1e9,
        # Both ends' threads: the process's CPU seconds per GB moved.
        "cpu_s_per_gb_median": statistics.median(cpu) / (nbytes / 1e9),
    }
    print(
        f"{n:6d} blocks {nbytes / 2**20:9.1f} MiB  best {row['gb_per_s_best']:6.2f} "
        f"median {row['gb_per_s_median']:6.2f} GB/s  {row['cpu_s_per_gb_median']:5.2f} CPU s/GB"
    )
    return row
