"""Protocol tests on the I/O-free xDS stream machines (no sockets, no Envoy)."""

from __future__ import annotations

import envoy_data_plane.envoy.config.core.v3 as core
from envoy_data_plane.envoy.service.discovery.v3 import (
    DeltaDiscoveryRequest,
    DeltaDiscoveryResponse,
    DiscoveryRequest,
    DiscoveryResponse,
)
from envoy_data_plane.google.rpc import Status
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.catalog import Catalog, Model, Routing
from controlplane.endpoints import Endpoint
from xds.protocol import Ack, DeltaStream, Nack, SotwStream, Stale
from xds.snapshot import CLUSTER, ENDPOINT, LISTENER, ORDER, ROUTE, build_snapshot
from xds.translate import cluster_name

NODE = core.Node(id="test-envoy", cluster="t")


def catalog(*names: str, timeout: float = 2.0) -> Catalog:
    return Catalog(models=tuple(
        Model(name=n, routing=Routing(connect_timeout_s=timeout)) for n in names))


def eps(model: str, *ports: int) -> list[Endpoint]:
    return [Endpoint(model, "127.0.0.1", p) for p in ports]


def sotw_req(t: str, names=(), version="", nonce="", error: str | None = None) -> DiscoveryRequest:
    return DiscoveryRequest(
        version_info=version, node=NODE, resource_names=list(names), type_url=t,
        response_nonce=nonce,
        error_detail=Status(code=13, message=error) if error else None,
    )


def delta_req(t: str, sub=(), unsub=(), nonce="", initial=None, error: str | None = None):
    return DeltaDiscoveryRequest(
        node=NODE, type_url=t, resource_names_subscribe=list(sub),
        resource_names_unsubscribe=list(unsub), initial_resource_versions=initial or {},
        response_nonce=nonce,
        error_detail=Status(code=13, message=error) if error else None,
    )


def sotw_connect(m: SotwStream, snap, models=("a", "b")) -> dict[str, str]:
    """Drive a SotW stream like Envoy does: CDS, EDS, ACKs, LDS, RDS. Returns nonces."""
    m.update(snap)
    nonces = {}
    p = m.receive(sotw_req(CLUSTER)).pushes
    assert [x.type_url for x in p] == [CLUSTER]
    nonces[CLUSTER] = p[0].nonce
    names = [cluster_name(x) for x in models]
    p = m.receive(sotw_req(ENDPOINT, names)).pushes
    assert [x.type_url for x in p] == [ENDPOINT]
    nonces[ENDPOINT] = p[0].nonce
    assert not m.receive(sotw_req(ENDPOINT, names, p[0].version, p[0].nonce)).pushes
    assert not m.receive(sotw_req(CLUSTER, (), snap.version(CLUSTER), nonces[CLUSTER])).pushes
    p = m.receive(sotw_req(LISTENER)).pushes
    nonces[LISTENER] = p[0].nonce
    p = m.receive(sotw_req(ROUTE, ["llmgw"])).pushes
    nonces[ROUTE] = p[0].nonce
    return nonces


def test_nonces_rise_and_stale_nonce_gets_no_reply() -> None:
    snap = build_snapshot(catalog("a", "b"), eps("a", 1))
    m = SotwStream()
    nonces = sotw_connect(m, snap)
    seq = [int(nonces[t]) for t in ORDER]
    assert seq == sorted(seq) and len(set(seq)) == 4
    # Envoy answering an older CDS nonce: ignored, nothing sent.
    step = m.receive(sotw_req(CLUSTER, (), "old", "0"))
    assert step.pushes == [] and step.events == [Stale(CLUSTER, "0")]
    snap2 = snap.with_endpoints("a", eps("a", 1, 2))
    step = m.update(snap2)
    assert [int(p.nonce) for p in step.pushes] == [5]


