"""The periodic stats line (server/stats_log.py): rates over the interval, silent when idle."""

from __future__ import annotations

from atom_runtime.protocol.engine_core import EngineStats
from atom_runtime.server.stats_log import stats_line


def _stats(**kw) -> EngineStats:
    base = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_blocks=100, block_size=16,
                prefix_queries=0, prefix_hits=0, num_preemptions=0, prompt_tokens=0,
                generation_tokens=0)  # fmt: skip
    return EngineStats(**{**base, **kw})


def test_stats_line_gives_rates_over_the_interval():
    before = _stats(prompt_tokens=100, generation_tokens=50, prefix_queries=100, prefix_hits=0)
    now = _stats(prompt_tokens=300, generation_tokens=150, prefix_queries=300, prefix_hits=50,
                 num_running=3, num_waiting=1, kv_cache_usage=0.25)  # fmt: skip
    assert stats_line(before, now, 10.0) == (
        "engine: prompt 20.0 tokens/s, generation 10.0 tokens/s; 3 running, 1 waiting; "
        "KV cache 25.0% used; prefix cache hit rate 25.0%"
    )


def test_stats_line_is_silent_when_idle():
    idle = _stats(prompt_tokens=10, generation_tokens=10)
    assert stats_line(idle, idle, 10.0) is None
