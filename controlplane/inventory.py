"""The fleet inventory: nodes, their GPUs and replicas, and each node's lifecycle.

Owns the only mutable record of what agents reported. One writer changes it: events go
through a queue and `apply` handles them one at a time (stream handlers never touch the
record). Readers get an `InventoryView`, a frozen value, and can wait for a newer one.
The clock is injected, so lifecycle rules (Ready -> Unreachable -> Lost) are tested in
milliseconds with a fake clock.

Rules:
- a node is Ready while its agent's stream is up and heartbeats arrive;
- Unreachable when the stream goes away or heartbeats stop for `unreachable_after`;
- Lost when nothing was heard for `lost_after`; back to Ready when it registers again;
- a second agent claiming a connected node's name is refused; a reconnect of the same
  agent must carry a higher generation; anything from an older stream is dropped;
- a status for a replica the node never reported and the control plane never started
  is refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum

log = logging.getLogger("llmgw.inventory")


class NodeState(StrEnum):
    READY = "Ready"
    UNREACHABLE = "Unreachable"
    LOST = "Lost"


class ReplicaState(StrEnum):
    REQUESTED = "requested"  # the control plane sent Start; no report yet
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


LIVE_STATES = frozenset({ReplicaState.REQUESTED, ReplicaState.STARTING, ReplicaState.READY,
                         ReplicaState.DRAINING})


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_mb: int


@dataclass(frozen=True)
class Replica:
    replica_id: str
    model: str
    state: ReplicaState
    host: str = ""
    port: int = 0
    in_flight: int = 0
    gpu_indices: tuple[int, ...] = ()
    profile_hash: str = ""
    message: str = ""
    pid: int = 0
    # Reported by a node that came back after Lost: replaced elsewhere meanwhile, so
    # never routed to again and stopped by the reconciler.
    stale: bool = False

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES


@dataclass(frozen=True)
class Node:
    name: str
    state: NodeState
    agent_id: str
    generation: int
    address: str
    labels: tuple[tuple[str, str], ...]
    gpus: tuple[Gpu, ...]
    replicas: tuple[Replica, ...]
    connected: bool
    last_seen: float
    state_since: float
    # Set when the node came back after being Lost: what it still runs is stale.
    returned_after_lost: bool = False

    def replica(self, replica_id: str) -> Replica | None:
        for r in self.replicas:
            if r.replica_id == replica_id:
                return r
        return None

    @property
    def used_gpus(self) -> frozenset[int]:
        return frozenset(i for r in self.replicas if r.live for i in r.gpu_indices)

    @property
    def free_gpus(self) -> tuple[Gpu, ...]:
        used = self.used_gpus
        return tuple(g for g in self.gpus if g.index not in used)


@dataclass(frozen=True)
class InventoryView:
    """An immutable picture of the fleet at one moment."""

    nodes: tuple[Node, ...] = ()
    version: int = 0

    def node(self, name: str) -> Node | None:
        for n in self.nodes:
            if n.name == name:
                return n
        return None


# ---------------------------------------------------------------------- events


@dataclass(frozen=True)
class Register:
    stream_id: int
    node: str
    agent_id: str
    generation: int
    address: str
    labels: tuple[tuple[str, str], ...]
    gpus: tuple[Gpu, ...]
    replicas: tuple[Replica, ...]


@dataclass(frozen=True)
class Heartbeat:
    stream_id: int
    node: str


@dataclass(frozen=True)
class Status:
    stream_id: int
    node: str
    replica: Replica


@dataclass(frozen=True)
class Disconnect:
    stream_id: int
    node: str


@dataclass(frozen=True)
class StartRequested:
    node: str
    replica: Replica


@dataclass(frozen=True)
class DrainRequested:
    """The control plane decided to drain a replica: it is DRAINING from now on."""

    node: str
    replica_id: str


@dataclass(frozen=True)
class Forget:
    """Drop a replica record (after it stopped and the control plane is done with it)."""

    node: str
    replica_id: str


@dataclass(frozen=True)
class Tick:
    pass


InventoryEvent = (Register | Heartbeat | Status | Disconnect | StartRequested | DrainRequested
                  | Forget | Tick)


class Rejected(Exception):
    """An event the inventory refuses; `code` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _NodeRecord:
    node: Node
    stream_id: int | None = None
    lost_at: float | None = None
    replicas: dict[str, Replica] = field(default_factory=dict)


