"""Prefill/decode between real engines (pd_engines.py): a producer `atom serve` process and a
consumer `LLM`, each at its own tensor-parallel size (gloo ranks on CPU), over the portable TCP
connector or NIXL (DRAM to DRAM through UCX, for real). Pins: the decode engine's greedy tokens
equal the aggregated engine's, and they come from a pull (one pull, no fallback, exactly the
bytes of the prompt's resumable blocks at the decode engine's shard), for heterogeneous tensor
parallelism (2 -> 1, 1 -> 2, a replicated KV head) and for a hybrid model, whose recurrent and
conv state travel as a state checkpoint with the KV blocks. Every engine, worker and process is
stopped by its test."""

from __future__ import annotations

import pytest

from atom_runtime import LLM
from atom_runtime.kv_transfer.nixl_lib import load_nixl
from atom_runtime.kv_transfer.state_handoff import resume_blocks
from tests.hf_reference import atom_greedy
from tests.model_factory import make_tiny_model
from tests.runtime.kv_transfer.pd_engines import (
    KEY_HEX,
    engine,
    producer_process,
    remote_decode,
    remote_prefill,
)
from tests.server.conftest import Launcher

PORTABLE, NIXL = "AtomPortableConnector", "NixlConnector"


def _nixl_absent() -> str:
    try:
        load_nixl()
    except ImportError as e:
        return str(e)
    return ""


# ./install.sh --test installs NIXL on Linux x86_64 (CI runs these); elsewhere they skip.
NIXL_ABSENT = _nixl_absent()
needs_nixl = pytest.mark.skipif(bool(NIXL_ABSENT), reason=f"NIXL absent: {NIXL_ABSENT}")


def _case(connector: str, *rest):
    return pytest.param(connector, *rest, marks=[needs_nixl] if connector == NIXL else [])


PROMPT = [(i * 37) % 200 + 3 for i in range(70)]  # 4 full blocks of 16 + 6 tokens
MAX_TOKENS = 6


