"""What `atom bench serve`'s client costs per streamed chunk, so its figures can be trusted at
saturation (W4: 256 streams, ~23k chunks/s on the H200).

A stand-in OpenAI server (raw asyncio, another process) answers every completion with
`--tokens` SSE chunks, each written and drained on its own so the client reads them one by one,
then a usage chunk. The client is the real one (`bench_serve.benchmark`). Reported: the client
process's CPU time per chunk (robust on a shared machine) and the chunk rate it sustained.

    python benchmarks/serve_client_cost.py --num-prompts 256 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import time

from atom_runtime.bench import serve as bs
from atom_runtime.bench import serve_client as bsc
from atom_runtime.bench import serve_datasets as bsd


def _chunk(i: int) -> bytes:
    body = {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": None}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _serve(port: int, tokens: int) -> None:
    chunks = [_chunk(i) for i in range(tokens)]
    usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
    tail = (
        b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n"
    )
    models = json.dumps({"data": [{"id": "m", "object": "model"}]}).encode()

    def frame(data: bytes) -> bytes:
        return f"{len(data):x}\r\n".encode() + data + b"\r\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if length:
                    await reader.readexactly(length)
                if head.startswith(b"GET"):
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        + f"content-length: {len(models)}\r\n\r\n".encode()
                        + models
                    )
                    await writer.drain()
                    continue
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                for c in chunks:
                    writer.write(frame(c))
                    await writer.drain()
                    await asyncio.sleep(0)  # let other streams interleave, one read per chunk
                writer.write(frame(tail) + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def _server_main(port: int, tokens: int) -> None:
    asyncio.run(_serve(port, tokens))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    cli = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = mp.Process(target=_server_main, args=(port, cli.tokens), daemon=True)
    proc.start()
    try:
        parser = argparse.ArgumentParser()
        bs.add_arguments(parser)
        args = parser.parse_args(
            [
                "--port",
                str(port),
                "--model",
                "m",
                "--disable-tqdm",
                "--ready-check-timeout-sec",
                "30",
            ]
        )
        args.model_id = "m"
        samples = [bsd.SampleRequest([1, 2, 3], 3, cli.tokens) for _ in range(cli.num_prompts)]
        asyncio.run(bsc._probe(args))
        cpu, wall = time.process_time(), time.perf_counter()
        out = asyncio.run(bsc.benchmark(args, samples))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        ok = [o for o in out["outputs"] if o.success]
        chunks = sum(len(o.itl) + 1 for o in ok)
        print(
            f"{len(ok)}/{cli.num_prompts} streams, {chunks} chunks in {wall:.2f} s wall: "
            f"{chunks / wall:,.0f} chunks/s; client CPU {cpu:.2f} s = "
            f"{cpu / chunks * 1e6:.1f} us per chunk ({chunks / cpu:,.0f} chunks per CPU-second)"
        )
    finally:
        proc.terminate()
        proc.join()


if __name__ == "__main__":
    main()
