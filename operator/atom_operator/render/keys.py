"""The per-deployment Secret `<name>-atom-keys`: the shared key that authenticates KV transfers
(the router signs transfer requests with it, producers check them) and the CurveZMQ key pairs of
the KV-event stream. Mounted read-only at /etc/atom/keys in every prefill, decode and router pod.

The values are random and made once: the operator generates a set on each reconcile and passes it
to the renderer (which stays pure), and the Secret is created only when it does not exist yet
(`apply` never patches a Secret), so a later reconcile never changes a key the pods hold.
"""

from __future__ import annotations

import base64
import dataclasses
import secrets
from typing import Any

from atom_operator.render.names import child_metadata, child_name, common_labels

KEYS_SUFFIX = "atom-keys"
KEYS_MOUNT = "/etc/atom/keys"
KEYS_VOLUME = "atom-keys"
TRANSFER_KEY_FILE = "transfer-key"
TRANSFER_KEY_ENV = "ATOM_TRANSFER_KEY_FILE"
CURVE_FILES = (
    "kv-events-server.key",
    "kv-events-server.pub",
    "kv-events-client.key",
    "kv-events-client.pub",
)
# Owner read and group read (the pods' fsGroup); nobody else, and never writable.
KEYS_FILE_MODE = 0o440


@dataclasses.dataclass(frozen=True)
class DeploymentKeys:
    """The secret values of one AtomDeployment: file name in /etc/atom/keys -> text."""

    files: dict[str, str]

    @classmethod
    def generate(cls) -> DeploymentKeys:
        """Fresh random keys: 32 random bytes as 64 hex characters for the transfer key, and
        two CurveZMQ key pairs (Z85 text) for the KV-event server and its clients."""
        import zmq  # the operator's only use of pyzmq; imported here so rendering needs none

        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        values = (server_secret, server_public, client_secret, client_public)
        files = {TRANSFER_KEY_FILE: secrets.token_hex(32)}
        files.update(
            (name, key.decode("ascii")) for name, key in zip(CURVE_FILES, values, strict=True)
        )
        return cls(files)


def keys_secret_name(body: dict[str, Any]) -> str:
    return child_name(body, KEYS_SUFFIX)


def render_keys_secret(body: dict[str, Any], keys: DeploymentKeys) -> dict[str, Any]:
    """The Opaque Secret holding `keys`, owned by the AtomDeployment (created once, see above)."""
    data = {
        name: base64.b64encode(text.encode()).decode("ascii") for name, text in keys.files.items()
    }
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(body, keys_secret_name(body), common_labels(body)),
        "type": "Opaque",
        "data": data,
    }


def keys_volume(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Secret as a pod volume and its read-only mount at KEYS_MOUNT."""
    volume = {
        "name": KEYS_VOLUME,
        "secret": {"secretName": keys_secret_name(body), "defaultMode": KEYS_FILE_MODE},
    }
    return volume, {"name": KEYS_VOLUME, "mountPath": KEYS_MOUNT, "readOnly": True}


def transfer_key_env() -> dict[str, str]:
    """Where the runtime finds the transfer key (a file, so the key never sits in the env)."""
    return {"name": TRANSFER_KEY_ENV, "value": f"{KEYS_MOUNT}/{TRANSFER_KEY_FILE}"}
