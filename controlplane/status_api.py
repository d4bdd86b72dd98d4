"""The control plane's HTTP status API: /status (JSON) and /metrics (Prometheus).

Owns the read-only view operators and `llmgw status` use: catalog models, published
endpoints, snapshot versions, and every Envoy's last ACK and NACK. Everything it
returns is built from immutable snapshots; it never changes state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from controlplane.publisher import Publisher
from xds.server import AdsServer
from xds.snapshot import SHORT


def status_document(publisher: Publisher, ads: AdsServer) -> dict[str, Any]:
    live, closed = ads.clients.snapshot()
    snap = ads.cache.snapshot
    eps = publisher.endpoints()
    return {
        "models": [
            {
                "name": m.name,
                "aliases": list(m.aliases),
                "endpoints": [
                    {"address": e.address, "replica_id": e.replica_id, "draining": e.draining}
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
    }


def make_app(document: Callable[[], dict[str, Any]]) -> web.Application:
    async def status(_: web.Request) -> web.Response:
        return web.json_response(document())

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    return app


async def start_api(document: Callable[[], dict[str, Any]], host: str,
                    port: int) -> tuple[web.AppRunner, int]:
    """Serve the API; return the runner (to clean up) and the bound port."""
    runner = web.AppRunner(make_app(document), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=False)
    await site.start()
    server = site._server
    bound = port
    if server is not None and server.sockets:  # type: ignore[attr-defined]
        bound = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    return runner, bound
