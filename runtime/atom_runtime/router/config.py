"""`atom router`'s settings (`RouterConfig`, checked on construction) and `RouterError`, the
failure a client gets back as an OpenAI error body."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from fastapi.responses import Response

from atom_runtime.web.errors import error_body

POLICIES = ("kv-aware", "round-robin")


@dataclass
class RouterConfig:
    decode_services: list[str] = field(default_factory=list)
    prefill_services: list[str] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)  # static decode backends
    prefill_backends: list[str] = field(default_factory=list)
    kv_events_port: int | None = 5557
    kv_replay_port: int | None = 5558
    discovery: str = "auto"  # auto | kubernetes | dns
    discovery_interval: float = 5.0
    policy: str = "kv-aware"
    remote_prefill_threshold: int = 256
    load_weight: float = 64.0  # prompt tokens one queued or running request is worth
    queue_size: int = 256
    queue_timeout: float = 120.0
    probe_interval: float = 2.0
    probe_timeout: float = 2.0
    connect_timeout: float = 5.0
    max_attempts: int = 3
    # Trust boundaries (docs/security.md).
    api_key: str | None = None  # every route but /health needs it
    max_request_body_bytes: int = 8 * 1024 * 1024
    request_header_timeout: float = 10.0
    request_body_timeout: float = 60.0
    kv_events_curve_dir: str | None = None  # CurveZMQ keys for the engines' KV-event sockets
    kv_transfer_insecure: bool = False  # sign nothing (engines run with insecure: true)

    def __post_init__(self) -> None:
        if not (self.decode_services or self.backends):
            raise ValueError("give at least one --decode-service or --backend")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.discovery not in ("auto", "kubernetes", "dns"):
            raise ValueError(f"discovery: must be auto, kubernetes or dns, got {self.discovery!r}")
        for name in ("queue_size", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes: must be >= 1, got {self.max_request_body_bytes}"
            )
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key: must not be empty")
        for name in (
            "queue_timeout",
            "probe_interval",
            "probe_timeout",
            "connect_timeout",
            "request_header_timeout",
            "request_body_timeout",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.remote_prefill_threshold < 0 or self.load_weight < 0:
            raise ValueError("remote_prefill_threshold and load_weight must be >= 0")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_services or self.prefill_backends)


class RouterError(Exception):
    """Answered as an OpenAI error body; `retry_after` seconds go in a Retry-After header."""

    def __init__(self, status: int, message: str, type: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.retry_after = status, message, type, retry_after

    def response(self) -> Response:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return Response(
            json.dumps(error_body(self.message, self.type)),
            status_code=self.status,
            media_type="application/json",
            headers=headers,
        )
