"""Load-aware routing through a real Envoy: poller weights (EDS-only, host state kept),
ORCA weights computed by Envoy itself, and session affinity (sticky while healthy,
moved on drain and loss)."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from prometheus_client import REGISTRY

from bench.harness import Load
from xds.translate import affinity_cluster_name, cluster_name

from .conftest import EngineProc, Gateway, GatewayFactory, wait_for

pytestmark = pytest.mark.slow

M = cluster_name("m")


async def healthy(gw: Gateway, cluster: str, n: int) -> None:
    async def check() -> bool:
        hs = await gw.envoy.hosts(cluster)
        return len([h for h in hs if not h.failed_active_hc and h.eds_health != "DRAINING"]) == n

    await wait_for(check, 15, f"{n} healthy hosts in {cluster}")


async def weights(gw: Gateway, cluster: str) -> dict[int, int]:
    return {int(h.address.rsplit(":", 1)[1]): h.weight for h in await gw.envoy.hosts(cluster)}


async def test_poller_weights_are_eds_only_and_keep_host_state(
    gateway: GatewayFactory, engines: list[EngineProc]
) -> None:
    fast, slow = engines[0], engines[1]
    gw = await gateway("models: [{name: m, routing: {load_balancing: weighted}}]",
                       [fast.endpoint("m"), slow.endpoint("m")],
                       load_interval_s=0.2, weight_min_interval_s=0.5)
    await healthy(gw, M, 2)
    for _ in range(6):
        assert (await gw.chat("m"))[0] == 200
    total_before = {h.address: h.rq_total for h in await gw.envoy.hosts(M)}
    cds = await gw.envoy.stat("cluster_manager.cds.update_success")
    modified = await gw.envoy.stat("cluster_manager.cluster_modified")
    pushes = dict(gw.cp.ads.stats().pushes)
    # Decoding 4x slower: each request holds the slow replica 4x longer.
    slow.fault(decode_slowdown=4.0)

    async with Load(gw.url, ["m"], workers=6, max_tokens=20, stream_every=0) as load:
        async def slow_weighted_down() -> bool:
            w = await weights(gw, M)
            return w.get(fast.port) == 100 and w.get(slow.port, 100) <= 50

        # Decode 4x slower: a weight near 25 once the smoothed rates settle.
        await wait_for(slow_weighted_down, 30, "the slow replica to get a lower weight in Envoy")
        load.started_after = time.monotonic()
        await load.wait_requests(40)
    assert load.result.failures == []
    w = await weights(gw, M)
    assert w[fast.port] == 100 and w[slow.port] <= 50, w
    assert gw.cp.publisher.weights()["m"][slow.endpoint("m").address] == w[slow.port]
    # Endpoint-only: no cluster re-sent or modified, and host counters kept counting.
    assert await gw.envoy.stat("cluster_manager.cds.update_success") == cds
    assert await gw.envoy.stat("cluster_manager.cluster_modified") == modified
    now = gw.cp.ads.stats().pushes
    assert now.get("cds") == pushes.get("cds") and now["eds"] > pushes["eds"]
    after = {h.address: h.rq_total for h in await gw.envoy.hosts(M)}
    for addr, n in total_before.items():
        assert after[addr] >= n, f"{addr} counters were reset: {n} -> {after[addr]}"
    # The operator sees load and weights.
    doc = gw.cp.status()
    eps = {e["address"]: e for e in doc["models"][0]["endpoints"]}
    assert eps[slow.endpoint("m").address]["weight"] == w[slow.port]
    assert "running" in eps[fast.endpoint("m").address]["load"]
    # ... and Prometheus does: the published weight, the polled load, the counters.
    slow_addr = slow.endpoint("m").address
    assert REGISTRY.get_sample_value(
        "llmgw_load_weight", {"model": "m", "replica": slow_addr}) == w[slow.port]
    assert REGISTRY.get_sample_value(
        "llmgw_replica_load", {"model": "m", "replica": slow_addr, "measure": "running"}
    ) is not None
    assert (REGISTRY.get_sample_value("llmgw_load_scrapes_total",
                                      {"model": "m", "result": "ok"}) or 0) > 0
    assert (REGISTRY.get_sample_value("llmgw_load_weight_updates_total",
                                      {"model": "m"}) or 0) >= 1


async def test_orca_weights_come_from_engine_reports(
    gateway: GatewayFactory, engines: list[EngineProc]
) -> None:
    fast, slow = engines[2], engines[3]
    gw = await gateway(
        "models: [{name: m, routing: {load_balancing: orca, orca_blackout_s: 0.2, "
        "orca_weight_update_s: 0.1}}]", [fast.endpoint("m"), slow.endpoint("m")])
    await healthy(gw, M, 2)
    slow.fault(latency_s=0.2)
    async with gw.session.post(gw.url + "/v1/chat/completions",
                               json={"model": "m", "messages": [], "max_tokens": 1}) as r:
        assert r.status == 200
        # Envoy asked for the report (the engine sent it) and kept it from the client.
        assert "endpoint-load-metrics" not in r.headers
    async with Load(gw.url, ["m"], workers=6, max_tokens=2, stream_every=0) as load:
        async def weighted() -> bool:
            w = await weights(gw, M)
            return w.get(slow.port, 1) < w.get(fast.port, 1)

        await wait_for(weighted, 30, "Envoy to weight the slow replica down from ORCA reports")
    assert load.result.failures == []
    assert gw.cp.ads.stats().nacks == 0
    assert gw.cp.publisher.weights() == {}  # nothing came from the control plane


async def test_session_affinity_sticks_and_moves_on_drain_and_loss(
    gateway: GatewayFactory, engines: list[EngineProc]
) -> None:
    e0, e1, e2 = engines[:3]
    reps = {e.replica_id: e for e in (e0, e1, e2)}
    gw = await gateway("models: [{name: m, routing: {session_header: x-session-id}}]",
                       [e.endpoint("m") for e in (e0, e1, e2)])
    await healthy(gw, M, 3)
    await healthy(gw, affinity_cluster_name("m"), 3)

    async def where(session: str | None, n: int = 5) -> set[str]:
        got = set()
        for _ in range(n):
            headers = {"x-session-id": session} if session else {}
            async with gw.session.post(gw.url + "/v1/chat/completions", headers=headers,
                                       json={"model": "m", "messages": [],
                                             "max_tokens": 1}) as r:
                assert r.status == 200
                got.add(r.headers["x-llmgw-replica"])
        return got

    homes = {}
    for s in (f"conv-{i}" for i in range(8)):
        home = await where(s)
        assert len(home) == 1, f"session {s} went to {home}"
        homes[s] = home.pop()
    assert len(set(homes.values())) >= 2, "sessions should spread over replicas"
    # Without the header: load-balanced over every replica.
    spread: Counter[str] = Counter()
    for _ in range(4):
        spread.update(await where(None, 10))
    assert len(spread) == 3

    # Drain the home of one session: its sessions move, the others stay.
    s, home = next(iter(homes.items()))
    drained = reps[home]
    others = [e for e in (e0, e1, e2) if e is not drained]
    gw.cp.publisher.set_endpoints(
        "m", [drained.endpoint("m", draining=True), *(e.endpoint("m") for e in others)])
    await healthy(gw, affinity_cluster_name("m"), 2)
    moved = await where(s)
    assert len(moved) == 1 and home not in moved
    for other, h in homes.items():
        if h != home:
            assert await where(other, 2) == {h}, "a session on a healthy replica moved"
    # Lose the new home too (gone from EDS): the session moves again, and sticks.
    new_home = reps[moved.pop()]
    last = [e for e in others if e is not new_home]
    gw.cp.publisher.set_endpoints("m", [e.endpoint("m") for e in last])
    await healthy(gw, affinity_cluster_name("m"), 1)
    assert await where(s) == {last[0].replica_id}
