"""A real network partition: one node's agent and engines in their own network namespace,
joined to this host by a veth pair; cutting the link partitions it, restoring it heals.

Needs root and iproute2 (`ip netns`); skips with the reason where namespaces cannot be
made. Addresses are the test's own (a /30 on its veth), never anything else; the
namespace and the veth are removed even when the test fails.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.harness import Fleet, Load, wait_for
from controlplane.inventory import NodeState, ReplicaState
from xds.translate import cluster_name

pytestmark = pytest.mark.slow

CATALOG = """
models:
  - name: m
    min_replicas: 2
    max_replicas: 2
    drain_timeout_s: 10
    profiles:
      - {name: v1, engine: sim, gpus: 1, args: [--ttft, "0.01", --tokens-per-s, "100"]}
    routing:
      health_check_interval_s: 0.5
      health_check_timeout_s: 0.5
      per_try_idle_timeout_s: 1.0
      connect_timeout_s: 0.5
"""
M = cluster_name("m")


def _ip(*args: str, ns: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=10)


@dataclass(frozen=True)
class Netns:
    name: str
    host_if: str
    host_ip: str
    ns_ip: str

    def cut(self) -> None:
        r = _ip("link", "set", self.host_if, "down")
        assert r.returncode == 0, r.stderr

    def heal(self) -> None:
        r = _ip("link", "set", self.host_if, "up")
        assert r.returncode == 0, r.stderr


@pytest.fixture
def netns() -> Iterator[Netns]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    tag = f"{os.getpid() % 10000}{int(time.time() * 1000) % 1000}"
    name, host_if, ns_if = f"llmgw-t{tag}", f"lgh{tag}", f"lgn{tag}"
    octet = 1 + os.getpid() % 250
    host_ip, ns_ip = f"10.250.{octet}.1", f"10.250.{octet}.2"
    r = _ip("netns", "add", name)
    if r.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {r.stderr.strip()}")
    try:
        steps = [
            (("link", "add", host_if, "type", "veth", "peer", "name", ns_if), None),
            (("link", "set", ns_if, "netns", name), None),
            (("addr", "add", f"{host_ip}/30", "dev", host_if), None),
            (("link", "set", host_if, "up"), None),
            (("addr", "add", f"{ns_ip}/30", "dev", ns_if), name),
            (("link", "set", ns_if, "up"), name),
            (("link", "set", "lo", "up"), name),
        ]
        for args, ns in steps:
            r = _ip(*args, ns=ns)
            if r.returncode != 0:
                pytest.skip(f"cannot set up the test's veth pair: ip {' '.join(args)}: "
                            f"{r.stderr.strip()}")
        yield Netns(name, host_if, host_ip, ns_ip)
    finally:
        _ip("link", "del", host_if)
        _ip("netns", "del", name)


async def test_partition_loses_node_rebuilds_elsewhere_and_fences_on_heal(
    netns: Netns, tmp_path: Path
) -> None:
    f = Fleet(tmp_path, CATALOG, unreachable_after=1.0, lost_after=3.0)
    f.agents_host = netns.host_ip  # reachable from the namespace and from this host
    watchers: list[asyncio.Task[None]] = []
    try:
        await f.start_cp()
        # The partitioned node, in its namespace; its engines listen on its own address.
        # Its fencing timeout is long, so what fences its stale replica on heal is the
        # control plane (the agent's own fencing is tested elsewhere).
        f.start_agent("ns-node", "2xH100-80GB", "--bind", netns.ns_ip, "--advertise",
                      netns.ns_ip, "--fence-after", "120", netns=netns.name)
        f.start_agent("node-1")
        await f.start_envoy()
        await f.converged({"m": 2}, timeout=40)

        async def spread() -> bool:
            nodes = {n for n, _, _ in f.replicas("m")}
            return nodes == {"ns-node", "node-1"}

        await wait_for(spread, 30, "a replica on the namespaced node")
        await f.converged({"m": 2})
        f.start_agent("node-2")  # room to rebuild on
        await f.node_state_ready("node-2")
        stale_id = next(rid for n, rid, _ in f.replicas("m") if n == "ns-node")
        assert f.cp is not None and f.envoy is not None
        routed_after_lost: list[str] = []
        lost_at: list[float] = []
        stop = asyncio.Event()

        async def watch() -> None:
            # The stale replica must never be routed to again once the node is Lost.
            assert f.envoy is not None
            while not stop.is_set():
                hosts = {h.address for h in await f.envoy.hosts(M)}
                if lost_at and any(a.startswith(netns.ns_ip + ":") for a in hosts):
                    routed_after_lost.append(str(hosts))
                await asyncio.sleep(0.05)

        watchers.append(asyncio.create_task(watch()))
        async with Load(f.url, ["m"], workers=4, max_tokens=20, stream_every=2) as load:
            await load.wait_requests(10)
            netns.cut()
            await f.node_state("ns-node", NodeState.UNREACHABLE, timeout=10)
            await f.node_state("ns-node", NodeState.LOST, timeout=10)
            lost_at.append(time.monotonic())
            load.started_after = time.monotonic() + 2.0  # Envoy has failed the host by then
            await f.converged({"m": 2}, timeout=30)
            assert {n for n, _, _ in f.replicas("m")} == {"node-1", "node-2"}
            await load.wait_requests(20)
            netns.heal()
            # Back, flagged as returned after Lost; its old replica is stale, then stopped.
            await f.node_state_ready("ns-node", timeout=40)
            node = f.cp.inventory.view().node("ns-node")
            assert node is not None and node.returned_after_lost

            async def fenced() -> bool:
                assert f.cp is not None
                n = f.cp.inventory.view().node("ns-node")
                r = n.replica(stale_id) if n else None
                return r is None or r.state in (ReplicaState.STOPPED, ReplicaState.FAILED)

            await wait_for(fenced, 30, "the stale replica to be stopped")
            await f.converged({"m": 2}, timeout=30)
            await load.wait_requests(20)
        stop.set()
        await watchers[0]
        assert routed_after_lost == [], routed_after_lost[:3]
        after = load.after
        assert after.failures == [] and after.cut_streams == [], (after.failures[:3],
                                                                 after.cut_streams[:3])
        print(f"\npartition: {load.result.ok} ok, {len(load.result.cut_streams)} streams cut "
              f"at the cut, {len(load.result.failures)} failed before Envoy failed the host, "
              f"{after.ok} ok and 0 failed after")
    finally:
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        netns.heal()
        await f.close()
