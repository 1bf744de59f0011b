"""The built-in autoscaler end to end: the real kopf operator against the emulated API, scraping a
real `atom serve` engine on 127.0.0.1 under real load.

The test plays the Deployment controller and the kubelet: it creates the role's Pod objects in the
emulated API with status.podIP 127.0.0.1 and the engine's port as the container port named
`http` (on a cluster that port is 8000 and the IP the pod's own; the operator reads both from the
pod, so nothing differs). Scale-to-zero's demand signal comes from a real HTTP server serving the
router's `atom:router_queued_requests` gauge, standing in for `atom router`.
"""

from __future__ import annotations

import asyncio
import http.server
import os
import re
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import DEPLOYMENTS, NAMESPACE, eventually

from tests.server.conftest import TINY_FLAGS, Launcher

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def engine(tiny_models, tmp_path_factory):
    """One real engine, one sequence at a time, so concurrent requests queue up (waiting > 0)."""
    server = Launcher(tmp_path_factory.mktemp("autoscale"))(
        "--model", str(tiny_models["llama"]), *TINY_FLAGS, "--max-num-seqs", "1",
    )  # fmt: skip
    yield server
    server.stop()


class RouterGauge:
    """A real HTTP server answering /metrics with the router's queued-requests gauge."""

    def __init__(self) -> None:
        self.queued = {"decode": 0.0, "prefill": 0.0}
        gauge = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                lines = ["# TYPE atom:router_queued_requests gauge"]
                lines += [
                    f'atom:router_queued_requests{{role="{role}"}} {value}'
                    for role, value in gauge.queued.items()
                ]
                body = ("\n".join(lines) + "\n").encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture()
def router_gauge() -> Iterator[RouterGauge]:
    gauge = RouterGauge()
    yield gauge
    gauge.close()


async def add_pod(cluster, name: str, role: str, port: int, *, ready: bool = True) -> None:
    """A Pod of `role` as the kubelet would report it: Running and Ready on 127.0.0.1:`port`."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {"serving.atom.dev/deployment": "chat", "serving.atom.dev/role": role},
        },
        "spec": {"containers": [{"name": "engine" if role != "router" else "router",
                                 "ports": [{"name": "http", "containerPort": port}]}]},
    }  # fmt: skip
    await cluster.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    status = {"phase": "Running" if ready else "Pending", "conditions": [condition]}
    if ready:
        status["podIP"] = "127.0.0.1"
    await cluster.request(
        "PATCH", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/status", {"status": status}
    )


async def scale_to_zero(cluster, name: str) -> None:
    """Deployment `name` at zero replicas, as after an idle period (`kubectl scale`): a new
    Deployment starts at 1, and a role without a Ready pod holds its replicas."""
    await cluster.request(
        "PATCH",
        f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}",
        {"spec": {"replicas": 0}},
    )


async def remove_pod(cluster, name: str) -> None:
    await cluster.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")


def replicas(cluster, name: str) -> int | None:
    deployment = cluster.get(DEPLOYMENTS, name)
    return None if deployment is None else deployment["spec"].get("replicas", 1)


def decision(cluster, role: str) -> dict:
    return cluster.atomd("chat")["status"]["autoscaling"][role]


def condition(cluster, kind: str) -> dict:
    (found,) = [c for c in cluster.atomd("chat")["status"]["conditions"] if c["type"] == kind]
    return found


async def test_real_load_scales_the_role_up_to_its_max_and_back(cluster, operator_running, engine):
    spec = {
        "accelerator": {"vendor": "cpu"},
        "decode": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2,
                                   "targetRequestsWaiting": 1,
                                   "scaleDownStabilizationSeconds": 0}},
    }  # fmt: skip
    async with operator_running(), httpx.AsyncClient(base_url=engine.url, timeout=120) as client:
        await cluster.create_atomd("chat", spec)
        await eventually(lambda: cluster.get(DEPLOYMENTS, "chat-decode"))
        # Rendered without replicas: the autoscaler is the field's only writer.
        assert "replicas" not in cluster.get(DEPLOYMENTS, "chat-decode")["spec"]
        await add_pod(cluster, "chat-decode-5d8f-a1", "decode", engine.port)
        await eventually(lambda: decision(cluster, "decode")["metrics"]["pods"] == "1.0")
        assert decision(cluster, "decode")["desiredReplicas"] == 1

        # Five requests on an engine that runs one at a time: a long one runs, four wait. The
        # engine core is frozen once its /metrics shows the four waiting, so every scrape the
        # operator makes sees them, however fast or slow this machine is.
        body = {"model": engine_model(engine), "prompt": "hello", "max_tokens": 48,
                "ignore_eos": True}  # fmt: skip
        post = client.post
        load = [asyncio.create_task(post("/v1/completions", json={**body, "max_tokens": 900}))]
        await scrape_until(client, lambda g: g["atom:requests_running"] == 1)
        load += [asyncio.create_task(post("/v1/completions", json=body)) for _ in range(4)]
        core = engine.engine_pid()
        try:
            await scrape_until(client, lambda g: g["atom:requests_waiting"] == 4)
            os.kill(core, signal.SIGSTOP)
            await eventually(lambda: replicas(cluster, "chat-decode") == 2, timeout=60)
            await eventually(lambda: decision(cluster, "decode")["currentReplicas"] == 2)
            assert decision(cluster, "decode")["lastScaleTime"]
            await eventually(lambda: condition(cluster, "ScalingLimited")["status"] == "True")
            # The new pod is still Pending (no GPU yet, say): it is not scraped.
            await add_pod(cluster, "chat-decode-5d8f-b2", "decode", engine.port, ready=False)
        finally:
            os.kill(core, signal.SIGCONT)
            answers = await asyncio.gather(*load)
        assert [a.status_code for a in answers] == [200] * 5

        # Idle again: back to minReplicas (no scale-down window in this spec).
        await eventually(lambda: replicas(cluster, "chat-decode") == 1, timeout=30)
        await eventually(lambda: condition(cluster, "ScalingLimited")["status"] == "False")
        limited_record = condition(cluster, "ScalingLimited")

    events = cluster.events()
    scaled = [message for _, reason, message in events if reason == "Autoscaled"]
    assert scaled[0].startswith("decode: 1 -> 2 replicas: surge: requestsWaiting")
    assert scaled[1].startswith("decode: 2 -> 1 replicas: scale-down: requestsWaiting 0/pod")
    # 4 waiting / target 1 wanted 4 pods, above maxReplicas 2: reported, not silently capped.
    limited = [(kind, message) for kind, reason, message in events if reason == "ScalingLimited"]
    assert limited[0][0] == "Warning"
    assert limited[0][1].startswith("decode is at maxReplicas: surge: requestsWaiting")
    assert "limited by maxReplicas 2" in limited[0][1]
    assert limited_record["reason"] == "WithinLimits"
    # Every replica write came from the autoscaler, under its own field manager.
    writes = [w for w in cluster.writes() if w.url.path.endswith("/deployments/chat-decode")]
    assert [w.url.query.get("fieldManager") for w in writes if b"replicas" in (w.body or b"")] == [
        "atom-operator-autoscaler", "atom-operator-autoscaler"]  # fmt: skip


async def scrape_until(client: httpx.AsyncClient, check) -> None:
    """Read the engine's /metrics until `check(gauges)` holds (120 s: a deadlock guard)."""
    deadline = time.monotonic() + 120
    while True:
        text = (await client.get("/metrics")).text
        found = re.finditer(r"^(atom:\S+) (\S+)$", text, re.M)
        gauges = {m.group(1): float(m.group(2)) for m in found}
        if check(gauges):
            return
        assert time.monotonic() < deadline, f"engine gauges never matched: {gauges}"
        await asyncio.sleep(0.02)


