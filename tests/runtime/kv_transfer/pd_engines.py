"""Prefill/decode with real engines, driven the way the router drives them (signed
kv_transfer_params, max_tokens=1 on the prefill engine, its reply to the decode engine): the
producer is an `atom serve` process (any tensor-parallel size), the consumer an `LLM` in this
process (any tensor-parallel size). Tensor-parallel state is per process (system/distributed.py),
so two engines of one process cannot both run, whatever their sizes: hence the subprocess."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import httpx

from atom_runtime import LLM, SamplingParams
from atom_runtime.kv_transfer.auth import TransferKey
from atom_runtime.protocol.engine_core import EngineRequest
from tests.server.conftest import TINY_FLAGS, Launcher, ServerProcess, free_ports

KEY_HEX = "6d" * 32
KEY = TransferKey.from_text(KEY_HEX, "test")
_ids = itertools.count()


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
    """An engine in this process (the consumer)."""
    kwargs.setdefault("num_gpu_blocks_override", 128)
    return LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        tensor_parallel_size=tp,
        kv_transfer_config=transfer_config(connector, role, tp),
        **kwargs,
    )


def producer_process(launcher: Launcher, folder: Path, connector: str, tp: int) -> ServerProcess:
    """`atom serve` as a kv_producer at tensor-parallel size tp (stopped by the launcher)."""
    return launcher(
        "--model",
        str(folder),
        *TINY_FLAGS,
        "--max-model-len",
        "512",
        "--tensor-parallel-size",
        str(tp),
        "--kv-transfer-config",
        transfer_config(connector, "kv_producer", tp),
        env={"ATOM_TRANSFER_KEY": KEY_HEX},
    )


def remote_prefill(server: ServerProcess, folder: Path, prompt: list[int]) -> dict:
    """The router's first call: the prompt with max_tokens=1 and signed do_remote_decode; the
    producer's kv_transfer_params (where its held blocks are)."""
    body = {
        "model": str(folder),
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": KEY.sign_params({"do_remote_decode": True}),
    }
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    if r.status_code != 200:
        raise AssertionError(f"prefill answered {r.status_code}: {r.text}")
    return r.json()["kv_transfer_params"]


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


def remote_decode(decode: LLM, reply: dict, prompt: list[int], max_tokens: int):
    """The router's second call: the prompt on the decode engine with the producer's reply
    (signed). Returns (its greedy tokens, its finishing update)."""
    request = EngineRequest(
        f"d{next(_ids)}",
        prompt,
        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        kv_transfer_params=KEY.sign_params({**reply, "do_remote_prefill": True}),
    )
    return _run(decode, request)
