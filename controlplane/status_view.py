"""Rendering the status document for a terminal (`llmgw status`).

Owns presentation only: tables of models and endpoints, and of each Envoy with its
last ACK and last NACK (with Envoy's error text, shortened).
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table


def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0.0, time.time() - ts)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago"


def render_status(doc: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    models = Table(title="Models", title_justify="left")
    for col in ("model", "aliases", "endpoints", "draining"):
        models.add_column(col)
    for m in doc.get("models", []):
        eps = m.get("endpoints", [])
        models.add_row(
            m["name"],
            ", ".join(m.get("aliases", [])) or "-",
            "\n".join(e["address"] for e in eps) or "[red]none[/]",
            str(sum(1 for e in eps if e.get("draining"))),
        )
    console.print(models)

    xds = doc.get("xds", {})
    envoys = Table(title=f"Envoys (xDS port {xds.get('port')})", title_justify="left")
    for col in ("node", "mode", "type", "acked version", "pushes", "NACKs", "last NACK"):
        envoys.add_column(col)
    for e in xds.get("envoys", []):
        for i, (t, s) in enumerate(sorted(e.get("types", {}).items())):
            nack = s.get("last_nack")
            envoys.add_row(
                e["node_id"] if i == 0 else "",
                e["mode"] if i == 0 else "",
                t,
                s.get("acked_version") or "-",
                str(s.get("pushes", 0)),
                str(s.get("nacks", 0)),
                "-" if not nack else f"{_ago(nack['at'])}: {nack['message'][:1000]}",
            )
    if not xds.get("envoys"):
        envoys.add_row("[yellow]no Envoy connected[/]", "", "", "", "", "", "")
    console.print(envoys)
    st = xds.get("stats", {})
    console.print(f"xDS totals: pushes {st.get('pushes')}, ACKs {st.get('acks')}, "
                  f"NACKs {st.get('nacks')}, stale requests {st.get('stale')}")
