"""Per-Envoy xDS client status: who is connected, what each acknowledged or rejected.

Owns the record the ADS server keeps of each stream (node id, mode, per-type last ACK
and last NACK with Envoy's error text, push counts). Stream handlers write it, all on
the event loop; readers get immutable copies from `snapshot()`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from xds.snapshot import SHORT


@dataclass(frozen=True)
class NackInfo:
    version: str
    nonce: str
    message: str
    at: float


@dataclass(frozen=True)
class TypeStatus:
    acked_version: str = ""
    requests: int = 0
    acks: int = 0
    pushes: int = 0
    bytes_sent: int = 0
    nacks: int = 0
    last_nack: NackInfo | None = None


@dataclass(frozen=True)
class ClientStatus:
    stream_id: int
    node_id: str
    cluster: str
    mode: str  # "sotw" or "delta"
    peer: str
    connected_at: float
    disconnected_at: float | None = None
    types: dict[str, TypeStatus] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {
            "stream_id": self.stream_id,
            "node_id": self.node_id,
            "cluster": self.cluster,
            "mode": self.mode,
            "peer": self.peer,
            "connected_at": self.connected_at,
            "disconnected_at": self.disconnected_at,
            "types": {
                SHORT.get(t, t): {
                    "acked_version": s.acked_version,
                    "requests": s.requests,
                    "acks": s.acks,
                    "pushes": s.pushes,
                    "bytes_sent": s.bytes_sent,
                    "nacks": s.nacks,
                    "last_nack": None
                    if s.last_nack is None
                    else {
                        "version": s.last_nack.version,
                        "nonce": s.last_nack.nonce,
                        "message": s.last_nack.message,
                        "at": s.last_nack.at,
                    },
                }
                for t, s in sorted(self.types.items())
            },
        }


class ClientRegistry:
    """Status of every stream, current and recently closed (bounded)."""

    def __init__(self, keep_closed: int = 32) -> None:
        self._live: dict[int, ClientStatus] = {}
        self._closed: list[ClientStatus] = []
        self._keep_closed = keep_closed
        self._next = 0

    def open(self, mode: str, peer: str) -> int:
        self._next += 1
        self._live[self._next] = ClientStatus(self._next, "", "", mode, peer, time.time())
        return self._next

    def identify(self, sid: int, node_id: str, cluster: str) -> None:
        self._live[sid] = replace(self._live[sid], node_id=node_id, cluster=cluster)

    def _update(self, sid: int, type_url: str, **changes: object) -> None:
        c = self._live[sid]
        ts = c.types.get(type_url, TypeStatus())
        new = replace(ts, **changes)  # type: ignore[arg-type]
        self._live[sid] = replace(c, types={**c.types, type_url: new})

    def _type(self, sid: int, type_url: str) -> TypeStatus:
        return self._live[sid].types.get(type_url, TypeStatus())

    def requested(self, sid: int, type_url: str) -> None:
        self._update(sid, type_url, requests=self._type(sid, type_url).requests + 1)

    def pushed(self, sid: int, type_url: str, size: int) -> None:
        ts = self._type(sid, type_url)
        self._update(sid, type_url, pushes=ts.pushes + 1, bytes_sent=ts.bytes_sent + size)

    def acked(self, sid: int, type_url: str, version: str) -> None:
        ts = self._type(sid, type_url)
        self._update(sid, type_url, acked_version=version, acks=ts.acks + 1)

    def nacked(self, sid: int, type_url: str, nack: NackInfo) -> None:
        ts = self._type(sid, type_url)
        self._update(sid, type_url, nacks=ts.nacks + 1, last_nack=nack)

    def close(self, sid: int) -> None:
        c = self._live.pop(sid, None)
        if c is not None:
            self._closed.append(replace(c, disconnected_at=time.time()))
            del self._closed[: -self._keep_closed]

    def snapshot(self) -> tuple[tuple[ClientStatus, ...], tuple[ClientStatus, ...]]:
        """(connected, recently closed): immutable values."""
        return tuple(self._live.values()), tuple(self._closed)

    def get(self, sid: int) -> ClientStatus | None:
        return self._live.get(sid)
