"""KV events, engine side: the wire format, the config, and the never-blocking publisher.

Real ZMQ sockets only (ipc in a temp folder, tcp on 127.0.0.1); no mocks.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from array import array
from pathlib import Path

import msgspec
import pytest
import zmq

from atom_runtime.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventDecodeError,
    KVEventPublisherError,
    KVEventsConfig,
    NullEventPublisher,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
    make_publisher,
)
from atom_runtime.kv_events.config import endpoint_binds, offset_endpoint

DATA = Path(__file__).parent / "data"
H1 = 8356527653647720045  # contract 1: [1, 2, 3, 4]
H2 = 610383040053763902  # contract 1: [5, 6, 7, 8] after H1
BIG = 18446744073709551557  # above 2**63 - 1: must travel as msgpack uint64


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stored(hashes: list[int], parent: int | None = None, block_size: int = 4) -> BlockStored:
    tokens = list(range(1, len(hashes) * block_size + 1))
    return BlockStored(hashes, parent, tokens, block_size)


def recv_frames(sub: zmq.Socket, timeout_ms: int = 60000) -> list[bytes]:
    if not sub.poll(timeout_ms):
        raise TimeoutError("no message within the timeout")
    return sub.recv_multipart()


@pytest.fixture
def ipc(tmp_path: Path):
    def endpoint(name: str = "pub") -> str:
        return f"ipc://{tmp_path}/{name}"

    return endpoint


def subscribed(endpoint: str, topic: bytes = b"") -> zmq.Socket:
    """A SUB socket connected to `endpoint`, once a probe shows the subscription has arrived."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def publish_until_received(pub: ZmqEventPublisher, sub: zmq.Socket) -> list[bytes]:
    """PUB/SUB joins asynchronously: publish probes until one arrives, return its frames.
    (Probes are `[AllBlocksCleared()]` batches; later ones may still arrive after this returns.)"""
    deadline = time.monotonic() + 60  # a deadlock guard
    while time.monotonic() < deadline:
        pub.publish([AllBlocksCleared()])
        if sub.poll(25):
            return sub.recv_multipart()
    raise TimeoutError("subscription never reached the publisher")


# ---- events and the type boundary ------------------------------------------------------------


def test_block_stored_takes_lists_and_refuses_an_array_naming_the_field():
    ok = BlockStored([H1], None, [1, 2, 3, 4], 4)
    assert ok.token_ids == [1, 2, 3, 4] and ok.medium == "GPU" and ok.lora_id is None
    with pytest.raises(TypeError, match=r"BlockStored\.token_ids must be a list, got array"):
        BlockStored([H1], None, array("i", [1, 2, 3, 4]), 4)
    with pytest.raises(TypeError, match=r"BlockStored\.block_hashes must be a list, got tuple"):
        BlockStored((H1,), None, [1, 2, 3, 4], 4)
    with pytest.raises(TypeError, match=r"BlockRemoved\.block_hashes must be a list, got array"):
        BlockRemoved(array("Q", [H1]))


def test_block_hashes_must_be_unsigned_64_bit():
    assert BlockStored([BIG], BIG, [1, 2, 3, 4], 4).block_hashes == [BIG]
    with pytest.raises(ValueError, match="not an unsigned 64-bit int"):
        BlockStored([-1], None, [1, 2, 3, 4], 4)
    with pytest.raises(ValueError, match="parent_block_hash"):
        BlockStored([H1], 1 << 64, [1, 2, 3, 4], 4)
    with pytest.raises(TypeError, match="block hash must be int, got bool"):
        BlockRemoved([True])


def test_block_stored_token_count_must_match_blocks():
    with pytest.raises(ValueError, match="has 3 tokens; 1 blocks of 4 need 4"):
        BlockStored([H1], None, [1, 2, 3], 4)


def test_event_arrays_are_tagged_in_vllm_field_order():
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(BlockStored([BIG], H1, [1, 2, 3, 4], 4)))
    assert raw == ["BlockStored", [BIG], H1, [1, 2, 3, 4], 4, None, "GPU", None]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(BlockRemoved([H2]))) == [
        "BlockRemoved",
        [H2],
        "GPU",
    ]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(AllBlocksCleared())) == [
        "AllBlocksCleared"
    ]
    batch = EventBatch(1.5, [AllBlocksCleared()], 2)
    assert msgspec.msgpack.decode(encode_batch(batch)) == [1.5, [["AllBlocksCleared"]], 2]


