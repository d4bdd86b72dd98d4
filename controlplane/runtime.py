"""The control plane as one object: agents, inventory, reconciler, publisher, xDS, API.

Owns start-up and shutdown order, so the CLI, the demo and in-process tests run the
same thing. Long-running pieces are tasks owned here; an exception in one is logged and
marks the control plane failed instead of being lost. After a restart the reconciler
and the publisher wait for the start-up gate (agents re-registered or grace over), so
neither Envoy nor the fleet sees a control plane that "forgot" its replicas.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from controlplane import metrics
from controlplane.agent_server import AgentAuth, AgentServer
from controlplane.autoscaler import Autoscaler
from controlplane.catalog import Catalog
from controlplane.catalog_watch import CatalogWatcher
from controlplane.fleet_source import InventorySource
from controlplane.inventory import Inventory
from controlplane.load_poller import LoadPoller
from controlplane.load_weights import LoadWeights
from controlplane.publisher import EndpointSource, Publisher
from controlplane.reconciler import Reconciler
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
        catalog_path: Path | None = None,
        startup_grace_s: float = 0.0,
        state_dir: Path | None = None,
        resync_s: float = 1.0,
        expected_nodes: Sequence[str] = (),
        reconcile: bool = True,
        load_interval_s: float = 1.0,
        weight_min_interval_s: float = 2.0,
    ) -> None:
        self.cache = SnapshotCache()
        self.ads = AdsServer(self.cache)
        self.publisher = Publisher(self.cache, catalog)
        self.inventory = inventory or Inventory()
        self._xds = xds
        self._api = api
        self._sources = list(sources)
        self._creds = xds_credentials
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.failed = asyncio.Event()
        self.xds_port = 0
        self.api_port = 0
        self.agents_port = 0
        self._agents_addr = agents
        self.agents: AgentServer | None = None
        self.reconciler: Reconciler | None = None
        self.fleet: InventorySource | None = None
        self.state_dir = state_dir
        if agents is not None:
            if agent_auth is None:
                raise ValueError("an agent server needs AgentAuth (a token at least)")
            self.agents = AgentServer(self.inventory, agent_auth, lease_s=lease_s)
            if reconcile:
                self.reconciler = Reconciler(self.inventory, lambda: self.publisher.catalog,
                                             resync_s=resync_s)
            self.fleet = InventorySource(self.inventory, startup_grace_s=startup_grace_s,
                                         expected_nodes=expected_nodes or self._known_nodes())
            self._sources.append(self.fleet)
        self.watcher = (CatalogWatcher(catalog_path, self.set_catalog)
                        if catalog_path is not None else None)
        # Engine load: polled from each replica's /metrics, never in the request path.
        self.load: LoadPoller | None = None
        self.weights: LoadWeights | None = None
        self.autoscaler: Autoscaler | None = None
        if load_interval_s > 0:
            self.load = LoadPoller(self.publisher.endpoints, interval_s=load_interval_s,
                                   timeout_s=min(1.0, load_interval_s))
            self.weights = LoadWeights(self.publisher.set_weights, enabled=self._weighted,
                                       min_interval_s=weight_min_interval_s)
            self.load.add_listener(self.weights)
            if self.reconciler is not None:
                self.autoscaler = Autoscaler(lambda: self.publisher.catalog,
                                             self._autoscale_targets, self._scale_to)
                self.load.add_listener(self.autoscaler)
        metrics.track(self)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._spawn(self.inventory.run(), "inventory")
        if self.agents is not None and self._agents_addr is not None:
            self.agents_port = await self.agents.start(*self._agents_addr)
        if self.fleet is None:
            self.publisher.publish()
        self.xds_port = await self.ads.start(*self._xds, credentials=self._creds)
        if self._api is not None:
            self._runner, self.api_port = await start_api(self.status, self.command,
                                                          *self._api)
            log.info("status API on http://%s:%d/status (metrics at /metrics)",
                     self._api[0], self.api_port)
        for src in self._sources:
            self._spawn(src.run(self.publisher), f"endpoint source {type(src).__name__}")
        if self.reconciler is not None:
            self._spawn(self._reconcile(), "reconciler")
        if self.watcher is not None:
            self._spawn(self.watcher.run(), "catalog watcher")
        if self.load is not None:
            self._spawn(self.load.run(), "load poller")
        if self.state_dir is not None:
            self._spawn(self._remember_nodes(), "node list writer")

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            # Bounded: a task that does not end on cancel is named, not waited on forever.
            _, stuck = await asyncio.wait(self._tasks, timeout=5)
            for t in stuck:
                log.error("task %s did not stop within 5 s of shutdown", t.get_name())
        self._tasks.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.agents is not None:
            await self.agents.stop()
        await self.ads.stop()

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        async def guard() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s failed", what)
                self.failed.set()

        self._tasks.append(asyncio.create_task(guard(), name=what))

    async def _reconcile(self) -> None:
        assert self.reconciler is not None and self.agents is not None and self.fleet
        # After a restart, act only on a fleet that has re-reported.
        await self.fleet.gate_open.wait()
        await self.reconciler.run(self.agents.start_replica, self.agents.drain_replica,
                                  self.agents.stop_replica)

    # ------------------------------------------------------------------ catalog

    def set_catalog(self, catalog: Catalog) -> None:
        self.publisher.set_catalog(catalog)
        if self.reconciler is not None:
            # A model no longer autoscaled keeps its count, no longer the scaler's wish.
            for m in catalog.models:
                if m.autoscale is None:
                    self.reconciler.desired.pop(m.name, None)
        if self.fleet is not None:
            self.fleet.publish(self.publisher)
        if self.reconciler is not None:
            self.reconciler.trigger()

    # ------------------------------------------------------------------ load

    def _weighted(self, model: str) -> bool:
        m = self.publisher.catalog.model(model)
        return m is not None and m.routing.load_balancing == "weighted"

    def _autoscale_targets(self) -> dict[str, int]:
        assert self.reconciler is not None
        return {m.name: self.reconciler.target(m) for m in self.publisher.catalog.models}

    def _scale_to(self, model: str, replicas: int) -> None:
        assert self.reconciler is not None
        self.reconciler.desired[model] = replicas
        self.reconciler.trigger()

    # ------------------------------------------------------------------ known nodes

    def _nodes_file(self) -> Path | None:
        return None if self.state_dir is None else self.state_dir / "nodes.json"

    def _known_nodes(self) -> list[str]:
        f = self._nodes_file()
        if f is None:
            return []
        try:
            names = json.loads(f.read_text())
        except (OSError, ValueError):
            return []
        return [n for n in names if isinstance(n, str)]

    async def _remember_nodes(self) -> None:
        f = self._nodes_file()
        assert f is not None
        f.parent.mkdir(parents=True, exist_ok=True)
        written: list[str] = []
        version = -1
        while True:
            view = await self.inventory.wait_newer(version)
            version = view.version
            names = [n.name for n in view.nodes]
            if names != written:
                f.write_text(json.dumps(names))
                written = names

    # ------------------------------------------------------------------ API

    def status(self) -> dict[str, Any]:
        return status_document(self.publisher, self.ads, self.inventory.view(),
                               self.reconciler, self.watcher,
                               load=self.load.view if self.load else None,
                               autoscaler=self.autoscaler)

    def command(self, verb: str, node: str) -> tuple[int, str]:
        """Operator commands from the API: cordon (drain) and uncordon a node."""
        if self.reconciler is None:
            return 409, "this control plane runs no reconciler (no agents)"
        if self.inventory.view().node(node) is None:
            return 404, f"unknown node {node!r}"
        if verb == "drain":
            self.reconciler.cordon(node)
            return 200, f"node {node} cordoned: replicas move elsewhere, then drain"
        if verb == "uncordon":
            self.reconciler.uncordon(node)
            return 200, f"node {node} accepts replicas again"
        return 400, f"unknown command {verb!r}"