def test_identical_snapshot_pushes_nothing() -> None:
    cat = catalog("a", "b")
    snap = build_snapshot(cat, eps("a", 1))
    for m in (SotwStream(), DeltaStream()):
        if isinstance(m, SotwStream):
            sotw_connect(m, snap)
        else:
            delta_connect(m, snap)
        assert m.update(build_snapshot(cat, eps("a", 1))).pushes == []
        assert m.update(snap).pushes == []


def test_nack_is_recorded_and_not_answered_with_the_same_version() -> None:
    snap = build_snapshot(catalog("a", "b"), eps("a", 1))
    m = SotwStream()
    nonces = sotw_connect(m, snap)
    bad = build_snapshot(catalog("a", "b", timeout=3.0), eps("a", 1))
    step = m.update(bad)
    cds = [p for p in step.pushes if p.type_url == CLUSTER]
    assert len(cds) == 1
    step = m.receive(sotw_req(CLUSTER, (), snap.version(CLUSTER), cds[0].nonce, error="boom"))
    assert step.pushes == []
    assert step.events == [Nack(CLUSTER, snap.version(CLUSTER), cds[0].nonce, "boom")]
    # The same bad content again (e.g. a re-publish) is not re-sent either.
    assert [p for p in m.update(bad).pushes if p.type_url == CLUSTER] == []
    # A fixed snapshot is sent.
    good = build_snapshot(catalog("a", "b", timeout=4.0), eps("a", 1))
    assert [p.type_url for p in m.update(good).pushes][0] == CLUSTER
    assert nonces  # connected


def test_one_push_goes_clusters_endpoints_listeners_routes() -> None:
    snap = build_snapshot(catalog("a"), eps("a", 1))
    for m in (SotwStream(), DeltaStream()):
        if isinstance(m, SotwStream):
            sotw_connect(m, snap, models=("a",))
        else:
            delta_connect(m, snap, models=("a",))
        # New model c: cluster, its endpoints, listener unchanged, routes.
        nxt = build_snapshot(catalog("a", "c", timeout=2.5), eps("a", 1) + eps("c", 7))
        types = [p.type_url for p in m.update(nxt).pushes]
        order = [ORDER.index(t) for t in types]
        assert order == sorted(order), types
        assert types[0] == CLUSTER and ROUTE in types


def test_removed_cluster_goes_after_routes() -> None:
    snap = build_snapshot(catalog("a", "b"), eps("a", 1) + eps("b", 2))
    smaller = build_snapshot(catalog("a"), eps("a", 1))
    m = SotwStream()
    sotw_connect(m, snap)
    pushes = m.update(smaller).pushes
    types = [p.type_url for p in pushes]
    assert types[0] == CLUSTER and types[-1] == CLUSTER
    assert types.index(ROUTE) < len(types) - 1
    # First CDS still carries b (make before break); the last one drops it.
    assert cluster_name("b") in pushes[0].names
    assert cluster_name("b") not in pushes[-1].names
    d = DeltaStream()
    delta_connect(d, snap)
    pushes = d.update(smaller).pushes
    assert pushes[-1].type_url == CLUSTER and pushes[-1].removed == (cluster_name("b"),)
    assert ROUTE in [p.type_url for p in pushes[:-1]]


def test_unknown_endpoint_name_gets_an_empty_assignment() -> None:
    snap = build_snapshot(catalog("a"), eps("a", 1))
    m = SotwStream()
    m.update(snap)
    m.receive(sotw_req(CLUSTER))
    p = m.receive(sotw_req(ENDPOINT, ["nope", cluster_name("a")])).pushes
    assert p[0].names == ("model-a", "nope")
    d = DeltaStream()
    d.update(snap)
    p = d.receive(delta_req(ENDPOINT, sub=["nope"])).pushes
    assert p[0].names == ("nope",)


