"""`atom router`: KV-cache-aware routing and prefill/decode orchestration over `atom serve` pods.

backends.py (who is there, healthy, loaded, caching what), discovery.py (static URLs,
EndpointSlices, DNS), app.py (the proxy), metrics.py, cli.py. See docs/router.md.
"""
