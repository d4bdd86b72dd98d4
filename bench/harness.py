"""A whole fleet on one machine, for tests and benchmarks.

Owns the harness: a control plane in this process, agent processes (optionally in
network namespaces), a real Envoy, a closed-loop client load that tells cut streams
from failures, and `wait_for`, the polling-with-deadline helper every test uses.
Everything on loopback (or the caller's own namespaces), on ports picked at run time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from controlplane.agent_server import AgentAuth
from controlplane.catalog import Catalog, load_catalog
from controlplane.envoy_proc import EnvoyProcess
from controlplane.inventory import Inventory, NodeState, ReplicaState
from controlplane.netutil import free_port
from controlplane.runtime import ControlPlane
from xds.translate import cluster_name


async def wait_for(cond: Callable[[], Awaitable[bool]], timeout: float, what: str,
                   interval: float = 0.02) -> float:
    """Poll `cond` until true; return the seconds it took; fail with `what` at the deadline."""
    start = time.monotonic()
    while True:
        if await cond():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


TOKEN = "fleet-test-token"


@dataclass
class Agent:
    node: str
    proc: subprocess.Popen[bytes]
    log: Path
    state_dir: Path


class Fleet:
    def __init__(self, tmp: Path, catalog_yaml: str, *, delta: bool = False,
                 unreachable_after: float = 1.0, lost_after: float = 3.0,
                 load_interval_s: float = 1.0) -> None:
        self.tmp = tmp
        self.catalog_path = tmp / "catalog.yaml"
        self.listener_port = free_port()
        self.write_catalog(catalog_yaml)
        self.agents_port = free_port()
        # Where agents reach the control plane: loopback, or the host end of a test's
        # veth when some agents live in network namespaces.
        self.agents_host = "127.0.0.1"
        self.delta = delta
        self.unreachable_after = unreachable_after
        self.lost_after = lost_after
        self.load_interval_s = load_interval_s
        self.cp: ControlPlane | None = None
        self.envoy: EnvoyProcess | None = None
        self.agents: dict[str, Agent] = {}
        self.session: aiohttp.ClientSession | None = None

    def write_catalog(self, text: str) -> None:
        if "listener:" not in text:
            text = f"listener: {{port: {self.listener_port}}}\n" + text
        tmp = self.catalog_path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.catalog_path)

    def catalog(self) -> Catalog:
        assert self.cp is not None
        return self.cp.publisher.catalog

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener_port}"

    async def start(self, nodes: int = 3, gpus: str = "2xH100-80GB", xds_port: int = 0,
                    startup_grace_s: float = 0.0, state_dir: Path | None = None) -> None:
        await self.start_cp(xds_port=xds_port, startup_grace_s=startup_grace_s,
                            state_dir=state_dir)
        for i in range(nodes):
            self.start_agent(f"node-{i + 1}", gpus)
        await self.start_envoy()

    async def start_envoy(self) -> None:
        assert self.cp is not None
        self.envoy = EnvoyProcess("127.0.0.1", self.cp.xds_port, delta=self.delta,
                                  node_id="fleet-envoy", workdir=self.tmp)
        await self.envoy.start()
        await self.envoy.wait_listener()
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))

    async def start_cp(self, xds_port: int = 0, startup_grace_s: float = 0.0,
                       state_dir: Path | None = None,
                       expected_nodes: tuple[str, ...] = ()) -> ControlPlane:
        inv = Inventory(unreachable_after=self.unreachable_after, lost_after=self.lost_after,
                        tick_interval=0.05)
        self.cp = ControlPlane(
            load_catalog(self.catalog_path), xds=("127.0.0.1", xds_port), api=None,
            agents=(self.agents_host, self.agents_port), agent_auth=AgentAuth(token=TOKEN),
            inventory=inv, lease_s=self.lost_after, catalog_path=self.catalog_path,
            startup_grace_s=startup_grace_s, state_dir=state_dir, resync_s=0.2,
            expected_nodes=expected_nodes, load_interval_s=self.load_interval_s)
        await self.cp.start()
        return self.cp

    def start_agent(self, node: str, gpus: str = "2xH100-80GB", *extra: str,
                    netns: str | None = None, control_plane: str | None = None) -> Agent:
        log = self.tmp / f"{node}.log"
        state = self.tmp / f"state-{node}"
        cmd = [sys.executable, "-m", "controlplane.cli", "agent", "--control-plane",
               control_plane or f"{self.agents_host}:{self.agents_port}", "--node", node,
               "--simulate-gpus", gpus, "--state-dir", str(state), "--heartbeat", "0.2",
               "--fence-after", str(self.lost_after * 3), *extra]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        proc = subprocess.Popen(cmd, env={**os.environ, "LLMGW_AGENT_TOKEN": TOKEN},
                                stdout=log.open("ab"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.agents[node] = Agent(node, proc, log, state)
        return self.agents[node]

    def kill_node(self, node: str) -> None:
        """SIGKILL a node's agent and every engine it runs: the machine died."""
        a = self.agents[node]
        pids = [a.proc.pid]
        with contextlib.suppress(OSError, ValueError):
            pids += [e["pid"] for e in json.loads((a.state_dir / "replicas.json").read_text())]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        a.proc.wait()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        for a in self.agents.values():
            if a.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    a.proc.send_signal(signal.SIGTERM)
        for a in self.agents.values():
            try:
                a.proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(a.proc.pid, signal.SIGKILL)
            with contextlib.suppress(OSError, ValueError):
                for e in json.loads((a.state_dir / "replicas.json").read_text()):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(e["pid"], signal.SIGKILL)
        if self.envoy is not None:
            await self.envoy.stop()
        if self.cp is not None:
            await self.cp.stop()

    # ------------------------------------------------------------------ waiting

    async def node_state(self, node: str, state: NodeState, timeout: float = 20) -> None:
        async def check() -> bool:
            assert self.cp is not None
            n = self.cp.inventory.view().node(node)
            return n is not None and n.state == state

        await wait_for(check, timeout, f"node {node} to be {state}")

    async def node_state_ready(self, node: str, timeout: float = 20) -> None:
        async def check() -> bool:
            assert self.cp is not None
            n = self.cp.inventory.view().node(node)
            return n is not None and n.state == NodeState.READY and n.connected

        await wait_for(check, timeout, f"node {node} to be Ready")

    def replicas(self, model: str, states: tuple[ReplicaState, ...] = (ReplicaState.READY,)
                 ) -> list[tuple[str, str, str]]:
        """(node, replica id, profile hash) of a model's replicas in these states."""
        assert self.cp is not None
        out = []
        for n in self.cp.inventory.view().nodes:
            if n.state == NodeState.LOST:
                continue
            for r in n.replicas:
                if r.model == model and r.state in states and not r.stale:
                    out.append((n.name, r.replica_id, r.profile_hash))
        return out

    async def converged(self, want: dict[str, int], timeout: float = 60) -> None:
        """Every model has exactly `want` Ready replicas, nothing else live, all of
        them healthy in Envoy, and no model outside `want` has a cluster."""
        assert self.cp is not None and self.envoy is not None
        live = (ReplicaState.REQUESTED, ReplicaState.STARTING, ReplicaState.DRAINING)

        async def check() -> bool:
            assert self.envoy is not None and self.cp is not None
            cat = self.catalog()
            for m in cat.models:
                ready = self.replicas(m.name)
                if len(ready) != want.get(m.name, 0) or self.replicas(m.name, live):
                    return False
                hashes = m.profile_hashes
                if any(h not in hashes for _, _, h in ready):
                    return False
                hosts = await self.envoy.hosts(cluster_name(m.name))
                ok = [h for h in hosts if not h.failed_active_hc and h.eds_health != "DRAINING"]
                if len(ok) != len(ready) or len(hosts) != len(ready):
                    return False
            return {m.name for m in cat.models} == set(want)

        await wait_for(check, timeout, f"the fleet to converge to {want}", interval=0.1)

    def gpus_double_booked(self) -> list[str]:
        assert self.cp is not None
        bad = []
        for n in self.cp.inventory.view().nodes:
            seen: Counter[int] = Counter(i for r in n.replicas if r.live for i in r.gpu_indices)
            bad += [f"{n.name} GPU {i}" for i, c in seen.items() if c > 1]
        return bad


