"""The KV-event replay ROUTER socket under abuse: a flood of malformed requests is counted one by
one but logged at most once per interval, an oversized frame never reaches the engine, and the
socket keeps answering well-formed requests throughout. Real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from atom_runtime.kv_events import BlockStored, KVEventsConfig, make_publisher
from atom_runtime.kv_events.publisher import REPLAY_MAX_FRAME_BYTES, REPLAY_WARNING_INTERVAL_S
from tests.runtime.kv_events.test_kv_events import ask_replay, free_tcp_port

GUARD_S = 120.0  # deadlock guard, not a correctness window


@pytest.fixture
def publisher(tmp_path):
    cfg = KVEventsConfig(
        True, endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"tcp://127.0.0.1:{free_tcp_port()}"
    )
    pub = make_publisher(cfg)
    pub.publish([BlockStored([1], None, [1, 2, 3, 4], 4)])
    deadline = time.monotonic() + GUARD_S
    while pub.published_total < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield pub, cfg.replay_endpoint
    finally:
        pub.shutdown()


def _dealer(endpoint: str) -> zmq.Socket:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    return dealer


def test_a_flood_of_malformed_requests_is_counted_but_logged_at_a_bounded_rate(publisher, caplog):
    pub, endpoint = publisher
    caplog.set_level(logging.WARNING, logger="atom_runtime.kv_events.publisher")
    dealer = _dealer(endpoint)
    flood = 2000
    began = time.monotonic()
    try:
        for i in range(flood):
            # Wrong shapes: no delimiter, a short seq, too many frames.
            shape = [[b"x"], [b"", b"\x01"], [b"", b"\x00" * 8, b"more", b"and more"]][i % 3]
            dealer.send_multipart(shape)
        deadline = time.monotonic() + GUARD_S
        while pub.replay_errors_total < flood:
            assert time.monotonic() < deadline, pub.replay_errors_total
            time.sleep(0.01)
    finally:
        dealer.close()
    elapsed = time.monotonic() - began
    warnings = [r for r in caplog.records if "malformed KV event replay request" in r.message]
    assert pub.replay_errors_total == flood
    # One warning, plus one per interval the flood lasted (a slow machine may take several).
    assert 1 <= len(warnings) <= 1 + int(elapsed / REPLAY_WARNING_INTERVAL_S) + 1
    assert ask_replay(endpoint, 0)[-1][1] == (-1).to_bytes(8, "big", signed=True)


def test_an_oversized_frame_is_refused_by_the_socket(publisher):
    pub, endpoint = publisher
    big = _dealer(endpoint)
    try:
        big.send_multipart([b"", b"\x00" * (16 * 1024 * 1024)])
        # libzmq drops the peer before the frame is buffered: no answer, nothing counted, and
        # the socket still serves everyone else.
        replies = ask_replay(endpoint, 0)
        assert [int.from_bytes(r[1], "big", signed=True) for r in replies] == [0, -1]
        assert not big.poll(200)
        assert pub.replay_errors_total == 0
    finally:
        big.close()
    assert REPLAY_MAX_FRAME_BYTES < 16 * 1024 * 1024
