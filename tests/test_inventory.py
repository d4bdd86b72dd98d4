"""Inventory rules with a fake clock: lifecycle, refusals, immutable views, concurrency."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from controlplane.inventory import (
    Disconnect,
    Gpu,
    Heartbeat,
    Inventory,
    NodeState,
    Register,
    Rejected,
    Replica,
    ReplicaState,
    StartRequested,
    Status,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def reg(node: str = "n1", sid: int = 1, agent: str = "a1", gen: int = 1,
        replicas: tuple[Replica, ...] = ()) -> Register:
    return Register(sid, node, agent, gen, "127.0.0.1", (("zone", "a"),),
                    (Gpu(0, "GPU-0", "H100", 81920),), replicas)


def rep(rid: str = "r1", state: ReplicaState = ReplicaState.READY) -> Replica:
    return Replica(rid, "m", state, "127.0.0.1", 9000)


def make() -> tuple[Inventory, Clock]:
    c = Clock()
    return Inventory(c, unreachable_after=5, lost_after=30), c


def test_lifecycle_ready_unreachable_lost_and_back() -> None:
    inv, clock = make()
    inv.apply(reg())
    assert inv.view().node("n1").state == NodeState.READY
    for _ in range(10):  # heartbeats keep it Ready
        clock.t += 4
        inv.apply(Heartbeat(1, "n1"))
        assert inv.view().node("n1").state == NodeState.READY
    clock.t += 5.5
    inv.apply(StartRequested("n1", rep("x", ReplicaState.REQUESTED)))  # any event ticks
    assert inv.view().node("n1").state == NodeState.UNREACHABLE
    clock.t += 25
    inv.apply(Disconnect(99, "n1"))  # an unrelated old stream: ignored, but ticks
    assert inv.view().node("n1").state == NodeState.LOST
    inv.apply(reg(sid=2, gen=2, replicas=(rep(),)))
    n = inv.view().node("n1")
    assert n.state == NodeState.READY and n.returned_after_lost
    assert [r.replica_id for r in n.replicas] == ["r1"]


def test_stream_close_is_unreachable_at_once_and_reconnect_is_ready() -> None:
    inv, clock = make()
    inv.apply(reg())
    inv.apply(Disconnect(1, "n1"))
    assert inv.view().node("n1").state == NodeState.UNREACHABLE
    clock.t += 1
    inv.apply(reg(sid=2, agent="a1", gen=2, replicas=(rep(),)))
    n = inv.view().node("n1")
    assert n.state == NodeState.READY and not n.returned_after_lost and n.connected


def test_refusals_leave_the_inventory_unchanged() -> None:
    inv, _ = make()
    inv.apply(reg(replicas=(rep(),)))
    before = inv.view()
    with pytest.raises(Rejected) as e:
        inv.apply(reg(sid=2, agent="intruder"))
    assert e.value.code == "ALREADY_EXISTS"
    with pytest.raises(Rejected) as e:
        inv.apply(reg(sid=2, agent="a1", gen=1))
    assert e.value.code == "FAILED_PRECONDITION"
    with pytest.raises(Rejected) as e:
        inv.apply(Status(1, "n1", rep("nope")))
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(Rejected) as e:
        inv.apply(Status(7, "n1", rep()))  # from a stream that is not the node's
    assert e.value.code == "FAILED_PRECONDITION"
    with pytest.raises(Rejected):
        inv.apply(Heartbeat(1, "unknown-node"))
    assert inv.view().nodes == before.nodes


def test_status_of_started_replica_and_views_are_immutable() -> None:
    inv, _ = make()
    inv.apply(reg())
    inv.apply(StartRequested("n1", rep("r2", ReplicaState.REQUESTED)))
    old = inv.view()
    inv.apply(Status(1, "n1", rep("r2", ReplicaState.STARTING)))
    inv.apply(Status(1, "n1", rep("r2", ReplicaState.READY)))
    assert old.node("n1").replica("r2").state == ReplicaState.REQUESTED
    assert inv.view().node("n1").replica("r2").state == ReplicaState.READY
    assert inv.view().version > old.version
    with pytest.raises(dataclasses.FrozenInstanceError):
        inv.view().node("n1").state = NodeState.LOST  # type: ignore[misc]
    assert inv.view().node("n1").used_gpus == frozenset()


async def test_burst_of_concurrent_status_reports() -> None:
    """Many stream handlers report at once; the single writer applies all, in order."""
    inv = Inventory(unreachable_after=60, lost_after=120)
    writer = asyncio.create_task(inv.run())
    try:
        nodes = [f"n{i}" for i in range(20)]
        for i, n in enumerate(nodes):
            await inv.submit(reg(n, sid=i + 1, agent=f"a{i}",
                                 replicas=tuple(rep(f"{n}-r{k}", ReplicaState.STARTING)
                                                for k in range(5))))

        async def report(i: int, n: str) -> None:
            for k in range(5):
                await inv.submit(Status(i + 1, n, rep(f"{n}-r{k}", ReplicaState.READY)))
                await inv.submit(Heartbeat(i + 1, n))

        await asyncio.gather(*(report(i, n) for i, n in enumerate(nodes)))
        view = inv.view()
        assert len(view.nodes) == 20
        assert all(r.state == ReplicaState.READY for n in view.nodes for r in n.replicas)
        assert sum(len(n.replicas) for n in view.nodes) == 100
        # A refusal reaches its submitter and the writer keeps going.
        with pytest.raises(Rejected):
            await inv.submit(Status(1, "n0", rep("ghost")))
        await inv.submit(Heartbeat(1, "n0"))
    finally:
        writer.cancel()


def test_heard_again_on_the_same_stream_after_lost_marks_replicas_stale() -> None:
    inv, clock = make()
    inv.apply(reg(replicas=(rep(),)))
    clock.t += 31
    inv.apply(StartRequested("n1", rep("x", ReplicaState.REQUESTED)))  # ticks
    assert inv.view().node("n1").state == NodeState.LOST
    inv.apply(Heartbeat(1, "n1"))  # the partition healed before TCP noticed
    n = inv.view().node("n1")
    assert n.state == NodeState.READY and n.returned_after_lost
    assert all(r.stale for r in n.replicas)
