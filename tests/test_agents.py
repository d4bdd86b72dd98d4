"""Agents and inventory with real processes: agents, their engines, the control plane."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest

from agents.agent import METHOD
from agents.pb.llmgw.agent.v1 import (
    AgentMessage,
    ControlMessage,
    Gpu,
    Heartbeat,
    Register,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
)
from controlplane.agent_server import AgentAuth
from controlplane.catalog import parse_catalog
from controlplane.inventory import Inventory, NodeState
from controlplane.inventory import ReplicaState as RS
from controlplane.netutil import free_port
from controlplane.runtime import ControlPlane

from .conftest import wait_for

pytestmark = pytest.mark.slow

TOKEN = "test-token-5f0c2e"  # a made-up secret: it must never appear in logs
UNREACHABLE, LOST = 1.0, 2.5


@dataclass
class AgentProc:
    node: str
    state_dir: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        """SIGKILL the agent alone: its engines keep running, as after a crash."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.agents_port = free_port()
        self.cp: ControlPlane | None = None
        self.procs: list[AgentProc] = []

    async def start_cp(self) -> ControlPlane:
        inv = Inventory(unreachable_after=UNREACHABLE, lost_after=LOST, tick_interval=0.05)
        self.cp = ControlPlane(parse_catalog("models: [{name: m}]"), xds=("127.0.0.1", 0),
                               api=None, agents=("127.0.0.1", self.agents_port),
                               agent_auth=AgentAuth(token=TOKEN), inventory=inv, lease_s=LOST,
                               reconcile=False)
        await self.cp.start()
        return self.cp

    def agent(self, node: str, *extra: str, token: str = TOKEN) -> AgentProc:
        state = self.tmp / f"state-{node}"
        log = self.tmp / f"agent-{node}.log"
        env = {**os.environ, "LLMGW_AGENT_TOKEN": token}
        proc = subprocess.Popen(
            [sys.executable, "-m", "controlplane.cli", "agent", "--control-plane",
             f"127.0.0.1:{self.agents_port}", "--node", node, "--simulate-gpus", "2xH100-80GB",
             "--state-dir", str(state), "--heartbeat", "0.2", "--fence-after", "30", *extra],
            env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        a = AgentProc(node, state, proc, log)
        self.procs.append(a)
        return a

    @property
    def inv(self) -> Inventory:
        assert self.cp is not None
        return self.cp.inventory

    async def node_state(self, node: str, state: NodeState, timeout: float = 15) -> float:
        async def check() -> bool:
            n = self.inv.view().node(node)
            return n is not None and n.state == state

        return await wait_for(check, timeout, f"node {node} to be {state}")

    async def replica_state(self, node: str, rid: str, state: RS, timeout: float = 20) -> None:
        async def check() -> bool:
            n = self.inv.view().node(node)
            r = n.replica(rid) if n else None
            return r is not None and r.state == state

        await wait_for(check, timeout, f"replica {rid} on {node} to be {state}")

    async def start_replica(self, node: str, rid: str) -> int:
        assert self.cp is not None and self.cp.agents is not None
        await self.cp.agents.start_replica(node, ReplicaSpec(
            replica_id=rid, model="m", engine="sim", gpu_indices=[0], profile_hash="p1"))
        await self.replica_state(node, rid, RS.READY)
        r = self.inv.view().node(node).replica(rid)  # type: ignore[union-attr]
        assert r is not None and r.pid > 0
        return r.pid

    async def close(self) -> None:
        for a in self.procs:
            if a.proc.poll() is None:
                a.proc.send_signal(signal.SIGTERM)
        for a in self.procs:
            try:
                a.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(a.proc.pid, signal.SIGKILL)
        # Engines of SIGKILLed agents that no later agent took over.
        for a in self.procs:
            f = a.state_dir / "replicas.json"
            if f.exists():
                import json

                for e in json.loads(f.read_text()):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(e["pid"], signal.SIGKILL)
        if self.cp is not None:
            await self.cp.stop()


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    f = Fleet(tmp_path)
    await f.start_cp()
    try:
        yield f
    finally:
        await f.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------ 1. registration


async def test_three_agents_register_and_stay_ready(fleet: Fleet) -> None:
    for n in ("gpu-a", "gpu-b", "gpu-c"):
        fleet.agent(n, "--label", f"zone={n[-1]}")
    for n in ("gpu-a", "gpu-b", "gpu-c"):
        await fleet.node_state(n, NodeState.READY)
    view = fleet.inv.view()
    assert [n.name for n in view.nodes] == ["gpu-a", "gpu-b", "gpu-c"]
    for n in view.nodes:
        assert [(g.index, g.name, g.memory_mb) for g in n.gpus] == [(0, "H100", 81920),
                                                                    (1, "H100", 81920)]
        assert dict(n.labels) == {"zone": n.name[-1]}
    # Heartbeats keep them Ready well past the Unreachable deadline.
    start = fleet.inv.clock()

    async def long_enough() -> bool:
        for n in fleet.inv.view().nodes:
            assert n.state == NodeState.READY, n
        return fleet.inv.clock() - start > 3 * UNREACHABLE

    await wait_for(long_enough, 10, "three Unreachable deadlines to pass")


# ------------------------------------------------------------------ 2. agent killed


async def test_killed_agent_goes_unreachable_then_lost_and_comes_back(fleet: Fleet) -> None:
    a = fleet.agent("gpu-a")
    await fleet.node_state("gpu-a", NodeState.READY)
    pid = await fleet.start_replica("gpu-a", "r1")
    a.kill()
    t_unreachable = await fleet.node_state("gpu-a", NodeState.UNREACHABLE, timeout=10)
    await fleet.node_state("gpu-a", NodeState.LOST, timeout=10)
    node = fleet.inv.view().node("gpu-a")
    assert node is not None
    quiet = node.state_since - node.last_seen
    # Lost on the configured deadline (one tick of slack), not before.
    assert LOST <= quiet <= LOST + 1.0, quiet
    assert t_unreachable < LOST
    assert pid_alive(pid), "the engine must survive its agent"
    fleet.agent("gpu-a")
    await fleet.node_state("gpu-a", NodeState.READY)
    await fleet.replica_state("gpu-a", "r1", RS.READY)
    back = fleet.inv.view().node("gpu-a")
    assert back is not None and back.returned_after_lost
    r = back.replica("r1")
    assert r is not None and r.pid == pid, "re-reported, not restarted"


# ------------------------------------------------------------------ 3. control plane restart


async def test_control_plane_restart_agents_rereport_without_restarts(fleet: Fleet) -> None:
    for n in ("gpu-a", "gpu-b"):
        fleet.agent(n)
    pids = {}
    for n in ("gpu-a", "gpu-b"):
        await fleet.node_state(n, NodeState.READY)
        pids[n] = await fleet.start_replica(n, f"{n}-r1")
    assert fleet.cp is not None
    await fleet.cp.stop()
    await fleet.start_cp()  # a new inventory: it knows nothing until agents report
    assert fleet.inv.view().nodes == ()
    for n in ("gpu-a", "gpu-b"):
        await fleet.node_state(n, NodeState.READY, timeout=20)
        await fleet.replica_state(n, f"{n}-r1", RS.READY)
        r = fleet.inv.view().node(n).replica(f"{n}-r1")  # type: ignore[union-attr]
        assert r is not None and r.pid == pids[n]
        assert pid_alive(pids[n])


# ------------------------------------------------------------------ 4. replica lifecycle


async def test_start_serve_drain_stop_and_crash(fleet: Fleet) -> None:
    fleet.agent("gpu-a")
    await fleet.node_state("gpu-a", NodeState.READY)
    await fleet.start_replica("gpu-a", "r1")
    r = fleet.inv.view().node("gpu-a").replica("r1")  # type: ignore[union-attr]
    assert r is not None and r.gpu_indices == (0,)
    url = f"http://{r.host}:{r.port}"
    async with aiohttp.ClientSession() as s:
        body = {"model": "m", "messages": [], "stream": True, "max_tokens": 3}
        async with s.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            text = await resp.text()
        assert text.rstrip().endswith("data: [DONE]")
        # Drain with a request in flight: the replica waits for it, then stops.
        slow = {"model": "m", "messages": [], "max_tokens": 100}  # ~0.5 s at 200 tok/s
        inflight = asyncio.create_task(s.post(url + "/v1/chat/completions", json=slow))

        async def running() -> bool:
            async with s.get(url + "/metrics") as m:
                return "vllm:num_requests_running{model_name=\"m\"} 1.0" in await m.text()

        await wait_for(running, 10, "the slow request to reach the engine")
        assert fleet.cp is not None and fleet.cp.agents is not None
        fleet.cp.agents.drain_replica("gpu-a", "r1", 30)
        await fleet.replica_state("gpu-a", "r1", RS.DRAINING)
        done = await inflight
        assert done.status == 200
        done.release()
        await fleet.replica_state("gpu-a", "r1", RS.STOPPED)
    assert not pid_alive(r.pid)
    # Stop.
    pid2 = await fleet.start_replica("gpu-a", "r2")
    fleet.cp.agents.stop_replica("gpu-a", "r2")
    await fleet.replica_state("gpu-a", "r2", RS.STOPPED)
    assert not pid_alive(pid2)
    # Crash: reported failed.
    await fleet.start_replica("gpu-a", "r3")
    r3 = fleet.inv.view().node("gpu-a").replica("r3")  # type: ignore[union-attr]
    assert r3 is not None
    os.kill(r3.pid, signal.SIGKILL)
    await fleet.replica_state("gpu-a", "r3", RS.FAILED)
    failed = fleet.inv.view().node("gpu-a").replica("r3")  # type: ignore[union-attr]
    assert failed is not None and "exited unexpectedly" in failed.message


async def test_sigterm_stops_engines_and_lease_loss_fences(fleet: Fleet) -> None:
    a = fleet.agent("gpu-a")
    await fleet.node_state("gpu-a", NodeState.READY)
    pid = await fleet.start_replica("gpu-a", "r1")
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(15) == 0
    assert not pid_alive(pid)
    # Fencing: an agent cut off from the control plane longer than its fence timeout
    # stops its engines by itself.
    b = fleet.agent("gpu-b", "--fence-after", "1.5")
    await fleet.node_state("gpu-b", NodeState.READY)
    pid_b = await fleet.start_replica("gpu-b", "rb")
    assert fleet.cp is not None
    await fleet.cp.stop()

    async def fenced() -> bool:
        return not pid_alive(pid_b)

    await wait_for(fenced, 15, "the cut-off agent to stop its engine")
    assert "fencing" in b.log.read_text()
    await fleet.start_cp()


# ------------------------------------------------------------------ 7. refusals


Call = Callable[..., Awaitable[tuple[grpc.StatusCode | None, str]]]


async def raw_stream(port: int, messages: list[AgentMessage], token: str | None = TOKEN,
                     wait: float = 5.0) -> tuple[grpc.StatusCode | None, str]:
    """Send messages on a raw agent stream; return how the server ended it."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.stream_stream(METHOD, request_serializer=bytes,
                                response_deserializer=ControlMessage.parse)
        md = (("authorization", f"Bearer {token}"),) if token else ()
        stream = call(metadata=md)
        try:
            for m in messages:
                await stream.write(m)
            await stream.done_writing()
            async with asyncio.timeout(wait):
                async for _ in stream:
                    pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
        return None, ""


def register(node: str = "evil", agent_id: str = "x", gpus: int = 1,
             labels: dict[str, str] | None = None,
             replicas: list[ReplicaStatus] | None = None) -> AgentMessage:
    return AgentMessage(register=Register(
        node=node, agent_id=agent_id, generation=1,
        gpus=[Gpu(index=i, uuid=f"u{i}", name="H100", memory_mb=81920) for i in range(gpus)],
        labels=labels or {}, replicas=replicas or []))


async def test_bad_token_and_malformed_messages_are_refused(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    port = fleet.agents_port
    code, _ = await raw_stream(port, [register()], token="wrong")
    assert code == grpc.StatusCode.UNAUTHENTICATED
    code, _ = await raw_stream(port, [register()], token=None)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    # A real agent with a wrong token never registers.
    bad = fleet.agent("gpu-z", token="not-the-token")

    async def refused() -> bool:
        return "UNAUTHENTICATED" in bad.log.read_text()

    await wait_for(refused, 15, "the agent to log its refusal")
    code, details = await raw_stream(port, [AgentMessage(heartbeat=Heartbeat(seq=1))])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "first message" in details
    code, details = await raw_stream(port, [register(gpus=65)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "GPUs" in details
    code, details = await raw_stream(port, [register(node="bad name!")])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "node name" in details
    unknown = ReplicaStatus(replica_id="ghost", model="m", state=ReplicaState.READY)
    code, details = await raw_stream(port, [register(node="evil2"),
                                            AgentMessage(status=unknown)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown replica" in details
    code, _ = await raw_stream(port, [register(labels={"k": "v" * (2 * 1024 * 1024)})])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Duplicate node name: a second agent for a connected node is refused.
    fleet.agent("gpu-a")
    await fleet.node_state("gpu-a", NodeState.READY)
    code, details = await raw_stream(port, [register(node="gpu-a", agent_id="impostor")])
    assert code == grpc.StatusCode.ALREADY_EXISTS
    # Nothing bogus got in, the real node is untouched, the server still serves.
    names = [n.name for n in fleet.inv.view().nodes]
    assert "gpu-z" not in names and "evil" not in names
    assert fleet.inv.view().node("gpu-a").state == NodeState.READY  # type: ignore[union-attr]
    # No secret in the logs of the control plane or the agents.
    assert TOKEN not in caplog.text
    for a in fleet.procs:
        assert TOKEN not in a.log.read_text()
        assert "not-the-token" not in a.log.read_text()


# ------------------------------------------------------------------ TLS


async def test_mtls_agent_channel(tmp_path: Path) -> None:
    from .certs import issue, make_ca

    ca, ca_key, ca_name = make_ca()
    server = issue(ca_key, ca_name, "controlplane.llmgw.test", server=True)
    client = issue(ca_key, ca_name, "gpu-a", server=False)
    rogue_ca, rogue_key, rogue_name = make_ca("rogue CA")
    rogue = issue(rogue_key, rogue_name, "gpu-x", server=False)
    files = {}
    for name, data in [("ca.pem", ca.cert), ("client.pem", client.cert),
                       ("client.key", client.key), ("rogue.pem", rogue.cert),
                       ("rogue.key", rogue.key)]:
        files[name] = tmp_path / name
        files[name].write_bytes(data)
    f = Fleet(tmp_path)
    inv = Inventory(unreachable_after=UNREACHABLE, lost_after=LOST, tick_interval=0.05)
    f.cp = ControlPlane(parse_catalog("models: [{name: m}]"), xds=("127.0.0.1", 0), api=None,
                        agents=("127.0.0.1", f.agents_port),
                        agent_auth=AgentAuth(token=TOKEN, server_cert=server.cert,
                                             server_key=server.key, client_ca=ca.cert),
                        inventory=inv, lease_s=LOST, reconcile=False)
    await f.cp.start()
    try:
        tls = ("--tls-ca", str(files["ca.pem"]), "--tls-server-name",
               "controlplane.llmgw.test")
        f.agent("gpu-a", *tls, "--tls-cert", str(files["client.pem"]), "--tls-key",
                str(files["client.key"]))
        await f.node_state("gpu-a", NodeState.READY)
        # A certificate from another CA, and no certificate at all, are refused.
        x = f.agent("gpu-x", *tls, "--tls-cert", str(files["rogue.pem"]), "--tls-key",
                    str(files["rogue.key"]))
        y = f.agent("gpu-y", *tls)
        plain = f.agent("gpu-p")  # plaintext against a TLS server

        async def all_refused() -> bool:
            return all("reconnecting" in a.log.read_text() for a in (x, y, plain))

        await wait_for(all_refused, 20, "agents without a trusted certificate to fail")
        assert [n.name for n in inv.view().nodes] == ["gpu-a"]
    finally:
        await f.close()
