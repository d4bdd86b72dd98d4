"""The node agent: one stream to the control plane, the node's engines kept running.

Owns the connection to the control plane (register, heartbeats, status reports,
commands), reconnecting with backoff and jitter when it drops, without touching healthy
engines; the lease watchdog that fences the node (stops its engines) when the control
plane has been unreachable longer than the fencing timeout; and a clean stop of every
engine on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import betterproto2
import grpc

from agents.gpus import GpuInfo
from agents.pb.llmgw.agent.v1 import (
    AgentMessage,
    ControlMessage,
    Gpu,
    Heartbeat,
    Register,
    ReplicaStatus,
)
from agents.replicas import ReplicaManager

log = logging.getLogger("llmgw.agent")

METHOD = "/llmgw.agent.v1.AgentService/Connect"
VERSION = "0.1.0"
# A registration not answered by a lease within this long is retried.
REGISTER_TIMEOUT_S = 5.0


@dataclass
class AgentConfig:
    control_plane: str  # HOST:PORT
    node: str
    gpus: list[GpuInfo]
    state_dir: Path
    token: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    advertise: str = "127.0.0.1"  # how Envoy reaches this node's engines
    bind: str = "127.0.0.1"  # where engines listen
    heartbeat_s: float = 1.0
    # Stop the engines after this long without a lease renewal. Must be longer than
    # the control plane's Lost deadline, so the fleet has rebuilt the replicas first.
    fence_after_s: float = 60.0
    backoff_max_s: float = 5.0
    tls_ca: bytes | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_server_name: str | None = None


def _resolve(host: str) -> str:
    """Envoy's EDS takes IP addresses only: a host name is resolved once, at start."""
    import ipaddress
    import socket

    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return socket.gethostbyname(host)


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        cfg.advertise = _resolve(cfg.advertise)
        self.cfg = cfg
        self.agent_id = uuid.uuid4().hex
        self.generation = 0
        self._updates: asyncio.Queue[ReplicaStatus] = asyncio.Queue()
        self.replicas = ReplicaManager(cfg.state_dir, advertise=cfg.advertise, bind=cfg.bind,
                                       on_change=self._updates.put_nowait)
        self._last_lease = time.monotonic()
        self._fenced = False
        self.connected = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        adopted = await self.replicas.adopt()
        if adopted:
            log.info("kept %d running replicas from the previous agent run", len(adopted))
        tasks = [asyncio.create_task(self._connection_loop()),
                 asyncio.create_task(self._fence_watchdog())]
        try:
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            log.info("stopping: shutting down %d replicas", len(self.replicas.statuses()))
            await self.replicas.stop_all("agent stopped")
            await self.replicas.close()

    async def _fence_watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.cfg.fence_after_s / 10))
            quiet = time.monotonic() - self._last_lease
            if quiet > self.cfg.fence_after_s and self.replicas.running():
                log.error("fencing: no lease renewal from the control plane for %.0fs "
                          "(limit %.0fs); stopping every engine on this node", quiet,
                          self.cfg.fence_after_s)
                self._fenced = True
                await self.replicas.stop_all("fenced: control plane unreachable")

    # ------------------------------------------------------------------ connection

    def _channel(self) -> grpc.aio.Channel:
        opts: list[tuple[str, str | int]] = [
            ("grpc.keepalive_time_ms", 5_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # We do our own backoff with jitter.
            ("grpc.enable_retries", 0),
        ]
        if self.cfg.tls_ca is not None:
            creds = grpc.ssl_channel_credentials(self.cfg.tls_ca, self.cfg.tls_key,
                                                 self.cfg.tls_cert)
            if self.cfg.tls_server_name:
                opts.append(("grpc.ssl_target_name_override", self.cfg.tls_server_name))
            return grpc.aio.secure_channel(self.cfg.control_plane, creds, options=opts)
        return grpc.aio.insecure_channel(self.cfg.control_plane, options=opts)

    async def _connection_loop(self) -> None:
        attempt = 0
        while True:
            started = time.monotonic()
            try:
                await self._session()
                why = "stream ended"
            except TimeoutError:
                why = f"no lease from the control plane within {REGISTER_TIMEOUT_S:g}s"
            except grpc.aio.AioRpcError as e:
                why = f"{e.code().name}: {e.details()}"
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.ALREADY_EXISTS):
                    log.error("control plane refused this agent: %s", why)
            finally:
                self.connected.clear()
            if time.monotonic() - started > 10:
                attempt = 0  # it was a healthy session: start backoff over
            attempt += 1
            # Full jitter: agents of a whole fleet must not reconnect in lockstep.
            delay = random.uniform(0, min(self.cfg.backoff_max_s, 0.2 * 2**attempt))
            log.warning("control plane %s: %s; reconnecting in %.1fs (replicas keep "
                        "running)", self.cfg.control_plane, why, delay)
            await asyncio.sleep(delay)

    async def _session(self) -> None:
        async with self._channel() as channel:
            call = channel.stream_stream(METHOD, request_serializer=bytes,
                                         response_deserializer=ControlMessage.parse)
            metadata = (("authorization", f"Bearer {self.cfg.token}"),) if self.cfg.token else ()
            stream = call(metadata=metadata)
            self.generation += 1
            # Register carries the full picture; queued updates are now stale.
            while not self._updates.empty():
                self._updates.get_nowait()
            await self._converse(stream)

    async def _converse(self, stream: grpc.aio.StreamStreamCall) -> None:
        # Registration is answered by a lease. Without one in time the session is
        # given up and retried: a call the server ended early (a refused token) was
        # seen to leave the first write or read waiting forever, the agent silent.
        async with asyncio.timeout(REGISTER_TIMEOUT_S):
            await stream.write(AgentMessage(register=self._register()))
            msg = await stream.read()
        sender = asyncio.create_task(self._send_loop(stream))
        try:
            while msg is not grpc.aio.EOF:
                await self._on_command(msg)
                msg = await stream.read()
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                await sender

    def _register(self) -> Register:
        return Register(
            node=self.cfg.node, agent_id=self.agent_id, generation=self.generation,
            labels=dict(self.cfg.labels),
            gpus=[Gpu(index=g.index, uuid=g.uuid, name=g.name, memory_mb=g.memory_mb)
                  for g in self.cfg.gpus],
            replicas=self.replicas.statuses(), address=self.cfg.advertise, version=VERSION,
        )

    async def _send_loop(self, stream: grpc.aio.StreamStreamCall) -> None:
        seq = 0
        next_beat = time.monotonic()
        while True:
            timeout = max(0.0, next_beat - time.monotonic())
            try:
                # asyncio.timeout, not wait_for: wait_for can swallow a cancellation.
                async with asyncio.timeout(timeout):
                    st = await self._updates.get()
                await stream.write(AgentMessage(status=st))
            except TimeoutError:
                seq += 1
                await stream.write(AgentMessage(heartbeat=Heartbeat(seq=seq)))
                next_beat = time.monotonic() + self.cfg.heartbeat_s

    async def _on_command(self, msg: ControlMessage) -> None:
        kind, _ = betterproto2.which_one_of(msg, "msg")
        if kind == "lease":
            self._last_lease = time.monotonic()
            if not self.connected.is_set():
                self.connected.set()
                log.info("connected to control plane %s as node %s (generation %d)",
                         self.cfg.control_plane, self.cfg.node, self.generation)
            if self._fenced:
                log.info("lease renewed again after fencing; node serves new replicas only")
                self._fenced = False
        elif kind == "start" and msg.start is not None and msg.start.spec is not None:
            await self.replicas.start(msg.start.spec)
        elif kind == "drain" and msg.drain is not None:
            # Draining waits for in-flight requests: do not block the command stream.
            self._spawn(self.replicas.drain(msg.drain.replica_id, msg.drain.timeout_s))
        elif kind == "stop" and msg.stop is not None:
            self._spawn(self.replicas.stop(msg.stop.replica_id))
        else:
            log.warning("ignoring unknown command %r", kind)


    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def run_agent(cfg: AgentConfig) -> None:
    """Run until SIGTERM/SIGINT; then stop every engine cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await Agent(cfg).run(stop)
