"""The KV-transfer wire, attacked from 127.0.0.1 as any pod on the network could: a pull without
the deployment's key gets no bytes, a captured pull cannot be replayed, pulls outside the bounds
(NaN or endless timeouts, duplicated or unheld block ids) hold nothing, idle payload connections
take no sender thread and are dropped, one address cannot open unbounded connections, garbage on
the control port costs one log line per interval, and a producer holds at most its share of the
pool. Also: where the key comes from, router-signed params, and where the sockets bind."""

from __future__ import annotations

import logging
import math
import socket
import struct
import time

import msgspec
import pytest
import zmq

from atom_runtime.core.sequence import Sequence
from atom_runtime.kv_transfer import producer as producer_module
from atom_runtime.kv_transfer.auth import PARAMS_TTL_S, TransferKey, TransferKeyError
from atom_runtime.kv_transfer.config import KVTransferConfig
from atom_runtime.kv_transfer.wire import MAX_SKEW_S, PROTOCOL, Pull, PullReply, Stripe, WireSeal
from atom_runtime.sampling_params import SamplingParams
from tests.runtime.kv_transfer.conftest import (
    KEY_HEX,
    NUM_BLOCKS,
    PROMPT,
    _prefill,
    _pull,
    _until,
)

OTHER_KEY = TransferKey.from_text("a7" * 32, "test")


class _Peer:
    """A DEALER on a producer's control port, with the key it seals with (None: none)."""

    def __init__(self, port: int, key: TransferKey | None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.seal = WireSeal(key)

    def pull(self, params: dict, **fields) -> PullReply:
        msg = Pull(
            params["remote_request_id"],
            fields.pop("block_ids", params["remote_block_ids"]),
            fields.pop("layout"),
            PROTOCOL,
            **fields,
        )
        return self.send(msgspec.msgpack.encode(self.seal.seal(msg)))

    def send(self, raw: bytes) -> PullReply:
        self.sock.send(raw)
        assert self.sock.poll(20_000), "no reply from the producer"
        return msgspec.msgpack.decode(self.sock.recv(), type=PullReply)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def peers():
    made: list[_Peer] = []

    def make(port: int, key: TransferKey | None) -> _Peer:
        made.append(_Peer(port, key))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _hello(ticket: str, index: int, key: TransferKey | None) -> bytes:
    body = msgspec.msgpack.encode(WireSeal(key).seal(Stripe(ticket, index)))
    return struct.pack(">I", len(body)) + body


def _read_all(conn: socket.socket, timeout: float = 20.0) -> bytes:
    """Everything the producer sends before it closes the connection."""
    conn.settimeout(timeout)
    out = b""
    while chunk := conn.recv(65536):
        out += chunk
    return out


def test_a_pull_without_the_secret_gets_no_bytes(agents, peers, transfer_key):
    producer = agents("kv_producer", fill=True)
    params = _prefill(producer)
    port, data_port = params["remote_port"], producer.connector._data_port
    for key in (None, OTHER_KEY):  # no key at all, or another deployment's
        reply = peers(port, key).pull(params, layout=producer.kv.layout, timeout_s=5.0)
        assert reply.ticket == "" and "not authenticated" in reply.error
    assert not producer.connector._tickets
    # Straight to the payload port with a made-up ticket: closed, not a byte.
    with socket.create_connection(("127.0.0.1", data_port)) as conn:
        conn.sendall(_hello("00" * 16, 0, None))
        assert _read_all(conn) == b""
    # A real ticket (seen on the wire, say) is useless without the key to seal the hello.
    reply = peers(port, transfer_key).pull(params, layout=producer.kv.layout, timeout_s=5.0)
    assert reply.error is None and reply.ticket
    for key in (None, OTHER_KEY):
        with socket.create_connection(("127.0.0.1", data_port)) as conn:
            conn.sendall(_hello(reply.ticket, 0, key))
            assert _read_all(conn) == b""
    with socket.create_connection(("127.0.0.1", data_port)) as conn:  # the key holder's
        conn.sendall(_hello(reply.ticket, 0, transfer_key))
        assert len(_read_all(conn)) > 0


def test_a_captured_pull_cannot_be_replayed(agents, peers, transfer_key):
    producer = agents("kv_producer", fill=True)
    params = _prefill(producer)
    peer = peers(params["remote_port"], transfer_key)
    msg = peer.seal.seal(
        Pull(
            params["remote_request_id"],
            params["remote_block_ids"],
            producer.kv.layout,
            PROTOCOL,
            timeout_s=5.0,
        )
    )
    raw = msgspec.msgpack.encode(msg)
    assert peer.send(raw).error is None
    assert "replayed" in peer.send(raw).error
    # Sealed properly but stamped long ago (or by a clock far off): refused too.
    stale = msgspec.structs.replace(msg, ts=time.time() - 4 * MAX_SKEW_S, nonce=b"n" * 16)
    stale.mac = peer.seal._mac(stale)
    assert "clock" in peer.send(msgspec.msgpack.encode(stale)).error


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"timeout_s": math.nan}, "timeout_s"),
        ({"timeout_s": math.inf}, "timeout_s"),
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"timeout_s": 1e9}, "timeout_s"),
        ({"block_ids": "dup"}, "asked for twice"),
        ({"block_ids": "unheld"}, "not held"),
        ({"block_ids": []}, "no blocks"),
    ],
)
def test_pulls_outside_the_bounds_hold_nothing(agents, peers, transfer_key, fields, error):
    producer = agents("kv_producer", fill=True)
    params = _prefill(producer)
    held = params["remote_block_ids"]
    if fields.get("block_ids") == "dup":  # 73.7 GB were granted for duplicated ids once
        fields["block_ids"] = held + held
    elif fields.get("block_ids") == "unheld":
        fields["block_ids"] = [b for b in range(NUM_BLOCKS) if b not in held][:2]
    fields.setdefault("timeout_s", 5.0)
    reply = peers(params["remote_port"], transfer_key).pull(
        params, layout=producer.kv.layout, **fields
    )
    assert error in reply.error and reply.ticket == ""
    assert not producer.connector._tickets and not producer.connector._reading


