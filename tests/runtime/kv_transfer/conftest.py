"""Shared by the KV-transfer tests: small real KV caches, agents over real block pools and the
real TCP connector on 127.0.0.1, a test transfer key in the environment, and the steps an engine
takes to hold a prompt (producer) and pull it (consumer)."""

from __future__ import annotations

import json
import time

import pytest
import torch
import zmq

from atom_runtime.core.block_manager import BlockManager
from atom_runtime.core.block_pool import BlockPool
from atom_runtime.core.sequence import FinishReason, Sequence
from atom_runtime.kv_transfer import tcp
from atom_runtime.kv_transfer.agent import TransferAgent
from atom_runtime.kv_transfer.auth import TransferKey
from atom_runtime.kv_transfer.base import KVCacheAccess
from atom_runtime.kv_transfer.config import KVTransferConfig
from atom_runtime.kv_transfer.payload import CHUNK_BYTES
from atom_runtime.layers.attention import PagedAttention
from atom_runtime.layers.latent_attention import LatentAttention
from atom_runtime.sampling_params import SamplingParams
from tests.server.conftest import free_port

BS = 16
NUM_BLOCKS = 24
KEY_HEX = "5e" * 32  # the deployment's transfer key in these tests


@pytest.fixture(autouse=True)
def transfer_key(monkeypatch):
    monkeypatch.setenv("ATOM_TRANSFER_KEY", KEY_HEX)
    monkeypatch.delenv("ATOM_TRANSFER_KEY_FILE", raising=False)
    return TransferKey.from_text(KEY_HEX, "test")


def _paged_layer(fill: bool, device: str = "cpu", dtype=torch.float32) -> PagedAttention:
    """An attention layer (2 KV heads of 8) with its cache bound, random or zeros."""
    layer = PagedAttention(2, 2, 8, 1.0)
    make = torch.randn if fill else torch.zeros
    layer.bind_cache([make((NUM_BLOCKS, BS, 2, 8), device=device).to(dtype) for _ in range(2)])
    return layer


def _latent_layer(fill: bool, dtype=torch.float32) -> LatentAttention:
    """An MLA layer (latent 40 + rope 12, one row a token) with its latent cache bound."""
    layer = LatentAttention(4, 40, 16, 12, 16, 1.0)
    make = torch.randn if fill else torch.zeros
    layer.bind_cache([make((NUM_BLOCKS, BS, 52)).to(dtype)])
    return layer


def _config(role: str, kv_ip: str | None = "127.0.0.1", **extra) -> KVTransferConfig:
    """The portable connector's config on 127.0.0.1 (kv_ip None: the default, the pod's)."""
    config = {
        "kv_connector": "AtomPortableConnector",
        "kv_role": role,
        "kv_ip": kv_ip,
        "kv_port": free_port(),
        "kv_connector_extra_config": extra,
    }
    if kv_ip is None:
        del config["kv_ip"]
    return KVTransferConfig.from_cli(json.dumps(config))


def _agent(
    role: str,
    fill: bool,
    device="cpu",
    dtype=torch.float32,
    direct: bool | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    **extra,
) -> TransferAgent:
    pool = BlockPool(NUM_BLOCKS, BS, enable_events=True)
    layers = [_paged_layer(fill, device, dtype), _paged_layer(fill, device, dtype)]
    kv = KVCacheAccess(layers, direct=direct)
    config = _config(role, **extra)
    return TransferAgent(config, BlockManager(pool), kv, tcp.TCPConnector(config, kv, chunk_bytes))


@pytest.fixture
def agents():
    made: list[TransferAgent] = []

    def make(role, fill=False, **kwargs):
        made.append(_agent(role, fill, **kwargs))
        return made[-1]

    yield make
    for a in made:
        a.close()


PROMPT = [(i * 37) % 900 + 1 for i in range(100)]  # 6 full blocks + 4 tokens


def _prefill(producer: TransferAgent, prompt=PROMPT) -> dict:
    """What the engine does for a max_tokens=1 request with do_remote_decode."""
    seq = Sequence("req-1", prompt, SamplingParams(max_tokens=1))
    seq.kv_transfer_params = {"do_remote_decode": True}
    bm = producer.block_manager
    assert bm.allocate(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    seq.finish(FinishReason.LENGTH)
    producer.on_finished(seq)  # before the scheduler frees the blocks
    bm.publish_computed_blocks(seq)
    bm.free(seq)
    return seq.kv_transfer_reply


def _until(cond, timeout=120.0):
    # A bound for a broken transport, not a speed expectation: a loaded 2-core CI box can take
    # seconds to schedule the transport's threads.
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _pull(consumer: TransferAgent, params: dict, prompt=PROMPT) -> Sequence:
    seq = Sequence("req-1", prompt, SamplingParams())
    seq.kv_transfer_params = params
    assert consumer.park(seq)
    ready: list = []
    _until(lambda: ready.extend(consumer.poll()) or ready)
    assert ready == [seq]
    return seq


@pytest.fixture
def silent_producer():
    """A ROUTER that takes pulls and never answers; yields (port, socket)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield port, sock
    sock.close(0)
    ctx.term()


def _params_for(port: int, prompt=PROMPT, tid="t-1") -> dict:
    producer_like = _agent("kv_producer", fill=False)
    try:
        params = _prefill(producer_like, prompt)
    finally:
        producer_like.close()
    return {**params, "remote_port": port, "remote_request_id": tid}