def test_named_subscription_answers_exactly_the_names_asked() -> None:
    snap = build_snapshot(catalog("a", "b", "c"), eps("a", 1) + eps("b", 2))
    m = SotwStream()
    m.update(snap)
    p = m.receive(sotw_req(ENDPOINT, [cluster_name("b")])).pushes
    assert p[0].names == (cluster_name("b"),)
    d = DeltaStream()
    d.update(snap)
    p = d.receive(delta_req(ENDPOINT, sub=[cluster_name("c")])).pushes
    assert p[0].names == (cluster_name("c"),)


def test_endpoint_change_sends_only_that_assignment() -> None:
    snap = build_snapshot(catalog("a", "b"), eps("a", 1) + eps("b", 2))
    nxt = snap.with_endpoints("a", eps("a", 1, 3))
    for m in (SotwStream(), DeltaStream()):
        if isinstance(m, SotwStream):
            sotw_connect(m, snap)
        else:
            delta_connect(m, snap)
        pushes = m.update(nxt).pushes
        assert [(p.type_url, p.names) for p in pushes] == [(ENDPOINT, (cluster_name("a"),))]


def test_changed_cluster_is_followed_by_fresh_assignment() -> None:
    """Warming fix: a modified cluster's EDS is re-sent at once with a new version."""
    snap = build_snapshot(catalog("a", "b"), eps("a", 1))
    nxt = build_snapshot(Catalog(models=(Model(name="a", routing=Routing(connect_timeout_s=9)),
                                         Model(name="b"))), eps("a", 1))
    m = SotwStream()
    sotw_connect(m, snap)
    pushes = m.update(nxt).pushes
    assert [p.type_url for p in pushes] == [CLUSTER, ENDPOINT]
    assert pushes[1].names == (cluster_name("a"),)
    assert "+" in pushes[1].version  # a new version though the content is the same
    d = DeltaStream()
    delta_connect(d, snap)
    pushes = d.update(nxt).pushes
    assert [p.type_url for p in pushes] == [CLUSTER, ENDPOINT]
    msg = pushes[1].message
    assert isinstance(msg, DeltaDiscoveryResponse) and "+" in msg.resources[0].version


def delta_connect(m: DeltaStream, snap, models=("a", "b")) -> None:
    m.update(snap)
    p = m.receive(delta_req(CLUSTER)).pushes
    assert p[0].type_url == CLUSTER
    names = [cluster_name(x) for x in models]
    e = m.receive(delta_req(ENDPOINT, sub=names)).pushes
    assert e[0].type_url == ENDPOINT
    assert m.receive(delta_req(ENDPOINT, nonce=e[0].nonce)).events == [
        Ack(ENDPOINT, "", e[0].nonce)]
    m.receive(delta_req(CLUSTER, nonce=p[0].nonce))
    m.receive(delta_req(LISTENER))
    m.receive(delta_req(ROUTE, sub=["llmgw"]))


def test_delta_unsubscribe_resubscribe_and_removals() -> None:
    snap = build_snapshot(catalog("a", "b"), eps("a", 1))
    d = DeltaStream()
    delta_connect(d, snap)
    assert d.receive(delta_req(ENDPOINT, unsub=[cluster_name("b")])).pushes == []
    p = d.receive(delta_req(ENDPOINT, sub=[cluster_name("b")])).pushes
    assert p[0].names == (cluster_name("b"),)  # re-sent on re-subscribe
    smaller = build_snapshot(catalog("a"), eps("a", 1))
    pushes = d.update(smaller).pushes
    removed = {x for p in pushes for x in p.removed}
    assert cluster_name("b") in removed


def test_delta_reconnect_with_initial_versions_sends_only_differences() -> None:
    snap = build_snapshot(catalog("a", "b"), eps("a", 1))
    have = {n: r.version for n, r in snap.of_type(CLUSTER).items()}
    d = DeltaStream()
    d.update(snap)
    assert d.receive(delta_req(CLUSTER, initial=have)).pushes == []
    # Envoy holds a cluster we no longer have: it is removed.
    d2 = DeltaStream()
    d2.update(snap)
    p = d2.receive(delta_req(CLUSTER, initial={**have, "model-gone": "x"})).pushes
    assert p[0].removed == ("model-gone",) and p[0].names == ()