def test_idle_payload_connections_take_no_sender_and_are_dropped(agents, transfer_key):
    """40 connections that never say which stripe they want: a real pull still completes (it
    once starved the producer's 4 sender threads), and the idle ones are closed after
    HELLO_TIMEOUT_S."""
    producer = agents("kv_producer", fill=True, streams=2)
    consumer = agents("kv_consumer", streams=2)
    params = _prefill(producer)
    idle = [
        socket.create_connection(("127.0.0.1", producer.connector._data_port)) for _ in range(40)
    ]
    try:
        _until(lambda: len(producer.connector._hellos) == 40)
        seq = _pull(consumer, params)
        assert consumer.stats.pulls_ok == 1 and consumer.stats.fallbacks == 0
        assert len(consumer.block_manager.find_prefix_hit(seq)) == 6
        for conn in idle:
            assert _read_all(conn, timeout=30) == b""  # closed by the producer
        assert not producer.connector._hellos
    finally:
        for conn in idle:
            conn.close()


def test_one_address_gets_a_bounded_number_of_payload_connections(
    agents, monkeypatch, transfer_key
):
    monkeypatch.setattr(producer_module, "HELLO_TIMEOUT_S", 120.0)
    producer = agents("kv_producer", fill=True)
    _prefill(producer)
    cap = producer_module.MAX_CONNS_PER_PEER
    conns = [
        socket.create_connection(("127.0.0.1", producer.connector._data_port))
        for _ in range(cap + 5)
    ]
    try:
        closed = []
        for conn in conns[cap:]:  # accepted and closed at once, never read
            closed.append(_read_all(conn, timeout=30))
        assert closed == [b""] * 5
        assert producer.connector._peer_conns["127.0.0.1"] == cap
        assert len(producer.connector._hellos) == cap
    finally:
        for conn in conns:
            conn.close()
    _until(lambda: not producer.connector._hellos)  # the closed ones are noticed and dropped
    assert not producer.connector._peer_conns


def test_garbage_on_the_control_port_is_logged_at_most_once_per_interval(
    agents, peers, transfer_key, caplog
):
    producer = agents("kv_producer", fill=True)
    params = _prefill(producer)
    peer = peers(params["remote_port"], transfer_key)
    with caplog.at_level(logging.WARNING, logger="atom_runtime.kv_transfer"):
        for i in range(300):
            peer.sock.send(b"\xc1garbage %d" % i)  # 0xc1 is never valid msgpack
            peer.sock.send_multipart([b"two", b"frames"])
        reply = peer.pull(params, layout=producer.kv.layout, timeout_s=5.0)  # served after them
    assert reply.error is None and reply.ticket
    lines = [r for r in caplog.records if "KV" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]


def test_an_oversized_control_message_is_dropped_and_the_producer_serves_on(
    agents, peers, transfer_key
):
    producer = agents("kv_producer", fill=True)
    params = _prefill(producer)
    big = peers(params["remote_port"], transfer_key)
    big.sock.send(b"\x00" * (8 << 20))  # far above MAXMSGSIZE for a 24-block pool
    assert not big.sock.poll(500)  # nothing decoded, nothing answered
    reply = peers(params["remote_port"], transfer_key).pull(
        params, layout=producer.kv.layout, timeout_s=5.0
    )
    assert reply.error is None


def test_a_producer_holds_at_most_its_share_of_the_pool(agents):
    producer = agents("kv_producer", fill=True, max_held_fraction=0.3)  # 7 of 24 blocks
    first = _prefill(producer)
    assert len(first["remote_block_ids"]) == 6
    second = _prefill(producer, [t + 1 for t in PROMPT])
    assert second["remote_block_ids"] == [] and producer.stats.holds_refused == 1
    assert producer.pool.num_free_blocks == NUM_BLOCKS - 6


