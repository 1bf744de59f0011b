"""The output path without a server: a step's columns reach each request as its own tokens,
logprobs and finish after the msgpack round trip; the byte templates of text-only chunks are
exactly the dict-built events; a request's stream hands out its live state once per change (a
slow reader gets several steps at once); merging several runs hands out every run's finish; the
server runs on uvloop when it is installed."""

from __future__ import annotations

import asyncio

import pytest

from atom_runtime.engine.core_client import RequestStream
from atom_runtime.engine.output_processor import OutputProcessor
from atom_runtime.protocol.engine_core import RequestUpdate, StepOutputs
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.server import responses as R
from atom_runtime.server.in_flight import Run, merged

TEXTS = ["", "plain", ' quote " and \\ backslash', "tab\tnewline\n\x01", "é漢字😀", "\u2028"]


def _dict_event(rid, created, model, chat, choices) -> bytes:
    built = []
    for index, text, reason, stop in choices:
        if chat:
            delta = {"content": text} if text else {}
            built.append(R.chat_delta_choice(index, delta, reason, stop, None))
        else:
            built.append(R.completion_choice(index, text, reason, stop, None))
    return R.sse_event(R.completion_body(rid, created, model, built, None, chunk=True, chat=chat))


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    "finish", [(None, None), ("length", None), ("stop", "END\n"), ("stop", 151645)]
)
def test_text_chunks_are_byte_for_byte_the_dict_events(chat, finish):
    rid, created, model = 'cmpl-"x"', 1700000000, "org/model ü"
    chunks = R.TextChunks(rid, created, model, chat)
    for text in TEXTS:
        one = [(0, text, *finish)]
        assert chunks.event(one) == _dict_event(rid, created, model, chat, one)
    several = [(i, t, *finish) for i, t in enumerate(TEXTS)]
    assert chunks.event(several) == _dict_event(rid, created, model, chat, several)


def _run(proc: OutputProcessor, rid: str, index: int, n: int = 1) -> Run:
    proc.add_request(rid, None, [1, 2, 3], SamplingParams(max_tokens=8, n=n))
    return Run(rid, "api", index, RequestStream(proc.requests[rid]), 3, 0.0, 0.0)


def _feed(proc: OutputProcessor, runs: dict[str, Run], rows, finished=()) -> None:
    """What the engine client's reader does with one message: (request id, token) rows, then
    the finish (length) of the requests in `finished`."""
    updates = [RequestUpdate(rid, finish_reason="length") for rid in finished]
    updated, _ = proc.process(
        StepOutputs([r for r, _ in rows], [t for _, t in rows], updates=updates)
    )
    for state in updated:
        runs[state.request_id].stream.put()


def test_a_slow_reader_gets_every_step_since_it_last_looked_at_once():
    async def go():
        proc = OutputProcessor(None)
        run = _run(proc, "r", 0)
        for token in (5, 6, 7):
            _feed(proc, {"r": run}, [("r", token)])
        state = await run.next()
        assert list(state.sequences[0].token_ids) == [5, 6, 7] and not run.finished
        waiting = asyncio.ensure_future(run.next())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing new: the reader waits
        _feed(proc, {"r": run}, [("r", 8)], finished=["r"])
        state = await waiting
        assert list(state.sequences[0].token_ids) == [5, 6, 7, 8] and run.finished

    asyncio.run(go())


def test_merging_runs_hands_out_each_runs_finish_even_when_both_end_in_one_step():
    async def go():
        proc = OutputProcessor(None)
        runs = {"p-0": _run(proc, "p-0", 0), "p-1": _run(proc, "p-1", 1)}
        seen: list[tuple[int, list[int], bool]] = []

        async def read():
            async for run, state in merged(list(runs.values())):
                c = state.sequences[0]
                seen.append((run.prompt_index, list(c.token_ids), c.finish_reason is not None))

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0)
        _feed(proc, runs, [("p-0", 1), ("p-1", 2)])
        for _ in range(10):  # until the reader has taken both unfinished states
            await asyncio.sleep(0)
        assert sorted(seen) == [(0, [1], False), (1, [2], False)]
        _feed(proc, runs, [("p-0", 3), ("p-1", 4)], finished=["p-0", "p-1"])
        await asyncio.wait_for(reader, 10)
        for index, final in ((0, [1, 3]), (1, [2, 4])):
            assert (index, final, True) in seen

    asyncio.run(go())