def test_sotw_reconnect_with_current_version_gets_nothing() -> None:
    snap = build_snapshot(catalog("a", "b"), eps("a", 1))
    m = SotwStream()
    m.update(snap)
    assert m.receive(sotw_req(CLUSTER, (), snap.version(CLUSTER), "")).pushes == []
    names = [cluster_name("a"), cluster_name("b")]
    assert m.receive(sotw_req(ENDPOINT, names, snap.version(ENDPOINT), "")).pushes == []
    # A different version: everything asked is sent.
    m2 = SotwStream()
    m2.update(snap)
    assert m2.receive(sotw_req(CLUSTER, (), "older", "")).pushes[0].type_url == CLUSTER


# ---------------------------------------------------------------- generated sequences

MODELS = ["a", "b", "c"]


@st.composite
def snapshots(draw):
    names = draw(st.lists(st.sampled_from(MODELS), min_size=1, unique=True))
    cat = Catalog(models=tuple(Model(name=n, routing=Routing(
        connect_timeout_s=draw(st.sampled_from([1.0, 2.0])))) for n in sorted(names)))
    endpoints = []
    for n in names:
        for p in draw(st.lists(st.integers(1, 4), unique=True, max_size=3)):
            endpoints.append(Endpoint(n, "127.0.0.1", 1000 + p))
    return build_snapshot(cat, endpoints)


class FakeEnvoy:
    """A minimal SotW/delta client: ACKs whatever it is sent, tracks what it holds."""

    def __init__(self, delta: bool) -> None:
        self.delta = delta
        self.held: dict[str, dict[str, str]] = {t: {} for t in ORDER}
        self.nonce: dict[str, str] = {}
        self.version: dict[str, str] = {}

    def apply(self, pushes) -> list:
        reqs = []
        for p in pushes:
            msg = p.message
            self.nonce[p.type_url] = msg.nonce
            before = set(self.held[CLUSTER])
            if isinstance(msg, DiscoveryResponse):
                if p.type_url in (CLUSTER, LISTENER):
                    self.held[p.type_url] = {n: p.version for n in p.names}
                else:
                    self.held[p.type_url].update({n: p.version for n in p.names})
                self.version[p.type_url] = p.version
                reqs.append(sotw_req(p.type_url, self.names(p.type_url), p.version, msg.nonce))
            else:
                for r in msg.resources:
                    self.held[p.type_url][r.name] = r.version
                for n in msg.removed_resources:
                    self.held[p.type_url].pop(n, None)
                reqs.append(delta_req(p.type_url, nonce=msg.nonce))
            after = set(self.held[CLUSTER])
            if p.type_url == CLUSTER and after != before:
                # Like Envoy: a changed cluster set changes the EDS subscription.
                for n in before - after:
                    self.held[ENDPOINT].pop(n, None)
                if self.delta:
                    reqs.append(delta_req(ENDPOINT, sub=sorted(after - before),
                                          unsub=sorted(before - after)))
                else:
                    reqs.append(sotw_req(ENDPOINT, sorted(after), self.version.get(ENDPOINT, ""),
                                         self.nonce.get(ENDPOINT, "")))
        return reqs

    def names(self, t: str) -> list[str]:
        if t == ENDPOINT:
            return sorted(self.held[CLUSTER])
        if t == ROUTE:
            return ["llmgw"]
        return []


