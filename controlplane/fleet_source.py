"""From inventory to Envoy: the Ready (and draining) replicas of each model as endpoints.

Owns the rule for what is routable: replicas Ready on nodes that are not Lost (an
Unreachable node keeps its endpoints while Envoy's own health checks still pass them:
data-path health is Envoy's call), draining ones as DRAINING, never a stale replica of a
node that came back after Lost. Also owns the start-up gate: after a control-plane
restart nothing is published until the agents have re-registered or a grace period
has passed, so Envoy never sees an empty fleet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from controlplane.catalog import Catalog
from controlplane.endpoints import Endpoint
from controlplane.inventory import Inventory, InventoryView, NodeState, ReplicaState
from controlplane.publisher import Publisher

log = logging.getLogger("llmgw.fleet")


def endpoints_from(view: InventoryView, catalog: Catalog) -> dict[str, list[Endpoint]]:
    out: dict[str, list[Endpoint]] = {m.name: [] for m in catalog.models}
    for node in view.nodes:
        if node.state == NodeState.LOST:
            continue
        for r in node.replicas:
            if r.stale or r.model not in out or not r.port:
                continue
            if r.state == ReplicaState.READY:
                out[r.model].append(Endpoint(r.model, r.host, r.port, r.replica_id))
            elif r.state == ReplicaState.DRAINING:
                out[r.model].append(Endpoint(r.model, r.host, r.port, r.replica_id,
                                             draining=True))
    return out


class InventorySource:
    def __init__(self, inventory: Inventory, *, startup_grace_s: float = 0.0,
                 expected_nodes: Iterable[str] = ()) -> None:
        self.inventory = inventory
        self.startup_grace_s = startup_grace_s
        self.expected = frozenset(expected_nodes)
        self.gate_open = asyncio.Event()

    async def _gate(self) -> None:
        if self.startup_grace_s <= 0:
            return
        deadline = time.monotonic() + self.startup_grace_s
        version = -1
        while True:
            view = self.inventory.view()
            seen = {n.name for n in view.nodes}
            if self.expected and self.expected <= seen:
                log.info("all %d known nodes re-registered: publishing", len(self.expected))
                return
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(self.expected - seen)
                log.info("start-up grace of %.0fs over: publishing%s", self.startup_grace_s,
                         f" without {missing}" if missing else "")
                return
            version = view.version
            waiter = asyncio.create_task(self.inventory.wait_newer(version))
            try:
                await asyncio.wait({waiter}, timeout=left)
            finally:
                waiter.cancel()

    async def run(self, publisher: Publisher) -> None:
        await self._gate()
        self.gate_open.set()
        publisher.publish()
        version = -1
        while True:
            view = self.inventory.view()
            if view.version == version:
                view = await self.inventory.wait_newer(version)
            version = view.version
            self.publish(publisher, view)

    def publish(self, publisher: Publisher, view: InventoryView | None = None) -> None:
        view = view or self.inventory.view()
        for model, eps in endpoints_from(view, publisher.catalog).items():
            publisher.set_endpoints(model, eps)