# ---- golden bytes, read by a decoder that knows only the msgpack spec ---------------------------


class MiniMsgpack:
    """Just enough msgpack to read vLLM's KV event layout, written from the msgpack spec."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        chunk = self.data[self.pos : self.pos + n]
        if len(chunk) != n:
            raise ValueError("truncated msgpack")
        self.pos += n
        return chunk

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "big")

    def value(self):
        b = self.take(1)[0]
        if b <= 0x7F:
            return b  # positive fixint
        if b >= 0xE0:
            return b - 0x100  # negative fixint
        if 0x90 <= b <= 0x9F:
            return [self.value() for _ in range(b & 0x0F)]  # fixarray
        if 0xA0 <= b <= 0xBF:
            return self.take(b & 0x1F).decode("utf-8")  # fixstr
        if b == 0xC0:
            return None
        if b in (0xC2, 0xC3):
            return b == 0xC3
        if b == 0xCB:
            return struct.unpack(">d", self.take(8))[0]  # float64
        if b in (0xCC, 0xCD, 0xCE, 0xCF):
            return self.uint(1 << (b - 0xCC))  # uint8/16/32/64
        if b in (0xD0, 0xD1, 0xD2, 0xD3):
            return int.from_bytes(self.take(1 << (b - 0xD0)), "big", signed=True)  # int8..64
        if b == 0xD9:
            return self.take(self.uint(1)).decode("utf-8")  # str8
        if b == 0xDC:
            return [self.value() for _ in range(self.uint(2))]  # array16
        if b == 0xDD:
            return [self.value() for _ in range(self.uint(4))]  # array32
        raise ValueError(f"msgpack type byte 0x{b:02x} is not part of the KV event layout")

    def document(self):
        out = self.value()
        if self.pos != len(self.data):
            raise ValueError(f"{len(self.data) - self.pos} trailing bytes")
        return out


GOLDEN_BATCH = EventBatch(
    ts=1767225600.25,
    events=[
        BlockStored([H1, H2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None),
        BlockStored([BIG], H2, [9, 300, 70000, 4294967295], 4, 7, "GPU", "adapter-a"),
        BlockRemoved([H1, BIG], "GPU"),
        AllBlocksCleared(),
    ],
    data_parallel_rank=3,
)


def test_golden_batch_bytes_are_what_we_encode():
    golden = (DATA / "kv_events_batch.bin").read_bytes()
    assert encode_batch(GOLDEN_BATCH) == golden
    assert decode_batch(golden) == GOLDEN_BATCH


def test_golden_batch_read_by_hand_written_decoder():
    golden = (DATA / "kv_events_batch.bin").read_bytes()
    assert golden[0] == 0x93  # the batch is a 3-element array, not a map
    ts, events, rank = MiniMsgpack(golden).document()
    assert ts == 1767225600.25
    assert rank == 3
    assert events == [
        ["BlockStored", [H1, H2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None],
        ["BlockStored", [BIG], H2, [9, 300, 70000, 4294967295], 4, 7, "GPU", "adapter-a"],
        ["BlockRemoved", [H1, BIG], "GPU"],
        ["AllBlocksCleared"],
    ]
    # The hash above 2**63 is a uint64 (0xcf), never a negative int64 (0xd3).
    assert bytes([0xCF]) + BIG.to_bytes(8, "big") in golden
    assert bytes([0xD3]) not in golden


def test_mini_decoder_fails_on_corrupt_bytes():
    golden = (DATA / "kv_events_batch.bin").read_bytes()
    with pytest.raises(ValueError, match="truncated"):
        MiniMsgpack(golden[:-5]).document()


# ---- decoding what other vLLM versions send -----------------------------------------------------


def test_map_shaped_vllm_events_decode():
    payload = msgspec.msgpack.encode(
        {
            "ts": 12.5,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [BIG],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, 4],
                    "block_size": 4,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None],
                    "group_idx": 0,
                },
                {"type": "BlockRemoved", "block_hashes": [H1], "medium": "CPU"},
                {"type": "AllBlocksCleared"},
            ],
            "data_parallel_rank": 1,
        }
    )
    assert decode_batch(payload) == EventBatch(
        12.5,
        [BlockStored([BIG], None, [1, 2, 3, 4], 4), BlockRemoved([H1], "CPU"), AllBlocksCleared()],
        1,
    )


def test_map_events_inside_an_array_batch_and_unknown_trailing_fields_decode():
    payload = msgspec.msgpack.encode(
        [
            3.0,
            [
                ["BlockStored", [H1], None, [1, 2, 3, 4], 4, None, "GPU", None, [None], 0],
                {"type": "BlockRemoved", "block_hashes": [H1]},
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch == EventBatch(
        3.0, [BlockStored([H1], None, [1, 2, 3, 4], 4), BlockRemoved([H1], "GPU")], None
    )  # a map without `medium` (older vLLM) means the GPU


def test_signed_and_bytes_hashes_are_read_as_uint64():
    payload = msgspec.msgpack.encode(
        [1.0, [["BlockRemoved", [-59, b"\x00" * 24 + H1.to_bytes(8, "big")], "GPU"]], 0]
    )
    assert decode_batch(payload).events == [BlockRemoved([BIG, H1], "GPU")]


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\xc1", "not msgpack"),
        (msgspec.msgpack.encode([1.0, [["Nope", 1]]]), "unknown event tag 'Nope'"),
        (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None]]]), "payload is not a KV"),
        (msgspec.msgpack.encode("hello"), "batch must be an array or a map"),
    ],
)
def test_garbage_payloads_raise_decode_error(payload: bytes, message: str):
    with pytest.raises(KVEventDecodeError, match=message):
        decode_batch(payload)


# ---- config -------------------------------------------------------------------------------------


def test_config_defaults_match_vllm_but_bind_the_pods_own_address(monkeypatch):
    cfg = KVEventsConfig()
    assert (cfg.enable_kv_cache_events, cfg.publisher, cfg.endpoint) == (False, "null", None)
    # vLLM binds tcp://*:5557; ATOM the pod's address (every prompt's token ids go out here).
    monkeypatch.delenv("POD_IP", raising=False)
    assert cfg.publish_endpoint() == "tcp://127.0.0.1:5557"
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert (cfg.publish_endpoint(), cfg.publish_endpoint(2)) == (
        "tcp://10.1.2.3:5557",
        "tcp://10.1.2.3:5559",
    )
    assert (cfg.include_token_ids, cfg.curve_keys_dir) == (True, None)
    assert (cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.topic) == (
        None,
        10_000,
        100_000,
        100_000,
        "",
    )
    # Like vLLM: enabling events without naming a publisher picks zmq.
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert KVEventsConfig(enable_kv_cache_events=True, publisher="null").enabled is False
    assert KVEventsConfig(publisher="zmq").enabled is False


def test_from_cli_reads_the_json_flag():
    cfg = KVEventsConfig.from_cli(
        json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": "tcp://*:6000",
                "replay_endpoint": "tcp://*:6001",
                "buffer_steps": 5,
                "hwm": 7,
                "max_queue_size": 9,
                "topic": "kv@10.0.0.1:6000@m",
            }
        ),
        environ={},
    )
    assert cfg == KVEventsConfig(
        True, "zmq", "tcp://*:6000", "tcp://*:6001", 5, 7, 9, "kv@10.0.0.1:6000@m"
    )


@pytest.mark.parametrize(
    "flag, field",
    [
        ("{not json", "--kv-events-config"),
        ("[1, 2]", "--kv-events-config"),
        ('{"endpont": "tcp://*:1"}', "endpont"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events"),
        ('{"hwm": true}', "hwm"),
        ('{"buffer_steps": 1.5}', "buffer_steps"),
        ('{"buffer_steps": -1}', "buffer_steps"),
        ('{"hwm": -5}', "hwm"),
        ('{"max_queue_size": 0}', "max_queue_size"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"endpoint": "localhost:5557"}', "endpoint"),
        ('{"endpoint": "tcp://*"}', "endpoint"),
        ('{"endpoint": "tcp://*:99999"}', "endpoint"),
        ('{"replay_endpoint": "127.0.0.1:5558"}', "replay_endpoint"),
        ('{"topic": 5}', "topic"),
        ('{"include_token_ids": "no"}', "include_token_ids"),
        ('{"enable_kv_cache_events": true, "curve_keys_dir": "/nonexistent"}', "curve_keys_dir"),
    ],
)
def test_from_cli_names_the_bad_field(flag: str, field: str):
    with pytest.raises(ValueError) as info:
        KVEventsConfig.from_cli(flag, environ={})
    assert info.value.field == field
    assert repr(field) in str(info.value)


def test_env_vars_set_fields_and_the_flag_wins_per_field():
    env = {
        "ATOM_KV_EVENTS_ENABLE_KV_CACHE_EVENTS": "true",
        "ATOM_KV_EVENTS_ENDPOINT": "tcp://*:7000",
        "ATOM_KV_EVENTS_BUFFER_STEPS": "42",
        "ATOM_KV_EVENTS_TOPIC": "from-env",
        "ATOM_KV_EVENTS_REPLAY_ENDPOINT": "",  # empty is unset
        "UNRELATED": "x",
    }
    cfg = KVEventsConfig.from_cli('{"topic": "from-flag", "hwm": 3}', environ=env)
    assert cfg.enable_kv_cache_events is True and cfg.publisher == "zmq"
    assert (cfg.endpoint, cfg.buffer_steps, cfg.topic, cfg.hwm) == (
        "tcp://*:7000",
        42,
        "from-flag",
        3,
    )
    assert cfg.replay_endpoint is None
    assert (
        KVEventsConfig.from_cli(None, environ={"ATOM_KV_EVENTS_PUBLISHER": "null"}).publisher
        == "null"
    )


@pytest.mark.parametrize(
    "env, field",
    [
        ({"ATOM_KV_EVENTS_HWM": "lots"}, "ATOM_KV_EVENTS_HWM"),
        (
            {"ATOM_KV_EVENTS_ENABLE_KV_CACHE_EVENTS": "maybe"},
            "ATOM_KV_EVENTS_ENABLE_KV_CACHE_EVENTS",
        ),
        ({"ATOM_KV_EVENTS_ENDPONT": "tcp://*:1"}, "ATOM_KV_EVENTS_ENDPONT"),
        ({"ATOM_KV_EVENTS_MAX_QUEUE_SIZE": "-3"}, "max_queue_size"),
    ],
)
def test_bad_env_vars_name_the_variable(env: dict[str, str], field: str):
    with pytest.raises(ValueError) as info:
        KVEventsConfig.from_cli(None, environ=env)
    assert info.value.field == field


def test_bind_or_connect_and_data_parallel_offsets():
    assert endpoint_binds("tcp://*:5557") is True
    assert endpoint_binds("ipc:///tmp/kv") is True
    assert endpoint_binds("inproc://kv") is True
    assert endpoint_binds("tcp://10.0.0.7:5557") is False  # not this host's: a central binder
    assert endpoint_binds("tcp://indexer:5557") is False
    # An address of this host binds (what the operator renders: tcp://$(POD_IP):5557).
    assert endpoint_binds("tcp://127.0.0.2:5557") is True
    assert endpoint_binds("tcp://localhost:5557") is True
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://[::1]:5557", 2) == "tcp://[::1]:5559"
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"
    cfg = KVEventsConfig(True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600")
    assert (cfg.publish_endpoint(4), cfg.replay_publish_endpoint(4)) == (
        "tcp://*:5561",
        "tcp://*:5604",
    )
    assert KVEventsConfig(True).replay_publish_endpoint(4) is None
    with pytest.raises(ValueError, match="exceeds 65535"):
        offset_endpoint("tcp://*:65535", 1)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        offset_endpoint("tcp://*:5557", -1)


# ---- the publisher on real sockets --------------------------------------------------------------


def test_make_publisher_picks_null_when_disabled():
    assert isinstance(make_publisher(KVEventsConfig()), NullEventPublisher)
    null = make_publisher(KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
    assert isinstance(null, NullEventPublisher)
    null.publish([AllBlocksCleared()])
    null.raise_if_failed()
    assert (null.published_total, null.dropped_total) == (0, 0)
    with pytest.raises(TypeError, match="takes a list"):
        null.publish((AllBlocksCleared(),))


def ask_replay(endpoint: str, start: int, timeout_ms: int = 60000) -> list[list[bytes]]:
    """Every reply frame list for one replay request, up to and including the end marker."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            if not dealer.poll(timeout_ms):
                raise TimeoutError("replay never ended")
            replies.append(dealer.recv_multipart())
            if replies[-1][1] == (-1).to_bytes(8, "big", signed=True):
                return replies
    finally:
        dealer.close()


