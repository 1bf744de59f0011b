"""`atom router`'s HTTP side: an OpenAI-compatible proxy that picks a pod per request.

One request: read the body -> token ids of the prompt (the decode pods' `/tokenize`, only when
there is a choice to make) -> wait for a ready decode pod (bounded queue, scale-from-zero) ->
rank decode pods by uncached prompt tokens plus load -> when a prefill role exists and the best
decode pod would still compute more than `remote_prefill_threshold` prompt tokens, run the
prompt on a prefill pod with max_tokens=1 and hand its `kv_transfer_params` to the decode pod ->
relay the decode pod's answer byte for byte (SSE included). A pod that fails before the first
byte is ejected and the request goes to the next one; after the first byte nothing is retried.

Trust (docs/security.md): kv_transfer_params a client sends are dropped; the router signs the
ones it sends with the deployment's transfer key (kv_transfer/auth.py), and strips them from what
it answers. With --api-key, the `x-atom-cache-salt` header sets the request's cache_salt.

This module holds the `Router` (discovery and probes, the queue, the choice of pod, remote
prefill); the FastAPI app is router/routes.py, the relay with retry router/relay.py, the
settings router/config.py.
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
from fastapi import Request
from fastapi.responses import Response

from atom_runtime import envs
from atom_runtime.kv_events.curve import CurveKeys
from atom_runtime.kv_transfer.auth import TransferKey
from atom_runtime.router.backends import Backend, BackendAddress, BackendPool
from atom_runtime.router.config import RouterConfig, RouterError
from atom_runtime.router.discovery import (
    EndpointSliceWatch,
    ServiceTarget,
    in_cluster_config_loaded,
    resolve_dns,
)
from atom_runtime.router.metrics import RouterMetrics
from atom_runtime.router.relay import FORWARDED_HEADERS, RETRYABLE_STATUS, BackendRelay

log = logging.getLogger(__name__)

# The header a gateway in front sets per tenant: the request's cache_salt (honoured only with
# --api-key, so only a caller holding the key can pick a salt this way).
CACHE_SALT_HEADER = "x-atom-cache-salt"


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
        """Raises ValueError naming what is missing: the transfer key of a disaggregated
        router, an unusable CurveZMQ key directory."""
        self.config = config
        self.transfer_key = TransferKey.load()
        if config.disaggregated and self.transfer_key is None and not config.kv_transfer_insecure:
            raise ValueError(
                "disaggregated routing (--prefill-backend / --prefill-service) signs every KV "
                f"transfer with the deployment's key: set {envs.TRANSFER_KEY_FILE.name} or "
                f"{envs.TRANSFER_KEY.name}, the same the engines read (--kv-transfer-insecure "
                "sends unsigned params to engines run with insecure: true, for local experiments)"
            )
        curve = None
        if config.kv_events_curve_dir is not None:
            curve = CurveKeys.for_subscriber(config.kv_events_curve_dir, "--kv-events-curve-dir")
        self.pool = BackendPool(curve=curve)
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

    def matched_tokens(
        self, backends: Sequence[Backend], tokens: list[int], cache_salt: str | None = None
    ) -> dict[str, int]:
        """Prompt tokens each pod caches (under the request's cache_salt, as the engines hash)."""
        sizes = {b.block_size for b in backends if b.block_size}
        out: dict[str, int] = {}
        for size in sizes:
            for pod, blocks in self.pool.index.best_pods(tokens, size, cache_salt):
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
        body, raw = self.request_body(request, await request.body())
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        decode = await self.acquire("decode")
        c = self.config
        single = body.get("n") in (None, 1)
        salt = body.get("cache_salt")
        tokens: list[int] = []
        if c.policy == "kv-aware" and (len(decode) > 1 or (c.disaggregated and single)):
            tokens = await self.prompt_tokens(path, body, decode, headers)
        matched = self.matched_tokens(decode, tokens, salt) if tokens else {}
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
                raw = json.dumps({**body, "kv_transfer_params": params}).encode()
                return await self._relay_first_that_answers("decode", order, path, raw, headers)
        self.metrics.decisions.labels("local_prefill").inc()
        return await self._relay_first_that_answers("decode", order, path, raw, headers)

    def request_body(self, request: Request, raw: bytes) -> tuple[dict, bytes]:
        """The client's JSON object and the bytes to send on: any kv_transfer_params it sent
        dropped (only the router asks for transfers), its cache_salt as the authenticated
        header says. The client's own bytes when nothing changed."""
        body = parse_json_object(raw)
        changed = "kv_transfer_params" in body
        body.pop("kv_transfer_params", None)
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise RouterError(
                400, "cache_salt: must be a non-empty string", "invalid_request_error"
            )
        tenant = request.headers.get(CACHE_SALT_HEADER)
        if tenant and self.config.api_key is not None:  # the guard checked the key already
            body["cache_salt"] = tenant if salt is None else f"{tenant}\n{salt}"
            changed = True
        return body, json.dumps(body).encode() if changed else raw

    def sign(self, params: dict) -> dict:
        """kv_transfer_params as engines act on them: signed with the transfer key."""
        if self.transfer_key is None:  # --kv-transfer-insecure
            return dict(params)
        return self.transfer_key.sign_params(params)

    async def _remote_prefill(self, path: str, body: dict, headers: dict) -> dict | None:
        """Prefill on a prefill pod; its kv_transfer_params, or None to prefill locally."""
        prefill = sorted(self._rotate(self.pool.ready("prefill")), key=lambda b: b.load)
        req = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
        req.pop("max_completion_tokens", None)
        req.update(max_tokens=1, n=1, kv_transfer_params=self.sign({"do_remote_decode": True}))
        payload = json.dumps(req).encode()
        for backend in prefill[: self.config.max_attempts]:
            backend.in_flight += 1
            start = time.monotonic()
            try:
                r = await self.client.post(backend.url + path, content=payload, headers=headers)
            except httpx.HTTPError as e:
                await self.backend_failed(backend, e)
                continue
            finally:
                backend.in_flight -= 1
            self.metrics.latency.labels("prefill", backend.url).observe(time.monotonic() - start)
            if r.status_code in RETRYABLE_STATUS:
                self.pool.eject(backend, f"answered {r.status_code}")
                continue
            if r.status_code != 200:
                break  # the request itself is refused: the decode pod will say why
            try:
                params = r.json().get("kv_transfer_params")
            except ValueError:
                break
            if isinstance(params, dict) and params.get("remote_block_ids"):
                return self.sign({**params, "do_remote_prefill": True})
            break  # nothing held (the producer's holds are full): the decode pod prefills
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


def parse_json_object(raw: bytes) -> dict:
    """A request body as a JSON object; RouterError 400 for anything else, however deep."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RouterError(400, f"body: not valid JSON ({e})", "invalid_request_error") from None
    except RecursionError:
        raise RouterError(400, "body: JSON nested too deeply", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise RouterError(400, "body: must be a JSON object", "invalid_request_error")
    return body
