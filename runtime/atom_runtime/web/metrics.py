"""Prometheus plumbing shared by `atom serve` and `atom router` (contract 8): a registry of
their own, and its rendering in a worker thread so a scrape never blocks the event loop."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def metrics_registry(*collectors: Collector) -> CollectorRegistry:
    """A registry holding `collectors`, without the `*_created` series (they double the scrape
    for nothing a rate() needs; prometheus-client's switch is process-global)."""
    disable_created_metrics()
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return registry


async def render(registry: CollectorRegistry) -> bytes:
    """The registry in the text exposition format (CONTENT_TYPE), rendered off the event loop."""
    return await asyncio.to_thread(generate_latest, registry)
