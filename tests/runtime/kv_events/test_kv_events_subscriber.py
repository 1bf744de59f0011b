"""KV events, router side: the prefix index, the gap-filling subscriber, `atom kv-events listen`.

Real sockets only. Where a test needs exact control of what the live stream delivers, it plays
the PUB side itself with an XPUB socket (which tells it when the subscription has arrived) and
leaves replay to a real ZmqEventPublisher.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from array import array
from pathlib import Path

import msgspec
import pytest
import xxhash
import zmq

from atom_runtime.bench.processes import ATOM
from atom_runtime.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventsConfig,
    KVEventSubscriber,
    PrefixIndex,
    ZmqEventPublisher,
    make_publisher,
)

H1 = 8356527653647720045  # contract 1: [1, 2, 3, 4]
H2 = 610383040053763902  # contract 1: [5, 6, 7, 8] after H1


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch(*events) -> EventBatch:
    return EventBatch(1.0, list(events), 0)


def stored(hashes: list[int], parent: int | None = None, block_size: int = 4) -> BlockStored:
    return BlockStored(hashes, parent, list(range(len(hashes) * block_size)), block_size)


@pytest.fixture
def ipc(tmp_path: Path):
    return lambda name="pub": f"ipc://{tmp_path}/{name}"


def wait_published(pub: ZmqEventPublisher, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while pub.published_total < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {pub.published_total} of {n} batches went out")
        time.sleep(0.005)


def poll_until(sub: KVEventSubscriber, last_seq: int, timeout: float = 30.0) -> list[int]:
    seqs: list[int] = []
    deadline = time.monotonic() + timeout
    while sub.last_seq < last_seq:
        if time.monotonic() > deadline:
            raise TimeoutError(f"subscriber stuck at seq {sub.last_seq}, wanted {last_seq}")
        seqs += [seq for seq, _ in sub.poll(50)]
    return seqs


class FakeLiveStream:
    """The live PUB side under the test's control: sends exactly the frames it is given."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)

    def wait_for_subscriber(self) -> None:
        if not self.sock.poll(5000):
            raise TimeoutError("no subscription arrived")
        assert self.sock.recv()[0] == 1  # a subscribe message

    def send(self, seq: int, payload: bytes, topic: bytes = b"") -> None:
        self.sock.send_multipart([topic, seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self.sock.close()


def ring(replay_endpoint: str, start: int) -> dict[int, bytes]:
    """The publisher's replayed (seq -> payload) from `start`, as a client sees it."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = {}
    try:
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            if seq == b"\xff" * 8:
                return out
            out[int.from_bytes(seq, "big")] = payload
        raise TimeoutError("replay never ended")
    finally:
        dealer.close()


# ---- the prefix index ---------------------------------------------------------------------------


def test_contract_hash_vector_matches_xxh64_by_hand():
    first = xxhash.xxh64_intdigest(b"".join(t.to_bytes(8, "little") for t in [1, 2, 3, 4]))
    second = xxhash.xxh64_intdigest(
        first.to_bytes(8, "little") + b"".join(t.to_bytes(8, "little") for t in [5, 6, 7, 8])
    )
    assert (first, second) == (H1, H2)


def test_match_prefix_recomputes_the_chained_hashes():
    index = PrefixIndex()
    index.apply("pod-a", batch(BlockStored([H1, H2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4)))
    assert index.hashes("pod-a") == {H1, H2}
    assert index.match_prefix("pod-a", [1, 2, 3, 4, 5, 6, 7, 8], 4) == 2
    assert index.match_prefix("pod-a", array("i", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), 4) == 2
    assert index.match_prefix("pod-a", [1, 2, 3, 4, 5, 6, 7, 9], 4) == 1
    assert index.match_prefix("pod-a", [1, 2, 3], 4) == 0  # no full block
    assert index.match_prefix("pod-a", [2, 1, 3, 4, 5, 6, 7, 8], 4) == 0
    assert index.match_prefix("pod-b", [1, 2, 3, 4], 4) == 0
    # The same tokens in blocks of 8 are other blocks entirely.
    assert index.match_prefix("pod-a", [1, 2, 3, 4, 5, 6, 7, 8], 8) == 0
    with pytest.raises(ValueError, match="block_size"):
        index.match_prefix("pod-a", [1, 2, 3, 4], 0)


def test_removed_and_cleared_blocks_stop_matching():
    index = PrefixIndex()
    index.apply("a", batch(BlockStored([H1, H2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4)))
    index.apply("b", batch(BlockStored([H1], None, [1, 2, 3, 4], 4)))
    index.apply("a", batch(BlockRemoved([H1])))
    assert index.match_prefix("a", [1, 2, 3, 4, 5, 6, 7, 8], 4) == 0  # leading block gone
    assert index.hashes("a") == {H2}
    assert index.holders(H1) == {"b"}
    index.apply("b", batch(AllBlocksCleared()))
    assert index.hashes("b") == set() and index.holders(H1) == set()
    assert index.holders(H2) == {"a"}
    index.remove_pod("a")
    assert index.holders(H2) == set() and index.pods() == ["b"]


def test_best_pods_ranks_by_matched_leading_blocks():
    index = PrefixIndex()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    index.apply("c", batch(AllBlocksCleared()))  # known, holds nothing
    index.apply("b", batch(BlockStored([H1], None, [1, 2, 3, 4], 4)))
    index.apply("a", batch(BlockStored([H1, H2], None, tokens, 4)))
    index.apply("d", batch(BlockStored([H2], H1, [5, 6, 7, 8], 4)))  # second block only
    assert index.best_pods(tokens, 4) == [("a", 2), ("b", 1), ("c", 0), ("d", 0)]
    assert index.best_pods([9, 9, 9, 9], 4) == [("a", 0), ("b", 0), ("c", 0), ("d", 0)]


# ---- the subscriber on real sockets ------------------------------------------------------------


def test_late_joining_subscriber_recovers_the_full_history_by_replay(ipc):
    replay = f"tcp://127.0.0.1:{free_tcp_port()}"
    pub = make_publisher(KVEventsConfig(True, endpoint=ipc(), replay_endpoint=replay))
    steps = [
        [BlockStored([H1], None, [1, 2, 3, 4], 4)],
        [BlockStored([H2], H1, [5, 6, 7, 8], 4)],
        [stored([77])],
        [BlockRemoved([77])],
    ]
    try:
        for events in steps:
            pub.publish(events)
        wait_published(pub, len(steps))
        sub = KVEventSubscriber(ipc(), replay, pod="pod-a")
        try:
            got = sub.poll(0)  # no live message was ever seen: all of it comes from replay
        finally:
            sub.close()
    finally:
        pub.shutdown()
    assert [seq for seq, _ in got] == [0, 1, 2, 3]
    assert [b.events for _, b in got] == steps
    assert sub.last_seq == 3
    assert (sub.gaps_unfillable, sub.batches_missed, sub.replay_failures) == (0, 0, 0)
    assert sub.index.hashes("pod-a") == {H1, H2}
    assert sub.index.match_prefix("pod-a", [1, 2, 3, 4, 5, 6, 7, 8], 4) == 2


def test_a_gap_in_the_live_stream_is_filled_from_replay(ipc):
    replay = f"tcp://127.0.0.1:{free_tcp_port()}"
    pub = make_publisher(KVEventsConfig(True, endpoint=ipc("real"), replay_endpoint=replay))
    live = FakeLiveStream(ipc("live"))
    sub = KVEventSubscriber(ipc("live"), replay, pod="p")
    try:
        pub.publish([stored([100])])
        wait_published(pub, 1)
        assert [seq for seq, _ in sub.poll(0)] == [0]  # bootstrap from replay
        live.wait_for_subscriber()
        for i in range(1, 6):
            pub.publish([stored([100 + i])])
        wait_published(pub, 6)
        frames = ring(replay, 0)
        live.send(1, frames[1])
        live.send(4, frames[4])  # 2 and 3 never arrive live
        live.send(5, frames[5])
        got = poll_until(sub, 5)
    finally:
        sub.close()
        live.close()
        pub.shutdown()
    assert got == [1, 2, 3, 4, 5]
    assert (sub.gaps_filled, sub.gaps_unfillable, sub.batches_missed) == (1, 0, 0)
    assert sub.duplicates_skipped == 2  # live 4 and 5 had already come through replay
    assert sub.index.hashes("p") == {100, 101, 102, 103, 104, 105}


def test_a_gap_older_than_the_replay_ring_is_counted_unfillable(ipc):
    replay = f"tcp://127.0.0.1:{free_tcp_port()}"
    cfg = KVEventsConfig(True, endpoint=ipc("real"), replay_endpoint=replay, buffer_steps=3)
    pub = make_publisher(cfg)
    live = FakeLiveStream(ipc("live"))
    sub = KVEventSubscriber(ipc("live"), replay, pod="p")
    try:
        pub.publish([stored([100])])
        wait_published(pub, 1)
        assert [seq for seq, _ in sub.poll(0)] == [0]
        live.wait_for_subscriber()
        for i in range(1, 10):
            pub.publish([stored([100 + i])])
        wait_published(pub, 10)
        live.send(9, ring(replay, 9)[9])
        got = poll_until(sub, 9)
    finally:
        sub.close()
        live.close()
        pub.shutdown()
    assert got == [7, 8, 9]  # all the ring still had
    assert (sub.gaps_filled, sub.gaps_unfillable, sub.batches_missed) == (0, 1, 6)
    assert sub.index.hashes("p") == {100, 107, 108, 109}


def test_without_replay_a_late_join_is_counted_as_missed(ipc):
    live = FakeLiveStream(ipc())
    sub = KVEventSubscriber(ipc())
    try:
        sub.poll(0)
        live.wait_for_subscriber()
        live.send(3, msgspec.msgpack.encode(batch(AllBlocksCleared())))
        got = poll_until(sub, 3)
    finally:
        sub.close()
        live.close()
    assert got == [3]
    assert (sub.gaps_unfillable, sub.batches_missed, sub.replay_failures) == (1, 3, 0)


def test_slow_subscriber_overflowing_zmq_buffers_recovers_every_batch(ipc):
    """The realistic gap: ZMQ drops at the high-water marks while nobody reads."""
    replay = f"tcp://127.0.0.1:{free_tcp_port()}"
    pub = make_publisher(KVEventsConfig(True, endpoint=ipc(), replay_endpoint=replay, hwm=10))
    sub = KVEventSubscriber(ipc(), replay, pod="p", rcvhwm=10)
    total = 1500
    try:
        sub.poll(0)
        start = 0  # seqs are numbered per accepted publish(), from 0
        for _ in range(100):  # wait until live messages flow
            pub.publish([AllBlocksCleared()])
            start += 1
            if sub.poll(20):
                break
        big = list(range(70_000, 70_000 + 1024))  # ~5 KB a batch, far beyond the buffers
        for i in range(total):
            pub.publish([BlockStored([1000 + i], None, big, 1024)])
        wait_published(pub, start + total)
        got = poll_until(sub, start + total - 1)
    finally:
        sub.close()
        pub.shutdown()
    assert sub.gaps_filled >= 1  # ZMQ really dropped, and replay filled it
    assert (sub.gaps_unfillable, sub.batches_missed) == (0, 0)
    assert got == sorted(set(got)) and got[-total:] == list(range(start, start + total))
    assert sub.index.hashes("p") == {1000 + i for i in range(total)}


def test_malformed_messages_are_counted_and_skipped(ipc):
    live = FakeLiveStream(ipc())
    sub = KVEventSubscriber(ipc())
    try:
        sub.poll(0)
        live.wait_for_subscriber()
        live.sock.send_multipart([b"", b"\x00" * 8])  # two frames
        live.sock.send_multipart([b"", b"\x00\x01", b"x"])  # a 2-byte seq
        live.send(0, b"\xc1")  # not msgpack
        live.send(1, msgspec.msgpack.encode(batch(stored([5]))))
        got = poll_until(sub, 1)
    finally:
        sub.close()
        live.close()
    assert got == [1]
    assert sub.malformed_total == 3
    assert (sub.gaps_unfillable, sub.batches_applied) == (0, 1)
    assert sub.index.hashes(ipc()) == {5}  # pod defaults to the endpoint


def test_map_shaped_vllm_batches_reach_the_index(ipc):
    live = FakeLiveStream(ipc())
    sub = KVEventSubscriber(ipc(), topic="kv@", pod="vllm-pod")
    payload = msgspec.msgpack.encode(
        {
            "ts": 2.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [H1, H2],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                    "block_size": 4,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            ],
            "data_parallel_rank": None,
        }
    )
    try:
        sub.poll(0)
        live.wait_for_subscriber()
        live.send(0, payload, topic=b"other@x@m")  # filtered out by the topic prefix
        live.send(0, payload, topic=b"kv@10.0.0.1:5557@m")
        got = poll_until(sub, 0)
    finally:
        sub.close()
        live.close()
    assert got == [0] and sub.malformed_total == 0
    assert sub.index.match_prefix("vllm-pod", [1, 2, 3, 4, 5, 6, 7, 8], 4) == 2


def test_unreachable_replay_times_out_and_is_counted(ipc):
    sub = KVEventSubscriber(ipc(), f"tcp://127.0.0.1:{free_tcp_port()}", replay_timeout_ms=200)
    try:
        start = time.monotonic()
        assert sub.poll(0) == []
        elapsed = time.monotonic() - start
    finally:
        sub.close()
    assert sub.replay_failures == 1
    assert elapsed > 0.15  # it waited for the timeout (no upper bound: a loaded machine is slow)


def test_background_mode_applies_events_until_stopped(ipc):
    replay = f"tcp://127.0.0.1:{free_tcp_port()}"
    pub = make_publisher(KVEventsConfig(True, endpoint=ipc(), replay_endpoint=replay))
    index = PrefixIndex()
    sub = KVEventSubscriber(ipc(), replay, pod="bg", index=index)
    try:
        sub.start()
        assert sub.running
        with pytest.raises(RuntimeError, match="background thread"):
            sub.poll(0)
        pub.publish([BlockStored([H1, H2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4)])
        deadline = time.monotonic() + 60  # a deadlock guard
        while index.match_prefix("bg", [1, 2, 3, 4, 5, 6, 7, 8], 4) != 2:
            if time.monotonic() > deadline:
                raise TimeoutError("the background subscriber never applied the batch")
            time.sleep(0.01)
    finally:
        sub.stop()
        pub.shutdown()
    assert not sub.running and sub.last_seq == 0 and sub.gaps_unfillable == 0


def test_subscriber_refuses_a_bad_endpoint():
    with pytest.raises(ValueError, match="endpoint"):
        KVEventSubscriber("localhost:5557")
    with pytest.raises(ValueError, match="replay_endpoint"):
        KVEventSubscriber("tcp://127.0.0.1:5557", "5558")


# ---- atom kv-events listen ----------------------------------------------------------------------


def run_listen(args: list[str], timeout: float = 20.0) -> tuple[str, str]:
    """Run the real `atom` CLI to completion; returns its stdout and stderr."""
    proc = subprocess.Popen(
        [str(ATOM), "kv-events", "listen", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"listen did not exit; stdout={out!r} stderr={err!r}") from None
    assert proc.returncode == 0, err
    return out, err


def test_listen_prints_the_history_from_replay(ipc):
    replay = f"tcp://127.0.0.1:{free_tcp_port()}"
    pub = make_publisher(
        KVEventsConfig(True, endpoint=ipc(), replay_endpoint=replay, topic="kv@pod@m"), 1
    )
    try:
        pub.publish([BlockStored([H1, 2**64 - 59], None, [1, 2, 3, 4, 9, 9, 9, 9], 4)])
        pub.publish([BlockRemoved([H1]), AllBlocksCleared()])
        wait_published(pub, 2)
        # data-parallel rank 1: both endpoints are offset (ipc path suffix, tcp port + 1)
        assert (pub.bound_endpoint, pub.bound_replay_endpoint) == (
            ipc() + "_dp1",
            replay[: replay.rindex(":") + 1] + str(int(replay.rsplit(":", 1)[1]) + 1),
        )
        out, err = run_listen(
            [pub.bound_endpoint, "--replay", pub.bound_replay_endpoint, "--count", "2"]
        )
    finally:
        pub.shutdown()
    lines = out.splitlines()
    assert len(lines) == 5
    assert lines[0].startswith("seq=0 ts=") and lines[0].endswith("dp_rank=1 events=1")
    assert lines[1] == (
        f"  BlockStored hashes=[{H1}, {2**64 - 59}] parent=None block_size=4 "
        "tokens=[1, 2, 3, 4, 9, 9, 9, 9] medium=GPU"
    )
    assert lines[2].startswith("seq=1 ts=") and lines[2].endswith("dp_rank=1 events=2")
    assert lines[3] == f"  BlockRemoved block_hashes=[{H1}] medium=GPU"
    assert lines[4] == "  AllBlocksCleared"
    assert "batches=2 last_seq=1 gaps_filled=0 gaps_unfillable=0" in err


def test_listen_json_prints_live_batches(ipc):
    pub = make_publisher(KVEventsConfig(True, endpoint=ipc()))
    proc = subprocess.Popen(
        [str(ATOM), "kv-events", "listen", ipc(), "--count", "2", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            pub.publish([BlockStored([H2], H1, [5, 6, 7, 8], 4, 3, "GPU", "lora-x")])
            time.sleep(0.02)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.shutdown()
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 2
    assert records[1]["seq"] == records[0]["seq"] + 1
    assert records[0]["data_parallel_rank"] == 0
    assert records[0]["events"] == [
        {
            "type": "BlockStored",
            "block_hashes": [H2],
            "parent_block_hash": H1,
            "token_ids": [5, 6, 7, 8],
            "block_size": 4,
            "lora_id": 3,
            "medium": "GPU",
            "lora_name": "lora-x",
        }
    ]


def test_listen_refuses_a_bad_endpoint():
    proc = subprocess.run(
        [str(ATOM), "kv-events", "listen", "localhost:5557", "--count", "1"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 2
    assert "needs a scheme" in proc.stderr
