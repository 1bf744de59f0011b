"""The operator's one Kubernetes API client, built from the credentials kopf logged in with."""

from __future__ import annotations

import kopf

from atom_operator import apply


class KubeConnection:
    """The credentials kopf logged in with, turned into one `apply.KubeAPI` on first use.

    Kept in the operator's memo (shared by every object's memo) because kopf logs in after
    the startup handlers run and again whenever its credentials stop working.
    """

    def __init__(self) -> None:
        self.info: kopf.ConnectionInfo | None = None
        self._api: apply.KubeAPI | None = None
        self._retired: list[apply.KubeAPI] = []  # built from older credentials; closed at exit

    def set_info(self, info: kopf.ConnectionInfo | None) -> None:
        if info is not self.info:
            self.info = info
            if self._api is not None:
                self._retired.append(self._api)
            self._api = None

    def api(self) -> apply.KubeAPI:
        if self._api is None:
            if self.info is None:
                raise kopf.TemporaryError("not logged in to the Kubernetes API yet", delay=1)
            self._api = apply.KubeAPI.from_connection_info(self.info)
        return self._api

    async def close(self) -> None:
        for api in [*self._retired, self._api]:
            if api is not None:
                await api.close()
        self._api, self._retired = None, []


def connection(memo: kopf.Memo) -> KubeConnection:
    """The operator's connection, kept in its memo."""
    return memo.setdefault("kube", KubeConnection())
