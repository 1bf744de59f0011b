"""Response bodies of the OpenAI API, built as plain dicts by pure functions.

This is a JSON edge: token ids and logprobs may arrive as `array("i")`/`array("f")` (they grow
once per token inside the engine) and leave as lists. `encode` refuses anything else that JSON
cannot hold (msgspec raises TypeError on an `array`), so a missed conversion fails loudly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import msgspec

TokenText = Callable[[int], str]  # token id -> its text, for logprobs

_json = msgspec.json.Encoder()


def encode(body: dict) -> bytes:
    return _json.encode(body)


def sse_event(body: dict) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class TextChunks:
    """The SSE events of one streamed response whose choices carry text only (no logprobs, echo
    or tool calls), the usual case: byte templates built once per response, so an event costs a
    string escape instead of two dicts and an encode. Byte for byte what `sse_event` makes of
    `completion_body(..., chunk=True)` around `completion_choice` / `chat_delta_choice`."""

    def __init__(self, request_id: str, created: int, model: str, chat: bool) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = b"data: " + _json.encode(
            {"id": request_id, "object": obj, "created": created, "model": model}
        )[:-1] + b',"choices":['  # fmt: skip
        self._text = b',"delta":{"content":' if chat else b',"text":'
        self._close = b"}" if chat else b""
        self._empty = b',"delta":{}' if chat else b',"text":""'
        self._tail = b'],"usage":null}\n\n'

    def event(self, choices: list[tuple[int, str, str | None, int | str | None]]) -> bytes:
        """One event of (index, text, finish_reason, stop_reason) choices."""
        parts = []
        for index, text, finish_reason, stop_reason in choices:
            body = self._text + _json.encode(text) + self._close if text else self._empty
            if finish_reason is None and stop_reason is None:
                end = b',"logprobs":null,"finish_reason":null,"stop_reason":null}'
            else:
                end = (
                    b',"logprobs":null,"finish_reason":' + _json.encode(finish_reason)
                    + b',"stop_reason":' + _json.encode(stop_reason) + b"}"
                )  # fmt: skip
            parts.append(b'{"index":%d%s%s' % (index, body, end))
        return self._head + b",".join(parts) + self._tail


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of one position (the entry also holds the sampled token)."""
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, float]],
    k: int,
    token_text: TokenText,
    text_offset: int,
) -> dict:
    """/v1/completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for token, entry in zip(token_ids, logprobs, strict=True):
        text = token_text(token)
        tokens.append(text)
        token_lps.append(float(entry[token]))
        tops.append({token_text(t): float(lp) for t, lp in _top(entry, k)} if k else None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def echoed_logprobs(
    prompt_ids: Sequence[int],
    prompt_logprobs: Sequence[dict[int, float] | None],
    output: dict,
    k: int,
    token_text: TokenText,
) -> dict:
    """/v1/completions `logprobs` with `echo`: the prompt's tokens first (the first has no
    logprob), then the output's (`output`, whose text offsets already count the prompt)."""
    tokens = [token_text(t) for t in prompt_ids]
    offsets = [0, *itertools.accumulate(len(t) for t in tokens[:-1])]
    token_lps = [None] + [
        float(e[t]) for t, e in zip(prompt_ids[1:], prompt_logprobs[1:], strict=True)
    ]
    tops = [None] + [
        {token_text(t): float(lp) for t, lp in _top(e, k)} if k else None
        for e in prompt_logprobs[1:]
    ]
    return {
        "tokens": tokens + output["tokens"],
        "token_logprobs": token_lps + output["token_logprobs"],
        "top_logprobs": tops + output["top_logprobs"],
        "text_offset": offsets + output["text_offset"],
    }


def prompt_logprobs(
    prompt_ids: Sequence[int],
    entries: Sequence[dict[int, float] | None],
    ranks: Sequence[int | None],
    k: int,
    token_text: TokenText,
) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), {token id: {logprob,
    rank, decoded_token}} for the prompt's own token and the k most likely there."""
    out: list[dict | None] = [None]
    for token, entry, rank in zip(prompt_ids[1:], entries[1:], ranks[1:], strict=True):
        item = {
            str(t): {"logprob": float(lp), "rank": i + 1, "decoded_token": token_text(t)}
            for i, (t, lp) in enumerate(_top(entry, k))
        }
        item[str(token)] = {
            "logprob": float(entry[token]),
            "rank": rank,
            "decoded_token": token_text(token),
        }
        out.append(item)
    return out


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[dict[int, float]], k: int, token_text: TokenText
) -> dict:
    """/v1/chat/completions `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for token, entry in zip(token_ids, logprobs, strict=True):
        text = token_text(token)
        content.append(
            {
                "token": text,
                "logprob": float(entry[token]),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": (t := token_text(tid)),
                        "logprob": float(lp),
                        "bytes": list(t.encode()),
                    }
                    for tid, lp in _top(entry, k)
                ],
            }
        )
    return {"content": content}


def _choice(index: int, key: str, body, logprobs, finish_reason, stop_reason) -> dict:
    """One choice of a response or a stream chunk: `key` ("text", "message" or "delta") holds
    what it carries; OpenAI's field order."""
    return {
        "index": index,
        key: body,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def completion_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    stop_reason: int | str | None,
    logprobs: dict | None,
) -> dict:
    return _choice(index, "text", text, logprobs, finish_reason, stop_reason)


def chat_choice(
    index: int,
    content: str | None,
    finish_reason: str | None,
    stop_reason: int | str | None,
    logprobs: dict | None,
    tool_calls: list[dict] | None = None,
    *,
    reasoning: bool = False,
    reasoning_content: str | None = None,
) -> dict:
    """`reasoning`: the server runs a reasoning parser, so the message carries
    `reasoning_content` (null when the choice had none)."""
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning_content
    if tool_calls:
        message["tool_calls"] = tool_calls
    return _choice(index, "message", message, logprobs, finish_reason, stop_reason)


def chat_delta_choice(
    index: int,
    delta: dict,
    finish_reason: str | None,
    stop_reason: int | str | None,
    logprobs: dict | None,
) -> dict:
    return _choice(index, "delta", delta, logprobs, finish_reason, stop_reason)


def completion_body(
    request_id: str,
    created: int,
    model: str,
    choices: list[dict],
    usage_: dict | None,
    kv_transfer_params: dict | None = None,
    *,
    chunk: bool = False,
    chat: bool = False,
) -> dict:
    """The envelope of a completion (or chat completion, or one streamed chunk of either)."""
    if chat:
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    body = {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def model_list(names: Sequence[str], created: int, root: str, max_model_len: int) -> dict:
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "atom",
                "root": root,
                "max_model_len": max_model_len,
            }
            for name in names
        ],
    }
