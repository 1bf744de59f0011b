"""KV events kept private, with the real engine: hashes only (no token ids on the wire) and
CurveZMQ, so only the holder of the router's key reads anything, live or through replay; the
router's index still matches prompts, salted ones under their cache_salt only."""

from __future__ import annotations

import json
import socket
import time

import pytest
import zmq

from atom_runtime import LLM, SamplingParams
from atom_runtime.kv_events import BlockStored, KVEventSubscriber
from atom_runtime.kv_events.curve import CLIENT_PUBLIC, CLIENT_SECRET, CurveKeys, write_keys
from atom_runtime.protocol.engine_core import EngineRequest

BLOCK = 16
PROMPT = list(range(200, 264))  # 4 full blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def private_engine(tiny_models, tmp_path):
    keys = tmp_path / "keys"
    write_keys(str(keys))
    port, replay = _free_port(), _free_port()
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "include_token_ids": False,
        "curve_keys_dir": str(keys),
    }
    llm = LLM(
        str(tiny_models["llama"]),
        dtype="float32",
        block_size=BLOCK,
        num_gpu_blocks_override=32,
        max_model_len=128,
        kv_events_config=json.dumps(config),
    )
    yield llm, keys, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"
    llm.shutdown()


def _run(llm, request_id: str, cache_salt: str | None = None) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine = llm.engine
    engine.add_request(EngineRequest(request_id, PROMPT, params, cache_salt=cache_salt))
    while engine.has_unfinished_requests():
        engine.step()


def _until(sub: KVEventSubscriber, want: set[int], batches: list, timeout: float = 120.0):
    deadline = time.monotonic() + timeout  # a deadlock guard
    while sub.index.hashes("pod") != want:
        batches.extend(sub.poll(20))
        assert time.monotonic() < deadline, "the keyed subscriber never caught up"


def test_only_the_routers_key_reads_events_and_hashes_alone_still_route(private_engine, tmp_path):
    llm, keys, endpoint, replay = private_engine
    # An eavesdropper with no key, and one with a client keypair of its own and the engines'
    # public key (no secret): both subscribed before anything is published.
    plain = zmq.Context.instance().socket(zmq.SUB)
    plain.setsockopt(zmq.LINGER, 0)
    plain.setsockopt(zmq.SUBSCRIBE, b"")
    plain.connect(endpoint)
    other = tmp_path / "other"
    write_keys(str(other))
    stranger = CurveKeys(
        server_public=CurveKeys.for_subscriber(str(keys), "t").server_public,
        client_public=(other / CLIENT_PUBLIC).read_text().strip().encode(),
        client_secret=(other / CLIENT_SECRET).read_text().strip().encode(),
    )
    intruder = KVEventSubscriber(endpoint, replay, pod="pod", curve=stranger, replay_timeout_ms=500)
    router = KVEventSubscriber(
        endpoint, replay, pod="pod", curve=CurveKeys.for_subscriber(str(keys), "t")
    )
    try:
        router.poll(50)
        intruder.poll(50)
        batches: list = []
        _run(llm, "unsalted")
        _until(router, set(llm.engine.cached_block_hashes()), batches)
        _run(llm, "salted", cache_salt="tenant-a")
        _until(router, set(llm.engine.cached_block_hashes()), batches)

        stored = [e for _, b in batches for e in b.events if isinstance(e, BlockStored)]
        assert stored and all(e.token_ids == [] for e in stored)  # hashes only on the wire
        # The index matches prompts from the hashes alone, a salted one under its salt only.
        assert router.index.match_prefix("pod", PROMPT, BLOCK) == 4
        assert router.index.match_prefix("pod", PROMPT, BLOCK, cache_salt="tenant-a") == 4
        assert router.index.match_prefix("pod", PROMPT, BLOCK, cache_salt="tenant-b") == 0
        # Neither eavesdropper read a thing, live or through replay.
        assert not plain.poll(1000)
        assert intruder.poll(1000) == [] and intruder.batches_applied == 0
        assert intruder.index.hashes("pod") == set()
    finally:
        plain.close()
        router.close()
        intruder.close()


def test_a_bad_key_directory_fails_engine_start_naming_the_field(tiny_models, tmp_path):
    config = {"enable_kv_cache_events": True, "curve_keys_dir": str(tmp_path / "nothing")}
    with pytest.raises(ValueError, match="curve_keys_dir.*kv-events-server"):
        LLM(str(tiny_models["llama"]), dtype="float32", kv_events_config=json.dumps(config))
