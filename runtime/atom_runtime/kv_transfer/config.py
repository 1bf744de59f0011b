"""`--kv-transfer-config`: vLLM's KVTransferConfig field names, checked at startup.

{"kv_connector": "AtomPortableConnector" | "NixlConnector",
 "kv_role": "kv_producer"|"kv_consumer"|"kv_both",
 "kv_ip": HOST, "kv_port": 14579, "kv_connector_extra_config": {...}}

kv_ip is where a producer listens: by default the pod's own address ($POD_IP), else 127.0.0.1;
a wildcard (0.0.0.0, ::) only when given. Under tensor parallelism rank r's control port is
kv_port + r (and its payload port data_port + r when data_port is set).

Extra config (all optional; the first group is every connector's):
  key_file         the transfer key's file (default: $ATOM_TRANSFER_KEY_FILE, else
                   $ATOM_TRANSFER_KEY; kv_transfer/auth.py); without any, start-up fails
  insecure         true: run without a key (unsigned params, unauthenticated wire), with a
                   WARNING; for local experiments only
  advertise_host   the address consumers dial (default: $POD_IP, else kv_ip unless it is a
                   wildcard, else this host's primary address)
  hold_timeout_s   how long a producer keeps a finished prompt's blocks for a pull (default 60,
                   at most 600)
  pull_timeout_s   how long a consumer waits for a pull before prefilling locally (default 30,
                   at most 300)
  max_held_fraction  the largest share of the producer's KV blocks held for pulls at once
                   (default 0.5); a prompt finishing beyond it is not held (local prefill)
  streams          (portable) TCP connections one pull's payload is split over, in contiguous
                   stripes; on a producer, how many stripes it sends at once (default 4)
  data_port        the producer's payload port (default 0: any free port, told to consumers in
                   each PullReply)
  socket_buffer_bytes  SO_SNDBUF/SO_RCVBUF of payload sockets (default 0: the kernel autotunes,
                   which an explicit size turns off; the kernel caps it at net.core.*mem_max)
  backends         (NIXL) the NIXL backends the agent creates (default ["UCX"])
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from atom_runtime import envs
from atom_runtime.kv_transfer.auth import TransferKey, TransferKeyError, check_timeout

# The connectors this runtime has. The other RDMA transports are named so their refusal is
# specific: they plug in behind atom_runtime.kv_transfer.base.KVConnector when they land.
PORTABLE = ("AtomPortableConnector", "TCPConnector")
NIXL = ("NixlConnector",)
KNOWN = PORTABLE + NIXL
NOT_YET = ("MooncakeConnector", "MoRIConnector", "P2pNcclConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_PORT = 14579  # vLLM's default kv_port
DEFAULT_STREAMS = 4
MAX_STREAMS = 64
MAX_HOLD_TIMEOUT_S = 600.0
MAX_PULL_TIMEOUT_S = 300.0  # also the longest a producer keeps a ticket for one pull
WILDCARDS = ("0.0.0.0", "::", "*", "")


def _extra_number(name: str, default: float) -> property:
    """kv_connector_extra_config[name] as the default's type (int or float), else the default."""
    kind = type(default)
    return property(lambda self: kind(self.kv_connector_extra_config.get(name, default)))


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_ip: str | None = None  # None: the pod's address ($POD_IP), else 127.0.0.1
    kv_port: int = DEFAULT_PORT
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_nixl(self) -> bool:
        return self.kv_connector in NIXL

    def for_rank(self, rank: int) -> KVTransferConfig:
        """This config as tensor-parallel rank `rank` uses it: its control port kv_port + rank,
        its payload port data_port + rank when data_port is set."""
        if rank == 0:
            return self
        extra = dict(self.kv_connector_extra_config)
        if extra.get("data_port"):
            extra["data_port"] += rank
        return dataclasses.replace(
            self, kv_port=self.kv_port + rank, kv_connector_extra_config=extra
        )

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    # kv_connector_extra_config's numbers (checked by _check_extra), else their defaults.
    hold_timeout_s = _extra_number("hold_timeout_s", 60.0)
    pull_timeout_s = _extra_number("pull_timeout_s", 30.0)
    max_held_fraction = _extra_number("max_held_fraction", 0.5)
    streams = _extra_number("streams", DEFAULT_STREAMS)
    data_port = _extra_number("data_port", 0)
    socket_buffer_bytes = _extra_number("socket_buffer_bytes", 0)

    @property
    def insecure(self) -> bool:
        return self.kv_connector_extra_config.get("insecure") is True

    @property
    def key_file(self) -> str | None:
        return self.kv_connector_extra_config.get("key_file")

    def bind_host(self) -> str:
        """Where the producer's sockets listen: kv_ip when given, else the pod's address."""
        if self.kv_ip is not None:
            return self.kv_ip
        return os.environ.get("POD_IP") or "127.0.0.1"

    def load_key(self) -> TransferKey | None:
        """The deployment's transfer key; None only with `insecure: true`. Raises ValueError
        naming what to set when there is none."""
        key = TransferKey.load(self.key_file)
        if key is None and not self.insecure:
            raise TransferKeyError(
                f"kv_transfer_config: no KV-transfer key; set {envs.TRANSFER_KEY_FILE.name} "
                f"(a file of 64 hex digits) or {envs.TRANSFER_KEY.name}, the same for the router "
                "and every engine of the deployment (kv_connector_extra_config.insecure: true "
                "runs without one, for local experiments only)"
            )
        return key

    def advertise_host(self) -> str:
        host = self.kv_connector_extra_config.get("advertise_host") or os.environ.get("POD_IP")
        if host:
            return str(host)
        bind = self.bind_host()
        if bind not in WILDCARDS:
            return bind
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"

    @classmethod
    def from_cli(cls, text: str | None) -> KVTransferConfig | None:
        """Parse and check the flag's JSON; ValueError naming the field on anything wrong."""
        if text is None:
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_transfer_config: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError("kv_transfer_config: must be a JSON object")
        # vLLM fields this runtime has no use for (kv_buffer_size, kv_rank, ...) are accepted and
        # ignored, so a config written for vLLM works unchanged; the ones used are checked.
        connector = raw.get("kv_connector")
        if not isinstance(connector, str) or not connector:
            raise ValueError("kv_transfer_config.kv_connector: required, a connector name")
        if connector in NOT_YET:
            raise ValueError(
                f"kv_transfer_config.kv_connector: {connector} is not available in this runtime "
                f"yet; use one of {', '.join(KNOWN)}"
            )
        if connector not in KNOWN:
            raise ValueError(
                f"kv_transfer_config.kv_connector: unknown connector {connector!r}; "
                f"known: {', '.join(KNOWN)}"
            )
        role = raw.get("kv_role")
        if role not in ROLES:
            raise ValueError(
                f"kv_transfer_config.kv_role: must be one of {', '.join(ROLES)}, got {role!r}"
            )
        port = raw.get("kv_port", DEFAULT_PORT)
        if type(port) is not int or not 0 < port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port: must be in 1..65535, got {port!r}")
        ip = raw.get("kv_ip")
        if ip is not None and (not isinstance(ip, str) or not ip):
            raise ValueError(f"kv_transfer_config.kv_ip: must be an address, got {ip!r}")
        extra = raw.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config: must be an object")
        _check_extra(extra)
        return cls(connector, role, ip, port, dict(extra))


