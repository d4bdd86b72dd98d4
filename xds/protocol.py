"""The xDS stream logic as I/O-free state machines: state of the world and delta.

Owns what one Envoy stream has been sent, what it asked for and acknowledged, and so
what to send next. A machine is fed requests (`receive`) and new snapshots (`update`)
and returns the responses to send plus the ACK/NACK events seen; it never touches a
socket, so every protocol rule is tested without one (tests/test_protocol.py).

Rules held here (see DESIGN.md section 2):
- nonces rise per stream; a request answering an old nonce gets no reply;
- a NACK is recorded and never answered by re-sending the same content;
- resources go out clusters, endpoints, listeners, routes; removed clusters go
  last, after the routes that named them are gone;
- every requested endpoint name is answered, an unknown one with an empty assignment;
- after a cluster changes, its assignment is re-sent at once with a new version (Envoy
  otherwise keeps the cluster warming until its 15 s initial-fetch timeout);
- nothing is sent when nothing changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import envoy_data_plane.envoy.config.core.v3 as core
from envoy_data_plane.envoy.config.endpoint.v3 import ClusterLoadAssignment
from envoy_data_plane.envoy.service.discovery.v3 import (
    DeltaDiscoveryRequest,
    DeltaDiscoveryResponse,
    DiscoveryRequest,
    DiscoveryResponse,
)
from envoy_data_plane.envoy.service.discovery.v3 import Resource as DeltaResource
from envoy_data_plane.google.protobuf import Any

from xds.snapshot import CLUSTER, ENDPOINT, ORDER, WILDCARD_TYPES, Resource, Snapshot

CONTROL_PLANE = core.ControlPlane(identifier="llmgw")
# A forced re-send carries "<content version>+<nonce>"; the part before '+' is the
# content, which is what we compare when Envoy tells us what it holds.
_SEP = "+"


def content_version(v: str) -> str:
    return v.split(_SEP, 1)[0]


def _empty_assignment(name: str) -> Resource:
    return Resource.of(ENDPOINT, name, ClusterLoadAssignment(cluster_name=name))


@dataclass(frozen=True)
class Ack:
    type_url: str
    version: str
    nonce: str


@dataclass(frozen=True)
class Nack:
    type_url: str
    version: str  # SotW: the last version Envoy accepted; delta: the rejected nonce's
    nonce: str
    message: str


@dataclass(frozen=True)
class Stale:
    type_url: str
    nonce: str


Event = Ack | Nack | Stale


@dataclass(frozen=True)
class Push:
    """One response to send, with what it carries (for metrics and tests)."""

    type_url: str
    nonce: str
    version: str
    names: tuple[str, ...]
    removed: tuple[str, ...]
    message: DiscoveryResponse | DeltaDiscoveryResponse


@dataclass
class Step:
    pushes: list[Push] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)


@dataclass
class _TypeState:
    wildcard: bool = False
    names: set[str] = field(default_factory=set)
    # name -> content version Envoy holds (or was last sent: a NACKed content is
    # not re-sent, so "sent" is what counts).
    known: dict[str, str] = field(default_factory=dict)
    nonce: str = ""
    # The full resources last sent for wildcard types, to keep removed clusters
    # alive until the routes that use them are gone (SotW make-before-break).
    last_full: dict[str, Resource] = field(default_factory=dict)


class _Machine:
    """What SotW and delta share: per-type state, nonces and the ordering of a push."""

    def __init__(self) -> None:
        self._types: dict[str, _TypeState] = {}
        self._nonce = 0
        self._snap: Snapshot | None = None
        # While applying a snapshot patched from the one this stream last applied:
        # the names that changed per type. Only those can differ from what Envoy
        # was sent, so the diff costs the change, not the fleet.
        self._hint: Mapping[str, frozenset[str]] | None = None

    def _next_nonce(self) -> str:
        self._nonce += 1
        return str(self._nonce)

    def _targets(self, t: str, st: _TypeState, snap: Snapshot) -> list[str]:
        current = snap.of_type(t)
        if st.wildcard:
            return sorted(set(current) | st.names)
        return sorted(st.names)

    def _changed(
        self, t: str, st: _TypeState, snap: Snapshot, force: Iterable[str] = ()
    ) -> tuple[list[Resource], list[str], list[str]]:
        """(resources to send, their names that were forced, names removed)."""
        current = snap.of_type(t)
        forced = set(force)
        out: list[Resource] = []
        if self._hint is not None:
            changed = self._hint.get(t, frozenset()) | forced
            names = sorted(n for n in changed if st.wildcard or n in st.names)
            known: Iterable[str] = [n for n in changed if n in st.known]
        else:
            names = self._targets(t, st, snap)
            known = st.known
        for n in names:
            res = current.get(n)
            if res is None:
                if t != ENDPOINT:
                    continue
                # Envoy waits forever for an assignment it asked for: answer an
                # unknown cluster name with an empty one.
                res = _empty_assignment(n)
            if st.known.get(n) != res.version or n in forced:
                out.append(res)
        removed = sorted(n for n in known if n not in current and (st.wildcard or t != ENDPOINT))
        return out, sorted(forced & {r.name for r in out}), removed

    def update(self, snap: Snapshot) -> Step:
        """A new snapshot: push what changed for each subscribed type, in order."""
        prev, self._snap = self._snap, snap
        if prev is not None and snap.base is not None and snap.base[0] == prev.serial:
            self._hint = snap.base[1]
        step = Step()
        try:
            self._push_all(snap, step)
        finally:
            self._hint = None
        return step

    def _push_all(self, snap: Snapshot, step: Step) -> None:
        raise NotImplementedError

    def _modified_clusters(self, st: _TypeState, sent: list[Resource]) -> list[str]:
        return [r.name for r in sent if r.name in st.known and st.known[r.name] != r.version]


class SotwStream(_Machine):
    """State of the world over ADS (StreamAggregatedResources)."""

    def receive(self, req: DiscoveryRequest) -> Step:
        step = Step()
        t = req.type_url
        st = self._types.get(t)
        if st is None:
            st = self._types[t] = _TypeState()
        elif req.response_nonce != st.nonce:
            # Answers a response that is no longer the latest: no reply.
            step.events.append(Stale(t, req.response_nonce))
            return step
        if req.response_nonce:
            if req.error_detail is not None and (req.error_detail.code or req.error_detail.message):
                step.events.append(Nack(t, req.version_info, req.response_nonce,
                                        req.error_detail.message))
            else:
                step.events.append(Ack(t, req.version_info, req.response_nonce))
        names = set(req.resource_names)
        if t in WILDCARD_TYPES:
            st.wildcard = not names or "*" in names
            names.discard("*")
        # A name dropped from the subscription is forgotten, so it is sent again if
        # it comes back.
        for gone in st.names - names:
            st.known.pop(gone, None)
        st.names = names
        snap = self._snap
        reconnect = snap is not None and not req.response_nonce and req.version_info
        # Reconnect: Envoy already holds version_info. If that is what we have, it
        # needs nothing.
        if snap is not None and reconnect and content_version(req.version_info) == snap.version(t):
            cur = snap.of_type(t)
            for n in self._targets(t, st, snap):
                if n in cur:
                    st.known[n] = cur[n].version
            if st.wildcard:
                st.last_full = dict(cur)
        if snap is not None:
            self._push_type(t, st, snap, step)
        return step

    def _push_all(self, snap: Snapshot, step: Step) -> None:
        cds = self._types.get(CLUSTER)
        two_phase = False
        modified: list[str] = []
        if cds is not None:
            sent, _, removed = self._changed(CLUSTER, cds, snap)
            if sent or removed:
                modified = self._modified_clusters(cds, sent)
                if removed:
                    # Phase one keeps removed clusters until routes stop naming them.
                    keep = {n: cds.last_full[n] for n in removed if n in cds.last_full}
                    union = {**keep, **snap.of_type(CLUSTER)}
                    step.pushes.append(self._response(
                        CLUSTER, cds, list(union.values()), snap.version(CLUSTER) + _SEP + "keep",
                        (), record=False))
                    two_phase = True
                else:
                    step.pushes.append(self._full(CLUSTER, cds, snap))
        for t in ORDER[1:]:
            st = self._types.get(t)
            if st is not None:
                force = modified if t == ENDPOINT else ()
                self._push_type(t, st, snap, step, force)
        if cds is not None and two_phase:
            step.pushes.append(self._full(CLUSTER, cds, snap))

    def _push_type(
        self, t: str, st: _TypeState, snap: Snapshot, step: Step, force: Iterable[str] = ()
    ) -> None:
        sent, forced, removed = self._changed(t, st, snap, force)
        if t in WILDCARD_TYPES:
            if sent or removed:
                modified = self._modified_clusters(st, sent) if t == CLUSTER else []
                step.pushes.append(self._full(t, st, snap))
                if modified and ENDPOINT in self._types:
                    self._push_type(ENDPOINT, self._types[ENDPOINT], snap, step, modified)
        elif sent:
            version = snap.version(t) + (_SEP + str(self._nonce + 1) if forced else "")
            step.pushes.append(self._response(t, st, sent, version, ()))

    def _full(self, t: str, st: _TypeState, snap: Snapshot) -> Push:
        cur = snap.of_type(t)
        removed = tuple(sorted(set(st.known) - set(cur)))
        push = self._response(t, st, list(cur.values()), snap.version(t), removed)
        st.known = {n: r.version for n, r in cur.items()}
        st.last_full = dict(cur)
        return push

    def _response(
        self,
        t: str,
        st: _TypeState,
        resources: list[Resource],
        version: str,
        removed: tuple[str, ...],
        record: bool = True,
    ) -> Push:
        nonce = self._next_nonce()
        st.nonce = nonce
        if record:
            for r in resources:
                st.known[r.name] = r.version
        resources = sorted(resources, key=lambda r: r.name)
        msg = DiscoveryResponse(
            version_info=version,
            resources=[Any(type_url=t, value=r.body) for r in resources],
            type_url=t,
            nonce=nonce,
            control_plane=CONTROL_PLANE,
        )
        return Push(t, nonce, version, tuple(r.name for r in resources), removed, msg)


class DeltaStream(_Machine):
    """Incremental xDS over ADS (DeltaAggregatedResources)."""

    def receive(self, req: DeltaDiscoveryRequest) -> Step:
        step = Step()
        t = req.type_url
        st = self._types.get(t)
        if st is None:
            st = self._types[t] = _TypeState()
            # Reconnect: what Envoy already holds, so it is not sent again.
            st.known = {n: content_version(v) for n, v in req.initial_resource_versions.items()}
            if t in WILDCARD_TYPES and not req.resource_names_subscribe:
                st.wildcard = True
        if req.response_nonce:
            if req.response_nonce != st.nonce:
                step.events.append(Stale(t, req.response_nonce))
            elif req.error_detail is not None and (
                req.error_detail.code or req.error_detail.message
            ):
                step.events.append(Nack(t, "", req.response_nonce, req.error_detail.message))
            else:
                step.events.append(Ack(t, "", req.response_nonce))
        for n in req.resource_names_subscribe:
            if n == "*":
                st.wildcard = True
            else:
                st.names.add(n)
                # Envoy (re)subscribing wants the resource even if it once had it.
                if n not in req.initial_resource_versions:
                    st.known.pop(n, None)
        for n in req.resource_names_unsubscribe:
            if n == "*":
                st.wildcard = False
            else:
                st.names.discard(n)
                st.known.pop(n, None)
        if self._snap is not None:
            self._push_type(t, st, self._snap, step)
        return step

    def _push_all(self, snap: Snapshot, step: Step) -> None:
        cds_removed: list[str] = []
        modified: list[str] = []
        for t in ORDER:
            st = self._types.get(t)
            if st is None:
                continue
            if t == CLUSTER:
                sent, _, removed = self._changed(t, st, snap)
                modified = self._modified_clusters(st, sent)
                if sent:
                    step.pushes.append(self._response(t, st, sent, (), snap))
                cds_removed = removed
            else:
                self._push_type(t, st, snap, step, modified if t == ENDPOINT else ())
        if cds_removed:
            # Removed clusters go last, once no route names them.
            step.pushes.append(self._response(CLUSTER, self._types[CLUSTER], [], cds_removed, snap))

    def _push_type(
        self, t: str, st: _TypeState, snap: Snapshot, step: Step, force: Iterable[str] = ()
    ) -> None:
        sent, forced, removed = self._changed(t, st, snap, force)
        if sent or removed:
            modified = self._modified_clusters(st, sent) if t == CLUSTER else []
            step.pushes.append(self._response(t, st, sent, removed, snap, set(forced)))
            if modified and ENDPOINT in self._types:
                self._push_type(ENDPOINT, self._types[ENDPOINT], snap, step, modified)

    def _response(
        self,
        t: str,
        st: _TypeState,
        resources: list[Resource],
        removed: Iterable[str],
        snap: Snapshot,
        forced: set[str] | None = None,
    ) -> Push:
        nonce = self._next_nonce()
        st.nonce = nonce
        removed = tuple(sorted(removed))
        for n in removed:
            st.known.pop(n, None)
        out: list[DeltaResource] = []
        for r in sorted(resources, key=lambda r: r.name):
            st.known[r.name] = r.version
            version = r.version + (_SEP + nonce if forced and r.name in forced else "")
            out.append(DeltaResource(name=r.name, version=version,
                                     resource=Any(type_url=t, value=r.body)))
        msg = DeltaDiscoveryResponse(
            system_version_info=snap.version(t),
            resources=out,
            type_url=t,
            removed_resources=list(removed),
            nonce=nonce,
            control_plane=CONTROL_PLANE,
        )
        return Push(t, nonce, snap.version(t), tuple(r.name for r in out), removed, msg)