class Inventory:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        unreachable_after: float = 5.0,
        lost_after: float = 30.0,
        tick_interval: float = 0.25,
    ) -> None:
        if lost_after <= unreachable_after:
            raise ValueError("lost_after must be longer than unreachable_after")
        self.clock = clock
        self.unreachable_after = unreachable_after
        self.lost_after = lost_after
        self.tick_interval = tick_interval
        self._records: dict[str, _NodeRecord] = {}
        self._view = InventoryView()
        self._queue: asyncio.Queue[tuple[InventoryEvent, asyncio.Future[None] | None]] = (
            asyncio.Queue()
        )
        self._changed = asyncio.Event()
        self.events_applied = 0

    # ------------------------------------------------------------------ reading

    def view(self) -> InventoryView:
        return self._view

    async def wait_newer(self, version: int) -> InventoryView:
        while self._view.version <= version:
            await self._changed.wait()
        return self._view

    # ------------------------------------------------------------------ writing

    async def submit(self, ev: InventoryEvent) -> None:
        """Queue an event for the writer and wait for its outcome (raises Rejected)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._queue.put((ev, fut))
        await fut

    def post(self, ev: InventoryEvent) -> None:
        """Queue an event without waiting for its outcome."""
        self._queue.put_nowait((ev, None))

    async def run(self) -> None:
        """The single writer: applies queued events, and ticks the lifecycle clock."""
        while True:
            # Not asyncio.wait_for: on 3.11 it can swallow a cancellation that arrives as
            # the queue hands over an item, and the writer would never stop (seen here).
            try:
                async with asyncio.timeout(self.tick_interval):
                    ev, fut = await self._queue.get()
            except TimeoutError:
                ev, fut = Tick(), None
            try:
                self.apply(ev)
            except Rejected as e:
                if fut is not None and not fut.done():
                    fut.set_exception(e)
                continue
            except Exception as e:  # a bug must not kill the writer or hang a stream
                log.exception("inventory failed to apply %r", ev)
                if fut is not None and not fut.done():
                    fut.set_exception(Rejected("INTERNAL", f"inventory error: {e}"))
                continue
            if fut is not None and not fut.done():
                fut.set_result(None)

    def apply(self, ev: InventoryEvent) -> None:
        """Apply one event (the writer; tests call it directly with a fake clock)."""
        now = self.clock()
        changed = False
        if isinstance(ev, Register):
            changed = self._register(ev, now)
        elif isinstance(ev, Heartbeat):
            changed = self._heartbeat(ev, now)
        elif isinstance(ev, Status):
            changed = self._status(ev, now)
        elif isinstance(ev, Disconnect):
            changed = self._disconnect(ev, now)
        elif isinstance(ev, StartRequested):
            rec = self._records.get(ev.node)
            if rec is None:
                raise Rejected("NOT_FOUND", f"unknown node {ev.node!r}")
            rec.replicas[ev.replica.replica_id] = ev.replica
            changed = True
        elif isinstance(ev, DrainRequested):
            changed = self._drain(ev)
        elif isinstance(ev, Forget):
            found = self._records.get(ev.node)
            changed = found is not None and found.replicas.pop(ev.replica_id, None) is not None
        changed = self._tick(now) or changed
        self.events_applied += 1
        if changed:
            self._publish()

    # ------------------------------------------------------------------ rules

    def _current(self, node: str, stream_id: int) -> _NodeRecord:
        rec = self._records.get(node)
        if rec is None:
            raise Rejected("FAILED_PRECONDITION", f"node {node!r} has not registered")
        if rec.stream_id != stream_id:
            raise Rejected("FAILED_PRECONDITION",
                           f"message for node {node!r} from an older stream: dropped")
        return rec

    def _register(self, ev: Register, now: float) -> bool:
        rec = self._records.get(ev.node)
        if rec is not None and rec.stream_id is not None:
            same_agent = rec.node.agent_id == ev.agent_id
            if not same_agent:
                raise Rejected("ALREADY_EXISTS",
                               f"node {ev.node!r} is already connected from another agent")
            if ev.generation <= rec.node.generation:
                raise Rejected("FAILED_PRECONDITION",
                               f"stale registration of {ev.node!r}: generation "
                               f"{ev.generation} <= {rec.node.generation}")
        returned = rec is not None and rec.node.state == NodeState.LOST
        replicas = {r.replica_id: replace(r, stale=returned or r.stale) for r in ev.replicas}
        if rec is not None and not returned:
            # Stale stays stale across reconnects.
            for rid, r in replicas.items():
                old = rec.replicas.get(rid)
                if old is not None and old.stale:
                    replicas[rid] = replace(r, stale=True)
        if rec is not None and not returned:
            # Keep what the control plane asked for and the agent has not reported yet.
            for rid, r in rec.replicas.items():
                if r.state == ReplicaState.REQUESTED and rid not in replicas:
                    replicas[rid] = r
        node = Node(
            name=ev.node, state=NodeState.READY, agent_id=ev.agent_id,
            generation=ev.generation, address=ev.address, labels=ev.labels, gpus=ev.gpus,
            replicas=(), connected=True, last_seen=now, state_since=now,
            returned_after_lost=returned,
        )
        if rec is None:
            log.info("node %s registered: %d GPUs, %d replicas", ev.node, len(ev.gpus),
                     len(ev.replicas))
        elif returned:
            log.warning("node %s is back after being Lost: its %d running replicas are "
                        "stale", ev.node, len(ev.replicas))
        else:
            log.info("node %s re-registered (generation %d), %d replicas re-reported",
                     ev.node, ev.generation, len(ev.replicas))
        self._records[ev.node] = _NodeRecord(node, ev.stream_id, None, replicas)
        return True

    def _drain(self, ev: DrainRequested) -> bool:
        rec = self._records.get(ev.node)
        r = rec.replicas.get(ev.replica_id) if rec else None
        if rec is None or r is None or not r.live or r.state == ReplicaState.DRAINING:
            return False
        rec.replicas[ev.replica_id] = replace(r, state=ReplicaState.DRAINING)
        return True

    def _heartbeat(self, ev: Heartbeat, now: float) -> bool:
        rec = self._current(ev.node, ev.stream_id)
        if rec.node.state == NodeState.LOST:
            # Heard again on the same stream after Lost: what it runs was replaced
            # meanwhile, so it is stale.
            rec.node = replace(rec.node, returned_after_lost=True)
            for rid, r in rec.replicas.items():
                rec.replicas[rid] = replace(r, stale=True)
            log.warning("node %s is back after being Lost: its %d replicas are stale",
                        ev.node, len(rec.replicas))
        rec.node = replace(rec.node, last_seen=now)
        return self._set_state(rec, NodeState.READY, now, "heartbeat")

    def _disconnect(self, ev: Disconnect, now: float) -> bool:
        rec = self._records.get(ev.node)
        if rec is None or rec.stream_id != ev.stream_id:
            return False  # an older stream of a node that already reconnected
        rec.stream_id = None
        rec.node = replace(rec.node, connected=False)
        self._set_state(rec, NodeState.UNREACHABLE, now, "agent stream closed")
        return True

    def _status(self, ev: Status, now: float) -> bool:
        rec = self._current(ev.node, ev.stream_id)
        r = ev.replica
        if r.replica_id not in rec.replicas:
            if not r.live:
                # A late "stopped" for a replica the control plane already forgot.
                return False
            raise Rejected("INVALID_ARGUMENT",
                           f"unknown replica id {r.replica_id!r} on node {ev.node!r}")
        old = rec.replicas[r.replica_id]
        r = replace(r, stale=old.stale)
        if old.state == ReplicaState.DRAINING and r.state in (ReplicaState.STARTING,
                                                               ReplicaState.READY):
            # The agent has not seen the drain yet: it stays draining.
            r = replace(r, state=ReplicaState.DRAINING)
        rec.replicas[r.replica_id] = r
        rec.node = replace(rec.node, last_seen=now)
        if old.state != r.state:
            log.info("replica %s (%s) on %s: %s -> %s%s", r.replica_id, r.model, ev.node,
                     old.state, r.state, f" ({r.message})" if r.message else "")
        return old != r

    def _set_state(self, rec: _NodeRecord, state: NodeState, now: float, why: str) -> bool:
        if rec.node.state == state:
            return False
        if state == NodeState.LOST:
            rec.lost_at = now
        log.log(logging.WARNING if state != NodeState.READY else logging.INFO,
                "node %s: %s -> %s (%s)", rec.node.name, rec.node.state, state, why)
        rec.node = replace(rec.node, state=state, state_since=now)
        return True

    def _tick(self, now: float) -> bool:
        changed = False
        for rec in self._records.values():
            quiet = now - rec.node.last_seen
            st = rec.node.state
            if st == NodeState.READY and quiet > self.unreachable_after:
                changed |= self._set_state(rec, NodeState.UNREACHABLE, now,
                                           f"no heartbeat for {quiet:.1f}s")
                st = rec.node.state
            if st == NodeState.UNREACHABLE and quiet > self.lost_after:
                changed |= self._set_state(rec, NodeState.LOST, now,
                                           f"nothing heard for {quiet:.1f}s")
        return changed

    def _publish(self) -> None:
        nodes = []
        for name in sorted(self._records):
            rec = self._records[name]
            reps = tuple(rec.replicas[k] for k in sorted(rec.replicas))
            nodes.append(replace(rec.node, replicas=reps))
        self._view = InventoryView(tuple(nodes), self._view.version + 1)
        self._changed.set()
        self._changed = asyncio.Event()
