"""The per-deployment KV-transfer secret, and what it signs: the router's kv_transfer_params and
the transfer wire's control messages. Connector-independent and torch-free (the router imports
it): every transport (the portable TCP one, an RDMA one) authenticates with the same key.

Where the key comes from, first found wins:
  1. `kv_connector_extra_config.key_file` of --kv-transfer-config (engines only),
  2. the file named by $ATOM_TRANSFER_KEY_FILE (the operator mounts one Secret per AtomDeployment
     at /etc/atom/keys/transfer-key in the prefill, decode and router pods),
  3. $ATOM_TRANSFER_KEY, the key itself.
A key is at least 64 hex digits (32 bytes; `python -c 'import secrets;print(secrets.token_hex(32))'`).

Signed kv_transfer_params: the router adds `atom_request_id` (a fresh uuid4), `atom_expires`
(unix seconds) and `atom_signature`, HMAC-SHA256 over a canonical JSON encoding (sorted keys, no
spaces) of every other field. An engine with a key acts on no kv_transfer_params without a valid,
unexpired signature, so `do_remote_decode` (pin a producer's blocks) and the producer address of
`do_remote_prefill` (whom a decode engine dials) come only from the router.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from atom_runtime import envs

KEY_BYTES = 32
SIGNATURE = "atom_signature"
EXPIRES = "atom_expires"
REQUEST_ID = "atom_request_id"
ENVELOPE = (SIGNATURE, EXPIRES, REQUEST_ID)
# How long a signed kv_transfer_params stays good: the router signs just before it sends, and a
# decode engine checks on arrival; the margin covers retries and clocks a little apart.
PARAMS_TTL_S = 60
# Domain labels: a MAC made for one kind of message is never valid for another.
_PARAMS_LABEL = b"atom-kv-transfer-params/1"


class TransferKeyError(ValueError):
    """No usable transfer key; the message names where it looked (never the key)."""


class TransferKey:
    """An HMAC-SHA256 key shared by the router and every engine of one deployment."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < KEY_BYTES:
            raise TransferKeyError(f"the transfer key must be at least {KEY_BYTES} bytes")
        self._secret = secret

    def __repr__(self) -> str:
        return "TransferKey(<secret>)"

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_text(cls, text: str, where: str) -> TransferKey:
        value = text.strip()
        try:
            secret = bytes.fromhex(value)
        except ValueError:
            secret = b""
        if len(secret) < KEY_BYTES:
            raise TransferKeyError(
                f"{where}: the transfer key must be at least {2 * KEY_BYTES} hex digits "
                f"({KEY_BYTES} bytes), got {len(value)} characters that are not"
            )
        return cls(secret)

    @classmethod
    def from_file(cls, path: str, where: str) -> TransferKey:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise TransferKeyError(
                f"{where}={path}: cannot read the transfer key ({e.strerror})"
            ) from None
        return cls.from_text(text, f"{where}={path}")

    @classmethod
    def load(cls, key_file: str | None = None) -> TransferKey | None:
        """The deployment's key (`key_file` first, then the environment), or None when none is
        configured anywhere. A configured key that cannot be used raises TransferKeyError."""
        if key_file:
            return cls.from_file(key_file, "kv_connector_extra_config.key_file")
        path = envs.TRANSFER_KEY_FILE.value()
        if path:
            return cls.from_file(path, envs.TRANSFER_KEY_FILE.name)
        text = envs.TRANSFER_KEY.value()
        if text:
            return cls.from_text(text, envs.TRANSFER_KEY.name)
        return None

    # -- MACs ------------------------------------------------------------------------------------

    def mac(self, label: bytes, *parts: bytes) -> bytes:
        """HMAC-SHA256 over `label` and `parts`, each length-prefixed (no two part lists
        encode alike)."""
        h = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in (label, *parts):
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
        return h.digest()

    def verify(self, mac: bytes, label: bytes, *parts: bytes) -> bool:
        """Whether `mac` is this key's MAC of `label` and `parts` (constant time)."""
        return hmac.compare_digest(mac, self.mac(label, *parts))

    # -- the router's kv_transfer_params ---------------------------------------------------------

    def sign_params(self, params: Mapping, ttl_s: float = PARAMS_TTL_S) -> dict:
        """`params` with a fresh request id, an expiry and the signature over all of it."""
        signed = {k: v for k, v in params.items() if k not in ENVELOPE}
        signed[REQUEST_ID] = uuid.uuid4().hex
        signed[EXPIRES] = int(time.time() + ttl_s) + 1
        signed[SIGNATURE] = self.mac(_PARAMS_LABEL, canonical(signed)).hex()
        return signed

    def open_params(self, params: Mapping, now: float | None = None) -> dict:
        """The fields of router-signed kv_transfer_params (the envelope taken off). Raises
        ValueError naming kv_transfer_params when the signature is missing, wrong or expired."""
        signature = params.get(SIGNATURE)
        if not isinstance(signature, str):
            raise ValueError(
                "kv_transfer_params: not signed by the router (only `atom router` may ask an "
                "engine for a KV transfer)"
            )
        body = {k: v for k, v in params.items() if k != SIGNATURE}
        try:
            mac = bytes.fromhex(signature)
            encoded = canonical(body)
        except (ValueError, TypeError):
            mac, encoded = b"", b""
        if not encoded or not self.verify(mac, _PARAMS_LABEL, encoded):
            raise ValueError("kv_transfer_params: the router's signature does not match")
        expires = body.get(EXPIRES)
        now = time.time() if now is None else now
        if type(expires) is not int or expires < now:
            raise ValueError("kv_transfer_params: the router's signature has expired")
        return {k: v for k, v in body.items() if k not in ENVELOPE}


def canonical(value: Mapping) -> bytes:
    """The one JSON encoding both ends sign: sorted keys, no spaces, ASCII, finite numbers."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def check_timeout(value: object, field: str, limit: float) -> float:
    """A finite number of seconds in (0, limit], else ValueError naming `field`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= limit
    ):
        raise ValueError(f"{field}: must be a number of seconds in (0, {limit:g}], got {value!r}")
    return float(value)
