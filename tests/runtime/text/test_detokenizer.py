"""Incremental detokenization: never a split multi-byte character, stop strings found across token
boundaries and never streamed in part."""

from __future__ import annotations

import pytest

from atom_runtime.engine.output_processor import OutputProcessor, SequenceText
from atom_runtime.models.loader import default_model_path
from atom_runtime.protocol.engine_core import StepOutputs
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def _feed(tok, text, params):
    seq = SequenceText(0, params, tok)
    shown = []
    ids = tok.encode(text)
    for t in ids:
        stopped = seq.append_token(t)
        shown.append(seq.streamable_text)
        if stopped:
            break
    return seq, shown, ids


def test_emoji_split_across_tokens_is_never_emitted_half_done(tok):
    text = "ok 😀👍🏽 é漢字 done"
    seq, shown, ids = _feed(tok, text, SamplingParams())
    assert len(ids) > len(text.split())  # the emoji really are several tokens
    assert all("\ufffd" not in s for s in shown)
    assert seq.text == text


def test_stop_string_spanning_tokens_truncates_and_is_never_streamed(tok):
    text = "alpha beta gamma delta"
    stop = "ta gam"  # spans the tokens of "beta" and "gamma"
    seq, shown, _ = _feed(tok, text, SamplingParams(stop=[stop]))
    assert seq.finish_reason == "stop" and seq.stop_reason == stop
    assert seq.text == "alpha be"
    # Text that could begin the stop string is held back: nothing past "alpha be" ever shows.
    assert all("alpha be".startswith(s) for s in shown)
    assert shown[-1] == "alpha be"


def test_include_stop_str_in_output(tok):
    seq, _, _ = _feed(
        tok, "one two three four", SamplingParams(stop=["three"], include_stop_str_in_output=True)
    )
    assert seq.text == "one two three"


def test_processor_reports_stop_string_request_for_abort(tok):
    proc = OutputProcessor(tok)
    [req] = proc.add_request("r1", None, [1, 2], SamplingParams(stop=["cd"], max_tokens=50))
    results, to_abort = [], []
    for t in tok.encode("ab cd ef"):
        outs, ab = proc.process(StepOutputs([req.request_id], [t]))
        results += outs
        to_abort += ab
    assert to_abort == ["r1"]
    assert results[-1].finished and results[-1].output().outputs[0].text == "ab "
    assert "r1" not in proc.requests


def test_n_fans_out_with_distinct_seeds(tok):
    proc = OutputProcessor(tok)
    reqs = proc.add_request("p", None, [5], SamplingParams(n=3, seed=10))
    assert [r.request_id for r in reqs] == ["p#0", "p#1", "p#2"]
    assert [r.sampling_params.seed for r in reqs] == [10, 11, 12]
    assert all(r.sampling_params.n == 1 for r in reqs)