def test_wire_frames_are_topic_seq_payload_with_seq_from_zero(ipc):
    cfg = KVEventsConfig(
        True,
        endpoint=ipc(),
        replay_endpoint=f"tcp://127.0.0.1:{free_tcp_port()}",
        topic="kv@10.1.2.3:5557@llama",
    )
    pub = make_publisher(cfg, data_parallel_rank=0)
    assert isinstance(pub, ZmqEventPublisher)
    sub = subscribed(cfg.endpoint)
    try:
        # PUB/SUB joins asynchronously, so the first probes may be lost; the replay ring below
        # still shows every seq from 0.
        publish_until_received(pub, sub)
        pub.publish([])  # an empty step sends nothing
        steps = [[stored([H1])], [BlockRemoved([H1])], [AllBlocksCleared(), stored([H2], H1)]]
        before = time.time()
        for events in steps:
            pub.publish(events)
        frames = []
        while len(frames) < len(steps):
            message = recv_frames(sub)
            if decode_batch(message[2]).events != [AllBlocksCleared()]:  # not a late probe
                frames.append(message)
        assert not sub.poll(100), "an empty publish() must not send a message"
        replayed = ask_replay(cfg.replay_endpoint, 0)
    finally:
        sub.close()
        pub.shutdown()
    first = int.from_bytes(frames[0][1], "big")  # the steps follow the probes' seqs
    for i, (message, events) in enumerate(zip(frames, steps, strict=True)):
        assert len(message) == 3
        topic, seq, payload = message
        assert topic == b"kv@10.1.2.3:5557@llama"
        assert len(seq) == 8 and int.from_bytes(seq, "big") == first + i
        batch = decode_batch(payload)
        assert batch.events == events and batch.data_parallel_rank == 0
        assert before <= batch.ts <= time.time()
    total = first + len(steps)
    assert (pub.published_total, pub.dropped_total) == (total, 0)
    # The ring holds every batch: seqs 0, 1, 2, ... with the same bytes that went out live.
    assert [int.from_bytes(r[1], "big") for r in replayed[:-1]] == list(range(total))
    assert [r[2] for r in replayed[-1 - len(steps) : -1]] == [m[2] for m in frames]
    assert replayed[-1] == [b"", b"\xff" * 8, b""]


