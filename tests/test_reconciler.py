"""Reconciler decisions on hand-made inventory views (no I/O, fake clock)."""

from __future__ import annotations

from controlplane.catalog import Catalog, Model, Profile
from controlplane.inventory import (
    Gpu,
    Inventory,
    InventoryView,
    Node,
    NodeState,
    Replica,
    ReplicaState,
)
from controlplane.reconciler import Drain, ForgetReplica, Reconciler, Start

P1 = Profile(name="v1", engine="sim", gpus=1)
P2 = Profile(name="v2", engine="sim", gpus=1, args=("--ttft", "0.1"))


def node(name: str, *replicas: Replica, state: NodeState = NodeState.READY, gpus: int = 4,
         labels: tuple[tuple[str, str], ...] = ()) -> Node:
    return Node(name, state, "a", 1, "127.0.0.1", labels,
                tuple(Gpu(i, f"{name}-{i}", "H100", 81920) for i in range(gpus)), replicas,
                state != NodeState.LOST, 0.0, 0.0)


def rep(rid: str, model: str = "m", state: ReplicaState = ReplicaState.READY, gpu: int = 0,
        profile: Profile = P1, stale: bool = False) -> Replica:
    return Replica(rid, model, state, "127.0.0.1", 9000, gpu_indices=(gpu,),
                   profile_hash=profile.hash, stale=stale)


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def recon(*models: Model) -> tuple[Reconciler, Catalog]:
    cat = Catalog(models=models)
    r = Reconciler(Inventory(), lambda: cat, clock=Clock())
    return r, cat


def m(mn: int = 2, mx: int = 3, profile: Profile = P1, prio: int = 0) -> Model:
    return Model(name="m", min_replicas=mn, max_replicas=mx,
                 profiles=(profile.model_copy(update={"priority": prio}),))


def kinds(actions: list) -> list[tuple[str, str]]:
    return sorted((type(a).__name__, a.node) for a in actions)


def test_starts_up_to_min_spread_over_nodes() -> None:
    r, cat = recon(m(mn=2))
    acts = r.decide(cat, InventoryView((node("a"), node("b")), 1))
    assert kinds(acts) == [("Start", "a"), ("Start", "b")]
    assert all(isinstance(a, Start) and a.placement.profile.hash == P1.hash for a in acts)


def test_is_idempotent_requested_replicas_count() -> None:
    r, cat = recon(m(mn=2))
    view = InventoryView((node("a", rep("r1", state=ReplicaState.REQUESTED)),
                          node("b", rep("r2", state=ReplicaState.STARTING))), 1)
    assert r.decide(cat, view) == []


def test_drains_above_max_not_ready_first() -> None:
    r, cat = recon(m(mn=1, mx=2))
    view = InventoryView((node("a", rep("r1"), rep("r2", gpu=1)),
                          node("b", rep("r3", state=ReplicaState.STARTING))), 1)
    acts = r.decide(cat, view)
    assert [(type(a).__name__, a.replica_id) for a in acts] == [("Drain", "r3")]


def test_profile_change_starts_new_before_draining_old() -> None:
    r, _ = recon(m(mn=2))
    new = Catalog(models=(m(mn=2, profile=P2),))
    old = InventoryView((node("a", rep("o1")), node("b", rep("o2"))), 1)
    acts = r.decide(new, old)
    assert sorted(type(a).__name__ for a in acts) == ["Start", "Start"]  # surge, no drain
    # New ones starting: still no drain (capacity would drop below min).
    mid = InventoryView((node("a", rep("o1"), rep("n1", state=ReplicaState.STARTING, gpu=1,
                                                  profile=P2)),
                         node("b", rep("o2"), rep("n2", state=ReplicaState.STARTING, gpu=1,
                                                  profile=P2))), 2)
    assert r.decide(new, mid) == []
    # One new Ready: one old may go.
    one = InventoryView((node("a", rep("o1"), rep("n1", gpu=1, profile=P2)),
                         node("b", rep("o2"), rep("n2", state=ReplicaState.STARTING, gpu=1,
                                                  profile=P2))), 3)
    acts = r.decide(new, one)
    assert [(type(a).__name__, a.replica_id) for a in acts] == [("Drain", "o1")]


def test_profile_change_without_free_gpus_retires_one_old_while_min_holds() -> None:
    r, _ = recon()
    new = Catalog(models=(m(mn=1, mx=2, profile=P2),))
    full = InventoryView((node("a", rep("o1"), rep("o2", gpu=1), gpus=2),), 1)
    acts = r.decide(new, full)
    assert [(type(a).__name__, a.replica_id) for a in acts] == [("Drain", "o1")]
    # At min (1 serving) with no room: wait rather than drop capacity.
    tight = InventoryView((node("a", rep("o1"), gpus=1),), 1)
    assert [type(a).__name__ for a in r.decide(Catalog(models=(m(mn=1, mx=1, profile=P2),)),
                                              tight)] == []


