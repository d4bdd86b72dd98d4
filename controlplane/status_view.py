"""Rendering the status document for a terminal (`llmgw status`).

Owns presentation only: models with their published endpoints, nodes with GPUs and
replicas by state, replica load and weights, the reconciler's and autoscaler's recent
decisions, and each Envoy with its last ACK and NACK (Envoy's error text included).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table


def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0.0, time.time() - ts)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago"


def _models(doc: dict[str, Any]) -> Table:
    t = Table(title="Models", title_justify="left")
    for col in ("model", "aliases", "min/target/max", "endpoints (Envoy)", "draining", "note"):
        t.add_column(col)
    for m in doc.get("models", []):
        eps = m.get("endpoints", [])
        t.add_row(
            m["name"], ", ".join(m.get("aliases", [])) or "-",
            f"{m.get('min_replicas')}/{m.get('target')}/{m.get('max_replicas')}",
            "\n".join(e["address"] for e in eps) or "[red]none[/]",
            str(sum(1 for e in eps if e.get("draining"))),
            m.get("unplaced") or "",
        )
    return t


def _load(doc: dict[str, Any]) -> Table | None:
    t = Table(title="Replica load (from engine /metrics)", title_justify="left")
    for col in ("model", "replica", "balancing", "running", "waiting", "KV cache", "TTFT",
                "weight"):
        t.add_column(col)
    rows = 0
    for m in doc.get("models", []):
        for e in m.get("endpoints", []):
            ld = e.get("load")
            if ld is None:
                continue
            rows += 1
            if "error" in ld:
                cells = [f"[red]{ld['error']}[/]", "", "", ""]
            else:
                ttft = ld.get("ttft_s")
                cells = [f"{ld['running']:g}", f"{ld['waiting']:g}", f"{ld['kv_usage']:.0%}",
                         "-" if ttft is None else f"{ttft * 1000:.0f} ms"]
            t.add_row(m["name"], e["address"], m.get("load_balancing", ""), *cells,
                      str(e.get("weight") or "equal"))
    return t if rows else None


def _nodes(doc: dict[str, Any]) -> Table:
    t = Table(title="Nodes", title_justify="left")
    for col in ("node", "state", "GPUs used/total", "replicas", "labels"):
        t.add_column(col)
    colors = {"Ready": "green", "Unreachable": "yellow", "Lost": "red"}
    cordoned = set(doc.get("cordoned", []))
    for n in doc.get("nodes", []):
        state = f"[{colors.get(n['state'], 'white')}]{n['state']}[/]"
        if n["name"] in cordoned:
            state += " (cordoned)"
        reps = "\n".join(
            f"{r['model']} {r['replica_id'].rsplit('-', 1)[-1]} {r['state']}"
            + (f" {r['endpoint']}" if r["endpoint"] else "") + (" STALE" if r["stale"] else "")
            for r in n["replicas"]) or "-"
        t.add_row(n["name"], state, f"{n['gpus_used']}/{len(n['gpus'])}", reps,
                  ",".join(f"{k}={v}" for k, v in n["labels"].items()) or "-")
    return t


def _envoys(doc: dict[str, Any]) -> Table:
    xds = doc.get("xds", {})
    t = Table(title=f"Envoys (xDS port {xds.get('port')})", title_justify="left")
    for col in ("node", "mode", "type", "acked version", "pushes", "NACKs", "last NACK"):
        t.add_column(col)
    for e in xds.get("envoys", []):
        for i, (typ, s) in enumerate(sorted(e.get("types", {}).items())):
            nack = s.get("last_nack")
            t.add_row(
                e["node_id"] if i == 0 else "", e["mode"] if i == 0 else "", typ,
                s.get("acked_version") or "-", str(s.get("pushes", 0)), str(s.get("nacks", 0)),
                "-" if not nack else f"{_ago(nack['at'])}: {nack['message'][:1000]}",
            )
    if not xds.get("envoys"):
        t.add_row("[yellow]no Envoy connected[/]", "", "", "", "", "", "")
    return t


TRAFFIC_STATS = {
    "requests": "upstream_rq_total",
    "5xx": "upstream_rq_5xx",
    "active": "upstream_rq_active",
    "retries": "upstream_rq_retry",
    "ejected": "outlier_detection.ejections_active",
    "healthy hosts": "membership_healthy",
}


def envoy_traffic(admin_url: str, models: list[str]) -> dict[str, dict[str, int]]:
    """Per-model counters from an Envoy's admin stats (raises OSError if unreachable)."""
    import json
    import urllib.parse
    import urllib.request

    from xds.translate import cluster_name

    url = (admin_url.rstrip("/") + "/stats?format=json&filter="
           + urllib.parse.quote(r"^cluster\.model-"))
    with urllib.request.urlopen(url, timeout=5) as r:
        # Histograms come as entries without a name: only counters and gauges here.
        stats = {s["name"]: s.get("value", 0) for s in json.loads(r.read()).get("stats", [])
                 if "name" in s and isinstance(s.get("value", 0), int)}
    out = {}
    for m in models:
        prefix = f"cluster.{cluster_name(m)}."
        out[m] = {k: int(stats.get(prefix + v, 0)) for k, v in TRAFFIC_STATS.items()}
    return out