def test_replay_answers_from_start_seq_then_the_end_marker(ipc):
    cfg = KVEventsConfig(
        True, endpoint=ipc(), replay_endpoint=f"tcp://127.0.0.1:{free_tcp_port()}", buffer_steps=5
    )
    pub = make_publisher(cfg)
    try:
        for i in range(8):
            pub.publish([stored([i + 1])])
        deadline = time.monotonic() + 60  # a deadlock guard
        while pub.published_total < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        from_five = ask_replay(cfg.replay_endpoint, 5)
        from_zero = ask_replay(cfg.replay_endpoint, 0)  # older than the ring: what it still has
        past_end = ask_replay(cfg.replay_endpoint, 100)
    finally:
        pub.shutdown()
    end = [b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert [int.from_bytes(r[1], "big") for r in from_five[:-1]] == [5, 6, 7]
    assert [decode_batch(r[2]).events for r in from_five[:-1]] == [
        [stored([6])],
        [stored([7])],
        [stored([8])],
    ]
    assert from_five[-1] == end
    assert [int.from_bytes(r[1], "big") for r in from_zero[:-1]] == [3, 4, 5, 6, 7]
    assert past_end == [end]
    assert pub.replay_errors_total == 0


def test_publisher_connects_to_a_bound_subscriber_over_tcp():
    """A host name (an indexer's Service, say) is connected to; only this host's addresses are
    bound. The machine's own name stands for a remote indexer here."""
    port = free_tcp_port()
    host = socket.gethostname()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://{socket.gethostbyname(host)}:{port + 2}")  # rank 2 adds 2 to the port
    pub = make_publisher(KVEventsConfig(True, endpoint=f"tcp://{host}:{port}"), 2)
    try:
        topic, seq, payload = publish_until_received(pub, sub)
    finally:
        sub.close()
        pub.shutdown()
    assert pub.bound_endpoint is None  # it connected
    assert topic == b""
    batch = decode_batch(payload)
    assert (batch.events, batch.data_parallel_rank) == ([AllBlocksCleared()], 2)


def test_data_parallel_rank_offsets_the_bound_ports(ipc):
    port = free_tcp_port()
    cfg = KVEventsConfig(True, endpoint=ipc(), replay_endpoint=f"tcp://127.0.0.1:{port}")
    pub = make_publisher(cfg, data_parallel_rank=1)
    try:
        assert pub.bound_endpoint == ipc() + "_dp1"
        assert pub.bound_replay_endpoint == f"tcp://127.0.0.1:{port + 1}"
    finally:
        pub.shutdown()


def test_a_busy_endpoint_fails_at_construction(ipc):
    port = free_tcp_port()
    cfg = KVEventsConfig(True, endpoint=ipc(), replay_endpoint=f"tcp://127.0.0.1:{port}")
    first = make_publisher(cfg)
    try:
        with pytest.raises(zmq.ZMQError):
            make_publisher(
                KVEventsConfig(True, endpoint=ipc("b"), replay_endpoint=cfg.replay_endpoint)
            )
    finally:
        first.shutdown()


def test_publish_never_blocks_and_drops_oldest_when_full(ipc):
    # Nobody subscribes and the queue holds 4 batches: 50k steps must go through at once.
    pub = make_publisher(KVEventsConfig(True, endpoint=ipc(), max_queue_size=4, hwm=1))
    total = 50_000
    events = [stored([H1])]
    try:
        start = time.perf_counter()
        for _ in range(total):
            pub.publish(events)
        elapsed = time.perf_counter() - start
    finally:
        pub.shutdown()
    assert elapsed < 60.0  # a blocking publish would wait forever: nobody listens
    assert pub.dropped_total > 0
    assert pub.published_total + pub.dropped_total == total


def test_dropped_batches_leave_a_hole_in_the_sequence(ipc):
    """A batch dropped from the full queue keeps its seq, so subscribers can see the loss."""
    pub = make_publisher(KVEventsConfig(True, endpoint=ipc(), max_queue_size=1))
    sub = subscribed(pub.bound_endpoint)
    try:
        seen = [int.from_bytes(publish_until_received(pub, sub)[1], "big")]
        while sub.poll(100):
            seen.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        dropped_before = pub.dropped_total
        total = 2000
        for _ in range(total):
            pub.publish([AllBlocksCleared()])
        pub.shutdown()
        newest = pub.published_total + pub.dropped_total - 1
        while seen[-1] != newest:  # every batch sent has left; wait for it, however slow
            seen.append(int.from_bytes(recv_frames(sub)[1], "big"))
    finally:
        sub.close()
        pub.shutdown()
    assert dropped_before == 0
    assert pub.dropped_total > 0
    assert seen[-1] == pub.published_total + pub.dropped_total - 1  # the newest is never dropped
    assert all(a < b for a, b in zip(seen, seen[1:], strict=False))
    holes = sum(b - a - 1 for a, b in zip(seen, seen[1:], strict=False))
    assert holes == pub.dropped_total


def wait_for_failure(pub: ZmqEventPublisher, timeout: float = 60.0) -> KVEventPublisherError:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pub.raise_if_failed()
        except KVEventPublisherError as exc:
            return exc
        time.sleep(0.01)
    raise TimeoutError("the publisher never reported the failure")


def test_encoding_failure_surfaces_in_the_engine(ipc):
    pub = make_publisher(KVEventsConfig(True, endpoint=ipc()))
    bad = stored([H1])
    bad.token_ids[2] = object()  # past the constructor's checks: only the encoder notices
    try:
        pub.raise_if_failed()  # healthy so far
        pub.publish([bad])
        failure = wait_for_failure(pub)
        assert "cannot encode KV event batch seq=0" in str(failure)
        assert "object" in str(failure.__cause__.__cause__)
        with pytest.raises(KVEventPublisherError, match="cannot encode"):
            pub.raise_if_failed()  # again: the failure is sticky
        with pytest.raises(KVEventPublisherError):
            pub.publish([AllBlocksCleared()])  # sticky: the next step fails too
    finally:
        pub.shutdown()
    assert pub.published_total == 0
    assert pub.dropped_total == 1


def test_shutdown_flushes_queued_batches(ipc):
    pub = make_publisher(KVEventsConfig(True, endpoint=ipc()))
    sub = subscribed(pub.bound_endpoint)
    publish_until_received(pub, sub)
    for _ in range(100):
        pub.publish([stored([H1])])
    pub.shutdown()
    assert pub.published_total >= 101 and pub.dropped_total == 0
    with pytest.raises(RuntimeError, match="after shutdown"):
        pub.publish([AllBlocksCleared()])
    pub.shutdown()  # twice is harmless
    sub.close()