def test_lost_node_is_rebuilt_elsewhere_and_unreachable_is_not() -> None:
    r, cat = recon(m(mn=2))
    unreachable = InventoryView((node("a", rep("r1")),
                                 node("b", rep("r2"), state=NodeState.UNREACHABLE),
                                 node("c")), 1)
    assert r.decide(cat, unreachable) == []
    lost = InventoryView((node("a", rep("r1")), node("b", rep("r2"), state=NodeState.LOST),
                          node("c")), 2)
    acts = r.decide(cat, lost)
    assert kinds(acts) == [("Start", "c")]


def test_stale_replicas_are_stopped_and_failed_ones_replaced() -> None:
    r, cat = recon(m(mn=1, mx=1))
    view = InventoryView((node("a", rep("r1")),
                          node("b", rep("old", stale=True)),
                          node("c", rep("dead", state=ReplicaState.FAILED))), 1)
    acts = r.decide(cat, view)
    assert sorted((type(a).__name__, a.replica_id) for a in acts) == [
        ("ForgetReplica", "dead"), ("Stop", "dead"), ("Stop", "old")]


def test_model_removed_from_catalog_is_drained() -> None:
    r, _ = recon()
    view = InventoryView((node("a", rep("r1", model="gone")),), 1)
    acts = r.decide(Catalog(models=()), view)
    assert [(type(a).__name__, a.replica_id) for a in acts] == [("Drain", "r1")]
    stopped = InventoryView((node("a", rep("r1", model="gone",
                                          state=ReplicaState.STOPPED)),), 2)
    assert [type(a) for a in r.decide(Catalog(models=()), stopped)] == [ForgetReplica]


def test_cordoned_node_moves_replicas_make_before_break() -> None:
    r, cat = recon(m(mn=1, mx=2))
    r.cordon("a")
    view = InventoryView((node("a", rep("r1")), node("b")), 1)
    acts = r.decide(cat, view)
    assert kinds(acts) == [("Start", "b")]
    moved = InventoryView((node("a", rep("r1")), node("b", rep("r2"))), 2)
    acts = r.decide(cat, moved)
    assert [(type(a).__name__, a.replica_id) for a in acts] == [("Drain", "r1")]


def test_higher_priority_below_min_evicts_lower_priority_above_min() -> None:
    hi = Model(name="hi", min_replicas=1, max_replicas=1,
               profiles=(P1.model_copy(update={"priority": 10}),))
    lo = Model(name="lo", min_replicas=1, max_replicas=2, profiles=(P1,))
    cat = Catalog(models=(hi, lo))
    r = Reconciler(Inventory(), lambda: cat, clock=Clock())
    view = InventoryView((node("a", rep("l1", model="lo"), rep("l2", model="lo", gpu=1),
                               gpus=2),), 1)
    acts = r.decide(cat, view)
    drains = [a for a in acts if isinstance(a, Drain)]
    assert [(a.replica_id, "hi" in a.reason) for a in drains] == [("l1", True)]
    assert "hi" in r.unplaced


def test_commands_only_to_connected_nodes() -> None:
    r, cat = recon(m(mn=1, mx=1))
    gone = Node("a", NodeState.UNREACHABLE, "x", 1, "h", (), (), (rep("r1", stale=True),),
                False, 0.0, 0.0)
    assert [type(a) for a in r.decide(cat, InventoryView((gone,), 1))] == []


def test_replicas_crowded_on_one_node_are_spread_make_before_break() -> None:
    r, cat = recon(m(mn=1, mx=2))
    crowded = InventoryView((node("a", rep("r1"), rep("r2", gpu=1)), node("b")), 1)
    acts = r.decide(cat, crowded)
    assert kinds(acts) == [("Start", "b")]  # capacity first: nothing drained yet
    moved = InventoryView((node("a", rep("r1"), rep("r2", gpu=1)), node("b", rep("r3"))), 2)
    acts = r.decide(cat, moved)
    assert [(type(a).__name__, a.replica_id) for a in acts] == [("Drain", "r2")]
    assert "spread" in acts[0].reason
    # Two nodes each with one: settled, nothing to do.
    done = InventoryView((node("a", rep("r1")), node("b", rep("r3"))), 3)
    assert r.decide(cat, done) == []
