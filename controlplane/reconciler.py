"""The reconciler: drives the fleet's actual replicas toward what the catalog wants.

Owns the decisions: start replicas up to a model's minimum (placement picks where),
drain those above its maximum, replace replicas whose profile changed (start the new
one, wait until it is Ready, then drain the old, so serving capacity never drops below
the minimum), move replicas off cordoned nodes the same way, rebuild a Lost node's
replicas on survivors, stop stale replicas of a node that came back after Lost, drain a
lower-priority replica when a higher-priority model cannot reach its minimum, and clean
up failed and stopped ones.

It is level-triggered: each pass reads the current catalog and inventory view and
computes actions from desired vs actual; it never acts on an event's payload. `decide`
does no I/O (tests call it with hand-made views); `run` executes its actions through
the agent server and the inventory's single writer. Every action carries its reason and
is logged and kept for `llmgw status`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from agents.pb.llmgw.agent.v1 import ReplicaSpec
from controlplane.catalog import Catalog, Model
from controlplane.inventory import (
    DrainRequested,
    Forget,
    Inventory,
    InventoryView,
    Node,
    NodeState,
    Rejected,
    Replica,
    ReplicaState,
)
from controlplane.metrics import RECONCILER_ACTIONS
from controlplane.placement import Evictable, NodeCapacity, Placement, Request, plan

log = logging.getLogger("llmgw.reconciler")


@dataclass(frozen=True)
class Start:
    node: str
    placement: Placement
    replica_id: str
    reason: str


@dataclass(frozen=True)
class Drain:
    node: str
    replica_id: str
    model: str
    timeout_s: float
    reason: str


@dataclass(frozen=True)
class Stop:
    node: str
    replica_id: str
    model: str
    reason: str


@dataclass(frozen=True)
class ForgetReplica:
    node: str
    replica_id: str
    reason: str


Action = Start | Drain | Stop | ForgetReplica


@dataclass(frozen=True)
class Decision:
    at: float
    action: str
    model: str
    node: str
    replica_id: str
    reason: str


def _replica_id(model: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-." else "-" for c in model)[:40]
    return f"{safe}-{uuid.uuid4().hex[:6]}"


@dataclass
class _Memory:
    """What the reconciler remembers between passes (never fleet state)."""

    # replica id -> when Start was sent (a REQUESTED replica that never shows up is
    # forgotten after start_timeout_s).
    requested_at: dict[str, float] = field(default_factory=dict)
    # (action kind, replica id) -> when it was last sent, so a pass does not repeat a
    # command the agent is still carrying out.
    sent: dict[tuple[str, str], float] = field(default_factory=dict)
    # Replicas being moved to restore spread (replaced like an outdated profile).
    moving: set[str] = field(default_factory=set)
    # A model's replica count the last time none of them was being replaced: what a
    # rollout or a move must keep.
    settled: dict[str, int] = field(default_factory=dict)


class Reconciler:
    def __init__(
        self,
        inventory: Inventory,
        catalog: Callable[[], Catalog],
        *,
        clock: Callable[[], float] = time.monotonic,
        resync_s: float = 1.0,
        resend_after_s: float = 10.0,
        request_timeout_s: float = 30.0,
    ) -> None:
        self.inventory = inventory
        self.catalog = catalog
        self.clock = clock
        self.resync_s = resync_s
        self.resend_after_s = resend_after_s
        self.request_timeout_s = request_timeout_s
        self.cordoned: set[str] = set()
        # The autoscaler's wish per model; without one, a model keeps the replicas it
        # has, within [min, max].
        self.desired: dict[str, int] = {}
        self.targets: dict[str, int] = {}
        self._mem = _Memory()
        self.decisions: deque[Decision] = deque(maxlen=200)
        self.unplaced: dict[str, str] = {}
        self._wake = asyncio.Event()
        self.passes = 0

    # ------------------------------------------------------------------ triggers

    def trigger(self) -> None:
        """Ask for a pass soon (catalog changed, node cordoned...)."""
        self._wake.set()

    def cordon(self, node: str) -> None:
        self.cordoned.add(node)
        log.info("node %s cordoned: its replicas move to other nodes", node)
        self.trigger()

    def uncordon(self, node: str) -> None:
        self.cordoned.discard(node)
        self.trigger()

    def target(self, m: Model, serving: int | None = None) -> int:
        """Replicas a model should have: the autoscaler's wish, else what it has now,
        held within [min_replicas, max_replicas]."""
        if serving is None:
            return self.targets.get(m.name, m.min_replicas)
        want = self.desired.get(m.name, serving)
        return max(m.min_replicas, min(m.max_replicas, want))

    # ------------------------------------------------------------------ deciding

    def decide(self, catalog: Catalog, view: InventoryView) -> list[Action]:
        now = self.clock()
        models = {m.name: m for m in catalog.models}
        actions: list[Action] = []
        connected = {n.name for n in view.nodes if n.connected and n.state != NodeState.LOST}
        counted: dict[str, list[tuple[Node, Replica]]] = {m: [] for m in models}
        for node in view.nodes:
            for r in node.replicas:
                actions += self._housekeeping(node, r, models, now)
                if (node.state != NodeState.LOST and r.model in models and r.live
                        and not r.stale and r.state != ReplicaState.DRAINING):
                    counted[r.model].append((node, r))
        placeable = [self._capacity(n, view, models) for n in view.nodes
                     if n.state == NodeState.READY and n.connected
                     and n.name not in self.cordoned]
        live_ids = {r.replica_id for pairs in counted.values() for _, r in pairs}
        self._mem.moving &= live_ids
        for name, m in models.items():
            if not any(self._outdated(m, n, r) for n, r in counted[name]):
                self._mem.settled[name] = len(counted[name])
            self._respread(m, counted[name], placeable)
        requests: list[Request] = []
        spare: dict[str, int] = {}
        for name, m in models.items():
            reqs, acts, above_min = self._model(m, counted[name])
            requests += reqs
            actions += acts
            spare[name] = above_min
        p = plan(requests, placeable, spare)
        for pl in p.placements:
            actions.append(Start(pl.node, pl, _replica_id(pl.model),
                                 f"{pl.model} below target: placed on {pl.node} GPUs "
                                 f"{list(pl.gpu_indices)} ({pl.profile.name})"))
        for ev in p.evictions:
            actions.append(Drain(ev.node, ev.replica_id, ev.model,
                                 models[ev.model].drain_timeout_s,
                                 f"making room for higher-priority {ev.for_model}"))
        self.unplaced = {m: why for m, why in p.unplaced}
        # Rolling updates stall when there is no room for a new replica: then retire
        # an old one, as long as serving capacity stays at the minimum.
        for name in dict.fromkeys(name for name, why in p.unplaced if "GPU" in why):
            m = models[name]
            drained = {a.replica_id for a in actions if isinstance(a, Drain)}
            serving = [r for _, r in counted[name]
                       if r.state == ReplicaState.READY and r.replica_id not in drained]
            old = [(n, r) for n, r in counted[name]
                   if self._outdated(m, n, r) and r.replica_id not in drained]
            if old and len(serving) - 1 >= m.min_replicas:
                n, r = sorted(old, key=lambda x: (x[1].state == ReplicaState.READY,
                                                  x[1].replica_id))[0]
                actions.append(Drain(n.name, r.replica_id, name, m.drain_timeout_s,
                                     "replacing it, and no free GPUs to start the new one "
                                     "first"))
        # Only nodes that can hear us get commands.
        return [a for a in actions if a.node in connected or isinstance(a, ForgetReplica)]

    def _outdated(self, m: Model, node: Node, r: Replica) -> bool:
        return (r.profile_hash not in m.profile_hashes or node.name in self.cordoned
                or r.replica_id in self._mem.moving)

    def _respread(self, m: Model, live: list[tuple[Node, Replica]],
                  placeable: list[NodeCapacity]) -> None:
        """Mark one replica to move when a node holds two of a model while another node
        that could run it holds none (replicas placed while nodes were still joining).
        The move is make-before-break, like a profile change."""
        if any(r.replica_id in self._mem.moving for _, r in live):
            return  # one move at a time per model
        if any(r.state != ReplicaState.READY or self._outdated(m, n, r) for n, r in live):
            return  # only a settled model is rebalanced
        per_node: dict[str, list[Replica]] = {}
        for n, r in live:
            per_node.setdefault(n.name, []).append(r)
        crowded = [name for name, rs in per_node.items() if len(rs) >= 2]
        if not crowded:
            return
        empty = [c for c in placeable if c.model_counts.get(m.name, 0) == 0
                 and all(c.labels.get(k) == v for k, v in m.pool.items())
                 and plan([Request(m, 1)], [c]).placements]
        if not empty:
            return
        worst = max(sorted(crowded), key=lambda name: len(per_node[name]))
        victim = sorted(per_node[worst], key=lambda r: r.replica_id)[-1]
        self._mem.moving.add(victim.replica_id)
        log.info("moving %s (%s) off %s to spread the model over nodes", victim.replica_id,
                 m.name, worst)

    def _model(self, m: Model, live: list[tuple[Node, Replica]]
               ) -> tuple[list[Request], list[Action], int]:
        current = [(n, r) for n, r in live if not self._outdated(m, n, r)]
        old = [(n, r) for n, r in live if self._outdated(m, n, r)]
        # Replacing old replicas keeps their number: during a rollout or a move the
        # count to hold is the one the model had when it was last settled.
        base = self._mem.settled.get(m.name, max(len(current), len(old)))
        target = self.target(m, base)
        self.targets[m.name] = target
        actions: list[Action] = []
        reqs: list[Request] = []
        need = target - len(current)
        if need > 0:
            reqs.append(Request(m, need, below_min=max(0, m.min_replicas - len(current))))
        elif need < 0:
            # Above target: retire replicas that are not serving first, then by name.
            extra = sorted(current, key=lambda x: (x[1].state == ReplicaState.READY,
                                                   x[1].replica_id))[: -need]
            for n, r in extra:
                actions.append(Drain(n.name, r.replica_id, m.name, m.drain_timeout_s,
                                     f"{m.name} has {len(current)} replicas, target {target}"))
            current = [x for x in current if x not in extra]
        ready_new = sum(1 for _, r in current if r.state == ReplicaState.READY)
        ready_old = [(n, r) for n, r in old if r.state == ReplicaState.READY]
        not_ready_old = [(n, r) for n, r in old if r.state != ReplicaState.READY]
        # Old replicas that do not serve can go at once; serving ones only while
        # enough Ready replicas remain.
        retire = list(not_ready_old)
        room = ready_new + len(ready_old) - max(target, m.min_replicas)
        retire += sorted(ready_old, key=lambda x: x[1].replica_id)[: max(0, room)]
        for n, r in retire:
            why = (f"node {n.name} is cordoned" if n.name in self.cordoned
                   else "moved to spread the model" if r.replica_id in self._mem.moving
                   else "its profile changed")
            actions.append(Drain(n.name, r.replica_id, m.name, m.drain_timeout_s,
                                 f"replaced: {why}"))
        above_min = max(0, len(current) - m.min_replicas)
        return reqs, actions, above_min

    def _housekeeping(self, node: Node, r: Replica, models: dict[str, Model],
                      now: float) -> list[Action]:
        if r.state == ReplicaState.STOPPED:
            return [ForgetReplica(node.name, r.replica_id, "stopped")]
        if r.state == ReplicaState.FAILED:
            # The agent cleans up; the control plane forgets it (and so replaces it).
            return [Stop(node.name, r.replica_id, r.model, f"failed: {r.message}"),
                    ForgetReplica(node.name, r.replica_id, "failed")]
        if r.state == ReplicaState.REQUESTED:
            since = self._mem.requested_at.setdefault(r.replica_id, now)
            if now - since > self.request_timeout_s:
                return [ForgetReplica(node.name, r.replica_id,
                                      f"no report {self.request_timeout_s:.0f}s after Start")]
            return []
        self._mem.requested_at.pop(r.replica_id, None)
        if r.stale and r.live:
            return [Stop(node.name, r.replica_id, r.model,
                         "stale: its node came back after being Lost")]
        if r.model not in models and r.live and r.state != ReplicaState.DRAINING:
            return [Drain(node.name, r.replica_id, r.model, 30.0,
                          f"model {r.model} is no longer in the catalog")]
        return []

    def _capacity(self, n: Node, view: InventoryView, models: dict[str, Model]) -> NodeCapacity:
        counts: dict[str, int] = {}
        evictable = []
        for r in n.replicas:
            if r.live and not r.stale:
                counts[r.model] = counts.get(r.model, 0) + 1
                m = models.get(r.model)
                if m is not None and r.state != ReplicaState.DRAINING:
                    evictable.append(Evictable(r.replica_id, r.model, m.priority, r.gpu_indices))
        return NodeCapacity(n.name, dict(n.labels), n.free_gpus, counts, n.gpus,
                            tuple(evictable))

    # ------------------------------------------------------------------ acting

    async def run(self, send_start: Callable[[str, ReplicaSpec], object],
                  send_drain: Callable[[str, str, float], bool],
                  send_stop: Callable[[str, str], bool]) -> None:
        version = -1
        while True:
            view = self.inventory.view()
            try:
                await self.reconcile_once(view, send_start, send_drain, send_stop)
            except Exception:  # a bad pass must not stop reconciling
                log.exception("reconcile pass failed; retrying in %.1fs", self.resync_s)
            version = view.version
            waiter = asyncio.create_task(self.inventory.wait_newer(version))
            woken = asyncio.create_task(self._wake.wait())
            try:
                await asyncio.wait({waiter, woken}, timeout=self.resync_s,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                woken.cancel()
            self._wake.clear()

    async def reconcile_once(self, view: InventoryView,
                             send_start: Callable[[str, ReplicaSpec], object],
                             send_drain: Callable[[str, str, float], bool],
                             send_stop: Callable[[str, str], bool]) -> list[Action]:
        self.passes += 1
        now = self.clock()
        actions = self.decide(self.catalog(), view)
        done = []
        for a in actions:
            key = (type(a).__name__, a.replica_id)
            if not isinstance(a, ForgetReplica):
                last = self._mem.sent.get(key)
                if last is not None and now - last < self.resend_after_s:
                    continue
                self._mem.sent[key] = now
            try:
                await self._execute(a, send_start, send_drain, send_stop)
            except Rejected as e:
                log.warning("could not %s %s on %s: %s", type(a).__name__.lower(),
                            a.replica_id, a.node, e)
                continue
            done.append(a)
            model = a.placement.model if isinstance(a, Start) else getattr(a, "model", "")
            RECONCILER_ACTIONS.labels(type(a).__name__.lower(), model).inc()
            self.decisions.append(Decision(time.time(), type(a).__name__.lower(), model,
                                           a.node, a.replica_id, a.reason))
            lvl = logging.DEBUG if isinstance(a, ForgetReplica) else logging.INFO
            log.log(lvl, "%s %s (%s) on %s: %s", type(a).__name__.lower(), a.replica_id,
                    model, a.node, a.reason)
        # Forget memory of replicas that no longer exist.
        known = {r.replica_id for n in view.nodes for r in n.replicas}
        self._mem.sent = {k: v for k, v in self._mem.sent.items()
                          if k[1] in known or now - v < self.resend_after_s}
        return done

    async def _execute(self, a: Action, send_start: Callable[[str, ReplicaSpec], object],
                       send_drain: Callable[[str, str, float], bool],
                       send_stop: Callable[[str, str], bool]) -> None:
        if isinstance(a, Start):
            p = a.placement
            spec = ReplicaSpec(
                replica_id=a.replica_id, model=p.model, engine=p.profile.engine,
                model_path=p.profile.model_path, args=list(p.profile.args),
                gpu_indices=list(p.gpu_indices), env=dict(p.profile.env),
                profile_hash=p.profile.hash)
            self._mem.requested_at[a.replica_id] = self.clock()
            result = send_start(a.node, spec)
            if asyncio.iscoroutine(result):
                await result
        elif isinstance(a, Drain):
            # DRAINING in the inventory first: Envoy stops sending new requests while
            # the agent waits for in-flight ones.
            await self.inventory.submit(DrainRequested(a.node, a.replica_id))
            send_drain(a.node, a.replica_id, a.timeout_s)
        elif isinstance(a, Stop):
            send_stop(a.node, a.replica_id)
        elif isinstance(a, ForgetReplica):
            await self.inventory.submit(Forget(a.node, a.replica_id))
