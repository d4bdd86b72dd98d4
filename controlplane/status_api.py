"""The control plane's HTTP API: /status (JSON), /metrics (Prometheus), node commands.

Owns the operator's view: catalog models with their published endpoints, nodes with
GPUs used and free, replicas by state, each replica's load and weight, the
reconciler's and the autoscaler's recent decisions and what could not be placed,
and every Envoy's last ACK and NACK. The document is built from immutable snapshots.
The only writes are `POST /nodes/{name}/drain|uncordon`, handed to the reconciler.
Binds loopback unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from controlplane.inventory import InventoryView
from controlplane.publisher import Publisher
from xds.server import AdsServer
from xds.snapshot import SHORT

if TYPE_CHECKING:
    from controlplane.autoscaler import Autoscaler
    from controlplane.catalog_watch import CatalogWatcher
    from controlplane.load_poller import LoadView
    from controlplane.reconciler import Reconciler


def _nodes(view: InventoryView) -> list[dict[str, Any]]:
    out = []
    for n in view.nodes:
        used = n.used_gpus
        out.append({
            "name": n.name, "state": str(n.state), "connected": n.connected,
            "address": n.address, "labels": dict(n.labels), "generation": n.generation,
            "returned_after_lost": n.returned_after_lost,
            "gpus": [{"index": g.index, "name": g.name, "memory_mb": g.memory_mb,
                      "uuid": g.uuid, "used": g.index in used} for g in n.gpus],
            "gpus_used": len(used), "gpus_free": len(n.gpus) - len(used),
            "replicas": [{"replica_id": r.replica_id, "model": r.model, "state": str(r.state),
                          "endpoint": f"{r.host}:{r.port}" if r.port else "",
                          "gpus": list(r.gpu_indices), "in_flight": r.in_flight,
                          "profile_hash": r.profile_hash, "stale": r.stale,
                          "message": r.message, "pid": r.pid}
                         for r in n.replicas],
        })
    return out


def status_document(publisher: Publisher, ads: AdsServer, view: InventoryView | None = None,
                    reconciler: Reconciler | None = None,
                    watcher: CatalogWatcher | None = None, load: LoadView | None = None,
                    autoscaler: Autoscaler | None = None) -> dict[str, Any]:
    live, closed = ads.clients.snapshot()
    snap = ads.cache.snapshot
    eps = publisher.endpoints()
    weights = publisher.weights()
    load = load or {}

    def endpoint(model: str, address: str) -> dict[str, Any]:
        r = load.get(address)
        out: dict[str, Any] = {"weight": weights.get(model, {}).get(address)}
        if r is not None:
            out["load"] = ({"running": r.running, "waiting": r.waiting, "kv_usage": r.kv_usage,
                            "ttft_s": r.ttft_s} if r.ok else {"error": r.error})
        return out

    doc: dict[str, Any] = {
        "models": [
            {
                "name": m.name,
                "aliases": list(m.aliases),
                "min_replicas": m.min_replicas,
                "max_replicas": m.max_replicas,
                "target": reconciler.target(m) if reconciler else m.min_replicas,
                "unplaced": (reconciler.unplaced.get(m.name, "") if reconciler else ""),
                "load_balancing": m.routing.load_balancing,
                "session_header": m.routing.session_header,
                "autoscale": m.autoscale is not None,
                "endpoints": [
                    {"address": e.address, "replica_id": e.replica_id, "draining": e.draining,
                     **endpoint(m.name, e.address)}
                    for e in eps.get(m.name, ())
                ],
            }
            for m in publisher.catalog.models
        ],
        "snapshot": None if snap is None else {SHORT[t]: v for t, v in snap.versions.items()},
        "xds": {
            "port": ads.port,
            "stats": ads.stats().__dict__,
            "envoys": [c.as_dict() for c in live],
            "recently_disconnected": [c.as_dict() for c in closed],
        },
        "nodes": _nodes(view) if view is not None else [],
    }
    if reconciler is not None:
        doc["cordoned"] = sorted(reconciler.cordoned)
        doc["decisions"] = [d.__dict__ for d in list(reconciler.decisions)[-30:]]
    if autoscaler is not None:
        doc["autoscaler"] = [d.__dict__ for d in list(autoscaler.decisions)[-30:]]
    if watcher is not None:
        doc["catalog"] = {"path": str(watcher.path), "reloads": watcher.applied,
                          "refused": watcher.refused, "last_error": watcher.last_error}
    return doc


def make_app(document: Callable[[], dict[str, Any]],
             command: Callable[[str, str], tuple[int, str]] | None = None) -> web.Application:
    async def status(_: web.Request) -> web.Response:
        return web.json_response(document())

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def node_command(req: web.Request) -> web.Response:
        if command is None:
            return web.json_response({"error": "no commands here"}, status=404)
        code, msg = command(req.match_info["verb"], req.match_info["name"])
        return web.json_response({"message": msg} if code < 400 else {"error": msg},
                                 status=code)

    app = web.Application()
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/nodes/{name}/{verb}", node_command)
    return app


async def start_api(document: Callable[[], dict[str, Any]],
                    command: Callable[[str, str], tuple[int, str]] | None, host: str,
                    port: int) -> tuple[web.AppRunner, int]:
    """Serve the API; return the runner (to clean up) and the bound port."""
    runner = web.AppRunner(make_app(document, command), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=False)
    await site.start()
    server = site._server
    bound = port
    if server is not None and server.sockets:  # type: ignore[attr-defined]
        bound = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    return runner, bound
