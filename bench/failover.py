"""Failover timeline: what clients see when a node dies, an engine crashes or freezes,
a node is drained or the control plane restarts.

For each scenario a fresh fleet runs on this machine (control plane, 3 agents with
simulated GPUs, real Envoy), a model with 2 replicas takes an open-loop load, the fault
is injected, and we record every request. Reported per scenario: time from the fault
to the first request answered by a replacement replica, time to full capacity (2 Ready
replicas behind Envoy again), requests completed, failed and cut. A PNG timeline shows
requests per second and errors over time with the fault and the recovery marked.

Run:  .venv/bin/python bench/failover.py [--rate 100] [--scenarios node_kill,...]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import png_path, print_table, write_json  # noqa: E402
from bench.harness import Fleet, wait_for  # noqa: E402
from bench.loadgen import OpenLoop, Sample  # noqa: E402
from controlplane.inventory import NodeState, ReplicaState  # noqa: E402

CATALOG = """
models:
  - name: m
    min_replicas: 2
    max_replicas: 2
    drain_timeout_s: 20
    profiles:
      - {name: v1, engine: sim, gpus: 1, args: [--ttft, "0.02", --tokens-per-s, "200"]}
    routing:
      health_check_interval_s: 0.5
      health_check_timeout_s: 0.5
      per_try_idle_timeout_s: 1.0
"""
SCENARIOS = ("node_kill", "engine_crash", "engine_freeze", "planned_drain", "cp_restart")


def ready(f: Fleet) -> list[tuple[str, str, str]]:
    return f.replicas("m", (ReplicaState.READY,))


async def settle(f: Fleet) -> None:
    await f.converged({"m": 2}, timeout=60)

    async def spread() -> bool:
        return len({n for n, _, _ in ready(f)}) == 2 and not f.replicas(
            "m", (ReplicaState.STARTING, ReplicaState.DRAINING, ReplicaState.REQUESTED))

    await wait_for(spread, 60, "two replicas on two nodes")
    await f.converged({"m": 2}, timeout=60)


def pid_of(f: Fleet, node: str) -> int:
    assert f.cp is not None
    n = f.cp.inventory.view().node(node)
    assert n is not None
    return next(r.pid for r in n.replicas if r.model == "m" and r.state == ReplicaState.READY)


async def run_scenario(name: str, rate: float, work: Path) -> dict[str, Any]:
    (work / name).mkdir(parents=True, exist_ok=True)
    f = Fleet(work / name, CATALOG, unreachable_after=1.0, lost_after=3.0)
    await f.start(nodes=3)
    load = OpenLoop(f.url, "m", rate=rate, max_tokens=8)
    try:
        await settle(f)
        before = {rid for _, rid, _ in ready(f)}
        victim_node = sorted(n for n, _, _ in ready(f))[0]
        load.start()
        await asyncio.sleep(2.0)  # a steady baseline on the timeline
        t_fault = time.monotonic()
        frozen = 0
        if name == "node_kill":
            f.kill_node(victim_node)
            await f.node_state(victim_node, NodeState.LOST, timeout=20)
        elif name == "engine_crash":
            os.kill(pid_of(f, victim_node), signal.SIGKILL)
        elif name == "engine_freeze":
            frozen = pid_of(f, victim_node)
            os.kill(frozen, signal.SIGSTOP)
        elif name == "planned_drain":
            assert f.cp is not None
            f.cp.command("drain", victim_node)
        elif name == "cp_restart":
            assert f.cp is not None
            port = f.cp.xds_port
            await f.cp.stop()
            await f.start_cp(xds_port=port, startup_grace_s=20,
                             expected_nodes=("node-1", "node-2", "node-3"))
        if frozen:
            await asyncio.sleep(5.0)
            os.kill(frozen, signal.SIGCONT)
        else:
            async def replaced() -> bool:
                now = {rid for _, rid, _ in ready(f)}
                return name == "cp_restart" or bool(now - before)

            await wait_for(replaced, 60, "a replacement replica")
        await f.converged({"m": 2}, timeout=60)
        t_full = time.monotonic()
        await asyncio.sleep(2.0)
        samples = await load.stop()
        after = {rid for _, rid, _ in ready(f)}
    finally:
        await load.stop()
        await f.close()
    new = after - before
    first_new = min((s.end for s in samples if s.replica in new and s.ok), default=None)
    done = [s for s in samples if s.start >= t_fault]
    return {
        "scenario": name,
        "requests": len(samples),
        "after_fault": len(done),
        "failed": sum(1 for s in samples if not s.ok and not s.cut),
        "cut": sum(1 for s in samples if s.cut),
        "to_first_on_replacement_s": None if first_new is None else first_new - t_fault,
        "to_full_capacity_s": t_full - t_fault,
        "timeline": timeline(samples, t_fault),
        "fault_at_s": 0.0,
        "recovered_at_s": t_full - t_fault,
    }


def timeline(samples: list[Sample], t0: float, step: float = 0.25) -> list[dict[str, float]]:
    if not samples:
        return []
    start = min(s.end for s in samples)
    end = max(s.end for s in samples)
    bins: list[dict[str, float]] = []
    t = start
    while t < end:
        in_bin = [s for s in samples if t <= s.end < t + step]
        bins.append({"t": round(t - t0, 3), "ok_rps": sum(s.ok for s in in_bin) / step,
                     "err_rps": sum(not s.ok for s in in_bin) / step})
        t += step
    return bins


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.4 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        ts = [b["t"] for b in r["timeline"]]
        ax.plot(ts, [b["ok_rps"] for b in r["timeline"]], label="ok req/s", color="tab:green")
        ax.plot(ts, [b["err_rps"] for b in r["timeline"]], label="failed req/s",
                color="tab:red")
        ax.axvline(0, color="black", linestyle="--", label="fault")
        ax.axvline(r["recovered_at_s"], color="tab:blue", linestyle=":",
                   label="full capacity")
        ax.set_title(f"{r['scenario']}: {r['failed']} failed, {r['cut']} cut of "
                     f"{r['requests']}")
        ax.set_ylabel("req/s")
        ax.legend(loc="lower left", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since the fault")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=100.0, help="open-loop requests per second")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="llmgw-failover-"))
    results = []
    for name in a.scenarios.split(","):
        results.append(await run_scenario(name, a.rate, work))
        print(f"measured {name}", flush=True)
    cols = ["scenario", "requests", "after_fault", "failed", "cut",
            "to_first_on_replacement_s", "to_full_capacity_s"]
    print_table(f"failover at {a.rate:.0f} req/s open loop (2 replicas, 3 nodes)", cols,
                [[("-" if r[c] is None else r[c]) for c in cols] for r in results])
    out = write_json("failover", {"rate": a.rate, "results": results})
    png = png_path("failover")
    plot(results, png)
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    asyncio.run(main())
