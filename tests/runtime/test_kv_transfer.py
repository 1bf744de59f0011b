"""KV transfer in one process: two TransferAgents over real block pools, real KV tensors and the
real TCP connector (ZMQ on 127.0.0.1); a bare ZMQ ROUTER plays a producer that never answers.
Pins: only the blocks a consumer lacks are pulled, the bytes land where the prefix cache finds
them and are announced as stored, and every hold and every claimed block is released on success,
on abort and on timeout."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import torch
import zmq

from atom_runtime.block_manager import BlockManager
from atom_runtime.block_pool import BlockPool
from atom_runtime.kv_events import BlockStored
from atom_runtime.kv_transfer.agent import TransferAgent
from atom_runtime.kv_transfer.base import KVCacheAccess
from atom_runtime.kv_transfer.config import KVTransferConfig
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.sequence import FinishReason, Sequence
from tests.server.conftest import free_port

BS = 16
NUM_BLOCKS = 24


class _Layer:
    def __init__(self, fill: bool, device: str = "cpu", dtype=torch.float32) -> None:
        shape = (NUM_BLOCKS, BS, 2, 8)
        make = torch.randn if fill else torch.zeros
        self.k_cache = make(shape, device=device).to(dtype)
        self.v_cache = make(shape, device=device).to(dtype)


def _config(role: str, **extra) -> KVTransferConfig:
    return KVTransferConfig.from_cli(
        json.dumps(
            {
                "kv_connector": "AtomPortableConnector",
                "kv_role": role,
                "kv_ip": "127.0.0.1",
                "kv_port": free_port(),
                "kv_connector_extra_config": extra,
            }
        )
    )


def _agent(role: str, fill: bool, device="cpu", dtype=torch.float32, **extra) -> TransferAgent:
    pool = BlockPool(NUM_BLOCKS, BS, enable_events=True)
    kv = KVCacheAccess([_Layer(fill, device, dtype), _Layer(fill, device, dtype)])
    return TransferAgent(_config(role, **extra), BlockManager(pool), kv)


@pytest.fixture
def agents():
    made: list[TransferAgent] = []

    def make(role, fill=False, **extra):
        made.append(_agent(role, fill, **extra))
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
    return seq.kv_transfer_params


def _until(cond, timeout=10.0):
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


def _block_data(kv: KVCacheAccess, block_ids: list[int]) -> torch.Tensor:
    return torch.stack(
        [torch.stack([x.k_cache[block_ids], x.v_cache[block_ids]]) for x in kv.layers]
    )


def test_a_pull_moves_the_prompt_blocks_into_the_consumers_prefix_cache(agents):
    producer = agents("kv_producer", fill=True)
    consumer = agents("kv_consumer")
    params = _prefill(producer)
    assert len(params["remote_block_ids"]) == 6 and params["remote_num_tokens"] == 100
    assert producer.pool.num_free_blocks == NUM_BLOCKS - 6  # held for the pull
    consumer.pool.drain_events()

    seq = _pull(consumer, params)
    hits = consumer.block_manager.find_prefix_hit(seq)
    assert len(hits) == 6  # (100 - 1) // 16: the last block is computed locally
    assert torch.equal(
        _block_data(consumer.kv, hits), _block_data(producer.kv, params["remote_block_ids"])
    )
    stored = [e for e in consumer.pool.drain_events() if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == params["remote_block_hashes"]
    assert consumer.pool.num_free_blocks == NUM_BLOCKS  # cached, not held
    assert consumer.stats.pulls_ok == 1 and consumer.stats.blocks_received == 6
    # The consumer's release ends the producer's hold; its blocks stay cached there.
    _until(lambda: producer.poll() == [] and not producer.holds)
    assert producer.pool.num_free_blocks == NUM_BLOCKS
    assert producer.stats.holds_released == 1 and producer.stats.hold_timeouts == 0
    assert producer.snapshot().blocks_sent == 6


def test_blocks_the_consumer_already_holds_are_not_pulled(agents):
    producer = agents("kv_producer", fill=True)
    consumer = agents("kv_consumer")
    # The consumer computed the first 3 blocks itself earlier.
    own = Sequence("earlier", PROMPT[:48] + [5], SamplingParams())
    assert consumer.block_manager.allocate(own, 49)
    own.num_computed_tokens = 49
    consumer.block_manager.publish_computed_blocks(own)
    consumer.block_manager.free(own)
    params = _prefill(producer)
    seq = _pull(consumer, params)
    assert consumer.stats.blocks_local_hit == 3
    assert consumer.stats.blocks_received == 3
    hits = consumer.block_manager.find_prefix_hit(seq)
    assert len(hits) == 6
    assert torch.equal(
        _block_data(consumer.kv, hits[3:]),
        _block_data(producer.kv, params["remote_block_ids"][3:]),
    )


def test_a_hold_nobody_pulls_times_out_and_is_counted(agents):
    producer = agents("kv_producer", fill=True, hold_timeout_s=0.2)
    _prefill(producer)
    assert producer.pool.num_free_blocks == NUM_BLOCKS - 6
    _until(lambda: producer.poll() == [] and not producer.holds)
    assert producer.stats.hold_timeouts == 1
    assert producer.pool.num_free_blocks == NUM_BLOCKS


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


def test_a_pull_that_times_out_falls_back_and_frees_its_blocks(agents, silent_producer):
    port, sock = silent_producer
    consumer = agents("kv_consumer", pull_timeout_s=0.3)
    seq = _pull(consumer, _params_for(port))  # returns once the pull has failed
    assert consumer.stats.fallbacks == 1 and consumer.stats.pulls_ok == 0
    assert consumer.block_manager.find_prefix_hit(seq) == []  # nothing half-written is cached
    assert consumer.pool.num_free_blocks == NUM_BLOCKS
    _ident, first = sock.recv_multipart()
    assert msgspec.msgpack.decode(first)["type"] == "Pull"


def test_aborting_a_parked_request_frees_everything_and_releases_the_producer(
    agents, silent_producer
):
    port, sock = silent_producer
    consumer = agents("kv_consumer", pull_timeout_s=30)
    seq = Sequence("req-1", PROMPT, SamplingParams())
    seq.kv_transfer_params = _params_for(port, tid="t-abort")
    assert consumer.park(seq)
    assert consumer.pool.num_free_blocks == NUM_BLOCKS - 6
    assert sock.poll(5000)
    sock.recv_multipart()  # the pull
    assert consumer.abort({"req-1"}) == [seq]
    assert seq.finish_reason is FinishReason.ABORT
    assert consumer.pool.num_free_blocks == NUM_BLOCKS
    assert consumer.stats.pulls_in_flight == 0
    assert sock.poll(5000)
    _ident, release = sock.recv_multipart()
    assert msgspec.msgpack.decode(release) == {"type": "Release", "transfer_id": "t-abort"}


def test_malformed_params_raise_before_anything_is_held(agents):
    consumer = agents("kv_consumer")
    seq = Sequence("req-1", PROMPT, SamplingParams())
    seq.kv_transfer_params = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_host": 3}
    with pytest.raises(ValueError, match="remote_block_hashes"):
        consumer.park(seq)
    assert consumer.pool.num_free_blocks == NUM_BLOCKS and not consumer.pulls


def test_mismatched_hashes_pull_nothing(agents, silent_producer):
    port, _ = silent_producer
    consumer = agents("kv_consumer")
    params = _params_for(port)
    seq = Sequence("req-1", [t + 1 for t in PROMPT], SamplingParams())  # another prompt
    seq.kv_transfer_params = params
    assert not consumer.park(seq)  # scheduled at once, prefilled locally
    assert consumer.pool.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize(
    "config, message",
    [
        ("{", "not valid JSON"),
        ('{"kv_role": "kv_producer"}', "kv_connector: required"),
        ('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}', "not available in this"),
        ('{"kv_connector": "AtomPortableConnector", "kv_role": "kv_x"}', "kv_role: must be"),
        ('{"kv_connector": "TCPConnector", "kv_role": "kv_both", "kv_port": 0}', "kv_port"),
        (
            '{"kv_connector": "TCPConnector", "kv_role": "kv_both", '
            '"kv_connector_extra_config": {"pull_timeout_s": -1}}',
            "pull_timeout_s",
        ),
    ],
)
def test_bad_transfer_configs_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.from_cli(config)


def test_a_vllm_style_config_is_accepted():
    cfg = KVTransferConfig.from_cli(
        '{"kv_connector": "AtomPortableConnector", "kv_role": "kv_both", "kv_buffer_size": 1e9}'
    )
    assert cfg.is_producer and cfg.is_consumer and cfg.kv_port == 14579


@pytest.mark.parametrize(
    ("tp", "hybrid", "message"),
    [(2, False, "needs tensor_parallel_size 1"), (1, True, "per-request recurrent state")],
)
def test_engines_a_transfer_cannot_serve_are_refused_at_start(tp, hybrid, message):
    """TP shards and hybrid models' recurrent state do not travel: refused before anything binds."""
    from types import SimpleNamespace

    from atom_runtime.kv_transfer import make_transfer_agent

    config = SimpleNamespace(
        kv_transfer_config='{"kv_connector": "AtomPortableConnector", "kv_role": "kv_both"}',
        tensor_parallel_size=tp,
    )
    with pytest.raises(ValueError, match=message):
        make_transfer_agent(config, block_manager=None, runner=None, hybrid=hybrid)


@pytest.mark.gpu
def test_a_pull_between_gpu_caches_is_exact(agents):
    """Device -> pinned host on the side stream -> TCP -> pinned host -> device, in bf16."""
    producer = agents("kv_producer", fill=True, device="cuda", dtype=torch.bfloat16)
    consumer = agents("kv_consumer", device="cuda", dtype=torch.bfloat16)
    params = _prefill(producer)
    seq = _pull(consumer, params)
    hits = consumer.block_manager.find_prefix_hit(seq)
    assert len(hits) == 6
    torch.cuda.synchronize()
    assert torch.equal(
        _block_data(consumer.kv, hits), _block_data(producer.kv, params["remote_block_ids"])
    )
