"""KV events end to end with the real engine: a subscriber on 127.0.0.1 keeps an index equal to
the engine's set of cached block hashes after every step, through prefix hits, evictions and a
reset; every published hash re-derives from the published tokens (contract 1, docs/architecture.md)."""

from __future__ import annotations

import json
import random
import socket
import time

import pytest

from atom_runtime import LLM, SamplingParams
from atom_runtime.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventSubscriber
from atom_runtime.protocol.block_hash import hash_block_tokens
from atom_runtime.protocol.engine_core import EngineRequest

BLOCK = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until_equal(sub, pod, want, batches, timeout=120.0):  # a deadlock guard
    deadline = time.monotonic() + timeout
    while True:
        batches.extend(sub.poll(20))
        if sub.index.hashes(pod) == want:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"index {sorted(sub.index.hashes(pod))} != engine {sorted(want)}")


@pytest.fixture
def engine_with_events(tiny_models):
    port, replay = _free_port(), _free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv@pod-a@tiny",
    }
    llm = LLM(
        str(tiny_models["llama"]),
        dtype="float32",
        block_size=BLOCK,
        num_gpu_blocks_override=10,  # 160 tokens: the workload below must evict
        max_model_len=128,
        kv_events_config=json.dumps(config),
    )
    sub = KVEventSubscriber(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", topic="kv@", pod="pod-a"
    )
    yield llm, sub
    sub.close()
    llm.shutdown()


def test_index_tracks_the_engine_after_every_step(engine_with_events):
    llm, sub = engine_with_events
    engine = llm.engine
    rng = random.Random(0)
    shared = [rng.randrange(3, 40000) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 40000) for _ in range(n)] for n in (5, 21, 9)]
    prompts += [[rng.randrange(3, 40000) for _ in range(n)] for n in (70, 33, 50)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    batches = []
    sub.poll(50)  # connect (and ask for replay from 0)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
        # Step a few times between arrivals so later prompts hit earlier prefixes.
        for _ in range(4):
            engine.step()
            _until_equal(sub, "pod-a", set(engine.cached_block_hashes()), batches)
    while engine.has_unfinished_requests():
        engine.step()
        _until_equal(sub, "pod-a", set(engine.cached_block_hashes()), batches)

    events = [e for _, b in batches for e in b.events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert stored and removed, "the small pool must store and evict"
    assert engine.scheduler.prefix_hits >= 32  # the shared 40-token prefix hit (2 blocks)
    # A hash is stored again only after it was removed: prefix hits emit nothing.
    live: set[int] = set()
    for e in events:
        if isinstance(e, BlockStored):
            assert not live & set(e.block_hashes), "a cache hit was published as BlockStored"
            live |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= live, "removed a hash that was never stored"
            live -= set(e.block_hashes)
    # Contract 1: every stored hash re-derives from its parent and the published tokens.
    for e in stored:
        parent = e.parent_block_hash
        assert len(e.token_ids) == BLOCK * len(e.block_hashes) and e.block_size == BLOCK
        for i, h in enumerate(e.block_hashes):
            parent = hash_block_tokens(parent, e.token_ids[i * BLOCK : (i + 1) * BLOCK])
            assert parent == h
    assert sub.gaps_unfillable == 0

    assert llm.reset_prefix_cache() is True
    _until_equal(sub, "pod-a", set(), batches)
    assert isinstance(batches[-1][1].events[-1], AllBlocksCleared)


def test_late_subscriber_recovers_history_through_replay(engine_with_events, tiny_models):
    llm, early = engine_with_events
    llm.generate(
        [{"prompt_token_ids": list(range(100, 100 + n))} for n in (40, 60)],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    want = set(llm.engine.cached_block_hashes())
    assert want
    late = KVEventSubscriber(early.endpoint, early.replay_endpoint, topic="kv@", pod="pod-a")
    try:
        _until_equal(late, "pod-a", want, [])
        assert late.last_seq == llm.engine.publisher.published_total - 1
    finally:
        late.close()