def _check_extra(extra: dict) -> None:
    """Check kv_connector_extra_config; ValueError naming the field."""
    where = "kv_transfer_config.kv_connector_extra_config"
    for key, limit in (
        ("hold_timeout_s", MAX_HOLD_TIMEOUT_S),
        ("pull_timeout_s", MAX_PULL_TIMEOUT_S),
    ):
        if extra.get(key) is not None:
            check_timeout(extra[key], f"{where}.{key}", limit)
    fraction = extra.get("max_held_fraction")
    if fraction is not None and (
        isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1
    ):
        raise ValueError(f"{where}.max_held_fraction: must be in (0, 1], got {fraction!r}")
    if "insecure" in extra and not isinstance(extra["insecure"], bool):
        raise ValueError(f"{where}.insecure: must be true or false, got {extra['insecure']!r}")
    backends = extra.get("backends")
    if backends is not None and (
        not isinstance(backends, list)
        or not backends
        or not all(isinstance(b, str) and b for b in backends)
    ):
        raise ValueError(
            f"{where}.backends: must be a list of NIXL backend names, got {backends!r}"
        )
    key_file = extra.get("key_file")
    if key_file is not None and (not isinstance(key_file, str) or not key_file):
        raise ValueError(f"{where}.key_file: must be a file path, got {key_file!r}")
    for key, low, high in (
        ("streams", 1, MAX_STREAMS),
        ("data_port", 0, 65535),
        ("socket_buffer_bytes", 0, 1 << 30),
    ):
        value = extra.get(key)
        if value is not None and (type(value) is not int or not low <= value <= high):
            raise ValueError(f"{where}.{key}: must be an integer in {low}..{high}, got {value!r}")
