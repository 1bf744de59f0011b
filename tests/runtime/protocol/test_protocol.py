"""The wire protocol between the engine's processes (runtime/atom_runtime/protocol/): a step's inputs cross to
a tensor-parallel worker as the very `StepInputs` the runner built (numpy arrays by dtype, shape
and bytes), each channel's union decodes exactly its own messages, and anything that is not a
protocol type is refused instead of pickled."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from atom_runtime.protocol.codec import decoder, encoder
from atom_runtime.protocol.engine_core import ClientMessage, EngineMessage, check_token_ids
from atom_runtime.protocol.worker import (
    FromWorker,
    StepInputs,
    ToWorker,
    WorkerCall,
    WorkerFailed,
    WorkerHello,
    WorkerReady,
    WorkerResult,
)


def _step(**kw) -> StepInputs:
    fields = dict(
        input_ids=np.array([5, 9, 2], dtype=np.int64),
        positions=np.array([0, 1, 7], dtype=np.int64),
        slot_mapping=np.array([16, 17, 39], dtype=np.int64),
        block_tables=np.array([[1, 0], [2, 4]], dtype=np.int32),
        seq_lens=np.array([2, 8], dtype=np.int32),
        cu_seqlens_q=np.array([0, 2, 3], dtype=np.int32),
        max_seqlen_q=2,
        sample_rows=np.array([1, 2], dtype=np.int64),
    )
    fields.update(kw)
    return StepInputs(**fields)


def _same(a: StepInputs, b: StepInputs) -> None:
    for name in StepInputs.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape, name
            assert np.array_equal(x, y), name
        else:
            assert x == y, name


@pytest.mark.parametrize("pending", [None, np.array([[2], [0]], dtype=np.int64)])
def test_step_inputs_cross_to_a_worker_unchanged_and_writable(pending):
    step = _step(pending_sources=pending)
    got = decoder(ToWorker).decode(encoder().encode(step))
    assert isinstance(got, StepInputs)
    _same(got, step)
    assert got.pending_sources is None if pending is None else got.pending_sources is not None
    assert all(getattr(got, n).flags.writeable for n in ("input_ids", "block_tables"))
    assert not got.decode_only and _step(max_seqlen_q=1).decode_only


def test_a_strided_array_goes_as_its_values():
    table = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]  # not contiguous
    got = decoder(ToWorker).decode(encoder().encode(_step(block_tables=table)))
    assert np.array_equal(got.block_tables, table) and got.block_tables.shape == (3, 2)


def test_each_channel_decodes_its_own_messages_only():
    to_worker = decoder(ToWorker)
    from_worker = decoder(FromWorker)
    call = WorkerCall(3, "parameter_bytes")
    assert to_worker.decode(encoder().encode(call)) == call
    for msg in (WorkerHello(1, 42), WorkerReady(1, 640), WorkerResult(3, 1, [1, 2]),
                WorkerFailed(1, "boom")):  # fmt: skip
        assert from_worker.decode(encoder().encode(msg)) == msg
    with pytest.raises(Exception, match="Invalid value 'ready'"):
        to_worker.decode(encoder().encode(WorkerReady(1, 640)))
    # The engine's ready message is its own type, not the worker's, whatever the shared tag.
    with pytest.raises(Exception, match="Expected"):
        decoder(EngineMessage).decode(encoder().encode(WorkerReady(1, 640)))
    with pytest.raises(Exception, match="Invalid value 'step'"):
        decoder(ClientMessage).decode(encoder().encode(_step()))


def test_anything_else_is_refused_not_pickled():
    class Opaque:
        pass

    with pytest.raises(NotImplementedError, match="cannot put a Opaque on the wire"):
        encoder().encode(WorkerResult(1, 1, Opaque()))


@pytest.mark.parametrize("ids", [[3, 7, 10, 4, -2], [0, 9, 10], [-1, 5, 100]])
def test_check_token_ids_names_the_first_bad_id_for_lists_and_arrays(ids):
    """The array fast path (one numpy pass) and the id-by-id walk over a list raise the same
    error, naming the first id outside [0, vocab)."""
    first_bad = next(t for t in ids if not 0 <= t < 10)
    for form in (ids, array("i", ids)):
        with pytest.raises(ValueError, match=rf"^prompt: token id {first_bad} is outside"):
            check_token_ids("prompt", form, 10)


def test_check_token_ids_accepts_ids_in_range():
    for form in ([0, 9, 3], array("i", [0, 9, 3]), array("i")):
        check_token_ids("prompt", form, 10)
