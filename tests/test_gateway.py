"""End to end: a real Envoy driven by our ADS server, real engine processes, both modes."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections import Counter

import aiohttp
import pytest
from prometheus_client import REGISTRY
from rich.console import Console

from controlplane.catalog import parse_catalog
from controlplane.envoy_proc import EnvoyError
from controlplane.status_api import status_document
from controlplane.status_view import render_status
from xds.server import AdsServer
from xds.snapshot import CLUSTER, LISTENER, Resource, build_snapshot, make_snapshot
from xds.translate import build_cluster, cluster_name

from .conftest import EngineProc, Gateway, GatewayFactory, wait_for

pytestmark = pytest.mark.slow

CATALOG = """
models:
  - name: model-a
    aliases: [alpha]
  - name: model-b
  - name: model-c
"""
A, B, C = cluster_name("model-a"), cluster_name("model-b"), cluster_name("model-c")


async def hosts_are(gw: Gateway, cluster: str, ports: set[int], timeout: float = 10) -> None:
    async def check() -> bool:
        got = {int(h.address.rsplit(":", 1)[1]) for h in await gw.envoy.hosts(cluster)}
        return got == ports

    await wait_for(check, timeout, f"{cluster} to have hosts {sorted(ports)}")


async def healthy(gw: Gateway, cluster: str, n: int, timeout: float = 10) -> None:
    async def check() -> bool:
        hs = await gw.envoy.hosts(cluster)
        ok = [h for h in hs if not h.failed_active_hc and not h.failed_outlier_check
              and h.eds_health != "DRAINING"]
        return len(ok) == n

    await wait_for(check, timeout, f"{n} healthy hosts in {cluster}")


async def basic(gateway: GatewayFactory, engines: list[EngineProc]) -> Gateway:
    e0, e1, e2, _ = engines
    gw = await gateway(CATALOG, [e0.endpoint("model-a"), e1.endpoint("model-a"),
                                 e2.endpoint("model-b")])
    await hosts_are(gw, A, {e0.port, e1.port})
    await hosts_are(gw, B, {e2.port})
    await healthy(gw, A, 2)
    return gw


# ------------------------------------------------------------------ 1. routing


async def test_routes_by_model_and_alias_and_shares_load(
    gateway: GatewayFactory, engines: list[EngineProc]
) -> None:
    gw = await basic(gateway, engines)
    e0, e1, e2, _ = engines
    status, body, replica = await gw.chat("model-b")
    assert status == 200 and replica == e2.replica_id, body

    async def staggered(i: int, model: str) -> tuple[int, object, str]:
        # Arrivals a few ms apart, as real traffic: Envoy counts a request as active
        # on a host once it is sent, so a burst of same-instant arrivals sees ties.
        await asyncio.sleep(0.01 * i)
        return await gw.chat(model, max_tokens=30)

    results = await asyncio.gather(*(staggered(i, m)
                                     for i, m in enumerate(["model-a", "alpha"] * 10)))
    assert all(s == 200 for s, _, _ in results), results
    share = Counter(r for _, _, r in results)
    assert set(share) == {e0.replica_id, e1.replica_id}
    # Least-request spreads 20 concurrent requests over both replicas.
    assert min(share.values()) >= 4, share


async def test_stream_first_chunk_arrives_while_generating(
    gateway: GatewayFactory, engines: list[EngineProc]
) -> None:
    gw = await basic(gateway, engines)
    body = {"model": "model-b", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 60, "stream": True}
    arrivals: list[float] = []
    chunks: list[bytes] = []
    async with gw.session.post(gw.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.content:
            if line.startswith(b"data: "):
                arrivals.append(time.monotonic())
                chunks.append(line)
    assert chunks[-1].strip() == b"data: [DONE]" and len(chunks) == 61
    # 60 tokens at 100 tokens/s: ~0.6 s of generation. A buffering proxy would deliver
    # everything at once; here the first chunk comes long before the last.
    assert arrivals[-1] - arrivals[0] > 0.3, arrivals[-1] - arrivals[0]


# ------------------------------------------------------------------ 2. endpoint updates


async def test_endpoint_change_is_eds_only_and_keeps_host_state(
    gateway: GatewayFactory, engines: list[EngineProc]
) -> None:
    e0, e1, e2, e3 = engines
    gw = await basic(gateway, engines)
    # model-c gets e3 which answers 500: outlier detection ejects it.
    e3.fault(error_rate=1.0)
    pub = gw.cp.publisher
    pub.set_endpoints("model-c", [e3.endpoint("model-c"), e2.endpoint("model-c")])
    await hosts_are(gw, C, {e3.port, e2.port})

    async def e3_ejected() -> bool:
        await gw.chat("model-c")
        return any(h.failed_outlier_check for h in await gw.envoy.hosts(C)
                   if h.address.endswith(f":{e3.port}"))

    await wait_for(e3_ejected, 15, "e3 to be ejected by outlier detection")
    cds_before = await gw.envoy.stat("cluster_manager.cds.update_success")
    modified_before = await gw.envoy.stat("cluster_manager.cluster_modified")
    eds_before = await gw.envoy.stat(f"cluster.{A}.update_success")
    pushes_before = gw.cp.ads.stats().pushes
    total_before = {h.address: h.rq_total for h in await gw.envoy.hosts(A)}

    # A long stream on model-a while e1 is removed and e3 is added to model-c.
    body = {"model": "model-a", "messages": [], "max_tokens": 80, "stream": True}
    async with gw.session.post(gw.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        serving = r.headers["x-llmgw-replica"]
        keep = e0 if serving == e0.replica_id else e1
        drop = e1 if keep is e0 else e0
        pub.set_endpoints("model-a", [keep.endpoint("model-a")])
        pub.set_endpoints("model-c", [e3.endpoint("model-c"), e2.endpoint("model-c"),
                                      e0.endpoint("model-c")])
        await hosts_are(gw, A, {keep.port})
        data = await r.read()
    assert data.rstrip().endswith(b"data: [DONE]"), "in-flight stream was cut"
    await hosts_are(gw, C, {e3.port, e2.port, e0.port})

    assert await gw.envoy.stat("cluster_manager.cds.update_success") == cds_before
    assert await gw.envoy.stat("cluster_manager.cluster_modified") == modified_before
    assert await gw.envoy.stat(f"cluster.{A}.update_success") > eds_before
    pushes = gw.cp.ads.stats().pushes
    assert pushes.get("cds") == pushes_before.get("cds")
    # Two changes, published back to back, may go out in one EDS response.
    assert 1 <= pushes["eds"] - pushes_before["eds"] <= 2
    assert pushes.get("lds") == pushes_before.get("lds")
    assert pushes.get("rds") == pushes_before.get("rds")
    # The surviving host kept its counters; the ejected one is still ejected.
    after = {h.address: h.rq_total for h in await gw.envoy.hosts(A)}
    assert after[f"127.0.0.1:{keep.port}"] >= total_before[f"127.0.0.1:{keep.port}"] + 1
    assert drop.port not in {int(a.rsplit(":", 1)[1]) for a in after}
    ejected = [h for h in await gw.envoy.hosts(C) if h.address.endswith(f":{e3.port}")]
    assert ejected and ejected[0].failed_outlier_check


# ------------------------------------------------------------------ 3. no-op publish


async def test_identical_republish_sends_nothing(
    gateway: GatewayFactory, engines: list[EngineProc]
) -> None:
    gw = await basic(gateway, engines)
    e0, e1, e2, _ = engines
    before = gw.cp.ads.stats().pushes
    envoy_before = await gw.envoy.stats(r"update_(attempt|success)$")
    assert gw.cp.publisher.publish() is False
    rebuilt = build_snapshot(gw.cp.publisher.catalog,
                             [e0.endpoint("model-a"), e1.endpoint("model-a"),
                              e2.endpoint("model-b")])
    assert gw.cp.cache.set_snapshot(rebuilt) is False
    assert gw.cp.publisher.set_endpoints("model-b", [e2.endpoint("model-b")]) is False
    # A real change afterwards: the stream is ordered, so once it arrives anything the
    # no-ops had sent would have arrived too.
    gw.cp.publisher.set_endpoints("model-c", [e2.endpoint("model-c")])
    await hosts_are(gw, C, {e2.port})
    after = gw.cp.ads.stats().pushes
    assert {k: after[k] - before.get(k, 0) for k in after} == {
        "cds": 0, "eds": 1, "lds": 0, "rds": 0}
    envoy_after = await gw.envoy.stats(r"update_(attempt|success)$")
    moved = {k for k in envoy_after if envoy_after[k] != envoy_before.get(k)}
    assert moved == {f"cluster.{C}.update_attempt", f"cluster.{C}.update_success"}, moved


# ------------------------------------------------------------------ 4. NACK


async def test_nack_is_surfaced_and_envoy_keeps_last_good(
    gateway: GatewayFactory, engines: list[EngineProc], caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    caplog.set_level(logging.ERROR, logger="llmgw.xds")
    gw = await basic(gateway, engines)
    snap = gw.cp.cache.snapshot
    assert snap is not None
    # A cluster Envoy must refuse: an ejection percentage above 100.
    bad = build_cluster(snap.catalog.models[0])
    assert bad.outlier_detection is not None
    bad.outlier_detection.max_ejection_percent = 250
    resources = {t: dict(snap.of_type(t)) for t in snap.resources}
    resources[CLUSTER][A] = Resource.of(CLUSTER, A, bad)
    nacks_metric = REGISTRY.get_sample_value("llmgw_xds_nacks_total",
                                             {"type": "cds", "mode": mode}) or 0
    bad_snap = make_snapshot(resources, snap.catalog, snap.route_clusters)
    gw.cp.cache.set_snapshot(bad_snap)

    async def nacked() -> bool:
        return gw.cp.ads.stats().nacks >= 1

    await wait_for(nacked, 10, "Envoy to NACK the bad cluster")
    (client,), _ = gw.cp.ads.clients.snapshot()
    nack = client.types[CLUSTER].last_nack
    assert nack is not None and "max_ejection_percent" in nack.message
    assert any("NACK from Envoy" in r.getMessage() and "max_ejection_percent" in r.getMessage()
               for r in caplog.records)
    assert REGISTRY.get_sample_value("llmgw_xds_nacks_total",
                                     {"type": "cds", "mode": mode}) == nacks_metric + 1
    assert await gw.envoy.stat("cluster_manager.cds.update_rejected") == 1
    # Envoy keeps serving with its last good config.
    status, body, _ = await gw.chat("model-a")
    assert status == 200, body
    # Status shows it, in JSON and in the terminal view.
    doc = status_document(gw.cp.publisher, gw.cp.ads)
    assert "max_ejection_percent" in json.dumps(doc)
    console = Console(record=True, width=250)
    render_status(doc, console)
    assert "max_ejection_percent" in console.export_text()
    # Not re-sent: an unrelated endpoint change on top of the rejected snapshot goes
    # out as EDS only; the rejected cluster is not pushed again.
    cds_pushes = gw.cp.ads.stats().pushes["cds"]
    e2 = engines[2]
    gw.cp.cache.set_snapshot(bad_snap.with_endpoints("model-c", [e2.endpoint("model-c")]))
    await hosts_are(gw, C, {e2.port})
    assert gw.cp.ads.stats().pushes["cds"] == cds_pushes
    assert gw.cp.ads.stats().nacks == 1


# ------------------------------------------------------------------ 5. restart


async def test_xds_restart_keeps_serving_and_resyncs_without_removals(
    gateway: GatewayFactory, engines: list[EngineProc]
) -> None:
    gw = await basic(gateway, engines)
    failures: list[object] = []
    done = asyncio.Event()

    async def traffic() -> int:
        n = 0
        while not done.is_set():
            status, body, _ = await gw.chat("alpha")
            if status != 200:
                failures.append((status, body))
            n += 1
        return n

    load = asyncio.create_task(traffic())
    hosts_before = {h.address for h in await gw.envoy.hosts(A)}
    modified = await gw.envoy.stat("cluster_manager.cluster_modified")
    port = gw.cp.xds_port
    await gw.cp.ads.stop(grace=0)

    async def disconnected() -> bool:
        return await gw.envoy.stat("control_plane.connected_state") == 0

    await wait_for(disconnected, 10, "Envoy to notice the control plane is gone")
    served_while_down = await gw.envoy.stat(f"cluster.{A}.upstream_rq_total")
    new = AdsServer(gw.cp.cache)
    await new.start("127.0.0.1", port)
    gw.cp.ads = new

    async def reconnected() -> bool:
        return (await gw.envoy.stat("control_plane.connected_state") == 1
                and len(new.clients.snapshot()[0]) == 1)

    await wait_for(reconnected, 30, "Envoy to reconnect to the new xDS server")
    # Let the resync finish: Envoy has asked for every type again.
    await wait_for(lambda: _asked_all(new), 10, "Envoy to re-subscribe to every type")
    await wait_for(lambda: _served_more(gw, served_while_down), 10, "more traffic")
    done.set()
    total = await load
    assert failures == [], failures[:5]
    assert total > 0
    assert {h.address for h in await gw.envoy.hosts(A)} == hosts_before
    assert await gw.envoy.stat("cluster_manager.cluster_modified") == modified
    # Identical content: the new server had nothing to send.
    assert new.stats().pushes == {}


async def _asked_all(server: AdsServer) -> bool:
    (c,), _ = server.clients.snapshot()
    return len(c.types) == 4 and all(t.requests >= 1 for t in c.types.values())


async def _served_more(gw: Gateway, than: int) -> bool:
    return await gw.envoy.stat(f"cluster.{A}.upstream_rq_total") > than + 5


# ------------------------------------------------------------------ 6. errors


@pytest.mark.parametrize(
    "method,path,body,ctype,status,code",
    [
        ("POST", "/v1/chat/completions", {"model": "nope"}, "json", 404, "model_not_found"),
        ("POST", "/v1/chat/completions", "{not json", "application/json", 400, "invalid_json"),
        # `curl -d` sends valid JSON as a form: refused with the content type named.
        ("POST", "/v1/chat/completions", '{"model": "model-a"}',
         "application/x-www-form-urlencoded", 400, "invalid_json"),
        ("POST", "/v1/chat/completions", {"messages": []}, "json", 400, "missing_model"),
        ("POST", "/v1/chat/completions", [1, 2], "json", 400, "missing_model"),
        ("GET", "/v1/chat/completions", None, None, 400, "missing_model"),
        ("POST", "/nope", {"model": "model-a"}, "json", 404, "unknown_url"),
        ("POST", "/v1/completions", {"model": "model-c"}, "json", 503, "no_healthy_upstream"),
        ("POST", "/v1/completions", {"model": "model-d"}, "json", 503, "no_healthy_upstream"),
    ],
)
async def test_openai_errors(
    gateway: GatewayFactory, engines: list[EngineProc], method: str, path: str,
    body: object, ctype: str | None, status: int, code: str,
) -> None:
    e0, e1, e2, _ = engines
    cat = CATALOG + "  - name: model-d\n"
    gw = await gateway(cat, [e0.endpoint("model-a"), e2.endpoint("model-d", draining=True)])
    await hosts_are(gw, cluster_name("model-d"), {e2.port})
    kw: dict[str, object] = {}
    if ctype == "json":
        kw["json"] = body
    elif body is not None:
        kw["data"] = body
        kw["headers"] = {"content-type": ctype}
    async with gw.session.request(method, gw.url + path,
                                  timeout=aiohttp.ClientTimeout(total=5), **kw) as r:
        assert r.status == status
        assert r.headers["content-type"].startswith("application/json")
        doc = await r.json()
    assert doc["error"]["code"] == code and doc["error"]["message"]
    assert doc["error"]["type"] in ("invalid_request_error", "server_error")
    if code == "model_not_found":
        assert "'nope'" in doc["error"]["message"]
    if code == "invalid_json":
        assert "content-type: application/json" in doc["error"]["message"]


async def test_models_list_is_served_by_envoy(
    gateway: GatewayFactory, engines: list[EngineProc]
) -> None:
    gw = await basic(gateway, engines)
    async with gw.session.get(gw.url + "/v1/models") as r:
        assert r.status == 200 and r.headers["content-type"] == "application/json"
        ids = [d["id"] for d in (await r.json())["data"]]
    assert ids == ["model-a", "alpha", "model-b", "model-c"]
    # Kept current over xDS: a new alias shows up.
    cat = parse_catalog(CATALOG.replace("[alpha]", "[alpha, a2]"))
    listener = gw.cp.publisher.catalog.listener
    gw.cp.publisher.set_catalog(cat.model_copy(update={"listener": listener}))

    async def listed() -> bool:
        async with gw.session.get(gw.url + "/v1/models") as r:
            return "a2" in [d["id"] for d in (await r.json())["data"]]

    await wait_for(listed, 10, "the new alias in /v1/models")
    status, _, _ = await gw.chat("a2")
    assert status == 200


async def test_models_list_of_a_large_catalog(
    gateway: GatewayFactory, engines: list[EngineProc]
) -> None:
    cat = "models:\n" + "".join(f"  - {{name: model-{i:03d}, aliases: [alias-{i:03d}]}}\n"
                                for i in range(150))
    gw = await gateway(cat, [])
    async with gw.session.get(gw.url + "/v1/models") as r:
        assert r.status == 200
        assert len((await r.json())["data"]) == 300
    assert gw.cp.ads.stats().nacks == 0


# ------------------------------------------------------------------ 7. cluster change


async def test_cluster_change_applies_fast_and_old_cluster_serves(
    gateway: GatewayFactory, engines: list[EngineProc]
) -> None:
    gw = await basic(gateway, engines)
    failures: list[object] = []
    done = asyncio.Event()

    async def traffic() -> None:
        while not done.is_set():
            status, body, _ = await gw.chat("model-a")
            if status != 200:
                failures.append((status, body))

    load = asyncio.create_task(traffic())
    modified = await gw.envoy.stat("cluster_manager.cluster_modified")
    cat = gw.cp.publisher.catalog
    m = cat.models[0]
    changed = m.model_copy(update={"routing": m.routing.model_copy(update={"max_requests": 777})})
    new_cat = cat.model_copy(update={"models": (changed, *cat.models[1:])})
    gw.cp.publisher.set_catalog(new_cat)

    async def applied() -> bool:
        return (await gw.envoy.stat("cluster_manager.cluster_modified") == modified + 1
                and await gw.envoy.stat("cluster_manager.warming_clusters") == 0)

    took = await wait_for(applied, 10, "the changed cluster to be active", interval=0.005)
    done.set()
    await load
    print(f"cluster change active after {took * 1000:.0f} ms")
    # Well under Envoy's 15 s initial-fetch timeout (bench/ measures it precisely).
    assert took < 5.0
    assert failures == [], failures[:5]
    dump_url = gw.envoy.admin_url + "/config_dump?resource=dynamic_active_clusters"
    async with gw.session.get(dump_url) as r:
        dump = await r.text()
    assert '"max_requests": 777' in dump


# ------------------------------------------------------------------ 8. sizes and ports


async def test_large_prompt_is_routed_and_oversized_gets_413(
    gateway: GatewayFactory, engines: list[EngineProc]
) -> None:
    e0, e1, e2, _ = engines
    cat = "listener: {max_request_bytes: 4194304}\n" + CATALOG
    gw = await gateway(cat, [e2.endpoint("model-b")])
    await hosts_are(gw, B, {e2.port})
    big = "x" * (2 * 1024 * 1024)
    status, body, replica = await gw.chat("model-b", messages=[{"role": "user", "content": big}])
    assert status == 200 and replica == e2.replica_id
    huge = "x" * (5 * 1024 * 1024)
    status, body, _ = await gw.chat("model-b", messages=[{"role": "user", "content": huge}])
    assert status == 413
    assert isinstance(body, dict) and body["error"]["code"] == "request_too_large"


async def test_listener_port_in_use_fails_loudly(
    gateway: GatewayFactory, engines: list[EngineProc], mode: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        gw = await gateway(CATALOG, [], listener_port=port, wait_listener=False)
        with pytest.raises(EnvoyError, match="rejected the listener"):
            await gw.envoy.wait_listener(timeout=10)
        (client,), _ = gw.cp.ads.clients.snapshot()
        nack = client.types[LISTENER].last_nack
        assert nack is not None and "ddress already in use" in nack.message

