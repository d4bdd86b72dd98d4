"""Convergence: from an agent's Ready report, and from a catalog change, to Envoy
having applied it, as the fleet grows.

Simulated agents speak the real agent protocol over real gRPC to a real control plane
(agent server, inventory, publisher, xDS) driving a real Envoy. The fleet is
10/100/1000/5000 Ready endpoints (50 per simulated node, 10 per model). Measured, in
SotW and delta:
- ready -> Envoy: the control plane asks a node to start a replica; the simulated agent
  answers Ready; time from that report to Envoy's ACK of the EDS update carrying it;
- catalog -> Envoy: an alias is added; time from the catalog change to Envoy's ACK of
  the route update.
"Applied" is Envoy's ACK: the endpoints are fake (health checks are slowed so Envoy does
not spend the run failing them), so no request could be served by them.

Run:  .venv/bin/python bench/convergence.py [--sizes 10,100,1000,5000] [--samples 20]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agents.agent import METHOD  # noqa: E402
from agents.pb.llmgw.agent.v1 import (  # noqa: E402
    AgentMessage,
    ControlMessage,
    Gpu,
    Register,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
)
from bench.common import png_path, print_table, write_json  # noqa: E402
from controlplane.agent_server import AgentAuth  # noqa: E402
from controlplane.catalog import Catalog, Model, Profile, Routing  # noqa: E402
from controlplane.envoy_proc import EnvoyProcess  # noqa: E402
from controlplane.inventory import Inventory  # noqa: E402
from controlplane.runtime import ControlPlane  # noqa: E402
from xds.protocol import Ack, Event  # noqa: E402
from xds.snapshot import ENDPOINT, ROUTE  # noqa: E402

PER_NODE, PER_MODEL, TOKEN = 50, 10, "bench-token"


class FakeAgent:
    """One node over a real agent stream: registers Ready replicas, answers Start."""

    def __init__(self, port: int, node: str, replicas: list[ReplicaStatus]) -> None:
        self.port, self.node, self.replicas = port, node, replicas
        self.reported: dict[str, float] = {}
        self._out: asyncio.Queue[AgentMessage] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            call = ch.stream_stream(METHOD, request_serializer=bytes,
                                    response_deserializer=ControlMessage.parse)
            stream = call(metadata=(("authorization", f"Bearer {TOKEN}"),))
            await stream.write(AgentMessage(register=Register(
                node=self.node, agent_id=self.node, generation=1,
                gpus=[Gpu(index=i, uuid=f"{self.node}-{i}", name="H100", memory_mb=81920)
                      for i in range(8)],
                replicas=self.replicas, address="127.0.0.1")))

            async def send() -> None:
                while True:
                    await stream.write(await self._out.get())

            sender = asyncio.create_task(send())
            try:
                async for msg in stream:
                    if msg.start is not None and msg.start.spec is not None:
                        spec: ReplicaSpec = msg.start.spec
                        port = 40000 + len(self.reported)
                        self.reported[spec.replica_id] = time.perf_counter()
                        await self._out.put(AgentMessage(status=ReplicaStatus(
                            replica_id=spec.replica_id, model=spec.model,
                            state=ReplicaState.READY, host="127.0.0.2", port=port)))
            finally:
                sender.cancel()


async def measure(n: int, delta: bool, samples: int) -> dict[str, Any]:
    models = max(1, n // PER_MODEL)
    slow_hc = Routing(health_check_interval_s=600)
    cat = Catalog(models=tuple(Model(name=f"m{i:04d}", routing=slow_hc, max_replicas=100,
                                     profiles=(Profile(engine="sim", gpus=0),))
                               for i in range(models)))
    cp = ControlPlane(cat, xds=("127.0.0.1", 0), api=None, agents=("127.0.0.1", 0),
                      agent_auth=AgentAuth(token=TOKEN), reconcile=False,
                      inventory=Inventory(unreachable_after=600, lost_after=1200))
    await cp.start()
    acks: asyncio.Queue[tuple[str, float]] = asyncio.Queue()

    def on_event(_node: str, ev: Event) -> None:
        if isinstance(ev, Ack):
            acks.put_nowait((ev.type_url, time.perf_counter()))

    cp.ads.add_listener(on_event)
    agents: list[FakeAgent] = []
    envoy = EnvoyProcess("127.0.0.1", cp.xds_port, delta=delta, node_id=f"conv-{n}")
    try:
        nodes = max(1, (n + PER_NODE - 1) // PER_NODE)
        for k in range(nodes):
            reps = [ReplicaStatus(replica_id=f"n{k}-r{j}",
                                  model=f"m{(k * PER_NODE + j) % models:04d}",
                                  state=ReplicaState.READY, host="127.0.0.1",
                                  port=20000 + k * PER_NODE + j)
                    for j in range(min(PER_NODE, n - k * PER_NODE))]
            a = FakeAgent(cp.agents_port, f"node-{k}", reps)
            a.task = asyncio.create_task(a.run())
            agents.append(a)
        deadline = time.monotonic() + 120
        while sum(len(e) for e in cp.publisher.endpoints().values()) < n:  # noqa: ASYNC110
            if time.monotonic() > deadline:
                raise RuntimeError("the simulated fleet did not register in 120 s")
            await asyncio.sleep(0.05)
        await envoy.start(timeout=120)
        await envoy.wait_listener(timeout=120)
        await asyncio.sleep(1.0)  # let the initial ACKs drain
        while not acks.empty():
            acks.get_nowait()
        ready, catalog = [], []
        assert cp.agents is not None
        for s in range(samples):
            a = agents[s % len(agents)]
            rid = f"new-{s}"
            await cp.agents.start_replica(a.node, ReplicaSpec(
                replica_id=rid, model=f"m{s % models:04d}", engine="sim"))
            while True:
                t, at = await asyncio.wait_for(acks.get(), 30)
                if t == ENDPOINT and rid in a.reported and at > a.reported[rid]:
                    ready.append(at - a.reported[rid])
                    break
        current = cp.publisher.catalog
        for s in range(samples):
            m0 = current.models[0]
            current = current.model_copy(update={"models": (
                m0.model_copy(update={"aliases": (*m0.aliases, f"alias-{s}")}),
                *current.models[1:])})
            while not acks.empty():
                acks.get_nowait()
            t0 = time.perf_counter()
            cp.set_catalog(current)
            while True:
                t, at = await asyncio.wait_for(acks.get(), 30)
                if t == ROUTE:
                    catalog.append(at - t0)
                    break
    finally:
        for a in agents:
            if a.task is not None:
                a.task.cancel()
        await asyncio.gather(*(a.task for a in agents if a.task), return_exceptions=True)
        await envoy.stop()
        await cp.stop()

    def p(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] * 1000

    return {"endpoints": n, "mode": "delta" if delta else "sotw",
            "ready_p50_ms": statistics.median(ready) * 1000, "ready_p99_ms": p(ready, 0.99),
            "catalog_p50_ms": statistics.median(catalog) * 1000,
            "catalog_p99_ms": p(catalog, 0.99)}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode in ("sotw", "delta"):
        rs = [r for r in rows if r["mode"] == mode]
        xs = [r["endpoints"] for r in rs]
        axes[0].plot(xs, [r["ready_p99_ms"] for r in rs], marker="o", label=f"{mode} p99")
        axes[0].plot(xs, [r["ready_p50_ms"] for r in rs], marker=".", linestyle=":",
                     label=f"{mode} p50")
        axes[1].plot(xs, [r["catalog_p99_ms"] for r in rs], marker="o", label=f"{mode} p99")
    axes[0].set_title("agent Ready report -> Envoy ACK (ms)")
    axes[1].set_title("catalog change -> Envoy ACK (ms)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("endpoints in fleet")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10,100,1000,5000")
    ap.add_argument("--samples", type=int, default=20)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for n in [int(x) for x in a.sizes.split(",")]:
        for delta in (False, True):
            rows.append(await measure(n, delta, a.samples))
            print(f"measured {n} endpoints, {'delta' if delta else 'sotw'}", flush=True)
    cols = ["endpoints", "mode", "ready_p50_ms", "ready_p99_ms", "catalog_p50_ms",
            "catalog_p99_ms"]
    print_table(f"convergence ({a.samples} samples each)", cols,
                [[r[c] for c in cols] for r in rows])
    out = write_json("convergence", {"samples": a.samples, "results": rows})
    plot(rows, png_path("convergence"))
    print(f"wrote {out} and {png_path('convergence')}")


if __name__ == "__main__":
    asyncio.run(main())
