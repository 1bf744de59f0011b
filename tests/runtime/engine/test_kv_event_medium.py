"""KV events name where the blocks are: a CPU engine's say "CPU" (vLLM's medium), not "GPU"."""

from __future__ import annotations

from atom_runtime import LLM, SamplingParams
from atom_runtime.core.block_pool import BlockPool


class _Recorder:
    published_total = dropped_total = 0

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, events) -> None:
        self.events += events

    def raise_if_failed(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_a_cpu_engine_publishes_medium_cpu(tiny_models):
    llm = LLM(
        str(tiny_models["llama"]),
        device="cpu",
        dtype="float32",
        num_gpu_blocks_override=64,
        kv_events_config='{"enable_kv_cache_events": true, "publisher": "null"}',
    )
    try:
        recorder = llm.engine.publisher = _Recorder()
        prompt = {"prompt_token_ids": list(range(10, 50))}  # more than two 16-token blocks
        llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        assert llm.engine.pool.medium == "CPU"
        stored = [e for e in recorder.events if type(e).__name__ == "BlockStored"]
        assert stored and {e.medium for e in stored} == {"CPU"}
    finally:
        llm.shutdown()


def test_block_pool_events_carry_its_medium():
    pool = BlockPool(4, 16, enable_events=True, medium="CPU")
    pool._emit_stored([123], None, list(range(16)))
    (event,) = pool.drain_events()
    assert event.medium == "CPU"
    assert BlockPool(4, 16).medium == "GPU"  # the default, as vLLM's