@pytest.fixture(autouse=True)
def transfer_key(monkeypatch):
    monkeypatch.setenv("ATOM_TRANSFER_KEY", KEY_HEX)
    monkeypatch.delenv("ATOM_TRANSFER_KEY_FILE", raising=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """qwen3 (2 KV heads: split over 2 ranks), llama3 (1 KV head: replicated on 2 ranks),
    qwen3_5 (a hybrid: Gated DeltaNet + attention), built once."""
    root = tmp_path_factory.mktemp("pd_models")
    built = {kind: make_tiny_model(root / kind, kind) for kind in ("qwen3", "llama3")}
    # With an MTP head (unused unless speculating).
    built["qwen3_5"] = make_tiny_model(root / "qwen3_5", "qwen3_5", mtp_layers=1)
    return built


@pytest.fixture(scope="module")
def aggregated(models):
    """Each model's greedy tokens for PROMPT from one aggregated engine (computed once)."""
    out = {}
    for kind, folder in models.items():
        llm = LLM(str(folder), dtype="float32", device="cpu", num_gpu_blocks_override=128)
        try:
            out[kind] = atom_greedy(llm, [PROMPT], MAX_TOKENS)[0]
        finally:
            llm.shutdown()
    return out


def _pd(tmp_path, folder, connector: str, prefill_tp: int, decode_tp: int):
    """PROMPT through a producer process and a consumer engine: (decode tokens, the consumer's
    transfer stats, the producer's reply, the consumer's checkpoint counters or None)."""
    launcher = Launcher(tmp_path)
    try:
        server = producer_process(launcher, folder, connector, prefill_tp)
        consumer = engine(folder, connector, "kv_consumer", decode_tp)
        try:
            reply = remote_prefill(server, folder, PROMPT)
            tokens, _ = remote_decode(consumer, reply, PROMPT, MAX_TOKENS)
            checkpoints = consumer.engine.checkpoints
            counters = checkpoints.counters if checkpoints is not None else None
            return tokens, consumer.engine.kv_transfer.snapshot(), reply, counters
        finally:
            consumer.shutdown()
    finally:
        launcher.close()


def _block_bytes(llm_kind: str, decode_tp: int) -> int:
    """One block's KV bytes on one decode rank: layers x (K, V) x 16 tokens x heads x dim x 4."""
    layers, heads, dim = {"qwen3": (2, 2, 32), "llama3": (2, 1, 16)}[llm_kind]
    return layers * 2 * 16 * max(1, heads // decode_tp) * dim * 4


@pytest.mark.parametrize(
    ("connector", "prefill_tp", "decode_tp", "kind"),
    [
        _case(PORTABLE, 2, 1, "qwen3"),
        _case(PORTABLE, 1, 2, "qwen3"),
        _case(NIXL, 1, 1, "qwen3"),
        _case(NIXL, 2, 1, "qwen3"),
        _case(NIXL, 1, 2, "qwen3"),
        _case(NIXL, 1, 2, "llama3"),
    ],
)
def test_disaggregated_answers_equal_aggregated_at_any_tp_pair(
    tmp_path, models, aggregated, no_leftover_tp_workers, connector, prefill_tp, decode_tp, kind
):
    tokens, stats, reply, _ = _pd(tmp_path, models[kind], connector, prefill_tp, decode_tp)
    assert tokens == aggregated[kind]
    assert reply["tp_size"] == prefill_tp
    n = resume_blocks(len(PROMPT), 16)
    assert (stats.pulls_ok, stats.fallbacks, stats.blocks_received) == (1, 0, n)
    # Every decode rank pulled its own shard: rank 0's bytes are counted per rank.
    assert stats.bytes_received == n * _block_bytes(kind, decode_tp) * decode_tp


@pytest.mark.parametrize(
    ("connector", "tp"),
    [_case(PORTABLE, 1), _case(NIXL, 1), _case(NIXL, 2)],
    ids=["tcp", "nixl", "nixl-tp2"],
)
def test_a_hybrid_models_state_travels_with_its_kv(
    tmp_path, models, aggregated, no_leftover_tp_workers, connector, tp
):
    """Each rank's image is its own shard of the state: at TP 2 both ranks pull theirs."""
    tokens, stats, reply, counters = _pd(tmp_path, models["qwen3_5"], connector, tp, tp)
    assert tokens == aggregated["qwen3_5"]
    n = resume_blocks(len(PROMPT), 16)
    assert reply["remote_state_tokens"] == n * 16 and reply["remote_state_block_ids"]
    assert (stats.pulls_ok, stats.fallbacks, stats.blocks_received) == (1, 0, n)
    # The consumer resumed from the received checkpoint (stored once, restored once) instead of
    # recomputing the prompt's state.
    assert counters.stored >= 1 and counters.restored >= 1


@needs_nixl
def test_a_hybrid_transfer_across_tp_sizes_falls_back_to_the_same_answer(
    tmp_path, models, aggregated, no_leftover_tp_workers
):
    """A state image is one rank's shard: prefill TP 2 -> decode TP 1 cannot use it, so the
    decode engine prefills locally (counted) and answers the same."""
    tokens, stats, reply, _ = _pd(tmp_path, models["qwen3_5"], NIXL, 2, 1)
    assert tokens == aggregated["qwen3_5"]
    assert reply["tp_size"] == 2 and reply["remote_state_block_ids"]
    assert (stats.pulls_ok, stats.fallbacks, stats.bytes_received) == (0, 1, 0)


@pytest.mark.parametrize(
    ("kind", "method"),
    [("qwen3", "ngram"), ("qwen3", "draft_model"), ("qwen3_5", "mtp")],
)
def test_a_speculating_decode_engine_resumes_from_the_pulled_kv(
    tmp_path, models, aggregated, no_leftover_tp_workers, kind, method
):
    """P/D with speculation on the decode engine (the operator renders spec.engine.speculative
    into the decode role): its greedy tokens are the aggregated engine's. The pulled blocks hold
    the target's KV alone, so a draft model first catches up over the pulled prompt: with the
    target as its own draft, its drafts are then accepted (without that catch-up, none were)."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "draft_model":
        spec["model"] = str(models[kind])
    launcher = Launcher(tmp_path)
    try:
        server = producer_process(launcher, models[kind], PORTABLE, 1)
        consumer = engine(models[kind], PORTABLE, "kv_consumer", 1, speculative_config=spec)
        try:
            reply = remote_prefill(server, models[kind], PROMPT)
            tokens, _ = remote_decode(consumer, reply, PROMPT, MAX_TOKENS)
            stats = consumer.engine.kv_transfer.snapshot()
            spec_stats = consumer.engine.scheduler.spec_stats
        finally:
            consumer.shutdown()
    finally:
        launcher.close()
    assert tokens == aggregated[kind]
    assert (stats.pulls_ok, stats.fallbacks) == (1, 0)
    if method == "draft_model":
        drafted, accepted = spec_stats.num_draft_tokens, spec_stats.num_accepted_tokens
        assert drafted > 0 and accepted * 2 > drafted, spec_stats