def _traffic(traffic: dict[str, dict[str, int]], admin_url: str) -> Table:
    t = Table(title=f"Traffic (Envoy admin {admin_url})", title_justify="left")
    t.add_column("model")
    for k in TRAFFIC_STATS:
        t.add_column(k, justify="right")
    for m, row in traffic.items():
        t.add_row(m, *(str(row[k]) for k in TRAFFIC_STATS))
    return t


def render_status(doc: dict[str, Any], console: Console | None = None,
                  envoy_admin: str | None = None) -> None:
    console = console or Console()
    for item in status_renderables(doc, envoy_admin):
        console.print(item)


def status_renderables(doc: dict[str, Any], envoy_admin: str | None = None) -> list[Any]:
    """Everything `llmgw status` shows, as rich renderables (for print or Live)."""
    from rich.console import Group
    from rich.text import Text

    out: list[Any] = []
    console = _Collector(out)
    console.print(_models(doc))
    if envoy_admin:
        models = [m["name"] for m in doc.get("models", [])]
        try:
            console.print(_traffic(envoy_traffic(envoy_admin, models), envoy_admin))
        except OSError as e:
            console.print(Text(f"Envoy admin {envoy_admin} unreachable: {e}", style="yellow"))
    load = _load(doc)
    if load is not None:
        console.print(load)
    if doc.get("nodes"):
        console.print(_nodes(doc))
        states = Counter(r["state"] for n in doc["nodes"] for r in n["replicas"])
        console.print("replicas by state: " + (", ".join(f"{k} {v}" for k, v in
                                                           sorted(states.items())) or "none"))
    console.print(_envoys(doc))
    st = doc.get("xds", {}).get("stats", {})
    console.print(f"xDS totals: pushes {st.get('pushes')}, ACKs {st.get('acks')}, "
                  f"NACKs {st.get('nacks')}, stale requests {st.get('stale')}")
    cat = doc.get("catalog")
    if cat and cat.get("last_error"):
        console.print(f"[red]last catalog edit refused[/] (last good catalog in force):\n"
                      f"{cat['last_error']}")
    _recent(console, "autoscaler:", doc.get("autoscaler", []),
            lambda d: f"{d['model']} {d['from_replicas']} -> {d['to_replicas']} replicas")
    _recent(console, "recent decisions:", doc.get("decisions", []),
            lambda d: f"{d['action']} {d['replica_id']} on {d['node']}")
    return [Group(*out)]


def _recent(console: _Collector, title: str, items: list[dict[str, Any]],
            what: Callable[[dict[str, Any]], str]) -> None:
    """The last ten decisions of a kind: when, what, and why."""
    if not items:
        return
    console.print(title)
    for d in items[-10:]:
        console.print(f"  {_ago(d['at'])}: {what(d)}: {d['reason']}")


class _Collector:
    """Collects what would be printed, so one function serves print and Live."""

    def __init__(self, out: list[Any]) -> None:
        self.out = out

    def print(self, item: Any) -> None:
        self.out.append(item)
