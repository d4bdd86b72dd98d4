"""Shared fixtures: real simulated-engine processes, a control plane and a real Envoy.

Everything binds loopback on ports picked at run time; nothing uses the demo's ports.
Waits are on conditions with deadlines, never bare sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from bench.harness import wait_for as wait_for  # re-exported for the tests
from controlplane.catalog import Catalog, parse_catalog
from controlplane.endpoints import Endpoint
from controlplane.envoy_proc import EnvoyProcess
from controlplane.netutil import free_port
from controlplane.publisher import StaticSource
from controlplane.runtime import ControlPlane


@dataclass
class EngineProc:
    replica_id: str
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def endpoint(self, model: str, **kw: object) -> Endpoint:
        return Endpoint(model, "127.0.0.1", self.port, replica_id=self.replica_id, **kw)  # type: ignore[arg-type]

    def fault(self, **faults: object) -> None:
        req = urllib.request.Request(self.url + "/admin/fault", data=json.dumps(faults).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            r.read()


def start_engine(replica_id: str, tokens_per_s: float = 100.0,
                 extra: tuple[str, ...] = ()) -> EngineProc:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agents.simengine", "--port", str(port), "--model", "pool",
         "--replica-id", replica_id, "--ttft", "0.005", "--tokens-per-s", str(tokens_per_s),
         *extra],
        start_new_session=True,
    )
    return EngineProc(replica_id, port, proc)


def wait_engine(e: EngineProc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if e.proc.poll() is not None:
            raise RuntimeError(f"engine {e.replica_id} exited with {e.proc.returncode}")
        try:
            with urllib.request.urlopen(e.url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"engine {e.replica_id} not healthy after {timeout}s")


def stop_engine(e: EngineProc) -> None:
    if e.proc.poll() is None:
        os.killpg(e.proc.pid, signal.SIGTERM)
        try:
            e.proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(e.proc.pid, signal.SIGKILL)
            e.proc.wait()


@pytest.fixture(scope="module")
def engines() -> Iterator[list[EngineProc]]:
    """Four simulated engine processes shared by a test module; faults reset per test."""
    pool = [start_engine(f"e{i}") for i in range(4)]
    try:
        for e in pool:
            wait_engine(e)
        yield pool
    finally:
        for e in pool:
            stop_engine(e)


@pytest.fixture(autouse=True)
def _reset_faults(request: pytest.FixtureRequest) -> None:
    if "engines" in request.fixturenames:
        for e in request.getfixturevalue("engines"):
            e.fault(error_rate=0.0, latency_s=0.0, hang=False, unhealthy=False, crash_after=-1,
                    decode_slowdown=1.0)


@pytest.fixture(params=["sotw", "delta"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@dataclass
class Gateway:
    cp: ControlPlane
    envoy: EnvoyProcess
    url: str
    session: aiohttp.ClientSession

    async def chat(self, model: str, *, stream: bool = False, max_tokens: int = 4,
                   **extra: object) -> tuple[int, dict[str, object] | str, str]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": max_tokens, "stream": stream, **extra}
        async with self.session.post(self.url + "/v1/chat/completions", json=body) as r:
            text = await r.text()
            replica = r.headers.get("x-llmgw-replica", "")
            try:
                return r.status, json.loads(text), replica
            except json.JSONDecodeError:
                return r.status, text, replica


GatewayFactory = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def gateway(mode: str, tmp_path: Path) -> AsyncIterator[GatewayFactory]:
    """Start control plane + Envoy for a catalog and endpoints; torn down after the test."""
    started: list[Gateway] = []

    async def make(catalog: str | Catalog, endpoints: list[Endpoint] = (),  # type: ignore[assignment]
                   listener_port: int | None = None, wait_listener: bool = True,
                   load_interval_s: float = 0.0, **cp_args: object) -> Gateway:
        port = listener_port or free_port()
        if isinstance(catalog, str):
            text = catalog
            catalog = parse_catalog(text)
        catalog = catalog.model_copy(
            update={"listener": catalog.listener.model_copy(update={"port": port})})
        # The load poller is off unless a test asks for it: its weight updates would
        # add EDS pushes to tests that count them.
        cp = ControlPlane(catalog, xds=("127.0.0.1", 0), api=None,
                          sources=[StaticSource(endpoints)], load_interval_s=load_interval_s,
                          **cp_args)  # type: ignore[arg-type]
        await cp.start()
        envoy = EnvoyProcess("127.0.0.1", cp.xds_port, delta=(mode == "delta"),
                             node_id=f"test-{mode}", workdir=tmp_path)
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        gw = Gateway(cp, envoy, f"http://127.0.0.1:{port}", session)
        started.append(gw)
        await envoy.start()
        if wait_listener:
            await envoy.wait_listener()
        return gw

    yield make
    for gw in started:
        await gw.session.close()
        await gw.envoy.stop()
        await gw.cp.stop()
