"""Placement: which node and which GPUs each new replica gets. A pure function.

Owns the packing policy. Given the replicas to add per model and each node's free GPUs,
it returns placements (model, profile, node, GPU indices), the evictions that would make
room for a higher-priority model below its minimum, and what could not be placed and
why. Rules, in order:
- pools: a node must carry every label of the model's pool;
- profiles: the first of the model's profiles whose GPU count, memory and product
  constraints the node's free GPUs meet;
- spread: a node with fewer replicas of the model wins;
- best fit: then the node left with the fewest free GPUs (keeps big holes for big jobs);
- priority: higher-priority models place first; names break every tie, so the same
  input always gives the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from controlplane.catalog import Model, Profile
from controlplane.inventory import Gpu


@dataclass(frozen=True)
class Evictable:
    """A running replica that could be drained to make room."""

    replica_id: str
    model: str
    priority: int
    gpu_indices: tuple[int, ...]


@dataclass(frozen=True)
class NodeCapacity:
    name: str
    labels: Mapping[str, str]
    free: tuple[Gpu, ...]
    # Replicas of each model already on this node (live ones).
    model_counts: Mapping[str, int] = field(default_factory=dict)
    all_gpus: tuple[Gpu, ...] = ()
    evictable: tuple[Evictable, ...] = ()


@dataclass(frozen=True)
class Request:
    model: Model
    count: int  # replicas to add
    below_min: int = 0  # how many of them are needed to reach min_replicas


@dataclass(frozen=True)
class Placement:
    model: str
    profile: Profile
    node: str
    gpu_indices: tuple[int, ...]


@dataclass(frozen=True)
class Eviction:
    model: str
    node: str
    replica_id: str
    for_model: str


@dataclass(frozen=True)
class Plan:
    placements: tuple[Placement, ...] = ()
    evictions: tuple[Eviction, ...] = ()
    unplaced: tuple[tuple[str, str], ...] = ()  # (model, why)


def _gpu_ok(g: Gpu, p: Profile) -> bool:
    if g.memory_mb < p.gpu_memory_mb:
        return False
    return p.gpu_model is None or p.gpu_model.lower() in g.name.lower()


def _fit(free: Sequence[Gpu], p: Profile) -> tuple[int, ...] | None:
    ok = [g.index for g in sorted(free, key=lambda g: g.index) if _gpu_ok(g, p)]
    if len(ok) < p.gpus:
        return None
    return tuple(ok[: p.gpus])


def _pool_ok(model: Model, labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in model.pool.items())


def plan(requests: Sequence[Request], nodes: Sequence[NodeCapacity],
         min_replicas_left: Mapping[str, int] | None = None) -> Plan:
    """Place the requested replicas.

    `min_replicas_left` gives, per model, how many of its running replicas are above
    its minimum (so may be evicted for a higher-priority model).
    """
    free: dict[str, list[Gpu]] = {n.name: list(n.free) for n in nodes}
    counts: dict[tuple[str, str], int] = {
        (m, n.name): c for n in nodes for m, c in n.model_counts.items()}
    spare = dict(min_replicas_left or {})
    by_name = {n.name: n for n in nodes}
    evicted: set[str] = set()
    placements: list[Placement] = []
    evictions: list[Eviction] = []
    unplaced: list[tuple[str, str]] = []
    for req in sorted(requests, key=lambda r: (-r.model.priority, r.model.name)):
        m = req.model
        for k in range(req.count):
            best: tuple[tuple[int, int, int, str], Placement] | None = None
            for name in sorted(by_name):
                node = by_name[name]
                if not _pool_ok(m, node.labels):
                    continue
                for pi, prof in enumerate(m.profiles):
                    gpus = _fit(free[name], prof)
                    if gpus is None:
                        continue
                    key = (counts.get((m.name, name), 0), pi, len(free[name]) - len(gpus), name)
                    if best is None or key < best[0]:
                        best = (key, Placement(m.name, prof, name, gpus))
                    break
            if best is not None:
                p = best[1]
                placements.append(p)
                free[p.node] = [g for g in free[p.node] if g.index not in p.gpu_indices]
                counts[(m.name, p.node)] = counts.get((m.name, p.node), 0) + 1
                continue
            if k < req.below_min:
                ev = _evict_for(m, nodes, free, spare, evicted)
                if ev is not None:
                    evictions.append(ev)
                    unplaced.append((m.name, f"waiting for {ev.model}/{ev.replica_id} on "
                                     f"{ev.node} to drain"))
                    continue
            unplaced.append((m.name, _why(m, nodes)))
    return Plan(tuple(placements), tuple(evictions), tuple(unplaced))


def _evict_for(m: Model, nodes: Sequence[NodeCapacity], free: Mapping[str, list[Gpu]],
               spare: dict[str, int], evicted: set[str]) -> Eviction | None:
    """The lowest-priority replica above its model's min whose GPUs would fit `m`."""
    options: list[tuple[tuple[int, str, str], Eviction]] = []
    for node in sorted(nodes, key=lambda n: n.name):
        if not _pool_ok(m, node.labels):
            continue
        gpus = {g.index: g for g in node.all_gpus}
        for v in node.evictable:
            if v.priority >= m.priority or spare.get(v.model, 0) <= 0 or v.replica_id in evicted:
                continue
            freed = list(free[node.name]) + [gpus[i] for i in v.gpu_indices if i in gpus]
            if any(_fit(freed, p) is not None for p in m.profiles):
                options.append(((v.priority, node.name, v.replica_id),
                                Eviction(v.model, node.name, v.replica_id, m.name)))
    if not options:
        return None
    ev = min(options, key=lambda o: o[0])[1]
    spare[ev.model] -= 1
    evicted.add(ev.replica_id)
    return ev


def _why(m: Model, nodes: Sequence[NodeCapacity]) -> str:
    pool = [n for n in nodes if _pool_ok(m, n.labels)]
    if not nodes:
        return "no Ready node"
    if not pool:
        return f"no Ready node matches pool {dict(m.pool)}"
    need = ", ".join(f"{p.gpus} GPU(s)" + (f" {p.gpu_model}" if p.gpu_model else "")
                     + (f" >= {p.gpu_memory_mb} MiB" if p.gpu_memory_mb else "")
                     for p in m.profiles)
    return f"not enough free GPUs (needs {need})"
