"""`llmgw demo`: the all-in-one on one machine — control plane, engines and Envoy.

Owns the demo's orchestration: starts simulated engines as child processes, the
control plane in this process (endpoints published through the same EndpointSource
interface the reconciler uses), and Envoy on the default ports; shows progress, prints
the URLs and a curl to paste, and stops everything on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

import aiohttp
from rich.console import Console

from controlplane.catalog import Catalog, load_catalog
from controlplane.endpoints import Endpoint
from controlplane.envoy_proc import EnvoyProcess
from controlplane.netutil import free_port, port_free
from controlplane.publisher import StaticSource
from controlplane.runtime import ControlPlane

DEMO_CATALOG = Path(__file__).with_name("demo_catalog.yaml")


async def _wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not healthy after {timeout}s")


async def run_demo(
    catalog_path: Path = DEMO_CATALOG,
    *,
    xds_port: int = 18000,
    api_port: int = 18001,
    admin_port: int = 9901,
    delta: bool = False,
    exit_after: float | None = None,
) -> int:
    console = Console()
    catalog: Catalog = load_catalog(catalog_path)
    lst = catalog.listener
    for what, host, port in [("Envoy listener", lst.address, lst.port),
                             ("Envoy admin", "127.0.0.1", admin_port),
                             ("xDS server", "127.0.0.1", xds_port),
                             ("status API", "127.0.0.1", api_port)]:
        if not port_free(host, port):
            console.print(f"[red]error:[/] {what} port {host}:{port} is already in use")
            return 2
    procs: list[asyncio.subprocess.Process] = []
    endpoints: list[Endpoint] = []
    cp: ControlPlane | None = None
    envoy: EnvoyProcess | None = None
    try:
        with console.status("starting simulated engines...") as status:
            for m in catalog.models:
                for i in range(max(1, m.min_replicas)):
                    port = free_port()
                    rid = f"{m.name}-{i}"
                    procs.append(await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "agents.simengine", "--port", str(port),
                        "--model", m.name, "--replica-id", rid, start_new_session=True))
                    endpoints.append(Endpoint(m.name, "127.0.0.1", port, replica_id=rid))
            for n, ep in enumerate(endpoints, 1):
                status.update(f"waiting for engine {n}/{len(endpoints)} ({ep.replica_id}) "
                              "to be healthy...")
                await _wait_healthy(f"http://{ep.address}/health", 30)
            status.update("starting control plane...")
            cp = ControlPlane(catalog, xds=("127.0.0.1", xds_port), api=("127.0.0.1", api_port),
                              sources=[StaticSource(endpoints)])
            await cp.start()
            status.update("starting Envoy and waiting until it is LIVE...")
            envoy = EnvoyProcess("127.0.0.1", xds_port, admin_port=admin_port, delta=delta,
                                 node_id="llmgw-demo")
            await envoy.start()
            listener = await envoy.wait_listener()
        first = catalog.models[0]
        alias = first.aliases[0] if first.aliases else first.name
        console.print(f"[green]llmgw demo is up[/] ({'delta' if delta else 'state-of-the-world'}"
                      f" xDS), {len(endpoints)} replicas of {len(catalog.models)} models")
        console.print(f"  Envoy listener: http://{listener}")
        console.print(f"  Envoy admin:    {envoy.admin_url}")
        console.print(f"  control plane:  http://127.0.0.1:{cp.api_port}/status "
                      f"(llmgw status --url http://127.0.0.1:{cp.api_port})")
        console.print("Try:")
        console.print(f"  curl -s http://{listener}/v1/chat/completions -H 'content-type: "
                      f"application/json' -d '{{\"model\": \"{alias}\", \"messages\": "
                      "[{\"role\": \"user\", \"content\": \"hi\"}], \"stream\": true}'",
                      soft_wrap=True)
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
        if envoy is not None:
            await envoy.stop()
        if cp is not None:
            await cp.stop()
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), 5)
            except TimeoutError:
                p.kill()
