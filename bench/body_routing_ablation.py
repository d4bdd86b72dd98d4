"""Where llmgw's Envoy spends CPU per request beyond a plain static Envoy, at 1 KB bodies.

llmgw's own config is taken from a live Envoy (admin /config_dump, with EDS), turned
into a static bootstrap, and replayed with one feature removed at a time: the body
routing (json_to_metadata + the metadata route match: replaced by one prefix route),
per-endpoint stats, active health checks, the retry policy, outlier detection. Each
variant runs in its own Envoy (1 worker) behind the same two simulated engines under
wrk (4 connections, 1 KB prompt); Envoy's CPU time per request is read from /proc.
Rounds are interleaved and the median is reported.

Run:  .venv/bin/python bench/body_routing_ablation.py [--rounds 3] [--seconds 6]
      (needs `wrk`: apt-get install wrk)
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import png_path, print_table, write_json  # noqa: E402
from bench.proxy_overhead import body, cpu_seconds, spawn, static_envoy, wait_http, wrk  # noqa: E402
from controlplane.catalog import parse_catalog  # noqa: E402
from controlplane.endpoints import Endpoint  # noqa: E402
from controlplane.envoy_proc import EnvoyProcess, envoy_binary  # noqa: E402
from controlplane.netutil import free_port  # noqa: E402
from controlplane.publisher import StaticSource  # noqa: E402
from controlplane.runtime import ControlPlane  # noqa: E402

VARIANTS = {
    "static Envoy (no body routing)": "static",
    "llmgw": "",
    "llmgw without body routing": "no-body-routing",
    "llmgw without per-endpoint stats": "no-endpoint-stats",
    "llmgw without health checks": "no-health-checks",
    "llmgw without retries": "no-retries",
    "llmgw without outlier detection": "no-outlier-detection",
}


async def llmgw_config(ports: list[int]) -> dict[str, Any]:
    """The config llmgw gives Envoy for one model on these engines (config_dump)."""
    cat = parse_catalog("models: [{name: m}]")
    cp = ControlPlane(cat, xds=("127.0.0.1", 0), api=None, load_interval_s=0,
                      sources=[StaticSource([Endpoint("m", "127.0.0.1", p) for p in ports])])
    await cp.start()
    env = EnvoyProcess("127.0.0.1", cp.xds_port, node_id="ablation")
    try:
        await env.start()
        await env.wait_listener()
        async with aiohttp.ClientSession() as s:
            for _ in range(100):  # until the routes and endpoints are in
                async with s.get(env.admin_url + "/config_dump?include_eds") as r:
                    dump: dict[str, Any] = await r.json(content_type=None)
                text = json.dumps(dump)
                if '"lb_endpoints"' in text and '"dynamic_route_configs"' in text:
                    return dump
                await asyncio.sleep(0.1)
        raise RuntimeError("Envoy never received the routes and endpoints")
    finally:
        await env.stop()
        await cp.stop()


def _section(dump: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in dump["configs"] if c["@type"].endswith("." + kind))


def bootstrap(dump: dict[str, Any], port: int, variant: str) -> dict[str, Any]:
    eds = {e["endpoint_config"]["cluster_name"]: e["endpoint_config"]
           for e in _section(dump, "EndpointsConfigDump").get("dynamic_endpoint_configs", [])}
    clusters = []
    for dc in _section(dump, "ClustersConfigDump")["dynamic_active_clusters"]:
        c = copy.deepcopy(dc["cluster"])
        c.pop("@type", None)
        c.pop("eds_cluster_config", None)
        c["type"] = "STATIC"
        la = copy.deepcopy(eds[c["name"]])
        la.pop("@type", None)
        for loc in la.get("endpoints", []):
            loc.pop("load_balancing_weight", None)
            for lb in loc.get("lb_endpoints", []):
                lb.pop("health_status", None)
                lb.pop("load_balancing_weight", None)
        c["load_assignment"] = la
        drop = {"no-endpoint-stats": "track_cluster_stats", "no-health-checks": "health_checks",
                "no-outlier-detection": "outlier_detection"}.get(variant)
        if drop:
            c.pop(drop, None)
        clusters.append(c)
    lst = copy.deepcopy(_section(dump, "ListenersConfigDump")["dynamic_listeners"][0]
                        ["active_state"]["listener"])
    lst.pop("@type", None)
    lst["address"]["socket_address"]["port_value"] = port
    hcm = lst["filter_chains"][0]["filters"][0]["typed_config"]
    rc = copy.deepcopy(_section(dump, "RoutesConfigDump")["dynamic_route_configs"][0]
                       ["route_config"])
    rc.pop("@type", None)
    hcm.pop("rds")
    hcm["route_config"] = rc
    routes = rc["virtual_hosts"][0]["routes"]
    if variant == "no-retries":
        for r in routes:
            if "route" in r:
                r["route"].pop("retry_policy", None)
    if variant == "no-body-routing":
        hcm["http_filters"] = [f for f in hcm["http_filters"]
                               if "json_to_metadata" not in f["name"]]
        model = next(r for r in routes if r.get("name") == "model:m")
        model["match"] = {"prefix": "/"}
        rc["virtual_hosts"][0]["routes"] = [model]
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                     "port_value": 0}}},
            "static_resources": {"listeners": [lst], "clusters": clusters}}


async def measure(cfg: dict[str, Any], port: int, work: Path, seconds: float) -> float:
    f = work / f"envoy-{port}.json"
    f.write_text(json.dumps(cfg))
    proc = spawn([str(envoy_binary()), "-c", str(f), "--disable-hot-restart",
                  "--concurrency", "1", "-l", "warning"], work / f"envoy-{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_http(url, 20, proc)
        wrk(url, 2, 4, body(1024), work)  # warm up
        c0 = cpu_seconds([proc.pid])
        r = wrk(url, seconds, 4, body(1024), work)
        if r["errors"]:
            raise RuntimeError(f"{r['errors']} non-2xx answers")
        return (cpu_seconds([proc.pid]) - c0) / r["requests"] * 1e6
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmgw-ablation-"))
    ports = [free_port(), free_port()]
    engines = [spawn([sys.executable, "-m", "agents.simengine", "--port", str(p), "--model",
                      "m", "--ttft", "0", "--tokens-per-s", "1000000", "--max-concurrency",
                      "1024"], work / f"engine-{p}.log") for p in ports]
    runs: dict[str, list[float]] = {}
    try:
        for p in ports:
            await wait_http(f"http://127.0.0.1:{p}", 30)
        dump = await llmgw_config(ports)
        for rnd in range(a.rounds):
            for name, variant in VARIANTS.items():
                port = free_port()
                cfg = static_envoy(port, ports) if variant == "static" else \
                    bootstrap(dump, port, variant)
                us = await measure(cfg, port, work, a.seconds)
                runs.setdefault(name, []).append(us)
                print(f"round {rnd + 1}/{a.rounds}, {name}: {us:.1f} us/request", flush=True)
    finally:
        for e in engines:
            os.killpg(e.pid, signal.SIGTERM)
            e.wait(10)
    base = statistics.median(runs["static Envoy (no body routing)"])
    rows = [{"variant": n, "cpu_us_per_req": statistics.median(xs),
             "vs_static_pct": (statistics.median(xs) / base - 1) * 100, "runs": xs}
            for n, xs in runs.items()]
    cols = ["variant", "cpu_us_per_req", "vs_static_pct"]
    print_table(f"Envoy CPU per 1 KB request, median of {a.rounds} rounds", cols,
                [[r[c] for c in cols] for r in rows])
    out = write_json("body_routing_ablation", {"rounds": a.rounds, "seconds": a.seconds,
                                               "results": rows})
    plot(rows, png_path("body_routing_ablation"))
    print(f"wrote {out} and {png_path('body_routing_ablation')}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.barh([r["variant"] for r in rows], [r["cpu_us_per_req"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("Envoy CPU per request (us), 1 KB body")
    ax.set_title("what llmgw's Envoy config costs over a plain static Envoy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    asyncio.run(main())
