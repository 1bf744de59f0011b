"""Scale to zero end to end on CPU: the real kopf operator against the emulated API, a real
`atom router` holding a request for a role at zero, and a real `atom serve` engine brought up
for it.

The role that goes to zero is decode of an aggregated AtomDeployment with the router on
(`router.enabled`): the CRD lets decode reach zero only behind the router, which holds requests
for it meanwhile (a disaggregated deployment has the router too; the autoscaler treats both
alike, tests/operator/test_autoscale_operator.py). The router runs with a static `--backend` on
the port where the decode engine will listen, as its pod would resolve the decode Service to
that engine's address. The test plays the Deployment controller
and the kubelet: it reports the router pod and, once the operator asks for a decode replica,
starts the engine on that port and marks its pod Ready.

The held request streams, and the test measures what a user waits when a deployment is at zero:
from sending the request to its first token (printed, `pytest -s` shows it, and kept as the
test's `scale_from_zero_first_token_s` property). On CPU it is dominated by the operator's
autoscaler interval and the tiny engine's start; docs/operator.md records the figure.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import DEPLOYMENTS, NAMESPACE, eventually
from test_autoscale_operator import add_pod, decision, replicas, scale_to_zero

from tests.router.conftest import RouterProcess, launch_router
from tests.server.conftest import TINY_FLAGS, Launcher, free_port

pytestmark = pytest.mark.asyncio

QUEUED = 'atom:router_queued_requests{role="decode"}'


@pytest.fixture()
def decode_port() -> int:
    """Where the decode engine will listen once the operator asks for it."""
    return free_port()


@pytest.fixture()
def engines(tmp_path) -> Iterator[Launcher]:
    """Starts the decode engine when the test, as the kubelet, runs its pod; stops it after."""
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.close()


@pytest.fixture()
def router(tmp_path, decode_port) -> Iterator[RouterProcess]:
    router = launch_router(
        tmp_path,
        "--backend", f"http://127.0.0.1:{decode_port}",
        "--kv-events-port", "0",
        "--queue-size", "4",
        "--queue-timeout", "300",  # a guard: the wait below ends when the engine is up
    )  # fmt: skip
    yield router
    router.stop()


async def queued(router: RouterProcess) -> float:
    """The router's own gauge of requests it holds for decode, read from its /metrics."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{router.url}/metrics")).text
    (line,) = [line for line in text.splitlines() if line.startswith(QUEUED + " ")]
    return float(line.rsplit(" ", 1)[1])


async def mark_ready(cluster, name: str) -> None:
    """The kubelet's report once the engine's readiness probe passes."""
    status = {"phase": "Running", "podIP": "127.0.0.1",
              "conditions": [{"type": "Ready", "status": "True"}]}  # fmt: skip
    await cluster.request(
        "PATCH", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/status", {"status": status}
    )


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict
) -> tuple[float, str, dict]:
    """POST a streamed completion; (seconds from sending to the first token, the whole text,
    usage)."""
    request = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start, first, pieces, usage = time.monotonic(), None, [], {}
    async with client.stream("POST", url, json=request) as response:
        if response.status_code != 200:
            raise AssertionError(f"{response.status_code}: {(await response.aread())!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                if first is None:
                    first = time.monotonic() - start
                pieces.append(choice.get("text") or "")
    if first is None:
        raise AssertionError("the stream carried no token")
    return first, "".join(pieces), usage


async def test_a_held_request_brings_decode_up_from_zero_and_idle_takes_it_back(
    cluster, operator_running, router, decode_port, engines, tiny_models, record_property
):
    spec = {
        "accelerator": {"vendor": "cpu"},
        "router": {"enabled": True},
        "decode": {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                                   "targetRequestsRunning": 4, "scaleToZeroAfterSeconds": 1}},
    }  # fmt: skip
    model = str(tiny_models["llama"])
    body = {"model": model, "prompt": "scale me from zero", "max_tokens": 4, "temperature": 0}
    async with operator_running(), httpx.AsyncClient(timeout=300) as client:
        await cluster.create_atomd("chat", spec)
        await eventually(lambda: cluster.get(DEPLOYMENTS, "chat-decode"))
        await scale_to_zero(cluster, "chat-decode")
        await add_pod(cluster, "chat-router-77c-r1", "router", router.port)
        await eventually(
            lambda: (
                decision(cluster, "decode")["reason"] == "scaled to zero, no queued demand"
                and decision(cluster, "decode")["metrics"]["routerQueued"] == "0.0"
            ),
            timeout=30,
        )
        assert replicas(cluster, "chat-decode") == 0

        # A client request reaches the router, which has no decode pod: it is held.
        held = asyncio.create_task(stream_completion(client, f"{router.url}/v1/completions", body))
        try:
            await eventually_async(lambda: queued(router), lambda v: v == 1, timeout=60)
            assert not held.done()
            # The operator scrapes the router and brings decode back.
            await eventually(lambda: replicas(cluster, "chat-decode") == 1, timeout=60)
            await eventually(
                lambda: decision(cluster, "decode")["reason"] == "1 request(s) queued at the router"
            )

            # The Deployment controller creates the pod; the kubelet starts the engine on it.
            await add_pod(cluster, "chat-decode-5d8f-d1", "decode", decode_port, ready=False)
            engine = await asyncio.to_thread(
                engines, "--model", model, *TINY_FLAGS, port=decode_port
            )
            await mark_ready(cluster, "chat-decode-5d8f-d1")
            first_token_s, text, usage = await asyncio.wait_for(held, timeout=300)
        finally:
            if not held.done():
                held.cancel()
        print(f"\nscale from zero: first token {first_token_s:.2f} s after the held request")
        record_property("scale_from_zero_first_token_s", round(first_token_s, 3))
        # The engine's own answer to the same greedy request: the router relayed it.
        direct = await client.post(f"{engine.url}/v1/completions", json=body)
        assert direct.status_code == 200, direct.text
        assert text == direct.json()["choices"][0]["text"]
        assert usage["completion_tokens"] == 4
        assert await queued(router) == 0

        # Idle engine, nothing held: back to zero after scaleToZeroAfterSeconds.
        await eventually(lambda: replicas(cluster, "chat-decode") == 0, timeout=60)
        # The status record follows the write within the same autoscaler pass.
        await eventually(lambda: decision(cluster, "decode")["reason"].startswith("idle for "))
        assert engine.proc.poll() is None  # scaling down is the controller's job, not ours

    scaled = [m for _, reason, m in cluster.events() if reason == "Autoscaled"]
    assert scaled[0].startswith("decode: 0 -> 1 replicas: 1 request(s) queued at the router")
    assert scaled[1].startswith("decode: 1 -> 0 replicas: idle for ")
    assert len(scaled) == 2
    # Both replica changes after the test's own scale to zero came from the autoscaler.
    writes = [w for w in cluster.writes() if w.url.path.endswith("/deployments/chat-decode")]
    managers = [w.url.query.get("fieldManager") for w in writes if b"replicas" in (w.body or b"")]
    assert managers == [None, "atom-operator-autoscaler", "atom-operator-autoscaler"]


async def eventually_async(read, accept, *, timeout: float) -> object:
    """Await `read()` until `accept` takes its value; `timeout` is a deadlock guard."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await read()
        if accept(value):
            return value
        if loop.time() > deadline:
            raise AssertionError(f"still {value!r} after {timeout}s")
        await asyncio.sleep(0.05)