def test_the_server_runs_on_uvloop_when_it_is_installed():
    from atom_runtime.server.api_server import run_event_loop

    uvloop = pytest.importorskip("uvloop")

    async def loop_type():
        return type(asyncio.get_running_loop())

    assert run_event_loop(loop_type()) is uvloop.Loop


def test_a_steps_columns_reach_each_request_as_its_own_tokens_logprobs_and_finish():
    """One message for the whole step: after the msgpack round trip each request gets its own
    tokens in order, its logprobs (only the request that asked for them keeps any), its
    once-only facts and its finish, exactly as the engine sampled them."""
    from atom_runtime.protocol.codec import decoder, encoder
    from atom_runtime.protocol.engine_core import EngineMessage, EngineStats, Outputs

    proc = OutputProcessor(None)
    proc.add_request("a", None, [1, 2, 3], SamplingParams(max_tokens=8, logprobs=1))
    proc.add_request("b", None, [4], SamplingParams(max_tokens=8))
    step = StepOutputs(
        request_ids=["a", "b", "a"],
        token_ids=[10, 20, 11],
        logprobs=[-0.5, -0.25, -1.5],
        top_ids=[[12], [], [13]],
        top_logprobs=[[-0.75], [], [-2.0]],
        updates=[
            RequestUpdate("a", num_prompt_tokens=3, num_cached_tokens=2, first_token_time=5.0),
            RequestUpdate("b", finish_reason="stop", stop_reason=20, kv_transfer_params={"x": 1}),
        ],
    )
    stats = EngineStats(1, 0, 0.5, 64, 16, 10, 4, 0, 10, 3)
    wire = decoder(EngineMessage).decode(encoder().encode(Outputs(step, stats)))
    assert wire.outputs == step
    updated, to_abort = proc.process(wire.outputs)
    assert to_abort == [] and [s.request_id for s in updated] == ["a", "b"]
    a, b = (s.output() for s in updated)
    assert a.outputs[0].token_ids == [10, 11] and not a.finished
    assert a.outputs[0].logprobs == [{10: -0.5, 12: -0.75}, {11: -1.5, 13: -2.0}]
    assert (a.num_cached_tokens, a.metrics.first_token_time) == (2, 5.0)
    assert b.outputs[0].token_ids == [20] and b.outputs[0].logprobs is None
    assert (b.finished, b.outputs[0].finish_reason, b.outputs[0].stop_reason) == (True, "stop", 20)
    assert b.kv_transfer_params == {"x": 1} and "b" not in proc.requests


def test_a_non_streamed_reader_wakes_for_its_first_token_and_its_finish_only():
    async def go():
        proc = OutputProcessor(None)
        run = _run(proc, "r", 0)
        wakes = []
        get = run.stream.get

        async def counted():
            state = await get()
            wakes.append(list(state.sequences[0].token_ids))
            return state

        run.stream.get = counted
        final = asyncio.ensure_future(run.final())
        await asyncio.sleep(0)
        for token in (5, 6, 7):
            _feed(proc, {"r": run}, [("r", token)])
            for _ in range(3):
                await asyncio.sleep(0)
        _feed(proc, {"r": run}, [("r", 8)], finished=["r"])
        state = await asyncio.wait_for(final, 10)
        assert wakes == [[5], [5, 6, 7, 8]]  # the first token (TTFT), then the finish
        assert state.finished and run.first_token_at is not None

    asyncio.run(go())
