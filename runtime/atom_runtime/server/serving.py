"""The two generation endpoints: /v1/completions and /v1/chat/completions.

A request is parsed (pydantic, strict), turned into SamplingParams, tokenized (chat template for
chat) and submitted to the engine core; the engine's verdict on it (context length, vocabulary)
arrives before any byte of the response is sent, so a refused request is a 400, never a broken
stream. Then either the final outputs are collected (while watching for the client leaving) or
SSE chunks are streamed. Whatever way a request ends, `finally` aborts what is unfinished in the
engine, records its metrics and logs its one line.

The request's state in flight (`Run`, `_Shape`) is server/in_flight.py; parsing the body and sending
JSON or SSE, web/request_io.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from starlette.requests import Request
from starlette.responses import Response

from atom_runtime.engine.core_client import EngineCoreClient, EngineDeadError
from atom_runtime.engine.output_processor import RequestState, SequenceText
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.server import responses as R
from atom_runtime.server.in_flight import RequestCut, Run, _retrieve, _Shape, merged
from atom_runtime.server.metrics import ServerMetrics
from atom_runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from atom_runtime.server.reasoning import make_parser, plan_reasoning
from atom_runtime.server.tools import named_call_delta, plan_tools
from atom_runtime.text.tokenizer import Tokenizer
from atom_runtime.web.errors import (
    bad_request,
    engine_unavailable,
    error_body,
    from_value_error,
    model_not_found,
    shutting_down,
)
from atom_runtime.web.request_io import (
    ClientGone,
    _sse,
    json_response,
    parse_body,
    random_id,
    wait_disconnect,
)

log = logging.getLogger("atom_runtime.server")


class OpenAIServing:
    def __init__(
        self,
        client: EngineCoreClient,
        tokenizer: Tokenizer,
        model_names: list[str],
        metrics: ServerMetrics,
        log_requests: bool = True,
        tool_parser: str | None = None,
        max_sequences: int = 256,
        reasoning_parser: str | None = None,
    ) -> None:
        self.client = client
        self.max_sequences = max_sequences
        # Tokenizing and chat templates run here, off the event loop, so a long prompt never
        # stalls /health or other requests; two workers bound how many prompts are tokenized
        # (and so how much tokenizer memory is in use) at once.
        self._tokenize_pool = ThreadPoolExecutor(2, thread_name_prefix="atom-tokenize")
        self.tool_parser = tool_parser
        self.reasoning_parser = make_parser(reasoning_parser)
        self.tokenizer = tokenizer
        self.model_names = model_names
        self.metrics = metrics
        self.log_requests = log_requests
        self._token_text_cache: dict[int, str] = {}
        # Submitted HTTP requests not yet finished, by id: what a shutdown cut reaches.
        self._in_flight: dict[str, list[Run]] = {}
        self._cut_reason: str | None = None

    def cut_in_flight(self, reason: str) -> int:
        """End every request still running (and any submitted from now on): non-streaming ones
        answer 503, streams end with an SSE error event and [DONE]. Returns how many were cut."""
        self._cut_reason = reason
        cut = 0
        for runs in self._in_flight.values():
            unfinished = [run for run in runs if not run.finished]
            for run in unfinished:
                run.stream.fail(RequestCut(reason))
            cut += bool(unfinished)
        return cut

    async def _off_loop(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenize_pool, functools.partial(fn, *args, **kwargs)
        )

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._off_loop(self.tokenizer.encode, text, add_special_tokens)

    async def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        return await self._off_loop(self.tokenizer.encode_chat, messages, **kwargs)

    async def decode(self, ids: list[int]) -> str:
        return await self._off_loop(self.tokenizer.decode, ids)

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def check_sequences(self, n: int, num_prompts: int) -> None:
        """One request may fan out to at most max_sequences sequences (n x prompts)."""
        if n * num_prompts <= self.max_sequences:
            return
        param = "n" if n > 1 else "prompt"
        raise bad_request(
            f"{param}: n x prompts = {n} x {num_prompts} = {n * num_prompts} sequences is more "
            f"than the {self.max_sequences} one request may ask for "
            "(--max-sequences-per-request)",
            param,
        )

    def check_model(self, name: str | None) -> str:
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise model_not_found(name)
        return name

    def token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = text
        return text

    # -- endpoints -------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        arrival = (time.monotonic(), time.time())
        req: CompletionRequest = parse_body(CompletionRequest, await request.body())
        model = self.check_model(req.model)
        params = req.sampling_params()
        batch = req.prompts()
        self.check_sequences(params.n, len(batch))
        prompts = [(p, await self.encode(p)) if isinstance(p, str) else (None, p) for p in batch]
        rid = f"cmpl-{random_id()}"
        runs = await self._submit(rid, prompts, params, req, arrival)
        shape = _Shape(rid, int(time.time()), model, params, req.include_usage, chat=False)
        shape.prompt_logprobs = req.prompt_logprobs
        if req.echo:
            shape.echo = [self._echo(text, ids) for text, ids in prompts]
        if req.stream:
            return _sse(self._stream(runs, shape))
        outs = await self._collect(request, runs)
        choices = []
        for run, out in zip(runs, outs, strict=True):
            for c in out.sequences:
                index = run.prompt_index * params.n + c.index
                choice = self._chunk_choice(shape, index, c, c.text, 0, 0, run)
                choices.append(self._echoed(shape, run, out, choice))
        return json_response(
            R.completion_body(rid, shape.created, model, choices, _usage(runs), _kv_transfer(outs))
        )

    async def chat(self, request: Request) -> Response:
        arrival = (time.monotonic(), time.time())
        req: ChatCompletionRequest = parse_body(ChatCompletionRequest, await request.body())
        model = self.check_model(req.model)
        tools = plan_tools(req.tools, req.tool_choice, self.tool_parser)
        params = req.sampling_params(tools)
        self.check_sequences(params.n, 1)
        template_kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            template_kwargs["tools"] = req.tools
        try:
            prompt_ids = await self.encode_chat(
                req.conversation(),
                add_generation_prompt=req.add_generation_prompt,
                **template_kwargs,
            )
        except ValueError as e:
            raise from_value_error(e, req.renames()) from None
        except Exception as e:  # a template that fails on this conversation (jinja2 errors)
            raise bad_request(f"messages: the chat template failed: {e}", "messages") from None
        rid = f"chatcmpl-{random_id()}"
        reasoning = plan_reasoning(
            self.reasoning_parser, tools, params, req.include_reasoning,
            lambda: self.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False),
        )  # fmt: skip
        runs = await self._submit(rid, [(None, prompt_ids)], params, req, arrival)
        shape = _Shape(rid, int(time.time()), model, params, req.include_usage, chat=True)
        shape.tools = tools
        shape.reasoning = reasoning
        if req.stream:
            return _sse(self._stream(runs, shape))
        outs = await self._collect(request, runs)
        choices = []
        shape.prompt_logprobs = req.prompt_logprobs
        for c in outs[0].sequences:
            lp = None
            if params.logprobs is not None:
                lp = R.chat_logprobs(c.token_ids, c.top, params.logprobs, self.token_text)
            thought = None
            if reasoning is not None:
                thought, content, calls = reasoning[c.index].message(c.text)
            else:
                content, calls = tools.parse(c.text) if c.finish_reason else (c.text, [])
            reason = tools.finish_reason(calls, c.finish_reason)
            choices.append(
                R.chat_choice(
                    c.index, content, reason, c.stop_reason, lp, calls,
                    reasoning=reasoning is not None, reasoning_content=thought,
                )
            )  # fmt: skip
        body = R.completion_body(
            rid, shape.created, model, choices, _usage(runs), _kv_transfer(outs), chat=True
        )
        if req.prompt_logprobs is not None:  # vLLM puts a chat's at the top level
            body["prompt_logprobs"] = self._prompt_logprobs(shape, prompt_ids, outs[0])
        return json_response(body)

    # -- submitting and collecting ---------------------------------------------------------------

    async def _submit(
        self,
        rid: str,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        req: CompletionRequest | ChatCompletionRequest,
        arrival: tuple[float, float],
    ) -> list[Run]:
        runs: list[Run] = []
        renames = req.renames()
        try:
            for i, (text, ids) in enumerate(prompts):
                sub_id = rid if len(prompts) == 1 else f"{rid}-{i}"
                stream = await self.client.add_request(
                    sub_id, text, ids, params, req.kv_transfer_params, req.cache_salt
                )
                runs.append(Run(sub_id, rid, i, stream, len(ids), *arrival))
        except ValueError as e:
            self._finish(runs, aborted=True)
            raise from_value_error(e, renames) from None
        except EngineDeadError:
            self._finish(runs, aborted=True)
            raise engine_unavailable("the engine core died") from None
        except BaseException:
            self._finish(runs, aborted=True)
            raise
        self._in_flight[rid] = runs
        if self._cut_reason is not None:  # submitted while the server is being cut off
            for run in runs:
                run.stream.fail(RequestCut(self._cut_reason))
        return runs

    async def _collect(self, request: Request, runs: list[Run]) -> list[RequestState]:
        """Every run's final output; gives up (and aborts) if the client disconnects, and answers
        503 if the engine dies or the shutdown grace period ends first."""
        finals = [asyncio.ensure_future(run.final()) for run in runs]
        gone = asyncio.ensure_future(wait_disconnect(request))
        aborted = True
        try:
            pending = set(finals)
            while pending:
                done, pending = await asyncio.wait(
                    pending | {gone}, return_when=asyncio.FIRST_COMPLETED
                )
                if gone in done:
                    raise ClientGone()
                pending.discard(gone)
                for task in done:
                    try:
                        task.result()
                    except EngineDeadError:
                        raise engine_unavailable("the engine core died") from None
                    except RequestCut as e:
                        raise shutting_down(str(e)) from None
            aborted = False
            return [task.result() for task in finals]
        finally:
            for task in (*finals, gone):
                task.add_done_callback(_retrieve)
                task.cancel()
            self._finish(runs, aborted)

    async def _stream(self, runs: list[Run], shape: _Shape) -> AsyncIterator[bytes]:
        aborted = True
        chunk = self._chunker(shape)
        try:
            if shape.chat:
                role = [
                    R.chat_delta_choice(i, {"role": "assistant", "content": ""}, None, None, None)
                    for i in range(shape.params.n)
                ]
                yield R.sse_event(shape.body(role, None))
            if len(runs) == 1:  # the usual case, without merged()'s helper tasks
                run = runs[0]
                while not run.finished:
                    event = chunk(run, await run.next())
                    if event is not None:
                        yield event
            else:
                async with contextlib.aclosing(merged(runs)) as updates:
                    async for run, state in updates:
                        event = chunk(run, state)
                        if event is not None:
                            yield event
            if shape.include_usage:
                yield R.sse_event(shape.body([], _usage(runs)))
            aborted = False
        except EngineDeadError:
            yield R.sse_event(
                error_body("the engine core died", "service_unavailable_error", None, "503")
            )
        except RequestCut as e:
            yield R.sse_event(shutting_down(str(e)).body())
        finally:
            self._finish(runs, aborted)
        yield R.SSE_DONE

    def _chunker(self, shape: _Shape) -> Callable[[Run, RequestState], bytes | None]:
        """The function that turns a run's live state into the stream's next SSE event: what is
        new in each choice since the last event (None when nothing is)."""
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (chars, tokens) already sent
        done: set[int] = set()
        n = shape.params.n
        plain = R.TextChunks(shape.request_id, shape.created, shape.model, shape.chat)
        text_only = shape.text_only

        def chunk(run: Run, state: RequestState) -> bytes | None:
            choices = []
            for c in state.sequences:
                index = run.prompt_index * n + c.index
                if index in done:
                    continue
                first = index not in sent  # a choice's first chunk carries the echo
                chars, ntok = sent.get(index, (0, 0))
                upto = (
                    c.streamable_len
                    if shape.tools is None or shape.reasoning is not None
                    else shape.tools.streamable(c.streamable_text)
                )
                num_tokens = len(c.token_ids)
                if upto == chars and num_tokens == ntok and c.finish_reason is None:
                    continue
                text = c.text[chars:upto]
                sent[index] = (chars + len(text), num_tokens)
                if c.finish_reason is not None:
                    done.add(index)
                if text_only:
                    choices.append((index, text, c.finish_reason, c.stop_reason))
                    continue
                choice = self._chunk_choice(shape, index, c, text, ntok, chars, run)
                if first:
                    choice = self._echoed(shape, run, state, choice)
                choices.append(choice)
            if not choices:
                return None
            if text_only:
                return plain.event(choices)
            return R.sse_event(shape.body(choices, None))

        return chunk

    def _echo(self, text: str | None, ids: list[int]) -> tuple[str, list[int], int]:
        """What `echo` puts in front of a prompt's choices: its text, its ids, and the length
        of its tokens' text (where the output's text offsets start)."""
        prompt = text if text is not None else self.tokenizer.decode(ids)
        return prompt, ids, sum(len(self.token_text(t)) for t in ids)

    def _prompt_logprobs(self, shape, ids: list[int], out: RequestState) -> list | None:
        """vLLM's `prompt_logprobs` of a prompt, when the request asked for them."""
        k = shape.prompt_logprobs
        if k is None or out.prompt_logprobs is None:
            return None
        return R.prompt_logprobs(
            ids, out.prompt_logprobs, out.prompt_logprob_ranks, k, self.token_text
        )

    def _echoed(self, shape, run: Run, out: RequestState, choice: dict) -> dict:
        """A completion choice (or its first chunk) with the prompt in front, its logprobs too,
        and vLLM's prompt_logprobs when asked for."""
        if shape.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(shape, out.prompt_token_ids, out)
        if shape.echo is None:
            return choice
        prompt, ids, _ = shape.echo[run.prompt_index]
        choice["text"] = prompt + choice["text"]
        if choice["logprobs"] is not None and out.prompt_logprobs is not None:
            k = shape.params.logprobs
            choice["logprobs"] = R.echoed_logprobs(
                ids, out.prompt_logprobs, choice["logprobs"], k, self.token_text
            )
        return choice

    def _chunk_choice(
        self, shape, index: int, c: SequenceText, text: str, ntok: int, chars: int, run: Run
    ) -> dict:
        """One choice of a chunk (or of the whole answer, from ntok = chars = 0): `text` and the
        tokens from `ntok` on, with their logprobs when asked for."""
        k = shape.params.logprobs
        new_ids = c.token_ids[ntok:]
        if shape.chat:
            lp = None
            if k is not None:
                lp = R.chat_logprobs(new_ids, c.top[ntok:], k, self.token_text)
            delta = {"content": text} if text else {}
            reason = c.finish_reason
            if shape.reasoning is not None:
                seen = c.text[: chars + len(text)]
                delta, calls = shape.reasoning[c.index].delta(seen, final=reason is not None)
                if calls:
                    delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
                reason = shape.tools.finish_reason(calls, reason)
            elif shape.tools is not None and shape.tools.mode == "named":
                # The text is the call's arguments: stream them as such.
                first = index not in shape.called
                shape.called.add(index)
                delta = {}
                if text or first:
                    delta["tool_calls"] = [named_call_delta(shape.tools.name, text, first)]
            elif shape.tools is not None and reason is not None:
                # The held-back rest: the calls, and any content the parser gives back.
                content, calls = shape.tools.parse(c.text)
                rest = (content or "") if calls else c.text
                held = rest[chars + len(text) :]
                if held:
                    delta["content"] = text + held
                if calls:
                    delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
                reason = shape.tools.finish_reason(calls, reason)
            return R.chat_delta_choice(index, delta, reason, c.stop_reason, lp)
        lp = None
        if k is not None:
            base = 0 if shape.echo is None else shape.echo[run.prompt_index][2]
            lp = R.completion_logprobs(new_ids, c.top[ntok:], k, self.token_text, base + chars)
        return R.completion_choice(index, text, c.finish_reason, c.stop_reason, lp)

    def _finish(self, runs: list[Run], aborted: bool) -> None:
        """Abort what is unfinished, then record metrics and log one line per run."""
        if runs:
            self._in_flight.pop(runs[0].api_request_id, None)
        for run in runs:
            if not run.finished:
                self.client.abort(run.request_id)
            state = run.state
            reason = "abort"
            if run.finished:
                reason = state.sequences[0].finish_reason or "abort"
            now = time.monotonic()
            ttft = None if run.first_token_at is None else run.first_token_at - run.arrival
            queue = None
            scheduled = state.metrics.first_scheduled_time
            if scheduled is not None:
                queue = scheduled - run.arrival_wall
            num_output_tokens = state.num_output_tokens
            self.metrics.observe_request(reason, ttft, now - run.arrival, num_output_tokens, queue)
            if self.log_requests:
                log.info(
                    "%s: prompt_tokens=%d cached_tokens=%d output_tokens=%d ttft=%s e2e=%.3fs "
                    "finish=%s",
                    run.request_id,
                    run.num_prompt_tokens,
                    state.num_cached_tokens,
                    num_output_tokens,
                    "-" if ttft is None else f"{ttft:.3f}s",
                    now - run.arrival,
                    reason,
                )


def _usage(runs: list[Run]) -> dict:
    prompt = sum(run.num_prompt_tokens for run in runs)
    completion = sum(run.state.num_output_tokens for run in runs)
    cached = sum(run.state.num_cached_tokens for run in runs)
    return R.usage(prompt, completion, cached)


def _kv_transfer(outs) -> dict | None:
    """The kv_transfer_params the engine returned with the (first) finished prompt, if any."""
    return next((o.kv_transfer_params for o in outs if o.kv_transfer_params is not None), None)
