"""Prefill/decode in one test process: two engines (EngineCore under `LLM`), a producer and a
consumer, each at its own tensor-parallel size and with either connector, driven the way the
router drives them (signed kv_transfer_params, max_tokens=1 on the prefill engine, its reply to
the decode engine). One process may run one tensor-parallel group at a time, so at most one of
the two engines has tensor_parallel_size > 1."""

from __future__ import annotations

import itertools
import json
import socket

from atom_runtime import LLM, SamplingParams
from atom_runtime.kv_transfer.auth import TransferKey
from atom_runtime.protocol.engine_core import EngineRequest

KEY_HEX = "6d" * 32
KEY = TransferKey.from_text(KEY_HEX, "test")
_ids = itertools.count()


def free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free now (rank r of a producer listens on kv_port + r)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()


def transfer_config(connector: str, role: str, tp: int, **extra) -> str:
    return json.dumps(
        {
            "kv_connector": connector,
            "kv_role": role,
            "kv_ip": "127.0.0.1",
            "kv_port": free_ports(tp),
            "kv_connector_extra_config": {"pull_timeout_s": 60, **extra},
        }
    )


def engine(folder, connector: str, role: str, tp: int = 1, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 128)
    return LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        tensor_parallel_size=tp,
        kv_transfer_config=transfer_config(connector, role, tp),
        **kwargs,
    )


def _run(llm: LLM, request: EngineRequest) -> tuple[list[int], object]:
    """Run one request to its end: its tokens and its finishing update. (The engine may have
    work left: a producer's hold waits for its consumer, who runs meanwhile.)"""
    core = llm.engine
    core.add_request(request)
    tokens, last = [], None
    while last is None:
        out = core.step()
        for rid, tok in zip(out.request_ids, out.token_ids, strict=True):
            if rid == request.request_id:
                tokens.append(tok)
        for update in out.updates:
            if update.request_id == request.request_id and update.finish_reason:
                last = update
    return tokens, last


def disaggregated(prefill: LLM, decode: LLM, prompt: list[int], max_tokens: int):
    """The router's two calls: prefill with max_tokens=1, decode with the prefill's reply.
    Returns (decode tokens, decode's finishing update, the producer's reply)."""
    n = next(_ids)
    greedy = dict(temperature=0, ignore_eos=True)
    first = EngineRequest(
        f"p{n}",
        prompt,
        SamplingParams(max_tokens=1, **greedy),
        kv_transfer_params=KEY.sign_params({"do_remote_decode": True}),
    )
    _, done = _run(prefill, first)
    reply = done.kv_transfer_params
    second = EngineRequest(
        f"d{n}",
        prompt,
        SamplingParams(max_tokens=max_tokens, **greedy),
        kv_transfer_params=KEY.sign_params({**reply, "do_remote_prefill": True}),
    )
    tokens, update = _run(decode, second)
    return tokens, update, reply
