"""The NIXL connector for real: two agents over real block pools and KV tensors in this process,
each with its own NIXL agent (UCX, DRAM to DRAM), control on 127.0.0.1 sealed with the test
transfer key. Pins: a pull lands the exact bytes where the prefix cache finds them and ends the
producer's hold; a head slice of the producer's blocks lands in a consumer rank of fewer heads
(heterogeneous tensor parallelism); a pull without the key, or unsealed, gets neither a grant
nor the agent metadata a read needs; the control port binds the pod's own address; close()
leaves no thread behind."""

from __future__ import annotations

import json
import threading

import msgspec
import pytest
import torch
import zmq

from atom_runtime.core.block_manager import BlockManager
from atom_runtime.core.block_pool import BlockPool
from atom_runtime.kv_transfer.agent import TransferAgent
from atom_runtime.kv_transfer.base import KVCacheAccess, RemoteBlocks
from atom_runtime.kv_transfer.config import KVTransferConfig
from atom_runtime.kv_transfer.nixl_wire import NixlGrant, NixlPull, nixl_seal
from atom_runtime.layers.attention import PagedAttention
from tests.runtime.kv_transfer.conftest import BS, NUM_BLOCKS, _paged_layer, _prefill, _pull, _until
from tests.server.conftest import free_port

pytest.importorskip("nixl_cu12._api", reason="NIXL (pip install --no-deps nixl-cu12) is absent")

from atom_runtime.kv_transfer.nixl import NixlConnector  # noqa: E402


def _config(role: str, kv_ip: str | None = "127.0.0.1", **extra) -> KVTransferConfig:
    raw = {"kv_connector": "NixlConnector", "kv_role": role, "kv_port": free_port()}
    if kv_ip is not None:
        raw["kv_ip"] = kv_ip
    raw["kv_connector_extra_config"] = extra
    return KVTransferConfig.from_cli(json.dumps(raw))


@pytest.fixture
def nixl_agents():
    made: list[TransferAgent] = []

    def make(role: str, fill: bool = False, kv_ip="127.0.0.1", **extra) -> TransferAgent:
        pool = BlockPool(NUM_BLOCKS, BS, enable_events=True)
        kv = KVCacheAccess([_paged_layer(fill), _paged_layer(fill)])
        config = _config(role, kv_ip, **extra)
        made.append(TransferAgent(config, BlockManager(pool), kv, NixlConnector(config, kv)))
        return made[-1]

    yield make
    for a in made:
        a.close()


def _ended(producer: TransferAgent) -> bool:
    producer.poll()
    return not producer.holds


def test_a_nixl_pull_moves_the_exact_blocks_and_ends_the_hold(nixl_agents):
    producer = nixl_agents("kv_producer", fill=True)
    consumer = nixl_agents("kv_consumer")
    params = _prefill(producer)
    seq = _pull(consumer, params)
    assert (consumer.stats.pulls_ok, consumer.stats.fallbacks) == (1, 0)
    local = consumer.block_manager.find_prefix_hit(seq)
    remote = params["remote_block_ids"]
    assert len(local) == len(remote) == 6
    for a, b in zip(producer.kv.layers, consumer.kv.layers, strict=True):
        assert torch.equal(a.k_cache[remote], b.k_cache[local])
        assert torch.equal(a.v_cache[remote], b.v_cache[local])
    _until(lambda: _ended(producer))  # the consumer's release (or its read's note) ends it
    assert producer.stats.holds_released == 1 and producer.stats.hold_timeouts == 0
    # The read's note may come after the release (NIXL and the control port are two channels):
    # it still counts the blocks as sent.
    _until(lambda: producer.snapshot().blocks_sent == 6)
    assert consumer.pool.num_free_blocks == NUM_BLOCKS  # the pulled blocks are cached, not held


def _rank_cache(heads: int) -> KVCacheAccess:
    """One rank's cache of a model with 2 KV heads, holding `heads` of them."""
    layers = []
    for _ in range(2):
        layer = PagedAttention(heads, heads, 8, 1.0)
        layer.bind_cache([torch.randn(NUM_BLOCKS, BS, heads, 8) for _ in range(2)])
        layers.append(layer)
    return KVCacheAccess(layers, kv_heads=2)


@pytest.mark.parametrize("head", [0, 1])
def test_a_head_slice_lands_in_a_rank_of_fewer_heads(head):
    """Prefill TP 1 -> decode TP 2: decode rank `head` reads only head `head` of each block."""
    whole, half = _rank_cache(2), _rank_cache(1)
    assert whole.layout == half.layout  # the layout names the model's heads, not a rank's
    producer = NixlConnector(_config("kv_producer"), whole)
    consumer = NixlConnector(_config("kv_consumer"), half)
    try:
        ids, into = [3, 4, 9], [20, 2, 7]
        producer.offer("t", ids)
        host, port = producer.address()
        consumer.start_pull(RemoteBlocks("t", host, port, ids, heads=(head, head + 1)), into, 60)
        results = []
        _until(lambda: results.extend(consumer.completed()) or results)
        assert results[0].error is None
        for a, b in zip(whole.full_caches, half.full_caches, strict=True):
            assert torch.equal(a[ids][:, :, head : head + 1], b[into])
    finally:
        producer.close()
        consumer.close()


def test_a_consumer_of_another_key_is_refused_and_prefills_locally(nixl_agents, monkeypatch):
    producer = nixl_agents("kv_producer", fill=True)
    params = _prefill(producer)
    monkeypatch.setenv("ATOM_TRANSFER_KEY", "a7" * 32)
    consumer = nixl_agents("kv_consumer")
    _pull(consumer, params)
    assert (consumer.stats.pulls_ok, consumer.stats.fallbacks) == (0, 1)
    assert consumer.stats.bytes_received == 0


@pytest.mark.parametrize("key", [None, "a7" * 32])
def test_an_unsealed_or_foreign_pull_gets_no_metadata(nixl_agents, key):
    """The grant carries what a NIXL read needs (the agent's metadata, the cache addresses):
    a pull not sealed with the deployment's key gets an error and nothing else."""
    from atom_runtime.kv_transfer.auth import TransferKey

    producer = nixl_agents("kv_producer", fill=True)
    params = _prefill(producer)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://127.0.0.1:{params['remote_port']}")
        seal = nixl_seal(TransferKey.from_text(key, "test") if key else None)
        msg = NixlPull(
            params["remote_request_id"],
            params["remote_block_ids"],
            producer.kv.layout,
            agent="intruder",
        )
        sock.send(msgspec.msgpack.encode(seal.seal(msg)))
        assert sock.poll(20_000), "no reply from the producer"
        grant = msgspec.msgpack.decode(sock.recv(), type=NixlGrant)
    finally:
        sock.close(0)
        ctx.term()
    assert grant.error and not grant.metadata and not grant.regions and not grant.ticket


def test_the_control_port_binds_the_pods_own_address(nixl_agents, monkeypatch):
    monkeypatch.setenv("POD_IP", "127.0.0.2")
    producer = nixl_agents("kv_producer", kv_ip=None)
    host, port = producer.connector.address()
    assert host == "127.0.0.2"
    endpoint = producer.connector._router.getsockopt_string(zmq.LAST_ENDPOINT)
    assert endpoint == f"tcp://127.0.0.2:{port}"


def test_close_stops_the_control_thread():
    before = set(threading.enumerate())
    kv = KVCacheAccess([_paged_layer(False)])
    connector = NixlConnector(_config("kv_both"), kv)
    connector.close()
    assert not connector._thread.is_alive()
    assert {t for t in threading.enumerate() if t.name == "kv-nixl"} - before == set()
