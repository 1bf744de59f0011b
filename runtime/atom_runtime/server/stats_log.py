"""The periodic stats line of `atom serve` (vLLM's "Avg prompt throughput ..."): every STATS_LOG_S
while the engine has work or did some since the last line, from the EngineStats the engine core
pushes; silent when idle. `--disable-log-stats` turns it off."""

from __future__ import annotations

import asyncio
import logging
import time

from atom_runtime.protocol.engine_core import EngineStats

log = logging.getLogger("atom_runtime.server.stats")

STATS_LOG_S = 10.0


def stats_line(before: EngineStats, now: EngineStats, seconds: float) -> str | None:
    """The line for the interval between two stats snapshots `seconds` apart, or None when
    the engine was idle throughout."""
    prompt = now.prompt_tokens - before.prompt_tokens
    generated = now.generation_tokens - before.generation_tokens
    if not (prompt or generated or now.num_running or now.num_waiting):
        return None
    queries = now.prefix_queries - before.prefix_queries
    hits = now.prefix_hits - before.prefix_hits
    hit_rate = f"{100 * hits / queries:.1f}%" if queries else "-"
    return (
        f"engine: prompt {prompt / seconds:.1f} tokens/s, generation {generated / seconds:.1f} "
        f"tokens/s; {now.num_running} running, {now.num_waiting} waiting; KV cache "
        f"{100 * now.kv_cache_usage:.1f}% used; prefix cache hit rate {hit_rate}"
    )


async def log_stats_while_busy(client, interval: float = STATS_LOG_S) -> None:
    """Log `stats_line` every `interval` seconds (until cancelled)."""
    before, then = client.stats, time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now, at = client.stats, time.monotonic()
        if before is not None and now is not None:
            line = stats_line(before, now, at - then)
            if line is not None:
                log.info("%s", line)
        before, then = now, at
