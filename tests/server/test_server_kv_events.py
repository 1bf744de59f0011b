"""`atom serve --kv-events-config ...` publishes events an llm-d-style subscriber reads: after a
workload with shared prefixes and a KV pool small enough to evict, the subscriber's index equals
the server's cached block hashes (`GET /debug/kv_cache`); `POST /reset_prefix_cache` clears it;
and the counters show on `/metrics`."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from atom_runtime.kv_events import AllBlocksCleared, BlockRemoved, KVEventSubscriber
from tests.server.conftest import free_port


@pytest.fixture(scope="module")
def events_server(tiny_models, launch_module_server):
    port, replay = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv@pod-a@tiny",
    }
    srv = launch_module_server(
        "--model",
        str(tiny_models["llama"]),
        "--dtype",
        "float32",
        "--num-gpu-blocks-override",
        "12",
        "--max-model-len",
        "128",
        "--kv-events-config",
        json.dumps(config),
        "--enable-debug-endpoints",
    )
    yield srv, port, replay
    assert srv.stop() == 0, srv.log()


def _cached(url: str) -> set[int]:
    return set(httpx.get(f"{url}/debug/kv_cache", timeout=600).json()["block_hashes"])


def _until(sub, want, seen, timeout=120.0):  # a deadlock guard
    deadline = time.monotonic() + timeout
    while sub.index.hashes("pod-a") != want:
        seen.extend(sub.poll(50))
        if time.monotonic() > deadline:
            raise AssertionError(f"index {sub.index.hashes('pod-a')} != server {want}")


def test_subscriber_index_matches_the_server(events_server, tiny_models):
    srv, port, replay = events_server
    sub = KVEventSubscriber(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", topic="kv@", pod="pod-a"
    )
    seen = []
    try:
        sub.poll(50)
        shared = list(range(1000, 1040))
        for tail in (list(range(2000, 2010)), list(range(3000, 3030)), list(range(4000, 4060))):
            r = httpx.post(
                f"{srv.url}/v1/completions",
                json={
                    "model": str(tiny_models["llama"]),
                    "prompt": shared + tail,
                    "max_tokens": 20,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                timeout=600,
            )
            assert r.status_code == 200, r.text
            _until(sub, _cached(srv.url), seen)
        events = [e for _, b in seen for e in b.events]
        assert any(isinstance(e, BlockRemoved) for e in events)
        metrics = httpx.get(f"{srv.url}/metrics", timeout=600).text
        published = [
            line
            for line in metrics.splitlines()
            if line.startswith("atom:kv_events_published_total")
        ]
        assert published and float(published[0].split()[-1]) >= 1

        r = httpx.post(f"{srv.url}/reset_prefix_cache", timeout=600)
        assert r.status_code == 200 and r.json() == {"reset": True}
        _until(sub, set(), seen)
        assert isinstance(seen[-1][1].events[-1], AllBlocksCleared)
        assert _cached(srv.url) == set()
        assert sub.gaps_unfillable == 0
    finally:
        sub.close()
