"""Prefill/decode disaggregation with real processes: a prefill engine (kv_producer), a decode
engine (kv_consumer) and `atom router` on 127.0.0.1. Greedy answers equal the aggregated ones;
the decode engine computes only the prompt's last block; failed, dropped or abandoned transfers
fall back or clean up without leaking a block on either engine."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import msgspec
import pytest
import zmq

from atom_runtime.kv_transfer.auth import TransferKey
from tests.router.conftest import (
    TRANSFER_KEY,
    launch_engine,
    launch_router,
    prompt_ids,
    transfer_config,
)
from tests.server.conftest import free_port

pytestmark = pytest.mark.slow

BLOCK = 16
PULL_TIMEOUT_S = 10
HOLD_TIMEOUT_S = 6


@pytest.fixture(scope="module")
def pd(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    model = tiny_models["llama"]
    procs = []
    try:
        prefill = launch_engine(
            tmp,
            model,
            "--kv-transfer-config",
            transfer_config("kv_producer", free_port(), hold_timeout_s=HOLD_TIMEOUT_S),
        )
        procs.append(prefill.server)
        decode = launch_engine(
            tmp,
            model,
            "--kv-transfer-config",
            transfer_config("kv_consumer", free_port(), pull_timeout_s=PULL_TIMEOUT_S),
        )
        procs.append(decode.server)
        router = launch_router(
            tmp,
            "--backend",
            decode.backend_arg,
            "--prefill-backend",
            prefill.url,
            "--remote-prefill-threshold",
            str(BLOCK),
        )
        procs.append(router)
        router.wait_backends("decode", 1)
        router.wait_backends("prefill", 1)
        yield prefill, decode, router
    finally:
        for p in reversed(procs):
            p.stop()


def _wait(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _stream(url: str, path: str, body: dict) -> str:
    parts = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def test_disaggregated_answers_equal_aggregated_ones(pd, model_name):
    prefill, decode, router = pd
    pulls0 = decode.metric("atom:kv_transfer_pulls_total")
    computed0 = decode.metric("atom:prompt_tokens_total")
    remote0 = router.metric('atom:router_decisions_total{path="remote_prefill"}')

    # completions, by token ids: the prefill engine alone is the aggregated reference.
    body = {"model": model_name, "prompt": prompt_ids(1), "max_tokens": 6, "temperature": 0}
    ref = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=60).json()
    got = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).json()
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 144  # 9 of 10 blocks pulled

    # chat, and streaming of both kinds.
    words = " ".join(f"w{i}" for i in range(70))
    chat = {
        "model": model_name,
        "messages": [{"role": "user", "content": words}],
        "max_tokens": 5,
        "temperature": 0,
    }
    ref_chat = httpx.post(f"{prefill.url}/v1/chat/completions", json=chat, timeout=60).json()
    got_chat = httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=60).json()
    assert got_chat["choices"][0]["message"] == ref_chat["choices"][0]["message"]
    other = " ".join(f"v{i}" for i in range(70))  # shares no block with `words`
    chat2 = {**chat, "messages": [{"role": "user", "content": other}]}
    ref2 = httpx.post(f"{prefill.url}/v1/chat/completions", json=chat2, timeout=60).json()
    assert (
        _stream(router.url, "/v1/chat/completions", chat2)
        == (ref2["choices"][0]["message"]["content"])
    )
    body3 = {**body, "prompt": prompt_ids(3)}
    ref3 = httpx.post(f"{prefill.url}/v1/completions", json=body3, timeout=60).json()
    assert _stream(router.url, "/v1/completions", body3) == ref3["choices"][0]["text"]

    assert decode.metric("atom:kv_transfer_pulls_total") - pulls0 == 4
    assert router.metric('atom:router_decisions_total{path="remote_prefill"}') - remote0 == 4
    # The decode engine computed only each prompt's tail (under one block per request).
    assert decode.metric("atom:prompt_tokens_total") - computed0 < 4 * BLOCK
    assert decode.metric("atom:kv_transfer_fallbacks_total") == 0
    # Every hold was released by the consumer; nothing is left held or in use.
    _wait(lambda: prefill.metric("atom:kv_transfer_held_blocks") == 0, what="holds released")
    assert prefill.metric("atom:kv_transfer_holds_released_total") >= 4
    assert prefill.metric("atom:kv_cache_usage_ratio") == 0
    assert decode.metric("atom:kv_cache_usage_ratio") == 0


def test_the_decode_pod_pulls_only_the_blocks_it_lacks(pd, model_name):
    prefill, decode, router = pd
    shared = prompt_ids(5, 96)  # 6 blocks
    first = {"model": model_name, "prompt": shared + [7] * 40, "max_tokens": 1, "temperature": 0}
    known0 = router.backends()["decode"][0]["cached_blocks"]
    httpx.post(f"{decode.url}/v1/completions", json=first, timeout=60).raise_for_status()
    hit0 = decode.metric("atom:kv_transfer_blocks_local_hit_total")
    got0 = decode.metric("atom:kv_transfer_blocks_received_total")
    body = {**first, "prompt": shared + [9] * 70, "max_tokens": 3}  # 166 tokens: 10 usable blocks
    ref = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=60).json()
    out = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).json()
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert decode.metric("atom:kv_transfer_blocks_local_hit_total") - hit0 == 6
    assert decode.metric("atom:kv_transfer_blocks_received_total") - got0 == 4
    # Once the decode pod's KV events say it holds the whole prompt, remote prefill no longer
    # pays: the router lets the decode pod run it. The pod stored 8 blocks computing `first`
    # and 4 by the pull: the router hears of all 12 (pulled blocks are announced as stored).
    _wait(lambda: router.backends()["decode"][0]["cached_blocks"] >= known0 + 12, what="KV events")
    local0 = router.metric('atom:router_decisions_total{path="local_prefill"}')
    remote0 = router.metric('atom:router_decisions_total{path="remote_prefill"}')
    again = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).json()
    assert again["choices"][0]["text"] == ref["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
    assert router.metric('atom:router_decisions_total{path="local_prefill"}') == local0 + 1
    assert router.metric('atom:router_decisions_total{path="remote_prefill"}') == remote0


def test_a_dropped_transfer_falls_back_to_local_prefill(pd, model_name):
    prefill, decode, _ = pd
    body = {"model": model_name, "prompt": prompt_ids(11), "max_tokens": 4, "temperature": 0}
    ref = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=60).json()
    fb0 = decode.metric("atom:kv_transfer_fallbacks_total")
    # A producer address where nobody answers: the pull times out.
    params = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
        "remote_request_id": "gone-1",
        "remote_block_ids": list(range(9)),
        "remote_block_hashes": [1] * 9,
    }
    # Hashes that do not match the prompt: nothing is pulled at all, and the answer is right.
    out = httpx.post(
        f"{decode.url}/v1/completions",
        json={**body, "kv_transfer_params": TRANSFER_KEY.sign_params(params)},
        timeout=60,
    ).json()
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert decode.metric("atom:kv_transfer_fallbacks_total") == fb0
    # Matching hashes, taken from a real prefill of a prompt the decode engine has not cached (it
    # just prefilled the first one itself).
    body = {**body, "prompt": prompt_ids(12)}
    ref = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=60).json()
    real = _hold(prefill, body)
    # The producer no longer knows the transfer (dropped on its side): it answers with an error.
    dropped = {**real, "remote_request_id": real["remote_request_id"] + "-dropped"}
    out = httpx.post(
        f"{decode.url}/v1/completions",
        json={**body, "kv_transfer_params": TRANSFER_KEY.sign_params(dropped)},
        timeout=60,
    ).json()
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert decode.metric("atom:kv_transfer_fallbacks_total") == fb0 + 1
    assert decode.metric("atom:kv_cache_usage_ratio") == 0
    # The real hold was never pulled or released: it times out on the producer, counted.
    _wait(
        lambda: prefill.metric("atom:kv_transfer_hold_timeouts_total") >= 1,
        timeout=HOLD_TIMEOUT_S + 20,
        what="the hold to time out",
    )
    _wait(lambda: prefill.metric("atom:kv_transfer_held_blocks") == 0, what="held blocks freed")
    assert prefill.metric("atom:kv_cache_usage_ratio") == 0


def _hold(prefill, body: dict) -> dict:
    """What the router does first: the prompt on the prefill engine with signed
    do_remote_decode; returns the producer's kv_transfer_params (where the blocks are held)."""
    r = httpx.post(
        f"{prefill.url}/v1/completions",
        json={
            **body,
            "max_tokens": 1,
            "kv_transfer_params": TRANSFER_KEY.sign_params({"do_remote_decode": True}),
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_malformed_transfer_params_are_a_400(pd, model_name):
    _, decode, _ = pd
    bad = {"do_remote_prefill": True, "remote_block_ids": "x"}
    r = httpx.post(
        f"{decode.url}/v1/completions",
        json={
            "model": model_name,
            "prompt": prompt_ids(2),
            "max_tokens": 2,
            "kv_transfer_params": TRANSFER_KEY.sign_params(bad),
        },
        timeout=60,
    )
    assert r.status_code == 400
    assert "remote_block_ids" in r.json()["error"]["message"]


def test_client_disconnect_during_a_pull_leaks_nothing(pd, model_name):
    """The pull is stuck on a producer that never answers; the client leaves; the decode engine
    frees every block and tells the producer to release its hold."""
    prefill, decode, _ = pd
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    try:
        real = _hold(prefill, {"model": model_name, "prompt": prompt_ids(21)})
        stuck = TRANSFER_KEY.sign_params({**real, "remote_port": port})
        body = json.dumps(
            {
                "model": model_name,
                "prompt": prompt_ids(21),
                "max_tokens": 4,
                "stream": True,
                "kv_transfer_params": stuck,
            }
        ).encode()
        aborts0 = decode.metric('atom:requests_finished_total{reason="abort"}')
        fallbacks0 = decode.metric("atom:kv_transfer_fallbacks_total")
        # A raw connection, so that closing it is a real TCP close the server sees at once.
        conn = socket.create_connection(("127.0.0.1", decode.server.port))
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        assert fake.poll(20_000), "the decode engine never asked for the blocks"
        _ident, pull = fake.recv_multipart()
        assert msgspec.msgpack.decode(pull)["transfer_id"] == real["remote_request_id"]
        _wait(lambda: decode.metric("atom:kv_transfer_pulls_in_flight") == 1, what="the pull")
        assert decode.metric("atom:kv_cache_usage_ratio") > 0  # blocks allocated for the pull
        conn.close()  # the client leaves mid-transfer
        # Ended by the abort, not by the pull's timeout.
        _wait(lambda: decode.metric('atom:requests_finished_total{reason="abort"}') == aborts0 + 1)
        _wait(lambda: decode.metric("atom:kv_transfer_pulls_in_flight") == 0, what="abort")
        _wait(lambda: decode.metric("atom:kv_cache_usage_ratio") == 0, what="blocks freed")
        assert decode.metric("atom:kv_transfer_fallbacks_total") == fallbacks0
        assert fake.poll(10_000), "no release reached the producer"
        _ident, release = fake.recv_multipart()
        release = msgspec.msgpack.decode(release)
        assert (release["type"], release["transfer_id"]) == ("Release", real["remote_request_id"])
    finally:
        fake.close(0)
        ctx.term()


@pytest.fixture
def fake_producer():
    """A port where a KV producer would listen, which the test owns: any connection to it is a
    connection the engines made on a client's word."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    yield listener
    listener.close()


def _never_dialled(listener: socket.socket) -> bool:
    try:
        listener.accept()[0].close()
    except BlockingIOError:
        return True
    return False


def test_client_kv_transfer_params_are_dropped_by_the_router_and_refused_by_engines(
    pd, model_name, fake_producer
):
    """The attack: a client's own kv_transfer_params naming its own producer, with the hashes
    of a prompt it wants poisoned. The router drops them (the answer is the right one), the
    engines refuse them unsigned, forged or tampered with (400 naming the field), and nothing
    ever dials the fake producer; nor can a client make a producer hold its blocks."""
    prefill, decode, router = pd
    prompt = prompt_ids(41)
    body = {"model": model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    ref = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=60).json()
    real = _hold(prefill, body)  # genuine hashes and block ids of this prompt
    poison = {**real, "remote_port": fake_producer.getsockname()[1], "do_remote_prefill": True}
    held0 = prefill.metric("atom:kv_transfer_held_blocks")

    got = httpx.post(
        f"{router.url}/v1/completions", json={**body, "kv_transfer_params": poison}, timeout=60
    )
    assert got.status_code == 200 and got.json()["choices"] == ref["choices"]
    short = {**body, "prompt": prompt[:10], "kv_transfer_params": {"do_remote_decode": True}}
    assert httpx.post(f"{router.url}/v1/completions", json=short, timeout=60).status_code == 200

    other_key = TransferKey.from_text("99" * 32, "attacker")
    for params in (
        poison,  # unsigned
        other_key.sign_params(poison),  # signed with another key
        {**TRANSFER_KEY.sign_params(real), "remote_port": poison["remote_port"]},  # tampered
    ):
        for engine in (decode, prefill):
            r = httpx.post(
                f"{engine.url}/v1/completions", json={**body, "kv_transfer_params": params}
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "kv_transfer_params"
    r = httpx.post(
        f"{prefill.url}/v1/completions",
        json={**body, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    assert _never_dialled(fake_producer)
    # The client pinned nothing: the routed requests' genuine holds end once decode has pulled
    # them (well before a hold's 60 s expiry, which is what a pinned block would wait for).
    _wait(
        lambda: prefill.metric("atom:kv_transfer_held_blocks") <= held0,
        timeout=20.0,
        what="the producer's holds back to where they were",
    )


def test_answers_to_clients_carry_no_internal_address_or_transfer_id(pd, model_name):
    prefill, decode, router = pd
    remote0 = router.metric('atom:router_decisions_total{path="remote_prefill"}')
    body = {"model": model_name, "prompt": prompt_ids(43), "max_tokens": 3, "temperature": 0}
    answers = [httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).text]
    streamed = {**body, "prompt": prompt_ids(44), "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=streamed, timeout=60) as r:
        answers.append(r.read().decode())
    assert "data: [DONE]" in answers[-1]
    assert router.metric('atom:router_decisions_total{path="remote_prefill"}') == remote0 + 2
    # The decode engine itself, asked as the router asks: it echoes nothing it was given.
    params = TRANSFER_KEY.sign_params(_hold(prefill, {**body, "prompt": prompt_ids(45)}))
    direct = httpx.post(
        f"{decode.url}/v1/completions",
        json={**body, "prompt": prompt_ids(45), "kv_transfer_params": params},
        timeout=60,
    )
    assert direct.status_code == 200
    answers.append(direct.text)
    for text in answers:
        for secret in ("kv_transfer_params", "remote_", "127.0.0.1", params["remote_request_id"]):
            assert secret not in text, (secret, text[:300])


def test_prefill_engine_killed_before_the_pull_is_answered_by_fallback(pd, model_name):
    """Runs last in this module: it kills the prefill engine. (Killed while the payload moves:
    test_disaggregated_faults.py.)"""
    prefill, decode, router = pd
    body = {"model": model_name, "prompt": prompt_ids(31), "max_tokens": 4, "temperature": 0}
    ref = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=60).json()
    params = TRANSFER_KEY.sign_params(_hold(prefill, body))
    # After handing out its blocks, before the pull: the engine core (which serves pulls) first,
    # then its API server.
    os.kill(prefill.server.engine_pid(), signal.SIGKILL)
    prefill.server.proc.kill()
    prefill.server.proc.wait()
    fb0 = decode.metric("atom:kv_transfer_fallbacks_total")
    out = httpx.post(
        f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60
    ).json()
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert decode.metric("atom:kv_transfer_fallbacks_total") == fb0 + 1
    # Through the router: the dead prefill pod is ejected, the decode pod prefills itself.
    for seed in (33, 34):  # prompts the decode pod does not hold: remote prefill would pay
        body2 = {**body, "prompt": prompt_ids(seed)}
        r = httpx.post(f"{router.url}/v1/completions", json=body2, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    # Ejected by a probe first (no_prefill_backend) or by the failed request (prefill_failed).
    assert (
        router.metric('atom:router_fallbacks_total{reason="prefill_failed"}')
        + router.metric('atom:router_fallbacks_total{reason="no_prefill_backend"}')
        >= 2
    )
    assert router.metric('atom:router_queued_requests{role="prefill"}') == 0  # none in flight
    state = router.backends()["prefill"]
    assert state[0]["healthy"] is False
    assert decode.metric("atom:kv_cache_usage_ratio") == 0
