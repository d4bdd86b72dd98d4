"""Snapshots: frozen sets of serialized Envoy resources with content-derived versions.

Owns the resource value (name, type, bytes, version), the per-type version, the
consistency check (every cluster has its endpoints, every route names an existing
cluster) and the two ways to make a snapshot: from a whole (catalog, endpoints) input,
or by replacing one model's endpoints in an existing snapshot. The latter costs the
size of the change, not of the fleet. Versions are hashes of content, so the same
input always has the same version, across restarts too.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import betterproto2
from envoy_data_plane.envoy.config.route.v3 import RouteConfiguration

from controlplane.catalog import Catalog
from controlplane.endpoints import Endpoint
from xds import translate

CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
# Make before break: a cluster exists before its endpoints, both before the
# listener and routes that lead to them.
ORDER: tuple[str, ...] = (CLUSTER, ENDPOINT, LISTENER, ROUTE)
# Types Envoy subscribes to as a whole ("wildcard"); the others by name.
WILDCARD_TYPES = frozenset({CLUSTER, LISTENER})
SHORT = {CLUSTER: "cds", ENDPOINT: "eds", LISTENER: "lds", ROUTE: "rds"}


class InconsistentSnapshot(ValueError):
    """A snapshot refers to something it does not contain; it is never published."""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


@dataclass(frozen=True)
class Resource:
    """One serialized Envoy resource. The version is a hash of its bytes."""

    type_url: str
    name: str
    body: bytes
    version: str

    @classmethod
    def of(cls, type_url: str, name: str, msg: betterproto2.Message) -> Resource:
        body = bytes(msg)
        return cls(type_url, name, body, _digest(body))


_MASK = (1 << 64) - 1


def _entry(name: str, version: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{name}\0{version}".encode()).digest()[:8], "big")


def _type_sum(resources: Mapping[str, Resource]) -> int:
    # A sum of per-resource hashes, not a hash of the sorted list: replacing one
    # resource updates it in O(1) (subtract the old entry, add the new one), and
    # it is still a pure function of the content.
    return sum(_entry(n, r.version) for n, r in resources.items()) & _MASK


def _version_of(total: int) -> str:
    return f"{total:016x}"


_serials = itertools.count(1)


@dataclass(frozen=True)
class Snapshot:
    """An immutable, consistent set of resources for every type, with versions."""

    resources: Mapping[str, Mapping[str, Resource]]
    versions: Mapping[str, str]
    # What the snapshot was built from, kept to patch endpoints and render status.
    catalog: Catalog = field(compare=False)
    # Cluster names referenced by each route config, for the consistency check.
    route_clusters: Mapping[str, frozenset[str]] = field(compare=False)
    # Per-type sums behind `versions`, to update a version without a full walk.
    sums: Mapping[str, int] = field(compare=False, default_factory=dict)
    # Identity of this snapshot, and (serial of the snapshot it was patched from,
    # names changed per type): lets a stream in sync with the base diff only those.
    serial: int = field(compare=False, default_factory=lambda: next(_serials))
    base: tuple[int, Mapping[str, frozenset[str]]] | None = field(compare=False, default=None)
    # Model name -> its cluster names (one, or two with a session cluster).
    _model_clusters: Mapping[str, tuple[str, ...]] = field(compare=False, default_factory=dict)

    def of_type(self, type_url: str) -> Mapping[str, Resource]:
        return self.resources.get(type_url, MappingProxyType({}))

    def version(self, type_url: str) -> str:
        return self.versions.get(type_url, "")

    def check(self) -> None:
        """Raise InconsistentSnapshot if a name points at something missing."""
        clusters = set(self.of_type(CLUSTER))
        endpoints = set(self.of_type(ENDPOINT))
        missing_eds = sorted(clusters - endpoints)
        if missing_eds:
            raise InconsistentSnapshot(f"clusters without endpoints resource: {missing_eds}")
        orphans = sorted(endpoints - clusters)
        if orphans:
            raise InconsistentSnapshot(f"endpoints for unknown clusters: {orphans}")
        for rc, names in self.route_clusters.items():
            unknown = sorted(names - clusters)
            if unknown:
                raise InconsistentSnapshot(f"route config {rc!r} names unknown clusters {unknown}")
        listeners = self.of_type(LISTENER)
        if listeners and translate.ROUTE_CONFIG_NAME not in self.of_type(ROUTE):
            raise InconsistentSnapshot(
                f"listener uses route config {translate.ROUTE_CONFIG_NAME!r}, which is missing"
            )

    def with_endpoints(self, model: str, endpoints: Iterable[Endpoint]) -> Snapshot:
        """A new snapshot in which one model's endpoints are replaced.

        Costs the size of that model's assignment; everything else is shared.
        """
        names = self._model_clusters.get(model)
        if not names:
            raise InconsistentSnapshot(f"model {model!r} is not in the catalog")
        endpoints = tuple(endpoints)
        eds = self.of_type(ENDPOINT)
        total = self.sums[ENDPOINT]
        new: dict[str, Resource] = {}
        for name in names:
            res = Resource.of(ENDPOINT, name, translate.build_load_assignment(name, endpoints))
            prev = eds[name]
            if prev.version != res.version:
                new[name] = res
                total += _entry(name, res.version) - _entry(name, prev.version)
        if not new:
            return self
        total &= _MASK
        # The same names as before, so the consistency checked at assembly still holds.
        return Snapshot(
            resources=MappingProxyType({**self.resources,
                                        ENDPOINT: MappingProxyType({**eds, **new})}),
            versions=MappingProxyType({**self.versions, ENDPOINT: _version_of(total)}),
            catalog=self.catalog,
            route_clusters=self.route_clusters,
            sums=MappingProxyType({**self.sums, ENDPOINT: total}),
            base=(self.serial, MappingProxyType({ENDPOINT: frozenset(new)})),
            _model_clusters=self._model_clusters,
        )


def _assemble(
    resources: Mapping[str, Mapping[str, Resource]],
    catalog: Catalog,
    route_clusters: Mapping[str, frozenset[str]],
) -> Snapshot:
    frozen = {t: MappingProxyType(dict(r)) for t, r in resources.items()}
    sums = {t: _type_sum(r) for t, r in frozen.items()}
    snap = Snapshot(
        resources=MappingProxyType(frozen),
        versions=MappingProxyType({t: _version_of(v) for t, v in sums.items()}),
        catalog=catalog,
        route_clusters=MappingProxyType(dict(route_clusters)),
        sums=MappingProxyType(sums),
        _model_clusters=MappingProxyType({
            m.name: tuple(n for n in translate.cluster_names(m) if n in frozen.get(CLUSTER, {}))
            for m in catalog.models}),
    )
    snap.check()
    return snap


def build_snapshot(catalog: Catalog, endpoints: Iterable[Endpoint],
                   same_endpoints_as: Snapshot | None = None) -> Snapshot:
    """Translate a catalog plus Ready endpoints into a checked snapshot.

    Endpoints of models not in the catalog are ignored (they cannot be routed to).
    `same_endpoints_as`: a snapshot built from the same endpoints (a catalog change);
    its resources for models whose settings did not change are reused as they are, so
    a catalog edit costs what it changes rather than a rebuild of the whole fleet.
    """
    by_model: dict[str, list[Endpoint]] = {m.name: [] for m in catalog.models}
    for ep in endpoints:
        if ep.model in by_model:
            by_model[ep.model].append(ep)
    clusters: dict[str, Resource] = {}
    assignments: dict[str, Resource] = {}
    prev = same_endpoints_as
    for m in catalog.models:
        old = prev.catalog.model(m.name) if prev is not None else None
        names = translate.cluster_names(m)
        if (prev is not None and old is not None
                and translate.cluster_names(old) == names
                and all(n in prev.of_type(CLUSTER) for n in names)):
            # Clusters depend on routing settings only; the endpoints are the same.
            if old.routing == m.routing:
                clusters.update({n: prev.of_type(CLUSTER)[n] for n in names})
            else:
                for c in translate.build_clusters(m):
                    clusters[c.name] = Resource.of(CLUSTER, c.name, c)
            assignments.update({n: prev.of_type(ENDPOINT)[n] for n in names})
            continue
        for c in translate.build_clusters(m):
            clusters[c.name] = Resource.of(CLUSTER, c.name, c)
            cla = translate.build_load_assignment(c.name, by_model[m.name])
            assignments[c.name] = Resource.of(ENDPOINT, c.name, cla)
    lst = translate.build_listener(catalog)
    rc: RouteConfiguration = translate.build_routes(catalog)
    used = frozenset(
        r.route.cluster
        for vh in rc.virtual_hosts
        for r in vh.routes
        if r.route is not None and r.route.cluster
    )
    return _assemble(
        {
            CLUSTER: clusters,
            ENDPOINT: assignments,
            LISTENER: {lst.name: Resource.of(LISTENER, lst.name, lst)},
            ROUTE: {rc.name: Resource.of(ROUTE, rc.name, rc)},
        },
        catalog,
        {rc.name: used},
    )


def make_snapshot(
    resources: Mapping[str, Mapping[str, Resource]],
    catalog: Catalog,
    route_clusters: Mapping[str, frozenset[str]],
) -> Snapshot:
    """Assemble and check a snapshot from already-built resources (tests, tools)."""
    return _assemble(resources, catalog, route_clusters)
