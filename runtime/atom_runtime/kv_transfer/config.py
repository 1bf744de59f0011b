"""`--kv-transfer-config`: vLLM's KVTransferConfig field names, checked at startup.

{"kv_connector": "AtomPortableConnector", "kv_role": "kv_producer"|"kv_consumer"|"kv_both",
 "kv_ip": "0.0.0.0", "kv_port": 14579, "kv_connector_extra_config": {...}}

Extra config understood by the portable connector (all optional):
  advertise_host   the address consumers dial (default: $POD_IP, else kv_ip unless it is a
                   wildcard, else this host's primary address)
  hold_timeout_s   how long a producer keeps a finished prompt's blocks for a pull (default 60)
  pull_timeout_s   how long a consumer waits for a pull before prefilling locally (default 30)
  streams          TCP connections one pull's payload is split over, in contiguous stripes; on a
                   producer, how many stripes it sends at once (default 4)
  data_port        the producer's payload port (default 0: any free port, told to consumers in
                   each PullReply)
  socket_buffer_bytes  SO_SNDBUF/SO_RCVBUF of payload sockets (default 0: the kernel autotunes,
                   which an explicit size turns off; the kernel caps it at net.core.*mem_max)
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

# The connectors this runtime has. The RDMA transports are named so their refusal is specific:
# they plug in behind atom_runtime.kv_transfer.base.KVConnector when they land.
PORTABLE = ("AtomPortableConnector", "TCPConnector")
NOT_YET = ("NixlConnector", "MooncakeConnector", "MoRIConnector", "P2pNcclConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_PORT = 14579  # vLLM's default kv_port
DEFAULT_STREAMS = 4
MAX_STREAMS = 64


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_ip: str = "0.0.0.0"
    kv_port: int = DEFAULT_PORT
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def hold_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("hold_timeout_s", 60.0))

    @property
    def pull_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("pull_timeout_s", 30.0))

    @property
    def streams(self) -> int:
        return int(self.kv_connector_extra_config.get("streams", DEFAULT_STREAMS))

    @property
    def data_port(self) -> int:
        return int(self.kv_connector_extra_config.get("data_port", 0))

    @property
    def socket_buffer_bytes(self) -> int:
        return int(self.kv_connector_extra_config.get("socket_buffer_bytes", 0))

    def advertise_host(self) -> str:
        host = self.kv_connector_extra_config.get("advertise_host") or os.environ.get("POD_IP")
        if host:
            return str(host)
        if self.kv_ip not in ("0.0.0.0", "::", "*", ""):
            return self.kv_ip
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
                f"yet; use one of {', '.join(PORTABLE)}"
            )
        if connector not in PORTABLE:
            raise ValueError(
                f"kv_transfer_config.kv_connector: unknown connector {connector!r}; "
                f"known: {', '.join(PORTABLE)}"
            )
        role = raw.get("kv_role")
        if role not in ROLES:
            raise ValueError(
                f"kv_transfer_config.kv_role: must be one of {', '.join(ROLES)}, got {role!r}"
            )
        port = raw.get("kv_port", DEFAULT_PORT)
        if type(port) is not int or not 0 < port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port: must be in 1..65535, got {port!r}")
        ip = raw.get("kv_ip", "0.0.0.0")
        if not isinstance(ip, str) or not ip:
            raise ValueError(f"kv_transfer_config.kv_ip: must be an address, got {ip!r}")
        extra = raw.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config: must be an object")
        for key in ("hold_timeout_s", "pull_timeout_s"):
            value = extra.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
            ):
                raise ValueError(
                    f"kv_transfer_config.kv_connector_extra_config.{key}: must be a number > 0, "
                    f"got {value!r}"
                )
        for key, low, high in (
            ("streams", 1, MAX_STREAMS),
            ("data_port", 0, 65535),
            ("socket_buffer_bytes", 0, 1 << 30),
        ):
            value = extra.get(key)
            if value is not None and (type(value) is not int or not low <= value <= high):
                raise ValueError(
                    f"kv_transfer_config.kv_connector_extra_config.{key}: must be an integer in "
                    f"{low}..{high}, got {value!r}"
                )
        return cls(connector, role, ip, port, dict(extra))
