"""The KV-cache sections: KV transfer between roles, KV events for routers, state checkpoints."""

from __future__ import annotations

from atom_operator.schema.api import ENGINE_HTTP_PORT
from atom_operator.schema.fields import free_object, int_field, object_field, str_field

KV_TRANSFER = object_field(
    "KV transfer between prefill and decode (--kv-transfer-config). Only valid with a "
    "prefill role; omitted => the runtime's portable connector.",
    {
        "connector": str_field(
            "Connector class name.", default="AtomPortableConnector", minLength=1
        ),  # fmt: skip
        "config": free_object("kv_connector_extra_config, passed through.", default={}),
    },
)

KV_EVENTS = object_field(
    "KV-cache events (vLLM wire format) for cache-aware routers.",
    {
        "enabled": {"type": "boolean", "default": True},
        "port": int_field("ZMQ PUB port.", default=5557, minimum=1024, maximum=65535),
        "replayPort": int_field(
            "ZMQ ROUTER replay port.", default=5558, minimum=1024, maximum=65535
        ),  # fmt: skip
        "encryption": str_field(
            "none: plain ZMQ (the NetworkPolicy admits only the router to these ports). curve: "
            "CurveZMQ encryption and authentication with the per-deployment keys "
            "(<name>-atom-keys): the engines get curve_keys_dir in --kv-events-config, the "
            "router --kv-events-curve-dir; other subscribers need the client key pair.",
            default="none",
            enum=["none", "curve"],
        ),
        "includeTokenIds": {
            "type": "boolean",
            "default": True,
            "description": "Whether BlockStored events carry the blocks' token ids (vLLM's "
            "format) or block hashes only (include_token_ids: false). The router scores on "
            "hashes; llm-d's precise prefix scorer needs the token ids.",
        },
    },
    default={},
    **{
        "x-kubernetes-validations": [
            {
                "rule": "!has(self.port) || !has(self.replayPort) || self.port != self.replayPort",
                "message": "port and replayPort must differ",
                "fieldPath": ".replayPort",
            },
            {
                "rule": f"(!has(self.port) || self.port != {ENGINE_HTTP_PORT}) && "
                f"(!has(self.replayPort) || self.replayPort != {ENGINE_HTTP_PORT})",
                "message": f"port {ENGINE_HTTP_PORT} is the engine's HTTP port",
                "fieldPath": ".port",
            },
        ]
    },
)

STATE_CHECKPOINT = object_field(
    "Per-request state checkpoints for hybrid (recurrent-state) models.",
    {
        "intervalTokens": int_field(
            "N > 0: a checkpoint every N tokens (a multiple of engine.blockSize); 0: off; "
            "-1: no ladder, prompt-end anchors and demand checkpoints only.",
            default=-1,
            minimum=-1,
        ),
        "demand": {"type": "boolean", "default": True},
        "memoryFraction": {
            "type": "number",
            "description": "The share of the KV block pool checkpoints may borrow at "
            "most (least recently used ones are evicted beyond it; live KV reclaims them "
            "whenever it needs the blocks).",
            "default": 0.1,
            "minimum": 0,
            "exclusiveMinimum": True,
            "maximum": 1,
        },
    },
    default={},
)
