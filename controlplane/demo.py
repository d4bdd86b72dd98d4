"""`llmgw demo`: the all-in-one on one machine — control plane, three agents, Envoy.

Owns the demo's orchestration: the control plane runs in this process (agent server,
inventory, reconciler, xDS, status API), three node agents with simulated GPUs run as
child processes, and Envoy runs from the wheel. It shows progress until every model has
its minimum of Ready replicas behind Envoy, prints the URLs and a curl to paste, and
stops everything on Ctrl-C (agents stop their engines on SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from controlplane.agent_server import AgentAuth
from controlplane.catalog import Catalog, load_catalog
from controlplane.envoy_proc import EnvoyProcess
from controlplane.inventory import Inventory
from controlplane.netutil import port_free
from controlplane.runtime import ControlPlane
from xds.translate import cluster_name

DEMO_CATALOG = Path(__file__).with_name("demo_catalog.yaml")
NODES = (("gpu-node-1", "zone=a"), ("gpu-node-2", "zone=b"), ("gpu-node-3", "zone=c"))


@dataclass(frozen=True)
class DemoPorts:
    listener: int | None = None  # None: the catalog's
    admin: int = 9901
    xds: int = 18000
    api: int = 18001
    agents: int = 18002


async def _ready_counts(envoy: EnvoyProcess, catalog: Catalog) -> tuple[int, int]:
    """(replicas Envoy can route to, replicas wanted) over all models."""
    have = 0
    for m in catalog.models:
        hosts = await envoy.hosts(cluster_name(m.name))
        ok = [h for h in hosts if not h.failed_active_hc and h.eds_health != "DRAINING"]
        have += min(len(ok), m.min_replicas)
    return have, sum(m.min_replicas for m in catalog.models)


DEFAULT_PORTS = DemoPorts()


async def run_demo(catalog_path: Path = DEMO_CATALOG, *, ports: DemoPorts = DEFAULT_PORTS,
                   delta: bool = False, exit_after: float | None = None,
                   timeout: float = 120.0) -> int:
    console = Console()
    catalog: Catalog = load_catalog(catalog_path)
    if ports.listener is not None:
        catalog = catalog.model_copy(update={
            "listener": catalog.listener.model_copy(update={"port": ports.listener})})
    lst = catalog.listener
    for what, host, port in [("Envoy listener", lst.address, lst.port),
                             ("Envoy admin", "127.0.0.1", ports.admin),
                             ("xDS server", "127.0.0.1", ports.xds),
                             ("status API", "127.0.0.1", ports.api),
                             ("agent server", "127.0.0.1", ports.agents)]:
        if not port_free(host, port):
            console.print(f"[red]error:[/] {what} port {host}:{port} is already in use")
            return 2
    work = Path(tempfile.mkdtemp(prefix="llmgw-demo-"))
    token = secrets.token_urlsafe(24)  # agents authenticate even in the demo
    cp = ControlPlane(
        catalog, xds=("127.0.0.1", ports.xds), api=("127.0.0.1", ports.api),
        agents=("127.0.0.1", ports.agents), agent_auth=AgentAuth(token=token),
        inventory=Inventory(unreachable_after=3, lost_after=10), lease_s=10,
        # Place replicas once all three nodes are there, so they spread.
        startup_grace_s=30, expected_nodes=[n for n, _ in NODES],
        catalog_path=catalog_path if ports.listener is None else None,
    )
    agents: list[asyncio.subprocess.Process] = []
    envoy: EnvoyProcess | None = None
    try:
        with console.status("starting the control plane...") as status:
            await cp.start()
            status.update("starting 3 node agents (2 simulated H100 each)...")
            for node, label in NODES:
                log = (work / f"{node}.log").open("ab")
                agents.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "controlplane.cli", "agent", "--control-plane",
                    f"127.0.0.1:{cp.agents_port}", "--node", node, "--label", label,
                    "--simulate-gpus", "2xH100-80GB", "--state-dir", str(work / node),
                    "--fence-after", "20",
                    env={**os.environ, "LLMGW_AGENT_TOKEN": token}, stdout=log, stderr=log,
                    start_new_session=True))
                log.close()
            status.update("starting Envoy and waiting until it is LIVE...")
            envoy = EnvoyProcess("127.0.0.1", cp.xds_port, admin_port=ports.admin,
                                 delta=delta, node_id="llmgw-demo", workdir=work)
            await envoy.start()
            listener = await envoy.wait_listener()
            deadline = time.monotonic() + timeout
            while True:
                have, want = await _ready_counts(envoy, catalog)
                nodes = len(cp.inventory.view().nodes)
                status.update(f"placing replicas: {have}/{want} Ready behind Envoy "
                              f"({nodes}/3 nodes registered)...")
                if have >= want:
                    break
                if time.monotonic() > deadline:
                    console.print(f"[red]error:[/] only {have}/{want} replicas Ready after "
                                  f"{timeout:.0f}s; agent logs in {work}")
                    return 1
                await asyncio.sleep(0.2)
        first = catalog.models[0]
        alias = first.aliases[0] if first.aliases else first.name
        console.print(f"[green]llmgw demo is up[/] ({'delta' if delta else 'state-of-the-world'}"
                      f" xDS): {want} replicas of {len(catalog.models)} models on 3 nodes")
        console.print(f"  Envoy listener: http://{listener}")
        console.print(f"  Envoy admin:    {envoy.admin_url}")
        console.print(f"  control plane:  http://127.0.0.1:{cp.api_port}/status   "
                      f"(llmgw status --url http://127.0.0.1:{cp.api_port})")
        console.print(f"  logs:           {work}")
        console.print("Try:")
        console.print(f"  curl -s http://{listener}/v1/chat/completions -H 'content-type: "
                      f"application/json' -d '{{\"model\": \"{alias}\", \"messages\": "
                      "[{\"role\": \"user\", \"content\": \"hi\"}], \"stream\": true}'",
                      soft_wrap=True)
        console.print(f"  curl -s http://{listener}/v1/models", soft_wrap=True)
        console.print("Ctrl-C stops everything.")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), exit_after)
        console.print("stopping...")
        return 0
    finally:
        for p in agents:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in agents:
            try:
                await asyncio.wait_for(p.wait(), 20)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        if envoy is not None:
            await envoy.stop()
        await cp.stop()