@settings(max_examples=60, deadline=None)
@given(st.lists(snapshots(), min_size=1, max_size=6), st.booleans())
def test_generated_sequences_converge_and_nonces_rise(snaps, delta) -> None:
    m = DeltaStream() if delta else SotwStream()
    env = FakeEnvoy(delta)
    m.update(snaps[0])
    sent_nonces: list[int] = []

    def pump(reqs) -> None:
        for _ in range(20):
            if not reqs:
                return
            nxt = []
            for r in reqs:
                step = m.receive(r)
                sent_nonces.extend(int(p.nonce) for p in step.pushes)
                nxt += env.apply(step.pushes)
            reqs = nxt
        raise AssertionError("the stream never went quiet")

    for t in (CLUSTER, LISTENER, ROUTE):
        if delta:
            r = delta_req(t, sub=["llmgw"] if t == ROUTE else [])
        else:
            r = sotw_req(t, env.names(t))
        step = m.receive(r)
        sent_nonces.extend(int(p.nonce) for p in step.pushes)
        pump(env.apply(step.pushes))
    for snap in snaps:
        step = m.update(snap)
        sent_nonces.extend(int(p.nonce) for p in step.pushes)
        pump(env.apply(step.pushes))
        # Envoy now holds exactly the snapshot's clusters, listener and routes.
        assert set(env.held[CLUSTER]) == set(snap.of_type(CLUSTER))
        for n in snap.of_type(CLUSTER):
            held = env.held[ENDPOINT].get(n)
            assert held is not None
        # Nothing more to send for the same snapshot.
        assert m.update(snap).pushes == []
    assert sent_nonces == sorted(sent_nonces) and len(set(sent_nonces)) == len(sent_nonces)


@st.composite
def patch_ops(draw):
    """A base snapshot, then endpoint patches (some not seen by the stream) and rebuilds."""
    base = draw(snapshots())
    ops = draw(st.lists(st.tuples(
        st.sampled_from(["patch", "patch", "patch", "rebuild", "unseen"]),
        st.sampled_from(MODELS), st.lists(st.integers(1, 4), unique=True, max_size=3),
        snapshots()), max_size=8))
    return base, ops


@settings(max_examples=60, deadline=None)
@given(patch_ops(), st.booleans())
def test_patched_snapshots_push_the_same_as_a_full_diff(case, delta) -> None:
    """The changed-names hint of a patched snapshot never changes what is sent."""
    import dataclasses

    base, ops = case
    hinted, full = (DeltaStream(), DeltaStream()) if delta else (SotwStream(), SotwStream())
    envs = [FakeEnvoy(delta), FakeEnvoy(delta)]

    def pushes_of(step) -> list:
        return [(p.type_url, p.names, p.removed, p.version) for p in step.pushes]

    def both(call) -> None:
        steps = [call(hinted, False), call(full, True)]
        assert pushes_of(steps[0]) == pushes_of(steps[1])
        reqs = [envs[0].apply(steps[0].pushes), envs[1].apply(steps[1].pushes)]
        for _ in range(20):
            if not reqs[0] and not reqs[1]:
                return
            assert len(reqs[0]) == len(reqs[1])
            nxt: list[list] = [[], []]
            for a, b in zip(reqs[0], reqs[1], strict=True):
                sa, sb = hinted.receive(a), full.receive(b)
                assert pushes_of(sa) == pushes_of(sb)
                nxt[0] += envs[0].apply(sa.pushes)
                nxt[1] += envs[1].apply(sb.pushes)
            reqs = nxt

    def strip(snap):
        return dataclasses.replace(snap, base=None)

    both(lambda m, s: m.update(strip(base) if s else base))
    for t in (CLUSTER, LISTENER, ROUTE):
        def sub(m, _s, t=t):
            if delta:
                return m.receive(delta_req(t, sub=["llmgw"] if t == ROUTE else []))
            return m.receive(sotw_req(t, envs[0].names(t)))
        both(sub)
    snap = base
    for kind, model, ports, other in ops:
        if kind == "rebuild":
            snap = other
        elif snap.catalog.model(model) is not None:
            eps = [Endpoint(model, "127.0.0.1", 1000 + p) for p in ports]
            snap = snap.with_endpoints(model, eps)
        if kind != "unseen":
            both(lambda m, s, cur=snap: m.update(strip(cur) if s else cur))
