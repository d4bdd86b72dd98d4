"""The control plane's side of the agent protocol: a grpc.aio server for agent streams.

Owns authentication (shared token in metadata, TLS/mTLS when configured), validation of
what agents send (bounds on GPUs, labels, replicas; register first), translation of
messages into inventory events, lease renewals, and delivery of Start / Drain / Stop
commands to the right stream. It never changes the inventory itself: it submits events
to its single writer and answers with the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeAlias

import betterproto2
import grpc
from prometheus_client import Counter, Gauge

from agents.pb.llmgw.agent.v1 import (
    AgentMessage,
    ControlMessage,
    Drain,
    Lease,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    Start,
    Stop,
)
from agents.pb.llmgw.agent.v1 import (
    Register as PbRegister,
)
from controlplane import inventory as inv

log = logging.getLogger("llmgw.agents")

METHOD = "/llmgw.agent.v1.AgentService/Connect"
SERVICE = "llmgw.agent.v1.AgentService"

MAX_MESSAGE_BYTES = 1024 * 1024
MAX_GPUS = 64
MAX_GPU_MEMORY_MB = 4 * 1024 * 1024  # 4 TiB: anything above is a bug or a lie
MAX_LABELS = 64
MAX_REPLICAS = 256
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")

REJECTED = Counter("llmgw_agent_messages_rejected", "Agent messages refused", ["reason"])
CONNECTED = Gauge("llmgw_agent_streams", "Connected agent streams")

_STATE = {
    ReplicaState.STARTING: inv.ReplicaState.STARTING,
    ReplicaState.READY: inv.ReplicaState.READY,
    ReplicaState.DRAINING: inv.ReplicaState.DRAINING,
    ReplicaState.STOPPED: inv.ReplicaState.STOPPED,
    ReplicaState.FAILED: inv.ReplicaState.FAILED,
}


_Item: TypeAlias = "ControlMessage | AgentMessage | None"


class InvalidMessage(ValueError):
    pass


def replica_value(s: ReplicaStatus) -> inv.Replica:
    if s.state not in _STATE:
        raise InvalidMessage(f"replica {s.replica_id!r}: state must be set")
    if not s.replica_id or not s.model:
        raise InvalidMessage("replica status needs replica_id and model")
    if s.port > 65535:
        raise InvalidMessage(f"replica {s.replica_id!r}: port {s.port} out of range")
    return inv.Replica(
        replica_id=s.replica_id, model=s.model, state=_STATE[s.state], host=s.host,
        port=s.port, in_flight=s.in_flight, gpu_indices=tuple(s.gpu_indices),
        profile_hash=s.profile_hash, message=s.message[:500], pid=s.pid,
    )


def register_event(stream_id: int, r: PbRegister) -> inv.Register:
    """Validate a registration and turn it into an inventory event."""
    if not _NODE_RE.match(r.node):
        raise InvalidMessage(f"invalid node name {r.node!r}")
    if not r.agent_id:
        raise InvalidMessage("agent_id is required")
    if len(r.gpus) > MAX_GPUS:
        raise InvalidMessage(f"node {r.node!r} reports {len(r.gpus)} GPUs (max {MAX_GPUS})")
    idx = [g.index for g in r.gpus]
    if len(set(idx)) != len(idx) or any(i >= MAX_GPUS for i in idx):
        raise InvalidMessage(f"node {r.node!r}: GPU indices must be unique and < {MAX_GPUS}")
    for g in r.gpus:
        if g.memory_mb > MAX_GPU_MEMORY_MB:
            raise InvalidMessage(f"node {r.node!r}: GPU {g.index} memory {g.memory_mb} MB "
                                 "is not plausible")
    if len(r.labels) > MAX_LABELS:
        raise InvalidMessage(f"node {r.node!r}: too many labels ({len(r.labels)})")
    if len(r.replicas) > MAX_REPLICAS:
        raise InvalidMessage(f"node {r.node!r}: too many replicas ({len(r.replicas)})")
    replicas = tuple(replica_value(s) for s in r.replicas)
    if len({x.replica_id for x in replicas}) != len(replicas):
        raise InvalidMessage(f"node {r.node!r}: duplicate replica ids")
    return inv.Register(
        stream_id=stream_id, node=r.node, agent_id=r.agent_id, generation=r.generation,
        address=r.address or "127.0.0.1",
        labels=tuple(sorted(r.labels.items())),
        gpus=tuple(inv.Gpu(g.index, g.uuid, g.name, g.memory_mb)
                   for g in sorted(r.gpus, key=lambda g: g.index)),
        replicas=replicas,
    )


@dataclass(frozen=True)
class AgentAuth:
    """How agents prove who they are. A token is required unless explicitly disabled."""

    token: str | None
    # TLS: server certificate and key; with client_ca, agents must present a cert.
    server_cert: bytes | None = None
    server_key: bytes | None = None
    client_ca: bytes | None = None

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.server_cert is None or self.server_key is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.server_key, self.server_cert)], root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


class AgentServer:
    def __init__(self, inventory: inv.Inventory, auth: AgentAuth, lease_s: float = 30.0) -> None:
        self.inventory = inventory
        self.auth = auth
        self.lease_s = lease_s
        self._server: grpc.aio.Server | None = None
        self._outbox: dict[str, tuple[int, asyncio.Queue[_Item]]] = {}
        self._ids = itertools.count(1)
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 2_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.so_reuseport", 0),
        ], maximum_concurrent_rpcs=4096)
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Connect": grpc.stream_stream_rpc_method_handler(
                self._connect, request_deserializer=AgentMessage.parse,
                response_serializer=bytes),
        })
        server.add_generic_rpc_handlers((handler,))
        creds = self.auth.credentials()
        addr = f"{host}:{port}"
        bound = server.add_secure_port(addr, creds) if creds else server.add_insecure_port(addr)
        if bound == 0:
            raise OSError(f"agent server cannot bind {addr}")
        await server.start()
        self._server = server
        self.port = bound
        log.info("agent server listening on %s:%d (%s, %s)", host, bound,
                 "TLS" + (" with client certificates" if self.auth.client_ca else "")
                 if creds else "plaintext",
                 "token required" if self.auth.token else "NO token check")
        return bound

    async def stop(self, grace: float | None = 0.5) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    # ------------------------------------------------------------------ commands

    def send(self, node: str, msg: ControlMessage) -> bool:
        """Queue a command for a node's current stream; False if it is not connected."""
        entry = self._outbox.get(node)
        if entry is None:
            return False
        entry[1].put_nowait(msg)
        return True

    async def start_replica(self, node: str, spec: ReplicaSpec) -> None:
        """Record the request in the inventory, then tell the agent."""
        await self.inventory.submit(inv.StartRequested(node, inv.Replica(
            replica_id=spec.replica_id, model=spec.model, state=inv.ReplicaState.REQUESTED,
            gpu_indices=tuple(spec.gpu_indices), profile_hash=spec.profile_hash)))
        if not self.send(node, ControlMessage(start=Start(spec=spec))):
            raise inv.Rejected("UNAVAILABLE", f"node {node!r} is not connected")

    def drain_replica(self, node: str, replica_id: str, timeout_s: float) -> bool:
        return self.send(node, ControlMessage(drain=Drain(replica_id=replica_id,
                                                          timeout_s=timeout_s)))

    def stop_replica(self, node: str, replica_id: str) -> bool:
        return self.send(node, ControlMessage(stop=Stop(replica_id=replica_id)))

    # ------------------------------------------------------------------ stream

    def _authenticated(self, context: grpc.aio.ServicerContext) -> bool:
        if self.auth.token is None:
            return True
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, token = value.partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(
                        token.encode(), self.auth.token.encode()):
                    return True
        return False

    async def _reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                      reason: str, message: str) -> None:
        REJECTED.labels(reason).inc()
        log.warning("refused agent stream from %s: %s", context.peer(), message)
        await context.abort(code, message)

    async def _connect(self, requests: AsyncIterator[AgentMessage],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[ControlMessage]:
        if not self._authenticated(context):
            # Say nothing about why beyond the code: the peer may be probing.
            await self._reject(context, grpc.StatusCode.UNAUTHENTICATED, "auth",
                               "missing or wrong agent token")
        sid = next(self._ids)
        it = requests.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return
        kind, _ = betterproto2.which_one_of(first, "msg")
        if kind != "register" or first.register is None:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "protocol",
                               f"first message must be register, got {kind or 'nothing'}")
        assert first.register is not None
        try:
            reg = register_event(sid, first.register)
            await self.inventory.submit(reg)
        except InvalidMessage as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid", str(e))
        except inv.Rejected as e:
            await self._reject(context, getattr(grpc.StatusCode, e.code), e.code.lower(), str(e))
        node = reg.node
        # One queue per stream: what the agent sends (and None when it is gone) and the
        # commands for it, handled in arrival order by this handler alone.
        out: asyncio.Queue[_Item] = asyncio.Queue()
        self._outbox[node] = (sid, out)
        CONNECTED.inc()

        async def read() -> None:
            try:
                async for m in it:
                    await out.put(m)
            except grpc.RpcError:
                pass
            finally:
                await out.put(None)

        tasks = [asyncio.create_task(read())]
        try:
            yield ControlMessage(lease=Lease(duration_s=self.lease_s, generation=reg.generation))
            while True:
                item = await out.get()
                if item is None:
                    break
                if isinstance(item, ControlMessage):
                    yield item
                    continue
                reply = await self._handle(sid, node, reg.generation, item, context)
                if reply is not None:
                    yield reply
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            CONNECTED.dec()
            if self._outbox.get(node, (None,))[0] == sid:
                del self._outbox[node]
            self.inventory.post(inv.Disconnect(sid, node))

    async def _handle(self, sid: int, node: str, generation: int, msg: AgentMessage,
                      context: grpc.aio.ServicerContext) -> ControlMessage | None:
        kind, _ = betterproto2.which_one_of(msg, "msg")
        try:
            if kind == "heartbeat":
                await self.inventory.submit(inv.Heartbeat(sid, node))
                return ControlMessage(lease=Lease(duration_s=self.lease_s, generation=generation))
            if kind == "status" and msg.status is not None:
                await self.inventory.submit(inv.Status(sid, node, replica_value(msg.status)))
                return None
            raise InvalidMessage(f"unexpected message {kind or 'empty'} after register")
        except InvalidMessage as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid", str(e))
        except inv.Rejected as e:
            await self._reject(context, getattr(grpc.StatusCode, e.code), e.code.lower(), str(e))
        return None
