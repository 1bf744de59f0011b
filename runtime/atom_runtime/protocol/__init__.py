"""The wire protocol: every message that crosses a process boundary inside one engine, and the
block hash the KV events and the router share. No torch here (an import-linter contract).

Two channels, each a pair of ZMQ sockets carrying msgspec msgpack (never pickle):

    API server / LLM client ──(ClientMessage)──> EngineCore process       (engine/core_proc.py)
                            <──(EngineMessage)──                          protocol/engine_core.py
    tensor-parallel rank 0  ──(ToWorker)──────> worker of rank r > 0      (worker/tp_worker.py)
                            <──(FromWorker)────                           protocol/worker.py

protocol/codec.py encodes and decodes both. Sockets to external parties (KV events, kv_events/)
speak their own, fixed format; protocol/block_hash.py is contract 1 of docs/architecture.md.
"""
