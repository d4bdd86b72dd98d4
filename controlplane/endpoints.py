"""Ready endpoints: the values the publisher turns into Envoy load assignments.

An endpoint is a replica of a model that answers on host:port. It is a frozen value;
whoever discovers endpoints (the static demo source now, the reconciler later) hands
tuples of them to the publisher and never a live object.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Endpoint:
    """One serving replica of `model` at host:port."""

    model: str
    host: str
    port: int
    replica_id: str = ""
    # Draining: Envoy sends it no new requests; in-flight ones finish.
    draining: bool = False
    # Load-balancing weight (1..128); None leaves Envoy's default.
    weight: int | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
