"""The ADS gRPC server (grpc.aio): glue between Envoy streams, the cache and the machines.

Owns sockets and stream lifetimes only. Per stream it runs one I/O-free machine from
xds.protocol, feeds it Envoy's requests and the cache's new snapshots, writes what it
returns, and reports ACKs, NACKs and pushes to the client registry and to Prometheus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from envoy_data_plane.envoy.service.discovery.v3 import (
    DeltaDiscoveryRequest,
    DiscoveryRequest,
)
from prometheus_client import Counter, Gauge

from xds.cache import SnapshotCache
from xds.clients import ClientRegistry, NackInfo
from xds.protocol import Ack, DeltaStream, Event, Nack, Push, SotwStream, Stale, Step
from xds.snapshot import SHORT

log = logging.getLogger("llmgw.xds")

SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"

PUSHES = Counter("llmgw_xds_pushes", "xDS responses sent", ["type", "mode"])
PUSH_BYTES = Counter("llmgw_xds_push_bytes", "Bytes of xDS responses sent", ["type", "mode"])
NACKS = Counter("llmgw_xds_nacks", "xDS responses Envoy rejected (NACK)", ["type", "mode"])
ACKS = Counter("llmgw_xds_acks", "xDS responses Envoy accepted (ACK)", ["type", "mode"])
STALE = Counter("llmgw_xds_stale_requests", "Requests answering an old nonce (ignored)", ["mode"])
STREAMS = Gauge("llmgw_xds_streams", "Connected Envoy ADS streams", ["mode"])

# Bounds on what one peer can make us hold.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_CONCURRENT_STREAMS = 1024


@dataclass(frozen=True)
class ServerStats:
    """Totals since start: what tests and benchmarks assert on."""

    pushes: dict[str, int]
    bytes_sent: dict[str, int]
    nacks: int
    acks: int
    stale: int


class AdsServer:
    """Aggregated Discovery Service over grpc.aio, SotW and delta."""

    def __init__(self, cache: SnapshotCache, clients: ClientRegistry | None = None) -> None:
        self.cache = cache
        self.clients = clients or ClientRegistry()
        self._server: grpc.aio.Server | None = None
        self._pushes: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self._nacks = 0
        self._acks = 0
        self._stale = 0
        self.port = 0
        self._listeners: list[Callable[[str, Event], None]] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        credentials: grpc.ServerCredentials | None = None,
    ) -> int:
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", 256 * 1024 * 1024),
                ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
                # Notice a half-open connection instead of holding its stream forever.
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.keepalive_timeout_ms", 10_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=MAX_CONCURRENT_STREAMS,
        )
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(
                    self._sotw, request_deserializer=DiscoveryRequest.parse,
                ),
                "DeltaAggregatedResources": grpc.stream_stream_rpc_method_handler(
                    self._delta, request_deserializer=DeltaDiscoveryRequest.parse,
                ),
            },
        )
        server.add_generic_rpc_handlers((handler,))
        addr = f"{host}:{port}"
        bound = (
            server.add_secure_port(addr, credentials)
            if credentials is not None
            else server.add_insecure_port(addr)
        )
        if bound == 0:
            raise OSError(f"xDS server cannot bind {addr}")
        await server.start()
        self._server = server
        self.port = bound
        log.info("xDS (ADS) server listening on %s:%d", host, bound)
        return bound

    async def stop(self, grace: float | None = 0.5) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    def add_listener(self, cb: Callable[[str, Event], None]) -> None:
        """Call cb(node_id, event) for every ACK, NACK and stale request (tools, benches)."""
        self._listeners.append(cb)

    def stats(self) -> ServerStats:
        return ServerStats(dict(self._pushes), dict(self._bytes), self._nacks, self._acks,
                           self._stale)

    # ------------------------------------------------------------------ streams

    async def _sotw(
        self, requests: AsyncIterator[DiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[object]:
        async for msg in self._stream("sotw", SotwStream(), requests, context):
            yield msg

    async def _delta(
        self, requests: AsyncIterator[DeltaDiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[object]:
        async for msg in self._stream("delta", DeltaStream(), requests, context):
            yield msg

    async def _stream(
        self,
        mode: str,
        machine: SotwStream | DeltaStream,
        requests: AsyncIterator[DiscoveryRequest] | AsyncIterator[DeltaDiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[object]:
        sid = self.clients.open(mode, context.peer())
        STREAMS.labels(mode).inc()
        inbox: asyncio.Queue[object] = asyncio.Queue()
        end = object()
        new_snapshot = object()

        async def read() -> None:
            try:
                async for req in requests:
                    await inbox.put(req)
            finally:
                await inbox.put(end)

        async def watch() -> None:
            gen = self.cache.generation
            while True:
                gen = await self.cache.wait_newer(gen)
                await inbox.put(new_snapshot)

        tasks = [asyncio.create_task(read()), asyncio.create_task(watch())]
        node = ""
        try:
            snap = self.cache.snapshot
            if snap is not None:
                machine.update(snap)  # nothing is subscribed yet: this only primes it
            while True:
                item = await inbox.get()
                if item is end:
                    break
                if item is new_snapshot:
                    snap = self.cache.snapshot
                    if snap is None:
                        continue
                    step = machine.update(snap)
                else:
                    req = item
                    if not node and req.node is not None and req.node.id:  # type: ignore[attr-defined]
                        node = req.node.id  # type: ignore[attr-defined]
                        self.clients.identify(sid, node, req.node.cluster)  # type: ignore[attr-defined]
                        log.info("Envoy %s connected (%s, %s)", node, mode, context.peer())
                    self.clients.requested(sid, req.type_url)  # type: ignore[attr-defined]
                    step = machine.receive(req)  # type: ignore[arg-type]
                self._record(sid, mode, node, step)
                for push in step.pushes:
                    # Serialized once here; grpc sends the bytes as they are.
                    data = bytes(push.message)
                    self._count(sid, mode, push, len(data))
                    yield data
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            self.clients.close(sid)
            STREAMS.labels(mode).dec()
            if node:
                log.info("Envoy %s disconnected (%s)", node, mode)

    def _record(self, sid: int, mode: str, node: str, step: Step) -> None:
        for ev in step.events:
            short = SHORT.get(ev.type_url, ev.type_url)
            if isinstance(ev, Nack):
                self._nacks += 1
                NACKS.labels(short, mode).inc()
                self.clients.nacked(sid, ev.type_url, NackInfo(ev.version, ev.nonce, ev.message,
                                                               time.time()))
                # Envoy keeps its last good config; we keep ours and do not re-send.
                log.error("NACK from Envoy %s for %s (nonce %s, keeps version %r): %s",
                          node or "?", short, ev.nonce, ev.version, ev.message)
            elif isinstance(ev, Ack):
                self._acks += 1
                ACKS.labels(short, mode).inc()
                self.clients.acked(sid, ev.type_url, ev.version or ev.nonce)
            elif isinstance(ev, Stale):
                self._stale += 1
                STALE.labels(mode).inc()
            for cb in self._listeners:
                cb(node, ev)

    def _count(self, sid: int, mode: str, push: Push, size: int) -> None:
        short = SHORT.get(push.type_url, push.type_url)
        self._pushes[short] = self._pushes.get(short, 0) + 1
        self._bytes[short] = self._bytes.get(short, 0) + size
        PUSHES.labels(short, mode).inc()
        PUSH_BYTES.labels(short, mode).inc(size)
        self.clients.pushed(sid, push.type_url, size)
        log.debug("push %s to stream %d: %d resources, %d removed, %d bytes", short, sid,
                  len(push.names), len(push.removed), size)