def engine_model(engine) -> str:
    return httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]


async def test_idle_role_scales_to_zero_and_back_on_router_demand(
    cluster, operator_running, engine, router_gauge
):
    spec = {
        "accelerator": {"vendor": "cpu"},
        "decode": {"replicas": 1},
        "prefill": {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                                    "targetRequestsWaiting": 2, "scaleToZeroAfterSeconds": 1}},
    }  # fmt: skip
    async with operator_running():
        await cluster.create_atomd("chat", spec)
        await eventually(lambda: cluster.get(DEPLOYMENTS, "chat-prefill"))
        await add_pod(cluster, "chat-router-77c-r1", "router", router_gauge.port)
        await add_pod(cluster, "chat-prefill-6b9-p1", "prefill", engine.port)

        # An idle engine and nothing queued at the router: zero after scaleToZeroAfterSeconds.
        await eventually(lambda: replicas(cluster, "chat-prefill") == 0, timeout=30)
        await eventually(lambda: decision(cluster, "prefill")["reason"].startswith("idle for "))
        await remove_pod(cluster, "chat-prefill-6b9-p1")  # the controller removes the pod
        await eventually(lambda: decision(cluster, "prefill")["currentReplicas"] == 0)
        assert replicas(cluster, "chat-prefill") == 0

        # A request waits at the router for a prefill pod: back to one.
        router_gauge.queued["prefill"] = 2.0
        await eventually(lambda: replicas(cluster, "chat-prefill") == 1, timeout=30)
        await eventually(
            lambda: decision(cluster, "prefill")["reason"] == "2 request(s) queued at the router"
        )

    scaled = [m for _, reason, m in cluster.events() if reason == "Autoscaled"]
    assert scaled[0].startswith("prefill: 1 -> 0 replicas: idle for ")
    assert scaled[1].startswith("prefill: 0 -> 1 replicas: 2 request(s) queued at the router")


@pytest.mark.parametrize(
    "mode", [{"router": {"enabled": True}}, {"prefill": {"replicas": 1}}],
    ids=["aggregated-router", "disaggregated"],
)  # fmt: skip
async def test_decode_at_zero_comes_back_on_the_routers_queued_demand(
    cluster, operator_running, router_gauge, mode
):
    """Decode rests at zero behind any router, aggregated or not: the autoscaler scrapes the
    router pods' queued-requests gauge whenever the AtomDeployment has a router."""
    spec = {
        "accelerator": {"vendor": "cpu"}, **mode,
        "decode": {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                                   "targetRequestsRunning": 4}},
    }  # fmt: skip
    async with operator_running():
        await cluster.create_atomd("chat", spec)
        await eventually(lambda: cluster.get(DEPLOYMENTS, "chat-decode"))
        await scale_to_zero(cluster, "chat-decode")
        await add_pod(cluster, "chat-router-77c-r1", "router", router_gauge.port)
        await eventually(
            lambda: decision(cluster, "decode")["metrics"].get("routerQueued") == "0.0",
            timeout=30,
        )
        assert decision(cluster, "decode")["reason"] == "scaled to zero, no queued demand"

        router_gauge.queued["decode"] = 3.0
        await eventually(lambda: replicas(cluster, "chat-decode") == 1, timeout=30)
        await eventually(
            lambda: decision(cluster, "decode")["reason"] == "3 request(s) queued at the router"
        )