@dataclass
class LoadResult:
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    cut_streams: list[str] = field(default_factory=list)
    by_replica: Counter[str] = field(default_factory=Counter)


class Load:
    """Closed-loop clients through Envoy: non-streaming and streaming, counting failures.

    A stream counts as complete only if it ends with `data: [DONE]`; one cut mid-way is
    a failure the client saw, never a silent success.
    """

    def __init__(self, url: str, models: list[str], workers: int = 4, max_tokens: int = 8,
                 stream_every: int = 2) -> None:
        self.url = url
        self.models = models
        self.workers = workers
        self.max_tokens = max_tokens
        self.stream_every = stream_every
        self.result = LoadResult()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self.started_after: float = 0.0  # requests that start after this time count apart
        self.after: LoadResult = LoadResult()

    async def __aenter__(self) -> Load:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.workers)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> LoadResult:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
        return self.result

    async def wait_requests(self, n: int, timeout: float = 30) -> None:
        start = self.result.ok + len(self.result.failures)

        async def enough() -> bool:
            return self.result.ok + len(self.result.failures) - start >= n

        await wait_for(enough, timeout, f"{n} more requests through the load")

    async def _worker(self, i: int) -> None:
        assert self._session is not None
        k = 0
        while not self._stop.is_set():
            k += 1
            model = self.models[(i + k) % len(self.models)]
            stream = self.stream_every > 0 and k % self.stream_every == 0
            t0 = time.monotonic()
            target = self.after if self.started_after and t0 >= self.started_after else None
            outcome, replica, cut = await self._one(model, stream)
            for res in (self.result, target):
                if res is None:
                    continue
                if outcome is None:
                    res.ok += 1
                    res.by_replica[replica] += 1
                elif cut:
                    res.cut_streams.append(outcome)
                else:
                    res.failures.append(outcome)

    async def _one(self, model: str, stream: bool) -> tuple[str | None, str, bool]:
        assert self._session is not None
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": self.max_tokens, "stream": stream}
        try:
            async with self._session.post(self.url + "/v1/chat/completions", json=body) as r:
                replica = r.headers.get("x-llmgw-replica", "")
                text = await r.text()
                if r.status != 200:
                    return f"{model}: HTTP {r.status} {text[:200]}", replica, False
                if stream and not text.rstrip().endswith("data: [DONE]"):
                    return f"{model}: stream cut after {text.count('data: ')} chunks", replica, True
                return None, replica, False
        except (aiohttp.ClientError, TimeoutError) as e:
            return f"{model}: {type(e).__name__}: {e}", "", stream
