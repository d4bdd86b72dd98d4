"""The publisher: the single writer of what Envoy is told.

Owns the current (catalog, endpoints by model) input and turns every change into a
snapshot in the xDS cache. A catalog change rebuilds the whole snapshot; an endpoint
change of one model patches only that model's assignment, so its cost follows the
change, not the fleet. Endpoint sources (static, or the inventory) call
`set_endpoints`; the load poller calls `set_weights`; nothing else writes the cache.
Weights are kept apart from the endpoints and merged when publishing, so a weight
change is an endpoint-only (EDS) update and a source never has to know about them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Protocol

from controlplane.catalog import Catalog
from controlplane.endpoints import Endpoint
from xds.cache import SnapshotCache
from xds.snapshot import InconsistentSnapshot, Snapshot, build_snapshot

log = logging.getLogger("llmgw.publisher")


class Publisher:
    def __init__(self, cache: SnapshotCache, catalog: Catalog) -> None:
        self._cache = cache
        self._catalog = catalog
        self._endpoints: dict[str, tuple[Endpoint, ...]] = {}
        # Model -> address -> load-balancing weight (absent: Envoy's default).
        self._weights: dict[str, dict[str, int]] = {}
        self._snapshot: Snapshot | None = None

    @property
    def catalog(self) -> Catalog:
        return self._catalog

    def endpoints(self) -> Mapping[str, tuple[Endpoint, ...]]:
        """Published endpoints by model: a copy of immutable tuples."""
        return dict(self._endpoints)

    def weights(self) -> Mapping[str, Mapping[str, int]]:
        """Published load weights by model and address (copies)."""
        return {m: dict(w) for m, w in self._weights.items()}

    def _weighted(self, model: str) -> tuple[Endpoint, ...]:
        eps = self._endpoints.get(model, ())
        w = self._weights.get(model)
        if not w:
            return eps
        return tuple(replace(e, weight=w.get(e.address)) for e in eps)

    def _all_endpoints(self) -> list[Endpoint]:
        return [e for m in self._endpoints for e in self._weighted(m)]

    def publish(self) -> bool:
        """Build from the current input and hand it to the cache; True if it changed."""
        return self._set(build_snapshot(self._catalog, self._all_endpoints()))

    def set_catalog(self, catalog: Catalog) -> bool:
        """Apply a new catalog. An inconsistent result is refused; the last stays."""
        snap = build_snapshot(catalog, self._all_endpoints(), same_endpoints_as=self._snapshot)
        changed = self._set(snap)
        self._catalog = catalog
        return changed

    def set_endpoints(self, model: str, endpoints: Iterable[Endpoint]) -> bool:
        """Replace one model's Ready endpoints; True if Envoy will be told."""
        eps = tuple(sorted(set(endpoints)))
        if any(e.model != model for e in eps):
            raise ValueError(f"endpoints for another model passed as {model!r}")
        if self._endpoints.get(model, ()) == eps:
            return False
        self._endpoints[model] = eps
        if self._catalog.model(model) is None:
            log.warning("endpoints for model %r, which is not in the catalog: not routed", model)
            return False
        return self._patch(model)

    def set_weights(self, model: str, weights: Mapping[str, int]) -> bool:
        """Replace one model's load weights (address -> 1..128); True if Envoy is told.

        Weights of addresses that are not endpoints are kept for when they become
        one; an empty mapping returns the model to Envoy's equal weights.
        """
        new = {a: int(w) for a, w in weights.items()}
        if any(not 1 <= w <= 128 for w in new.values()):
            raise ValueError(f"load weights must be 1..128: {new}")
        if self._weights.get(model, {}) == new:
            return False
        if new:
            self._weights[model] = new
        else:
            self._weights.pop(model, None)
        if self._catalog.model(model) is None or model not in self._endpoints:
            return False
        return self._patch(model)

    def _patch(self, model: str) -> bool:
        if self._snapshot is None:
            return self.publish()
        try:
            return self._set(self._snapshot.with_endpoints(model, self._weighted(model)))
        except InconsistentSnapshot:
            return self.publish()

    def _set(self, snap: Snapshot) -> bool:
        changed = self._cache.set_snapshot(snap)
        self._snapshot = snap
        return changed


class EndpointSource(Protocol):
    """Something that discovers Ready endpoints and hands them to the publisher."""

    async def run(self, publisher: Publisher) -> None: ...


class StaticSource:
    """A fixed set of endpoints (the demo's engines before agents exist, tests)."""

    def __init__(self, endpoints: Iterable[Endpoint]) -> None:
        self._endpoints = tuple(endpoints)

    async def run(self, publisher: Publisher) -> None:
        by_model: dict[str, list[Endpoint]] = {}
        for e in self._endpoints:
            by_model.setdefault(e.model, []).append(e)
        for model, eps in sorted(by_model.items()):
            publisher.set_endpoints(model, eps)
