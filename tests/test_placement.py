"""Placement: properties under generated fleets and catalogs, and the rules one by one."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.catalog import Model, Profile
from controlplane.inventory import Gpu
from controlplane.placement import Evictable, NodeCapacity, Request, plan


def gpus(n: int, name: str = "H100", mem: int = 81920) -> tuple[Gpu, ...]:
    return tuple(Gpu(i, f"u{i}", name, mem) for i in range(n))


def model(name: str, gpus_per: int = 1, prio: int = 0, pool: dict[str, str] | None = None,
          gpu_model: str | None = None, mn: int = 1, mx: int = 8) -> Model:
    return Model(name=name, min_replicas=mn, max_replicas=mx, pool=pool or {},
                 profiles=(Profile(engine="sim", gpus=gpus_per, priority=prio,
                                   gpu_model=gpu_model),))


@st.composite
def fleets(draw):
    nodes = []
    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["H100", "A100", "L4"]))
        n = draw(st.integers(0, 8))
        used = draw(st.sets(st.integers(0, 7)))
        free = tuple(g for g in gpus(n, kind) if g.index not in used)
        labels = {"zone": draw(st.sampled_from(["a", "b"]))}
        nodes.append(NodeCapacity(f"node-{i}", labels, free, {}, gpus(n, kind)))
    reqs = []
    for j in range(draw(st.integers(1, 5))):
        m = model(f"m{j}", gpus_per=draw(st.integers(0, 4)), prio=draw(st.integers(0, 3)),
                  pool=draw(st.sampled_from([{}, {"zone": "a"}])),
                  gpu_model=draw(st.sampled_from([None, "H100"])))
        reqs.append(Request(m, draw(st.integers(1, 6))))
    return nodes, reqs


@settings(max_examples=300, deadline=None)
@given(fleets())
def test_no_gpu_oversubscribed_pools_respected_and_deterministic(fleet) -> None:
    nodes, reqs = fleet
    p = plan(reqs, nodes)
    by_node = {n.name: n for n in nodes}
    taken: set[tuple[str, int]] = set()
    for pl in p.placements:
        node = by_node[pl.node]
        free = {g.index: g for g in node.free}
        assert len(pl.gpu_indices) == pl.profile.gpus
        for i in pl.gpu_indices:
            assert i in free, "placed on a GPU that was not free"
            assert (pl.node, i) not in taken, "GPU double-booked"
            taken.add((pl.node, i))
            if pl.profile.gpu_model:
                assert pl.profile.gpu_model in free[i].name
        m = next(r.model for r in reqs if r.model.name == pl.model)
        assert all(node.labels.get(k) == v for k, v in m.pool.items())
    # Every request is either placed or explained.
    for r in reqs:
        placed = sum(1 for pl in p.placements if pl.model == r.model.name)
        missing = sum(1 for m, _ in p.unplaced if m == r.model.name)
        assert placed + missing == r.count
    # Same input, same plan, whatever the order nodes and requests come in.
    shuffled_nodes, shuffled_reqs = list(nodes), list(reqs)
    random.Random(1).shuffle(shuffled_nodes)
    random.Random(2).shuffle(shuffled_reqs)
    assert plan(shuffled_reqs, shuffled_nodes) == p


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(1, 4))
def test_spread_on_identical_nodes(n_nodes: int, replicas: int, gpus_per: int) -> None:
    nodes = [NodeCapacity(f"n{i}", {}, gpus(8), {}, gpus(8)) for i in range(n_nodes)]
    p = plan([Request(model("m", gpus_per=gpus_per), replicas)], nodes)
    per_node = {n.name: 0 for n in nodes}
    for pl in p.placements:
        per_node[pl.node] += 1
    capacity = n_nodes * (8 // gpus_per)
    assert len(p.placements) == min(replicas, capacity)
    # Spread: while room remains on every node, counts differ by at most one.
    if replicas <= capacity:
        assert max(per_node.values()) - min(per_node.values()) <= 1


def test_spread_counts_existing_replicas_and_best_fit() -> None:
    nodes = [NodeCapacity("a", {}, gpus(4), {"m": 1}, gpus(4)),
             NodeCapacity("b", {}, gpus(4), {}, gpus(4)),
             NodeCapacity("c", {}, gpus(2), {}, gpus(4))]
    p = plan([Request(model("m"), 1)], nodes)
    # b and c have none of m; c is the tighter fit.
    assert [(pl.node, pl.gpu_indices) for pl in p.placements] == [("c", (0,))]


def test_profiles_in_order_and_constraints() -> None:
    m = Model(name="m", profiles=(
        Profile(name="h100", engine="sim", gpus=1, gpu_model="H100"),
        Profile(name="a100x2", engine="sim", gpus=2, gpu_model="A100", gpu_memory_mb=40000)))
    nodes = [NodeCapacity("a100-node", {}, gpus(2, "A100-SXM4-40GB", 40960), {},
                          gpus(2, "A100-SXM4-40GB", 40960))]
    p = plan([Request(m, 1)], nodes)
    assert p.placements[0].profile.name == "a100x2"
    small = [NodeCapacity("l4", {}, gpus(4, "L4", 24576), {}, gpus(4, "L4", 24576))]
    p = plan([Request(m, 1)], small)
    assert p.placements == () and "not enough free GPUs" in p.unplaced[0][1]
    p = plan([Request(model("x", pool={"zone": "z"}), 1)], small)
    assert "pool" in p.unplaced[0][1]


def test_priority_places_first_and_may_evict_above_min() -> None:
    hi, lo = model("hi", prio=10, mn=1), model("lo", prio=0, mn=1)
    node = NodeCapacity("n", {}, gpus(1), {}, gpus(1))
    p = plan([Request(lo, 1), Request(hi, 1, below_min=1)], [node])
    assert [pl.model for pl in p.placements] == ["hi"]
    # Full node running two "lo" replicas (one above lo's min): one is drained for "hi".
    full = NodeCapacity("n", {}, (), {"lo": 2}, gpus(2),
                        (Evictable("lo-1", "lo", 0, (0,)), Evictable("lo-2", "lo", 0, (1,))))
    p = plan([Request(hi, 1, below_min=1)], [full], {"lo": 1})
    assert [(e.replica_id, e.for_model) for e in p.evictions] == [("lo-1", "hi")]
    # Not below lo's min, and never a replica of equal or higher priority.
    p = plan([Request(hi, 1, below_min=1)], [full], {"lo": 0})
    assert p.evictions == ()
    peer = model("peer", prio=0)  # same priority as lo: no eviction
    p = plan([Request(peer, 1, below_min=1)], [full], {"lo": 1})
    assert p.evictions == ()
