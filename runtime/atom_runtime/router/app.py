"""`atom router`'s HTTP side: an OpenAI-compatible proxy that picks a pod per request.

One request: read the body -> token ids of the prompt (the decode pods' `/tokenize`, only when
there is a choice to make) -> wait for a ready decode pod (bounded queue, scale-from-zero) ->
rank decode pods by uncached prompt tokens plus load -> when a prefill role exists and the best
decode pod would still compute more than `remote_prefill_threshold` prompt tokens, run the
prompt on a prefill pod with max_tokens=1 and hand its `kv_transfer_params` to the decode pod ->
relay the decode pod's answer byte for byte (SSE included). A pod that fails before the first
byte is ejected and the request goes to the next one; after the first byte nothing is retried.

This module holds the `Router` (discovery and probes, the queue, the choice of pod, remote
prefill) and the FastAPI app; the relay with retry is router/relay.py, the settings
router/config.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Sequence
from itertools import count

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from atom_runtime.router.backends import Backend, BackendAddress, BackendPool
from atom_runtime.router.config import RouterConfig, RouterError
from atom_runtime.router.discovery import (
    EndpointSliceWatch,
    ServiceTarget,
    in_cluster_config_loaded,
    resolve_dns,
)
from atom_runtime.router.metrics import CONTENT_TYPE, RouterMetrics
from atom_runtime.router.relay import FORWARDED_HEADERS, RETRYABLE_STATUS, BackendRelay
from atom_runtime.web.request_io import wait_disconnect

log = logging.getLogger(__name__)

# Counted for a client that left before its answer began (nginx's code; nothing is sent).
CLIENT_CLOSED_REQUEST = 499


def rank_backends(
    backends: Sequence[Backend],
    matched_tokens: dict[str, int],
    prompt_tokens: int,
    load_weight: float,
) -> list[Backend]:
    """Cheapest first: the prompt tokens a pod would still compute, plus `load_weight` for each
    request it holds; a pod whose KV cache is nearly full pays the whole prompt again (it would
    evict, or preempt). Ties keep the given order (the caller rotates it for round-robin)."""

    def cost(b: Backend) -> float:
        uncached = prompt_tokens - min(matched_tokens.get(b.url, 0), prompt_tokens)
        penalty = prompt_tokens if b.kv_cache_usage >= 0.95 else 0
        return uncached + penalty + load_weight * b.load

    return sorted(backends, key=cost)


class Router(BackendRelay):
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pool = BackendPool()
        self.metrics = RouterMetrics(self.pool)
        self.pool.on_eject = lambda role: self.metrics.ejections.labels(role).inc()
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=config.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self._rotation = count()
        self._tasks: list[asyncio.Task] = []
        self._watches: list[EndpointSliceWatch] = []
        self._queued = {"decode": 0, "prefill": 0}

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        c = self.config
        for role, static in (("decode", c.backends), ("prefill", c.prefill_backends)):
            if static:
                self.pool.set_role_addresses(
                    role,
                    [BackendAddress.parse(u, c.kv_events_port, c.kv_replay_port) for u in static],
                )
        services = [("decode", u) for u in c.decode_services]
        services += [("prefill", u) for u in c.prefill_services]
        use_k8s = c.discovery == "kubernetes" or (
            c.discovery == "auto" and services and in_cluster_config_loaded()
        )
        for role, url in services:
            target = ServiceTarget.parse(url)
            if use_k8s and target.service is not None:
                self._start_watch(role, target)
            else:
                self._tasks.append(asyncio.create_task(self._dns_loop(role, target)))
        self._tasks.append(asyncio.create_task(self._probe_loop()))

    def _start_watch(self, role: str, target: ServiceTarget) -> None:
        loop = asyncio.get_running_loop()
        c = self.config

        def on_change(addresses: list[BackendAddress]) -> None:
            loop.call_soon_threadsafe(self.pool.set_role_addresses, role, addresses)

        watch = EndpointSliceWatch(target, on_change, c.kv_events_port, c.kv_replay_port)
        watch.start()
        self._watches.append(watch)

        async def fall_back_to_dns() -> None:
            while watch.failure is None:
                await asyncio.sleep(c.discovery_interval)
            await self._dns_loop(role, target)

        self._tasks.append(asyncio.create_task(fall_back_to_dns()))

    async def _dns_loop(self, role: str, target: ServiceTarget) -> None:
        c = self.config
        while True:
            addresses = await resolve_dns(target, c.kv_events_port, c.kv_replay_port)
            self.pool.set_role_addresses(role, addresses)
            await asyncio.sleep(c.discovery_interval)

    async def _probe_loop(self) -> None:
        while True:
            try:
                await self.pool.probe_all(self.client, self.config.probe_timeout)
            except Exception:  # a probe bug must not stop re-admission for good
                log.exception("backend probe round failed")
            await asyncio.sleep(self.config.probe_interval)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for watch in self._watches:
            await asyncio.to_thread(watch.stop)
        await asyncio.to_thread(self.pool.close)
        await self.client.aclose()

    # -- choosing --------------------------------------------------------------------------------

    async def acquire(self, role: str) -> list[Backend]:
        """The ready backends of `role`, waiting in the bounded queue while there are none."""
        self.metrics.demand.labels(role).inc()
        ready = self.pool.ready(role)
        if ready:
            return ready
        gauge = self.metrics.queued.labels(role)
        if self._queued[role] >= self.config.queue_size:
            raise RouterError(
                429,
                f"no {role} backend is ready and {self.config.queue_size} requests already "
                "wait for one; retry later",
                "rate_limit_exceeded",
                retry_after=max(1, int(self.config.queue_timeout / 4)),
            )
        self._queued[role] += 1
        gauge.inc()
        try:
            ok = await self.pool.wait_ready(role, self.config.queue_timeout)
        finally:
            self._queued[role] -= 1
            gauge.dec()
        if not ok:
            raise RouterError(
                503,
                f"no {role} backend became ready within {self.config.queue_timeout:g} s",
                "service_unavailable",
                retry_after=max(1, int(self.config.queue_timeout / 4)),
            )
        return self.pool.ready(role)

    def _rotate(self, backends: list[Backend]) -> list[Backend]:
        if not backends:
            return backends
        k = next(self._rotation) % len(backends)
        return backends[k:] + backends[:k]

    def matched_tokens(self, backends: Sequence[Backend], tokens: list[int]) -> dict[str, int]:
        sizes = {b.block_size for b in backends if b.block_size}
        out: dict[str, int] = {}
        for size in sizes:
            for pod, blocks in self.pool.index.best_pods(tokens, size):
                out[pod] = blocks * size
        return out

    async def prompt_tokens(
        self, path: str, body: dict, backends: list[Backend], headers: dict
    ) -> list[int]:
        """The prompt's token ids, asked of a decode pod (it owns the tokenizer and template)
        with the client's headers: an engine run with --api-key answers /tokenize only to the
        client's key, and without the ids nothing is scored and nothing is disaggregated."""
        if path == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                return []
            request = {"prompt": prompt}
        else:
            request = {"messages": body.get("messages"), "add_generation_prompt": True}
        if body.get("model") is not None:
            request["model"] = body["model"]
        for backend in backends[:2]:
            try:
                r = await self.client.post(f"{backend.url}/tokenize", json=request, headers=headers)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                return list(r.json().get("tokens") or [])
            return []  # the pod will refuse the request itself, with the reason
        return []

    # -- the request path ------------------------------------------------------------------------

    async def handle(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RouterError(400, f"body: not valid JSON ({e})", "invalid_request_error") from None
        if not isinstance(body, dict):
            raise RouterError(400, "body: must be a JSON object", "invalid_request_error")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        decode = await self.acquire("decode")
        c = self.config
        single = body.get("n") in (None, 1) and body.get("kv_transfer_params") is None
        tokens: list[int] = []
        if c.policy == "kv-aware" and (len(decode) > 1 or (c.disaggregated and single)):
            tokens = await self.prompt_tokens(path, body, decode, headers)
        matched = self.matched_tokens(decode, tokens) if tokens else {}
        order = self._rotate(decode)
        if c.policy == "kv-aware":
            order = rank_backends(order, matched, len(tokens), c.load_weight)
        if tokens:
            self.metrics.prompt_tokens.inc(len(tokens))
            self.metrics.matched_tokens.inc(min(matched.get(order[0].url, 0), len(tokens)))

        uncached = len(tokens) - matched.get(order[0].url, 0)
        if c.disaggregated and single and tokens and uncached > c.remote_prefill_threshold:
            self.metrics.demand.labels("prefill").inc()
            if not self.pool.ready("prefill"):
                # Served by the decode pods now; counted as waiting for prefill while it runs,
                # so the operator brings the prefill role up from zero.
                self.metrics.fallbacks.labels("no_prefill_backend").inc()
                self.metrics.decisions.labels("local_prefill").inc()
                gauge = self.metrics.queued.labels("prefill")
                gauge.inc()
                return await self._relay_first_that_answers(
                    "decode", order, path, raw, headers, on_done=gauge.dec
                )
            params = await self._remote_prefill(path, body, headers)
            if params is not None:
                self.metrics.decisions.labels("remote_prefill").inc()
                body = {**body, "kv_transfer_params": params}
                raw = json.dumps(body).encode()
                return await self._relay_first_that_answers("decode", order, path, raw, headers)
        self.metrics.decisions.labels("local_prefill").inc()
        return await self._relay_first_that_answers("decode", order, path, raw, headers)

    async def _remote_prefill(self, path: str, body: dict, headers: dict) -> dict | None:
        """Prefill on a prefill pod; its kv_transfer_params, or None to prefill locally."""
        prefill = sorted(self._rotate(self.pool.ready("prefill")), key=lambda b: b.load)
        req = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
        req.pop("max_completion_tokens", None)
        req.update(max_tokens=1, n=1, kv_transfer_params={"do_remote_decode": True})
        payload = json.dumps(req).encode()
        for backend in prefill[: self.config.max_attempts]:
            backend.in_flight += 1
            start = time.monotonic()
            try:
                r = await self.client.post(backend.url + path, content=payload, headers=headers)
            except httpx.HTTPError as e:
                self.pool.eject(backend, f"{type(e).__name__}: {e}")
                continue
            finally:
                backend.in_flight -= 1
            self.metrics.latency.labels("prefill", backend.url).observe(time.monotonic() - start)
            if r.status_code in RETRYABLE_STATUS:
                self.pool.eject(backend, f"answered {r.status_code}")
                continue
            if r.status_code != 200:
                break  # the request itself is refused: the decode pod will say why
            params = r.json().get("kv_transfer_params")
            if isinstance(params, dict) and params.get("remote_block_ids") is not None:
                return {**params, "do_remote_prefill": True}
            break
        self.metrics.fallbacks.labels("prefill_failed").inc()
        return None

    def describe(self) -> dict:
        return {
            role: [
                {
                    "url": b.url,
                    "healthy": b.healthy,
                    "ejected_reason": b.ejected_reason,
                    "requests_running": b.requests_running,
                    "requests_waiting": b.requests_waiting,
                    "kv_cache_usage": b.kv_cache_usage,
                    "in_flight": b.in_flight,
                    "block_size": b.block_size,
                    "cached_blocks": len(self.pool.index.hashes(b.url)),
                }
                for b in self.pool.backends[role].values()
            ]
            for role in self.pool.backends
        }


def build_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="atom router", lifespan=lifespan)

    async def routed(request: Request, route: str) -> Response:
        # Until the first byte is relayed nothing else notices a client that leaves (a remote
        # prefill, a pull, a whole non-streamed answer may be under way): watch for it, and
        # cancel the work, which closes the pods' requests so that they abort too.
        await request.body()  # read first: the watch takes the rest of the receive channel
        work = asyncio.ensure_future(router.handle(request, route))
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait((work,))
        if work.cancelled():
            response = Response(status_code=CLIENT_CLOSED_REQUEST)
        else:
            try:
                response = work.result()
            except RouterError as e:
                response = e.response()
        router.metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await routed(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await routed(request, "/v1/chat/completions")

    async def passthrough(request: Request, method: str, path: str) -> Response:
        try:
            return await router.passthrough(request, method, path)
        except RouterError as e:
            return e.response()

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await passthrough(request, "GET", "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await passthrough(request, "POST", "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await passthrough(request, "POST", "/detokenize")

    @app.get("/health")
    async def health() -> Response:
        # Always 200 while the process runs: with a role scaled to zero the router must stay in
        # its Service, so requests reach the queue that makes the operator scale the role up.
        ready = {role: len(router.pool.ready(role)) for role in router.pool.backends}
        return Response(
            json.dumps({"status": "ok", "ready_backends": ready}), media_type="application/json"
        )

    @app.get("/router/backends")
    async def backends() -> Response:
        return Response(json.dumps(router.describe()), media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.metrics.render(), media_type=CONTENT_TYPE)

    return app
