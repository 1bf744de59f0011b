"""`atom router`'s relay: send a request to the first backend that answers, retrying the next
one on a connection failure or a 502/503/504 before the first byte, then stream the pod's bytes
through as they come (SSE included); after the first byte nothing is retried.

A streamed chat answer opens with an event announcing each choice's role, sent before the
prompt's prefill (and, disaggregated, before the KV pull). The relay holds such opening events
back until the pod says something more, so a pod that dies during the prefill or the pull is
still retried on the next one, which announces the roles again: the client sees one answer.

What fails is judged by who failed: a pod that answers 502/503/504 or cannot be connected to is
ejected; a pod whose connection broke mid-request is probed at once and ejected only if the
probe fails; a 4xx is the request's fault, never the pod's (an engine's 413 on an oversized
body, even one whose connection it then closed, ejects nothing). Non-streamed JSON answers lose
any `kv_transfer_params` on the way out (transfer ids, block ids, hashes and internal addresses
are not for end clients), and no error the client gets names a pod.

`BackendRelay` is a part of `Router` (router/app.py), kept apart so the request path reads on its
own; it uses the router's client, pool, metrics, config, `acquire` and `_rotate`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from atom_runtime.router.backends import Backend
from atom_runtime.router.config import RouterError
from atom_runtime.web.errors import error_body

log = logging.getLogger(__name__)

RETRYABLE_STATUS = (502, 503, 504)  # the pod is loading, dying or gone; another may answer
FORWARDED_HEADERS = ("authorization", "content-type", "x-request-id")
# Opening role events held back at most this long (bytes): a pod sends one per choice.
MAX_HELD_PREAMBLE = 64 * 1024
_ROLE_CHOICE_KEYS = {"index", "delta", "logprobs", "finish_reason", "stop_reason"}


def says_more_than_roles(start: bytes) -> bool:
    """Whether the start of an SSE stream has an event other than a chat stream's opening role
    announcement (a choice's delta of `role` and empty content, no finish reason, no usage):
    from then on the client has seen something another pod could not say for it. An event still
    incomplete at the end of `start` does not count yet; an empty start (no body) does."""
    if not start or len(start) > MAX_HELD_PREAMBLE:
        return True
    *events, _tail = start.replace(b"\r\n", b"\n").split(b"\n\n")
    for event in events:
        data = b"".join(
            line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")
        )
        if not data:
            continue  # a comment or keep-alive
        try:
            body = json.loads(data)
        except ValueError:
            return True  # [DONE] or anything that is not a chunk
        if not isinstance(body, dict) or body.get("usage") or not body.get("choices"):
            return True
        for choice in body["choices"]:
            delta = choice.get("delta")
            if not isinstance(delta, dict) or "role" not in delta or delta.get("content"):
                return True
            if set(delta) - {"role", "content"} or set(choice) - _ROLE_CHOICE_KEYS:
                return True
            if choice.get("finish_reason") is not None or choice.get("logprobs"):
                return True
    return False


class _Unavailable(Exception):
    pass


class BackendRelay:
    async def _relay_first_that_answers(
        self,
        role: str,
        order: list[Backend],
        path: str,
        payload: bytes,
        headers: dict,
        on_done: Callable[[], None] | None = None,
    ) -> Response:
        """Send to the first backend of `order` that answers; `on_done` runs when the request
        is over, however it ends."""
        try:
            response = await self._send_first(role, order, path, payload, headers, on_done)
        except BaseException:
            if on_done is not None:
                on_done()
            raise
        return response

    async def _send_first(self, role, order, path, payload, headers, on_done) -> Response:
        last = "no backend tried"
        for attempt, backend in enumerate(order[: self.config.max_attempts]):
            if attempt:
                self.metrics.fallbacks.labels("retry").inc()
            backend.in_flight += 1
            start = time.monotonic()
            resp: httpx.Response | None = None
            try:
                req = self.client.build_request(
                    "POST", backend.url + path, content=payload, headers=headers
                )
                resp = await self.client.send(req, stream=True)
                if resp.status_code in RETRYABLE_STATUS:
                    raise _Unavailable(f"answered {resp.status_code}")
                chunks = resp.aiter_raw()
                first = await anext(chunks, b"")
                content_type = resp.headers.get("content-type", "")
                if content_type.startswith("text/event-stream"):
                    while not says_more_than_roles(first):
                        more = await anext(chunks, None)
                        if more is None:
                            break
                        first += more
            except (httpx.HTTPError, _Unavailable) as e:
                backend.in_flight -= 1
                if resp is not None:
                    await resp.aclose()
                if resp is not None and 400 <= resp.status_code < 500:
                    raise _refused(role, resp.status_code) from None  # the request's fault
                last = f"{backend.url}: {type(e).__name__}: {e}"
                await self.backend_failed(backend, e)
                continue
            except BaseException:  # the client left while we waited: let the pod abort too
                backend.in_flight -= 1
                if resp is not None:
                    await resp.aclose()
                raise
            if content_type.startswith("application/json"):
                return await self._buffered(role, backend, resp, first, chunks, start, on_done)
            return StreamingResponse(
                self._relay(role, backend, resp, first, chunks, start, on_done),
                status_code=resp.status_code,
                headers={"content-type": resp.headers.get("content-type", "application/json")},
            )
        log.warning("every %s backend tried failed before answering (last: %s)", role, last)
        raise RouterError(
            503,
            f"every {role} backend tried failed before answering",
            "service_unavailable",
            retry_after=1,
        )

    async def backend_failed(self, backend: Backend, error: Exception) -> None:
        """A request to `backend` failed without an answer: eject it when it cannot be reached
        or says it is unavailable; when only the connection broke, eject it only if a probe
        fails now (a pod that closed one connection, say after refusing its body, is healthy)."""
        reason = f"{type(error).__name__}: {error}"
        if isinstance(error, _Unavailable | httpx.ConnectError | httpx.ConnectTimeout):
            self.pool.eject(backend, reason)
            return
        await self.pool.probe(self.client, backend, self.config.probe_timeout)
        if backend.healthy:
            log.info(
                "%s backend %s: %s (it answers its probe: kept)", backend.role, backend.url, reason
            )

    async def _buffered(self, role, backend, resp, first, chunks, start, on_done) -> Response:
        """A non-streamed JSON answer, read whole and relayed without kv_transfer_params."""
        try:
            parts = [first]
            async for chunk in chunks:
                parts.append(chunk)
        except httpx.HTTPError as e:
            if 400 <= resp.status_code < 500:
                raise _refused(role, resp.status_code) from None
            await self.backend_failed(backend, e)
            raise RouterError(
                503, f"the {role} backend failed mid-response", "service_unavailable", 1
            ) from None
        finally:
            backend.in_flight -= 1
            self.metrics.latency.labels(role, backend.url).observe(time.monotonic() - start)
            await resp.aclose()
        if on_done is not None:  # (on a failure, the caller runs it)
            on_done()
        return Response(
            strip_transfer_params(b"".join(parts)),
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type", "application/json"),
        )

    async def _relay(
        self,
        role: str,
        backend: Backend,
        resp: httpx.Response,
        first: bytes,
        rest: AsyncIterator[bytes],
        start: float,
        on_done: Callable[[], None] | None,
    ) -> AsyncIterator[bytes]:
        """Relay the pod's bytes; close the upstream response however this ends (a client that
        disconnects closes it here, and the pod aborts the request)."""
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        try:
            if first:
                yield first
            try:
                async for chunk in rest:
                    yield chunk
            except httpx.HTTPError as e:
                # Bytes already went out: no retry. Say so in the stream rather than hang.
                if not 400 <= resp.status_code < 500:
                    self.pool.eject(backend, f"failed mid-response: {type(e).__name__}: {e}")
                if sse:
                    err = error_body(
                        f"the {role} backend failed mid-response", "service_unavailable"
                    )
                    yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            backend.in_flight -= 1
            if on_done is not None:
                on_done()
            self.metrics.latency.labels(role, backend.url).observe(time.monotonic() - start)
            await resp.aclose()

    async def passthrough(self, request: Request, method: str, path: str) -> Response:
        """Routes with no routing decision (/v1/models, /tokenize, ...): any ready decode pod."""
        decode = self._rotate(await self.acquire("decode"))
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        raw = await request.body()
        for backend in decode[: self.config.max_attempts]:
            try:
                r = await self.client.request(
                    method, backend.url + path, content=raw or None, headers=headers
                )
            except httpx.HTTPError as e:
                await self.backend_failed(backend, e)
                continue
            if r.status_code in RETRYABLE_STATUS:
                self.pool.eject(backend, f"answered {r.status_code}")
                continue
            return Response(
                r.content,
                status_code=r.status_code,
                media_type=r.headers.get("content-type", "application/json"),
            )
        raise RouterError(503, "no decode backend answered", "service_unavailable", 1)


def _refused(role: str, status: int) -> RouterError:
    """A pod answered `status` (4xx) and closed the connection before its body: the request's
    fault, answered with that status."""
    what = "too large for the backends" if status == 413 else f"refused by the {role} backend"
    return RouterError(status, f"request: {what} ({status})", "invalid_request_error")


def strip_transfer_params(body: bytes) -> bytes:
    """A JSON answer without its top-level kv_transfer_params (what a producer says about where
    it holds blocks); other bytes unchanged."""
    if b'"kv_transfer_params"' not in body:
        return body
    try:
        parsed = json.loads(body)
    except ValueError:
        return body
    if not isinstance(parsed, dict) or parsed.pop("kv_transfer_params", None) is None:
        return body
    return json.dumps(parsed).encode()
