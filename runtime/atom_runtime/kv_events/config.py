"""`--kv-events-config`: vLLM's `KVEventsConfig` field names, plus `ATOM_KV_EVENTS_*` env vars.

The JSON flag and the environment merge per field, the flag winning. Every bad input raises
`KVEventsConfigError` (a ValueError) naming the field, so the server can refuse to start with a
message that says what to fix.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import socket
from collections.abc import Mapping
from typing import Any

ENV_PREFIX = "ATOM_KV_EVENTS_"
PUBLISHERS = ("zmq", "null")
SCHEMES = ("tcp", "ipc", "inproc")
DEFAULT_PORT = 5557
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class KVEventsConfigError(ValueError):
    """A KV-events setting that cannot be used; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"kv-events config field {field!r}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    # None means "not chosen": like vLLM, it becomes "zmq" when events are enabled, else "null".
    publisher: str | None = None
    # None: tcp://<the pod's address>:5557 ($POD_IP, else 127.0.0.1), bound. `*` only if given.
    endpoint: str | None = None
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    # ATOM's own: BlockStored without token ids (hashes only: a router re-derives them from its
    # prompts, ATOM's PrefixIndex does), and CurveZMQ keys (kv_events/curve.py).
    include_token_ids: bool = True
    curve_keys_dir: str | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check_type(field.name, getattr(self, field.name))
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise KVEventsConfigError(
                "publisher", f"must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}"
            )
        if self.endpoint is not None:
            parse_endpoint("endpoint", self.endpoint)
        if self.curve_keys_dir is not None and self.enabled:
            from atom_runtime.kv_events.curve import CurveKeys

            try:
                CurveKeys.for_publisher(self.curve_keys_dir, "curve_keys_dir")
            except ValueError as e:
                message = str(e).removeprefix("curve_keys_dir: ")
                raise KVEventsConfigError("curve_keys_dir", message) from None
        if self.replay_endpoint is not None:
            parse_endpoint("replay_endpoint", self.replay_endpoint)
        for name, least in (("buffer_steps", 0), ("hwm", 0), ("max_queue_size", 1)):
            if getattr(self, name) < least:
                raise KVEventsConfigError(name, f"must be >= {least}, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        """Whether events are actually published (enabled and not the null publisher)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_cli(
        cls, json_text: str | None, environ: Mapping[str, str] = os.environ
    ) -> KVEventsConfig:
        """Build from `--kv-events-config` JSON and `ATOM_KV_EVENTS_<FIELD>`; the flag wins per field."""
        values: dict[str, Any] = {}
        names = {f.name: f for f in dataclasses.fields(cls)}
        for key, text in environ.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name not in names:
                raise KVEventsConfigError(key, f"unknown setting; known: {', '.join(names)}")
            if text == "":
                continue  # an empty variable is the same as an unset one
            values[name] = _from_env(name, text)
        if json_text is not None and json_text.strip():
            try:
                flag = json.loads(json_text)
            except json.JSONDecodeError as exc:
                raise KVEventsConfigError("--kv-events-config", f"invalid JSON: {exc}") from exc
            if not isinstance(flag, dict):
                raise KVEventsConfigError(
                    "--kv-events-config", f"must be a JSON object, got {type(flag).__name__}"
                )
            for name, value in flag.items():
                if name not in names:
                    raise KVEventsConfigError(name, f"unknown field; known: {', '.join(names)}")
                values[name] = value
        return cls(**values)

    def publish_endpoint(self, data_parallel_rank: int = 0) -> str:
        """The PUB endpoint for one data-parallel rank (tcp port + rank)."""
        endpoint = self.endpoint
        if endpoint is None:
            host = os.environ.get("POD_IP") or "127.0.0.1"
            endpoint = f"tcp://{f'[{host}]' if ':' in host else host}:{DEFAULT_PORT}"
        return offset_endpoint(endpoint, data_parallel_rank)

    def replay_publish_endpoint(self, data_parallel_rank: int = 0) -> str | None:
        """The replay ROUTER endpoint for one data-parallel rank, or None when replay is off."""
        if self.replay_endpoint is None:
            return None
        return offset_endpoint(self.replay_endpoint, data_parallel_rank)


_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str, type(None)),
    "endpoint": (str, type(None)),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
    "include_token_ids": (bool,),
    "curve_keys_dir": (str, type(None)),
}


def _check_type(name: str, value: object) -> None:
    allowed = _TYPES[name]
    # bool is an int subclass: `"hwm": true` must not pass as 1.
    if type(value) not in allowed:
        wanted = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
        raise KVEventsConfigError(name, f"must be {wanted}, got {type(value).__name__} {value!r}")


def _from_env(name: str, text: str) -> Any:
    kind = _TYPES[name][0]
    key = ENV_PREFIX + name.upper()
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise KVEventsConfigError(key, f"must be a boolean (true/false/1/0), got {text!r}")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise KVEventsConfigError(key, f"must be an integer, got {text!r}") from None
    return text


def parse_endpoint(field: str, endpoint: str) -> tuple[str, str, int | None]:
    """Split `scheme://address` into (scheme, host or path, tcp port or None); raises on nonsense."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in SCHEMES:
        raise KVEventsConfigError(
            field, f"{endpoint!r} needs a scheme, one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    if not rest:
        raise KVEventsConfigError(field, f"{endpoint!r} has no address after the scheme")
    if scheme != "tcp":
        return scheme, rest, None
    host, colon, port_text = rest.rpartition(":")
    if not colon or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise KVEventsConfigError(field, f"{endpoint!r} must be tcp://HOST:PORT (PORT 0-65535)")
    return scheme, host, int(port_text)


def endpoint_binds(endpoint: str) -> bool:
    """Bind ipc/inproc paths, a wildcard host (`tcp://*:5557`) and an address of this host
    (the pod's own, 127.0.0.1, localhost); connect to anything else (`tcp://indexer:5557`, for a
    router that binds one socket every engine connects to)."""
    scheme, host, _ = parse_endpoint("endpoint", endpoint)
    return scheme != "tcp" or host == "*" or is_local_address(host)


def is_local_address(host: str) -> bool:
    """Whether `host` (a name is not resolved, except localhost) is an address of this host."""
    if host == "localhost":
        return True
    host = host.removeprefix("[").removesuffix("]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if address.is_loopback:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((host, 0))  # only an address of one of this host's interfaces binds
        except OSError:
            return False
    return True


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """Give each data-parallel rank its own endpoint: tcp port + rank, ipc/inproc path + `_dp<rank>`.

    Port 0 (an ephemeral port, tests only) stays 0.
    """
    if type(data_parallel_rank) is not int or data_parallel_rank < 0:
        raise ValueError(f"data_parallel_rank must be an int >= 0, got {data_parallel_rank!r}")
    if data_parallel_rank == 0:
        return endpoint
    scheme, host, port = parse_endpoint("endpoint", endpoint)
    if port is None:
        return f"{endpoint}_dp{data_parallel_rank}"
    if port == 0:
        return endpoint
    if port + data_parallel_rank > 65535:
        raise KVEventsConfigError(
            "endpoint", f"port {port} + data-parallel rank {data_parallel_rank} exceeds 65535"
        )
    return f"{scheme}://{host}:{port + data_parallel_rank}"
