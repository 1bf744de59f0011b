"""The engine loop's grammar worker: a guided request's grammar compiles on its own thread while
the caller goes on (the pipe wakes the loop when it is done), an abort that arrives meanwhile
drops the job, and a grammar that does not compile is the request's error, not the engine's."""

from __future__ import annotations

import select
import threading

import pytest

from atom_runtime.core.sequence import Sequence
from atom_runtime.engine.grammar_compiler import GrammarCompiler
from atom_runtime.protocol.engine_core import EngineRequest
from atom_runtime.sampling_params import SamplingParams

GUARD_S = 60  # deadlock guard


def _job(rid: str) -> tuple[list[EngineRequest], list[Sequence]]:
    params = SamplingParams(max_tokens=2)
    return [EngineRequest(rid, [1, 2, 3], params)], [Sequence(rid, [1, 2, 3], params)]


def _wait_done(compiler: GrammarCompiler) -> list:
    assert select.select([compiler.fileno()], [], [], GUARD_S)[0], "the worker never woke us"
    return compiler.finished()


@pytest.fixture
def gated():
    """A compiler whose compile blocks until `gate` is set (as a big grammar would)."""
    gate = threading.Event()
    calls: list[str] = []

    def compile_one(request: EngineRequest):
        calls.append(request.request_id)
        assert gate.wait(GUARD_S)
        if request.request_id.startswith("bad"):
            raise ValueError("guided_regex: unbalanced parenthesis")
        return f"matcher-{request.request_id}"

    compiler = GrammarCompiler(compile_one)
    yield compiler, gate, calls
    gate.set()
    compiler.close()


def test_the_caller_goes_on_while_a_grammar_compiles(gated):
    compiler, gate, _ = gated
    compiler.submit(7, *_job("a"))  # returns at once although the compile is blocked
    assert compiler.request_ids() == {"a"}
    assert compiler.finished() == []
    gate.set()
    (job,) = _wait_done(compiler)
    assert (job.call_id, job.matchers, job.error) == (7, ["matcher-a"], None)
    assert compiler.request_ids() == set()


def test_an_abort_while_compiling_drops_the_job(gated):
    compiler, gate, calls = gated
    compiler.submit(1, *_job("gone"))
    compiler.submit(2, *_job("kept"))
    compiler.abort({"gone"})
    gate.set()
    done = []
    while len(done) < 1 or compiler.request_ids():
        done += _wait_done(compiler)
    assert [job.call_id for job in done] == [2]
    assert calls == ["gone", "kept"]  # compiled in arrival order, one at a time


def test_a_grammar_that_does_not_compile_is_the_requests_error(gated):
    compiler, gate, _ = gated
    gate.set()
    compiler.submit(3, *_job("bad-1"))
    (job,) = _wait_done(compiler)
    assert job.error == "guided_regex: unbalanced parenthesis" and job.matchers == []
