"""Backend discovery: EndpointSlices -> backend URLs (the pure translation), and the router's
watch against kmock's Kubernetes API emulator over real HTTP (list, then watch events)."""

from __future__ import annotations

import asyncio
import threading

import kmock
import pytest
from kubernetes import client

from atom_runtime.router.app import rank_backends
from atom_runtime.router.backends import Backend, BackendAddress, parse_engine_metrics
from atom_runtime.router.discovery import EndpointSliceWatch, ServiceTarget, addresses_from_slices
from tests.operator.conftest import VERBS, ClusterEmulator, eventually

TARGET = ServiceTarget.parse("http://m-decode.llm.svc.cluster.local:8000")
SLICES = "discovery.k8s.io/v1/endpointslices"


def _slice(name: str, endpoints: list[tuple[str, bool | None]], port: int = 8000) -> dict:
    eps = []
    for ip, ready in endpoints:
        ep = {"addresses": [ip]}
        if ready is not None:
            ep["conditions"] = {"ready": ready}
        eps.append(ep)
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "llm",
            "labels": {"kubernetes.io/service-name": "m-decode"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": eps,
    }


def test_service_urls_name_the_service_and_namespace():
    assert (TARGET.service, TARGET.namespace, TARGET.port) == ("m-decode", "llm", 8000)
    plain = ServiceTarget.parse("http://localhost:9000")
    assert plain.service is None and plain.port == 9000
    with pytest.raises(ValueError, match="not an http"):
        ServiceTarget.parse("tcp://x:1")


def test_ready_endpoints_of_every_slice_become_backends():
    slices = [
        _slice("a", [("10.0.0.2", True), ("10.0.0.3", False), ("10.0.0.4", None)]),
        _slice("b", [("10.0.0.2", True), ("10.0.0.9", True)], port=8000),
        {**_slice("c", [("pod.example", True)]), "addressType": "FQDN"},
    ]
    got = addresses_from_slices(slices, TARGET, 5557, 5558)
    assert [a.url for a in got] == [
        "http://10.0.0.2:8000",
        "http://10.0.0.4:8000",
        "http://10.0.0.9:8000",
    ]
    assert got[0].kv_events == "tcp://10.0.0.2:5557"
    assert got[0].kv_replay == "tcp://10.0.0.2:5558"
    v6 = addresses_from_slices([_slice("d", [("fd00::5", True)])], TARGET, None, None)
    assert v6 == [BackendAddress("http://[fd00::5]:8000")]


def test_static_backend_options():
    a = BackendAddress.parse("http://127.0.0.1:8001,kv-events=6001,kv-replay=6002", 5557, 5558)
    assert (a.url, a.kv_events, a.kv_replay) == (
        "http://127.0.0.1:8001",
        "tcp://127.0.0.1:6001",
        "tcp://127.0.0.1:6002",
    )
    assert BackendAddress.parse("http://h:1", None, 5558).kv_events is None
    with pytest.raises(ValueError, match="kv-events=PORT"):
        BackendAddress.parse("http://h:1,kv=3", 1, 2)


def test_engine_metrics_are_read_for_load_and_block_size():
    text = (
        "# TYPE atom:requests_running gauge\natom:requests_running 3.0\n"
        "# TYPE atom:requests_waiting gauge\natom:requests_waiting 2.0\n"
        "# TYPE atom:kv_cache_usage_ratio gauge\natom:kv_cache_usage_ratio 0.25\n"
        "# TYPE atom:cache_config info\n"
        'atom:cache_config_info{block_size="16",num_gpu_blocks="256"} 1.0\n'
    )
    assert parse_engine_metrics(text) == {
        "requests_running": 3.0,
        "requests_waiting": 2.0,
        "kv_cache_usage": 0.25,
        "block_size": 16,
    }


def test_ranking_weighs_cached_prefix_against_load():
    a = Backend(BackendAddress("http://a"), "decode", requests_running=2)
    b = Backend(BackendAddress("http://b"), "decode")
    # a holds 256 of 300 tokens: 44 to compute + 2 * 64 load = 172 < 300 for idle b.
    assert rank_backends([b, a], {"http://a": 256}, 300, 64.0) == [a, b]
    # With 5 requests on a, b wins.
    a.requests_running = 5
    assert rank_backends([a, b], {"http://a": 256}, 300, 64.0) == [b, a]
    # A nearly full KV cache pays the prompt again.
    a.requests_running, a.kv_cache_usage = 0, 0.97
    assert rank_backends([a, b], {"http://a": 256}, 300, 64.0) == [b, a]


@pytest.mark.asyncio
async def test_the_watch_follows_slices_on_a_real_api_server():
    async with ClusterEmulator() as api, kmock.Server(api):
        api.resources[SLICES] = kmock.ResourceInfo(
            kind="EndpointSlice", namespaced=True, verbs=VERBS
        )
        url = str(api.url).rstrip("/")
        config = client.Configuration(host=url)
        seen: list[list[str]] = []
        lock = threading.Lock()

        def on_change(addresses):
            with lock:
                seen.append([a.url for a in addresses])

        api_client = client.ApiClient(config)
        watch = EndpointSliceWatch(TARGET, on_change, 5557, 5558, api_client=api_client)
        base = "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"
        try:
            watch.start()
            await eventually(lambda: seen and seen[-1] == [])
            async with api.request(
                "POST", base, json=_slice("s1", [("10.1.0.1", True), ("10.1.0.2", False)])
            ) as r:
                assert r.status < 300
            await eventually(lambda: seen[-1] == ["http://10.1.0.1:8000"])
            patch = {"endpoints": [{"addresses": ["10.1.0.2"], "conditions": {"ready": True}}]}
            async with api.request(
                "PATCH",
                f"{base}/s1",
                json=patch,
                headers={"Content-Type": "application/merge-patch+json"},
            ) as r:
                assert r.status < 300
            await eventually(lambda: seen[-1] == ["http://10.1.0.2:8000"])
            async with api.request("DELETE", f"{base}/s1") as r:
                assert r.status < 300
            await eventually(lambda: seen[-1] == [])
        finally:
            await asyncio.to_thread(watch.stop)
            api_client.close()
