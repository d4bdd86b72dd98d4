"""The control plane as one object: ADS server, publisher, status API, endpoint sources.

Owns start-up and shutdown order, so the CLI, the demo and in-process tests run the
same thing. Sources run in an asyncio.TaskGroup-like set of tasks: an exception in one
is logged and stops the control plane rather than being lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
from aiohttp import web

from controlplane.agent_server import AgentAuth, AgentServer
from controlplane.catalog import Catalog
from controlplane.inventory import Inventory
from controlplane.publisher import EndpointSource, Publisher
from controlplane.status_api import start_api, status_document
from xds.cache import SnapshotCache
from xds.server import AdsServer

log = logging.getLogger("llmgw.controlplane")


class ControlPlane:
    def __init__(
        self,
        catalog: Catalog,
        *,
        xds: tuple[str, int] = ("127.0.0.1", 18000),
        api: tuple[str, int] | None = ("127.0.0.1", 18001),
        sources: Sequence[EndpointSource] = (),
        xds_credentials: grpc.ServerCredentials | None = None,
        agents: tuple[str, int] | None = None,
        agent_auth: AgentAuth | None = None,
        inventory: Inventory | None = None,
        lease_s: float = 30.0,
    ) -> None:
        self.cache = SnapshotCache()
        self.ads = AdsServer(self.cache)
        self.publisher = Publisher(self.cache, catalog)
        self._xds = xds
        self._api = api
        self._sources = list(sources)
        self._creds = xds_credentials
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.xds_port = 0
        self.api_port = 0
        self.failed = asyncio.Event()
        self.inventory = inventory or Inventory()
        self._agents_addr = agents
        self.agents: AgentServer | None = None
        if agents is not None:
            if agent_auth is None:
                raise ValueError("an agent server needs AgentAuth (a token at least)")
            self.agents = AgentServer(self.inventory, agent_auth, lease_s=lease_s)
        self.agents_port = 0

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self.inventory.run()))
        if self.agents is not None and self._agents_addr is not None:
            self.agents_port = await self.agents.start(*self._agents_addr)
        self.publisher.publish()
        self.xds_port = await self.ads.start(*self._xds, credentials=self._creds)
        if self._api is not None:
            self._runner, self.api_port = await start_api(
                lambda: status_document(self.publisher, self.ads), *self._api
            )
            log.info("status API on http://%s:%d/status (metrics at /metrics)",
                     self._api[0], self.api_port)
        for src in self._sources:
            self._tasks.append(asyncio.create_task(self._run_source(src)))

    async def _run_source(self, src: EndpointSource) -> None:
        try:
            await src.run(self.publisher)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("endpoint source %r failed", src)
            self.failed.set()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self.agents is not None:
            await self.agents.stop()
        await self.ads.stop()