def test_the_producer_binds_the_pods_own_address_by_default(monkeypatch, agents):
    monkeypatch.setenv("POD_IP", "127.0.0.2")  # a loopback address other than 127.0.0.1
    config = KVTransferConfig.from_cli('{"kv_connector": "TCPConnector", "kv_role": "kv_both"}')
    assert config.bind_host() == "127.0.0.2" and config.advertise_host() == "127.0.0.2"
    producer = agents("kv_producer", fill=True, kv_ip=None)
    port = producer.connector.address()[1]
    endpoint = producer.connector._router.getsockopt_string(zmq.LAST_ENDPOINT)
    assert endpoint == f"tcp://127.0.0.2:{port}"
    assert producer.connector._listener.getsockname()[0] == "127.0.0.2"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", producer.connector._data_port), timeout=5)
    monkeypatch.delenv("POD_IP")
    assert config.bind_host() == "127.0.0.1"  # no pod: loopback, never a wildcard


def test_a_consumer_without_the_key_is_refused_and_prefills_locally(agents, monkeypatch):
    producer = agents("kv_producer", fill=True)
    params = _prefill(producer)
    monkeypatch.delenv("ATOM_TRANSFER_KEY")
    consumer = agents("kv_consumer", insecure=True)
    assert consumer.key is None
    _pull(consumer, params)
    assert consumer.stats.fallbacks == 1 and consumer.stats.pulls_ok == 0


# -- the key and the router's signature ----------------------------------------------------------


def test_where_the_key_comes_from(monkeypatch, tmp_path):
    config = KVTransferConfig.from_cli('{"kv_connector": "TCPConnector", "kv_role": "kv_both"}')
    key = config.load_key()
    assert key is not None and key.verify(key.mac(b"x", b"y"), b"x", b"y")
    monkeypatch.delenv("ATOM_TRANSFER_KEY")
    with pytest.raises(TransferKeyError, match="ATOM_TRANSFER_KEY_FILE"):
        config.load_key()
    path = tmp_path / "transfer-key"
    path.write_text("c3" * 32 + "\n")
    monkeypatch.setenv("ATOM_TRANSFER_KEY_FILE", str(path))
    from_file = config.load_key()
    assert from_file.verify(from_file.mac(b"x"), b"x")
    assert not from_file.verify(key.mac(b"x"), b"x")  # a different key
    path.write_text("not-hex-and-too-short")
    with pytest.raises(TransferKeyError, match="ATOM_TRANSFER_KEY_FILE=.*64 hex digits") as e:
        config.load_key()
    assert "not-hex" not in str(e.value)  # a key's text never reaches a log
    monkeypatch.setenv("ATOM_TRANSFER_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(TransferKeyError, match="cannot read"):
        config.load_key()
    own = tmp_path / "own-key"
    own.write_text(KEY_HEX)
    extra = KVTransferConfig.from_cli(
        '{"kv_connector": "TCPConnector", "kv_role": "kv_both", '
        f'"kv_connector_extra_config": {{"key_file": "{own}"}}}}'
    )
    assert extra.load_key().verify(key.mac(b"x"), b"x")  # key_file wins over the environment
    insecure = KVTransferConfig.from_cli(
        '{"kv_connector": "TCPConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"insecure": true}}'
    )
    monkeypatch.delenv("ATOM_TRANSFER_KEY_FILE")
    assert insecure.load_key() is None


def test_router_signed_params_open_only_untouched_and_in_time(transfer_key):
    params = {"do_remote_prefill": True, "remote_host": "10.0.0.5", "remote_port": 14579,
              "remote_block_ids": [3, 4], "remote_block_hashes": [2**64 - 1, 7]}  # fmt: skip
    signed = transfer_key.sign_params(params)
    assert transfer_key.open_params(signed) == params
    assert len(signed["atom_request_id"]) == 32
    with pytest.raises(ValueError, match="kv_transfer_params: not signed"):
        transfer_key.open_params(params)
    for forged in (
        {**signed, "remote_host": "10.6.6.6"},  # a client's own producer
        {**signed, "atom_expires": signed["atom_expires"] + 3600},
        {**signed, "atom_signature": "00" * 32},
        OTHER_KEY.sign_params(params),
    ):
        with pytest.raises(ValueError, match="does not match"):
            transfer_key.open_params(forged)
    with pytest.raises(ValueError, match="expired"):
        transfer_key.open_params(signed, now=time.time() + PARAMS_TTL_S + 5)


def test_an_engine_acts_only_on_signed_params_of_its_role(agents, transfer_key):
    consumer = agents("kv_consumer")
    with pytest.raises(ValueError, match="not signed"):
        consumer.open_params({"do_remote_decode": True})
    with pytest.raises(ValueError, match="do_remote_decode: this engine is not a producer"):
        consumer.open_params(transfer_key.sign_params({"do_remote_decode": True}))
    params = _prefill(agents("kv_producer", fill=True))
    seq = Sequence("r", PROMPT, SamplingParams())
    seq.kv_transfer_params = consumer.open_params(transfer_key.sign_params(params))
    assert consumer.park(seq)
